/* Configuration: load and validate a detproxy config file (docs/configuration.md), with its
 * manifests (its "Manifest" section), policy (docs/policy.md) and security settings
 * (docs/security.md), into plain immutable structs.
 *
 * Ownership: cfg_load returns one heap object that owns everything reachable from it; free it
 * with cfg_free. A loaded config is never mutated, so a live reload can build a new one beside
 * the old and swap (in-flight requests keep a reference to the one they started with).
 *
 * Validation collects every error it finds, each prefixed with its JSON path
 * ("pools[1].manifest.quantization: expected a string"), so `detproxy check` can print them all
 * at once. Unknown keys are errors everywhere. */
#ifndef DP_CONFIG_H
#define DP_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"

/* ---- errors ---------------------------------------------------------------------------- */

typedef struct {
    char **items; /* "path: message" strings */
    size_t count;
    char **warnings; /* e.g. secret file readable by group/others */
    size_t nwarnings;
} cfg_errors_t;

void cfg_errors_free(cfg_errors_t *e);
/* One more error, a copy of msg ("path: message"), for a check made outside the config module. */
void cfg_errors_add(cfg_errors_t *e, const char *msg);

/* ---- addresses --------------------------------------------------------------------------- */

/* The longest path a URL may have: requests built on it (the path plus an endpoint and a nonce)
 * fit the fixed buffers that hold them. */
#define CFG_URL_PATH_MAX 256

/* "host:port", "[v6]:port" or "http(s)://host[:port][/path]" split into parts. */
typedef struct {
    bool tls;   /* https:// */
    char *host; /* without brackets */
    uint16_t port;
    char *path;     /* "" or "/prefix" without trailing slash; agent URLs keep their full path */
    char *hostport; /* value for a Host header: "host:port" ("[v6]:port") */
} cfg_url_t;

typedef struct {
    char *host; /* numeric IPv4 or IPv6 address (no brackets) */
    uint16_t port;
} cfg_addr_t;

/* Is host (a numeric address) a loopback one: 127.0.0.0/8 or ::1? */
bool cfg_addr_is_loopback(const char *host);

/* ---- manifest (docs/configuration.md, "Manifest") -------------------------------------------- */

typedef struct {
    char *prompt;
    uint32_t max_tokens;
    char *expected_sha256; /* 64 lowercase hex */
} cfg_canary_t;

/* "determinism": {"mode": ...} (docs/configuration.md, "Deterministic pools"). batch_invariant is
 * attested by the replica; single_sequence is enforced by detproxy (one request in flight per
 * replica). */
typedef enum {
    CFG_DETERMINISM_NONE = 0,
    CFG_DETERMINISM_BATCH_INVARIANT,
    CFG_DETERMINISM_SINGLE_SEQUENCE
} cfg_determinism_t;

extern const char *const cfg_determinism_names[]; /* "none", "batch_invariant", ... */

/* Every field is optional; NULL means "not pinned". */
typedef struct cfg_manifest_s {
    char *model;
    char *checkpoint_sha256; /* 64 lowercase hex */
    char *quantization;
    char *dtype;
    char *framework_name;
    char *framework_version;
    char *engine_fingerprint; /* the engine's system_fingerprint (docs/attestation.md §5) */
    cfg_canary_t *canary;     /* NULL when absent */
    /* "oms" (docs/attestation.md §9): {"signer": 64 lowercase hex} pins a key or certificate
     * signer, {"identity": ID, "issuer": URL} a keyless one; NULL when absent */
    char *oms_signer;
    char *oms_identity, *oms_issuer; /* both or neither */
    char fingerprint[20]; /* "fp_" + 16 hex, computed at load (docs/configuration.md, "Manifest") */
    /* Not part of the fingerprint; accept[] entries inherit it (they cannot set their own). */
    cfg_determinism_t determinism;
    /* "accept": further identities admitted during a rollout, each complete (fields it does not
     * list, and the canary, are copied from the manifest) with its own fingerprint; never
     * nested (their own accept is empty). */
    struct cfg_manifest_s *accept;
    size_t naccept;
} cfg_manifest_t;

/* ---- policy (docs/configuration.md, "Policy"; docs/policy.md) -------------------------------- */

typedef enum {
    CFG_PARAM_TEMPERATURE = 0,
    CFG_PARAM_TOP_P,
    CFG_PARAM_TOP_K,
    CFG_PARAM_SEED,
    CFG_PARAM_MAX_TOKENS,
    CFG_PARAM_N,
    CFG_PARAM_PRESENCE_PENALTY,
    CFG_PARAM_FREQUENCY_PENALTY,
    CFG_PARAM__COUNT
} cfg_param_t;

