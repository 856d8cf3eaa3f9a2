/* The fleet (docs/fleet.md): many instances, one set of verdicts, shared through etcd.
 *
 * Each instance holds a member key on a lease (its version, config fingerprint, listeners,
 * start time), watches the fleet's prefix, and applies what the others publish to its own
 * replicas at once (replica state is what every worker's next pick reads): operator drains and
 * enables, quarantines (with the reason and who found it). A member whose config fingerprint
 * differs from the fleet's is named config_skew and its verdicts are not applied. Without etcd
 * the instance keeps the last state it had and its own decisions, says so (/admin/fleet,
 * detproxy_fleet_connected, a log line per change), and reconciles when etcd is back.
 * Control thread only. */
#ifndef PX_FLEET_H
#define PX_FLEET_H

#include <stdbool.h>

#include "common/buf.h"
#include "attest/report.h"
#include "common/jw.h"
#include "proxy/core/px.h"
#include "proxy/core/replica.h"

/* Start when the config has a fleet section (no-op otherwise); stop at shutdown. leave: the
 * stop is clean (nothing of this instance runs on a single_sequence engine), so the lease is
 * revoked and its keys go now; else they go when it expires. */
void px_fleet_start(px_t *px);
void px_fleet_stop(px_t *px, bool leave);
/* A reload's configuration cfg, before its generation is made from it (old: the running
 * one): a fleet section that differs takes a restart (logged), and cfg is given the running
 * one, so /admin/config and the config fingerprint say what runs. */
void px_fleet_keep(px_t *px, cfg_t *old, cfg_t *cfg);
/* After a reload (px->gen the new generation): the member key says its config fingerprint. */
void px_fleet_reloaded(px_t *px);

/* An operator drained or enabled r here (POST /admin/replicas/NAME/drain|enable): the fleet
 * applies it too. */
void px_fleet_drained(px_t *px, const px_replica_t *r, bool drained, const char *reason);
/* px->replica_hooks.changed: a quarantine decided here (or its end) goes to the fleet. */
void px_fleet_replica_changed(const px_replica_t *r, px_replica_state_t from);

/* Attestation duty: whether this instance checks r now. True without a fleet, while etcd is
 * unreachable or this instance is config_skew (everything is attested here then), when this
 * instance holds r's duty (rendezvous hash of r over the live members without config_skew),
 * or when r's published verdict is overdue. Otherwise the attester's published verdict is
 * applied here (px_attest_apply_verdict). */
bool px_fleet_should_attest(px_t *px, const px_replica_t *r);
/* A verdict another member published for a replica (docs/fleet.md "Attestation duty"). */
typedef struct {
    const char *origin;
    px_replica_state_t state;
    const char *const *reasons; /* NULL-terminated, or NULL */
    const char *fingerprint;    /* the accepted identity ("accept") it was admitted as */
    const attest_report_t *report;
    dp_buf_t *evidence; /* the sink may take it */
    px_canary_t canary;
    uint64_t at_ms;
} px_fleet_verdict_t;
/* Where published verdicts go: attestation applies one to r as if checked here, or says false
 * (a check of its own is in flight or due). Set once by attestation at start. */
typedef bool (*px_fleet_verdict_sink_t)(px_replica_t *r, const px_fleet_verdict_t *v);
void px_fleet_set_verdict_sink(px_t *px, px_fleet_verdict_sink_t sink);
/* A check of r done here: published as its verdict (state, reasons, report, evidence, time). */
void px_fleet_attested(px_t *px, px_replica_t *r, const attest_report_t *rep);

/* The etcd key this instance's latest audit checkpoint is written to (appended to key), and
 * the checkpoint written last (0: none yet); false without a fleet. */
bool px_fleet_anchor(px_t *px, dp_buf_t *key, uint64_t *seq);

/* With a fleet, /admin/drift's body (a JSON object in out) gains a "fleet" member beside
 * "pools": each pool's windows summed over every member without config_skew (their published
 * aggregates and this instance's own), rendered with their verdict like a local pool. */
void px_fleet_drift_json(px_t *px, dp_buf_t *out);

/* With a fleet, /admin/rollouts' body (a JSON object in out) gains a "fleet" member beside
 * "rollouts": each candidate's samples and copy counts summed over every member without
 * config_skew, judged against the fleet's pooled baseline windows (px_fleet_drift_json's) and
 * rendered like a local candidate. Only the pool only[0..only_len) when only is not NULL. */
void px_fleet_rollouts_json(px_t *px, const char *only, size_t only_len, dp_buf_t *out);

/* GET /admin/fleet. */
void px_fleet_json(px_t *px, dp_buf_t *out);
/* One line for the status page: mode, endpoint or error, members (config_skew named), drains
 * and quarantines held. Plain text (the caller escapes it). */
void px_fleet_summary(px_t *px, dp_buf_t *out);
/* The status page's and /metrics' view: connected, live members. */
bool px_fleet_enabled(const px_t *px);
bool px_fleet_connected(const px_t *px);
size_t px_fleet_members(const px_t *px);

#endif
