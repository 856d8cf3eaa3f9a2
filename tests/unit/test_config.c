/* config/: parsing, defaults and every validation rule, on configs given as strings (no files).
 * File-backed behaviour (referenced documents, secrets, keys, the check command) is in
 * test_config_files.c.
 *
 * Configs are written with single quotes to stay readable in C; q() turns them into JSON. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"

/* ---- helpers ----------------------------------------------------------------------------- */

static char *q(const char *s)
{
    char *d = strdup(s);
    for (char *p = d; *p; p++)
        if (*p == '\'')
            *p = '"';
    return d;
}

static int load_q(const char *sq, cfg_t **out, cfg_errors_t *e)
{
    char *json = q(sq);
    int rc = cfg_load_string(json, strlen(json), "/nonexistent-config-dir", out, e);
    free(json);
    return rc;
}

static void dump(const cfg_errors_t *e)
{
    for (size_t i = 0; i < e->count; i++)
        fprintf(stderr, "  error: %s\n", e->items[i]);
    for (size_t i = 0; i < e->nwarnings; i++)
        fprintf(stderr, "  warning: %s\n", e->warnings[i]);
}

/* Some item is "<path>: <...msg...>": the path exactly, then the message somewhere after. */
static bool has_at(char *const *items, size_t n, const char *path, const char *msg)
{
    size_t plen = strlen(path);
    for (size_t i = 0; i < n; i++) {
        const char *it = items[i];
        if (strncmp(it, path, plen) == 0 && strncmp(it + plen, ": ", 2) == 0 &&
            strstr(it + plen + 2, msg) != NULL)
            return true;
    }
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

/* Load a config that must be valid. */
static cfg_t *must_load(const char *sq)
{
    cfg_t *cfg = NULL;
    cfg_errors_t e = {0};
    int rc = load_q(sq, &cfg, &e);
    if (rc != 0)
        dump(&e);
    cr_assert_eq(rc, 0, "config should be valid");
    cr_assert_eq(e.count, 0);
    cr_assert_not_null(cfg);
    cfg_errors_free(&e);
    return cfg;
}

#define H64 "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
#define REPLICA "{'name':'r1','url':'http://127.0.0.1:8001'}"
#define POOL "{'name':'p','models':['*'],'replicas':[" REPLICA "]}"
/* A valid config plus top-level members. */
#define CFG(extra) "{'pools':[" POOL "]" extra "}"
/* A pool with extra members (fields start with a comma). */
#define POOLF(fields) "{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "]" fields "}]}"
/* A pool with only the given members after name and models. */
#define POOLX(fields) "{'pools':[{'name':'p','models':['*']" fields "}]}"
/* The single replica with extra members. */
#define REPF(fields)                                                                               \
    "{'pools':[{'name':'p','models':['*'],'replicas':[{'name':'r1','url':'http://"                 \
    "127.0.0.1:8001'" fields "}]}]}"
#define MANIFEST(m) POOLF(",'manifest':" m)
#define POLICY(tenants) CFG(",'policy':{'tenants':[" tenants "]}")
#define TENANT(fields) "{'name':'t','match':{'any':true}" fields "}"
#define RULE(param, rule) POLICY(TENANT(",'sampling':{'" param "':" rule "}"))
#define URL(u) "{'pools':[{'name':'p','models':['*'],'replicas':[{'name':'r1','url':'" u "'}]}]}"

/* ---- every validation rule: an invalid config and the error path it must name ---------------- */

typedef struct {
    const char *json;
    const char *path;
    const char *msg;
} bad_case_t;

/* clang-format off */
static const bad_case_t bad_cases[] = {
    /* document */
    {"[]", "config", "expected a JSON object"},
    {"{'pools': [}", "config", "invalid JSON at line 1, column"},
    {"{} x", "config", "invalid JSON"},
    {"{}", "pools", "required"},
    {"{'pools':[]}", "pools", "at least one pool"},
    {"{'pools':{}}", "pools", "expected an array"},
    {CFG(",'bogus':1"), "bogus", "unknown key"},
    {CFG(",'lissen':'127.0.0.1:1'"), "lissen", "did you mean \"listen\""},
    {CFG(",'listen':'127.0.0.1:1','listen':'127.0.0.1:2'"), "listen", "duplicate key"},
    {CFG(",'a b':1"), "[\"a b\"]", "unknown key"},
    /* listeners */
    {CFG(",'listen':5"), "listen", "expected a string"},
    {CFG(",'listen':''"), "listen", "must not be empty"},
    {CFG(",'listen':'localhost:8080'"), "listen", "numeric IP address"},
    {CFG(",'listen':'127.0.0.1'"), "listen", "expected host:port"},
    {CFG(",'listen':'127.0.0.1:65536'"), "listen", "port must be between 0 and 65535"},
    {CFG(",'listen':'127.0.0.1:-1'"), "listen", "port must be between 0 and 65535"},
    {CFG(",'listen':'::1:80'"), "listen", "brackets"},
    {CFG(",'listen':'[::1:80'"), "listen", "missing ']'"},
    {CFG(",'listen':'[zz]:80'"), "listen", "not a numeric IPv6 address"},
    {CFG(",'listen':'[::1]80'"), "listen", "expected ':' after ']'"},
    {CFG(",'listen':':80'"), "listen", "missing host"},
    {CFG(",'admin_listen':'10.0.0.1:9901'"), "admin_listen", "not a loopback address"},
    {CFG(",'admin_listen':'0.0.0.0:9901'"), "admin_listen", "not a loopback address"},
    {CFG(",'admin_listen':'[::]:9901'"), "admin_listen", "not a loopback address"},
    {CFG(",'admin_listen':'bad'"), "admin_listen", "expected host:port"},
    {CFG(",'listen':'127.0.0.1:9000','admin_listen':'127.0.0.1:9000'"), "admin_listen", "overlaps listen"},
    {CFG(",'listen':'0.0.0.0:9000','admin_listen':'127.0.0.1:9000'"), "admin_listen", "overlaps listen"},
    /* candidates (docs/configuration.md "Candidates") */
    {"{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "],'candidates':5},{'name':'q','models':['q'],'replicas':[" REPLICA "]}]}", "pools[0].candidates", "expected an array"},
    {"{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "],'candidates':[5]},{'name':'q','models':['q'],'replicas':[" REPLICA "]}]}", "pools[0].candidates[0]", "expected an object"},
    {"{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "],'candidates':[{'pool':'q'}]},{'name':'q','models':['q'],'replicas':[" REPLICA "]}]}", "pools[0].candidates[0].rate", "required"},
    {"{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "],'candidates':[{'rate':0.5}]},{'name':'q','models':['q'],'replicas':[" REPLICA "]}]}", "pools[0].candidates[0].pool", "required"},
    {"{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "],'candidates':[{'pool':'q','rate':1.5}]},{'name':'q','models':['q'],'replicas':[" REPLICA "]}]}", "pools[0].candidates[0].rate", "between"},
    {"{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "],'candidates':[{'pool':'q','rate':-0.1}]},{'name':'q','models':['q'],'replicas':[" REPLICA "]}]}", "pools[0].candidates[0].rate", "between"},
    {"{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "],'candidates':[{'pool':'q','rate':0.1,'model':'x'}]},{'name':'q','models':['q'],'replicas':[" REPLICA "]}]}", "pools[0].candidates[0].model", "unknown key"},
    {"{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "],'candidates':[{'pool':'nope','rate':0.1}]},{'name':'q','models':['q'],'replicas':[" REPLICA "]}]}", "pools[0].candidates[0].pool", "no pool is named \"nope\""},
    {"{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "],'candidates':[{'pool':'p','rate':0.1}]},{'name':'q','models':['q'],'replicas':[" REPLICA "]}]}", "pools[0].candidates[0].pool", "its own candidate"},
    {"{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "],'candidates':[{'pool':'q','rate':0.1},{'pool':'q','rate':0.2}]},{'name':'q','models':['q'],'replicas':[" REPLICA "]}]}", "pools[0].candidates[1].pool", "duplicate candidate (also candidates[0])"},
    {"{'pools':[{'name':'p','models':['*'],'replicas':[" REPLICA "],'candidates':[{'pool':'q','rate':0.1}]},{'name':'q','models':['q'],'replicas':[" REPLICA "],'candidates':[{'pool':'p','rate':0.1}]}]}", "pools[1].candidates", "itself a candidate"},
    /* workers */
    {CFG(",'workers':65"), "workers", "must be between 0 and 64"},
    {CFG(",'workers':-1"), "workers", "must be between 0 and 64"},
    {CFG(",'workers':'2'"), "workers", "expected an integer"},
    {CFG(",'workers':1.5"), "workers", "expected an integer"},
    /* limits */
    {CFG(",'limits':5"), "limits", "expected an object"},
    {CFG(",'limits':{'max_header':5}"), "limits.max_header", "did you mean \"max_headers\""},
    {CFG(",'limits':{'max_headers':0}"), "limits.max_headers", "must be between 1 and 10000"},
    {CFG(",'limits':{'max_headers':10001}"), "limits.max_headers", "must be between 1 and 10000"},
    {CFG(",'limits':{'max_headers':'100'}"), "limits.max_headers", "expected an integer"},
    {CFG(",'limits':{'max_header_bytes':0}"), "limits.max_header_bytes", "must be between 1 and 1048576"},
    {CFG(",'limits':{'max_body_bytes':1.5}"), "limits.max_body_bytes", "expected an integer"},
    {CFG(",'limits':{'max_body_bytes':1073741825}"), "limits.max_body_bytes", "must be between 1 and 1073741824"},
    {CFG(",'limits':{'max_body_bytes':1e999}"), "limits.max_body_bytes", "expected an integer"},
    {CFG(",'limits':{'max_connections':-1}"), "limits.max_connections", "must be between 1 and 1000000"},
    {CFG(",'limits':{'max_inflight_body_bytes':1000}"), "limits.max_inflight_body_bytes", "must be at least limits.max_body_bytes (8388608)"},
    {CFG(",'limits':{'client_body_timeout_ms':0}"), "limits.client_body_timeout_ms", "must be between 1 and 86400000"},
    {CFG(",'limits':{'max_response_rewrite_bytes':0}"), "limits.max_response_rewrite_bytes", "must be between 1 and 1073741824"},
    {CFG(",'limits':{'max_pending_handshakes':0}"), "limits.max_pending_handshakes", "must be between 1 and 1000000"},
    {CFG(",'limits':{'shutdown_timeout_ms':0}"), "limits.shutdown_timeout_ms", "must be between 1 and 86400000"},
    {CFG(",'limits':{'client_header_timeout_ms':0}"), "limits.client_header_timeout_ms", "must be between 1 and 86400000"},
    {CFG(",'limits':{'client_idle_timeout_ms':0}"), "limits.client_idle_timeout_ms", "must be between 1"},
    {CFG(",'limits':{'upstream_connect_timeout_ms':0}"), "limits.upstream_connect_timeout_ms", "must be between 1"},
    {CFG(",'limits':{'upstream_first_byte_timeout_ms':86400001}"), "limits.upstream_first_byte_timeout_ms", "must be between 1 and 86400000"},
    {CFG(",'limits':{'upstream_idle_timeout_ms':0}"), "limits.upstream_idle_timeout_ms", "must be between 1"},
    /* attestation */
    {CFG(",'attestation':[]"), "attestation", "expected an object"},
    {CFG(",'attestation':{'interval':5}"), "attestation.interval", "did you mean \"interval_ms\""},
    {CFG(",'attestation':{'interval_ms':99}"), "attestation.interval_ms", "must be between 100 and 86400000"},
    {CFG(",'attestation':{'timeout_ms':0}"), "attestation.timeout_ms", "must be between 1"},
    {CFG(",'attestation':{'require_signature':'yes'}"), "attestation.require_signature", "expected true or false"},
    {CFG(",'attestation':{'require_signature':true}"), "attestation.trusted_keys", "required when require_signature is true"},
    {CFG(",'attestation':{'require_signature':true,'trusted_keys':[]}"), "attestation.trusted_keys", "must not be empty when require_signature"},
    {CFG(",'attestation':{'trusted_keys':'k.pem'}"), "attestation.trusted_keys", "expected an array"},
    {CFG(",'attestation':{'trusted_keys':['']}"), "attestation.trusted_keys[0]", "must not be empty"},
    {CFG(",'attestation':{'trusted_keys':[7]}"), "attestation.trusted_keys[0]", "expected a string"},
    {CFG(",'attestation':{'trusted_keys':['missing.pub.pem']}"), "attestation.trusted_keys[0]", "cannot read /nonexistent-config-dir/missing.pub.pem"},
    /* shadow */
    {CFG(",'shadow':{'rate':1.5}"), "shadow.rate", "must be between 0 and 1"},
    {CFG(",'shadow':{'rate':-0.1}"), "shadow.rate", "must be between 0 and 1"},
    {CFG(",'shadow':{'rate':'0.1'}"), "shadow.rate", "expected a number"},
    {CFG(",'shadow':{'self_rate':2}"), "shadow.self_rate", "must be between 0 and 1"},
    {CFG(",'shadow':{'max_inflight':0}"), "shadow.max_inflight", "must be between 1 and 10000"},
    {CFG(",'shadow':{'max_output_bytes':0}"), "shadow.max_output_bytes", "must be between 1"},
    {CFG(",'shadow':{'quarantine':1}"), "shadow.quarantine", "expected true or false"},
    {CFG(",'shadow':{'sample':1}"), "shadow.sample", "unknown key"},
    /* log */
    {CFG(",'log':{'level':'verbose'}"), "log.level", "must be one of debug, info, warn, error"},
    {CFG(",'log':{'level':1}"), "log.level", "must be one of"},
    {CFG(",'log':{'audit_path':'/nonexistent-dir/x/audit.jsonl'}"), "log.audit_path", "cannot create /nonexistent-dir/x/audit.jsonl"},
    {CFG(",'log':{'audit_path':'/'}"), "log.audit_path", "is not a regular file"},
    {CFG(",'log':{'file':'x'}"), "log.file", "unknown key"},
    /* tls and admin token */
    {CFG(",'tls':{}"), "tls.cert_file", "required"},
    {CFG(",'tls':{}"), "tls.key_file", "required"},
    {CFG(",'tls':{'cert_file':'c.crt','key_file':'c.key'}"), "tls.cert_file", "cannot read /nonexistent-config-dir/c.crt"},
    {CFG(",'tls':{'cert_file':'c.crt','key_file':'c.key'}"), "tls.key_file", "cannot read"},
    {CFG(",'tls':{'cert_file':'c.crt','key_file':'c.key','client_ca_file':'ca.crt'}"), "tls.client_ca_file", "cannot read"},
    {CFG(",'tls':{'cert':'c.crt'}"), "tls.cert", "did you mean \"cert_file\""},
    {CFG(",'admin_token_file':'token'"), "admin_token_file", "cannot read /nonexistent-config-dir/token"},
    {CFG(",'admin_token_file':3"), "admin_token_file", "expected a string"},
    /* pools */
    {"{'pools':[1]}", "pools[0]", "expected an object"},
    {"{'pools':[{'models':['*'],'replicas':[" REPLICA "]}]}", "pools[0].name", "required"},
    {"{'pools':[{'name':'','models':['*'],'replicas':[" REPLICA "]}]}", "pools[0].name", "must not be empty"},
    {"{'pools':[{'name':'a b','models':['*'],'replicas':[" REPLICA "]}]}", "pools[0].name", "must be 1-128 characters"},
    {"{'pools':[{'name':'-','models':['*'],'replicas':[" REPLICA "]}]}", "pools[0].name", "not '-' alone"},
    {"{'pools':[" POOL "," POOL "]}", "pools[1].name", "duplicate pool name (also pools[0])"},
    {"{'pools':[{'name':'p','replicas':[" REPLICA "]}]}", "pools[0].models", "required"},
    {"{'pools':[{'name':'p','models':[],'replicas':[" REPLICA "]}]}", "pools[0].models", "must not be empty"},
    {"{'pools':[{'name':'p','models':['a',''],'replicas':[" REPLICA "]}]}", "pools[0].models[1]", "must not be empty"},
    {"{'pools':[{'name':'p','models':[1],'replicas':[" REPLICA "]}]}", "pools[0].models[0]", "expected a string"},
    {"{'pools':[{'name':'p','models':'*','replicas':[" REPLICA "]}]}", "pools[0].models", "expected an array"},
    {POOLF(",'balance':'random'"), "pools[0].balance", "must be one of least_inflight, round_robin, affinity"},
    /* affinity (docs/configuration.md "Affinity routing") */
    {POOLF(",'affinity':{}"), "pools[0].affinity", "only with \"balance\": \"affinity\""},
    {POOLF(",'balance':'round_robin','affinity':{'key':'prefix'}"), "pools[0].affinity", "only with"},
    {POOLF(",'balance':'affinity','affinity':3"), "pools[0].affinity", "expected an object"},
    {POOLF(",'balance':'affinity','affinity':{'key':'user'}"), "pools[0].affinity.key", "must be one of prefix, session, seed"},
    {POOLF(",'balance':'affinity','affinity':{'prefix_bytes':0}"), "pools[0].affinity.prefix_bytes", "must be between 1 and 16777216"},
    {POOLF(",'balance':'affinity','affinity':{'prefix_bytes':'4k'}"), "pools[0].affinity.prefix_bytes", "expected"},
    {POOLF(",'balance':'affinity','affinity':{'session_header':'x session'}"), "pools[0].affinity.session_header", "not a valid HTTP header name"},
    {POOLF(",'balance':'affinity','affinity':{'session_header':''}"), "pools[0].affinity.session_header", "must not be empty"},
    {POOLF(",'balance':'affinity','affinity':{'load_factor':0.9}"), "pools[0].affinity.load_factor", "must be between 1 and 100"},
    {POOLF(",'balance':'affinity','affinity':{'load_factor':'1.25'}"), "pools[0].affinity.load_factor", "expected a number"},
    {POOLF(",'balance':'affinity','affinity':{'keys':'prefix'}"), "pools[0].affinity.keys", "unknown key"},
    {POOLF(",'max_inflight_per_replica':-1"), "pools[0].max_inflight_per_replica", "must be between 0 and 1000000"},
    {POOLF(",'max_inflight_per_replica':1000001"), "pools[0].max_inflight_per_replica", "must be between 0 and 1000000"},
    {POOLF(",'queue_limit':1.5"), "pools[0].queue_limit", "expected an integer"},
    {POOLF(",'queue_timeout_ms':0"), "pools[0].queue_timeout_ms", "must be between 1 and 86400000"},
    {POOLF(",'replica':[]"), "pools[0].replica", "did you mean \"replicas\""},
    {POOLF(",'api_key_file':'secrets/key'"), "pools[0].api_key_file", "cannot read /nonexistent-config-dir/secrets/key"},
    {POOLX(""), "pools[0]", "needs replicas or discovery"},
    {POOLX(",'replicas':[]"), "pools[0]", "needs replicas or discovery"},
    {POOLX(",'replicas':{}"), "pools[0].replicas", "expected an array"},
    {POOLF(",'manifest':5"), "pools[0].manifest", "expected a file path or an object"},
    {POOLF(",'manifest':''"), "pools[0].manifest", "expected a file path or an object"},
    {POOLF(",'manifest':'manifests/m.json'"), "pools[0].manifest", "cannot read /nonexistent-config-dir/manifests/m.json"},
    /* replicas */
    {POOLX(",'replicas':['r1']"), "pools[0].replicas[0]", "expected an object"},
    {POOLX(",'replicas':[{'url':'http://h'}]"), "pools[0].replicas[0].name", "required"},
    {POOLX(",'replicas':[{'name':'r 1','url':'http://h'}]"), "pools[0].replicas[0].name", "must be 1-128 characters"},
    /* names are parts of admin paths, which are normalised before routing */
    {POOLX(",'replicas':[{'name':'..','url':'http://h'}]"), "pools[0].replicas[0].name", "'.' or '..' part"},
    {POOLX(",'replicas':[{'name':'a//b','url':'http://h'}]"), "pools[0].replicas[0].name", "no empty"},
    {POOLX(",'replicas':[{'name':'x/.','url':'http://h'}]"), "pools[0].replicas[0].name", "between slashes"},
    {POOLX(",'replicas':[{'name':'z/','url':'http://h'}]"), "pools[0].replicas[0].name", "between slashes"},
    {POOLX(",'replicas':[{'name':'/z','url':'http://h'}]"), "pools[0].replicas[0].name", "between slashes"},
    {POOLX(",'replicas':[" REPLICA "," REPLICA "]"), "pools[0].replicas[1].name", "duplicate replica name (also replicas[0])"},
    {POOLX(",'replicas':[{'name':'r1'}]"), "pools[0].replicas[0].url", "required"},
    {REPF(",'uri':'x'"), "pools[0].replicas[0].uri", "did you mean \"url\""},
    {URL("ftp://h"), "pools[0].replicas[0].url", "must start with http:// or https://"},
    {URL("127.0.0.1:8000"), "pools[0].replicas[0].url", "must start with http:// or https://"},
    {URL("http://"), "pools[0].replicas[0].url", "missing host"},
    {URL("http://h:0"), "pools[0].replicas[0].url", "port must be between 1 and 65535"},
    {URL("http://h:65536"), "pools[0].replicas[0].url", "port must be between 1 and 65535"},
    {URL("http://h:/v1"), "pools[0].replicas[0].url", "port must be between 1 and 65535"},
    {URL("http://h:8x"), "pools[0].replicas[0].url", "port must be between 1 and 65535"},
    {URL("http://user:pw@h"), "pools[0].replicas[0].url", "must not carry user info"},
    {URL("http://h/v1?x=1"), "pools[0].replicas[0].url", "query string or fragment"},
    {URL("http://h/v1#top"), "pools[0].replicas[0].url", "query string or fragment"},
    {URL("http://10.0.0.256:80"), "pools[0].replicas[0].url", "invalid host"},
    {URL("http://-h-:80"), "pools[0].replicas[0].url", "invalid host"},
    {URL("http://h!x:80"), "pools[0].replicas[0].url", "invalid host"},
    {URL("http://[zz]:80"), "pools[0].replicas[0].url", "not a numeric IPv6 address"},
    {URL("http://::1:80"), "pools[0].replicas[0].url", "brackets"},
    {URL("http://h/a b"), "pools[0].replicas[0].url", "percent-encoded"},
    {URL("http://h/a%zz"), "pools[0].replicas[0].url", "percent-encoded"},
    {REPF(",'server_name':'bad name'"), "pools[0].replicas[0].server_name", "must be a DNS name"},
    {REPF(",'server_name':''"), "pools[0].replicas[0].server_name", "must not be empty"},
    {REPF(",'attest':'vllm'"), "pools[0].replicas[0].attest", "expected an object"},
    {REPF(",'attest':{}"), "pools[0].replicas[0].attest.source", "required"},
    {REPF(",'attest':{'source':'none'}"), "pools[0].replicas[0].attest.source", "must be one of agent, vllm, tgi, sglang, llamacpp"},
    {REPF(",'attest':{'source':'VLLM'}"), "pools[0].replicas[0].attest.source", "must be one of"},
    {REPF(",'attest':{'source':'agent'}"), "pools[0].replicas[0].attest.url", "required"},
    {REPF(",'attest':{'source':'agent','url':'ftp://h'}"), "pools[0].replicas[0].attest.url", "must start with http://"},
    {REPF(",'attest':{'source':'vllm','url':'http://h/attestation'}"), "pools[0].replicas[0].attest.url", "only used with source agent"},
    {REPF(",'attest':{'source':'vllm','port':9101}"), "pools[0].replicas[0].attest.port", "unknown key"},
    /* default attestation source */
    {POOLF(",'manifest':{'model':'m'}"), "pools[0].replicas[0].attest", "required: the pool's manifest pins fields"},
    {POOLF(",'manifest':{'framework':{'name':'custom'}}"), "pools[0].replicas[0].attest", "names no native adapter"},
    {POOLF(",'manifest':{'dtype':'bf16','framework':{'name':'vLLM'}}"), "pools[0].replicas[0].attest", "required"},
    /* discovery */
    {POOLX(",'discovery':5"), "pools[0].discovery", "expected an object"},
    {POOLX(",'discovery':{'port':8000}"), "pools[0].discovery.dns", "required"},
    {POOLX(",'discovery':{'dns':'bad host!','port':8000}"), "pools[0].discovery.dns", "must be a DNS name"},
    {POOLX(",'discovery':{'dns':'a..b','port':8000}"), "pools[0].discovery.dns", "must be a DNS name"},
    {POOLX(",'discovery':{'dns':'svc'}"), "pools[0].discovery.port", "required"},
    {POOLX(",'discovery':{'dns':'svc','port':8000,'max_replicas':0}"), "pools[0].discovery.max_replicas", "must be between 1 and 4096"},
    {POOLX(",'discovery':{'dns':'svc','port':0}"), "pools[0].discovery.port", "must be between 1 and 65535"},
    {POOLX(",'discovery':{'dns':'svc','port':65536}"), "pools[0].discovery.port", "must be between 1 and 65535"},
    {POOLX(",'discovery':{'dns':'svc','port':80,'refresh_ms':99}"), "pools[0].discovery.refresh_ms", "must be between 100 and 86400000"},
    {POOLX(",'discovery':{'dns':'svc','port':80,'ttl':5}"), "pools[0].discovery.ttl", "unknown key"},
    {POOLX(",'discovery':{'dns':'svc','port':80,'attest':{'source':'agent'}}"), "pools[0].discovery.attest.port", "required with source agent"},
    {POOLX(",'discovery':{'dns':'svc','port':80,'attest':{'source':'agent','port':0}}"), "pools[0].discovery.attest.port", "must be between 1 and 65535"},
    {POOLX(",'discovery':{'dns':'svc','port':80,'attest':{'source':'tgi','port':9101}}"), "pools[0].discovery.attest.port", "only used with source agent"},
    {POOLX(",'discovery':{'dns':'svc','port':80,'attest':{'source':'x'}}"), "pools[0].discovery.attest.source", "must be one of"},
    {POOLX(",'discovery':{'dns':'svc','port':80,'attest':{'url':'http://h'}}"), "pools[0].discovery.attest.url", "unknown key"},
    {POOLX(",'manifest':{'quantization':'awq'},'discovery':{'dns':'svc','port':80}"), "pools[0].discovery.attest", "required: the pool's manifest pins fields"},
    /* upstream_tls */
    {POOLF(",'upstream_tls':true"), "pools[0].upstream_tls", "expected an object"},
    {POOLF(",'upstream_tls':{'client_cert_file':'c.crt'}"), "pools[0].upstream_tls.client_key_file", "required with client_cert_file"},
    {POOLF(",'upstream_tls':{'client_key_file':'c.key'}"), "pools[0].upstream_tls.client_cert_file", "required with client_key_file"},
    {POOLF(",'upstream_tls':{'ca_file':'ca.crt'}"), "pools[0].upstream_tls.ca_file", "cannot read /nonexistent-config-dir/ca.crt"},
    {POOLF(",'upstream_tls':{'verify':false}"), "pools[0].upstream_tls.verify", "unknown key"},
    /* manifest (docs/configuration.md "Manifest") */
    {MANIFEST("[]"), "pools[0].manifest", "expected a file path or an object"},
    {MANIFEST("{'modle':'m'}"), "pools[0].manifest.modle", "did you mean \"model\""},
    {MANIFEST("{'model':5}"), "pools[0].manifest.model", "expected a string"},
    {MANIFEST("{'model':''}"), "pools[0].manifest.model", "must not be empty"},
    {MANIFEST("{'checkpoint_sha256':'" "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA" "'}"), "pools[0].manifest.checkpoint_sha256", "64 lowercase hex"},
    {MANIFEST("{'checkpoint_sha256':'abc'}"), "pools[0].manifest.checkpoint_sha256", "64 lowercase hex"},
    {MANIFEST("{'quantization':4}"), "pools[0].manifest.quantization", "expected a string"},
    {MANIFEST("{'dtype':true}"), "pools[0].manifest.dtype", "expected a string"},
    {MANIFEST("{'framework':'vllm'}"), "pools[0].manifest.framework", "expected an object"},
    {MANIFEST("{'framework':{'name':1}}"), "pools[0].manifest.framework.name", "expected a string"},
    {MANIFEST("{'framework':{'name':'vllm','version':''}}"), "pools[0].manifest.framework.version", "must not be empty"},
    {MANIFEST("{'framework':{'name':'vllm','versoin':'1'}}"), "pools[0].manifest.framework.versoin", "did you mean \"version\""},
    {MANIFEST("{'canary':'x'}"), "pools[0].manifest.canary", "expected an object"},
    {MANIFEST("{'canary':{'expected_sha256':'" H64 "'}}"), "pools[0].manifest.canary.prompt", "required"},
    {MANIFEST("{'canary':{'prompt':'','expected_sha256':'" H64 "'}}"), "pools[0].manifest.canary.prompt", "must not be empty"},
    {MANIFEST("{'canary':{'prompt':'p','expected_sha256':'xyz'}}"), "pools[0].manifest.canary.expected_sha256", "64 lowercase hex"},
    {MANIFEST("{'canary':{'prompt':'p','max_tokens':0,'expected_sha256':'" H64 "'}}"), "pools[0].manifest.canary.max_tokens", "must be between 1 and 4096"},
    {MANIFEST("{'canary':{'prompt':'p','max_tokens':4097,'expected_sha256':'" H64 "'}}"), "pools[0].manifest.canary.max_tokens", "must be between 1 and 4096"},
    {MANIFEST("{'canary':{'prompt':'p','expected_sha256':'" H64 "','temperature':0}}"), "pools[0].manifest.canary.temperature", "unknown key"},
    /* manifest "accept" (rollouts) */
    {MANIFEST("{'model':'m','accept':{}}"), "pools[0].manifest.accept", "expected an array"},
    {MANIFEST("{'model':'m','accept':[]}"), "pools[0].manifest.accept", "must list 1 to 8 identities (found 0)"},
    {MANIFEST("{'model':'m','accept':[{'dtype':'a'},{'dtype':'b'},{'dtype':'c'},{'dtype':'d'},{'dtype':'e'},{'dtype':'f'},{'dtype':'g'},{'dtype':'h'},{'dtype':'i'}]}"), "pools[0].manifest.accept", "must list 1 to 8 identities (found 9)"},
    {MANIFEST("{'model':'m','accept':['x']}"), "pools[0].manifest.accept[0]", "expected an object"},
    {MANIFEST("{'model':'m','accept':[{'dtype':'bf16'},{'checkpoint_sha256':'abc'}]}"), "pools[0].manifest.accept[1].checkpoint_sha256", "64 lowercase hex"},
    {MANIFEST("{'model':'m','accept':[{'dtype':'bf16','accept':[]}]}"), "pools[0].manifest.accept[0].accept", "unknown key"},
    {MANIFEST("{'model':'m','accept':[{'framework':{'versoin':'1'}}]}"), "pools[0].manifest.accept[0].framework.versoin", "did you mean \"version\""},
    {MANIFEST("{'model':'m','dtype':'f16','accept':[{'dtype':'f16'}]}"), "pools[0].manifest.accept[0]", "the same identity as the manifest itself (fp_"},
    {MANIFEST("{'model':'m','accept':[{'dtype':'bf16'},{'dtype':'bf16'}]}"), "pools[0].manifest.accept[1]", "the same identity as accept[0] (fp_"},
    {MANIFEST("{'accept':[{'dtype':'bf16'}]}"), "pools[0].manifest.accept", "pins no identity, so every replica would be admitted"},
    /* policy (docs/configuration.md "Policy") */
    {CFG(",'policy':5"), "policy", "expected a file path or an object"},
    {CFG(",'policy':'policies/p.json'"), "policy", "cannot read /nonexistent-config-dir/policies/p.json"},
    {CFG(",'policy':{}"), "policy.tenants", "required"},
    {CFG(",'policy':{'tenants':[]}"), "policy.tenants", "at least one tenant"},
    {CFG(",'policy':{'tenants':{}}"), "policy.tenants", "expected an array"},
    {CFG(",'policy':{'tenants':[" TENANT("") "],'version':1}"), "policy.version", "unknown key"},
    {POLICY("5"), "policy.tenants[0]", "expected an object"},
    {POLICY("{'match':{'any':true}}"), "policy.tenants[0].name", "required"},
    {POLICY("{'name':'a b','match':{'any':true}}"), "policy.tenants[0].name", "must be 1-128 characters"},
    {POLICY("{'name':'-','match':{'any':true}}"), "policy.tenants[0].name", "not '-' alone"},
    {POLICY(TENANT("") "," TENANT("")), "policy.tenants[1].name", "duplicate tenant name (also tenants[0])"},
    {POLICY("{'name':'t'}"), "policy.tenants[0].match", "required"},
    {POLICY("{'name':'t','match':'any'}"), "policy.tenants[0].match", "expected an object"},
    {POLICY("{'name':'t','match':{}}"), "policy.tenants[0].match", "needs exactly one of api_keys_sha256, header, any"},
    {POLICY("{'name':'t','match':{'any':true,'header':{'name':'x','value':'y'}}}"), "policy.tenants[0].match", "needs exactly one"},
    {POLICY("{'name':'t','match':{'all':true}}"), "policy.tenants[0].match.all", "unknown key"},
    {POLICY("{'name':'t','match':{'any':false}}"), "policy.tenants[0].match.any", "must be true"},
    {POLICY("{'name':'t','match':{'any':1}}"), "policy.tenants[0].match.any", "expected true or false"},
    {POLICY("{'name':'t','match':{'any':true,'unknown_keys':1}}"), "policy.tenants[0].match.unknown_keys", "expected true or false"},
    {POLICY("{'name':'t','match':{'header':{'name':'x','value':'y'},'unknown_keys':true}}"), "policy.tenants[0].match.unknown_keys", "only with \"any\": true"},
    {POLICY("{'name':'t','match':{'api_keys_sha256':[]}}"), "policy.tenants[0].match.api_keys_sha256", "must not be empty"},
    {POLICY("{'name':'t','match':{'api_keys_sha256':'" H64 "'}}"), "policy.tenants[0].match.api_keys_sha256", "expected an array"},
    {POLICY("{'name':'t','match':{'api_keys_sha256':['" H64 "','sk-live-123']}}"), "policy.tenants[0].match.api_keys_sha256[1]", "64 hex digits (not the token itself)"},
    {POLICY("{'name':'t','match':{'api_keys_sha256':['" H64 "g']}}"), "policy.tenants[0].match.api_keys_sha256[0]", "64 hex digits"},
    {POLICY("{'name':'t','match':{'api_keys_sha256':[5]}}"), "policy.tenants[0].match.api_keys_sha256[0]", "64 hex digits"},
    {POLICY("{'name':'t','match':{'header':'x-tenant'}}"), "policy.tenants[0].match.header", "expected an object"},
    {POLICY("{'name':'t','match':{'header':{'name':'x-t'}}}"), "policy.tenants[0].match.header.value", "required"},
    {POLICY("{'name':'t','match':{'header':{'value':'v'}}}"), "policy.tenants[0].match.header.name", "required"},
    {POLICY("{'name':'t','match':{'header':{'name':'x t','value':'v'}}}"), "policy.tenants[0].match.header.name", "not a valid HTTP header name"},
    {POLICY("{'name':'t','match':{'header':{'name':'x-t','value':'a\\nb'}}}"), "policy.tenants[0].match.header.value", "control characters"},
    {POLICY("{'name':'t','match':{'header':{'name':'x-t','value':'v','regex':true}}}"), "policy.tenants[0].match.header.regex", "unknown key"},
    {POLICY(TENANT(",'pool':'nope'")), "policy.tenants[0].pool", "no pool is named \"nope\""},
    {POLICY(TENANT(",'pool':''")), "policy.tenants[0].pool", "must not be empty"},
    {POLICY(TENANT(",'audit':true")), "policy.tenants[0].audit", "requires log.audit_path"},
    {POLICY(TENANT(",'audit':'yes'")), "policy.tenants[0].audit", "expected true or false"},
    {POLICY(TENANT(",'shadow_rate':1.5")), "policy.tenants[0].shadow_rate", "must be between 0 and 1"},
    {POLICY(TENANT(",'deny_params':'logit_bias'")), "policy.tenants[0].deny_params", "expected an array"},
    {POLICY(TENANT(",'deny_params':['a','']")), "policy.tenants[0].deny_params[1]", "must not be empty"},
    {POLICY(TENANT(",'rate_limits':5")), "policy.tenants[0].rate_limits", "unknown key"},
    {POLICY(TENANT(",'rate_limit':5")), "policy.tenants[0].rate_limit", "expected an object"},
    {POLICY(TENANT(",'rate_limit':{}")), "policy.tenants[0].rate_limit.requests_per_second", "required"},
    {POLICY(TENANT(",'rate_limit':{'requests_per_second':0}")), "policy.tenants[0].rate_limit.requests_per_second", "must be greater than 0"},
    {POLICY(TENANT(",'rate_limit':{'requests_per_second':-1}")), "policy.tenants[0].rate_limit.requests_per_second", "must be between"},
    {POLICY(TENANT(",'rate_limit':{'requests_per_second':5,'burst':0}")), "policy.tenants[0].rate_limit.burst", "must be between"},
    {POLICY(TENANT(",'rate_limit':{'requests_per_second':5,'burst':2.5}")), "policy.tenants[0].rate_limit.burst", ""},
    {POLICY(TENANT(",'rate_limit':{'requests_per_second':5,'window':1}")), "policy.tenants[0].rate_limit.window", "unknown key"},
    {CFG(",'log':{'access':true}"), "log.access", "expected an object"},
    {CFG(",'log':{'access':{'sample':1}}"), "log.access.sample", "unknown key"},
    {CFG(",'log':{'access':{'sample_rate':2}}"), "log.access.sample_rate", "must be between 0 and 1"},
    {CFG(",'log':{'access':{'enabled':'no'}}"), "log.access.enabled", "expected true or false"},
    {CFG(",'log':{'access':{'fields':'tenant'}}"), "log.access.fields", "expected an array"},
    {CFG(",'log':{'access':{'fields':['tenant','ttft']}}"), "log.access.fields[1]", "expected one of tenant, pool"},
    {POLICY(TENANT(",'allow_params':[]")), "policy.tenants[0].allow_params", "must not be empty"},
    {POLICY(TENANT(",'allow_params':['model',3]")), "policy.tenants[0].allow_params[1]", "expected a string"},
    {POLICY(TENANT(",'sampling':[]")), "policy.tenants[0].sampling", "expected an object"},
    {RULE("temprature", "{'force':0}"), "policy.tenants[0].sampling.temprature", "did you mean \"temperature\""},
    {RULE("logit_bias", "{'force':0}"), "policy.tenants[0].sampling.logit_bias", "unknown key"},
    {RULE("seed", "1234"), "policy.tenants[0].sampling.seed", "expected an object such as {\"force\": 0}"},
    {RULE("temperature", "{'forced':0}"), "policy.tenants[0].sampling.temperature.forced", "did you mean \"force\""},
    {RULE("temperature", "{'force':'0'}"), "policy.tenants[0].sampling.temperature.force", "expected a number"},
    {RULE("temperature", "{'force':0,'max':1}"), "policy.tenants[0].sampling.temperature", "force cannot be combined"},
    {RULE("temperature", "{'force':0,'default':0}"), "policy.tenants[0].sampling.temperature", "force cannot be combined"},
    {RULE("seed", "{'force':1,'derive':true}"), "policy.tenants[0].sampling.seed", "force cannot be combined"},
    {RULE("top_p", "{'min':0.9,'max':0.5}"), "policy.tenants[0].sampling.top_p", "min (0.9) is greater than max (0.5)"},
    {RULE("temperature", "{'default':1.5,'max':1}"), "policy.tenants[0].sampling.temperature.default", "must be within min and max"},
    {RULE("temperature", "{'default':0.1,'min':0.2}"), "policy.tenants[0].sampling.temperature.default", "must be within min and max"},
    {RULE("temperature", "{'derive':true}"), "policy.tenants[0].sampling.temperature.derive", "only seed can be derived"},
    {RULE("seed", "{'derive':false}"), "policy.tenants[0].sampling.seed.derive", "must be true"},
    {RULE("seed", "{'derive':'yes'}"), "policy.tenants[0].sampling.seed.derive", "expected true or false"},
    {RULE("seed", "{'derive':true,'default':5}"), "policy.tenants[0].sampling.seed", "derive and default cannot be combined"},
    {RULE("temperature", "{'min':-0.1}"), "policy.tenants[0].sampling.temperature.min", "must be at least 0"},
    {RULE("top_p", "{'force':0}"), "policy.tenants[0].sampling.top_p.force", "must be greater than 0 and at most 1"},
    {RULE("top_p", "{'max':1.01}"), "policy.tenants[0].sampling.top_p.max", "must be greater than 0 and at most 1"},
    {RULE("top_k", "{'force':-2}"), "policy.tenants[0].sampling.top_k.force", "must be between -1 and 2147483647"},
    {RULE("top_k", "{'default':1.5}"), "policy.tenants[0].sampling.top_k.default", "must be an integer"},
    {RULE("seed", "{'force':-1}"), "policy.tenants[0].sampling.seed.force", "must be between 0 and 9007199254740991"},
    {RULE("seed", "{'force':9007199254740992}"), "policy.tenants[0].sampling.seed.force", "must be between 0 and 9007199254740991"},
    {RULE("seed", "{'force':1.5}"), "policy.tenants[0].sampling.seed.force", "must be an integer"},
    {RULE("max_tokens", "{'max':0}"), "policy.tenants[0].sampling.max_tokens.max", "must be between 1 and 2147483647"},
    {RULE("max_tokens", "{'default':2.5}"), "policy.tenants[0].sampling.max_tokens.default", "must be an integer"},
    {RULE("n", "{'force':0}"), "policy.tenants[0].sampling.n.force", "must be between 1"},
    {RULE("n", "{'max':1.5}"), "policy.tenants[0].sampling.n.max", "must be an integer"},
    {RULE("presence_penalty", "{'max':2.5}"), "policy.tenants[0].sampling.presence_penalty.max", "must be between -2 and 2"},
    {RULE("frequency_penalty", "{'min':-3}"), "policy.tenants[0].sampling.frequency_penalty.min", "must be between -2 and 2"},
};
/* clang-format on */

