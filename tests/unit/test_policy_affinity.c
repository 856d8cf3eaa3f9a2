/* Affinity key bytes (docs/configuration.md "Affinity routing"): what the prefix key covers for
 * completions and chat, and the body's `user` for session keys. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/policy.h"

static policy_req_t *req;
static dp_buf_t out, scratch;

static void setup(void)
{
    req = policy_req_new();
}

static void teardown(void)
{
    policy_req_free(req);
    req = NULL;
    dp_buf_free(&out);
    dp_buf_free(&scratch);
}

TestSuite(affinity_key, .init = setup, .fini = teardown);

/* The prefix bytes of body (parsed fresh) as a NUL-terminated copy; caller frees. */
static char *prefix(policy_route_t route, const char *body, size_t max)
{
    policy_error_t err;
    policy_req_reset(req);
    cr_assert_eq(policy_parse(req, route, body, strlen(body), &err), 0, "%s", err.message);
    policy_affinity_prefix(req, max, &out, &scratch);
    return strndup(out.base ? out.base : "", out.len);
}

static char *chat(const char *messages)
{
    char body[4096];
    snprintf(body, sizeof(body), "{\"model\":\"m\",\"messages\":%s}", messages);
    return prefix(POLICY_ROUTE_CHAT, body, 4096);
}

#define SYS "{\"role\":\"system\",\"content\":\"You are terse.\"}"
#define U1 "{\"role\":\"user\",\"content\":\"What is 2+2?\"}"
#define A1 "{\"role\":\"assistant\",\"content\":\"4\"}"
#define U2 "{\"role\":\"user\",\"content\":\"And 3+3?\"}"
#define A2 "{\"role\":\"assistant\",\"content\":\"6\"}"
#define U3 "{\"role\":\"user\",\"content\":\"Thanks\"}"

Test(affinity_key, chat_turns_of_one_conversation_share_a_key)
{
    char *t1 = chat("[" SYS "," U1 "]");
    char *t2 = chat("[" SYS "," U1 "," A1 "," U2 "]");
    char *t3 = chat("[" SYS "," U1 "," A1 "," U2 "," A2 "," U3 "]");
    cr_assert_str_eq(t1, "system\nYou are terse.\nuser\nWhat is 2+2?\n");
    cr_assert_str_eq(t2, t1);
    cr_assert_str_eq(t3, t1);
    free(t1);
    free(t2);
    free(t3);
}

Test(affinity_key, different_system_prompts_or_first_questions_do_not)
{
    char *a = chat("[" SYS "," U1 "]");
    char *b = chat("[{\"role\":\"system\",\"content\":\"You are verbose.\"}," U1 "]");
    char *c = chat("[" SYS "," U2 "]");
    char *d = chat("[" U1 "]");
    cr_assert_str_neq(a, b);
    cr_assert_str_neq(a, c);
    cr_assert_str_neq(a, d);
    free(a);
    free(b);
    free(c);
    free(d);
}

Test(affinity_key, roles_matter)
{
    char *a =
        chat("[{\"role\":\"system\",\"content\":\"x\"},{\"role\":\"user\",\"content\":\"y\"}]");
    char *b =
        chat("[{\"role\":\"developer\",\"content\":\"x\"},{\"role\":\"user\",\"content\":\"y\"}]");
    char *c = chat("[{\"role\":\"user\",\"content\":\"x\"}]");
    cr_assert_str_neq(a, b);
    cr_assert_str_eq(c, "user\nx\n");
    cr_assert_str_neq(a, c);
    free(a);
    free(b);
    free(c);
}

Test(affinity_key, content_parts_escapes_and_null)
{
    /* A content array's text parts read like the same string; escapes are decoded. */
    char *a = chat("[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi \"},"
                   "{\"type\":\"text\",\"text\":\"there\"}]}]");
    char *b = chat("[{\"role\":\"user\",\"content\":\"hi \\u0074here\"}]");
    cr_assert_str_eq(a, "user\nhi there\n");
    cr_assert_str_eq(b, a);
    char *c = chat("[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\","
                   "\"image_url\":{\"url\":\"u\"}}]}]");
    cr_assert_str_eq(c, "user\n{\"type\":\"image_url\",\"image_url\":{\"url\":\"u\"}}\n");
    /* No user message at all: the whole list (an assistant prefill, say). */
    char *d =
        chat("[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"assistant\",\"content\":null}]");
    cr_assert_str_eq(d, "system\ns\nassistant\n\n");
    free(a);
    free(b);
    free(c);
    free(d);
}

