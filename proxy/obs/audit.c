#define _GNU_SOURCE /* renameat2 */
#include "proxy/obs/audit.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "attest/audit.h"
#include "common/buf.h"
#include "common/log.h"
#include "common/util.h"
#include "proxy/core/metrics.h"
#include "proxy/core/px.h"

#define FSYNC_EVERY_MS 1000
#define TORN_NAMES 999 /* PATH.torn-TIME.1 .. .999 after PATH.torn-TIME itself */

typedef struct {
    char sha[65];
    char *bytes;
    size_t n;
} blob_t;

typedef enum { E_LINE, E_CHECKPOINT, E_REOPEN } entry_kind_t;

/* One step of a batch, in file order: a line (with its bodies), a checkpoint, or the switch to
 * the reopened file. */
typedef struct {
    entry_kind_t kind;
    const char *reason; /* E_CHECKPOINT: static */
    size_t off, len;    /* E_LINE: its bytes in batch.raw */
    size_t blob0, nblob;
    px_audit_cb cb;
    void *data;
    int status;    /* E_LINE: what its callback gets; a store error for a line written unstored */
    bool in_file;  /* its bytes are in the segment being written */
    bool written;  /* E_LINE: its line reached the file */
    bool unstored; /* E_LINE: its bodies could not be stored */
} entry_t;

typedef struct {
    dp_buf_t raw;
    blob_t *blobs;
    size_t nblobs, bcap;
    entry_t *e;
    size_t ne, ecap;
    bool has_reopen;
} batch_t;

/* Entries accumulate in `pending` while one batch (`inflight`) is written on the thread pool: at
 * most one at a time keeps lines in order, and batches them under load. The chain is advanced
 * by the batch as it is written and kept only for what reached the file. */
struct px_audit_s {
    uv_loop_t *loop;
    char *path;
    char *store;            /* NULL: bodies are not stored */
    attest_key_t *key;      /* NULL: no checkpoints */
    attest_key_t **retired; /* keys replaced while a batch used them: freed after it */
    size_t nretired;
    uint32_t checkpoint_lines;
    bool fail_closed;
    audit_chain_t chain; /* what is on disk; the batch in flight owns it while `writing` */
    uv_file fd;
    int lock_fd, store_lock_fd;
    /* A flock on the file the writer appends to (lock_path at open; moved with it by
     * follow_lock), or -1; lock_dev and lock_ino name that file. Kept by the loop: the batch in
     * flight reads a copy (w_lock_*) and hands a new lock back in w_lock_fd. */
    int file_lock_fd;
    dev_t lock_dev;
    ino_t lock_ino;
    /* The locks of a path a reopen moved away from: held while lines still go to its file (the
     * batch in flight, and the lines queued before the reopen), so that no second writer can
     * start on it meanwhile. Released once a batch moved to the new file; the first
     * old_locks_armed are those whose move the batch in flight holds. In pairs: the path's lock
     * file, then its file lock (-1: none); a reopen back onto that path takes the pair back. */
    int *old_locks;
    size_t nold_locks, old_locks_armed;
    /* The locks of stores px_audit_configure moved away from while a batch was in flight: that
     * batch may still put bodies into its store (w_store), so no second writer may take the
     * folder yet. Released once the batch is done (batch_done). */
    int *old_store_locks;
    size_t nold_store_locks;
    /* px_audit_retire: no line is taken any more; once those queued before it are written
     * (retiring), the file is closed and every lock released (released). */
    bool retiring, released;
    batch_t pending, inflight;
    uv_work_t work;
    uv_fs_t fsync_req;
    bool writing, syncing, dirty, store_dirty, closing;
    _Atomic bool writable;
    uv_timer_t fsync_timer;
    px_series_t *m_errors, *m_store_errors, *m_seq, *m_writable;
    uint64_t lines, errors, store_errors;
    bool head_unsaved; /* saving the chain's head in the lock file failed (logged once) */
    uint64_t anchor_seq;
    char anchor_sha[65];
    /* Set by the worker, read by the loop once it is done. */
    char *w_path;  /* the file of the batch in flight (its reopen target with a reopen) */
    char *w_store; /* the store of the batch in flight: a reload may change a->store meanwhile */
    const attest_key_t *w_key;
    uint32_t w_lines;
    bool w_closed;
    dp_buf_t w_out;
    int w_head_fd; /* the lock file the batch's head goes to (write_head, flush_segment) */
    /* Orders the batch's head writes (into w_head_fd and lock_fd, the newest path's, which
     * the batch in flight may not know yet) with a reopen's copy of the head into its new lock
     * file and its move of lock_fd: a line the batch writes into the old file meanwhile is
     * named by the new lock file whichever goes first. lock_fd changes only under it. */
    uv_mutex_t head_mu;
    int w_status, w_store_status;
    const char *w_op, *w_store_op;
    uint64_t w_failed_lines, w_unstored_lines;
    dev_t w_lock_dev; /* the file locked: the loop's at the start, then the batch's own */
    ino_t w_lock_ino;
    bool w_lock_held; /* the loop holds a lock on (w_lock_dev, w_lock_ino) */
    int w_lock_fd;    /* a lock the batch took on the file it moved to, or -1 */
    bool w_locked;    /* the file it was to move to is locked by another process */
    bool w_moved;     /* a reopen moved the batch to another file */
};

static void start_write(px_audit_t *a);
static void maybe_release(px_audit_t *a);

/* The audit file for appending; -1 with errno set. Only a regular file: a FIFO put in its place
 * would block the open (no reader) or swallow the lines (one), so the open does not wait
 * (O_NONBLOCK, which a regular file ignores) and anything else is refused (EINVAL). */
