/* Intrusive doubly linked lists headed by a plain pointer, as BSD <sys/queue.h>'s LIST: each
 * element carries its own two link fields (named by the caller, so one element may sit in
 * several lists), the head is a pointer to the first element or NULL. Insertion at the head
 * and removal from anywhere are O(1) and allocate nothing; walking is a plain loop over `next`.
 * Neither macro locks: the caller's thread or lock owns the list. */
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
#define DP_LIST_UNLINK(head, elem, next, prev)                                                     \
    do {                                                                                           \
        if ((elem)->prev)                                                                          \
            (elem)->prev->next = (elem)->next;                                                     \
        else                                                                                       \
            (head) = (elem)->next;                                                                 \
        if ((elem)->next)                                                                          \
            (elem)->next->prev = (elem)->prev;                                                     \
        (elem)->next = (elem)->prev = NULL;                                                        \
    } while (0)

#endif
