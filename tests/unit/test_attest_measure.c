/* What a measuring agent signs (docs/attestation.md §4, "What the agent measures"): the
 * contradictions judgement, the payload's new members and their backward compatibility, the
 * single-file hash, flags against the engine's report, and the /proc readings that find the
 * engine's process and model (attest/engine.h). */
#define _GNU_SOURCE /* unshare */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "attest/adapters.h"
#include "attest/engine.h"
#include "attest/hash.h"
#include "attest/match.h"
#include "attest/view.h"
#include "common/util.h"

static char tmp[256];

static void make_tmp(void)
{
    snprintf(tmp, sizeof(tmp), "/tmp/dp-measure-XXXXXX");
    cr_assert_not_null(mkdtemp(tmp));
}

static void write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s", path);
    cr_assert_eq(fwrite(data, 1, n, f), n);
    fclose(f);
}

static void rm_tree(void)
{
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmp);
    cr_assert_eq(system(cmd), 0);
}

/* ---- contradictions: the proxy's judgement ----------------------------------------------- */

static void measured_llamacpp(attest_report_t *r)
{
    memset(r, 0, sizeof(*r));
    strcpy(r->source, "agent");
    r->is_signed = true;
    attest_report_set(r, ATTEST_F_MODEL, "tiny");
    attest_report_set(r, ATTEST_F_QUANTIZATION, "Q8_0");
    attest_report_set(r, ATTEST_F_FRAMEWORK_NAME, "llamacpp");
    attest_report_set(r, ATTEST_F_FRAMEWORK_VERSION, "b11669-Debian");
    r->measured = 1u << ATTEST_F_QUANTIZATION;
}

Test(attest_measure, a_contradiction_rejects_naming_both_values)
{
    attest_report_t r;
    measured_llamacpp(&r);
    attest_report_add_contradiction(&r, "quantization", "F16", "Q8_0");
    cfg_manifest_t m = {.model = "tiny"};
    attest_reasons_t why = {0};
    cr_assert_eq(attest_admit(&m, &r, true, &why), 1);
    cr_assert_str_eq(why.items[0], "agent: --quantization F16 contradicts the engine's Q8_0");
    attest_reasons_free(&why);
    /* Whatever the manifest pins, or without one: the agent's operator said something false. */
    cr_assert_eq(attest_admit(NULL, &r, false, &why), 1);
    attest_reasons_free(&why);
    /* Pinned too: the mismatch follows the contradiction, both naming both values. */
    m.quantization = "F16";
    cr_assert_eq(attest_admit(&m, &r, true, &why), 2);
    cr_assert_str_eq(why.items[0], "agent: --quantization F16 contradicts the engine's Q8_0");
    cr_assert_str_eq(why.items[1], "quantization mismatch: got Q8_0 want F16");
    attest_reasons_free(&why);
    attest_report_clear(&r);
}

Test(attest_measure, model_dir_and_unknown_fields_are_named_too)
{
    attest_report_t r;
    measured_llamacpp(&r);
    attest_report_add_contradiction(&r, "model_dir", "/srv/models/llama", "/models/tiny.gguf");
    attest_report_add_contradiction(&r, "rope\x01scaling", "x", "y");
    attest_reasons_t why = {0};
    cr_assert_eq(attest_admit(NULL, &r, false, &why), 2);
    cr_assert_str_eq(why.items[0], "agent: --model-dir /srv/models/llama contradicts the engine's "
                                   "/models/tiny.gguf");
    cr_assert_str_eq(why.items[1], "agent: rope\x01scaling x contradicts the engine's y");
    attest_reasons_free(&why);
    attest_report_clear(&r);
}

Test(attest_measure, dropping_one_field_s_contradiction_keeps_the_others_in_order)
{
    attest_report_t r;
    measured_llamacpp(&r);
    attest_report_add_contradiction(&r, "quantization", "F16", "Q8_0");
    attest_report_add_contradiction(&r, "model_dir", "/srv/a", "/models/x.gguf");
    attest_report_add_contradiction(&r, "dtype", "float16", "bfloat16");
    attest_report_drop_contradiction(&r, "model_dir");
    cr_assert_eq(r.ncontradictions, 2);
    cr_assert_str_eq(r.contradictions[0].field, "quantization");
    cr_assert_str_eq(r.contradictions[1].field, "dtype");
    attest_report_drop_contradiction(&r, "model_dir"); /* none left: nothing changes */
    cr_assert_eq(r.ncontradictions, 2);
    attest_report_clear(&r);
}

Test(attest_measure, a_measured_llamacpp_quantization_compares_caselessly)
{
    attest_report_t r;
    measured_llamacpp(&r);
    cfg_manifest_t m = {.quantization = "q8_0"};
    attest_reasons_t why = {0};
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 0);
    /* Repeated from a flag, the agent's value is compared as written. */
    r.measured = 0;
    cr_assert_eq(attest_manifest_match(&m, &r, &why), 1);
    attest_reasons_free(&why);
    attest_report_clear(&r);
}

/* ---- the payload ------------------------------------------------------------------------- */

Test(attest_measure, payload_round_trips_the_measurement)
{
    attest_report_t r;
    measured_llamacpp(&r);
    attest_report_set(&r, ATTEST_F_ENGINE_FINGERPRINT, "b11669-Debian");
    r.measured |= 1u << ATTEST_F_FRAMEWORK_NAME | 1u << ATTEST_F_ENGINE_FINGERPRINT;
    r.model_path = dp_xstrdup("/models/tiny-q8_0.gguf");
    attest_report_add_contradiction(&r, "quantization", "F16", "Q8_0");
    attest_report_set_unattested(&r, ATTEST_F_CHECKPOINT, "the engine loaded x, out of sight");
    r.nonce = dp_xstrdup("n1");
    r.issued_at = dp_xstrdup("2026-01-01T00:00:00.000Z");
    dp_buf_t p = {0}, why = {0};
    attest_payload_build(&r, &p);
    cr_assert(strstr(p.base, "\"model_path\":\"/models/tiny-q8_0.gguf\""), "%s", p.base);
    cr_assert(strstr(p.base, "\"measured\":[\"quantization\",\"framework.name\","
                             "\"engine_fingerprint\"]"),
              "%s", p.base);
    cr_assert(strstr(p.base, "\"contradictions\":[{\"field\":\"quantization\",\"flag\":\"F16\","
                             "\"engine\":\"Q8_0\"}]"),
              "%s", p.base);
    cr_assert(strstr(p.base,
                     "\"unattested\":{\"checkpoint_sha256\":\"the engine loaded x, out of sight\""),
              "%s", p.base);
    attest_report_t back = {0};
    cr_assert_eq(attest_payload_parse(p.base, p.len, &back, &why), 0, "%s", why.base);
    cr_assert_str_eq(back.model_path, "/models/tiny-q8_0.gguf");
    cr_assert_eq(back.measured, r.measured);
    cr_assert_eq(back.ncontradictions, 1);
    cr_assert_str_eq(back.contradictions[0].field, "quantization");
    cr_assert_str_eq(back.contradictions[0].flag, "F16");
    cr_assert_str_eq(back.contradictions[0].engine, "Q8_0");
    cr_assert_str_eq(back.unattested_note[ATTEST_F_CHECKPOINT],
                     "the engine loaded x, out of sight");
    /* The copy the proxy keeps carries it all. */
    attest_report_t copy;
    attest_report_copy(&copy, &back);
    cr_assert_eq(copy.ncontradictions, 1);
    cr_assert_str_eq(copy.contradictions[0].engine, "Q8_0");
    cr_assert_str_eq(copy.model_path, back.model_path);
    attest_report_clear(&copy);
    attest_report_clear(&back);
    attest_report_clear(&r);
    dp_buf_free(&p);
    dp_buf_free(&why);
}

