/* The whole policy decision for one inference body, as the proxy makes it and `detproxy policy
 * test` shows it: parse, choose the pool, apply the tenant's rules for that pool's framework. */
#include <stdio.h>
#include <string.h>

#include "policy/policy.h"

int policy_decide(const cfg_t *cfg, const cfg_tenant_t *t, policy_req_t *r, policy_route_t route,
                  const char *body, size_t len, const cfg_pool_t **pool, policy_result_t *out,
                  policy_error_t *err)
{
    *pool = NULL;
    if (policy_parse(r, route, body ? body : "", len, err) != 0)
        return -1;
    const cfg_pool_t *p;
    cfg_determinism_t need = t ? t->require_determinism : CFG_DETERMINISM_NONE;
    dp_iovec_t m = policy_model(r);
    if (t && t->pool)
        p = cfg_pool_by_name(cfg, t->pool); /* `check` holds it to the tenant's mode */
    else
        p = cfg_pool_for_model_mode(cfg, m.base, m.len, need);
    if (p == NULL) {
        bool served = need != CFG_DETERMINISM_NONE && cfg_pool_for_model(cfg, m.base, m.len);
        *err = (policy_error_t){.status = 404,
                                .type = "invalid_request_error",
                                .code = served ? "determinism_unavailable" : "model_not_found"};
        snprintf(err->param, sizeof(err->param), "model");
        if (served)
            snprintf(err->message, sizeof(err->message),
                     "this tenant requires determinism %s and no pool with that "
                     "determinism.mode serves this model",
                     cfg_determinism_names[need]);
        else
            snprintf(err->message, sizeof(err->message), "no pool serves this model");
        return -1;
    }
    if (policy_apply_pool(r, t, p, out, err) != 0)
        return -1;
    *pool = p;
    return 0;
}
