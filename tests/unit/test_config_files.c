/* config/ against real files: referenced manifests and policies, relative path resolution,
 * secrets, certificates and keys, the example configs, and the `detproxy check` command.
 * Every test works in its own temporary folder, removed afterwards. PEM fixtures (test-only
 * keys) come from tests/unit/data/config/. */
#define _GNU_SOURCE /* nftw, mkdtemp, symlink */
#include <criterion/criterion.h>

#include <errno.h>
#include <ftw.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/pem.h"
#include "config/cfg_internal.h"
#include "config/config.h"

#define FIXTURES DP_SOURCE_DIR "/tests/unit/data/config/"
#define EXAMPLES DP_SOURCE_DIR "/config/examples/"

static char g_dir[64];

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    return remove(path);
}

static void setup(void)
{
    strcpy(g_dir, "/tmp/dp-config-test-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
}

static void teardown(void)
{
    nftw(g_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

TestSuite(config_files, .init = setup, .fini = teardown);

/* ---- helpers ----------------------------------------------------------------------------- */

static char *path_in(const char *rel)
{
    static char buf[4][PATH_MAX];
    static int next;
    char *p = buf[next++ % 4];
    snprintf(p, PATH_MAX, "%s/%s", g_dir, rel);
    return p;
}

static void mkdirs_for(const char *path)
{
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof(tmp), "%s", path);
    for (char *s = tmp + strlen(g_dir) + 1; (s = strchr(s, '/')) != NULL; s++) {
        *s = '\0';
        mkdir(tmp, 0755);
        *s = '/';
    }
}

static void write_bytes(const char *rel, const char *data, size_t n, mode_t mode)
{
    const char *p = path_in(rel);
    mkdirs_for(p);
    FILE *f = fopen(p, "wb");
    cr_assert_not_null(f, "%s: %s", p, strerror(errno));
    cr_assert_eq(fwrite(data, 1, n, f), n);
    fclose(f);
    cr_assert_eq(chmod(p, mode), 0);
}

/* Single quotes become double quotes, as in test_config.c. */
static void write_q(const char *rel, const char *sq, mode_t mode)
{
    char *d = strdup(sq);
    for (char *s = d; *s; s++)
        if (*s == '\'')
            *s = '"';
    write_bytes(rel, d, strlen(d), mode);
    free(d);
}

static void write_text(const char *rel, const char *text, mode_t mode)
{
    write_bytes(rel, text, strlen(text), mode);
}

static void copy_fixture(const char *name, const char *rel, mode_t mode)
{
    char src[PATH_MAX];
    snprintf(src, sizeof(src), FIXTURES "%s", name);
    FILE *f = fopen(src, "rb");
    cr_assert_not_null(f, "%s", src);
    char buf[8192];
    size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    write_bytes(rel, buf, n, mode);
}

static void dump(const cfg_errors_t *e)
{
    for (size_t i = 0; i < e->count; i++)
        fprintf(stderr, "  error: %s\n", e->items[i]);
    for (size_t i = 0; i < e->nwarnings; i++)
        fprintf(stderr, "  warning: %s\n", e->warnings[i]);
}

static bool has_at(char *const *items, size_t n, const char *path, const char *msg)
{
    size_t plen = strlen(path);
    for (size_t i = 0; i < n; i++)
        if (strncmp(items[i], path, plen) == 0 && strncmp(items[i] + plen, ": ", 2) == 0 &&
            strstr(items[i] + plen + 2, msg) != NULL)
            return true;
    return false;
}

static bool has_error(const cfg_errors_t *e, const char *path, const char *msg)
{
    return has_at(e->items, e->count, path, msg);
}

static bool has_warning(const cfg_errors_t *e, const char *path, const char *msg)
{
    return has_at(e->warnings, e->nwarnings, path, msg);
}

static bool mentions(const cfg_errors_t *e, const char *text)
{
    for (size_t i = 0; i < e->count; i++)
        if (strstr(e->items[i], text) != NULL)
            return true;
    for (size_t i = 0; i < e->nwarnings; i++)
        if (strstr(e->warnings[i], text) != NULL)
            return true;
    return false;
}

/* Write CONFIG as <tmp>/<rel> and load it. */
static int load_cfg(const char *rel, const char *sq, cfg_t **cfg, cfg_errors_t *e)
{
    write_q(rel, sq, 0644);
    return cfg_load(path_in(rel), cfg, e);
}

static cfg_t *must_load(const char *rel, const char *sq, cfg_errors_t *e)
{
    cfg_t *cfg = NULL;
    int rc = load_cfg(rel, sq, &cfg, e);
    if (rc != 0)
        dump(e);
    cr_assert_eq(rc, 0);
    return cfg;
}

#define H64 "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
#define REPLICA "{'name':'r1','url':'http://127.0.0.1:8001'}"
#define POOL "{'name':'p','models':['*'],'replicas':[" REPLICA "]}"
#define CFG(extra) "{'pools':[" POOL "]" extra "}"
#define POOLF(fields) "{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "]" fields "}]}"

/* ---- relative paths and referenced documents --------------------------------------------- */

Test(config_files, relative_paths_resolve_against_the_config_folder)
{
    write_q("sub/manifests/m.json",
            "{'model':'meta-llama/Llama-3.1-8B-Instruct','framework':{'name':'vllm',"
            "'version':'0.6.3'}}",
            0644);
    write_q("sub/policy.json", "{'tenants':[{'name':'bank','match':{'any':true},'audit':true}]}",
            0644);
    write_text("sub/secrets/key", "sk-test\n", 0600);
    write_text("sub/secrets/admin", "admin-token \t\r\n", 0600);
    copy_fixture("ed25519.pub.pem", "sub/keys/pipeline.pub.pem", 0644);
    copy_fixture("test.crt", "sub/tls/proxy.crt", 0644);
    copy_fixture("test.key", "sub/tls/proxy.key", 0600);
    copy_fixture("test.crt", "sub/tls/ca.crt", 0644);
    write_q("sub/detproxy.json",
            "{'attestation':{'trusted_keys':['keys/pipeline.pub.pem'],'require_signature':false},"
            " 'tls':{'cert_file':'tls/proxy.crt','key_file':'tls/proxy.key',"
            "        'client_ca_file':'tls/ca.crt'},"
            " 'admin_token_file':'secrets/admin',"
            " 'pools':[{'name':'p','models':['*'],'manifest':'manifests/m.json',"
            "   'api_key_file':'secrets/key','upstream_tls':{'ca_file':'tls/ca.crt'},"
            "   'replicas':[" REPLICA "]}],"
            " 'policy':'policy.json','log':{'audit_path':'audit.jsonl'}}",
            0644);
    cr_assert_eq(chdir(g_dir), 0);

    cfg_t *cfg;
    cfg_errors_t e = {0};
    int rc = cfg_load("sub/detproxy.json", &cfg, &e);
    if (rc != 0 || e.nwarnings != 0)
        dump(&e);
    cr_assert_eq(rc, 0);
    cr_assert_eq(e.nwarnings, 0);
    cr_assert_str_eq(cfg->path, path_in("sub/detproxy.json"));
    cr_assert_str_eq(cfg->dir, path_in("sub"));
    cr_assert_str_eq(cfg->attestation.trusted_keys[0], path_in("sub/keys/pipeline.pub.pem"));
    cr_assert_str_eq(cfg->tls->cert_file, path_in("sub/tls/proxy.crt"));
    cr_assert_str_eq(cfg->tls->key_file, path_in("sub/tls/proxy.key"));
    cr_assert_str_eq(cfg->tls->client_ca_file, path_in("sub/tls/ca.crt"));
    cr_assert_str_eq(cfg->admin_token_file, path_in("sub/secrets/admin"));
    cr_assert_str_eq(cfg->admin_token, "admin-token"); /* trailing whitespace trimmed */
    cr_assert_str_eq(cfg->log.audit_path, path_in("sub/audit.jsonl"));
    const cfg_pool_t *p = &cfg->pools[0];
    cr_assert_str_eq(p->api_key_file, path_in("sub/secrets/key"));
    cr_assert_str_eq(p->api_key, "sk-test");
    cr_assert_str_eq(p->upstream_tls->ca_file, path_in("sub/tls/ca.crt"));
    cr_assert_str_eq(p->manifest->model, "meta-llama/Llama-3.1-8B-Instruct");
    cr_assert_str_eq(p->manifest->fingerprint, "fp_3c3b2857ad9d4389");
    cr_assert_eq(p->replicas[0].attest.source, CFG_ATTEST_VLLM);
    cr_assert_str_eq(cfg->policy->tenants[0].name, "bank");
    cr_assert(cfg->policy->tenants[0].audit);
    cfg_free(cfg);
    cfg_errors_free(&e);
}

Test(config_files, absolute_paths_are_kept)
{
    char sq[1024];
    copy_fixture("ed25519.pub.pem", "elsewhere/k.pem", 0644);
    snprintf(sq, sizeof(sq), CFG(",'attestation':{'trusted_keys':['%s']}"),
             path_in("elsewhere/k.pem"));
    cfg_errors_t e = {0};
    cfg_t *cfg = must_load("conf/c.json", sq, &e);
    cr_assert_str_eq(cfg->attestation.trusted_keys[0], path_in("elsewhere/k.pem"));
    cfg_free(cfg);
}

/* docs/configuration.md "attestation": trusting a key means requiring signatures unless said
 * otherwise, and an explicit `false` beside trusted keys warns for each agent source. */
Test(config_files, trusted_keys_imply_require_signature)
{
    char sq[1024];
    copy_fixture("ed25519.pub.pem", "k.pem", 0644);
    static const char agent[] = "{'pools':[{'name':'p','models':['*'],'replicas':[{'name':'r1',"
                                "'url':'http://127.0.0.1:8001','attest':{'source':'agent',"
                                "'url':'http://127.0.0.1:9101/attestation'}}]}],"
                                "'attestation':{'trusted_keys':['%s']%s}}";
    snprintf(sq, sizeof(sq), agent, path_in("k.pem"), "");
    cfg_errors_t e = {0};
    cfg_t *cfg = must_load("c.json", sq, &e);
    cr_assert_eq(cfg->attestation.require_signature, true);
    cr_assert_eq(e.nwarnings, 0);
    cfg_free(cfg);
    cfg_errors_free(&e);
    snprintf(sq, sizeof(sq), agent, path_in("k.pem"), ",'require_signature':false");
    memset(&e, 0, sizeof(e));
    cfg = must_load("c.json", sq, &e);
    cr_assert_eq(cfg->attestation.require_signature, false);
    cr_assert(has_warning(&e, "pools[0].replicas[0].attest", "stripped of its signatures"));
    cfg_free(cfg);
    cfg_errors_free(&e);
}

/* A ConfigMap mount swaps a symlinked folder on update: the config keeps the path it was given
 * so a reload reads the new files. */
Test(config_files, symlinked_folder_is_not_resolved)
{
    write_q("real/c.json", CFG(""), 0644);
    cr_assert_eq(symlink(path_in("real"), path_in("link")), 0);
    cfg_t *cfg;
    cr_assert_eq(cfg_load(path_in("link/c.json"), &cfg, NULL), 0);
    cr_assert_str_eq(cfg->dir, path_in("link"));
    cr_assert_str_eq(cfg->path, path_in("link/c.json"));
    cfg_free(cfg);
}

Test(config_files, inline_and_referenced_manifest_are_the_same)
{
    const char *m = "{'model':'m','checkpoint_sha256':'" H64 "','quantization':'awq',"
                    "'dtype':'float16','framework':{'name':'tgi','version':'2.0'},"
                    "'canary':{'prompt':'Count:','max_tokens':8,'expected_sha256':'" H64 "'}}";
    write_q("m.json", m, 0644);
    char sq[2048];
    snprintf(sq, sizeof(sq),
             "{'pools':[{'name':'a','models':['a'],'manifest':'m.json','replicas':[" REPLICA
             "]},{'name':'b','models':['b'],'manifest':%s,'replicas':[" REPLICA "]}]}",
             m);
    cfg_errors_t e = {0};
    cfg_t *cfg = must_load("c.json", sq, &e);
    const cfg_manifest_t *a = cfg->pools[0].manifest, *b = cfg->pools[1].manifest;
    cr_assert_str_eq(a->fingerprint, b->fingerprint);
    cr_assert_str_eq(a->checkpoint_sha256, b->checkpoint_sha256);
    cr_assert_str_eq(a->framework_version, "2.0");
    cr_assert_str_eq(a->canary->prompt, b->canary->prompt);
    cr_assert_eq(a->canary->max_tokens, 8);
    cr_assert_eq(b->canary->max_tokens, 8);
    cfg_free(cfg);
}

Test(config_files, errors_inside_referenced_files_name_the_file)
{
    write_q("manifests/m.json", "{'model':'m','quantization':4,'framework':{'name':'vllm'}}", 0644);
    write_text("manifests/bad.json", "{\"model\":\n}", 0644);
    write_q("policy.json",
            "{'tenants':[{'name':'t','match':{'any':true},'pool':'zz'},{'name':'u','match':{}}]}",
            0644);
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(load_cfg("c.json",
                          "{'pools':[{'name':'p','models':['*'],'manifest':'manifests/m.json',"
                          "'replicas':[" REPLICA "]},{'name':'q','models':['*'],"
                          "'manifest':'manifests/bad.json','replicas':[" REPLICA "]},"
                          "{'name':'r','models':['*'],'manifest':'manifests/none.json',"
                          "'replicas':[" REPLICA "]}],'policy':'policy.json'}",
                          &cfg, &e),
                 -1);
    cr_assert_eq(e.count, 5);
    cr_assert_str_eq(e.items[0],
                     "pools[0].manifest.quantization: expected a string (in manifests/m.json)");
    cr_assert_str_eq(e.items[1],
                     "pools[1].manifest: invalid JSON at line 2, column 1 (in manifests/bad.json)");
    char want[PATH_MAX + 128];
    snprintf(want, sizeof(want), "pools[2].manifest: cannot read %s: No such file or directory",
             path_in("manifests/none.json"));
    cr_assert_str_eq(e.items[2], want);
    cr_assert_str_eq(e.items[3], "policy.tenants[1].match: needs exactly one of api_keys_sha256, "
                                 "header, any (in policy.json)");
    cr_assert_str_eq(e.items[4],
                     "policy.tenants[0].pool: no pool is named \"zz\" (in policy.json)");
    cfg_errors_free(&e);
}

Test(config_files, missing_config_file)
{
    cfg_t *cfg = (cfg_t *)1;
    cfg_errors_t e = {0};
    cr_assert_eq(cfg_load(path_in("nope.json"), &cfg, &e), -1);
    cr_assert_null(cfg);
    cr_assert(has_error(&e, "config", "cannot read"));
    cfg_errors_free(&e);
    cr_assert_eq(cfg_load(g_dir, &cfg, &e), -1);
    cr_assert(has_error(&e, "config", "is not a regular file"));
    cfg_errors_free(&e);
}

/* ---- secrets ----------------------------------------------------------------------------- */

Test(config_files, secret_file_mode_warns_without_content)
{
    write_text("key", "SECRET-MODE-4\n", 0644);
    write_text("admin", "SECRET-MODE-5", 0640);
    cfg_errors_t e = {0};
    cfg_t *cfg = must_load("c.json",
                           "{'admin_listen':'0.0.0.0:9901','admin_token_file':'admin',"
                           "'pools':[{'name':'p','models':['*'],'api_key_file':'key',"
                           "'replicas':[" REPLICA "]}]}",
                           &e);
    cr_assert_eq(e.nwarnings, 2);
    cr_assert(has_warning(&e, "pools[0].api_key_file", "(mode 0644): chmod 600 it"));
    cr_assert(has_warning(&e, "admin_token_file", "(mode 0640)"));
    cr_assert(!mentions(&e, "SECRET-MODE"));
    cr_assert_str_eq(cfg->pools[0].api_key, "SECRET-MODE-4");
    cr_assert_str_eq(cfg->admin_token, "SECRET-MODE-5");
    cfg_free(cfg);
    cfg_errors_free(&e);
}

/* Every way a secret can be wrong: the message names the file, never what is in it. */
Test(config_files, secrets_never_appear_in_messages)
{
    char big[5000];
    memset(big, 'S', sizeof(big));
    memcpy(big, "SECRET-BIG-2", 12);
    write_bytes("s/ctl", "SECRET-CTL-1\x01xyz", 16, 0600);
    write_bytes("s/big", big, sizeof(big), 0600);
    write_text("s/nl", "SECRET-NL-3\nSECRET-NL-3b\n", 0600);
    write_text("s/blank", " \n\t\n", 0600);
    copy_fixture("test.crt", "tls/c.crt", 0644);
    copy_fixture("other.key", "tls/other.key", 0644);
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(
        load_cfg("c.json",
                 "{'admin_token_file':'s/nl','tls':{'cert_file':'tls/c.crt',"
                 "'key_file':'tls/other.key'},"
                 "'pools':[{'name':'a','models':['*'],'api_key_file':'s/ctl','replicas':[" REPLICA
                 "]},{'name':'b','models':['*'],'api_key_file':'s/big','replicas':[" REPLICA
                 "]},{'name':'c','models':['*'],'api_key_file':'s/blank','replicas':[" REPLICA
                 "]}],'policy':{'tenants':[{'name':'t','match':{'api_keys_sha256':"
                 "['sk-live-SECRET-RAW-5']}},{'name':'u','match':{'header':{'name':'x-k',"
                 "'value':'SECRET-HDR-6\\u0007'}}}]}}",
                 &cfg, &e),
        -1);
    cr_assert(has_error(&e, "pools[0].api_key_file", "contains control characters"));
    cr_assert(has_error(&e, "pools[1].api_key_file", "is larger than 4096 bytes"));
    cr_assert(has_error(&e, "pools[2].api_key_file", "is empty"));
    cr_assert(has_error(&e, "admin_token_file", "contains control characters"));
    cr_assert(has_error(&e, "tls.key_file", "does not match the certificate"));
    cr_assert(has_warning(&e, "tls.key_file", "mode 0644"));
    cr_assert(has_error(&e, "policy.tenants[0].match.api_keys_sha256[0]", "not the token itself"));
    cr_assert(has_error(&e, "policy.tenants[1].match.header.value", "control characters"));
    cr_assert(!mentions(&e, "SECRET"));
    cr_assert(!mentions(&e, "PRIVATE KEY"));
    cr_assert(!mentions(&e, "xyz"));
    cfg_errors_free(&e);
}

/* ---- TLS, keys ----------------------------------------------------------------------------- */

typedef struct {
    const char *cert, *key, *ca;
    const char *path, *msg; /* NULL: valid */
} tls_case_t;

Test(config_files, listener_tls_files)
{
    copy_fixture("test.crt", "test.crt", 0644);
    copy_fixture("test.key", "test.key", 0600);
    copy_fixture("other.key", "other.key", 0600);
    copy_fixture("ed25519.pub.pem", "ed.pub.pem", 0644);
    mkdir(path_in("dir"), 0755);
    const tls_case_t cases[] = {
        {"test.crt", "test.key", NULL, NULL, NULL},
        {"test.crt", "test.key", "test.crt", NULL, NULL},
        {"test.crt", "other.key", NULL, "tls.key_file", "does not match the certificate"},
        {"ed.pub.pem", "test.key", NULL, "tls.cert_file", "has no PEM certificate"},
        {"test.crt", "test.crt", NULL, "tls.key_file", "is not an unencrypted PEM private key"},
        {"test.crt", "test.key", "ed.pub.pem", "tls.client_ca_file", "has no PEM certificate"},
        {"dir", "test.key", NULL, "tls.cert_file", "is not a regular file"},
        {"test.crt", "missing.key", NULL, "tls.key_file", "No such file or directory"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const tls_case_t *c = &cases[i];
        char sq[512];
        snprintf(sq, sizeof(sq),
                 CFG(",'tls':{'cert_file':'%s','key_file':'%s','client_ca_file':%s%s%s}"), c->cert,
                 c->key, c->ca ? "'" : "", c->ca ? c->ca : "null", c->ca ? "'" : "");
        cfg_t *cfg = NULL;
        cfg_errors_t e = {0};
        int rc = load_cfg("c.json", sq, &cfg, &e);
        if (c->path == NULL) {
            cr_assert_eq(rc, 0, "case %zu", i);
            cr_assert_eq(e.nwarnings, 0, "case %zu", i);
            cr_assert_eq(cfg->tls->client_ca_file == NULL, c->ca == NULL);
        } else {
            cr_assert_eq(rc, -1, "case %zu", i);
            cr_assert(has_error(&e, c->path, c->msg), "case %zu", i);
        }
        cfg_free(cfg);
        cfg_errors_free(&e);
    }
}

Test(config_files, upstream_tls_files)
{
    copy_fixture("test.crt", "ca.crt", 0644);
    copy_fixture("test.crt", "client.crt", 0644);
    copy_fixture("test.key", "client.key", 0640);
    copy_fixture("other.key", "other.key", 0600);
    cfg_errors_t e = {0};
    cfg_t *cfg = must_load("c.json",
                           POOLF(",'upstream_tls':{'ca_file':'ca.crt','client_cert_file':"
                                 "'client.crt','client_key_file':'client.key'}"),
                           &e);
    cr_assert_str_eq(cfg->pools[0].upstream_tls->client_cert_file, path_in("client.crt"));
    cr_assert_str_eq(cfg->pools[0].upstream_tls->client_key_file, path_in("client.key"));
    cr_assert_eq(e.nwarnings, 1);
    cr_assert(has_warning(&e, "pools[0].upstream_tls.client_key_file", "mode 0640"));
    cfg_free(cfg);
    cfg_errors_free(&e);

    cr_assert_eq(load_cfg("c.json",
                          POOLF(",'upstream_tls':{'client_cert_file':'client.crt',"
                                "'client_key_file':'other.key'}"),
                          &cfg, &e),
                 -1);
    cr_assert(has_error(&e, "pools[0].upstream_tls.client_key_file", "does not match"));
    cfg_errors_free(&e);
}

Test(config_files, trusted_keys_must_be_ed25519_public_keys)
{
    copy_fixture("ed25519.pub.pem", "keys/ed.pem", 0644);
    copy_fixture("p256.pub.pem", "keys/p256.pem", 0644);
    copy_fixture("test.crt", "keys/cert.pem", 0644);
    cfg_errors_t e = {0};
    cfg_t *cfg =
        must_load("c.json",
                  "{'attestation':{'require_signature':true,'trusted_keys':['keys/ed.pem']},"
                  "'pools':[{'name':'p','models':['*'],'replicas':[{'name':'r1','url':'http://h',"
                  "'attest':{'source':'agent','url':'http://h:9101/attestation'}}]}]}",
                  &e);
    cr_assert_eq(e.nwarnings, 0);
    cr_assert(cfg->attestation.require_signature);
    cr_assert_eq(cfg->attestation.ntrusted_keys, 1);
    cfg_free(cfg);

    cr_assert_eq(load_cfg("c.json",
                          CFG(",'attestation':{'trusted_keys':['keys/ed.pem','keys/p256.pem',"
                              "'keys/cert.pem']}"),
                          &cfg, &e),
                 -1);
    cr_assert_eq(e.count, 2);
    cr_assert(has_error(&e, "attestation.trusted_keys[1]", "key type is EC, expected Ed25519"));
    cr_assert(has_error(&e, "attestation.trusted_keys[2]", "not a PEM public key"));
    cfg_errors_free(&e);
}

/* A key file of DP_PEM_KEY_MAX bytes (a key and the whitespace after it) passes, one byte more
 * is refused: the limit the readers at run time apply (attest_key_load). */
Test(config_files, a_trusted_key_file_is_at_most_the_key_file_limit)
{
    static const char pem[] = "-----BEGIN PUBLIC KEY-----\n"
                              "MCowBQYDK2VwAyEAEnjhciCF9AXGi2bWLsyssO6DzbvlGSoDbYl+yvxgg4s=\n"
                              "-----END PUBLIC KEY-----\n";
    char *text = malloc(DP_PEM_KEY_MAX + 1);
    cr_assert_not_null(text);
    memcpy(text, pem, sizeof(pem) - 1);
    memset(text + sizeof(pem) - 1, '\n', DP_PEM_KEY_MAX + 1 - (sizeof(pem) - 1));
    write_bytes("keys/limit.pem", text, DP_PEM_KEY_MAX, 0644);
    write_bytes("keys/over.pem", text, DP_PEM_KEY_MAX + 1, 0644);
    free(text);
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(load_cfg("c.json",
                          CFG(",'attestation':{'trusted_keys':['keys/limit.pem','keys/over.pem']}"),
                          &cfg, &e),
                 -1);
    dump(&e);
    cr_assert_eq(e.count, 1);
    char msg[64];
    snprintf(msg, sizeof(msg), "over.pem is larger than %d bytes", DP_PEM_KEY_MAX);
    cr_assert(has_error(&e, "attestation.trusted_keys[1]", msg));
    cfg_errors_free(&e);
}

/* A key file is its PEM block and nothing else: OpenSSL alone skips text before the block and
 * ignores text after it, so "garbage" before a key, or a second key after it, would pass. */
Test(config_files, a_trusted_key_file_holds_its_pem_block_alone)
{
    static const char pem[] = "-----BEGIN PUBLIC KEY-----\n"
                              "MCowBQYDK2VwAyEAEnjhciCF9AXGi2bWLsyssO6DzbvlGSoDbYl+yvxgg4s=\n"
                              "-----END PUBLIC KEY-----\n";
    char text[512];
    snprintf(text, sizeof(text), "%s \n\r\n\t\n", pem);
    write_text("keys/spaced.pem", text, 0644);
    snprintf(text, sizeof(text), "garbage\n%s", pem);
    write_text("keys/before.pem", text, 0644);
    snprintf(text, sizeof(text), "\n%s", pem);
    write_text("keys/blank.pem", text, 0644);
    snprintf(text, sizeof(text), "%sgarbage\n", pem);
    write_text("keys/after.pem", text, 0644);
    snprintf(text, sizeof(text), "%s%s", pem, pem);
    write_text("keys/two.pem", text, 0644);
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(load_cfg("c.json",
                          CFG(",'attestation':{'trusted_keys':['keys/spaced.pem','keys/before.pem',"
                              "'keys/blank.pem','keys/after.pem','keys/two.pem']}"),
                          &cfg, &e),
                 -1);
    dump(&e);
    cr_assert_eq(e.count, 4);
    cr_assert(has_error(&e, "attestation.trusted_keys[1]",
                        "before.pem: text before the PEM block: the file must start with "
                        "-----BEGIN"));
    cr_assert(has_error(&e, "attestation.trusted_keys[2]", "text before the PEM block"));
    cr_assert(has_error(&e, "attestation.trusted_keys[3]",
                        "after.pem: text after the PEM block's END line: the file holds one key "
                        "and nothing else"));
    cr_assert(has_error(&e, "attestation.trusted_keys[4]", "text after the PEM block's END line"));
    cfg_errors_free(&e);
}

Test(config_files, unsigned_sources_under_require_signature_warn)
{
    copy_fixture("ed25519.pub.pem", "ed.pem", 0644);
    cfg_errors_t e = {0};
    cfg_t *cfg =
        must_load("c.json",
                  "{'attestation':{'require_signature':true,'trusted_keys':['ed.pem']},"
                  "'pools':[{'name':'p','models':['*'],'replicas':[{'name':'r1','url':'http://h',"
                  "'attest':{'source':'vllm'}}],'discovery':{'dns':'svc','port':80,"
                  "'attest':{'source':'llamacpp'}}}]}",
                  &e);
    cr_assert_eq(e.nwarnings, 2);
    cr_assert(has_warning(&e, "pools[0].replicas[0].attest", "vllm adapter is unsigned"));
    cr_assert(has_warning(&e, "pools[0].discovery.attest", "llamacpp adapter is unsigned"));
    cfg_free(cfg);
    cfg_errors_free(&e);
}

Test(config_files, audit_path)
{
    cfg_t *cfg;
    cfg_errors_t e = {0};
    /* Its folder must exist... */
    cr_assert_eq(load_cfg("c.json", CFG(",'log':{'audit_path':'audit/a.jsonl'}"), &cfg, &e), -1);
    cr_assert(has_error(&e, "log.audit_path", "cannot create"));
    cfg_errors_free(&e);
    mkdir(path_in("audit"), 0755);
    cfg = must_load("c.json", CFG(",'log':{'audit_path':'audit/a.jsonl'}"), &e);
    cr_assert_str_eq(cfg->log.audit_path, path_in("audit/a.jsonl"));
    cfg_free(cfg);
    /* ...or the file itself, which may already hold lines. */
    write_text("audit/a.jsonl", "{}\n", 0644);
    cfg = must_load("c.json", CFG(",'log':{'audit_path':'audit/a.jsonl'}"), &e);
    cfg_free(cfg);
    cfg_errors_free(&e);
}

/* ---- the shipped examples ------------------------------------------------------------------ */

Test(config_files, example_config_is_valid)
{
    cfg_t *cfg;
    cfg_errors_t e = {0};
    int rc = cfg_load(EXAMPLES "detproxy.json", &cfg, &e);
    if (rc != 0 || e.nwarnings != 0)
        dump(&e);
    cr_assert_eq(rc, 0);
    cr_assert_eq(e.nwarnings, 0);
    cr_assert_eq(cfg->npools, 1);
    const cfg_pool_t *p = &cfg->pools[0];
    cr_assert_eq(p->nreplicas, 3);
    const char *urls[] = {"127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"};
    for (size_t i = 0; i < 3; i++) {
        cr_assert_str_eq(p->replicas[i].url.hostport, urls[i]);
        cr_assert_eq(p->replicas[i].attest.source, CFG_ATTEST_VLLM); /* r3 by default */
    }
    cr_assert_str_eq(p->manifest->fingerprint, "fp_3c3b2857ad9d4389");
    cr_assert_eq(cfg->policy->ntenants, 2);
    const cfg_tenant_t *bank = &cfg->policy->tenants[0];
    cr_assert_str_eq(bank->name, "bank");
    cr_assert_eq(bank->match_kind, CFG_MATCH_API_KEYS);
    /* printf 'bank-demo-token' | sha256sum -> 0d2a099f...c79d */
    cr_assert_eq(bank->api_keys[0][0], 0x0d);
    cr_assert_eq(bank->api_keys[0][1], 0x2a);
    cr_assert_eq(bank->api_keys[0][31], 0x9d);
    cr_assert(bank->audit);
    cr_assert(bank->rules[CFG_PARAM_SEED].has_force);
    cr_assert(cfg->policy->tenants[1].rules[CFG_PARAM_SEED].derive);
    cr_assert_eq(cfg->policy->tenants[1].match_kind, CFG_MATCH_ANY);
    cr_assert_not_null(cfg->log.audit_path);
    cfg_free(cfg);
}

static cfg_manifest_t *parse_manifest_file(const char *path, cfg_errors_t *e)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    char buf[65536];
    size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    return cfg_manifest_parse(buf, n, path, e);
}

Test(config_files, example_manifests_and_policy_parse)
{
    cfg_errors_t e = {0};
    cfg_manifest_t *m = parse_manifest_file(EXAMPLES "manifests/llama.json", &e);
    cr_assert_not_null(m);
    cfg_manifest_free(m);
    m = parse_manifest_file(EXAMPLES "manifests/llama-agent.json", &e);
    cr_assert_not_null(m);
    cr_assert_str_eq(m->quantization, "awq");
    cfg_manifest_free(m);

    FILE *f = fopen(EXAMPLES "policy.json", "rb");
    char buf[65536];
    size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    cfg_policy_t *p = cfg_policy_parse(buf, n, "policy", &e);
    cr_assert_not_null(p);
    cfg_policy_free(p);
    if (e.count)
        dump(&e);
    cr_assert_eq(e.count, 0);
    cfg_errors_free(&e);
}

/* ---- detproxy check ------------------------------------------------------------------------ */

static char *slurp(FILE *f)
{
    fflush(f);
    long n = ftell(f);
    char *s = calloc(1, (size_t)n + 1);
    rewind(f);
    size_t got = fread(s, 1, (size_t)n, f);
    s[got] = '\0';
    fclose(f);
    return s;
}

/* Run `detproxy check ARGS...` (args NULL-terminated) capturing stdout and stderr. */
static int run_check(const char *const *args, char **out, char **err)
{
    char *argv[16] = {"check"};
    int argc = 1;
    for (; argc < 15 && args[argc - 1] != NULL; argc++)
        argv[argc] = (char *)args[argc - 1];

    fflush(stdout);
    fflush(stderr);
    int save_out = dup(1), save_err = dup(2);
    FILE *fo = tmpfile(), *fe = tmpfile();
    dup2(fileno(fo), 1);
    dup2(fileno(fe), 2);
    int rc = cfg_cmd_check(argc, argv);
    fflush(stdout);
    fflush(stderr);
    dup2(save_out, 1);
    dup2(save_err, 2);
    close(save_out);
    close(save_err);
    fseek(fo, 0, SEEK_END);
    fseek(fe, 0, SEEK_END);
    *out = slurp(fo);
    *err = slurp(fe);
    return rc;
}

#define CHECK(out, err, ...) run_check((const char *const[]){__VA_ARGS__, NULL}, out, err)

static size_t count_lines(const char *s)
{
    size_t n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

Test(config_files, check_usage)
{
    char *out, *err;
    cr_assert_eq(CHECK(&out, &err, "--help"), 0);
    cr_assert_eq(strncmp(out, "usage: detproxy check -c CONFIG [--strict]\n", 41), 0);
    cr_assert_str_eq(err, "");
    free(out);
    free(err);

    const char *bad[][4] = {{NULL},
                            {"-x", NULL},
                            {"-c", NULL},
                            {"--config", NULL},
                            {"file.json", NULL},
                            {"-c", "a.json", "--config=b.json", NULL},
                            {"--config=", NULL}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc = run_check(bad[i], &out, &err);
        cr_assert_eq(rc, 2, "case %zu", i);
        cr_assert_str_eq(out, "", "case %zu", i);
        cr_assert_eq(count_lines(err), 1, "case %zu: %s", i, err);
        cr_assert_eq(strncmp(err, "detproxy check: ", 16), 0, "case %zu", i);
        free(out);
        free(err);
    }
}

Test(config_files, check_valid_example)
{
    char *out, *err;
    cr_assert_eq(CHECK(&out, &err, "-c", EXAMPLES "detproxy.json"), 0);
    cr_assert_str_eq(out, "ok: 1 pool, 3 replicas, 2 tenants\n");
    cr_assert_str_eq(err, "");
    free(out);
    free(err);
    cr_assert_eq(CHECK(&out, &err, "--config=" EXAMPLES "detproxy.json"), 0);
    cr_assert_str_eq(out, "ok: 1 pool, 3 replicas, 2 tenants\n");
    free(out);
    free(err);
}

Test(config_files, check_prints_errors_and_warnings)
{
    write_q("bad.json",
            "{'limits':{'max_headers':0},'pools':[{'name':'p','models':['*'],"
            "'replicas':[{'name':'r','url':'ftp://h'}]}]}",
            0644);
    char *out, *err;
    cr_assert_eq(CHECK(&out, &err, "-c", path_in("bad.json")), 1);
    cr_assert_str_eq(out, "");
    cr_assert_str_eq(err, "error: limits.max_headers: must be between 1 and 10000\n"
                          "error: pools[0].replicas[0].url: must start with http:// or https://\n");
    free(out);
    free(err);

    write_text("key", "k", 0644);
    write_q("warn.json",
            "{'pools':[{'name':'p','models':['*'],'api_key_file':'key','replicas':[" REPLICA
            "]},{'name':'q','models':['m'],'discovery':{'dns':'svc','port':80}}],"
            "'policy':{'tenants':[{'name':'a','match':{'any':true}}]}}",
            0644);
    cr_assert_eq(CHECK(&out, &err, "--config", path_in("warn.json")), 0);
    cr_assert_str_eq(out, "ok: 2 pools, 1 replica, 1 tenant (+ DNS discovery in 1 pool)\n");
    cr_assert_eq(strncmp(err, "warning: pools[0].api_key_file: ", 32), 0, "%s", err);
    cr_assert_eq(count_lines(err), 1);
    free(out);
    free(err);

    cr_assert_eq(CHECK(&out, &err, "-c", path_in("missing.json")), 1);
    cr_assert_eq(strncmp(err, "error: config: cannot read ", 27), 0, "%s", err);
    free(out);
    free(err);
}

/* ---- a Kubernetes volume swapped during a load --------------------------------------------- */

/* The kubelet's layout: name -> ..data/name, ..data -> the version's folder, swapped by a rename
 * of a new link over ..data. */
static void kube_volume(void)
{
    write_bytes("vol/v1/a.json", "a1", 2, 0644);
    write_bytes("vol/v1/b.json", "b1", 2, 0644);
    write_bytes("vol/v2/a.json", "a2", 2, 0644);
    write_bytes("vol/v2/b.json", "b2", 2, 0644);
    cr_assert_eq(symlink("v1", path_in("vol/..data")), 0);
    cr_assert_eq(symlink("..data/a.json", path_in("vol/a.json")), 0);
    cr_assert_eq(symlink("..data/b.json", path_in("vol/b.json")), 0);
}

static void kube_swap_to(const char *version)
{
    cr_assert_eq(symlink(version, path_in("vol/..data_tmp")), 0);
    cr_assert_eq(rename(path_in("vol/..data_tmp"), path_in("vol/..data")), 0);
}

static const char *read_in(cfg_ctx_t *c, const char *rel, dp_buf_t *b)
{
    dp_buf_reset(b);
    cr_assert(cfg_read_file(c, NULL, path_in(rel), 64, b), "%s", rel);
    dp_buf_appendc(b, '\0');
    return b->base;
}

Test(config_files, a_load_reads_one_version_of_a_kubernetes_volume)
{
    kube_volume();
    cfg_errors_t e = {0};
    cfg_ctx_t c;
    cfg_ctx_init(&c, &e, NULL, "config", g_dir);
    dp_buf_t b = {0};
    cfg_versions_begin();
    cr_assert_str_eq(read_in(&c, "vol/a.json", &b), "a1");
    kube_swap_to("v2"); /* between the config and the policy it names */
    cr_assert_str_eq(read_in(&c, "vol/b.json", &b), "b1", "two versions mixed in one load");
    cfg_versions_end();
    /* The next load reads the new version whole; outside a load, files are read as they are. */
    cfg_versions_begin();
    cr_assert_str_eq(read_in(&c, "vol/b.json", &b), "b2");
    kube_swap_to("v1");
    cr_assert_str_eq(read_in(&c, "vol/a.json", &b), "a2");
    cfg_versions_end();
    cr_assert_str_eq(read_in(&c, "vol/a.json", &b), "a1");
    /* One folder however its path is spelled. */
    cfg_versions_begin();
    cr_assert_str_eq(read_in(&c, "vol/./a.json", &b), "a1");
    kube_swap_to("v2");
    cr_assert_str_eq(read_in(&c, "vol/b.json", &b), "b1", "two spellings, two versions");
    cr_assert(!cfg_versions_gone());
    /* The kubelet removes the old version after a swap: a load that finds it gone says so. */
    cr_assert_eq(remove(path_in("vol/v1/a.json")), 0);
    dp_buf_reset(&b);
    cr_assert(!cfg_read_file(&c, NULL, path_in("vol/a.json"), 64, &b));
    cr_assert(cfg_versions_gone());
    cfg_versions_end();
    dp_buf_free(&b);
    cfg_ctx_free(&c);
    cfg_errors_free(&e);
}
