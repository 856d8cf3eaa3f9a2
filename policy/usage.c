/* Token usage from responses, for detproxy_tokens_total and the access log's tokens
 * (docs/operations.md §6): an incremental scanner over a response body, JSON or SSE, that finds
 * each `"usage": {...}` object and keeps the last one's prompt and completion counts (the
 * Responses API's input_tokens and output_tokens are the same two). A usage object is read
 * where it lies, and copied only when a read ends inside it (at most POLICY_USAGE_CAP bytes);
 * between strings the scan jumps to the next quote, inside one to the next quote, backslash or
 * newline; in an event stream a line end also ends an object, as an event cut inside a usage
 * object. A body parsed whole for its fingerprint whose one usage object is a top-level member
 * gives it from that parse, and is not scanned. */
#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/buf.h"

#include "policy/policy_int.h"

enum { ST_SCAN = 0, ST_AFTER_KEY, ST_AFTER_COLON, ST_CAPTURE };

static bool number(const jdoc_t *d, uint32_t obj, const char *key, int64_t *out)
{
    uint32_t t = jdoc_get(d, obj, key);
    if (t == JDOC_NONE || d->toks[t].type != JT_NUM)
        return false;
    int64_t i;
    if (jdoc_int64(d, t, &i) == 0) { /* what engines send: no strtod */
        if (i < 0 || i > (int64_t)1e15)
            return false;
        *out = i;
        return true;
    }
    double v = jdoc_num(d, t); /* 3.0, 1e2, or an integer too long for int64 */
    if (v < 0 || v > 1e15 || v != (double)(int64_t)v)
        return false;
    *out = (int64_t)v;
    return true;
}

/* The usage object at token obj of d (the first of duplicate keys counts): prompt_tokens and
 * completion_tokens as chat and completions answers name them, else input_tokens and
 * output_tokens as the Responses API does. */
