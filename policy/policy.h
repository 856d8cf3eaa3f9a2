/* Sampling policy (docs/policy.md, and the policy parts of docs/requests.md): tenant matching,
 * strict request-body validation, the rule engine (force / default / min / max / derive), framework
 * normalisation, RFC 8785 canonical JSON, response fingerprint rewriting (JSON and SSE) and audit
 * lines.
 *
 * Pure: no libuv, no sockets, no files, no globals; safe to call from any thread as long as one
 * policy_req_t is used by one thread at a time. Hostile input is the normal case: every function
 * here accepts arbitrary bytes and answers with an error, never a crash.
 *
 * Ownership and lifetimes (the rules that bite):
 *   - The config structs (cfg_policy_t, cfg_tenant_t) are borrowed and must outlive every call
 *     that takes them; policy keeps no pointer to them after a call returns, except
 *     policy_match_tenant's return value, which points into the cfg_policy_t.
 *   - policy_parse borrows the body: it must stay unchanged and alive until policy_req_reset /
 *     policy_req_free, because the tape and policy_result_t.body may point into it.
 *   - Everything in a policy_result_t (parts, model) points into the body or into the
 *     policy_req_t's own buffers: valid until policy_req_reset / policy_req_free. Copy what you
 *     keep longer (the audit line, shadow copies).
 *   - Bearer tokens are hashed from the header slice in place; nothing here copies a token, logs
 *     it or leaves its digest in memory after the call (OPENSSL_cleanse).
 *
 * Call order in the proxy, per inference request:
 *   1. policy_match_tenant        as soon as the request head is complete (401 before reading a
 *                                 body costs nothing)
 *   2. policy_parse               once the whole body is read: strict JSON + `model`
 *   3. policy_model               route by model (or by the tenant's `pool`)
 *   4. policy_apply               with the tenant and the chosen pool's manifest framework name
 *   5. forward result.parts       with a fresh Content-Length (body_len); headers from the
 *                                 result; policy_body when one contiguous copy is needed
 *   6. policy_fp_rewrite_json / policy_sse_fp_*  on the response
 *   7. policy_audit_line          when the tenant has `audit: true`
 * A policy_req_t can be reused for the next request on the same connection (policy_req_reset),
 * which makes steady-state parsing and rewriting allocation-free. */
#ifndef DP_POLICY_H
#define DP_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/buf.h"
#include "config/config.h"

/* ---- errors -------------------------------------------------------------------------------- */

/* An OpenAI-shaped error: {"error":{"message","type","param","code"}}. All strings are static
 * except message and param, which are copied in (client-controlled bytes in them are escaped by
 * policy_error_json). */
typedef struct {
    int status;       /* 400 or 401 */
    const char *type; /* "invalid_request_error" */
    const char *code; /* "invalid_json", "duplicate_key", "invalid_value", "policy_violation",
                         "invalid_api_key", or NULL */
    char param[64];   /* "" means null */
    char message[224];
} policy_error_t;

/* Append the error as one JSON object (no newline). */
void policy_error_json(const policy_error_t *e, dp_buf_t *out);

/* ---- tenants (docs/policy.md §1) ------------------------------------------------------------- */

/* Header lookup supplied by the caller. `lname` is a lowercase, NUL-terminated field name.
 * Returns how many header fields have that name (ASCII case-insensitively) and sets *value to
 * the first one's value. Values are borrowed for the duration of the call only. */
typedef size_t (*policy_header_cb)(void *ud, const char *lname, dp_iovec_t *value);

/* A ready-made lookup over an array of (name, value) slices: pass a policy_headers_t as ud.
 * net_header_t has the same two members, so the proxy can fill one of these cheaply or supply
 * its own callback over its own array. */
typedef struct {
    dp_iovec_t name;
    dp_iovec_t value;
} policy_header_t;

typedef struct {
    const policy_header_t *items;
    size_t count;
} policy_headers_t;

