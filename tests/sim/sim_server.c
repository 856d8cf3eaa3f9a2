/* detproxy-sim's event loop side. See sim_server.h; the endpoints are listed in
 * docs/contributing/simulator.md.
 *
 * One job per inference request. A job embeds a uv_timer_t that drives generation one token
 * per tick (every --token-delay-ms, or every loop iteration at 0, so concurrent requests really
 * overlap and --noise can act). Lifetime rule: a job is freed only in its timer's close
 * callback. net_resp_* may call on_abort synchronously when a write fails, so after every
 * net_resp_* call the code checks job->req (cleared by on_abort) before touching the request again.
 */
#define _GNU_SOURCE
#include "tests/sim/sim_server.h"

#include <stddef.h>
#include <stdint.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cjson/cJSON.h>

#include "attest/dsse.h"
#include "common/jw.h"
#include "common/list.h"
#include "common/log.h"
#include "common/util.h"
#include "net/server.h"
#include "net/tls.h"
#include "tests/sim/lm.h"
#include "tests/sim/sim_attest.h"
#include "tests/sim/sim_fmt.h"
#include "tests/sim/sim_req.h"

#define REQLOG_SIZE 64
#define REQLOG_BODY_MAX (64 * 1024) /* bodies kept in /_sim/requests; last_request keeps all */
#define DIE_AFTER_TOKENS 3
#define HUGE_ATTEST_BYTES (10 * 1024 * 1024)
#define TRICKLE_MS 200 /* fault "trickle": a byte this often, well within any idle timeout */

static const char *const fault_names[SIM_FAULT__COUNT] = {"none",           "close_before_response",
                                                          "hang",           "garbage",
                                                          "die_mid_stream", "bad_framing",
                                                          "error_500",      "coded",
                                                          "wrong_type",     "trickle"};
static const char *const afault_names[SIM_AFAULT__COUNT] = {
    "none", "wrong_nonce", "bad_signature", "unsigned", "garbage", "huge", "hang"};

int sim_fault_parse(const char *s)
{
    for (int i = 0; i < SIM_FAULT__COUNT; i++)
        if (strcmp(s, fault_names[i]) == 0)
            return i;
    return -1;
}

const char *sim_fault_name(sim_fault_t f)
{
    return fault_names[f];
}

int sim_attest_fault_parse(const char *s)
{
    for (int i = 0; i < SIM_AFAULT__COUNT; i++)
        if (strcmp(s, afault_names[i]) == 0)
            return i;
    return -1;
}

const char *sim_attest_fault_name(sim_attest_fault_t f)
{
    return afault_names[f];
}

typedef struct job_s job_t;

typedef struct {
    uv_loop_t *loop;
    net_server_t *srv;
    uv_signal_t sigterm, sigint, sigpipe;
    sim_identity_t id;
    sim_lm_t lm;
    double noise;
    uint32_t token_delay_ms;
    bool finish_abandoned; /* sim_config_t */
    sim_fault_t fault;
    bool fault_all;          /* every non-/_sim/ route, not only inference */
    int64_t fault_remaining; /* -1: until changed */
    sim_attest_fault_t attest_fault;
    attest_key_t *key;
    uint64_t rng;
    size_t high_water;
    struct {
        uint64_t requests; /* inference requests received */
        uint64_t completed;
        uint64_t aborted; /* client went away mid-generation */
        uint64_t tokens;  /* tokens generated, all requests */
        uint64_t hung;
        uint64_t faults;
        uint32_t inflight; /* generations running now */
        uint32_t max_inflight;
    } st;
    char *reqlog[REQLOG_SIZE]; /* JSON objects, ring */
    uint64_t reqlog_count;
    char *last_inference; /* JSON object */
    job_t *jobs;
    bool stopping;
} sim_t;

typedef struct {
    sim_gen_t g;
    dp_buf_t text;
    uint32_t ntok;
} choice_t;

struct job_s {
    uv_timer_t timer; /* timer.data = job; the job is freed in its close callback */
    sim_t *sim;
    net_req_t *req; /* NULL once the response ended or the client left */
    job_t *prev, *next;
    sim_req_t rq;
    sim_fmt_ctx_t fmt;
    char idbuf[48];
    char *model;
    dp_buf_t fingerprint;
    choice_t *ch;
    size_t nch;
    uint32_t prompt_tokens;
    uint32_t ticks;
    bool hung;    /* fault "hang": never answered */
    bool counted; /* counted in st.inflight */
    bool paused;  /* waiting for on_drain */
    bool closing;
    bool die; /* fault "die_mid_stream" */
    /* A stream in a llama.cpp stream session (x-conversation-id): generated on for a later
     * reader when its client leaves, as a non-streamed answer is (finish_abandoned). */
    bool session;
};

/* ---- small helpers --------------------------------------------------------------------------- */

static uint64_t rand64(sim_t *s)
{
    s->rng += 0x9e3779b97f4a7c15ull;
    return sim_mix64(s->rng);
}

static bool iov_is(dp_iovec_t v, const char *s)
{
    return strlen(s) == v.len && memcmp(v.base, s, v.len) == 0;
}

static bool method_is(const net_req_t *req, const char *m)
{
    return iov_is(req->method_name, m);
}

static bool is_get(const net_req_t *req)
{
    return method_is(req, "GET") || method_is(req, "HEAD");
}

static void send_json(net_req_t *req, int status, const dp_buf_t *body)
{
    net_resp_send(req, status, "application/json", body->base, body->len, NULL, 0);
}

static void send_error(net_req_t *req, int status, const char *type, const char *param,
                       const char *message)
{
    net_resp_error(req, status, type, NULL, param, message, NULL, 0);
}

static void reload_lm(sim_t *s)
{
    sim_lm_init(&s->lm, s->id.checkpoint_sha256, s->id.quantization, s->id.dtype);
}

/* ---- request log (test-only /_sim/ endpoints) ------------------------------------------------ */

