/* OMS bundles (docs/attestation.md §9): the spec's published test vectors (tests/unit/data/oms, see
 * its README) checked the way the spec's validator checks them, and the predicate rules of OMS
 * §5-§6 one at a time on statements built here. Signatures and directories are exercised
 * end-to-end by tests/integration/test_oms.py with bundles signed by the openssl CLI. */
#define _GNU_SOURCE
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attest/oms.h"
#include "common/util.h"

#define D1 "bc9a717db6064a32cbe9eae6fc40651dd6d36ef1757183f590eff2b1765d7ebc"
#define D2 "32dcb1f8e1ae52d5963e56a6ba06ab58b424c15ed2a6b70d2feca1d089370028"
#define ROOT12 "92745110b1ab4368471cbe31664e10174e954b113a3df333db860317b2c6dec4"

static char *vector_path(const char *rel)
{
    char *p = NULL;
    cr_assert(asprintf(&p, "%s/tests/unit/data/oms/v1.0/%s", DP_SOURCE_DIR, rel) > 0);
    return p;
}

/* Parse one vector; returns 0 or -1, the reason in *why. */
static int parse_vector(const char *rel, dp_buf_t *why)
{
    char *p = vector_path(rel);
    dp_buf_t json = {0};
    cr_assert_eq(dp_read_file(p, 1 << 20, &json), 0, "read %s", p);
    oms_bundle_t *b = NULL;
    int rc = oms_bundle_parse(json.base ? json.base : "", json.len, &b, why);
    cr_assert_eq(rc == 0, b != NULL);
    oms_bundle_free(b);
    dp_buf_free(&json);
    free(p);
    return rc;
}

Test(oms_vectors, valid_bundles_parse)
{
    static const struct {
        const char *file;
        oms_method_t method;
        const char *root;
    } v[] = {{"valid/key.bundle.json", OMS_METHOD_KEY, ROOT12},
             {"valid/certificate.bundle.json", OMS_METHOD_CERTIFICATE, ROOT12},
             {"valid/sigstore.bundle.json", OMS_METHOD_SIGSTORE,
              "61d4849d9d90076d6215f4d525f13d6574af8e3f67aef3e6f36fc40a14fdd226"}};
    for (size_t i = 0; i < DP_ARRAY_SIZE(v); i++) {
        char *p = vector_path(v[i].file);
        dp_buf_t json = {0}, why = {0};
        cr_assert_eq(dp_read_file(p, 1 << 20, &json), 0);
        oms_bundle_t *b = NULL;
        cr_assert_eq(oms_bundle_parse(json.base, json.len, &b, &why), 0, "%s: %s", v[i].file,
                     why.base);
        cr_expect_eq(oms_bundle_method(b), v[i].method, "%s", v[i].file);
        /* Two-file models (signme-1, signme-2; ignore-me ignored); the subject is checked
         * against the root digest of the resources at parse. */
        cr_expect_str_eq(oms_bundle_root_digest(b), v[i].root, "%s", v[i].file);
        cr_expect_eq(oms_bundle_resource_count(b), 2);
        oms_bundle_free(b);
        dp_buf_free(&json);
        dp_buf_free(&why);
        free(p);
    }
}

Test(oms_vectors, invalid_bundles_are_refused_with_a_reason)
{
    static const struct {
        const char *file, *reason;
    } v[] = {
        {"invalid/empty.bundle.json", "bundle: empty file"},
        {"invalid/missing-envelope.bundle.json", "bundle.dsseEnvelope: missing"},
        {"invalid/missing-verification-material.bundle.json",
         "bundle.verificationMaterial: missing"},
        {"invalid/missing-tlog-entries.bundle.json", "verificationMaterial.tlogEntries: missing"},
        {"invalid-payload/wrong-predicate.bundle.json",
         "statement.predicateType: expected \"https://model_signing/signature/v1.0\", got "
         "\"https://example.com/wrong-predicate/v1.0\""},
    };
    for (size_t i = 0; i < DP_ARRAY_SIZE(v); i++) {
        dp_buf_t why = {0};
        cr_expect_eq(parse_vector(v[i].file, &why), -1, "%s accepted", v[i].file);
        cr_expect(why.base && strstr(why.base, v[i].reason), "%s: got \"%s\" want \"%s\"",
                  v[i].file, why.base ? why.base : "", v[i].reason);
        dp_buf_free(&why);
    }
}