static int open_file(const char *path)
{
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0640);
    if (fd < 0)
        return -1;
    struct stat st;
    int fl, e = 0;
    if (fstat(fd, &st) != 0)
        e = errno;
    else if (!S_ISREG(st.st_mode))
        e = EINVAL;
    else if ((fl = fcntl(fd, F_GETFL)) < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
        e = errno;
    if (e != 0) {
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static void log_error(px_audit_t *a, const char *what, int err)
{
    dp_jw_t *w = dp_log_begin(DP_LOG_ERROR, "audit_write_failed");
    if (w) {
        dp_jw_str(w, "path", a->path);
        dp_jw_str(w, "op", what);
        dp_jw_str(w, "error", uv_strerror(err));
        dp_log_end(w);
    }
}

/* ---- the lock -------------------------------------------------------------------------------- */

/* The lock file's second line for chain head c ("chain PREV SEQ CHECKPOINT SINCE\n", fixed
 * width): its length, written into out (192 bytes). */
static int head_line(char *out, size_t cap, const audit_chain_t *c)
{
    return snprintf(out, cap, "chain %s %020" PRIu64 " %s %020" PRIu64 "\n", c->prev, c->seq,
                    c->checkpoint[0] ? c->checkpoint : AUDIT_GENESIS, c->since_checkpoint);
}

/* Create lockpath already holding our pid and `content`'s head, so no crash finds it without
 * one: written into an unnamed file in its folder (O_TMPFILE) and linked in whole. Nothing
 * when it exists by now, or the file system has no unnamed files (then take_lock creates it
 * empty and writes the head after, an instant apart). */
static void create_with(const char *lockpath, const char *content, size_t n)
{
    char dir[PATH_MAX];
    const char *slash = strrchr(lockpath, '/');
    if (slash == NULL || (size_t)(slash - lockpath) >= sizeof(dir))
        return;
    snprintf(dir, sizeof(dir), "%.*s", slash == lockpath ? 1 : (int)(slash - lockpath), lockpath);
    int t = open(dir, O_TMPFILE | O_WRONLY | O_CLOEXEC, 0640);
    if (t < 0)
        return;
    char self[64];
    snprintf(self, sizeof(self), "/proc/self/fd/%d", t);
    if (pwrite(t, content, n, 0) == (ssize_t)n)
        (void)linkat(AT_FDCWD, self, AT_FDCWD, lockpath, AT_SYMLINK_FOLLOW); /* EEXIST: it is */
    close(t);
}

/* Take an exclusive flock on lockpath (created if needed) and write our pid into it. The file is
 * never removed: removing it would let a third process lock a new file while a second still
 * holds the old one. The chain head after the pid is `head` when given (a reopen moving the
 * trail to this file), else the one the last holder left, for load_head to judge. Returns the
 * fd, or -1 with *err saying why (the holder's pid). */
static int take_lock(const char *lockpath, const char *what, const audit_chain_t *head,
                     dp_buf_t *err)
{
    char mine[192] = "";
    if (head) {
        head_line(mine, sizeof(mine), head);
        char first[32 + sizeof(mine)];
        int n = snprintf(first, sizeof(first), "%ld\n%s", (long)getpid(), mine);
        if (access(lockpath, F_OK) != 0 && errno == ENOENT)
            create_with(lockpath, first, (size_t)n);
    }
    int fd = open(lockpath, O_RDWR | O_CREAT | O_CLOEXEC, 0640);
    if (fd < 0) {
        dp_buf_printf(err, "%s: cannot open its lock file %s: %s", what, lockpath, strerror(errno));
        return -1;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        char pid[32] = "";
        ssize_t n = pread(fd, pid, sizeof(pid) - 1, 0);
        pid[n > 0 ? n : 0] = '\0';
        pid[strcspn(pid, "\n")] = '\0';
        if (e == EWOULDBLOCK && strtol(pid, NULL, 10) == (long)getpid())
            dp_buf_printf(err,
                          "%s is still held by this detproxy's previous audit writer, which "
                          "has lines or bodies of its own still to write (a disk that does not "
                          "answer?): reload again once it lets go (audit_closed)",
                          what);
        else if (e == EWOULDBLOCK)
            dp_buf_printf(err,
                          "%s is in use by another detproxy (pid %s holds %s): two instances on "
                          "one audit trail would interleave it",
                          what, pid[0] ? pid : "unknown", lockpath);
        else
            dp_buf_printf(err, "%s: cannot lock %s: %s", what, lockpath, strerror(e));
        close(fd);
        return -1;
    }
    /* The last holder's second line (at most a head's length of it, ended by a newline) stays
     * after our pid unless a head is given. Written over the old contents, then cut to length:
     * a crash between the two leaves the head whole (load_head reads up to its newline). */
    char old[256], buf[32 + sizeof(old)];
    const char *second = mine[0] ? mine : NULL;
    if (second == NULL) {
        ssize_t got = pread(fd, old, sizeof(old) - 1, 0);
        old[got > 0 ? got : 0] = '\0';
        second = strchr(old, '\n');
        second = second && second[1] ? second + 1 : NULL;
    }
    int n = second ? snprintf(buf, sizeof(buf), "%ld\n%.*s\n", (long)getpid(),
                              (int)strcspn(second, "\n"), second)
                   : snprintf(buf, sizeof(buf), "%ld\n", (long)getpid());
    if (pwrite(fd, buf, (size_t)n, 0) != n || ftruncate(fd, n) != 0) {
        /* the lock holds without the pid; only the message of a second instance is poorer */
    }
    return fd;
}

/* The chain's head after each batch, as the lock file's second line ("chain PREV SEQ CHECKPOINT
 * SINCE", fixed width, so each write replaces the last): when logrotate has moved the file
 * away and detproxy starts again on an empty one, the new file continues the chain from here
 * instead of from genesis, and `audit verify old new` reads one chain. */
static int write_head(int lock_fd, const audit_chain_t *c)
{
    char line[224];
    int pl = snprintf(line, sizeof(line), "%ld\n", (long)getpid());
    int n = head_line(line + pl, sizeof(line) - (size_t)pl, c);
    return n > 0 && pwrite(lock_fd, line + pl, (size_t)n, pl) != n ? -errno : 0;
}

static void save_head(px_audit_t *a)
{
    int rc = write_head(a->lock_fd, &a->chain);
    if (rc != 0 && !a->head_unsaved) {
        a->head_unsaved = true; /* said once: the trail itself is unaffected */
        log_error(a, "save_chain_head", rc);
    }
}

/* Is p n lowercase hex digits (hex) or n decimal digits, followed by `end`? */
static bool field(const char *p, size_t n, bool hex, char end)
{
    for (size_t i = 0; i < n; i++)
        if (!(p[i] >= '0' && p[i] <= '9') && !(hex && p[i] >= 'a' && p[i] <= 'f'))
            return false;
    return p[n] == end;
}

/* The head the lock file keeps (save_head) into *c. 1: there is one; 0: none (a new trail, or
 * a lock file from before heads were kept); -1: a second line that is not one of ours. */
static int load_head(int lock_fd, audit_chain_t *c)
{
    char buf[256];
    ssize_t got = pread(lock_fd, buf, sizeof(buf) - 1, 0);
    buf[got > 0 ? got : 0] = '\0';
    const char *nl = strchr(buf, '\n');
    if (nl == NULL || nl[1] == '\0')
        return 0;
    /* "chain " PREV(64 hex) ' ' SEQ(20 digits) ' ' CHECKPOINT(64 hex) ' ' SINCE(20 digits) '\n' */
    const char *h = nl + 1;
    if ((size_t)(buf + (got > 0 ? got : 0) - h) < 178 || strncmp(h, "chain ", 6) != 0 ||
        !field(h + 6, 64, true, ' ') || !field(h + 71, 20, false, ' ') ||
        !field(h + 92, 64, true, ' ') || !field(h + 157, 20, false, '\n'))
        return -1;
    audit_chain_t t;
    audit_chain_init(&t);
    memcpy(t.prev, h + 6, 64);
    t.prev[64] = '\0';
    t.seq = strtoull(h + 71, NULL, 10);
    memcpy(t.checkpoint, h + 92, 64);
    t.checkpoint[64] = '\0';
    t.since_checkpoint = strtoull(h + 157, NULL, 10);
    if (strcmp(t.checkpoint, AUDIT_GENESIS) == 0)
        t.checkpoint[0] = '\0';
    *c = t;
    return 1;
}

/* The file's one name: symlinks, "." and ".." resolved (of its folder when it does not exist
 * yet), so every way of naming it reaches the same lock file. */
static int canonical(const char *path, char out[PATH_MAX])
{
    if (realpath(path, out) != NULL)
        return 0;
    const char *slash = strrchr(path, '/');
    char dir[PATH_MAX];
    snprintf(dir, sizeof(dir), "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
    if (slash == path)
        snprintf(dir, sizeof(dir), "/");
    char rdir[PATH_MAX];
    if (realpath(dir, rdir) == NULL)
        return -1;
    const char *base = slash ? slash + 1 : path;
    if (snprintf(out, PATH_MAX, "%s/%s", strcmp(rdir, "/") == 0 ? "" : rdir, base) >= PATH_MAX)
        return -1;
    return 0;
}

/* Two locks for one writer: PATH.lock beside the file's canonical name (it names the holder's
 * pid, and holds across rotations), and a flock on the file itself, which a hard link to it
 * shares (moved to each new file the writer appends to: follow_lock, open_live). The second fd
 * goes to *file_fd. */
/* PATH.lock beside path's canonical name (real), in lp: 0, or -1 with *err saying why. */
static int lock_file_name(const char *path, char real[PATH_MAX], char lp[PATH_MAX + 8],
                          dp_buf_t *err)
{
    if (canonical(path, real) != 0) {
        dp_buf_printf(err, "audit file %s: its folder cannot be resolved: %s", path,
                      strerror(errno));
        return -1;
    }
    if (snprintf(lp, PATH_MAX + 8, "%s.lock", real) >= PATH_MAX + 8) {
        dp_buf_printf(err, "audit file %s: name too long", path);
        return -1;
    }
    return 0;
}

static int lock_path(const char *path, const audit_chain_t *head, int *file_fd, dp_buf_t *err)
{
    char real[PATH_MAX], lp[PATH_MAX + 8];
    if (lock_file_name(path, real, lp, err) != 0)
        return -1;
    char what[PATH_MAX + 64];
    snprintf(what, sizeof(what), "audit file %s", path);
    int fd = take_lock(lp, what, head, err);
    if (fd < 0)
        return -1;
    int ffd = open(real, O_RDONLY | O_CREAT | O_CLOEXEC, 0640);
    if (ffd < 0) {
        /* not creatable: the writer's own open says why (and fails closed) */
    } else if (flock(ffd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        dp_buf_printf(err, "%s is in use by another detproxy under another name (a hard link: %s)",
                      what, e == EWOULDBLOCK ? "locked" : strerror(e));
        close(ffd);
        close(fd);
        return -1;
    }
    *file_fd = ffd;
    return fd;
}

/* The lock for the file fd has open, which the writer is to append to next. 0 when that is the
 * file (*dev, *ino) already locked (held): a second flock of it, through another open file
 * description, would conflict with our own. Otherwise the file is flocked through a duplicate of
 * fd, so the lock is on the very file written whatever its name is by now: 0 with *lk that new
 * fd and (*dev, *ino) naming the file. A negative errno otherwise, -EWOULDBLOCK when another
 * process holds its lock (a hard link to it is another writer's audit file). Any thread. */
static int lock_file_of(int fd, bool held, dev_t *dev, ino_t *ino, int *lk)
{
    struct stat st;
    *lk = -1;
    if (fstat(fd, &st) != 0)
        return -errno;
    if (held && st.st_dev == *dev && st.st_ino == *ino)
        return 0;
    int l = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (l < 0)
        return -errno;
    if (flock(l, LOCK_EX | LOCK_NB) != 0) {
        int e = -errno;
        close(l);
        return e;
    }
    *lk = l;
    *dev = st.st_dev;
    *ino = st.st_ino;
    return 0;
}

/* The loop's file lock becomes fd (-1: none), on the file it names; the old lock is released. */
static void set_file_lock(px_audit_t *a, int fd)
{
    struct stat st;
    if (a->file_lock_fd >= 0)
        close(a->file_lock_fd);
    a->file_lock_fd = fd;
    bool known = fd >= 0 && fstat(fd, &st) == 0;
    a->lock_dev = known ? st.st_dev : 0;
    a->lock_ino = known ? st.st_ino : 0;
}

/* Close the *n fds of fds (-1: none there) and empty the list. */
static void close_fds(int *fds, size_t *n)
{
    for (size_t i = 0; i < *n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    *n = 0;
}

/* On the loop with no batch in flight (at open): the file lock moves to a->fd's file, if it is
 * not there yet. 0 or a negative errno (-EWOULDBLOCK: another process holds that file's lock). */
static int follow_lock(px_audit_t *a)
{
    dev_t dev = a->lock_dev;
    ino_t ino = a->lock_ino;
    int lk;
    int rc = lock_file_of(a->fd, a->file_lock_fd >= 0, &dev, &ino, &lk);
    if (rc == 0 && lk >= 0)
        set_file_lock(a, lk);
    return rc;
}

static void log_locked(const dp_buf_t *why)
{
    dp_jw_t *w = dp_log_begin(DP_LOG_ERROR, "audit_locked");
    if (w) {
        dp_jw_strn(w, "detail", why->base ? why->base : "", why->len);
        dp_log_end(w);
    }
}

/* A lock not had: logged, why copied to *err (may be NULL) for the caller, why freed. */
static void refuse_locked(dp_buf_t *why, dp_buf_t *err)
{
    log_locked(why);
    if (err)
        dp_buf_append(err, why->base, why->len);
    dp_buf_free(why);
}

/* ---- batches --------------------------------------------------------------------------------- */

static void batch_clear(batch_t *b)
{
    for (size_t i = 0; i < b->nblobs; i++)
        free(b->blobs[i].bytes);
    b->nblobs = 0;
    b->ne = 0;
    b->has_reopen = false;
    dp_buf_reset(&b->raw);
}

static void batch_free(batch_t *b)
{
    batch_clear(b);
    free(b->blobs);
    free(b->e);
    dp_buf_free(&b->raw);
}

static bool batch_empty(const batch_t *b)
{
    return b->ne == 0;
}

static entry_t *batch_add(batch_t *b, entry_kind_t kind)
{
    if (b->ne == b->ecap) {
        b->ecap = b->ecap ? b->ecap * 2 : 16;
        b->e = dp_xrealloc(b->e, b->ecap * sizeof(*b->e));
    }
    entry_t *e = &b->e[b->ne++];
    memset(e, 0, sizeof(*e));
    e->kind = kind;
    e->blob0 = b->nblobs;
    return e;
}

/* Open w_path for the batch, the file lock moved to it (thread pool: the lock the batch takes
 * goes back to the loop in w_lock_fd). The fd, or -1 with *err the negative errno and *op what
 * failed: "lock" with w_locked set when another process holds the file's lock, so that nothing
 * of ours is written into another writer's file. */
static int open_live(px_audit_t *a, int *err, const char **op)
{
    int fd = open_file(a->w_path);
    if (fd < 0) {
        *err = -errno;
        *op = "open";
        return -1;
    }
    int lk;
    int rc =
        lock_file_of(fd, a->w_lock_held || a->w_lock_fd >= 0, &a->w_lock_dev, &a->w_lock_ino, &lk);
    if (rc != 0) {
        close(fd);
        *err = rc;
        *op = "lock";
        if (rc == -EWOULDBLOCK)
            a->w_locked = true;
        return -1;
    }
    if (lk >= 0) {
        if (a->w_lock_fd >= 0)
            close(a->w_lock_fd); /* taken earlier in this batch, on a file it leaves now */
        a->w_lock_fd = lk;
    }
    return fd;
}

/* Write w_out (the segment of entries [from, to) that is in it) to the file; on a failure cut
 * the file back to where it was and fail those entries. 0 or a negative errno. */
static int flush_segment(px_audit_t *a, size_t from, size_t to, audit_chain_t *c)
{
    batch_t *b = &a->inflight;
    int rc = 0;
    if (a->w_out.len == 0)
        goto done;
    if (a->fd < 0 && (a->fd = open_live(a, &rc, &a->w_op)) < 0)
        goto done; /* a failed open earlier was tried again, and failed again */
    struct stat st;
    off_t was = fstat(a->fd, &st) == 0 ? st.st_size : -1;
    rc = audit_write_all(a->fd, a->w_out.base, a->w_out.len);
    if (rc != 0) {
        a->w_op = "write";
        /* A partial write (ENOSPC) would leave a fragment the next line is appended to: the file
         * goes back to its last complete line, where the chain still is. */
        if (was >= 0 && ftruncate(a->fd, was) != 0)
            a->w_op = "write (and cutting back its partial line failed)";
    }
done:
    if (rc == 0) {
        a->chain = *c;
        /* The lock file names the last line now, not after the batch: a crash later in it (a
         * reopen's new file begun, a store fsync) leaves a head that a file rotated away
         * while detproxy was down continues (batch_done saves it again, and says if it
         * cannot). */
        uv_mutex_lock(&a->head_mu);
        write_head(a->w_head_fd, c);
        if (a->lock_fd != a->w_head_fd)
            write_head(a->lock_fd, c);
        uv_mutex_unlock(&a->head_mu);
        for (size_t i = from; i < to; i++)
            if (b->e[i].in_file && b->e[i].kind == E_LINE)
                b->e[i].written = true;
    } else {
        *c = a->chain;
        for (size_t i = from; i < to; i++)
            if (b->e[i].in_file && b->e[i].kind == E_LINE)
                b->e[i].status = rc;
    }
    for (size_t i = from; i < to; i++)
        b->e[i].in_file = false;
    dp_buf_reset(&a->w_out);
    return rc;
}

/* The batch's file work; on the thread pool (or on the loop at shutdown). Touches only the
 * batch, fd, chain and the w_* fields: the loop leaves them alone while `writing`. The file lock
 * stays the loop's: a new file's lock comes back in w_lock_fd, for batch_done. */
static void write_batch(px_audit_t *a)
{
    batch_t *b = &a->inflight;
    a->w_status = a->w_store_status = 0;
    a->w_failed_lines = a->w_unstored_lines = 0;
    audit_chain_t c = a->chain;
    size_t seg = 0;
    int failed = 0; /* once a segment failed, the rest of the batch is not written */
    for (size_t i = 0; i < b->ne; i++) {
        entry_t *e = &b->e[i];
        if (e->kind == E_REOPEN) {
            if (failed == 0 && (failed = flush_segment(a, seg, i, &c)) != 0)
                a->w_status = failed;
            seg = i + 1;
            int err;
            const char *op;
            int fd = open_live(a, &err, &op);
            if (fd < 0) {
                /* Stay on the old file. A new file whose lock another process holds is that
                 * process's to write: audit_locked says so, and the lines go on in the old. */
                if (err != -EWOULDBLOCK) {
                    a->w_op = op;
                    a->w_status = err;
                }
                continue;
            }
            if (a->fd >= 0) {
                fsync(a->fd); /* the old file is finished: make it whole on disk now */
                close(a->fd);
            }
            a->fd = fd;
            a->w_moved = true;
            failed = 0; /* a new file (perhaps another disk): try it */
            continue;
        }
        if (failed) {
            if (e->kind == E_LINE)
                e->status = failed;
            continue;
        }
        if (e->kind == E_CHECKPOINT) {
            if (a->w_key &&
                audit_chain_checkpoint(&c, a->w_key, e->reason, dp_wall_ms(), &a->w_out) != 0) {
                a->w_op = "sign";
                a->w_status = UV_EINVAL;
            }
            continue;
        }
        int bs = 0;
        for (size_t k = e->blob0; k < e->blob0 + e->nblob && a->w_store; k++) {
            int rc = audit_store_put(a->w_store, b->blobs[k].sha, b->blobs[k].bytes, b->blobs[k].n,
                                     &a->w_store_op);
            if (rc != 0)
                bs = a->w_store_status = rc;
        }
        e->status = bs;
        e->unstored = bs != 0;
        if (bs != 0 && a->w_closed)
            continue; /* fail closed: the request is refused, so no line says it was answered */
        /* Fail open: the line is written and says its bodies are not in the store, so the
         * trail verifies with the store and no line names bodies it silently lacks. */
        const char *line = b->raw.base + e->off;
        int fr = bs != 0 ? audit_chain_append_unstored(&c, line, e->len, &a->w_out)
                         : audit_chain_append(&c, line, e->len, &a->w_out);
        if (fr != 0) {
            e->status = UV_EINVAL;
            a->w_op = "format";
            a->w_status = UV_EINVAL;
            continue;
        }
        e->in_file = true;
        if (a->w_key && c.since_checkpoint >= a->w_lines &&
            audit_chain_checkpoint(&c, a->w_key, "interval", dp_wall_ms(), &a->w_out) != 0) {
            a->w_op = "sign";
            a->w_status = UV_EINVAL;
        }
    }
    if (failed == 0 && (failed = flush_segment(a, seg, b->ne, &c)) != 0)
        a->w_status = failed;
    for (size_t i = 0; i < b->ne; i++) {
        if (b->e[i].kind != E_LINE)
            continue;
        if (!b->e[i].written)
            a->w_failed_lines++;
        if (b->e[i].unstored)
            a->w_unstored_lines++;
    }
}

static void work_cb(uv_work_t *req)
{
    px_audit_t *a = req->data;
    write_batch(a);
    /* Signing a checkpoint gives this pool thread OpenSSL state of its own (its error queue).
     * OpenSSL frees it as the thread exits, unless OPENSSL_cleanup has run by then, which at
     * exit it has: libuv joins its pool later. Freed after each batch that may have signed. */
    if (a->w_key)
        OPENSSL_thread_stop();
}

static void note_anchor(px_audit_t *a)
{
    if (a->chain.seq == a->anchor_seq && strcmp(a->chain.checkpoint, a->anchor_sha) == 0)
        return;
    if (a->anchor_sha[0]) { /* one anchor series at a time: the old one goes */
        char old[24];
        snprintf(old, sizeof(old), "%llu", (unsigned long long)a->anchor_seq);
        px_metrics_drop("seq", old, "sha256", a->anchor_sha);
    }
    a->anchor_seq = a->chain.seq;
    memcpy(a->anchor_sha, a->chain.checkpoint, sizeof(a->anchor_sha));
    if (a->anchor_sha[0] == '\0')
        return;
    px_metrics_set(a->m_seq, (double)a->anchor_seq);
    char seq[24];
    snprintf(seq, sizeof(seq), "%llu", (unsigned long long)a->anchor_seq);
    px_metrics_set(
        px_metrics_get("detproxy_audit_checkpoint_info", "seq", seq, "sha256", a->anchor_sha, NULL),
        1);
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "audit_checkpoint");
    if (w) {
        dp_jw_str(w, "path", a->path);
        dp_jw_uint(w, "seq", a->anchor_seq);
        dp_jw_str(w, "sha256", a->anchor_sha);
        dp_log_end(w);
    }
}

/* The file is empty (new, or rotated away): the lock file kept the chain's head (found 1), or
 * its second line is not one (-1: the chain starts at genesis, which `audit verify` across
 * the files will show as a break at this file's first line). */
static void log_head(px_audit_t *a, int found)
{
    dp_jw_t *w = dp_log_begin(found > 0 ? DP_LOG_INFO : DP_LOG_WARN,
                              found > 0 ? "audit_chain_continued" : "audit_chain_head_unreadable");
    if (w) {
        dp_jw_str(w, "path", a->path);
        if (found > 0) {
            dp_jw_str(w, "prev_sha256", a->chain.prev);
            dp_jw_uint(w, "checkpoint_seq", a->chain.seq);
        }
        dp_jw_str(w, "detail",
                  found > 0 ? "the file is empty: its first line continues the chain the lock "
                              "file's head names (the previous file, rotated away)"
                            : "the file is empty and the lock file's second line is not a chain "
                              "head: the chain starts at genesis here");
        dp_log_end(w);
    }
}

/* The names made in store folder dir reach the disk (each body's bytes were fsynced before its
 * rename); on the loop. */
static void sync_folder(px_audit_t *a, const char *dir)
{
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd) != 0)
        log_error(a, "fsync", -errno);
    if (dfd >= 0)
        close(dfd);
}

/* Back on the loop: errors, state, then every line's callback with its own status. */
static void batch_done(px_audit_t *a)
{
    batch_t *b = &a->inflight;
    if (a->w_store_status != 0)
        log_error(a, a->w_store_op, a->w_store_status);
    if (a->w_status != 0)
        log_error(a, a->w_op, a->w_status);
    bool ok = a->w_status == 0 && a->w_store_status == 0;
    atomic_store_explicit(&a->writable, ok, memory_order_relaxed);
    px_metrics_set(a->m_writable, ok ? 1 : 0);
    if (a->w_failed_lines)
        px_metrics_add(a->m_errors, (double)a->w_failed_lines);
    a->errors += a->w_failed_lines;
    if (a->w_unstored_lines)
        px_metrics_add(a->m_store_errors, (double)a->w_unstored_lines);
    a->store_errors += a->w_unstored_lines;
    if (b->nblobs)
        a->store_dirty = true;
    a->dirty = true;
    save_head(a);
    if (a->w_lock_fd >= 0) {
        /* The batch moved to a new file and locked it: the old file's lock goes. Unless a reopen
         * onto another path took that one's lock meanwhile: its E_REOPEN is next. */
        if (strcmp(a->w_path, a->path) == 0)
            set_file_lock(a, a->w_lock_fd);
        else
            close(a->w_lock_fd);
        a->w_lock_fd = -1;
    }
    if (a->w_moved && a->old_locks_armed) {
        /* Nothing more goes to the files they lock. */
        size_t armed = a->old_locks_armed;
        close_fds(a->old_locks, &armed);
        a->nold_locks -= a->old_locks_armed;
        memmove(a->old_locks, a->old_locks + a->old_locks_armed, a->nold_locks * sizeof(int));
    }
    a->old_locks_armed = 0;
    if (a->nold_store_locks) {
        /* The batch is done with the store it used, which a reload replaced meanwhile: the
         * names it made there reach the disk (the timer syncs only the store in use), then
         * another writer may take the folder. */
        if (b->nblobs && a->w_store && (a->store == NULL || strcmp(a->w_store, a->store) != 0))
            sync_folder(a, a->w_store);
        close_fds(a->old_store_locks, &a->nold_store_locks);
    }
    if (a->w_locked) {
        dp_buf_t why = {0};
        dp_buf_printf(&why,
                      "audit file %s is in use by another detproxy under another name (a hard "
                      "link: locked): lines go on in the file open before it",
                      a->w_path);
        log_locked(&why);
        dp_buf_free(&why);
    }
    free(a->w_path);
    free(a->w_store);
    a->w_path = a->w_store = NULL;
    a->w_key = NULL;
    for (size_t i = 0; i < a->nretired; i++)
        attest_key_free(a->retired[i]);
    a->nretired = 0;
    note_anchor(a);
}

static void run_callbacks(px_audit_t *a, batch_t *b)
{
    for (size_t i = 0; i < b->ne; i++) {
        entry_t *e = &b->e[i];
        if (e->kind != E_LINE)
            continue;
        if (e->written)
            a->lines++;
        if (e->cb)
            e->cb(e->data, e->status);
    }
}

static void after_work_cb(uv_work_t *req, int status)
{
    px_audit_t *a = req->data;
    (void)status;
    batch_done(a);
    a->writing = false;
    /* Callbacks may queue more lines (into pending): the batch is cleared after them. */
    run_callbacks(a, &a->inflight);
    batch_clear(&a->inflight);
    start_write(a);
    maybe_release(a);
}

static void swap_batches(px_audit_t *a)
{
    batch_t t = a->inflight;
    a->inflight = a->pending;
    a->pending = t;
    batch_clear(&a->pending);
    a->w_path = dp_xstrdup(a->path);
    a->w_head_fd = a->lock_fd;
    a->w_store = a->store ? dp_xstrdup(a->store) : NULL;
    a->w_key = a->key;
    a->w_lines = a->checkpoint_lines;
    a->w_closed = a->fail_closed;
    a->w_lock_dev = a->lock_dev;
    a->w_lock_ino = a->lock_ino;
    a->w_lock_held = a->file_lock_fd >= 0;
    a->w_lock_fd = -1;
    a->w_locked = false;
    a->w_moved = false;
    a->old_locks_armed = a->nold_locks; /* their reopens are in this batch or went before it */
}

static void start_write(px_audit_t *a)
{
    if (a->writing || a->closing || batch_empty(&a->pending))
        return;
    swap_batches(a);
    a->writing = true;
    a->work.data = a;
    if (uv_queue_work(a->loop, &a->work, work_cb, after_work_cb) != 0) {
        write_batch(a); /* cannot happen with a live loop; never drop lines over it */
        after_work_cb(&a->work, 0);
    }
}

static void fsync_cb(uv_fs_t *req)
{
    px_audit_t *a = req->data;
    if (req->result < 0)
        log_error(a, "fsync", (int)req->result);
    uv_fs_req_cleanup(req);
    a->syncing = false;
    maybe_release(a); /* its file was kept open for this fsync */
}

/* The store's new names reach the disk on the same once-a-second beat as the lines (each body's
 * bytes were fsynced before its rename). */
static void sync_store(px_audit_t *a)
{
    if (!a->store_dirty || a->store == NULL)
        return;
    a->store_dirty = false;
    sync_folder(a, a->store);
}

static void fsync_timer_cb(uv_timer_t *t)
{
    px_audit_t *a = t->data;
    if (!a->dirty || a->syncing || a->writing || a->fd < 0)
        return;
    sync_store(a);
    a->dirty = false;
    a->syncing = true;
    a->fsync_req.data = a;
    if (uv_fs_fsync(a->loop, &a->fsync_req, a->fd, fsync_cb) != 0)
        a->syncing = false;
}

/* ---- open: resume the chain, repair a torn tail ---------------------------------------------- */

/* Move from to the name to, never replacing a file there: renameat2(RENAME_NOREPLACE), or where
 * the filesystem or kernel lacks it, link(2) then unlink(2) (link fails on a name taken just the
 * same). 0 or a negative errno, -EEXIST when the name is taken. */
static int move_noreplace(const char *from, const char *to)
{
    if (renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE) == 0)
        return 0;
    if (errno != EINVAL && errno != ENOSYS)
        return -errno;
    if (link(from, to) != 0)
        return -errno;
    if (unlink(from) != 0) {
        int e = -errno;
        unlink(to); /* back to the one name it had */
        return e;
    }
    return 0;
}

/* The file ends with bytes after its last '\n' (a crash mid-write): set it aside, untouched, as
 * PATH.torn-TIME, or PATH.torn-TIME.1, .2, ... when that name is taken (a crash loop repairs more
 * than once a second: the earlier file must stay), and start a new PATH (a->fd, the file lock
 * moved to it) with a repair line that names the set-aside file and the fragment and chains from
 * the last complete line. 0; or a negative errno with *why saying so, and the caller refuses to
 * start, when the file cannot be set aside, the new file's lock is another process's (nothing
 * is written to it), or the repair line cannot be written (the torn file goes back to PATH). */
static int repair_torn(px_audit_t *a, const audit_torn_t *t, dp_buf_t *why)
{
    char ts[32], stamp[4120], rotated[4200];
    uint64_t now = dp_wall_ms();
    dp_iso8601(ts, now);
    /* 2026-01-02T03:04:05.678Z -> 20260102T030405Z: a name without ':' */
    char compact[24];
    size_t k = 0;
    for (const char *p = ts; *p && *p != '.' && k < sizeof(compact) - 2; p++)
        if (*p != '-' && *p != ':')
            compact[k++] = *p;
    compact[k++] = 'Z';
    compact[k] = '\0';
    snprintf(stamp, sizeof(stamp), "%s.torn-%s", a->path, compact);
    int rc = -EEXIST;
    for (int i = 0; i <= TORN_NAMES && rc == -EEXIST; i++) {
        int n = i == 0 ? snprintf(rotated, sizeof(rotated), "%s", stamp)
                       : snprintf(rotated, sizeof(rotated), "%s.%d", stamp, i);
        rc = n < (int)sizeof(rotated) ? move_noreplace(a->path, rotated) : -ENAMETOOLONG;
    }
    if (rc != 0) {
        /* Appending after the fragment would break the trail for good: refused like a trail
         * that is not ours, with why. */
        dp_buf_printf(why,
                      "audit file %s ends in a line a crash cut short, and it cannot be set aside "
                      "as %s (%s): fix the folder's permissions, or move the file away",
                      a->path, stamp, strerror(-rc));
        return rc;
    }
    dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "audit_torn_tail");
    if (w) {
        dp_jw_str(w, "path", a->path);
        dp_jw_str(w, "set_aside", rotated);
        dp_jw_uint(w, "torn_offset", t->offset);
        dp_jw_uint(w, "torn_bytes", t->len);
        dp_jw_str(w, "torn_sha256", t->sha256);
        dp_log_end(w);
    }
    a->fd = open_file(a->path);
    int open_err = a->fd < 0 ? -errno : 0;
    if (a->fd >= 0 && (rc = follow_lock(a)) != 0) {
        dp_buf_printf(why,
                      "audit file %s is in use by another detproxy under another name (a hard "
                      "link: %s): the file the torn-tail repair started is not ours to write",
                      a->path, rc == -EWOULDBLOCK ? "locked" : strerror(-rc));
        return rc;
    }
    const char *base = strrchr(rotated, '/');
    base = base ? base + 1 : rotated;
    dp_buf_t out = {0};
    audit_chain_repair(&a->chain, t, base, now, &out);
    rc = a->fd < 0 ? open_err : audit_write_all(a->fd, out.base, out.len);
    if (rc == 0 && fsync(a->fd) != 0)
        rc = -errno;
    dp_buf_free(&out);
    if (rc != 0) {
        /* The chain would go on from a line in no file. Undone instead: the torn file back at
         * PATH over the new one (rename replaces it at once), so the next start repairs it
         * again, and this one is refused. */
        log_error(a, "write", rc);
        int back = rename(rotated, a->path) == 0 ? 0 : -errno;
        dp_buf_printf(why,
                      "audit file %s ends in a line a crash cut short, and the line that repairs "
                      "it could not be written (%s): %s",
                      a->path, strerror(-rc),
                      back == 0 ? "the file is back as it was; free space and start again"
                                : "and moving the torn file back failed: move it back by hand");
        return rc;
    }
    return 0;
}

