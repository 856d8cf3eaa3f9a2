/* Deterministic pools (docs/attestation.md §10), the attestation side: the manifest's
 * determinism.mode, the adapters that attest batch_invariant (SGLang, llama.cpp), the match, the
 * agent's payload, and the /proc reading behind `attest serve --determinism batch_invariant`. */
#define _GNU_SOURCE /* mkdtemp */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "attest/adapters.h"
#include "attest/determinism.h"
#include "attest/match.h"

#define IOV(s) ((dp_iovec_t){(s), strlen(s)})
#define NONE ((dp_iovec_t){NULL, 0})

static cfg_manifest_t *manifest(const char *json, cfg_errors_t *e)
{
    return cfg_manifest_parse(json, strlen(json), "m", e);
}

/* ---- manifest -------------------------------------------------------------------------------- */

Test(determinism_manifest, modes_parse_and_accept_entries_inherit_them)
{
    cfg_errors_t e = {0};
    cfg_manifest_t *m = manifest("{\"model\":\"a\",\"determinism\":{\"mode\":\"batch_invariant\"},"
                                 "\"accept\":[{\"model\":\"b\"}]}",
                                 &e);
    cr_assert_not_null(m);
    cr_assert_eq(m->determinism, CFG_DETERMINISM_BATCH_INVARIANT);
    cr_assert_eq(m->accept[0].determinism, CFG_DETERMINISM_BATCH_INVARIANT);
    char fp[20];
    cfg_manifest_t plain = {.model = "a"};
    cfg_manifest_fingerprint(&plain, fp);
    cr_assert_str_eq(m->fingerprint, fp, "determinism is not part of the fingerprint");
    cfg_manifest_free(m);
    m = manifest("{\"determinism\":{\"mode\":\"single_sequence\"}}", &e);
    cr_assert_eq(m->determinism, CFG_DETERMINISM_SINGLE_SEQUENCE);
    cfg_manifest_free(m);
    cr_assert_eq(e.count, 0);
    cfg_errors_free(&e);
}

