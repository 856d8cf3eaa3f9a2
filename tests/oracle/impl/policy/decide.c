/* The whole policy decision for one inference body, as the proxy makes it and `detproxy policy
 * test` shows it: parse, choose the pool, apply the tenant's rules for that pool's framework. */
#include <stdio.h>
#include <string.h>

#include "common/jw.h"
#include "policy/jdoc.h"
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

/* body with its top-level `key` given the raw JSON `value`, every other byte kept; when body
 * has no such key, inserted first if `insert`, else -1 (out untouched). */
static int set_member(const char *body, size_t len, const char *key, const char *value, size_t vlen,
                      bool insert, dp_buf_t *out)
{
    jdoc_t d;
    jdoc_init(&d);
    int rc = -1;
    if (jdoc_parse(&d, body, len, JDOC_OBJECT_ONLY | JDOC_ALLOW_DUPS) == 0) {
        uint32_t tok = jdoc_get(&d, 0, key);
        if (tok != JDOC_NONE) {
            const jtok_t *t = &d.toks[tok];
            dp_buf_append(out, body, t->start);
            dp_buf_append(out, value, vlen);
            dp_buf_append(out, body + t->start + t->len, len - t->start - t->len);
            rc = 0;
        } else if (insert) {
            const jtok_t *o = &d.toks[0];
            dp_buf_append(out, body, o->start + 1);
            dp_buf_appendc(out, '"');
            dp_json_escape(out, key, strlen(key));
            dp_buf_append(out, "\":", 2);
            dp_buf_append(out, value, vlen);
            if (o->aux > 0)
                dp_buf_appendc(out, ',');
            dp_buf_append(out, body + o->start + 1, len - o->start - 1);
            rc = 0;
        }
    }
    jdoc_free(&d);
    return rc;
}

int policy_replace_model(const char *body, size_t len, const char *model, dp_buf_t *out)
{
    dp_buf_t v = {0};
    dp_buf_appendc(&v, '"');
    dp_json_escape(&v, model, strlen(model));
    dp_buf_appendc(&v, '"');
    int rc = set_member(body, len, "model", v.base, v.len, false, out);
    dp_buf_free(&v);
    return rc;
}

int policy_force_cache_prompt_off(const char *body, size_t len, dp_buf_t *out)
{
    return set_member(body, len, "cache_prompt", "false", 5, true, out);
}
