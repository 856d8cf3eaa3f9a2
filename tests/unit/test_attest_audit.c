/* The audit chain (docs/operations.md "Evidence"): prev_sha256 splicing, signed checkpoints,
 * resuming a file's chain, the body store, and every break audit_verify_file must name. */
#define _GNU_SOURCE /* memmem */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "attest/audit.h"
#include "common/util.h"

static char g_dir[64];
static attest_key_t *g_priv, *g_pub, *g_other;

static attest_key_t *load(const char *prefix, bool priv)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/%s.%s.pem", g_dir, prefix, priv ? "key" : "pub");
    attest_key_t *k = NULL;
    dp_buf_t err = {0};
    cr_assert_eq(attest_key_load(path, priv, &k, &err), 0, "%s", err.base ? err.base : "");
    dp_buf_free(&err);
    return k;
}

static void setup(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/dp-audit-unit-XXXXXX");
    cr_assert(mkdtemp(g_dir));
    char p[128];
    dp_buf_t err = {0};
    snprintf(p, sizeof(p), "%s/k", g_dir);
    cr_assert_eq(attest_keygen(p, NULL, &err), 0);
    snprintf(p, sizeof(p), "%s/o", g_dir);
    cr_assert_eq(attest_keygen(p, NULL, &err), 0);
    dp_buf_free(&err);
    g_priv = load("k", true);
    g_pub = load("k", false);
    g_other = load("o", false);
}

