/* `detproxy policy test -c CONFIG [-H 'Name: value']... --body FILE [--path P]`: the policy
 * decision for one request without a replica: the tenant matched, the pool, the body as it
 * would be forwarded, the seed, and the audit line it would write. A refusal prints the same
 * status, code, param and message the proxy would answer with (exit 1). */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/args.h"
#include "common/jw.h"
#include "common/util.h"
#include "net/server.h"
#include "net/validate.h"
#include "policy/policy.h"
#include "proxy/cli/cli.h"

#define MAX_HEADERS 32

static int parse_header(const char *s, policy_header_t *h)
{
    const char *colon = strchr(s, ':');
    if (colon == NULL || colon == s)
        return -1;
    for (const char *p = s; p < colon; p++) /* a token (RFC 9110), as the proxy's parser has it */
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
              strchr("!#$%&'*+-.^_`|~", *p) != NULL))
            return -1;
    const char *v = colon + 1;
    while (*v == ' ' || *v == '\t')
        v++;
    size_t vl = strlen(v);
    while (vl > 0 && (v[vl - 1] == ' ' || v[vl - 1] == '\t'))
        vl--;
    h->name = (dp_iovec_t){s, (size_t)(colon - s)};
    h->value = (dp_iovec_t){v, vl};
    return 0;
}

typedef struct {
    policy_header_t items[MAX_HEADERS];
    size_t n;
} headers_t;

typedef struct {
    const char *config, *body, *path;
    headers_t hdrs;
} policy_test_opts_t;

static int add_header(void *dst, const char *v, char *why, size_t n)
{
    headers_t *h = dst;
    if (h->n == MAX_HEADERS)
        return dp_arg_fail(why, n, "at most %d headers", MAX_HEADERS);
    if (parse_header(v, &h->items[h->n]) != 0)
        return dp_arg_fail(why, n, "a header is 'Name: value', got '%s'", v);
    h->n++;
    return 0;
}

static int set_path(void *dst, const char *v, char *why, size_t n)
{
    if (strcmp(v, "/v1/chat/completions") != 0 && strcmp(v, "/v1/completions") != 0 &&
        strcmp(v, "/v1/responses") != 0)
        return dp_arg_fail(why, n,
                           "expected /v1/chat/completions, /v1/completions or /v1/responses, "
                           "got '%s'",
                           v);
    *(const char **)dst = v;
    return 0;
}

static const dp_arg_t policy_test_table[] = {
    {.name = "--config",
     .shortopt = 'c',
     .kind = DP_ARG_STR,
     .off = offsetof(policy_test_opts_t, config),
     .meta = "CONFIG",
     .help = "config file (policy and pools)",
     .flags = DP_ARG_REQUIRED},
    {.name = "--header",
     .shortopt = 'H',
     .kind = DP_ARG_CALL,
     .off = offsetof(policy_test_opts_t, hdrs),
     .meta = "H",
     .help = "a request header, 'Name: value' (repeatable, up to " DP_ARGS_STR(
         MAX_HEADERS) "),\n"
                      "e.g. -H 'Authorization: Bearer sk-...'",
     .cb = add_header},
    {.name = "--body",
     .kind = DP_ARG_STR,
     .off = offsetof(policy_test_opts_t, body),
     .meta = "FILE",
     .help = "the request body ('-' reads stdin)",
     .flags = DP_ARG_REQUIRED},
    {.name = "--path",
     .kind = DP_ARG_CALL,
     .off = offsetof(policy_test_opts_t, path),
     .meta = "P",
     .help = "the route; default: chat when the body has \"messages\",\n"
             "/v1/responses when it has \"input\", else completions",
     .cb = set_path},
};

static const dp_args_t policy_test_spec = {
    .prog = "detproxy policy test",
    .usage =
        "detproxy policy test -c CONFIG [-H 'Name: value']... --body FILE\n"
        "                            [--path /v1/chat/completions|/v1/completions|/v1/responses]",
    .about =
        "Run the policy on one request body exactly as the proxy would, without a replica,\n"
        "and print one JSON object: the tenant matched, the pool, the seed, the overrides,\n"
        "the body as it would be forwarded, and the audit line it would write\n"
        "(docs/policy.md). A refusal prints {\"status\":N,\"error\":{...}} as the proxy would\n"
        "answer; exit 1.",
    .opts = policy_test_table,
    .nopts = DP_ARRAY_SIZE(policy_test_table),
    .epilog = "exit codes: 0 accepted, 1 refused, 2 usage error, 3 config or file unreadable",
};

