#include "net/mailbox.h"

#include <assert.h>

static void on_async(uv_async_t *a)
{
    net_mailbox_run(a->data);
}

int net_mailbox_init(net_mailbox_t *mb, uv_loop_t *loop, uint32_t cap)
{
    atomic_init(&mb->head, NULL);
    atomic_init(&mb->waiting, 0);
    atomic_init(&mb->dropped, 0);
    mb->cap = cap ? cap : 4096;
    int r = uv_async_init(loop, &mb->async, on_async);
    if (r != 0)
        return r;
    mb->async.data = mb;
    mb->open = true;
    return 0;
}

static void push(net_mailbox_t *mb, net_mb_node_t *n, net_mb_fn fn)
{
    assert(mb->open); /* posting after net_mailbox_close is a bug */
    assert(fn != NULL);
    n->fn = fn;
    net_mb_node_t *old = atomic_load_explicit(&mb->head, memory_order_relaxed);
    do
        n->next = old;
    while (!atomic_compare_exchange_weak_explicit(&mb->head, &old, n, memory_order_release,
                                                  memory_order_relaxed));
    uv_async_send(&mb->async);
}

bool net_mailbox_try_post(net_mailbox_t *mb, net_mb_node_t *n, net_mb_fn fn)
{
    if (atomic_fetch_add_explicit(&mb->waiting, 1, memory_order_relaxed) >= mb->cap) {
        atomic_fetch_sub_explicit(&mb->waiting, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&mb->dropped, 1, memory_order_relaxed);
        return false;
    }
    push(mb, n, fn);
    return true;
}

void net_mailbox_post(net_mailbox_t *mb, net_mb_node_t *n, net_mb_fn fn)
{
    atomic_fetch_add_explicit(&mb->waiting, 1, memory_order_relaxed);
    push(mb, n, fn);
}

size_t net_mailbox_run(net_mailbox_t *mb)
{
    size_t ran = 0;
    net_mb_node_t *n;
    /* Callbacks may post to this mailbox again: those run on the next pass of this loop, not
     * forever. */
    while ((n = atomic_exchange_explicit(&mb->head, NULL, memory_order_acquire)) != NULL) {
        net_mb_node_t *fifo = NULL; /* the stack is newest first */
        while (n) {
            net_mb_node_t *next = n->next;
            n->next = fifo;
            fifo = n;
            n = next;
        }
        while (fifo) {
            net_mb_node_t *next = fifo->next;
            /* Each node was counted in `waiting` before it was pushed. */
            assert(atomic_load_explicit(&mb->waiting, memory_order_relaxed) > 0);
            atomic_fetch_sub_explicit(&mb->waiting, 1, memory_order_relaxed);
            fifo->fn(fifo);
            fifo = next;
            ran++;
        }
        if (ran >= mb->cap)
            break; /* a fair share: other handles of the loop get their turn */
    }
    if (atomic_load_explicit(&mb->head, memory_order_relaxed) != NULL)
        uv_async_send(&mb->async);
    return ran;
}

uint64_t net_mailbox_dropped(const net_mailbox_t *mb)
{
    return atomic_load_explicit(&mb->dropped, memory_order_relaxed);
}

void net_mailbox_close(net_mailbox_t *mb)
{
    if (!mb->open)
        return;
    while (net_mailbox_run(mb) > 0)
        ;
    assert(atomic_load_explicit(&mb->head, memory_order_relaxed) == NULL);
    mb->open = false;
    uv_close((uv_handle_t *)&mb->async, NULL);
}