/* A file with lines but no checkpoint of its own (a crash before a rotated file's first): its
 * checkpoints go on from the trail's last, which the lock file's head names, not from seq 1.
 * When the head names this file's last line, its count of lines since that checkpoint is the
 * trail's (the file's own count leaves out those of the files before it). */
static void seq_from_head(px_audit_t *a, int lock)
{
    audit_chain_t h;
    if (a->chain.seq == 0 && load_head(lock, &h) == 1 && h.seq > 0) {
        a->chain.seq = h.seq;
        memcpy(a->chain.checkpoint, h.checkpoint, sizeof(h.checkpoint));
        if (strcmp(h.prev, a->chain.prev) == 0)
            a->chain.since_checkpoint = h.since_checkpoint;
    }
}

px_audit_t *px_audit_open(uv_loop_t *loop, const char *path, dp_buf_t *err)
{
    dp_buf_t why = {0};
    int file_lock = -1;
    int lock = lock_path(path, NULL, &file_lock, &why);
    if (lock < 0) {
        refuse_locked(&why, err);
        return NULL;
    }
    dp_buf_free(&why);
    px_audit_t *a = dp_xcalloc(1, sizeof(*a));
    a->loop = loop;
    a->path = dp_xstrdup(path);
    a->lock_fd = lock;
    a->file_lock_fd = -1;
    set_file_lock(a, file_lock);
    a->fd = -1;
    a->w_lock_fd = -1;
    a->w_head_fd = -1;
    uv_mutex_init(&a->head_mu);
    a->store_lock_fd = -1;
    a->checkpoint_lines = 1000;
    a->fail_closed = true;
    atomic_init(&a->writable, true);
    px_metrics_family("detproxy_audit_writable", PX_GAUGE,
                      "1 while the audit trail's last write succeeded, 0 after a failed one.");
    px_metrics_family("detproxy_audit_checkpoint_seq", PX_GAUGE,
                      "The seq of the audit trail's latest signed checkpoint (the anchor).");
    px_metrics_family("detproxy_audit_checkpoint_info", PX_GAUGE,
                      "Always 1; seq and sha256 of the latest checkpoint line (the anchor).");
    a->m_errors = px_metrics_get("detproxy_audit_write_errors_total", NULL);
    a->m_store_errors = px_metrics_get("detproxy_audit_store_errors_total", NULL);
    a->m_seq = px_metrics_get("detproxy_audit_checkpoint_seq", NULL);
    a->m_writable = px_metrics_get("detproxy_audit_writable", NULL);
    px_metrics_set(a->m_writable, 1);
    audit_torn_t torn;
    struct stat st;
    bool empty = stat(path, &st) != 0 || st.st_size == 0;
    int refused = 0, head = 0;
    int rc = audit_chain_resume_torn(&a->chain, path, &torn);
    if (rc != 0) {
        /* Lines chained from genesis into a trail that has lines would break it for good. */
        refused = rc;
        dp_buf_printf(&why,
                      "audit file %s: its chain cannot be resumed (%s; a last line over 1 MiB is "
                      "not detproxy's): move the file away",
                      path, strerror(-rc));
    } else {
        /* No complete line (empty, or only a fragment: a crash during the first write into a
         * rotated file): the chain's head is the lock file's. Lines: theirs, and the lock
         * file's checkpoint seq when they have no checkpoint of their own. */
        if (torn.torn ? torn.offset == 0 : empty) {
            head = load_head(lock, &a->chain); /* said once the start is sure (log_head) */
        } else {
            seq_from_head(a, lock);
        }
        if (torn.torn)
            refused = repair_torn(a, &torn, &why);
    }
    if (refused == 0 && a->fd < 0)
        a->fd = open_file(path);
    if (refused == 0 && a->fd < 0) {
        log_error(a, "open", -errno);
        atomic_store(&a->writable, false);
        px_metrics_set(a->m_writable, 0);
    } else if (refused == 0 && (refused = follow_lock(a)) != 0) {
        /* the file at path is no longer the one lock_path locked (moved meanwhile) */
        dp_buf_printf(&why,
                      "audit file %s is in use by another detproxy under another name (a "
                      "hard link: %s)",
                      path, refused == -EWOULDBLOCK ? "locked" : strerror(-refused));
    }
    if (refused != 0) {
        /* Another writer's file: refused like a locked trail, nothing of ours in it. */
        refuse_locked(&why, err);
        px_metrics_set(a->m_writable, 0);
        if (a->fd >= 0)
            close(a->fd);
        set_file_lock(a, -1);
        close(a->lock_fd);
        uv_mutex_destroy(&a->head_mu);
        free(a->path);
        free(a);
        return NULL;
    }
    if (head != 0)
        log_head(a, head);
    a->anchor_sha[0] = '\0';
    note_anchor(a);
    uv_timer_init(loop, &a->fsync_timer);
    a->fsync_timer.data = a;
    uv_timer_start(&a->fsync_timer, fsync_timer_cb, FSYNC_EVERY_MS, FSYNC_EVERY_MS);
    uv_unref((uv_handle_t *)&a->fsync_timer); /* the audit log alone never keeps us running */
    return a;
}

