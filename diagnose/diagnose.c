/* `detproxy diagnose -c CONFIG [--pool P] [--prompt TEXT] [--repeat N] [--concurrency C]
 * [--json]` (docs/diagnose.md): the isolation steps for "same prompt, different outputs", run
 * against one pool's replicas directly (no balancing, no policy rewrite), then a verdict.
 *
 * This file does the I/O: flags, config, a private uv loop, and every request, through the same
 * client code the proxy uses (net_fetch over net_upstream), so timeouts and framing checks are the
 * proxy's. Steps run one after another; within a step, replicas run in parallel:
 *   1  the proxy's attestation check (probe/probe.h), every replica at once, then the canary;
 *   2  per replica, 4 completions one at a time (unseeded x2, seeded x2);
 *   3a per replica, --repeat completions at temperature 0, one at a time;
 *   3b per replica, --repeat completions at temperature 0, --concurrency in flight.
 * "One at a time" is per serving endpoint: two replicas configured with the same host:port share
 * one lane, so a sequential phase never puts two requests on one server. A replica whose last two
 * requests failed below HTTP (refused, timed out) is given up: its remaining requests are
 * skipped, not each waited out.
 * report.c judges the collected results and prints them. */
#include "diagnose/diagnose.h"

#include <netdb.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <uv.h>

#include "attest/check.h"
#include "attest/dsse.h"
#include "attest/match.h"
#include "common/args.h"
#include "common/util.h"
#include "net/fetch.h"
#include "net/resolve.h"
#include "net/tls.h"
#include "probe/probe.h"
#include "probe/relay.h"
#include "drift/drift.h"

#define OUTPUT_MAX_BYTES ((size_t)4 << 20) /* a 32-token completion is a few hundred bytes */
#define GIVE_UP_FAILURES 2
#define DISCOVERY_MAX 256 /* addresses taken from one discovery name */

typedef struct dg_s dg_t;

/* Per-replica I/O state. */
typedef struct {
    dg_t *d;
    size_t idx;
    char *hostport, *path;  /* Host and path prefix of its requests (the relay's, when relayed) */
    char *endpoint, *rpath; /* the replica URL's own host:port and path prefix */
    const char *bearer;     /* Authorization of its requests: the pool's key, or the admin token */
    char *extra;            /* extra header lines (the relay's replica names), or NULL */
    bool relayed;           /* through the running proxy, which serves this replica */
    char *agent_hostport, *agent_path;
    net_upstream_t *up;     /* completions */
    net_upstream_t *att_up; /* attestation: the agent, or the replica itself (short timeouts) */
    size_t lane;            /* replicas with the same hostport share a lane */
    /* steps 2 and 3: the current phase's jobs */
    dg_out_t **outs;
    const dp_buf_t **bodies;
    size_t njobs, next, inflight, pdone;
    unsigned transport_failures;
} rio_t;

typedef struct {
    rio_t *io;
    dg_out_t *out;
} job_t;

struct dg_s {
    uv_loop_t loop;
    const cfg_t *cfg;
    const cfg_pool_t *pool;
    attest_keyset_t keys;
    dg_run_t run;
    rio_t *io;
    /* Through the running proxy's admin relay (probe/relay.h), for each replica it serves:
     * every request to it then takes the pool's admission slots. */
    probe_relay_t relay;
    bool relayed;
    net_tls_ctx_t *tls; /* the pool's upstream_tls, made on first https URL; NULL otherwise */
    char *tls_err;      /* why it could not be made */
    size_t *lane_busy;  /* in-flight requests per lane */
    /* the current phase */
    const char *phase;
    bool sequential;
    unsigned limit;
    size_t total, done;
    dp_buf_t body_t0, body_unseeded, body_seeded;
};

/* ---- progress (stderr) ----------------------------------------------------------------------- */

