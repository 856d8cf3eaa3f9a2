/* The audit trail file (docs/policy.md §7, docs/operations.md "Evidence"): JSON lines appended with
 * O_APPEND through libuv's thread pool, so a slow disk never blocks the event loop. fsync at most
 * once a second and at shutdown; reopened on SIGHUP for log rotation.
 *
 * One writer: the file (and the store) are locked for the life of the process (PATH.lock,
 * STORE/.lock, flock(2), holding the writer's pid), so a second instance on the same files
 * refuses to start instead of interleaving lines. A flock on the file written, which a hard link
 * to it shares, moves with it: to the new file at a reopen and after a torn-tail repair.
 *
 * Every line is hash-chained (attest/audit.h); the chain resumes from the file's last complete
 * line at open and carries across reopens. A file whose last line a crash tore is set aside at
 * open (PATH.torn-TIME, or PATH.torn-TIME.N when that name is taken: never replacing a file) and
 * the new file starts with a repair line naming that file and the torn bytes. With a
 * signing key, a signed checkpoint line (numbered: seq) follows every checkpoint_lines lines,
 * closes the old file at reopen and the file at shutdown; the latest one is the anchor
 * (px_audit_anchor: logged as audit_checkpoint, exported as a metric, served by the admin API).
 *
 * Lines are chained when their batch is written, not when queued: a batch that fails (a full
 * disk) is cut back out of the file (ftruncate to where it started) and the chain stays at the
 * last line on disk, so a write error never leaves a fragment or a gap in the chain. Each line's
 * callback gets its own status. With fail_closed, a line whose stored bodies cannot be written
 * is not written either (its request is refused: no line claims an answer nobody got); without,
 * it is written with "bodies_stored":false (attest/audit.h), so `audit verify --store` knows
 * those bodies are not to be found, and its callback still gets the store's error. */
#ifndef PX_AUDIT_H
#define PX_AUDIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/buf.h"

typedef struct px_audit_s px_audit_t;

/* Called once the line was handed to the kernel (status 0) or could not be (status < 0). */
typedef void (*px_audit_cb)(void *data, int status);

/* Lock PATH.lock, recover a torn tail, open the file. NULL when another process holds the lock
 * (logged as audit_locked, naming its pid), the file's own lock (a hard link: also the file a
 * torn-tail repair started), or the lock file cannot be made; *err (may be NULL) then says why. */
px_audit_t *px_audit_open(uv_loop_t *loop, const char *path, dp_buf_t *err);
/* Queue one line (copied). cb (may be NULL) runs once the write containing it completed. */
void px_audit_write(px_audit_t *a, const char *line, size_t n, px_audit_cb cb, void *data);
/* The lock of audit store folder store (STORE/.lock, holding our pid), taken ahead of the
 * px_audit_configure that is to use the store, so that a store another process holds refuses
 * a start or a reload before anything of it is applied. a (may be NULL) is the writer: a lock
 * it holds on that folder already (the store in use, or one a batch in flight still writes
 * into) is shared (a dup), not taken again. The lock (an fd, the caller's until handed to
 * px_audit_configure); -1 when another process holds it or it cannot be made (logged as
 * audit_locked, naming the holder's pid; *err, may be NULL, says why). */
int px_audit_store_lock(const px_audit_t *a, const char *store, dp_buf_t *err);
/* Store folder (NULL: none) with its lock from px_audit_store_lock (taken over; -1 exactly when
 * store is NULL), signing key file (NULL: no checkpoints), checkpoint interval, and whether a
 * line whose bodies failed is dropped (fail_closed); at start and on reload. The lock of the
 * store used before is released once nothing writes into it: at once, or when the batch in
 * flight (which may be storing bodies there) is done. 0; -1 when the key does not load
 * (logged: no checkpoints). */
int px_audit_configure(px_audit_t *a, const char *store, int store_lock, const char *signing_key,
                       uint32_t checkpoint_lines, bool fail_closed);
bool px_audit_stores(const px_audit_t *a);
/* false from a failed write until a write succeeds again; any thread (a relaxed read). */
bool px_audit_writable(const px_audit_t *a);

typedef struct {
    uint64_t seq;          /* 0: no checkpoint yet */
    char sha256[65];       /* of the checkpoint line */
    uint64_t lines;        /* lines written since start */
    uint64_t errors;       /* lines not written since start */
    uint64_t store_errors; /* lines whose bodies could not be stored, written or not */
    const char *path;      /* borrowed */
    const char *store;     /* borrowed, NULL none */
    bool writable, signing, fail_closed;
} px_audit_state_t;
/* The writer's state for the admin API (control thread). */
void px_audit_state(const px_audit_t *a, px_audit_state_t *out);

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
 * calling thread's loop once the line is written (status < 0: failed, or there is no writer).
 * At most PX_AUDIT_MAX_BODIES bodies. */
#define PX_AUDIT_MAX_BODIES 3
struct px_s;
void px_audit_submit(struct px_s *px, const char *line, size_t n, const px_audit_body_t *b,
                     size_t nb, px_audit_cb cb, void *data);
/* Reopen the file at path (NULL: the same path; rotation); pending lines go to the new file, and
 * the file lock with them (kept when it is the same file). 0 once the reopen is queued. -1 when
 * path is a new path whose locks another process holds (logged as audit_locked; *err, may be
 * NULL, says why): nothing is queued and the writer stays on its file. A new file at the same
 * path whose flock another process holds is met by the batch (logged as audit_locked then): the
 * writer stays on its file too. */
int px_audit_reopen(px_audit_t *a, const char *path, dp_buf_t *err);
/* The configuration has no audit trail any more (a reload removed audit_path): no line is
 * taken from now on (the caller drops a from where lines are submitted); the lines queued
 * before, and with a signing key a shutdown checkpoint after them, are written to the file,
 * then it is fsynced and closed and every lock released: the path's, the file's and the
 * store's, as a move releases the old path's (logged as audit_closed). a stays valid, holding
 * nothing, until px_audit_close frees it. */
void px_audit_retire(px_audit_t *a);
/* Flush everything synchronously, fsync, close, unlock and free (shutdown; a retired writer
 * first writes what its retirement has not yet). Callbacks of pending lines run with their
 * status before it returns. */
void px_audit_close(px_audit_t *a);

#endif
