/* Response fingerprint rewriting (JSON and SSE, split at every byte boundary) and the audit
 * line. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/util.h"
#include "policy/policy.h"

#define FP "fp_0123456789abcdef"

TestSuite(fp_json);

static void rewrite(const char *in, const char *want, const char *want_prev)
{
    dp_buf_t out = {0};
    char prev[POLICY_FP_PREV_MAX];
    cr_assert_eq(policy_fp_rewrite_json(in, strlen(in), FP, &out, prev, NULL), 1, "%s", in);
    cr_assert_str_eq(out.base, want);
    cr_assert_str_eq(prev, want_prev);
    dp_buf_free(&out);
}

Test(fp_json, replaces_adds_and_reports)
{
    rewrite("{\"id\":\"x\",\"system_fingerprint\":\"fp_replica\",\"choices\":[]}",
            "{\"id\":\"x\",\"system_fingerprint\":\"" FP "\",\"choices\":[]}", "fp_replica");
    rewrite("{\"id\":\"x\", \"system_fingerprint\" : null }\n",
            "{\"id\":\"x\", \"system_fingerprint\" : \"" FP "\" }\n", "");
    rewrite("{\"id\":\"x\",\"choices\":[{\"text\":\"a\"}]}\n",
            "{\"id\":\"x\",\"choices\":[{\"text\":\"a\"}],\"system_fingerprint\":\"" FP "\"}\n",
            "");
    rewrite("{}", "{\"system_fingerprint\":\"" FP "\"}", "");
    rewrite("{ }", "{ \"system_fingerprint\":\"" FP "\"}", "");
    /* an escaped spelling of the key is the key */
    rewrite("{\"system\\u005ffingerprint\":\"a\\\"b\"}",
            "{\"system\\u005ffingerprint\":\"" FP "\"}", "a\"b");
    /* nested copies are the replica's business */
    rewrite("{\"choices\":[{\"system_fingerprint\":\"n\"}],\"system_fingerprint\":\"t\"}",
            "{\"choices\":[{\"system_fingerprint\":\"n\"}],\"system_fingerprint\":\"" FP "\"}",
            "t");
    /* controls in the old value never reach a header */
    rewrite("{\"system_fingerprint\":\"a\\r\\nX-Evil: 1\"}", "{\"system_fingerprint\":\"" FP "\"}",
            "a??X-Evil: 1");
}

Test(fp_json, leaves_non_json_alone)
{
    const char *bad[] = {"", "not json", "[1,2]", "{\"a\":1", "{\"a\":\"\xff\"}", "Internal Error"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        dp_buf_t out = {0};
        char prev[POLICY_FP_PREV_MAX];
        cr_assert_eq(policy_fp_rewrite_json(bad[i], strlen(bad[i]), FP, &out, prev, NULL), 0, "%s",
                     bad[i]);
        cr_assert_eq(out.len, 0);
        dp_buf_free(&out);
    }
    /* Too large for the tape on the stack, and broken after its key: no value reported, as for
     * a small broken body. */
    dp_buf_t big = {0}, out = {0};
    dp_buf_appends(&big, "{\"system_fingerprint\":\"fp_replica\",\"a\":[");
    for (int i = 0; i < 300; i++)
        dp_buf_appends(&big, "0,");
    dp_buf_appends(&big, "0]"); /* no closing brace */
    char prev[POLICY_FP_PREV_MAX];
    memset(prev, 'Z', sizeof(prev));
    cr_assert_eq(policy_fp_rewrite_json(big.base, big.len, FP, &out, prev, NULL), 0);
    cr_assert_str_eq(prev, "");
    cr_assert_eq(out.len, 0);
    dp_buf_free(&big);
    dp_buf_free(&out);
}

Test(fp_json, long_previous_value_truncated)
{
    dp_buf_t in = {0}, out = {0};
    dp_buf_appends(&in, "{\"system_fingerprint\":\"");
    for (int i = 0; i < 300; i++)
        dp_buf_appendc(&in, 'a');
    dp_buf_appends(&in, "\"}");
    char prev[POLICY_FP_PREV_MAX];
    cr_assert_eq(policy_fp_rewrite_json(in.base, in.len, FP, &out, prev, NULL), 1);
    cr_assert_eq(strlen(prev), POLICY_FP_PREV_MAX - 1);
    dp_buf_free(&in);
    dp_buf_free(&out);
}

/* ---- SSE ------------------------------------------------------------------------------------ */

