/* What a replica says it is: the attestation report, its payload JSON (docs/attestation.md §2), and
 * the list of human-readable reasons that every attestation decision carries.
 *
 * A report comes from one of two places: the payload of a verified DSSE envelope (source
 * "agent", see dsse.h) or a native adapter reading a framework's own metadata (source "vllm",
 * "tgi", ..., see adapters.h). A field the source does not report is NULL, optionally with a
 * note saying why, so a manifest that pins it can fail closed with a useful reason. */
#ifndef ATTEST_REPORT_H
#define ATTEST_REPORT_H

#include <stdbool.h>
#include <stddef.h>

#include "common/buf.h"
#include "common/jw.h"

/* The identity fields a manifest can pin, in the order docs/configuration.md "Manifest" lists
 * them. */
typedef enum {
    ATTEST_F_MODEL = 0,
    ATTEST_F_CHECKPOINT,
    ATTEST_F_QUANTIZATION,
    ATTEST_F_DTYPE,
    ATTEST_F_FRAMEWORK_NAME,
    ATTEST_F_FRAMEWORK_VERSION,
    ATTEST_F_ENGINE_FINGERPRINT,
    ATTEST_F_DETERMINISM, /* "batch_invariant" when attested (docs/attestation.md §10) */
    ATTEST_F__COUNT
} attest_field_t;

/* The longest identity or issuer a keyless OMS signer may have (SIGSTORE_NAME_MAX). */
#define ATTEST_OMS_NAME_MAX 512

/* "model", "checkpoint_sha256", "quantization", "dtype", "framework.name", "framework.version",
 * "engine_fingerprint", "determinism.mode" */
extern const char *const attest_field_names[ATTEST_F__COUNT];

/* A flag the agent was started with that the engine's own report contradicts
 * (docs/attestation.md §4, "What the agent measures"): the engine's value is the one attested,
 * and the proxy rejects the replica naming both. field is "quantization", "dtype" or
 * "model_dir" (a newer agent may name others). Owned strings. */
typedef struct {
    char *field;
    char *flag;   /* the flag's value */
    char *engine; /* what the engine reports */
} attest_contradiction_t;

/* Owned strings throughout; zero-initialise, release with attest_report_clear. */
typedef struct {
    char *model;
    char *checkpoint_sha256; /* 64 lowercase hex when present */
    char *quantization;
    char *dtype;
    char *framework_name;
    char *framework_version;
    char *engine_fingerprint; /* the system_fingerprint the engine puts on its responses */
    char *determinism;        /* "batch_invariant" when attested (docs/attestation.md §10) */
    /* Parsed from a vLLM-form engine fingerprint (informational: not pinnable). NULL / 0 when
     * the fingerprint does not say. */
    char *engine_hardware; /* "H100" */
    unsigned engine_tp;    /* tensor-parallel size */
    /* Why a NULL field above is not reported, e.g. "vllm adapter does not report it". NULL:
     * the default wording for the source is used. Indexed by attest_field_t. */
    char *unattested_note[ATTEST_F__COUNT];
    /* What the engine reports having loaded: llama.cpp /props model_path, SGLang model_path,
     * vLLM /v1/models root, TGI model_id (a local path or a Hub id). NULL when not reported. */
    char *model_path;
    /* Agent only: bit (1u << f) set for each field measured (read from the engine, or hashed
     * from the files it loaded) rather than repeated from the agent's flags. */
    unsigned measured;
    attest_contradiction_t *contradictions;
    size_t ncontradictions;
    char *nonce;     /* agent only: echoed from the request */
    char *issued_at; /* agent only: RFC 3339 UTC, "2026-11-29T17:30:46.123Z" */
    bool is_signed;  /* a trusted signature verified over this payload */
    char keyid[65];  /* hex SHA-256 of the signer's SubjectPublicKeyInfo DER; "" when unsigned */
    char source[16]; /* "agent", "vllm", "tgi", "sglang", "llamacpp" */
    /* OMS (docs/attestation.md §9): only an agent started with --oms-bundle reports these. */
    bool oms_reported;
    bool oms_verified;        /* it verified the publisher's bundle against the directory */
    char oms_signer[65];      /* hex SHA-256 of the signer's public key DER; "" unless verified */
    char oms_root_digest[65]; /* the bundle's root digest; "" unless verified */
    /* a keyless (Sigstore) bundle: the certificate's identity and OIDC issuer it verified;
     * "" otherwise */
    char oms_identity[ATTEST_OMS_NAME_MAX + 1];
    char oms_issuer[ATTEST_OMS_NAME_MAX + 1];
} attest_report_t;

