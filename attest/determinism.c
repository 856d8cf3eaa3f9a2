/* VLLM_BATCH_INVARIANT of a co-located vLLM server from /proc (see determinism.h). */
#include "attest/determinism.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attest/engine.h"
#include "common/util.h"

#define VAR "VLLM_BATCH_INVARIANT"
#define ENVIRON_MAX ((size_t)1 << 20) /* ARG_MAX-sized environments are already absurd */
#define CMDLINE_MAX 4096              /* the first words are all that is looked at */
#define MATCH_MAX 16                  /* processes named like the server checked per scan */

static bool is_blank(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

bool attest_env_flag_on(const char *val, size_t len)
{
    size_t i = 0, end = len;
    while (i < end && is_blank(val[i]))
        i++;
    while (end > i && is_blank(val[end - 1]))
        end--;
    if (i < end && (val[i] == '+' || val[i] == '-'))
        i++;
    if (i == end)
        return false; /* int("") raises: vLLM reads that as off */
    bool nonzero = false;
    for (; i < end; i++) {
        if (val[i] < '0' || val[i] > '9')
            return false; /* int("true") raises too */
        nonzero |= val[i] != '0';
    }
    return nonzero;
}

bool attest_environ_get(const char *env, size_t len, const char *var, const char **val,
                        size_t *vlen)
{
    size_t vl = strlen(var);
    for (size_t i = 0; i < len;) {
        const char *e = memchr(env + i, '\0', len - i);
        size_t n = e ? (size_t)(e - (env + i)) : len - i;
        if (n > vl && env[i + vl] == '=' && memcmp(env + i, var, vl) == 0) {
            *val = env + i + vl + 1;
            *vlen = n - vl - 1;
            return true;
        }
        i += n + 1;
    }
    return false;
}

/* Word i of a NUL-separated argv, or NULL. */
static const char *argv_word(const char *cmd, size_t len, int i, size_t *n)
{
    size_t at = 0;
    for (int k = 0; at < len; k++) {
        const char *e = memchr(cmd + at, '\0', len - at);
        size_t wl = e ? (size_t)(e - (cmd + at)) : len - at;
        if (k == i) {
            *n = wl;
            return cmd + at;
        }
        at += wl + 1;
    }
    return NULL;
}

static bool base_is(const char *w, size_t n, const char *name)
{
    size_t start = n;
    while (start > 0 && w[start - 1] != '/')
        start--;
    w += start;
    n -= start;
    return n == strlen(name) && memcmp(w, name, n) == 0;
}

bool attest_cmdline_runs(const char *cmdline, size_t len, const char *name)
{
    size_t n0 = 0, n1 = 0, n2 = 0, nl = strlen(name);
    const char *w0 = argv_word(cmdline, len, 0, &n0);
    const char *w1 = argv_word(cmdline, len, 1, &n1);
    if (w0 == NULL)
        return false;
    if (base_is(w0, n0, name) || (w1 && base_is(w1, n1, name)))
        return true;
    const char *w2 =
        w1 && n1 == 2 && memcmp(w1, "-m", 2) == 0 ? argv_word(cmdline, len, 2, &n2) : NULL;
    return w2 && n2 >= nl && memcmp(w2, name, nl) == 0 && (n2 == nl || w2[nl] == '.');
}

/* A whole /proc file into out (reset first): 0, or -errno (-EFBIG past max, with what was
 * read kept). */
static int read_small(const char *path, size_t max, dp_buf_t *out)
{
    dp_buf_reset(out);
    return dp_read_file(path, max, out);
}

static const char *errno_hint(int e)
{
    switch (e) {
    case EACCES:
    case EPERM:
        return " (the agent needs the server's uid or CAP_SYS_PTRACE)";
    case ENOENT:
    case ESRCH:
        return " (the process is gone)";
    default:
        return "";
    }
}

/* One process: 1 on, 0 off, -1 cannot tell; *why says so for 0 and -1. */
static int check_pid(const char *proc, pid_t pid, dp_buf_t *scratch, dp_buf_t *why)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%d/environ", proc, (int)pid);
    int rc = read_small(path, ENVIRON_MAX, scratch);
    if (rc < 0) {
        dp_buf_printf(why, "cannot tell: %s: %s%s", path, strerror(-rc), errno_hint(-rc));
        return -1;
    }
    if (scratch->len == 0) {
        /* A kernel thread, a zombie, or (on some kernels) a read the access check refused. */
        dp_buf_printf(why, "cannot tell: %s is empty", path);
        return -1;
    }
    const char *v;
    size_t vl;
    if (!attest_environ_get(scratch->base, scratch->len, VAR, &v, &vl)) {
        dp_buf_printf(why, VAR " is not set in pid %d", (int)pid);
        return 0;
    }
    if (!attest_env_flag_on(v, vl)) {
        dp_buf_printf(why, VAR "=%.*s in pid %d", vl > 16 ? 16 : (int)vl, v, (int)pid);
        return 0;
    }
    return 1;
}

