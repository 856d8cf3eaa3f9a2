#include "proxy/px_audit.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/buf.h"
#include "common/log.h"
#include "proxy/px_metrics.h"

#define FSYNC_EVERY_MS 1000

typedef struct waiter_s {
    px_audit_cb cb;
    void *data;
    struct waiter_s *next;
} waiter_t;

/* Lines accumulate in `pending` while one uv_fs_write of `inflight` is running: at most one
 * write at a time keeps lines in order, and batches them under load. */
struct px_audit_s {
    uv_loop_t *loop;
    char *path;
    uv_file fd;
    dp_buf_t pending, inflight;
    waiter_t *pending_w, **pending_tail, *inflight_w;
    uv_fs_t write_req, fsync_req;
    bool writing, syncing, dirty, reopen, closing;
    uv_timer_t fsync_timer;
    px_series_t *m_errors;
};

static void start_write(px_audit_t *a);

static int open_file(const char *path)
{
    return open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
}

static void log_error(px_audit_t *a, const char *what, int err)
{
    px_metric_add(a->m_errors, 1);
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

static void write_cb(uv_fs_t *req)
{
    px_audit_t *a = req->data;
    ssize_t r = req->result;
    uv_fs_req_cleanup(req);
    int status = 0;
    if (r < 0) {
        status = (int)r;
        log_error(a, "write", status);
    } else if ((size_t)r < a->inflight.len) {
        /* Short write: retry the rest before anything else, keeping lines whole and in order. */
        dp_buf_consume(&a->inflight, (size_t)r);
        uv_buf_t b = uv_buf_init(a->inflight.base, (unsigned)a->inflight.len);
        if (uv_fs_write(a->loop, &a->write_req, a->fd, &b, 1, -1, write_cb) == 0)
            return;
        status = UV_EIO;
        log_error(a, "write", status);
    }
    a->dirty = true;
    a->writing = false;
    dp_buf_reset(&a->inflight);
    waiter_t *w = a->inflight_w;
    a->inflight_w = NULL;
    run_waiters(w, status);
    start_write(a);
}

static void start_write(px_audit_t *a)
{
    if (a->writing || a->pending.len == 0 || a->closing)
        return;
    if (a->reopen) {
        a->reopen = false;
        int fd = open_file(a->path);
        if (fd < 0) {
            log_error(a, "open", -errno);
        } else {
            if (a->fd >= 0)
                close(a->fd);
            a->fd = fd;
        }
    }
    if (a->fd < 0) {
        /* No file: count and drop, but never hold a response hostage to the audit disk. */
        log_error(a, "open", UV_EBADF);
        waiter_t *w = a->pending_w;
        a->pending_w = NULL;
        a->pending_tail = &a->pending_w;
        dp_buf_reset(&a->pending);
        run_waiters(w, UV_EBADF);
        return;
    }
    dp_buf_t t = a->inflight;
    a->inflight = a->pending;
    a->pending = t;
    a->inflight_w = a->pending_w;
    a->pending_w = NULL;
    a->pending_tail = &a->pending_w;
    a->writing = true;
    a->write_req.data = a;
    uv_buf_t b = uv_buf_init(a->inflight.base, (unsigned)a->inflight.len);
    if (uv_fs_write(a->loop, &a->write_req, a->fd, &b, 1, -1, write_cb) != 0) {
        a->writing = false;
        log_error(a, "write", UV_EIO);
        waiter_t *w = a->inflight_w;
        a->inflight_w = NULL;
        dp_buf_reset(&a->inflight);
        run_waiters(w, UV_EIO);
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

static void fsync_timer_cb(uv_timer_t *t)
{
    px_audit_t *a = t->data;
    if (!a->dirty || a->syncing || a->fd < 0)
        return;
    a->dirty = false;
    a->syncing = true;
    a->fsync_req.data = a;
    if (uv_fs_fsync(a->loop, &a->fsync_req, a->fd, fsync_cb) != 0)
        a->syncing = false;
}

px_audit_t *px_audit_open(uv_loop_t *loop, const char *path)
{
    px_audit_t *a = dp_xcalloc(1, sizeof(*a));
    a->loop = loop;
    a->path = dp_xstrdup(path);
    a->pending_tail = &a->pending_w;
    a->m_errors = px_metrics_get("detproxy_audit_write_errors_total", NULL);
    a->fd = open_file(path);
    if (a->fd < 0)
        log_error(a, "open", -errno);
    uv_timer_init(loop, &a->fsync_timer);
    a->fsync_timer.data = a;
    uv_timer_start(&a->fsync_timer, fsync_timer_cb, FSYNC_EVERY_MS, FSYNC_EVERY_MS);
    uv_unref((uv_handle_t *)&a->fsync_timer); /* the audit log alone never keeps us running */
    return a;
}

void px_audit_write(px_audit_t *a, const char *line, size_t n, px_audit_cb cb, void *data)
{
    dp_buf_append(&a->pending, line, n);
    if (cb) {
        waiter_t *w = dp_xcalloc(1, sizeof(*w));
        w->cb = cb;
        w->data = data;
        *a->pending_tail = w;
        a->pending_tail = &w->next;
    }
    start_write(a);
}

void px_audit_reopen(px_audit_t *a, const char *path)
{
    if (path && strcmp(path, a->path) != 0) {
        free(a->path);
        a->path = dp_xstrdup(path);
    }
    if (a->writing) {
        a->reopen = true; /* after the write in flight */
        return;
    }
    int fd = open_file(a->path);
    if (fd < 0) {
        log_error(a, "open", -errno);
        return;
    }
    if (a->fd >= 0)
        close(a->fd);
    a->fd = fd;
}

static void write_all(px_audit_t *a, dp_buf_t *b)
{
    size_t off = 0;
    while (off < b->len && a->fd >= 0) {
        ssize_t r = write(a->fd, b->base + off, b->len - off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            log_error(a, "write", -errno);
            return;
        }
        off += (size_t)r;
    }
}

static void timer_closed(uv_handle_t *h)
{
    free(h->data);
}

void px_audit_close(px_audit_t *a)
{
    a->closing = true;
    /* A thread-pool write may still be running: let the loop finish it first. */
    while (a->writing || a->syncing)
        uv_run(a->loop, UV_RUN_ONCE);
    write_all(a, &a->pending);
    if (a->fd >= 0) {
        fsync(a->fd);
        close(a->fd);
        a->fd = -1;
    }
    waiter_t *w = a->pending_w;
    a->pending_w = NULL;
    run_waiters(w, 0);
    dp_buf_free(&a->pending);
    dp_buf_free(&a->inflight);
    free(a->path);
    a->fsync_timer.data = a;
    uv_close((uv_handle_t *)&a->fsync_timer, timer_closed);
}