/* The writer's lock on the store lock file lp: that of the store in use, or of one a batch in
 * flight may still write into (old_store_locks); -1 when it holds none there. */
static int held_store_lock(const px_audit_t *a, const char *lp)
{
    struct stat held, st;
    if (a == NULL || stat(lp, &st) != 0)
        return -1;
    for (size_t i = 0; i <= a->nold_store_locks; i++) {
        int fd = i == 0 ? a->store_lock_fd : a->old_store_locks[i - 1];
        if (fd >= 0 && fstat(fd, &held) == 0 && held.st_dev == st.st_dev &&
            held.st_ino == st.st_ino)
            return fd;
    }
    return -1;
}

int px_audit_store_lock(const px_audit_t *a, const char *store, dp_buf_t *err)
{
    char lp[4096], what[4200];
    snprintf(lp, sizeof(lp), "%s/.lock", store);
    /* The writer's own lock on that folder's lock file, however the folder is spelled, is
     * shared rather than taken again: a second flock of this process's would be refused as if
     * another process held it. */
    int held = held_store_lock(a, lp);
    if (held >= 0) {
        int fd = fcntl(held, F_DUPFD_CLOEXEC, 0);
        if (fd < 0 && err)
            dp_buf_printf(err, "audit store %s: cannot keep its lock: %s", store, strerror(errno));
        return fd;
    }
    snprintf(what, sizeof(what), "audit store %s", store);
    dp_buf_t why = {0};
    int fd = take_lock(lp, what, NULL, &why);
    if (fd < 0)
        refuse_locked(&why, err);
    dp_buf_free(&why);
    return fd;
}

