/* A mailbox: how one event loop hands work to another without a lock.
 *
 * Any thread posts a node (an intrusive struct the caller embeds in its message); the loop that
 * owns the mailbox runs each node's callback, in posting order, on its next iteration (the post
 * wakes it through a uv_async_t, which libuv coalesces). Multi-producer, single-consumer: posting
 * is one compare-and-swap on the head of a stack; the consumer takes the whole stack with one
 * exchange and reverses it, so there is no ABA problem and nothing to lock.
 *
 * Bounded for what may be dropped: net_mailbox_try_post refuses a node once `cap` are waiting
 * and counts it (net_mailbox_dropped), so a slow consumer never makes a producer block or grow
 * memory without bound. net_mailbox_post is for what must arrive (a generation to adopt, a
 * completion someone waits for): it ignores the bound. */
#ifndef NET_MAILBOX_H
#define NET_MAILBOX_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

typedef struct net_mb_node_s net_mb_node_t;
typedef void (*net_mb_fn)(net_mb_node_t *n);

struct net_mb_node_s {
    net_mb_node_t *next;
    net_mb_fn fn; /* runs on the mailbox's loop; owns the node from then on */
};

typedef struct {
    _Atomic(net_mb_node_t *) head;
    atomic_uint waiting; /* nodes posted and not yet run */
    atomic_uint_fast64_t dropped;
    uint32_t cap;
    bool open;
    uv_async_t async;
} net_mailbox_t;

/* On the owning loop's thread. cap 0 means 4096. */
int net_mailbox_init(net_mailbox_t *mb, uv_loop_t *loop, uint32_t cap);
/* From any thread. False (node not taken, counted as dropped) when cap nodes are waiting. */
bool net_mailbox_try_post(net_mailbox_t *mb, net_mb_node_t *n, net_mb_fn fn);
/* From any thread, always taken. */
void net_mailbox_post(net_mailbox_t *mb, net_mb_node_t *n, net_mb_fn fn);
/* On the owning thread: run what is waiting now (the async callback does this). Returns how
 * many ran. */
size_t net_mailbox_run(net_mailbox_t *mb);
uint64_t net_mailbox_dropped(const net_mailbox_t *mb);
/* On the owning thread: run what is still waiting, then close the async handle. Posting after
 * this is a bug. */
void net_mailbox_close(net_mailbox_t *mb);

#endif
