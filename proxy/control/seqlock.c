/* See proxy/control/seqlock.h. One record per engine a single_sequence pool names, found by its
 * label (the URL as written) on each tick; the engine objects themselves may go between ticks
 * (a reload), so a callback looks its engine up again.
 *
 * A key is ours while it is on our lease: taken by us, or found so (a take's failure answer, the
 * watch, the read at connect: written before etcd was lost and found again on the same lease).
 * We let go of it with a delete guarded by that lease, so a delete that may have failed is sent
 * again until etcd says the key is not on our lease any more. Losing etcd does not lose the key
 * (etcd keeps leases across its own restarts, and ours may outlive the outage); it only stops
 * anything new from starting until we are connected again.
 *
 * A key that went with its holder's lease (the holder killed, or cut off past its lease) says
 * nothing of what the holder left running: llama.cpp finishes a non-streamed generation whose
 * connection closed. So a member lets go of a key it knows clean with the same transaction
 * putting idle/<id> (on no lease), and the take reads and deletes that mark in its own: a take
 * that finds none (the holder's lease ended, its answer was lost, its check was cut short)
 * runs a start check (px_admission_check_engine) before anything of ours starts there, and
 * the key is known clean again once that check ends knowing the engine idle. */
#include "proxy/control/seqlock.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/list.h"
#include "common/log.h"
#include "common/util.h"
#include "fleet/etcdjson.h"
#include "proxy/core/px.h"
#include "proxy/core/replica.h"
#include "proxy/data/admission.h"
#include "proxy/data/worker.h"

typedef struct lock_s {
    struct lock_s *next, *prev;
    px_seqlock_t *s;
    char *label;           /* the engine's */
    char *key;             /* <prefix>engines/<first 32 hex digits of the label's SHA-256> */
    char *mark;            /* <prefix>idle/<the same>: the last holder let go of it clean */
    uint64_t serial;       /* the engine object last found for it (px_engine_t.serial) */
    uint64_t seen;         /* the tick that last found its engine */
    int64_t lease;         /* the lease the key is on while it is ours; 0: not ours */
    uint64_t held_ms;      /* ours since (loop ms) */
    uint64_t ran_ms;       /* something of ours last ran on the engine (loop ms) */
    uint64_t next_try_ms;  /* not taken again before (loop ms) */
    bool busy;             /* a call for it in flight */
    bool handing;          /* held too long while busy: nothing new starts, it goes once idle */
    bool sure;             /* ours for certain (not only maybe: a take with no answer) */
    bool clean;            /* ours, and nothing an earlier holder left can run there: the mark */
    bool checking;         /* ours, and its start check runs */
    int64_t rev;           /* the revision of our last take or release of it */
    uint64_t taken, given; /* times it became ours and stopped being so */
} lock_t;

struct px_seqlock_s {
    px_t *px;
    fleet_etcd_t *etcd;
    char *prefix, *instance;
    int64_t lease;  /* ours now; 0 while not connected */
    uint64_t until; /* it surely lives until then (dp_now_ms) */
    uv_timer_t tick;
    uint64_t ticks;
    lock_t *locks;
    unsigned calls; /* in flight */
    bool stopped, tick_closed;
    void (*then)(void *); /* px_seqlock_close's, while its releases are in flight */
    void *then_data;
};

static void lock_free(lock_t *l)
{
    free(l->label);
    free(l->key);
    free(l->mark);
    free(l);
}

static void maybe_free(px_seqlock_t *s)
{
    if (!s->stopped || !s->tick_closed || s->calls > 0)
        return;
    while (s->locks) {
        lock_t *l = s->locks;
        DP_LIST_UNLINK(s->locks, l, next, prev);
        lock_free(l);
    }
    free(s->prefix);
    free(s->instance);
    free(s);
}

typedef struct {
    const char *label;
    px_engine_t *found;
} find_t;

static void find_cb(px_engine_t *e, void *data)
{
    find_t *f = data;
    if (strcmp(e->label, f->label) == 0)
        f->found = e;
}

