/* The audit trail file (docs/policy.md §7, docs/operations.md "Evidence"): JSON lines appended with
 * O_APPEND through libuv's thread pool, so a slow disk never blocks the event loop. fsync at most
 * once a second and at shutdown; reopened on SIGHUP for log rotation; a failed write is logged and
 * counted (detproxy_audit_write_errors_total), never fatal.
 *
 * Every line is hash-chained (attest/audit.h; the chain resumes from the file's last line
 * at open and carries across reopens); with a signing key, a signed checkpoint line follows
 * every checkpoint_lines lines, closes the old file at reopen and the file at shutdown. With a
 * store, the bodies queued with a line are written (content-addressed) before that line. */
#ifndef PX_AUDIT_H
#define PX_AUDIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/buf.h"

typedef struct px_audit_s px_audit_t;

/* Called once the line was handed to the kernel (or failed: status < 0). */
typedef void (*px_audit_cb)(void *data, int status);

px_audit_t *px_audit_open(uv_loop_t *loop, const char *path);
/* Queue one line (copied). cb (may be NULL) runs once the write containing it completed. */
void px_audit_write(px_audit_t *a, const char *line, size_t n, px_audit_cb cb, void *data);
/* Store folder (NULL: none), signing key file (NULL: no checkpoints), checkpoint interval;
 * at start and on reload. A key that does not load is logged and means no checkpoints; -1. */
int px_audit_configure(px_audit_t *a, const char *store, const char *signing_key,
                       uint32_t checkpoint_lines);
bool px_audit_stores(const px_audit_t *a);

typedef struct {
    const char *sha256; /* 64 hex + NUL: the body's name in the store */
    const char *base;
    size_t len;
    dp_buf_t *take; /* non-NULL: the bytes are this buffer's, taken (left empty), not copied */
} px_audit_body_t;
/* px_audit_write, storing bodies (copied or taken; ignored without a store) before the line. */
void px_audit_write_bodies(px_audit_t *a, const char *line, size_t n, const px_audit_body_t *b,
                           size_t nb, px_audit_cb cb, void *data);
/* From any thread: px_audit_write_bodies on px->audit, on the control thread; cb runs on the
 * calling thread's loop once the line is written (status < 0: failed, or the writer's queue
 * was full). */
struct px_s;
void px_audit_submit(struct px_s *px, const char *line, size_t n, const px_audit_body_t *b,
                     size_t nb, px_audit_cb cb, void *data);
/* Reopen the file at path (rotation); pending lines go to the new file. */
void px_audit_reopen(px_audit_t *a, const char *path);
/* Flush everything synchronously, fsync, close and free (shutdown). Callbacks of pending lines
 * run with their status before it returns. */
void px_audit_close(px_audit_t *a);

#endif
