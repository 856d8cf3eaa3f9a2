/* bench-upstream: the one fast upstream every proxy in `make bench` shares.
 *
 * Single-threaded, on the project's own HTTP/1.1 server (net/server.h), so its per-request
 * cost is the server core and nothing else: every answer is a precomputed byte string.
 *
 *   POST /v1/chat/completions, POST /v1/completions
 *       "stream": true absent -> a fixed ~230-byte JSON completion (Content-Length).
 *       "stream": true        -> SSE: --chunks events, one every --interval-ms, each carrying
 *                                "@<CLOCK_MONOTONIC ns at write>" as its content so a client on
 *                                the same host can compute per-chunk transit time; then
 *                                "data: [DONE]". Chunked transfer encoding. A request may set
 *                                its own count and spacing with the headers x-bench-chunks and
 *                                x-bench-interval-ms (scenario 11: thousands of long streams
 *                                at 20 events/s beside scenario 3's short fast ones).
 *   GET /v1/models, GET /version  vLLM's metadata shapes (owned_by "vllm"), so detproxy's vllm
 *                                native adapter attests the replica against a manifest pinning
 *                                model + framework name/version.
 *   GET /health                   200, empty.
 *
 * Usage: bench-upstream --listen HOST:PORT [--listen HOST:PORT ...] [--model NAME]
 *        [--framework-version V] [--chunks N] [--interval-ms MS]   (--help lists them)
 * Several --listen give several "replicas" in one process (shadow scenario). Runs until killed. */
#define _GNU_SOURCE
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <uv.h>

#include "common/args.h"
#include "common/buf.h"
#include "common/util.h"
#include "net/server.h"

#define MAX_LISTEN 8

typedef struct {
    uv_loop_t *loop;
    dp_buf_t models, version, chat, compl ;
    const char *model;
    uint32_t chunks;
    uint32_t interval_ms;
    uint64_t requests, streams;
} up_t;

static up_t U;

/* One streamed response. Freed only in its timer's close callback; req is NULL once the
 * response ended or the client left (on_abort). */
typedef struct {
    uv_timer_t timer;
    net_req_t *req;
    bool chat;
    uint32_t sent;
    uint32_t chunks, interval_ms;
} stream_t;

static bool iov_is(dp_iovec_t v, const char *s)
{
    return strlen(s) == v.len && memcmp(v.base, s, v.len) == 0;
}

/* Does the JSON body ask for "stream": true? A byte scan, not a parse: the upstream must cost
 * far less than any proxy in front of it. Accepts whitespace around the colon. */
