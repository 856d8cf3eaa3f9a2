/* The gate that holds an audited stream's closing event (policy/sse_end.c): every split of the
 * stream gives the same bytes now and the same bytes held, and nothing but a closing line (and
 * what follows it) is ever held. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "policy/policy.h"

/* Feed s in two pieces cut at `cut`, then finish: out and held. */
static void run(const char *s, size_t cut, dp_buf_t *out, dp_buf_t *held)
{
    policy_sse_end_t g;
    memset(&g, 0, sizeof(g));
    size_t n = strlen(s);
    policy_sse_end_feed(&g, s, cut, out, held);
    policy_sse_end_feed(&g, s + cut, n - cut, out, held);
    policy_sse_end_finish(&g, out, held);
    policy_sse_end_free(&g);
}

/* At every cut, and one byte at a time: s goes out as `sent` and the rest waits. */
static void expect(const char *s, const char *sent)
{
    size_t n = strlen(s);
    for (size_t cut = 0; cut <= n; cut++) {
        dp_buf_t out = {0}, held = {0};
        run(s, cut, &out, &held);
        cr_assert_eq(out.len, strlen(sent), "cut %zu of %s: sent %.*s", cut, s, (int)out.len,
                     out.base ? out.base : "");
        cr_assert(out.len == 0 || memcmp(out.base, sent, out.len) == 0, "cut %zu of %s", cut, s);
        cr_assert_eq(held.len, n - strlen(sent), "cut %zu of %s", cut, s);
        cr_assert(held.len == 0 || memcmp(held.base, s + strlen(sent), held.len) == 0);
        dp_buf_free(&out);
        dp_buf_free(&held);
    }
    policy_sse_end_t g;
    memset(&g, 0, sizeof(g));
    dp_buf_t out = {0}, held = {0};
    for (size_t i = 0; i < n; i++)
        policy_sse_end_feed(&g, s + i, 1, &out, &held);
    policy_sse_end_finish(&g, &out, &held);
    policy_sse_end_free(&g);
    cr_assert_eq(out.len, strlen(sent), "bytewise %s", s);
    cr_assert_eq(held.len, n - strlen(sent), "bytewise %s", s);
    dp_buf_free(&out);
    dp_buf_free(&held);
}

#define EV1 "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
#define EV2 "data: {\"choices\":[{\"text\":\"b\",\"finish_reason\":\"stop\"}]}\n\n"

Test(sse_end, chat_stream_holds_done_and_after)
{
    expect(EV1 EV2 "data: [DONE]\n\n", EV1 EV2);
    expect(EV1 "data:[DONE]\r\n\r\n", EV1);
    expect(EV1 "data: [DONE]", EV1); /* the last line without its end */
    expect(EV1 ": keep-alive\n\ndata: [DONE]\n\n", EV1 ": keep-alive\n\n");
}

Test(sse_end, responses_stream_holds_its_final_event)
{
    const char *created = "event: response.created\ndata: {\"type\":\"response.created\"}\n\n";
    const char *delta = "event: response.output_text.delta\ndata: {\"delta\":\"x\"}\n\n";
    char s[512];
    snprintf(s, sizeof(s), "%s%sevent: response.completed\ndata: {\"type\":\"x\"}\n\n", created,
             delta);
    char sent[512];
    snprintf(sent, sizeof(sent), "%s%s", created, delta);
    expect(s, sent);
    expect("event:response.incomplete\ndata: {}\n\n", "");
    expect("event: response.failed\r\ndata: {}\r\n\r\n", "");
}

Test(sse_end, what_a_client_takes_for_the_end_is_held)
{
    /* openai-python: data that starts with [DONE]; a Responses event by its data's "type"
     * (escapes decoded, any duplicate), whether or not an event: line names it */
    const char *s[] = {
        "data: [DONE] \n\n",
        "data: [DONE]]\n\n",
        "data:[DONE]x\n\n",
        "data: {\"sequence_number\":9,\"type\":\"response.completed\"}\n\n",
        "data: {\"type\": \"response.incomplete\", \"response\": {}}\r\n\r\n",
        "data: {\"\\u0074ype\":\"response.failed\"}\n\n",
        "data: {\"type\":\"x\",\"type\":\"response.completed\"}\n\n",
        "data: {\"type\":\ndata: \"response.completed\"}\n\n",
        "event: response.completed \ndata: {}\n\n",
        "event: response.completed\n\n",
        "\xEF\xBB\xBF"
        "data: [DONE]\n\n", /* a decoder drops the BOM */
        /* objects a client's parser reads and jdoc refuses: held, whatever their type */
        "data: {\"type\":\"response.completed\",\"x\":1e400}\n\n",
        "data: {\"type\":\"response.completed\",\"x\":\"\\ud800\"}\n\n",
        "data: {\"type\":\"response.completed\",\"x\":NaN}\n\n",
    };
    for (size_t i = 0; i < sizeof(s) / sizeof(s[0]); i++)
        expect(s[i], "");
    char big[POLICY_SSE_END_EVENT_MAX + 64];
    memset(big, 'x', sizeof(big) - 1);
    memcpy(big, "data: ", 6);
    big[sizeof(big) - 1] = '\0';
    dp_buf_t out = {0}, held = {0};
    policy_sse_end_t g;
    memset(&g, 0, sizeof(g));
    policy_sse_end_feed(&g, big, strlen(big), &out, &held);
    cr_assert_eq(out.len, 0, "an event that never ends is not passed on");
    cr_assert_eq(held.len, strlen(big));
    policy_sse_end_free(&g);
    dp_buf_free(&out);
    dp_buf_free(&held);
}

/* The "\n" of a blank line's "\r\n" goes on with its event, not with the next one: a client
 * that waits for "\r\n\r\n" sees each event when it comes. */
Test(sse_end, a_crlf_event_goes_on_whole_at_once)
{
    policy_sse_end_t g;
    memset(&g, 0, sizeof(g));
    dp_buf_t out = {0}, held = {0};
    const char *ev = "data: {\"choices\":[]}\r\n\r\n";
    policy_sse_end_feed(&g, ev, strlen(ev), &out, &held);
    cr_assert_eq(out.len, strlen(ev));
    cr_assert(memcmp(out.base, ev, out.len) == 0);
    cr_assert_eq(held.len, 0);
    policy_sse_end_free(&g);
    dp_buf_free(&out);
    dp_buf_free(&held);
}

Test(sse_end, events_that_only_look_alike_pass)
{
    const char *s[] = {
        "data:  [DONE]\n\n",
        "data: \"[DONE]\"\n\n",
        "data: [DON\n\n",
        "data: [DO\ndata: NE]\n\n",
        "event: response.created\ndata: {\"type\":\"response.created\"}\n\n",
        "data: {\"delta\":\"\\\"type\\\":\\\"response.completed\\\"\"}\n\n",
        "data: {\"response\":{\"type\":\"response.completed\"}}\n\n",
        "data\n\n",
        " data: [DONE]\n\n",
        ": keep-alive\n\n",
        "event: response.output_text.done\ndata: {}\n\n",
    };
    for (size_t i = 0; i < sizeof(s) / sizeof(s[0]); i++)
        expect(s[i], s[i]);
}
