/* Replica admission. Until attestation is wired in, every replica whose address resolves is
 * admitted at start. */
#include "proxy/px_attest.h"

#include "common/log.h"
#include "proxy/px_admin.h"

void px_attest_start(px_t *px)
{
    px_attest_sync(px);
}

void px_attest_sync(px_t *px)
{
    for (size_t i = 0; i < px->gen->npools; i++) {
        px_pool_t *p = &px->gen->pools[i];
        for (size_t k = 0; k < p->nreplicas; k++) {
            px_replica_t *r = p->replicas[k];
            if (r->state == PX_REPLICA_PENDING && r->up)
                px_replica_set_state(r, PX_REPLICA_ADMITTED, NULL);
        }
    }
}

void px_attest_stop(px_t *px)
{
    (void)px;
}

void px_attest_connection_failed(px_t *px, px_replica_t *r)
{
    (void)px;
    (void)r;
}

void px_attest_replica_free(px_replica_t *r)
{
    (void)r;
}

void px_attest_replica_json(dp_jw_t *w, const px_replica_t *r)
{
    (void)r;
    dp_jw_null(w, "attestation");
}

int px_reload(px_t *px, const char *why)
{
    (void)px;
    dp_log_msg(DP_LOG_WARN, "reload_unsupported", why);
    return -1;
}

int px_admin_authorize(px_t *px, px_req_t *req)
{
    (void)px;
    (void)req;
    return 0;
}

int px_admin_extra_route(px_t *px, px_req_t *req)
{
    (void)px;
    (void)req;
    return -1;
}