/* The engine of l while a single_sequence pool names it; NULL when none does. */
static px_engine_t *engine_of(const lock_t *l)
{
    find_t f = {l->label, NULL};
    px_replica_engines_each(find_cb, &f);
    return f.found;
}

/* A line naming l's engine and key; with why, at warn whatever lvl says. */
static void lock_log(dp_log_level_t lvl, const char *msg, const lock_t *l, const char *why)
{
    dp_jw_t *w = dp_log_begin(why ? DP_LOG_WARN : lvl, msg);
    if (w) {
        dp_jw_str(w, "engine", l->label);
        dp_jw_str(w, "key", l->key);
        if (why)
            dp_jw_str(w, "error", why);
        dp_log_end(w);
    }
}

/* Nothing new starts on l's engine (the key is not ours, or we cannot tell now). */
static void stop_starting(const lock_t *l)
{
    px_engine_t *e = engine_of(l);
    if (e)
        atomic_store(&e->held, false);
}

/* The key is ours, or may be, on lease; `clean` when the take that made it so found the mark.
 * Nothing starts on its engine for that alone (own()). */
static void mine(lock_t *l, int64_t lease, bool sure, bool clean)
{
    l->lease = lease;
    l->sure = sure;
    l->clean = clean;
    l->checking = false;
    l->held_ms = uv_now(l->s->px->loop);
    l->handing = false;
    l->taken++;
}

/* The key is not ours (any more). */
static void lost(lock_t *l)
{
    stop_starting(l);
    l->lease = 0;
    l->clean = l->checking = false;
    l->handing = false;
    l->given++;
}

/* The key is ours, and not known clean: a start check on its engine before anything of ours
 * starts there, its slot taken first (it keeps the key meanwhile). An engine that only pools
 * not naming llama.cpp send to cannot be asked, and is as clean as the members can know it. One
 * no pool of the configuration in force sends to cannot be asked either: nothing of ours starts
 * there (a request queued under an earlier configuration would), and it goes unmarked. Nor is
 * one asked once a graceful stop has its clients answered (a take sent before that, answered
 * after): nothing of ours starts anywhere any more, and a check would only hold the stop up for
 * a second or more; the key goes unmarked. */
static void check(lock_t *l, px_engine_t *e)
{
    bool stopping = e && px_replica_engines_quiesced();
    if (stopping)
        lock_log(DP_LOG_INFO, "fleet_engine_unchecked_at_stop", l, NULL);
    int r = e && !stopping
                ? px_admission_check_engine(l->s->px, e, "its fleet holder did not let it go clean")
                : -1;
    l->checking = r > 0;
    l->clean = r == 0;
    l->handing = r < 0;
    if (l->checking) /* what it waits for is its own line, engine_start_check */
        lock_log(DP_LOG_INFO, "fleet_engine_checking", l, NULL);
}

/* Requests may start on e, whose key l is surely ours: at once when the key is known clean,
 * else after a start check (its slot taken first), or not at all when none can be made there
 * (it goes unmarked). */
static void allow(lock_t *l, px_engine_t *e)
{
    if (!l->clean && !l->checking && !l->handing)
        check(l, e);
    atomic_store(&e->want, false);
    atomic_store(&e->held_until, l->s->until);
    atomic_store(&e->closing, l->handing);
    atomic_store(&e->held, true);
    px_workers_wake(l->s->px); /* requests queued for it look again */
}

/* The key is ours, on s's lease now; `clean` when the take found the mark. */
static void own(lock_t *l, bool clean)
{
    px_seqlock_t *s = l->s;
    mine(l, s->lease, true, clean);
    px_engine_t *e = engine_of(l);
    if (e) {
        l->serial = e->serial;           /* what the mark, or a check, says is of this one */
        atomic_store(&e->unsure, false); /* from before: the mark, or a check, says now */
        allow(l, e);
    }
    /* else no pool asks for it now: the next tick lets it go */
}

