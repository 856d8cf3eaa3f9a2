/* One attestation check's requests (see probe.h). */
#include "probe/probe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>

#include "attest/adapters.h"
#include "common/util.h"
#include "net/fetch.h"

struct probe_s {
    probe_cb cb;
    void *data;
    net_upstream_t *up;
    attest_check_t plan;
    char *hostport, *base, *bearer, *via, *extra, *model;
    const attest_keyset_t *keys;
    bool require_signature;
    net_fetch_t *fetch[ATTEST_CHECK_MAX_REQUESTS];
    size_t pending;
    /* The answers, kept until all are in (their bodies copied: net_fetch's are the call's). */
    attest_answer_t ans[ATTEST_CHECK_MAX_REQUESTS];
    dp_buf_t body[ATTEST_CHECK_MAX_REQUESTS];
    char *error[ATTEST_CHECK_MAX_REQUESTS], *detail[ATTEST_CHECK_MAX_REQUESTS];
    net_fetch_t *completion; /* the engine-fingerprint probe */
    bool completion_may_run; /* probe_completion_may_run */
    char *known_fp;          /* probe_opts_t.known_fingerprint */
    bool metadata_fp;        /* probe_opts_t.metadata_fingerprint */
    bool length_required;    /* probe_opts_t.length_required */
    uint32_t deadline_ms;    /* probe_opts_t.deadline_ms */
    attest_outcome_t out;
};

static char *dup_or_null(const char *s)
{
    return s ? dp_xstrdup(s) : NULL;
}

static void probe_free(probe_t *p)
{
    for (size_t i = 0; i < ATTEST_CHECK_MAX_REQUESTS; i++) {
        dp_buf_free(&p->body[i]);
        free(p->error[i]);
        free(p->detail[i]);
    }
    if (p->bearer) {
        OPENSSL_cleanse(p->bearer, strlen(p->bearer));
        free(p->bearer);
    }
    free(p->hostport);
    free(p->base);
    free(p->via);
    free(p->extra);
    free(p->model);
    free(p->known_fp);
    attest_outcome_clear(&p->out);
    free(p);
}

static void finish(probe_t *p)
{
    p->cb(&p->out, p->data);
    probe_free(p);
}

static void completion_done(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                            const char *detail, void *data)
{
    probe_t *p = data;
    /* A completion that failed with its exchange open (a timeout, an answer over the size cap)
     * stays takeable during the callback (probe_take_completion),
     * and one that failed once the engine had it says so (probe_completion_may_run): its engine
     * may still be generating it. */
    p->completion = net_fetch_open(f) ? f : NULL;
    p->completion_may_run = net_fetch_failed_running(f, status, err);
    attest_answer_t a = {.status = status,
                         .body = body->base,
                         .len = body->len,
                         .error = net_up_err_name(err),
                         .detail = detail};
    attest_check_probe_read(&p->out, &a);
    finish(p);
}

/* POST <base>/v1/completions, 1 token at temperature 0, to the replica itself. */
static void completion_start(probe_t *p)
{
    dp_buf_t body = {0};
    attest_check_completion_body(attest_check_probe_model(&p->out, p->model), ATTEST_PROBE_PROMPT,
                                 1, false, false, &body);
    char target[600];
    snprintf(target, sizeof(target), "%s/v1/completions", p->base);
    net_fetch_opts_t o = {.via = p->via,
                          .method = "POST",
                          .hostport = p->hostport,
                          .target = target,
                          .bearer = p->bearer,
                          .body = body.base,
                          .body_len = body.len,
                          .max_bytes = ATTEST_PROBE_MAX_BYTES,
                          .extra_headers = p->extra,
                          .length_required = p->length_required,
                          .deadline_ms = p->deadline_ms};
    p->completion = net_fetch(p->up, &o, completion_done, p);
    dp_buf_free(&body);
}

