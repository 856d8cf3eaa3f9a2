/* Strict body validation (through policy_parse) and RFC 8785 canonical JSON (policy_jcs,
 * jcs_es_number). */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "policy/jcs.h"
#include "policy/policy.h"

static policy_req_t *req;

static void setup(void)
{
    req = policy_req_new();
}

static void teardown(void)
{
    policy_req_free(req);
    req = NULL;
}

TestSuite(policy_json, .init = setup, .fini = teardown);

static int parse_n(const char *body, size_t n, policy_error_t *err)
{
    memset(err, 0, sizeof(*err));
    return policy_parse(req, POLICY_ROUTE_CHAT, body, n, err);
}

static int parse(const char *body, policy_error_t *err)
{
    return parse_n(body, strlen(body), err);
}

/* Expect a 400 whose code and message say why. */
static void expect_reject(const char *body, size_t n, const char *code, const char *msg_part)
{
    policy_error_t err;
    cr_assert_eq(parse_n(body, n, &err), -1, "accepted: %.*s", (int)(n > 80 ? 80 : n), body);
    cr_assert_eq(err.status, 400);
    cr_assert_str_eq(err.code, code, "code %s for %.*s", err.code, (int)(n > 80 ? 80 : n), body);
    cr_assert(strstr(err.message, msg_part), "message \"%s\" lacks \"%s\"", err.message, msg_part);
}

static void expect_ok(const char *body)
{
    policy_error_t err;
    cr_assert_eq(parse(body, &err), 0, "rejected %s: %s", body, err.message);
}

