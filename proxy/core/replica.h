/* A replica: one inference server of a pool, its attested state and its connections.
 *
 * Replicas are refcounted and shared between generations when their definition is unchanged,
 * so a reload keeps their attestation state and keep-alive pools. The control thread writes
 * their state; workers read it (atomics, seqstr.h for text). Per worker (indexed by slot, see
 * thread.h): a keep-alive pool and TLS context, touched by that worker only. The last
 * reference frees a replica on the control thread, after px->replica_hooks.freed. */
#ifndef PX_REPLICA_H
#define PX_REPLICA_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include "config/config.h"
#include "net/client.h"
#include "net/mailbox.h"
#include "proxy/core/metrics.h"
#include "proxy/core/seqstr.h"
#include "proxy/core/types.h"

typedef enum {
    PX_REPLICA_PENDING = 0,
    PX_REPLICA_ADMITTED,
    PX_REPLICA_REJECTED,
    PX_REPLICA_UNREACHABLE,
    PX_REPLICA_QUARANTINED,
} px_replica_state_t;

extern const char *const px_replica_state_names[];

#define PX_MAX_REASONS 8

/* The reasons text workers log with a 503 (px_pool_why_unavailable). */
#define PX_WHY_BYTES 512

/* The canary's last verdict on a replica, as attestation publishes it. */
typedef enum { PX_CANARY_UNKNOWN = 0, PX_CANARY_PASS, PX_CANARY_FAIL } px_canary_t;

/* One engine, whichever pools and configuration generations name it (however they spell its
 * URL: cfg_url_engine): what it runs at all, so a single_sequence pool's one request waits for
 * every other. */
typedef struct px_engine_s {
    /* The slots naming it, the single_sequence ones, and of those the ones whose engine
     * finishes an answer whose connection closed (policy_pool_drains_abandoned). Control
     * thread. */
    int refs, ones, drains;
    struct px_engine_s *next, *prev;
    atomic_uint running; /* requests on it: every slot held, whichever slots hold it */
    /* While a single_sequence pool names it (ones > 0), every slot on it is taken only when
     * nothing runs there: a reload that makes a pool single_sequence waits for what the
     * pool's earlier mode still runs, and an earlier generation's queue sends nothing beside
     * the one sequence. */
    atomic_bool one;
    /* drains > 0: an exchange with it that nobody will read is read to its end, whatever mode
     * it was sent under (px_replica_drains_abandoned). */
    atomic_bool drain;
    /* Across a fleet (docs/fleet.md, "One sequence per engine across the fleet"): while
     * `gated`, a request starts only while this member `held`s the engine's key in etcd, a new
     * one not while it is `closing` (letting go of the key once nothing runs), and a take
     * refused for want of the key sets `want` (proxy/control/seqlock.c takes the key then). */
    atomic_bool gated, held, closing, want;
    /* ... and only until this (dp_now_ms): while its lease surely lives, so a member paused or
     * cut off past its lease starts nothing there when it runs again, before it learns so. */
    _Atomic uint64_t held_until;
    /* Its URL as cfg_url_engine writes it ("http://host:port/path"): its key here, in logs and
     * in the fleet. */
    char *label;
    /* This engine object among all made by this process: one made anew for the same URL (a
     * reload took every pool naming it away, then brought one back) knows nothing of what the
     * earlier one did (`unsure`, below). Control thread. */
    uint64_t serial;
    /* Counted here from the last generation made (px_replica_engine_seen): nothing this
     * process sent runs there, but an earlier process may have left a generation running.
     * Control thread. */
    bool fresh;
    /* The start checks a fleet member runs here after taking its key unmarked
     * (proxy/control/seqlock.c, proxy/data/admission.c): how many run, and whether one of
     * those since the count was last 0 ended not knowing that nothing an earlier sender left
     * runs there (cut short by a stop, over its time, no pool left to ask through). Control
     * thread. */
    unsigned checks;
    bool check_unknown;
    /* A drain or hold kept a slot here until its time ran out: what it was kept for may still
     * run, so a fleet member lets go of the key unmarked (seqlock.c reads and clears it). */
    atomic_bool unsure;
} px_engine_t;