int px_audit_configure(px_audit_t *a, const char *store, int store_lock, const char *signing_key,
                       uint32_t checkpoint_lines, bool fail_closed)
{
    assert((store == NULL) == (store_lock < 0));
    assert(!a->retiring);
    int rc = 0;
    if (a->store_lock_fd >= 0 && a->writing && a->w_store) {
        /* The batch in flight may be putting bodies into the store used before: its lock is
         * held until that batch is done (batch_done), as a moved audit file's are. */
        a->old_store_locks =
            dp_xrealloc(a->old_store_locks, (a->nold_store_locks + 1) * sizeof(int));
        a->old_store_locks[a->nold_store_locks++] = a->store_lock_fd;
    } else if (a->store_lock_fd >= 0) {
        close(a->store_lock_fd);
    }
    a->store_lock_fd = store_lock;
    free(a->store);
    a->store = store ? dp_xstrdup(store) : NULL;
    a->checkpoint_lines = checkpoint_lines ? checkpoint_lines : 1000;
    a->fail_closed = fail_closed;
    attest_key_t *k = NULL;
    if (signing_key) {
        dp_buf_t err = {0};
        if (attest_key_load(signing_key, true, &k, &err) != 0) {
            dp_jw_t *w = dp_log_begin(DP_LOG_ERROR, "audit_signing_key_failed");
            if (w) {
                dp_jw_str(w, "path", signing_key);
                dp_jw_strn(w, "error", err.base ? err.base : "", err.len);
                dp_log_end(w);
            }
            k = NULL;
            rc = -1;
        }
        dp_buf_free(&err);
    }
    if (a->writing && a->key) {
        a->retired = dp_xrealloc(a->retired, (a->nretired + 1) * sizeof(*a->retired));
        a->retired[a->nretired++] = a->key;
    } else {
        attest_key_free(a->key);
    }
    a->key = k;
    return rc;
}

