/* libFuzzer target: the policy module against its oracle, the implementation it replaced
 * (tests/oracle/). Every disagreement tests/oracle/diff.h defines (accept/refuse, error, seed,
 * forwarded bytes, canonical form, response fingerprint) aborts with the reason on stderr.
 * Where the CPU has AVX-512, the oracle is asked again with the AVX2 string scanner (the same
 * block loop at another width).
 *
 * The body's parse at every vector level is checked against the byte loop's on every input as
 * well: verdict, error, its byte and the token tape (a vector level scans a string it refuses
 * again with the checking path, so a false refusal there would cost time, not a wrong answer),
 * and the work units it met against the byte loop's. Then every level parses the body once
 * more under a work budget (jdoc_t.budget), where it must stop or change nothing, and get
 * through wherever the byte loop does (check_budget).
 *
 * Input: byte 0 selects route, tenant and framework, and with its top three bits the budget
 * (budget_for); the rest is the body. Seed corpus: tests/fuzz/corpus/policy/ (the module's)
 * and tests/fuzz/corpus/policy_oracle/. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/jdoc.h"
#include "tests/oracle/diff.h"

#define NO_BUDGET UINT32_MAX /* jdoc_init's: no limit */

/* One parse of the body: the level and budget it ran with, what jdoc_parse returned, and the
 * document (tape, error, units met). */
typedef struct {
    int level;
    uint32_t budget;
    int rc;
    jdoc_t d;
} parse_t;

static void parse_at(parse_t *p, int level, uint32_t budget, const char *body, size_t n)
{
    jdoc_simd_select(level);
    p->level = level;
    p->budget = budget;
    p->d.budget = budget;
    p->rc = jdoc_parse(&p->d, body, n, JDOC_OBJECT_ONLY);
}

/* The work units the parse met: JDOC_TOKEN_UNITS a token, and its slow steps. */
static uint64_t units(const parse_t *p)
{
    return (uint64_t)p->d.ntoks * JDOC_TOKEN_UNITS + p->d.nslow;
}

/* Did the parse stop at its budget (no verdict on the body)? */
static bool stopped(const parse_t *p)
{
    return p->rc != 0 && jdoc_over_budget(&p->d);
}

/* The same verdict, error, its byte and duplicate key, and token tape? */
static bool same_outcome(const parse_t *a, const parse_t *b)
{
    if (a->rc != b->rc || a->d.ntoks != b->d.ntoks)
        return false;
    if (a->rc != 0)
        return strcmp(a->d.err, b->d.err) == 0 && a->d.err_at == b->d.err_at &&
               a->d.err_tok == b->d.err_tok;
    for (uint32_t k = 0; k < a->d.ntoks; k++) {
        const jtok_t *x = &a->d.toks[k], *y = &b->d.toks[k];
        if (x->start != y->start || x->len != y->len || x->end != y->end || x->aux != y->aux ||
            x->aux2 != y->aux2 || x->type != y->type || x->flags != y->flags)
            return false;
    }
    return true;
}

static void describe(const char *name, const parse_t *p)
{
    char budget[24] = "none";
    if (p->budget != NO_BUDGET)
        snprintf(budget, sizeof(budget), "%u", p->budget);
    fprintf(stderr, "  %-5s level %d, budget %s: ", name, p->level, budget);
    if (p->rc == 0)
        fprintf(stderr, "accepted");
    else
        fprintf(stderr, "%s at %zu", p->d.err, p->d.err_at);
    fprintf(stderr, ", %u tokens, %llu units\n", p->d.ntoks, (unsigned long long)units(p));
}

static void fail(const char *rule, const parse_t *got, const parse_t *ref)
{
    fprintf(stderr, "parse breaks \"%s\":\n", rule);
    describe("got", got);
    describe("ref", ref);
    abort();
}

/* Abort unless got's outcome is ref's or, when may_stop, got stopped at its budget. */
static void expect_same(const char *rule, const parse_t *got, const parse_t *ref, bool may_stop)
{
    if (!same_outcome(got, ref) && !(may_stop && stopped(got)))
        fail(rule, got, ref);
}