/* Print a refusal as the proxy answers it: {"status":N,"error":{...}}. */
static int refused(const policy_error_t *e)
{
    /* The proxy's own error writer, so the bytes are those a client would get. */
    dp_buf_t err = {0}, b = {0};
    net_error_body(&err, net_error_type_for_status(e->status), e->code,
                   e->param[0] ? e->param : NULL, e->message); /* {"error":{...}} */
    dp_buf_printf(&b, "{\"status\":%d,", e->status);
    dp_buf_append(&b, err.base + 1, err.len - 1);
    dp_buf_appendc(&b, '\n');
    dp_buf_free(&err);
    fwrite(b.base, 1, b.len, stdout);
    dp_buf_free(&b);
    return 1;
}

static int run(const cfg_t *cfg, const policy_header_t *hdrs, size_t nh, const dp_buf_t *body,
               const char *path)
{
    /* The head as the proxy's scanner reads it: a name or value it refuses (a control
     * character, a space in a name) is refused here as there, before anything else. */
    dp_buf_t head = {0};
    dp_buf_appends(&head, "POST /v1/completions HTTP/1.1\r\n");
    for (size_t i = 0; i < nh; i++)
        dp_buf_printf(&head, "%.*s: %.*s\r\n", (int)hdrs[i].name.len, hdrs[i].name.base,
                      (int)hdrs[i].value.len, hdrs[i].value.base);
    dp_buf_appends(&head, "\r\n");
    net_head_scan_t scan = {.max_bytes = cfg->limits.max_header_bytes,
                            .max_headers = cfg->limits.max_headers};
    size_t used;
    int status;
    const char *reason = NULL;
    int scanned = net_head_scan(&scan, head.base, head.len, &used, &status, &reason);
    dp_buf_free(&head);
    if (scanned != NET_SCAN_DONE) {
        policy_error_t e = {.status = scanned == NET_SCAN_ERROR ? status : 400,
                            .type = "invalid_request_error",
                            .code = status == 431 ? "headers_too_large" : "bad_request"};
        snprintf(e.message, sizeof(e.message), "%s", reason ? reason : "malformed request head");
        return refused(&e);
    }
    policy_headers_t hs = {hdrs, nh};
    policy_error_t err;
    const cfg_tenant_t *t = policy_match_tenant(cfg->policy, policy_headers_lookup, &hs, &err);
    if (t == NULL)
        return refused(&err);
    /* What the proxy refuses from the headers alone, before policing a body. */
    for (size_t i = 0; i < nh; i++) {
        net_header_t h = {hdrs[i].name, hdrs[i].value};
        if (net_content_coded(&h, 1)) {
            policy_error_t e = {.status = 415,
                                .type = "invalid_request_error",
                                .code = "unsupported_content_encoding"};
            snprintf(e.message, sizeof(e.message), "%s", NET_CODED_BODY_MESSAGE);
            return refused(&e);
        }
    }
    static const char *const paths[] = {"/v1/completions", "/v1/chat/completions", "/v1/responses"};
    policy_route_t route = POLICY_ROUTE_COMPLETIONS;
    if (path == NULL) {
        cJSON *j = cJSON_ParseWithLength(body->base ? body->base : "", body->len);
        if (cJSON_GetObjectItemCaseSensitive(j, "messages") != NULL)
            route = POLICY_ROUTE_CHAT;
        else if (cJSON_GetObjectItemCaseSensitive(j, "input") != NULL)
            route = POLICY_ROUTE_RESPONSES;
        cJSON_Delete(j);
    } else {
        for (int i = 0; i < 3; i++)
            if (strcmp(path, paths[i]) == 0)
                route = (policy_route_t)i;
    }
    policy_req_t *r = policy_req_new();
    policy_result_t res;
    const cfg_pool_t *pool;
    int rc = 0;
    if (policy_decide(cfg, t, r, route, body->base, body->len, &pool, &res, &err) != 0) {
        rc = refused(&err);
        goto done;
    }
    char fp[20], fwd[65];
    cfg_manifest_fingerprint(pool->manifest, fp);
    dp_iovec_t sent = policy_body(r, &res);
    dp_sha256_hex(sent.base, sent.len, fwd);
    dp_buf_t out = {0};
    dp_jw_t w;
    dp_jw_init(&w, &out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_int(&w, "status", 200);
    dp_jw_str(&w, "tenant", t->name);
    dp_jw_str(&w, "pool", pool->name);
    dp_jw_str(&w, "fingerprint", fp);
    dp_jw_str(&w, "route", paths[route]);
    if (res.has_seed)
        dp_jw_uint(&w, "seed", res.seed);
    else
        dp_jw_null(&w, "seed");
    dp_jw_bool(&w, "seed_derived", res.seed_derived);
    dp_jw_bool(&w, "rewritten", res.rewritten);
    /* The body is valid JSON (policy wrote or validated it): embed it as it would be sent. */
    dp_jw_raw(&w, "body", sent.base, sent.len);
    dp_jw_bool(&w, "audited", t->audit);
    /* The line the proxy would append for an audited tenant. Replica, status and response
     * hash are the replica's to give: null here, and status as a success would have it. */
    policy_audit_t a = {
        .wall_ms = dp_wall_ms(),
        .request_id = "policy-test",
        .tenant = t->name,
        .pool = pool->name,
        .fingerprint = fp,
        .route = paths[route],
        .model = res.model.base,
        .model_len = res.model.len,
        .result = &res,
        .forwarded_sha256 = fwd,
        .status = 200,
    };
    dp_buf_t line = {0};
    policy_audit_line(&a, &line);
    dp_jw_raw(&w, "audit_line", line.base, line.len - 1 /* its newline */);
    dp_buf_free(&line);
    dp_jw_obj_end(&w);
    dp_buf_appendc(&out, '\n');
    fwrite(out.base, 1, out.len, stdout);
    dp_buf_free(&out);
done:
    policy_req_free(r);
    return rc;
}

static int policy_test(int argc, char **argv)
{
    policy_test_opts_t o = {0};
    int r = dp_args_parse(&policy_test_spec, argc, argv, &o);
    if (r != 0)
        return dp_args_exit(r);
    const char *config = o.config, *body_path = o.body;
    cfg_errors_t errs = {0};
    cfg_t *cfg = NULL;
    if (cfg_load(config, &cfg, &errs) != 0) {
        for (size_t i = 0; i < errs.count; i++)
            fprintf(stderr, "error: %s\n", errs.items[i]);
        cfg_errors_free(&errs);
        return 3;
    }
    cfg_errors_free(&errs);
    dp_buf_t body = {0};
    int rc;
    int rd = dp_read_input(body_path, cfg->limits.max_body_bytes, &body);
    if (rd == -EFBIG) {
        /* limits.max_body_bytes: what the proxy's listener would answer. */
        policy_error_t e = {
            .status = 413, .type = "invalid_request_error", .code = "body_too_large"};
        snprintf(e.message, sizeof(e.message), "request body too large");
        rc = refused(&e);
    } else if (rd != 0) {
        fprintf(stderr, "detproxy policy test: cannot read %s: %s\n", body_path,
                dp_input_strerror(rd));
        rc = 3;
    } else {
        rc = run(cfg, o.hdrs.items, o.hdrs.n, &body, o.path);
    }
    dp_buf_free(&body);
    cfg_free(cfg);
    return rc;
}

int px_cmd_policy(int argc, char **argv)
{
    if (argc >= 2 && (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0)) {
        dp_args_help(&policy_test_spec, stdout);
        return 0;
    }
    if (argc < 2 || strcmp(argv[1], "test") != 0) {
        fprintf(stderr, "detproxy policy: expected 'test' (try 'detproxy policy test --help')\n");
        return 2;
    }
    return policy_test(argc - 1, argv + 1);
}