/* The slots of one engine in one pool (single_sequence pools share theirs). */
typedef struct px_slots_s {
    /* The replica objects sharing them, and the requests (own checks' drains) that outlive
     * every one of those: a replica object made while any holds them shares them. */
    atomic_int refs;
    char *key; /* URL, and pool unless single_sequence (control thread only, as their list) */
    size_t keylen;
    struct px_slots_s *next, *prev;
    /* Requests holding a slot, whichever worker sent them: taken with compare-and-swap so
     * max_inflight_per_replica holds across workers (px_replica_take_slot). */
    atomic_uint inflight;
    /* Operator requests (the admin relay) that waited in vain for a spare slot hold the next
     * one freed here: px_replica_put_slot passes it to them (granted) instead of freeing it, so
     * a busy pool cannot starve them. held + granted = how many wait. */
    atomic_uint held, granted;
    px_engine_t *eng;
    bool one;   /* a single_sequence pool's (eng->ones counts it) */
    bool drain; /* ... whose engine finishes abandoned answers (eng->drains counts it) */
} px_slots_t;

struct px_replica_s {
    atomic_int refs;
    net_mb_node_t free_node; /* the last reference dropped on a worker: freed on control */
    /* Once freed on control, the workers' upstreams of it still go: the memory stays until
     * each worker has dropped its own (a close seen on one meanwhile asks px_replica_try_ref). */
    atomic_uint free_waits;
    px_t *px;
    char *key; /* identity for reload reuse: everything in its definition */
    char *pool_name;
    char *name;
    cfg_url_t url;
    char *server_name;
    cfg_attest_t attest;
    struct sockaddr_storage addr;
    bool resolved;
    net_upstream_t *up;        /* the control thread's (attestation canary); NULL: unreachable */
    net_upstream_t *shadow_up; /* shadow copies use their own connections (lazily created) */
    struct net_tls_ctx_s *tls_ctx; /* https replica or agent: verification, SNI, sessions */
    /* Each worker's keep-alive pool and TLS client context, made by the worker on first use. */
    net_upstream_t **wup;
    struct net_tls_ctx_s **wtls;
    _Atomic px_replica_state_t state; /* written by the control thread only */
    char *reasons[PX_MAX_REASONS];    /* control thread only; workers read `why` */
    size_t nreasons;
    PX_SEQSTR(PX_WHY_BYTES) why; /* the reasons joined with "; " */
    /* Its engine's slots: shared with every other replica object of the same pool and URL
     * alive at once (a reload that changed the definition makes a new one while requests of
     * the old one still run on the engine), so max_inflight_per_replica counts what the
     * engine runs, not what one object sent. */
    px_slots_t *slots;
    /* The attestation evidence in force (attest_outcome_t.evidence of the check that admitted
     * it) and its SHA-256, "" when none: audit lines name it (attestation_sha256) and the
     * audit store keeps its bytes. The control thread sets it, workers copy it: ev_lock. */
    uv_mutex_t ev_lock;
    dp_buf_t evidence;
    char evidence_sha[65];
    atomic_uint_fast64_t requests; /* lifetime requests sent */
    uint64_t aff_id;               /* identity in the affinity order: px_affinity_hash(name) */
    uint64_t last_attested_at;     /* wall ms, 0 = never */
    char fingerprint[20]; /* the accepted identity it was admitted as (manifest "accept"); "" */
    PX_SEQSTR(24) wfingerprint; /* the same, for workers */
    PX_SEQSTR(136) engine_fp;   /* the engine fingerprint it attested ("" none), for workers */
    /* When a client response last carried that fingerprint (dp_now_ns; 0 never): written by
     * workers, read by attestation, which then needs no probe completion of its own. */
    _Atomic uint64_t fp_seen_ns;
    /* What attestation knows that drift verdicts use (control thread only). */
    px_canary_t canary;
    uint64_t identity_changed_ms; /* wall ms its attested identity last changed; 0 never */
    void *attest_state;           /* control/attest.c's per-replica state */
    px_series_t *m_admitted;      /* detproxy_replica_admitted */
    bool discovered;              /* added by DNS discovery */
    /* POST /admin/replicas/NAME/drain: out of rotation (in-flight requests finish), whatever
     * the attestation state, until /enable. Lives on the replica, so it survives reloads that
     * keep the replica's definition. */
    atomic_bool drained;
    /* Set by a worker that saw the replica fail a connection or answer with another engine
     * fingerprint, until the control thread has handled that (a mailbox hop later): no worker
     * picks it meanwhile (core/event.c). */
    atomic_bool suspect;
    /* Set by a thread that saw the replica close a connection (PX_EVENT_PEER_CLOSED): it may be
     * another engine now. It stays
     * serving, but takes no new client requests or copies (they queue, and routing counts it
     * full) until a check begun after that has its verdict (control/attest.c settle). */
    atomic_bool unverified;
    /* New connections: one opened to r (none pooled is free) carries nothing until a check
     * begun after it was established has its verdict (px_event_connection_checked): nothing
     * says the engine that answers a new connection is the one attested. check_begun numbers r's
     * checks as they start and check_settled is the number of the latest one with a verdict (the
     * control thread writes both). */
    atomic_uint_fast64_t check_begun, check_settled;
    /* The hold lifts with the verdict of a check numbered above this (the latest check begun
     * when a thread last held the replica: core/event.c). */
    atomic_uint_fast64_t hold_after;
    /* A check is asked for by a request that needs a new connection (PX_EVENT_NEW_CONNECTION)
     * and has not begun yet: the requests that need one meanwhile share it. */
    atomic_bool conn_wanted;
    px_series_t *m_drained;              /* detproxy_replica_drained */
    px_replica_t *live_prev, *live_next; /* every replica alive */
};