bool px_audit_stores(const px_audit_t *a)
{
    return a && a->store != NULL;
}

bool px_audit_writable(const px_audit_t *a)
{
    return a && atomic_load_explicit(&a->writable, memory_order_relaxed);
}

void px_audit_state(const px_audit_t *a, px_audit_state_t *out)
{
    memset(out, 0, sizeof(*out));
    out->seq = a->anchor_seq;
    memcpy(out->sha256, a->anchor_sha, sizeof(out->sha256));
    out->lines = a->lines;
    out->errors = a->errors;
    out->store_errors = a->store_errors;
    out->path = a->path;
    out->store = a->store;
    out->writable = px_audit_writable(a);
    out->signing = a->key != NULL;
    out->fail_closed = a->fail_closed;
}

void px_audit_write_bodies(px_audit_t *a, const char *line, size_t n, const px_audit_body_t *b,
                           size_t nb, px_audit_cb cb, void *data)
{
    assert(!a->retiring);
    batch_t *p = &a->pending;
    entry_t *e = batch_add(p, E_LINE);
    for (size_t i = 0; a->store && i < nb; i++) {
        if (p->nblobs == p->bcap) {
            p->bcap = p->bcap ? p->bcap * 2 : 8;
            p->blobs = dp_xrealloc(p->blobs, p->bcap * sizeof(*p->blobs));
        }
        blob_t *x = &p->blobs[p->nblobs++];
        e->nblob++;
        memcpy(x->sha, b[i].sha256, 65);
        if (b[i].take) {
            x->n = b[i].take->len;
            x->bytes = dp_buf_steal(b[i].take);
            continue;
        }
        x->bytes = dp_xmalloc(b[i].len ? b[i].len : 1);
        if (b[i].len)
            memcpy(x->bytes, b[i].base, b[i].len);
        x->n = b[i].len;
    }
    e->off = p->raw.len;
    dp_buf_append(&p->raw, line, n);
    e->len = n;
    e->cb = cb;
    e->data = data;
    start_write(a);
}

