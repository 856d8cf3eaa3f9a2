/* Audit hash chain, checkpoints, body store and verifier (see audit.h). */
#define _GNU_SOURCE /* memmem */
#include "attest/audit.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/jw.h"
#include "common/util.h"

#define SIG_MARK ",\"sig\":\""

void audit_chain_init(audit_chain_t *c)
{
    memcpy(c->prev, AUDIT_GENESIS, sizeof(c->prev));
    c->since_checkpoint = 0;
    c->seq = 0;
    c->checkpoint[0] = '\0';
}

/* The hash of a line as the chain sees it: its bytes without the '\n'. */
static void line_hash(const char *p, size_t n, char out[65])
{
    if (n > 0 && p[n - 1] == '\n')
        n--;
    dp_sha256_hex(p, n, out);
}

#define CHECKPOINT_HEAD "{\"checkpoint\":"

/* The seq of a checkpoint line (0 when it has none: written before checkpoints were numbered). */
static uint64_t checkpoint_seq(const char *p, size_t n)
{
    cJSON *o = cJSON_ParseWithLength(p, n);
    const cJSON *s =
        cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, "checkpoint"), "seq");
    uint64_t seq = cJSON_IsNumber(s) ? dp_sat_u64(s->valuedouble) : 0;
    cJSON_Delete(o);
    return seq;
}

/* The checkpoint line p[0..n) (without its '\n') is the chain's last: its seq and hash into c. */
static void take_checkpoint(audit_chain_t *c, const char *p, size_t n)
{
    c->seq = checkpoint_seq(p, n);
    dp_sha256_hex(p, n, c->checkpoint);
}

#define BACK_CHUNK (64u * 1024)

/* After a crash the file ends without its shutdown checkpoint: the next checkpoint must count
 * the lines already there. The file's complete lines before offset `end` (0 or just after a
 * '\n') are read backwards in BACK_CHUNK pieces,
 * counted into c->since_checkpoint up to the last checkpoint, whose line (bounded by
 * AUDIT_LINE_MAX; a longer one is not ours and is counted as a line) gives c its seq and hash.
 * Memory stays bounded whatever the distance to that checkpoint. 0 or a negative errno. */
static int back_to_checkpoint(audit_chain_t *c, int fd, off_t end)
{
    const size_t head = strlen(CHECKPOINT_HEAD);
    char *buf = dp_xmalloc(BACK_CHUNK);
    off_t lo = end, hi = end; /* buf holds the file's bytes [lo, hi) */
    off_t e = end;            /* the end (after its '\n') of the line being looked at */
    int rc = 0;
    while (e > 0) {
        /* Find the line's start: after the last '\n' before e - 1, or the file's start. */
        off_t s = e - 1;
        for (;;) {
            if (s == 0)
                break;
            if (s <= lo) {
                off_t from = s > (off_t)BACK_CHUNK ? s - (off_t)BACK_CHUNK : 0;
                ssize_t got = pread(fd, buf, (size_t)(s - from), from);
                if (got != (ssize_t)(s - from)) {
                    rc = got < 0 ? -errno : -EIO;
                    goto out;
                }
                lo = from;
                hi = s;
            }
            const char *nl = memrchr(buf, '\n', (size_t)(s - lo));
            if (nl) {
                s = lo + (off_t)(nl - buf) + 1;
                break;
            }
            s = lo;
        }
        size_t n = (size_t)(e - 1 - s); /* the line without its '\n' */
        char h[sizeof(CHECKPOINT_HEAD)];
        bool cp = false;
        if (n > head) {
            if (s + (off_t)head <= hi && s >= lo) {
                memcpy(h, buf + (s - lo), head);
            } else if (pread(fd, h, head, s) != (ssize_t)head) {
                rc = -EIO;
                goto out;
            }
            cp = memcmp(h, CHECKPOINT_HEAD, head) == 0 && n <= AUDIT_LINE_MAX;
        }
        if (cp) {
            char *line = dp_xmalloc(n);
            ssize_t got = pread(fd, line, n, s);
            if (got == (ssize_t)n)
                take_checkpoint(c, line, n);
            else
                rc = got < 0 ? -errno : -EIO;
            free(line);
            goto out;
        }
        c->since_checkpoint++;
        e = s;
    }
out:
    free(buf);
    return rc;
}

