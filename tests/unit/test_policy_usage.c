/* policy/usage.c: token usage from response bodies, JSON and SSE, fed in any split. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <string.h>

#include "policy/policy.h"

/* Feed s in pieces of `step` bytes (1 = byte by byte), as an event stream if sse. */
static policy_usage_t feed_as(const char *s, size_t step, bool sse)
{
    policy_usage_t u;
    memset(&u, 0, sizeof(u));
    u.sse = sse;
    size_t n = strlen(s);
    for (size_t i = 0; i < n; i += step)
        policy_usage_feed(&u, s + i, i + step <= n ? step : n - i);
    policy_usage_free(&u); /* a body that ended inside a usage object */
    return u;
}

static policy_usage_t feed(const char *s, size_t step)
{
    return feed_as(s, step, false);
}

static void expect_as(const char *s, bool sse, int64_t p, int64_t c)
{
    for (size_t step = 1; step <= strlen(s); step++) {
        policy_usage_t u = feed_as(s, step, sse);
        cr_assert(u.found, "no usage found with step %zu in %s", step, s);
        cr_assert_eq(u.prompt_tokens, p, "step %zu", step);
        cr_assert_eq(u.completion_tokens, c, "step %zu", step);
    }
}

static void expect(const char *s, int64_t p, int64_t c)
{
    expect_as(s, false, p, c);
}

static void expect_none_as(const char *s, bool sse)
{
    for (size_t step = 1; step <= strlen(s); step++)
        cr_assert_not(feed_as(s, step, sse).found, "found usage with step %zu in %s", step, s);
}

static void expect_none(const char *s)
{
    expect_none_as(s, false);
}

Test(usage, non_streamed_json_body)
{
    expect("{\"id\":\"x\",\"choices\":[{\"text\":\"hi\"}],\"usage\":{\"prompt_tokens\":12,"
           "\"total_tokens\":17,\"completion_tokens\":5}}",
           12, 5);
    /* pretty-printed, as some engines answer */
    expect("{\n  \"usage\" : {\n    \"prompt_tokens\": 3,\n    \"completion_tokens\": 4\n  }\n}\n",
           3, 4);
}

Test(usage, sse_usage_chunk_last_one_wins)
{
    expect("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n"
           "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1}}\n\n"
           "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":9}}\n\n"
           "data: [DONE]\n\n",
           7, 9);
}

Test(usage, keys_and_quotes_inside_strings_never_match)
{
    expect_none("{\"text\":\"\\\"usage\\\": {\\\"prompt_tokens\\\": 1}\"}");
    expect_none("{\"usage_notes\":{\"prompt_tokens\":1,\"completion_tokens\":2}}");
    expect_none("{\"xusage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}");
    /* keys as long as the key buffer and one longer, then the real key */
    expect_none("{\"usageabc\":{\"prompt_tokens\":1},\"usageabcd\":{\"prompt_tokens\":1}}");
    expect(
        "{\"abcdefgh\":1,\"abcdefghi\":2,\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":6}}",
        5, 6);
    /* a string value that looks like usage followed by an object elsewhere */
    expect_none("{\"a\":\"usage\",\"b\":{\"prompt_tokens\":1}}");
    /* after the text containing it, the real one still counts */
    expect("{\"text\":\"say \\\"usage\\\": {\",\"usage\":{\"prompt_tokens\":2,"
           "\"completion_tokens\":3}}",
           2, 3);
}