static bool wants_stream(const char *p, size_t n)
{
    static const char key[] = "\"stream\"";
    const char *end = p + n;
    while (p < end) {
        const char *k = memmem(p, (size_t)(end - p), key, sizeof(key) - 1);
        if (k == NULL)
            return false;
        const char *q = k + sizeof(key) - 1;
        while (q < end && (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r'))
            q++;
        if (q < end && *q == ':') {
            q++;
            while (q < end && (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r'))
                q++;
            return end - q >= 4 && memcmp(q, "true", 4) == 0;
        }
        p = k + 1;
    }
    return false;
}

static void stream_closed(uv_handle_t *h)
{
    free(h->data);
}

static void stream_close(stream_t *st)
{
    if (st->req) {
        st->req->data = NULL;
        st->req = NULL;
    }
    uv_timer_stop(&st->timer);
    uv_close((uv_handle_t *)&st->timer, stream_closed);
}

static void stream_tick(uv_timer_t *t)
{
    stream_t *st = t->data;
    char ev[512];
    int n;
    if (st->sent < st->chunks) {
        /* The timestamp is taken right before the write: what the client measures is transit
         * (kernel + any proxy), not this process's timer slack. */
        uint64_t ts = uv_hrtime();
        bool last = st->sent + 1 == st->chunks;
        if (st->chat)
            n = snprintf(ev, sizeof(ev),
                         "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\","
                         "\"created\":1732900000,\"model\":\"%s\",\"system_fingerprint\":"
                         "\"fp_bench\",\"choices\":[{\"index\":0,\"delta\":{\"content\":"
                         "\"@%llu\"},\"logprobs\":null,\"finish_reason\":%s}]}\n\n%s",
                         U.model, (unsigned long long)ts, last ? "\"length\"" : "null",
                         last ? "data: [DONE]\n\n" : "");
        else
            n = snprintf(ev, sizeof(ev),
                         "data: {\"id\":\"cmpl-bench\",\"object\":\"text_completion\","
                         "\"created\":1732900000,\"model\":\"%s\",\"system_fingerprint\":"
                         "\"fp_bench\",\"choices\":[{\"index\":0,\"text\":\"@%llu\","
                         "\"logprobs\":null,\"finish_reason\":%s}]}\n\n%s",
                         U.model, (unsigned long long)ts, last ? "\"length\"" : "null",
                         last ? "data: [DONE]\n\n" : "");
        st->sent++;
        net_req_t *req = st->req;
        if (net_resp_write(req, ev, (size_t)n) != 0 || st->req == NULL) {
            if (st->req)
                stream_close(st);
            return; /* on_abort (if due) finds req->data NULL */
        }
        if (!last) {
            uv_timer_start(&st->timer, stream_tick, st->interval_ms, 0);
            return;
        }
    }
    net_req_t *req = st->req;
    req->data = NULL;
    st->req = NULL;
    net_resp_end(req);
    stream_close(st);
}

/* A request header's value as a number in [lo, hi], or def when absent or out of range. */
static uint32_t header_u32(const net_req_t *req, const char *name, uint32_t def, uint32_t lo,
                           uint32_t hi)
{
    const net_header_t *h = net_req_header(req, name);
    if (h == NULL || h->value.len == 0 || h->value.len > 9)
        return def;
    uint32_t v = 0;
    for (size_t i = 0; i < h->value.len; i++) {
        char c = h->value.base[i];
        if (c < '0' || c > '9')
            return def;
        v = v * 10 + (uint32_t)(c - '0');
    }
    return v >= lo && v <= hi ? v : def;
}

static void start_stream(net_req_t *req, bool chat)
{
    net_header_t h[2] = {{DP_IOV("content-type"), DP_IOV("text/event-stream")},
                         {DP_IOV("cache-control"), DP_IOV("no-cache")}};
    if (net_resp_start(req, 200, h, 2, -1) != 0)
        return;
    stream_t *st = dp_xcalloc(1, sizeof(*st));
    uv_timer_init(U.loop, &st->timer);
    st->timer.data = st;
    st->req = req;
    st->chat = chat;
    st->chunks = header_u32(req, "x-bench-chunks", U.chunks, 1, 100000);
    st->interval_ms = header_u32(req, "x-bench-interval-ms", U.interval_ms, 0, 600000);
    req->data = st;
    U.streams++;
    uv_timer_start(&st->timer, stream_tick, st->interval_ms, 0);
}

static net_body_mode_t on_head(net_req_t *req)
{
    return NET_BODY_BUFFER;
}

static void on_complete(net_req_t *req)
{
    static const char json[] = "application/json";
    U.requests++;
    bool post = iov_is(req->method_name, "POST");
    bool chat = iov_is(req->path, "/v1/chat/completions");
    if (post && (chat || iov_is(req->path, "/v1/completions"))) {
        if (wants_stream(req->body.base ? req->body.base : "", req->body.len)) {
            start_stream(req, chat);
            return;
        }
        const dp_buf_t *b = chat ? &U.chat : &U.compl ;
        net_resp_send(req, 200, json, b->base, b->len, NULL, 0);
    } else if (!post && iov_is(req->path, "/v1/models")) {
        net_resp_send(req, 200, json, U.models.base, U.models.len, NULL, 0);
    } else if (!post && iov_is(req->path, "/version")) {
        net_resp_send(req, 200, json, U.version.base, U.version.len, NULL, 0);
    } else if (!post && iov_is(req->path, "/health")) {
        net_resp_send(req, 200, NULL, "", 0, NULL, 0);
    } else {
        net_resp_error(req, 404, "NotFoundError", NULL, NULL, "no such route", NULL, 0);
    }
}

static void on_abort(net_req_t *req)
{
    stream_t *st = req->data;
    if (st)
        stream_close(st);
}

typedef struct {
    const char *listen_store[MAX_LISTEN];
    dp_arg_list_t listens;
    const char *model, *fwv;
    uint64_t chunks, interval_ms;
} upstream_opts_t;

static const dp_arg_t upstream_table[] = {
    {.name = "--listen",
     .kind = DP_ARG_LIST,
     .off = offsetof(upstream_opts_t, listens),
     .meta = "HOST:PORT",
     .help = "a port to serve on, one \"replica\" each (repeatable, up to " DP_ARGS_STR(
         MAX_LISTEN) ")"},
    {.name = "--model",
     .kind = DP_ARG_STR,
     .off = offsetof(upstream_opts_t, model),
     .meta = "NAME",
     .help = "the model name it serves (default bench-model)"},
    {.name = "--framework-version",
     .kind = DP_ARG_STR,
     .off = offsetof(upstream_opts_t, fwv),
     .meta = "V",
     .help = "the vLLM version GET /version reports (default 0.6.3)"},
    {.name = "--chunks",
     .kind = DP_ARG_UINT,
     .off = offsetof(upstream_opts_t, chunks),
     .meta = "N",
     .help = "SSE events per stream (default 20)",
     .min = 1,
     .max = 100000},
    {.name = "--interval-ms",
     .kind = DP_ARG_UINT,
     .off = offsetof(upstream_opts_t, interval_ms),
     .meta = "MS",
     .help = "between two SSE events (default 2)",
     .max = 600000},
};

static const dp_args_t upstream_spec = {
    .prog = "bench-upstream",
    .usage = "bench-upstream --listen HOST:PORT [--listen ...] [--model NAME]\n"
             "       [--framework-version V] [--chunks N] [--interval-ms MS]",
    .about = "The upstream every proxy in `make bench` shares (bench/README.md). Runs until\n"
             "killed.",
    .opts = upstream_table,
    .nopts = DP_ARRAY_SIZE(upstream_table),
};

int main(int argc, char **argv)
{
    upstream_opts_t o = {.model = "bench-model", .fwv = "0.6.3", .chunks = 20, .interval_ms = 2};
    o.listens = DP_ARG_LIST_OF(o.listen_store);
    int r = dp_args_parse(&upstream_spec, argc, argv, &o);
    if (r != 0)
        return dp_args_exit(r);
    if (o.listens.n == 0)
        return dp_args_usage_error(&upstream_spec, "--listen HOST:PORT is required");
    U.model = o.model;
    U.chunks = (uint32_t)o.chunks;
    U.interval_ms = (uint32_t)o.interval_ms;
    const char **listens = o.listens.items;
    size_t nlisten = o.listens.n;
    const char *fwv = o.fwv;
    signal(SIGPIPE, SIG_IGN);

    dp_buf_printf(&U.models,
                  "{\"object\":\"list\",\"data\":[{\"id\":\"%s\",\"object\":\"model\","
                  "\"created\":1732900000,\"owned_by\":\"vllm\",\"root\":\"%s\",\"parent\":null,"
                  "\"max_model_len\":4096}]}",
                  U.model, U.model);
    dp_buf_printf(&U.version, "{\"version\":\"%s\"}", fwv);
    /* ~230 bytes (with model "bench-model"): the shape of a short vLLM answer. */
    dp_buf_printf(&U.chat,
                  "{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion\","
                  "\"model\":\"%s\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\","
                  "\"content\":\"ok\"},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":"
                  "250,\"completion_tokens\":1,\"total_tokens\":251}}",
                  U.model);
    dp_buf_printf(&U.compl,
                  "{\"id\":\"cmpl-1\",\"object\":\"text_completion\","
                  "\"model\":\"%s\",\"choices\":[{\"index\":0,\"text\":\"ok\",\"logprobs\":null,"
                  "\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":250,"
                  "\"completion_tokens\":1,\"total_tokens\":251}}",
                  U.model);

    U.loop = uv_default_loop();
    static const net_handler_t h = {
        .on_head = on_head, .on_complete = on_complete, .on_abort = on_abort};
    net_server_limits_t lim;
    net_server_limits_default(&lim);
    lim.max_connections = 100000;
    lim.client_idle_timeout_ms = 600000;
    lim.max_body_bytes = 64 * 1024 * 1024;
    for (size_t i = 0; i < nlisten; i++) {
        char host[64];
        const char *colon = strrchr(listens[i], ':');
        if (colon == NULL || (size_t)(colon - listens[i]) >= sizeof(host)) {
            fprintf(stderr, "bench-upstream: bad --listen %s\n", listens[i]);
            return 2;
        }
        memcpy(host, listens[i], (size_t)(colon - listens[i]));
        host[colon - listens[i]] = '\0';
        net_server_t *s = net_server_new(U.loop, &h, NULL, &lim);
        int r = net_server_listen(s, host, (uint16_t)atoi(colon + 1));
        if (r != 0) {
            fprintf(stderr, "bench-upstream: listen %s: %s\n", listens[i], uv_strerror(r));
            return 3;
        }
    }
    fprintf(stderr, "bench-upstream: listening (%zu ports), chat body %zu bytes\n", nlisten,
            U.chat.len);
    uv_run(U.loop, UV_RUN_DEFAULT);
    return 0;
}