/* Criterion runs each parameter in a fresh process where the tables' string pointers may lie
 * elsewhere (ASLR), so the parameters are indices into the tables. */
static size_t *indices(size_t n)
{
    size_t *idx = cr_malloc(n * sizeof(*idx));
    for (size_t i = 0; i < n; i++)
        idx[i] = i;
    return idx;
}

static void free_indices(struct criterion_test_params *p)
{
    cr_free(p->params);
}

ParameterizedTestParameters(config, rejects)
{
    size_t n = sizeof(bad_cases) / sizeof(bad_cases[0]);
    return cr_make_param_array(size_t, indices(n), n, free_indices);
}

ParameterizedTest(size_t *i, config, rejects)
{
    const bad_case_t *tc = &bad_cases[*i];
    cfg_t *cfg = (cfg_t *)1;
    cfg_errors_t e = {0};
    int rc = load_q(tc->json, &cfg, &e);
    if (rc == 0 || !has_error(&e, tc->path, tc->msg)) {
        fprintf(stderr, "case %s\n  want: %s: ...%s...\n", tc->json, tc->path, tc->msg);
        dump(&e);
    }
    cr_assert_eq(rc, -1);
    cr_assert_null(cfg);
    cr_assert(has_error(&e, tc->path, tc->msg));
    cfg_errors_free(&e);
}

