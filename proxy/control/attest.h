/* Replica admission: drives each replica's state from attestation against the pool's manifest
 * (docs/attestation.md §2-§6, docs/configuration.md "Manifest"). */
#ifndef PX_ATTEST_H
#define PX_ATTEST_H

#include "attest/report.h"
#include "common/jw.h"
#include "proxy/core/px.h"

/* Start checking every replica of the current generation (and new ones as they appear). */
void px_attest_start(px_t *px);
/* Stop all timers and in-flight checks (shutdown). */
void px_attest_stop(px_t *px);
/* A generation became current: adopt its replicas (reload, discovery). */
void px_attest_sync(px_t *px);
/* What the data plane saw about a replica (core/event.h): a failed connect takes it out of
 * service until re-attested, a lost connection brings its next check forward, a response with
 * another engine fingerprint takes it out of service and re-attests it at once. */
void px_attest_on_event(px_t *px, const px_event_t *ev);
/* Stop attesting r (it left the pool, kept aside by discovery); px_attest_sync starts again. */
void px_attest_replica_free(px_replica_t *r);
/* r's last attestation report, or NULL before the first one (the status page). */
const attest_report_t *px_attest_report(const px_replica_t *r);
/* r's "attestation" object for /admin/replicas. */
void px_attest_replica_json(dp_jw_t *w, const px_replica_t *r);

#endif