Test(usage, bad_or_absent_values_are_ignored)
{
    expect_none("{\"usage\":null}");
    expect_none("{\"usage\":{\"prompt_tokens\":-1,\"completion_tokens\":2}}");
    expect_none("{\"usage\":{\"prompt_tokens\":1.5,\"completion_tokens\":2}}");
    expect_none("{\"usage\":{\"prompt_tokens\":\"3\"}}");
    expect_none("{\"usage\":{\"prompt_tokens\":3");    /* truncated */
    expect("{\"usage\":{\"prompt_tokens\":3}}", 3, 0); /* no completion: 0 */
    /* integral values however written count; past 10^15 nothing does */
    expect("{\"usage\":{\"prompt_tokens\":3.0,\"completion_tokens\":2e0}}", 3, 2);
    expect("{\"usage\":{\"prompt_tokens\":1000000000000000,\"completion_tokens\":0}}",
           1000000000000000, 0);
    expect_none("{\"usage\":{\"prompt_tokens\":1000000000000001}}");
    expect_none("{\"usage\":{\"prompt_tokens\":99999999999999999999}}");
}

Test(usage, oversized_object_is_skipped_and_scanning_goes_on)
{
    char big[2048];
    int n = snprintf(big, sizeof(big), "{\"usage\":{\"pad\":\"");
    memset(big + n, 'x', 700);
    n += 700;
    n += snprintf(big + n, sizeof(big) - (size_t)n,
                  "\",\"prompt_tokens\":1}}\ndata: {\"usage\":{\"prompt_tokens\":4,"
                  "\"completion_tokens\":6}}\n");
    expect(big, 4, 6);
}

Test(usage, the_byte_that_finds_the_copy_full_is_still_scanned)
{
    /* The object's 513th byte (the copy holds 512) is the quote that ends a string. Skipped,
     * the scan would stay inside a string to the end, and miss the top-level usage after it
     * (no newline in a JSON body resets it). */
    char big[2048];
    int n = snprintf(big, sizeof(big), "{\"choices\":[{\"usage\":{\"a\":\"");
    int obj = n - 6; /* where the nested object's '{' is */
    memset(big + n, 'x', (size_t)(obj + 512 - n));
    n = obj + 512;
    snprintf(big + n, sizeof(big) - (size_t)n,
             "\"}}],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}");
    cr_assert_eq(big[obj], '{');
    cr_assert_eq(big[obj + 512], '"');
    expect(big, 7, 3);
}

Test(usage, a_truncated_event_does_not_leave_the_scanner_in_a_string)
{
    /* The first event is cut inside a string; the newline resets, the next event counts. */
    expect("data: {\"choices\":[{\"text\":\"unterminated\n\n"
           "data: {\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":2}}\n\n",
           8, 2);
}

Test(usage, an_event_cut_inside_its_usage_does_not_hide_the_next_ones)
{
    static const char *const cut[] = {
        "data: {\"usage\":{\"prompt_tokens\":5,\n\n",           /* between members */
        "data: {\"usage\":{\"note\":\"unterminated\n\n",        /* inside a string in it */
        "data: {\"usage\":{\"a\":{\"b\":1\r\n\r\n",             /* inside an object in it */
        "data: {\"usage\":{\"prompt_tokens\":5,\r\r",           /* CR-only line ends */
        "data: {\"usage\":{\"prompt_tokens\":5,\"x\":\"\\\n\n", /* after a backslash */
    };
    const char *next = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":8,"
                       "\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
    char body[2048];
    for (size_t i = 0; i < sizeof(cut) / sizeof(cut[0]); i++) {
        snprintf(body, sizeof(body), "%s%s", cut[i], next);
        expect_as(body, true, 8, 2);
    }
    /* Cut inside a string outside any usage object, and inside one that outgrew the copy (the
     * scan, not the copy, meets the line end), with each kind of line end. */
    static const char *const ends[] = {"\n\n", "\r\n\r\n", "\r\r"};
    for (size_t e = 0; e < 3; e++) {
        snprintf(body, sizeof(body), "data: {\"choices\":[{\"text\":\"abc%s%s", ends[e], next);
        expect_as(body, true, 8, 2);
        int k = snprintf(body, sizeof(body), "data: {\"usage\":{\"note\":\"");
        memset(body + k, 'x', 600);
        snprintf(body + k + 600, sizeof(body) - (size_t)k - 600, "\\%s%s", ends[e], next);
        expect_as(body, true, 8, 2);
    }
    /* A key whose line ended is not followed on the next line. */
    expect_none_as("data: {\"usage\"\n\n: {\"prompt_tokens\":9,\"completion_tokens\":9}\n\n", true);
    expect("{\"usage\"\n:\n{\"prompt_tokens\":9,\"completion_tokens\":9}}", 9, 9);
    /* What an event stream's complete usage events give is unchanged. */
    expect_as("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1}}"
              "\r\n\r\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,"
              "\"completion_tokens\":9}}\n\ndata: [DONE]\n\n",
              true, 7, 9);
    /* A JSON body's line ends are whitespace, even inside its usage object. */
    expect(
        "{\n  \"usage\" : {\n    \"prompt_tokens\": 3,\r\n    \"completion_tokens\": 4\n  }\n}\n",
        3, 4);
}