size_t policy_headers_lookup(void *ud, const char *lname, dp_iovec_t *value);

/* First tenant whose match holds, or NULL with err set to 401 (code invalid_api_key).
 *   api_keys_sha256: exactly one Authorization field of the form "Bearer <token>" (scheme
 *     case-insensitive, one space, token without spaces; surrounding whitespace ignored). The
 *     token's SHA-256 is compared in constant time with every digest of the tenant: all are
 *     compared, so timing does not reveal which key matched.
 *   header: exactly one field with that name whose value equals the configured one byte for byte
 *     (compared in constant time when the lengths agree).
 *   any: always. */
const cfg_tenant_t *policy_match_tenant(const cfg_policy_t *pol, policy_header_cb lookup, void *ud,
                                        policy_error_t *err);

/* ---- request parsing and the rule engine --------------------------------------------------- */

typedef enum {
    POLICY_ROUTE_COMPLETIONS = 0,
    POLICY_ROUTE_CHAT,
    POLICY_ROUTE_RESPONSES
} policy_route_t;

typedef enum {
    POLICY_FORCED = 0,
    POLICY_DEFAULTED,
    POLICY_CLAMPED,
    POLICY_DERIVED,
    POLICY_NORMALIZED,
    POLICY_ACTION__COUNT
} policy_action_t;

/* "forced", "defaulted", "clamped", "derived", "normalized": the `action` metric label. */
extern const char *const policy_action_names[POLICY_ACTION__COUNT];

#define POLICY_VAL_LEN 32
#define POLICY_MAX_CHANGES 40

/* One override, for x-detproxy-* headers, the audit line and
 * detproxy_policy_overrides_total{tenant,param,action}. A parameter can appear twice: once for
 * its rule and once for framework normalisation (forced to 1, then removed for TGI). */
typedef struct {
    const char *param; /* static: "temperature", ..., "max_completion_tokens", "min_p" */
    policy_action_t action;
    char before[POLICY_VAL_LEN]; /* JSON text of the value before, "" when absent */
    char after[POLICY_VAL_LEN];  /* JSON text of the value sent upstream, "" when removed */
} policy_change_t;

/* Pieces of the forwarded body: at most two per rewritten parameter plus the tail. */
#define POLICY_MAX_PARTS 40

typedef struct {
    /* The body to forward, as splices sent in order (writev): the client's own bytes in one
     * piece when nothing changed (rewritten == false); else untouched spans of them with the
     * new bytes between (a changed value replaced in place, a removed member cut with its
     * comma, added members inserted before the closing brace). Client whitespace is kept.
     * Pieces point into the body policy_parse read and into the policy_req_t. */
    const dp_iovec_t *parts; /* nparts of them, kept by the policy_req_t */
    size_t nparts;
    size_t body_len; /* sum of the parts' lengths */
    bool rewritten;
    dp_iovec_t model; /* unescaped, NUL-terminated at model.base[model.len] */
    bool stream;
    bool has_seed; /* a seed is sent upstream (x-detproxy-seed) */
    uint64_t seed;
    bool seed_derived;
    bool has_temperature; /* post-policy temperature sent upstream */
    double temperature;
    bool comparable; /* temperature 0 or a seed: eligible for shadowing (docs/drift.md) */
    bool has_top_p;  /* post-policy top_p and output length sent upstream (spans) */
    double top_p;
    bool has_max_tokens; /* max_tokens, or its alias the route uses (max_output_tokens, ...) */
    int64_t max_tokens;
    /* It runs more than one sequence at once on an engine (n or n_cmpl above 1, best_of above
     * 1, use_beam_search, a batch of prompts): refused on a single_sequence pool, and no copy of it
     * is sent to one. */
    bool several_sequences;
    /* Kept by the policy_req_t, sized to what its requests needed: a result is a few dozen
     * bytes that live as long as the request (a stream's whole life), not room for the most
     * any request could change. */
    const policy_change_t *changes;
    size_t nchanges;
} policy_result_t;

