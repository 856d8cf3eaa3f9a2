/* `detproxy attest canary -c CONFIG --pool P (--replica R | --url URL) [--json]`: send the pool
 * manifest's canary to one replica exactly as the proxy does (probe/canary.c: the same body
 * bytes, the same client code, the pool's api_key and upstream_tls) and print the expected_sha256
 * to pin, with the text it hashed. Exit 0 when the replica answered (whether or not it matches what
 * is pinned: the output says), 2 for bad flags or values (unknown pool or replica, a manifest
 * without a canary), 3 when the replica could not be asked or did not answer. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "common/args.h"
#include "common/jw.h"
#include "common/util.h"
#include "diagnose/diagnose.h"
#include "net/resolve.h"
#include "net/tls.h"
#include "probe/probe.h"

typedef struct {
    const char *config, *pool, *replica, *url, *accept;
    bool json;
} canary_opts_t;

static const dp_arg_t canary_table[] = {
    {.name = "--config",
     .shortopt = 'c',
     .kind = DP_ARG_STR,
     .off = offsetof(canary_opts_t, config),
     .meta = "CONFIG",
     .help = "the proxy's configuration",
     .flags = DP_ARG_REQUIRED},
    {.name = "--pool",
     .kind = DP_ARG_STR,
     .off = offsetof(canary_opts_t, pool),
     .meta = "P",
     .help = "the pool whose manifest has the canary",
     .flags = DP_ARG_REQUIRED},
    {.name = "--replica",
     .kind = DP_ARG_STR,
     .off = offsetof(canary_opts_t, replica),
     .meta = "R",
     .help = "a replica of that pool, by name"},
    {.name = "--url",
     .kind = DP_ARG_STR,
     .off = offsetof(canary_opts_t, url),
     .meta = "URL",
     .help = "or any replica, by URL (http://host:port[/prefix])"},
    {.name = "--accept",
     .kind = DP_ARG_STR,
     .off = offsetof(canary_opts_t, accept),
     .meta = "N",
     .help = "the canary of the manifest's accept[N] identity (a rollout's new\n"
             "one, when it lists its own canary) instead of the manifest's"},
    {.name = "--json",
     .kind = DP_ARG_FLAG,
     .off = offsetof(canary_opts_t, json),
     .help = "one JSON object instead of text"},
};

static const dp_args_t canary_spec = {
    .prog = "detproxy attest canary",
    .usage = "detproxy attest canary -c CONFIG --pool P (--replica R | --url URL) [--accept N]\n"
             "                              [--json]",
    .about =
        "Send pool P's manifest canary (canary.prompt, max_tokens, temperature 0, seed 0) to one\n"
        "replica exactly as the proxy does, and print the SHA-256 of its output text: the\n"
        "canary.expected_sha256 to pin (docs/attestation.md §6, \"Recording a canary\"). --url\n"
        "asks a replica that is not in the config (a new one, or one found by discovery) with\n"
        "the pool's api_key_file and upstream_tls.",
    .opts = canary_table,
    .nopts = DP_ARRAY_SIZE(canary_table),
    .epilog = "Exit codes: 0 answered, 2 usage (unknown pool or replica, no canary), 3 no answer.",
};

typedef struct {
    uv_loop_t *loop;
    bool done;
    bool answered;
    char *text;
    size_t len;
    char sha256[65];
    char *error;
    int status;
} canary_out_t;

static void on_result(const probe_canary_result_t *res, void *data)
{
    canary_out_t *o = data;
    o->done = true;
    uv_stop(o->loop); /* the idle keep-alive connection would keep the loop running */
    o->answered = res->answered;
    o->status = res->status;
    if (res->answered) {
        o->text = dp_xstrndup(res->text, res->len);
        o->len = res->len;
        memcpy(o->sha256, res->sha256, sizeof(o->sha256));
    } else {
        o->error = dp_xstrdup(res->error ? res->error : "no answer");
    }
}

