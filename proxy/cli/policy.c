/* `detproxy policy test -c CONFIG [-H 'Name: value']... --body FILE [--path P]`: the policy
 * decision for one request without a replica: the tenant matched, the pool, the body as it
 * would be forwarded, the seed, and the audit line it would write. A refusal prints the same
 * status, code, param and message the proxy would answer with (exit 1). */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/jw.h"
#include "common/util.h"
#include "net/server.h"
#include "policy/policy.h"
#include "proxy/cli/cli.h"

#define MAX_HEADERS 32

static void usage(FILE *f)
{
    fputs(
        "usage: detproxy policy test -c CONFIG [-H 'Name: value']... --body FILE\n"
        "                            [--path /v1/chat/completions|/v1/completions|/v1/responses]\n"
        "\n"
        "Run the policy on one request body exactly as the proxy would, without a replica,\n"
        "and print one JSON object: the tenant matched, the pool, the seed, the overrides,\n"
        "the body as it would be forwarded, and the audit line it would write.\n"
        "A refusal prints {\"status\":N,\"error\":{...}} as the proxy would answer; exit 1.\n"
        "\n"
        "options:\n"
        "  -c, --config FILE   config file (policy and pools)\n"
        "  -H, --header H      a request header, 'Name: value' (repeatable), e.g.\n"
        "                      -H 'Authorization: Bearer sk-...'\n"
        "  --body FILE         the request body ('-' reads stdin)\n"
        "  --path P            the route; default: chat when the body has \"messages\",\n"
        "                      /v1/responses when it has \"input\", else completions\n"
        "  -h, --help          this help\n"
        "\n"
        "exit codes: 0 accepted, 1 refused, 2 usage error, 3 config or file unreadable\n",
        f);
}

static int usage_error(const char *what, const char *arg)
{
    fprintf(stderr, "detproxy policy test: %s%s%s (try --help)\n", what, arg ? ": " : "",
            arg ? arg : "");
    return 2;
}

static int parse_header(const char *s, policy_header_t *h)
{
    const char *colon = strchr(s, ':');
    if (colon == NULL || colon == s)
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
    policy_headers_t hs = {hdrs, nh};
    policy_error_t err;
    const cfg_tenant_t *t = policy_match_tenant(cfg->policy, policy_headers_lookup, &hs, &err);
    if (t == NULL)
        return refused(&err);
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
    dp_sha256_hex(res.body.base, res.body.len, fwd);
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
    dp_jw_raw(&w, "body", res.body.base, res.body.len);
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
    static const struct option opts[] = {
        {"config", required_argument, NULL, 'c'}, {"header", required_argument, NULL, 'H'},
        {"body", required_argument, NULL, 'b'},   {"path", required_argument, NULL, 'p'},
        {"help", no_argument, NULL, 'h'},         {0}};
    const char *config = NULL, *body_path = NULL, *path = NULL;
    policy_header_t hdrs[MAX_HEADERS];
    size_t nh = 0;
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "c:H:h", opts, NULL)) != -1) {
        switch (c) {
        case 'c':
            config = optarg;
            break;
        case 'H':
            if (nh == MAX_HEADERS)
                return usage_error("too many -H", NULL);
            if (parse_header(optarg, &hdrs[nh++]) != 0)
                return usage_error("a header is 'Name: value'", optarg);
            break;
        case 'b':
            body_path = optarg;
            break;
        case 'p':
            if (strcmp(optarg, "/v1/chat/completions") != 0 &&
                strcmp(optarg, "/v1/completions") != 0 && strcmp(optarg, "/v1/responses") != 0)
                return usage_error(
                    "--path is /v1/chat/completions, /v1/completions or /v1/responses", optarg);
            path = optarg;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            return usage_error("unknown or incomplete option", argv[optind - 1]);
        }
    }
    if (optind < argc)
        return usage_error("unexpected argument", argv[optind]);
    if (config == NULL)
        return usage_error("missing -c CONFIG", NULL);
    if (body_path == NULL)
        return usage_error("missing --body FILE", NULL);
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
    int rd = dp_read_file(strcmp(body_path, "-") == 0 ? "/dev/stdin" : body_path,
                          cfg->limits.max_body_bytes, &body);
    if (rd == -EFBIG) {
        /* limits.max_body_bytes: what the proxy's listener would answer. */
        policy_error_t e = {
            .status = 413, .type = "invalid_request_error", .code = "body_too_large"};
        snprintf(e.message, sizeof(e.message), "request body too large");
        rc = refused(&e);
    } else if (rd != 0) {
        fprintf(stderr, "detproxy policy test: cannot read %s: %s\n", body_path, strerror(-rd));
        rc = 3;
    } else {
        rc = run(cfg, hdrs, nh, &body, path);
    }
    dp_buf_free(&body);
    cfg_free(cfg);
    return rc;
}

int px_cmd_policy(int argc, char **argv)
{
    if (argc >= 2 && (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0)) {
        usage(stdout);
        return 0;
    }
    if (argc < 2 || strcmp(argv[1], "test") != 0) {
        fprintf(stderr, "detproxy policy: expected 'test' (try 'detproxy policy test --help')\n");
        return 2;
    }
    return policy_test(argc - 1, argv + 1);
}