typedef struct policy_req_s policy_req_t;

/* For a body no policy shaped (the admin relay's, a pass-through path's) sent to a
 * single_sequence pool: 0 when it surely runs one sequence; -1 with err (400) when it asks for
 * several at once (policy_violation, naming the key: the rules of policy_decide on such a
 * pool, n or n_cmpl other than 1, best_of, beam search, a batch of prompts; and a batch of
 * inputs: several embeddings `input`/`inputs`/`content`, rerank `documents`/`texts`, /score
 * `text_1`/`text_2`), or is not one JSON object without duplicate keys (invalid_json,
 * duplicate_key: an engine would read it its own way). input_items: the body is for
 * /v1/responses, whose `input` array holds one conversation's items. r is scratch, reset
 * after. */
int policy_one_sequence(policy_req_t *r, const char *body, size_t len, bool input_items,
                        policy_error_t *err);

policy_req_t *policy_req_new(void);
/* Forget the current request but keep the buffers for the next one. */
void policy_req_reset(policy_req_t *r);
/* The parse is done with: the request's model, body (policy_body) and result stay valid, the
 * token tape and the canonical-form staging are freed (the next parse allocates them again).
 * For a request that lives long, a stream, which would otherwise hold them to its end. */
void policy_req_trim(policy_req_t *r);
/* The forwarded body is done with (its answer began, and nothing resends or stores it): the
 * new bytes and the parts that point into the client's body are freed, and res no longer has
 * parts (policy_body may not be called). The model and the changes stay, for the access line.
 * The next request allocates them again. */
void policy_req_forget_body(policy_req_t *r, policy_result_t *res);
void policy_req_free(policy_req_t *r);

/* Stop policy_parse once the body holds more than `values` JSON values' worth of work (an
 * escape costs an eighth of one, jdoc_t.budget; 0: no limit, the default): it then fails with
 * policy_over_budget(err), a bound on the work, not a verdict on the body. Kept across
 * policy_req_reset. */
void policy_req_set_budget(policy_req_t *r, uint32_t values);
bool policy_over_budget(const policy_error_t *err);

/* Validate body strictly (a JSON object; valid UTF-8 everywhere including escapes; nesting at
 * most 64 deep; no duplicate key in any object; no number literal longer than 512 bytes or
 * overflowing a double) and extract
 * `model` (required, a non-empty string). 0, or -1 with err set (400). Bodies of 4 GiB or more
 * are refused. */
int policy_parse(policy_req_t *r, policy_route_t route, const char *body, size_t len,
                 policy_error_t *err);

/* The parsed `model` (unescaped, NUL-terminated); valid until reset/free. */
dp_iovec_t policy_model(const policy_req_t *r);

/* Apply tenant t to the parsed request, in this order:
 *   1. deny_params: any listed top-level key present -> 400 policy_violation naming it;
 *   2. types and shapes: `stream` boolean; numeric parameters numbers (top_k, seed, max_tokens,
 *      n integers; seed in [0, 2^63-1]); `prompt` (completions) or `messages` (chat); a JSON
 *      null parameter counts as absent -> 400 invalid_value naming the parameter;
 *   3. rules per parameter (force, default, min/max), max_tokens' rule also governing the
 *      aliases max_completion_tokens, n_predict and max_new_tokens when present; a governed
 *      count still below 1 after them -> 400 invalid_value naming it; then seed derivation;
 *   4. normalisation for `framework` (the pool manifest's framework.name: "vllm", "tgi",
 *      "sglang", "llamacpp", a few aliases; NULL or unknown: none). See docs/policy.md.
 * The same policy_req_t may be applied again (another tenant or framework) without reparsing.
 * 0 and *out filled, or -1 with err set. */
int policy_apply(policy_req_t *r, const cfg_tenant_t *t, const char *framework,
                 policy_result_t *out, policy_error_t *err);

