/* Drift output extraction: whole JSON responses and the incremental SSE extractor, fed at every
 * split point. */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "drift/drift.h"

/* Feed s in pieces cut at the given points (sorted, within len); returns the bytes consumed
 * through the [DONE] event, or the last negative code. */
static long feed_split(drift_sse_t *st, const char *s, size_t len, const size_t *cuts, int ncuts)
{
    size_t at = 0;
    long rc = -2;
    for (int i = 0; i <= ncuts; i++) {
        size_t end = i < ncuts ? cuts[i] : len;
        rc = drift_sse_feed(st, s + at, end - at);
        if (rc >= 0) /* the next read may still hold the LF of the [DONE] event's CRLF */
            return (long)at + rc + (end < len ? drift_sse_feed(st, s + end, len - end) : 0);
        if (rc == -1)
            return -1;
        at = end;
    }
    return rc;
}

static const char completion_stream[] =
    "data: {\"id\":\"c1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":"
    "\"Hello\",\"finish_reason\":null}]}\n\n"
    ": keep-alive comment\n\n"
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"text\":\" w\\u00f6rld\",\"finish_reason\":"
    "null}]}\n\n"
    "event: message\nid: 7\nretry: 10\n"
    "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"text\":\"!\",\"finish_reason\":\"stop\"}]}"
    "\n\n"
    "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"completion_tokens\":3}}\n\n"
    "data: [DONE]\n\n";

static void check_completion(const drift_output_t *o)
{
    cr_assert_str_eq(o->text.base, "Hello w\xc3\xb6rld!");
    cr_assert_str_eq(o->finish.base, "stop");
    cr_assert(o->done);
    cr_assert_not(o->truncated);
}

Test(drift_sse, completion_stream_at_every_split_point)
{
    size_t len = sizeof(completion_stream) - 1;
    for (size_t cut = 0; cut <= len; cut++) {
        drift_sse_t st = {0};
        long rc = feed_split(&st, completion_stream, len, &cut, 1);
        cr_assert_eq(rc, (long)len, "cut %zu: rc %ld", cut, rc);
        drift_output_t o = {0};
        cr_assert_eq(drift_sse_finish(&st, &o), 0);
        check_completion(&o);
        drift_output_free(&o);
        drift_sse_free(&st);
    }
}

Test(drift_sse, completion_stream_byte_by_byte_and_three_way_splits)
{
    size_t len = sizeof(completion_stream) - 1;
    drift_sse_t st = {0};
    long rc = -2;
    size_t i;
    for (i = 0; i < len && rc == -2; i++)
        rc = drift_sse_feed(&st, completion_stream + i, 1);
    cr_assert_eq(rc, 1);
    cr_assert_eq(i, len);
    drift_output_t o = {0};
    cr_assert_eq(drift_sse_finish(&st, &o), 0);
    check_completion(&o);
    drift_output_free(&o);

    for (size_t c1 = 0; c1 <= len; c1 += 7) {
        for (size_t c2 = c1; c2 <= len; c2 += 13) {
            size_t cuts[2] = {c1, c2};
            drift_sse_t s2 = {0};
            cr_assert_eq(feed_split(&s2, completion_stream, len, cuts, 2), (long)len);
            cr_assert_eq(drift_sse_finish(&s2, &o), 0);
            check_completion(&o);
            drift_output_free(&o);
        }
    }
}

