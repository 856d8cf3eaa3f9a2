/* The gate that holds an audited stream's closing event until its audit line is written
 * (policy.h, "the end of an audited stream"). */
#include <string.h>

#include "policy/policy.h"

/* The closing events' lines, spelled with no space after the colon; a line is compared after
 * dropping one space there. */
static const char *const end_lines[] = {"data:[DONE]", "event:response.completed",
                                        "event:response.incomplete", "event:response.failed"};

/* The line start l[0..n) with its optional space after the first ':' dropped into out:
 * its length, or 0 when it has no ':' yet within what is held (then it is copied as it is). */
static size_t normalise(const char *l, size_t n, char out[POLICY_SSE_END_MAX])
{
    const char *colon = memchr(l, ':', n);
    size_t head = colon ? (size_t)(colon - l) + 1 : n;
    memcpy(out, l, head);
    size_t k = head;
    size_t from = head < n && colon && l[head] == ' ' ? head + 1 : head;
    memcpy(out + k, l + from, n - from);
    return k + (n - from);
}

/* 1: l[0..n) is a whole closing line (whole: its line end came); 0: it may still start one;
 * -1: it cannot be one. */
static int judge(const char *l, size_t n, bool whole)
{
    char norm[POLICY_SSE_END_MAX];
    size_t m = normalise(l, n, norm);
    for (size_t i = 0; i < sizeof(end_lines) / sizeof(end_lines[0]); i++) {
        size_t len = strlen(end_lines[i]);
        if (m <= len && memcmp(norm, end_lines[i], m) == 0 && (!whole || m == len))
            return whole ? 1 : 0;
    }
    return -1;
}

static void start_holding(policy_sse_end_t *g, dp_buf_t *held)
{
    g->holding = true;
    dp_buf_append(held, g->pre, g->npre);
    g->npre = 0;
}

void policy_sse_end_feed(policy_sse_end_t *g, const char *p, size_t n, dp_buf_t *out,
                         dp_buf_t *held)
{
    size_t i = 0;
    while (i < n && !g->holding) {
        if (g->mid) { /* pass the rest of a decided line on, up to and with its end */
            size_t k = i;
            while (k < n && p[k] != '\n' && p[k] != '\r')
                k++;
            if (k < n) {
                k++;
                g->mid = false;
            }
            dp_buf_append(out, p + i, k - i);
            i = k;
            continue;
        }
        char c = p[i];
        if (c == '\n' || c == '\r') {
            if (g->npre && judge(g->pre, g->npre, true) == 1) {
                start_holding(g, held);
                break;
            }
            dp_buf_append(out, g->pre, g->npre);
            dp_buf_appendc(out, c);
            g->npre = 0;
            i++;
            continue;
        }
        if (g->npre == POLICY_SSE_END_MAX) { /* longer than any closing line */
            dp_buf_append(out, g->pre, g->npre);
            g->npre = 0;
            g->mid = true;
            continue;
        }
        g->pre[g->npre++] = c;
        i++;
        if (judge(g->pre, g->npre, false) < 0) {
            dp_buf_append(out, g->pre, g->npre);
            g->npre = 0;
            g->mid = true;
        }
    }
    if (g->holding)
        dp_buf_append(held, p + i, n - i);
}

void policy_sse_end_finish(policy_sse_end_t *g, dp_buf_t *out, dp_buf_t *held)
{
    if (!g->holding && g->npre && judge(g->pre, g->npre, true) == 1)
        start_holding(g, held);
    dp_buf_append(out, g->pre, g->npre);
    g->npre = 0;
}