/* policy_apply for a pool: its manifest's framework.name, and on a single_sequence pool of
 * llama.cpp also `cache_prompt: false` (docs/policy.md §5, N8; an override with action
 * "normalized"). */
int policy_apply_pool(policy_req_t *r, const cfg_tenant_t *t, const cfg_pool_t *pool,
                      policy_result_t *out, policy_error_t *err);

/* The forwarded body of a successful policy_apply in one piece: parts[0] itself when there is
 * one, else the parts joined into a buffer of r (made once per apply). Valid until the next
 * apply / reset / free. For the readers that need contiguous bytes (shadow copies, stored
 * audit bodies, `detproxy policy test`); the send path uses the parts. */
dp_iovec_t policy_body(policy_req_t *r, const policy_result_t *res);

/* SHA-256 of the parts, as of policy_body's bytes, without joining them. */
void policy_body_sha256_hex(const policy_result_t *res, char out[65]);

/* Steps 2-4 in one call, as the proxy runs them and `detproxy policy test` shows them: parse
 * body, choose the pool (the tenant's `pool`, else the first whose `models` lists the model:
 * none is 404 model_not_found), apply t for that pool (policy_apply_pool). A tenant with
 * require_determinism only considers pools with that mode: when the model is served, but not by
 * such a pool, 404 determinism_unavailable (param "model"). 0 with *pool and *out set, or -1
 * with err set (and *pool NULL). */
int policy_decide(const cfg_t *cfg, const cfg_tenant_t *t, policy_req_t *r, policy_route_t route,
                  const char *body, size_t len, const cfg_pool_t **pool, policy_result_t *out,
                  policy_error_t *err);

/* body (a JSON object) with its top-level `model` value replaced by the string `model`, every
 * other byte kept as it was, appended to out: what a candidate pool serving another model name
 * receives (docs/rollouts.md §2). 0, or -1 (out untouched) when body is not an object with a
 * `model`. */
int policy_replace_model(const char *body, size_t len, const char *model, dp_buf_t *out);
/* Does this pool turn llama.cpp's prompt cache off on every request (a single_sequence pool of
 * llama.cpp, docs/configuration.md "Deterministic pools")? Then body with `cache_prompt: false`
 * (replaced, or inserted first), appended to out: what a candidate copy to such a pool carries. -1
 * when body is not an object. */
bool policy_pool_no_cache_prompt(const cfg_pool_t *pool);
int policy_force_cache_prompt_off(const char *body, size_t len, dp_buf_t *out);
/* Is an abandoned exchange to this pool's replicas read to its end, its slot held
 * until then? On a single_sequence pool whose engine may go on generating an answer whose
 * connection closed (llama.cpp does); not on vLLM (its manifest's framework.name), whose
 * OpenAI server cancels the request on the disconnect: there it is closed at once. */
bool policy_pool_drains_abandoned(const cfg_pool_t *pool);
/* The longest such an exchange is read on (a drain: net_creq_drain), from when it was left,
 * before it is given up and its slot freed: the longer of the upstream first-byte and idle
 * timeouts, so a first-byte timeout set shorter than a generation does not cut that wait as
 * short, and a stream that never ends does not keep the slot for good. */
uint64_t policy_abandoned_drain_ms(const cfg_limits_t *limits);

/* ---- canonical JSON (RFC 8785) ------------------------------------------------------------- */

/* Canonicalise any JSON text (same strictness as policy_parse, any top-level type). 0 and the
 * JCS form appended to out, or -1 with err set. Numbers print as jcs_es_number (policy/jcs.h)
 * prints them. */
int policy_jcs(const char *json, size_t len, dp_buf_t *out, policy_error_t *err);

/* ---- response fingerprint (docs/policy.md §6) ------------------------------------------------ */

#define POLICY_FP_PREV_MAX 128

