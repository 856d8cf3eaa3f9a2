/* Policy-internal: a strict, single-pass JSON scanner that produces a flat token tape.
 *
 * Not part of the module's contract (policy.h is); shared by policy.c, jcs.c and
 * fingerprint.c. Why not cJSON for request bodies: cJSON keeps the first of two duplicate keys
 * (Python backends keep the last), turns every number into a double (a seed above 2^53 would
 * change), truncates strings at \u0000 and rejects numbers longer than 63 characters. The tape
 * keeps exact spans of the client's bytes, so untouched values are forwarded byte-for-byte.
 *
 * What the scanner accepts is RFC 8259 JSON plus these refusals: invalid UTF-8 anywhere (also
 * overlong forms, UTF-8-encoded surrogates, > U+10FFFF), \u escapes that leave a lone surrogate,
 * nesting deeper than JDOC_MAX_DEPTH, number literals longer than JDOC_MAX_NUMBER bytes or that
 * overflow a double, and duplicate keys in any
 * object (compared after unescaping: "a" and "\u0061" are one key).
 *
 * Memory: every array in jdoc_t grows with dp_xrealloc and is kept by jdoc_reset, so a reused
 * jdoc_t allocates nothing once warm. Token offsets are 32-bit: inputs of 4 GiB or more are
 * refused. Spans point into the caller's input, which must outlive the jdoc_t's use of it. */
#ifndef DP_POLICY_JDOC_H
#define DP_POLICY_JDOC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"

#define JDOC_MAX_DEPTH 64
#define JDOC_MAX_NUMBER 512 /* bytes in one number literal */
#define JDOC_NONE UINT32_MAX

typedef enum { JT_OBJ = 1, JT_ARR, JT_STR, JT_NUM, JT_TRUE, JT_FALSE, JT_NULL } jtype_t;

enum {
    JF_ESC = 1,    /* string: has at least one backslash escape */
    JF_KEY = 2,    /* string: an object member's key */
    JF_INT = 4,    /* number: no fraction and no exponent */
    JF_NEG = 8,    /* number: starts with '-' */
    JF_REESC = 16, /* string: has a \u or \/ escape, which RFC 8785 writes differently; without
                      one the literal is already canonical (\" \\ \b \f \n \r \t are kept) */
};

/* One token. Objects are followed by key, value, key, value...; arrays by their elements;
 * `end` is the index just past the token's subtree, so siblings are reached without a walk. */
typedef struct {
    uint32_t start; /* first byte (the quote for strings, the bracket for containers) */
    uint32_t len;   /* raw byte length, quotes and brackets included */
    uint32_t end;
    uint32_t aux;  /* containers: child count (members for objects); escaped keys: offset of the
                      decoded key in jdoc_t.keys */
    uint32_t aux2; /* objects: offset of their sorted member list in jdoc_t.order;
                      escaped keys: decoded length */
    uint8_t type;
    uint8_t flags;
} jtok_t;

/* A token's work units against a slow step's one: canonicalising a number (parse, then
 * shortest round-trip print) costs ~180 ns, an escape or a checked character 6-30 ns. A number
 * literal also costs a unit per JDOC_NUMBER_BYTES of its digits (strtod of 120 digits: ~560
 * ns), and an object's key sort one per JDOC_KEY_BYTE_LEVELS key bytes compared (its keys'
 * bytes times ceil(log2(members)): ~0.8 ns each). */
#define JDOC_TOKEN_UNITS 8
#define JDOC_NUMBER_BYTES 8
#define JDOC_KEY_BYTE_LEVELS 32

typedef struct {
    const char *src;
    size_t srclen;
    jtok_t *toks;
    uint32_t ntoks, cap;
    uint32_t *order; /* per object: its key tokens sorted by JCS order (UTF-16 code units) */
    uint32_t norder, ordercap;
    uint32_t *tmp; /* merge-sort scratch */
    uint32_t tmpcap;
    bool toks_borrowed; /* toks is the caller's array (jdoc_init_with): copied out to grow */
    dp_buf_t keys;      /* decoded bytes of escaped keys */
    /* The most work units jdoc_parse may meet before it stops with jdoc_over_budget(): a
     * token is JDOC_TOKEN_UNITS, a slow step one (an escape, or a multi-byte character checked
     * one at a time: all of them without AVX2, those of a document that is not valid UTF-8
     * with it), long numbers and key sorts more (JDOC_NUMBER_BYTES, JDOC_KEY_BYTE_LEVELS).
     * What a body costs to parse, canonicalise and police grows with these, not with its
     * bytes. UINT32_MAX (jdoc_init's) for no limit; kept by jdoc_reset. */
    uint32_t budget;
    uint32_t nslow; /* slow steps met so far */
    /* set when jdoc_parse fails */
    const char *err;
    size_t err_at;
    uint32_t err_tok; /* duplicate key: the second key token; else JDOC_NONE */
} jdoc_t;