static void teardown(void)
{
    attest_key_free(g_priv);
    attest_key_free(g_pub);
    attest_key_free(g_other);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(audit, .init = setup, .fini = teardown);

static void sha_of_line(const char *line, char out[65])
{
    const char *nl = strchr(line, '\n');
    dp_sha256_hex(line, nl ? (size_t)(nl - line) : strlen(line), out);
}

Test(audit, append_splices_prev_and_chains)
{
    audit_chain_t c;
    audit_chain_init(&c);
    dp_buf_t out = {0};
    cr_assert_eq(audit_chain_append(&c, "{\"a\":1}\n", 8, &out), 0);
    cr_assert_str_eq(out.base, "{\"a\":1,\"prev_sha256\":\"" AUDIT_GENESIS "\"}\n");
    char h1[65];
    sha_of_line(out.base, h1);
    cr_assert_str_eq(c.prev, h1);
    size_t second = out.len;
    cr_assert_eq(audit_chain_append(&c, "{}", 2, &out), 0);
    dp_buf_appendc(&out, '\0');
    char want[128];
    snprintf(want, sizeof(want), "{\"prev_sha256\":\"%s\"}\n", h1);
    cr_assert_str_eq(out.base + second, want);
    cr_assert_eq(c.since_checkpoint, 2);
    out.len--;
    size_t len = out.len;
    cr_assert_eq(audit_chain_append(&c, "[1]", 3, &out), -1);
    cr_assert_eq(audit_chain_append(&c, "", 0, &out), -1);
    /* a line audit verify would refuse as too long: nothing appended, the chain unmoved */
    char prev[65];
    memcpy(prev, c.prev, sizeof(prev));
    size_t big = AUDIT_LINE_MAX - 20;
    char *line = malloc(big);
    memset(line, ' ', big);
    memcpy(line, "{\"a\":\"", 6);
    memcpy(line + big - 2, "\"}", 2);
    cr_assert_eq(audit_chain_append(&c, line, big, &out), -1);
    cr_assert_str_eq(c.prev, prev);
    free(line);
    cr_assert_eq(out.len, len, "a refused line appends nothing");
    cr_assert_eq(c.since_checkpoint, 2);
    dp_buf_free(&out);
}

Test(audit, checkpoint_is_signed_over_its_prefix)
{
    audit_chain_t c;
    audit_chain_init(&c);
    dp_buf_t out = {0};
    audit_chain_append(&c, "{\"a\":1}", 7, &out);
    char before[65];
    memcpy(before, c.prev, 65);
    size_t start = out.len;
    cr_assert_eq(audit_chain_checkpoint(&c, g_priv, "interval", 1767225600000ull, &out), 0);
    dp_buf_appendc(&out, '\0');
    const char *cp = out.base + start;
    cr_assert(strstr(cp, "{\"checkpoint\":{\"reason\":\"interval\",\"time\":"
                         "\"2026-01-01T00:00:00.000Z\",\"lines\":1,\"seq\":1},\"prev_sha256\":\""));
    cr_assert(strstr(cp, before));
    cr_assert(strstr(cp, attest_key_id(g_pub)));
    cr_assert_eq(c.since_checkpoint, 0);
    char h[65];
    sha_of_line(cp, h);
    cr_assert_str_eq(c.prev, h);
    const char *mark = strstr(cp, ",\"sig\":\"");
    cr_assert(mark);
    const char *b64 = mark + 8;
    size_t blen = (size_t)(strchr(b64, '"') - b64);
    dp_buf_t sig = {0};
    cr_assert_eq(attest_b64_decode_any(b64, blen, &sig), 0);
    cr_assert_eq(sig.len, 64);
    cr_assert(attest_key_verify(g_pub, cp, (size_t)(mark - cp), sig.base, sig.len));
    cr_assert_not(attest_key_verify(g_other, cp, (size_t)(mark - cp), sig.base, sig.len));
    cr_assert_not(attest_key_verify(g_pub, cp, (size_t)(mark - cp) - 1, sig.base, sig.len));
    /* a public key cannot sign */
    cr_assert_eq(audit_chain_checkpoint(&c, g_pub, "interval", 0, &out), -1);
    dp_buf_free(&sig);
    dp_buf_free(&out);
}

/* A file of n lines with a checkpoint after every k, and one at the end. */
static void write_file(const char *path, int n, int k, dp_buf_t *out)
{
    audit_chain_t c;
    audit_chain_init(&c);
    dp_buf_reset(out);
    for (int i = 0; i < n; i++) {
        char line[64];
        int len = snprintf(line, sizeof(line), "{\"request_id\":\"r%d\",\"status\":200}", i);
        audit_chain_append(&c, line, (size_t)len, out);
        if ((i + 1) % k == 0)
            audit_chain_checkpoint(&c, g_priv, "interval", 1, out);
    }
    if (c.since_checkpoint)
        audit_chain_checkpoint(&c, g_priv, "shutdown", 1, out);
    FILE *f = fopen(path, "w");
    fwrite(out->base, 1, out->len, f);
    fclose(f);
}

static void put(const char *path, const dp_buf_t *b)
{
    FILE *f = fopen(path, "w");
    fwrite(b->base, 1, b->len, f);
    fclose(f);
}

/* verify path with o, expecting a break whose reason names why_part: the line it is at. */
static uint64_t verify_break_opts(const char *path, const audit_verify_opts_t *o,
                                  const char *why_part)
{
    audit_verify_result_t r;
    dp_buf_t why = {0};
    cr_assert_eq(audit_verify_file(path, o, &r, &why), -1, "expected a break (%s)", why_part);
    dp_buf_appendc(&why, '\0');
    cr_assert(strstr(why.base, why_part), "'%s' does not say '%s'", why.base, why_part);
    dp_buf_free(&why);
    return r.bad_line;
}

static uint64_t verify_break(const char *path, const attest_key_t *pub, const char *expect_prev,
                             const char *why_part)
{
    audit_verify_opts_t o = {.pubkey = pub, .expect_prev = expect_prev};
    return verify_break_opts(path, &o, why_part);
}

Test(audit, verify_intact_and_every_break)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/a.jsonl", g_dir);
    dp_buf_t good = {0}, bad = {0};
    write_file(path, 5, 2, &good); /* r0 r1 cp r2 r3 cp r4 cp: 8 lines */
    audit_verify_opts_t o = {.pubkey = g_pub};
    audit_verify_result_t r;
    dp_buf_t why = {0};
    cr_assert_eq(audit_verify_file(path, &o, &r, &why), 0, "%.*s", (int)why.len, why.base);
    cr_assert_eq(r.lines, 8);
    cr_assert_eq(r.checkpoints, 3);
    cr_assert_eq(r.signatures_checked, 3);
    cr_assert_eq(r.unsigned_tail, 0);
    cr_assert_str_eq(r.first_prev, AUDIT_GENESIS);
    char last[65];
    memcpy(last, r.last, 65);

    /* Without a key: the chain is still checked, the signatures are not. */
    o.pubkey = NULL;
    cr_assert_eq(audit_verify_file(path, &o, &r, &why), 0);
    cr_assert_eq(r.signatures_checked, 0);

    /* A changed byte in line 1: line 2 names the break. */
    dp_buf_reset(&bad);
    dp_buf_append(&bad, good.base, good.len);
    char *s = memmem(bad.base, bad.len, "200", 3);
    s[2] = '1';
    put(path, &bad);
    cr_assert_eq(verify_break(path, g_pub, NULL, "chain broken"), 2);

    /* A deleted line. */
    dp_buf_reset(&bad);
    char *nl = memchr(good.base, '\n', good.len);
    dp_buf_append(&bad, good.base, (size_t)(nl + 1 - good.base));
    char *nl2 = memchr(nl + 1, '\n', good.len);
    dp_buf_append(&bad, nl2 + 1, good.len - (size_t)(nl2 + 1 - good.base));
    put(path, &bad);
    cr_assert_eq(verify_break(path, g_pub, NULL, "chain broken"), 2);

    /* The wrong key. */
    put(path, &good);
    cr_assert_eq(verify_break(path, g_other, NULL, "not by the --pubkey"), 3);

    /* A flipped signature byte (the next line then breaks too: the first break is named). */
    dp_buf_reset(&bad);
    dp_buf_append(&bad, good.base, good.len);
    char *sig = memmem(bad.base, bad.len, ",\"sig\":\"", 8) + 8;
    sig[0] = sig[0] == 'A' ? 'B' : 'A';
    put(path, &bad);
    cr_assert_eq(verify_break(path, g_pub, NULL, "bad signature"), 3);

    /* A torn last line. */
    dp_buf_reset(&bad);
    dp_buf_append(&bad, good.base, good.len - 5);
    put(path, &bad);
    cr_assert_eq(verify_break(path, g_pub, NULL, "incomplete last line"), 8);

    /* Not the file that follows the expected one. */
    put(path, &good);
    cr_assert_eq(verify_break(path, g_pub, last, "the previous file ended with"), 1);

    /* Garbage. */
    dp_buf_reset(&bad);
    dp_buf_appends(&bad, "{\"a\":1}\n");
    put(path, &bad);
    cr_assert_eq(verify_break(path, g_pub, NULL, "no prev_sha256"), 1);
    dp_buf_reset(&bad);
    dp_buf_appends(&bad, "not json\n");
    put(path, &bad);
    cr_assert_eq(verify_break(path, g_pub, NULL, "not a JSON object"), 1);

    dp_buf_free(&why);
    dp_buf_free(&good);
    dp_buf_free(&bad);
}