/* Non-streamed JSON response: set the top-level `system_fingerprint` to fp, whatever its value
 * was (every top-level copy, should a replica send two), or append the member when absent;
 * everything else is copied byte for byte. Returns 1 with the new body in out (reset first),
 * or 0 when the body is not a valid JSON object (an error page, truncated JSON): forward it
 * untouched. prev receives the replica's own string value, unescaped, for
 * x-detproxy-upstream-fingerprint: "" when absent or not a string; bytes outside visible ASCII
 * become '?' so it is always a safe header value; truncated to POLICY_FP_PREV_MAX-1.
 * usage, when not NULL, takes the body's usage from the same parse where it can (see
 * policy_usage_t). */
typedef struct policy_usage policy_usage_t;
int policy_fp_rewrite_json(const char *body, size_t len, const char *fp, dp_buf_t *out,
                           char prev[POLICY_FP_PREV_MAX], policy_usage_t *usage);

/* Streamed (SSE) responses: an incremental rewriter. In every `data:` event whose JSON is an
 * object, the first top-level "system_fingerprint" whose value is a string or null gets fp
 * instead (the rest of that event then passes untouched); events without one are left alone
 * (nothing is added); "data: [DONE]", comments and other fields pass through. Bytes go out as
 * they come in: the only bytes held back are a top-level key cut by the end of a read that
 * could still be "system_fingerprint" (at most 20 bytes, kept in the struct), so memory is
 * constant and no event is buffered. The key must be spelled plainly (servers never escape
 * it). The replica's values are kept as written (escapes not decoded, bytes outside visible
 * ASCII as '?'): the first non-empty one in prev and the first later one that differs from it
 * in alt, so a fingerprint that changes within a stream is seen. Response headers are gone by
 * then, so log, audit or check them.
 *
 * Unlike the parsers in STYLE.md this one transforms rather than parses, so it never answers
 * "need more": every byte fed is consumed. Zero-initialise and set fp, or policy_sse_fp_init. */
typedef struct {
    const char *fp; /* borrowed: must outlive the stream */
    uint8_t line;   /* line state */
    uint8_t pfx;    /* bytes of "data:" matched at line start */
    uint8_t bom;    /* bytes of a UTF-8 BOM matched at the stream's start */
    bool started;   /* past the stream's first byte that is not a BOM's */
    bool last_cr;
    /* JSON tracking for the current event */
    uint8_t js; /* JSON state */
    uint16_t depth;
    bool top_obj; /* the event's top-level value is an object */
    bool in_str, esc;
    uint8_t held; /* bytes of a candidate key held back */
    char hold[24];
    uint8_t vskip;                 /* bytes of a null literal being replaced */
    size_t rewritten;              /* number of values replaced so far */
    char prev[POLICY_FP_PREV_MAX]; /* the stream's first non-empty value */
    char alt[POLICY_FP_PREV_MAX];  /* the first later one that differs from it, or "" */
    char cur[POLICY_FP_PREV_MAX];  /* the value being read, as written (given back if cut) */
    uint8_t curlen;
} policy_sse_fp_t;

void policy_sse_fp_init(policy_sse_fp_t *s, const char *fp);
/* Feed the next n bytes of the response body; the bytes to forward are appended to out.
 * Returns n (every byte is consumed: held bytes are kept in s), or -1 if s->fp is NULL. */
ssize_t policy_sse_fp_feed(policy_sse_fp_t *s, const char *p, size_t n, dp_buf_t *out);
/* End of stream: append any held bytes. */
void policy_sse_fp_finish(policy_sse_fp_t *s, dp_buf_t *out);

/* ---- the end of an audited stream ------------------------------------------------------------ */

/* A stream's closing event, as OpenAI's clients recognise one: an event whose data starts with
 * `[DONE]` (completions, chat), or, on the Responses API, one whose data is a JSON object with a
 * member "type" (escapes decoded, any of duplicates) of "response.completed", ".incomplete" or
 * ".failed", or whose `event:` field starts with one of those. For a tenant whose answers may
 * not exist without their audit line, that event and everything after it wait until the line
 * is written: a client that reads to the end never sees a finished answer the trail does not
 * hold. Events are judged whole: each is kept until its blank line (an engine writes an event
 * in one piece, so this adds no wait), and one longer than POLICY_SSE_END_EVENT_MAX is taken as
 * the end (kept, not passed on). Zero-initialise; policy_sse_end_free when done. */