Test(policy_json, not_an_object)
{
    const char *bad[] = {"", "   ", "[]", "\"x\"", "1", "null", "[{\"model\":\"m\"}]"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        expect_reject(bad[i], strlen(bad[i]), "invalid_json", "must be a JSON object");
    /* A byte-order mark is not JSON (RFC 8259 §8.1 lets parsers refuse it). */
    expect_reject("\xEF\xBB\xBF{\"model\":\"m\"}", 16, "invalid_json", "must be a JSON object");
}

Test(policy_json, syntax_errors)
{
    const char *bad[] = {
        "{\"model\":\"m\"",
        "{\"model\":\"m\",}",
        "{\"model\" \"m\"}",
        "{model:\"m\"}",
        "{\"model\":\"m\"} x",
        "{\"model\":'m'}",
        "{\"model\":\"m\",\"a\":tru}",
        "{\"model\":\"m\",\"a\":nul}",
        "{\"model\":\"m\",\"a\":[1,]}",
        "{\"model\":\"m\",\"a\":[1 2]}",
        "{\"model\":\"m\"}}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        expect_reject(bad[i], strlen(bad[i]), "invalid_json", "not valid JSON");
    expect_ok(" \t\r\n{ \"model\" : \"m\" } \n");
    /* an empty object closing before any other (once pointer arithmetic on NULL, UBSan) */
    expect_ok("{\"e\":{},\"model\":\"m\",\"a\":[{}]}");
}

Test(policy_json, numbers)
{
    const char *bad[] = {"01",  "1.",       ".5",        "+1",   "-",    "1e", "1e+",
                         "NaN", "Infinity", "-Infinity", "0x10", "1.5e", "--1"};
    char body[128];
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(body, sizeof(body), "{\"model\":\"m\",\"a\":%s}", bad[i]);
        expect_reject(body, strlen(body), "invalid_json", "not valid JSON");
    }
    /* Overflowing a double has no canonical form: refused. Underflow to 0 is fine. */
    expect_reject("{\"model\":\"m\",\"a\":1e400}", 23, "invalid_json", "number out of range");
    char big[400] = "{\"model\":\"m\",\"a\":";
    size_t l = strlen(big);
    memset(big + l, '9', 320);
    strcpy(big + l + 320, "}");
    expect_reject(big, strlen(big), "invalid_json", "number out of range");
    expect_ok("{\"model\":\"m\",\"a\":[1e-400,-0,0.5e308,123456789012345678901234567890,-1.5E+3]}");
    /* overflow decided by strtod near the limit, whatever the spelling */
    expect_ok(
        "{\"model\":\"m\",\"a\":[1.7976931348623157e308,0.00017976931348623157e312,1e-99999]}");
    expect_reject("{\"model\":\"m\",\"a\":1.8e308}", 24, "invalid_json", "number out of range");
    expect_reject("{\"model\":\"m\",\"a\":0.00018e313}", 28, "invalid_json", "number out of range");
    /* number literals are capped at 512 bytes: strtod on megabytes of digits would stall */
    char lim[600] = "{\"model\":\"m\",\"a\":0.";
    size_t ll = strlen(lim);
    memset(lim + ll, '1', 510);
    strcpy(lim + ll + 510, "}");
    expect_ok(lim);
    memset(lim + ll, '1', 511);
    strcpy(lim + ll + 511, "}");
    expect_reject(lim, strlen(lim), "invalid_json", "number too long");
}

Test(policy_json, duplicate_keys_anywhere)
{
    const char *bad[] = {
        /* top level: cJSON would keep the first temperature, Python the last */
        "{\"model\":\"m\",\"temperature\":0,\"temperature\":2}",
        /* nested, in an array of objects, deep */
        "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\",\"role\":\"system\"}]"
        "}",
        "{\"model\":\"m\",\"a\":{\"b\":{\"c\":{\"d\":1,\"e\":2,\"d\":3}}}}",
        "{\"model\":\"m\",\"x\":[[{\"k\":1}],[{\"j\":1,\"k\":2,\"j\":0}]]}",
        /* the same key spelled with escapes */
        "{\"model\":\"m\",\"a\":1,\"\\u0061\":2}",
        "{\"model\":\"m\",\"\\u0074emperature\":1,\"temperature\":0}",
        "{\"model\":\"m\",\"\\ud83d\\ude00\":1,\"\xF0\x9F\x98\x80\":2}",
        "{\"model\":\"m\",\"a\\/b\":1,\"a/b\":2}",
        "{\"model\":\"m\",\"model\":\"n\"}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        expect_reject(bad[i], strlen(bad[i]), "duplicate_key", "duplicate key");
    /* The message shows the key decoded, a control byte escaped (a NUL does not end it), and
     * a long key cut short of a whole character. */
    const char *nul = "{\"model\":\"m\",\"a\\u0000b\":1,\"a\\u0000b\":2}";
    expect_reject(nul, strlen(nul), "duplicate_key", "duplicate key \"a\\u0000b\" at byte");
    char longkey[200], dup[2 * sizeof(longkey) + 32];
    memset(longkey, 0, sizeof(longkey));
    memset(longkey, 'x', 47);
    strcat(longkey, "\xC3\xA9\xC3\xA9"); /* the 48-byte cut falls inside the first e-acute */
    snprintf(dup, sizeof(dup), "{\"model\":\"m\",\"%s\":1,\"%s\":2}", longkey, longkey);
    longkey[47] = '\0';
    char want[sizeof(longkey) + 32];
    snprintf(want, sizeof(want), "duplicate key \"%s\" at byte", longkey);
    expect_reject(dup, strlen(dup), "duplicate_key", want);
    /* Keys that only look alike are distinct. */
    expect_ok("{\"model\":\"m\",\"a\":1,\"A\":2,\"a \":3,\"\\u00e9\":4,\"e\\u0301\":5}");
    /* The same key in sibling objects is not a duplicate. */
    expect_ok("{\"model\":\"m\",\"x\":[{\"k\":1},{\"k\":2}],\"y\":{\"k\":3}}");
}

Test(policy_json, duplicate_keys_large_object)
{
    /* 5000 distinct keys (merge-sort path) then one duplicate at the end. */
    dp_buf_t b = {0};
    dp_buf_appends(&b, "{\"model\":\"m\"");
    for (int i = 0; i < 5000; i++)
        dp_buf_printf(&b, ",\"k%d\":%d", (i * 7919) % 5000, i);
    dp_buf_appends(&b, "}");
    policy_error_t err;
    cr_assert_eq(parse_n(b.base, b.len, &err), 0, "%s", err.message);
    b.len--;
    dp_buf_appends(&b, ",\"k4999\":1}");
    expect_reject(b.base, b.len, "duplicate_key", "\"k4999\"");
    dp_buf_free(&b);
}

static char *nest(int arrays)
{
    /* {"model":"m","a": [[[...]]] } with `arrays` arrays: depth = arrays + 1 */
    size_t n = 20 + 2 * (size_t)arrays;
    char *s = malloc(n + 1), *p = s;
    p += sprintf(p, "{\"model\":\"m\",\"a\":");
    memset(p, '[', (size_t)arrays);
    p += arrays;
    memset(p, ']', (size_t)arrays);
    p += arrays;
    *p++ = '}';
    *p = '\0';
    return s;
}

Test(policy_json, depth_limit)
{
    char *ok = nest(63), *bad = nest(64);
    expect_ok(ok);
    expect_reject(bad, strlen(bad), "invalid_json", "deeper than 64");
    free(ok);
    free(bad);
}

Test(policy_json, depth_bomb)
{
    size_t n = 1000000;
    char *s = malloc(n + 20);
    strcpy(s, "{\"model\":\"m\",\"a\":");
    memset(s + 17, '[', n);
    expect_reject(s, n + 17, "invalid_json", "deeper than 64");
    free(s);
    /* objects too: {"a":{"a":{"a":... */
    dp_buf_t b = {0};
    dp_buf_appends(&b, "{\"model\":\"m\"");
    for (int i = 0; i < 100000; i++)
        dp_buf_appends(&b, ",\"a\":{\"b\":0");
    expect_reject(b.base, b.len, "invalid_json", "deeper than 64");
    dp_buf_free(&b);
}

Test(policy_json, invalid_utf8)
{
    static const struct {
        const char *s;
        size_t n;
    } bad[] = {
#define B(x) {x, sizeof(x) - 1}
        B("{\"model\":\"m\",\"a\":\"\xC3\"}"),             /* truncated 2-byte */
        B("{\"model\":\"m\",\"a\":\"\xC0\x80\"}"),         /* overlong NUL */
        B("{\"model\":\"m\",\"a\":\"\xE0\x80\xAF\"}"),     /* overlong '/' */
        B("{\"model\":\"m\",\"a\":\"\xED\xA0\x80\"}"),     /* UTF-8-encoded surrogate */
        B("{\"model\":\"m\",\"a\":\"\xF4\x90\x80\x80\"}"), /* > U+10FFFF */
        B("{\"model\":\"m\",\"a\":\"\xF8\x88\x80\x80\x80\"}"),
        B("{\"model\":\"m\",\"a\":\"\xFF\"}"),
        B("{\"model\":\"m\",\"a\":\"\x80\"}"),     /* lone continuation */
        B("{\"model\":\"m\",\"a\":\"\xE2\x82\"}"), /* truncated 3-byte */
        B("{\"model\":\"m\",\"\xC3(\":1}"),        /* in a key */
        B("{\"model\":\"\xC3\"}"),
#undef B
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        expect_reject(bad[i].s, bad[i].n, "invalid_json", "invalid UTF-8");
    /* Outside strings any non-ASCII byte is a syntax error. */
    expect_reject("{\"model\":\"m\",\xC3\xA9:1}", 17, "invalid_json", "not valid JSON");
    expect_ok("{\"model\":\"m\",\"a\":\"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\xF4\x8F\xBF\xBF\"}");
}

Test(policy_json, control_characters_and_escapes)
{
    expect_reject("{\"model\":\"m\",\"a\":\"x\ny\"}", 23, "invalid_json", "control character");
    expect_reject("{\"model\":\"m\",\"a\":\"\\x\"}", 22, "invalid_json", "invalid escape");
    expect_reject("{\"model\":\"m\",\"a\":\"\\u12G4\"}", 26, "invalid_json", "invalid \\u escape");
    expect_reject("{\"model\":\"m\",\"a\":\"\\u12\"}", 24, "invalid_json", "escape");
    expect_ok("{\"model\":\"m\",\"a\":\"\\\"\\\\\\/\\b\\f\\n\\r\\t\\u0000\\u00e9\"}");
}

Test(policy_json, lone_surrogates)
{
    const char *bad[] = {
        "{\"model\":\"m\",\"a\":\"\\ud800\"}",        "{\"model\":\"m\",\"a\":\"\\udc00\"}",
        "{\"model\":\"m\",\"a\":\"\\ud800\\u0041\"}", "{\"model\":\"m\",\"a\":\"\\ud800x\"}",
        "{\"model\":\"m\",\"a\":\"\\ud800\\ud800\"}", "{\"model\":\"m\",\"\\udfff\":1}",
        "{\"model\":\"m\",\"a\":\"x\\uDBFF\"}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        expect_reject(bad[i], strlen(bad[i]), "invalid_json", "lone surrogate");
    expect_ok("{\"model\":\"m\",\"a\":\"\\ud83d\\ude00\\uDBFF\\uDFFF\"}");
}

Test(policy_json, model_required)
{
    policy_error_t err;
    const char *bad[] = {"{}",
                         "{\"prompt\":\"x\"}",
                         "{\"model\":5}",
                         "{\"model\":null}",
                         "{\"model\":[\"m\"]}",
                         "{\"model\":\"\"}"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_assert_eq(parse(bad[i], &err), -1, "%s", bad[i]);
        cr_assert_eq(err.status, 400);
        cr_assert_str_eq(err.param, "model");
    }
    cr_assert_eq(parse("{\"model\":\"meta-llama\\/Llama-3.1-8B\"}", &err), 0);
    dp_iovec_t m = policy_model(req);
    cr_assert_eq(m.len, strlen("meta-llama/Llama-3.1-8B"));
    cr_assert_str_eq(m.base, "meta-llama/Llama-3.1-8B");
}

/* Whatever the scanner accepts, cJSON accepts too (the scanner is the stricter of the two), and
 * the two agree on the top-level keys. */
Test(policy_json, stricter_than_cjson)
{
    const char *docs[] = {
        "{\"model\":\"m\",\"a\":[1,2.5,-0,1e-9,{\"b\":null}],\"c\":\"\\u00e9\\n\"}",
        " {\"model\" : \"m\" , \"messages\" : [ ] } ",
        "{\"model\":\"m\",\"x\":{\"y\":{\"z\":[true,false,null]}}}",
    };
    for (size_t i = 0; i < sizeof(docs) / sizeof(docs[0]); i++) {
        policy_error_t err;
        cr_assert_eq(parse(docs[i], &err), 0);
        /* require_null_terminated: the length must cover the NUL. */
        cJSON *j = cJSON_ParseWithLengthOpts(docs[i], strlen(docs[i]) + 1, NULL, 1);
        cr_assert_not_null(j, "cJSON rejects %s", docs[i]);
        cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(j, "model")->valuestring, "m");
        cJSON_Delete(j);
    }
}

/* ---- RFC 8785 ------------------------------------------------------------------------------- */

/* A budget bounds the parse's work, not the body: values count eight units, escapes and
 * characters checked one at a time one each. Over it the parse stops with policy_over_budget
 * (no verdict); the same body parses in full without one, whether it is valid or not. */
Test(policy_json, budget_stops_the_parse_and_is_no_verdict)
{
    dp_buf_t b = {0};
    dp_buf_appends(&b, "{\"model\":\"m\",\"messages\":[");
    for (int i = 0; i < 40; i++)
        dp_buf_appends(&b, i ? ",1" : "1"); /* 40 values */
    dp_buf_appends(&b, "],\"p\":\"");
    for (int i = 0; i < 100; i++)
        dp_buf_appends(&b, "\\n"); /* 100 escapes */
    dp_buf_appends(&b, "\"}");
    policy_error_t err;
    /* 47 values (the 40, the object, the array, 3 keys, 2 strings: 8 units each) and 100
     * escapes: 476 units, 59.5 values' worth */
    policy_req_set_budget(req, 59);
    cr_assert_eq(parse_n(b.base, b.len, &err), -1);
    cr_assert(policy_over_budget(&err), "%s", err.message);
    policy_req_set_budget(req, 60);
    cr_assert_eq(parse_n(b.base, b.len, &err), 0, "%s", err.message);
    cr_assert_not(policy_over_budget(&err));
    /* a refusal within the budget is the body's own; past it, none */
    b.base[b.len - 1] = ',';
    cr_assert_eq(parse_n(b.base, b.len, &err), -1);
    cr_assert_not(policy_over_budget(&err));
    cr_assert_str_eq(err.code, "invalid_json");
    policy_req_set_budget(req, 10);
    cr_assert_eq(parse_n(b.base, b.len, &err), -1);
    cr_assert(policy_over_budget(&err));
    policy_req_set_budget(req, 0);
    cr_assert_eq(parse_n(b.base, b.len, &err), -1);
    cr_assert_str_eq(err.code, "invalid_json");
    cr_assert_eq(err.status, 400);
    dp_buf_free(&b);
}

/* What the budget also charges beyond tokens and escapes: the key sort of an object with
 * many long keys, and long number literals. Each body below fits the budget by its tokens
 * alone and is refused it only for that cost. */
Test(policy_json, budget_charges_key_sorts_and_long_numbers)
{
    policy_error_t err;
    dp_buf_t keys = {0}, nums = {0};
    /* 64 keys of 200 bytes: 12,800 key bytes x 6 levels / 32 = 2,400 units (300 values) */
    dp_buf_appends(&keys, "{\"model\":\"m\",\"messages\":[],\"x\":{");
    for (int i = 0; i < 64; i++) {
        dp_buf_appends(&keys, i ? ",\"" : "\"");
        for (int k = 0; k < 196; k++)
            dp_buf_appendc(&keys, 'k');
        dp_buf_printf(&keys, "%04d\":0", i);
    }
    dp_buf_appends(&keys, "}}");
    /* 40 numbers of 160 digits: 40 x 160 / 8 = 800 units (100 values) */
    dp_buf_appends(&nums, "{\"model\":\"m\",\"messages\":[],\"x\":[");
    for (int i = 0; i < 40; i++) {
        dp_buf_appends(&nums, i ? ",1." : "1.");
        for (int k = 0; k < 158; k++)
            dp_buf_appendc(&nums, (char)('0' + k % 10));
    }
    dp_buf_appends(&nums, "]}");
    policy_req_set_budget(req, 250); /* 2,000 units: more than either body's tokens */
    cr_assert_eq(parse_n(keys.base, keys.len, &err), -1);
    cr_assert(policy_over_budget(&err), "the key sort was not charged");
    policy_req_set_budget(req, 120);
    cr_assert_eq(parse_n(nums.base, nums.len, &err), -1);
    cr_assert(policy_over_budget(&err), "the long numbers were not charged");
    policy_req_set_budget(req, 0);
    cr_assert_eq(parse_n(keys.base, keys.len, &err), 0, "%s", err.message);
    cr_assert_eq(parse_n(nums.base, nums.len, &err), 0, "%s", err.message);
    dp_buf_free(&keys);
    dp_buf_free(&nums);
}

TestSuite(jcs);

static double from_bits(uint64_t b)
{
    double d;
    memcpy(&d, &b, 8);
    return d;
}

Test(jcs, es_number_rfc8785_appendix_b)
{
    static const struct {
        uint64_t bits;
        const char *want;
    } v[] = {
        {0x0000000000000000, "0"},
        {0x8000000000000000, "0"},
        {0x0000000000000001, "5e-324"},
        {0x8000000000000001, "-5e-324"},
        {0x7fefffffffffffff, "1.7976931348623157e+308"},
        {0xffefffffffffffff, "-1.7976931348623157e+308"},
        {0x4340000000000000, "9007199254740992"},
        {0xc340000000000000, "-9007199254740992"},
        {0x4430000000000000, "295147905179352830000"},
        {0x44b52d02c7e14af5, "9.999999999999997e+22"},
        {0x44b52d02c7e14af6, "1e+23"},
        {0x44b52d02c7e14af7, "1.0000000000000001e+23"},
        {0x444b1ae4d6e2ef4e, "999999999999999700000"},
        {0x444b1ae4d6e2ef4f, "999999999999999900000"},
        {0x444b1ae4d6e2ef50, "1e+21"},
        {0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"},
        {0x3eb0c6f7a0b5ed8d, "0.000001"},
        {0x41b3de4355555553, "333333333.3333332"},
        {0x41b3de4355555554, "333333333.33333325"},
        {0x41b3de4355555555, "333333333.3333333"},
        {0x41b3de4355555556, "333333333.3333334"},
        {0x41b3de4355555557, "333333333.33333343"},
        {0xbecbf647612f3696, "-0.0000033333333333333333"},
        {0x43143ff3c1cb0959, "1424953923781206.2"},
        {0x7fffffffffffffff, "null"}, /* NaN: not representable in JSON */
        {0x7ff0000000000000, "null"}, /* Infinity */
    };
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        char out[32];
        size_t n = jcs_es_number(from_bits(v[i].bits), out);
        cr_assert_str_eq(out, v[i].want, "%016llx", (unsigned long long)v[i].bits);
        cr_assert_eq(n, strlen(v[i].want));
    }
}

Test(jcs, es_number_forms)
{
    static const struct {
        double v;
        const char *want;
    } v[] = {
        {1.0, "1"},
        {1e21, "1e+21"},
        {1e20, "100000000000000000000"},
        {0.000001, "0.000001"},
        {1e-7, "1e-7"},
        {-0.0, "0"},
        {123456789012345680000.0, "123456789012345680000"},
        {0.1, "0.1"},
        {0.7, "0.7"},
        {-1.5, "-1.5"},
        {4.35, "4.35"},
        {1.5e300, "1.5e+300"},
        {2e-3, "0.002"},
        {1152921504606846976.0, "1152921504606847000"}, /* 2^60: shortest digits, then zeros */
        {9007199254740993.0, "9007199254740992"},
        {100, "100"},
        {1.2345e-5, "0.000012345"},
        {1.2345e-7, "1.2345e-7"},
        {2.2250738585072014e-308, "2.2250738585072014e-308"},
        {4294967295.0, "4294967295"},
        /* decimal ties at powers of two: the correctly rounded 16 digits do not read back, the
         * neighbour above does (V8 agrees) */
        {5.9604644775390625e-8, "5.960464477539063e-8"},   /* 2^-24 */
        {5.6843418860808015e-14, "5.684341886080802e-14"}, /* 2^-44 */
        {-7.1202363472230444e-307, "-7.120236347223045e-307"},
        {6.1897001964269014e+26, "6.189700196426902e+26"},
    };
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        char out[32];
        jcs_es_number(v[i].v, out);
        cr_assert_str_eq(out, v[i].want, "case %zu", i);
    }
}

static void expect_jcs(const char *in, size_t inlen, const char *want, size_t wantlen)
{
    dp_buf_t out = {0};
    policy_error_t err;
    cr_assert_eq(policy_jcs(in, inlen, &out, &err), 0, "%s", err.message);
    cr_assert_eq(out.len, wantlen, "got %s", out.base);
    cr_assert(memcmp(out.base, want, wantlen) == 0, "got %s", out.base);
    dp_buf_free(&out);
}

#define JCS(in, want) expect_jcs(in, sizeof(in) - 1, want, sizeof(want) - 1)

Test(jcs, rfc8785_section_3_2_2_example)
{
    JCS("{\n  \"numbers\": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],\n"
        "  \"string\": \"\\u20ac$\\u000F\\u000aA'\\u0042\\u0022\\u005c\\\\\\\"\\/\",\n"
        "  \"literals\": [null, true, false]\n}",
        "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],"
        "\"string\":\"\xE2\x82\xAC$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}");
}

Test(jcs, rfc8785_section_3_2_3_sorting)
{
    /* U+1F600 (a surrogate pair in UTF-16) sorts before U+FB33, unlike in UTF-8 byte order. */
    JCS("{\"\\u20ac\": \"Euro Sign\",\"\\r\": \"Carriage Return\",\"\\ufb33\": \"Hebrew Letter "
        "Dalet With Dagesh\",\"1\": \"One\",\"\\ud83d\\ude00\": \"Emoji: Grinning Face\","
        "\"\\u0080\": \"Control\",\"\\u00f6\": \"Latin Small Letter O With Diaeresis\"}",
        "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\xC2\x80\":\"Control\",\"\xC3\xB6\":\"Latin "
        "Small Letter O With Diaeresis\",\"\xE2\x82\xAC\":\"Euro "
        "Sign\",\"\xF0\x9F\x98\x80\":\"Emoji: "
        "Grinning Face\",\"\xEF\xAC\xB3\":\"Hebrew Letter Dalet With Dagesh\"}");
}

Test(jcs, strings_and_nesting)
{
    /* Controls get short or \u00xx escapes, '/' and non-ASCII are written raw, U+2028 raw. */
    JCS("[\"\\u0001\\b\\t\\n\\f\\r\\u001f\\u007f\\/\\u2028\", "
        "{\"b\":[{\"d\":1,\"c\":2}],\"a\":{}}, "
        "[], -0, 1.0, 10E-1, 0.1e1]",
        "[\"\\u0001\\b\\t\\n\\f\\r\\u001f\x7f/"
        "\xE2\x80\xA8\",{\"a\":{},\"b\":[{\"c\":2,\"d\":1}]},[],"
        "0,1,1,1]");
    JCS("{\"a\\u0000b\":\"x\\u0000y\"}", "{\"a\\u0000b\":\"x\\u0000y\"}");
}

Test(jcs, refuses_what_policy_refuses)
{
    dp_buf_t out = {0};
    policy_error_t err;
    cr_assert_eq(policy_jcs("{\"a\":1,\"a\":2}", 13, &out, &err), -1);
    cr_assert_str_eq(err.code, "duplicate_key");
    cr_assert_eq(policy_jcs("[1e999]", 7, &out, &err), -1);
    cr_assert_eq(policy_jcs("\"\\ud800\"", 8, &out, &err), -1);
    dp_buf_free(&out);
}
