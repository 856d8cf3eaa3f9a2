/* The engine an agent measures (docs/attestation.md §4, "What the agent measures"): which
 * process serves --framework-url, where the model that engine reports having loaded is from the
 * agent's side, whether that process has it open or mapped, and how the agent's flags weigh
 * against the engine's own report.
 *
 * The agent sees the engine's process only when it shares the engine's network namespace (the
 * listening socket in /proc/net/tcp) and PID namespace (the socket among /proc/PID/fd), with the
 * engine's uid or CAP_SYS_PTRACE (the kernel's rule for another process's fd, maps, root and
 * cwd). Everything here answers "not seen" rather than guess when it cannot look.
 *
 * Synchronous reads of /proc (in-memory files) and stat(); no libuv. attest_proc_loaded reads a
 * process's whole maps file: the agent calls it from a worker thread. */
#ifndef ATTEST_ENGINE_H
#define ATTEST_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "attest/hash.h"
#include "attest/report.h"
#include "common/buf.h"

/* ---- the process serving a port ---------------------------------------------------------- */

/* The inode of the socket listening on addr's port, with addr or a wildcard (0.0.0.0, ::) as its
 * local address (a v6 socket also for a v4 addr: dual stack, or ::ffff:a.b.c.d), in one table
 * of /proc/net/tcp (v6 false) or /proc/net/tcp6 (v6 true) text. addr is AF_INET or AF_INET6.
 * 0: no such socket in this table. *uid (may be NULL) gets the uid owning it, as the reader's
 * user namespace shows it. */
uint64_t attest_net_listener(const char *table, size_t len, bool v6, const struct sockaddr *addr,
                             uint32_t *uid);

/* Is addr one of this host's own (loopback, or an address of one of its interfaces)? Only then
 * is a socket listening on its port the engine's rather than another host's port number. */
bool attest_addr_is_local(const struct sockaddr *addr);

/* The same over proc's net/tcp and net/tcp6 ("/proc": the agent's own network namespace):
 * the inode, 0 when none listens there, or a negative errno when neither table can be read. */
int64_t attest_proc_listener(const char *proc, const struct sockaddr *addr, uint32_t *uid);

/* The process holding socket:[ino] among its fds, never self: its pid, or 0 when no process
 * the agent may look into holds it. When several hold it and they do not all read alike (ids,
 * groups, capabilities, root, user namespace: a root parent and the unprivileged child that
 * serves, socket activation's pid 1), none is taken for the engine: 0, with *mixed set. Reads
 * every /proc/PID/fd it may: call it when the listening socket or its holder changed, not on
 * every check. */
pid_t attest_proc_socket_owner(const char *proc, uint64_t ino, pid_t self, bool *mixed);

/* Does a socket without a holder in proc mean that its holder hides it? True when the caller
 * is in the initial PID and user namespaces (their fixed nsfs inodes) and may look into every
 * process's fd table (CAP_SYS_PTRACE, and CAP_DAC_OVERRIDE or CAP_DAC_READ_SEARCH, in
 * proc/self/status's CapEff): then every process on the machine is in sight, and a listening
 * socket in no fd table is one kept out of them (passed over a Unix socket between accepts)
 * or in a fd table of a thread's own. False anywhere else (a container's PID namespace), where
 * the holder may just be out of sight. */
bool attest_proc_sees_every_process(const char *proc);

/* Field 22 of /proc/PID/stat, the process's start time in clock ticks since boot: another
 * value for the same pid is another process. 0 when unreadable. */
unsigned long long attest_proc_start_time(const char *proc, pid_t pid);

/* ---- the engine's model, from the agent's side ------------------------------------------- */

typedef enum {
    ATTEST_LOC_FOUND = 0,   /* l->path reaches it */
    ATTEST_LOC_NOT_LOCAL,   /* not a path on this machine: a Hub id ("org/name") */
    ATTEST_LOC_NOT_VISIBLE, /* a local path the agent cannot reach (*why says why) */
} attest_locate_t;