/* A chain begun at genesis with one line, {"x":1}, to be put at g_dir/name. */
static void chain_begin(char path[128], const char *name, audit_chain_t *c, dp_buf_t *out)
{
    snprintf(path, 128, "%s/%s", g_dir, name);
    audit_chain_init(c);
    *out = (dp_buf_t){0};
    audit_chain_append(c, "{\"x\":1}", 7, out);
}

Test(audit, checkpoint_line_count_must_match)
{
    char path[128];
    audit_chain_t c;
    dp_buf_t out;
    chain_begin(path, "b.jsonl", &c, &out);
    audit_chain_checkpoint(&c, g_priv, "interval", 1, &out);
    audit_chain_append(&c, "{\"x\":2}", 7, &out);
    c.since_checkpoint = 5; /* a checkpoint claiming lines that are not there */
    audit_chain_checkpoint(&c, g_priv, "interval", 1, &out);
    put(path, &out);
    cr_assert_eq(verify_break(path, g_pub, NULL, "says 5 lines"), 4);
    dp_buf_free(&out);
}

/* The longest line chain_append takes, after another line, and a torn fragment almost as long
 * after it: the resume finds that line whole (verify takes it, so a restart must too). */
Test(audit, resume_takes_the_longest_line_with_a_torn_fragment_after_it)
{
    char path[128];
    audit_chain_t c;
    dp_buf_t out;
    chain_begin(path, "long.jsonl", &c, &out);
    size_t room = AUDIT_LINE_MAX - 81; /* its "}" becomes ,"prev_sha256":"<64>"} */
    char *line = malloc(room);
    memset(line, 'a', room);
    memcpy(line, "{\"a\":\"", 6);
    memcpy(line + room - 2, "\"}", 2);
    size_t at = out.len;
    cr_assert_eq(audit_chain_append(&c, line, room, &out), 0);
    cr_assert_eq(out.len - at - 1, AUDIT_LINE_MAX, "the line is as long as verify takes");
    char want[65];
    memcpy(want, c.prev, 65);
    dp_buf_append(&out, line, room); /* the fragment: no newline */
    put(path, &out);
    audit_chain_t d;
    audit_torn_t torn;
    cr_assert_eq(audit_chain_resume_torn(&d, path, &torn), 0);
    cr_assert_str_eq(d.prev, want);
    cr_assert(torn.torn);
    cr_assert_eq(torn.len, room);
    free(line);
    dp_buf_free(&out);
}