TestSuite(fp_sse);

static const char sse_in[] =
    ": keep-alive comment\n"
    "\n"
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"system_fingerprint\":\"fp_r1\","
    "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"he said \\\"system_fingerprint\\\":"
    "\\\"x\\\" {\"}}]}\n"
    "\n"
    "event: message\n"
    "data: {\"choices\":[{\"delta\":{\"system_fingerprint\":\"nested\"}}],\"system_fingerprint\":"
    "null}\r\n"
    "\r\n"
    /* one event over two data lines (CRLF), a nested key after a comma */
    "data: {\"choices\":[{\"index\":0,\"system_fingerprint\":\"nested\"}],\r\n"
    "data: \"system_fingerprint\":\"fp_multi\"}\r\n"
    "\r\n"
    /* an escaped quote right before the real key: a scanner that mistakes it for the end of
     * the string loses track of which key is top level */
    "data: {\"t\":\"\\\"\",\"system_fingerprint\":\"fp_r\"}\n\n"
    "data:{\"system_fingerprint\" : \"fp_\\u0072\",\"usage\":{\"system_fingerprint_x\":1},"
    "\"system_fingerprin\":2,\"system_fingerprintt\":3}\r\r"
    "data: {\"id\":\"c2\",\"choices\":[]}\n\n"
    "data: {\"system_fingerprint\":7}\n\n"
    "data: [DONE]\n\n";

static const char sse_want[] =
    ": keep-alive comment\n"
    "\n"
    "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"system_fingerprint\":\"" FP "\","
    "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"he said \\\"system_fingerprint\\\":"
    "\\\"x\\\" {\"}}]}\n"
    "\n"
    "event: message\n"
    "data: {\"choices\":[{\"delta\":{\"system_fingerprint\":\"nested\"}}],\"system_fingerprint\":"
    "\"" FP "\"}\r\n"
    "\r\n"
    "data: {\"choices\":[{\"index\":0,\"system_fingerprint\":\"nested\"}],\r\n"
    "data: \"system_fingerprint\":\"" FP "\"}\r\n"
    "\r\n"
    "data: {\"t\":\"\\\"\",\"system_fingerprint\":\"" FP "\"}\n\n"
    "data:{\"system_fingerprint\" : \"" FP "\",\"usage\":{\"system_fingerprint_x\":1},"
    "\"system_fingerprin\":2,\"system_fingerprintt\":3}\r\r"
    "data: {\"id\":\"c2\",\"choices\":[]}\n\n"
    "data: {\"system_fingerprint\":7}\n\n"
    "data: [DONE]\n\n";

static void feed_chunks(const char *in, size_t n, const size_t *cuts, size_t ncuts, dp_buf_t *out,
                        policy_sse_fp_t *s)
{
    size_t pos = 0;
    for (size_t i = 0; i <= ncuts; i++) {
        size_t end = i < ncuts ? cuts[i] : n;
        cr_assert_eq(policy_sse_fp_feed(s, in + pos, end - pos, out), (ssize_t)(end - pos));
        pos = end;
    }
    policy_sse_fp_finish(s, out);
}

static void expect_out(const dp_buf_t *out, const char *what)
{
    cr_assert_eq(out->len, sizeof(sse_want) - 1, "%s: got\n%s", what, out->base);
    cr_assert(memcmp(out->base, sse_want, out->len) == 0, "%s: got\n%s", what, out->base);
}

Test(fp_sse, whole_stream)
{
    policy_sse_fp_t s;
    policy_sse_fp_init(&s, FP);
    dp_buf_t out = {0};
    feed_chunks(sse_in, sizeof(sse_in) - 1, NULL, 0, &out, &s);
    expect_out(&out, "whole");
    cr_assert_eq(s.rewritten, 5);
    cr_assert_str_eq(s.prev, "fp_r1");   /* the first value */
    cr_assert_str_eq(s.alt, "fp_multi"); /* the first that differs from it */
    dp_buf_free(&out);
}

Test(fp_sse, every_split_point)
{
    size_t n = sizeof(sse_in) - 1;
    for (size_t cut = 1; cut < n; cut++) {
        policy_sse_fp_t s;
        policy_sse_fp_init(&s, FP);
        dp_buf_t out = {0};
        feed_chunks(sse_in, n, &cut, 1, &out, &s);
        char what[32];
        snprintf(what, sizeof(what), "cut at %zu", cut);
        expect_out(&out, what);
        cr_assert_str_eq(s.prev, "fp_r1", "%s", what); /* values cut by a read, kept whole */
        cr_assert_str_eq(s.alt, "fp_multi", "%s", what);
        dp_buf_free(&out);
    }
}

