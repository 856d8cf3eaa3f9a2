#include "tests/sim/sim_fmt.h"

#include <stdio.h>
#include <string.h>

#include "common/jw.h"

/* The id SGLang reports as matched_stop for an end-of-sequence (Llama 3's <|eot_id|>). */
#define SGLANG_EOS_ID 128009

const char *sim_finish_name(sim_finish_t f)
{
    switch (f) {
    case SIM_FINISH_LENGTH:
        return "length";
    case SIM_FINISH_STOP:
        return "stop";
    case SIM_FINISH_NONE:
        break;
    }
    return NULL;
}

void sim_fmt_id(sim_flavor_t f, sim_api_t api, uint64_t r1, uint64_t r2, char out[48])
{
    const char *prefix = "";
    switch (f) {
    case SIM_FLAVOR_VLLM:
        prefix = api == SIM_API_CHAT ? "chat-" : "cmpl-";
        break;
    case SIM_FLAVOR_LLAMACPP:
        prefix = api == SIM_API_CHAT ? "chatcmpl-" : "cmpl-";
        break;
    case SIM_FLAVOR_SGLANG:
        break;
    case SIM_FLAVOR_TGI:
        out[0] = '\0';
        return;
    }
    snprintf(out, 48, "%s%016llx%016llx", prefix, (unsigned long long)r1, (unsigned long long)r2);
}

void sim_fmt_token_text(sim_api_t api, uint32_t position, int32_t token, dp_buf_t *out)
{
    const char *w = sim_lm_word(token);
    if (w == NULL)
        return;
    if (api == SIM_API_COMPLETIONS || position > 0)
        dp_buf_appendc(out, ' ');
    dp_buf_appends(out, w);
}

static const char *object_name(const sim_fmt_ctx_t *c, bool chunk)
{
    if (c->api == SIM_API_COMPLETIONS)
        return "text_completion";
    return chunk ? "chat.completion.chunk" : "chat.completion";
}

static void head(dp_jw_t *w, const sim_fmt_ctx_t *c, bool chunk)
{
    dp_jw_str(w, "id", c->id);
    dp_jw_str(w, "object", object_name(c, chunk));
    dp_jw_uint(w, "created", c->created);
    dp_jw_str(w, "model", c->model);
    if (c->fingerprint)
        dp_jw_str(w, "system_fingerprint", c->fingerprint);
}

static void usage(dp_jw_t *w, const sim_fmt_ctx_t *c, const sim_usage_t *u)
{
    dp_jw_obj_begin(w, "usage");
    dp_jw_uint(w, "prompt_tokens", u->prompt_tokens);
    dp_jw_uint(w, "total_tokens", (uint64_t)u->prompt_tokens + u->completion_tokens);
    dp_jw_uint(w, "completion_tokens", u->completion_tokens);
    if (c->flavor == SIM_FLAVOR_SGLANG)
        dp_jw_null(w, "prompt_tokens_details");
    dp_jw_obj_end(w);
}

/* Fields after finish_reason that only some frameworks send. */
static void choice_tail(dp_jw_t *w, const sim_fmt_ctx_t *c, sim_finish_t finish)
{
    if (c->flavor == SIM_FLAVOR_VLLM) {
        dp_jw_null(w, "stop_reason");
    } else if (c->flavor == SIM_FLAVOR_SGLANG) {
        if (finish == SIM_FINISH_STOP)
            dp_jw_int(w, "matched_stop", SGLANG_EOS_ID);
        else
            dp_jw_null(w, "matched_stop");
    }
}

static void finish_reason(dp_jw_t *w, sim_finish_t f)
{
    const char *name = sim_finish_name(f);
    if (name)
        dp_jw_str(w, "finish_reason", name);
    else
        dp_jw_null(w, "finish_reason");
}

