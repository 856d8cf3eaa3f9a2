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
        prefix = api == SIM_API_CHAT ? "chat-" : api == SIM_API_RESPONSES ? "resp_" : "cmpl-";
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
    if (api == SIM_API_COMPLETIONS || position > 0) /* chat and responses: no leading space */
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

/* ---- /v1/responses ---------------------------------------------------------------------------
 * OpenAI's Responses shapes as vLLM serves them: one message item with one output_text part;
 * "status" completed, or incomplete with incomplete_details.reason "max_output_tokens". */

static void resp_message_id(const sim_fmt_ctx_t *c, char out[56])
{
    snprintf(out, 56, "msg_%s", strncmp(c->id, "resp_", 5) == 0 ? c->id + 5 : c->id);
}

static void resp_message(dp_jw_t *w, const char *key, const sim_fmt_ctx_t *c, const char *text,
                         size_t len, const char *status)
{
    char mid[56];
    resp_message_id(c, mid);
    dp_jw_obj_begin(w, key);
    dp_jw_str(w, "id", mid);
    dp_jw_str(w, "type", "message");
    dp_jw_str(w, "status", status);
    dp_jw_str(w, "role", "assistant");
    dp_jw_arr_begin(w, "content");
    if (text) {
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "type", "output_text");
        dp_jw_strn(w, "text", text, len);
        dp_jw_arr_begin(w, "annotations");
        dp_jw_arr_end(w);
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
}

/* The response object; ch NULL while in progress (response.created). */
static void resp_object(dp_jw_t *w, const char *key, const sim_fmt_ctx_t *c, const sim_choice_t *ch,
                        const sim_usage_t *u)
{
    dp_jw_obj_begin(w, key);
    dp_jw_str(w, "id", c->id);
    dp_jw_str(w, "object", "response");
    dp_jw_uint(w, "created_at", c->created);
    const char *status = ch == NULL                        ? "in_progress"
                         : ch->finish == SIM_FINISH_LENGTH ? "incomplete"
                                                           : "completed";
    dp_jw_str(w, "status", status);
    dp_jw_str(w, "model", c->model);
    if (ch && ch->finish == SIM_FINISH_LENGTH) {
        dp_jw_obj_begin(w, "incomplete_details");
        dp_jw_str(w, "reason", "max_output_tokens");
        dp_jw_obj_end(w);
    } else {
        dp_jw_null(w, "incomplete_details");
    }
    dp_jw_null(w, "error");
    dp_jw_arr_begin(w, "output");
    if (ch)
        resp_message(w, NULL, c, ch->text, ch->len, "completed");
    dp_jw_arr_end(w);
    dp_jw_bool(w, "parallel_tool_calls", true);
    dp_jw_str(w, "tool_choice", "auto");
    dp_jw_arr_begin(w, "tools");
    dp_jw_arr_end(w);
    if (u) {
        dp_jw_obj_begin(w, "usage");
        dp_jw_uint(w, "input_tokens", u->prompt_tokens);
        dp_jw_uint(w, "output_tokens", u->completion_tokens);
        dp_jw_uint(w, "total_tokens", (uint64_t)u->prompt_tokens + u->completion_tokens);
        dp_jw_obj_end(w);
    } else {
        dp_jw_null(w, "usage");
    }
    dp_jw_obj_end(w);
}

/* One SSE event: "event: TYPE\ndata: {"type":TYPE,...}\n\n"; the caller fills the middle. */
static void event_begin(dp_jw_t *w, dp_buf_t *out, const char *type)
{
    dp_buf_printf(out, "event: %s\ndata: ", type);
    dp_jw_init(w, out);
    dp_jw_obj_begin(w, NULL);
    dp_jw_str(w, "type", type);
}

static void event_end(dp_jw_t *w, dp_buf_t *out)
{
    dp_jw_obj_end(w);
    dp_buf_append(out, "\n\n", 2);
}

static void event_item(dp_jw_t *w, const sim_fmt_ctx_t *c, bool part)
{
    char mid[56];
    resp_message_id(c, mid);
    dp_jw_str(w, "item_id", mid);
    dp_jw_uint(w, "output_index", 0);
    if (part)
        dp_jw_uint(w, "content_index", 0);
}

static void resp_stream_begin(dp_buf_t *out, const sim_fmt_ctx_t *c)
{
    dp_jw_t w;
    event_begin(&w, out, "response.created");
    resp_object(&w, "response", c, NULL, NULL);
    event_end(&w, out);
    event_begin(&w, out, "response.output_item.added");
    dp_jw_uint(&w, "output_index", 0);
    resp_message(&w, "item", c, NULL, 0, "in_progress");
    event_end(&w, out);
    event_begin(&w, out, "response.content_part.added");
    event_item(&w, c, true);
    dp_jw_obj_begin(&w, "part");
    dp_jw_str(&w, "type", "output_text");
    dp_jw_str(&w, "text", "");
    dp_jw_arr_begin(&w, "annotations");
    dp_jw_arr_end(&w);
    dp_jw_obj_end(&w);
    event_end(&w, out);
}

void sim_fmt_responses_end(dp_buf_t *out, const sim_fmt_ctx_t *c, const sim_choice_t *ch,
                           const sim_usage_t *u)
{
    dp_jw_t w;
    event_begin(&w, out, "response.output_text.done");
    event_item(&w, c, true);
    dp_jw_strn(&w, "text", ch->text, ch->len);
    event_end(&w, out);
    event_begin(&w, out, "response.output_item.done");
    dp_jw_uint(&w, "output_index", 0);
    resp_message(&w, "item", c, ch->text, ch->len, "completed");
    event_end(&w, out);
    const char *done =
        ch->finish == SIM_FINISH_LENGTH ? "response.incomplete" : "response.completed";
    event_begin(&w, out, done);
    resp_object(&w, "response", c, ch, u);
    event_end(&w, out);
}

void sim_fmt_response(dp_buf_t *out, const sim_fmt_ctx_t *c, const sim_choice_t *choices, size_t n,
                      const sim_usage_t *u)
{
    dp_jw_t w;
    if (c->api == SIM_API_RESPONSES) {
        dp_jw_init(&w, out);
        resp_object(&w, NULL, c, &choices[0], u);
        return;
    }
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
    if (c->api == SIM_API_RESPONSES) {
        resp_stream_begin(out, c);
        return;
    }
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
    if (c->api == SIM_API_RESPONSES) {
        if (len == 0)
            return; /* the end is sim_fmt_responses_end's */
        event_begin(&w, out, "response.output_text.delta");
        event_item(&w, c, true);
        dp_jw_strn(&w, "delta", text, len);
        event_end(&w, out);
        return;
    }
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