static void left(uv_timer_t *t);

/* A call's context: the lease it was made under. */
typedef struct {
    lock_t *l;
    int64_t lease;
} call_t;

static call_t *call_new(lock_t *l)
{
    call_t *c = dp_xcalloc(1, sizeof(*c));
    c->l = l;
    c->lease = l->s->lease;
    l->busy = true;
    l->s->calls++;
    return c;
}

/* The call is over; false when the seqlock stopped meanwhile (nothing more to do). */
static bool call_done(call_t *c)
{
    lock_t *l = c->l;
    px_seqlock_t *s = l->s;
    l->busy = false;
    s->calls--;
    free(c);
    if (s->stopped) {
        /* The last release at a clean stop answered: `then` on the next turn. */
        if (s->then && s->calls == 0)
            uv_timer_start(&s->tick, left, 0, 0);
        maybe_free(s);
        return false;
    }
    return true;
}

/* The keys a transaction's i-th answer, a range, found (NULL when it is not one). */
static const cJSON *range_kvs(const cJSON *res, int i)
{
    const cJSON *r = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(res, "responses"), i);
    return cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(r, "response_range"),
                                            "kvs");
}

/* Is the key a failed take's answer found on `lease`? */
static bool found_on(const cJSON *res, int64_t lease)
{
    fleet_kv_t kv = {0};
    bool on = lease != 0 && fleet_ej_kv(cJSON_GetArrayItem(range_kvs(res, 0), 0), &kv) == 0 &&
              kv.lease == lease;
    fleet_kv_free(&kv);
    return on;
}

static void taken(const cJSON *res, const char *why, void *data)
{
    call_t *c = data;
    lock_t *l = c->l;
    px_seqlock_t *s = l->s;
    int64_t lease = c->lease;
    if (!call_done(c))
        return;
    uint64_t now = uv_now(s->px->loop);
    if (res == NULL) {
        /* It may have been written: ours then, maybe. Let go of as if it were (a delete
         * guarded by the lease does nothing to a key that is not), then taken again if
         * wanted; nothing starts on it meanwhile. Not clean: the take may have found no mark
         * and deleted one, and whoever takes it next checks. */
        lock_log(DP_LOG_DEBUG, "fleet_engine_take_failed", l, why);
        mine(l, lease, false, false);
        l->next_try_ms = now + PX_SEQLOCK_RETRY_MS;
        return;
    }
    /* Not written: held by another member (tried again at its delete, or in a while), or by
     * us on the lease we hold now (from before etcd was lost and found again): ours then. */
    if (!cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(res, "succeeded")) &&
        !found_on(res, lease)) {
        l->next_try_ms = now + PX_SEQLOCK_RETRY_MS;
        return;
    }
    l->rev = fleet_ej_revision(res);
    /* Clean when this take wrote the key and read the mark (deleting it): the last holder let
     * go of it clean. A key found already ours was written by a take of ours whose answer went
     * astray (sent again to another endpoint, say): what that one found is not known. */
    bool clean = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(res, "succeeded")) &&
                 cJSON_GetArraySize(range_kvs(res, 1)) > 0;
    if (lease != s->lease) {
        /* On a lease that has gone since (it goes with it), or while we are not connected: the
         * key is ours on that lease, let go of once we are connected on it again, or run on
         * (px_seqlock_lease) once known clean. */
        if (s->lease == 0)
            mine(l, lease, true, clean);
        return;
    }
    own(l, clean);
    lock_log(DP_LOG_DEBUG, "fleet_engine_taken", l, NULL);
}

static void given(const cJSON *res, const char *why, void *data)
{
    call_t *c = data;
    lock_t *l = c->l;
    if (!call_done(c))
        return;
    if (res == NULL) { /* it may or may not be gone: asked again while it may be ours */
        lock_log(DP_LOG_DEBUG, "fleet_engine_release_failed", l, why);
        return;
    }
    /* Deleted, or not on our lease any more (deleted by someone, or its lease gone). Counted
     * once: the lease may have gone while the delete was in flight (lost). */
    l->rev = fleet_ej_revision(res);
    if (l->lease != 0) {
        l->lease = 0;
        l->given++;
    }
    l->handing = l->clean = l->checking = false;
    l->next_try_ms = uv_now(l->s->px->loop) + PX_SEQLOCK_BACKOFF_MS;
}