/* Parse the body at level under budget into got, then expect_same against ref. */
static void parse_and_compare(const char *rule, parse_t *got, int level, uint32_t budget,
                              const char *body, size_t n, const parse_t *ref, bool may_stop)
{
    parse_at(got, level, budget, body, n);
    expect_same(rule, got, ref, may_stop);
}

/* Multi-byte characters the body may hold: its UTF-8 lead bytes (and bytes that only look like
 * one, which makes the count an upper bound). */
static uint64_t lead_bytes(const char *body, size_t n)
{
    uint64_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += (unsigned char)body[i] >= 0xC0;
    return k;
}

/* The level that charges exactly as `level` does, at the same points of the body, or -1: SSE2
 * checks every multi-byte character on its own, as the byte loop does (only the search for a
 * plain run differs), and AVX-512 runs AVX2's 64-byte block loop with one vector instead of
 * two halves. */
static int charges_as(int level)
{
    switch (level) {
    case JDOC_SIMD_SSE2:
        return JDOC_SIMD_SCALAR;
    case JDOC_SIMD_AVX512:
        return JDOC_SIMD_AVX2;
    default:
        return -1;
    }
}

/* What a level met without a budget against the byte loop's: the levels charge tokens,
 * escapes, long numbers and key sorts alike, and a multi-byte character in a string one unit
 * where it is checked on its own. AVX2 and AVX-512 validate a string's UTF-8 as they scan it
 * and charge nothing for its multi-byte characters when it passes; one they refuse is scanned
 * again by the checking path, which charges as the byte loop does. So a level meets at most
 * the byte loop's units, and at least those less one per multi-byte character; the same as
 * the level it charges as. */
static void check_units(const parse_t *unlimited, int level, uint64_t multibyte)
{
    const parse_t *got = &unlimited[level], *scalar = &unlimited[JDOC_SIMD_SCALAR];
    uint64_t u = units(got), most = units(scalar);
    if (u > most)
        fail("a vector level meets no more units than the byte loop", got, scalar);
    if (u + multibyte < most)
        fail("a vector level leaves uncharged only multi-byte characters", got, scalar);
    int twin = charges_as(level);
    if (twin >= 0 && u != units(&unlimited[twin]))
        fail("a level meets the units of the level it charges as", got, &unlimited[twin]);
}

/* The budget the levels parse the body under, from byte 0's top three bits and the units the
 * parse without one met at the byte loop (most) and at the widest level (least): none; a unit
 * under least, or least (the widest level just stops, or just fits); a unit under most, or most
 * (the byte loop just stops, or just fits); a quarter, a half or three quarters of most (a stop
 * inside a string, a number, a key sort). Where the levels can differ, a body with multi-byte
 * characters between least and most, is narrow: a budget drawn from byte 0 alone would rarely
 * fall in it. */
static uint32_t budget_for(uint8_t sel, uint64_t most, uint64_t least)
{
    unsigned pick = sel >> 5;
    uint64_t b;
    switch (pick) {
    case 0:
        return NO_BUDGET;
    case 1:
        b = least ? least - 1 : 0;
        break;
    case 2:
        b = least;
        break;
    case 3:
        b = most ? most - 1 : 0;
        break;
    case 4:
        b = most;
        break;
    default:
        b = most * (pick - 4) / 4;
        break;
    }
    return b < NO_BUDGET ? (uint32_t)b : NO_BUDGET - 1;
}

/* The body at every level up to top under budget (into capped[level]), against the same level
 * without one (unlimited[level]) and the byte loop under the budget:
 * - A budget stops a parse or changes nothing: jdoc_parse only compares the units met with it
 *   and, past it, stops with jdoc_over_budget; a vector level that runs out inside a string
 *   scans it again with the checking path, from its quote, as any string it refuses. So a
 *   budgeted parse never accepts what the parse without one refuses, nor refuses it another
 *   way, nor gives another tape.
 * - Within its budget a parse runs as without one: the units met only grow as the parse goes,
 *   so no check sees more than the parse without a budget met in all. The one exception, a
 *   vector level counting a block's escapes in a string it refuses anyway (an invalid UTF-8
 *   byte before them), ends as that refusal does: in the checking path's scan from the quote.
 * - Nor does a parse run on past its budget: each slow step is checked as it is charged (the
 *   escapes of a 64-byte block all together, before they are added), and the tokens at the
 *   start of every value, key or close; a parse that does not stop has met at most its budget
 *   or, refused, one token more (a key pushed just before the ':' after it is found missing).
 * - A vector level charges no more than the byte loop: it charges as the byte loop does but
 *   for the multi-byte characters in the strings it passes, and a block's escapes it counts at
 *   once the byte loop counts too, with at least as much met before, by the last of them; a
 *   string it runs out in or refuses it scans again as the byte loop does. So where the byte
 *   loop gets through under the budget, accepting or refusing, every level does too, with the
 *   same outcome.
 * - A level that charges as another does (charges_as) stops where that one does, with the
 *   same units met. */
