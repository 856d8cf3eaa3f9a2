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
}

/* The hash of a line as the chain sees it: its bytes without the '\n'. */
static void line_hash(const char *p, size_t n, char out[65])
{
    if (n > 0 && p[n - 1] == '\n')
        n--;
    dp_sha256_hex(p, n, out);
}

#define CHECKPOINT_HEAD "{\"checkpoint\":"

/* After a crash the file ends without its shutdown checkpoint: the next checkpoint must count
 * the lines already there. buf[0..end) ends with '\n'; its first line is partial when
 * first_partial (a tail of a larger file). */
static uint64_t lines_since_checkpoint(const char *buf, size_t end, bool first_partial)
{
    uint64_t n = 0;
    size_t e = end;
    while (e > 0) {
        size_t s = e - 1;
        while (s > 0 && buf[s - 1] != '\n')
            s--;
        if (s == 0 && first_partial)
            break;
        if (e - s > strlen(CHECKPOINT_HEAD) &&
            memcmp(buf + s, CHECKPOINT_HEAD, strlen(CHECKPOINT_HEAD)) == 0)
            break;
        n++;
        e = s;
    }
    return n;
}

int audit_chain_resume(audit_chain_t *c, const char *path)
{
    audit_chain_init(c);
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
        /* The last complete line: a torn tail (crash mid-write) is left for verify to name. */
        size_t end = (size_t)got;
        while (end > 0 && buf[end - 1] != '\n')
            end--;
        if (end > 0) {
            size_t start = end - 1;
            while (start > 0 && buf[start - 1] != '\n')
                start--;
            if (start > 0 || (off_t)want == size) {
                line_hash(buf + start, end - start, c->prev);
                c->since_checkpoint = lines_since_checkpoint(buf, end, (off_t)want < size);
            } else {
                rc = -EFBIG; /* a last line longer than AUDIT_TAIL_MAX is not ours */
            }
        }
    }
    free(buf);
    close(fd);
    return rc;
}

int audit_chain_append(audit_chain_t *c, const char *line, size_t n, dp_buf_t *out)
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
    dp_buf_appends(out, "\"prev_sha256\":\"");
    dp_buf_append(out, c->prev, 64);
    dp_buf_appends(out, "\"}");
    line_hash(out->base + start, out->len - start, c->prev);
    dp_buf_appendc(out, '\n');
    c->since_checkpoint++;
    return 0;
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

static int check_body(const char *store, const cJSON *obj, const char *field, const char *flag,
                      dp_buf_t *why, audit_verify_result_t *r)
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
    r->bodies_checked++;
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
    if (seen_checkpoint && (uint64_t)lines->valuedouble != since) {
        dp_buf_printf(why, "checkpoint: says %.0f lines since the previous one, found %llu",
                      lines->valuedouble, (unsigned long long)since);
        return -1;
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
    if (cJSON_GetObjectItemCaseSensitive(obj, "checkpoint")) {
        if (check_checkpoint(line, n, obj, o, *seen_checkpoint, *since, why, r) != 0)
            goto out;
        *seen_checkpoint = true;
        *since = 0;
    } else {
        (*since)++;
        if (o->store && (check_body(o->store, obj, "forwarded_body_sha256", "forwarded_body_stored",
                                    why, r) != 0 ||
                         check_body(o->store, obj, "response_body_sha256", "response_body_stored",
                                    why, r) != 0))
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
    FILE *f = fopen(path, "re");
    if (f == NULL) {
        dp_buf_appends(why, strerror(errno));
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
            dp_buf_appends(why, "incomplete last line (no newline: a torn write?)");
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
        dp_buf_appends(why, "read error");
        rc = -1;
    }
    free(line);
    fclose(f);
    r->unsigned_tail = since;
    memcpy(r->last, prev, sizeof(prev));
    return rc;
}