static void take(lock_t *l)
{
    px_seqlock_t *s = l->s;
    dp_buf_t v = {0}, body = {0};
    dp_jw_t w;
    dp_jw_init(&w, &v);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "instance", s->instance);
    dp_jw_str(&w, "engine", l->label);
    dp_jw_uint(&w, "at_ms", dp_wall_ms());
    dp_jw_obj_end(&w);
    fleet_ej_txn_take(&body, l->key, v.base, v.len, s->lease, l->mark);
    fleet_etcd_call(s->etcd, "/v3/kv/txn", &body, taken, call_new(l));
    dp_buf_free(&v);
    dp_buf_free(&body);
}

static void give(lock_t *l)
{
    dp_buf_t body = {0}, v = {0};
    /* Not clean after a drain or hold of ours there ran out its time (the engine may still
     * generate what it was kept for). */
    px_engine_t *e = engine_of(l);
    if (e && atomic_exchange(&e->unsure, false))
        l->clean = false;
    if (l->clean) {
        dp_jw_t w;
        dp_jw_init(&w, &v);
        dp_jw_obj_begin(&w, NULL);
        dp_jw_str(&w, "instance", l->s->instance);
        dp_jw_uint(&w, "at_ms", dp_wall_ms());
        dp_jw_obj_end(&w);
    }
    fleet_ej_txn_delete_on_lease(&body, l->key, l->lease, l->clean ? l->mark : NULL, v.base, v.len);
    fleet_etcd_call(l->s->etcd, "/v3/kv/txn", &body, given, call_new(l));
    dp_buf_free(&body);
    dp_buf_free(&v);
}

static lock_t *lock_by_label(px_seqlock_t *s, const char *label)
{
    for (lock_t *l = s->locks; l; l = l->next)
        if (strcmp(l->label, label) == 0)
            return l;
    return NULL;
}

/* e is l's engine now. One made anew since it was last found (a reload took every pool naming
 * it away and brought one back before a tick saw it gone) does not know what ran on the one
 * before (a drain of ours there that ran out its time): the key is not known clean. */
static void same_engine(lock_t *l, const px_engine_t *e)
{
    if (l->serial != e->serial)
        l->clean = false;
    l->serial = e->serial;
}

static void seen_cb(px_engine_t *e, void *data)
{
    px_seqlock_t *s = data;
    lock_t *l = lock_by_label(s, e->label);
    if (l == NULL) {
        l = dp_xcalloc(1, sizeof(*l));
        l->s = s;
        l->label = dp_xstrdup(e->label);
        char hex[65];
        dp_sha256_hex(e->label, strlen(e->label), hex);
        dp_buf_t k = {0};
        dp_buf_printf(&k, "%sengines/%.32s", s->prefix, hex);
        l->key = dp_buf_steal(&k);
        dp_buf_printf(&k, "%sidle/%.32s", s->prefix, hex);
        l->mark = dp_buf_steal(&k);
        DP_LIST_PUSH(s->locks, l, next, prev);
    }
    l->seen = s->ticks;
    same_engine(l, e);
}

/* What the start check on l's engine found, once its checks there have ended. */
static void checked(lock_t *l, const px_engine_t *e)
{
    if (!l->checking || e->checks != 0)
        return;
    l->checking = false;
    l->clean = !e->check_unknown;
    /* Not known clean (cut short, over its time, no pool to ask through): nothing of ours
     * starts there (the check set `closing`), and it goes unmarked. */
    l->handing = !l->clean;
}

/* Let go of l now if nothing runs on its engine: `closing` is set first, then the count read
 * (take_only in proxy/core/replica.c reads them the other way round). */