/* ---- predicate rules on statements built here ------------------------------------------------ */

#define SER_FILES                                                                                  \
    "\"serialization\":{\"method\":\"files\",\"hash_type\":\"sha256\",\"allow_symlinks\":false}"

static void statement_bundle(const char *statement, dp_buf_t *out)
{
    dp_buf_t b64 = {0};
    dp_base64_encode(statement, strlen(statement), &b64);
    dp_buf_printf(out,
                  "{\"mediaType\":\"application/vnd.dev.sigstore.bundle.v0.3+json\","
                  "\"verificationMaterial\":{\"publicKey\":{\"hint\":\"00\"}},"
                  "\"dsseEnvelope\":{\"payload\":\"%.*s\",\"payloadType\":"
                  "\"application/vnd.in-toto+json\",\"signatures\":[{\"sig\":\"AAAA\"}]}}",
                  (int)b64.len, b64.base);
    dp_buf_free(&b64);
}

static void statement_of(const char *root, const char *resources, const char *ser, dp_buf_t *out)
{
    dp_buf_printf(out,
                  "{\"_type\":\"https://in-toto.io/Statement/v1\",\"subject\":[{\"name\":\"m\","
                  "\"digest\":{\"sha256\":\"%s\"}}],\"predicateType\":"
                  "\"https://model_signing/signature/v1.0\",\"predicate\":{\"resources\":[%s],%s}}",
                  root, resources, ser);
}

static int parse_statement(const char *statement, dp_buf_t *why)
{
    dp_buf_t bundle = {0};
    statement_bundle(statement, &bundle);
    oms_bundle_t *b = NULL;
    int rc = oms_bundle_parse(bundle.base, bundle.len, &b, why);
    oms_bundle_free(b);
    dp_buf_free(&bundle);
    return rc;
}

static void expect_refused(const char *root, const char *resources, const char *ser,
                           const char *reason)
{
    dp_buf_t st = {0}, why = {0};
    statement_of(root, resources, ser, &st);
    cr_expect_eq(parse_statement(st.base, &why), -1, "accepted: %s", st.base);
    cr_expect(why.base && strstr(why.base, reason), "got \"%s\" want \"%s\"",
              why.base ? why.base : "", reason);
    dp_buf_free(&st);
    dp_buf_free(&why);
}

#define RES(n, d) "{\"name\":\"" n "\",\"digest\":\"" d "\",\"algorithm\":\"sha256\"}"

Test(oms_rules, a_good_statement_parses)
{
    dp_buf_t st = {0}, why = {0};
    statement_of(ROOT12, RES("signme-1", D1) "," RES("signme-2", D2), SER_FILES, &st);
    cr_assert_eq(parse_statement(st.base, &why), 0, "%s", why.base);
    dp_buf_free(&st);
    dp_buf_free(&why);
}

