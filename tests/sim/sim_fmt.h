/* Response bodies for detproxy-sim's inference routes, in each framework's shape: whole
 * responses ("text_completion" / "chat.completion") and SSE chunks ("data: {...}\n\n").
 * Pure: structs in, bytes appended to a dp_buf_t.
 *
 * Text conventions (the same streamed and not, so concatenated deltas equal the whole text):
 * completions emit " word" per token; chat emits "word" for the first token and " word" after. */
#ifndef SIM_FMT_H
#define SIM_FMT_H

#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "tests/sim/lm.h"
#include "tests/sim/sim_flavor.h"
#include "tests/sim/sim_req.h"

typedef struct {
    sim_flavor_t flavor;
    sim_api_t api;
    const char *id;          /* response id (see sim_fmt_id) */
    uint64_t created;        /* unix seconds */
    const char *model;       /* the model name to report */
    const char *fingerprint; /* system_fingerprint, or NULL to leave it out */
} sim_fmt_ctx_t;

typedef struct {
    uint32_t index;
    const char *text;
    size_t len;
    sim_finish_t finish;
} sim_choice_t;

typedef struct {
    uint32_t prompt_tokens;
    uint32_t completion_tokens;
} sim_usage_t;

/* "length" / "stop" (NULL while running). */
const char *sim_finish_name(sim_finish_t f);

/* A response id in the flavor's format from 128 random bits: vLLM "cmpl-<hex>" / "chat-<hex>",
 * SGLang "<hex>", llama.cpp "cmpl-<hex>" / "chatcmpl-<hex>", TGI "" (it sends an empty id). */
void sim_fmt_id(sim_flavor_t f, sim_api_t api, uint64_t r1, uint64_t r2, char out[48]);

/* The text a token adds to the output: " word", or "word" for the first chat token. */
void sim_fmt_token_text(sim_api_t api, uint32_t position, int32_t token, dp_buf_t *out);

void sim_fmt_response(dp_buf_t *out, const sim_fmt_ctx_t *c, const sim_choice_t *choices, size_t n,
                      const sim_usage_t *u);

/* The first chat chunk of choice `index`, carrying the role (nothing for TGI, which repeats the
 * role in every delta, and for completions). */
void sim_fmt_chunk_role(dp_buf_t *out, const sim_fmt_ctx_t *c, uint32_t index);
/* A token delta; finish != NONE marks it as the choice's last chunk. */
void sim_fmt_chunk(dp_buf_t *out, const sim_fmt_ctx_t *c, uint32_t index, const char *text,
                   size_t len, sim_finish_t finish);
/* stream_options.include_usage: the final chunk with empty choices and the usage. */
void sim_fmt_chunk_usage(dp_buf_t *out, const sim_fmt_ctx_t *c, const sim_usage_t *u);
void sim_fmt_done(dp_buf_t *out);
/* /v1/responses streams (sim_fmt_chunk_role opens one, sim_fmt_chunk sends
 * response.output_text.delta events): the closing events, ending with response.completed (or
 * response.incomplete) carrying the whole response. No [DONE]: the Responses API sends none. */
void sim_fmt_responses_end(dp_buf_t *out, const sim_fmt_ctx_t *c, const sim_choice_t *ch,
                           const sim_usage_t *u);

#endif
