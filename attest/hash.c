/* Checkpoint hashing: list, sort, then stream every file through SHA-256 (see hash.h). */
#define _GNU_SOURCE
#include "attest/hash.h"

#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "attest/view.h"
#include "common/util.h"

/* ---- listing ------------------------------------------------------------------------------ */

typedef struct {
    attest_snapshot_t *snap;
    size_t cap;
    dp_buf_t *err;
    const char *root;
    const attest_walk_opts_t *opts; /* never NULL */
    dp_buf_t rel; /* relative path of the directory being listed ("" at the root) */
    /* Directories on the current path: entering one of these again is a symlink loop. */
    struct {
        dev_t dev;
        ino_t ino;
    } stack[ATTEST_HASH_MAX_DEPTH];
    int depth;
} walk_t;

static void errf(dp_buf_t *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void errf(dp_buf_t *err, const char *fmt, ...)
{
    if (err == NULL)
        return;
    va_list ap;
    va_start(ap, fmt);
    char tmp[1024];
    vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    /* File names are the walked tree's: a control byte in one (a newline, a terminal escape)
     * is shown as \xNN, so the message stays one line that says only what it says. */
    for (const unsigned char *p = (const unsigned char *)tmp; *p; p++) {
        if (*p < 0x20 || *p == 0x7f)
            dp_buf_printf(err, "\\x%02x", *p);
        else
            dp_buf_appendc(err, (char)*p);
    }
}

/* Full path of a relpath for messages: what an operator can paste into ls. */
static const char *full_path(dp_buf_t *tmp, const char *root, const char *rel)
{
    dp_buf_reset(tmp);
    dp_buf_appends(tmp, root);
    if (rel[0] != '\0') {
        if (tmp->len == 0 || tmp->base[tmp->len - 1] != '/')
            dp_buf_appendc(tmp, '/');
        dp_buf_appends(tmp, rel);
    }
    return tmp->base;
}

static int64_t mtime_ns(const struct stat *st)
{
    return (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec;
}

static int64_t ctime_ns(const struct stat *st)
{
    return (int64_t)st->st_ctim.tv_sec * 1000000000 + st->st_ctim.tv_nsec;
}

static bool name_is_unsupported(const char *name)
{
    return strpbrk(name, "\n\r\\") != NULL;
}

static void add_file(walk_t *w, const char *rel, const struct stat *st)
{
    attest_snapshot_t *s = w->snap;
    if (s->count == w->cap) {
        w->cap = w->cap ? w->cap * 2 : 64;
        s->files = dp_xrealloc(s->files, w->cap * sizeof(*s->files));
    }
    attest_file_t *f = &s->files[s->count++];
    f->relpath = dp_xstrdup(rel);
    f->size = (uint64_t)st->st_size;
    f->mtime_ns = mtime_ns(st);
    f->ctime_ns = ctime_ns(st);
    f->dev = (uint64_t)st->st_dev;
    f->ino = (uint64_t)st->st_ino;
    s->total_bytes += f->size;
}

/* Is the directory st one of those on the current path (entering it again would loop)? */
static bool on_path(const walk_t *w, const struct stat *st)
{
    for (int i = 0; i < w->depth; i++)
        if (w->stack[i].dev == st->st_dev && w->stack[i].ino == st->st_ino)
            return true;
    return false;
}

/* List the directory open on fd (ownership of fd passes here). Recurses into subdirectories. */
static int walk_dir(walk_t *w, int fd)
{
    assert(w->opts != NULL);
    dp_buf_t tmp = {0};
    int rc = 0;
    DIR *d = fdopendir(fd);
    if (d == NULL) {
        rc = -errno;
        close(fd);
        errf(w->err, "cannot list %s: %s", full_path(&tmp, w->root, w->rel.base), strerror(-rc));
        goto out;
    }
    size_t base_len = w->rel.len;
    for (;;) {
        errno = 0;
        struct dirent *de = readdir(d);
        if (de == NULL) {
            if (errno != 0) {
                rc = -errno;
                w->rel.len = base_len;
                w->rel.base[base_len] = '\0';
                errf(w->err, "cannot list %s: %s", full_path(&tmp, w->root, w->rel.base),
                     strerror(-rc));
            }
            break;
        }
        const char *name = de->d_name;
        if (name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0')))
            continue;
        /* Checkpoint: hidden names are skipped at every level. */
        if (name[0] == '.' && !w->opts->include_hidden)
            continue;
        w->rel.len = base_len;
        w->rel.base[base_len] = '\0';
        if (base_len > 0)
            dp_buf_appendc(&w->rel, '/');
        dp_buf_appends(&w->rel, name);
        const char *rel = w->rel.base;
        if (w->opts->exclude && w->opts->exclude(rel, w->opts->data))
            continue;

        struct stat st;
        if (w->opts->no_follow_symlinks) {
            if (fstatat(dirfd(d), name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
                if (errno == ENOENT)
                    continue; /* removed since readdir returned it */
                rc = -errno;
                errf(w->err, "cannot stat %s: %s", full_path(&tmp, w->root, rel), strerror(-rc));
                break;
            }
            if (S_ISLNK(st.st_mode)) {
                rc = w->opts->on_symlink ? w->opts->on_symlink(rel, w->opts->data) : -ELOOP;
                if (rc == 0)
                    continue;
                errf(w->err, "symlink not followed: %s", full_path(&tmp, w->root, rel));
                break;
            }
        } else if ((attest_view_on() ? attest_view_stat(full_path(&tmp, w->root, rel), &st)
                                     : fstatat(dirfd(d), name, &st, 0)) != 0) {
            int e = errno;
            if (e == ENOENT) {
                /* A dangling symlink (find -L skips it: it is not a regular file), or an entry
                 * removed since readdir returned it: either way it is not part of the tree. */
                continue;
            }
            rc = -e;
            if (e == ELOOP)
                errf(w->err, "symlink loop: %s (too many levels of symbolic links%s)",
                     full_path(&tmp, w->root, rel),
                     attest_view_on() ? ", or a link through /proc, which is not followed" : "");
            else
                errf(w->err, "cannot stat %s: %s", full_path(&tmp, w->root, rel), strerror(e));
            break;
        }
        if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode)) {
            /* FIFOs, sockets, devices: never opened (a FIFO would block) */
            rc = w->opts->on_special ? w->opts->on_special(rel, w->opts->data) : 0;
            if (rc == 1)
                add_file(w, rel, &st);
            if (rc >= 0) {
                rc = 0;
                continue;
            }
            errf(w->err, "not a regular file: %s", full_path(&tmp, w->root, rel));
            break;
        }
        if (!w->opts->any_file_name && name_is_unsupported(name)) {
            rc = -EINVAL;
            errf(w->err,
                 "unsupported file name (contains a newline, carriage return or backslash, "
                 "which the coreutils cross-check cannot reproduce): %s",
                 full_path(&tmp, w->root, rel));
            break;
        }
        if (S_ISREG(st.st_mode)) {
            add_file(w, rel, &st);
            continue;
        }
        if (on_path(w, &st)) {
            rc = -ELOOP;
            errf(w->err, "symlink loop: %s leads back to an ancestor directory",
                 full_path(&tmp, w->root, rel));
            break;
        }
        if (w->depth >= ATTEST_HASH_MAX_DEPTH) {
            rc = -ELOOP;
            errf(w->err, "directory tree deeper than %d levels at %s", ATTEST_HASH_MAX_DEPTH,
                 full_path(&tmp, w->root, rel));
            break;
        }
        /* In the engine's view a link is followed in its root: by the entry's whole path. */
        int cfd = attest_view_on()
                      ? attest_view_open(full_path(&tmp, w->root, rel), O_RDONLY | O_DIRECTORY)
                      : openat(dirfd(d), name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (cfd < 0) {
            int e = errno;
            if (e == ENOENT)
                continue; /* removed since it was listed */
            rc = -e;
            errf(w->err, "cannot open directory %s: %s", full_path(&tmp, w->root, rel),
                 strerror(e));
            break;
        }
        /* Push what was actually opened, not what fstatat saw: they differ only under a race,
         * and the loop check must be about the directory we are about to read. */
        struct stat cst;
        if (fstat(cfd, &cst) != 0) {
            rc = -errno;
            close(cfd);
            errf(w->err, "cannot stat %s: %s", full_path(&tmp, w->root, rel), strerror(-rc));
            break;
        }
        assert(w->depth < ATTEST_HASH_MAX_DEPTH); /* checked before the open */
        w->stack[w->depth].dev = cst.st_dev;
        w->stack[w->depth].ino = cst.st_ino;
        w->depth++;
        rc = walk_dir(w, cfd);
        w->depth--;
        if (rc != 0)
            break;
    }
    closedir(d);
    w->rel.len = base_len;
    if (w->rel.base)
        w->rel.base[base_len] = '\0';
out:
    dp_buf_free(&tmp);
    return rc;
}

static int cmp_files(const void *a, const void *b)
{
    /* strcmp compares as unsigned char: the same order as LC_ALL=C sort. */
    return strcmp(((const attest_file_t *)a)->relpath, ((const attest_file_t *)b)->relpath);
}

void attest_snapshot_free(attest_snapshot_t *s)
{
    for (size_t i = 0; i < s->count; i++)
        free(s->files[i].relpath);
    free(s->files);
    s->files = NULL;
    s->count = 0;
    s->total_bytes = 0;
}

int attest_snapshot_take(const char *dir, attest_snapshot_t *out, dp_buf_t *err)
{
    return attest_snapshot_take_opts(dir, NULL, out, err);
}

int attest_snapshot_take_opts(const char *dir, const attest_walk_opts_t *opts,
                              attest_snapshot_t *out, dp_buf_t *err)
{
    static const attest_walk_opts_t checkpoint_rules = {0};
    memset(out, 0, sizeof(*out));
    walk_t w = {.snap = out, .err = err, .root = dir, .opts = opts ? opts : &checkpoint_rules};
    dp_buf_appends(&w.rel, "");
    int rc = 0;
    int fd = attest_view_open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0) {
        rc = -errno;
        errf(err, "cannot open directory %s: %s", dir, strerror(-rc));
        goto fail;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        rc = -errno;
        close(fd);
        errf(err, "cannot stat %s: %s", dir, strerror(-rc));
        goto fail;
    }
    w.stack[0].dev = st.st_dev;
    w.stack[0].ino = st.st_ino;
    w.depth = 1;
    rc = walk_dir(&w, fd);
    if (rc != 0)
        goto fail;
    if (out->count > 1)
        qsort(out->files, out->count, sizeof(*out->files), cmp_files);
    dp_buf_free(&w.rel);
    return 0;
fail:
    dp_buf_free(&w.rel);
    attest_snapshot_free(out);
    return rc;
}

bool attest_snapshot_differs(const attest_snapshot_t *a, const attest_snapshot_t *b, dp_buf_t *why)
{
    size_t i = 0, j = 0;
    while (i < a->count || j < b->count) {
        int c;
        if (i == a->count)
            c = 1;
        else if (j == b->count)
            c = -1;
        else
            c = strcmp(a->files[i].relpath, b->files[j].relpath);
        if (c < 0) {
            errf(why, "removed: %s", a->files[i].relpath);
            return true;
        }
        if (c > 0) {
            errf(why, "added: %s", b->files[j].relpath);
            return true;
        }
        const attest_file_t *x = &a->files[i], *y = &b->files[j];
        if (x->size != y->size) {
            errf(why, "%s: size %llu -> %llu", x->relpath, (unsigned long long)x->size,
                 (unsigned long long)y->size);
            return true;
        }
        if (x->mtime_ns != y->mtime_ns) {
            errf(why, "%s: modified (mtime changed)", x->relpath);
            return true;
        }
        if (x->dev != y->dev || x->ino != y->ino) {
            errf(why, "%s: replaced (new inode)", x->relpath);
            return true;
        }
        if (x->ctime_ns != y->ctime_ns) {
            errf(why, "%s: modified (ctime changed)", x->relpath);
            return true;
        }
        i++;
        j++;
    }
    return false;
}

/* ---- hashing ------------------------------------------------------------------------------ */

typedef struct {
    const attest_hash_opts_t *opts;
    attest_progress_t prog;
    uint8_t *buf;
    size_t bufsize;
    EVP_MD_CTX *fctx;
    const EVP_MD *md;
    EVP_MD *md_owned;
    dp_buf_t *err;
} hasher_t;

static bool cancelled(const hasher_t *h)
{
    return h->opts && h->opts->cancel && atomic_load(h->opts->cancel) != 0;
}

static void report(hasher_t *h)
{
    if (h->opts && h->opts->progress)
        h->opts->progress(&h->prog, h->opts->progress_data);
}

static bool same_as_listed(const struct stat *st, const attest_file_t *f)
{
    return (uint64_t)st->st_size == f->size && mtime_ns(st) == f->mtime_ns &&
           ctime_ns(st) == f->ctime_ns;
}

/* Stream one file through the digest, checking it is still the file that was listed. With
 * shard > 0 the digest restarts every shard bytes (OMS shard serialization) and a zero-byte file
 * gives no digest; with shard 0 there is one digest of the whole file. Raw digests are appended
 * to out, in file order. */
static int hash_file(hasher_t *h, const char *path, const attest_file_t *f, uint64_t shard,
                     dp_buf_t *out)
{
    int rc = 0;
    /* O_NONBLOCK: if a FIFO was swapped in since listing, open must not hang. */
    int fd = attest_view_open(path, O_RDONLY | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) {
        rc = -errno;
        if (rc == -ENOENT)
            errf(h->err, "file vanished during hashing: %s", path);
        else
            errf(h->err, "cannot open %s: %s", path, strerror(-rc));
        return rc;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        rc = -errno;
        errf(h->err, "cannot stat %s: %s", path, strerror(-rc));
        goto out;
    }
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_dev != f->dev || (uint64_t)st.st_ino != f->ino) {
        rc = -ESTALE;
        errf(h->err, "file changed during hashing: %s (replaced since listing)", path);
        goto out;
    }
    if (!same_as_listed(&st, f)) {
        rc = -ESTALE;
        errf(h->err, "file changed during hashing: %s (size %llu -> %llu, or mtime/ctime)", path,
             (unsigned long long)f->size, (unsigned long long)st.st_size);
        goto out;
    }
    (void)posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    uint64_t done = 0, in_piece = 0;
    bool open_piece = false;
    uint8_t md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    for (;;) {
        if (cancelled(h)) {
            rc = -ECANCELED;
            errf(h->err, "hashing cancelled");
            goto out;
        }
        ssize_t r = read(fd, h->buf, h->bufsize);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            rc = -errno;
            errf(h->err, "cannot read %s: %s", path, strerror(-rc));
            goto out;
        }
        if (r == 0)
            break;
        done += (uint64_t)r;
        if (done > f->size)
            break; /* grew: reported below without hashing the rest */
        const uint8_t *p = h->buf;
        size_t left = (size_t)r;
        while (left > 0) {
            if (!open_piece) {
                if (EVP_DigestInit_ex(h->fctx, h->md, NULL) != 1) {
                    rc = -EIO;
                    errf(h->err, "digest init failed");
                    goto out;
                }
                open_piece = true;
                in_piece = 0;
            }
            size_t take = left;
            if (shard > 0 && shard - in_piece < take)
                take = (size_t)(shard - in_piece);
            EVP_DigestUpdate(h->fctx, p, take);
            in_piece += take;
            p += take;
            left -= take;
            if (shard > 0 && in_piece == shard) {
                EVP_DigestFinal_ex(h->fctx, md, &mdlen);
                dp_buf_append(out, md, mdlen);
                open_piece = false;
            }
        }
        h->prog.bytes_done += (uint64_t)r;
        report(h);
    }
    if (done != f->size) {
        rc = -ESTALE;
        errf(h->err, "file changed during hashing: %s (size %llu at listing, %s%llu bytes read)",
             path, (unsigned long long)f->size, done > f->size ? "more than " : "",
             (unsigned long long)(done > f->size ? f->size : done));
        goto out;
    }
    /* Same size but rewritten in place while we read: the ctime tells, even when the writer
     * put the mtime back. */
    if (fstat(fd, &st) != 0 || !same_as_listed(&st, f)) {
        rc = -ESTALE;
        errf(h->err, "file changed during hashing: %s (modified while being read)", path);
        goto out;
    }
    if (!open_piece && shard == 0) { /* an empty file: the digest of nothing */
        if (EVP_DigestInit_ex(h->fctx, h->md, NULL) != 1) {
            rc = -EIO;
            errf(h->err, "digest init failed");
            goto out;
        }
        open_piece = true;
    }
    if (open_piece) { /* the whole file, or the last (short) shard */
        EVP_DigestFinal_ex(h->fctx, md, &mdlen);
        dp_buf_append(out, md, mdlen);
    }
out:
    close(fd);
    return rc;
}

