/* The request bytes affinity routing keys on (docs/configuration.md, "Affinity routing"): the
 * prompt's start for `prefix`, the body's `user` for `session`. Reads the tape policy_parse
 * left; never reparses. */
#include <string.h>

#include "policy/policy_int.h"

/* Appends at most `room` more bytes to out: the key is a digest of a bounded prefix, so nothing
 * beyond the cut is ever copied. */
typedef struct {
    dp_buf_t *out;
    size_t room;
    dp_buf_t *scratch;
} cut_t;

static void cut_append(cut_t *c, const char *p, size_t n)
{
    if (n > c->room)
        n = c->room;
    dp_buf_append(c->out, p, n);
    c->room -= n;
}

/* A string token's text, unescaped. Only escaped strings go through scratch. */
static void cut_string(cut_t *c, const jdoc_t *d, uint32_t tok)
{
    const jtok_t *t = &d->toks[tok];
    if (!(t->flags & JF_ESC)) {
        cut_append(c, d->src + t->start + 1, t->len - 2);
        return;
    }
    dp_buf_reset(c->scratch);
    jdoc_str_decode(d, tok, c->scratch);
    cut_append(c, c->scratch->base ? c->scratch->base : "", c->scratch->len);
}

static void cut_compact(cut_t *c, const jdoc_t *d, uint32_t tok)
{
    dp_buf_reset(c->scratch);
    jdoc_write_compact(d, tok, c->scratch);
    cut_append(c, c->scratch->base ? c->scratch->base : "", c->scratch->len);
}

/* A string's text, anything else its compact JSON (Responses input items are not checked). */
static void cut_value(cut_t *c, const jdoc_t *d, uint32_t v)
{
    if (d->toks[v].type == JT_STR)
        cut_string(c, d, v);
    else
        cut_compact(c, d, v);
}

/* A message's content: a string, an array of parts, or null (assistant tool calls). */
static void cut_content(cut_t *c, const jdoc_t *d, uint32_t v)
{
    if (v == JDOC_NONE || d->toks[v].type == JT_NULL)
        return;
    const jtok_t *t = &d->toks[v];
    if (t->type != JT_ARR) {
        cut_value(c, d, v);
    } else {
        for (uint32_t part = v + 1; part < t->end && c->room; part = d->toks[part].end) {
            uint32_t ty = jdoc_get(d, part, "type");
            uint32_t tx = jdoc_get(d, part, "text");
            if (ty != JDOC_NONE && jdoc_str_eq(d, ty, "text") && tx != JDOC_NONE &&
                d->toks[tx].type == JT_STR)
                cut_string(c, d, tx);
            else
                cut_compact(c, d, part);
        }
    }
}

static void cut_messages(cut_t *c, const jdoc_t *d, uint32_t arr)
{
    const jtok_t *a = &d->toks[arr];
    for (uint32_t m = arr + 1; m < a->end && c->room; m = d->toks[m].end) {
        if (d->toks[m].type != JT_OBJ) { /* a bare Responses input item */
            cut_compact(c, d, m);
            cut_append(c, "\n", 1);
            continue;
        }
        uint32_t role = jdoc_get(d, m, "role");
        if (role != JDOC_NONE)
            cut_value(c, d, role);
        cut_append(c, "\n", 1);
        cut_content(c, d, jdoc_get(d, m, "content"));
        cut_append(c, "\n", 1);
        if (role != JDOC_NONE && d->toks[role].type == JT_STR && jdoc_str_eq(d, role, "user"))
            break; /* the opening ends with the first question */
    }
}

void policy_affinity_prefix(const policy_req_t *r, size_t max, dp_buf_t *out, dp_buf_t *scratch)
{
    dp_buf_reset(out);
    policy_route_t route;
    const jdoc_t *d = policy_req_doc(r, &route);
    if (d == NULL)
        return;
    cut_t c = {out, max, scratch};
    if (route == POLICY_ROUTE_CHAT) {
        uint32_t v = jdoc_get(d, 0, "messages");
        if (v != JDOC_NONE && d->toks[v].type == JT_ARR)
            cut_messages(&c, d, v);
        return;
    }
    if (route == POLICY_ROUTE_RESPONSES) {
        /* instructions are the system prompt; input a string or items shaped like messages */
        uint32_t ins = jdoc_get(d, 0, "instructions");
        if (ins != JDOC_NONE && d->toks[ins].type == JT_STR) {
            cut_append(&c, "system\n", 7);
            cut_string(&c, d, ins);
            cut_append(&c, "\n", 1);
        }
        uint32_t v = jdoc_get(d, 0, "input");
        if (v != JDOC_NONE && d->toks[v].type == JT_ARR)
            cut_messages(&c, d, v);
        else if (v != JDOC_NONE)
            cut_value(&c, d, v);
        return;
    }
    uint32_t v = jdoc_get(d, 0, "prompt");
    if (v != JDOC_NONE)
        cut_value(&c, d, v);
}

bool policy_affinity_user(const policy_req_t *r, dp_buf_t *out)
{
    dp_buf_reset(out);
    policy_route_t route;
    const jdoc_t *d = policy_req_doc(r, &route);
    uint32_t v = d ? jdoc_get(d, 0, "user") : JDOC_NONE;
    if (v == JDOC_NONE || d->toks[v].type != JT_STR)
        return false;
    jdoc_str_decode(d, v, out);
    return out->len > 0;
}