/* Header names lowercased; repeated names joined with ", " so the object has unique keys. */
static void write_headers(dp_jw_t *w, const net_req_t *req)
{
    dp_jw_obj_begin(w, "headers");
    bool *done = dp_xcalloc(req->nheaders + 1, sizeof(bool));
    for (size_t i = 0; i < req->nheaders; i++) {
        if (done[i])
            continue;
        const net_header_t *h = &req->headers[i];
        char *name = dp_xstrndup(h->name.base, h->name.len);
        for (char *p = name; *p; p++)
            if (*p >= 'A' && *p <= 'Z')
                *p = (char)(*p + 32);
        dp_buf_t val = {0};
        dp_buf_append(&val, h->value.base, h->value.len);
        for (size_t j = i + 1; j < req->nheaders; j++) {
            const net_header_t *o = &req->headers[j];
            if (!done[j] && dp_strieq(o->name.base, o->name.len, name)) {
                done[j] = true;
                dp_buf_append(&val, ", ", 2);
                dp_buf_append(&val, o->value.base, o->value.len);
            }
        }
        dp_jw_strn(w, name, val.base ? val.base : "", val.len);
        dp_buf_free(&val);
        free(name);
    }
    free(done);
    dp_jw_obj_end(w);
}

static char *request_json(const net_req_t *req, bool inference, size_t body_max)
{
    dp_buf_t b = {0};
    dp_jw_t w;
    dp_jw_init(&w, &b);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_strn(&w, "method", req->method_name.base, req->method_name.len);
    dp_jw_strn(&w, "path", req->path.base, req->path.len);
    dp_jw_strn(&w, "target", req->target.base, req->target.len);
    dp_jw_bool(&w, "inference", inference);
    dp_jw_uint(&w, "received_at_ms", dp_wall_ms());
    write_headers(&w, req);
    size_t n = req->body.len;
    dp_jw_bool(&w, "body_truncated", n > body_max);
    dp_jw_strn(&w, "body", req->body.base ? req->body.base : "", n > body_max ? body_max : n);
    dp_jw_obj_end(&w);
    return dp_buf_steal(&b);
}

static void record_request(sim_t *s, const net_req_t *req, bool inference)
{
    size_t slot = s->reqlog_count % REQLOG_SIZE;
    free(s->reqlog[slot]);
    s->reqlog[slot] = request_json(req, inference, REQLOG_BODY_MAX);
    s->reqlog_count++;
    if (inference) {
        free(s->last_inference);
        s->last_inference = request_json(req, inference, SIZE_MAX);
    }
}

/* ---- jobs ------------------------------------------------------------------------------------ */

static void job_closed(uv_handle_t *h)
{
    job_t *j = h->data;
    for (size_t i = 0; i < j->nch; i++)
        dp_buf_free(&j->ch[i].text);
    free(j->ch);
    j->ch = NULL;
    sim_req_free(&j->rq);
    free(j->model);
    j->model = NULL;
    dp_buf_free(&j->fingerprint);
    free(j);
}

/* Stop the job and schedule its release. Safe to call more than once. */
static void job_close(job_t *j)
{
    if (j->closing)
        return;
    j->closing = true;
    sim_t *s = j->sim;
    if (j->counted) {
        j->counted = false;
        s->st.inflight--;
    }
    if (j->req) {
        j->req->data = NULL;
        j->req = NULL;
    }
    DP_LIST_UNLINK(s->jobs, j, next, prev);
    uv_timer_stop(&j->timer);
    uv_close((uv_handle_t *)&j->timer, job_closed);
}

static job_t *job_new(sim_t *s, net_req_t *req)
{
    job_t *j = dp_xcalloc(1, sizeof(*j));
    uv_timer_init(s->loop, &j->timer);
    j->timer.data = j;
    j->sim = s;
    j->req = req;
    req->data = j;
    DP_LIST_PUSH(s->jobs, j, next, prev);
    return j;
}

static void job_tick_cb(uv_timer_t *t);

static void job_arm(job_t *j, uint64_t delay_ms)
{
    uv_timer_start(&j->timer, job_tick_cb, delay_ms, 0);
}

static sim_usage_t job_usage(const job_t *j)
{
    sim_usage_t u = {j->prompt_tokens, 0};
    for (size_t i = 0; i < j->nch; i++)
        u.completion_tokens += j->ch[i].ntok;
    return u;
}

/* Detach the request from the job before a call that ends the response: after net_resp_end /
 * net_resp_abort the request must not be touched, and an on_abort fired from inside the call
 * then finds no job. */
static net_req_t *job_detach(job_t *j)
{
    net_req_t *req = j->req;
    req->data = NULL;
    j->req = NULL;
    return req;
}

static void job_finish(job_t *j)
{
    sim_t *s = j->sim;
    sim_usage_t u = job_usage(j);
    dp_buf_t out = {0};
    int r = 0;
    if (j->rq.stream) {
        if (j->req == NULL) /* its client left: finish_abandoned ran it out */
            goto done;
        if (j->die) {
            /* Fewer tokens than DIE_AFTER_TOKENS were asked for: die before [DONE]. */
            net_resp_abort(job_detach(j));
            goto done;
        }
        if (j->rq.api == SIM_API_RESPONSES) {
            sim_choice_t ch = {0, j->ch[0].text.base ? j->ch[0].text.base : "", j->ch[0].text.len,
                               j->ch[0].g.finish};
            sim_fmt_responses_end(&out, &j->fmt, &ch, &u);
        } else {
            if (j->rq.include_usage)
                sim_fmt_chunk_usage(&out, &j->fmt, &u);
            sim_fmt_done(&out);
        }
        r = net_resp_write(j->req, out.base, out.len);
        if (r != 0 || j->req == NULL)
            goto done; /* on_abort took the job */
        r = net_resp_end(job_detach(j));
    } else {
        sim_choice_t *cs = dp_xcalloc(j->nch, sizeof(*cs));
        for (size_t i = 0; i < j->nch; i++)
            cs[i] = (sim_choice_t){(uint32_t)i, j->ch[i].text.base ? j->ch[i].text.base : "",
                                   j->ch[i].text.len, j->ch[i].g.finish};
        sim_fmt_response(&out, &j->fmt, cs, j->nch, &u);
        free(cs);
        if (j->req == NULL) /* its client left (counted then): finish_abandoned ran it out */
            goto done;
        net_req_t *req = job_detach(j);
        if (j->die) {
            /* Announce the whole length, send half, hang up. */
            net_header_t h = {DP_IOV("content-type"), DP_IOV("application/json")};
            if (net_resp_start(req, 200, &h, 1, (int64_t)out.len) == 0 &&
                net_resp_write(req, out.base, out.len / 2) == 0)
                net_resp_abort(req);
            goto done;
        }
        r = net_resp_send(req, 200, "application/json", out.base, out.len, NULL, 0);
    }
    if (r == 0)
        s->st.completed++;
    else if (j->counted)
        s->st.aborted++;
done:
    dp_buf_free(&out);
    job_close(j);
}