Test(audit, resume_continues_from_the_last_complete_line)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/c.jsonl", g_dir);
    audit_chain_t c;
    cr_assert_eq(audit_chain_resume(&c, path), 0, "absent file: genesis");
    cr_assert_str_eq(c.prev, AUDIT_GENESIS);
    dp_buf_t out = {0};
    audit_chain_append(&c, "{\"x\":1}", 7, &out);
    audit_chain_append(&c, "{\"x\":2}", 7, &out);
    char want[65];
    memcpy(want, c.prev, 65);
    dp_buf_appends(&out, "{\"torn");
    put(path, &out);
    audit_chain_t d;
    cr_assert_eq(audit_chain_resume(&d, path), 0);
    cr_assert_str_eq(d.prev, want);
    cr_assert_eq(d.since_checkpoint, 2, "no checkpoint yet: both lines count");
    /* After a checkpoint, only the lines that follow it count (a crash after them). */
    out.len -= strlen("{\"torn");
    audit_chain_checkpoint(&c, g_priv, "interval", 1, &out);
    audit_chain_append(&c, "{\"x\":3}", 7, &out);
    put(path, &out);
    cr_assert_eq(audit_chain_resume(&d, path), 0);
    cr_assert_str_eq(d.prev, c.prev);
    cr_assert_eq(d.since_checkpoint, 1);
    dp_buf_free(&out);
}

Test(audit, store_put_is_content_addressed)
{
    char hex[65];
    dp_sha256_hex("body", 4, hex);
    const char *op = NULL;
    cr_assert_eq(audit_store_put(g_dir, hex, "body", 4, &op), 0);
    cr_assert_eq(audit_store_put(g_dir, hex, "body", 4, &op), 0, "already there: fine");
    char path[160];
    snprintf(path, sizeof(path), "%s/%s", g_dir, hex);
    dp_buf_t b = {0};
    cr_assert_eq(dp_read_file(path, 100, &b), 0);
    cr_assert_eq(b.len, 4);
    cr_assert_eq(memcmp(b.base, "body", 4), 0);
    dp_buf_free(&b);
    cr_assert_lt(audit_store_put("/nonexistent-dir", hex, "body", 4, &op), 0);
    cr_assert_str_eq(op, "open");
}

Test(audit, checkpoints_are_numbered_and_resumed)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/s.jsonl", g_dir);
    dp_buf_t out = {0};
    write_file(path, 5, 2, &out); /* checkpoints 1, 2, 3 */
    cr_assert(memmem(out.base, out.len, "\"seq\":3}", 8));
    audit_chain_t c;
    cr_assert_eq(audit_chain_resume(&c, path), 0);
    cr_assert_eq(c.seq, 3);
    cr_assert_str_eq(c.checkpoint, c.prev, "the last line is checkpoint 3");
    dp_buf_free(&out);
}

Test(audit, anchors_seq_gaps_and_rewrites)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/n.jsonl", g_dir);
    dp_buf_t out = {0};
    write_file(path, 4, 2, &out); /* r0 r1 cp1 r2 r3 cp2 */
    audit_chain_t c;
    cr_assert_eq(audit_chain_resume(&c, path), 0);
    audit_anchor_t a = {.seq = 2};
    memcpy(a.sha256, c.checkpoint, 65);
    audit_verify_opts_t o = {.anchors = &a, .nanchors = 1};
    audit_verify_result_t r;
    dp_buf_t why = {0};
    cr_assert_eq(audit_verify_file(path, &o, &r, &why), 0, "%.*s", (int)why.len, why.base);
    cr_assert(a.found);
    cr_assert_eq(r.first_seq, 1);
    cr_assert_eq(r.last_seq, 2);
    a.sha256[0] = a.sha256[0] == 'a' ? 'b' : 'a';
    a.found = false;
    cr_assert_eq(audit_verify_file(path, &o, &r, &why), -1);
    dp_buf_appendc(&why, '\0');
    cr_assert(strstr(why.base, "rewritten"), "%s", why.base);
    /* The previous file ended at seq 5: this file's seq 1 is a gap (or a restart elsewhere). */
    dp_buf_reset(&why);
    audit_verify_opts_t o2 = {.prev_seq = 5};
    cr_assert_eq(audit_verify_file(path, &o2, &r, &why), -1);
    dp_buf_appendc(&why, '\0');
    cr_assert(strstr(why.base, "seq 1 follows seq 5"), "%s", why.base);
    dp_buf_free(&why);
    dp_buf_free(&out);
}