/* Values at the edge of each range, which must be accepted. */
static const char *good_cases[] = {
    CFG(",'listen':'0.0.0.0:0','admin_listen':'[::1]:0'"),
    CFG(",'listen':'[::]:8080','admin_listen':'127.1.2.3:9901'"),
    CFG(",'admin_listen':'[::ffff:127.0.0.1]:9901'"),
    CFG(",'listen':'127.0.0.1:8080','admin_listen':'127.0.0.2:9901'"),
    CFG(",'limits':{'max_headers':10000,'max_header_bytes':1,'max_body_bytes':1073741824}"),
    CFG(",'attestation':{'interval_ms':100,'timeout_ms':86400000,'trusted_keys':[]}"),
    CFG(",'shadow':{'rate':1,'self_rate':0,'max_inflight':10000}"),
    CFG(",'tls':null,'admin_token_file':null,'log':{'audit_path':null}"),
    POOLF(",'upstream_tls':{'ca_file':null,'client_cert_file':null,'client_key_file':null}"),
    POOLF(",'max_inflight_per_replica':1000000,'queue_limit':0,'queue_timeout_ms':1"),
    URL("https://[2001:db8::1]:8443/v1/"),
    URL("HTTP://Example.COM"),
    URL("http://h/a%2Fb"),
    POOLX(",'replicas':[{'name':'r1','url':'https://10.0.0.11:8000','server_name':'r1.llm'}]"),
    POOLX(",'replicas':[],'discovery':{'dns':'vllm.ns.svc.cluster.local','port':8000}"),
    POOLX(",'discovery':{'dns':'svc','port':1,'refresh_ms':100,'attest':{'source':'agent','port':"
          "65535}}"),
    RULE("temperature", "{'force':0}"),
    RULE("top_p", "{'min':0.000001,'max':1}"),
    RULE("top_k", "{'force':-1}"),
    RULE("seed", "{'force':9007199254740991}"),
    RULE("seed", "{'derive':true,'min':0,'max':100}"),
    RULE("max_tokens", "{'default':256,'min':1,'max':256}"),
    RULE("presence_penalty", "{'min':-2,'max':2}"),
    RULE("frequency_penalty", "{'force':-2}"),
    RULE("n", "{'force':1}"),
    MANIFEST("{'canary':{'prompt':'Count:\\n one,\\ttwo,','expected_sha256':'" H64 "'}}"),
};