static void job_tick(job_t *j)
{
    sim_t *s = j->sim;
    dp_buf_t out = {0};
    bool all_done = true;
    for (size_t i = 0; i < j->nch; i++) {
        choice_t *c = &j->ch[i];
        if (c->g.finish != SIM_FINISH_NONE)
            continue;
        sim_noise_t nz = {s->noise, s->st.inflight, rand64(s)};
        sim_step_t st;
        if (!sim_gen_step(&c->g, &nz, &st))
            continue;
        size_t start = c->text.len;
        if (st.token != SIM_LM_TOKEN_EOS) {
            sim_fmt_token_text(j->rq.api, c->ntok, st.token, &c->text);
            c->ntok++;
            s->st.tokens++;
        }
        if (j->rq.stream)
            sim_fmt_chunk(&out, &j->fmt, (uint32_t)i, c->text.base + start, c->text.len - start,
                          c->g.finish);
        if (c->g.finish == SIM_FINISH_NONE)
            all_done = false;
    }
    j->ticks++;
    if (j->rq.stream && out.len > 0 && j->req) { /* none: its client left (finish_abandoned) */
        int r = net_resp_write(j->req, out.base, out.len);
        if (r != 0 || j->req == NULL) {
            /* The connection is gone; on_abort has closed (or will close) the job. */
            dp_buf_free(&out);
            return;
        }
        if (j->die && j->ticks >= DIE_AFTER_TOKENS) {
            dp_buf_free(&out);
            net_resp_abort(job_detach(j));
            job_close(j);
            return;
        }
    }
    dp_buf_free(&out);
    if (all_done) {
        job_finish(j);
        return;
    }
    if (j->rq.stream && j->req && net_resp_pending(j->req) > s->high_water) {
        j->paused = true; /* resumed by on_drain */
        return;
    }
    job_arm(j, s->token_delay_ms);
}

static void job_tick_cb(uv_timer_t *t)
{
    job_t *j = t->data;
    if (j->closing) /* a job whose client left is closed then, unless it is finished_abandoned */
        return;
    job_tick(j);
}

/* ---- inference --------------------------------------------------------------------------------
 */

/* TGI's own error shape for its validation failures (422). */
static void send_tgi_validation(net_req_t *req, const char *message)
{
    dp_buf_t b = {0};
    dp_jw_t w;
    dp_jw_init(&w, &b);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "error", message);
    dp_jw_str(&w, "error_type", "validation");
    dp_jw_obj_end(&w);
    send_json(req, 422, &b);
    dp_buf_free(&b);
}

static void handle_inference(sim_t *s, net_req_t *req, sim_api_t api, bool die)
{
    sim_req_t rq;
    sim_req_err_t err;
    const char *body = req->body.base ? req->body.base : "";
    if (sim_req_parse(&rq, api, body, req->body.len, &err) < 0) {
        send_error(req, 400, "BadRequestError", err.param, err.message);
        return;
    }
    sim_flavor_t fl = s->id.flavor;
    if ((fl == SIM_FLAVOR_VLLM || fl == SIM_FLAVOR_SGLANG) && rq.model &&
        strcmp(rq.model, s->id.model) != 0) {
        dp_buf_t m = {0};
        dp_buf_printf(&m, "The model `%s` does not exist.", rq.model);
        send_error(req, 404, "NotFoundError", "model", m.base);
        dp_buf_free(&m);
        sim_req_free(&rq);
        return;
    }
    if (fl == SIM_FLAVOR_TGI && rq.top_p_given && rq.top_p >= 1.0) {
        send_tgi_validation(req, "`top_p` must be > 0.0 and < 1.0");
        sim_req_free(&rq);
        return;
    }

    job_t *j = job_new(s, req);
    j->rq = rq;
    j->die = die;
    j->session = net_req_header(req, "x-conversation-id") != NULL;
    j->model = dp_xstrdup(rq.model && fl != SIM_FLAVOR_TGI ? rq.model : s->id.model);
    sim_fmt_id(fl, api, rand64(s), rand64(s), j->idbuf);
    sim_identity_fingerprint(&s->id, &j->fingerprint);
    j->fmt = (sim_fmt_ctx_t){
        fl,       api,
        j->idbuf, dp_wall_ms() / 1000,
        j->model, sim_identity_has_fingerprint(&s->id) ? j->fingerprint.base : NULL};
    j->nch = rq.nprompts * rq.n;
    j->ch = dp_xcalloc(j->nch, sizeof(*j->ch));
    for (size_t p = 0; p < rq.nprompts; p++) {
        j->prompt_tokens += rq.prompts[p].ntokens;
        for (uint32_t k = 0; k < rq.n; k++) {
            size_t idx = p * rq.n + k;
            sim_gen_params_t gp = {
                .temperature = rq.temperature,
                .top_p = rq.top_p,
                .top_k = rq.top_k,
                .max_tokens = rq.max_tokens,
                .sample_seed = rq.has_seed ? sim_lm_sample_seed(rq.seed, (uint32_t)idx) : rand64(s),
            };
            sim_gen_init(&j->ch[idx].g, &s->lm, &rq.prompts[p], &gp);
        }
    }
    j->counted = true;
    s->st.inflight++;
    if (s->st.inflight > s->st.max_inflight)
        s->st.max_inflight = s->st.inflight;

    dp_jw_t *w = dp_log_begin(DP_LOG_DEBUG, "generate");
    if (w) {
        dp_jw_str(w, "request_id", req->id);
        dp_jw_str(w, "api",
                  api == SIM_API_CHAT        ? "chat"
                  : api == SIM_API_RESPONSES ? "responses"
                                             : "completions");
        dp_jw_uint(w, "choices", j->nch);
        dp_jw_uint(w, "max_tokens", rq.max_tokens);
        dp_jw_double(w, "temperature", rq.temperature);
        dp_jw_bool(w, "stream", rq.stream);
        dp_jw_uint(w, "inflight", s->st.inflight);
        dp_log_end(w);
    }

    if (rq.stream) {
        net_header_t h[2] = {{DP_IOV("content-type"), DP_IOV("text/event-stream")},
                             {DP_IOV("cache-control"), DP_IOV("no-cache")}};
        if (net_resp_start(req, 200, h, 2, -1) != 0) {
            job_close(j);
            return;
        }
        dp_buf_t out = {0};
        for (size_t i = 0; i < j->nch; i++)
            sim_fmt_chunk_role(&out, &j->fmt, (uint32_t)i);
        /* Send the head (and role chunks) now: a client sees the stream open at once. */
        int r = net_resp_write(req, out.base ? out.base : "", out.len);
        dp_buf_free(&out);
        if (r != 0 || j->req == NULL)
            return;
    }
    job_arm(j, s->token_delay_ms);
}

