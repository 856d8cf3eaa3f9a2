/* What a simulated replica says about itself, in each serving framework's own shape. Pure:
 * an identity struct in, JSON bytes out.
 *
 * Each flavor exposes only what the real server exposes (docs/contributing/simulator.md lists the
 * shapes and where they come from), so the attestation adapters are tested against what they will
 * really see: vLLM has no dtype, quantization or checkpoint anywhere; TGI has a dtype but only a
 * git revision for the weights; SGLang dumps its server arguments (dtype, quantization); llama.cpp
 * has a model path and a build string. */
#ifndef SIM_FLAVOR_H
#define SIM_FLAVOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"

typedef enum {
    SIM_FLAVOR_VLLM = 0,
    SIM_FLAVOR_TGI,
    SIM_FLAVOR_SGLANG,
    SIM_FLAVOR_LLAMACPP,
} sim_flavor_t;

/* The replica's identity. Every string is owned (heap) and never NULL once
 * sim_identity_defaults has run; change one with sim_identity_set. */
typedef struct {
    sim_flavor_t flavor;
    char *model;
    char *framework_version;
    char *quantization;        /* what it generates with */
    char *report_quantization; /* what it reports; "" = same as quantization */
    char *dtype;
    char *checkpoint_sha256;
    uint32_t max_model_len;
    uint32_t total_slots;         /* llama.cpp /props total_slots (--parallel); default 4 */
    bool deterministic_inference; /* SGLang enable_deterministic_inference; default false */
    uint64_t created;             /* unix seconds, used for "created" fields */
} sim_identity_t;

/* Parse "vllm|tgi|sglang|llamacpp"; -1 when unknown. */
int sim_flavor_parse(const char *s);
const char *sim_flavor_name(sim_flavor_t f);
/* The framework version a flavor reports when --framework-version is not given. */
const char *sim_flavor_default_version(sim_flavor_t f);

/* Fill every field with its default (flavor vllm, model "sim-model", quantization "none",
 * dtype "float16", checkpoint = SHA-256 of "sim"). */
void sim_identity_defaults(sim_identity_t *id);
void sim_identity_free(sim_identity_t *id);
/* Replace one owned string field. */
void sim_identity_set(char **field, const char *value);
/* The quantization the replica reports (report_quantization when set). */
const char *sim_identity_reported_quantization(const sim_identity_t *id);

/* The value of system_fingerprint in responses, or NULL when the framework leaves it out. */
void sim_identity_fingerprint(const sim_identity_t *id, dp_buf_t *out);
bool sim_identity_has_fingerprint(const sim_identity_t *id);

/* Answer a GET for a metadata path (/health, /v1/models, and the flavor's own: /version,
 * /info, /get_server_info, /get_model_info, /props). Returns the HTTP status with the body in
 * *out and its content type in *ctype, or 0 when this flavor has no such path. */
int sim_flavor_get(const sim_identity_t *id, const char *path, size_t pathlen, dp_buf_t *out,
                   const char **ctype);

/* The body a framework sends for an unknown path, with its status (404). */
int sim_flavor_not_found(const sim_identity_t *id, dp_buf_t *out, const char **ctype);

#endif
