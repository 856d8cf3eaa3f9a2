/* Manifest match (docs/configuration.md "Manifest"), admission, canary history
 * (docs/attestation.md §6), payload and report JSON. */
#include <criterion/criterion.h>

#include <string.h>

#include "attest/match.h"
#include "common/util.h"

#define H1 "ab12cd34ab12cd34ab12cd34ab12cd34ab12cd34ab12cd34ab12cd34ab12cd34"
#define H2 "cd34ef56cd34ef56cd34ef56cd34ef56cd34ef56cd34ef56cd34ef56cd34ef56"

static cfg_manifest_t full_manifest(void)
{
    cfg_manifest_t m = {0};
    m.model = "meta-llama/Llama-3.1-8B-Instruct";
    m.checkpoint_sha256 = H2;
    m.quantization = "awq";
    m.dtype = "float16";
    m.framework_name = "vllm";
    m.framework_version = "0.6.3";
    return m;
}

static void agent_report(attest_report_t *r)
{
    memset(r, 0, sizeof(*r));
    attest_report_set(r, ATTEST_F_MODEL, "meta-llama/Llama-3.1-8B-Instruct");
    attest_report_set(r, ATTEST_F_CHECKPOINT, H2);
    attest_report_set(r, ATTEST_F_QUANTIZATION, "awq");
    attest_report_set(r, ATTEST_F_DTYPE, "float16");
    attest_report_set(r, ATTEST_F_FRAMEWORK_NAME, "vllm");
    attest_report_set(r, ATTEST_F_FRAMEWORK_VERSION, "0.6.3");
    strcpy(r->source, "agent");
    r->is_signed = true;
}

Test(attest_match, exact_match_admits)
{
    cfg_manifest_t m = full_manifest();
    attest_report_t r;
    agent_report(&r);
    attest_reasons_t why = {0};
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 0);
    cr_assert_eq(attest_admit(&m, &r, true, &why), 0);
    cr_assert_eq(why.count, 0);
    cr_assert_eq(attest_manifest_match(NULL, &r, &why), 0, "no manifest pins nothing");
    attest_report_clear(&r);
}

Test(attest_match, one_reason_per_mismatch)
{
    cfg_manifest_t m = full_manifest();
    attest_report_t r;
    agent_report(&r);
    attest_report_set(&r, ATTEST_F_CHECKPOINT, H1);
    attest_report_set(&r, ATTEST_F_DTYPE, "bfloat16");
    attest_report_set(&r, ATTEST_F_FRAMEWORK_VERSION, "0.6.2");
    attest_reasons_t why = {0};
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 3);
    cr_assert_eq(why.count, 3);
    cr_assert_str_eq(why.items[0], "checkpoint_sha256 mismatch: got ab12cd34.. want cd34ef56..");
    cr_assert_str_eq(why.items[1], "dtype mismatch: got bfloat16 want float16");
    cr_assert_str_eq(why.items[2], "framework.version mismatch: got 0.6.2 want 0.6.3");
    dp_buf_t joined = {0};
    attest_reasons_join(&why, "; ", &joined);
    cr_assert(strstr(joined.base, "; dtype mismatch"));
    dp_buf_free(&joined);
    attest_reasons_free(&why);
    attest_report_clear(&r);
}

Test(attest_match, match_is_exact_not_case_or_prefix)
{
    cfg_manifest_t m = {0};
    m.quantization = "awq";
    m.model = "llama";
    attest_report_t r;
    agent_report(&r);
    attest_report_set(&r, ATTEST_F_QUANTIZATION, "AWQ");
    attest_report_set(&r, ATTEST_F_MODEL, "llama-2");
    attest_reasons_t why = {0};
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 2);
    attest_reasons_free(&why);
    attest_report_clear(&r);
}