Test(oms_rules, each_schema_rule_is_a_clear_error)
{
    expect_refused(ROOT12, "", SER_FILES, "predicate.resources: empty");
    expect_refused(ROOT12, RES("signme-2", D2) "," RES("signme-1", D1), SER_FILES,
                   "resources are not sorted by name");
    expect_refused(ROOT12, RES("signme-1", D1) "," RES("signme-1", D1), SER_FILES,
                   "resources are not sorted by name (or repeat one)");
    expect_refused(ROOT12, RES("../signme-1", D1) "," RES("signme-2", D2), SER_FILES,
                   "has a \"..\" component (parent traversal)");
    expect_refused(ROOT12, RES("a/../signme-1", D1), SER_FILES, "parent traversal");
    expect_refused(ROOT12, RES("/etc/passwd", D1), SER_FILES, "absolute");
    expect_refused(ROOT12, RES("./signme-1", D1), SER_FILES, "not normalised");
    expect_refused(ROOT12, RES("a//b", D1), SER_FILES, "empty component");
    expect_refused(ROOT12, RES("signme-1", "abcd") "," RES("signme-2", D2), SER_FILES,
                   "predicate.resources[0].digest: 4 hex digits, sha256 gives 64");
    expect_refused(ROOT12, RES("signme-1", "ABCD"), SER_FILES, "expected lowercase hex");
    expect_refused(ROOT12,
                   "{\"name\":\"signme-1\",\"digest\":\"" D1 "\",\"algorithm\":\"blake2b\"}",
                   SER_FILES, "differs from serialization.hash_type");
    /* The subject must be the root digest of exactly these resources. */
    expect_refused(ROOT12, RES("signme-1", D1), SER_FILES, "is not the root digest");
    expect_refused(ROOT12, RES("signme-1", D1) "," RES("signme-2", D2),
                   "\"serialization\":{\"method\":\"files\",\"hash_type\":\"blake3\","
                   "\"allow_symlinks\":false}",
                   "blake3 is not supported");
    expect_refused(ROOT12, RES("signme-1", D1) "," RES("signme-2", D2),
                   "\"serialization\":{\"method\":\"shards\",\"hash_type\":\"sha256\","
                   "\"allow_symlinks\":false}",
                   "shard_size: missing");
    expect_refused(ROOT12, RES("signme-1", D1) "," RES("signme-2", D2),
                   "\"serialization\":{\"method\":\"files\",\"hash_type\":\"sha256\","
                   "\"shard_size\":10,\"allow_symlinks\":false}",
                   "must be absent when method is \"files\"");
    expect_refused(ROOT12, RES("signme-1", D1) "," RES("signme-2", D2),
                   "\"serialization\":{\"method\":\"files\",\"hash_type\":\"sha256\"}",
                   "allow_symlinks: missing");
    expect_refused(ROOT12, RES("signme-1", D1) "," RES("signme-2", D2),
                   "\"serialization\":{\"method\":\"files\",\"hash_type\":\"sha256\","
                   "\"allow_symlinks\":false,\"ignore_paths\":[\"*.bin\"]}",
                   "glob character");
    expect_refused(ROOT12, RES("signme-1", D1) "," RES("signme-2", D2),
                   "\"serialization\":{\"method\":\"files\",\"hash_type\":\"sha256\","
                   "\"allow_symlinks\":false,\"extra\":1}",
                   "unknown member \"extra\"");
    expect_refused(ROOT12, RES("signme-1", D1) "," RES("signme-2", D2),
                   "\"serialization\":{\"method\":\"tar\",\"hash_type\":\"sha256\","
                   "\"allow_symlinks\":false}",
                   "expected \"files\" or \"shards\"");
}

Test(oms_rules, shard_names)
{
    const char *ser = "\"serialization\":{\"method\":\"shards\",\"hash_type\":\"sha256\","
                      "\"shard_size\":10,\"allow_symlinks\":false}";
    char root[65];
    uint8_t raw[64];
    dp_unhex(D1 D2, 128, raw, 64);
    dp_sha256_hex(raw, 64, root);
    dp_buf_t st = {0}, why = {0};
    /* A colon in a file name: the range is the last two fields. */
    statement_of(root, RES("a:b:0:10", D1) "," RES("a:b:10:15", D2), ser, &st);
    cr_expect_eq(parse_statement(st.base, &why), 0, "%s", why.base);
    dp_buf_free(&st);
    dp_buf_free(&why);
    expect_refused(root, RES("w.bin", D1) "," RES("w.bin:10:15", D2), ser,
                   "expected \"<path>:<start>:<end>\"");
    expect_refused(root, RES("w.bin:0:10", D1) "," RES("w.bin:20:25", D2), ser,
                   "do not cover it contiguously");
    expect_refused(root, RES("w.bin:0:10", D1) "," RES("w.bin:5:10", D2), ser,
                   "not a shard of shard_size 10");
    expect_refused(root, RES("w.bin:0:7", D1) "," RES("w.bin:10:15", D2), ser,
                   "do not cover it contiguously");
}