static void hasher_free(hasher_t *h)
{
    EVP_MD_CTX_free(h->fctx);
    EVP_MD_free(h->md_owned);
    free(h->buf);
    memset(h, 0, sizeof(*h));
}

static int hasher_init(hasher_t *h, const char *md_name, const attest_hash_opts_t *opts,
                       dp_buf_t *err)
{
    memset(h, 0, sizeof(*h));
    h->opts = opts;
    h->err = err;
    h->bufsize = opts && opts->read_size ? opts->read_size : ATTEST_HASH_READ_SIZE;
    if (posix_memalign((void **)&h->buf, 4096, h->bufsize) != 0) {
        h->buf = NULL;
        errf(err, "out of memory for a %zu-byte read buffer", h->bufsize);
        return -ENOMEM;
    }
    /* Fetch the implementation once instead of an implicit fetch per file (OpenSSL 3). */
    h->md_owned = EVP_MD_fetch(NULL, md_name, NULL);
    h->md = h->md_owned;
    h->fctx = EVP_MD_CTX_new();
    if (h->md == NULL || h->fctx == NULL) {
        errf(err, "OpenSSL %s unavailable", md_name);
        hasher_free(h);
        return -EIO;
    }
    return 0;
}

struct attest_filehasher_s {
    hasher_t h;
};