int audit_chain_resume(audit_chain_t *c, const char *path)
{
    return audit_chain_resume_torn(c, path, NULL);
}

int audit_chain_resume_torn(audit_chain_t *c, const char *path, audit_torn_t *torn)
{
    audit_chain_init(c);
    if (torn)
        memset(torn, 0, sizeof(*torn));
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0 : -errno;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = -errno;
        close(fd);
        return e;
    }
    off_t size = st.st_size;
    size_t want = size > (off_t)AUDIT_TAIL_MAX ? AUDIT_TAIL_MAX : (size_t)size;
    char *buf = dp_xmalloc(want + 1);
    ssize_t got = pread(fd, buf, want, size - (off_t)want);
    int rc = 0;
    if (got < 0) {
        rc = -errno;
    } else {
        /* The last complete line; a torn tail (crash mid-write) after it is described. */
        size_t end = (size_t)got;
        while (end > 0 && buf[end - 1] != '\n')
            end--;
        bool partial = (off_t)want < size;
        if (end == 0 && partial) {
            rc = -EFBIG; /* no line end in the whole tail: not a file of ours */
        } else {
            if (torn && end < (size_t)got) {
                torn->torn = true;
                torn->offset = (uint64_t)(size - (off_t)got + (off_t)end);
                torn->len = (uint64_t)((size_t)got - end);
                dp_sha256_hex(buf + end, (size_t)got - end, torn->sha256);
            }
            if (end > 0) {
                size_t start = end - 1;
                while (start > 0 && buf[start - 1] != '\n')
                    start--;
                if (start > 0 || !partial) {
                    line_hash(buf + start, end - start, c->prev);
                    rc = back_to_checkpoint(c, fd, size - (off_t)got + (off_t)end);
                } else {
                    rc = -EFBIG; /* a last line longer than AUDIT_TAIL_MAX is not ours */
                }
            }
        }
    }
    free(buf);
    close(fd);
    if (rc != 0)
        audit_chain_init(c);
    return rc;
}

void audit_chain_repair(audit_chain_t *c, const audit_torn_t *t, const char *file, uint64_t wall_ms,
                        dp_buf_t *out)
{
    char ts[32];
    dp_iso8601(ts, wall_ms);
    dp_buf_t line = {0};
    dp_jw_t w;
    dp_jw_init(&w, &line);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_obj_begin(&w, "repair");
    dp_jw_str(&w, "reason", "torn_tail");
    dp_jw_str(&w, "file", file);
    dp_jw_uint(&w, "torn_offset", t->offset);
    dp_jw_uint(&w, "torn_bytes", t->len);
    dp_jw_str(&w, "torn_sha256", t->sha256);
    dp_jw_str(&w, "time", ts);
    dp_jw_obj_end(&w);
    dp_jw_obj_end(&w);
    audit_chain_append(c, line.base, line.len, out);
    dp_buf_free(&line);
}

/* audit_chain_append, with `extra` (members, NULL none) spliced in just before prev_sha256. */
static int chain_append(audit_chain_t *c, const char *line, size_t n, const char *extra,
                        dp_buf_t *out)
{
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == ' '))
        n--;
    if (n < 2 || line[0] != '{' || line[n - 1] != '}')
        return -1;
    assert(strlen(c->prev) == 64); /* the hash of the last line: audit_chain_init or _resume */
    size_t start = out->len;
    size_t body = n - 1;
    while (body > 1 && line[body - 1] == ' ')
        body--;
    dp_buf_append(out, line, n - 1);
    if (line[body - 1] != '{')
        dp_buf_appendc(out, ',');
    if (extra) {
        dp_buf_appends(out, extra);
        dp_buf_appendc(out, ',');
    }
    dp_buf_appends(out, "\"prev_sha256\":\"");
    dp_buf_append(out, c->prev, 64);
    dp_buf_appends(out, "\"}");
    if (out->len - start > AUDIT_LINE_MAX) {
        /* audit verify refuses such a line: it never goes in, and the chain stays where it was */
        out->len = start;
        out->base[start] = '\0';
        return -1;
    }
    line_hash(out->base + start, out->len - start, c->prev);
    dp_buf_appendc(out, '\n');
    c->since_checkpoint++;
    return 0;
}