Test(fp_sse, byte_by_byte_and_random_chunks)
{
    size_t n = sizeof(sse_in) - 1;
    size_t *cuts = malloc(n * sizeof(size_t));
    for (size_t i = 0; i + 1 < n; i++)
        cuts[i] = i + 1;
    policy_sse_fp_t s;
    policy_sse_fp_init(&s, FP);
    dp_buf_t out = {0};
    feed_chunks(sse_in, n, cuts, n - 1, &out, &s);
    expect_out(&out, "byte by byte");
    dp_buf_free(&out);
    srand(7);
    for (int round = 0; round < 200; round++) {
        size_t nc = 0, pos = 0;
        while (1) {
            pos += 1 + (size_t)rand() % 40;
            if (pos >= n)
                break;
            cuts[nc++] = pos;
        }
        policy_sse_fp_init(&s, FP);
        feed_chunks(sse_in, n, cuts, nc, &out, &s);
        expect_out(&out, "random chunks");
        dp_buf_free(&out);
    }
    free(cuts);
}

Test(fp_sse, held_bytes_are_bounded)
{
    /* A key that keeps matching is held at most until it stops matching (<= 20 bytes). */
    policy_sse_fp_t s;
    policy_sse_fp_init(&s, FP);
    dp_buf_t out = {0};
    const char *p = "data: {\"system_fingerprint";
    policy_sse_fp_feed(&s, p, strlen(p), &out);
    cr_assert_eq(out.len, strlen("data: {"));
    cr_assert(s.held <= 20);
    policy_sse_fp_finish(&s, &out); /* stream cut: hand back what was held */
    cr_assert_str_eq(out.base, p);
    dp_buf_free(&out);
}

/* Feed in two reads split at every point, then end the stream: the bytes that came out. */
static void expect_every_split(const char *in, const char *want, const char *what)
{
    size_t n = strlen(in);
    for (size_t cut = 0; cut <= n; cut++) {
        policy_sse_fp_t s;
        policy_sse_fp_init(&s, FP);
        dp_buf_t out = {0};
        feed_chunks(in, n, &cut, 1, &out, &s);
        dp_buf_appendc(&out, '\0');
        cr_assert_str_eq(out.base, want, "%s, cut at %zu", what, cut);
        dp_buf_free(&out);
    }
}

Test(fp_sse, a_value_cut_by_a_line_break_or_the_end_comes_back_as_it_was)
{
    /* An event broken inside the old value is not JSON; its bytes pass on unchanged. */
    const char *broken = "data: {\"system_fingerprint\":\"ab\\\"c\ndata: def\"}\n\n"
                         "data: {\"system_fingerprint\":\"fp_next\"}\n\n";
    expect_every_split(broken,
                       "data: {\"system_fingerprint\":\"ab\\\"c\ndata: def\"}\n\n"
                       "data: {\"system_fingerprint\":\"" FP "\"}\n\n",
                       "line break");
    expect_every_split("data: {\"system_fingerprint\":\"ab\xc3\xa9",
                       "data: {\"system_fingerprint\":\"ab\xc3\xa9", "end of stream");
    expect_every_split("data: {\"system_fingerprint\":nul\r\r",
                       "data: {\"system_fingerprint\":nul\r\r", "null cut");
}

Test(fp_sse, a_value_longer_than_it_holds_is_replaced_and_its_rest_swallowed)
{
    char in[600], want[600];
    char val[300];
    memset(val, 'v', sizeof(val) - 1);
    val[sizeof(val) - 1] = '\0';
    val[150] = '\\'; /* an escaped quote past what is held */
    val[151] = '"';
    snprintf(in, sizeof(in), "data: {\"system_fingerprint\":\"%s\",\"x\":1}\n\n", val);
    snprintf(want, sizeof(want), "data: {\"system_fingerprint\":\"%s\",\"x\":1}\n\n", FP);
    expect_every_split(in, want, "long value");
    policy_sse_fp_t s;
    policy_sse_fp_init(&s, FP);
    dp_buf_t out = {0};
    feed_chunks(in, strlen(in), NULL, 0, &out, &s);
    cr_assert_eq(strlen(s.prev), POLICY_FP_PREV_MAX - 1); /* its first bytes, recorded */
    cr_assert_eq(s.rewritten, 1);
    dp_buf_free(&out);
    /* cut by a line break once replaced: nothing is held to give back */
    snprintf(in, sizeof(in), "data: {\"system_fingerprint\":\"%.200s\ndata: x\n\n", val + 152);
    snprintf(want, sizeof(want), "data: {\"system_fingerprint\":\"%s\"\ndata: x\n\n", FP);
    expect_every_split(in, want, "long value cut");
}