Test(drift_sse, done_reports_bytes_consumed_and_ignores_the_rest)
{
    const char s[] = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n"
                     "data: {\"choices\":[{\"text\":\"IGNORED\"}]}\n\n";
    drift_sse_t st = {0};
    long rc = drift_sse_feed(&st, s, sizeof(s) - 1);
    cr_assert_eq(rc, (long)(strstr(s, "[DONE]\n\n") - s) + 8);
    cr_assert_eq(drift_sse_feed(&st, "data: x\n\n", 9), 0);
    drift_output_t o = {0};
    cr_assert_eq(drift_sse_finish(&st, &o), 0);
    cr_assert_str_eq(o.text.base, "a");
    cr_assert(o.done);
    drift_output_free(&o);

    /* A CR ends the [DONE] event and other bytes follow in the same read: a LF in a later read
     * is not part of the event. (finish left st empty, ready for reuse.) */
    const char t[] = "data: [DONE]\r\rxy";
    cr_assert_eq(drift_sse_feed(&st, t, sizeof(t) - 1), 14);
    cr_assert_eq(drift_sse_feed(&st, "\n", 1), 0);
    cr_assert_eq(drift_sse_finish(&st, &o), 0);
    cr_assert(o.done);
    drift_output_free(&o);
}

static const char chat_stream[] =
    "data: {\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":"
    "\"assistant\"},\"finish_reason\":null}]}\r\n\r\n"
    "data: {\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":"
    "\"Paris\"},\"finish_reason\":null}]}\r\n\r\n"
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":null},\"finish_reason\":null}]}\r\n"
    "\r\n"
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" is\\ncapital\"},"
    "\"finish_reason\":null}]}\r\r"
    "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n"
    "data: [DONE]\r\n\r\n";

Test(drift_sse, chat_chunks_with_crlf_and_cr_at_every_split_point)
{
    size_t len = sizeof(chat_stream) - 1;
    for (size_t cut = 0; cut <= len; cut++) {
        drift_sse_t st = {0};
        long rc = feed_split(&st, chat_stream, len, &cut, 1);
        cr_assert_eq(rc, (long)len, "cut %zu: rc %ld", cut, rc);
        drift_output_t o = {0};
        cr_assert_eq(drift_sse_finish(&st, &o), 0);
        cr_assert_str_eq(o.text.base, "Paris is\ncapital");
        cr_assert_str_eq(o.finish.base, "length");
        cr_assert(o.done);
        drift_output_free(&o);
    }
}

/* n=2, deltas interleaved and index 1 first: the output is choice 0's text then choice 1's. */
static const char multi_stream[] =
    "data: {\"choices\":[{\"index\":1,\"text\":\"B1\"}]}\n\n"
    "data: {\"choices\":[{\"index\":0,\"text\":\"A1\"}]}\n\n"
    "data: {\"choices\":[{\"index\":1,\"text\":\"B2\",\"finish_reason\":\"length\"},"
    "{\"index\":0,\"text\":\"A2\",\"finish_reason\":\"stop\"}]}\n\n"
    "data: [DONE]\n\n";

Test(drift_sse, multi_choice_concatenates_in_index_order)
{
    size_t len = sizeof(multi_stream) - 1;
    for (size_t cut = 0; cut <= len; cut++) {
        drift_sse_t st = {0};
        cr_assert_eq(feed_split(&st, multi_stream, len, &cut, 1), (long)len);
        drift_output_t o = {0};
        cr_assert_eq(drift_sse_finish(&st, &o), 0);
        cr_assert_str_eq(o.text.base, "A1A2B1B2");
        cr_assert_str_eq(o.finish.base, "stop,length");
        drift_output_free(&o);
    }
}

Test(drift_sse, same_bytes_as_the_unstreamed_response)
{
    const char body[] =
        "{\"choices\":[{\"index\":1,\"text\":\"B1B2\",\"finish_reason\":\"length\"},"
        "{\"index\":0,\"text\":\"A1A2\",\"finish_reason\":\"stop\"}]}";
    drift_output_t whole = {0}, streamed = {0};
    cr_assert_eq(drift_extract_json(body, sizeof(body) - 1, 0, &whole), 0);
    drift_sse_t st = {0};
    drift_sse_feed(&st, multi_stream, sizeof(multi_stream) - 1);
    cr_assert_eq(drift_sse_finish(&st, &streamed), 0);
    drift_result_t r;
    drift_compare(&whole, &streamed, &r);
    cr_assert(r.match);
    cr_assert_not(r.finish_differs);
    drift_output_free(&whole);
    drift_output_free(&streamed);
}

