/* The canary request and the text it hashes (see probe.h). */
#include "probe/probe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "attest/check.h"
#include "attest/match.h"
#include "common/util.h"
#include "net/fetch.h"

struct probe_canary_s {
    net_fetch_t *f;
    probe_canary_cb cb;
    void *data;
    char expected[65];
};

const char *probe_canary_model(const cfg_pool_t *pc, const cfg_manifest_t *id)
{
    const cfg_manifest_t *m = id ? id : pc->manifest;
    return m && m->model ? m->model : pc->nmodels ? pc->models[0] : "";
}

void probe_canary_body(const cfg_pool_t *pc, const cfg_manifest_t *id, dp_buf_t *out)
{
    const cfg_manifest_t *m = id ? id : pc->manifest;
    /* llama-server's prompt cache evaluates a cached prefix in other batches than a fresh one,
     * which can change temperature-0 output: the same canary must not answer differently
     * because it ran before. */
    bool llamacpp = m->framework_name && strcmp(m->framework_name, "llamacpp") == 0;
    attest_check_completion_body(probe_canary_model(pc, id), m->canary->prompt,
                                 m->canary->max_tokens, true, llamacpp, out);
}

static void fetched(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                    const char *detail, void *data)
{
    probe_canary_t *c = data;
    probe_canary_result_t res = {.status = status};
    res.open = net_fetch_open(f) ? f : NULL;
    res.may_run = net_fetch_failed_running(f, status, err);
    memcpy(res.expected, c->expected, sizeof(res.expected));
    char why[300];
    cJSON *doc = NULL;
    if (status == 200) {
        doc = cJSON_ParseWithLength(body->base ? body->base : "", body->len);
        const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(doc, "choices"), 0);
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(ch, "text");
        if (cJSON_IsString(t)) {
            res.answered = true;
            res.text = t->valuestring;
            res.len = strlen(t->valuestring);
            attest_canary_sha256(res.text, res.len, res.sha256);
            res.matched = res.expected[0] && strcmp(res.sha256, res.expected) == 0;
        } else {
            res.error = "HTTP 200 without choices[0].text in the response";
        }
    } else if (status != 0) {
        /* Say what the replica said: a 404 for an unknown model reads differently from a 500. */
        int n = body->len > 200 ? 200 : (int)body->len;
        snprintf(why, sizeof(why), "HTTP %d: %.*s", status, n ? n : 12,
                 n ? body->base : "(empty body)");
        res.error = why;
    } else {
        snprintf(why, sizeof(why), "%s%s%s", net_up_err_name(err), detail ? ": " : "",
                 detail ? detail : "");
        res.error = why;
    }
    c->cb(&res, c->data);
    cJSON_Delete(doc);
    free(c);
}

probe_canary_t *probe_canary_start(net_upstream_t *u, const cfg_pool_t *pc,
                                   const cfg_manifest_t *id, const probe_route_t *to,
                                   probe_canary_cb cb, void *data)
{
    if (id == NULL)
        id = pc->manifest;
    const cfg_canary_t *can = id->canary;
    probe_canary_t *c = dp_xcalloc(1, sizeof(*c));
    c->cb = cb;
    c->data = data;
    snprintf(c->expected, sizeof(c->expected), "%s",
             can->expected_sha256 ? can->expected_sha256 : ""); /* "": not recorded yet */
    dp_buf_t body = {0};
    probe_canary_body(pc, id, &body);
    char target[512];
    snprintf(target, sizeof(target), "%s/v1/completions", to->base ? to->base : "");
    net_fetch_opts_t o = {.via = to->via,
                          .method = "POST",
                          .hostport = to->hostport,
                          .target = target,
                          .bearer = to->bearer,
                          .extra_headers = to->extra_headers,
                          .body = body.base,
                          .body_len = body.len,
                          .max_bytes = PROBE_CANARY_MAX_BYTES,
                          .length_required = to->length_required,
                          .deadline_ms = to->deadline_ms};
    c->f = net_fetch(u, &o, fetched, c);
    dp_buf_free(&body);
    return c;
}

net_fetch_t *probe_canary_detach(probe_canary_t *c)
{
    net_fetch_t *f = c->f;
    free(c);
    return f;
}

void probe_canary_cancel(probe_canary_t *c)
{
    if (c == NULL)
        return;
    net_fetch_cancel(c->f);
    free(c);
}