extern const char *const cfg_param_names[CFG_PARAM__COUNT];

/* One parameter's rule. Validation guarantees: force excludes default/min/max/derive; derive only
 * for seed; min <= max; integer parameters (top_k, seed, max_tokens, n) hold integral values. */
typedef struct {
    bool has_force, has_default, has_min, has_max, derive;
    double force, def, min, max;
} cfg_rule_t;

typedef enum { CFG_MATCH_API_KEYS, CFG_MATCH_HEADER, CFG_MATCH_ANY } cfg_match_kind_t;

typedef struct {
    char *name;
    cfg_match_kind_t match_kind;
    uint8_t (*api_keys)[32]; /* SHA-256 digests of bearer tokens */
    size_t napi_keys;
    bool any_unknown_keys; /* {"any": true, "unknown_keys": true}: also requests with a token */
    char *header_name;     /* lowercase */
    char *header_value;
    char *pool; /* NULL: route by model */
    cfg_rule_t rules[CFG_PARAM__COUNT];
    char **deny_params;
    size_t ndeny_params;
    char **allow_params; /* NULL: any top-level key; else the only ones a request may carry */
    size_t nallow_params;
    bool audit;
    double shadow_rate; /* < 0 when not set (use shadow.rate) */
    /* "rate_limit": {"requests_per_second": R, "burst": B}: a token bucket per tenant (per
     * process). rate_rps 0: no limit. burst defaults to max(1, ceil(R)). */
    double rate_rps;
    uint32_t rate_burst;
    /* "require_determinism": served only by pools whose manifest has that mode
     * (docs/configuration.md, "Deterministic pools"); CFG_DETERMINISM_NONE: any pool. */
    cfg_determinism_t require_determinism;
} cfg_tenant_t;

typedef struct {
    cfg_tenant_t *tenants;
    size_t ntenants;
} cfg_policy_t;

/* ---- pools and replicas ------------------------------------------------------------------ */

typedef enum {
    CFG_ATTEST_NONE = 0, /* no attestation source: only valid when the pool pins nothing */
    CFG_ATTEST_AGENT,
    CFG_ATTEST_VLLM,
    CFG_ATTEST_TGI,
    CFG_ATTEST_SGLANG,
    CFG_ATTEST_LLAMACPP
} cfg_attest_source_t;

extern const char *const cfg_attest_source_names[]; /* indexed by cfg_attest_source_t */

typedef struct {
    cfg_attest_source_t source;
    cfg_url_t url; /* agent only: full URL of /attestation */
} cfg_attest_t;

typedef struct {
    char *name;
    cfg_url_t url;
    char *server_name; /* TLS name to verify; NULL = url.host */
    cfg_attest_t attest;
} cfg_replica_t;

typedef struct {
    char *dns;
    uint16_t port;
    uint32_t refresh_ms;
    cfg_attest_source_t attest_source;
    uint16_t attest_port;  /* agent only */
    uint32_t max_replicas; /* addresses beyond it are ignored (default 64) */
} cfg_discovery_t;

typedef struct {
    char *ca_file; /* NULL: system store */
    char *client_cert_file;
    char *client_key_file;
} cfg_upstream_tls_t;

typedef enum {
    CFG_BALANCE_LEAST_INFLIGHT = 0,
    CFG_BALANCE_ROUND_ROBIN,
    CFG_BALANCE_AFFINITY,
} cfg_balance_t;

/* `balance: affinity` (docs/configuration.md, "Affinity routing"): what a request's routing key is
 * made of. */
typedef enum {
    CFG_AFFINITY_PREFIX = 0,
    CFG_AFFINITY_SESSION,
    CFG_AFFINITY_SEED
} cfg_affinity_key_t;

extern const char *const cfg_affinity_key_names[3]; /* "prefix", "session", "seed" */

typedef struct {
    cfg_affinity_key_t key;
    uint32_t prefix_bytes; /* how much of the prompt the prefix key covers */
    char *session_header;  /* lowercase header name (key "session") */
    double load_factor;    /* bounded loads: pass over a replica above this x mean + 1 */
} cfg_affinity_t;

/* A fraction `rate` of the pool's comparable requests also goes to an admitted replica of pool
 * `pool` (index `index` in cfg_t.pools), judged against the baseline's noise
 * (docs/configuration.md, "Candidates"; docs/rollouts.md). */