/* ---- from the workers ------------------------------------------------------------------------
 *
 * One writer, on the control thread, keeps the chain and the file; a worker's line travels
 * there with copies of its bodies, and its completion travels back to the worker, so the
 * worker's callback runs on the worker's loop once the write containing the line completed:
 * the same guarantee as a write made here (a held response waits for its line). */
typedef struct {
    net_mb_node_t node;
    px_t *px;
    unsigned slot; /* the submitting worker's */
    dp_buf_t line;
    size_t nb;
    char sha[PX_AUDIT_MAX_BODIES][65];
    dp_buf_t bytes[PX_AUDIT_MAX_BODIES];
    px_audit_cb cb;
    void *data;
    int status;
} audit_msg_t;

static void audit_msg_free(audit_msg_t *m)
{
    dp_buf_free(&m->line);
    for (size_t i = 0; i < m->nb; i++)
        dp_buf_free(&m->bytes[i]);
    free(m);
}

static void completed_on_worker(net_mb_node_t *n)
{
    audit_msg_t *m = (audit_msg_t *)n;
    px_audit_cb cb = m->cb;
    void *data = m->data;
    int status = m->status;
    audit_msg_free(m);
    cb(data, status);
}

static void written(void *data, int status)
{
    audit_msg_t *m = data;
    m->status = status;
    /* A worker already stopped (shutdown): its loop is the control thread's now. */
    if (!px_thread_post(m->px, m->slot, &m->node, completed_on_worker))
        completed_on_worker(&m->node);
}

static void write_posted(net_mb_node_t *n)
{
    audit_msg_t *m = (audit_msg_t *)n;
    px_audit_t *a = m->px->audit;
    if (a == NULL) { /* turned off by a reload in the meantime, or its file is locked */
        if (m->cb)
            written(m, UV_ECANCELED);
        else
            audit_msg_free(m);
        return;
    }
    px_audit_body_t b[PX_AUDIT_MAX_BODIES];
    for (size_t i = 0; i < m->nb; i++)
        b[i] = (px_audit_body_t){m->sha[i], NULL, 0, &m->bytes[i]};
    px_audit_write_bodies(a, m->line.base, m->line.len, b, m->nb, m->cb ? written : NULL, m);
    if (m->cb == NULL)
        audit_msg_free(m);
}

