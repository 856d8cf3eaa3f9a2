/* Response fingerprint rewriting (docs/policy.md §6): a non-streamed JSON body gets the pool
 * fingerprint as its top-level system_fingerprint; SSE events get the same, byte-incrementally. */
#include <assert.h>
#include <string.h>

#include "common/jw.h"
#include "policy/policy_int.h"

static const char FP_KEY[] = "system_fingerprint";
#define FP_KEY_LEN (sizeof(FP_KEY) - 1)
/* The SSE rewriter holds back at most the quoted key. */
_Static_assert(FP_KEY_LEN + 2 <= sizeof(((policy_sse_fp_t *)0)->hold), "hold fits \"key\"");

static void prev_put(char *prev, size_t *n, unsigned char c)
{
    if (*n < POLICY_FP_PREV_MAX - 1)
        prev[(*n)++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
}

static void append_fp_value(dp_buf_t *out, const char *fp)
{
    /* Pool fingerprints are "fp_" + hex: copy them straight; escape anything else. */
    size_t n = strlen(fp), i = 0;
    while (i < n && fp[i] >= 0x20 && fp[i] < 0x7f && fp[i] != '"' && fp[i] != '\\')
        i++;
    dp_buf_reserve(out, n + 2);
    out->base[out->len++] = '"';
    if (i == n) {
        memcpy(out->base + out->len, fp, n);
        out->len += n;
    } else {
        dp_json_escape(out, fp, n);
    }
    dp_buf_appendc(out, '"');
}

/* The rewrite as it goes: the bytes before each top-level system_fingerprint value, then the
 * pool's value in its place. */
typedef struct {
    const char *body;
    const char *fp;
    dp_buf_t *out;
    char *prev;
    size_t pos, pn;
    bool found;
} fp_rewrite_t;

static bool is_fp_key(const char *src, const jdoc_member_t *m)
{
    const char *k = src + m->key_start + 1;
    size_t kn = m->key_len - 2;
    if (!(m->key_flags & JF_ESC))
        return kn == FP_KEY_LEN && memcmp(k, FP_KEY, FP_KEY_LEN) == 0;
    if (kn < FP_KEY_LEN) /* an escape only makes a key longer than what it decodes to */
        return false;
    dp_buf_t dec = {0};
    jdoc_unescape(k, kn, &dec);
    bool eq = dec.len == FP_KEY_LEN && memcmp(dec.base, FP_KEY, FP_KEY_LEN) == 0;
    dp_buf_free(&dec);
    return eq;
}

static void fp_member(void *data, const jdoc_t *d, const jdoc_member_t *m)
{
    fp_rewrite_t *r = data;
    if (!is_fp_key(d->src, m))
        return;
    if (!r->found && m->val_type == JT_STR) {
        dp_buf_t tmp = {0};
        jdoc_unescape(d->src + m->val_start + 1, m->val_len - 2, &tmp);
        for (size_t i = 0; i < tmp.len; i++)
            prev_put(r->prev, &r->pn, (unsigned char)tmp.base[i]);
        dp_buf_free(&tmp);
    }
    r->found = true;
    dp_buf_append(r->out, r->body + r->pos, m->val_start - r->pos);
    append_fp_value(r->out, r->fp);
    r->pos = m->val_start + m->val_len;
}

/* The tape of a body whose tokens fit this (a completion's top level and its choices) is kept
 * on the stack, and gives the usage where it can (policy_usage_take_json); a larger or denser
 * one is scanned without a tape, its memory the output's alone. */
#define FP_TAPE_TOKENS 128

int policy_fp_rewrite_json(const char *body, size_t len, const char *fp, dp_buf_t *out,
                           char prev[POLICY_FP_PREV_MAX], policy_usage_t *usage)
{
    prev[0] = '\0';
    dp_buf_reset(out);
    jdoc_t d;
    jtok_t toks[FP_TAPE_TOKENS];
    jdoc_init_with(&d, toks, FP_TAPE_TOKENS);
    /* Duplicates are not refused here: a replica's response is forwarded, not policed; every
     * top-level copy of the key is rewritten. The budget stops the parse before the tape
     * outgrows the stack (each token is checked against it before it is added); slow steps
     * (escapes) count too, so a body with many of them is scanned as well. */
    d.budget = (FP_TAPE_TOKENS - 1) * JDOC_TOKEN_UNITS;
    fp_rewrite_t r = {.body = body, .fp = fp, .out = out, .prev = prev};
    uint32_t members = 0;
    dp_buf_reserve(out, len + 48);
    if (jdoc_parse(&d, body, len, JDOC_OBJECT_ONLY | JDOC_ALLOW_DUPS) == 0) {
        if (usage)
            policy_usage_take_json(usage, &d);
        const jtok_t *root = &d.toks[0];
        members = root->aux;
        for (uint32_t k = 1; k < root->end; k = d.toks[k + 1].end) {
            const jtok_t *key = &d.toks[k], *v = &d.toks[k + 1];
            fp_member(&r, &d,
                      &(jdoc_member_t){.key_start = key->start,
                                       .key_len = key->len,
                                       .key_flags = key->flags,
                                       .val_start = v->start,
                                       .val_len = v->len,
                                       .val_type = v->type});
        }
    } else if (!jdoc_over_budget(&d) || jdoc_scan_top(&d, body, len, fp_member, &r, &members) < 0) {
        /* The scan may have met the key before it met the error: nothing of it stays. */
        jdoc_free(&d);
        dp_buf_reset(out);
        prev[0] = '\0';
        return 0;
    }
    jdoc_free(&d);
    prev[r.pn] = '\0';
    if (!r.found) {
        size_t close = len; /* the final '}', before any trailing whitespace */
        while (body[--close] != '}')
            ;
        dp_buf_append(out, body, close);
        if (members > 0)
            dp_buf_appendc(out, ',');
        dp_buf_append(out, "\"system_fingerprint\":", FP_KEY_LEN + 3);
        append_fp_value(out, fp);
        r.pos = close;
    }
    dp_buf_append(out, body + r.pos, len - r.pos);
    return 1;
}

/* ---- SSE ----------------------------------------------------------------------------------- */

enum { L_START = 0, L_DATA, L_OTHER };

enum {
    J_BEGIN = 0,  /* before the event's top-level value */
    J_KEY_EXPECT, /* depth 1 of an object, where a key may start */
    J_KEY,        /* inside a depth-1 key that still matches FP_KEY (held back) */
    J_COLON,      /* after a matching key */
    J_VALUE,      /* after its colon */
    J_FPSTR,      /* swallowing the old string value, held in cur to give back if cut */
    J_FPREST,     /* the rest of an old value too long to hold, already replaced */
    J_NULL,       /* swallowing a null value */
    J_SCAN,       /* anywhere else inside the event's JSON */
    J_SKIP,       /* the rest of the event is not ours (not an object, or done) */
};

#define SSE_MAX_DEPTH 60000

void policy_sse_fp_init(policy_sse_fp_t *s, const char *fp)
{
    memset(s, 0, sizeof(*s));
    s->fp = fp;
}

/* The old value is replaced: its first bytes (in s->cur as written, curlen of them) are the
 * stream's first value, or the first that differs. Bytes that are not visible ASCII are read
 * as '?', as the JSON body's are. */
static void sse_fp_seen(policy_sse_fp_t *s)
{
    for (size_t k = 0; k < s->curlen; k++) {
        unsigned char c = (unsigned char)s->cur[k];
        if (c < 0x20 || c >= 0x7f)
            s->cur[k] = '?';
    }
    s->cur[s->curlen] = '\0';
    if (s->cur[0] == '\0')
        return;
    if (s->prev[0] == '\0')
        memcpy(s->prev, s->cur, sizeof(s->prev));
    else if (s->alt[0] == '\0' && strcmp(s->cur, s->prev) != 0)
        memcpy(s->alt, s->cur, sizeof(s->alt));
}

static void flush_held(policy_sse_fp_t *s, dp_buf_t *out)
{
    if (s->held) {
        dp_buf_append(out, s->hold, s->held);
        s->held = 0;
    }
}

/* A line break or the stream's end cut the event: what was held back goes out as it came (a
 * key that could still be ours, a value being replaced, part of a null). */
static void give_back(policy_sse_fp_t *s, dp_buf_t *out)
{
    if (s->js == J_NULL) {
        dp_buf_append(out, "null", s->vskip);
    } else if (s->js == J_FPSTR) {
        dp_buf_appendc(out, '"');
        dp_buf_append(out, s->cur, s->curlen);
    }
    flush_held(s, out);
}

static void event_reset(policy_sse_fp_t *s)
{
    s->js = J_BEGIN;
    s->depth = 0;
    s->top_obj = false;
    s->in_str = false;
    s->esc = false;
    s->vskip = 0;
}

/* One byte of the JSON inside data lines, outside the special states. Returns nothing: bytes
 * are emitted by the caller's run logic. */
static void scan_byte(policy_sse_fp_t *s, unsigned char c)
{
    if (s->in_str) {
        if (s->esc)
            s->esc = false;
        else if (c == '\\')
            s->esc = true;
        else if (c == '"')
            s->in_str = false;
        return;
    }
    switch (c) {
    case '"':
        s->in_str = true;
        break;
    case '{':
    case '[':
        if (++s->depth > SSE_MAX_DEPTH)
            s->js = J_SKIP;
        break;
    case '}':
    case ']':
        if (s->depth > 0 && --s->depth == 0)
            s->js = J_SKIP; /* the event's value is complete */
        break;
    case ',':
        if (s->depth == 1 && s->top_obj)
            s->js = J_KEY_EXPECT;
        break;
    default:
        break;
    }
}

/* Byte classes for scan_run: 1 ends a string run, 2 is structural outside strings. */
static const uint8_t sse_class[256] = {
    ['\n'] = 1, ['\r'] = 1, ['"'] = 1, ['\\'] = 1, ['{'] = 2,
    ['['] = 2,  ['}'] = 2,  [']'] = 2, [','] = 2,
};

/* J_SCAN over b[i..n): the bulk of every event (choices, deltas, usage). Tight loop on locals;
 * returns where it stopped: the end, a line break (left for the caller), or a state change
 * (J_KEY_EXPECT after a depth-1 comma, J_SKIP when the event's value closes). */
static size_t scan_run(policy_sse_fp_t *s, const unsigned char *b, size_t i, size_t n)
{
    bool in_str = s->in_str;
    unsigned depth = s->depth;
    if (in_str && s->esc) { /* an escape split across reads */
        if (i < n && b[i] != '\n' && b[i] != '\r') {
            s->esc = false;
            i++;
        }
    }
    while (i < n) {
        if (in_str) {
            while (i < n && sse_class[b[i]] != 1)
                i++;
            if (i >= n)
                break;
            unsigned char c = b[i];
            if (c == '\n' || c == '\r')
                break;
            if (c == '\\') {
                if (i + 1 >= n) {
                    s->esc = true;
                    i++;
                    break;
                }
                if (b[i + 1] == '\n' || b[i + 1] == '\r') {
                    i++;
                    break;
                }
                i += 2;
                continue;
            }
            in_str = false; /* '"' */
            i++;
            continue;
        }
        unsigned char c = b[i];
        if (c == '\n' || c == '\r')
            break;
        i++;
        if (c == '"') {
            in_str = true;
        } else if (sse_class[c] == 2) {
            if (c == '{' || c == '[') {
                if (++depth > SSE_MAX_DEPTH) {
                    s->js = J_SKIP;
                    break;
                }
            } else if (c == ',') {
                if (depth == 1 && s->top_obj) {
                    s->js = J_KEY_EXPECT;
                    break;
                }
            } else if (depth > 0 && --depth == 0) {
                s->js = J_SKIP; /* the event's value is complete */
                break;
            }
        }
    }
    s->in_str = in_str;
    s->depth = (uint16_t)depth;
    return i;
}

static bool is_ws(unsigned char c)
{
    return c == ' ' || c == '\t';
}

ssize_t policy_sse_fp_feed(policy_sse_fp_t *s, const char *p, size_t n, dp_buf_t *out)
{
    if (s->fp == NULL)
        return -1;
    const unsigned char *b = (const unsigned char *)p;
    size_t run = 0; /* start of the bytes passed through but not yet appended */
    size_t i = 0;
#define FLUSH_RUN()                                                                                \
    do {                                                                                           \
        if (i > run)                                                                               \
            dp_buf_append(out, p + run, i - run);                                                  \
    } while (0)
    while (i < n) {
        unsigned char c = b[i];
        if (!s->started) {
            /* A BOM that starts the stream is dropped by the client's decoder (the WHATWG
             * event-stream rules): the first line starts after it, whatever comes next. It passes
             * on as it came. */
            if (s->bom < 3 && c == (unsigned char)"\xEF\xBB\xBF"[s->bom]) {
                s->started = ++s->bom == 3;
                i++;
                continue;
            }
            s->started = true;
            if (s->bom > 0)
                s->line = L_OTHER; /* part of one: decoded as U+FFFD, the line is no field */
        }
        if (c == '\n' || c == '\r') {
            bool crlf = c == '\n' && s->last_cr;
            s->last_cr = c == '\r';
            if (crlf) {
                i++;
                continue;
            }
            if (s->line == L_START && s->pfx == 0) {
                event_reset(s); /* blank line: the event ends */
            } else if (s->line == L_DATA) {
                /* A key or a value cannot span a line break: give back anything held. */
                if (s->held || s->js == J_KEY || s->js == J_FPSTR || s->js == J_FPREST ||
                    s->js == J_NULL || s->in_str) {
                    FLUSH_RUN();
                    run = i;
                    give_back(s, out);
                    s->js = J_SKIP;
                    s->in_str = false;
                }
            }
            s->line = L_START;
            s->pfx = 0;
            i++;
            continue;
        }
        s->last_cr = false;
        if (s->line == L_START) {
            if (c == (unsigned char)"data:"[s->pfx]) {
                if (++s->pfx == 5)
                    s->line = L_DATA;
            } else {
                s->line = L_OTHER;
            }
            i++;
            continue;
        }
        if (s->line == L_OTHER || s->js == J_SKIP) {
            /* Nothing to do until the end of the line: memchr is vectorised. */
            const unsigned char *nl = memchr(b + i, '\n', n - i);
            size_t end = nl ? (size_t)(nl - b) : n;
            const unsigned char *cr = memchr(b + i, '\r', end - i);
            i = cr ? (size_t)(cr - b) : end;
            continue;
        }
        switch (s->js) {
        case J_BEGIN:
            if (c == '{') {
                s->top_obj = true;
                s->depth = 1;
                s->js = J_KEY_EXPECT;
            } else if (!is_ws(c)) {
                s->js = J_SKIP; /* [DONE], arrays, anything else */
            }
            i++;
            break;
        case J_KEY_EXPECT:
            if (c == '"' && n - i >= FP_KEY_LEN + 2) {
                /* The whole key is in this read (the usual case): decide in place. */
                if (memcmp(b + i + 1, FP_KEY, FP_KEY_LEN) == 0 && b[i + 1 + FP_KEY_LEN] == '"') {
                    i += FP_KEY_LEN + 2;
                    s->js = J_COLON;
                } else {
                    s->in_str = true; /* some other key: scan_run skips it */
                    s->js = J_SCAN;
                    i++;
                }
            } else if (c == '"') {
                /* Cut by the end of the read: hold what could still become our key. */
                FLUSH_RUN();
                s->hold[0] = '"';
                s->held = 1;
                s->js = J_KEY;
                i++;
                run = i;
            } else if (is_ws(c)) {
                i++;
            } else {
                s->js = J_SCAN;
                scan_byte(s, c);
                i++;
            }
            break;
        case J_KEY:
            assert(s->held >= 1 && (size_t)s->held <= FP_KEY_LEN + 1); /* '"' and a prefix */
            if (c == '"' && (size_t)s->held - 1 == FP_KEY_LEN) {
                s->hold[s->held++] = '"';
                flush_held(s, out);
                s->js = J_COLON;
                i++;
                run = i;
            } else if (c != '\\' && c != '"' && (size_t)s->held - 1 < FP_KEY_LEN &&
                       c == (unsigned char)FP_KEY[s->held - 1]) {
                s->hold[s->held++] = (char)c;
                i++;
                run = i;
            } else {
                /* Not our key (escaped spellings are not recognised here; they never occur in
                 * servers' output). Give back what was held and scan on as a string. */
                flush_held(s, out);
                s->in_str = true;
                s->js = J_SCAN;
                run = i;
                scan_byte(s, c);
                i++;
            }
            break;
        case J_COLON:
            if (c == ':')
                s->js = J_VALUE;
            else if (!is_ws(c)) {
                s->js = J_SCAN;
                scan_byte(s, c);
            }
            i++;
            break;
        case J_VALUE:
            if (c == '"' || c == 'n') {
                FLUSH_RUN();
                s->curlen = 0;
                if (c == 'n') {
                    s->js = J_NULL;
                    s->vskip = 1;
                } else {
                    s->js = J_FPSTR;
                    s->esc = false;
                }
                i++;
                run = i;
            } else if (is_ws(c)) {
                i++;
            } else {
                s->js = J_SCAN; /* a number or an object: not ours to rewrite */
                scan_byte(s, c);
                i++;
            }
            break;
        case J_FPSTR:
        case J_FPREST: {
            /* Swallow the old value. Its bytes are held as written (escapes kept: decoding
             * here would need more state for no operator benefit), to be given back if a line
             * break or the stream's end cuts it; one longer than cur holds is replaced once
             * cur is full, and the rest of it swallowed. */
            size_t pn = s->curlen;
            while (i < n) {
                c = b[i];
                if (c == '\n' || c == '\r')
                    break;
                i++;
                bool end = false;
                if (s->esc)
                    s->esc = false;
                else if (c == '\\')
                    s->esc = true;
                else
                    end = c == '"';
                if (s->js == J_FPREST) {
                    if (end)
                        s->js = J_SKIP;
                } else if (end || pn == POLICY_FP_PREV_MAX - 1) {
                    s->curlen = (uint8_t)pn;
                    sse_fp_seen(s);
                    append_fp_value(out, s->fp);
                    s->rewritten++;
                    /* One top-level key per event (duplicates are not worth tracking the
                     * rest for): the remainder of the event passes untouched. */
                    s->js = end ? J_SKIP : J_FPREST;
                } else {
                    s->cur[pn++] = (char)c;
                }
                if (s->js == J_SKIP)
                    break;
            }
            s->curlen = (uint8_t)pn;
            run = i;
            break;
        }
        case J_NULL:
            if (c == (unsigned char)"null"[s->vskip]) {
                i++;
                run = i;
                if (++s->vskip == 4) {
                    append_fp_value(out, s->fp);
                    s->rewritten++;
                    s->js = J_SKIP;
                }
            } else {
                /* Not null after all: give the swallowed bytes back. */
                dp_buf_append(out, "null", s->vskip);
                s->js = J_SCAN;
                run = i;
            }
            break;
        default: /* J_SCAN */
            i = scan_run(s, b, i, n);
            break;
        }
    }
    FLUSH_RUN();
#undef FLUSH_RUN
    return (ssize_t)n;
}

void policy_sse_fp_finish(policy_sse_fp_t *s, dp_buf_t *out)
{
    give_back(s, out);
    event_reset(s);
}
