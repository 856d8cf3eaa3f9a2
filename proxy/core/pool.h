/* A pool: the replicas serving one set of models under one manifest, as one generation
 * (gen.h) built it. Its replica list is fixed once the generation is published; each thread
 * has its own share of the pool (px_pool_slot_t, indexed by slot: see thread.h). */
#ifndef PX_POOL_H
#define PX_POOL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "config/config.h"
#include "proxy/core/affinity.h"
#include "proxy/core/metrics.h"
#include "proxy/core/types.h"

/* One thread's share of a pool: touched by that thread only. */
typedef struct px_pool_slot_s {
    uint32_t rr;
    /* Admission queue (max_inflight_per_replica): FIFO; the worker's one timer watches the
     * heads' deadlines (data/admission.c). */
    px_admission_entry_t *q_head, *q_tail;
    uint32_t qlen;
    /* The head's ticket + 1 (0: empty), read by the other workers: a slot goes to the oldest
     * head across them, so one worker's queue cannot keep it while another's waits. */
    _Atomic uint64_t head_ticket;
    struct px_pool_slot_s *active_next; /* on the worker's list of non-empty queues */
    bool active;
    /* detproxy_requests_total series by (tenant, status, code): looked up once, then a
     * pointer compare per request. Tenant names belong to this generation's config and codes
     * are static strings, so pointers are stable for the pool's whole life. */
    struct {
        const char *tenant;
        const char *code;
        int status;
        px_series_t *s;
    } m_requests[16];
    /* detproxy_tokens_total's two series (prompt, completion) by tenant, the same way. */
    struct {
        const char *tenant;
        px_series_t *prompt, *completion;
    } m_tokens[8];
} px_pool_slot_t;

struct px_pool_s {
    px_gen_t *gen;
    const cfg_pool_t *cfg;
    const char *name;
    char fingerprint[20];
    px_replica_t **replicas; /* fixed once the generation is published */
    size_t nreplicas;
    size_t cap;
    px_pool_slot_t *slots;    /* px->nslots */
    atomic_uint waiting;      /* requests queued on every worker together */
    _Atomic uint64_t tickets; /* queue order across the workers (px_pool_slot_t.head_ticket) */
    px_series_t *m_duration;
    px_series_t *m_affinity[PX_AFF__COUNT]; /* detproxy_affinity_total by result (affinity) */
};

/* Add (taking the caller's reference) / remove (dropping the pool's reference). */
void px_pool_push_replica(px_pool_t *p, px_replica_t *r);
void px_pool_remove_replica(px_pool_t *p, px_replica_t *r);
/* Any replica of the pool that may get requests (px_replica_serving)? */
bool px_pool_has_admitted(const px_pool_t *p);
/* Human-readable reasons why a pool has no admitted replica (for 503 and /readyz). */
void px_pool_why_unavailable(const px_pool_t *p, dp_buf_t *out);
/* No replica serves only because operators drained every admitted one (at least one is). */
bool px_pool_all_drained(const px_pool_t *p);
/* This thread's detproxy_requests_total series (cached; see px_pool_slot_t). p NULL: a
 * request refused before any pool was chosen (label pool="-"). code is static. */
px_series_t *px_pool_requests_series(px_pool_t *p, const char *tenant, int status,
                                     const char *code);
/* detproxy_tokens_total{tenant, pool, kind="prompt"|"completion"} for tenant (the same stable
 * pointer rule), looked up once per worker. */
void px_pool_tokens_series(px_pool_t *p, const char *tenant, px_series_t **prompt,
                           px_series_t **completion);

#endif