typedef struct {
    char *pool;
    size_t index;
    double rate;
} cfg_candidate_t;

/* One entry of a pool's `passthrough` list (docs/configuration.md, "Pass-through routes"):
 * "[METHOD ]/exact/path" or "[METHOD ]/prefix*". Paths are compared with the request's
 * normalised path (no query), byte for byte. */
typedef struct {
    char *text;   /* as written, for messages and the config dump */
    char *method; /* NULL: any method */
    char *path;   /* without the trailing '*' */
    size_t len;
    bool prefix;
} cfg_passthrough_t;

typedef struct {
    char *name;
    char **models; /* "*" matches any */
    size_t nmodels;
    /* models but "*", in byte order, for the per-request look-up (a pool may list thousands of
     * adapters); built with models at load. */
    const char **models_sorted;
    size_t nmodels_sorted;
    bool any_model;           /* models holds "*" */
    cfg_manifest_t *manifest; /* NULL when the pool pins nothing */
    cfg_balance_t balance;
    cfg_affinity_t affinity;           /* balance == CFG_BALANCE_AFFINITY only */
    uint32_t max_inflight_per_replica; /* 0 = unlimited; 1 on a single_sequence pool */
    uint32_t queue_limit;
    uint32_t queue_timeout_ms;
    cfg_replica_t *replicas;
    size_t nreplicas;
    cfg_discovery_t *discovery;       /* NULL when absent */
    cfg_upstream_tls_t *upstream_tls; /* NULL when absent */
    char *api_key_file;
    char *api_key;               /* file contents, trailing whitespace trimmed; never logged */
    cfg_candidate_t *candidates; /* docs/configuration.md, "Candidates" */
    size_t ncandidates;
    /* What a policed tenant may send through unpoliced besides GET and HEAD (docs/policy.md §2,
     * "Routes and pass-through"). */
    cfg_passthrough_t *passthrough;
    size_t npassthrough;
    /* Named in another pool's candidates: model routing passes over it. only_candidate: and no
     * tenant pins it either, so it serves no client (/readyz does not wait for it). */
    bool is_candidate;
    bool only_candidate;
    /* pools[].attestation.require_signature: 1 or 0, or -1 when not set (the top-level
     * attestation.require_signature applies); read it with cfg_pool_require_signature. */
    int require_signature;
} cfg_pool_t;

/* ---- top level --------------------------------------------------------------------------- */

typedef struct {
    uint32_t max_header_bytes;
    uint64_t max_body_bytes;
    uint32_t max_connections;
    uint32_t max_connections_per_client; /* 0: no bound */
    uint32_t max_headers;
    uint32_t client_header_timeout_ms;
    uint32_t client_idle_timeout_ms;
    uint32_t upstream_connect_timeout_ms;
    uint32_t upstream_first_byte_timeout_ms;
    uint32_t upstream_idle_timeout_ms;
    uint32_t upstream_keepalive_timeout_ms;
    uint64_t max_inflight_body_bytes;
    uint32_t client_body_timeout_ms;
    uint64_t max_response_rewrite_bytes;
    uint32_t max_pending_handshakes;
    uint32_t shutdown_timeout_ms; /* SIGTERM's drain: how long in-flight work may finish */
} cfg_limits_t;

typedef struct {
    uint32_t interval_ms;
    uint32_t timeout_ms;
    bool require_signature;
    char **trusted_keys; /* resolved paths of PEM public keys */
    size_t ntrusted_keys;
} cfg_attestation_t;

typedef struct {
    double rate;
    double self_rate;
    uint32_t max_inflight;
    uint64_t max_output_bytes;
    bool quarantine;
} cfg_shadow_t;

/* log.access: one "access" log line per client request (docs/configuration.md). */
typedef enum {
    CFG_ACCESS_TENANT = 0,
    CFG_ACCESS_POOL,
    CFG_ACCESS_REPLICA,
    CFG_ACCESS_CODE,
    CFG_ACCESS_MODEL,
    CFG_ACCESS_REMOTE,
    CFG_ACCESS_UPSTREAM_MS,
    CFG_ACCESS_TTFB_MS,
    CFG_ACCESS_TOKENS,
    CFG_ACCESS_SEED,
    CFG_ACCESS_POLICY,
    CFG_ACCESS__COUNT
} cfg_access_field_t;

extern const char *const cfg_access_field_names[CFG_ACCESS__COUNT];