Test(oms_rules, envelope_and_material)
{
    dp_buf_t why = {0};
    oms_bundle_t *b = NULL;
    const char *two = "{\"mediaType\":\"application/vnd.dev.sigstore.bundle.v0.3+json\","
                      "\"verificationMaterial\":{\"publicKey\":{\"hint\":\"00\"},"
                      "\"certificate\":{\"rawBytes\":\"AAAA\"}},\"dsseEnvelope\":{}}";
    cr_expect_eq(oms_bundle_parse(two, strlen(two), &b, &why), -1);
    cr_expect(strstr(why.base, "more than one of"), "%s", why.base);
    dp_buf_reset(&why);
    const char *mt = "{\"mediaType\":\"application/vnd.dev.sigstore.bundle.v0.1+json\"}";
    cr_expect_eq(oms_bundle_parse(mt, strlen(mt), &b, &why), -1);
    cr_expect(strstr(why.base, "bundle.mediaType: expected"), "%s", why.base);
    dp_buf_reset(&why);
    const char *dup = "{\"mediaType\":\"x\",\"mediaType\":\"y\"}";
    cr_expect_eq(oms_bundle_parse(dup, strlen(dup), &b, &why), -1);
    cr_expect(strstr(why.base, "duplicate member \"mediaType\""), "%s", why.base);
    dp_buf_free(&why);
}

/* ---- the shared hasher's shard boundaries ------------------------------------------------------
 */

static size_t digests_of(const char *dir, const char *name, size_t size, uint64_t shard,
                         dp_buf_t *out)
{
    char p[512];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    cr_assert_not_null(f);
    for (size_t i = 0; i < size; i++)
        fputc((int)(i & 0xff), f);
    fclose(f);
    attest_snapshot_t snap;
    attest_walk_opts_t wo = {.include_hidden = true};
    cr_assert_eq(attest_snapshot_take_opts(dir, &wo, &snap, NULL), 0);
    const attest_file_t *file = NULL;
    for (size_t i = 0; i < snap.count; i++)
        if (strcmp(snap.files[i].relpath, name) == 0)
            file = &snap.files[i];
    cr_assert_not_null(file, "%s listed (dot-names included)", name);
    /* A small read size so shard boundaries fall inside and across reads. */
    attest_hash_opts_t ho = {.read_size = 4096};
    attest_filehasher_t *fh = attest_filehasher_new("SHA256", &ho, NULL);
    cr_assert_not_null(fh);
    dp_buf_reset(out);
    cr_assert_eq(attest_filehasher_file(fh, dir, file, shard, out, NULL), 0);
    attest_filehasher_free(fh);
    attest_snapshot_free(&snap);
    return out->len / 32;
}