attest_filehasher_t *attest_filehasher_new(const char *md_name, const attest_hash_opts_t *opts,
                                           dp_buf_t *err)
{
    attest_filehasher_t *fh = dp_xcalloc(1, sizeof(*fh));
    if (hasher_init(&fh->h, md_name, opts, err) != 0) {
        free(fh);
        return NULL;
    }
    return fh;
}

size_t attest_filehasher_size(const attest_filehasher_t *fh)
{
    return (size_t)EVP_MD_get_size(fh->h.md);
}

int attest_filehasher_file(attest_filehasher_t *fh, const char *dir, const attest_file_t *f,
                           uint64_t shard_size, dp_buf_t *digests, dp_buf_t *err)
{
    dp_buf_t path = {0};
    fh->h.err = err;
    int rc = hash_file(&fh->h, full_path(&path, dir, f->relpath), f, shard_size, digests);
    dp_buf_free(&path);
    return rc;
}

void attest_filehasher_free(attest_filehasher_t *fh)
{
    if (fh == NULL)
        return;
    hasher_free(&fh->h);
    free(fh);
}

int attest_hash_snapshot(const char *dir, const attest_snapshot_t *snap,
                         const attest_hash_opts_t *opts, char out_hex[65], dp_buf_t *lines,
                         dp_buf_t *err)
{
    dp_buf_t path = {0}, line = {0}, d = {0};
    hasher_t h;
    EVP_MD_CTX *tctx = NULL;
    int rc = hasher_init(&h, "SHA256", opts, err);
    if (rc != 0)
        return rc;
    tctx = EVP_MD_CTX_new();
    if (tctx == NULL || EVP_DigestInit_ex(tctx, h.md, NULL) != 1) {
        rc = -EIO;
        errf(err, "OpenSSL SHA-256 unavailable");
        goto out;
    }
    h.prog.files_total = snap->count;
    h.prog.bytes_total = snap->total_bytes;
    for (size_t i = 0; i < snap->count; i++) {
        const attest_file_t *f = &snap->files[i];
        h.prog.current = f->relpath;
        report(&h);
        dp_buf_reset(&d);
        rc = hash_file(&h, full_path(&path, dir, f->relpath), f, 0, &d);
        if (rc != 0)
            goto out;
        char hex[65];
        dp_hex(d.base, 32, hex);
        dp_buf_reset(&line);
        dp_buf_append(&line, hex, 64);
        dp_buf_append(&line, "  ", 2);
        dp_buf_appends(&line, f->relpath);
        dp_buf_appendc(&line, '\n');
        EVP_DigestUpdate(tctx, line.base, line.len);
        if (lines)
            dp_buf_append(lines, line.base, line.len);
        h.prog.files_done++;
    }
    h.prog.current = NULL;
    report(&h);
    uint8_t total[32];
    unsigned int tlen = 0;
    EVP_DigestFinal_ex(tctx, total, &tlen);
    dp_hex(total, sizeof(total), out_hex);
out:
    EVP_MD_CTX_free(tctx);
    hasher_free(&h);
    dp_buf_free(&path);
    dp_buf_free(&line);
    dp_buf_free(&d);
    return rc;
}

