/* Two-level turns (turns.h).
 *
 * The first waiting piece of each (owner, sub) stands for it: its wait_tail is the last of that
 * (owner, sub)'s pieces, which follow it through `next`. An owner's subs form a ring through
 * sub_next, and the sub whose turn is last stands for the owner in the owners' ring (turn_next):
 * its sub_next is the sub whose turn is next. q->last is the owners' ring's last: the next turn
 * is q->last->turn_next's. A turn taken moves what had it to the back of both rings, in the
 * place of the piece taken. */
#include "common/turns.h"

#include <assert.h>

void dp_turns_wait(dp_turns_t *q, dp_turn_t *t, const void *owner, const void *sub)
{
    t->owner = owner;
    t->sub = sub;
    t->next = NULL;
    t->wait_tail = t;
    t->sub_next = t;
    q->waiting++;
    dp_turn_t *prev = q->last;
    if (prev == NULL) {
        t->turn_next = t;
        q->last = t;
        return;
    }
    do {
        dp_turn_t *o = prev->turn_next; /* stands for its owner: the owner's last sub */
        if (o->owner == owner) {
            dp_turn_t *s = o;
            do {
                s = s->sub_next;
                if (s->sub == sub) {
                    s->wait_tail->next = t;
                    s->wait_tail = t;
                    return;
                }
            } while (s != o);
            /* A new sub, its owner's last: it stands for the owner in o's place. */
            t->sub_next = o->sub_next;
            o->sub_next = t;
            t->turn_next = o->turn_next == o ? t : o->turn_next;
            prev->turn_next = t;
            if (q->last == o)
                q->last = t;
            return;
        }
        prev = o;
    } while (prev != q->last);
    t->turn_next = q->last->turn_next;
    q->last->turn_next = t;
    q->last = t;
}

dp_turn_t *dp_turns_next(dp_turns_t *q)
{
    if (q->last == NULL)
        return NULL;
    assert(q->waiting > 0);
    q->waiting--;
    dp_turn_t *o = q->last->turn_next; /* the owner whose turn it is, as its last sub */
    dp_turn_t *s = o->sub_next;        /* the sub whose turn it is (o itself when alone) */
    dp_turn_t *n = s->next, *last;     /* last: the owner's last sub after this turn */
    if (n) {
        n->wait_tail = s->wait_tail;
        n->sub_next = s == o ? n : s->sub_next;
        o->sub_next = n; /* in s's place, and its owner's last */
        last = n;
    } else if (s == o) {
        last = NULL; /* the owner's only sub had its last piece */
    } else {
        o->sub_next = s->sub_next;
        last = o;
    }
    if (last == NULL) {
        if (o == q->last)
            q->last = NULL;
        else
            q->last->turn_next = o->turn_next;
    } else {
        last->turn_next = o == q->last ? last : o->turn_next;
        q->last->turn_next = last; /* in o's place (o itself, when it is the only owner) */
        q->last = last;
    }
    s->next = NULL;
    return s;
}