static void give_if_idle(lock_t *l, px_engine_t *e)
{
    atomic_store(&e->closing, true);
    if (atomic_load(&e->running) != 0) {
        if (!l->handing)
            atomic_store(&e->closing, false); /* a request started meanwhile: keep it */
        return;
    }
    atomic_store(&e->held, false);
    give(l);
}

static void on_tick(uv_timer_t *t)
{
    px_seqlock_t *s = t->data;
    uint64_t now = uv_now(s->px->loop);
    s->ticks++;
    px_replica_engines_each(seen_cb, s);
    for (lock_t *l = s->locks, *next; l; l = next) {
        next = l->next;
        if (l->busy)
            continue;
        px_engine_t *e = l->seen == s->ticks ? engine_of(l) : NULL;
        if (l->lease && s->lease == 0)
            continue;    /* ours, maybe: let go of once connected (nothing new starts meanwhile) */
        if (e == NULL) { /* no single_sequence pool names it now */
            if (l->lease) {
                /* Not known clean: what ran there under the earlier configuration (a drain of
                 * ours that ran out its time, say) went with its engine object. */
                l->clean = false;
                give(l);
            } else {
                DP_LIST_UNLINK(s->locks, l, next, prev);
                lock_free(l);
            }
            continue;
        }
        if (l->lease) {
            checked(l, e);
            uint64_t last = l->ran_ms > l->held_ms ? l->ran_ms : l->held_ms;
            if (atomic_load(&e->running) != 0)
                l->ran_ms = now;
            else if (!l->handing && now - last < PX_SEQLOCK_IDLE_MS)
                continue; /* taken or used just now: kept for whoever looks next */
            if (!l->handing && now - l->held_ms >= PX_SEQLOCK_HOLD_MS &&
                atomic_load(&e->running) != 0) {
                l->handing = true; /* others may wait: nothing new, then it goes */
                atomic_store(&e->closing, true);
            }
            give_if_idle(l, e);
            continue;
        }
        /* Nothing is taken once a graceful stop has its clients answered: nothing of ours starts
         * anywhere any more. */
        if (s->lease != 0 && atomic_load(&e->want) && now >= l->next_try_ms &&
            !px_replica_engines_quiesced())
            take(l);
    }
}

static void tick_closed(uv_handle_t *h)
{
    px_seqlock_t *s = h->data;
    s->tick_closed = true;
    maybe_free(s);
}

px_seqlock_t *px_seqlock_start(px_t *px, fleet_etcd_t *etcd, const char *prefix,
                               const char *instance)
{
    px_seqlock_t *s = dp_xcalloc(1, sizeof(*s));
    s->px = px;
    s->etcd = etcd;
    s->prefix = dp_xstrdup(prefix);
    s->instance = dp_xstrdup(instance);
    uv_timer_init(px->loop, &s->tick);
    s->tick.data = s;
    uv_timer_start(&s->tick, on_tick, 0, PX_SEQLOCK_TICK_MS);
    px_replica_engines_gate();
    return s;
}

void px_seqlock_lease(px_seqlock_t *s, int64_t lease, uint64_t until_ms)
{
    if (s == NULL)
        return;
    s->lease = lease;
    s->until = lease ? until_ms : 0;
    for (lock_t *l = s->locks; l; l = l->next) {
        if (l->lease == 0)
            continue;
        if (lease == l->lease && l->busy)
            continue;     /* being let go of: not run on again */
        if (lease == 0) { /* etcd lost: nothing new starts until we know again */
            stop_starting(l);
        } else if (lease != l->lease) {
            lock_log(DP_LOG_DEBUG, "fleet_engine_lost", l, "the lease it was held on is gone");
            lost(l);
        } else {
            /* Kept alive, or connected again on it: a key surely ours may be run on again (one
             * whose slot went to a request that waits to start would otherwise never be let
             * go of, nor used). */
            px_engine_t *e = engine_of(l);
            if (e == NULL)
                continue;
            atomic_store(&e->held_until, s->until);
            if (l->sure && !atomic_load(&e->held))
                allow(l, e);
        }
    }
}