/* Every file quiet for at least settled_ns before start_ns? (see attest_hash_opts_t) */
static int settled(const attest_snapshot_t *s, uint64_t settled_ns, int64_t start_ns, dp_buf_t *err)
{
    if (settled_ns == 0)
        return 0;
    int64_t limit = start_ns - (int64_t)settled_ns;
    for (size_t i = 0; i < s->count; i++) {
        const attest_file_t *f = &s->files[i];
        if (f->ctime_ns > limit || f->mtime_ns > limit) {
            errf(err, "file changed during hashing: %s (changed less than %llu ms ago)", f->relpath,
                 (unsigned long long)(settled_ns / 1000000));
            return -ESTALE;
        }
    }
    return 0;
}

int attest_hash_dir(const char *dir, const attest_hash_opts_t *opts, char out_hex[65],
                    attest_snapshot_t *snap_out, dp_buf_t *lines, dp_buf_t *err)
{
    attest_snapshot_t snap;
    struct timespec t0;
    clock_gettime(CLOCK_REALTIME, &t0); /* the clock file timestamps come from */
    int64_t start_ns = (int64_t)t0.tv_sec * 1000000000 + t0.tv_nsec;
    int rc = attest_snapshot_take(dir, &snap, err);
    if (rc != 0)
        return rc;
    rc = settled(&snap, opts ? opts->settled_ns : 0, start_ns, err);
    if (rc == 0)
        rc = attest_hash_snapshot(dir, &snap, opts, out_hex, lines, err);
    if (rc == 0) {
        /* A file hashed early may have changed while later ones were read: only a listing
         * taken after the whole walk shows that every file stayed as it was hashed. */
        attest_snapshot_t after;
        rc = attest_snapshot_take(dir, &after, err);
        if (rc == 0) {
            dp_buf_t why = {0};
            if (attest_snapshot_differs(&snap, &after, &why)) {
                rc = -ESTALE;
                errf(err, "directory changed during hashing: %s", why.base);
            }
            dp_buf_free(&why);
            attest_snapshot_free(&after);
        }
    }
    if (rc == 0 && snap_out != NULL)
        *snap_out = snap;
    else
        attest_snapshot_free(&snap);
    return rc;
}

