/* Checkpoint hashing (docs/attestation.md §1) and cheap change detection for a model directory.
 *
 * The checkpoint hash is defined so that the coreutils pipeline of docs/attestation.md §1
 * (find -L, the hidden-path filter, LC_ALL=C sort, xargs sha256sum, sha256sum) reproduces it: every
 * regular file under DIR (symlinks followed, any path component starting with '.' skipped),
 * relative path with '/' separators, sorted bytewise; one line per file
 * "<sha256 hex>  <relpath>\n"; the checkpoint hash is the SHA-256 of all lines concatenated.
 *
 * Where the pipeline and the definition could disagree we fail instead of picking one:
 *   - a file name containing '\n', '\r' or '\\' is an error (sha256sum escapes such names, and
 *     xargs -d '\n' splits on newlines), so a digest we print is always reproducible;
 *   - a directory reached again through a symlink while already on the current path (a loop),
 *     ELOOP, or a tree deeper than ATTEST_HASH_MAX_DEPTH is an error (find warns and goes on,
 *     which would silently hash a different set of files).
 * Broken symlinks, FIFOs, sockets and devices are not regular files: skipped, as find does.
 *
 * Everything here is blocking file I/O with no libuv in it: the agent runs it on a worker thread
 * (uv_queue_work), the CLI on the main thread. No function here logs. */
#ifndef ATTEST_HASH_H
#define ATTEST_HASH_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"

#define ATTEST_HASH_MAX_DEPTH 64
/* Large reads keep syscall overhead well below the cost of SHA-256 itself. */
#define ATTEST_HASH_READ_SIZE ((size_t)4 << 20)

/* One regular file as seen when the directory was listed. */
typedef struct {
    char *relpath; /* relative to DIR, '/' separators, no leading "./" */
    uint64_t size;
    int64_t mtime_ns; /* st_mtim of the file (after following symlinks) */
    int64_t ctime_ns; /* st_ctim: moves on every write and cannot be set back (touch -d can) */
    uint64_t dev;
    uint64_t ino;
} attest_file_t;

/* The listing of a directory, sorted bytewise by relpath. Owns its strings. */
typedef struct {
    attest_file_t *files;
    size_t count;
    uint64_t total_bytes;
} attest_snapshot_t;

typedef struct {
    uint64_t files_done, files_total;
    uint64_t bytes_done, bytes_total;
    const char *current; /* relpath being hashed; valid only during the callback */
} attest_progress_t;

/* Called from the hashing thread after every read (every ATTEST_HASH_READ_SIZE bytes at most)
 * and once per file start; it must be cheap and do its own rate limiting. */
typedef void (*attest_progress_cb)(const attest_progress_t *p, void *data);

typedef struct {
    attest_progress_cb progress; /* may be NULL */
    void *progress_data;
    const atomic_int *cancel; /* may be NULL; when it becomes non-zero hashing stops (-ECANCELED) */
    size_t read_size;         /* 0: ATTEST_HASH_READ_SIZE */
    /* Refuse (-ESTALE) a hash when a file's ctime or mtime is less than this before the walk
     * started (0: no such check). File timestamps are coarse (a kernel tick, or worse): a
     * write in the same tick as the listed ctime leaves it unchanged, so only a file that has
     * been quiet for longer than the granularity is known not to be changing ("racy git"). */
    uint64_t settled_ns;
} attest_hash_opts_t;

/* How a directory is walked. Zero-initialised: the checkpoint rules above (docs/attestation.md
 * §1). The OMS verifier (oms.h) sets its own (dotfiles included, recorded ignore paths, symlink
 * policy). */
typedef struct {
    bool include_hidden;     /* list names starting with '.' too */
    bool any_file_name;      /* do not refuse names with '\n', '\r' or '\\' */
    bool no_follow_symlinks; /* a symlink is not followed: on_symlink decides */
    /* Leave out this relpath (and its subtree); called before the entry is even stat'ed. */
    bool (*exclude)(const char *relpath, void *data);
    /* With no_follow_symlinks: 0 skips the link (the callback records it), negative fails the
     * walk with that errno. NULL: fail with -ELOOP. */
    int (*on_symlink)(const char *relpath, void *data);
    /* A FIFO, socket or device (never opened): 0 skips it (the callback records it), 1 lists
     * it like a file (so that its appearing is a change), negative fails the walk with that
     * errno. NULL: skipped. */
    int (*on_special)(const char *relpath, void *data);
    void *data;
} attest_walk_opts_t;