typedef struct {
    char *path;    /* the model as the agent opens it (owned) */
    size_t prefix; /* bytes of path before the engine's own path: "/proc/41/root" when reached
                    * through the engine's root, 0 when path is the engine's path itself */
} attest_located_t;

/* Where the engine_path the engine reports is from here. Absolute: the path itself when it
 * exists and (with pid > 0) is the same file as PROC/PID/root/PATH, else through
 * PROC/PID/root (another mount namespace or a chroot). Relative: the engine's working
 * directory placed in its root (PROC/PID/root/CWD/PATH: pid > 0, and the kernel's names for the
 * two lead to the folder it works in; one that cannot be placed is NOT_VISIBLE); without pid, a
 * llama.cpp path (always_local: -m names a file) is NOT_VISIBLE, anything else
 * NOT_LOCAL (SGLang, vLLM and TGI take Hub ids). *l is filled only for FOUND; release it with
 * attest_located_free. */
attest_locate_t attest_engine_locate(const char *proc, pid_t pid, const char *engine_path,
                                     bool always_local, attest_located_t *l, dp_buf_t *why);
void attest_located_free(attest_located_t *l);

/* Does path, which the engine names as its model (shown as `shown` in *why), look like one: a
 * GGUF file (its magic), or a folder with a config.json (a Hugging Face model's)? The agent
 * hashes what the engine names and signs the hash for anyone who asks: a path to anything
 * else (/etc/shadow, "/") is not read at all. */
bool attest_model_shaped(const char *path, const char *shown, dp_buf_t *why);

/* What was hashed from path (snap: attest_hash_path's listing; is_file as it said) is still a
 * model as attest_model_shaped has it: the very file read (device and inode) starts with GGUF's
 * magic, or the folder's listing holds a config.json. A link swapped to something else after
 * the shape was looked at is caught here. False with why otherwise: that hash must be neither
 * used nor shown. */
bool attest_model_still_shaped(const char *path, bool is_file, const attest_snapshot_t *snap,
                               dp_buf_t *why);

/* Is the folder dir (stat'ed as *dir) the located model itself or a folder above it, on the
 * engine's side of l->prefix? Compared by device and inode, so across mount namespaces; in the
 * engine's view when it is on (attest/view.h), as the model was found. */
bool attest_located_under(const attest_located_t *l, const struct stat *dir);

/* ---- what the engine's process has open or mapped --------------------------------------- */

typedef enum {
    ATTEST_LOADED_NOT_SEEN = 0, /* neither (--no-mmap reads the file and closes it) */
    ATTEST_LOADED_OPEN,         /* one of snap's files among /proc/PID/fd */
    ATTEST_LOADED_MAPPED,       /* one of snap's files in /proc/PID/maps */
} attest_loaded_t;

/* Does the text of a maps file map a file with this device and inode, or at this path? */
bool attest_maps_has(const char *maps, size_t len, uint64_t dev, uint64_t ino, const char *path);

/* The kernel's names of snap's files (listed from root: the located path, or its folder for a
 * one-file snapshot), as /proc/PID/maps shows them to the agent: each file opened as the
 * caller reads, in the engine's view when it is on (attest/view.h), so that no link in the
 * engine's root is followed in the agent's. names[i] is NULL for a file that cannot be opened
 * now. Release with attest_loaded_names_free. */
char **attest_loaded_names(const char *root, const attest_snapshot_t *snap);
void attest_loaded_names_free(char **names, size_t count);

/* Which of snap's files the process has mapped or open: by device and inode, or (overlay
 * filesystems show the lower file's) by names[i] from attest_loaded_names (may be NULL). When
 * it has none of them, *other gets the first GGUF file it does have mapped or open (the engine
 * runs another model than it reports), if any. Negative errno when its maps cannot be read
 * (the agent lacks the access). */