Test(oms_hasher, shards_split_exactly)
{
    char dir[] = "/tmp/oms-hasher-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    dp_buf_t d = {0};
    cr_expect_eq(digests_of(dir, ".empty", 0, 0, &d), 1); /* files: the digest of nothing */
    char hex[65];
    dp_hex(d.base, 32, hex);
    cr_expect_str_eq(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    cr_expect_eq(digests_of(dir, ".empty", 0, 1000, &d), 0); /* shards: none */
    cr_expect_eq(digests_of(dir, "exact", 10000, 5000, &d), 2);
    cr_expect_eq(digests_of(dir, "short", 10001, 5000, &d), 3);
    /* Each shard is the digest of its own byte range. */
    uint8_t buf[5000];
    for (size_t i = 0; i < sizeof(buf); i++)
        buf[i] = (uint8_t)((i + 5000) & 0xff);
    uint8_t want[32];
    dp_sha256(buf, sizeof(buf), want);
    cr_expect(memcmp(d.base + 32, want, 32) == 0, "second shard");
    const uint8_t last = 10000 & 0xff;
    dp_sha256(&last, 1, want);
    cr_expect(memcmp(d.base + 64, want, 32) == 0, "last shard, one byte");
    cr_expect_eq(digests_of(dir, "whole", 9999, 0, &d), 1);
    dp_buf_free(&d);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    cr_expect_eq(system(cmd), 0);
}

/* The bundle and its statement are parsed before any signature is checked: hostile JSON. */
static void expect_bundle_refused(const char *json, size_t len, const char *reason)
{
    dp_buf_t why = {0};
    oms_bundle_t *b = NULL;
    cr_expect_eq(oms_bundle_parse(json, len, &b, &why), -1, "accepted (%s)", reason);
    cr_expect(why.base && strstr(why.base, reason), "got \"%s\" want \"%s\"",
              why.base ? why.base : "", reason);
    oms_bundle_free(b);
    dp_buf_free(&why);
}

Test(oms_rules, json_is_parsed_strictly_and_within_a_budget)
{
    dp_buf_t st = {0}, bundle = {0}, why = {0};
    statement_of(ROOT12, RES("signme-1", D1) "," RES("signme-2", D2), SER_FILES, &st);
    statement_bundle(st.base, &bundle);
    /* Data after the document: another reader could see something else. */
    dp_buf_appends(&bundle, " {\"mediaType\":\"x\"}");
    expect_bundle_refused(bundle.base, bundle.len, "bundle: data after the JSON value");
    dp_buf_appends(&st, "{}");
    cr_expect_eq(parse_statement(st.base, &why), -1);
    cr_expect(why.base && strstr(why.base, "statement (the decoded DSSE payload): data after "
                                           "the JSON value"),
              "%s", why.base);
    /* "signme-1\u0000x": cJSON would read "signme-1", a reader keeping the NUL would not. */
    dp_buf_reset(&st);
    dp_buf_reset(&why);
    statement_of(ROOT12, RES("signme-1\\u0000x", D1) "," RES("signme-2", D2), SER_FILES, &st);
    cr_expect_eq(parse_statement(st.base, &why), -1);
    cr_expect(why.base && strstr(why.base, "a string holds \\u0000 (NUL)"), "%s", why.base);
    static const char raw_nul[] = "{\"mediaType\":\"a\0b\"}";
    expect_bundle_refused(raw_nul, sizeof(raw_nul) - 1,
                          "bundle: a control character inside a "
                          "string");
    /* 64 MiB of "0," would be 32M cJSON nodes, gigabytes: refused before parsing. */
    dp_buf_reset(&bundle);
    dp_buf_appends(&bundle, "{\"x\":[");
    for (size_t i = 0; i < ((size_t)2 << 20) + 1; i++)
        dp_buf_append(&bundle, "0,", 2);
    dp_buf_appends(&bundle, "0]}");
    expect_bundle_refused(bundle.base, bundle.len, "bundle: more than 2097152 JSON values");
    dp_buf_free(&st);
    dp_buf_free(&bundle);
    dp_buf_free(&why);
}

/* The publisher's key file (--oms-pubkey, `attest oms verify --pubkey`) follows the rule of every
 * key file detproxy reads (common/pem.h): its PEM block alone. Text around it, or a second key
 * after it, is refused with the reason; whitespace after it is not text. */
Test(oms_trust, a_publisher_key_file_is_its_pem_block_alone)
{
    static const char pub[] = "-----BEGIN PUBLIC KEY-----\n"
                              "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEcPtnmPlDLUiBJbpaz/Oz4JDi8bAo\n"
                              "sz0Eimbc5ZZh+Uv97rxuRuBogIlHTtuM8Jc/NHNkduaC1wE587YS95dw/g==\n"
                              "-----END PUBLIC KEY-----\n";
    static const struct {
        const char *before, *after, *why;
    } files[] = {
        {"garbage\n", "", "text before the PEM block"},
        {"", "garbage\n", "text after the PEM block's END line"},
        {"", pub, "text after the PEM block's END line"},
        {"", "\n \t\r\n", NULL},
    };
    char dir[] = "/tmp/oms-pubkey-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[64];
    snprintf(path, sizeof(path), "%s/publisher.pub", dir);
    for (size_t i = 0; i < DP_ARRAY_SIZE(files); i++) {
        FILE *f = fopen(path, "w");
        cr_assert_not_null(f);
        fprintf(f, "%s%s%s", files[i].before, pub, files[i].after);
        fclose(f);
        oms_trust_t t = {0};
        dp_buf_t err = {0};
        int rc = oms_trust_load_pubkey(&t, path, &err);
        if (files[i].why) {
            cr_expect_eq(rc, -1, "%zu", i);
            cr_expect_null(t.pubkey);
            cr_expect(err.base && strstr(err.base, files[i].why), "%zu: %s", i, err.base);
        } else {
            cr_expect_eq(rc, 0, "%zu: %s", i, err.base);
        }
        oms_trust_free(&t);
        dp_buf_free(&err);
    }
    unlink(path);
    rmdir(dir);
}

/* The trusted root (attest/sigstore.h): the public-good one parses; broken ones are refused with
 * the member named. */
Test(sigstore_root, parse)
{
    char *p = NULL;
    cr_assert(asprintf(&p, "%s/tests/fixtures/sigstore/trusted_root.json", DP_SOURCE_DIR) > 0);
    sigstore_root_t *r = NULL;
    dp_buf_t err = {0};
    cr_assert_eq(sigstore_root_load(p, &r, &err), 0, "%s", err.base);
    sigstore_root_free(r);
    free(p);
    static const struct {
        const char *json, *want;
    } bad[] = {
        {"[]", "not a JSON object"},
        {"{\"mediaType\":\"application/json\"}", "mediaType: expected"},
        {"{\"mediaType\":\"application/vnd.dev.sigstore.trustedroot+json;version=0.1\"}",
         "certificateAuthorities: expected an array"},
        {"{\"mediaType\":\"application/vnd.dev.sigstore.trustedroot+json;version=0.1\","
         "\"tlogs\":[{\"publicKey\":{\"rawBytes\":\"AAAA\"},\"logId\":{\"keyId\":\"AAAA\"}}]}",
         "tlogs[0].logId.keyId: expected 32 bytes"},
        {"{\"mediaType\":\"application/vnd.dev.sigstore.trustedroot+json;version=0.1\","
         "\"tlogs\":[{\"publicKey\":{\"rawBytes\":\"AAAA\"},\"logId\":{\"keyId\":"
         "\"wNI9atQGlz+VWfO6LRygH4QUfY/8W4RFwiT5i5WRgB0=\"}}]}",
         "tlogs[0].publicKey.rawBytes: not a SubjectPublicKeyInfo"},
        {"{\"mediaType\":\"application/vnd.dev.sigstore.trustedroot+json;version=0.1\","
         "\"certificateAuthorities\":[]}",
         "needs at least one of each"},
    };
    for (size_t i = 0; i < DP_ARRAY_SIZE(bad); i++) {
        dp_buf_reset(&err);
        r = NULL;
        cr_expect_eq(sigstore_root_parse(bad[i].json, strlen(bad[i].json), &r, &err), -1);
        cr_expect_null(r);
        cr_expect(err.base && strstr(err.base, bad[i].want), "%s: got %s, want %s", bad[i].json,
                  err.base, bad[i].want);
    }
    dp_buf_free(&err);
}