#define POLICY_SSE_END_EVENT_MAX (1024 * 1024)
typedef struct {
    bool holding; /* the closing event began: every byte from it on is held */
    bool bol;     /* at the start of a line */
    bool cr;      /* the last byte was '\r' (a '\n' after it ends no second line) */
    dp_buf_t ev;  /* the current event, not passed on yet */
} policy_sse_end_t;

/* The next n bytes of the stream (as the client would get them): what may go now is appended
 * to out, what must wait to held. */
void policy_sse_end_feed(policy_sse_end_t *g, const char *p, size_t n, dp_buf_t *out,
                         dp_buf_t *held);
/* The stream ended: a last event without its blank line is judged as it is. */
void policy_sse_end_finish(policy_sse_end_t *g, dp_buf_t *out, dp_buf_t *held);
void policy_sse_end_free(policy_sse_end_t *g);

/* ---- token usage (detproxy_tokens_total) ---------------------------------------------------- */

/* Incremental scanner for `"usage": {"prompt_tokens": P, "completion_tokens": C, ...}` in a
 * response body: a non-streamed JSON body, or an SSE stream whose usage arrives in a chunk
 * (vLLM's stream_options.include_usage, llama.cpp's last chunk). Any depth, any number of
 * reads; the last usage object seen wins (continuous usage stats are cumulative). Keys and
 * quotes inside string values never match. Zero-initialise; feed every byte.
 *
 * A non-streamed JSON body that policy_fp_rewrite_json parsed needs no scan when the scan's
 * answer is plain from the parse: its only "usage" key (spelled plainly, at any depth) is a
 * member of the top level and its object fits the scan's copy. The counts are then read from
 * the parse, taken is set, and feeding the same bytes afterwards changes nothing. Any other
 * body is left to the scan, so a body counts the same whether or not it was parsed.
 *
 * Set sse before the first byte when the body is an event stream: a line end (CR or LF) then
 * ends a usage object still being copied, so an event cut inside one (a replica that failed
 * mid-event) does not run on into the events after it and hide their usage. A JSON body may
 * hold line ends between its tokens, so without sse they are whitespace. */
struct policy_usage {
    uint8_t st;
    bool sse;
    bool in_str, esc;
    uint8_t klen; /* bytes of the current string kept in key; 0xff: not a plain short key */
    char key[8];
    uint16_t depth;
    /* The usage object being read: clen bytes so far. One that ends in the read it began in is
     * read where it lies; one cut by a read's end is copied to cap (POLICY_USAGE_CAP bytes,
     * allocated then and freed when it is read or dropped), so a stream carries no copy
     * between its events. */
    uint16_t clen;
    char *cap;
    bool found;
    bool taken; /* read from a parsed body's top level: feeding more changes nothing */
    int64_t prompt_tokens, completion_tokens;
};

/* The most bytes a usage object may have; a longer one is skipped, as no engine's is. */
#define POLICY_USAGE_CAP 512

void policy_usage_feed(policy_usage_t *u, const char *p, size_t n);
/* Let go of a usage object cut mid-way (the body ended or was abandoned there). The counts
 * found stay; u may be fed again. */
void policy_usage_free(policy_usage_t *u);

/* ---- audit (docs/policy.md §7) --------------------------------------------------------------- */

/* What one audit line records; the proxy fills it (borrowed pointers, NULL prints null) and
 * owns the file. */