/* ---- faults -----------------------------------------------------------------------------------
 */

/* Broken responses go out through net_resp_raw_and_close: the server would (rightly) frame and
 * sanitise anything sent the normal way. */
static void fault_garbage(sim_t *s, net_req_t *req)
{
    static const char junk[] = "\x16\x03\x01\x02\x00 SSH-2.0-garbage \xff\xfe\x00 not http\r\n"
                               "\r\n\x01\x02\x03";
    (void)s;
    net_resp_raw_and_close(req, junk, sizeof(junk) - 1);
}

static void fault_bad_framing(net_req_t *req)
{
    /* Both Content-Length and Transfer-Encoding: the classic smuggling response. */
    static const char resp[] = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                               "content-length: 19\r\ntransfer-encoding: chunked\r\n\r\n"
                               "13\r\n{\"error\":\"framing\"}\r\n0\r\n\r\n";
    net_resp_raw_and_close(req, resp, sizeof(resp) - 1);
}

/* A 200 completion whose fingerprint is not the replica's own, with a head that makes it
 * unreadable to a proxy that checks it: a Content-Encoding (the body itself is plain: the head
 * is what is tested), or a type that is neither JSON nor an event stream. */
static void fault_unreadable(net_req_t *req, sim_fault_t f)
{
    static const char body[] = "{\"object\":\"text_completion\",\"system_fingerprint\":"
                               "\"fp_unchecked\",\"choices\":[{\"index\":0,\"text\":\"x\","
                               "\"finish_reason\":\"length\"}],\"usage\":{\"prompt_tokens\":1,"
                               "\"completion_tokens\":1,\"total_tokens\":2}}";
    dp_buf_t b = {0};
    dp_buf_printf(&b, "HTTP/1.1 200 OK\r\ncontent-type: %s\r\n%scontent-length: %zu\r\n\r\n%s",
                  f == SIM_FAULT_CODED ? "application/json" : "text/plain",
                  f == SIM_FAULT_CODED ? "content-encoding: gzip\r\n" : "", sizeof(body) - 1, body);
    net_resp_raw_and_close(req, b.base, b.len);
    dp_buf_free(&b);
}

/* A byte of the body, and the next one TRICKLE_MS later, for as long as the client stays. */
static void trickle_cb(uv_timer_t *t)
{
    job_t *j = t->data;
    if (j->closing || j->req == NULL)
        return;
    if (net_resp_write(j->req, " ", 1) != 0 || j->req == NULL)
        return; /* the connection is gone; on_abort has closed (or will close) the job */
    uv_timer_start(&j->timer, trickle_cb, TRICKLE_MS, 0);
}

static void fault_trickle(sim_t *s, net_req_t *req)
{
    static const net_header_t h[] = {{DP_IOV("Content-Type"), DP_IOV("application/json")}};
    job_t *j = job_new(s, req);
    j->hung = true;
    s->st.hung++;
    if (net_resp_start(req, 200, h, 1, -1) == 0 && j->req && net_resp_write(req, "{", 1) == 0 &&
        j->req)
        uv_timer_start(&j->timer, trickle_cb, TRICKLE_MS, 0);
}

/* Apply the configured fault to this request, if any. Returns true when it took the request
 * (die_mid_stream only marks *die and lets generation start). */