/* An explicit pid is the process checked first: 0, or -1 with *why when the kernel reused it. */
static int same_process(attest_det_opts_t *o, dp_buf_t *why)
{
    unsigned long long st = attest_proc_start_time(o->proc, o->pid);
    if (st == 0)
        return 0; /* gone or unreadable: the environ read says which */
    if (o->pid_start == 0)
        o->pid_start = st;
    if (st == o->pid_start)
        return 0;
    dp_buf_printf(why,
                  "cannot tell: pid %d is another process now (started at %llu, the one "
                  "checked at %llu)",
                  (int)o->pid, st, o->pid_start);
    return -1;
}

/* The pids under proc whose command runs o->process (at most MATCH_MAX), or -errno. */
static int scan(const attest_det_opts_t *o, pid_t *pids, dp_buf_t *scratch)
{
    DIR *d = opendir(o->proc);
    if (d == NULL)
        return -errno;
    int n = 0;
    struct dirent *e;
    while (n < MATCH_MAX && (e = readdir(d)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end != '\0' || pid <= 0 || pid == (long)o->self)
            continue;
        char path[512];
        snprintf(path, sizeof(path), "%s/%ld/cmdline", o->proc, pid);
        int rr = read_small(path, CMDLINE_MAX, scratch);
        if ((rr == 0 || rr == -EFBIG) && /* a long command line: its first words are read */
            attest_cmdline_runs(scratch->base ? scratch->base : "", scratch->len, o->process))
            pids[n++] = (pid_t)pid;
    }
    closedir(d);
    return n;
}

int attest_vllm_batch_invariant(attest_det_opts_t *o, dp_buf_t *why)
{
    dp_buf_reset(why);
    dp_buf_t scratch = {0};
    pid_t pids[MATCH_MAX];
    int n = 1, rc;
    if (o->pid > 0) {
        pids[0] = o->pid;
        if (same_process(o, why) != 0) {
            rc = -1;
            goto out;
        }
    } else if ((n = scan(o, pids, &scratch)) < 0) {
        dp_buf_printf(why, "cannot tell: %s: %s", o->proc, strerror(-n));
        rc = -1;
        goto out;
    } else if (n == 0) {
        dp_buf_printf(why, "cannot tell: no %s process in %s (shared process namespace?)",
                      o->process, o->proc);
        rc = -1;
        goto out;
    }
    /* Every process named like the server must have it: the API server and any sibling. */
    rc = 1;
    for (int i = 0; i < n && rc == 1; i++)
        rc = check_pid(o->proc, pids[i], &scratch, why);
    if (rc == 1) {
        dp_buf_appends(why, VAR " on in pid");
        for (int i = 0; i < n; i++)
            dp_buf_printf(why, " %d", (int)pids[i]);
    }
out:
    dp_buf_free(&scratch);
    return rc;
}