/* The body parsed whole for its fingerprint (policy_fp_rewrite_json) gives its usage where the
 * scan's answer is plain from the parse. */
static policy_usage_t take(const char *s)
{
    policy_usage_t u;
    memset(&u, 0, sizeof(u));
    dp_buf_t out = {0};
    char prev[POLICY_FP_PREV_MAX];
    policy_fp_rewrite_json(s, strlen(s), "fp_x", &out, prev, &u);
    dp_buf_free(&out);
    policy_usage_free(&u);
    return u;
}

static void expect_taken(const char *s, int64_t p, int64_t c)
{
    policy_usage_t u = take(s);
    cr_assert(u.taken && u.found, "no usage taken from %s", s);
    cr_assert_eq(u.prompt_tokens, p, "%s", s);
    cr_assert_eq(u.completion_tokens, c, "%s", s);
    /* and the scan of the same bytes that follows changes nothing */
    policy_usage_feed(&u, s, strlen(s));
    policy_usage_feed(&u, "{\"usage\":{\"prompt_tokens\":99}}", 30);
    cr_assert_eq(u.prompt_tokens, p, "%s", s);
    cr_assert_eq(u.completion_tokens, c, "%s", s);
    /* what the scan alone finds */
    expect(s, p, c);
}

Test(usage, a_parsed_body_gives_its_one_top_level_usage)
{
    expect_taken("{\"id\":\"x\",\"choices\":[{\"text\":\"hi\"}],\"usage\":{\"prompt_tokens\":12,"
                 "\"total_tokens\":17,\"completion_tokens\":5}}",
                 12, 5);
    expect_taken("{\"usage\":{\"prompt_tokens\":3}}", 3, 0);
    /* the first of duplicate keys inside it, as the scan's own parse of the object */
    expect_taken("{\"usage\":{\"prompt_tokens\":4,\"prompt_tokens\":5,\"completion_tokens\":6}}", 4,
                 6);
    /* a top-level usage object without counts is taken, and counts nothing, as scanned */
    policy_usage_t u = take("{\"usage\":{\"prompt_tokens\":-1},\"x\":1}");
    cr_assert(u.taken);
    cr_assert_not(u.found);
}

/* The Responses API names the two counts input_tokens and output_tokens, in a non-streamed
 * answer and in its stream's final event (inside the response object, with details objects). */
Test(usage, responses_api_counts)
{
    const char *body =
        "{\"id\":\"resp_1\",\"object\":\"response\",\"output\":[],\"usage\":{\"input_tokens\":3,"
        "\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":5,"
        "\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":8}}";
    expect(body, 3, 5);
    expect_taken(body, 3, 5);
    expect_as("event: response.created\ndata: {\"type\":\"response.created\",\"response\":{"
              "\"usage\":null}}\n\nevent: response.completed\ndata: {\"type\":"
              "\"response.completed\",\"response\":{\"status\":\"completed\",\"usage\":{"
              "\"input_tokens\":11,\"input_tokens_details\":{\"cached_tokens\":0},"
              "\"output_tokens\":2,\"total_tokens\":13}}}\n\n",
              true, 11, 2);
    /* the chat names win where an object has both */
    expect("{\"usage\":{\"input_tokens\":1,\"output_tokens\":2,\"prompt_tokens\":3,"
           "\"completion_tokens\":4}}",
           3, 4);
}