static bool apply_fault(sim_t *s, net_req_t *req, bool inference, bool *die)
{
    *die = false;
    if (s->fault == SIM_FAULT_NONE || (!inference && !s->fault_all))
        return false;
    sim_fault_t f = s->fault;
    s->st.faults++;
    if (s->fault_remaining > 0 && --s->fault_remaining == 0)
        s->fault = SIM_FAULT_NONE;
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "fault_injected");
    if (w) {
        dp_jw_str(w, "fault", fault_names[f]);
        dp_jw_str(w, "request_id", req->id);
        dp_log_end(w);
    }
    switch (f) {
    case SIM_FAULT_CLOSE_BEFORE_RESPONSE:
        net_resp_abort(req);
        return true;
    case SIM_FAULT_HANG: {
        job_t *j = job_new(s, req);
        j->hung = true;
        s->st.hung++;
        return true;
    }
    case SIM_FAULT_GARBAGE:
        fault_garbage(s, req);
        return true;
    case SIM_FAULT_BAD_FRAMING:
        fault_bad_framing(req);
        return true;
    case SIM_FAULT_ERROR_500:
        send_error(req, 500, "InternalServerError", NULL, "simulated replica failure");
        return true;
    case SIM_FAULT_CODED:
    case SIM_FAULT_WRONG_TYPE:
        fault_unreadable(req, f);
        return true;
    case SIM_FAULT_TRICKLE:
        fault_trickle(s, req);
        return true;
    case SIM_FAULT_DIE_MID_STREAM:
        if (!inference) {
            net_resp_abort(req);
            return true;
        }
        *die = true;
        return false;
    case SIM_FAULT_NONE:
    case SIM_FAULT__COUNT:
        break;
    }
    return false;
}

/* ---- /attestation ------------------------------------------------------------------------------
 */

static void handle_attestation(sim_t *s, net_req_t *req)
{
    char nonce[ATTEST_NONCE_MAX + 1];
    dp_buf_t nb = {0};
    bool ok = net_req_query(req, "nonce", &nb) == 1 && attest_nonce_copy(nb.base, nb.len, nonce);
    dp_buf_free(&nb);
    if (!ok) {
        send_error(req, 400, "invalid_request_error", "nonce", ATTEST_NONCE_RULE);
        return;
    }
    switch (s->attest_fault) {
    case SIM_AFAULT_HANG: {
        job_t *j = job_new(s, req);
        j->hung = true;
        s->st.hung++;
        return;
    }
    case SIM_AFAULT_GARBAGE: {
        static const char g[] = "<html>this is not an attestation</html>\n";
        net_resp_send(req, 200, "application/json", g, sizeof(g) - 1, NULL, 0);
        return;
    }
    case SIM_AFAULT_HUGE: {
        char *big = dp_xmalloc(HUGE_ATTEST_BYTES);
        memset(big, ' ', HUGE_ATTEST_BYTES);
        big[0] = '{';
        big[HUGE_ATTEST_BYTES - 1] = '}';
        net_resp_send(req, 200, "application/json", big, HUGE_ATTEST_BYTES, NULL, 0);
        free(big);
        return;
    }
    default:
        break;
    }
    dp_buf_t out = {0}, err = {0};
    if (sim_attest_envelope(s->key, &s->id, nonce, s->attest_fault, &out, &err) == 0)
        send_json(req, 200, &out);
    else
        send_error(req, 500, "server_error", NULL, err.base ? err.base : "signing failed");
    dp_buf_free(&out);
    dp_buf_free(&err);
}

/* ---- /_sim/ ------------------------------------------------------------------------------------
 */

static void write_config(const sim_t *s, dp_buf_t *out)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "flavor", sim_flavor_name(s->id.flavor));
    dp_jw_str(&w, "model", s->id.model);
    dp_jw_str(&w, "framework_version", s->id.framework_version);
    dp_jw_str(&w, "quantization", s->id.quantization);
    dp_jw_str(&w, "report_quantization", sim_identity_reported_quantization(&s->id));
    dp_jw_str(&w, "dtype", s->id.dtype);
    dp_jw_str(&w, "checkpoint_sha256", s->id.checkpoint_sha256);
    dp_jw_double(&w, "noise", s->noise);
    dp_jw_uint(&w, "token_delay_ms", s->token_delay_ms);
    dp_jw_str(&w, "fault", fault_names[s->fault]);
    dp_jw_str(&w, "fault_scope", s->fault_all ? "all" : "inference");
    dp_jw_int(&w, "fault_count", s->fault_remaining);
    dp_jw_str(&w, "attest_fault", afault_names[s->attest_fault]);
    dp_jw_bool(&w, "attestation", s->key != NULL);
    dp_jw_uint(&w, "total_slots", s->id.total_slots);
    dp_jw_bool(&w, "deterministic_inference", s->id.deterministic_inference);
    dp_jw_obj_end(&w);
}

/* The string members /_sim/config may change, and whether "" is allowed. */
static const struct {
    const char *key;
    size_t off;
    bool allow_empty;
} config_strings[] = {
    {"model", offsetof(sim_identity_t, model), false},
    {"framework_version", offsetof(sim_identity_t, framework_version), false},
    {"quantization", offsetof(sim_identity_t, quantization), false},
    {"report_quantization", offsetof(sim_identity_t, report_quantization), true},
    {"dtype", offsetof(sim_identity_t, dtype), false},
    {"checkpoint_sha256", offsetof(sim_identity_t, checkpoint_sha256), false},
};