ParameterizedTestParameters(config, accepts)
{
    size_t n = sizeof(good_cases) / sizeof(good_cases[0]);
    return cr_make_param_array(size_t, indices(n), n, free_indices);
}

ParameterizedTest(size_t *i, config, accepts)
{
    cfg_free(must_load(good_cases[*i]));
}

/* ---- collection, paths, errors ----------------------------------------------------------- */

Test(config, collects_every_error)
{
    cfg_t *cfg;
    cfg_errors_t e = {0};
    const char *sq = "{'listen':'x','limits':{'max_headers':0},'pools':[{'name':'p','models':[],"
                     "'replicas':[{'name':'r','url':'ftp://h'}]}],'log':{'level':'loud'}}";
    cr_assert_eq(load_q(sq, &cfg, &e), -1);
    cr_assert_eq(e.count, 5);
    cr_assert(has_error(&e, "listen", "expected host:port"));
    cr_assert(has_error(&e, "limits.max_headers", "must be between 1 and 10000"));
    cr_assert(has_error(&e, "pools[0].models", "must not be empty"));
    cr_assert(has_error(&e, "pools[0].replicas[0].url", "must start with"));
    cr_assert(has_error(&e, "log.level", "must be one of"));
    cfg_errors_free(&e);
}

Test(config, example_error_strings_are_exact)
{
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(load_q("{'pools':[" POOL "," POOL "],'limits':{'max_headers':0}}", &cfg, &e), -1);
    cr_assert_eq(e.count, 2);
    cr_assert_str_eq(e.items[0], "limits.max_headers: must be between 1 and 10000");
    cr_assert_str_eq(e.items[1], "pools[1].name: duplicate pool name (also pools[0])");
    cfg_errors_free(&e);

    cr_assert_eq(load_q(MANIFEST("{'quantization':4}"), &cfg, &e), -1);
    cr_assert_eq(e.count, 1);
    cr_assert_str_eq(e.items[0], "pools[0].manifest.quantization: expected a string");
    cfg_errors_free(&e);
}

Test(config, appends_to_errors_and_accepts_null)
{
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(load_q("{}", &cfg, &e), -1);
    cr_assert_eq(load_q("{}", &cfg, &e), -1);
    cr_assert_eq(e.count, 2);
    cfg_errors_free(&e);
    cr_assert_eq(e.count, 0);
    cr_assert_null(e.items);
    cr_assert_eq(load_q("{}", &cfg, NULL), -1);
    cr_assert_null(cfg);
}

Test(config, control_bytes_in_keys_are_escaped)
{
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(load_q(CFG(",'a\\u001b[31m':1"), &cfg, &e), -1);
    cr_assert_eq(e.count, 1);
    cr_assert_str_eq(e.items[0], "[\"a\\x1b[31m\"]: unknown key");
    cfg_errors_free(&e);
}

Test(config, rejects_nul_and_trailing_bytes)
{
    cfg_t *cfg;
    cfg_errors_t e = {0};
    const char json[] = "{\"pools\":[]}\0{}";
    cr_assert_eq(cfg_load_string(json, sizeof(json) - 1, "/", &cfg, &e), -1);
    cr_assert(has_error(&e, "config", "NUL byte"));
    cfg_errors_free(&e);
    cr_assert_eq(cfg_load_string("{}{}", 4, "/", &cfg, &e), -1);
    cr_assert(has_error(&e, "config", "invalid JSON at line 1, column 3"));
    cfg_errors_free(&e);
}

Test(config, rejects_a_nul_escape_in_any_string)
{
    cfg_t *cfg;
    cfg_errors_t e = {0};
    /* cJSON would cut the name at it: pool "p1", the config not the one written. */
    const char *json = "{\"pools\": [{\"name\": \"p1\\u0000-prod\", \"models\": [\"m\"],\n"
                       " \"replicas\": [{\"name\": \"r\", \"url\": \"http://127.0.0.1:1\"}]}]}";
    cr_assert_eq(cfg_load_string(json, strlen(json), "/", &cfg, &e), -1);
    cr_assert(has_error(&e, "config", "line 1, column 24 holds \\u0000"), "%s", e.items[0]);
    cfg_errors_free(&e);
    /* A key too; an escaped backslash before u0000 is text, not the escape. */
    const char *key = "{\"pools\": [], \"x\\u0000\": 1}";
    cr_assert_eq(cfg_load_string(key, strlen(key), "/", &cfg, &e), -1);
    cr_assert(has_error(&e, "config", "holds \\u0000"));
    cfg_errors_free(&e);
    const char *text = "{\"pools\": [], \"x\\\\u0000\": 1}";
    cr_assert_eq(cfg_load_string(text, strlen(text), "/", &cfg, &e), -1);
    cr_assert_str_eq(e.items[0], "[\"x\\\\u0000\"]: unknown key");
    cfg_errors_free(&e);
}

Test(config, numbers_are_read_as_json_writes_them)
{
    /* strtod takes 01, 1. and 1.e5; JSON (and jq, and every other reader of the file) does
     * not. Strings that look like numbers are not numbers. */
    static const char *const loose[] = {"01", "1.", "1.e5", "-", "1e", "-01", "00"};
    for (size_t i = 0; i < sizeof(loose) / sizeof(loose[0]); i++) {
        char json[96];
        snprintf(json, sizeof(json), "{\"pools\": [],\n \"workers\": %s}", loose[i]);
        cfg_t *cfg;
        cfg_errors_t e = {0};
        cr_assert_eq(cfg_load_string(json, strlen(json), "/", &cfg, &e), -1, "%s", loose[i]);
        cr_assert(has_error(&e, "config", "invalid JSON at line 2, column 13"), "%s: %s", loose[i],
                  e.count ? e.items[0] : "");
        cfg_errors_free(&e);
    }
    static const char *const fine[] = {"0", "-0", "2", "1e0", "1.0E+0", "\"01\""};
    for (size_t i = 0; i < sizeof(fine) / sizeof(fine[0]); i++) {
        char json[96];
        snprintf(json, sizeof(json), "{\"pools\": [], \"log\": {\"level\": \"info\"}, \"x\": %s}",
                 fine[i]);
        cfg_t *cfg;
        cfg_errors_t e = {0};
        cr_assert_eq(cfg_load_string(json, strlen(json), "/", &cfg, &e), -1, "%s", fine[i]);
        cr_assert_str_eq(e.items[0], "x: unknown key", "%s", fine[i]); /* read, then refused */
        cfg_errors_free(&e);
    }
}