/* What the control plane does when a replica changes or goes; set once at start (members may
 * be NULL). */
typedef struct {
    /* Its state changed (after the change, before the log line). */
    void (*changed)(const px_replica_t *r, px_replica_state_t from);
    /* Its last reference is gone: release what the control plane keeps on it. */
    void (*freed)(px_replica_t *r);
} px_replica_hooks_t;

static inline px_replica_state_t px_replica_state(const px_replica_t *r)
{
    return atomic_load_explicit(&r->state, memory_order_acquire);
}

void px_replica_ref(px_replica_t *r);
/* A reference only if r is not being freed (its last one dropped): for what points at r
 * without one of its own, a worker's upstream of it. */
bool px_replica_try_ref(px_replica_t *r);
/* Any thread; the last reference frees it on the control thread. */
void px_replica_unref(px_replica_t *r);
/* What defines a replica (a reload reuses one whose key is unchanged), and a new one. */
char *px_replica_key(const cfg_pool_t *p, const cfg_replica_t *d);
px_replica_t *px_replica_create(px_t *px, const cfg_t *cfg, const cfg_pool_t *p,
                                const cfg_replica_t *d, char *key);
/* A replica alive with this key (any generation's, or one only in-flight requests still hold:
 * a reload removed it), with a new reference; NULL when none. Reusing it keeps its in-flight
 * count, so max_inflight_per_replica holds across a removal and a re-adding. */
px_replica_t *px_replica_find_live(const char *key);
/* fn(r) for every replica object alive, those a reload replaced but something still holds
 * included (control thread only; fn must not free r). */
void px_replica_each_live(void (*fn)(px_replica_t *r, void *data), void *data);
/* A new replica for pool p's definition, not yet in any pool (DNS discovery); one reference. */
px_replica_t *px_replica_new_detached(px_t *px, px_pool_t *p, const cfg_replica_t *def);
/* A replica carried over by a reload reads its TLS files again. */
void px_replica_reload_tls(px_replica_t *r, const cfg_pool_t *p);
/* Change state with reasons (a NULL-terminated list of strings, copied); logs the transition
 * and updates detproxy_replica_admitted. */
void px_replica_set_state(px_replica_t *r, px_replica_state_t st, const char *const *reasons);
/* Drain (true) or enable (false) a replica; logs "replica_drain" and sets the gauge. */
void px_replica_set_drained(px_replica_t *r, bool drained);
void px_replica_upstream_opts(const cfg_t *cfg, net_upstream_opts_t *o);
/* TLS for an upstream of replica r (its own URL, or its agent's): no-op for http://. */
void px_replica_upstream_tls(px_replica_t *r, net_upstream_t *u, const cfg_url_t *url);
/* Idle keep-alive connections of r on every worker are closed (state change, drain; TLS files
 * rotated: `fresh`, else NULL, is the new trust each worker's TLS context takes first). */