Test(audit, a_torn_tail_is_described_and_repaired)
{
    char path[128], next[128];
    snprintf(path, sizeof(path), "%s/t.jsonl", g_dir);
    snprintf(next, sizeof(next), "%s/t2.jsonl", g_dir);
    dp_buf_t out = {0};
    audit_chain_t c;
    audit_chain_init(&c);
    audit_chain_append(&c, "{\"x\":1}", 7, &out);
    size_t whole = out.len;
    dp_buf_appends(&out, "{\"x\":2,\"to");
    put(path, &out);
    audit_torn_t t;
    cr_assert_eq(audit_chain_resume_torn(&c, path, &t), 0);
    cr_assert(t.torn);
    cr_assert_eq(t.offset, whole);
    cr_assert_eq(t.len, 10);
    char want[65];
    dp_sha256_hex("{\"x\":2,\"to", 10, want);
    cr_assert_str_eq(t.sha256, want);
    dp_buf_t rep = {0};
    audit_chain_repair(&c, &t, "t.jsonl.torn-X", 1, &rep);
    audit_chain_append(&c, "{\"x\":3}", 7, &rep);
    put(next, &rep);
    /* The torn file alone: a break. Both, in order: whole, and the repair reported. */
    audit_verify_opts_t o = {0};
    audit_verify_result_t r;
    dp_buf_t why = {0};
    cr_assert_eq(audit_verify_file(path, &o, &r, &why), -1);
    o.allow_torn = true;
    dp_buf_reset(&why);
    cr_assert_eq(audit_verify_file(path, &o, &r, &why), 0, "%.*s", (int)why.len, why.base);
    cr_assert(r.torn.torn);
    audit_torn_t seen = r.torn;
    char last[65];
    memcpy(last, r.last, 65);
    audit_verify_opts_t o2 = {.expect_prev = last, .expect_torn = &seen};
    cr_assert_eq(audit_verify_file(next, &o2, &r, &why), 0, "%.*s", (int)why.len, why.base);
    cr_assert(r.repaired);
    cr_assert_eq(r.repaired_offset, whole);
    /* A repair line after an intact file: a break. */
    audit_verify_opts_t o3 = {.expect_prev = last};
    dp_buf_reset(&why);
    cr_assert_eq(audit_verify_file(next, &o3, &r, &why), -1);
    dp_buf_free(&why);
    dp_buf_free(&rep);
    dp_buf_free(&out);
}

/* A crash far from the last checkpoint: more than AUDIT_TAIL_MAX of lines after it. Resume must
 * count every one of them (the next checkpoint says how many) and still find that checkpoint,
 * and a file with no checkpoint at all counts all its lines. */
