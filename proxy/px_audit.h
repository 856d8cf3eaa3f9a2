/* The audit trail file (SPEC §8): JSON lines appended with O_APPEND through libuv's thread
 * pool, so a slow disk never blocks the event loop. fsync at most once a second and at
 * shutdown; reopened on SIGHUP for log rotation; a failed write is logged and counted
 * (detproxy_audit_write_errors_total), never fatal. */
#ifndef PX_AUDIT_H
#define PX_AUDIT_H

#include <stddef.h>

#include <uv.h>

typedef struct px_audit_s px_audit_t;

/* Called once the line was handed to the kernel (or failed: status < 0). */
typedef void (*px_audit_cb)(void *data, int status);

px_audit_t *px_audit_open(uv_loop_t *loop, const char *path);
/* Queue one line (copied). cb (may be NULL) runs once the write containing it completed. */
void px_audit_write(px_audit_t *a, const char *line, size_t n, px_audit_cb cb, void *data);
/* Reopen the file at path (rotation); pending lines go to the new file. */
void px_audit_reopen(px_audit_t *a, const char *path);
/* Flush everything synchronously, fsync, close and free (shutdown). Callbacks of pending lines
 * run with their status before it returns. */
void px_audit_close(px_audit_t *a);

#endif