typedef struct {
    bool enabled;       /* default true (lines are at level info) */
    double sample_rate; /* fraction of answers below 400 logged; refusals always are. 1.0 */
    uint32_t fields;    /* bit (1 << cfg_access_field_t); default all */
} cfg_access_log_t;

typedef struct {
    int level;                       /* dp_log_level_t */
    char *audit_path;                /* NULL: no audit file (an audit tenant then fails `check`) */
    char *audit_store;               /* NULL: bodies are hashed, not stored (docs/operations.md) */
    char *audit_signing_key;         /* NULL: the chain is written without signed checkpoints */
    uint32_t audit_checkpoint_lines; /* 1000 */
    bool audit_fail_open; /* "audit_fail": "open" serves an audited request whose line cannot be
                           * written (counted); "closed" (default) refuses it 503 */
    cfg_access_log_t access;
} cfg_log_t;

typedef struct {
    char *cert_file;
    char *key_file;
    char *client_ca_file; /* NULL: no mTLS */
} cfg_tls_t;

/* OpenTelemetry export, OTLP/HTTP JSON (docs/configuration.md, "otel"; docs/operations.md §7). */
typedef struct {
    cfg_url_t endpoint; /* collector base URL; spans go to <endpoint>/v1/traces */
    double sample_rate; /* for requests without a traceparent (default 1.0) */
} cfg_otel_t;

/* Fleet: instances sharing their verdicts through etcd (docs/fleet.md, "Configuration"). */
#define CFG_FLEET_MAX_ENDPOINTS 16
typedef struct {
    char *name;            /* keys live under /detproxy/<name>/ */
    char *instance;        /* this instance's name (default: host name and admin port) */
    bool instance_default; /* instance was not set: the admin port is the one bound at start */
    cfg_url_t *endpoints;
    size_t nendpoints;
    char *ca_file, *cert_file, *key_file; /* etcd.tls (NULL: system store, no client cert) */
    char *username;
    char *password_file;
    char *password; /* contents, trimmed; never logged */
    uint32_t lease_ttl_ms;
} cfg_fleet_t;

/* `workers` beyond this is a configuration error: past a few dozen cores a single proxy
 * process is no longer the unit to scale (run several, as nginx and Envoy deployments do). */
#define CFG_MAX_WORKERS 64

typedef struct cfg_s {
    char *path; /* the file it was loaded from */
    char *dir;  /* its folder: relative paths resolve against it */
    cfg_addr_t listen;
    cfg_addr_t admin_listen;
    uint32_t workers; /* event-loop threads serving clients; 0 = one per CPU (cfg_workers) */
    cfg_limits_t limits;
    cfg_attestation_t attestation;
    cfg_pool_t *pools;
    size_t npools;
    cfg_policy_t *policy; /* never NULL: absent means one tenant "default" matching any */
    cfg_shadow_t shadow;
    cfg_log_t log;
    cfg_tls_t *tls;     /* NULL: plaintext listener */
    cfg_otel_t *otel;   /* NULL: no spans are exported */
    cfg_fleet_t *fleet; /* NULL: this instance decides alone */
    char *admin_token_file;
    char *admin_token; /* contents, trimmed; never logged */
} cfg_t;

/* Load and validate. On success returns 0 and *out; on failure returns -1, *out NULL, and errs
 * holds at least one error. Warnings may be set either way. */
int cfg_load(const char *path, cfg_t **out, cfg_errors_t *errs);
/* cfg_load for a reader of the audit trail (replay): log.audit_path's folder, audit_store and
 * audit_signing_key are not checked (they are the production host's). */
int cfg_load_reader(const char *path, cfg_t **out, cfg_errors_t *errs);
extern const char *const cfg_audit_fail_names[2]; /* closed, open */
/* Same, from JSON text; dir resolves relative paths. */
int cfg_load_string(const char *json, size_t len, const char *dir, cfg_t **out, cfg_errors_t *errs);
void cfg_free(cfg_t *cfg);

/* Parse a standalone manifest / policy document (used by `attest verify --manifest`, and by
 * cfg_load for referenced files). `path` prefixes error paths. */
cfg_manifest_t *cfg_manifest_parse(const char *json, size_t len, const char *path,
                                   cfg_errors_t *errs);
void cfg_manifest_free(cfg_manifest_t *m);
cfg_policy_t *cfg_policy_parse(const char *json, size_t len, const char *path, cfg_errors_t *errs);
void cfg_policy_free(cfg_policy_t *p);