static void close_cb(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

/* Run the canary against url on a private loop; fills out. 0, or 3 with out->error set. */
static int ask(const cfg_t *cfg, const cfg_pool_t *pool, const cfg_manifest_t *id,
               const cfg_url_t *url, const char *server_name, canary_out_t *out)
{
    uv_loop_t loop;
    if (uv_loop_init(&loop) != 0) {
        out->error = dp_xstrdup("cannot create an event loop");
        return 3;
    }
    int rc = 3;
    net_tls_ctx_t *tls = NULL;
    net_upstream_t *up = NULL;
    struct sockaddr_storage ss;
    if (!net_resolve(url->host, url->port, &ss)) {
        dp_buf_t why = {0};
        dp_buf_printf(&why, "host name '%s' did not resolve", url->host);
        out->error = dp_buf_steal(&why);
        goto out;
    }
    if (url->tls) {
        const cfg_upstream_tls_t *ut = pool->upstream_tls;
        dp_buf_t err = {0};
        tls = net_tls_client_ctx(ut ? ut->ca_file : NULL, ut ? ut->client_cert_file : NULL,
                                 ut ? ut->client_key_file : NULL, &err);
        if (tls == NULL) {
            out->error = dp_buf_steal(&err);
            goto out;
        }
    }
    net_upstream_opts_t o;
    probe_replica_upstream_opts(cfg, &o);
    up = net_upstream_new(&loop, (struct sockaddr *)&ss, &o);
    if (tls)
        net_upstream_set_tls(up, tls, server_name ? server_name : url->host);
    out->loop = &loop;
    const probe_route_t to = {.hostport = url->hostport,
                              .base = url->path,
                              .bearer = pool->api_key,
                              .deadline_ms = probe_answer_deadline_ms(cfg)};
    probe_canary_start(up, pool, id, &to, on_result, out);
    while (!out->done && uv_run(&loop, UV_RUN_DEFAULT) != 0)
        ;
    rc = out->answered ? 0 : 3;
out:
    if (up)
        net_upstream_free(up);
    uv_run(&loop, UV_RUN_DEFAULT); /* idle keep-alive connections finish closing */
    if (uv_loop_close(&loop) == UV_EBUSY) {
        uv_walk(&loop, close_cb, NULL);
        uv_run(&loop, UV_RUN_DEFAULT);
        uv_loop_close(&loop);
    }
    net_tls_ctx_unref(tls);
    return rc;
}

static void names(dp_buf_t *b, const cfg_t *cfg, const cfg_pool_t *pool)
{
    size_t n = pool ? pool->nreplicas : cfg->npools;
    for (size_t i = 0; i < n; i++)
        dp_buf_printf(b, "%s%s", i ? ", " : "", pool ? pool->replicas[i].name : cfg->pools[i].name);
    if (n == 0)
        dp_buf_appends(b, "none");
}

static void print_json(const cfg_manifest_t *id, const char *replica, const char *url,
                       const dp_buf_t *body, const canary_out_t *o, const char *pool_name)
{
    const char *pinned = id->canary->expected_sha256;
    dp_buf_t b = {0};
    dp_jw_t w;
    dp_jw_init(&w, &b);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "pool", pool_name);
    dp_jw_str(&w, "replica", replica);
    dp_jw_str(&w, "identity_fingerprint", id->fingerprint);
    dp_jw_str(&w, "url", url);
    dp_jw_raw(&w, "request", body->base, body->len);
    dp_jw_bool(&w, "answered", o->answered);
    if (o->answered) {
        dp_jw_strn(&w, "text", o->text, o->len);
        dp_jw_str(&w, "expected_sha256", o->sha256);
    } else {
        dp_jw_str(&w, "error", o->error);
    }
    dp_jw_str(&w, "pinned_sha256", pinned);
    if (o->answered && pinned)
        dp_jw_bool(&w, "matches_pinned", strcmp(pinned, o->sha256) == 0);
    else
        dp_jw_null(&w, "matches_pinned");
    dp_jw_obj_end(&w);
    printf("%s\n", b.base);
    dp_buf_free(&b);
}

static void print_text(const char *json_path, const cfg_pool_t *pool, const char *replica,
                       const char *url, const dp_buf_t *body, const canary_out_t *o,
                       const char *pinned)
{
    printf("pool %s, replica %s (%s)\n", pool->name, replica ? replica : "-", url);
    printf("request: POST /v1/completions %s\n", body->base);
    /* The text as a JSON string: whitespace and control bytes are part of what is hashed. */
    dp_buf_t t = {0};
    dp_jw_t w;
    dp_jw_init(&w, &t);
    dp_jw_strn(&w, NULL, o->text, o->len);
    printf("text (%zu bytes, JSON-escaped): %s\n", o->len, t.base);
    dp_buf_free(&t);
    printf("expected_sha256: %s\n", o->sha256);
    if (pinned == NULL)
        printf("manifest: not pinned yet; set %s.canary.expected_sha256 to the value above\n",
               json_path);
    else if (strcmp(pinned, o->sha256) == 0)
        printf("manifest: matches the pinned expected_sha256\n");
    else
        printf("manifest: DIFFERS from the pinned %s (the proxy would not admit this "
               "replica)\n",
               pinned);
}