typedef struct {
    uint64_t wall_ms; /* request start, ms since the epoch */
    const char *request_id;
    const char *tenant;
    const char *pool;
    const char *replica;
    const char *fingerprint;          /* pool fingerprint (docs/configuration.md, "Manifest") */
    const char *upstream_fingerprint; /* the replica's own system_fingerprint, if any */
    /* SHA-256 of the attestation evidence its replica was admitted on (docs/operations.md,
     * "Evidence"), NULL when none or no replica */
    const char *attestation_sha256;
    bool fingerprint_mismatch; /* it differed from what the replica attested */
    const char *route;         /* "/v1/chat/completions" */
    /* A request refused from its head (a route that is not policed, the rate limit): its
     * method, written as "method" (the route is its path); NULL for a policed route */
    const char *method;
    /* Set when route is a path cut at POLICY_AUDIT_ROUTE_MAX bytes: the whole path's length
     * and hex SHA-256, written as "route_bytes" and "route_sha256" */
    uint64_t route_bytes;
    const char *route_sha256;
    /* NULL: no body was read. A name longer than POLICY_AUDIT_MODEL_MAX bytes is written cut
     * (at a whole UTF-8 character), with "model_bytes" and "model_sha256" of all of it. */
    const char *model;
    size_t model_len;
    const policy_result_t *result; /* changes, seed, temperature; NULL when refused */
    const char *forwarded_sha256;  /* hex SHA-256 of the body sent upstream, NULL if none */
    const char *response_sha256;   /* hex SHA-256 of the response body sent to the client;
                                      NULL (null) when no replica answered */
    int status;                    /* HTTP status returned to the client */
    const char *error_code;        /* detproxy's refusal: its error code, NULL when none */
    const char *error_param;       /* the parameter it names, NULL when none */
} policy_audit_t;

/* A refused path longer than this is audited as its first this many bytes, with its length and
 * SHA-256: escaped, a line stays far below the audit file's line limit (attest/audit.h). */
#define POLICY_AUDIT_ROUTE_MAX 8192
/* The same for a model name (a client may send one of megabytes; engines' names are short). */
#define POLICY_AUDIT_MODEL_MAX 1024

/* Append one JSON line (with its '\n') to out:
 * {"time","request_id","tenant","pool","replica","fingerprint","upstream_fingerprint",
 *  "fingerprint_mismatch" (only when true),"route","method" (only when set),"route_bytes" and
 *  "route_sha256" (only when the route was cut),
 *  "model","model_bytes" and "model_sha256" (only when the model was cut),
 *  "status","seed","seed_derived","temperature",
 *  "params":[{"param","action","before","after"}...],
 *  "forwarded_body_sha256","response_body_sha256"};
 * before/after are omitted when absent/removed (with "removed":true for the latter). A refusal
 * adds "error":{"code","param"} (param null when none). */
void policy_audit_line(const policy_audit_t *a, dp_buf_t *out);

/* ---- affinity keys (docs/configuration.md, "Affinity routing") ------------------------------- */

/* The bytes a `prefix` affinity key is the digest of: the start of the prompt as the replica
 * sees it (policy never rewrites `prompt` or `messages`), cut at max bytes, appended to out
 * (reset first). Completions: a string prompt's unescaped text, any other prompt shape its
 * compact JSON. Chat: the conversation's opening, that is every message up to and including
 * the first "user" one (all of them when there is none), each as role, '\n', text, '\n', where
 * text is a string content unescaped, a content array's text parts' texts in order (other
 * parts as compact JSON) and "" for null. Later turns of a conversation repeat its opening, so
 * every turn gets the same bytes; the system prompt, the roles and the first question all
 * count. Responses: "instructions" as a "system" message, then a string input's text or the
 * input items as messages (items and fields that are not objects or strings as compact JSON).
 * scratch is working space (kept by the caller to avoid allocations). Requires a
 * successful policy_parse. */
void policy_affinity_prefix(const policy_req_t *r, size_t max, dp_buf_t *out, dp_buf_t *scratch);

/* The body's top-level `user`, unescaped, into out (reset first): false when it is absent, not
 * a string, or empty. */
bool policy_affinity_user(const policy_req_t *r, dp_buf_t *out);

#endif
