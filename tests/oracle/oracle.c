/* The facade of the oracle library (oracle.h), compiled against the oracle's own policy.h. */
#include "policy/policy.h"

#include <stdio.h>
#include <string.h>

#include "oracle.h"

void oracle_police(int route, const char *body, size_t len, const cfg_tenant_t *t,
                   const cfg_pool_t *pool, oracle_result_t *out)
{
    static _Thread_local policy_req_t *req;
    if (req == NULL)
        req = policy_req_new();
    policy_result_t res;
    policy_error_t err;
    memset(&err, 0, sizeof(err));
    dp_buf_reset(&out->body);
    out->rc = policy_parse(req, (policy_route_t)route, body, len, &err);
    if (out->rc == 0)
        out->rc = policy_apply_pool(req, t, pool, &res, &err);
    if (out->rc != 0) {
        out->status = err.status;
        snprintf(out->code, sizeof(out->code), "%s", err.code ? err.code : "");
        snprintf(out->param, sizeof(out->param), "%s", err.param);
        return;
    }
    out->status = 200;
    out->code[0] = out->param[0] = '\0';
    out->rewritten = res.rewritten;
    out->has_seed = res.has_seed;
    out->seed_derived = res.seed_derived;
    out->seed = res.seed;
    out->nchanges = res.nchanges;
    dp_buf_append(&out->body, res.body.base, res.body.len);
}

void oracle_result_free(oracle_result_t *r)
{
    dp_buf_free(&r->body);
}

int oracle_jcs(const char *json, size_t len, dp_buf_t *out)
{
    policy_error_t err;
    return policy_jcs(json, len, out, &err);
}

int oracle_fp_rewrite_json(const char *body, size_t len, const char *fp, dp_buf_t *out,
                           char prev[128])
{
    return policy_fp_rewrite_json(body, len, fp, out, prev);
}

bool oracle_usage(const char *body, size_t len, int64_t *prompt, int64_t *completion)
{
    policy_usage_t u;
    memset(&u, 0, sizeof(u));
    policy_usage_feed(&u, body, len);
    *prompt = u.prompt_tokens;
    *completion = u.completion_tokens;
    return u.found;
}
