#include "proxy/obs/audit.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attest/audit.h"
#include "common/buf.h"
#include "common/log.h"
#include "common/util.h"
#include "proxy/core/px.h"
#include "proxy/core/metrics.h"

#define FSYNC_EVERY_MS 1000

typedef struct waiter_s {
    px_audit_cb cb;
    void *data;
    struct waiter_s *next;
} waiter_t;

typedef struct {
    char sha[65];
    char *bytes;
    size_t n;
} blob_t;

/* One batch: the bodies first, then the lines. With `split` set, the lines before it close the
 * old file (its reopen checkpoint is the last of them) and the rest open the new one. */
typedef struct {
    dp_buf_t lines;
    blob_t *blobs;
    size_t nblobs, cap;
    size_t split; /* SIZE_MAX: no reopen in this batch */
    waiter_t *w, **tail;
} batch_t;

/* Lines accumulate in `pending` while one batch (`inflight`) is written on the thread pool: at
 * most one at a time keeps lines in order, and batches them under load. The chain advances when
 * a line is queued, so its order is the file's order. */
struct px_audit_s {
    uv_loop_t *loop;
    char *path;
    char *store;       /* NULL: bodies are not stored */
    attest_key_t *key; /* NULL: no checkpoints */
    uint32_t checkpoint_lines;
    audit_chain_t chain;
    uv_file fd;
    batch_t pending, inflight;
    uv_work_t work;
    uv_fs_t fsync_req;
    bool writing, syncing, dirty, store_dirty, closing;
    uv_timer_t fsync_timer;
    px_series_t *m_errors;
    /* Set by the worker, read by the loop once it is done. */
    char *w_path;  /* the file of the batch in flight (its reopen target with a split) */
    char *w_store; /* the store of the batch in flight: a reload may change a->store meanwhile */
    int w_status, w_store_status;
    const char *w_op, *w_store_op;
};

static void start_write(px_audit_t *a);
static void batch_done(px_audit_t *a);

static int open_file(const char *path)
{
    return open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
}

static void log_error(px_audit_t *a, const char *what, int err)
{
    px_metrics_add(a->m_errors, 1);
    dp_jw_t *w = dp_log_begin(DP_LOG_ERROR, "audit_write_failed");
    if (w) {
        dp_jw_str(w, "path", a->path);
        dp_jw_str(w, "op", what);
        dp_jw_str(w, "error", uv_strerror(err));
        dp_log_end(w);
    }
}

static void run_waiters(waiter_t *w, int status)
{
    while (w) {
        waiter_t *next = w->next;
        if (w->cb)
            w->cb(w->data, status);
        free(w);
        w = next;
    }
}

static void batch_init(batch_t *b)
{
    b->split = SIZE_MAX;
    b->w = NULL;
    b->tail = &b->w;
}

static void batch_clear(batch_t *b)
{
    for (size_t i = 0; i < b->nblobs; i++)
        free(b->blobs[i].bytes);
    b->nblobs = 0;
    dp_buf_reset(&b->lines);
    batch_init(b);
}

static void batch_free(batch_t *b)
{
    batch_clear(b);
    free(b->blobs);
    dp_buf_free(&b->lines);
}

/* The batch's file work; on the thread pool (or on the loop at shutdown). Touches only the
 * batch, fd and the w_* fields: the loop leaves them alone while `writing`. */
static void write_batch(px_audit_t *a)
{
    batch_t *b = &a->inflight;
    a->w_status = a->w_store_status = 0;
    for (size_t i = 0; i < b->nblobs; i++) {
        int rc = audit_store_put(a->w_store, b->blobs[i].sha, b->blobs[i].bytes, b->blobs[i].n,
                                 &a->w_store_op);
        if (rc != 0)
            a->w_store_status = rc; /* the line is still written: verify names the gap */
    }
    if (a->fd < 0)
        a->fd = open_file(a->w_path); /* a failed open earlier: try again */
    size_t split = b->split == SIZE_MAX ? b->lines.len : b->split;
    if (a->fd < 0) {
        a->w_op = "open";
        a->w_status = UV_EBADF;
    } else if ((a->w_status = audit_write_all(a->fd, b->lines.base, split)) != 0) {
        a->w_op = "write";
    }
    if (b->split == SIZE_MAX)
        return;
    int fd = open_file(a->w_path);
    if (fd < 0) {
        a->w_op = "open";
        a->w_status = -errno;
        if (a->fd < 0)
            return;
    } else {
        if (a->fd >= 0) {
            fsync(a->fd); /* the old file is finished: make it whole on disk now */
            close(a->fd);
        }
        a->fd = fd;
    }
    int rc = audit_write_all(a->fd, b->lines.base + split, b->lines.len - split);
    if (rc != 0) {
        a->w_op = "write";
        a->w_status = rc;
    }
}