Test(attest_match, pinned_but_unreported_fails_closed)
{
    cfg_manifest_t m = full_manifest();
    attest_report_t r = {0};
    strcpy(r.source, "vllm");
    attest_report_set(&r, ATTEST_F_MODEL, m.model);
    attest_report_set(&r, ATTEST_F_FRAMEWORK_NAME, "vllm");
    attest_report_set(&r, ATTEST_F_FRAMEWORK_VERSION, "0.6.3");
    attest_report_set_unattested(&r, ATTEST_F_CHECKPOINT, "vllm exposes no content hash");
    attest_reasons_t why = {0};
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 3);
    cr_assert_str_eq(why.items[0], "checkpoint_sha256 unattested (vllm exposes no content hash)");
    cr_assert_str_eq(why.items[1], "quantization unattested (vllm adapter does not report it)");
    cr_assert_str_eq(why.items[2], "dtype unattested (vllm adapter does not report it)");
    attest_reasons_free(&why);

    /* An agent that leaves a field out is named as such. */
    attest_report_clear(&r);
    agent_report(&r);
    attest_report_set(&r, ATTEST_F_QUANTIZATION, NULL);
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 1);
    cr_assert_str_eq(why.items[0], "quantization unattested (agent did not report it)");
    attest_reasons_free(&why);
    attest_report_clear(&r);
}

Test(attest_match, require_signature_rejects_unsigned_sources)
{
    cfg_manifest_t m = {0};
    m.model = "m";
    attest_report_t r = {0};
    strcpy(r.source, "tgi");
    attest_report_set(&r, ATTEST_F_MODEL, "m");
    attest_reasons_t why = {0};
    cr_assert_eq(attest_admit(&m, &r, false, &why), 0);
    cr_assert_eq(attest_admit(&m, &r, true, &why), 1);
    cr_assert_str_eq(
        why.items[0],
        "unsigned attestation (tgi adapter) but attestation.require_signature is true");
    attest_reasons_free(&why);
    attest_report_clear(&r);
}

Test(attest_match, reasons_sanitise_replica_values)
{
    cfg_manifest_t m = {0};
    m.model = "m";
    attest_report_t r = {0};
    char longv[200];
    memset(longv, 'x', sizeof(longv));
    longv[199] = '\0';
    longv[3] = '\n';
    attest_report_set(&r, ATTEST_F_MODEL, longv);
    attest_reasons_t why = {0};
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 1);
    cr_assert_null(strchr(why.items[0], '\n'));
    cr_assert(strstr(why.items[0], "xxx?xxx"));
    cr_assert(strstr(why.items[0], "... want m"));
    cr_assert_lt(strlen(why.items[0]), 120);
    attest_reasons_free(&why);
    attest_report_clear(&r);
}

/* ---- canary ------------------------------------------------------------------------------- */

Test(attest_canary, two_of_last_three)
{
    attest_canary_t c = {0};
    cr_assert_not(attest_canary_record(&c, false), "one mismatch is not enough");
    cr_assert(attest_canary_record(&c, false), "two mismatches reject");
    attest_canary_reset(&c);
    cr_assert_not(attest_canary_record(&c, false));
    cr_assert_not(attest_canary_record(&c, true));
    cr_assert(attest_canary_record(&c, false), "miss, hit, miss: 2 of 3");
    cr_assert_not(attest_canary_record(&c, true), "hit, miss, hit: only 1 of the last 3");
}

Test(attest_canary, window_slides)
{
    attest_canary_t c = {0};
    attest_canary_record(&c, false);
    attest_canary_record(&c, true);
    attest_canary_record(&c, true);
    cr_assert_not(attest_canary_rejected(&c));
    cr_assert_not(attest_canary_record(&c, false), "hit, hit, miss");
    cr_assert(attest_canary_record(&c, false), "hit, miss, miss");
    cr_assert(attest_canary_record(&c, true), "miss, miss, hit");
    cr_assert_not(attest_canary_record(&c, true), "miss, hit, hit: recovered");
    for (int i = 0; i < 10; i++)
        cr_assert_not(attest_canary_record(&c, true));
}

Test(attest_canary, output_hash)
{
    char hex[65];
    attest_canary_sha256("three, four", 11, hex);
    char want[65];
    dp_sha256_hex("three, four", 11, want);
    cr_assert_str_eq(hex, want);
    cfg_canary_t can = {.prompt = "Count: one, two,", .max_tokens = 16, .expected_sha256 = want};
    cr_assert(attest_canary_matches(&can, "three, four", 11));
    cr_assert_not(attest_canary_matches(&can, "three, five", 11));
    cr_assert(attest_canary_matches(NULL, "x", 1));
}