Test(drift_sse, multi_line_data_is_joined_with_newlines)
{
    const char s[] = "data: {\"choices\":\ndata: [{\"text\":\"x\"}]}\n\n";
    drift_sse_t st = {0};
    cr_assert_eq(drift_sse_feed(&st, s, sizeof(s) - 1), -2);
    drift_output_t o = {0};
    cr_assert_eq(drift_sse_finish(&st, &o), 0);
    cr_assert_str_eq(o.text.base, "x");
    cr_assert_not(o.done);
    drift_output_free(&o);
}

Test(drift_sse, cap_truncates_captured_text)
{
    size_t len = sizeof(completion_stream) - 1;
    for (size_t cut = 0; cut <= len; cut += 5) {
        drift_sse_t st = {.max_output_bytes = 8};
        cr_assert_eq(feed_split(&st, completion_stream, len, &cut, 1), (long)len);
        drift_output_t o = {0};
        cr_assert_eq(drift_sse_finish(&st, &o), 0);
        cr_assert_eq(o.text.len, 8);
        cr_assert_str_eq(o.text.base, "Hello w\xc3");
        cr_assert(o.truncated);
        cr_assert_str_eq(o.finish.base, "stop"); /* still read after the cap */
        drift_output_free(&o);
    }
}

Test(drift_sse, oversized_event_is_skipped_and_later_events_still_count)
{
    size_t big = 16 + DRIFT_SSE_EVENT_SLACK + 10;
    dp_buf_t s = {0};
    dp_buf_appends(&s, "data: {\"choices\":[{\"text\":\"ab\"}]}\n\n");
    dp_buf_appends(&s, "data: {\"choices\":[{\"text\":\"");
    for (size_t i = 0; i < big; i++)
        dp_buf_appendc(&s, 'z');
    dp_buf_appends(&s, "\"}]}\n\n");
    dp_buf_appends(&s, "data: {\"choices\":[{\"text\":\"cd\",\"finish_reason\":\"stop\"}]}\n\n");
    dp_buf_appends(&s, "data: [DONE]\n\n");
    for (size_t step = 1000; step <= s.len; step += 20011) {
        drift_sse_t st = {.max_output_bytes = 16};
        long rc = -2;
        for (size_t at = 0; at < s.len && rc == -2; at += step)
            rc = drift_sse_feed(&st, s.base + at, at + step > s.len ? s.len - at : step);
        cr_assert_geq(rc, 0);
        drift_output_t o = {0};
        cr_assert_eq(drift_sse_finish(&st, &o), 0);
        cr_assert_str_eq(o.text.base, "abcd");
        cr_assert(o.truncated);
        cr_assert(o.done);
        cr_assert_str_eq(o.finish.base, "stop");
        drift_output_free(&o);
    }
    dp_buf_free(&s);
}

Test(drift_sse, error_event_and_bad_json_fail_stickily)
{
    const char *bad[] = {
        "data: {\"error\":{\"message\":\"boom\"}}\n\n",
        "data: {not json\n\n",
        "data: [1,2]\n\n",
        "data: {\"choices\":{\"text\":\"x\"}}\n\n",
        "data: {\"choices\":[{\"index\":128,\"text\":\"x\"}]}\n\n",
        "data: {\"choices\":[{\"index\":-1,\"text\":\"x\"}]}\n\n",
        "data: {\"choices\":[{\"index\":0.5,\"text\":\"x\"}]}\n\n",
        "data: {\"choices\":[7]}\n\n",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        drift_sse_t st = {0};
        const char *ok = "data: {\"choices\":[{\"text\":\"ok\"}]}\n\n";
        cr_assert_eq(drift_sse_feed(&st, ok, strlen(ok)), -2);
        cr_assert_eq(drift_sse_feed(&st, bad[i], strlen(bad[i])), -1, "%s", bad[i]);
        cr_assert_eq(drift_sse_feed(&st, "data: [DONE]\n\n", 14), -1);
        drift_output_t o = {0};
        cr_assert_eq(drift_sse_finish(&st, &o), -1);
        cr_assert_null(o.text.base);
        drift_sse_free(&st);
    }
}

