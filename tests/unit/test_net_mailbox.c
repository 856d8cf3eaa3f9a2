/* net/mailbox: many producer threads, one consumer loop, order per producer, the bound. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>

#include "net/mailbox.h"

#define PRODUCERS 4
#define PER_PRODUCER 20000

typedef struct {
    net_mb_node_t node;
    int producer;
    int seq;
} msg_t;

static net_mailbox_t g_mb;
static int g_next[PRODUCERS]; /* the seq each producer's next message must carry */
static int g_received;
static bool g_in_order = true;

static void on_msg(net_mb_node_t *n)
{
    msg_t *m = (msg_t *)n;
    if (m->seq != g_next[m->producer])
        g_in_order = false;
    g_next[m->producer] = m->seq + 1;
    free(m);
    if (++g_received == PRODUCERS * PER_PRODUCER)
        net_mailbox_close(&g_mb);
}

static void *produce(void *arg)
{
    int id = (int)(intptr_t)arg;
    for (int i = 0; i < PER_PRODUCER; i++) {
        msg_t *m = calloc(1, sizeof(*m));
        m->producer = id;
        m->seq = i;
        net_mailbox_post(&g_mb, &m->node, on_msg);
    }
    return NULL;
}

Test(net_mailbox, many_producers_every_message_once_in_order)
{
    uv_loop_t loop;
    cr_assert_eq(uv_loop_init(&loop), 0);
    cr_assert_eq(net_mailbox_init(&g_mb, &loop, 16), 0);
    pthread_t t[PRODUCERS];
    for (int i = 0; i < PRODUCERS; i++)
        pthread_create(&t[i], NULL, produce, (void *)(intptr_t)i);
    uv_run(&loop, UV_RUN_DEFAULT); /* ends once the last message closed the mailbox */
    for (int i = 0; i < PRODUCERS; i++)
        pthread_join(t[i], NULL);
    cr_assert_eq(g_received, PRODUCERS * PER_PRODUCER);
    cr_assert(g_in_order, "messages of one producer ran out of order");
    cr_assert_eq(net_mailbox_dropped(&g_mb), 0, "post never drops");
    cr_assert_eq(uv_loop_close(&loop), 0);
}

static int g_ran;
static void count_msg(net_mb_node_t *n)
{
    (void)n;
    g_ran++;
}

Test(net_mailbox, try_post_refuses_past_the_bound_and_counts)
{
    uv_loop_t loop;
    net_mailbox_t mb;
    msg_t m[10];
    cr_assert_eq(uv_loop_init(&loop), 0);
    cr_assert_eq(net_mailbox_init(&mb, &loop, 4), 0);
    int taken = 0;
    for (int i = 0; i < 10; i++)
        taken += net_mailbox_try_post(&mb, &m[i].node, count_msg);
    cr_assert_eq(taken, 4);
    cr_assert_eq(net_mailbox_dropped(&mb), 6);
    cr_assert_eq(net_mailbox_run(&mb), 4);
    cr_assert_eq(g_ran, 4);
    /* Room again once the consumer ran them. */
    cr_assert(net_mailbox_try_post(&mb, &m[0].node, count_msg));
    net_mailbox_close(&mb); /* runs what is left */
    cr_assert_eq(g_ran, 5);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&loop), 0);
}
