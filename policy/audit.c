/* One audit line per request (docs/policy.md §7): formatting only; the proxy owns the file. */
#include <string.h>

#include "common/jw.h"
#include "common/util.h"
#include "policy/jcs.h"
#include "policy/policy_int.h"

void policy_audit_line(const policy_audit_t *a, dp_buf_t *out)
{
    char ts[32];
    dp_jw_t w;
    dp_iso8601(ts, a->wall_ms);
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "time", ts);
    dp_jw_str(&w, "request_id", a->request_id);
    dp_jw_str(&w, "tenant", a->tenant);
    dp_jw_str(&w, "pool", a->pool);
    dp_jw_str(&w, "replica", a->replica);
    dp_jw_str(&w, "fingerprint", a->fingerprint);
    dp_jw_str(&w, "upstream_fingerprint", a->upstream_fingerprint);
    if (a->fingerprint_mismatch)
        dp_jw_bool(&w, "fingerprint_mismatch", true);
    dp_jw_str(&w, "route", a->route);
    if (a->method)
        dp_jw_str(&w, "method", a->method);
    if (a->route_sha256) {
        dp_jw_uint(&w, "route_bytes", a->route_bytes);
        dp_jw_str(&w, "route_sha256", a->route_sha256);
    }
    if (a->model && a->model_len > POLICY_AUDIT_MODEL_MAX) {
        size_t cut = POLICY_AUDIT_MODEL_MAX;
        while (cut > 0 && ((unsigned char)a->model[cut] & 0xC0) == 0x80)
            cut--; /* not inside a character: the line stays valid UTF-8 */
        char sha[65];
        dp_sha256_hex(a->model, a->model_len, sha);
        dp_jw_strn(&w, "model", a->model, cut);
        dp_jw_uint(&w, "model_bytes", a->model_len);
        dp_jw_str(&w, "model_sha256", sha);
    } else if (a->model) {
        dp_jw_strn(&w, "model", a->model, a->model_len);
    } else {
        dp_jw_null(&w, "model");
    }
    dp_jw_int(&w, "status", a->status);
    const policy_result_t *r = a->result;
    if (r && r->has_seed)
        dp_jw_uint(&w, "seed", r->seed);
    else
        dp_jw_null(&w, "seed");
    dp_jw_bool(&w, "seed_derived", r && r->seed_derived);
    if (r && r->has_temperature) {
        char b[32];
        size_t n = jcs_es_number(r->temperature, b);
        dp_jw_raw(&w, "temperature", b, n);
    } else {
        dp_jw_null(&w, "temperature");
    }
    dp_jw_bool(&w, "stream", r && r->stream);
    dp_jw_arr_begin(&w, "params");
    for (size_t i = 0; r && i < r->nchanges; i++) {
        const policy_change_t *c = &r->changes[i];
        dp_jw_obj_begin(&w, NULL);
        dp_jw_str(&w, "param", c->param);
        dp_jw_str(&w, "action", policy_action_names[c->action]);
        /* before/after are JSON text on one line: numbers and literals policy wrote, or a
         * value of the client's with the whitespace between its tokens taken out. */
        if (c->before[0])
            dp_jw_raw(&w, "before", c->before, strlen(c->before));
        if (c->after[0])
            dp_jw_raw(&w, "after", c->after, strlen(c->after));
        else
            dp_jw_bool(&w, "removed", true);
        dp_jw_obj_end(&w);
    }
    dp_jw_arr_end(&w);
    dp_jw_str(&w, "forwarded_body_sha256", a->forwarded_sha256);
    dp_jw_str(&w, "response_body_sha256", a->response_sha256);
    dp_jw_str(&w, "attestation_sha256", a->attestation_sha256);
    if (a->error_code) {
        dp_jw_obj_begin(&w, "error");
        dp_jw_str(&w, "code", a->error_code);
        dp_jw_str(&w, "param", a->error_param);
        dp_jw_obj_end(&w);
    }
    dp_jw_obj_end(&w);
    dp_buf_appendc(out, '\n');
}