static void work_cb(uv_work_t *req)
{
    write_batch(req->data);
}

static void after_work_cb(uv_work_t *req, int status)
{
    px_audit_t *a = req->data;
    (void)status;
    batch_done(a);
    a->writing = false;
    waiter_t *w = a->inflight.w;
    batch_clear(&a->inflight);
    run_waiters(w, a->w_status);
    start_write(a);
}

static void swap_batches(px_audit_t *a)
{
    batch_t t = a->inflight;
    a->inflight = a->pending;
    a->pending = t;
    if (a->inflight.w == NULL)
        a->inflight.tail = &a->inflight.w;
    batch_clear(&a->pending);
    a->w_path = dp_xstrdup(a->path);
    a->w_store = a->store ? dp_xstrdup(a->store) : NULL;
}

static void batch_done(px_audit_t *a)
{
    if (a->w_store_status != 0)
        log_error(a, a->w_store_op, a->w_store_status);
    if (a->w_status != 0)
        log_error(a, a->w_op, a->w_status);
    if (a->inflight.nblobs)
        a->store_dirty = true;
    a->dirty = true;
    free(a->w_path);
    free(a->w_store);
    a->w_path = a->w_store = NULL;
}

static void start_write(px_audit_t *a)
{
    if (a->writing || a->closing ||
        (a->pending.lines.len == 0 && a->pending.nblobs == 0 && a->pending.split == SIZE_MAX))
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
}

/* The store's new names reach the disk on the same once-a-second beat as the lines (each body's
 * bytes were fsynced before its rename). */
static void sync_store(px_audit_t *a)
{
    if (!a->store_dirty || a->store == NULL)
        return;
    a->store_dirty = false;
    int dfd = open(a->store, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd) != 0)
        log_error(a, "fsync", -errno);
    if (dfd >= 0)
        close(dfd);
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

static void resume_chain(px_audit_t *a, const char *path)
{
    int rc = audit_chain_resume(&a->chain, path);
    if (rc != 0)
        log_error(a, "resume_chain", rc);
}

px_audit_t *px_audit_open(uv_loop_t *loop, const char *path)
{
    px_audit_t *a = dp_xcalloc(1, sizeof(*a));
    a->loop = loop;
    a->path = dp_xstrdup(path);
    batch_init(&a->pending);
    batch_init(&a->inflight);
    a->m_errors = px_metrics_get("detproxy_audit_write_errors_total", NULL);
    resume_chain(a, path);
    a->fd = open_file(path);
    if (a->fd < 0)
        log_error(a, "open", -errno);
    uv_timer_init(loop, &a->fsync_timer);
    a->fsync_timer.data = a;
    uv_timer_start(&a->fsync_timer, fsync_timer_cb, FSYNC_EVERY_MS, FSYNC_EVERY_MS);
    uv_unref((uv_handle_t *)&a->fsync_timer); /* the audit log alone never keeps us running */
    return a;
}

int px_audit_configure(px_audit_t *a, const char *store, const char *signing_key,
                       uint32_t checkpoint_lines)
{
    free(a->store);
    a->store = store ? dp_xstrdup(store) : NULL;
    a->checkpoint_lines = checkpoint_lines ? checkpoint_lines : 1000;
    attest_key_t *k = NULL;
    int rc = 0;
    if (signing_key) {
        dp_buf_t err = {0};
        rc = attest_key_load(signing_key, true, &k, &err);
        if (rc != 0) {
            dp_jw_t *w = dp_log_begin(DP_LOG_ERROR, "audit_signing_key_failed");
            if (w) {
                dp_jw_str(w, "path", signing_key);
                dp_jw_strn(w, "error", err.base ? err.base : "", err.len);
                dp_log_end(w);
            }
            k = NULL;
        }
        dp_buf_free(&err);
    }
    attest_key_free(a->key);
    a->key = k;
    return rc;
}

