/* Intrusive lists (common/list.h): after every insertion and removal, both directions of the
 * list must read the order a plain array model holds, and the head and tail must be its ends. */
#include <criterion/criterion.h>
#include <stddef.h>

#include "common/list.h"

typedef struct node node_t;
struct node {
    int id;
    node_t *next, *prev;
};

/* The list at head/tail read forwards and backwards must both be want[0..n). */
static void expect(node_t *head, node_t *tail, const int *want, int n)
{
    int i = 0;
    node_t *last = NULL;
    for (node_t *e = head; e; e = e->next, i++) {
        cr_assert_lt(i, n, "more than %d elements", n);
        cr_assert_eq(e->id, want[i], "forwards, element %d: %d, want %d", i, e->id, want[i]);
        cr_assert_eq(e->prev, last, "element %d's prev", i);
        last = e;
    }
    cr_assert_eq(i, n, "%d elements, want %d", i, n);
    cr_assert_eq(tail, last, "the tail is not the last element");
}

Test(list, push_puts_first_and_unlink_takes_from_anywhere)
{
    node_t v[4] = {{.id = 0}, {.id = 1}, {.id = 2}, {.id = 3}};
    node_t *head = NULL;
    for (int i = 0; i < 4; i++)
        DP_LIST_PUSH(head, &v[i], next, prev);
    node_t *tail = &v[0];
    expect(head, tail, (int[]){3, 2, 1, 0}, 4);
    DP_LIST_UNLINK(head, &v[1], next, prev); /* middle */
    expect(head, tail, (int[]){3, 2, 0}, 3);
    cr_assert(v[1].next == NULL && v[1].prev == NULL);
    DP_LIST_UNLINK(head, &v[3], next, prev); /* first */
    expect(head, tail, (int[]){2, 0}, 2);
    DP_LIST_UNLINK(head, &v[0], next, prev); /* last */
    expect(head, &v[2], (int[]){2}, 1);
    DP_LIST_UNLINK(head, &v[2], next, prev); /* only */
    cr_assert_null(head);
}

Test(list, a_queue_appends_at_its_tail_and_unlinks_from_anywhere)
{
    node_t v[4] = {{.id = 0}, {.id = 1}, {.id = 2}, {.id = 3}};
    node_t *head = NULL, *tail = NULL;
    for (int i = 0; i < 4; i++)
        DP_TLIST_APPEND(head, tail, &v[i], next, prev);
    expect(head, tail, (int[]){0, 1, 2, 3}, 4);
    DP_TLIST_UNLINK(head, tail, &v[3], next, prev); /* last: the tail moves back */
    expect(head, tail, (int[]){0, 1, 2}, 3);
    cr_assert(v[3].next == NULL && v[3].prev == NULL);
    DP_TLIST_UNLINK(head, tail, &v[0], next, prev); /* first: the head moves on */
    expect(head, tail, (int[]){1, 2}, 2);
    DP_TLIST_UNLINK(head, tail, &v[1], next, prev);
    expect(head, tail, (int[]){2}, 1);
    DP_TLIST_APPEND(head, tail, &v[0], next, prev); /* a removed element goes back in */
    expect(head, tail, (int[]){2, 0}, 2);
    DP_TLIST_UNLINK(head, tail, &v[2], next, prev);
    DP_TLIST_UNLINK(head, tail, &v[0], next, prev);
    cr_assert(head == NULL && tail == NULL);
}

Test(list, a_queue_inserts_after_any_element_or_first)
{
    node_t v[5] = {{.id = 0}, {.id = 1}, {.id = 2}, {.id = 3}, {.id = 4}};
    node_t *head = NULL, *tail = NULL;
    DP_TLIST_INSERT_AFTER(head, tail, (node_t *)NULL, &v[2], next, prev); /* into empty */
    expect(head, tail, (int[]){2}, 1);
    DP_TLIST_INSERT_AFTER(head, tail, (node_t *)NULL, &v[0], next, prev); /* first */
    expect(head, tail, (int[]){0, 2}, 2);
    DP_TLIST_INSERT_AFTER(head, tail, &v[0], &v[1], next, prev); /* middle */
    expect(head, tail, (int[]){0, 1, 2}, 3);
    DP_TLIST_INSERT_AFTER(head, tail, &v[2], &v[4], next, prev); /* after the tail */
    expect(head, tail, (int[]){0, 1, 2, 4}, 4);
    DP_TLIST_INSERT_AFTER(head, tail, &v[2], &v[3], next, prev);
    expect(head, tail, (int[]){0, 1, 2, 3, 4}, 5);
}