/* Pool fingerprint (docs/configuration.md, "Manifest"): "fp_" + 16 hex of SHA-256 over the six
 * manifest fields joined by '\n' (absent = empty). out must hold 20 bytes. A NULL manifest
 * fingerprints all-empty. */
void cfg_manifest_fingerprint(const cfg_manifest_t *m, char out[20]);
/* Accepted identity i of a manifest: 0 is the manifest itself, 1..naccept its accept[] entries;
 * NULL past the end (or for a NULL manifest). */
const cfg_manifest_t *cfg_manifest_identity(const cfg_manifest_t *m, size_t i);

/* Look-ups used by the router. cfg_pool_for_model passes over candidate pools. */
const cfg_pool_t *cfg_pool_by_name(const cfg_t *cfg, const char *name);
const cfg_pool_t *cfg_pool_for_model(const cfg_t *cfg, const char *model, size_t len);
/* The first pool serving the model whose determinism mode is `mode` (CFG_DETERMINISM_NONE:
 * any mode, as cfg_pool_for_model). */
const cfg_pool_t *cfg_pool_for_model_mode(const cfg_t *cfg, const char *model, size_t len,
                                          cfg_determinism_t mode);
/* The pool's manifest determinism mode (CFG_DETERMINISM_NONE without a manifest). */
cfg_determinism_t cfg_pool_determinism(const cfg_pool_t *p);

/* Parse "host:port" / "[v6]:port" (numeric host). 0 or -1 with a reason in *why. */
int cfg_parse_addr(const char *s, cfg_addr_t *out, const char **why);
/* Parse an http:// or https:// URL. 0 or -1 with a reason in *why. */
/* Offset of the first `\u0000` escape inside a string of json, or len. cJSON keeps strings NUL
 * terminated: one would cut a name, a URL or a quantization short there, silently, and be read
 * otherwise than it was written. A syntax error is left to the parser. */
size_t cfg_json_nul_escape(const char *json, size_t len);

int cfg_parse_url(const char *s, cfg_url_t *out, const char **why);
void cfg_url_free(cfg_url_t *u);
/* The engine u names, as "http[s]://HOST:PORT[/path]" into out (appended): what tells two
 * replica URLs' engines apart (single_sequence slots, a fleet's turn keys, config checks). The
 * host is compared without case, an IPv6 address in its shortest form (an IPv4-mapped one as
 * IPv4), an IPv4 address as the resolver reads it (0x7f000001 is 127.0.0.1), and the names of
 * this host's loopback (localhost, 127.0.0.1, ::1, and 0.0.0.0 and ::, which a connection
 * reaches it by) as one, 127.0.0.1: an engine listening on every address answers on each, so
 * spelling it two ways must not make it two engines (two engines taken for one cost
 * concurrency, never a second sequence). Other host names are not resolved. The path is
 * compared as a router reads it: %XX of an unreserved character decoded (/%76%31 is /v1),
 * other escapes without case, dot segments removed and empty segments dropped. */
void cfg_url_engine(const cfg_url_t *u, dp_buf_t *out);

/* ---- additions (config module) -------------------------------------------------------------
 * Notes on the declarations above, fixed by the implementation (docs/configuration.md):
 * - errs is appended to (never reset) and may be NULL. Items read "path: message"; an error
 *   inside a referenced manifest or policy file keeps the config's JSON path and ends with
 *   " (in FILE)", FILE as the config names it. Document-level errors use the path "config".
 * - cfg_load_string sets cfg->path to NULL; dir NULL means the current directory. cfg->path and
 *   cfg->dir are absolute, built without resolving symlinks.
 * - cfg_manifest_parse / cfg_policy_parse: path NULL or "" gives bare paths ("quantization").
 * - A replica without "attest" takes the native adapter named by the manifest's framework.name,
 *   else CFG_ATTEST_NONE (an error when the manifest pins an identity field). An agent URL with
 *   no path gets "/attestation". */

/* The effective configuration as one JSON object (GET /admin/config), appended to out:
 * defaults filled in, secrets redacted (config/dump.c says which). */
/* Whether pool p admits only signed attestations: its own attestation.require_signature, else
 * the top level's. */
bool cfg_pool_require_signature(const cfg_t *cfg, const cfg_pool_t *p);
void cfg_dump_json(const cfg_t *cfg, dp_buf_t *out);

/* `detproxy check -c CONFIG` (config/check.c); argv[0] is "check". Returns the exit code. */
int cfg_cmd_check(int argc, char **argv);

#endif
