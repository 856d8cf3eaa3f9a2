/* Turns: work waiting for a shared resource (a thread pool's threads), handed out fairly at two
 * levels. Owners take turns; within an owner's turn its subs take turns; each (owner, sub)'s
 * work goes in arrival order. An owner that queues much waits behind its own work, not in front
 * of every other owner's; a sub that queues much waits behind its own, not in front of its
 * owner's other subs'. A turn is one piece of work, whatever it costs.
 *
 * Intrusive, as common/list.h: each waiting piece carries a dp_turn_t and nothing is allocated.
 * Adding and taking are O(owners waiting + subs of one owner waiting), which is small where it
 * is used (tenants, replicas). Not locked: one thread owns a dp_turns_t. */
#ifndef DP_TURNS_H
#define DP_TURNS_H

#include <stdbool.h>
#include <stddef.h>

typedef struct dp_turn_s {
    const void *owner, *sub; /* compared as pointers only */
    struct dp_turn_s *turn_next, *sub_next, *wait_tail, *next;
} dp_turn_t;

typedef struct {
    dp_turn_t *last; /* the owner whose turn is last, NULL when nothing waits */
    size_t waiting;
} dp_turns_t;

/* t waits behind the work of its (owner, sub): a new sub's turn comes after its owner's other
 * subs', a new owner's after every owner waiting now. */
void dp_turns_wait(dp_turns_t *q, dp_turn_t *t, const void *owner, const void *sub);

/* The piece whose turn it is, taken out; NULL when nothing waits. */
dp_turn_t *dp_turns_next(dp_turns_t *q);

static inline bool dp_turns_empty(const dp_turns_t *q)
{
    return q->last == NULL;
}

#endif