Test(attest_measure, payloads_without_the_new_members_parse_as_before)
{
    static const char old[] =
        "{\"model\":\"m\",\"checkpoint_sha256\":null,\"quantization\":\"awq\","
        "\"dtype\":null,\"framework\":{\"name\":\"vllm\",\"version\":\"1\"},"
        "\"nonce\":\"n\",\"issued_at\":\"t\"}";
    attest_report_t r = {0};
    dp_buf_t why = {0};
    cr_assert_eq(attest_payload_parse(old, sizeof(old) - 1, &r, &why), 0, "%s", why.base);
    cr_assert_null(r.model_path);
    cr_assert_eq(r.measured, 0);
    cr_assert_eq(r.ncontradictions, 0);
    attest_reasons_t reasons = {0};
    cr_assert_eq(attest_admit(NULL, &r, false, &reasons), 0);
    /* And a payload with none of them builds without them. */
    dp_buf_t p = {0};
    attest_payload_build(&r, &p);
    cr_assert_null(strstr(p.base, "measured"));
    cr_assert_null(strstr(p.base, "contradictions"));
    cr_assert_null(strstr(p.base, "model_path"));
    cr_assert_null(strstr(p.base, "unattested"));
    attest_report_clear(&r);
    dp_buf_free(&p);
    dp_buf_free(&why);
}

Test(attest_measure, wrong_types_reject_the_payload)
{
    static const char *const bad[][2] = {
        {"\"model_path\":3", "payload.model_path: expected a string"},
        {"\"measured\":\"quantization\"", "payload.measured: expected an array of field names"},
        {"\"measured\":[1]", "payload.measured: expected an array of field names"},
        {"\"contradictions\":{}", "payload.contradictions: expected an array"},
        {"\"contradictions\":[{\"field\":\"dtype\",\"flag\":\"x\"}]",
         "payload.contradictions[0]: expected an object with string field, flag and engine"},
        {"\"unattested\":[]", "payload.unattested: expected an object of strings"},
        {"\"unattested\":{\"dtype\":1}", "payload.unattested.dtype: expected a string"},
    };
    for (size_t i = 0; i < DP_ARRAY_SIZE(bad); i++) {
        char json[512];
        snprintf(json, sizeof(json), "{\"model\":\"m\",%s,\"nonce\":\"n\",\"issued_at\":\"t\"}",
                 bad[i][0]);
        attest_report_t r = {0};
        dp_buf_t why = {0};
        cr_assert_eq(attest_payload_parse(json, strlen(json), &r, &why), -1, "%s", json);
        cr_assert_str_eq(why.base, bad[i][1]);
        dp_buf_free(&why);
    }
    /* Names this build does not know are ignored (a newer agent may measure more), and a note
     * never replaces a value. */
    static const char ok[] = "{\"model\":\"m\",\"dtype\":\"float16\",\"measured\":[\"rope\","
                             "\"dtype\"],\"unattested\":{\"rope\":\"x\",\"dtype\":\"y\"},"
                             "\"nonce\":\"n\",\"issued_at\":\"t\"}";
    attest_report_t r = {0};
    cr_assert_eq(attest_payload_parse(ok, sizeof(ok) - 1, &r, NULL), 0);
    cr_assert_eq(r.measured, 1u << ATTEST_F_DTYPE);
    cr_assert_null(r.unattested_note[ATTEST_F_DTYPE]);
    attest_report_clear(&r);
}

/* ---- the single-file hash ----------------------------------------------------------------- */

static void sha256_hex(const void *data, size_t n, char out[65])
{
    uint8_t md[32];
    unsigned len = 0;
    cr_assert_eq(EVP_Digest(data, n, md, &len, EVP_sha256(), NULL), 1);
    dp_hex(md, 32, out);
}

Test(attest_measure, a_gguf_file_hashes_to_its_own_sha256, .init = make_tmp, .fini = rm_tree)
{
    /* Bigger than one read, so the file is streamed in several. */
    size_t n = (size_t)9 << 20;
    uint8_t *data = malloc(n);
    memcpy(data, "GGUF", 4);
    for (size_t i = 4; i < n; i++)
        data[i] = (uint8_t)(i * 2654435761u >> 13);
    char path[300], want[65], hex[65], cmd[400];
    snprintf(path, sizeof(path), "%s/tiny-f16.gguf", tmp);
    write_file(path, data, n);
    sha256_hex(data, n, want);
    free(data);
    attest_snapshot_t snap;
    bool is_file = false;
    dp_buf_t err = {0};
    attest_hash_opts_t o = {.read_size = 1 << 20};
    cr_assert_eq(attest_hash_path(path, &o, hex, &snap, &is_file, &err), 0, "%s", err.base);
    cr_assert(is_file);
    cr_assert_str_eq(hex, want);
    cr_assert_eq(snap.count, 1);
    cr_assert_str_eq(snap.files[0].relpath, "tiny-f16.gguf");
    /* The value sha256sum prints (and Hugging Face shows), when coreutils is here. */
    snprintf(cmd, sizeof(cmd), "sha256sum '%s' 2>/dev/null", path);
    FILE *p = popen(cmd, "r");
    char line[200] = "";
    if (p && fgets(line, sizeof(line), p))
        cr_assert_eq(strncmp(line, hex, 64), 0, "sha256sum: %s", line);
    if (p)
        pclose(p);
    /* Its listing tells when the file changes. */
    attest_snapshot_t now;
    cr_assert_eq(attest_snapshot_take_path(path, &now, &is_file, &err), 0);
    cr_assert_not(attest_snapshot_differs(&snap, &now, NULL));
    attest_snapshot_free(&now);
    write_file(path, "GGUF", 4);
    cr_assert_eq(attest_snapshot_take_path(path, &now, NULL, &err), 0);
    dp_buf_t why = {0};
    cr_assert(attest_snapshot_differs(&snap, &now, &why));
    cr_assert(strstr(why.base, "tiny-f16.gguf: size"), "%s", why.base);
    attest_snapshot_free(&now);
    attest_snapshot_free(&snap);
    dp_buf_free(&why);
    dp_buf_free(&err);
}