Test(fp_sse, a_bom_that_starts_the_stream_is_passed_over)
{
    expect_every_split("\xEF\xBB\xBF"
                       "data: {\"system_fingerprint\":\"R\"}\n\n",
                       "\xEF\xBB\xBF"
                       "data: {\"system_fingerprint\":\"" FP "\"}\n\n",
                       "BOM");
    /* only at the start, and only whole: elsewhere the line is no data field */
    expect_every_split("data: 1\n\n\xEF\xBB\xBF"
                       "data: {\"system_fingerprint\":\"R\"}\n\n",
                       "data: 1\n\n\xEF\xBB\xBF"
                       "data: {\"system_fingerprint\":\"R\"}\n\n",
                       "BOM later");
    /* a stream's first byte decides: a line break, then a BOM, makes a line that is no field */
    expect_every_split("\n\xEF\xBB\xBF"
                       "data: {\"system_fingerprint\":\"R\"}\n\n",
                       "\n\xEF\xBB\xBF"
                       "data: {\"system_fingerprint\":\"R\"}\n\n",
                       "BOM after a line");
    /* part of a BOM, then a line break: that line is no field, the next one is read */
    expect_every_split("\xEF\xBB\n"
                       "data: {\"system_fingerprint\":\"R\"}\n\n",
                       "\xEF\xBB\n"
                       "data: {\"system_fingerprint\":\"" FP "\"}\n\n",
                       "part, then a line");
    expect_every_split("\xEF\xBB"
                       "data: {\"system_fingerprint\":\"R\"}\n\n"
                       "data: {\"system_fingerprint\":\"R\"}\n\n",
                       "\xEF\xBB"
                       "data: {\"system_fingerprint\":\"R\"}\n\n"
                       "data: {\"system_fingerprint\":\"" FP "\"}\n\n",
                       "part of a BOM");
}

Test(fp_sse, not_initialised)
{
    policy_sse_fp_t s;
    memset(&s, 0, sizeof(s));
    dp_buf_t out = {0};
    cr_assert_eq(policy_sse_fp_feed(&s, "x", 1, &out), -1);
}

/* ---- audit ---------------------------------------------------------------------------------- */

TestSuite(audit);