int attest_proc_loaded(const char *proc, pid_t pid, char *const *names,
                       const attest_snapshot_t *snap, dp_buf_t *other);

/* ---- reading as the engine's user ------------------------------------------------------- */

/* A file-system identity to read with: uid, gid and supplementary groups. */
typedef struct {
    uid_t uid;
    gid_t gid;
    size_t ngroups;
    gid_t *groups;
    bool taken;       /* by attest_fs_ident_enter: this holds what to go back to */
    bool view;        /* by attest_as_process_enter: the engine's view is on (attest/view.h) */
    uint64_t caps[2]; /* the effective capabilities gone back to (two 32-bit words each) */
    /* The engine's own effective capabilities (CapEff), when known: an engine running as uid 0
     * with fewer of them (a container with capabilities dropped) lends the agent no more. */
    bool cap_eff_known;
    uint64_t cap_eff;
} attest_fs_ident_t;

/* The identity to read what process pid names with, from its status file: its real uid and
 * gid, and its groups (the effective ids of a process running a set-user-ID program are the
 * program's, not its own: an engine exec'ing one must not lend the agent root's). start: the
 * process's start time as attest_proc_start_time gives it (0: any); another process with that
 * pid is -ESRCH. */
int attest_proc_fs_ident(const char *proc, pid_t pid, unsigned long long start,
                         attest_fs_ident_t *out, dp_buf_t *err);
/* Access files as `id` on the calling thread only (Linux keeps file-system ids, groups and
 * capabilities per thread; raw system calls, as glibc would change them for every thread),
 * with no effective capability but the two that change back (CAP_SETUID, CAP_SETGID): a root
 * agent then reads with the engine user's rights, and a link through another process's
 * /proc/PID/root or cwd opens nothing the engine's user could not. Where paths resolve is the
 * view's part (attest_as_process_enter). An `id` of uid 0 keeps only the capabilities it has
 * itself (cap_eff: root in a container with its capabilities dropped reads as such). Nothing
 * changes when the caller is not root (it reads only what it can anyway) or `id` is root with
 * every capability the caller has. *prev gets
 * what to go back to with attest_fs_ident_leave. Negative errno when the change fails (nothing
 * is changed then). */
int attest_fs_ident_enter(const attest_fs_ident_t *id, attest_fs_ident_t *prev, dp_buf_t *err);
void attest_fs_ident_leave(attest_fs_ident_t *prev);
void attest_fs_ident_free(attest_fs_ident_t *id);
/* The overflow uid and gid (Debian's nobody and nogroup): what an engine out of sight reads as
 * when its socket tells no other user. */
#define ATTEST_NOBODY 65534

/* Read as process pid would on this thread: its view of the files (attest/view.h: paths in its
 * root, no link through /proc followed), then attest_proc_fs_ident of pid and
 * attest_fs_ident_enter. pid 0 (the engine's process not seen: a sidecar in a PID namespace of
 * its own, an engine on another host): the agent's own root, still without /proc links, with
 * the rights of owner_uid (the uid owning the engine's listening socket) when it is above 0,
 * else of ATTEST_NOBODY; no group (ATTEST_NOBODY's gid) and no capability either way.
 * attest_fs_ident_leave goes back from all of it. */
int attest_as_process_enter(const char *proc, pid_t pid, unsigned long long start,
                            int64_t owner_uid, attest_fs_ident_t *prev, dp_buf_t *err);

/* ---- flags against the engine's report (pure) ------------------------------------------- */

/* Into ident, from what the engine reported (a native check of --framework-url): quantization
 * and dtype are the engine's when it reports them (their measured bits set; a flag that differs
 * other than in case is a contradiction, field "quantization" or "dtype"), else the flag's, else
 * unattested; model_path is the engine's. Every contradiction ident carried before is dropped
 * first: each framework read states them anew. */
void attest_engine_merge(const attest_report_t *engine, const char *flag_quantization,
                         const char *flag_dtype, attest_report_t *ident);

#endif