/* ---- payload and report JSON -------------------------------------------------------------- */

Test(attest_report, payload_round_trip)
{
    attest_report_t r;
    agent_report(&r);
    r.nonce = strdup("n-1");
    r.issued_at = strdup("2026-11-29T17:30:46.123Z");
    attest_report_set(&r, ATTEST_F_DTYPE, NULL);
    dp_buf_t p = {0};
    attest_payload_build(&r, &p);
    cr_assert(strstr(p.base, "\"dtype\":null"));
    cr_assert(strstr(p.base, "\"framework\":{\"name\":\"vllm\",\"version\":\"0.6.3\"}"));
    attest_report_t back = {0};
    dp_buf_t why = {0};
    cr_assert_eq(attest_payload_parse(p.base, p.len, &back, &why), 0, "%s", why.base);
    for (int f = 0; f < ATTEST_F__COUNT; f++) {
        const char *a = attest_report_get(&r, f), *b = attest_report_get(&back, f);
        cr_assert((a == NULL && b == NULL) || (a && b && strcmp(a, b) == 0), "field %d", f);
    }
    cr_assert_str_eq(back.nonce, "n-1");
    cr_assert_str_eq(back.source, "agent");
    cr_assert_not(back.is_signed, "parsing alone never makes a report signed");
    attest_report_clear(&r);
    attest_report_clear(&back);
    dp_buf_free(&p);
    dp_buf_free(&why);
}

Test(attest_report, copy_and_json)
{
    attest_report_t r = {0}, c;
    strcpy(r.source, "tgi");
    attest_report_set(&r, ATTEST_F_MODEL, "m");
    attest_report_set_unattested(&r, ATTEST_F_QUANTIZATION, "not in /info");
    attest_report_copy(&c, &r);
    attest_report_clear(&r);
    dp_buf_t out = {0};
    dp_jw_t w;
    dp_jw_init(&w, &out);
    attest_report_write_json(&c, &w, NULL);
    cr_assert_str_eq(out.base,
                     "{\"model\":\"m\",\"checkpoint_sha256\":null,\"quantization\":null,\"dtype\":"
                     "null,\"framework\":{\"name\":null,\"version\":null},"
                     "\"engine_fingerprint\":null,\"determinism\":{\"mode\":null},"
                     "\"nonce\":null,\"issued_at\":null,"
                     "\"signed\":false,\"keyid\":null,\"source\":\"tgi\","
                     "\"unattested\":{\"checkpoint_sha256\":\"not reported\",\"quantization\":"
                     "\"not in /info\",\"dtype\":\"not reported\",\"framework.name\":\"not "
                     "reported\",\"framework.version\":\"not reported\","
                     "\"engine_fingerprint\":\"not reported\","
                     "\"determinism.mode\":\"not reported\"}}");
    attest_report_clear(&c);
    dp_buf_free(&out);
}

/* ---- "accept": several identities during a rollout ------------------------------------------ */

Test(attest_match, accept_admits_any_listed_identity_and_names_which)
{
    cfg_manifest_t m = full_manifest();
    cfg_manifest_t next = full_manifest();
    next.checkpoint_sha256 = H1;
    next.framework_version = "0.6.4";
    strcpy(m.fingerprint, "fp_old");
    strcpy(next.fingerprint, "fp_new");
    m.accept = &next;
    m.naccept = 1;
    attest_report_t r;
    agent_report(&r);
    attest_reasons_t why = {0};
    /* The old identity: the manifest itself. */
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 0);
    cr_assert_eq(attest_manifest_identity(&m, &r), &m);
    /* The new one: accept[0], with its own fingerprint. */
    attest_report_set(&r, ATTEST_F_CHECKPOINT, H1);
    attest_report_set(&r, ATTEST_F_FRAMEWORK_VERSION, "0.6.4");
    cr_assert_eq(attest_admit(&m, &r, true, &why), 0);
    cr_assert_eq(why.count, 0);
    cr_assert_eq(attest_manifest_identity(&m, &r), &next);
    cr_assert_str_eq(attest_manifest_identity(&m, &r)->fingerprint, "fp_new");
    /* A mix of the two is neither: reasons against both. */
    attest_report_set(&r, ATTEST_F_FRAMEWORK_VERSION, "0.6.3");
    cr_assert_null(attest_manifest_identity(&m, &r));
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 2);
    cr_assert_eq(why.count, 2);
    cr_assert_str_eq(why.items[0], "checkpoint_sha256 mismatch: got ab12cd34.. want cd34ef56..");
    cr_assert_str_eq(why.items[1],
                     "nor accept[0] (fp_new): framework.version mismatch: got 0.6.3 want 0.6.4");
    attest_reasons_free(&why);
    /* Without the accept list the new identity is rejected, as before. */
    m.naccept = 0;
    attest_report_set(&r, ATTEST_F_FRAMEWORK_VERSION, "0.6.4");
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 2);
    cr_assert_null(attest_manifest_identity(&m, &r));
    cr_assert_null(attest_manifest_identity(NULL, &r));
    attest_reasons_free(&why);
    attest_report_clear(&r);
}