/* Validate every member first, then apply them all: a bad request changes nothing. */
static int config_apply(sim_t *s, const char *body, size_t n, dp_buf_t *why)
{
    cJSON *root = cJSON_ParseWithLength(body, n);
    int rc = -1;
    if (!cJSON_IsObject(root)) {
        dp_buf_appends(why, "body must be a JSON object");
        goto out;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, root)
    {
        const char *k = it->string;
        bool known = false;
        for (size_t i = 0; i < DP_ARRAY_SIZE(config_strings); i++) {
            if (strcmp(k, config_strings[i].key) != 0)
                continue;
            known = true;
            if (!cJSON_IsString(it) || (!config_strings[i].allow_empty && !it->valuestring[0])) {
                dp_buf_printf(why, "%s: expected a non-empty string", k);
                goto out;
            }
            if (strcmp(k, "checkpoint_sha256") == 0 && !dp_is_lower_hex(it->valuestring, 64)) {
                dp_buf_printf(why, "%s: expected 64 lowercase hex", k);
                goto out;
            }
        }
        if (known)
            continue;
        if (strcmp(k, "noise") == 0) {
            if (!cJSON_IsNumber(it) || !(it->valuedouble >= 0 && it->valuedouble <= 1)) {
                dp_buf_appends(why, "noise: expected a number in [0, 1]");
                goto out;
            }
        } else if (strcmp(k, "token_delay_ms") == 0) {
            double d = cJSON_IsNumber(it) ? it->valuedouble : -1;
            if (!(d >= 0 && d <= 600000 && d == floor(d))) {
                dp_buf_appends(why, "token_delay_ms: expected an integer in [0, 600000]");
                goto out;
            }
        } else if (strcmp(k, "fault") == 0) {
            if (!cJSON_IsString(it) || sim_fault_parse(it->valuestring) < 0) {
                dp_buf_appends(why, "fault: expected one of none, close_before_response, hang, "
                                    "garbage, die_mid_stream, bad_framing, error_500, coded, "
                                    "wrong_type, trickle");
                goto out;
            }
        } else if (strcmp(k, "fault_scope") == 0) {
            if (!cJSON_IsString(it) || (strcmp(it->valuestring, "inference") != 0 &&
                                        strcmp(it->valuestring, "all") != 0)) {
                dp_buf_appends(why, "fault_scope: expected \"inference\" or \"all\"");
                goto out;
            }
        } else if (strcmp(k, "fault_count") == 0) {
            double d = cJSON_IsNumber(it) ? it->valuedouble : -2;
            if (!(d == -1 || (d >= 1 && d <= 1e9 && d == floor(d)))) {
                dp_buf_appends(why, "fault_count: expected -1 (until changed) or a positive "
                                    "integer");
                goto out;
            }
        } else if (strcmp(k, "total_slots") == 0) {
            double d = cJSON_IsNumber(it) ? it->valuedouble : 0;
            if (!(d >= 1 && d <= 1024 && d == floor(d))) {
                dp_buf_appends(why, "total_slots: expected an integer in [1, 1024]");
                goto out;
            }
        } else if (strcmp(k, "deterministic_inference") == 0) {
            if (!cJSON_IsBool(it)) {
                dp_buf_appends(why, "deterministic_inference: expected a boolean");
                goto out;
            }
        } else if (strcmp(k, "attest_fault") == 0) {
            if (!cJSON_IsString(it) || sim_attest_fault_parse(it->valuestring) < 0) {
                dp_buf_appends(why, "attest_fault: expected one of none, wrong_nonce, "
                                    "bad_signature, unsigned, garbage, huge, hang");
                goto out;
            }
        } else {
            dp_buf_printf(why, "%s: unknown key", k);
            goto out;
        }
    }

    bool fault_given = false, count_given = false;
    cJSON_ArrayForEach(it, root)
    {
        const char *k = it->string;
        for (size_t i = 0; i < DP_ARRAY_SIZE(config_strings); i++)
            if (strcmp(k, config_strings[i].key) == 0)
                sim_identity_set((char **)((char *)&s->id + config_strings[i].off),
                                 it->valuestring);
        if (strcmp(k, "noise") == 0) {
            s->noise = it->valuedouble;
        } else if (strcmp(k, "token_delay_ms") == 0) {
            s->token_delay_ms = (uint32_t)it->valuedouble;
        } else if (strcmp(k, "fault") == 0) {
            s->fault = (sim_fault_t)sim_fault_parse(it->valuestring);
            fault_given = true;
        } else if (strcmp(k, "fault_scope") == 0) {
            s->fault_all = strcmp(it->valuestring, "all") == 0;
        } else if (strcmp(k, "fault_count") == 0) {
            s->fault_remaining = (int64_t)it->valuedouble;
            count_given = true;
        } else if (strcmp(k, "attest_fault") == 0) {
            s->attest_fault = (sim_attest_fault_t)sim_attest_fault_parse(it->valuestring);
        } else if (strcmp(k, "total_slots") == 0) {
            s->id.total_slots = (uint32_t)it->valuedouble;
        } else if (strcmp(k, "deterministic_inference") == 0) {
            s->id.deterministic_inference = cJSON_IsTrue(it);
        }
    }
    if (fault_given && !count_given)
        s->fault_remaining = -1;
    reload_lm(s);
    rc = 0;
out:
    cJSON_Delete(root);
    return rc;
}

static void write_stats(const sim_t *s, dp_buf_t *out)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_uint(&w, "requests", s->st.requests);
    dp_jw_uint(&w, "inflight", s->st.inflight);
    dp_jw_uint(&w, "max_inflight_seen", s->st.max_inflight);
    dp_jw_uint(&w, "aborted", s->st.aborted);
    dp_jw_uint(&w, "completed", s->st.completed);
    dp_jw_uint(&w, "tokens_generated", s->st.tokens);
    dp_jw_uint(&w, "hung", s->st.hung);
    dp_jw_uint(&w, "faults_injected", s->st.faults);
    dp_jw_uint(&w, "connections", net_server_connections(s->srv));
    dp_jw_uint(&w, "connections_total", net_server_accepted(s->srv));
    dp_jw_obj_end(&w);
}