Test(config, a_byte_order_mark_is_refused)
{
    /* Some editors save one; JSON has none (RFC 8259), and jq and Kubernetes refuse it. */
    static const char json[] = "\xef\xbb\xbf{\"pools\": []}";
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(cfg_load_string(json, sizeof(json) - 1, "/", &cfg, &e), -1);
    cr_assert_eq(e.count, 1);
    cr_assert_str_eq(e.items[0], "config: invalid JSON at line 1, column 1: a UTF-8 byte-order "
                                 "mark (EF BB BF): save the file without one");
    cfg_errors_free(&e);
}

Test(config, whitespace_is_space_tab_line_feed_and_carriage_return)
{
    /* cJSON skips every byte up to 0x20 between tokens; JSON's whitespace is these four. */
    static const char ctl[] = {'\x0b', '\x0c', '\x00', '\x01', '\x1f'};
    for (size_t i = 0; i < sizeof(ctl); i++) {
        char json[64];
        int n = snprintf(json, sizeof(json), "{\"pools\": [],\n \"workers\":X 2}");
        *strchr(json, 'X') = ctl[i];
        cfg_t *cfg;
        cfg_errors_t e = {0};
        cr_assert_eq(cfg_load_string(json, (size_t)n, "/", &cfg, &e), -1, "0x%02x", ctl[i]);
        cr_assert_eq(e.count, 1, "0x%02x", ctl[i]);
        char want[160];
        if (ctl[i] == '\0')
            snprintf(want, sizeof(want), "config: invalid JSON at line 2, column 12: a NUL byte");
        else
            snprintf(want, sizeof(want),
                     "config: invalid JSON at line 2, column 12: control byte 0x%02x between "
                     "tokens (JSON's whitespace is space, tab, line feed and carriage return)",
                     ctl[i]);
        cr_assert_str_eq(e.items[0], want);
        cfg_errors_free(&e);
    }
    static const char fine[] = "{\"pools\": [],\r\n\t\"x\": \t2 \r\n}\n";
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(cfg_load_string(fine, sizeof(fine) - 1, "/", &cfg, &e), -1);
    cr_assert_str_eq(e.items[0], "x: unknown key"); /* read, then refused */
    cfg_errors_free(&e);
}

Test(config, a_string_holds_no_raw_control_byte)
{
    /* cJSON takes a raw tab or line feed inside a string; JSON writes them escaped, and a name
     * or prompt read otherwise by another reader of the file would be another name. */
    static const char ctl[] = {'\t', '\n', '\x01', '\x1f'};
    for (size_t i = 0; i < sizeof(ctl); i++) {
        char json[96];
        int n =
            snprintf(json, sizeof(json), "{\"pools\": [],\n \"canary\": {\"prompt\": \"aXb\"}}");
        *strchr(json, 'X') = ctl[i];
        cfg_t *cfg;
        cfg_errors_t e = {0};
        cr_assert_eq(cfg_load_string(json, (size_t)n, "/", &cfg, &e), -1, "0x%02x", ctl[i]);
        cr_assert_eq(e.count, 1, "0x%02x", ctl[i]);
        char want[200];
        snprintf(want, sizeof(want),
                 "config: invalid JSON at line 2, column 25: control byte 0x%02x inside a string "
                 "(write it escaped: \\t, \\n, \\r or \\u00XX)",
                 ctl[i]);
        cr_assert_str_eq(e.items[0], want);
        cfg_errors_free(&e);
    }
    /* Escaped, and a quote escaped before it: read (then refused as an unknown key). */
    static const char fine[] = "{\"pools\": [], \"x\\\"\\t\\n\": 1}";
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(cfg_load_string(fine, sizeof(fine) - 1, "/", &cfg, &e), -1);
    cr_assert(strstr(e.items[0], "unknown key") != NULL, "%s", e.items[0]);
    cfg_errors_free(&e);
}

Test(config, a_config_is_utf8)
{
    static const char json[] = "{\"pools\": [],\n \"bogus\xff\": 1}";
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(cfg_load_string(json, sizeof(json) - 1, "/", &cfg, &e), -1);
    cr_assert(has_error(&e, "config", "line 2, column 8: not UTF-8"), "%s", e.items[0]);
    cfg_errors_free(&e);
    static const char fine[] = "{\"pools\": [],\n \"caf\xc3\xa9\": 1}";
    cr_assert_eq(cfg_load_string(fine, sizeof(fine) - 1, "/", &cfg, &e), -1);
    cr_assert_str_eq(e.items[0], "[\"caf\xc3\xa9\"]: unknown key");
    cfg_errors_free(&e);
}

Test(config, says_json_nested_too_deep_is_that)
{
    char json[2 * 1100 + 16] = "{\"pools\":";
    size_t n = strlen(json);
    memset(json + n, '[', 1100);
    memset(json + n + 1100, ']', 1100);
    strcpy(json + n + 2200, "}");
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(cfg_load_string(json, strlen(json), "/", &cfg, &e), -1);
    cr_assert(has_error(&e, "config", "nested deeper than 1000 levels"), "%s", e.items[0]);
    cfg_errors_free(&e);
}

Test(config, reports_json_syntax_position)
{
    cfg_t *cfg;
    cfg_errors_t e = {0};
    const char *json = "{\"a\": 1,\n \"b\": [1,,2]}";
    cr_assert_eq(cfg_load_string(json, strlen(json), "/", &cfg, &e), -1);
    cr_assert_eq(e.count, 1);
    cr_assert_str_eq(e.items[0], "config: invalid JSON at line 2, column 10");
    cfg_errors_free(&e);
}

/* ---- defaults ---------------------------------------------------------------------------- */

Test(config, defaults_match_the_spec)
{
    cfg_t *cfg = must_load(CFG(""));
    cr_assert_null(cfg->path);
    cr_assert_str_eq(cfg->dir, "/nonexistent-config-dir");
    cr_assert_str_eq(cfg->listen.host, "127.0.0.1");
    cr_assert_eq(cfg->listen.port, 8080);
    cr_assert_str_eq(cfg->admin_listen.host, "127.0.0.1");
    cr_assert_eq(cfg->admin_listen.port, 9901);
    const cfg_limits_t *l = &cfg->limits;
    cr_assert_eq(l->max_header_bytes, 32768);
    cr_assert_eq(l->max_body_bytes, 8388608);
    cr_assert_eq(l->max_connections, 10000);
    cr_assert_eq(l->max_headers, 100);
    cr_assert_eq(l->client_header_timeout_ms, 10000);
    cr_assert_eq(l->client_idle_timeout_ms, 60000);
    cr_assert_eq(l->upstream_connect_timeout_ms, 2000);
    cr_assert_eq(l->upstream_first_byte_timeout_ms, 600000);
    cr_assert_eq(l->upstream_idle_timeout_ms, 60000);
    cr_assert_eq(l->max_inflight_body_bytes, 268435456);
    cr_assert_eq(l->client_body_timeout_ms, 60000);
    cr_assert_eq(l->max_response_rewrite_bytes, 16777216);
    cr_assert_eq(l->max_pending_handshakes, 1000);
    cr_assert_eq(l->shutdown_timeout_ms, 30000);
    cr_assert_eq(cfg->attestation.interval_ms, 10000);
    cr_assert_eq(cfg->attestation.timeout_ms, 2000);
    cr_assert_eq(cfg->attestation.require_signature, false);
    cr_assert_eq(cfg->attestation.ntrusted_keys, 0);
    cr_assert_eq(cfg->shadow.rate, 0.0);
    cr_assert_eq(cfg->shadow.self_rate, 0.0);
    cr_assert_eq(cfg->shadow.max_inflight, 4);
    cr_assert_eq(cfg->shadow.max_output_bytes, 1048576);
    cr_assert_eq(cfg->shadow.quarantine, false);
    cr_assert_eq(cfg->log.level, 1 /* DP_LOG_INFO */);
    cr_assert_null(cfg->log.audit_path);
    cr_assert_null(cfg->tls);
    cr_assert_null(cfg->admin_token_file);
    cr_assert_null(cfg->admin_token);

    cr_assert_eq(cfg->npools, 1);
    const cfg_pool_t *p = &cfg->pools[0];
    cr_assert_str_eq(p->name, "p");
    cr_assert_eq(p->balance, CFG_BALANCE_LEAST_INFLIGHT);
    cr_assert_eq(p->max_inflight_per_replica, 0);
    cr_assert_eq(p->queue_limit, 1024);
    cr_assert_eq(p->queue_timeout_ms, 30000);
    cr_assert_null(p->manifest);
    cr_assert_null(p->discovery);
    cr_assert_null(p->upstream_tls);
    cr_assert_null(p->api_key);
    cr_assert_eq(p->nreplicas, 1);
    cr_assert_null(p->replicas[0].server_name);
    cr_assert_eq(p->replicas[0].attest.source, CFG_ATTEST_NONE);

    /* No policy: one tenant "default" matching any request, with no rules. */
    cr_assert_not_null(cfg->policy);
    cr_assert_eq(cfg->policy->ntenants, 1);
    const cfg_tenant_t *t = &cfg->policy->tenants[0];
    cr_assert_str_eq(t->name, "default");
    cr_assert_eq(t->match_kind, CFG_MATCH_ANY);
    cr_assert_null(t->pool);
    cr_assert_eq(t->audit, false);
    cr_assert_lt(t->shadow_rate, 0);
    for (int i = 0; i < CFG_PARAM__COUNT; i++) {
        const cfg_rule_t *r = &t->rules[i];
        cr_assert(!r->has_force && !r->has_default && !r->has_min && !r->has_max && !r->derive);
    }
    cfg_free(cfg);
}

Test(config, affinity_defaults_and_fields)
{
    cfg_t *cfg = must_load(POOLF(",'balance':'affinity'"));
    const cfg_affinity_t *a = &cfg->pools[0].affinity;
    cr_assert_eq(cfg->pools[0].balance, CFG_BALANCE_AFFINITY);
    cr_assert_eq(a->key, CFG_AFFINITY_PREFIX);
    cr_assert_eq(a->prefix_bytes, 4096);
    cr_assert_str_eq(a->session_header, "x-session-id");
    cr_assert_float_eq(a->load_factor, 1.25, 1e-12);
    cfg_free(cfg);
    cfg = must_load(POOLF(",'balance':'affinity','affinity':{'key':'session','prefix_bytes':512,"
                          "'session_header':'X-Conversation','load_factor':2}"));
    a = &cfg->pools[0].affinity;
    cr_assert_eq(a->key, CFG_AFFINITY_SESSION);
    cr_assert_eq(a->prefix_bytes, 512);
    cr_assert_str_eq(a->session_header, "x-conversation"); /* matched lowercase */
    cr_assert_float_eq(a->load_factor, 2.0, 1e-12);
    cfg_free(cfg);
    cfg = must_load(POOLF(",'balance':'affinity','affinity':{'key':'seed'}"));
    cr_assert_eq(cfg->pools[0].affinity.key, CFG_AFFINITY_SEED);
    cfg_free(cfg);
}

Test(config, candidates_resolve_and_leave_model_routing)
{
    cfg_t *cfg = must_load("{'pools':[{'name':'next','models':['m'],'replicas':[" REPLICA "]},"
                           "{'name':'base','models':['m'],'replicas':[" REPLICA "],"
                           "'candidates':[{'pool':'next','rate':0.25}]}]}");
    const cfg_pool_t *base = &cfg->pools[1], *next = &cfg->pools[0];
    cr_assert_eq(base->ncandidates, 1);
    cr_assert_str_eq(base->candidates[0].pool, "next");
    cr_assert_eq(base->candidates[0].index, 0);
    cr_assert_float_eq(base->candidates[0].rate, 0.25, 1e-12);
    cr_assert(next->is_candidate && next->only_candidate);
    cr_assert_not(base->is_candidate || base->only_candidate);
    /* Listed first for the same model, the candidate still gets no client traffic. */
    cr_assert_eq(cfg_pool_for_model(cfg, "m", 1), base);
    dp_buf_t out = {0};
    cfg_dump_json(cfg, &out);
    dp_buf_appendc(&out, '\0');
    cr_assert_not_null(strstr(out.base, "\"candidates\":[{\"pool\":\"next\",\"rate\":0.25}]"), "%s",
                       out.base);
    dp_buf_free(&out);
    cfg_free(cfg);
}

Test(config, a_pinned_candidate_still_serves_its_tenant)
{
    cfg_t *cfg = must_load("{'pools':[{'name':'base','models':['m'],'replicas':[" REPLICA "],"
                           "'candidates':[{'pool':'next','rate':0.1}]},"
                           "{'name':'next','models':['m'],'replicas':[" REPLICA "]}],"
                           "'policy':{'tenants':[{'name':'qa','match':{'any':true},"
                           "'pool':'next'}]}}");
    cr_assert(cfg->pools[1].is_candidate);
    cr_assert_not(cfg->pools[1].only_candidate, "qa's clients are served by it");
    cfg_free(cfg);
}

