/* The differential check between the policy module and its oracle (tests/oracle/oracle.h),
 * shared by the libFuzzer target (tests/fuzz/fuzz_policy_oracle.c) and the corpus test
 * (tests/unit/test_oracle_diff.c). Header-only: each includes it once.
 *
 * Input: byte 0 selects route (bits 0-1, mod 3), tenant (bits 2-4, mod 5) and framework with
 * its determinism mode (bits 5-7); the rest is the request body, also checked as a response
 * body. Both implementations must:
 *   - accept and refuse the same bodies, with the same status, error code and parameter;
 *   - forward, when accepted, the very same bytes when nothing changed, and otherwise bodies
 *     whose RFC 8785 forms are equal; set the same seed (derived or not) and the same number
 *     of changes;
 *   - agree on policy_jcs (accept/refuse, and the bytes);
 *   - find the same token usage in the body as a response, fed whole and in two reads, where
 *     both object parsers read JSON alike (the oracle parses the captured object with cJSON,
 *     which takes invalid UTF-8, control bytes as whitespace, numbers like "1." or "+1",
 *     deeper nesting and shorter numbers than the tape does, and reads a number that overflows
 *     a double as inf where the tape refuses it: bodies with non-ASCII or control bytes,
 *     escapes, such numbers, 60-character numbers or 32 brackets are left out);
 *   - rewrite a JSON response's system_fingerprint to the same bytes (the value spliced in,
 *     everything else as the replica sent it), with the same upstream value reported;
 * and the scan without a tape must judge the body as the parse does. */
#ifndef DP_ORACLE_DIFF_H
#define DP_ORACLE_DIFF_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/jdoc.h"
#include "policy/policy.h"
#include "tests/oracle/oracle.h"

static char *diff_deny[] = {"logit_bias", "logprobs"};
static char *diff_allow[] = {"model", "messages", "prompt",     "input", "temperature",
                             "seed",  "stream",   "max_tokens", "top_p", "user"};

static void diff_tenants(cfg_tenant_t t[5])
{
    memset(t, 0, 5 * sizeof(*t));
    /* the bench tenant: force temperature 0, derive a seed */
    t[0].name = "default";
    t[0].rules[CFG_PARAM_TEMPERATURE] = (cfg_rule_t){.has_force = true, .force = 0};
    t[0].rules[CFG_PARAM_SEED] = (cfg_rule_t){.derive = true};
    t[1].name = "bank";
    t[1].rules[CFG_PARAM_TEMPERATURE] = (cfg_rule_t){.has_force = true, .force = 0};
    t[1].rules[CFG_PARAM_TOP_P] = (cfg_rule_t){.has_force = true, .force = 1};
    t[1].rules[CFG_PARAM_SEED] = (cfg_rule_t){.has_force = true, .force = 1234};
    t[1].deny_params = diff_deny;
    t[1].ndeny_params = 2;
    t[2].name = "limits";
    t[2].rules[CFG_PARAM_MAX_TOKENS] =
        (cfg_rule_t){.has_default = true, .def = 64, .has_max = true, .max = 512};
    t[2].rules[CFG_PARAM_TOP_K] =
        (cfg_rule_t){.has_min = true, .min = 1, .has_max = true, .max = 100};
    t[2].rules[CFG_PARAM_N] = (cfg_rule_t){.has_default = true, .def = 1};
    t[2].rules[CFG_PARAM_PRESENCE_PENALTY] =
        (cfg_rule_t){.has_min = true, .min = -1, .has_max = true, .max = 1};
    t[2].rules[CFG_PARAM_FREQUENCY_PENALTY] = (cfg_rule_t){.has_max = true, .max = 0.5};
    t[2].rules[CFG_PARAM_TOP_P] = (cfg_rule_t){.has_max = true, .max = 0.95};
    t[2].rules[CFG_PARAM_SEED] = (cfg_rule_t){.derive = true};
    t[3].name = "open";
    t[4].name = "strict";
    t[4].allow_params = diff_allow;
    t[4].nallow_params = sizeof(diff_allow) / sizeof(diff_allow[0]);
    t[4].rules[CFG_PARAM_TEMPERATURE] =
        (cfg_rule_t){.has_default = true, .def = 0.7, .has_max = true, .max = 1.0};
    t[4].rules[CFG_PARAM_SEED] = (cfg_rule_t){.derive = true};
}

