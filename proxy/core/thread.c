/* The loop threads' table and the posts between them (thread.h). */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/util.h"
#include "proxy/core/px.h"

void px_thread_violation(const char *func)
{
    fprintf(stderr, "detproxy: %s called on worker thread %u: only the control thread may\n", func,
            px_thread_slot());
    abort();
}

void px_thread_init(px_t *px, unsigned nworkers)
{
    assert(px->loop != NULL && px->threads == NULL);
    px->nworkers = nworkers;
    px->nslots = nworkers + 1;
    px->threads = dp_xcalloc(px->nslots, sizeof(*px->threads));
    net_mailbox_init(&px->mb, px->loop, 0);
    px->control.slot = 0;
    px->control.loop = px->loop;
    px->control.mb = &px->mb;
    px->control.running = true;
    px->threads[0] = &px->control;
}

px_thread_t *px_thread_of(px_t *px, unsigned slot)
{
    assert(slot < px->nslots);
    return px->threads ? px->threads[slot] : NULL;
}

px_thread_t *px_thread_self(px_t *px)
{
    return px_thread_of(px, px_thread_slot());
}

px_gen_t *px_thread_gen(px_t *px)
{
    unsigned slot = px_thread_slot();
    return slot == 0 ? px->gen : px->threads[slot]->gen;
}

bool px_thread_post(px_t *px, unsigned slot, net_mb_node_t *n, net_mb_fn fn)
{
    if (slot == 0) {
        px_thread_post_control(px, n, fn);
        return true;
    }
    px_thread_t *t = px_thread_of(px, slot);
    /* running is the control thread's to change, and it posts to workers itself; a worker
     * posting to another reads it while both run (shutdown joins every worker at once). */
    if (t == NULL || !t->running || px->workers_joined)
        return false;
    net_mailbox_post(t->mb, n, fn);
    return true;
}

void px_thread_post_control(px_t *px, net_mb_node_t *n, net_mb_fn fn)
{
    net_mailbox_post(&px->mb, n, fn);
}

bool px_thread_try_post_control(px_t *px, net_mb_node_t *n, net_mb_fn fn)
{
    return net_mailbox_try_post(&px->mb, n, fn);
}

void px_thread_add_upstream(px_thread_t *t, net_upstream_t *u)
{
    if (t->nups == t->capups) {
        t->capups = t->capups ? t->capups * 2 : 16;
        t->ups = dp_xrealloc(t->ups, t->capups * sizeof(*t->ups));
    }
    t->ups[t->nups++] = u;
}

bool px_thread_forget_upstream(px_thread_t *t, net_upstream_t *u)
{
    for (size_t i = 0; i < t->nups; i++) {
        if (t->ups[i] == u) {
            t->ups[i] = t->ups[--t->nups];
            return true;
        }
    }
    return false;
}