int dg_cmd_attest_canary(int argc, char **argv)
{
    canary_opts_t o = {0};
    int pr = dp_args_parse(&canary_spec, argc, argv, &o);
    if (pr != 0)
        return dp_args_exit(pr);
    const char *config = o.config, *pool_name = o.pool, *replica = o.replica, *url_s = o.url;
    const char *accept_s = o.accept;
    if ((replica == NULL) == (url_s == NULL))
        return dp_args_usage_error(&canary_spec, "give one of --replica R and --url URL");

    cfg_errors_t errs = {0};
    cfg_t *cfg = NULL;
    int rc = cfg_load(config, &cfg, &errs);
    for (size_t i = 0; i < errs.count; i++)
        fprintf(stderr, "error: %s\n", errs.items[i]);
    cfg_errors_free(&errs); /* warnings are check's business (an unpinned canary is one) */
    if (rc != 0) {
        fprintf(stderr, "detproxy attest canary: invalid config (see 'detproxy check -c %s')\n",
                config);
        return DP_EXIT_FAILED;
    }
    rc = DP_EXIT_USAGE;
    dp_buf_t known = {0}, body = {0}, shown = {0};
    cfg_url_t own = {0};
    canary_out_t out = {0};
    const cfg_pool_t *pool = cfg_pool_by_name(cfg, pool_name);
    if (pool == NULL) {
        names(&known, cfg, NULL);
        fprintf(stderr, "detproxy attest canary: --pool: no pool named '%s' (pools: %s)\n",
                pool_name, known.base);
        goto done;
    }
    size_t pi = (size_t)(pool - cfg->pools);
    const cfg_manifest_t *id = pool->manifest;
    char json_path[64];
    snprintf(json_path, sizeof(json_path), "pools[%zu].manifest", pi);
    if (accept_s) {
        char *end = NULL;
        unsigned long n = strtoul(accept_s, &end, 10);
        id = *end == '\0' && accept_s[0] >= '0' && accept_s[0] <= '9'
                 ? cfg_manifest_identity(pool->manifest, n + 1)
                 : NULL;
        if (id == NULL) {
            dp_args_usage_error(&canary_spec,
                                "--accept %s: pool '%s' lists %zu accepted identit%s (accept[0..])",
                                accept_s, pool_name, pool->manifest ? pool->manifest->naccept : 0,
                                pool->manifest && pool->manifest->naccept == 1 ? "y" : "ies");
            goto done;
        }
        snprintf(json_path, sizeof(json_path), "pools[%zu].manifest.accept[%lu]", pi, n);
    }
    if (id == NULL || id->canary == NULL) {
        fprintf(stderr,
                "detproxy attest canary: pool '%s': its manifest has no canary prompt (add "
                "\"canary\": {\"prompt\": \"...\", \"max_tokens\": 16} to it first)\n",
                pool_name);
        goto done;
    }
    const cfg_url_t *url = NULL;
    const char *server_name = NULL;
    if (replica) {
        for (size_t i = 0; i < pool->nreplicas && url == NULL; i++)
            if (strcmp(pool->replicas[i].name, replica) == 0) {
                url = &pool->replicas[i].url;
                server_name = pool->replicas[i].server_name;
            }
        if (url == NULL) {
            names(&known, cfg, pool);
            fprintf(stderr,
                    "detproxy attest canary: --replica: pool '%s' has no replica named '%s' "
                    "(replicas: %s%s)\n",
                    pool_name, replica, known.base,
                    pool->discovery ? "; discovered replicas: use --url" : "");
            goto done;
        }
    } else {
        const char *why = NULL;
        if (cfg_parse_url(url_s, &own, &why) != 0) {
            dp_args_usage_error(&canary_spec, "--url %s: %s", url_s, why ? why : "invalid URL");
            goto done;
        }
        url = &own;
    }
    dp_buf_printf(&shown, "%s://%s%s", url->tls ? "https" : "http", url->hostport, url->path);
    probe_canary_body(pool, id, &body);
    signal(SIGPIPE, SIG_IGN); /* a replica closing on us is an error code, not a signal */
    rc = ask(cfg, pool, id, url, server_name, &out);
    if (o.json)
        print_json(id, replica, shown.base, &body, &out, pool->name);
    else if (rc == 0)
        print_text(json_path, pool, replica, shown.base, &body, &out, id->canary->expected_sha256);
    if (rc != 0)
        fprintf(stderr, "detproxy attest canary: %s: %s\n", shown.base, out.error);
done:
    free(out.text);
    free(out.error);
    cfg_url_free(&own);
    dp_buf_free(&known);
    dp_buf_free(&body);
    dp_buf_free(&shown);
    cfg_free(cfg);
    return rc;
}