typedef struct {
    const char *fw;
    cfg_determinism_t mode;
} diff_fw_t;

static const diff_fw_t diff_fws[8] = {
    {NULL, CFG_DETERMINISM_NONE},       {"vllm", CFG_DETERMINISM_NONE},
    {"tgi", CFG_DETERMINISM_NONE},      {"sglang", CFG_DETERMINISM_NONE},
    {"llamacpp", CFG_DETERMINISM_NONE}, {"llamacpp", CFG_DETERMINISM_SINGLE_SEQUENCE},
    {"other", CFG_DETERMINISM_NONE},    {"vllm", CFG_DETERMINISM_BATCH_INVARIANT},
};

static int diff_same(const void *a, size_t an, const void *b, size_t bn)
{
    return an == bn && (an == 0 || memcmp(a, b, an) == 0);
}

/* Both canonical forms exist and are equal. */
static int diff_canon_eq(const char *a, size_t an, const char *b, size_t bn)
{
    dp_buf_t ca = {0}, cb = {0};
    policy_error_t err;
    int ok = policy_jcs(a, an, &ca, &err) == 0 && policy_jcs(b, bn, &cb, &err) == 0 &&
             diff_same(ca.base, ca.len, cb.base, cb.len);
    dp_buf_free(&ca);
    dp_buf_free(&cb);
    return ok;
}

/* A maximal run of number characters is a JSON number (cJSON hands such runs to strtod, which
 * also takes "1.", "+1", "01", ".5" and "1e"). */
static bool diff_json_number(const char *p, size_t n)
{
    size_t i = 0;
    if (i < n && p[i] == '-')
        i++;
    if (i >= n || p[i] < '0' || p[i] > '9')
        return false;
    if (p[i] == '0')
        i++;
    else
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
    if (i < n && p[i] == '.') {
        if (++i >= n || p[i] < '0' || p[i] > '9')
            return false;
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
    }
    if (i < n && (p[i] == 'e' || p[i] == 'E')) {
        i++;
        if (i < n && (p[i] == '+' || p[i] == '-'))
            i++;
        if (i >= n || p[i] < '0' || p[i] > '9')
            return false;
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
    }
    return i == n;
}

static bool diff_usage_comparable(const char *p, size_t n)
{
    size_t br = 0;
    bool in_str = false; /* no backslash gets this far: a quote always opens or closes */
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        if (c >= 0x80 || c == '\\' || (c < 0x20 && c != '\t' && c != '\n' && c != '\r'))
            return false; /* cJSON also skips control bytes as whitespace */
        if (c < 0x20 && in_str)
            return false; /* a raw control byte in a string: cJSON takes it, jdoc does not */
        in_str ^= c == '"';
        br += c == '{' || c == '[';
        if (br > 32)
            return false;
    }
    for (size_t i = 0; i < n;) {
        size_t j = i, digits = 0;
        while (j < n && p[j] != '\0' && strchr("0123456789+-.eE", p[j]) != NULL) {
            digits += p[j] >= '0' && p[j] <= '9';
            j++;
        }
        if (j == i) {
            i++;
            continue;
        }
        if (digits && (j - i > 60 || !diff_json_number(p + i, j - i)))
            return false;
        if (digits) { /* one that overflows a double: jdoc refuses it, cJSON reads inf */
            char num[64];
            memcpy(num, p + i, j - i);
            num[j - i] = '\0';
            if (!isfinite(strtod(num, NULL)))
                return false;
        }
        i = j;
    }
    return true;
}

/* Usage fed whole, then in two reads split at cut; as an event stream if sse. The counts
 * stay; an object the body ended inside is let go. */
static void diff_usage(const char *p, size_t n, size_t cut, bool sse, policy_usage_t *whole,
                       policy_usage_t *split)
{
    memset(whole, 0, sizeof(*whole));
    memset(split, 0, sizeof(*split));
    whole->sse = split->sse = sse;
    policy_usage_feed(whole, p, n);
    policy_usage_feed(split, p, cut);
    policy_usage_feed(split, p + cut, n - cut);
    policy_usage_free(whole);
    policy_usage_free(split);
}

