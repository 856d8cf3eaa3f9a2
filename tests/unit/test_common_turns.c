/* Two-level turns (common/turns.h): the order work is handed out in, against a model that keeps
 * the owners and each owner's subs as plain lists. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "common/turns.h"

typedef struct {
    dp_turn_t turn;
    int seq;
} job_t;

static const void *key(int i)
{
    static char keys[16];
    return &keys[i];
}

static job_t *take(dp_turns_t *q)
{
    dp_turn_t *t = dp_turns_next(q);
    return t ? (job_t *)(void *)t : NULL;
}

static void add(dp_turns_t *q, job_t *j, int owner, int sub, int seq)
{
    j->seq = seq;
    dp_turns_wait(q, &j->turn, key(owner), key(sub));
}

/* The jobs (owner, sub) in order, each numbered by its place; then the order they are taken. */
static void expect(const int (*jobs)[2], int n, const int *want)
{
    dp_turns_t q = {0};
    job_t j[16];
    cr_assert(n <= 16);
    for (int i = 0; i < n; i++)
        add(&q, &j[i], jobs[i][0], jobs[i][1], i);
    cr_assert_eq(q.waiting, (size_t)n);
    for (int i = 0; i < n; i++)
        cr_assert_eq(take(&q)->seq, want[i], "turn %d", i);
    cr_assert_null(take(&q));
    cr_assert(dp_turns_empty(&q));
    cr_assert_eq(q.waiting, 0);
}

Test(turns, one_owner_is_first_come_first_served)
{
    expect((const int[][2]){{0, 0}, {0, 0}, {0, 0}, {0, 0}}, 4, (const int[]){0, 1, 2, 3});
}

Test(turns, an_owner_that_queued_first_and_most_waits_behind_its_own)
{
    /* owner 0 queues five, then owner 1 two, then owner 2 one: owners 0 1 2 0 1 0 0 0 */
    expect((const int[][2]){{0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {1, 0}, {1, 0}, {2, 0}}, 8,
           (const int[]){0, 5, 7, 1, 6, 2, 3, 4});
}

Test(turns, subs_take_turns_within_their_owners_turn)
{
    /* owner 0 (a replica) has answers for subs 1 (four) and 2 (one); owner 3 one answer.
     * Owners alternate; within owner 0, sub 1 and sub 2 alternate. */
    expect((const int[][2]){{0, 1}, {0, 1}, {0, 1}, {0, 1}, {0, 2}, {3, 0}}, 6,
           (const int[]){0, 5, 4, 1, 2, 3});
}

Test(turns, a_new_sub_comes_after_every_sub_of_its_owner_waiting_now)
{
    dp_turns_t q = {0};
    job_t j[4];
    add(&q, &j[0], 0, 1, 0);
    add(&q, &j[1], 0, 1, 1);
    cr_assert_eq(take(&q)->seq, 0);
    add(&q, &j[2], 0, 2, 2); /* sub 1 still waits: sub 2's turn is after it */
    add(&q, &j[3], 1, 0, 3); /* owner 1's after owner 0's */
    cr_assert_eq(take(&q)->seq, 1);
    cr_assert_eq(take(&q)->seq, 3);
    cr_assert_eq(take(&q)->seq, 2);
    cr_assert_null(take(&q));
}

/* The model: owners in turn order, each with its subs in turn order, each with its jobs. */
enum { OWNERS = 5, SUBS = 4, JOBS = 4096 };
typedef struct {
    int owners[OWNERS], nowners;
    int subs[OWNERS][SUBS], nsubs[OWNERS];
    int jobs[OWNERS][SUBS][JOBS], head[OWNERS][SUBS], tail[OWNERS][SUBS];
} model_t;

static int find(const int *a, int n, int v)
{
    for (int i = 0; i < n; i++)
        if (a[i] == v)
            return i;
    return -1;
}

static void rotate(int *a, int n, int i, bool keep)
{
    int v = a[i];
    memmove(a + i, a + i + 1, (size_t)(n - i - 1) * sizeof(*a));
    if (keep)
        a[n - 1] = v;
}

static void model_add(model_t *m, int owner, int sub, int seq)
{
    if (find(m->owners, m->nowners, owner) < 0)
        m->owners[m->nowners++] = owner;
    if (find(m->subs[owner], m->nsubs[owner], sub) < 0)
        m->subs[owner][m->nsubs[owner]++] = sub;
    m->jobs[owner][sub][m->tail[owner][sub]++ % JOBS] = seq;
}

static int model_take(model_t *m)
{
    if (m->nowners == 0)
        return -1;
    int owner = m->owners[0], sub = m->subs[owner][0];
    int seq = m->jobs[owner][sub][m->head[owner][sub]++ % JOBS];
    bool sub_left = m->head[owner][sub] != m->tail[owner][sub];
    rotate(m->subs[owner], m->nsubs[owner], 0, sub_left);
    if (!sub_left)
        m->nsubs[owner]--;
    bool owner_left = m->nsubs[owner] > 0;
    rotate(m->owners, m->nowners, 0, owner_left);
    if (!owner_left)
        m->nowners--;
    return seq;
}

Test(turns, matches_the_model_over_random_arrivals_and_takes)
{
    static model_t m;
    static job_t jobs[JOBS];
    memset(&m, 0, sizeof(m));
    dp_turns_t q = {0};
    uint64_t x = 0x9e3779b97f4a7c15u;
    int free_list[JOBS], nfree = 0, waiting = 0;
    for (int i = JOBS - 1; i >= 0; i--)
        free_list[nfree++] = i;
    for (int step = 0; step < 200000; step++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        /* bursts of arrivals and of takes, so the queue both fills and empties */
        bool arrive = ((step / 64) % 2 == 0) ? (x % 4 != 0) : (x % 4 == 0);
        if (arrive && nfree > 0) {
            int i = free_list[--nfree];
            int owner = (int)((x >> 8) % OWNERS), sub = (int)((x >> 16) % SUBS);
            add(&q, &jobs[i], owner, sub, i);
            model_add(&m, owner, sub, i);
            waiting++;
        } else {
            int want = model_take(&m);
            job_t *got = take(&q);
            /* one assertion per failure, not per step: --full-stats reports each one */
            if (want < 0) {
                if (got != NULL || !dp_turns_empty(&q))
                    cr_assert_fail("step %d: job %d when none waits", step, got ? got->seq : -1);
                continue;
            }
            if (got == NULL || got->seq != want)
                cr_assert_fail("step %d: job %d, the model's %d", step, got ? got->seq : -1, want);
            free_list[nfree++] = got->seq;
            waiting--;
        }
        if (q.waiting != (size_t)waiting)
            cr_assert_fail("step %d: %zu waiting, the model's %d", step, q.waiting, waiting);
    }
}