int audit_chain_append(audit_chain_t *c, const char *line, size_t n, dp_buf_t *out)
{
    return chain_append(c, line, n, NULL, out);
}

int audit_chain_append_unstored(audit_chain_t *c, const char *line, size_t n, dp_buf_t *out)
{
    return chain_append(c, line, n, AUDIT_UNSTORED_MEMBER, out);
}

int audit_chain_checkpoint(audit_chain_t *c, const attest_key_t *key, const char *reason,
                           uint64_t wall_ms, dp_buf_t *out)
{
    char ts[32];
    dp_iso8601(ts, wall_ms);
    size_t start = out->len;
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_obj_begin(&w, "checkpoint");
    dp_jw_str(&w, "reason", reason);
    dp_jw_str(&w, "time", ts);
    dp_jw_uint(&w, "lines", c->since_checkpoint);
    dp_jw_uint(&w, "seq", c->seq + 1);
    dp_jw_obj_end(&w);
    dp_jw_str(&w, "prev_sha256", c->prev);
    dp_jw_str(&w, "keyid", attest_key_id(key));
    /* The signed bytes: the line so far, before the writer closes the object. */
    unsigned char sig[ATTEST_SIG_LEN];
    if (attest_key_sign(key, out->base + start, out->len - start, sig) != 0) {
        out->len = start;
        return -1;
    }
    dp_buf_appends(out, SIG_MARK);
    dp_base64_encode(sig, sizeof(sig), out);
    dp_buf_appends(out, "\"}");
    line_hash(out->base + start, out->len - start, c->prev);
    memcpy(c->checkpoint, c->prev, sizeof(c->checkpoint));
    c->seq++;
    dp_buf_appendc(out, '\n');
    c->since_checkpoint = 0;
    return 0;
}

int audit_write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t r = write(fd, p, n);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

int audit_store_put(const char *dir, const char *hex, const void *p, size_t n, const char **op)
{
    char path[4096], tmp[4096];
    if (snprintf(path, sizeof(path), "%s/%s", dir, hex) >= (int)sizeof(path) ||
        snprintf(tmp, sizeof(tmp), "%s/.tmp.%s.%ld", dir, hex, (long)getpid()) >=
            (int)sizeof(tmp)) {
        *op = "open";
        return -ENAMETOOLONG;
    }
    if (access(path, F_OK) == 0)
        return 0; /* content-addressed: the same name holds the same bytes */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640);
    if (fd < 0) {
        *op = "open";
        return -errno;
    }
    int rc = audit_write_all(fd, p, n);
    if (rc != 0) {
        *op = "write";
    } else if (fsync(fd) != 0) {
        *op = "fsync";
        rc = -errno;
    }
    close(fd);
    if (rc == 0 && rename(tmp, path) != 0) {
        *op = "rename";
        rc = -errno;
    }
    if (rc != 0)
        unlink(tmp);
    return rc;
}

/* ---- verify --------------------------------------------------------------------------------- */

static bool is_hex64(const char *s)
{
    if (s == NULL || strlen(s) != 64)
        return false;
    for (size_t i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return false;
    return true;
}

/* The body obj's `field` names, in the store: 0 when it is there with the bytes its name hashes
 * to (counted in *checked), or when the line says it was not stored: `flag` false (too large),
 * or the line's bodies_stored false (unstored) and no file has its name (counted in *r's
 * unstored_missing). -1 with *why otherwise. */
static int check_body(const char *store, const cJSON *obj, const char *field, const char *flag,
                      bool unstored, audit_verify_result_t *r, dp_buf_t *why, uint64_t *checked)
{
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(obj, field);
    if (!cJSON_IsString(h))
        return 0; /* null: no body (refused before forwarding, or no answer) */
    if (cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(obj, flag)))
        return 0; /* the line itself says the body was not stored (too large) */
    if (!is_hex64(h->valuestring)) {
        dp_buf_printf(why, "%s is not a SHA-256", field);
        return -1;
    }
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", store, h->valuestring);
    dp_buf_t b = {0};
    int rc = dp_read_file(path, SIZE_MAX / 2, &b);
    if (rc == -ENOENT && unstored) {
        r->unstored_missing++;
        dp_buf_free(&b);
        return 0;
    }
    if (rc != 0) {
        dp_buf_printf(why, "%s %.12s..: stored body %s", field, h->valuestring,
                      rc == -ENOENT ? "missing" : "unreadable");
        dp_buf_free(&b);
        return -1;
    }
    char got[65];
    dp_sha256_hex(b.base, b.len, got);
    dp_buf_free(&b);
    if (strcmp(got, h->valuestring) != 0) {
        dp_buf_printf(why, "%s %.12s..: stored body was altered (its SHA-256 is %.12s..)", field,
                      h->valuestring, got);
        return -1;
    }
    (*checked)++;
    return 0;
}