static void fetched(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                    const char *detail, void *data)
{
    probe_t *p = data;
    size_t i = 0;
    while (i < p->plan.nrequests && p->fetch[i] != f)
        i++;
    p->fetch[i] = NULL;
    dp_buf_append(&p->body[i], body->base ? body->base : "", body->len);
    p->error[i] = status ? NULL : dp_xstrdup(net_up_err_name(err));
    p->detail[i] = status ? NULL : dup_or_null(detail);
    p->ans[i] = (attest_answer_t){.status = status,
                                  .body = p->body[i].base,
                                  .len = p->body[i].len,
                                  .error = p->error[i],
                                  .detail = p->detail[i]};
    if (--p->pending > 0)
        return;
    attest_check_read(&p->plan, p->ans, p->keys, p->require_signature, &p->out);
    const char *named =
        p->metadata_fp ? attest_check_metadata_fingerprint(&p->plan, &p->out) : NULL;
    if (named && attest_check_wants_probe(&p->plan, &p->out)) {
        char *fp = dp_xstrdup(named);
        attest_engine_fingerprint_set(&p->out.report, fp);
        free(fp);
        finish(p);
        return;
    }
    if (attest_check_wants_probe(&p->plan, &p->out) && p->known_fp == NULL) {
        completion_start(p);
        return;
    }
    if (attest_check_wants_probe(&p->plan, &p->out) && p->known_fp[0])
        attest_engine_fingerprint_set(&p->out.report, p->known_fp);
    else if (attest_check_wants_probe(&p->plan, &p->out))
        attest_report_set_unattested(&p->out.report, ATTEST_F_ENGINE_FINGERPRINT,
                                     "no free slot on the replica for the 1-token probe");
    finish(p);
}

probe_t *probe_start(const probe_opts_t *o, probe_cb cb, void *data)
{
    probe_t *p = dp_xcalloc(1, sizeof(*p));
    p->cb = cb;
    p->data = data;
    p->up = o->up;
    p->hostport = dp_xstrdup(o->hostport ? o->hostport : "");
    p->base = dp_xstrdup(o->base ? o->base : "");
    p->bearer = dup_or_null(o->bearer);
    p->via = dup_or_null(o->via);
    p->extra = dup_or_null(o->extra_headers);
    p->model = dup_or_null(o->model);
    p->known_fp = dup_or_null(o->known_fingerprint);
    p->metadata_fp = o->metadata_fingerprint;
    p->length_required = o->length_required;
    p->deadline_ms = o->deadline_ms;
    p->keys = o->keys;
    p->require_signature = o->require_signature;
    attest_check_plan(&p->plan, o->source, p->base, o->agent_path);
    p->pending = p->plan.nrequests;
    /* All at once; every one calls back later (net_fetch never calls back from here). */
    for (size_t i = 0; i < p->plan.nrequests; i++) {
        net_fetch_opts_t fo = {.via = p->via,
                               .method = "GET",
                               .hostport = p->hostport,
                               .target = p->plan.requests[i].target,
                               .bearer = p->bearer,
                               .max_bytes = p->plan.requests[i].max_bytes,
                               .extra_headers = p->extra,
                               .deadline_ms = p->deadline_ms};
        p->fetch[i] = net_fetch(p->up, &fo, fetched, p);
    }
    return p;
}

net_fetch_t *probe_take_completion(probe_t *p)
{
    if (p == NULL)
        return NULL;
    net_fetch_t *f = p->completion;
    p->completion = NULL;
    return f;
}

bool probe_completion_may_run(const probe_t *p)
{
    return p && p->completion_may_run;
}

void probe_cancel(probe_t *p)
{
    if (p == NULL)
        return;
    for (size_t i = 0; i < ATTEST_CHECK_MAX_REQUESTS; i++)
        if (p->fetch[i])
            net_fetch_cancel(p->fetch[i]);
    if (p->completion)
        net_fetch_cancel(p->completion);
    probe_free(p);
}

void probe_replica_upstream_opts(const cfg_t *cfg, net_upstream_opts_t *o)
{
    const cfg_limits_t *l = &cfg->limits;
    memset(o, 0, sizeof(*o));
    o->connect_timeout_ms = l->upstream_connect_timeout_ms;
    o->first_byte_timeout_ms = l->upstream_first_byte_timeout_ms;
    o->idle_timeout_ms = l->upstream_idle_timeout_ms;
    o->keepalive_ms = l->upstream_keepalive_timeout_ms;
}

uint32_t probe_answer_deadline_ms(const cfg_t *cfg)
{
    uint64_t ms =
        (uint64_t)cfg->limits.upstream_first_byte_timeout_ms + cfg->limits.upstream_idle_timeout_ms;
    return ms > UINT32_MAX ? UINT32_MAX : (uint32_t)ms;
}

void probe_attest_upstream_opts(const cfg_t *cfg, net_upstream_opts_t *o)
{
    /* Short timeouts: an attestation that takes longer than timeout_ms has failed. */
    memset(o, 0, sizeof(*o));
    o->connect_timeout_ms = o->first_byte_timeout_ms = o->idle_timeout_ms =
        cfg->attestation.timeout_ms;
    o->max_idle = 2;
}