Test(config, dump_names_the_affinity_balance)
{
    cfg_t *cfg = must_load(POOLF(",'balance':'affinity'"));
    dp_buf_t out = {0};
    cfg_dump_json(cfg, &out); /* the balance name table has three entries: affinity must be named */
    dp_buf_appendc(&out, '\0');
    cr_assert_not_null(strstr(out.base, "\"balance\":\"affinity\""), "%s", out.base);
    dp_buf_free(&out);
    cfg_free(cfg);
}

Test(config, discovery_defaults)
{
    cfg_t *cfg = must_load(POOLX(",'discovery':{'dns':'vllm.ns.svc','port':8000}"));
    const cfg_discovery_t *d = cfg->pools[0].discovery;
    cr_assert_not_null(d);
    cr_assert_str_eq(d->dns, "vllm.ns.svc");
    cr_assert_eq(d->port, 8000);
    cr_assert_eq(d->refresh_ms, 5000);
    cr_assert_eq(d->attest_source, CFG_ATTEST_NONE);
    cr_assert_eq(cfg->pools[0].nreplicas, 0);
    cfg_free(cfg);
}

/* ---- a full config, every field read ------------------------------------------------------ */

/* clang-format off */
static const char full_config[] =
    "{'listen':'0.0.0.0:8443','admin_listen':'[::1]:9902',"
    " 'limits':{'max_header_bytes':16384,'max_body_bytes':1048576,'max_connections':500,"
    "  'max_headers':50,'client_header_timeout_ms':5000,'client_idle_timeout_ms':30000,"
    "  'upstream_connect_timeout_ms':1000,'upstream_first_byte_timeout_ms':120000,"
    "  'upstream_idle_timeout_ms':20000},"
    " 'attestation':{'interval_ms':500,'timeout_ms':250,'require_signature':false},"
    " 'pools':["
    "  {'name':'llama','models':['meta-llama/Llama-3.1-8B-Instruct','llama'],"
    "   'manifest':{'model':'meta-llama/Llama-3.1-8B-Instruct','checkpoint_sha256':'" H64 "',"
    "     'quantization':'awq','dtype':'float16','framework':{'name':'sglang','version':'0.3.0'},"
    "     'canary':{'prompt':'Count: one, two,','expected_sha256':'" H64 "'}},"
    "   'balance':'round_robin','max_inflight_per_replica':1,'queue_limit':10,'queue_timeout_ms':500,"
    "   'replicas':["
    "    {'name':'r1','url':'https://10.0.0.11:8000/v1/','server_name':'r1.llm',"
    "     'attest':{'source':'agent','url':'http://10.0.0.11:9101'}},"
    "    {'name':'r2','url':'http://[fd00::2]:8000','attest':{'source':'sglang'}},"
    "    {'name':'r3','url':'http://vllm-3.internal'}],"
    "   'upstream_tls':{}},"
    "  {'name':'rest','models':['*'],'manifest':{'canary':{'prompt':'p','max_tokens':4,"
    "     'expected_sha256':'" H64 "'}},"
    "   'discovery':{'dns':'tgi.ns.svc.cluster.local','port':80,'refresh_ms':1000,"
    "     'attest':{'source':'agent','port':9101}}},"
    "  {'name':'empty-manifest','models':['x'],'manifest':{},'replicas':[" REPLICA "]}],"
    " 'policy':{'tenants':["
    "  {'name':'bank','match':{'api_keys_sha256':['" H64 "',"
    "     '0D2A099F2BCDA5B23F043444F04B8DD30C8135799E82A0FA44336C91B58CC79D']},"
    "   'pool':'llama','sampling':{'temperature':{'force':0},'top_p':{'force':1},"
    "     'seed':{'force':1234},'max_tokens':{'default':64,'min':1,'max':512}},"
    "   'deny_params':['logit_bias','logprobs'],'shadow_rate':0.05},"
    "  {'name':'ops','match':{'header':{'name':'X-Tenant','value':'Ops'}},"
    "   'sampling':{'top_k':{'min':-1,'max':40},'presence_penalty':{'default':0}}},"
    "  {'name':'default','match':{'any':true},"
    "   'sampling':{'temperature':{'default':0.7,'max':1.0},'seed':{'derive':true}}}]},"
    " 'shadow':{'rate':0.25,'self_rate':0.125,'max_inflight':8,'max_output_bytes':65536,"
    "  'quarantine':true},"
    " 'log':{'level':'debug'}}";
/* clang-format on */

Test(config, reads_every_field)
{
    cfg_t *cfg = must_load(full_config);
    cr_assert_str_eq(cfg->listen.host, "0.0.0.0");
    cr_assert_eq(cfg->listen.port, 8443);
    cr_assert_str_eq(cfg->admin_listen.host, "::1");
    cr_assert_eq(cfg->admin_listen.port, 9902);
    cr_assert_eq(cfg->limits.max_header_bytes, 16384);
    cr_assert_eq(cfg->limits.max_body_bytes, 1048576);
    cr_assert_eq(cfg->limits.max_connections, 500);
    cr_assert_eq(cfg->limits.max_headers, 50);
    cr_assert_eq(cfg->limits.client_header_timeout_ms, 5000);
    cr_assert_eq(cfg->limits.client_idle_timeout_ms, 30000);
    cr_assert_eq(cfg->limits.upstream_connect_timeout_ms, 1000);
    cr_assert_eq(cfg->limits.upstream_first_byte_timeout_ms, 120000);
    cr_assert_eq(cfg->limits.upstream_idle_timeout_ms, 20000);
    cr_assert_eq(cfg->attestation.interval_ms, 500);
    cr_assert_eq(cfg->attestation.timeout_ms, 250);
    cr_assert_eq(cfg->shadow.rate, 0.25);
    cr_assert_eq(cfg->shadow.self_rate, 0.125);
    cr_assert_eq(cfg->shadow.max_inflight, 8);
    cr_assert_eq(cfg->shadow.max_output_bytes, 65536);
    cr_assert_eq(cfg->shadow.quarantine, true);
    cr_assert_eq(cfg->log.level, 0 /* DP_LOG_DEBUG */);
    cr_assert_eq(cfg->npools, 3);

    const cfg_pool_t *p = &cfg->pools[0];
    cr_assert_eq(p->nmodels, 2);
    cr_assert_str_eq(p->models[1], "llama");
    cr_assert_eq(p->balance, CFG_BALANCE_ROUND_ROBIN);
    cr_assert_eq(p->max_inflight_per_replica, 1);
    cr_assert_eq(p->queue_limit, 10);
    cr_assert_eq(p->queue_timeout_ms, 500);
    cr_assert_not_null(p->upstream_tls);
    cr_assert_null(p->upstream_tls->ca_file);
    const cfg_manifest_t *m = p->manifest;
    cr_assert_str_eq(m->model, "meta-llama/Llama-3.1-8B-Instruct");
    cr_assert_str_eq(m->checkpoint_sha256, H64);
    cr_assert_str_eq(m->quantization, "awq");
    cr_assert_str_eq(m->dtype, "float16");
    cr_assert_str_eq(m->framework_name, "sglang");
    cr_assert_str_eq(m->framework_version, "0.3.0");
    cr_assert_str_eq(m->canary->prompt, "Count: one, two,");
    cr_assert_eq(m->canary->max_tokens, 16);
    cr_assert_str_eq(m->canary->expected_sha256, H64);
    cr_assert_eq(strlen(m->fingerprint), 19);
    cr_assert_eq(strncmp(m->fingerprint, "fp_", 3), 0);

    cr_assert_eq(p->nreplicas, 3);
    const cfg_replica_t *r1 = &p->replicas[0], *r2 = &p->replicas[1], *r3 = &p->replicas[2];
    cr_assert(r1->url.tls);
    cr_assert_str_eq(r1->url.host, "10.0.0.11");
    cr_assert_eq(r1->url.port, 8000);
    cr_assert_str_eq(r1->url.path, "/v1");
    cr_assert_str_eq(r1->url.hostport, "10.0.0.11:8000");
    cr_assert_str_eq(r1->server_name, "r1.llm");
    cr_assert_eq(r1->attest.source, CFG_ATTEST_AGENT);
    cr_assert_str_eq(r1->attest.url.host, "10.0.0.11");
    cr_assert_eq(r1->attest.url.port, 9101);
    cr_assert_str_eq(r1->attest.url.path, "/attestation"); /* default agent path */
    cr_assert_eq(r2->attest.source, CFG_ATTEST_SGLANG);
    cr_assert_str_eq(r2->url.host, "fd00::2");
    cr_assert_str_eq(r2->url.hostport, "[fd00::2]:8000");
    cr_assert_null(r2->attest.url.host);
    /* No attest: the manifest's framework.name picks the native adapter. */
    cr_assert_eq(r3->attest.source, CFG_ATTEST_SGLANG);
    cr_assert_str_eq(r3->url.hostport, "vllm-3.internal:80");

    const cfg_pool_t *rest = &cfg->pools[1];
    cr_assert_not_null(rest->manifest); /* canary only: kept, pins nothing */
    cr_assert_null(rest->manifest->model);
    cr_assert_eq(rest->manifest->canary->max_tokens, 4);
    cr_assert_eq(rest->discovery->attest_source, CFG_ATTEST_AGENT);
    cr_assert_eq(rest->discovery->attest_port, 9101);
    cr_assert_eq(rest->discovery->refresh_ms, 1000);
    cr_assert_eq(rest->discovery->port, 80);
    cr_assert_null(cfg->pools[2].manifest); /* {} pins nothing */

    const cfg_policy_t *pol = cfg->policy;
    cr_assert_eq(pol->ntenants, 3);
    const cfg_tenant_t *bank = &pol->tenants[0];
    cr_assert_eq(bank->match_kind, CFG_MATCH_API_KEYS);
    cr_assert_eq(bank->napi_keys, 2);
    cr_assert_eq(bank->api_keys[0][0], 0xaa);
    cr_assert_eq(bank->api_keys[0][31], 0xaa);
    cr_assert_eq(bank->api_keys[1][0], 0x0d); /* uppercase hex accepted */
    cr_assert_eq(bank->api_keys[1][31], 0x9d);
    cr_assert_str_eq(bank->pool, "llama");
    cr_assert_eq(bank->ndeny_params, 2);
    cr_assert_str_eq(bank->deny_params[1], "logprobs");
    cr_assert_eq(bank->shadow_rate, 0.05);
    cr_assert(bank->rules[CFG_PARAM_TEMPERATURE].has_force);
    cr_assert_eq(bank->rules[CFG_PARAM_TEMPERATURE].force, 0);
    cr_assert_eq(bank->rules[CFG_PARAM_TOP_P].force, 1);
    cr_assert_eq(bank->rules[CFG_PARAM_SEED].force, 1234);
    const cfg_rule_t *mt = &bank->rules[CFG_PARAM_MAX_TOKENS];
    cr_assert(mt->has_default && mt->has_min && mt->has_max && !mt->has_force);
    cr_assert_eq(mt->def, 64);
    cr_assert_eq(mt->min, 1);
    cr_assert_eq(mt->max, 512);
    const cfg_tenant_t *ops = &pol->tenants[1];
    cr_assert_eq(ops->match_kind, CFG_MATCH_HEADER);
    cr_assert_str_eq(ops->header_name, "x-tenant"); /* lowercased */
    cr_assert_str_eq(ops->header_value, "Ops");     /* value kept as written */
    cr_assert_eq(ops->rules[CFG_PARAM_TOP_K].min, -1);
    cr_assert(ops->rules[CFG_PARAM_PRESENCE_PENALTY].has_default);
    const cfg_tenant_t *def = &pol->tenants[2];
    cr_assert(def->rules[CFG_PARAM_SEED].derive);
    cr_assert_eq(def->rules[CFG_PARAM_TEMPERATURE].def, 0.7);
    cr_assert_eq(def->rules[CFG_PARAM_TEMPERATURE].max, 1.0);
    cr_assert_lt(def->shadow_rate, 0);
    cfg_free(cfg);
}

Test(config, param_names_in_enum_order)
{
    const char *want[] = {
        "temperature",      "top_p", "top_k", "seed", "max_tokens", "n", "presence_penalty",
        "frequency_penalty"};
    for (int i = 0; i < CFG_PARAM__COUNT; i++)
        cr_assert_str_eq(cfg_param_names[i], want[i]);
    cr_assert_str_eq(cfg_attest_source_names[CFG_ATTEST_NONE], "none");
    cr_assert_str_eq(cfg_attest_source_names[CFG_ATTEST_AGENT], "agent");
    cr_assert_str_eq(cfg_attest_source_names[CFG_ATTEST_LLAMACPP], "llamacpp");
}

/* ---- attestation source rule --------------------------------------------------------------- */

Test(config, default_source_follows_manifest_framework)
{
    const char *names[] = {"vllm", "tgi", "sglang", "llamacpp"};
    cfg_attest_source_t want[] = {CFG_ATTEST_VLLM, CFG_ATTEST_TGI, CFG_ATTEST_SGLANG,
                                  CFG_ATTEST_LLAMACPP};
    for (size_t i = 0; i < 4; i++) {
        char sq[512];
        snprintf(sq, sizeof(sq),
                 POOLX(",'manifest':{'model':'m','framework':{'name':'%s'}},'replicas':[" REPLICA
                       "],'discovery':{'dns':'svc','port':80}"),
                 names[i]);
        cfg_t *cfg = must_load(sq);
        cr_assert_eq(cfg->pools[0].replicas[0].attest.source, want[i], "%s", names[i]);
        cr_assert_eq(cfg->pools[0].discovery->attest_source, want[i], "%s", names[i]);
        cfg_free(cfg);
    }
}