Test(drift_sse, stream_without_done_and_without_final_blank_line)
{
    const char s[] = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
                     "data: {\"choices\":[{\"text\":\"b\",\"finish_reason\":\"stop\"}]}";
    drift_sse_t st = {0};
    cr_assert_eq(drift_sse_feed(&st, s, sizeof(s) - 1), -2);
    drift_output_t o = {0};
    cr_assert_eq(drift_sse_finish(&st, &o), 0);
    cr_assert_str_eq(o.text.base, "ab");
    cr_assert_str_eq(o.finish.base, "stop");
    cr_assert_not(o.done);
    drift_output_free(&o);

    /* [DONE] with no blank line before the connection closed still counts. */
    drift_sse_t s2 = {0};
    cr_assert_eq(drift_sse_feed(&s2, "data: [DONE]", 12), -2);
    cr_assert_eq(drift_sse_finish(&s2, &o), 0);
    cr_assert(o.done);
    cr_assert_str_eq(o.text.base, "");
    drift_output_free(&o);
}

Test(drift_sse, free_mid_stream_and_twice)
{
    drift_sse_t st = {0};
    drift_sse_feed(&st, "data: {\"choices\":[{\"text\":\"abc\"}]}\n\ndata: {\"cho", 48);
    drift_sse_free(&st);
    drift_sse_free(&st);
    cr_assert_null(st.acc.v);
    cr_assert_null(st.line.base);
}

Test(drift_extract, completion_and_chat_bodies)
{
    const char comp[] = "{\"id\":\"x\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,"
                        "\"text\":\" two, three\",\"finish_reason\":\"length\"}]}";
    drift_output_t o = {0};
    cr_assert_eq(drift_extract_json(comp, sizeof(comp) - 1, 0, &o), 0);
    cr_assert_str_eq(o.text.base, " two, three");
    cr_assert_str_eq(o.finish.base, "length");
    cr_assert_not(o.truncated);

    const char chat[] = "{\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\","
                        "\"content\":\"Bonjour\"},\"finish_reason\":\"stop\"}]}";
    cr_assert_eq(drift_extract_json(chat, sizeof(chat) - 1, 0, &o), 0);
    cr_assert_str_eq(o.text.base, "Bonjour");
    cr_assert_str_eq(o.finish.base, "stop");

    const char nullc[] = "{\"choices\":[{\"message\":{\"content\":null,\"tool_calls\":[]},"
                         "\"finish_reason\":\"tool_calls\"}]}";
    cr_assert_eq(drift_extract_json(nullc, sizeof(nullc) - 1, 0, &o), 0);
    cr_assert_str_eq(o.text.base, "");
    cr_assert_str_eq(o.finish.base, "tool_calls");
    drift_output_free(&o);
}

Test(drift_extract, multi_choice_by_index_and_cap)
{
    const char body[] = "{\"choices\":[{\"index\":2,\"text\":\"C\"},{\"index\":0,\"text\":\"AAAA\","
                        "\"finish_reason\":\"stop\"},{\"index\":1,\"text\":\"BB\"}]}";
    drift_output_t o = {0};
    cr_assert_eq(drift_extract_json(body, sizeof(body) - 1, 0, &o), 0);
    cr_assert_str_eq(o.text.base, "AAAABBC");
    cr_assert_str_eq(o.finish.base, "stop,,");
    cr_assert_eq(drift_extract_json(body, sizeof(body) - 1, 5, &o), 0);
    cr_assert_str_eq(o.text.base, "AAAAB");
    cr_assert(o.truncated);
    drift_output_free(&o);
}