Test(determinism_manifest, bad_values_name_their_path)
{
    static const struct {
        const char *json, *error;
    } cases[] = {
        {"{\"determinism\":{\"mode\":\"strict\"}}",
         "m.determinism.mode: must be one of batch_invariant, single_sequence"},
        {"{\"determinism\":{}}",
         "m.determinism.mode: required: \"batch_invariant\" or \"single_sequence\""},
        {"{\"determinism\":{\"mode\":\"single_sequence\",\"batch\":1}}",
         "m.determinism.batch: unknown key"},
        {"{\"determinism\":\"single_sequence\"}", "m.determinism: expected an object"},
        {"{\"model\":\"a\",\"accept\":[{\"determinism\":{\"mode\":\"single_sequence\"}}]}",
         "m.accept[0].determinism: unknown key"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        cfg_errors_t e = {0};
        cr_assert_null(manifest(cases[i].json, &e), "%s", cases[i].json);
        bool found = false;
        for (size_t k = 0; k < e.count; k++)
            found |= strncmp(e.items[k], cases[i].error, strlen(cases[i].error)) == 0;
        cr_assert(found, "%s: got %s", cases[i].json, e.count ? e.items[0] : "(none)");
        cfg_errors_free(&e);
    }
}

/* ---- adapters -------------------------------------------------------------------------------- */

static void sglang(const char *extra, attest_report_t *r)
{
    char body[512];
    snprintf(body, sizeof(body),
             "{\"model_path\":\"/m\",\"served_model_name\":\"m\",\"dtype\":\"bfloat16\","
             "\"version\":\"0.5.4\"%s}",
             extra);
    dp_buf_t why = {0};
    dp_iovec_t b[1] = {IOV(body)};
    memset(r, 0, sizeof(*r));
    cr_assert_eq(attest_adapter_for(CFG_ATTEST_SGLANG)->parse(b, 1, r, &why), 0, "%s", why.base);
    dp_buf_free(&why);
}

Test(determinism_adapters, sglang_enable_deterministic_inference)
{
    attest_report_t r;
    sglang(",\"enable_deterministic_inference\":true", &r);
    cr_assert_str_eq(r.determinism, "batch_invariant");
    attest_report_clear(&r);
    sglang(",\"enable_deterministic_inference\":false", &r);
    cr_assert_null(r.determinism);
    cr_assert_str_eq(r.unattested_note[ATTEST_F_DETERMINISM],
                     "sglang enable_deterministic_inference is false");
    attest_report_clear(&r);
    sglang("", &r);
    cr_assert_null(r.determinism);
    cr_assert_str_eq(r.unattested_note[ATTEST_F_DETERMINISM],
                     "this SGLang's /get_server_info has no enable_deterministic_inference");
    attest_report_clear(&r);
    sglang(",\"enable_deterministic_inference\":\"yes\"", &r);
    cr_assert_null(r.determinism, "a string is not the boolean SGLang writes");
    attest_report_clear(&r);
}

static void llamacpp(const char *slots, attest_report_t *r)
{
    char props[256];
    snprintf(props, sizeof(props), "{\"build_info\":\"b7000\",\"model_ftype\":\"F16\"%s}", slots);
    dp_buf_t why = {0};
    dp_iovec_t b[2] = {IOV(props), NONE};
    memset(r, 0, sizeof(*r));
    cr_assert_eq(attest_adapter_for(CFG_ATTEST_LLAMACPP)->parse(b, 2, r, &why), 0, "%s", why.base);
    dp_buf_free(&why);
}

Test(determinism_adapters, llamacpp_total_slots)
{
    attest_report_t r;
    llamacpp(",\"total_slots\":1", &r);
    cr_assert_str_eq(r.determinism, "batch_invariant");
    attest_report_clear(&r);
    llamacpp(",\"total_slots\":4", &r);
    cr_assert_null(r.determinism);
    cr_assert_str_eq(r.unattested_note[ATTEST_F_DETERMINISM],
                     "llamacpp total_slots is 4, batch_invariant needs 1");
    attest_report_clear(&r);
    llamacpp("", &r);
    cr_assert_str_eq(r.unattested_note[ATTEST_F_DETERMINISM],
                     "this llama.cpp /props has no total_slots");
    attest_report_clear(&r);
    llamacpp(",\"total_slots\":1.5", &r);
    cr_assert_null(r.determinism);
    attest_report_clear(&r);
}

/* ---- match ------------------------------------------------------------------------------------
 */

Test(determinism_match, batch_invariant_must_be_attested_single_sequence_pins_nothing)
{
    cfg_manifest_t m = {.model = "m", .determinism = CFG_DETERMINISM_BATCH_INVARIANT};
    attest_report_t r = {0};
    strcpy(r.source, "sglang");
    attest_report_set(&r, ATTEST_F_MODEL, "m");
    attest_reasons_t why = {0};
    attest_report_set_unattested(&r, ATTEST_F_DETERMINISM,
                                 "sglang enable_deterministic_inference is false");
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 1);
    cr_assert_str_eq(why.items[0],
                     "determinism.mode unattested (sglang enable_deterministic_inference is "
                     "false)");
    attest_reasons_free(&why);
    attest_report_set(&r, ATTEST_F_DETERMINISM, "batch_invariant");
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 0);
    m.determinism = CFG_DETERMINISM_SINGLE_SEQUENCE;
    attest_report_set(&r, ATTEST_F_DETERMINISM, NULL);
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 0, "detproxy enforces it: nothing to attest");
    cr_assert_null(attest_manifest_get(&m, ATTEST_F_DETERMINISM));
    attest_report_clear(&r);
}

Test(determinism_match, long_notes_are_kept_in_the_reason)
{
    cfg_manifest_t m = {.determinism = CFG_DETERMINISM_BATCH_INVARIANT};
    attest_report_t r = {0};
    strcpy(r.source, "agent");
    const char *note = "cannot tell: /proc/1234567/environ: Permission denied (the agent needs "
                       "the server's uid or CAP_SYS_PTRACE)";
    attest_report_set_unattested(&r, ATTEST_F_DETERMINISM, note);
    attest_reasons_t why = {0};
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 1);
    char want[256];
    snprintf(want, sizeof(want), "determinism.mode unattested (%s)", note);
    cr_assert_str_eq(why.items[0], want);
    attest_reasons_free(&why);
    attest_report_clear(&r);
}