Test(config, native_source_against_other_framework_warns)
{
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(load_q(POOLF(",'manifest':{'framework':{'name':'tgi'}}") "", &cfg, &e), 0);
    cr_assert_eq(e.nwarnings, 0);
    cfg_free(cfg);
    const char *sq = "{'pools':[{'name':'p','models':['*'],'manifest':{'framework':{'name':'tgi'}},"
                     "'replicas':[{'name':'r1','url':'http://h','attest':{'source':'vllm'}}]}]}";
    cr_assert_eq(load_q(sq, &cfg, &e), 0);
    cr_assert(has_warning(&e, "pools[0].replicas[0].attest.source", "can never be admitted"));
    cfg_free(cfg);
    cfg_errors_free(&e);
}

Test(config, agent_without_trusted_keys_warns)
{
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(load_q(REPF(",'attest':{'source':'agent','url':'http://h:9101/a'}"), &cfg, &e), 0);
    cr_assert_str_eq(cfg->pools[0].replicas[0].attest.url.path, "/a");
    cr_assert(has_warning(&e, "pools[0].replicas[0].attest", "rejected as untrusted"));
    cfg_free(cfg);
    cfg_errors_free(&e);
}

/* ---- other warnings ---------------------------------------------------------------------- */

Test(config, warns_on_shadowed_tenant_duplicate_url_and_plain_server_name)
{
    cfg_t *cfg;
    cfg_errors_t e = {0};
    const char *sq = "{'pools':[{'name':'p','models':['*'],'replicas':["
                     "{'name':'a','url':'http://h:80/v1/"
                     "','server_name':'h.llm'},{'name':'b','url':'http://h/v1'}]}],"
                     "'policy':{'tenants':[{'name':'open','match':{'any':true}},"
                     "{'name':'keyed','match':{'header':{'name':'x','value':'z'}},"
                     "'allow_params':['prompt']},"
                     "{'name':'all','match':{'any':true,'unknown_keys':true}},"
                     "{'name':'late','match':{'header':{'name':'x','value':'y'}}}]}}";
    cr_assert_eq(load_q(sq, &cfg, &e), 0);
    cr_assert_eq(e.nwarnings, 4);
    cr_assert(has_warning(&e, "pools[0].replicas[0].server_name", "only https://"));
    cr_assert(has_warning(&e, "pools[0].replicas[1].url", "same engine as replicas[0]"));
    cr_assert(has_warning(&e, "policy.tenants[1].allow_params", "does not list \"model\""));
    /* a plain {"any": true} leaves requests with credentials to later tenants */
    cr_assert(has_warning(&e, "policy.tenants[3]", "never matches: tenants[2]"));
    cfg_free(cfg);
    cfg_errors_free(&e);
}

Test(config, canary_without_expected_sha256_is_a_warning)
{
    /* The prompt goes in first; `detproxy attest canary` prints the hash to pin. */
    cfg_t *cfg;
    cfg_errors_t e = {0};
    cr_assert_eq(load_q(MANIFEST("{'canary':{'prompt':'p'}}"), &cfg, &e), 0);
    cr_assert_eq(e.nwarnings, 1);
    cr_assert(has_warning(&e, "pools[0].manifest.canary.expected_sha256", "not recorded"));
    cr_assert_null(cfg->pools[0].manifest->canary->expected_sha256);
    cfg_free(cfg);
    cfg_errors_free(&e);
}

Test(config, manifest_accept_entries_inherit_and_get_their_own_fingerprint)
{
    cfg_t *cfg = must_load(MANIFEST(
        "{'model':'m','checkpoint_sha256':'" H64 "','framework':{'name':'vllm','version':'0.6.3'},"
        "'canary':{'prompt':'p','expected_sha256':'" H64 "'},"
        "'accept':[{'framework':{'version':'0.6.4'}},"
        "{'checkpoint_sha256':'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb',"
        "'canary':{'prompt':'q','max_tokens':4,'expected_sha256':'cccccccccccccccccccccccccccccccc"
        "cccccccccccccccccccccccccccccccc'}}]}"));
    const cfg_manifest_t *m = cfg->pools[0].manifest;
    cr_assert_eq(m->naccept, 2);
    const cfg_manifest_t *a = cfg_manifest_identity(m, 1), *b = cfg_manifest_identity(m, 2);
    cr_assert_eq(cfg_manifest_identity(m, 0), m);
    cr_assert_null(cfg_manifest_identity(m, 3));
    /* accept[0]: only the version differs; the rest, canary included, is the manifest's. */
    cr_assert_str_eq(a->model, "m");
    cr_assert_str_eq(a->checkpoint_sha256, H64);
    cr_assert_str_eq(a->framework_name, "vllm");
    cr_assert_str_eq(a->framework_version, "0.6.4");
    cr_assert_str_eq(a->canary->prompt, "p");
    cr_assert_eq(b->canary->max_tokens, 4);
    cr_assert_str_eq(b->framework_version, "0.6.3");
    /* Each identity's fingerprint is the pool fingerprint's formula (docs/configuration.md
     * "Manifest") over its own fields. */
    char want[20];
    cfg_manifest_t tmp = {.model = "m",
                          .checkpoint_sha256 = H64,
                          .framework_name = "vllm",
                          .framework_version = "0.6.4"};
    cfg_manifest_fingerprint(&tmp, want);
    cr_assert_str_eq(a->fingerprint, want);
    cr_assert_str_neq(a->fingerprint, m->fingerprint);
    cr_assert_str_neq(b->fingerprint, a->fingerprint);
    cfg_free(cfg);
}

Test(config, manifest_accept_entry_may_differ_in_the_oms_signer_only)
{
    /* A new publisher key for the same weights: the fingerprint is equal, the identity is not. */
    cfg_t *cfg = must_load(MANIFEST(
        "{'model':'m','framework':{'name':'vllm'},'oms':{'signer':'" H64
        "'},'accept':[{'oms':{'signer':"
        "'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb'}},{'dtype':'bf16'}]}"));
    const cfg_manifest_t *m = cfg->pools[0].manifest;
    cr_assert_eq(m->naccept, 2);
    cr_assert_str_eq(m->accept[0].fingerprint, m->fingerprint);
    cr_assert_str_eq(m->accept[1].oms_signer, H64); /* inherited */
    cfg_free(cfg);
}

/* ---- look-ups ---------------------------------------------------------------------------- */

Test(config, pool_lookups)
{
    cfg_t *cfg = must_load("{'pools':[{'name':'a','models':['m1','m2'],'replicas':[" REPLICA
                           "]},{'name':'b','models':['m2','*'],'replicas':[" REPLICA
                           "]},{'name':'c','models':['m3'],'replicas':[" REPLICA "]}]}");
    cr_assert_eq(cfg_pool_for_model(cfg, "m1", 2), &cfg->pools[0]);
    cr_assert_eq(cfg_pool_for_model(cfg, "m2", 2), &cfg->pools[0]); /* first wins */
    cr_assert_eq(cfg_pool_for_model(cfg, "m3", 2), &cfg->pools[1]); /* '*' comes first */
    cr_assert_eq(cfg_pool_for_model(cfg, "other", 5), &cfg->pools[1]);
    cr_assert_eq(cfg_pool_for_model(cfg, "m1xyz", 2), &cfg->pools[0]); /* length-delimited */
    cr_assert_eq(cfg_pool_by_name(cfg, "c"), &cfg->pools[2]);
    cr_assert_null(cfg_pool_by_name(cfg, "d"));
    cfg_free(cfg);

    cfg = must_load("{'pools':[{'name':'a','models':['m1'],'replicas':[" REPLICA "]}]}");
    cr_assert_null(cfg_pool_for_model(cfg, "m", 1));
    cr_assert_null(cfg_pool_for_model(cfg, "m10", 3));
    cr_assert_null(cfg_pool_for_model(cfg, "", 0));
    cfg_free(cfg);
}

/* A pool of thousands of models (LoRA adapters) is searched, not scanned: every name is found in
 * its pool, and nothing else is (prefixes, extensions, an embedded NUL, a name of the later
 * pool that the first does not list). */
Test(config, pool_lookups_in_a_long_model_list)
{
    enum { N = 3000 };
    char *json = malloc(N * 24 + 512), *o = json;
    o += sprintf(o, "{'pools':[{'name':'a','replicas':[%s],'models':[", REPLICA);
    for (unsigned i = 0; i < N; i++) /* listed out of order: 1,009 is prime to 3,000 */
        o += sprintf(o, "%s'lora-%u'", i ? "," : "", (i * 1009u) % N);
    sprintf(o, ",'zzz']},{'name':'b','replicas':[%s],'models':['lora-1','other','*']}]}", REPLICA);
    cfg_t *cfg = must_load(json);
    free(json);
    const cfg_pool_t *a = &cfg->pools[0], *b = &cfg->pools[1];
    cr_assert_eq(a->nmodels_sorted, N + 1);
    char name[32];
    for (unsigned i = 0; i < N; i++) {
        int n = snprintf(name, sizeof(name), "lora-%u", i);
        cr_assert_eq(cfg_pool_for_model(cfg, name, (size_t)n), a, "%s", name);
        name[n] = 'x'; /* one byte longer than any listed name that is its prefix */
        cr_assert_eq(cfg_pool_for_model(cfg, name, (size_t)n + 1), b, "%.*s", n + 1, name);
    }
    cr_assert_eq(cfg_pool_for_model(cfg, "zzz", 3), a);
    cr_assert_eq(cfg_pool_for_model(cfg, "lora-", 5), b);
    cr_assert_eq(cfg_pool_for_model(cfg, "lora-1\0", 7), b);
    cr_assert_eq(cfg_pool_for_model(cfg, "", 0), b);
    cr_assert(!a->any_model && b->any_model);
    cfg_free(cfg);
}

/* ---- fingerprint (docs/configuration.md "Manifest") -------------------------------------- */

/* Expected values from coreutils, e.g.
 *   printf 'meta-llama/Llama-3.1-8B-Instruct\n\n\n\nvllm\n0.6.3' | sha256sum  ->
 * 3c3b2857ad9d4389... printf '\n\n\n\n\n' | sha256sum                                           ->
 * 7c370d9536d7d0d6... printf 'm\n<64 a>\nawq\nfloat16\nvllm\n0.6.3' | sha256sum                  ->
 * f29cf0756f0fcafe... printf '\n\nawq\n\n\n' | sha256sum                                        ->
 * 79285d13741264db... */
Test(config, fingerprint_known_values)
{
    char fp[20];
    cfg_manifest_fingerprint(NULL, fp);
    cr_assert_str_eq(fp, "fp_7c370d9536d7d0d6");

    cfg_manifest_t m = {0};
    cfg_manifest_fingerprint(&m, fp);
    cr_assert_str_eq(fp, "fp_7c370d9536d7d0d6");

    m.model = "meta-llama/Llama-3.1-8B-Instruct";
    m.framework_name = "vllm";
    m.framework_version = "0.6.3";
    cfg_manifest_fingerprint(&m, fp);
    cr_assert_str_eq(fp, "fp_3c3b2857ad9d4389");

    m.model = "m";
    m.checkpoint_sha256 = H64;
    m.quantization = "awq";
    m.dtype = "float16";
    cfg_manifest_fingerprint(&m, fp);
    cr_assert_str_eq(fp, "fp_f29cf0756f0fcafe");

    /* Field positions matter: the same value in another field is another fingerprint. */
    cfg_manifest_t q2 = {.quantization = "awq"};
    cfg_manifest_fingerprint(&q2, fp);
    cr_assert_str_eq(fp, "fp_79285d13741264db");
}

Test(config, fingerprint_computed_at_load)
{
    cfg_t *cfg = must_load(MANIFEST("{'model':'meta-llama/Llama-3.1-8B-Instruct',"
                                    "'framework':{'name':'vllm','version':'0.6.3'}}"));
    cr_assert_str_eq(cfg->pools[0].manifest->fingerprint, "fp_3c3b2857ad9d4389");
    cfg_free(cfg);
}

/* ---- standalone manifest and policy documents -------------------------------------------- */

Test(config, manifest_parse_standalone)
{
    cfg_errors_t e = {0};
    const char *ok = "{\"model\":\"meta-llama/Llama-3.1-8B-Instruct\","
                     "\"framework\":{\"name\":\"vllm\",\"version\":\"0.6.3\"}}";
    cfg_manifest_t *m = cfg_manifest_parse(ok, strlen(ok), NULL, &e);
    cr_assert_not_null(m);
    cr_assert_eq(e.count, 0);
    cr_assert_str_eq(m->fingerprint, "fp_3c3b2857ad9d4389");
    cfg_manifest_free(m);

    const char *bad = "{\"quantization\":4,\"dtype\":\"\"}";
    cr_assert_null(cfg_manifest_parse(bad, strlen(bad), NULL, &e));
    cr_assert_eq(e.count, 2);
    cr_assert_str_eq(e.items[0], "quantization: expected a string");
    cr_assert_str_eq(e.items[1], "dtype: must not be empty");
    cr_assert_null(cfg_manifest_parse(bad, strlen(bad), "manifest", &e));
    cr_assert_str_eq(e.items[2], "manifest.quantization: expected a string");
    cr_assert_null(cfg_manifest_parse("[1]", 3, NULL, &e));
    cr_assert_str_eq(e.items[4], "manifest: expected an object");
    cr_assert_null(cfg_manifest_parse("{", 1, NULL, NULL));
    cfg_errors_free(&e);
}