Test(attest_measure, a_folder_hashes_as_attest_hash_dir, .init = make_tmp, .fini = rm_tree)
{
    char path[300], a[65], b[65];
    snprintf(path, sizeof(path), "%s/config.json", tmp);
    write_file(path, "{}", 2);
    bool is_file = true;
    cr_assert_eq(attest_hash_path(tmp, NULL, a, NULL, &is_file, NULL), 0);
    cr_assert_not(is_file);
    cr_assert_eq(attest_hash_dir(tmp, NULL, b, NULL, NULL, NULL), 0);
    cr_assert_str_eq(a, b);
    dp_buf_t err = {0};
    snprintf(path, sizeof(path), "%s/nope.gguf", tmp);
    cr_assert_eq(attest_hash_path(path, NULL, a, NULL, NULL, &err), -ENOENT);
    cr_assert(strstr(err.base, "nope.gguf: No such file or directory"), "%s", err.base);
    dp_buf_free(&err);
}

/* ---- flags against the engine ------------------------------------------------------------- */

Test(attest_measure, the_engine_wins_and_a_differing_flag_is_listed)
{
    attest_report_t engine = {0}, ident = {0};
    strcpy(engine.source, "llamacpp");
    attest_report_set(&engine, ATTEST_F_QUANTIZATION, "Q8_0");
    attest_report_set(&engine, ATTEST_F_FRAMEWORK_NAME, "llamacpp");
    engine.model_path = dp_xstrdup("/models/tiny-q8_0.gguf");
    attest_report_add_contradiction(&ident, "dtype", "stale", "from an earlier read");
    attest_engine_merge(&engine, "F16", "float16", &ident);
    cr_assert_str_eq(ident.quantization, "Q8_0");
    cr_assert_str_eq(ident.dtype, "float16", "llama.cpp reports no dtype: the flag's");
    cr_assert_eq(ident.measured, 1u << ATTEST_F_QUANTIZATION | 1u << ATTEST_F_FRAMEWORK_NAME);
    cr_assert_eq(ident.ncontradictions, 1, "each read states them anew");
    cr_assert_str_eq(ident.contradictions[0].field, "quantization");
    cr_assert_str_eq(ident.contradictions[0].flag, "F16");
    cr_assert_str_eq(ident.contradictions[0].engine, "Q8_0");
    cr_assert_str_eq(ident.model_path, "/models/tiny-q8_0.gguf");
    /* Spelling is no contradiction; no flag, nothing to contradict. */
    attest_engine_merge(&engine, "q8_0", NULL, &ident);
    cr_assert_eq(ident.ncontradictions, 0);
    cr_assert_str_eq(ident.quantization, "Q8_0");
    cr_assert_null(ident.dtype);
    attest_report_clear(&engine);
    attest_report_clear(&ident);
}

Test(attest_measure, every_adapter_reports_the_path_it_loaded)
{
    static const struct {
        cfg_attest_source_t src;
        const char *body, *path;
    } cases[] = {
        {CFG_ATTEST_LLAMACPP,
         "{\"build_info\":\"b1\",\"model_ftype\":\"Q8_0\",\"model_path\":\"/m/t.gguf\"}",
         "/m/t.gguf"},
        {CFG_ATTEST_SGLANG,
         "{\"model_path\":\"/models/llama\",\"served_model_name\":\"l\",\"version\":\"0.3\"}",
         "/models/llama"},
        {CFG_ATTEST_VLLM,
         "{\"data\":[{\"id\":\"l\",\"owned_by\":\"vllm\",\"root\":\"/models/llama\"}]}",
         "/models/llama"},
        {CFG_ATTEST_TGI,
         "{\"model_id\":\"/data\",\"version\":\"2\",\"router\":\"text-generation-router\"}",
         "/data"},
    };
    for (size_t i = 0; i < DP_ARRAY_SIZE(cases); i++) {
        const attest_adapter_t *ad = attest_adapter_for(cases[i].src);
        dp_iovec_t b[2] = {{cases[i].body, strlen(cases[i].body)}, {NULL, 0}};
        attest_report_t r = {0};
        dp_buf_t why = {0};
        cr_assert_eq(ad->parse(b, ad->npaths, &r, &why), 0, "%s: %s", ad->name, why.base);
        cr_assert_str_eq(r.model_path, cases[i].path, "%s", ad->name);
        attest_report_clear(&r);
        dp_buf_free(&why);
    }
    /* A TGI whose /info has quantize reports it; released ones do not have it. */
    static const char tgi[] = "{\"model_id\":\"m\",\"version\":\"2\",\"quantize\":\"awq\"}";
    dp_iovec_t b = {tgi, sizeof(tgi) - 1};
    attest_report_t r = {0};
    dp_buf_t why = {0};
    cr_assert_eq(attest_adapter_for(CFG_ATTEST_TGI)->parse(&b, 1, &r, &why), 0);
    cr_assert_str_eq(r.quantization, "awq");
    attest_report_clear(&r);
}

/* ---- /proc: the listener, the process, the model ------------------------------------------ */

static const char tcp4[] =
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout "
    "inode\n"
    "   0: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 "
    "111 1 0000000000000000 20 4 30 10 -1\n"
    "   1: 0100007F:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 "
    "222 1 0000000000000000 100 0 0 10 0\n"
    "   2: 00000000:1F92 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 "
    "333 1 0000000000000000 100 0 0 10 0\n"
    "   3: 0500000A:1F93 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 "
    "444 1 0000000000000000 100 0 0 10 0\n";
static const char tcp6[] =
    "  sl  local_address                         remote_address                        st "
    "tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    "   0: 00000000000000000000000000000000:1F94 00000000000000000000000000000000:0000 0A "
    "00000000:00000000 00:00000000 00000000     0        0 555 1 0000000000000000 100 0 0 10 0\n"
    "   1: 0000000000000000FFFF00000100007F:1F95 00000000000000000000000000000000:0000 0A "
    "00000000:00000000 00:00000000 00000000     0        0 666 1 0000000000000000 100 0 0 10 0\n";

static struct sockaddr_in v4(const char *ip, uint16_t port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, ip, &a.sin_addr);
    return a;
}

