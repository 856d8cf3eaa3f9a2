/* Parsing and validation of OpenAI-shaped inference requests for detproxy-sim. Pure: bytes in,
 * a plain struct out (prompts already tokenised and hashed), no I/O.
 *
 * Accepted shapes follow vLLM's OpenAI server: `prompt` as a string, an array of strings, an
 * array of token ids, or an array of token-id arrays (each entry is its own prompt, and the
 * response has n choices per prompt); `messages` with string content, content parts (the text
 * parts are concatenated) or null content. Unknown fields are ignored, as vLLM does. */
#ifndef SIM_REQ_H
#define SIM_REQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tests/sim/lm.h"

#define SIM_REQ_DEFAULT_MAX_TOKENS 16
#define SIM_REQ_MAX_TOKENS_LIMIT 4096 /* the simulated max_model_len */
#define SIM_REQ_MAX_N 64
#define SIM_REQ_MAX_PROMPTS 64
#define SIM_REQ_MAX_CHOICES 256 /* prompts * n */

typedef enum {
    SIM_API_COMPLETIONS = 0,
    SIM_API_CHAT = 1,
    SIM_API_RESPONSES = 2, /* /v1/responses: `input`, max_output_tokens, one output */
} sim_api_t;

typedef struct {
    sim_api_t api;
    char *model; /* NULL when the request has none */
    sim_prompt_t *prompts;
    size_t nprompts;
    uint32_t n;
    uint32_t max_tokens;
    double temperature; /* default 1.0, as in the OpenAI API */
    double top_p;       /* default 1.0 */
    int32_t top_k;      /* default -1 (off) */
    bool top_p_given;   /* the request set top_p (TGI refuses 1.0) */
    bool has_seed;
    int64_t seed;
    bool stream;
    bool include_usage; /* stream_options.include_usage */
} sim_req_t;

typedef struct {
    const char *param; /* the offending field, or NULL */
    char message[256];
} sim_req_err_t;

/* Parse body (n bytes, need not be NUL-terminated) as a request for api. Returns 0, or -1 with
 * *err filled (the caller answers 400). On success the caller owns *r and frees it with
 * sim_req_free; on failure *r holds nothing. */
int sim_req_parse(sim_req_t *r, sim_api_t api, const char *body, size_t n, sim_req_err_t *err);
void sim_req_free(sim_req_t *r);

#endif