/* Does the line say its bodies were not stored? 1 when it carries AUDIT_UNSTORED_MEMBER where
 * the writer puts it (just before prev_sha256, the last member), 0 when it has no bodies_stored
 * member; -1 with *why for any other bodies_stored: the writer never makes one, so it is not
 * taken to excuse anything. */
static int check_unstored(const char *line, size_t n, const cJSON *obj, dp_buf_t *why)
{
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(obj, "bodies_stored");
    if (m == NULL)
        return 0;
    static const char tail[] = AUDIT_UNSTORED_MEMBER ",\"prev_sha256\":\"";
    size_t tl = sizeof(tail) - 1, want = tl + 64 + 2; /* then 64 hex and "} */
    if (cJSON_IsFalse(m) && n > want && (line[n - want - 1] == ',' || line[n - want - 1] == '{') &&
        memcmp(line + n - want, tail, tl) == 0)
        return 1;
    dp_buf_appends(why, "bodies_stored: only false, as the member before prev_sha256, says a "
                        "line's bodies were not stored");
    return -1;
}

static int check_repair(const cJSON *rep, const audit_verify_opts_t *o, audit_verify_result_t *r,
                        dp_buf_t *why)
{
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(rep, "torn_offset");
    const cJSON *len = cJSON_GetObjectItemCaseSensitive(rep, "torn_bytes");
    const cJSON *sha = cJSON_GetObjectItemCaseSensitive(rep, "torn_sha256");
    const cJSON *file = cJSON_GetObjectItemCaseSensitive(rep, "file");
    if (!cJSON_IsNumber(off) || !cJSON_IsNumber(len) || !cJSON_IsString(sha) ||
        !cJSON_IsString(file) || !is_hex64(sha->valuestring)) {
        dp_buf_appends(why, "repair: malformed (want torn_offset, torn_bytes, torn_sha256, file)");
        return -1;
    }
    if (r->lines != 1) {
        dp_buf_appends(why, "repair: only a file's first line repairs the previous file");
        return -1;
    }
    if (o->expect_torn && (dp_sat_u64(off->valuedouble) != o->expect_torn->offset ||
                           dp_sat_u64(len->valuedouble) != o->expect_torn->len ||
                           strcmp(sha->valuestring, o->expect_torn->sha256) != 0)) {
        dp_buf_printf(why,
                      "repair: names %.0f torn bytes at offset %.0f (SHA-256 %.12s..), the "
                      "previous file ends with %llu at %llu (%.12s..)",
                      len->valuedouble, off->valuedouble, sha->valuestring,
                      (unsigned long long)o->expect_torn->len,
                      (unsigned long long)o->expect_torn->offset, o->expect_torn->sha256);
        return -1;
    }
    if (o->expect_prev && !o->expect_torn) {
        dp_buf_appends(why, "repair: the previous file given does not end with a torn line");
        return -1;
    }
    r->repaired = true;
    r->repaired_offset = dp_sat_u64(off->valuedouble);
    snprintf(r->repaired_file, sizeof(r->repaired_file), "%s", file->valuestring);
    return 0;
}