static void handle_sim(sim_t *s, net_req_t *req)
{
    dp_iovec_t p = req->path;
    dp_buf_t out = {0};
    if (iov_is(p, "/_sim/last_request") && is_get(req)) {
        if (s->last_inference == NULL) {
            send_error(req, 404, "not_found_error", NULL, "no inference request received yet");
            return;
        }
        net_resp_send(req, 200, "application/json", s->last_inference, strlen(s->last_inference),
                      NULL, 0);
        return;
    }
    if (iov_is(p, "/_sim/requests") && is_get(req)) {
        dp_buf_appends(&out, "{\"requests\":[");
        uint64_t first = s->reqlog_count > REQLOG_SIZE ? s->reqlog_count - REQLOG_SIZE : 0;
        for (uint64_t i = first; i < s->reqlog_count; i++) {
            if (i > first)
                dp_buf_appendc(&out, ',');
            dp_buf_appends(&out, s->reqlog[i % REQLOG_SIZE]);
        }
        dp_buf_appends(&out, "]}");
    } else if (iov_is(p, "/_sim/stats") && is_get(req)) {
        write_stats(s, &out);
    } else if (iov_is(p, "/_sim/reset") && method_is(req, "POST")) {
        uint32_t inflight = s->st.inflight;
        memset(&s->st, 0, sizeof(s->st));
        s->st.inflight = inflight;
        s->st.max_inflight = inflight;
        for (size_t i = 0; i < REQLOG_SIZE; i++) {
            free(s->reqlog[i]);
            s->reqlog[i] = NULL;
        }
        s->reqlog_count = 0;
        free(s->last_inference);
        s->last_inference = NULL;
        write_stats(s, &out);
    } else if (iov_is(p, "/_sim/config") && is_get(req)) {
        write_config(s, &out);
    } else if (iov_is(p, "/_sim/config") && method_is(req, "POST")) {
        dp_buf_t why = {0};
        const char *body = req->body.base ? req->body.base : "";
        if (config_apply(s, body, req->body.len, &why) != 0) {
            send_error(req, 400, "invalid_request_error", NULL, why.base);
            dp_buf_free(&why);
            return;
        }
        write_config(s, &out);
        dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "config_changed");
        if (w) {
            dp_jw_raw(w, "config", out.base, out.len);
            dp_log_end(w);
        }
    } else {
        dp_buf_free(&out);
        send_error(req, 404, "not_found_error", NULL,
                   "test-only endpoints: GET /_sim/last_request, /_sim/requests, /_sim/stats, "
                   "/_sim/config; POST /_sim/config, /_sim/reset");
        return;
    }
    send_json(req, 200, &out);
    dp_buf_free(&out);
}

/* ---- routing -----------------------------------------------------------------------------------
 */

static net_body_mode_t on_head(net_req_t *req)
{
    req->data = NULL;
    return NET_BODY_BUFFER;
}

/* llama.cpp's GET /slots (b11669, tests/unit/data/llamacpp/slots-idle.json, params left out):
 * one object per slot, the first `inflight` of them processing, so a client can tell from it
 * whether the engine runs anything, as it can from llama-server's. */
static void handle_slots(sim_t *s, net_req_t *req)
{
    dp_buf_t out = {0};
    dp_jw_t w;
    dp_jw_init(&w, &out);
    dp_jw_arr_begin(&w, NULL);
    for (uint32_t i = 0; i < s->id.total_slots; i++) {
        dp_jw_obj_begin(&w, NULL);
        dp_jw_uint(&w, "id", i);
        dp_jw_uint(&w, "n_ctx", 512);
        dp_jw_bool(&w, "speculative", false);
        dp_jw_bool(&w, "is_processing", i < s->st.inflight);
        dp_jw_obj_end(&w);
    }
    dp_jw_arr_end(&w);
    net_resp_send(req, 200, "application/json", out.base, out.len, NULL, 0);
    dp_buf_free(&out);
}

static void on_complete(net_req_t *req)
{
    sim_t *s = net_server_data(req->server);
    dp_iovec_t p = req->path;
    if (p.len >= 6 && memcmp(p.base, "/_sim/", 6) == 0) {
        handle_sim(s, req);
        return;
    }
    bool post = method_is(req, "POST");
    bool chat = iov_is(p, "/v1/chat/completions"), cmpl = iov_is(p, "/v1/completions");
    bool resp = s->id.flavor == SIM_FLAVOR_VLLM && iov_is(p, "/v1/responses");
    bool inference = post && (chat || cmpl || resp);
    if (inference)
        s->st.requests++;
    record_request(s, req, inference);

    bool die;
    if (apply_fault(s, req, inference, &die))
        return;
    if (inference) {
        handle_inference(s, req,
                         chat   ? SIM_API_CHAT
                         : resp ? SIM_API_RESPONSES
                                : SIM_API_COMPLETIONS,
                         die);
        return;
    }
    if (chat || cmpl || resp) {
        send_error(req, 405, "invalid_request_error", NULL, "Method Not Allowed");
        return;
    }
    if (s->key && iov_is(p, "/attestation")) {
        if (is_get(req))
            handle_attestation(s, req);
        else
            send_error(req, 405, "invalid_request_error", NULL, "Method Not Allowed");
        return;
    }
    if (s->id.flavor == SIM_FLAVOR_LLAMACPP && is_get(req) && iov_is(p, "/slots")) {
        handle_slots(s, req);
        return;
    }
    dp_buf_t out = {0};
    const char *ctype = NULL;
    int status = is_get(req) ? sim_flavor_get(&s->id, p.base, p.len, &out, &ctype) : 0;
    if (status == 0) {
        dp_buf_reset(&out);
        status = sim_flavor_not_found(&s->id, &out, &ctype);
    }
    net_resp_send(req, status, ctype, out.base ? out.base : "", out.len, NULL, 0);
    dp_buf_free(&out);
}

static void on_abort(net_req_t *req)
{
    job_t *j = req->data;
    if (j == NULL)
        return;
    sim_t *s = j->sim;
    if (!j->hung && j->counted)
        s->st.aborted++;
    dp_jw_t *w = dp_log_begin(DP_LOG_DEBUG, "client_gone");
    if (w) {
        dp_jw_str(w, "request_id", req->id);
        dp_jw_uint(w, "ticks", j->ticks);
        dp_log_end(w);
    }
    j->req = NULL;
    req->data = NULL;
    if (s->finish_abandoned && (!j->rq.stream || j->session) && !j->hung)
        return; /* generates on, counted in flight, until job_finish drops the answer */
    job_close(j);
}

static void on_drain(net_req_t *req)
{
    job_t *j = req->data;
    if (j == NULL || j->closing || !j->paused)
        return;
    j->paused = false;
    job_arm(j, 0);
}

/* ---- lifecycle ----------------------------------------------------------------------------------
 */

static void signal_closed(uv_handle_t *h)
{
    (void)h;
}