enum {
    JDOC_OBJECT_ONLY = 1, /* the top-level value must be an object */
    JDOC_ALLOW_DUPS = 2,  /* skip duplicate detection and key sorting (response bodies) */
};

void jdoc_init(jdoc_t *d);
/* jdoc_init with the caller's token array (cap entries) used first: a small document (a
 * response body, a usage object) is parsed without allocating. toks must outlive d. */
void jdoc_init_with(jdoc_t *d, jtok_t *toks, uint32_t cap);
void jdoc_reset(jdoc_t *d);
void jdoc_free(jdoc_t *d);

/* Scan and validate src[0..n). 0 on success; -1 with d->err (static text) and d->err_at (byte
 * offset) set. The tape is valid until the next jdoc_parse/reset/free. */
int jdoc_parse(jdoc_t *d, const char *src, size_t n, int flags);

/* A member of the top-level object, as jdoc_scan_top reports it: raw spans (a key's and a
 * string's quotes included), the value's type, and the flags jdoc_parse gives their tokens. */
typedef struct {
    uint32_t key_start, key_len;
    uint32_t val_start, val_len;
    uint8_t key_flags, val_type, val_flags;
} jdoc_member_t;

/* Validate src as jdoc_parse(d, src, n, JDOC_OBJECT_ONLY | JDOC_ALLOW_DUPS) does with no budget,
 * accepting and refusing exactly the same documents, but keeping no tokens: fn is called for
 * each member of the top-level object, in order, as its value ends. For a document too large
 * or dense to hold a tape of (a response passed on): memory stays constant whatever its
 * shape. 0 with *nmembers set, or -1 with d->err set; d->budget is left as it was. */
int jdoc_scan_top(jdoc_t *d, const char *src, size_t n,
                  void (*fn)(void *data, const jdoc_t *d, const jdoc_member_t *m), void *data,
                  uint32_t *nmembers);

/* Decoded bytes of a key token (escaped keys live in d->keys: don't hold the pointer across
 * another parse). */
void jdoc_key(const jdoc_t *d, uint32_t tok, const char **p, size_t *n);
/* Member value of object `obj` whose key equals name, or JDOC_NONE. Linear: objects in request
 * bodies are small, and dedup already ran. */
uint32_t jdoc_get(const jdoc_t *d, uint32_t obj, const char *name);
/* A string token's contents equal s (after unescaping)? */
bool jdoc_str_eq(const jdoc_t *d, uint32_t tok, const char *s);
/* Append the unescaped contents of string token tok. */
void jdoc_str_decode(const jdoc_t *d, uint32_t tok, dp_buf_t *out);
/* Value of a number token as a double (correctly rounded, strtod). */
double jdoc_num(const jdoc_t *d, uint32_t tok);
/* Integer literal to int64; -1 when it does not fit. */
int jdoc_int64(const jdoc_t *d, uint32_t tok, int64_t *out);

/* String scanning: the widest vector unit the CPU has (checked at run time), or a portable
 * eight-bytes-at-a-time loop; all of them accept and refuse exactly the same inputs. */
enum {
    JDOC_SIMD_SCALAR = 0,
    JDOC_SIMD_SSE2,
    JDOC_SIMD_AVX2,   /* with BMI and POPCNT: strings 64 bytes a step (two halves), escapes as
                         bit masks, UTF-8 validated as they are scanned */
    JDOC_SIMD_AVX512, /* AVX-512 BW and VBMI: the same with one 64-byte vector */
    JDOC_SIMD_BEST = JDOC_SIMD_AVX512
};
/* Use at most level max (tests run every path this way); returns the level now in use. The
 * default is the best the CPU supports. Process-wide. */
int jdoc_simd_select(int max);

/* Did the last jdoc_parse stop at jdoc_t.budget (not a verdict on the document)? */
bool jdoc_over_budget(const jdoc_t *d);

/* Compare two UTF-8 strings by their UTF-16 code units, as RFC 8785 sorts keys. */
int jdoc_utf16_cmp(const char *a, size_t an, const char *b, size_t bn);

/* Append the raw text of the subtree at tok with insignificant whitespace removed. */
void jdoc_write_compact(const jdoc_t *d, uint32_t tok, dp_buf_t *out);

/* Unescape JSON string contents (no quotes; already validated) into out. */
void jdoc_unescape(const char *s, size_t n, dp_buf_t *out);
void jdoc_put_utf8(dp_buf_t *out, uint32_t cp);

/* The UTF-8 bytes of code point cp (at most U+10FFFF) into b; their number. */
static inline size_t jdoc_utf8_encode(uint32_t cp, char b[4])
{
    if (cp < 0x80) {
        b[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        b[0] = (char)(0xC0 | cp >> 6);
        b[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        b[0] = (char)(0xE0 | cp >> 12);
        b[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        b[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    b[0] = (char)(0xF0 | cp >> 18);
    b[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    b[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    b[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

#endif