Test(determinism_match, agent_payload_carries_mode_or_why_not)
{
    attest_report_t r = {0}, back = {0};
    r.nonce = strdup("n");
    r.issued_at = strdup("2026-12-01T12:00:00.000Z");
    dp_buf_t p = {0}, why = {0};
    attest_payload_build(&r, &p);
    cr_assert_null(strstr(p.base, "determinism"), "not checked: not in the payload");
    dp_buf_reset(&p);
    attest_report_set_unattested(&r, ATTEST_F_DETERMINISM, "VLLM_BATCH_INVARIANT=0 in pid 7");
    attest_payload_build(&r, &p);
    cr_assert_not_null(strstr(p.base, "\"determinism\":{\"mode\":null,\"note\":"
                                      "\"VLLM_BATCH_INVARIANT=0 in pid 7\"}"),
                       "%s", p.base);
    cr_assert_eq(attest_payload_parse(p.base, p.len, &back, &why), 0, "%s", why.base);
    cr_assert_null(back.determinism);
    cr_assert_str_eq(back.unattested_note[ATTEST_F_DETERMINISM], "VLLM_BATCH_INVARIANT=0 in pid 7");
    dp_buf_reset(&p);
    attest_report_set(&r, ATTEST_F_DETERMINISM, "batch_invariant");
    attest_payload_build(&r, &p);
    cr_assert_eq(attest_payload_parse(p.base, p.len, &back, &why), 0, "%s", why.base);
    cr_assert_str_eq(back.determinism, "batch_invariant");
    static const char bad[] = "{\"nonce\":\"n\",\"issued_at\":\"t\",\"determinism\":{\"mode\":1}}";
    cr_assert_eq(attest_payload_parse(bad, sizeof(bad) - 1, &back, &why), -1);
    cr_assert_not_null(strstr(why.base, "payload.determinism"), "%s", why.base);
    dp_buf_free(&p);
    dp_buf_free(&why);
    attest_report_clear(&r);
    attest_report_clear(&back);
}

/* ---- VLLM_BATCH_INVARIANT from /proc ------------------------------------------------------- */

Test(determinism_env, vllm_reads_the_flag_as_int_not_zero)
{
    static const struct {
        const char *v;
        bool on;
    } cases[] = {{"1", true},   {" 1\n", true}, {"2", true},     {"+1", true},  {"0", false},
                 {"00", false}, {"", false},    {"true", false}, {"1x", false}, {"-0", false}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        cr_assert_eq(attest_env_flag_on(cases[i].v, strlen(cases[i].v)), cases[i].on, "'%s'",
                     cases[i].v);
}

Test(determinism_env, environ_and_cmdline_parsing)
{
    static const char env[] = "PATH=/bin\0VLLM_BATCH_INVARIANTX=0\0VLLM_BATCH_INVARIANT=1\0";
    const char *v;
    size_t n;
    cr_assert(attest_environ_get(env, sizeof(env) - 1, "VLLM_BATCH_INVARIANT", &v, &n));
    cr_assert_eq(n, 1);
    cr_assert_eq(v[0], '1');
    cr_assert_not(attest_environ_get(env, sizeof(env) - 1, "HOME", &v, &n));
    static const char unterminated[] = {'A', '=', '1'};
    cr_assert(attest_environ_get(unterminated, 3, "A", &v, &n) && n == 1);

#define RUNS(s, name) attest_cmdline_runs(s, sizeof(s) - 1, name)
    cr_assert(RUNS("vllm\0serve\0m\0", "vllm"));
    cr_assert(RUNS("/usr/bin/python3\0/usr/local/bin/vllm\0serve\0", "vllm"));
    cr_assert(RUNS("python\0-m\0vllm.entrypoints.openai.api_server\0", "vllm"));
    cr_assert(RUNS("python\0-m\0vllm\0", "vllm"));
    cr_assert_not(RUNS("python\0-m\0vllmx\0", "vllm"));
    cr_assert_not(RUNS("tail\0-f\0vllm.log\0", "vllm"));
    cr_assert_not(RUNS("bash\0-c\0vllm serve\0", "vllm"));
    cr_assert_not(attest_cmdline_runs("", 0, "vllm"));
#undef RUNS
}

static char proc_root[64];

static void fake_proc(int pid, const char *cmdline, size_t clen, const char *env, size_t elen)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/%d", proc_root, pid);
    mkdir(path, 0755);
    snprintf(path, sizeof(path), "%s/%d/cmdline", proc_root, pid);
    FILE *f = fopen(path, "wb");
    fwrite(cmdline, 1, clen, f);
    fclose(f);
    if (env == NULL)
        return;
    snprintf(path, sizeof(path), "%s/%d/environ", proc_root, pid);
    f = fopen(path, "wb");
    fwrite(env, 1, elen, f);
    fclose(f);
}