Test(audit, one_json_line)
{
    policy_result_t r;
    memset(&r, 0, sizeof(r));
    r.has_seed = true;
    r.seed = 1234;
    r.has_temperature = true;
    r.temperature = 0;
    static const policy_change_t changes[] = {
        {"temperature", POLICY_FORCED, "0.9", "0"},
        {"top_p", POLICY_NORMALIZED, "1", ""},
    };
    r.changes = changes;
    r.nchanges = 2;
    policy_audit_t a = {
        .wall_ms = 1700000000123ull,
        .request_id = "req-1",
        .tenant = "bank",
        .pool = "llama",
        .replica = "r1",
        .fingerprint = FP,
        .upstream_fingerprint = NULL,
        .route = "/v1/chat/completions",
        .model = "m\"x",
        .model_len = 3,
        .result = &r,
        .forwarded_sha256 = "ab",
        .response_sha256 = "cd",
        .status = 200,
    };
    dp_buf_t out = {0};
    policy_audit_line(&a, &out);
    cr_assert_eq(out.base[out.len - 1], '\n');
    cr_assert_null(memchr(out.base, '\n', out.len - 1), "one line");
    cJSON *j = cJSON_ParseWithLengthOpts(out.base, out.len + 1, NULL, 0);
    cr_assert_not_null(j, "%s", out.base);
    cr_assert_str_eq(cJSON_GetObjectItem(j, "time")->valuestring, "2023-11-14T22:13:20.123Z");
    cr_assert_str_eq(cJSON_GetObjectItem(j, "tenant")->valuestring, "bank");
    cr_assert_str_eq(cJSON_GetObjectItem(j, "model")->valuestring, "m\"x");
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(j, "upstream_fingerprint")));
    cr_assert_eq(cJSON_GetObjectItem(j, "seed")->valuedouble, 1234);
    cr_assert_eq(cJSON_GetObjectItem(j, "status")->valueint, 200);
    cJSON *p = cJSON_GetObjectItem(j, "params");
    cr_assert_eq(cJSON_GetArraySize(p), 2);
    cJSON *p0 = cJSON_GetArrayItem(p, 0), *p1 = cJSON_GetArrayItem(p, 1);
    cr_assert_str_eq(cJSON_GetObjectItem(p0, "action")->valuestring, "forced");
    cr_assert_eq(cJSON_GetObjectItem(p0, "before")->valuedouble, 0.9);
    cr_assert_eq(cJSON_GetObjectItem(p0, "after")->valuedouble, 0);
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(p1, "removed")));
    cr_assert_null(cJSON_GetObjectItem(p1, "after"));
    cr_assert_str_eq(cJSON_GetObjectItem(j, "forwarded_body_sha256")->valuestring, "ab");
    cr_assert_null(cJSON_GetObjectItem(j, "error"), "no error member on a served request");
    cJSON_Delete(j);
    dp_buf_free(&out);

    /* a refused request: no result, no pool or replica chosen, no response body received */
    a.result = NULL;
    a.status = 400;
    a.pool = a.replica = a.fingerprint = NULL;
    a.forwarded_sha256 = a.response_sha256 = NULL;
    a.error_code = "policy_violation";
    a.error_param = "logit_bias";
    policy_audit_line(&a, &out);
    j = cJSON_ParseWithLengthOpts(out.base, out.len + 1, NULL, 0);
    cr_assert_not_null(j);
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(j, "seed")));
    cr_assert_eq(cJSON_GetArraySize(cJSON_GetObjectItem(j, "params")), 0);
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(j, "pool")));
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(j, "replica")));
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(j, "response_body_sha256")));
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(j, "forwarded_body_sha256")));
    cJSON *e = cJSON_GetObjectItem(j, "error");
    cr_assert_str_eq(cJSON_GetObjectItem(e, "code")->valuestring, "policy_violation");
    cr_assert_str_eq(cJSON_GetObjectItem(e, "param")->valuestring, "logit_bias");
    cr_assert_null(cJSON_GetObjectItem(j, "method"), "only a refusal from the head has one");
    cJSON_Delete(j);
    dp_buf_free(&out);

    /* refused from the head: the method and path tried, no model */
    a.route = "/generate";
    a.method = "POST";
    a.model = NULL;
    a.status = 404;
    a.error_code = "unpoliced_route";
    a.error_param = NULL;
    policy_audit_line(&a, &out);
    j = cJSON_ParseWithLengthOpts(out.base, out.len + 1, NULL, 0);
    cr_assert_not_null(j);
    cr_assert_str_eq(cJSON_GetObjectItem(j, "method")->valuestring, "POST");
    cr_assert_str_eq(cJSON_GetObjectItem(j, "route")->valuestring, "/generate");
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(j, "model")));
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "error"), "param")));
    cJSON_Delete(j);
    dp_buf_free(&out);

    /* a model name of megabytes (a client's, refused or not): cut at a whole character, its
     * length and hash beside it, so the line stays far below the audit file's line limit */
    size_t big = 2u << 20;
    char *model = malloc(big + 1);
    memset(model, 'x', big);
    memcpy(model + POLICY_AUDIT_MODEL_MAX - 1, "\xc3\xa9", 2); /* é across the cut */
    model[big] = '\0';
    a.method = NULL;
    a.model = model;
    a.model_len = big;
    policy_audit_line(&a, &out);
    cr_assert_lt(out.len, 4096);
    j = cJSON_ParseWithLengthOpts(out.base, out.len + 1, NULL, 0);
    cr_assert_not_null(j);
    const char *cut = cJSON_GetObjectItem(j, "model")->valuestring;
    cr_assert_eq(strlen(cut), POLICY_AUDIT_MODEL_MAX - 1, "the cut leaves no half character");
    cr_assert_eq(memcmp(cut, model, POLICY_AUDIT_MODEL_MAX - 1), 0);
    cr_assert_eq(cJSON_GetObjectItem(j, "model_bytes")->valuedouble, (double)big);
    char sha[65];
    dp_sha256_hex(model, big, sha);
    cr_assert_str_eq(cJSON_GetObjectItem(j, "model_sha256")->valuestring, sha);
    cJSON_Delete(j);
    dp_buf_free(&out);
    free(model);
}