static int check_checkpoint(const char *line, size_t n, const cJSON *obj,
                            const audit_verify_opts_t *o, bool seen_checkpoint, uint64_t since,
                            dp_buf_t *why, audit_verify_result_t *r)
{
    const cJSON *cp = cJSON_GetObjectItemCaseSensitive(obj, "checkpoint");
    const cJSON *keyid = cJSON_GetObjectItemCaseSensitive(obj, "keyid");
    const cJSON *sig = cJSON_GetObjectItemCaseSensitive(obj, "sig");
    const cJSON *lines = cJSON_GetObjectItemCaseSensitive(cp, "lines");
    if (!cJSON_IsObject(cp) || !cJSON_IsString(keyid) || !cJSON_IsString(sig) ||
        !cJSON_IsNumber(lines)) {
        dp_buf_appends(why, "checkpoint: malformed (want checkpoint{lines}, keyid, sig)");
        return -1;
    }
    /* The signed prefix ends where the last `,"sig":"` starts; the line must be exactly
     * prefix + that + the base64 the JSON says + "}. */
    const char *mark = NULL;
    for (const char *p = line;
         (p = memmem(p, n - (size_t)(p - line), SIG_MARK, strlen(SIG_MARK))) != NULL; p++)
        mark = p;
    size_t slen = strlen(sig->valuestring);
    if (mark == NULL || (size_t)(mark - line) + strlen(SIG_MARK) + slen + 2 != n ||
        memcmp(mark + strlen(SIG_MARK), sig->valuestring, slen) != 0) {
        dp_buf_appends(why, "checkpoint: sig must be the last member");
        return -1;
    }
    if (seen_checkpoint && dp_sat_u64(lines->valuedouble) != since) {
        dp_buf_printf(why, "checkpoint: says %.0f lines since the previous one, found %llu",
                      lines->valuedouble, (unsigned long long)since);
        return -1;
    }
    const cJSON *seqj = cJSON_GetObjectItemCaseSensitive(cp, "seq");
    uint64_t seq = cJSON_IsNumber(seqj) ? dp_sat_u64(seqj->valuedouble) : 0;
    uint64_t before = r->last_seq ? r->last_seq : o->prev_seq;
    if (seq && before && seq != before + 1) {
        dp_buf_printf(why, "checkpoint: seq %llu follows seq %llu (checkpoints were removed)",
                      (unsigned long long)seq, (unsigned long long)before);
        return -1;
    }
    if (seq) {
        if (r->first_seq == 0)
            r->first_seq = seq;
        r->last_seq = seq;
        char h[65];
        dp_sha256_hex(line, n, h);
        for (size_t i = 0; i < o->nanchors; i++) {
            if (o->anchors[i].seq != seq)
                continue;
            if (strcmp(o->anchors[i].sha256, h) != 0) {
                dp_buf_printf(why,
                              "checkpoint seq %llu hashes to %.12s.., the anchor says %.12s.. "
                              "(the history up to it was rewritten)",
                              (unsigned long long)seq, h, o->anchors[i].sha256);
                return -1;
            }
            o->anchors[i].found = true;
        }
    }
    r->checkpoints++;
    if (o->pubkey == NULL)
        return 0;
    if (strcmp(keyid->valuestring, attest_key_id(o->pubkey)) != 0) {
        dp_buf_printf(why, "checkpoint: signed by key %.8s.., not by the --pubkey %.8s..",
                      keyid->valuestring, attest_key_id(o->pubkey));
        return -1;
    }
    dp_buf_t raw = {0};
    int ok = attest_b64_decode_any(sig->valuestring, slen, &raw) == 0 &&
             attest_key_verify(o->pubkey, line, (size_t)(mark - line), raw.base, raw.len);
    dp_buf_free(&raw);
    if (!ok) {
        dp_buf_appends(why, "checkpoint: bad signature");
        return -1;
    }
    r->signatures_checked++;
    return 0;
}

