/* Shadow sampling. */
#include "proxy/px_shadow.h"

void *px_shadow_maybe(px_t *px, px_pool_t *pool, px_replica_t *primary, const cfg_tenant_t *t,
                      const policy_result_t *res, const px_req_t *req, const char *body,
                      size_t len)
{
    (void)px;
    (void)pool;
    (void)primary;
    (void)t;
    (void)res;
    (void)req;
    (void)body;
    (void)len;
    return NULL;
}

void px_shadow_primary_bytes(void *s, const char *p, size_t n)
{
    (void)s;
    (void)p;
    (void)n;
}

void px_shadow_primary_done(void *s, int status)
{
    (void)s;
    (void)status;
}

void px_shadow_drift_json(px_t *px, dp_buf_t *out)
{
    (void)px;
    dp_buf_appends(out, "{\"pools\":[]}");
}