Test(drift_extract, errors)
{
    const char *bad[] = {"",
                         "not json",
                         "[]",
                         "{}",
                         "{\"choices\":3}",
                         "{\"error\":{\"message\":\"x\"},\"choices\":[]}",
                         "{\"choices\":[{\"index\":1000}]}"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        drift_output_t o = {0};
        cr_assert_eq(drift_extract_json(bad[i], strlen(bad[i]), 0, &o), -EINVAL, "%s", bad[i]);
        cr_assert_null(o.text.base);
    }
    /* The length bounds parsing: a valid prefix is not read past len. */
    const char body[] = "{\"choices\":[]}garbage";
    drift_output_t o = {0};
    cr_assert_eq(drift_extract_json(body, 14, 0, &o), 0);
    cr_assert_str_eq(o.text.base, "");
    drift_output_free(&o);
}

/* /v1/responses (docs/drift.md §1): the stream's output_text deltas and the whole response's
 * output_text parts give the same bytes and the same finish (the status). */
static const char responses_stream[] =
    "event: response.created\n"
    "data: {\"type\":\"response.created\",\"response\":{\"object\":\"response\","
    "\"status\":\"in_progress\",\"output\":[]}}\n\n"
    "event: response.output_text.delta\n"
    "data: {\"type\":\"response.output_text.delta\",\"output_index\":0,\"delta\":\"Hel\"}\n\n"
    "event: response.output_text.delta\n"
    "data: {\"type\":\"response.output_text.delta\",\"output_index\":0,\"delta\":\"lo there\"}\n\n"
    "event: response.output_text.done\n"
    "data: {\"type\":\"response.output_text.done\",\"text\":\"Hello there\"}\n\n"
    "event: response.completed\n"
    "data: {\"type\":\"response.completed\",\"response\":{\"object\":\"response\","
    "\"status\":\"completed\",\"output\":[{\"type\":\"message\",\"content\":[{\"type\":"
    "\"output_text\",\"text\":\"Hello there\"}]}]}}\n\n";

Test(drift_sse, responses_stream_matches_the_whole_response)
{
    const char body[] = "{\"object\":\"response\",\"status\":\"completed\",\"error\":null,"
                        "\"output\":[{\"type\":\"reasoning\",\"content\":[{\"type\":"
                        "\"output_text\",\"text\":\"not compared\"}]},{\"type\":\"message\","
                        "\"content\":[{\"type\":\"output_text\",\"text\":\"Hello\"},{\"type\":"
                        "\"output_text\",\"text\":\" there\"}]}]}";
    drift_output_t whole = {0}, streamed = {0};
    cr_assert_eq(drift_extract_json(body, sizeof(body) - 1, 0, &whole), 0);
    cr_assert_str_eq(whole.text.base, "Hello there");
    cr_assert_str_eq(whole.finish.base, "completed");
    for (size_t cut = 0; cut < sizeof(responses_stream) - 1; cut += 7) {
        drift_sse_t st = {0};
        drift_sse_feed(&st, responses_stream, cut);
        drift_sse_feed(&st, responses_stream + cut, sizeof(responses_stream) - 1 - cut);
        cr_assert_eq(drift_sse_finish(&st, &streamed), 0);
        cr_assert_str_eq(streamed.text.base, "Hello there", "cut at %zu", cut);
        cr_assert_str_eq(streamed.finish.base, "completed");
        drift_output_free(&streamed);
    }
    drift_output_free(&whole);
}

Test(drift_sse, responses_failure_is_an_error)
{
    const char failed[] = "data: {\"type\":\"response.failed\",\"response\":{\"status\":"
                          "\"failed\"}}\n\n";
    drift_sse_t st = {0};
    drift_sse_feed(&st, failed, sizeof(failed) - 1);
    drift_output_t o = {0};
    cr_assert_neq(drift_sse_finish(&st, &o), 0);
    drift_output_free(&o);
    const char body[] = "{\"object\":\"response\",\"status\":\"failed\",\"error\":{\"code\":"
                        "\"server_error\"},\"output\":[]}";
    cr_assert_neq(drift_extract_json(body, sizeof(body) - 1, 0, &o), 0);
    drift_output_free(&o);
}