static int verify_line(const char *line, size_t n, const audit_verify_opts_t *o,
                       audit_verify_result_t *r, char prev[65], bool *seen_checkpoint,
                       uint64_t *since, dp_buf_t *why)
{
    cJSON *obj = cJSON_ParseWithLength(line, n);
    int rc = -1;
    if (!cJSON_IsObject(obj)) {
        dp_buf_appends(why, "not a JSON object");
        goto out;
    }
    const cJSON *ps = cJSON_GetObjectItemCaseSensitive(obj, "prev_sha256");
    if (!cJSON_IsString(ps) || !is_hex64(ps->valuestring)) {
        dp_buf_appends(why, "no prev_sha256");
        goto out;
    }
    if (r->lines == 1) {
        memcpy(r->first_prev, ps->valuestring, 65);
        if (o->expect_prev && strcmp(ps->valuestring, o->expect_prev) != 0) {
            dp_buf_printf(why, "chain broken: names %.12s.., the previous file ended with %.12s..",
                          ps->valuestring, o->expect_prev);
            goto out;
        }
    } else if (strcmp(ps->valuestring, prev) != 0) {
        dp_buf_printf(why,
                      "chain broken: prev_sha256 %.12s.. is not the previous line's %.12s.. "
                      "(a line before it was edited, deleted or inserted)",
                      ps->valuestring, prev);
        goto out;
    }
    const cJSON *rep = cJSON_GetObjectItemCaseSensitive(obj, "repair");
    if (rep) {
        if (check_repair(rep, o, r, why) != 0)
            goto out;
        (*since)++;
    } else if (r->lines == 1 && o->expect_torn) {
        dp_buf_appends(why, "the previous file ends with a torn line and this file does not "
                            "start with its repair line");
        goto out;
    } else if (cJSON_GetObjectItemCaseSensitive(obj, "checkpoint")) {
        if (check_checkpoint(line, n, obj, o, *seen_checkpoint, *since, why, r) != 0)
            goto out;
        *seen_checkpoint = true;
        *since = 0;
    } else {
        (*since)++;
        int un = check_unstored(line, n, obj, why);
        if (un < 0)
            goto out;
        r->unstored += (uint64_t)un;
        if (o->store && (check_body(o->store, obj, "forwarded_body_sha256", "forwarded_body_stored",
                                    un, r, why, &r->bodies_checked) != 0 ||
                         check_body(o->store, obj, "response_body_sha256", "response_body_stored",
                                    un, r, why, &r->bodies_checked) != 0 ||
                         check_body(o->store, obj, "attestation_sha256", "attestation_stored", un,
                                    r, why, &r->evidence_checked) != 0))
            goto out;
    }
    dp_sha256_hex(line, n, prev);
    rc = 0;
out:
    cJSON_Delete(obj);
    return rc;
}

int audit_verify_file(const char *path, const audit_verify_opts_t *o, audit_verify_result_t *r,
                      dp_buf_t *why)
{
    memset(r, 0, sizeof(*r));
    int fd = dp_open_input(path);
    FILE *f = fd >= 0 ? fdopen(fd, "r") : NULL;
    if (f == NULL) {
        dp_buf_appends(why, dp_input_strerror(fd < 0 ? fd : -errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    char prev[65];
    memcpy(prev, AUDIT_GENESIS, sizeof(prev));
    bool seen_checkpoint = false;
    uint64_t since = 0;
    char *line = NULL;
    size_t cap = 0;
    ssize_t got;
    int rc = 0;
    while ((got = getline(&line, &cap, f)) >= 0) {
        r->lines++;
        size_t n = (size_t)got;
        if (n == 0 || line[n - 1] != '\n') {
            if (o->allow_torn) {
                r->lines--;
                r->torn.torn = true;
                r->torn.offset = (uint64_t)ftello(f) - n;
                r->torn.len = n;
                dp_sha256_hex(line, n, r->torn.sha256);
                break;
            }
            dp_buf_appends(why, "incomplete last line (no newline: a torn write, repaired by the "
                                "next file's first line if the proxy restarted)");
            rc = -1;
        } else if (n - 1 > AUDIT_LINE_MAX) {
            dp_buf_appends(why, "line too long");
            rc = -1;
        } else {
            rc = verify_line(line, n - 1, o, r, prev, &seen_checkpoint, &since, why);
        }
        if (rc != 0) {
            r->bad_line = r->lines;
            break;
        }
    }
    if (rc == 0 && ferror(f)) {
        dp_buf_printf(why, "read error: %s", strerror(errno)); /* e.g. a directory: EISDIR */
        rc = -1;
    }
    free(line);
    fclose(f);
    r->unsigned_tail = since;
    /* A file without a complete line adds nothing to the chain: its head is the previous
     * file's, passed through to the next. */
    if (r->lines == 0 && o->expect_prev)
        snprintf(r->last, sizeof(r->last), "%s", o->expect_prev);
    else
        memcpy(r->last, prev, sizeof(prev));
    return rc;
}