static void server_closed(void *data)
{
    sim_t *s = data;
    s->srv = NULL;
}

static void stop(sim_t *s, const char *why)
{
    if (s->stopping)
        return;
    s->stopping = true;
    dp_log_msg(DP_LOG_INFO, "stopping", why);
    /* In-flight requests get on_abort, which closes their jobs; hung jobs too. */
    net_server_close(s->srv, server_closed, s);
    while (s->jobs)
        job_close(s->jobs);
    uv_close((uv_handle_t *)&s->sigterm, signal_closed);
    uv_close((uv_handle_t *)&s->sigint, signal_closed);
    uv_close((uv_handle_t *)&s->sigpipe, signal_closed);
}

static void on_signal(uv_signal_t *h, int signum)
{
    if (signum == SIGPIPE)
        return;
    stop(h->data, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

int sim_run(sim_config_t *cfg)
{
    sim_t *s = dp_xcalloc(1, sizeof(*s));
    int rc = 0;
    s->id = cfg->id;
    memset(&cfg->id, 0, sizeof(cfg->id));
    s->noise = cfg->noise;
    s->token_delay_ms = cfg->token_delay_ms;
    s->finish_abandoned = cfg->finish_abandoned;
    s->fault_remaining = -1;
    if (dp_random_bytes(&s->rng, sizeof(s->rng)) != 0)
        s->rng = dp_now_ns();
    reload_lm(s);

    if (cfg->attest_key_path) {
        dp_buf_t err = {0};
        if (attest_key_load(cfg->attest_key_path, true, &s->key, &err) != 0) {
            fprintf(stderr, "detproxy-sim: --attest-key: %s\n", err.base ? err.base : "?");
            dp_buf_free(&err);
            rc = 2;
            goto out_free;
        }
        dp_buf_free(&err);
    }

    s->loop = dp_xmalloc(sizeof(*s->loop));
    uv_loop_init(s->loop);
    net_handler_t h = {
        .on_head = on_head, .on_complete = on_complete, .on_abort = on_abort, .on_drain = on_drain};
    net_server_limits_t lim;
    net_server_limits_default(&lim);
    s->high_water = lim.write_high_water;
    s->srv = net_server_new(s->loop, &h, s, &lim);
    if (cfg->tls_cert || cfg->tls_key) {
        dp_buf_t terr = {0};
        net_tls_ctx_t *tc = cfg->tls_cert && cfg->tls_key
                                ? net_tls_server_ctx(cfg->tls_cert, cfg->tls_key, NULL, &terr)
                                : NULL;
        if (tc == NULL) {
            dp_log_msg(DP_LOG_ERROR, "tls_failed",
                       terr.base ? terr.base : "--tls-cert and --tls-key go together");
            dp_buf_free(&terr);
            net_server_close(s->srv, server_closed, s);
            uv_run(s->loop, UV_RUN_DEFAULT);
            rc = 3;
            goto out_loop;
        }
        net_server_set_tls(s->srv, tc);
        net_tls_ctx_unref(tc);
    }
    int r = net_server_listen(s->srv, cfg->host, cfg->port);
    if (r != 0) {
        dp_jw_t *w = dp_log_begin(DP_LOG_ERROR, "listen_failed");
        if (w) {
            dp_jw_str(w, "host", cfg->host);
            dp_jw_uint(w, "port", cfg->port);
            dp_jw_str(w, "error", uv_strerror(r));
            dp_log_end(w);
        }
        fprintf(stderr, "detproxy-sim: cannot listen on %s:%u: %s\n", cfg->host, cfg->port,
                uv_strerror(r));
        net_server_close(s->srv, server_closed, s);
        uv_run(s->loop, UV_RUN_DEFAULT);
        rc = 3;
        goto out_loop;
    }

    uv_signal_init(s->loop, &s->sigterm);
    uv_signal_init(s->loop, &s->sigint);
    uv_signal_init(s->loop, &s->sigpipe);
    s->sigterm.data = s->sigint.data = s->sigpipe.data = s;
    uv_signal_start(&s->sigterm, on_signal, SIGTERM);
    uv_signal_start(&s->sigint, on_signal, SIGINT);
    uv_signal_start(&s->sigpipe, on_signal, SIGPIPE);

    uint16_t port = net_server_port(s->srv);
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "listening");
    if (w) {
        dp_buf_t addr = {0};
        dp_buf_printf(&addr, strchr(cfg->host, ':') ? "[%s]:%u" : "%s:%u", cfg->host, port);
        dp_jw_uint(w, "port", port);
        dp_jw_str(w, "addr", addr.base);
        dp_jw_str(w, "service", "detproxy-sim");
        dp_jw_int(w, "pid", getpid());
        dp_jw_str(w, "flavor", sim_flavor_name(s->id.flavor));
        dp_jw_str(w, "model", s->id.model);
        dp_jw_str(w, "framework_version", s->id.framework_version);
        dp_jw_str(w, "quantization", s->id.quantization);
        dp_jw_str(w, "report_quantization", sim_identity_reported_quantization(&s->id));
        dp_jw_str(w, "dtype", s->id.dtype);
        dp_jw_str(w, "checkpoint_sha256", s->id.checkpoint_sha256);
        dp_jw_double(w, "noise", s->noise);
        dp_jw_uint(w, "token_delay_ms", s->token_delay_ms);
        dp_jw_bool(w, "attestation", s->key != NULL);
        dp_log_end(w);
        dp_buf_free(&addr);
    }

    uv_run(s->loop, UV_RUN_DEFAULT);
    dp_log_msg(DP_LOG_INFO, "stopped", NULL);

out_loop:
    uv_loop_close(s->loop);
    free(s->loop);
    s->loop = NULL;
out_free:
    attest_key_free(s->key);
    s->key = NULL;
    for (size_t i = 0; i < REQLOG_SIZE; i++)
        free(s->reqlog[i]);
    free(s->last_inference);
    sim_identity_free(&s->id);
    free(s);
    return rc;
}