Test(audit, resume_counts_lines_beyond_the_tail_window)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/big.jsonl", g_dir);
    dp_buf_t out = {0};
    audit_chain_t c;
    audit_chain_init(&c);
    char pad[301];
    memset(pad, 'x', sizeof(pad) - 1);
    pad[sizeof(pad) - 1] = '\0';
    char line[400];
    for (int i = 0; i < 3; i++) {
        int len = snprintf(line, sizeof(line), "{\"request_id\":\"a%d\",\"pad\":\"%s\"}", i, pad);
        audit_chain_append(&c, line, (size_t)len, &out);
    }
    audit_chain_checkpoint(&c, g_priv, "reopen", 1, &out);
    char cp[65];
    memcpy(cp, c.checkpoint, 65);
    size_t before = out.len;
    const int n = 10000; /* ~3.6 MiB */
    for (int i = 0; i < n; i++) {
        int len = snprintf(line, sizeof(line), "{\"request_id\":\"r%d\",\"pad\":\"%s\"}", i, pad);
        audit_chain_append(&c, line, (size_t)len, &out);
    }
    cr_assert_gt(out.len - before, 3 * (size_t)AUDIT_TAIL_MAX / 2);
    size_t whole = out.len;
    dp_buf_appends(&out, "{\"request_id\":\"torn");
    put(path, &out);
    audit_chain_t d;
    audit_torn_t t;
    cr_assert_eq(audit_chain_resume_torn(&d, path, &t), 0);
    cr_assert_str_eq(d.prev, c.prev);
    cr_assert_eq(d.since_checkpoint, (uint64_t)n, "counted %llu lines since the checkpoint",
                 (unsigned long long)d.since_checkpoint);
    cr_assert_eq(d.seq, 1);
    cr_assert_str_eq(d.checkpoint, cp);
    cr_assert(t.torn);
    cr_assert_eq(t.offset, whole);
    /* The next checkpoint's count verifies. */
    out.len = whole;
    audit_chain_checkpoint(&d, g_priv, "shutdown", 1, &out);
    put(path, &out);
    audit_verify_opts_t o = {.pubkey = g_pub};
    audit_verify_result_t r;
    dp_buf_t why = {0};
    cr_assert_eq(audit_verify_file(path, &o, &r, &why), 0, "%.*s", (int)why.len, why.base);
    cr_assert_eq(r.signatures_checked, 2);
    /* No checkpoint anywhere: every line counts. */
    audit_chain_init(&c);
    dp_buf_reset(&out);
    for (int i = 0; i < n; i++) {
        int len = snprintf(line, sizeof(line), "{\"request_id\":\"r%d\",\"pad\":\"%s\"}", i, pad);
        audit_chain_append(&c, line, (size_t)len, &out);
    }
    put(path, &out);
    cr_assert_eq(audit_chain_resume(&d, path), 0);
    cr_assert_eq(d.since_checkpoint, (uint64_t)n);
    cr_assert_eq(d.seq, 0);
    cr_assert_str_eq(d.checkpoint, "");
    dp_buf_free(&why);
    dp_buf_free(&out);
}

/* A line of a request whose forwarded body is `body` (hash in `hex`), chained into out, marked
 * unstored or not. */
static void body_line(audit_chain_t *c, const char *id, const char *body, bool unstored,
                      char hex[65], dp_buf_t *out)
{
    dp_sha256_hex(body, strlen(body), hex);
    char line[256];
    int len = snprintf(line, sizeof(line),
                       "{\"request_id\":\"%s\",\"forwarded_body_sha256\":\"%s\",\"status\":200}",
                       id, hex);
    if (unstored)
        cr_assert_eq(audit_chain_append_unstored(c, line, (size_t)len, out), 0);
    else
        cr_assert_eq(audit_chain_append(c, line, (size_t)len, out), 0);
}

static void store(const char *dir, const char *hex, const char *bytes)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/%s", dir, hex);
    FILE *f = fopen(path, "w");
    fputs(bytes, f);
    fclose(f);
}

static uint64_t verify_store_break(const char *path, const char *dir, const char *why_part)
{
    audit_verify_opts_t o = {.pubkey = g_pub, .store = dir};
    return verify_break_opts(path, &o, why_part);
}

Test(audit, append_unstored_marks_the_line_before_prev)
{
    audit_chain_t c;
    audit_chain_init(&c);
    dp_buf_t out = {0};
    cr_assert_eq(audit_chain_append_unstored(&c, "{\"a\":1}\n", 8, &out), 0);
    dp_buf_appendc(&out, '\0');
    cr_assert_str_eq(out.base,
                     "{\"a\":1,\"bodies_stored\":false,\"prev_sha256\":\"" AUDIT_GENESIS "\"}\n");
    out.len--;
    char h[65];
    sha_of_line(out.base, h);
    cr_assert_str_eq(c.prev, h, "the marker is part of the chained bytes");
    size_t second = out.len;
    cr_assert_eq(audit_chain_append_unstored(&c, "{}", 2, &out), 0);
    dp_buf_appendc(&out, '\0');
    cr_assert(strncmp(out.base + second, "{\"bodies_stored\":false,\"prev_sha256\":", 37) == 0,
              "%s", out.base + second);
    cr_assert_eq(c.since_checkpoint, 2);
    dp_buf_free(&out);
}