/* /proc/PID/stat with starttime (field 22) st; the command holds ") " as a real one may. */
static void fake_stat(int pid, unsigned long long st)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/%d/stat", proc_root, pid);
    FILE *f = fopen(path, "wb");
    fprintf(f, "%d (vl) lm) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 %llu 19 20\n", pid, st);
    fclose(f);
}

#define FAKE(pid, c, e) fake_proc(pid, c, sizeof(c) - 1, e, e ? sizeof(e) - 1 : 0)

static int check(pid_t pid, const char *name, dp_buf_t *why)
{
    attest_det_opts_t o = {.proc = proc_root, .pid = pid, .process = name, .self = 99};
    return attest_vllm_batch_invariant(&o, why);
}

Test(determinism_env, a_fake_proc_tree)
{
    snprintf(proc_root, sizeof(proc_root), "/tmp/detproxy-proc-XXXXXX");
    cr_assert_not_null(mkdtemp(proc_root));
    dp_buf_t why = {0};
    cr_assert_eq(check(0, "vllm", &why), -1);
    cr_assert(strstr(why.base, "cannot tell: no vllm process in ") == why.base, "%s", why.base);
    FAKE(10, "vllm\0serve\0", "PATH=/bin\0VLLM_BATCH_INVARIANT=1\0");
    FAKE(99, "vllm\0serve\0", "PATH=/bin\0"); /* the agent itself: never looked at */
    FAKE(12, "sleep\0100\0", "PATH=/bin\0");
    cr_assert_eq(check(0, "vllm", &why), 1, "%s", why.base);
    cr_assert_str_eq(why.base, "VLLM_BATCH_INVARIANT on in pid 10");
    /* A server with a long command line (many flags) is still found by its first words. */
    static char longcmd[10000];
    memset(longcmd, 'x', sizeof(longcmd));
    memcpy(longcmd, "vllm\0serve\0", 11);
    fake_proc(15, longcmd, sizeof(longcmd), "VLLM_BATCH_INVARIANT=1\0", 23);
    cr_assert_eq(check(0, "vllm", &why), 1, "%s", why.base);
    cr_assert(strcmp(why.base, "VLLM_BATCH_INVARIANT on in pid 10 15") == 0 ||
                  strcmp(why.base, "VLLM_BATCH_INVARIANT on in pid 15 10") == 0,
              "%s", why.base);
    FAKE(11, "python3\0-m\0vllm.entrypoints.openai.api_server\0", "VLLM_BATCH_INVARIANT=0\0");
    cr_assert_eq(check(0, "vllm", &why), 0);
    cr_assert_str_eq(why.base, "VLLM_BATCH_INVARIANT=0 in pid 11");
    cr_assert_eq(check(12, NULL, &why), 0, "an explicit pid is checked whatever it runs");
    cr_assert_str_eq(why.base, "VLLM_BATCH_INVARIANT is not set in pid 12");
    cr_assert_eq(check(13, NULL, &why), -1);
    char want[256];
    snprintf(want, sizeof(want),
             "cannot tell: %s/13/environ: No such file or directory (the process is gone)",
             proc_root);
    cr_assert_str_eq(why.base, want);
    /* --determinism-pid: a pid the kernel gave to another process (the server exited) is not
     * the server that was checked, whatever its environment says. */
    FAKE(20, "vllm\0serve\0", "VLLM_BATCH_INVARIANT=1\0");
    fake_stat(20, 1000);
    attest_det_opts_t o = {.proc = proc_root, .pid = 20, .self = 99};
    cr_assert_eq(attest_vllm_batch_invariant(&o, &why), 1, "%s", why.base);
    cr_assert_eq(attest_vllm_batch_invariant(&o, &why), 1, "%s", why.base);
    fake_stat(20, 2000);
    cr_assert_eq(attest_vllm_batch_invariant(&o, &why), -1);
    cr_assert_str_eq(why.base, "cannot tell: pid 20 is another process now (started at 2000, "
                               "the one checked at 1000)");
    FAKE(14, "x\0", "");
    cr_assert_eq(check(14, NULL, &why), -1);
    cr_assert(strstr(why.base, "/14/environ is empty") != NULL, "%s", why.base);
    dp_buf_free(&why);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", proc_root);
    cr_assert_eq(system(cmd), 0);
}
