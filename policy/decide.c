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
    if (t && t->pool) {
        p = cfg_pool_by_name(cfg, t->pool);
    } else {
        dp_iovec_t m = policy_model(r);
        p = cfg_pool_for_model(cfg, m.base, m.len);
    }
    if (p == NULL) {
        *err = (policy_error_t){
            .status = 404, .type = "invalid_request_error", .code = "model_not_found"};
        snprintf(err->param, sizeof(err->param), "model");
        snprintf(err->message, sizeof(err->message), "no pool serves this model");
        return -1;
    }
    const char *fw = p->manifest ? p->manifest->framework_name : NULL;
    if (policy_apply(r, t, fw, out, err) != 0)
        return -1;
    *pool = p;
    return 0;
}