/* The marker excuses a body file absent from the store, and nothing else: a present body is
 * checked against its name, a line without the marker still needs its bodies, the marker
 * cannot be added to a line afterwards, and only the writer's form of it is taken. */
Test(audit, unstored_lines_excuse_only_missing_bodies)
{
    char path[128], dir[128];
    snprintf(path, sizeof(path), "%s/u.jsonl", g_dir);
    snprintf(dir, sizeof(dir), "%s/ustore", g_dir);
    cr_assert_eq(mkdir(dir, 0700), 0);
    audit_chain_t c;
    audit_chain_init(&c);
    dp_buf_t good = {0}, bad = {0};
    char h1[65], h2[65], h3[65];
    body_line(&c, "r1", "stored", false, h1, &good);
    body_line(&c, "r2", "lost", true, h2, &good);
    body_line(&c, "r3", "kept anyway", true, h3, &good);
    audit_chain_checkpoint(&c, g_priv, "shutdown", 1, &good);
    put(path, &good);
    store(dir, h1, "stored");
    store(dir, h3, "kept anyway");
    audit_verify_opts_t o = {.pubkey = g_pub, .store = dir};
    audit_verify_result_t r;
    dp_buf_t why = {0};
    cr_assert_eq(audit_verify_file(path, &o, &r, &why), 0, "%.*s", (int)why.len, why.base);
    cr_assert_eq(r.unstored, 2);
    cr_assert_eq(r.unstored_missing, 1);
    cr_assert_eq(r.bodies_checked, 2, "the bodies present are checked, marker or not");
    cr_assert_eq(r.signatures_checked, 1);

    /* A body present under an unstored line's name with other bytes: altered. */
    store(dir, h2, "not lost");
    cr_assert_eq(verify_store_break(path, dir, "was altered"), 2);
    char p2[256];
    snprintf(p2, sizeof(p2), "%s/%s", dir, h2);
    cr_assert_eq(unlink(p2), 0);

    /* A line without the marker whose body is missing: still a break. */
    snprintf(p2, sizeof(p2), "%s/%s", dir, h1);
    cr_assert_eq(unlink(p2), 0);
    cr_assert_eq(verify_store_break(path, dir, "stored body missing"), 1);

    /* The marker added to that line afterwards: the next line names the break. */
    const char *nl = memchr(good.base, '\n', good.len);
    const char *pv = memmem(good.base, (size_t)(nl - good.base), "\"prev_sha256\"", 13);
    dp_buf_reset(&bad);
    dp_buf_append(&bad, good.base, (size_t)(pv - good.base));
    dp_buf_appends(&bad, AUDIT_UNSTORED_MEMBER ",");
    dp_buf_append(&bad, pv, good.len - (size_t)(pv - good.base));
    put(path, &bad);
    cr_assert_eq(verify_store_break(path, dir, "chain broken"), 2);
    store(dir, h1, "stored");

    /* Only "bodies_stored":false as the member before prev_sha256 is the writer's: any other
     * form is a break even in a chain that holds (rewritten whole, here signed by our key). */
    const char *forms[] = {
        "{\"bodies_stored\":false,\"request_id\":\"r9\",\"forwarded_body_sha256\":\"%s\"}",
        "{\"request_id\":\"r9\",\"forwarded_body_sha256\":\"%s\",\"bodies_stored\":\"false\"}",
        "{\"request_id\":\"r9\",\"forwarded_body_sha256\":\"%s\",\"bodies_stored\":0}",
        "{\"request_id\":\"r9\",\"forwarded_body_sha256\":\"%s\",\"bodies_stored\":true}",
    };
    for (size_t i = 0; i < sizeof(forms) / sizeof(forms[0]); i++) {
        audit_chain_init(&c);
        dp_buf_reset(&bad);
        char line[256];
        int len = snprintf(line, sizeof(line), forms[i], h2);
        cr_assert_eq(audit_chain_append(&c, line, (size_t)len, &bad), 0);
        audit_chain_checkpoint(&c, g_priv, "shutdown", 1, &bad);
        put(path, &bad);
        cr_assert_eq(verify_store_break(path, dir, "bodies_stored: only false"), 1, "form %zu", i);
    }
    dp_buf_free(&why);
    dp_buf_free(&good);
    dp_buf_free(&bad);
}