/* ---- one file or a folder (attest_hash_path) ---------------------------------------------- */

/* A regular file as a snapshot of one entry: root its folder, relpath its name, so that
 * messages, change detection and the file checks are those of a folder's files. */
static int file_snapshot(const char *path, const struct stat *st, char **root,
                         attest_snapshot_t *out)
{
    memset(out, 0, sizeof(*out));
    const char *slash = strrchr(path, '/');
    *root = slash == NULL   ? dp_xstrdup(".")
            : slash == path ? dp_xstrdup("/")
                            : dp_xstrndup(path, (size_t)(slash - path));
    out->files = dp_xcalloc(1, sizeof(*out->files));
    out->count = 1;
    attest_file_t *f = &out->files[0];
    f->relpath = dp_xstrdup(slash ? slash + 1 : path);
    f->size = (uint64_t)st->st_size;
    f->mtime_ns = mtime_ns(st);
    f->ctime_ns = ctime_ns(st);
    f->dev = (uint64_t)st->st_dev;
    f->ino = (uint64_t)st->st_ino;
    out->total_bytes = f->size;
    return 0;
}

/* stat() path: 1 a regular file, 0 a directory, else a negative errno with the reason. */
static int path_kind(const char *path, struct stat *st, dp_buf_t *err)
{
    if (attest_view_stat(path, st) != 0) {
        int e = errno;
        errf(err, "cannot open %s: %s", path, strerror(e));
        return -e;
    }
    if (S_ISREG(st->st_mode))
        return 1;
    if (S_ISDIR(st->st_mode))
        return 0;
    errf(err, "not a regular file or a directory: %s", path);
    return -EINVAL;
}