void px_replica_flush_workers(px_replica_t *r, struct net_tls_ctx_s *fresh);
/* Admitted, not drained, not suspect: may get client requests (and takes part in affinity
 * orders). The one eligibility rule: every balance, the affinity order and /readyz use it. */
bool px_replica_serving(const px_replica_t *r);
/* A single_sequence pool whose engine finishes an answer whose connection closed
 * (policy_pool_drains_abandoned) names r's engine now, whichever pool r is of: an exchange with
 * it that nobody will read is drained, not cut, whatever mode it was sent under (a reload may
 * have made the pool so since), for the engine is generating it still and the next request
 * must not start beside it. Any thread. */
bool px_replica_drains_abandoned(const px_replica_t *r);
/* A graceful stop, clients answered: from now on nothing new starts on an engine a
 * single_sequence pool names; what still runs there, summed. Control thread. */
unsigned px_replica_engines_quiesce(void);
/* Has px_replica_engines_quiesce been called (nothing new starts on such an engine)? */
bool px_replica_engines_quiesced(void);
/* From now on every engine is gated (px_engine_t.gated): a fleet takes turns on them. Control
 * thread. */
void px_replica_engines_gate(void);
/* Every engine a single_sequence pool names now, in no order. Control thread. */
void px_replica_engines_each(void (*fn)(px_engine_t *e, void *data), void *data);
/* e is no longer fresh. Control thread. */
void px_replica_engine_seen(px_engine_t *e);
/* r's engine's slot taken for a look before anything starts there: it was fresh, or a fleet
 * member's key on it was only now taken, so nothing can have been let start there yet (a hold
 * of this process's own, counted too, may still run). Control thread. */
void px_replica_take_first_slot(px_replica_t *r);
/* Take a slot on r under pool p's max_inflight_per_replica, atomically across workers: false
 * when r is at its limit. px_router_pick takes the slot of what it returns. */
bool px_replica_take_slot(const px_pool_t *p, px_replica_t *r);
/* The same for detproxy's own requests (copies, the probe, the canary): never while requests of
 * the pool wait in the admission queue, so they never go ahead of a client. */
bool px_replica_take_spare_slot(const px_pool_t *p, px_replica_t *r);
/* Give a slot back (a held one passes to a waiting operator request: px_replica_hold_slot). */
void px_replica_put_slot(px_replica_t *r);
/* A reference to r's engine slots, which outlives r: for a slot that must stay taken after r
 * is freed (an answer of its engine still to come). px_replica_slots_put_unref frees that slot (as
 * px_replica_put_slot) and drops the reference. While it is held, a replica object created for
 * the same engine shares these slots, even after r is gone. Control thread. */
px_slots_t *px_replica_slots_ref(px_replica_t *r);
void px_replica_slots_put_unref(px_slots_t *sl);
/* Control thread: the evidence in force becomes ev (taken, left empty; NULL or empty: none). */
void px_replica_set_evidence(px_replica_t *r, dp_buf_t *ev);
/* Any thread: the SHA-256 of the evidence in force ("" when none) into sha, and when bytes is
 * not NULL a copy of them (appended). */
void px_replica_get_evidence(px_replica_t *r, char sha[65], dp_buf_t *bytes);
/* An operator request that found no spare slot for long enough claims the next slot freed on
 * r: one request ahead of the pool's queue, once. Then poll px_replica_take_held_slot until it
 * says yes, or give up with px_replica_unhold_slot. */
void px_replica_hold_slot(px_replica_t *r);
/* True when the held slot is the caller's now (counted in r->slots->inflight). */
bool px_replica_take_held_slot(const px_pool_t *p, px_replica_t *r);
/* Give up a hold; a slot that was passed on meanwhile is freed. */
void px_replica_unhold_slot(px_replica_t *r);
#endif