/* List DIR (stat only, no reads). Returns 0, or a negative errno with a one-line reason in *err
 * (appended; err may be NULL). On failure *out is left empty. */
int attest_snapshot_take(const char *dir, attest_snapshot_t *out, dp_buf_t *err);
void attest_snapshot_free(attest_snapshot_t *s);
/* The same with explicit walk rules (opts NULL: the checkpoint rules). */
int attest_snapshot_take_opts(const char *dir, const attest_walk_opts_t *opts,
                              attest_snapshot_t *out, dp_buf_t *err);

/* Compare two snapshots. Returns true when they differ in the set of paths, a size, an mtime, a
 * ctime (rewritten in place with its mtime restored) or an inode (a file replaced by rename), and
 * appends a short description of the first difference to *why when why is non-NULL
 * ("model-00001.safetensors: size 10 -> 12", "added: x", ...). */
bool attest_snapshot_differs(const attest_snapshot_t *a, const attest_snapshot_t *b, dp_buf_t *why);

/* Hash DIR. On success returns 0, writes the 64-hex checkpoint hash (NUL-terminated) to out_hex,
 * and, when snap_out is non-NULL, hands over the listing the hash was computed from. Every file
 * is checked against it before and after it is read, and DIR is listed again once the whole
 * walk is done: a hash is returned only when no file changed (size, mtime, ctime, inode) from
 * the first listing to the end, so it never describes a half-written state. When lines is non-NULL
 * the per-file lines that were hashed are appended to it ("<hex>  <relpath>\n" each). Errors
 * (negative errno, reason appended to *err): unreadable directory or file, a symlink loop, an
 * unsupported file name, "file vanished during hashing: PATH", "file changed during hashing: PATH
 * (...)" and "directory changed during hashing: ..." (-ESTALE: try again once it settles),
 * -ECANCELED. opts may be NULL. */
int attest_hash_dir(const char *dir, const attest_hash_opts_t *opts, char out_hex[65],
                    attest_snapshot_t *snap_out, dp_buf_t *lines, dp_buf_t *err);

/* A model that is one file (a GGUF) or a folder. For a regular file (symlinks followed) the
 * hash is the SHA-256 of its bytes, what `sha256sum FILE` prints and Hugging Face shows for the
 * file (docs/attestation.md §1), and the snapshot has one entry (relpath: the file's name), so
 * attest_snapshot_differs tells when it changes; for a directory, attest_hash_dir (no per-file
 * lines). The file is checked as a folder's files are (same inode, size, mtime and ctime from
 * before its read to after, and the path still naming it), and settled_ns applies. *is_file
 * (may be NULL) says which it was. */
int attest_hash_path(const char *path, const attest_hash_opts_t *opts, char out_hex[65],
                     attest_snapshot_t *snap_out, bool *is_file, dp_buf_t *err);
/* The listing attest_hash_path compares against: one entry for a file, the folder's otherwise. */
int attest_snapshot_take_path(const char *path, attest_snapshot_t *out, bool *is_file,
                              dp_buf_t *err);

/* Hash one already-listed snapshot's files against DIR (the second half of attest_hash_dir). */
int attest_hash_snapshot(const char *dir, const attest_snapshot_t *snap,
                         const attest_hash_opts_t *opts, char out_hex[65], dp_buf_t *lines,
                         dp_buf_t *err);

/* One file at a time, with any OpenSSL digest ("SHA256", "BLAKE2B-512"): the hasher behind
 * attest_hash_snapshot, for callers with their own canonicalisation (OMS). Not thread-safe; one
 * per thread. attest_filehasher_file checks the file is still the one listed (as above) and
 * appends its raw digest(s) to digests: one for the whole file with shard_size 0, else one per
 * shard_size bytes (the last one short; none for an empty file). */
typedef struct attest_filehasher_s attest_filehasher_t;
attest_filehasher_t *attest_filehasher_new(const char *md_name, const attest_hash_opts_t *opts,
                                           dp_buf_t *err);
size_t attest_filehasher_size(const attest_filehasher_t *fh);
int attest_filehasher_file(attest_filehasher_t *fh, const char *dir, const attest_file_t *f,
                           uint64_t shard_size, dp_buf_t *digests, dp_buf_t *err);
void attest_filehasher_free(attest_filehasher_t *fh);

#endif