bool px_audit_stores(const px_audit_t *a)
{
    return a && a->store != NULL;
}

static void checkpoint(px_audit_t *a, const char *reason)
{
    if (a->key &&
        audit_chain_checkpoint(&a->chain, a->key, reason, dp_wall_ms(), &a->pending.lines) != 0)
        log_error(a, "sign", UV_EINVAL);
}

void px_audit_write_bodies(px_audit_t *a, const char *line, size_t n, const px_audit_body_t *b,
                           size_t nb, px_audit_cb cb, void *data)
{
    batch_t *p = &a->pending;
    for (size_t i = 0; a->store && i < nb; i++) {
        if (p->nblobs == p->cap) {
            p->cap = p->cap ? p->cap * 2 : 8;
            p->blobs = dp_xrealloc(p->blobs, p->cap * sizeof(*p->blobs));
        }
        blob_t *x = &p->blobs[p->nblobs++];
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
    if (audit_chain_append(&a->chain, line, n, &p->lines) != 0)
        log_error(a, "format", UV_EINVAL);
    if (a->key && a->chain.since_checkpoint >= a->checkpoint_lines)
        checkpoint(a, "interval");
    if (cb) {
        waiter_t *w = dp_xcalloc(1, sizeof(*w));
        w->cb = cb;
        w->data = data;
        *p->tail = w;
        p->tail = &w->next;
    }
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
    char sha[2][65];
    dp_buf_t bytes[2];
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
    if (a == NULL) { /* turned off by a reload in the meantime */
        if (m->cb)
            written(m, UV_ECANCELED);
        else
            audit_msg_free(m);
        return;
    }
    px_audit_body_t b[2];
    for (size_t i = 0; i < m->nb; i++)
        b[i] = (px_audit_body_t){m->sha[i], NULL, 0, &m->bytes[i]};
    px_audit_write_bodies(a, m->line.base, m->line.len, b, m->nb, m->cb ? written : NULL, m);
    if (m->cb == NULL)
        audit_msg_free(m);
}

void px_audit_submit(px_t *px, const char *line, size_t n, const px_audit_body_t *b, size_t nb,
                     px_audit_cb cb, void *data)
{
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
    for (size_t i = 0; i < nb && i < 2; i++) {
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

void px_audit_reopen(px_audit_t *a, const char *path)
{
    if (path && strcmp(path, a->path) != 0) {
        free(a->path);
        a->path = dp_xstrdup(path);
    }
    /* A checkpoint closes the old file; the new file's first line names it. Two reopens before
     * a batch starts: the first one's split stands, the second is folded into it. */
    checkpoint(a, "reopen");
    if (a->pending.split == SIZE_MAX)
        a->pending.split = a->pending.lines.len;
    start_write(a);
}

static void timer_closed(uv_handle_t *h)
{
    free(h->data);
}

void px_audit_close(px_audit_t *a)
{
    /* A thread-pool batch may still be running: let the loop finish it first. */
    while (a->writing || a->syncing)
        uv_run(a->loop, UV_RUN_ONCE);
    a->closing = true;
    checkpoint(a, "shutdown");
    if (a->pending.lines.len || a->pending.nblobs || a->pending.split != SIZE_MAX) {
        swap_batches(a);
        write_batch(a);
        batch_done(a);
    }
    sync_store(a);
    if (a->fd >= 0) {
        fsync(a->fd);
        close(a->fd);
        a->fd = -1;
    }
    run_waiters(a->inflight.w, 0);
    run_waiters(a->pending.w, 0);
    batch_free(&a->pending);
    batch_free(&a->inflight);
    attest_key_free(a->key);
    free(a->store);
    free(a->path);
    a->fsync_timer.data = a;
    uv_close((uv_handle_t *)&a->fsync_timer, timer_closed);
}