static void check_budget(const char *body, size_t n, int top, uint32_t budget,
                         const parse_t *unlimited, parse_t *capped)
{
    const parse_t *scalar = &capped[JDOC_SIMD_SCALAR];
    for (int level = JDOC_SIMD_SCALAR; level <= top; level++) {
        parse_t *p = &capped[level];
        parse_and_compare("a budget stops a parse or changes nothing", p, level, budget, body, n,
                          &unlimited[level], true);
        if (budget >= units(&unlimited[level]))
            expect_same("within its budget a parse runs as without one", p, &unlimited[level],
                        false);
        if (!stopped(p) && units(p) > (uint64_t)budget + (p->rc ? JDOC_TOKEN_UNITS : 0))
            fail("a parse does not run past its budget", p, &unlimited[level]);
        if (level > JDOC_SIMD_SCALAR && !stopped(scalar))
            expect_same("a vector level charges no more than the byte loop", p, scalar, false);
        int twin = charges_as(level);
        if (twin >= 0 && (!same_outcome(p, &capped[twin]) || units(p) != units(&capped[twin])))
            fail("a level stops where the level it charges as does", p, &capped[twin]);
    }
}

/* The body's parse at every level up to top, without a budget and then under the one byte 0
 * selects. */
static void check_parse(uint8_t sel, const char *body, size_t n, int top)
{
    parse_t unlimited[JDOC_SIMD_BEST + 1], capped[JDOC_SIMD_BEST + 1];
    for (int level = JDOC_SIMD_SCALAR; level <= top; level++) {
        jdoc_init(&unlimited[level].d);
        jdoc_init(&capped[level].d);
    }
    const parse_t *scalar = &unlimited[JDOC_SIMD_SCALAR];
    parse_at(&unlimited[JDOC_SIMD_SCALAR], JDOC_SIMD_SCALAR, NO_BUDGET, body, n);
    uint64_t multibyte = lead_bytes(body, n);
    for (int level = JDOC_SIMD_SSE2; level <= top; level++) {
        parse_and_compare("every level parses as the byte loop", &unlimited[level], level,
                          NO_BUDGET, body, n, scalar, false);
        check_units(unlimited, level, multibyte);
    }
    uint32_t budget = budget_for(sel, units(scalar), units(&unlimited[top]));
    if (budget != NO_BUDGET)
        check_budget(body, n, top, budget, unlimited, capped);
    for (int level = JDOC_SIMD_SCALAR; level <= top; level++) {
        jdoc_free(&unlimited[level].d);
        jdoc_free(&capped[level].d);
    }
    jdoc_simd_select(JDOC_SIMD_BEST);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char why[1024];
    /* A private copy: the fuzzer's buffer has no slack after it, so overreads show. */
    uint8_t *copy = malloc(size ? size : 1);
    memcpy(copy, data, size);
    if (diff_check(copy, size, why, sizeof(why)) != 0) {
        fprintf(stderr, "oracle disagreement: %s\n", why);
        abort();
    }
    int top = jdoc_simd_select(JDOC_SIMD_BEST);
    if (top > JDOC_SIMD_AVX2) {
        jdoc_simd_select(JDOC_SIMD_AVX2);
        int rc = diff_check(copy, size, why, sizeof(why));
        jdoc_simd_select(JDOC_SIMD_BEST);
        if (rc != 0) {
            fprintf(stderr, "oracle disagreement at the AVX2 level: %s\n", why);
            abort();
        }
    }
    if (size > 0)
        check_parse(copy[0], (const char *)copy + 1, size - 1, top);
    free(copy);
    return 0;
}