Test(affinity_key, prefix_bytes_cut)
{
    const char *body = "{\"model\":\"m\",\"prompt\":\"abcdefghij\"}";
    char *a = prefix(POLICY_ROUTE_COMPLETIONS, body, 4);
    cr_assert_str_eq(a, "abcd");
    char *b = prefix(POLICY_ROUTE_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"abcdXYZ\"}", 4);
    cr_assert_str_eq(b, a); /* same first 4 bytes: same key */
    char *c = prefix(POLICY_ROUTE_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"abcXYZ\"}", 4);
    cr_assert_str_neq(c, a);
    char *d = prefix(POLICY_ROUTE_COMPLETIONS, body, 4096);
    cr_assert_str_eq(d, "abcdefghij");
    /* An escaped prompt is cut after decoding: "\u0061" is one byte of the prompt. */
    char *e = prefix(POLICY_ROUTE_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"\\u0061bcdefg\"}", 4);
    cr_assert_str_eq(e, "abcd");
    /* The chat opening is cut too: a long system prompt alone decides the key. */
    char *f =
        prefix(POLICY_ROUTE_CHAT,
               "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"0123456789\"},"
               "{\"role\":\"user\",\"content\":\"q\"}]}",
               12);
    cr_assert_str_eq(f, "system\n01234");
    free(a);
    free(b);
    free(c);
    free(d);
    free(e);
    free(f);
}

Test(affinity_key, other_prompt_shapes_are_compact_json)
{
    char *a = prefix(POLICY_ROUTE_COMPLETIONS, "{\"model\":\"m\",\"prompt\":[1, 2, 3]}", 4096);
    cr_assert_str_eq(a, "[1,2,3]");
    char *b = prefix(POLICY_ROUTE_COMPLETIONS, "{\"model\":\"m\",\"prompt\":[\"x\", \"y\"]}", 4096);
    cr_assert_str_eq(b, "[\"x\",\"y\"]");
    free(a);
    free(b);
}

Test(affinity_key, user_field)
{
    policy_error_t err;
    const char *b1 = "{\"model\":\"m\",\"prompt\":\"p\",\"user\":\"al\\u0069ce\"}";
    cr_assert_eq(policy_parse(req, POLICY_ROUTE_COMPLETIONS, b1, strlen(b1), &err), 0);
    cr_assert(policy_affinity_user(req, &out));
    cr_assert_eq(out.len, 5);
    cr_assert_eq(memcmp(out.base, "alice", 5), 0);
    const char *absent[] = {"{\"model\":\"m\",\"prompt\":\"p\"}",
                            "{\"model\":\"m\",\"prompt\":\"p\",\"user\":\"\"}",
                            "{\"model\":\"m\",\"prompt\":\"p\",\"user\":7}"};
    for (size_t i = 0; i < 3; i++) {
        policy_req_reset(req);
        cr_assert_eq(
            policy_parse(req, POLICY_ROUTE_COMPLETIONS, absent[i], strlen(absent[i]), &err), 0);
        cr_assert_not(policy_affinity_user(req, &out), "%s", absent[i]);
    }
}

Test(affinity_key, unparsed_request_has_no_bytes)
{
    dp_buf_append(&out, "junk", 4);
    policy_affinity_prefix(req, 4096, &out, &scratch);
    cr_assert_eq(out.len, 0);
    cr_assert_not(policy_affinity_user(req, &out));
}

/* /v1/responses keys on its input (and instructions) like chat on its messages: without this
 * every Responses request had the empty key and met one replica whatever its prompt. */
static char *responses(const char *fields)
{
    char body[4096];
    snprintf(body, sizeof(body), "{\"model\":\"m\",%s}", fields);
    return prefix(POLICY_ROUTE_RESPONSES, body, 4096);
}

Test(affinity_key, responses_key_on_their_input)
{
    char *a = responses("\"input\":\"What is 2+2?\"");
    char *b = responses("\"input\":\"What is 3+3?\"");
    cr_assert_str_eq(a, "What is 2+2?");
    cr_assert_str_neq(a, b);
    char *c = responses("\"instructions\":\"You are terse.\",\"input\":[" U1 "]");
    cr_assert_str_eq(c, "system\nYou are terse.\nuser\nWhat is 2+2?\n");
    char *d = responses("\"instructions\":\"You are terse.\",\"input\":[" U1 "," A1 "," U2 "]");
    cr_assert_str_eq(d, c); /* later turns share the opening */
    free(a);
    free(b);
    free(c);
    free(d);
}

/* Input items are the replica's to judge, so their shapes are not checked: a non-string role,
 * a numeric content or a bare string item is keyed on its JSON, never read as a string. */
Test(affinity_key, responses_items_of_any_shape)
{
    char *a = responses("\"input\":[{\"role\":7,\"content\":1},\"x\",[1]]");
    cr_assert_str_eq(a, "7\n1\n\"x\"\n[1]\n");
    char *b = responses("\"input\":[\"x\"]");
    char *c = responses("\"input\":[\"y\"]");
    cr_assert_str_neq(b, c);
    free(a);
    free(b);
    free(c);
}