Test(attest_measure, the_listener_of_a_port_is_found_in_proc_net_tcp)
{
    /* Little-endian words, as the kernel prints them on this (x86) machine. */
    uint32_t probe = 1;
    if (*(uint8_t *)&probe != 1)
        cr_skip_test("the sample tables are a little-endian host's");
    struct sockaddr_in a = v4("127.0.0.1", 8080);
    cr_assert_eq(attest_net_listener(tcp4, sizeof(tcp4) - 1, false, (struct sockaddr *)&a, NULL), 0,
                 "8080 is an established connection, not a listener");
    a = v4("127.0.0.1", 8081);
    uint32_t uid = 7;
    cr_assert_eq(attest_net_listener(tcp4, sizeof(tcp4) - 1, false, (struct sockaddr *)&a, &uid),
                 222);
    cr_assert_eq(uid, 1000, "the uid owning the socket");
    a = v4("127.0.0.1", 8082); /* 0.0.0.0:8082 serves every address */
    cr_assert_eq(attest_net_listener(tcp4, sizeof(tcp4) - 1, false, (struct sockaddr *)&a, NULL),
                 333);
    a = v4("127.0.0.1", 8083); /* bound to 10.0.0.5 only */
    cr_assert_eq(attest_net_listener(tcp4, sizeof(tcp4) - 1, false, (struct sockaddr *)&a, NULL),
                 0);
    a = v4("10.0.0.5", 8083);
    cr_assert_eq(attest_net_listener(tcp4, sizeof(tcp4) - 1, false, (struct sockaddr *)&a, NULL),
                 444);
    a = v4("127.0.0.1", 8084); /* [::]:8084, dual stack */
    cr_assert_eq(attest_net_listener(tcp6, sizeof(tcp6) - 1, true, (struct sockaddr *)&a, NULL),
                 555);
    a = v4("127.0.0.1", 8085); /* [::ffff:127.0.0.1]:8085 */
    cr_assert_eq(attest_net_listener(tcp6, sizeof(tcp6) - 1, true, (struct sockaddr *)&a, NULL),
                 666);
    struct sockaddr_in6 s6 = {.sin6_family = AF_INET6, .sin6_port = htons(8082)};
    inet_pton(AF_INET6, "::1", &s6.sin6_addr);
    cr_assert_eq(attest_net_listener(tcp4, sizeof(tcp4) - 1, false, (struct sockaddr *)&s6, NULL),
                 0, "a v4 socket never serves a v6 address");
    cr_assert_eq(attest_net_listener("", 0, false, (struct sockaddr *)&a, NULL), 0);
}

/* A socket listening on 127.0.0.1 (its address into *a): its fd. */
static int listen_local(struct sockaddr_in *a)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    *a = v4("127.0.0.1", 0);
    socklen_t len = sizeof(*a);
    cr_assert_eq(bind(fd, (struct sockaddr *)a, sizeof(*a)), 0);
    cr_assert_eq(listen(fd, 1), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)a, &len), 0);
    return fd;
}

Test(attest_measure, this_process_is_found_by_its_listening_socket)
{
    struct sockaddr_in a;
    int fd = listen_local(&a);
    cr_assert(attest_addr_is_local((struct sockaddr *)&a));
    struct sockaddr_in far = v4("192.0.2.1", 80); /* TEST-NET-1: nobody's address */
    cr_assert_not(attest_addr_is_local((struct sockaddr *)&far));
    int64_t ino = attest_proc_listener("/proc", (struct sockaddr *)&a, NULL);
    cr_assert_gt(ino, 0);
    struct stat st;
    cr_assert_eq(fstat(fd, &st), 0);
    cr_assert_eq((uint64_t)ino, (uint64_t)st.st_ino);
    bool mixed = true;
    cr_assert_eq(attest_proc_socket_owner("/proc", (uint64_t)ino, 0, &mixed), getpid());
    cr_assert_not(mixed);
    cr_assert_eq(attest_proc_socket_owner("/proc", (uint64_t)ino, getpid(), &mixed), 0,
                 "never self");
    cr_assert_gt(attest_proc_start_time("/proc", getpid()), 0);
    close(fd);
    cr_assert_eq(attest_proc_listener("/proc", (struct sockaddr *)&a, NULL), 0, "closed: none");
}

/* A child holding the same socket: taken alike when it reads as its parent does, and neither
 * taken when it has dropped to another user (a root parent and its unprivileged worker). */
static pid_t holder_child(int fd, bool drop)
{
    int ready[2];
    cr_assert_eq(pipe(ready), 0);
    pid_t child = fork();
    cr_assert_neq(child, -1);
    if (child == 0) {
        if (drop && (setgid(65534) != 0 || setuid(65534) != 0))
            _exit(1);
        (void)!write(ready[1], "r", 1);
        for (;;)
            pause();
    }
    char c;
    cr_assert_eq(read(ready[0], &c, 1), 1);
    close(ready[0]);
    close(ready[1]);
    (void)fd; /* inherited by the child */
    return child;
}

Test(attest_measure, an_engine_in_a_user_namespace_of_its_own_lends_no_capability)
{
    if (geteuid() != 0)
        cr_skip_test("needs root to compare with");
    int ready[2];
    cr_assert_eq(pipe(ready), 0);
    pid_t child = fork();
    cr_assert_neq(child, -1);
    if (child == 0) {
        if (unshare(CLONE_NEWUSER) != 0)
            _exit(1);
        (void)!write(ready[1], "r", 1);
        for (;;)
            pause();
    }
    char c;
    cr_assert_eq(read(ready[0], &c, 1), 1, "the child made its user namespace");
    attest_fs_ident_t mine, its;
    dp_buf_t err = {0};
    cr_assert_eq(attest_proc_fs_ident("/proc", getpid(), 0, &mine, &err), 0, "%s", err.base);
    cr_assert_eq(attest_proc_fs_ident("/proc", child, 0, &its, &err), 0, "%s", err.base);
    cr_assert(mine.cap_eff_known && mine.cap_eff != 0, "root's own capabilities count");
    cr_assert(its.cap_eff_known);
    cr_assert_eq(its.cap_eff, 0, "capabilities of another user namespace count for nothing here");
    attest_fs_ident_free(&mine);
    attest_fs_ident_free(&its);
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    close(ready[0]);
    close(ready[1]);
    dp_buf_free(&err);
}

Test(attest_measure, a_socket_held_by_processes_reading_differently_has_no_engine)
{
    if (geteuid() != 0)
        cr_skip_test("needs root to drop a child to another user");
    struct sockaddr_in a;
    int fd = listen_local(&a);
    int64_t ino = attest_proc_listener("/proc", (struct sockaddr *)&a, NULL);
    cr_assert_gt(ino, 0);
    bool mixed = true;
    pid_t same = holder_child(fd, false);
    pid_t got = attest_proc_socket_owner("/proc", (uint64_t)ino, 0, &mixed);
    cr_assert(got == getpid() || got == same, "one of two alike holders: %d", (int)got);
    cr_assert_not(mixed);
    kill(same, SIGKILL);
    waitpid(same, NULL, 0);
    pid_t dropped = holder_child(fd, true);
    cr_assert_eq(attest_proc_socket_owner("/proc", (uint64_t)ino, 0, &mixed), 0);
    cr_assert(mixed, "a root holder and a nobody one: neither is the engine");
    kill(dropped, SIGKILL);
    waitpid(dropped, NULL, 0);
    cr_assert_eq(attest_proc_socket_owner("/proc", (uint64_t)ino, 0, &mixed), getpid());
    cr_assert_not(mixed);
    close(fd);
}