void attest_report_clear(attest_report_t *r);
/* Deep copy; dst must be empty (zeroed or cleared). */
void attest_report_copy(attest_report_t *dst, const attest_report_t *src);
/* The value of field f, or NULL when not reported. */
const char *attest_report_get(const attest_report_t *r, attest_field_t f);
/* Replace field f with a copy of v (NULL clears it). */
void attest_report_set(attest_report_t *r, attest_field_t f, const char *v);
/* Mark field f unattested with a note (the value, if any, is cleared). */
void attest_report_set_unattested(attest_report_t *r, attest_field_t f, const char *note);
/* Append a contradiction (copies of the three strings). */
void attest_report_add_contradiction(attest_report_t *r, const char *field, const char *flag,
                                     const char *engine);
/* Drop every contradiction. */
void attest_report_clear_contradictions(attest_report_t *r);
/* Drop the contradictions about one field ("model_dir"), keeping the others in order. */
void attest_report_drop_contradiction(attest_report_t *r, const char *field);
/* The agent flag a contradiction's field stands for: "--quantization", "--dtype",
 * "--model-dir"; NULL for a field this build does not know. */
const char *attest_contradiction_flag(const char *field);

/* The payload JSON an agent signs:
 * {"model","checkpoint_sha256","quantization","dtype","framework":{"name","version"},
 *  "nonce","issued_at"}, plus "oms":{"verified","signer","root_digest"} when oms_reported, and
 * "determinism":{"mode": "batch_invariant" or null, "note": why not} when the agent checks it
 * (--determinism; docs/attestation.md §10). An agent that measures its engine (--framework-url,
 * docs/attestation.md §4) adds "model_path", "measured" (the names of the measured fields),
 * "contradictions" ([{"field","flag","engine"}]) and "unattested" ({field: why it is null}),
 * each only when it has something to say.
 * Unreported fields are written as null. Appends to out. */
void attest_payload_build(const attest_report_t *r, dp_buf_t *out);

/* Parse a payload into *out (cleared first, so zero-initialised or previously used; source set
 * to "agent", is_signed false; left empty on failure).
 * Strict about types, lenient about extra keys (a newer agent may add fields): the root must be
 * an object; the six identity fields may each be a string, null or absent (= not reported);
 * checkpoint_sha256 must be 64 lowercase hex; nonce and issued_at must be strings; model_path a
 * string, measured an array of strings (names this build does not know are ignored),
 * contradictions an array of objects with string field, flag and engine, unattested an object
 * of strings, when present.
 * Returns 0, or -1 with a reason such as "payload.dtype: expected a string" appended to *why. */
int attest_payload_parse(const char *json, size_t len, attest_report_t *out, dp_buf_t *why);

/* Write the report as a JSON object (for /admin/replicas and `attest verify --json`):
 * {model, checkpoint_sha256, quantization, dtype, framework{name,version}, nonce, issued_at,
 *  signed, keyid, source, unattested{field: note}}, oms{verified, signer, root_digest} when
 * reported, and model_path, measured[], contradictions[] when there are any. key is the member
 * name or NULL. */
void attest_report_write_json(const attest_report_t *r, dp_jw_t *w, const char *key);

/* ---- reasons --------------------------------------------------------------------------------
 * Every decision (admit, reject, verify failure) carries reasons a human can act on. They end up
 * in logs and /admin/replicas, so values from a replica are sanitised (control characters
 * replaced, long values cut) before they are put in one. */
typedef struct {
    char **items;
    size_t count;
} attest_reasons_t;

void attest_reasons_add(attest_reasons_t *r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void attest_reasons_free(attest_reasons_t *r);
/* "a; b; c" into out (appended). */
void attest_reasons_join(const attest_reasons_t *r, const char *sep, dp_buf_t *out);

/* Append a value for a reason: 64-hex digests as the first 8 hex + "..", anything longer than
 * 64 bytes cut to 61 + "...", control characters as '?', NULL as "(none)". */
void attest_abbrev(const char *v, dp_buf_t *out);
/* The same for why a field is unattested: a sentence, so up to ATTEST_NOTE_MAX bytes. */
#define ATTEST_NOTE_MAX 160
void attest_abbrev_note(const char *v, dp_buf_t *out);

#endif
