/* The engine's view of its files (see view.h). */
#define _GNU_SOURCE
#include "attest/view.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <unistd.h>

/* One per thread: the hashing runs on a libuv worker while the loop thread looks at another
 * engine's path, and neither must resolve in the other's root. */
static _Thread_local struct {
    bool on;
    int root_fd;
    char prefix[256]; /* PROC/PID/root: what an agent-side path of the engine's starts with */
    size_t prefix_len;
} view = {.root_fd = -1};

static long openat2_raw(int dirfd, const char *path, int flags)
{
    struct open_how how = {
        .flags = (uint64_t)(flags | O_CLOEXEC),
        .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS,
    };
    long fd;
    /* EAGAIN: a rename or mount raced a ".." walk; the kernel asks for another try. */
    for (int i = 0; i < 16; i++) {
        fd = syscall(SYS_openat2, dirfd, path, &how, sizeof(how));
        if (fd >= 0 || errno != EAGAIN)
            break;
    }
    return fd;
}

int attest_view_enter(const char *proc, pid_t pid, dp_buf_t *err)
{
    attest_view_leave();
    int fd = -1;
    view.prefix_len = 0;
    if (pid > 0) {
        int n = snprintf(view.prefix, sizeof(view.prefix), "%s/%d/root", proc, (int)pid);
        if (n > 0 && (size_t)n < sizeof(view.prefix)) {
            fd = open(view.prefix, O_PATH | O_DIRECTORY | O_CLOEXEC);
            if (fd >= 0)
                view.prefix_len = (size_t)n;
        }
        /* The engine's process is known but its root cannot be opened (gone, or the agent lacks
         * its uid and CAP_SYS_PTRACE): nothing is read, rather than the agent's own root. */
        if (fd < 0) {
            int e = n > 0 && (size_t)n < sizeof(view.prefix) ? errno : ENAMETOOLONG;
            dp_buf_printf(err,
                          "opening the engine's root %s: %s (the agent needs the engine's uid "
                          "or CAP_SYS_PTRACE)",
                          view.prefix, strerror(e));
            return -e;
        }
    }
    if (fd < 0) /* the engine's process out of sight: the agent's root, /proc links refused */
        fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        dp_buf_printf(err, "opening the engine's root: %s", strerror(e));
        return -e;
    }
    /* Asked once, of something that exists: ENOSYS (Linux before 5.6, or a seccomp profile
     * without the call) must stop the read, not fall back to walking through the agent's root. */
    long probe = openat2_raw(fd, "/", O_PATH | O_DIRECTORY);
    if (probe < 0) {
        int e = errno;
        close(fd);
        dp_buf_printf(err,
                      "resolving in the engine's root needs openat2 (Linux 5.6 or later, allowed "
                      "by any seccomp profile): %s",
                      strerror(e));
        return -e;
    }
    close((int)probe);
    view.root_fd = fd;
    view.on = true;
    return 0;
}

void attest_view_leave(void)
{
    if (view.root_fd >= 0)
        close(view.root_fd);
    view.root_fd = -1;
    view.on = false;
    view.prefix_len = 0;
}

bool attest_view_on(void)
{
    return view.on;
}

/* The engine's own path for an agent-side one: what follows PROC/PID/root, or path itself. */
static const char *in_root(const char *path)
{
    if (view.prefix_len > 0 && strncmp(path, view.prefix, view.prefix_len) == 0) {
        const char *rest = path + view.prefix_len;
        if (*rest == '\0')
            return "/";
        if (*rest == '/')
            return rest;
    }
    return path;
}

int attest_view_open(const char *path, int flags)
{
    if (!view.on)
        return open(path, flags | O_CLOEXEC);
    return (int)openat2_raw(view.root_fd, in_root(path), flags);
}

int attest_view_stat(const char *path, struct stat *st)
{
    if (!view.on)
        return stat(path, st);
    int fd = attest_view_open(path, O_PATH);
    if (fd < 0)
        return -1;
    int rc = fstat(fd, st);
    int e = errno;
    close(fd);
    errno = e;
    return rc;
}