/* A fake /proc/41 whose root is a folder of the test: the engine in a chroot or another mount
 * namespace, whose /models the agent does not have. */
static void fake_engine_root(char *proc, char *root)
{
    char p[400];
    snprintf(root, 300, "%s/engine-root", tmp);
    snprintf(p, sizeof(p), "%s/models/llama", root);
    char cmd[1200];
    snprintf(cmd, sizeof(cmd), "mkdir -p '%s' '%s/proc/41'", p, tmp);
    cr_assert_eq(system(cmd), 0);
    snprintf(p, sizeof(p), "%s/models/llama/tiny.gguf", root);
    write_file(p, "GGUF", 4);
    snprintf(proc, 300, "%s/proc", tmp);
    snprintf(p, sizeof(p), "%s/proc/41/root", tmp);
    cr_assert_eq(symlink(root, p), 0);
    snprintf(p, sizeof(p), "%s/proc/41/cwd", tmp);
    char models[400];
    snprintf(models, sizeof(models), "%s/models", root);
    cr_assert_eq(symlink(models, p), 0);
}

Test(attest_measure, the_engines_model_is_found_through_its_root, .init = make_tmp, .fini = rm_tree)
{
    char proc[300], root[300], dir[400];
    fake_engine_root(proc, root);
    attest_located_t l;
    dp_buf_t why = {0};
    cr_assert_eq(attest_engine_locate(proc, 41, "/models/llama/tiny.gguf", true, &l, &why),
                 ATTEST_LOC_FOUND, "%s", why.base);
    char want[400];
    snprintf(want, sizeof(want), "%s/41/root/models/llama/tiny.gguf", proc);
    cr_assert_str_eq(l.path, want);
    /* --model-dir: the file itself, its folder, a folder above it; not another folder. */
    struct stat st;
    snprintf(dir, sizeof(dir), "%s/models/llama", root);
    cr_assert_eq(stat(dir, &st), 0);
    cr_assert(attest_located_under(&l, &st));
    snprintf(dir, sizeof(dir), "%s/models/llama/tiny.gguf", root);
    cr_assert_eq(stat(dir, &st), 0);
    cr_assert(attest_located_under(&l, &st));
    cr_assert_eq(stat(root, &st), 0);
    cr_assert(attest_located_under(&l, &st), "the engine's / is above everything it has");
    cr_assert_eq(stat(tmp, &st), 0);
    cr_assert_not(attest_located_under(&l, &st), "above the engine's root is not its folder");
    attest_located_free(&l);
    /* Relative: through its working directory. */
    cr_assert_eq(attest_engine_locate(proc, 41, "llama/tiny.gguf", true, &l, &why),
                 ATTEST_LOC_FOUND);
    attest_located_free(&l);
    /* Not there, or out of sight. */
    dp_buf_reset(&why);
    cr_assert_eq(attest_engine_locate(proc, 41, "/models/other.gguf", true, &l, &why),
                 ATTEST_LOC_NOT_VISIBLE);
    cr_assert(strstr(why.base, "not in the engine's root"), "%s", why.base);
    dp_buf_reset(&why);
    cr_assert_eq(attest_engine_locate(proc, 0, "/models/llama/tiny.gguf", true, &l, &why),
                 ATTEST_LOC_NOT_VISIBLE);
    cr_assert(strstr(why.base, "share the engine's process namespace"), "%s", why.base);
    dp_buf_reset(&why);
    cr_assert_eq(attest_engine_locate(proc, 0, "tiny.gguf", true, &l, &why),
                 ATTEST_LOC_NOT_VISIBLE);
    /* A Hub id is no path: SGLang, vLLM and TGI fetch it. */
    cr_assert_eq(attest_engine_locate(proc, 0, "meta-llama/Llama-3.1-8B", false, &l, &why),
                 ATTEST_LOC_NOT_LOCAL);
    cr_assert_eq(attest_engine_locate(proc, 41, "meta-llama/Llama-3.1-8B", false, &l, &why),
                 ATTEST_LOC_NOT_LOCAL);
    /* A path the agent has and the engine's root has not (a container's, a chroot's): not
     * the engine's file, whatever it holds. */
    char host_only[400];
    snprintf(host_only, sizeof(host_only), "%s/host-only.gguf", tmp);
    write_file(host_only, "GGUF", 4);
    dp_buf_reset(&why);
    cr_assert_eq(attest_engine_locate(proc, 41, host_only, true, &l, &why), ATTEST_LOC_NOT_VISIBLE,
                 "%s", l.path ? l.path : "");
    cr_assert(strstr(why.base, "not in the engine's root"), "%s", why.base);
    /* A path both sides see alike is taken as it is (it outlives the process). */
    cr_assert_eq(attest_engine_locate(proc, 0, want, true, &l, &why), ATTEST_LOC_FOUND);
    cr_assert_str_eq(l.path, want);
    cr_assert_eq(l.prefix, 0);
    attest_located_free(&l);
    dp_buf_free(&why);
}

/* The engine's view (attest/view.h): links in a folder it names resolve in its root. */
static void *view_of_another_thread(void *arg)
{
    *(bool *)arg = attest_view_on();
    return NULL;
}