static void diff_no_member(void *data, const jdoc_t *d, const jdoc_member_t *m)
{
    (void)data;
    (void)d;
    (void)m;
}

#define DIFF_FAIL(...)                                                                             \
    do {                                                                                           \
        snprintf(why, whylen, __VA_ARGS__);                                                        \
        rc = -1;                                                                                   \
        goto out;                                                                                  \
    } while (0)

/* The same counts found, or none in both. */
static bool diff_usage_same(const policy_usage_t *a, const policy_usage_t *b)
{
    return a->found == b->found && (!a->found || (a->prompt_tokens == b->prompt_tokens &&
                                                  a->completion_tokens == b->completion_tokens));
}

/* 0 when both agree on data; -1 with why set. */
static int diff_check(const uint8_t *data, size_t size, char *why, size_t whylen)
{
    static cfg_tenant_t tenants[5];
    static policy_req_t *req;
    static bool init;
    if (!init) {
        diff_tenants(tenants);
        req = policy_req_new();
        init = true;
    }
    if (size == 0)
        return 0;
    int rc = 0;
    uint8_t sel = data[0];
    const char *body = (const char *)data + 1;
    size_t n = size - 1;
    policy_route_t route = (policy_route_t)((sel & 3) % 3);
    const cfg_tenant_t *t = &tenants[((sel >> 2) & 7) % 5];
    const diff_fw_t *fw = &diff_fws[sel >> 5];
    cfg_manifest_t man = {.framework_name = (char *)fw->fw, .determinism = fw->mode};
    cfg_pool_t pool;
    memset(&pool, 0, sizeof(pool));
    pool.name = "p";
    pool.manifest = fw->fw ? &man : NULL;

    oracle_result_t o = {0};
    dp_buf_t oj = {0}, nj = {0}, of = {0}, nf = {0};
    oracle_police((int)route, body, n, t, &pool, &o);
    policy_result_t res;
    policy_error_t err;
    memset(&err, 0, sizeof(err));
    int nrc = policy_parse(req, route, body, n, &err);
    if (nrc == 0)
        nrc = policy_apply_pool(req, t, &pool, &res, &err);
    if (nrc != o.rc)
        DIFF_FAIL("accept/refuse: new %d (%s), oracle %d (%s)", nrc, err.message, o.rc, o.code);
    if (nrc != 0) {
        if (err.status != o.status || strcmp(err.code ? err.code : "", o.code) != 0 ||
            strcmp(err.param, o.param) != 0)
            DIFF_FAIL("refusal: new %d %s %s, oracle %d %s %s", err.status, err.code, err.param,
                      o.status, o.code, o.param);
    } else {
        dp_iovec_t b = policy_body(req, &res);
        if (res.rewritten != o.rewritten || res.has_seed != o.has_seed ||
            res.seed_derived != o.seed_derived || (res.has_seed && res.seed != o.seed) ||
            res.nchanges != o.nchanges)
            DIFF_FAIL("result: rewritten %d/%d seed %d:%llu/%d:%llu changes %zu/%zu", res.rewritten,
                      o.rewritten, res.has_seed, (unsigned long long)res.seed, o.has_seed,
                      (unsigned long long)o.seed, res.nchanges, o.nchanges);
        size_t sum = 0;
        for (size_t i = 0; i < res.nparts; i++)
            sum += res.parts[i].len;
        if (sum != res.body_len || sum != b.len)
            DIFF_FAIL("parts add up to %zu, body_len %zu", sum, res.body_len);
        if (!res.rewritten) {
            if (!diff_same(b.base, b.len, o.body.base, o.body.len) || b.base != body)
                DIFF_FAIL("untouched body differs");
        } else if (!diff_canon_eq(b.base, b.len, o.body.base, o.body.len)) {
            DIFF_FAIL("forwarded bodies differ canonically:\nnew    %.*s\noracle %.*s",
                      (int)(b.len > 400 ? 400 : b.len), b.base,
                      (int)(o.body.len > 400 ? 400 : o.body.len), o.body.base);
        }
    }
    int jn = policy_jcs(body, n, &nj, &err), jo = oracle_jcs(body, n, &oj);
    if (jn != jo || (jn == 0 && !diff_same(nj.base, nj.len, oj.base, oj.len)))
        DIFF_FAIL("policy_jcs: new %d, oracle %d", jn, jo);
    {
        policy_usage_t a, b;
        int64_t op = 0, oc = 0;
        size_t cut = n ? (size_t)sel * 7919 % (n + 1) : 0;
        diff_usage(body, n, cut, false, &a, &b);
        bool ou = oracle_usage(body, n, &op, &oc);
        if (a.found != b.found || a.prompt_tokens != b.prompt_tokens ||
            a.completion_tokens != b.completion_tokens)
            DIFF_FAIL("usage differs by read split at %zu", cut);
        /* Read as an event stream: the same at any split, and the same as a JSON body where
         * no line ends (a line end is all the two modes read differently). */
        policy_usage_t sa, sb;
        diff_usage(body, n, cut, true, &sa, &sb);
        if (!diff_usage_same(&sa, &sb))
            DIFF_FAIL("event-stream usage differs by read split at %zu", cut);
        if (!memchr(body, '\n', n) && !memchr(body, '\r', n) && !diff_usage_same(&sa, &a))
            DIFF_FAIL("a body without line ends counts differently as an event stream");
        if (diff_usage_comparable(body, n) &&
            (a.found != ou || (ou && (a.prompt_tokens != op || a.completion_tokens != oc))))
            DIFF_FAIL("usage: new %d %lld/%lld, oracle %d %lld/%lld", a.found,
                      (long long)a.prompt_tokens, (long long)a.completion_tokens, ou, (long long)op,
                      (long long)oc);
    }
    static const char fp[] = "fp_0123456789abcdef";
    char pn[POLICY_FP_PREV_MAX], po[POLICY_FP_PREV_MAX];
    policy_usage_t tu;
    memset(&tu, 0, sizeof(tu));
    int fn = policy_fp_rewrite_json(body, n, fp, &nf, pn, &tu);
    int fo = oracle_fp_rewrite_json(body, n, fp, &of, po);
    if (fn != fo)
        DIFF_FAIL("fp_rewrite_json: new %d, oracle %d", fn, fo);
    /* A held body (usage from the parse where it can, then its rewritten bytes teed) counts what
     * the scan of those bytes alone counts. */
    if (fn == 1) {
        policy_usage_t su;
        memset(&su, 0, sizeof(su));
        policy_usage_feed(&tu, nf.base, nf.len);
        policy_usage_feed(&su, nf.base, nf.len);
        if (!diff_usage_same(&tu, &su))
            DIFF_FAIL("usage from the parse %d %lld/%lld, from the scan %d %lld/%lld", tu.found,
                      (long long)tu.prompt_tokens, (long long)tu.completion_tokens, su.found,
                      (long long)su.prompt_tokens, (long long)su.completion_tokens);
    }
    if (fn == 1 && (strcmp(pn, po) != 0 || !diff_same(nf.base, nf.len, of.base, of.len)))
        DIFF_FAIL("fp_rewrite_json bodies or upstream values differ (%s / %s)", pn, po);
    {
        /* The scan without a tape (a large response's) and the parse: the same verdict, error
         * and its byte, and as many top-level members. */
        jdoc_t dp, ds;
        jdoc_init(&dp);
        jdoc_init(&ds);
        int rp = jdoc_parse(&dp, body, n, JDOC_OBJECT_ONLY | JDOC_ALLOW_DUPS);
        uint32_t members = 0;
        int rs = jdoc_scan_top(&ds, body, n, diff_no_member, NULL, &members);
        bool same = rs == rp && (rp == 0 ? members == dp.toks[0].aux
                                         : strcmp(ds.err, dp.err) == 0 && ds.err_at == dp.err_at);
        jdoc_free(&dp);
        jdoc_free(&ds);
        if (!same)
            DIFF_FAIL("jdoc_scan_top: %d, jdoc_parse: %d", rs, rp);
    }
out:
    oracle_result_free(&o);
    dp_buf_free(&oj);
    dp_buf_free(&nj);
    dp_buf_free(&of);
    dp_buf_free(&nf);
    return rc;
}

#endif
