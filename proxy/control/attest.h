/* Replica admission: drives each replica's state from attestation (SPEC §4-§6). */
#ifndef PX_ATTEST_H
#define PX_ATTEST_H

#include "drift/drift.h"
#include "attest/report.h"
#include "proxy/core/px.h"

/* Start checking every replica of the current generation (and new ones as they appear). */
void px_attest_start(px_t *px);
/* Stop all timers and in-flight checks (shutdown). */
void px_attest_stop(px_t *px);
/* A generation became current: adopt its replicas (reload, discovery). */
void px_attest_sync(px_t *px);
/* A connection to r failed: re-attest now (a restarted replica may be something else). With
 * deadmit (the connect itself failed) r also gets no new requests until re-admitted; a
 * keep-alive race or an early close only brings the check forward. */
void px_attest_connection_failed(px_t *px, px_replica_t *r, bool deadmit);
/* A response from r carried system_fingerprint `seen`: when r attested another engine
 * fingerprint, count detproxy_fingerprint_mismatch_total, take r out of service and re-attest
 * it at once (SPEC §5). Returns true on a mismatch (the caller flags its audit line). A response
 * without a fingerprint is not checked. */
bool px_attest_response_fingerprint(px_t *px, px_replica_t *r, const char *seen);
/* Stop attesting r (it left the pool, kept aside by discovery); px_attest_sync starts again. */
void px_attest_replica_free(px_replica_t *r);
/* What attestation knows about r that shadow samples cannot tell (for naming a suspect among
 * two replicas): its last canary result, the identity it was admitted as, when that changed. */
void px_attest_drift_hint(const px_replica_t *r, drift_hint_t *h);
/* r's last attestation report, or NULL before the first one (the status page). */
const attest_report_t *px_attest_report(const px_replica_t *r);
/* (Re)load the client listener's certificate from the current config (start, SIGHUP): new
 * connections use the new one, open ones keep theirs. 0, or -1 (logged; the old one stays). */
int px_tls_reload(px_t *px);
/* Reload the configuration (SIGHUP, POST /admin/reload). 0 on success. */
int px_reload(px_t *px, const char *why);

#endif
