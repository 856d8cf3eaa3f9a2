/* The gate that holds an audited stream's closing event until its audit line is written
 * (policy.h, "the end of an audited stream"). */
#include <string.h>

#include "common/util.h"
#include "policy/jdoc.h"
#include "policy/policy.h"

static const char *const end_types[] = {"response.completed", "response.incomplete",
                                        "response.failed"};

static bool starts_with(const char *p, size_t n, const char *s)
{
    size_t l = strlen(s);
    return n >= l && memcmp(p, s, l) == 0;
}

/* Does the joined data of an event name a closing type, as a client's JSON parser reads it? */
static bool data_closes(const char *p, size_t n)
{
    if (starts_with(p, n, "[DONE]"))
        return true;
    size_t i = 0;
    while (i < n && (p[i] == ' ' || p[i] == '\t' || p[i] == '\n' || p[i] == '\r'))
        i++;
    if (i == n || p[i] != '{')
        return false;
    jtok_t stack[64];
    jdoc_t d;
    jdoc_init_with(&d, stack, DP_ARRAY_SIZE(stack));
    bool closes = false;
    if (jdoc_parse(&d, p, n, JDOC_OBJECT_ONLY | JDOC_ALLOW_DUPS) == 0) {
        for (uint32_t k = 1; k < d.toks[0].end; k = d.toks[k + 1].end) {
            if (!jdoc_str_eq(&d, k, "type") || d.toks[k + 1].type != JT_STR)
                continue;
            for (size_t t = 0; t < DP_ARRAY_SIZE(end_types); t++)
                closes = closes || jdoc_str_eq(&d, k + 1, end_types[t]);
        }
    } else
        closes = true; /* an object a client's parser may read and this one refuses (a number
                          beyond a double, a lone surrogate, deeper nesting): held, to be safe */
    jdoc_free(&d);
    return closes;
}

/* Is the event ev[0..n) (its lines, as the SSE format splits them) a closing one? */
static bool event_closes(const char *ev, size_t n)
{
    dp_buf_t data = {0};
    bool any = false, closes = false;
    size_t i = 0;
    while (i < n && !closes) {
        size_t e = i;
        while (e < n && ev[e] != '\n' && ev[e] != '\r')
            e++;
        const char *line = ev + i;
        size_t len = e - i;
        if (len >= 3 && memcmp(line, "\xEF\xBB\xBF", 3) == 0) { /* a BOM, which a decoder drops */
            line += 3;
            len -= 3;
        }
        const char *colon = memchr(line, ':', len);
        size_t name = colon ? (size_t)(colon - line) : len;
        const char *v = colon ? colon + 1 : line + len;
        size_t vl = (size_t)(line + len - v);
        if (vl && *v == ' ') {
            v++;
            vl--;
        }
        if (name == 4 && memcmp(line, "data", 4) == 0) {
            if (any)
                dp_buf_appendc(&data, '\n');
            dp_buf_append(&data, v, vl);
            any = true;
        } else if (name == 5 && memcmp(line, "event", 5) == 0) {
            for (size_t t = 0; t < DP_ARRAY_SIZE(end_types); t++)
                closes = closes || starts_with(v, vl, end_types[t]);
        }
        i = e < n && ev[e] == '\r' && e + 1 < n && ev[e + 1] == '\n' ? e + 2 : e + 1;
    }
    closes = closes || (any && data_closes(data.base, data.len));
    dp_buf_free(&data);
    return closes;
}

/* The event kept in g->ev is whole (or the stream ended): pass it on, or hold from it on. */
static void judge(policy_sse_end_t *g, dp_buf_t *out, dp_buf_t *held)
{
    if (g->ev.len == 0)
        return;
    if (event_closes(g->ev.base, g->ev.len)) {
        g->holding = true;
        dp_buf_append(held, g->ev.base, g->ev.len);
    } else {
        dp_buf_append(out, g->ev.base, g->ev.len);
    }
    dp_buf_reset(&g->ev);
}

void policy_sse_end_feed(policy_sse_end_t *g, const char *p, size_t n, dp_buf_t *out,
                         dp_buf_t *held)
{
    size_t i = 0;
    for (; i < n && !g->holding; i++) {
        char c = p[i];
        if (c == '\n' && g->cr) { /* the second half of "\r\n" */
            g->cr = false;
            /* It ends a blank line whose event went on already: it goes on too (a client may
             * wait for it to see the event). */
            dp_buf_appendc(g->ev.len ? &g->ev : out, c);
            continue;
        }
        dp_buf_appendc(&g->ev, c);
        g->cr = c == '\r';
        if (c != '\n' && c != '\r') {
            g->bol = false;
        } else if (g->bol) { /* an empty line: the event is whole */
            judge(g, out, held);
        } else {
            g->bol = true;
        }
        if (g->ev.len > POLICY_SSE_END_EVENT_MAX) { /* never judged: taken as the end */
            g->holding = true;
            dp_buf_append(held, g->ev.base, g->ev.len);
            dp_buf_reset(&g->ev);
        }
    }
    if (g->holding)
        dp_buf_append(held, p + i, n - i);
}

void policy_sse_end_finish(policy_sse_end_t *g, dp_buf_t *out, dp_buf_t *held)
{
    if (!g->holding)
        judge(g, out, held);
}

void policy_sse_end_free(policy_sse_end_t *g)
{
    dp_buf_free(&g->ev);
}
