/* The engine's view of its files: paths it names, resolved in its root.
 *
 * An engine names its model by a path in its own root (a container's, a chroot's, or the host's),
 * and every link inside that model must be read as the engine would read it. The agent reaches
 * the engine's root through PROC/PID/root, but a path walked through that magic link resolves
 * any absolute link in it (`tokenizer.json -> /root/secret`) in the agent's root, and a link
 * through /proc/self reaches the agent's own files. While a view is on, on the calling thread
 * only, every path the hashing and shape checks open is resolved with openat2 in the engine's
 * root (RESOLVE_IN_ROOT: absolute links and ".." stay inside it) and no /proc magic link is
 * followed (RESOLVE_NO_MAGICLINKS). docs/attestation.md, "What the agent measures". */
#ifndef DP_ATTEST_VIEW_H
#define DP_ATTEST_VIEW_H

#include <stdbool.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "common/buf.h"

/* Turn the view on for this thread: the root is PROC/PID/root (pid > 0 and openable), else the
 * agent's own "/" (magic links are refused either way). A path that starts with PROC/PID/root
 * is taken as the engine's path after it. Negative errno (with err) when the kernel lacks
 * openat2 or the root cannot be opened. Views do not nest. */
int attest_view_enter(const char *proc, pid_t pid, dp_buf_t *err);
void attest_view_leave(void);
bool attest_view_on(void);

/* open(2) and stat(2) of path: in the view while it is on, plainly otherwise. -1 with errno
 * on failure, as the calls they stand for. */
int attest_view_open(const char *path, int flags);
int attest_view_stat(const char *path, struct stat *st);

#endif