void px_audit_submit(px_t *px, const char *line, size_t n, const px_audit_body_t *b, size_t nb,
                     px_audit_cb cb, void *data)
{
    if (nb > PX_AUDIT_MAX_BODIES)
        nb = PX_AUDIT_MAX_BODIES;
    if (px_thread_on_control()) {
        if (px->audit)
            px_audit_write_bodies(px->audit, line, n, b, nb, cb, data);
        else if (cb)
            cb(data, UV_ECANCELED);
        return;
    }
    audit_msg_t *m = dp_xcalloc(1, sizeof(*m));
    m->px = px;
    m->slot = px_thread_slot();
    dp_buf_append(&m->line, line, n);
    for (size_t i = 0; i < nb; i++) {
        memcpy(m->sha[i], b[i].sha256, 65);
        if (b[i].take)
            m->bytes[i] = *b[i].take, memset(b[i].take, 0, sizeof(*b[i].take));
        else
            dp_buf_append(&m->bytes[i], b[i].base ? b[i].base : "", b[i].len);
        m->nb = i + 1;
    }
    m->cb = cb;
    m->data = data;
    /* Always delivered (never dropped like a shadow sample): an audit line is evidence, and
     * the lines waiting are bounded by the requests in flight (one each, max_connections). */
    px_thread_post_control(px, &m->node, write_posted);
}

void px_audit_write(px_audit_t *a, const char *line, size_t n, px_audit_cb cb, void *data)
{
    px_audit_write_bodies(a, line, n, NULL, 0, cb, data);
}

/* The lock of `path` (its lock file's fd) when it is one a reopen moved away from and still
 * holds (old_locks), taken out of old_locks with its file lock in *file_lock; else -1. */
static int reclaim_old_locks(px_audit_t *a, const char *path, int *file_lock)
{
    char real[PATH_MAX], lp[PATH_MAX + 8];
    struct stat want, st;
    dp_buf_t why = {0}; /* lock_path, next, says why */
    int named = a->nold_locks ? lock_file_name(path, real, lp, &why) : -1;
    dp_buf_free(&why);
    if (named != 0 || stat(lp, &want) != 0)
        return -1;
    for (size_t i = 0; i + 1 < a->nold_locks; i += 2) {
        if (fstat(a->old_locks[i], &st) != 0 || st.st_dev != want.st_dev ||
            st.st_ino != want.st_ino)
            continue;
        int lock = a->old_locks[i];
        *file_lock = a->old_locks[i + 1];
        memmove(a->old_locks + i, a->old_locks + i + 2, (a->nold_locks - i - 2) * sizeof(int));
        a->nold_locks -= 2;
        if (i < a->old_locks_armed)
            a->old_locks_armed -= 2; /* no longer the batch in flight's to release */
        return lock;
    }
    return -1;
}

int px_audit_reopen(px_audit_t *a, const char *path, dp_buf_t *err)
{
    assert(!a->retiring);
    if (path && strcmp(path, a->path) != 0) {
        dp_buf_t why = {0};
        int file_lock = -1;
        /* Back onto a path whose locks are still ours (A to B to A before B's batch moved, or
         * B never opened): a lock taken again would conflict with our own. */
        int lock = reclaim_old_locks(a, path, &file_lock);
        bool reclaimed = lock >= 0;
        /* The new path's lock file names the chain's head from the moment it exists (the last
         * line written, which the old lock file names): a crash before the reopen's batch is
         * written then starts the new file from there, not from genesis. */
        uv_mutex_lock(&a->head_mu);
        audit_chain_t h;
        bool have = load_head(a->lock_fd, &h) == 1;
        if (!reclaimed)
            lock = lock_path(path, have ? &h : NULL, &file_lock, &why); /* created with it */
        else if (have)
            write_head(lock, &h);
        int old = a->lock_fd;
        if (lock >= 0)
            a->lock_fd = lock;
        uv_mutex_unlock(&a->head_mu);
        if (lock < 0) {
            refuse_locked(&why, err);
            return -1;
        }
        dp_buf_free(&why);
        /* The old path's locks stay until its file is no longer written (batch_done). */
        a->old_locks = dp_xrealloc(a->old_locks, (a->nold_locks + 2) * sizeof(int));
        a->old_locks[a->nold_locks++] = old;
        a->old_locks[a->nold_locks++] = a->file_lock_fd;
        a->file_lock_fd = -1;
        set_file_lock(a, file_lock);
        free(a->path);
        a->path = dp_xstrdup(path);
    }
    /* A checkpoint closes the old file; the new file's first line names it. Two reopens before
     * a batch starts: the second is folded into the first. */
    if (a->key)
        batch_add(&a->pending, E_CHECKPOINT)->reason = "reopen";
    if (!a->pending.has_reopen) {
        batch_add(&a->pending, E_REOPEN);
        a->pending.has_reopen = true;
    }
    start_write(a);
    return 0;
}

/* Lines were written or are to be, unsigned since the last checkpoint: a closing checkpoint
 * is due (a process that wrote none and finds none unsigned, a start refused after the audit
 * file was opened, leaves the trail as it found it). The batch in flight owns the chain: while
 * one is, it is due. */
static bool closing_checkpoint_due(const px_audit_t *a)
{
    return a->key &&
           (a->writing || a->lines || !batch_empty(&a->pending) || a->chain.since_checkpoint);
}

/* The writer holds nothing on disk any more: the store's new names and the file made durable,
 * the file closed, every lock released. Idempotent. */
static void let_go(px_audit_t *a)
{
    sync_store(a);
    if (a->fd >= 0) {
        fsync(a->fd);
        close(a->fd);
        a->fd = -1;
    }
    if (a->store_lock_fd >= 0)
        close(a->store_lock_fd);
    a->store_lock_fd = -1;
    set_file_lock(a, -1);
    if (a->lock_fd >= 0)
        close(a->lock_fd);
    a->lock_fd = -1;
    close_fds(a->old_locks, &a->nold_locks);
    close_fds(a->old_store_locks, &a->nold_store_locks);
}

/* A retiring writer whose lines are all written (no batch in flight, nothing queued: the
 * queue was closed by px_audit_retire) and whose file no fsync uses lets go of it. */
static void maybe_release(px_audit_t *a)
{
    if (!a->retiring || a->released || a->writing || a->syncing)
        return;
    assert(batch_empty(&a->pending));
    a->released = true;
    uv_timer_stop(&a->fsync_timer);
    let_go(a);
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "audit_closed");
    if (w) {
        dp_jw_str(w, "path", a->path);
        dp_jw_uint(w, "lines", a->lines);
        dp_jw_str(w, "detail",
                  "the configuration has no audit_path any more: the lines queued "
                  "before the reload are written, the file is closed and its locks "
                  "released");
        dp_log_end(w);
    }
}

void px_audit_retire(px_audit_t *a)
{
    assert(!a->retiring && !a->closing);
    a->retiring = true;
    if (closing_checkpoint_due(a))
        batch_add(&a->pending, E_CHECKPOINT)->reason = "shutdown";
    start_write(a);
    maybe_release(a);
}

static void timer_closed(uv_handle_t *h)
{
    free(h->data);
}

void px_audit_close(px_audit_t *a)
{
    /* A thread-pool batch may still be running: let the loop finish it first (a retiring
     * writer's queue with it: it lets go once that is written). */
    while (a->writing || a->syncing)
        uv_run(a->loop, UV_RUN_ONCE);
    a->closing = true;
    if (!a->retiring && closing_checkpoint_due(a))
        batch_add(&a->pending, E_CHECKPOINT)->reason = "shutdown";
    if (!batch_empty(&a->pending)) {
        swap_batches(a);
        write_batch(a);
        batch_done(a);
        run_callbacks(a, &a->inflight);
    }
    let_go(a);
    for (size_t i = 0; i < a->pending.ne; i++) /* queued by the callbacks above: not written */
        a->pending.e[i].status = UV_ECANCELED;
    run_callbacks(a, &a->pending);
    batch_free(&a->pending);
    batch_free(&a->inflight);
    dp_buf_free(&a->w_out);
    attest_key_free(a->key);
    free(a->retired);
    free(a->store);
    free(a->path);
    uv_mutex_destroy(&a->head_mu);
    free(a->old_locks);
    free(a->old_store_locks);
    a->fsync_timer.data = a;
    uv_close((uv_handle_t *)&a->fsync_timer, timer_closed);
}