static void mkdir_p(const char *dir)
{
    char cmd[700];
    snprintf(cmd, sizeof(cmd), "mkdir -p '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

static void model_folder(const char *dir)
{
    char p[600];
    mkdir_p(dir);
    snprintf(p, sizeof(p), "%s/config.json", dir);
    write_file(p, "{}", 2);
    snprintf(p, sizeof(p), "%s/model.safetensors", dir);
    write_file(p, "weights", 7);
}

Test(attest_measure, links_in_the_engines_folder_resolve_in_its_root, .init = make_tmp,
     .fini = rm_tree)
{
    char proc[300], root[300], hf[400], clean[400], secret[400], p[600], via[600], host[400];
    fake_engine_root(proc, root);
    snprintf(hf, sizeof(hf), "%s/models/hf", root);
    snprintf(clean, sizeof(clean), "%s/clean", tmp);
    model_folder(hf);
    model_folder(clean);
    /* The agent's secret, outside the engine's root: an absolute link to it and a relative one
     * that climbs past the engine's "/". */
    snprintf(secret, sizeof(secret), "%s/secret", tmp);
    write_file(secret, "root:$6$host", 12);
    snprintf(p, sizeof(p), "%s/tokenizer.json", hf);
    cr_assert_eq(symlink(secret, p), 0);
    snprintf(p, sizeof(p), "%s/vocab.json", hf);
    cr_assert_eq(symlink("../../../secret", p), 0);
    /* And a GGUF file of the agent's, named through a link in the engine's root. */
    snprintf(host, sizeof(host), "%s/host.gguf", tmp);
    write_file(host, "GGUF....", 8);
    snprintf(p, sizeof(p), "%s/models/escape.gguf", root);
    cr_assert_eq(symlink(host, p), 0);

    char plain[65], seen[65], want[65];
    dp_buf_t err = {0};
    snprintf(via, sizeof(via), "%s/41/root/models/hf", proc);
    cr_assert_eq(attest_hash_path(clean, NULL, want, NULL, NULL, &err), 0, "%s", err.base);
    cr_assert_eq(attest_hash_path(via, NULL, plain, NULL, NULL, &err), 0, "%s", err.base);
    cr_assert_str_neq(plain, want, "through the agent's root, the link reaches its secret");

    cr_assert_eq(attest_view_enter(proc, 41, &err), 0, "%s", err.base);
    bool other = true;
    pthread_t t;
    pthread_create(&t, NULL, view_of_another_thread, &other);
    pthread_join(t, NULL);
    cr_assert_not(other, "a view is the entering thread's alone");
    cr_assert_eq(attest_hash_path(via, NULL, seen, NULL, NULL, &err), 0, "%s", err.base);
    cr_assert_str_eq(seen, want, "in the engine's root both links lead nowhere");
    snprintf(p, sizeof(p), "%s/41/root/models/llama/tiny.gguf", proc);
    cr_assert(attest_model_shaped(p, "/models/llama/tiny.gguf", &err), "%s", err.base);
    snprintf(p, sizeof(p), "%s/41/root/models/escape.gguf", proc);
    dp_buf_reset(&err);
    cr_assert_not(attest_model_shaped(p, "/models/escape.gguf", &err));
    cr_assert(strstr(err.base, "cannot open"), "%s", err.base);
    attest_view_leave();
    cr_assert_not(attest_view_on());
    dp_buf_reset(&err);
    cr_assert(attest_model_shaped(p, "/models/escape.gguf", &err), "outside the view: %s",
              err.base);
    dp_buf_free(&err);
}

Test(attest_measure, the_names_matched_against_maps_are_the_engine_roots_files, .init = make_tmp,
     .fini = rm_tree)
{
    /* An absolute link in the engine's folder names a path the agent has a file at too: the
     * name compared with the engine's maps is its own root's file, never the agent's. */
    char proc[300], root[300], host[400], inside[800], p[600], want[PATH_MAX];
    fake_engine_root(proc, root);
    snprintf(host, sizeof(host), "%s/decoy.gguf", tmp);
    write_file(host, "GGUF host", 9);
    snprintf(inside, sizeof(inside), "%s%s", root, host);
    char cmd[1200];
    snprintf(cmd, sizeof(cmd), "mkdir -p '%s%s'", root, tmp);
    cr_assert_eq(system(cmd), 0);
    write_file(inside, "GGUF mine", 9);
    snprintf(p, sizeof(p), "%s/models/llama/linked.gguf", root);
    cr_assert_eq(symlink(host, p), 0);
    cr_assert_not_null(realpath(inside, want));

    dp_buf_t err = {0};
    cr_assert_eq(attest_view_enter(proc, 41, &err), 0, "%s", err.base);
    snprintf(p, sizeof(p), "%s/41/root/models/llama/linked.gguf", proc);
    attest_snapshot_t snap;
    cr_assert_eq(attest_snapshot_take_path(p, &snap, NULL, NULL), 0);
    snprintf(p, sizeof(p), "%s/41/root/models/llama", proc);
    char **names = attest_loaded_names(p, &snap);
    attest_view_leave();
    cr_assert_eq(snap.count, 1);
    cr_assert_not_null(names[0]);
    cr_assert_str_eq(names[0], want);
    attest_loaded_names_free(names, snap.count);
    attest_snapshot_free(&snap);
    dp_buf_free(&err);
}

Test(attest_measure, every_process_is_in_sight_only_from_the_first_namespaces_with_ptrace,
     .init = make_tmp, .fini = rm_tree)
{
    struct stat st;
    bool first = stat("/proc/self/ns/pid", &st) == 0 && st.st_ino == 0xEFFFFFFCU &&
                 stat("/proc/self/ns/user", &st) == 0 && st.st_ino == 0xEFFFFFFDU;
    char proc[300], p[400];
    snprintf(proc, sizeof(proc), "%s/proc", tmp);
    snprintf(p, sizeof(p), "%s/self/ns", proc);
    mkdir_p(p);
    snprintf(p, sizeof(p), "%s/self/ns/pid", proc);
    cr_assert_eq(symlink("/proc/self/ns/pid", p), 0); /* this test's own namespaces */
    snprintf(p, sizeof(p), "%s/self/ns/user", proc);
    cr_assert_eq(symlink("/proc/self/ns/user", p), 0);
    static const struct {
        const char *status;
        bool sees; /* from the first namespaces */
    } cases[] = {
        {"Name:\tagent\nCapEff:\t000001ffffffffff\n", true},
        {"CapEff:\t0000000000080004\n", true},  /* CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH */
        {"CapEff:\t0000000000080002\n", true},  /* CAP_SYS_PTRACE, CAP_DAC_OVERRIDE */
        {"CapEff:\t0000000000080000\n", false}, /* no fd table of another uid opens */
        {"CapEff:\t00000000000000ff\n", false}, /* no fd link of another uid reads */
        {"CapEff:\t0000000000000000\n", false},
        {"Name:\tagent\n", false},
    };
    snprintf(p, sizeof(p), "%s/self/status", proc);
    for (size_t i = 0; i < sizeof(cases) / sizeof(*cases); i++) {
        write_file(p, cases[i].status, strlen(cases[i].status));
        cr_assert_eq(attest_proc_sees_every_process(proc), first && cases[i].sees, "case %zu", i);
    }
    /* A PID namespace of its own (a container's): never. */
    write_file(p, cases[0].status, strlen(cases[0].status));
    snprintf(p, sizeof(p), "%s/self/ns/pid", proc);
    cr_assert_eq(unlink(p), 0);
    cr_assert_eq(symlink("/proc/self/ns/net", p), 0);
    cr_assert_not(attest_proc_sees_every_process(proc));
}

Test(attest_measure, no_link_through_proc_is_followed_in_a_view, .init = make_tmp, .fini = rm_tree)
{
    /* Magic links (/proc/self/cwd, /proc/PID/root, /proc/self/fd/N) lead past the engine's
     * root and into the agent's own files: refused even in the agent's own root (pid 0). */
    char dir[400], p[600];
    snprintf(dir, sizeof(dir), "%s/hf", tmp);
    model_folder(dir);
    snprintf(p, sizeof(p), "%s/reachable", tmp);
    write_file(p, "x", 1);
    char cwd[300];
    cr_assert_not_null(getcwd(cwd, sizeof(cwd)));
    cr_assert_eq(chdir(tmp), 0);
    snprintf(p, sizeof(p), "%s/tokenizer.json", dir);
    cr_assert_eq(symlink("/proc/self/cwd/reachable", p), 0);
    char hex[65];
    dp_buf_t err = {0};
    cr_assert_eq(attest_hash_path(dir, NULL, hex, NULL, NULL, &err), 0, "without a view: %s",
                 err.base);
    cr_assert_eq(attest_view_enter("/proc", 0, &err), 0, "%s", err.base);
    cr_assert_eq(attest_hash_path(dir, NULL, hex, NULL, NULL, &err), -ELOOP);
    cr_assert(strstr(err.base, "a link through /proc"), "%s", err.base);
    /* The folder itself named through a magic link: not opened either. */
    snprintf(p, sizeof(p), "/proc/self/cwd/hf");
    dp_buf_reset(&err);
    cr_assert_not(attest_model_shaped(p, p, &err));
    attest_view_leave();
    cr_assert_eq(chdir(cwd), 0);
    dp_buf_free(&err);
}

Test(attest_measure, an_engine_out_of_sight_lends_only_its_socket_s_uid, .init = make_tmp,
     .fini = rm_tree)
{
    if (geteuid() != 0)
        cr_skip_test("needs root to read as another uid");
    char closed[400], file[500];
    snprintf(closed, sizeof(closed), "%s/closed", tmp);
    mkdir_p(closed);
    cr_assert_eq(chmod(closed, 0700), 0);
    snprintf(file, sizeof(file), "%s/config.json", closed);
    write_file(file, "{}", 2);
    struct stat st;
    attest_fs_ident_t prev;
    dp_buf_t err = {0};
    cr_assert_eq(attest_as_process_enter("/proc", 0, 0, 65534, &prev, &err), 0, "%s", err.base);
    cr_assert(attest_view_on());
    cr_assert_eq(stat(file, &st), -1, "as the socket's uid, past a folder only root may enter");
    cr_assert_eq(errno, EACCES);
    attest_fs_ident_leave(&prev);
    cr_assert_not(attest_view_on());
    cr_assert_eq(stat(file, &st), 0, "the agent's own rights back");
    /* Owned by root (bound before the engine dropped to its user), or no owner seen: read as
     * nobody, never as the agent. */
    for (int owner = -1; owner <= 0; owner++) {
        cr_assert_eq(attest_as_process_enter("/proc", 0, 0, owner, &prev, &err), 0, "%s", err.base);
        cr_assert_eq(stat(file, &st), -1, "socket owner %d", owner);
        attest_fs_ident_leave(&prev);
    }
    cr_assert_eq(stat(file, &st), 0);
    dp_buf_free(&err);
}

Test(attest_measure, a_relative_path_is_placed_in_the_engines_root, .init = make_tmp,
     .fini = rm_tree)
{
    char proc[300], root[300], want[600], p[600];
    fake_engine_root(proc, root); /* its cwd is its /models */
    attest_located_t l;
    dp_buf_t why = {0};
    cr_assert_eq(attest_engine_locate(proc, 41, "llama/tiny.gguf", true, &l, &why),
                 ATTEST_LOC_FOUND, "%s", why.base);
    snprintf(want, sizeof(want), "%s/41/root/models/llama/tiny.gguf", proc);
    cr_assert_str_eq(l.path, want);
    snprintf(want, sizeof(want), "%s/41/root", proc);
    cr_assert_eq(l.prefix, strlen(want));
    attest_located_free(&l);
    /* A working directory the kernel's names do not place in the root (here: outside it). */
    char outside[400];
    snprintf(outside, sizeof(outside), "%s/outside/llama", tmp);
    mkdir_p(outside);
    snprintf(p, sizeof(p), "%s/tiny.gguf", outside);
    write_file(p, "GGUF", 4);
    snprintf(p, sizeof(p), "%s/41/cwd", proc);
    cr_assert_eq(unlink(p), 0);
    snprintf(outside, sizeof(outside), "%s/outside", tmp);
    cr_assert_eq(symlink(outside, p), 0);
    cr_assert_eq(attest_engine_locate(proc, 41, "llama/tiny.gguf", true, &l, &why),
                 ATTEST_LOC_NOT_VISIBLE);
    cr_assert(strstr(why.base, "cannot place in the engine's root"), "%s", why.base);
    dp_buf_free(&why);
}

static int loaded_by_me(const attest_snapshot_t *snap, dp_buf_t *instead)
{
    char **names = attest_loaded_names(tmp, snap);
    int rc = attest_proc_loaded("/proc", getpid(), names, snap, instead);
    attest_loaded_names_free(names, snap->count);
    return rc;
}

Test(attest_measure, the_model_mapped_by_a_process_is_seen, .init = make_tmp, .fini = rm_tree)
{
    char path[300], other[300];
    snprintf(path, sizeof(path), "%s/tiny.gguf", tmp);
    snprintf(other, sizeof(other), "%s/other.gguf", tmp);
    write_file(path, "GGUF....", 8);
    write_file(other, "GGUF----", 8);
    attest_snapshot_t snap;
    cr_assert_eq(attest_snapshot_take_path(path, &snap, NULL, NULL), 0);
    dp_buf_t instead = {0};
    cr_assert_eq(loaded_by_me(&snap, &instead), ATTEST_LOADED_NOT_SEEN);
    cr_assert_eq(instead.len, 0);
    /* Another GGUF open: the process runs something other than the reported file. */
    int ofd = open(other, O_RDONLY);
    cr_assert_eq(loaded_by_me(&snap, &instead), ATTEST_LOADED_NOT_SEEN);
    cr_assert_str_eq(instead.base, other);
    dp_buf_reset(&instead);
    int fd = open(path, O_RDONLY);
    cr_assert_eq(loaded_by_me(&snap, &instead), ATTEST_LOADED_OPEN);
    void *m = mmap(NULL, 8, PROT_READ, MAP_PRIVATE, fd, 0);
    cr_assert_neq(m, MAP_FAILED);
    cr_assert_eq(loaded_by_me(&snap, &instead), ATTEST_LOADED_MAPPED);
    cr_assert_eq(instead.len, 0);
    munmap(m, 8);
    close(fd);
    close(ofd);
    /* The reported path renamed over while the process keeps the old file mapped: the kernel
     * names it "PATH (deleted)", still another GGUF file than the one at the path. */
    char fresh[300];
    snprintf(fresh, sizeof(fresh), "%s/fresh", tmp);
    write_file(fresh, "GGUF....", 8);
    fd = open(path, O_RDONLY);
    m = mmap(NULL, 8, PROT_READ, MAP_PRIVATE, fd, 0);
    cr_assert_neq(m, MAP_FAILED);
    close(fd);
    cr_assert_eq(rename(fresh, path), 0);
    attest_snapshot_free(&snap);
    cr_assert_eq(attest_snapshot_take_path(path, &snap, NULL, NULL), 0);
    dp_buf_reset(&instead);
    cr_assert_eq(loaded_by_me(&snap, &instead), ATTEST_LOADED_NOT_SEEN);
    cr_assert(instead.len && strstr(instead.base, "tiny.gguf (deleted)"), "%s",
              instead.base ? instead.base : "(none)");
    munmap(m, 8);
    /* A maps line names its device as major:minor in hex. */
    static const char maps[] = "7f00-7f10 r--s 00000000 fd:01 1234   /models/t.gguf\n"
                               "7f10-7f20 r-xp 00000000 00:00 0\n";
    cr_assert(attest_maps_has(maps, sizeof(maps) - 1, makedev(0xfd, 1), 1234, NULL));
    cr_assert_not(attest_maps_has(maps, sizeof(maps) - 1, makedev(0xfd, 2), 1234, NULL));
    cr_assert(attest_maps_has(maps, sizeof(maps) - 1, 7, 7, "/models/t.gguf"), "by its path");
    attest_snapshot_free(&snap);
    dp_buf_free(&instead);
}

/* ---- reading as the engine's user -------------------------------------------------------- */

Test(attest_measure, the_engines_fs_identity_is_read_from_its_status, .init = make_tmp,
     .fini = rm_tree)
{
    char dir[300], path[320], stat_path[320];
    snprintf(dir, sizeof(dir), "%s/4242", tmp);
    cr_assert_eq(mkdir(dir, 0755), 0);
    snprintf(path, sizeof(path), "%s/status", dir);
    snprintf(stat_path, sizeof(stat_path), "%s/stat", dir);
    static const char stat[] = "4242 (llama server) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 1 0 "
                               "0 20 0 4 0 777 1000 10 18446744073709551615";
    write_file(stat_path, stat, sizeof(stat) - 1);
    static const char status[] = "Name:\tllama-server\nUmask:\t0022\nState:\tS (sleeping)\n"
                                 "Uid:\t1000\t1000\t1000\t1000\nGid:\t100\t100\t100\t100\n"
                                 "FDSize:\t64\nGroups:\t4 27 1000 \nNStgid:\t4242\n";
    write_file(path, status, sizeof(status) - 1);
    attest_fs_ident_t id;
    dp_buf_t err = {0};
    cr_assert_eq(attest_proc_fs_ident(tmp, 4242, 777, &id, &err), 0, "%s", err.base);
    cr_assert_eq(id.uid, 1000);
    cr_assert_eq(id.gid, 100);
    cr_assert_eq(id.ngroups, 3);
    cr_assert_eq(id.groups[0], 4);
    cr_assert_eq(id.groups[2], 1000);
    attest_fs_ident_free(&id);
    cr_assert_eq(attest_proc_fs_ident(tmp, 4242, 778, &id, &err), -ESRCH,
                 "another process given the engine's pid");
    cr_assert(strstr(err.base, "another process than the engine's now"), "%s", err.base);
    dp_buf_reset(&err);

    /* An engine of nobody's running a set-user-ID root program: its real ids, never root's. */
    static const char setuid_root[] = "Uid:\t65534\t0\t0\t0\nGid:\t65534\t0\t0\t0\nGroups:\t\n"
                                      "VmPeak:\t1 kB\n";
    write_file(path, setuid_root, sizeof(setuid_root) - 1);
    cr_assert_eq(attest_proc_fs_ident(tmp, 4242, 0, &id, &err), 0, "%s", err.base);
    cr_assert_eq(id.uid, 65534);
    cr_assert_eq(id.gid, 65534);
    cr_assert_eq(id.ngroups, 0, "an empty Groups line, the next line's numbers not taken");
    attest_fs_ident_free(&id);

    static const char no_gid[] = "Uid:\t0\t0\t0\t5\nGroups:\t1\n";
    write_file(path, no_gid, sizeof(no_gid) - 1);
    cr_assert_eq(attest_proc_fs_ident(tmp, 4242, 0, &id, &err), -EINVAL);
    cr_assert(strstr(err.base, "no Uid and Gid lines"), "%s", err.base);
    dp_buf_reset(&err);
    cr_assert_eq(attest_proc_fs_ident(tmp, 4243, 0, &id, &err), -ENOENT, "a process gone");
    dp_buf_free(&err);
}

static const char *g_secret;
static pthread_barrier_t g_switched;

/* A thread started before the change (threads inherit their creator's identity): it reads
 * once the main thread reads as the engine. */
static void *try_read(void *arg)
{
    (void)arg;
    pthread_barrier_wait(&g_switched);
    int fd = open(g_secret, O_RDONLY);
    if (fd >= 0)
        close(fd);
    return (void *)(intptr_t)(fd >= 0);
}

Test(attest_measure, files_are_read_as_the_engine_on_this_thread_only, .init = make_tmp,
     .fini = rm_tree)
{
    if (geteuid() != 0)
        cr_skip_test("needs root: the identity changes only for a root agent");
    char secret[300];
    snprintf(secret, sizeof(secret), "%s/secret", tmp);
    write_file(secret, "only root", 9);
    cr_assert_eq(chmod(secret, 0600), 0);
    cr_assert_eq(chmod(tmp, 0755), 0);
    g_secret = secret;
    pthread_t t;
    void *other = NULL;
    cr_assert_eq(pthread_barrier_init(&g_switched, NULL, 2), 0);
    cr_assert_eq(pthread_create(&t, NULL, try_read, NULL), 0);
    attest_fs_ident_t nobody = {.uid = 65534, .gid = 65534}, prev;
    dp_buf_t err = {0};
    cr_assert_eq(attest_fs_ident_enter(&nobody, &prev, &err), 0, "%s", err.base);
    cr_assert_eq(open(secret, O_RDONLY), -1, "read as the engine's user");
    cr_assert_eq(errno, EACCES);
    /* No capability but the two that change back: not CAP_SYS_PTRACE, which would open a
     * root process's /proc/PID/cwd past a folder only root may enter. */
    char via_proc[128];
    snprintf(via_proc, sizeof(via_proc), "/proc/%d/cwd", (int)getppid());
    struct stat st;
    cr_assert_eq(stat(via_proc, &st), -1, "%s: the runner's (root's) cwd", via_proc);
    cr_assert_eq(errno, EACCES, "%s", strerror(errno));
    pthread_barrier_wait(&g_switched);
    cr_assert_eq(pthread_join(t, &other), 0);
    pthread_barrier_destroy(&g_switched);
    cr_assert_eq((intptr_t)other, 1, "another thread keeps the agent's identity");
    attest_fs_ident_leave(&prev);
    int fd = open(secret, O_RDONLY);
    cr_assert_geq(fd, 0, "back to the agent's own identity");
    close(fd);

    attest_fs_ident_t root = {.uid = 0, .gid = 0};
    cr_assert_eq(attest_fs_ident_enter(&root, &prev, &err), 0);
    cr_assert_not(prev.taken, "an engine running as root: nothing to change");
    attest_fs_ident_leave(&prev);
    dp_buf_free(&err);
}