static void progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void progress(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("diagnose: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* ---- step 1: attestation --------------------------------------------------------------------- */

/* The proxy's check (probe/probe.h), judged as the proxy judges it: the same answers give the
 * same verdict and the same reasons here as in /admin/replicas. */
static void att_done(attest_outcome_t *out, void *data)
{
    rio_t *io = data;
    dg_t *d = io->d;
    dg_replica_t *r = &d->run.r[io->idx];
    attest_check_judge(out, d->pool->manifest, cfg_pool_require_signature(d->cfg, d->pool));
    r->verdict = out->verdict;
    r->admit_reasons = out->reasons;
    memset(&out->reasons, 0, sizeof(out->reasons)); /* moved */
    r->att_ok = out->verdict == ATTEST_V_ADMITTED || out->verdict == ATTEST_V_MISMATCH;
    r->admitted = out->verdict == ATTEST_V_ADMITTED;
    if (r->att_ok) {
        const attest_report_t *rep = &out->report;
        attest_report_copy(&r->report, rep);
        dp_buf_t line = {0};
        dp_buf_printf(&line, "[1/4] %s: %s", r->name,
                      r->source == CFG_ATTEST_NONE ? "reachable (no attestation source)"
                      : rep->is_signed             ? "attested, signed"
                                                   : "attested, unsigned");
        for (size_t f = ATTEST_F_CHECKPOINT; f < ATTEST_F__COUNT; f++) {
            const char *v = attest_report_get(rep, (attest_field_t)f);
            if (v) {
                dp_buf_appendc(&line, ' ');
                attest_abbrev(v, &line);
            }
        }
        progress("%s", line.base);
        dp_buf_free(&line);
    } else {
        r->att_err =
            dp_xstrdup(r->admit_reasons.count ? r->admit_reasons.items[0] : "attestation failed");
        progress("[1/4] %s: not attested: %s", r->name, r->att_err);
    }
    if (++d->done == d->total)
        uv_stop(&d->loop);
}

/* Start one replica's attestation; returns false when nothing was started (already judged). */
static bool att_start(rio_t *io)
{
    dg_t *d = io->d;
    dg_replica_t *r = &d->run.r[io->idx];
    if (io->att_up == NULL) {
        if (r->att_err == NULL)
            r->att_err = dp_xstrdup(r->skip_reason ? r->skip_reason : "not reachable");
        r->verdict = ATTEST_V_UNREACHABLE;
        attest_reasons_add(&r->admit_reasons, "%s", r->att_err);
        progress("[1/4] %s: not attested: %s", r->name, r->att_err);
        return false;
    }
    bool agent = r->source == CFG_ATTEST_AGENT;
    probe_opts_t o = {.up = io->att_up,
                      .source = r->source,
                      .hostport = agent ? io->agent_hostport : io->hostport,
                      .base = agent ? io->rpath : io->path,
                      .agent_path = io->agent_path,
                      .bearer = agent ? d->pool->api_key : io->bearer,
                      .extra_headers = agent ? NULL : io->extra,
                      .keys = &d->keys,
                      .require_signature = cfg_pool_require_signature(d->cfg, d->pool),
                      .model = probe_canary_model(d->pool, NULL),
                      .deadline_ms = d->cfg->attestation.timeout_ms};
    probe_start(&o, att_done, io);
    return true;
}

static void step_metadata(dg_t *d)
{
    progress("[1/4] metadata: fetching %zu attestation%s", d->run.n, d->run.n == 1 ? "" : "s");
    d->total = d->done = 0;
    for (size_t i = 0; i < d->run.n; i++)
        d->total += att_start(&d->io[i]);
    if (d->total)
        uv_run(&d->loop, UV_RUN_DEFAULT);
}

/* ---- step 1, behaviour: the canary ---------------------------------------------------------- */

/* After a canary mismatch of an agent-attested replica, what the engine itself reports, as the
 * proxy adds it (proxy/control/attest.c): the same reasons in both. */
static void engine_read_done(attest_outcome_t *out, void *data)
{
    rio_t *io = data;
    dg_t *d = io->d;
    dg_replica_t *r = &d->run.r[io->idx];
    if (out->verdict == ATTEST_V_REPORTED)
        attest_engine_reason(&r->report, &out->report, &r->admit_reasons);
    if (++d->done == d->total)
        uv_stop(&d->loop);
}

static void engine_read_start(rio_t *io)
{
    dg_t *d = io->d;
    dg_replica_t *r = &d->run.r[io->idx];
    cfg_attest_source_t src = attest_engine_source(&r->report);
    if (src == CFG_ATTEST_NONE || r->source != CFG_ATTEST_AGENT || io->up == NULL)
        return;
    probe_opts_t o = {.up = io->up,
                      .source = src,
                      .hostport = io->hostport,
                      .base = io->path,
                      .bearer = io->bearer,
                      .extra_headers = io->extra,
                      .known_fingerprint = "", /* metadata only: never a completion */
                      .metadata_fingerprint = true,
                      .deadline_ms = d->cfg->attestation.timeout_ms};
    d->total++;
    probe_start(&o, engine_read_done, io);
}

/* The proxy admits a replica whose metadata matches only once its canary matches too
 * (px_attest.c): diagnose's admission column says what the proxy would. */
static void canary_done(const probe_canary_result_t *res, void *data)
{
    rio_t *io = data;
    dg_t *d = io->d;
    dg_replica_t *r = &d->run.r[io->idx];
    r->canary.answered = res->answered;
    r->canary.matched = res->matched;
    memcpy(r->canary.expected, res->expected, sizeof(r->canary.expected));
    if (res->answered)
        memcpy(r->canary.sha256, res->sha256, sizeof(r->canary.sha256));
    else
        r->canary.err = dp_xstrdup(res->error ? res->error : "no answer");
    if (r->admitted && !res->matched) {
        r->admitted = false;
        if (!res->answered)
            attest_reasons_add(&r->admit_reasons, "canary not answered: %s", r->canary.err);
        else
            attest_canary_reason(res->sha256, res->expected, &r->admit_reasons);
        if (res->answered)
            engine_read_start(io);
    }
    progress("[1/4] %s: canary %s%s%.8s%s", r->name,
             !res->answered ? "not answered: "
             : res->matched ? "matches, sha256 "
                            : "DIFFERS, sha256 ",
             !res->answered ? r->canary.err : "", res->answered ? res->sha256 : "",
             res->answered ? ".." : "");
    if (++d->done == d->total)
        uv_stop(&d->loop);
}

static void step_canary(dg_t *d)
{
    d->total = d->done = 0;
    for (size_t i = 0; i < d->run.n; i++) {
        rio_t *io = &d->io[i];
        dg_replica_t *r = &d->run.r[i];
        const cfg_manifest_t *id = d->pool->manifest;
        if (r->att_ok)
            id = attest_manifest_identity(id, &r->report);
        if (id == NULL)
            id = d->pool->manifest; /* rejected on metadata: the manifest's own canary */
        if (id == NULL || id->canary == NULL || io->up == NULL)
            continue;
        r->canary.ran = true;
        d->total++;
        const probe_route_t to = {.hostport = io->hostport,
                                  .base = io->path,
                                  .bearer = io->bearer,
                                  .extra_headers = io->extra,
                                  .deadline_ms = probe_answer_deadline_ms(d->cfg)};
        probe_canary_start(io->up, d->pool, id, &to, canary_done, io);
    }
    if (d->total) {
        progress("[1/4] canary: the manifest's canary prompt to %zu replica%s", d->total,
                 d->total == 1 ? "" : "s");
        uv_run(&d->loop, UV_RUN_DEFAULT);
    }
}

/* ---- steps 2 and 3: completions -------------------------------------------------------------- */

static void pump(dg_t *d);

static void out_error(dg_out_t *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void out_error(dg_out_t *o, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    o->err = dp_xmalloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(o->err, (size_t)n + 1, fmt, ap);
    va_end(ap);
}

static void phase_replica_done(rio_t *io)
{
    dg_replica_t *r = &io->d->run.r[io->idx];
    size_t ok = 0;
    const char *err = NULL;
    for (size_t i = 0; i < io->njobs; i++) {
        ok += io->outs[i]->ok;
        if (!io->outs[i]->ok && err == NULL)
            err = io->outs[i]->err;
    }
    if (ok == io->njobs)
        progress("%s %s: %zu/%zu ok", io->d->phase, r->name, ok, io->njobs);
    else
        progress("%s %s: %zu/%zu ok (first error: %s)", io->d->phase, r->name, ok, io->njobs,
                 err ? err : "?");
}

static void job_finished(rio_t *io)
{
    dg_t *d = io->d;
    io->pdone++;
    d->done++;
    if (io->pdone == io->njobs)
        phase_replica_done(io);
}

/* A message for a non-200 answer: the OpenAI-shaped error's message when there is one. */
static void http_error(dg_out_t *o, int status, const dp_buf_t *body)
{
    cJSON *doc = cJSON_ParseWithLength(body->base ? body->base : "", body->len);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(doc, "error");
    const cJSON *msg = cJSON_IsObject(e) ? cJSON_GetObjectItemCaseSensitive(e, "message") : e;
    if (!cJSON_IsString(msg))
        msg = cJSON_GetObjectItemCaseSensitive(doc, "detail");
    if (cJSON_IsString(msg)) {
        dp_buf_t s = {0};
        attest_abbrev(msg->valuestring, &s); /* sanitised and cut: it is the replica's text */
        out_error(o, "HTTP %d: %s", status, s.base);
        dp_buf_free(&s);
    } else {
        out_error(o, "HTTP %d", status);
    }
    cJSON_Delete(doc);
}

static void job_done(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                     const char *detail, void *data)
{
    job_t *j = data;
    rio_t *io = j->io;
    dg_t *d = io->d;
    dg_out_t *o = j->out;
    (void)f;
    free(j);
    o->done = true;
    d->lane_busy[io->lane]--;
    io->inflight--;
    if (status == 200) {
        drift_output_t out = {0};
        if (drift_extract_json(body->base ? body->base : "", body->len, OUTPUT_MAX_BYTES, &out) ==
            0) {
            o->ok = true;
            o->len = out.text.len;
            o->text = dp_buf_steal(&out.text);
        } else {
            out_error(o, "HTTP 200 without a completion in the body");
        }
        drift_output_free(&out);
    } else if (status != 0) {
        http_error(o, status, body);
    } else {
        out_error(o, "%s%s%s", net_up_err_name(err), detail && *detail ? ": " : "",
                  detail ? detail : "");
    }
    /* Transport failures in a row (refused, timed out, reset) mean the rest would only wait
     * out the same timeouts; an HTTP error is an answer and keeps the replica in. */
    io->transport_failures = status == 0 ? io->transport_failures + 1 : 0;
    dg_replica_t *r = &d->run.r[io->idx];
    if (io->transport_failures >= GIVE_UP_FAILURES && r->skip_reason == NULL) {
        dp_buf_t why = {0};
        dp_buf_printf(&why, "%s (%s)", err == NET_UP_CONNECT ? "unreachable" : "not answering",
                      o->err);
        r->skip_reason = dp_buf_steal(&why);
        progress("%s %s: %s: skipping its remaining requests", d->phase, r->name, r->skip_reason);
    }
    job_finished(io);
    pump(d);
    if (d->done == d->total)
        uv_stop(&d->loop);
}

static void job_start(rio_t *io, size_t k)
{
    dg_t *d = io->d;
    job_t *j = dp_xcalloc(1, sizeof(*j));
    j->io = io;
    j->out = io->outs[k];
    char target[600];
    snprintf(target, sizeof(target), "%s/v1/completions", io->path);
    net_fetch_opts_t o = {.method = "POST",
                          .hostport = io->hostport,
                          .target = target,
                          .bearer = io->bearer,
                          .extra_headers = io->extra,
                          .body = io->bodies[k]->base,
                          .body_len = io->bodies[k]->len,
                          .max_bytes = OUTPUT_MAX_BYTES,
                          .deadline_ms = probe_answer_deadline_ms(d->cfg)};
    io->inflight++;
    d->lane_busy[io->lane]++;
    net_fetch(io->up, &o, job_done, j);
}

/* Start what the phase allows: one request per lane when sequential, else `limit` per replica.
 * Jobs of a replica given up on are settled at once as skipped. */
static void pump(dg_t *d)
{
    for (size_t i = 0; i < d->run.n; i++) {
        rio_t *io = &d->io[i];
        const char *skip = d->run.r[i].skip_reason;
        while (io->next < io->njobs) {
            if (skip) {
                dg_out_t *o = io->outs[io->next++];
                o->done = true;
                out_error(o, "skipped: %s", skip);
                job_finished(io);
                continue;
            }
            if (d->sequential ? d->lane_busy[io->lane] > 0 : io->inflight >= d->limit)
                break;
            job_start(io, io->next++);
        }
    }
}

/* Run one phase of njobs requests per replica: slot(r, k) is where replica r's k-th result goes,
 * body(d, k) what it sends. Returns when every job has finished or been skipped. */
static void run_phase(dg_t *d, const char *label, bool sequential, size_t njobs,
                      dg_out_t *(*slot)(dg_replica_t *r, size_t k),
                      const dp_buf_t *(*body)(dg_t *d, size_t k))
{
    d->phase = label;
    d->sequential = sequential;
    d->limit = d->run.concurrency;
    d->total = d->done = 0;
    for (size_t i = 0; i < d->run.n; i++) {
        rio_t *io = &d->io[i];
        io->outs = dp_xcalloc(njobs, sizeof(*io->outs));
        io->bodies = dp_xcalloc(njobs, sizeof(*io->bodies));
        for (size_t k = 0; k < njobs; k++) {
            io->outs[k] = slot(&d->run.r[i], k);
            io->bodies[k] = body(d, k);
        }
        io->njobs = njobs;
        io->next = io->inflight = io->pdone = 0;
        d->total += njobs;
    }
    pump(d);
    if (d->done < d->total)
        uv_run(&d->loop, UV_RUN_DEFAULT);
    for (size_t i = 0; i < d->run.n; i++) {
        free(d->io[i].outs);
        free(d->io[i].bodies);
        d->io[i].outs = NULL;
        d->io[i].bodies = NULL;
        d->io[i].njobs = 0;
    }
}

static dg_out_t *slot_sampling(dg_replica_t *r, size_t k)
{
    return &r->sampling[k];
}

static dg_out_t *slot_seq(dg_replica_t *r, size_t k)
{
    return &r->seq[k];
}

static dg_out_t *slot_conc(dg_replica_t *r, size_t k)
{
    return &r->conc[k];
}

static const dp_buf_t *body_sampling(dg_t *d, size_t k)
{
    return k < 2 ? &d->body_unseeded : &d->body_seeded;
}

static const dp_buf_t *body_t0(dg_t *d, size_t k)
{
    (void)k;
    return &d->body_t0;
}

/* A completions body; temperature < 0 means 0 as an integer (how clients usually send it). */
static void build_body(dg_t *d, dp_buf_t *out, double temperature, bool seeded)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "model", d->run.model);
    dp_jw_str(&w, "prompt", d->run.prompt);
    dp_jw_int(&w, "max_tokens", DG_MAX_TOKENS);
    if (temperature <= 0)
        dp_jw_int(&w, "temperature", 0);
    else
        dp_jw_double(&w, "temperature", temperature);
    if (seeded)
        dp_jw_int(&w, "seed", DG_SEED);
    dp_jw_obj_end(&w);
}

/* ---- replicas -------------------------------------------------------------------------------- */

/* The pool's client TLS context, as the proxy builds it (px_gen.c): its ca_file or the system
 * store, its client certificate. NULL (and d->tls_err) when it cannot be loaded. */
static net_tls_ctx_t *pool_tls(dg_t *d)
{
    if (d->tls == NULL && d->tls_err == NULL) {
        const cfg_upstream_tls_t *ut = d->pool->upstream_tls;
        dp_buf_t err = {0};
        d->tls = net_tls_client_ctx(ut ? ut->ca_file : NULL, ut ? ut->client_cert_file : NULL,
                                    ut ? ut->client_key_file : NULL, &err);
        if (d->tls == NULL)
            d->tls_err = dp_buf_steal(&err);
        dp_buf_free(&err);
    }
    return d->tls;
}

static void replica_add(dg_t *d, const char *name, bool tls, const char *host, uint16_t port,
                        const char *hostport, const char *path, cfg_attest_source_t source,
                        const cfg_url_t *agent, const char *server_name)
{
    size_t i = d->run.n++;
    dg_replica_t *r = &d->run.r[i];
    rio_t *io = &d->io[i];
    r->name = dp_xstrdup(name);
    dp_buf_t u = {0};
    dp_buf_printf(&u, "%s://%s%s", tls ? "https" : "http", hostport, path ? path : "");
    r->url = dp_buf_steal(&u);
    r->source = source;
    r->seq = dp_xcalloc(d->run.repeat, sizeof(dg_out_t));
    r->conc = dp_xcalloc(d->run.repeat, sizeof(dg_out_t));
    io->d = d;
    io->idx = i;
    io->endpoint = dp_xstrdup(hostport);
    io->rpath = dp_xstrdup(path ? path : "");
    const cfg_url_t me = {.tls = tls,
                          .host = (char *)host,
                          .port = port,
                          .path = (char *)(path ? path : ""),
                          .hostport = (char *)hostport};
    const probe_relay_replica_t *via =
        d->relayed ? probe_relay_lookup(&d->relay, d->pool->name, &me) : NULL;
    io->relayed = via != NULL;
    io->hostport = dp_xstrdup(via ? d->relay.hostport : hostport);
    io->path = dp_xstrdup(via ? PROBE_RELAY_BASE : io->rpath);
    io->bearer = via ? d->relay.bearer : d->pool->api_key;
    if (via) {
        dp_buf_t h = {0};
        probe_relay_headers(via->pool, via->name, &h);
        io->extra = dp_buf_steal(&h);
    } else if (d->relayed) {
        d->run.relayed = false; /* not every request shares the proxy's slots */
        progress("%s: the running detproxy has no replica at %s: directly to it", name, r->url);
    }
    io->agent_hostport = dp_xstrdup(agent && agent->hostport ? agent->hostport : "");
    io->agent_path = dp_xstrdup(agent && agent->path ? agent->path : "");
    io->lane = i;
    for (size_t k = 0; k < i; k++)
        if (strcmp(d->io[k].endpoint, hostport) == 0) {
            io->lane = d->io[k].lane;
            break;
        }

    /* https: verified exactly as the proxy verifies (docs/security.md §3, "Replicas and
     * agents"): never plaintext to an https port, never an unverified connection. */
    net_upstream_opts_t o;
    probe_replica_upstream_opts(d->cfg, &o);
    o.max_idle = d->run.concurrency + 2;
    struct sockaddr_storage ss;
    if (io->relayed) {
        /* The proxy holds the replica's address, TLS and credentials; this talks to the relay. */
        io->up = net_upstream_new(&d->loop, (struct sockaddr *)&d->relay.addr, &o);
    } else if (tls && pool_tls(d) == NULL) {
        r->skip_reason = dp_xstrdup(d->tls_err);
    } else if (!net_resolve(host, port, &ss)) {
        dp_buf_t why = {0};
        dp_buf_printf(&why, "host name '%s' did not resolve", host);
        r->skip_reason = dp_buf_steal(&why);
    } else {
        io->up = net_upstream_new(&d->loop, (struct sockaddr *)&ss, &o);
        if (tls)
            net_upstream_set_tls(io->up, d->tls, server_name ? server_name : host);
    }
    /* Attestation: short timeouts, as the proxy uses; an agent may live elsewhere. */
    net_upstream_opts_t ao;
    probe_attest_upstream_opts(d->cfg, &ao);
    if (source == CFG_ATTEST_AGENT) {
        if (agent->tls && pool_tls(d) == NULL) {
            r->att_err = dp_xstrdup(d->tls_err);
        } else if (!net_resolve(agent->host, agent->port, &ss)) {
            dp_buf_t why = {0};
            dp_buf_printf(&why, "agent host name '%s' did not resolve", agent->host);
            r->att_err = dp_buf_steal(&why);
        } else {
            io->att_up = net_upstream_new(&d->loop, (struct sockaddr *)&ss, &ao);
            if (agent->tls)
                net_upstream_set_tls(io->att_up, d->tls, agent->host);
        }
    } else if (io->up && io->relayed) {
        io->att_up = net_upstream_new(&d->loop, (struct sockaddr *)&d->relay.addr, &ao);
    } else if (io->up) {
        io->att_up = net_upstream_new(&d->loop, (struct sockaddr *)&ss, &ao);
        if (tls)
            net_upstream_set_tls(io->att_up, d->tls, server_name ? server_name : host);
    }
}

/* A discovery pool: every A/AAAA record of the name is a replica, resolved once now (the proxy
 * re-resolves every refresh_ms; a diagnosis is a snapshot). */
static int discover(dg_t *d, const cfg_discovery_t *disc)
{
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(disc->dns, NULL, &hints, &res);
    if (rc != 0) {
        fprintf(stderr, "detproxy diagnose: pool \"%s\": discovery name '%s' did not resolve: %s\n",
                d->pool->name, disc->dns, gai_strerror(rc));
        return -1;
    }
    size_t start = d->run.n;
    for (struct addrinfo *a = res; a && d->run.n - start < DISCOVERY_MAX; a = a->ai_next) {
        char host[INET6_ADDRSTRLEN] = "";
        if (getnameinfo(a->ai_addr, a->ai_addrlen, host, sizeof(host), NULL, 0, NI_NUMERICHOST) !=
            0)
            continue;
        bool v6 = strchr(host, ':') != NULL;
        char hostport[INET6_ADDRSTRLEN + 10], agent_hp[INET6_ADDRSTRLEN + 10];
        snprintf(hostport, sizeof(hostport), v6 ? "[%s]:%u" : "%s:%u", host, disc->port);
        snprintf(agent_hp, sizeof(agent_hp), v6 ? "[%s]:%u" : "%s:%u", host, disc->attest_port);
        /* Named as the proxy names them ("10.0.0.11:8000"); one entry per address, though
         * getaddrinfo repeats each per socket type. */
        bool dup = false;
        for (size_t i = start; i < d->run.n && !dup; i++)
            dup = strcmp(d->run.r[i].name, hostport) == 0;
        if (dup)
            continue;
        cfg_url_t agent = {.tls = false,
                           .host = host,
                           .port = disc->attest_port,
                           .path = "/attestation",
                           .hostport = agent_hp};
        replica_add(d, hostport, false, host, disc->port, hostport, "", disc->attest_source, &agent,
                    NULL);
    }
    freeaddrinfo(res);
    return 0;
}

/* ---- command line ---------------------------------------------------------------------------- */

typedef struct {
    const char *config, *pool, *prompt;
    uint64_t repeat, concurrency;
    bool json;
} opts_t;

/* The help text's numbers are the constants themselves (DP_ARGS_STR), one help line per source
 * line: */
/* clang-format off */
static const dp_arg_t diagnose_table[] = {
    {.name = "--config", .shortopt = 'c', .kind = DP_ARG_STR, .off = offsetof(opts_t, config),
     .meta = "CONFIG", .help = "config file, as for 'detproxy run'",
     .flags = DP_ARG_ONCE | DP_ARG_REQUIRED},
    {.name = "--pool", .shortopt = 'p', .kind = DP_ARG_STR, .off = offsetof(opts_t, pool),
     .meta = "NAME", .help = "pool to diagnose (default: the first in the config)",
     .flags = DP_ARG_ONCE},
    {.name = "--prompt", .kind = DP_ARG_STR, .off = offsetof(opts_t, prompt),
     .meta = "TEXT", .help = "prompt to send (default: \"" DG_DEFAULT_PROMPT "\")",
     .flags = DP_ARG_ONCE},
    {.name = "--repeat", .kind = DP_ARG_UINT, .off = offsetof(opts_t, repeat), .meta = "N",
     .help = "step 3 requests per replica and phase (default " DP_ARGS_STR(DG_DEFAULT_REPEAT)
             "; 2.." DP_ARGS_STR(DG_MAX_REPEAT) ")",
     .flags = DP_ARG_ONCE, .min = 2, .max = DG_MAX_REPEAT},
    {.name = "--concurrency", .kind = DP_ARG_UINT, .off = offsetof(opts_t, concurrency),
     .meta = "C",
     .help = "step 3 requests in flight per replica (default " DP_ARGS_STR(DG_DEFAULT_CONCURRENCY)
             "; 2.." DP_ARGS_STR(DG_MAX_CONCURRENCY) ")",
     .flags = DP_ARG_ONCE, .min = 2, .max = DG_MAX_CONCURRENCY},
    {.name = "--json", .kind = DP_ARG_FLAG, .off = offsetof(opts_t, json),
     .help = "print one JSON object on stdout instead of tables"},
};

static const dp_args_t diagnose_spec = {
    .prog = "detproxy diagnose",
    .usage = "detproxy diagnose -c CONFIG [--pool P] [--prompt TEXT] [--repeat N]\n"
             "                         [--concurrency C] [--json]",
    .about =
        "Find out why the same prompt gets different outputs from one pool, by running the\n"
        "isolation steps against its replicas directly (no balancing, no policy rewrite):\n"
        "  1 metadata  fetch each replica's attestation; compare checkpoint, quantization,\n"
        "              dtype and framework across replicas (and with the manifest)\n"
        "  2 sampling  the prompt twice at temperature " DP_ARGS_STR(DG_TEMPERATURE) " without a seed, then twice with\n"
        "              seed " DP_ARGS_STR(DG_SEED) ": does unseeded sampling vary, are seeds honoured?\n"
        "  3 single    the prompt N times at temperature 0 to each replica, one at a time,\n"
        "              then N more with C in flight: distinct outputs per replica\n"
        "  4 across    do the replicas' temperature-0 outputs agree?\n"
        "Tables go to stdout and progress to stderr. The last lines are one\n"
        "'verdict: <cause>: <detail>' per cause found, or 'verdict: consistent'.\n"
        "Causes: cross_replica_drift, nondeterministic_replica, batching_nondeterminism,\n"
        "seed_ignored, unseeded_sampling, unattested_replica, replica_error\n"
        "(docs/diagnose.md has the rules).",
    .opts = diagnose_table,
    .nopts = DP_ARRAY_SIZE(diagnose_table),
    .epilog =
        "Each request asks for " DP_ARGS_STR(DG_MAX_TOKENS) " tokens. Replicas are called with the pool's api_key_file.\n"
        "exit codes: 0 consistent, 1 a cause was found or the config is invalid,\n"
        "2 usage error, 3 runtime failure (no replica answered a completion request)",
};
/* clang-format on */

/* ---- the command ----------------------------------------------------------------------------- */

/* The model to ask for: the manifest's, else the pool's first literal name, else what the first
 * replica said about itself in step 1. */
static const char *pick_model(const dg_t *d)
{
    if (d->pool->manifest && d->pool->manifest->model)
        return d->pool->manifest->model;
    for (size_t i = 0; i < d->pool->nmodels; i++)
        if (strcmp(d->pool->models[i], "*") != 0)
            return d->pool->models[i];
    for (size_t i = 0; i < d->run.n; i++)
        if (d->run.r[i].att_ok && d->run.r[i].report.model)
            return d->run.r[i].report.model;
    return NULL;
}

static void load_keys(dg_t *d)
{
    const cfg_attestation_t *at = &d->cfg->attestation;
    for (size_t i = 0; i < at->ntrusted_keys; i++) {
        dp_buf_t err = {0};
        if (attest_keyset_add_file(&d->keys, at->trusted_keys[i], &err) != 0)
            fprintf(stderr, "detproxy diagnose: warning: trusted key %s: %s\n", at->trusted_keys[i],
                    err.base ? err.base : "unreadable");
        dp_buf_free(&err);
    }
}

static void print_unanswered(const dg_t *d)
{
    fprintf(stderr, "detproxy diagnose: no replica of pool \"%s\" answered a completion request:",
            d->pool->name);
    for (size_t i = 0; i < d->run.n; i++) {
        const dg_replica_t *r = &d->run.r[i];
        const char *why = r->skip_reason ? r->skip_reason : r->st.seq.first_err;
        if (why == NULL)
            why = r->sampling[0].err;
        fprintf(stderr, "%s %s: %s", i ? ";" : "", r->name, why ? why : "unknown error");
    }
    fputc('\n', stderr);
}

static void dg_close_cb(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

static void dg_free(dg_t *d)
{
    for (size_t i = 0; i < d->run.n; i++) {
        rio_t *io = &d->io[i];
        if (io->up)
            net_upstream_free(io->up);
        if (io->att_up)
            net_upstream_free(io->att_up);
        io->up = io->att_up = NULL;
        free(io->hostport);
        free(io->path);
        free(io->endpoint);
        free(io->rpath);
        free(io->extra);
        free(io->agent_hostport);
        free(io->agent_path);
    }
    /* Let the idle keep-alive connections finish closing, then the loop is empty. */
    uv_run(&d->loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&d->loop) == UV_EBUSY) {
        uv_walk(&d->loop, dg_close_cb, NULL);
        uv_run(&d->loop, UV_RUN_DEFAULT);
        uv_loop_close(&d->loop);
    }
    free(d->io);
    free(d->lane_busy);
    probe_relay_free(&d->relay);
    net_tls_ctx_unref(d->tls); /* upstreams hold their own references */
    d->tls = NULL;
    free(d->tls_err);
    d->tls_err = NULL;
    attest_keyset_free(&d->keys);
    dp_buf_free(&d->body_t0);
    dp_buf_free(&d->body_unseeded);
    dp_buf_free(&d->body_seeded);
    dg_run_free(&d->run);
}

static void runtime_failure_json(const dg_t *d, const char *msg)
{
    dp_buf_t out = {0};
    dp_jw_t w;
    dp_jw_init(&w, &out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "pool", d->pool ? d->pool->name : NULL);
    dp_jw_str(&w, "error", msg);
    dp_jw_int(&w, "exit_code", 3);
    dp_jw_obj_end(&w);
    printf("%s\n", out.base);
    dp_buf_free(&out);
}

int dg_cmd_diagnose(int argc, char **argv)
{
    opts_t o = {.repeat = DG_DEFAULT_REPEAT,
                .concurrency = DG_DEFAULT_CONCURRENCY,
                .prompt = DG_DEFAULT_PROMPT};
    int rc = dp_args_parse(&diagnose_spec, argc, argv, &o);
    if (rc != 0)
        return dp_args_exit(rc);

    cfg_errors_t errs = {0};
    cfg_t *cfg = NULL;
    rc = cfg_load(o.config, &cfg, &errs);
    for (size_t i = 0; i < errs.count; i++)
        fprintf(stderr, "error: %s\n", errs.items[i]);
    for (size_t i = 0; i < errs.nwarnings; i++)
        fprintf(stderr, "warning: %s\n", errs.warnings[i]);
    cfg_errors_free(&errs);
    if (rc != 0) {
        fprintf(stderr, "detproxy diagnose: invalid config (see 'detproxy check -c %s')\n",
                o.config);
        return 1;
    }

    const cfg_pool_t *pool = o.pool        ? cfg_pool_by_name(cfg, o.pool)
                             : cfg->npools ? cfg->pools
                                           : NULL;
    if (pool == NULL) {
        dp_buf_t known = {0};
        for (size_t i = 0; i < cfg->npools; i++)
            dp_buf_printf(&known, "%s%s", i ? ", " : "", cfg->pools[i].name);
        fprintf(stderr, "detproxy diagnose: --pool: no pool named '%s' (pools: %s) (try --help)\n",
                o.pool ? o.pool : "", known.base ? known.base : "none");
        dp_buf_free(&known);
        cfg_free(cfg);
        return 2;
    }
    /* A closed client or replica must be an error code, not a signal. */
    signal(SIGPIPE, SIG_IGN);

    dg_t d = {0};
    d.cfg = cfg;
    d.pool = pool;
    d.run.cfg = cfg;
    d.run.pool = pool;
    d.run.prompt = o.prompt;
    d.run.repeat = (unsigned)o.repeat;
    d.run.concurrency = (unsigned)o.concurrency;
    if (uv_loop_init(&d.loop) != 0) {
        fprintf(stderr, "detproxy diagnose: cannot create an event loop\n");
        cfg_free(cfg);
        return 3;
    }
    dp_buf_t note = {0};
    d.relayed = probe_relay_find(&d.loop, cfg, NULL, 0, &d.relay, &note) == 1;
    d.run.relayed = d.relayed;
    if (d.relayed)
        progress("through the running detproxy (admin %s): every request to a replica it serves "
                 "takes the pool's admission slots (max_inflight_per_replica %u%s)",
                 d.relay.hostport, pool->max_inflight_per_replica,
                 pool->max_inflight_per_replica ? "" : ": unlimited");
    else
        progress("directly to the replicas: %s; these requests do not share the proxy's "
                 "admission slots",
                 note.base);
    dp_buf_free(&note);
    size_t cap = pool->nreplicas + (pool->discovery ? DISCOVERY_MAX : 0);
    d.run.r = dp_xcalloc(cap ? cap : 1, sizeof(dg_replica_t));
    d.io = dp_xcalloc(cap ? cap : 1, sizeof(rio_t));
    d.lane_busy = dp_xcalloc(cap ? cap : 1, sizeof(size_t));
    for (size_t i = 0; i < pool->nreplicas; i++) {
        const cfg_replica_t *c = &pool->replicas[i];
        replica_add(&d, c->name, c->url.tls, c->url.host, c->url.port, c->url.hostport, c->url.path,
                    c->attest.source, &c->attest.url, c->server_name);
    }
    if (pool->discovery && discover(&d, pool->discovery) != 0) {
        if (o.json)
            runtime_failure_json(&d, "discovery name did not resolve");
        dg_free(&d);
        cfg_free(cfg);
        return 3;
    }
    if (d.run.n == 0) {
        fprintf(stderr, "detproxy diagnose: pool \"%s\" has no replicas\n", pool->name);
        if (o.json)
            runtime_failure_json(&d, "the pool has no replicas");
        dg_free(&d);
        cfg_free(cfg);
        return 3;
    }
    load_keys(&d);
    progress("pool \"%s\": %zu replica%s; step 3 sends each %u requests one at a time, then %u "
             "with %u in flight",
             pool->name, d.run.n, d.run.n == 1 ? "" : "s", d.run.repeat, d.run.repeat,
             d.run.concurrency);

    step_metadata(&d);
    step_canary(&d);
    d.run.model = pick_model(&d);
    if (d.run.model == NULL) {
        fprintf(stderr,
                "detproxy diagnose: pool \"%s\": no model to ask for (no manifest model, "
                "only \"*\" in models, and no replica named one)\n",
                pool->name);
        if (o.json)
            runtime_failure_json(&d, "no model to ask for");
        dg_free(&d);
        cfg_free(cfg);
        return 3;
    }
    build_body(&d, &d.body_t0, 0, false);
    build_body(&d, &d.body_unseeded, DG_TEMPERATURE, false);
    build_body(&d, &d.body_seeded, DG_TEMPERATURE, true);

    progress("[2/4] sampling: 2 requests at temperature %.1f without a seed, 2 with seed %d, "
             "per replica, model %s",
             DG_TEMPERATURE, DG_SEED, d.run.model);
    run_phase(&d, "[2/4]", true, DG_SAMPLES, slot_sampling, body_sampling);
    progress("[3/4] single replica: %u sequential requests at temperature 0 per replica",
             d.run.repeat);
    run_phase(&d, "[3/4] sequential", true, d.run.repeat, slot_seq, body_t0);
    progress("[3/4] single replica: %u requests at temperature 0 per replica, %u in flight",
             d.run.repeat, d.run.concurrency);
    run_phase(&d, "[3/4] concurrent", false, d.run.repeat, slot_conc, body_t0);
    progress("[4/4] across replicas: comparing");

    dg_analyse(&d.run);
    rc = dg_exit_code(&d.run);
    if (rc == 3) {
        print_unanswered(&d);
        if (o.json)
            runtime_failure_json(&d, "no replica answered a completion request");
    } else if (o.json) {
        dp_buf_t out = {0};
        dg_print_json(&d.run, &out);
        fwrite(out.base, 1, out.len, stdout);
        dp_buf_free(&out);
    } else {
        dg_print_text(&d.run, stdout);
    }
    fflush(stdout);
    dg_free(&d);
    cfg_free(cfg);
    return rc;
}