/* Shapes where the parse's top level and the scan could differ: the scan decides, so a held
 * body counts as one passed through unparsed (too large to hold) does. */
Test(usage, other_shapes_are_left_to_the_scan)
{
    char big[2048];
    int n = snprintf(big, sizeof(big), "{\"usage\":{\"pad\":\"");
    memset(big + n, 'x', 700);
    n += 700;
    snprintf(big + n, sizeof(big) - (size_t)n, "\",\"prompt_tokens\":9,\"completion_tokens\":1}}");
    const char *cases[] = {
        /* nested only, nested after the top level's, nested before an empty top-level one */
        "{\"choices\":[{\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":8}}]}",
        "{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2},\"choices\":[{\"usage\":"
        "{\"prompt_tokens\":7,\"completion_tokens\":8}}]}",
        "{\"choices\":[{\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}],\"usage\":{}}",
        /* two top-level ones */
        "{\"usage\":{\"prompt_tokens\":1},\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":6}}",
        /* an escaped spelling (the scan never matches one), a value that is not an object */
        "{\"us\\u0061ge\":{\"prompt_tokens\":2,\"completion_tokens\":3}}",
        "{\"usage\":null}",
        "{\"usage\":[1]}",
        /* larger than the scan's copy */
        big,
        /* not JSON */
        "not json",
        "{\"usage\":{\"prompt_tokens\":1}",
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        policy_usage_t u = take(cases[i]);
        cr_assert_not(u.taken, "%s", cases[i]);
        cr_assert_not(u.found, "%s", cases[i]);
        policy_usage_t scanned = feed(cases[i], strlen(cases[i]));
        policy_usage_feed(&u, cases[i], strlen(cases[i]));
        cr_assert_eq(u.found, scanned.found, "%s", cases[i]);
        cr_assert_eq(u.prompt_tokens, scanned.prompt_tokens, "%s", cases[i]);
        cr_assert_eq(u.completion_tokens, scanned.completion_tokens, "%s", cases[i]);
    }
}

/* A usage object that ends in the read it began in is read where it lies; one cut by a read's
 * end is copied until it is read or dropped: a stream holds no copy between its events. */
Test(usage, an_object_is_copied_only_while_a_read_ends_inside_it)
{
    const char *s = "data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\n";
    size_t n = strlen(s), cut = (size_t)(strstr(s, "\"completion") - s);
    policy_usage_t u;
    memset(&u, 0, sizeof(u));
    u.sse = true;
    policy_usage_feed(&u, s, n);
    cr_assert(u.found);
    cr_assert_null(u.cap);

    memset(&u, 0, sizeof(u));
    u.sse = true;
    policy_usage_feed(&u, s, cut);
    cr_assert_not_null(u.cap);
    cr_assert_not(u.found);
    policy_usage_feed(&u, s + cut, n - cut);
    cr_assert(u.found);
    cr_assert_null(u.cap);
    cr_assert_eq(u.prompt_tokens, 3);
    cr_assert_eq(u.completion_tokens, 4);

    /* an event cut inside the object: the copy goes with it, and the next event counts */
    const char *t = "data: {\"usage\":{\"prompt_tokens\":9\n\n"
                    "data: {\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":6}}\n\n";
    memset(&u, 0, sizeof(u));
    u.sse = true;
    size_t nl = (size_t)(strchr(t, '\n') - t);
    policy_usage_feed(&u, t, nl);
    cr_assert_not_null(u.cap);
    policy_usage_feed(&u, t + nl, 2);
    cr_assert_null(u.cap);
    policy_usage_feed(&u, t + nl + 2, strlen(t) - nl - 2);
    cr_assert_null(u.cap);
    cr_assert(u.found);
    cr_assert_eq(u.prompt_tokens, 5);
    cr_assert_eq(u.completion_tokens, 6);
}