static void read_usage(policy_usage_t *u, const jdoc_t *d, uint32_t obj)
{
    static const char *const names[][2] = {{"prompt_tokens", "completion_tokens"},
                                           {"input_tokens", "output_tokens"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        int64_t p, c;
        if (!number(d, obj, names[i][0], &p))
            continue;
        /* A usage chunk without the second (an embeddings-shaped body) counts 0 for it. */
        if (!number(d, obj, names[i][1], &c))
            c = 0;
        u->found = true;
        u->prompt_tokens = p;
        u->completion_tokens = c;
        return;
    }
}

/* A whole usage object's bytes, parsed on the stack. */
static void captured(policy_usage_t *u, const char *obj, size_t len)
{
    jdoc_t d;
    jtok_t toks[64];
    jdoc_init_with(&d, toks, 64);
    if (jdoc_parse(&d, obj, len, JDOC_OBJECT_ONLY | JDOC_ALLOW_DUPS) == 0)
        read_usage(u, &d, 0);
    jdoc_free(&d);
}

void policy_usage_free(policy_usage_t *u)
{
    free(u->cap);
    u->cap = NULL;
    u->clen = 0;
    if (u->st == ST_CAPTURE)
        u->st = ST_SCAN;
}

void policy_usage_take_json(policy_usage_t *u, const jdoc_t *d)
{
    assert(d->ntoks > 0 && d->toks[0].type == JT_OBJ);
    /* The scan counts every "usage" key spelled plainly, at any depth, whose object fits its
     * copy. The parse answers alone only where that is one member of the top level: any other
     * shape is left to the scan, so a held body and one passed through count alike. */
    uint32_t key = JDOC_NONE;
    for (uint32_t k = 1; k < d->ntoks; k++) {
        const jtok_t *t = &d->toks[k];
        if ((t->flags & (JF_KEY | JF_ESC)) != JF_KEY || t->len != 7 ||
            memcmp(d->src + t->start + 1, "usage", 5) != 0)
            continue;
        if (key != JDOC_NONE)
            return;
        key = k;
    }
    if (key == JDOC_NONE || d->toks[key + 1].type != JT_OBJ ||
        d->toks[key + 1].len > POLICY_USAGE_CAP)
        return;
    const jtok_t *root = &d->toks[0];
    for (uint32_t k = 1; k < root->end; k = d->toks[k + 1].end) {
        if (k == key) {
            u->taken = true;
            read_usage(u, d, key + 1);
            return;
        }
    }
}

/* The first '"', '\\', newline or `cr` (a line's other end, see line_cr) at or after j (n if
 * none): eight bytes a step, each tested for the four at once (a byte equal to c leaves a zero
 * byte in x ^ c). */
static inline size_t str_stop(const char *p, size_t j, size_t n, char cr)
{
    const uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
    while (j + 8 <= n) {
        uint64_t x;
        memcpy(&x, p + j, 8);
        uint64_t q = x ^ (ones * '"'), b = x ^ (ones * '\\'), l = x ^ (ones * '\n'),
                 r = x ^ (ones * (unsigned char)cr);
        uint64_t t =
            (((q - ones) & ~q) | ((b - ones) & ~b) | ((l - ones) & ~l) | ((r - ones) & ~r)) & highs;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        if (t) /* the lowest flag is exact (a borrow only runs upward from a zero byte) */
            return j + (size_t)__builtin_ctzll(t) / 8;
#else
        if (t) /* the first bytes in memory are the high ones: the byte loop finds it */
            break;
#endif
        j += 8;
    }
    while (j < n && p[j] != '"' && p[j] != '\\' && p[j] != '\n' && p[j] != cr)
        j++;
    return j;
}

/* The byte besides a newline that ends a line: a carriage return in an event stream (where a
 * CR alone ends a line), else a newline again (in a JSON body a CR is whitespace). */
static inline char line_cr(const policy_usage_t *u)
{
    return u->sse ? '\r' : '\n';
}

/* A line ended: no JSON string holds a raw line end, so a string in progress was cut there.
 * In an event stream the event's line is over: a key found before it no longer counts. */
static inline void line_end(policy_usage_t *u)
{
    u->in_str = u->esc = false;
    if (u->sse)
        u->st = ST_SCAN;
}

/* Take the usage object's bytes from p[i] on until its braces balance (then read it), the
 * input ends (then what came is copied to u->cap for the next read), it outgrows
 * POLICY_USAGE_CAP (then it is skipped, as no engine's usage is that large) or, in an event
 * stream, its line ends (then it is skipped: the event was cut). The object's bytes from
 * earlier reads are the u->clen in u->cap. Returns the index of the first byte it did not take:
 * n, the byte after the closing brace, or the byte that found the object too long or ended the
 * line (which the scan then reads, with the string state the capture kept). The state lives in
 * locals while it runs. */
static size_t capture(policy_usage_t *u, const char *p, size_t i, size_t n)
{
    const bool sse = u->sse;
    const char cr = line_cr(u);
    bool in_str = u->in_str, esc = u->esc;
    unsigned depth = u->depth;
    const size_t held = u->clen;
    size_t j = i;
    for (; j < n; j++) {
        char ch = p[j];
        if ((unsigned char)ch <= '\r' && (ch == '\n' || ch == cr)) { /* see line_end */
            in_str = esc = false;
            if (sse) { /* the event ended inside the object */
                u->st = ST_SCAN;
                break;
            }
        }
        if (held + (j - i) >= POLICY_USAGE_CAP) {
            u->st = ST_SCAN;
            u->klen = 0xff; /* a string cut here is a value's, or a key inside the object */
            break;
        }
        if (in_str) {
            if (esc)
                esc = false;
            else if (ch == '\\')
                esc = true;
            else if (ch == '"')
                in_str = false;
        } else if (ch == '"') {
            in_str = true;
        } else if (ch == '{') {
            depth++;
        } else if (ch == '}' && --depth == 0) {
            j++;
            if (held == 0) {
                captured(u, p + i, j - i);
            } else {
                memcpy(u->cap + held, p + i, j - i);
                captured(u, u->cap, held + (j - i));
            }
            u->st = ST_SCAN;
            break;
        }
    }
    u->in_str = in_str;
    u->esc = esc;
    u->depth = (uint16_t)depth;
    if (u->st == ST_CAPTURE) { /* the read ended inside the object */
        if (u->cap == NULL)
            u->cap = dp_xmalloc(POLICY_USAGE_CAP);
        memcpy(u->cap + held, p + i, j - i);
        u->clen = (uint16_t)(held + (j - i));
    } else {
        free(u->cap);
        u->cap = NULL;
        u->clen = 0;
    }
    return j;
}

void policy_usage_feed(policy_usage_t *u, const char *p, size_t n)
{
    if (u->taken)
        return;
    const char cr = line_cr(u);
    for (size_t i = 0; i < n; i++) {
        if (u->st == ST_CAPTURE) {
            i = capture(u, p, i, n);
            if (i == n)
                return;
        }
        char ch = p[i];
        if (ch == '\n' || ch == cr) { /* a truncated event cannot leave the scan in a string */
            line_end(u);
            continue;
        }
        if (u->st == ST_SCAN && !u->in_str) {
            /* Between strings only a quote starts anything: skip to it. */
            const char *q = memchr(p + i, '"', n - i);
            if (q == NULL)
                return;
            i = (size_t)(q - p);
            ch = '"';
        } else if (u->in_str && !u->esc) {
            /* Inside a string only '\\', '"' and a line end matter; the bytes before them are
             * the key's while it may still be "usage". */
            size_t j = str_stop(p, i, n, cr);
            if (u->klen != 0xff) {
                if (j - i <= sizeof(u->key) - u->klen) {
                    memcpy(u->key + u->klen, p + i, j - i);
                    u->klen = (uint8_t)(u->klen + (j - i));
                } else {
                    u->klen = 0xff;
                }
            }
            i = j;
            if (i == n)
                return;
            ch = p[i];
            if (ch == '\n' || ch == cr) {
                line_end(u);
                continue;
            }
        }
        if (u->in_str) {
            if (u->esc) {
                u->esc = false;
                u->klen = 0xff; /* an escaped key is never "usage" as engines write it */
            } else if (ch == '\\') {
                u->esc = true;
            } else { /* the closing quote (every other byte was taken above) */
                u->in_str = false;
                u->st = u->klen == 5 && memcmp(u->key, "usage", 5) == 0 ? ST_AFTER_KEY : ST_SCAN;
            }
            continue;
        }
        if (ch == ' ' || ch == '\t' || ch == '\r')
            continue;
        if (ch == '"') {
            u->in_str = true;
            u->klen = 0;
            u->st = ST_SCAN;
        } else if (u->st == ST_AFTER_KEY && ch == ':') {
            u->st = ST_AFTER_COLON;
        } else if (u->st == ST_AFTER_COLON && ch == '{') {
            u->st = ST_CAPTURE; /* from this brace on */
            u->depth = 0;
            u->clen = 0;
            i = capture(u, p, i, n);
            if (i == n)
                return;
            i--; /* the byte it stopped at is read next */
        } else {
            u->st = ST_SCAN;
        }
    }
}