void px_seqlock_kv(px_seqlock_t *s, const char *rel, int64_t lease, int64_t rev, bool deleted)
{
    if (s == NULL)
        return;
    size_t pl = strlen(s->prefix);
    for (lock_t *l = s->locks; l; l = l->next) {
        /* A watch that resumes replays changes from before our own last take or release: the
         * answer to that said where the key stands. */
        if (strcmp(l->key + pl, rel) != 0 || l->busy || (rev != 0 && rev <= l->rev))
            continue;
        if (deleted) {
            l->next_try_ms = 0; /* free: whoever wants it tries now */
            if (l->lease) {     /* ours, and we did not let it go: deleted by someone */
                lock_log(DP_LOG_DEBUG, "fleet_engine_lost", l, "its key was deleted");
                lost(l);
            }
        } else if (l->lease == 0 && lease != 0 && lease == s->lease) {
            /* Ours from before etcd was lost and found again: the next tick lets it go, or
             * keeps it while something runs. Whatever our take found there is not known. */
            mine(l, lease, true, false);
        }
    }
}

void px_seqlock_json(px_seqlock_t *s, dp_jw_t *w)
{
    dp_jw_arr_begin(w, "engines");
    for (lock_t *l = s ? s->locks : NULL; l; l = l->next) {
        px_engine_t *e = engine_of(l);
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "engine", l->label);
        dp_jw_str(w, "key", l->key);
        dp_jw_bool(w, "held", l->lease != 0);
        dp_jw_bool(w, "starting",
                   e && atomic_load(&e->held) && !atomic_load(&e->closing) &&
                       dp_now_ms() < atomic_load(&e->held_until));
        dp_jw_uint(w, "running", e ? atomic_load(&e->running) : 0);
        dp_jw_bool(w, "wanted", e && atomic_load(&e->want));
        dp_jw_uint(w, "taken", l->taken);
        dp_jw_uint(w, "given", l->given);
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
}

void px_seqlock_stop(px_seqlock_t *s)
{
    if (s == NULL)
        return;
    for (lock_t *l = s->locks; l; l = l->next)
        stop_starting(l);
    s->stopped = true;
    uv_timer_stop(&s->tick);
}

/* The clean stop's releases are answered, or their time is up: `then` runs once (a release
 * still in flight ends when the caller frees the client). */
static void left(uv_timer_t *t)
{
    px_seqlock_t *s = t->data;
    void (*then)(void *) = s->then;
    s->then = NULL;
    uv_close((uv_handle_t *)&s->tick, tick_closed);
    if (then)
        then(s->then_data);
}

void px_seqlock_close(px_seqlock_t *s, void (*then)(void *data), void *data)
{
    if (s == NULL) {
        if (then)
            then(data);
        return;
    }
    assert(s->stopped);
    assert(then == NULL || s->calls == 0); /* the caller ended the client's calls */
    s->then = then;
    s->then_data = data;
    for (lock_t *l = s->locks; l && then; l = l->next) {
        px_engine_t *e = engine_of(l);
        if (e == NULL || l->busy || l->lease == 0 || l->lease != s->lease || !l->sure)
            continue;
        same_engine(l, e);
        checked(l, e);
        /* Clean also when handed on for having been held too long (`handing`): what it waited
         * for has ended. Marked unless a drain or hold of ours there ran out its time. */
        if (l->clean && !l->checking) {
            give_if_idle(l, e);
            if (l->busy) /* its release is in flight */
                lock_log(DP_LOG_INFO, "fleet_engine_let_go_at_stop", l, NULL);
        }
    }
    /* `then` once the releases are answered (call_done), at PX_SEQLOCK_LEAVE_MS at the latest;
     * with none in flight, on the next turn. */
    uv_timer_start(&s->tick, left, s->calls > 0 ? PX_SEQLOCK_LEAVE_MS : 0, 0);
}