Test(config, policy_parse_standalone)
{
    cfg_errors_t e = {0};
    const char *ok = "{\"tenants\":[{\"name\":\"a\",\"match\":{\"any\":true},"
                     "\"sampling\":{\"seed\":{\"derive\":true}}}]}";
    cfg_policy_t *p = cfg_policy_parse(ok, strlen(ok), NULL, &e);
    cr_assert_not_null(p);
    cr_assert_eq(e.count, 0);
    cr_assert(p->tenants[0].rules[CFG_PARAM_SEED].derive);
    cfg_policy_free(p);

    const char *bad = "{\"tenants\":[{\"name\":\"a\",\"match\":{\"any\":false}}]}";
    cr_assert_null(cfg_policy_parse(bad, strlen(bad), "policy", &e));
    cr_assert_eq(e.count, 1);
    cr_assert_str_eq(e.items[0], "policy.tenants[0].match.any: must be true");
    cfg_errors_free(&e);
}

/* ---- addresses and URLs ------------------------------------------------------------------ */

typedef struct {
    const char *in;
    bool tls;
    const char *host;
    unsigned port;
    const char *path;
    const char *hostport;
} url_case_t;

static const url_case_t url_cases[] = {
    {"http://10.0.0.11:8000", false, "10.0.0.11", 8000, "", "10.0.0.11:8000"},
    {"https://10.0.0.11", true, "10.0.0.11", 443, "", "10.0.0.11:443"},
    {"http://h", false, "h", 80, "", "h:80"},
    {"http://h/", false, "h", 80, "", "h:80"},
    {"http://h:81/prefix//", false, "h", 81, "/prefix", "h:81"},
    {"https://[::1]:8443/v1/x", true, "::1", 8443, "/v1/x", "[::1]:8443"},
    {"https://[2001:db8::1]", true, "2001:db8::1", 443, "", "[2001:db8::1]:443"},
    {"HTTPS://Api.Example.com:65535/a%20b", true, "Api.Example.com", 65535, "/a%20b",
     "Api.Example.com:65535"},
    {"http://my_host.svc.cluster.local:1", false, "my_host.svc.cluster.local", 1, "",
     "my_host.svc.cluster.local:1"},
};

Test(config, parse_url_valid)
{
    for (size_t i = 0; i < sizeof(url_cases) / sizeof(url_cases[0]); i++) {
        const url_case_t *c = &url_cases[i];
        cfg_url_t u;
        const char *why = NULL;
        cr_assert_eq(cfg_parse_url(c->in, &u, &why), 0, "%s: %s", c->in, why);
        cr_assert_eq(u.tls, c->tls, "%s", c->in);
        cr_assert_str_eq(u.host, c->host, "%s", c->in);
        cr_assert_eq(u.port, c->port, "%s", c->in);
        cr_assert_str_eq(u.path, c->path, "%s", c->in);
        cr_assert_str_eq(u.hostport, c->hostport, "%s", c->in);
        cfg_url_free(&u);
        cr_assert_null(u.host);
    }
}

Test(config, parse_url_invalid)
{
    const char *bad[] = {
        "",           "h:80",          "http:/h",         "http://",          "http://:80",
        "http://h:",  "http://h:0",    "http://h:123456", "http://u@h",       "http://h?x",
        "http://h/#", "http://[::1",   "http://[::1]x",   "http://[1.2.3.4]", "http://1.2.3",
        "http://h h", "http://h/\x01", "http://a.-b.c",   "http://a..b"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cfg_url_t u;
        const char *why = NULL;
        cr_assert_eq(cfg_parse_url(bad[i], &u, &why), -1, "%s", bad[i]);
        cr_assert_not_null(why, "%s", bad[i]);
        cr_assert_null(u.host, "%s", bad[i]);
    }
    /* A path longer than CFG_URL_PATH_MAX is refused, not cut where a request is built on it;
     * one of exactly that length is taken whole. */
    char url[16 + CFG_URL_PATH_MAX + 2] = "http://h/";
    memset(url + 9, 'a', CFG_URL_PATH_MAX - 1);
    cfg_url_t u;
    const char *why = NULL;
    cr_assert_eq(cfg_parse_url(url, &u, &why), 0, "%s", why);
    cr_assert_eq(strlen(u.path), CFG_URL_PATH_MAX);
    cfg_url_free(&u);
    strcat(url, "b");
    cr_assert_eq(cfg_parse_url(url, &u, &why), -1);
    cr_assert_str_eq(why, "path longer than 256 bytes");
}

/* The engine a URL names: one string for every spelling of one engine, and different ones for
 * different engines. */
Test(config, url_engine_names_one_engine_one_way)
{
    static const char *const same[][2] = {
        {"http://localhost:8080", "http://127.0.0.1:8080"},
        {"http://[::1]:8080/", "http://LOCALHOST:8080"},
        {"http://[::ffff:127.0.0.1]:8080", "http://127.0.0.1:8080"},
        {"https://Engine.Example.com/v1", "https://engine.example.com:443/v1/"},
        {"http://[2001:DB8:0::1]:9", "http://[2001:db8::1]:9"},
        {"http://0.0.0.0:8080", "http://127.0.0.1:8080"},
        {"http://[::]:8080", "http://localhost:8080"},
        {"http://0x7f000001:8080", "http://127.0.0.1:8080"},
        {"http://0x0A000001:8080", "http://10.0.0.1:8080"},
        {"http://127.0.0.1:8080/%76%31", "http://127.0.0.1:8080/v1"},
        {"http://127.0.0.1:8080/a%2fb", "http://127.0.0.1:8080/a%2Fb"},
        {"http://127.0.0.1:8080/x/../v1/./", "http://127.0.0.1:8080/v1"},
        {"http://127.0.0.1:8080//v1//m", "http://127.0.0.1:8080/v1/m"},
        {"http://127.0.0.1:8080/%2E%2E/v1", "http://127.0.0.1:8080/v1"},
        {"http://127.0.0.1:8080/..", "http://127.0.0.1:8080"},
    };
    static const char *const other[][2] = {
        {"http://127.0.0.1:8080", "https://127.0.0.1:8080"},
        {"http://127.0.0.1:8080", "http://127.0.0.2:8080"},
        {"http://127.0.0.1:8080", "http://127.0.0.1:8081"},
        {"http://127.0.0.1:8080/a", "http://127.0.0.1:8080/b"},
        {"http://127.0.0.1:8080/a/b", "http://127.0.0.1:8080/a%2Fb"},
        {"http://127.0.0.1:8080/V1", "http://127.0.0.1:8080/v1"},
        {"http://engine-a:8080", "http://engine-b:8080"},
    };
    char want[2][96];
    for (size_t k = 0; k < 2; k++) {
        const char *const(*pairs)[2] = k == 0 ? same : other;
        size_t n = k == 0 ? sizeof(same) / sizeof(same[0]) : sizeof(other) / sizeof(other[0]);
        for (size_t i = 0; i < n; i++) {
            for (size_t j = 0; j < 2; j++) {
                cfg_url_t u;
                const char *why = NULL;
                cr_assert_eq(cfg_parse_url(pairs[i][j], &u, &why), 0, "%s", pairs[i][j]);
                dp_buf_t e = {0};
                cfg_url_engine(&u, &e);
                snprintf(want[j], sizeof(want[j]), "%.*s", (int)e.len, e.base);
                dp_buf_free(&e);
                cfg_url_free(&u);
            }
            cr_assert_eq(strcmp(want[0], want[1]) == 0, k == 0, "%s / %s: %s, %s", pairs[i][0],
                         pairs[i][1], want[0], want[1]);
        }
    }
}

Test(config, url_engine_spells_it_as_a_url)
{
    cfg_url_t u;
    const char *why = NULL;
    cr_assert_eq(cfg_parse_url("HTTPS://[::1]:8443/v1/", &u, &why), 0);
    dp_buf_t e = {0};
    cfg_url_engine(&u, &e);
    cr_assert_eq(e.len, strlen("https://127.0.0.1:8443/v1"));
    cr_assert_eq(memcmp(e.base, "https://127.0.0.1:8443/v1", e.len), 0);
    dp_buf_free(&e);
    cfg_url_free(&u);
    cr_assert_eq(cfg_parse_url("http://[2001:DB8:0::1]", &u, &why), 0);
    cfg_url_engine(&u, &e);
    cr_assert_eq(memcmp(e.base, "http://[2001:db8::1]:80", e.len), 0, "%.*s", (int)e.len, e.base);
    dp_buf_free(&e);
    cfg_url_free(&u);
}

Test(config, parse_addr)
{
    cfg_addr_t a;
    const char *why = NULL;
    cr_assert_eq(cfg_parse_addr("127.0.0.1:8080", &a, &why), 0);
    cr_assert_str_eq(a.host, "127.0.0.1");
    cr_assert_eq(a.port, 8080);
    free(a.host);
    cr_assert_eq(cfg_parse_addr("[::1]:0", &a, &why), 0);
    cr_assert_str_eq(a.host, "::1");
    cr_assert_eq(a.port, 0);
    free(a.host);
    cr_assert_eq(cfg_parse_addr("0.0.0.0:65535", &a, &why), 0);
    free(a.host);
    const char *bad[] = {"",          "127.0.0.1",    "127.0.0.1:",  "localhost:80",
                         "1.2.3.4:x", "1.2.3.4:+80",  "[::1]",       "::1:80",
                         "[::1]:x",   "256.0.0.1:80", "1.2.3.4:80 ", "[h]:80"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        why = NULL;
        cr_assert_eq(cfg_parse_addr(bad[i], &a, &why), -1, "%s", bad[i]);
        cr_assert_not_null(why);
        cr_assert_null(a.host);
    }
}

/* ---- access log, rate limits, the effective configuration ---------------------------------- */

Test(config, access_log_and_rate_limit_defaults)
{
    cfg_t *cfg = must_load(POLICY(TENANT(",'rate_limit':{'requests_per_second':2.5}")));
    cr_assert(cfg->log.access.enabled);
    cr_assert_eq(cfg->log.access.sample_rate, 1.0);
    cr_assert_eq(cfg->log.access.fields, (1u << CFG_ACCESS__COUNT) - 1, "every field");
    cr_assert_eq(cfg->policy->tenants[0].rate_rps, 2.5);
    cr_assert_eq(cfg->policy->tenants[0].rate_burst, 3, "burst defaults to ceil(rps)");
    cfg_free(cfg);
    cfg = must_load(CFG(",'log':{'access':{'enabled':false,'sample_rate':0.25,"
                        "'fields':['tenant','tokens']}}"));
    cr_assert_not(cfg->log.access.enabled);
    cr_assert_eq(cfg->log.access.sample_rate, 0.25);
    cr_assert_eq(cfg->log.access.fields, (1u << CFG_ACCESS_TENANT) | (1u << CFG_ACCESS_TOKENS));
    cr_assert_eq(cfg->policy->tenants[0].rate_rps, 0, "no rate limit by default");
    cfg_free(cfg);
    cfg = must_load(POLICY(TENANT(",'rate_limit':{'requests_per_second':0.1,'burst':7}")));
    cr_assert_eq(cfg->policy->tenants[0].rate_burst, 7);
    cfg_free(cfg);
}

Test(config, dump_fills_defaults_and_redacts_secrets)
{
    cfg_t *cfg =
        must_load("{'pools':[" POOL "],'policy':{'tenants':["
                  "{'name':'k','match':{'api_keys_sha256':['" H64 "']}},"
                  "{'name':'h','match':{'header':{'name':'x-t','value':'hush-value'}}}]}}");
    dp_buf_t out = {0};
    cfg_dump_json(cfg, &out);
    dp_buf_appendc(&out, '\0');
    cr_assert_not_null(strstr(out.base, "\"max_body_bytes\":8388608"), "%s", out.base);
    cr_assert_not_null(strstr(out.base, "\"listen\":\"127.0.0.1:8080\""));
    cr_assert_not_null(strstr(out.base, "\"interval_ms\":10000"));
    cr_assert_not_null(strstr(out.base, "\"balance\":\"least_inflight\""));
    cr_assert_not_null(strstr(out.base, "\"sample_rate\":1"));
    cr_assert_null(strstr(out.base, H64), "a key digest is shown by its prefix only");
    cr_assert_not_null(strstr(out.base, "<redacted>"));
    cr_assert_null(strstr(out.base, "hush-value"), "header-match values are redacted");
    cr_assert_not_null(strstr(out.base, "\"api_key\":null"), "no key file: null, not redacted");
    dp_buf_free(&out);
    cfg_free(cfg);
}