int attest_snapshot_take_path(const char *path, attest_snapshot_t *out, bool *is_file,
                              dp_buf_t *err)
{
    struct stat st;
    memset(out, 0, sizeof(*out));
    int kind = path_kind(path, &st, err);
    if (is_file)
        *is_file = kind == 1;
    if (kind < 0)
        return kind;
    if (kind == 0)
        return attest_snapshot_take(path, out, err);
    char *root = NULL;
    file_snapshot(path, &st, &root, out);
    free(root);
    return 0;
}

int attest_hash_path(const char *path, const attest_hash_opts_t *opts, char out_hex[65],
                     attest_snapshot_t *snap_out, bool *is_file, dp_buf_t *err)
{
    struct timespec t0;
    clock_gettime(CLOCK_REALTIME, &t0);
    int64_t start_ns = (int64_t)t0.tv_sec * 1000000000 + t0.tv_nsec;
    struct stat st;
    int kind = path_kind(path, &st, err);
    if (is_file)
        *is_file = kind == 1;
    if (kind < 0)
        return kind;
    if (kind == 0)
        return attest_hash_dir(path, opts, out_hex, snap_out, NULL, err);

    char *root = NULL;
    attest_snapshot_t snap;
    file_snapshot(path, &st, &root, &snap);
    hasher_t h;
    dp_buf_t d = {0};
    int rc = settled(&snap, opts ? opts->settled_ns : 0, start_ns, err);
    if (rc == 0)
        rc = hasher_init(&h, "SHA256", opts, err);
    if (rc == 0) {
        h.prog.files_total = 1;
        h.prog.bytes_total = snap.total_bytes;
        h.prog.current = snap.files[0].relpath;
        report(&h);
        /* hash_file checks the file against the listing before and after its read. */
        rc = hash_file(&h, path, &snap.files[0], 0, &d);
        if (rc == 0) {
            h.prog.files_done = 1;
            h.prog.current = NULL;
            report(&h);
            dp_hex(d.base, 32, out_hex);
        }
        hasher_free(&h);
    }
    if (rc == 0) {
        /* The path may name another file now (a rename over it): the same question the folder
         * hash asks of its listing once the walk is done. */
        struct stat after;
        if (attest_view_stat(path, &after) != 0 || (uint64_t)after.st_dev != snap.files[0].dev ||
            (uint64_t)after.st_ino != snap.files[0].ino) {
            rc = -ESTALE;
            errf(err, "file changed during hashing: %s (replaced while being read)", path);
        }
    }
    if (rc == 0 && snap_out != NULL)
        *snap_out = snap;
    else
        attest_snapshot_free(&snap);
    dp_buf_free(&d);
    free(root);
    return rc;
}