void sim_fmt_response(dp_buf_t *out, const sim_fmt_ctx_t *c, const sim_choice_t *choices, size_t n,
                      const sim_usage_t *u)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    head(&w, c, false);
    dp_jw_arr_begin(&w, "choices");
    for (size_t i = 0; i < n; i++) {
        const sim_choice_t *ch = &choices[i];
        dp_jw_obj_begin(&w, NULL);
        dp_jw_uint(&w, "index", ch->index);
        if (c->api == SIM_API_COMPLETIONS) {
            dp_jw_strn(&w, "text", ch->text, ch->len);
        } else {
            dp_jw_obj_begin(&w, "message");
            dp_jw_str(&w, "role", "assistant");
            dp_jw_strn(&w, "content", ch->text, ch->len);
            if (c->flavor == SIM_FLAVOR_VLLM) {
                dp_jw_arr_begin(&w, "tool_calls");
                dp_jw_arr_end(&w);
            } else if (c->flavor == SIM_FLAVOR_SGLANG) {
                dp_jw_null(&w, "tool_calls");
            }
            dp_jw_obj_end(&w);
        }
        if (c->flavor != SIM_FLAVOR_LLAMACPP)
            dp_jw_null(&w, "logprobs");
        finish_reason(&w, ch->finish);
        choice_tail(&w, c, ch->finish);
        dp_jw_obj_end(&w);
    }
    dp_jw_arr_end(&w);
    usage(&w, c, u);
    if (c->flavor == SIM_FLAVOR_VLLM && c->api == SIM_API_CHAT)
        dp_jw_null(&w, "prompt_logprobs");
    dp_jw_obj_end(&w);
}

static void chunk_begin(dp_jw_t *w, dp_buf_t *out, const sim_fmt_ctx_t *c)
{
    dp_buf_append(out, "data: ", 6);
    dp_jw_init(w, out);
    dp_jw_obj_begin(w, NULL);
    head(w, c, true);
    dp_jw_arr_begin(w, "choices");
}

static void chunk_end(dp_jw_t *w, dp_buf_t *out)
{
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
    dp_buf_append(out, "\n\n", 2);
}

void sim_fmt_chunk_role(dp_buf_t *out, const sim_fmt_ctx_t *c, uint32_t index)
{
    if (c->api != SIM_API_CHAT || c->flavor == SIM_FLAVOR_TGI)
        return;
    dp_jw_t w;
    chunk_begin(&w, out, c);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_uint(&w, "index", index);
    dp_jw_obj_begin(&w, "delta");
    dp_jw_str(&w, "role", "assistant");
    if (c->flavor == SIM_FLAVOR_LLAMACPP)
        dp_jw_null(&w, "content");
    else
        dp_jw_str(&w, "content", "");
    dp_jw_obj_end(&w);
    if (c->flavor != SIM_FLAVOR_LLAMACPP)
        dp_jw_null(&w, "logprobs");
    dp_jw_null(&w, "finish_reason");
    choice_tail(&w, c, SIM_FINISH_NONE);
    dp_jw_obj_end(&w);
    chunk_end(&w, out);
}

void sim_fmt_chunk(dp_buf_t *out, const sim_fmt_ctx_t *c, uint32_t index, const char *text,
                   size_t len, sim_finish_t finish)
{
    dp_jw_t w;
    chunk_begin(&w, out, c);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_uint(&w, "index", index);
    if (c->api == SIM_API_COMPLETIONS) {
        dp_jw_strn(&w, "text", text, len);
    } else {
        dp_jw_obj_begin(&w, "delta");
        if (c->flavor == SIM_FLAVOR_TGI)
            dp_jw_str(&w, "role", "assistant");
        /* llama.cpp ends a stream with an empty delta object. */
        if (!(c->flavor == SIM_FLAVOR_LLAMACPP && len == 0 && finish != SIM_FINISH_NONE))
            dp_jw_strn(&w, "content", text, len);
        dp_jw_obj_end(&w);
    }
    if (c->flavor != SIM_FLAVOR_LLAMACPP)
        dp_jw_null(&w, "logprobs");
    finish_reason(&w, finish);
    choice_tail(&w, c, finish);
    dp_jw_obj_end(&w);
    chunk_end(&w, out);
}

void sim_fmt_chunk_usage(dp_buf_t *out, const sim_fmt_ctx_t *c, const sim_usage_t *u)
{
    dp_jw_t w;
    chunk_begin(&w, out, c);
    dp_jw_arr_end(&w);
    usage(&w, c, u);
    dp_jw_obj_end(&w);
    dp_buf_append(out, "\n\n", 2);
}

void sim_fmt_done(dp_buf_t *out)
{
    dp_buf_appends(out, "data: [DONE]\n\n");
}