/* A keyless OMS signer (docs/attestation.md §9): identity and issuer round-trip through the
 * payload and are what a manifest's oms.identity/issuer pin. */
Test(attest_match, keyless_oms_identity_and_issuer)
{
    attest_report_t r;
    agent_report(&r);
    r.nonce = strdup("n-1");
    r.issued_at = strdup("2026-11-29T17:30:46.123Z");
    r.oms_reported = r.oms_verified = true;
    strcpy(r.oms_signer, H1);
    strcpy(r.oms_root_digest, H2);
    strcpy(r.oms_identity, "release@example.com");
    strcpy(r.oms_issuer, "https://accounts.google.com");
    dp_buf_t p = {0}, why = {0};
    attest_payload_build(&r, &p);
    attest_report_t back = {0};
    cr_assert_eq(attest_payload_parse(p.base, p.len, &back, &why), 0, "%s", why.base);
    cr_expect_str_eq(back.oms_identity, "release@example.com");
    cr_expect_str_eq(back.oms_issuer, "https://accounts.google.com");

    cfg_manifest_t m = full_manifest();
    m.oms_identity = "release@example.com";
    m.oms_issuer = "https://accounts.google.com";
    attest_reasons_t out = {0};
    cr_expect_eq(attest_manifest_match(&m, &back, &out), 0);
    attest_reasons_free(&out);
    m.oms_issuer = "https://github.com/login/oauth";
    cr_expect_eq(attest_manifest_match(&m, &back, &out), 1);
    cr_expect_str_eq(out.items[0], "oms.issuer mismatch: got https://accounts.google.com want "
                                   "https://github.com/login/oauth");
    attest_reasons_free(&out);

    /* Identity without issuer, or with verified false, or empty, is not a payload. */
    static const char *const bad[] = {
        "\"oms\":{\"verified\":true,\"signer\":\"" H1 "\",\"root_digest\":\"" H2
        "\",\"identity\":\"a@b\"}",
        "\"oms\":{\"verified\":false,\"identity\":\"a@b\",\"issuer\":\"https://x\"}",
        "\"oms\":{\"verified\":true,\"signer\":\"" H1 "\",\"root_digest\":\"" H2
        "\",\"identity\":\"\",\"issuer\":\"https://x\"}"};
    const char *o = strstr(p.base, "\"oms\":{");
    const char *e = o ? strchr(o, '}') : NULL;
    cr_assert(o && e);
    for (size_t i = 0; i < DP_ARRAY_SIZE(bad); i++) {
        dp_buf_t j = {0};
        dp_buf_append(&j, p.base, (size_t)(o - p.base));
        dp_buf_appends(&j, bad[i]);
        dp_buf_appends(&j, e + 1);
        attest_report_t x = {0};
        dp_buf_reset(&why);
        cr_expect_eq(attest_payload_parse(j.base, j.len, &x, &why), -1, "%s", j.base);
        cr_expect(why.base && strstr(why.base, "payload.oms"), "%s", why.base);
        attest_report_clear(&x);
        dp_buf_free(&j);
    }
    attest_report_clear(&back);
    attest_report_clear(&r);
    dp_buf_free(&p);
    dp_buf_free(&why);
}
