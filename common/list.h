/* Intrusive doubly linked lists, as BSD <sys/queue.h>'s LIST and TAILQ: each element carries
 * its own two link fields (named by the caller, so one element may sit in several lists).
 * DP_LIST_* lists are headed by a plain pointer to the first element or NULL; DP_TLIST_* lists
 * (queues) keep a second pointer, to the last element, so appending is O(1) too. Insertion and
 * removal from anywhere are O(1) and allocate nothing; walking is a plain loop over `next`.
 * No macro locks: the caller's thread or lock owns the list. */
#ifndef DP_LIST_H
#define DP_LIST_H

#include <stddef.h>

/* Put elem first in the list at head. */
#define DP_LIST_PUSH(head, elem, next, prev)                                                       \
    do {                                                                                           \
        (elem)->prev = NULL;                                                                       \
        (elem)->next = (head);                                                                     \
        if (head)                                                                                  \
            (head)->prev = (elem);                                                                 \
        (head) = (elem);                                                                           \
    } while (0)

/* Take elem, which is in the list at head, out of it; its links are left NULL. */
#define DP_LIST_UNLINK(head, elem, next, prev) DP_LIST_UNLINK_(head, elem, next, prev, (void)0)

/* The unlinking both kinds share; `at_end` runs when elem was the last element. */
#define DP_LIST_UNLINK_(head, elem, next, prev, at_end)                                            \
    do {                                                                                           \
        if ((elem)->prev)                                                                          \
            (elem)->prev->next = (elem)->next;                                                     \
        else                                                                                       \
            (head) = (elem)->next;                                                                 \
        if ((elem)->next)                                                                          \
            (elem)->next->prev = (elem)->prev;                                                     \
        else                                                                                       \
            at_end;                                                                                \
        (elem)->next = (elem)->prev = NULL;                                                        \
    } while (0)

/* Put elem after `after` in the queue at head/tail; after == NULL puts it first. */
#define DP_TLIST_INSERT_AFTER(head, tail, after, elem, next, prev)                                 \
    do {                                                                                           \
        (elem)->prev = (after);                                                                    \
        (elem)->next = (after) ? (after)->next : (head);                                           \
        if ((elem)->next)                                                                          \
            (elem)->next->prev = (elem);                                                           \
        else                                                                                       \
            (tail) = (elem);                                                                       \
        if ((elem)->prev)                                                                          \
            (elem)->prev->next = (elem);                                                           \
        else                                                                                       \
            (head) = (elem);                                                                       \
    } while (0)

/* Put elem last in the queue at head/tail. */
#define DP_TLIST_APPEND(head, tail, elem, next, prev)                                              \
    DP_TLIST_INSERT_AFTER(head, tail, tail, elem, next, prev)

/* Take elem, which is in the queue at head/tail, out of it; its links are left NULL. */
#define DP_TLIST_UNLINK(head, tail, elem, next, prev)                                              \
    DP_LIST_UNLINK_(head, elem, next, prev, (tail) = (elem)->prev)

#endif
