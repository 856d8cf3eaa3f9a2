/* The engine an agent measures: /proc, its model's path, flags against its report (engine.h). */
#define _GNU_SOURCE
#include "attest/engine.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <linux/capability.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "attest/view.h"
#include "common/util.h"

#define NET_TABLE_MAX ((size_t)64 << 20) /* a host with a million sockets is past caring */
#define MAPS_MAX ((size_t)256 << 20)

/* ---- /proc/net/tcp ------------------------------------------------------------------------ */

/* n hex digits at p into *v: false unless all are hex. */
static bool hex_u32(const char *p, size_t n, uint32_t *v)
{
    uint32_t x = 0;
    for (size_t i = 0; i < n; i++) {
        char c = p[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                       : -1;
        if (d < 0)
            return false;
        x = x << 4 | (uint32_t)d;
    }
    *v = x;
    return true;
}

/* The kernel prints an address as its 32-bit words, each in the host's byte order ("%08X" of
 * the raw word: 127.0.0.1 is 0100007F on x86), so a word copied back is the address's bytes. */
static bool parse_addr(const char *p, size_t n, uint8_t *out, size_t alen)
{
    if (n != alen * 2)
        return false;
    for (size_t w = 0; w < alen / 4; w++) {
        uint32_t word;
        if (!hex_u32(p + w * 8, 8, &word))
            return false;
        memcpy(out + w * 4, &word, 4);
    }
    return true;
}

static bool all_zero(const uint8_t *a, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (a[i])
            return false;
    return true;
}

/* Would a connection to want (4 or 16 bytes) reach a socket bound to local? */
static bool addr_serves(const uint8_t *local, size_t llen, const uint8_t *want, size_t wlen)
{
    if (all_zero(local, llen))
        return true; /* a wildcard: every address, a v6 one also v4 (dual stack) */
    if (llen == wlen)
        return memcmp(local, want, llen) == 0;
    static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return llen == 16 && wlen == 4 && memcmp(local, mapped, 12) == 0 &&
           memcmp(local + 12, want, 4) == 0;
}

uint64_t attest_net_listener(const char *table, size_t len, bool v6, const struct sockaddr *addr,
                             uint32_t *uid)
{
    uint8_t want[16];
    size_t wlen;
    uint16_t port;
    if (addr->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)addr;
        memcpy(want, &a->sin_addr, 4);
        wlen = 4;
        port = ntohs(a->sin_port);
    } else if (addr->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)addr;
        memcpy(want, &a->sin6_addr, 16);
        wlen = 16;
        port = ntohs(a->sin6_port);
        if (!v6)
            return 0; /* a v4 socket never serves a v6 address */
    } else {
        return 0;
    }
    size_t alen = v6 ? 16 : 4;
    const char *end = table + len;
    const char *line = memchr(table, '\n', len); /* the header line */
    while (line && line < end) {
        line++;
        const char *eol = memchr(line, '\n', (size_t)(end - line));
        if (eol == NULL)
            eol = end;
        /* "sl: local rem st tx:rx tr:when retrnsmt uid timeout inode ..." */
        const char *f[10];
        size_t fl[10], nf = 0;
        for (const char *p = line; p < eol && nf < 10;) {
            while (p < eol && (*p == ' ' || *p == '\t'))
                p++;
            const char *s = p;
            while (p < eol && *p != ' ' && *p != '\t')
                p++;
            if (p > s) {
                f[nf] = s;
                fl[nf++] = (size_t)(p - s);
            }
        }
        line = eol;
        const char *colon = nf == 10 ? memchr(f[1], ':', fl[1]) : NULL;
        uint32_t lport, st;
        uint8_t local[16];
        if (colon == NULL || !hex_u32(colon + 1, (size_t)(f[1] + fl[1] - colon - 1), &lport) ||
            !hex_u32(f[3], fl[3], &st) || st != 0x0A /* TCP_LISTEN */ || lport != port ||
            !parse_addr(f[1], (size_t)(colon - f[1]), local, alen) ||
            !addr_serves(local, alen, want, wlen))
            continue;
        char num[24];
        if (fl[9] >= sizeof(num))
            continue;
        memcpy(num, f[9], fl[9]);
        num[fl[9]] = '\0';
        uint64_t ino = strtoull(num, NULL, 10);
        if (ino == 0)
            continue;
        if (uid != NULL) {
            *uid = 0; /* unreadable: taken as root's, which lends the agent nothing */
            if (fl[7] < sizeof(num)) {
                memcpy(num, f[7], fl[7]);
                num[fl[7]] = '\0';
                *uid = (uint32_t)strtoul(num, NULL, 10);
            }
        }
        return ino;
    }
    return 0;
}

bool attest_addr_is_local(const struct sockaddr *addr)
{
    if (addr->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)addr;
        if ((ntohl(a->sin_addr.s_addr) >> 24) == 127)
            return true;
    } else if (addr->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)addr;
        if (IN6_IS_ADDR_LOOPBACK(&a->sin6_addr))
            return true;
    } else {
        return false;
    }
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0)
        return false;
    bool local = false;
    for (const struct ifaddrs *i = ifs; i && !local; i = i->ifa_next) {
        const struct sockaddr *x = i->ifa_addr;
        if (x == NULL || x->sa_family != addr->sa_family)
            continue;
        if (x->sa_family == AF_INET)
            local = memcmp(&((const struct sockaddr_in *)x)->sin_addr,
                           &((const struct sockaddr_in *)addr)->sin_addr, 4) == 0;
        else
            local = memcmp(&((const struct sockaddr_in6 *)x)->sin6_addr,
                           &((const struct sockaddr_in6 *)addr)->sin6_addr, 16) == 0;
    }
    freeifaddrs(ifs);
    return local;
}

int64_t attest_proc_listener(const char *proc, const struct sockaddr *addr, uint32_t *uid)
{
    static const char *const tables[] = {"net/tcp", "net/tcp6"};
    int readable = 0, last = -ENOENT;
    dp_buf_t b = {0};
    uint64_t ino = 0;
    for (size_t i = 0; i < 2 && ino == 0; i++) {
        char path[512];
        snprintf(path, sizeof(path), "%s/%s", proc, tables[i]);
        dp_buf_reset(&b);
        int r = dp_read_file(path, NET_TABLE_MAX, &b);
        if (r != 0) {
            last = r;
            continue;
        }
        readable++;
        ino = attest_net_listener(b.base ? b.base : "", b.len, i == 1, addr, uid);
    }
    dp_buf_free(&b);
    if (readable == 0)
        return last;
    return (int64_t)ino;
}

/* The line of a status file that begins with key ("Uid:"), past the key; NULL if none. */
static const char *status_line(const char *text, const char *key)
{
    size_t n = strlen(key);
    for (const char *p = text; p; p = strchr(p, '\n')) {
        p += *p == '\n';
        if (strncmp(p, key, n) == 0)
            return p + n;
    }
    return NULL;
}

/* A status file's effective capabilities ("CapEff:\t000001ffffffffff"); false if unreadable. */
static bool status_caps(const char *text, uint64_t *out)
{
    const char *p = status_line(text, "CapEff:");
    if (p == NULL)
        return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(p, &end, 16);
    if (end == p || errno != 0)
        return false;
    *out = (uint64_t)v;
    return true;
}

/* What a process reads with, as one comparable string: the status lines of its ids, groups
 * and capabilities, and its root and user namespace (device and inode). Empty when gone. */
static void read_identity(const char *proc, long pid, dp_buf_t *out)
{
    static const char *const lines[] = {"Uid:", "Gid:", "Groups:", "CapEff:"};
    static const char *const links[] = {"root", "ns/user"};
    char path[512];
    dp_buf_reset(out);
    snprintf(path, sizeof(path), "%s/%ld/status", proc, pid);
    dp_buf_t b = {0};
    if (dp_read_file(path, 64 * 1024, &b) != 0 || b.len == 0) {
        dp_buf_free(&b);
        return;
    }
    for (size_t i = 0; i < sizeof(lines) / sizeof(*lines); i++) {
        const char *l = status_line(b.base, lines[i]);
        size_t n = l ? strcspn(l, "\n") : 0;
        dp_buf_append(out, l ? l : "", n);
        dp_buf_appendc(out, '|');
    }
    dp_buf_free(&b);
    for (size_t i = 0; i < sizeof(links) / sizeof(*links); i++) {
        struct stat st;
        snprintf(path, sizeof(path), "%s/%ld/%s", proc, pid, links[i]);
        if (stat(path, &st) == 0)
            dp_buf_printf(out, "%llu:%llu|", (unsigned long long)st.st_dev,
                          (unsigned long long)st.st_ino);
        else
            dp_buf_appends(out, "?|");
    }
}

pid_t attest_proc_socket_owner(const char *proc, uint64_t ino, pid_t self, bool *mixed)
{
    char want[48];
    snprintf(want, sizeof(want), "socket:[%llu]", (unsigned long long)ino);
    size_t wl = strlen(want);
    *mixed = false;
    DIR *d = opendir(proc);
    if (d == NULL)
        return 0;
    pid_t found = 0;
    dp_buf_t first = {0}, other = {0};
    struct dirent *e;
    while (!*mixed && (e = readdir(d)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end != '\0' || pid <= 0 || pid == (long)self)
            continue;
        char path[512];
        snprintf(path, sizeof(path), "%s/%ld/fd", proc, pid);
        DIR *fds = opendir(path);
        if (fds == NULL)
            continue; /* gone, or not ours to look into */
        bool holds = false;
        struct dirent *fe;
        while (!holds && (fe = readdir(fds)) != NULL) {
            if (fe->d_name[0] == '.')
                continue;
            char link[64];
            ssize_t n = readlinkat(dirfd(fds), fe->d_name, link, sizeof(link));
            holds = n == (ssize_t)wl && memcmp(link, want, wl) == 0;
        }
        closedir(fds);
        if (!holds)
            continue;
        /* Every holder may serve it (a root parent that bound it, its unprivileged children,
         * pid 1 of socket activation): one is the engine only when all read alike. */
        if (found == 0) {
            found = (pid_t)pid;
            read_identity(proc, pid, &first);
        } else {
            read_identity(proc, pid, &other);
            *mixed = other.len > 0 && (first.len == 0 || other.len != first.len ||
                                       memcmp(other.base, first.base, first.len) != 0);
        }
    }
    closedir(d);
    dp_buf_free(&first);
    dp_buf_free(&other);
    return *mixed ? 0 : found;
}

bool attest_proc_sees_every_process(const char *proc)
{
    /* The kernel's fixed inode numbers of the initial namespaces (PROC_PID_INIT_INO,
     * PROC_USER_INIT_INO in include/linux/proc_ns.h), part of its ABI. */
    enum { PID_INIT_INO = 0xEFFFFFFCU, USER_INIT_INO = 0xEFFFFFFDU };
    char path[512];
    struct stat st;
    snprintf(path, sizeof(path), "%s/self/ns/pid", proc);
    if (stat(path, &st) != 0 || st.st_ino != PID_INIT_INO)
        return false;
    snprintf(path, sizeof(path), "%s/self/ns/user", proc);
    if (stat(path, &st) != 0 || st.st_ino != USER_INIT_INO)
        return false;
    snprintf(path, sizeof(path), "%s/self/status", proc);
    dp_buf_t b = {0};
    bool all = false;
    if (dp_read_file(path, 64 * 1024, &b) == 0 && b.len > 0) {
        uint64_t caps;
        all = status_caps(b.base, &caps) && (caps >> CAP_SYS_PTRACE & 1) &&
              ((caps >> CAP_DAC_OVERRIDE & 1) || (caps >> CAP_DAC_READ_SEARCH & 1));
    }
    dp_buf_free(&b);
    return all;
}

unsigned long long attest_proc_start_time(const char *proc, pid_t pid)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%d/stat", proc, (int)pid);
    dp_buf_t b = {0};
    unsigned long long st = 0;
    if (dp_read_file(path, 4096, &b) == 0 && b.len > 0) {
        dp_buf_appendc(&b, '\0');
        /* After the parenthesised command, which may hold anything, spaces included. */
        const char *p = strrchr(b.base, ')');
        for (int field = 2; p && field < 22; field++) /* p at the space before field + 1 */
            p = strchr(p + 1, ' ');
        st = p ? strtoull(p + 1, NULL, 10) : 0;
    }
    dp_buf_free(&b);
    return st;
}

/* ---- the model's path ----------------------------------------------------------------------- */

void attest_located_free(attest_located_t *l)
{
    free(l->path);
    l->path = NULL;
    l->prefix = 0;
}

static void located(attest_located_t *l, const char *prefix, const char *path)
{
    dp_buf_t b = {0};
    dp_buf_appends(&b, prefix);
    if (prefix[0] && path[0] != '/')
        dp_buf_appendc(&b, '/');
    dp_buf_appends(&b, path);
    l->path = dp_buf_steal(&b);
    l->prefix = strlen(prefix);
}

/* The engine's working directory as a path in its root (into *out, "/..."), when the names
 * the kernel gives for its root and working directory place one in the other and that path in
 * its root is the very folder it works in. */
static bool cwd_in_root(const char *proc, pid_t pid, dp_buf_t *out)
{
    char root_link[512], cwd_link[512], rl[4096], cl[4096];
    snprintf(root_link, sizeof(root_link), "%s/%d/root", proc, (int)pid);
    snprintf(cwd_link, sizeof(cwd_link), "%s/%d/cwd", proc, (int)pid);
    ssize_t rn = readlink(root_link, rl, sizeof(rl) - 1);
    ssize_t cn = readlink(cwd_link, cl, sizeof(cl) - 1);
    if (rn <= 0 || cn <= 0)
        return false;
    rl[rn] = '\0';
    cl[cn] = '\0';
    const char *in = NULL;
    if (strcmp(rl, "/") == 0)
        in = cl;
    else if (strncmp(cl, rl, (size_t)rn) == 0 && (cl[rn] == '/' || cl[rn] == '\0'))
        in = cl[rn] == '\0' ? "/" : cl + rn;
    if (in == NULL || in[0] != '/')
        return false;
    /* A name is only a name (a folder renamed since, "(deleted)"): it must lead to the folder
     * itself. */
    dp_buf_t p = {0};
    dp_buf_printf(&p, "%s%s", root_link, in);
    struct stat a, b;
    bool same = attest_view_stat(p.base, &a) == 0 && stat(cwd_link, &b) == 0 &&
                a.st_dev == b.st_dev && a.st_ino == b.st_ino && S_ISDIR(a.st_mode);
    dp_buf_free(&p);
    if (same)
        dp_buf_appends(out, in);
    return same;
}

attest_locate_t attest_engine_locate(const char *proc, pid_t pid, const char *engine_path,
                                     bool always_local, attest_located_t *l, dp_buf_t *why)
{
    memset(l, 0, sizeof(*l));
    char prefix[512];
    struct stat direct, via;
    if (engine_path == NULL || engine_path[0] == '\0') {
        dp_buf_appends(why, "the engine reports no model path");
        return always_local ? ATTEST_LOC_NOT_VISIBLE : ATTEST_LOC_NOT_LOCAL;
    }
    if (engine_path[0] == '/') {
        bool have_via = false, other_root = false, root_known = false;
        if (pid > 0) {
            snprintf(prefix, sizeof(prefix), "%s/%d/root", proc, (int)pid);
            dp_buf_t p = {0};
            dp_buf_printf(&p, "%s%s", prefix, engine_path);
            have_via = attest_view_stat(p.base, &via) == 0;
            dp_buf_free(&p);
            struct stat er, ar;
            root_known = stat(prefix, &er) == 0 && stat("/", &ar) == 0;
            other_root = root_known && (er.st_dev != ar.st_dev || er.st_ino != ar.st_ino);
        }
        /* The agent's own file of that name is looked at only when it can be the engine's:
         * the engine's root is the agent's (or the engine's process is out of sight). For an
         * engine with a root of its own, whether the agent has such a file must not show in
         * the answer either: that would tell the engine what the host holds. */
        bool have_direct =
            (pid <= 0 || (root_known && !other_root)) && stat(engine_path, &direct) == 0;
        /* The same file both ways: the plain path, which outlives this process. */
        if (have_direct && ((!have_via && pid <= 0) || (have_via && direct.st_dev == via.st_dev &&
                                                        direct.st_ino == via.st_ino))) {
            located(l, "", engine_path);
            return ATTEST_LOC_FOUND;
        }
        if (have_via) {
            located(l, prefix, engine_path);
            return ATTEST_LOC_FOUND;
        }
        if (pid <= 0)
            dp_buf_printf(why,
                          "the engine loaded %.200s, which the agent cannot see (mount the model "
                          "at the same path, or share the engine's process namespace)",
                          engine_path);
        else if (!root_known)
            dp_buf_printf(why,
                          "the engine loaded %.200s, which the agent cannot see (%s: %s; the "
                          "agent needs the engine's uid or CAP_SYS_PTRACE)",
                          engine_path, prefix, strerror(errno));
        else if (other_root)
            dp_buf_printf(why,
                          "the engine loaded %.200s, which is not in the engine's root (%s): "
                          "deleted or moved since it was loaded, or never there?",
                          engine_path, prefix);
        else
            dp_buf_printf(why,
                          "the engine loaded %.200s, which is not there, neither here nor in "
                          "the engine's root (%s): deleted or moved since it was loaded?",
                          engine_path, prefix);
        return ATTEST_LOC_NOT_VISIBLE;
    }
    if (pid > 0) {
        /* Relative to the engine's working directory, placed in its root: then it is read there,
         * links and all, as an absolute path is (attest/view.h). */
        dp_buf_t in = {0}, p = {0};
        snprintf(prefix, sizeof(prefix), "%s/%d/root", proc, (int)pid);
        bool placed = cwd_in_root(proc, pid, &in);
        if (placed) {
            dp_buf_printf(&p, "%s%s%s%s", prefix, in.base, strcmp(in.base, "/") ? "/" : "",
                          engine_path);
            if (attest_view_stat(p.base, &via) == 0) {
                located(l, "", p.base);
                l->prefix = strlen(prefix);
                dp_buf_free(&in);
                dp_buf_free(&p);
                return ATTEST_LOC_FOUND;
            }
        } else {
            dp_buf_printf(&p, "%s/%d/cwd/%s", proc, (int)pid, engine_path);
            if (stat(p.base, &via) == 0) {
                dp_buf_printf(why,
                              "the engine loaded %.200s, relative to a working directory the "
                              "agent cannot place in the engine's root: give the engine an "
                              "absolute path",
                              engine_path);
                dp_buf_free(&in);
                dp_buf_free(&p);
                return ATTEST_LOC_NOT_VISIBLE;
            }
        }
        dp_buf_free(&in);
        dp_buf_free(&p);
    }
    if (!always_local)
        return ATTEST_LOC_NOT_LOCAL; /* "meta-llama/Llama-3.1-8B-Instruct": fetched, not a path */
    dp_buf_printf(why,
                  "the engine loaded %.200s, relative to its working directory, which the agent "
                  "cannot see (share the engine's process namespace)",
                  engine_path);
    return ATTEST_LOC_NOT_VISIBLE;
}

/* Does the file open at fd start with GGUF's magic? Reads its first bytes. */
static bool gguf_magic(int fd)
{
    char magic[4];
    return fd >= 0 && read(fd, magic, sizeof(magic)) == (ssize_t)sizeof(magic) &&
           memcmp(magic, "GGUF", sizeof(magic)) == 0;
}

bool attest_model_shaped(const char *path, const char *shown, dp_buf_t *why)
{
    /* Looked at before anything is opened for reading: opening a device can act on it. */
    int fd = attest_view_open(path, O_PATH);
    struct stat st;
    bool ok = false;
    if (fd < 0 || fstat(fd, &st) != 0) {
        dp_buf_printf(why, "the engine reports %.200s, which the agent cannot open: %s", shown,
                      strerror(errno));
    } else if (S_ISREG(st.st_mode)) {
        char self[64];
        snprintf(self, sizeof(self), "/proc/self/fd/%d", fd);
        int rfd = open(self, O_RDONLY | O_CLOEXEC); /* the very file looked at */
        ok = gguf_magic(rfd);
        if (rfd >= 0)
            close(rfd);
        if (!ok)
            dp_buf_printf(why, "the engine reports %.200s, which is not a GGUF file: not hashed",
                          shown);
    } else if (S_ISDIR(st.st_mode)) {
        dp_buf_t cfg = {0};
        dp_buf_printf(&cfg, "%s/config.json", path);
        ok = attest_view_stat(cfg.base, &st) == 0 && S_ISREG(st.st_mode);
        dp_buf_free(&cfg);
        if (!ok)
            dp_buf_printf(why,
                          "the engine reports %.200s, a folder without a config.json (not a "
                          "model's): not hashed",
                          shown);
    } else {
        dp_buf_printf(why, "the engine reports %.200s, neither a file nor a folder: not hashed",
                      shown);
    }
    if (fd >= 0)
        close(fd);
    return ok;
}

bool attest_model_still_shaped(const char *path, bool is_file, const attest_snapshot_t *snap,
                               dp_buf_t *why)
{
    if (!is_file) {
        /* The listing hashed is the folder read: it holds a config.json, or it was no model. */
        for (size_t i = 0; i < snap->count; i++)
            if (strcmp(snap->files[i].relpath, "config.json") == 0)
                return true;
        dp_buf_printf(why, "%.200s held no config.json when hashed: not a model's folder", path);
        return false;
    }
    /* The file hashed (by identity) starts with the magic. */
    int fd = attest_view_open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY);
    struct stat st;
    bool ok = fd >= 0 && snap->count == 1 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
              (uint64_t)st.st_dev == snap->files[0].dev &&
              (uint64_t)st.st_ino == snap->files[0].ino && gguf_magic(fd);
    if (fd >= 0)
        close(fd);
    if (!ok)
        dp_buf_printf(why, "%.200s is not the GGUF file the engine named when hashed", path);
    return ok;
}

bool attest_located_under(const attest_located_t *l, const struct stat *dir)
{
    dp_buf_t p = {0};
    dp_buf_appends(&p, l->path);
    bool under = false;
    for (;;) {
        struct stat st;
        /* In the engine's view when it is on: a link on the way resolves in the engine's root,
         * not the agent's (a link to the agent's --model-dir is not that folder). */
        if (attest_view_stat(p.base, &st) == 0 && st.st_dev == dir->st_dev &&
            st.st_ino == dir->st_ino) {
            under = true;
            break;
        }
        /* Up to the engine's root (l->prefix, or the agent's "/"), not above it. */
        if (p.len <= l->prefix || (l->prefix == 0 && p.len <= 1))
            break;
        const char *slash = strrchr(p.base, '/');
        if (slash == NULL)
            break;
        size_t up = (size_t)(slash - p.base);
        if (l->prefix == 0 && up == 0)
            up = 1; /* "/models" -> "/" */
        if (up < l->prefix)
            break;
        p.len = up;
        p.base[up] = '\0';
    }
    dp_buf_free(&p);
    return under;
}

/* ---- open or mapped ------------------------------------------------------------------------ */

bool attest_maps_has(const char *maps, size_t len, uint64_t dev, uint64_t ino, const char *path)
{
    const char *end = maps + len;
    for (const char *line = maps; line < end;) {
        const char *eol = memchr(line, '\n', (size_t)(end - line));
        if (eol == NULL)
            eol = end;
        /* "start-end perms offset major:minor inode   path" */
        unsigned maj, min;
        unsigned long long i;
        int at = 0;
        char buf[4096];
        size_t n = (size_t)(eol - line) < sizeof(buf) - 1 ? (size_t)(eol - line) : sizeof(buf) - 1;
        memcpy(buf, line, n);
        buf[n] = '\0';
        line = eol + 1;
        if (sscanf(buf, "%*s %*s %*s %x:%x %llu %n", &maj, &min, &i, &at) < 3 || i == 0)
            continue;
        if ((uint64_t)makedev(maj, min) == dev && i == ino)
            return true;
        /* Overlay filesystems show the lower file's device and inode: the path then tells. */
        if (path && at > 0 && strcmp(buf + at, path) == 0)
            return true;
    }
    return false;
}

/* A GGUF file's name; the kernel adds " (deleted)" to a mapped or open file that was unlinked
 * or renamed over since (a new file put at the engine's path while it runs the old one): that
 * is still a GGUF file the process runs, and not the one at the path. */
static bool is_gguf(const char *path)
{
    static const char deleted[] = " (deleted)";
    size_t n = strlen(path), d = sizeof(deleted) - 1;
    if (n > d && strcmp(path + n - d, deleted) == 0)
        n -= d;
    return n > 5 && strncasecmp(path + n - 5, ".gguf", 5) == 0;
}

/* The first mapped GGUF file's path (the text after the inode), if any. */
static void maps_first_gguf(const char *maps, size_t len, dp_buf_t *out)
{
    const char *end = maps + len;
    for (const char *line = maps; line < end;) {
        const char *eol = memchr(line, '\n', (size_t)(end - line));
        if (eol == NULL)
            eol = end;
        const char *slash = memchr(line, '/', (size_t)(eol - line));
        if (slash) {
            char *p = dp_xstrndup(slash, (size_t)(eol - slash));
            bool hit = is_gguf(p);
            if (hit)
                dp_buf_appends(out, p);
            free(p);
            if (hit)
                return;
        }
        line = eol + 1;
    }
}

char **attest_loaded_names(const char *root, const attest_snapshot_t *snap)
{
    char **names = dp_xcalloc(snap->count ? snap->count : 1, sizeof(*names));
    dp_buf_t full = {0};
    for (size_t i = 0; i < snap->count; i++) {
        dp_buf_reset(&full);
        dp_buf_printf(&full, "%s/%s", root, snap->files[i].relpath);
        int fd = attest_view_open(full.base, O_PATH);
        if (fd < 0)
            continue;
        char self[64], name[PATH_MAX];
        snprintf(self, sizeof(self), "/proc/self/fd/%d", fd);
        ssize_t n = readlink(self, name, sizeof(name) - 1);
        close(fd);
        if (n > 0) {
            name[n] = '\0';
            names[i] = dp_xstrdup(name);
        }
    }
    dp_buf_free(&full);
    return names;
}

void attest_loaded_names_free(char **names, size_t count)
{
    for (size_t i = 0; names && i < count; i++)
        free(names[i]);
    free(names);
}

int attest_proc_loaded(const char *proc, pid_t pid, char *const *names,
                       const attest_snapshot_t *snap, dp_buf_t *other)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%d/maps", proc, (int)pid);
    dp_buf_t maps = {0};
    int rc = dp_read_file(path, MAPS_MAX, &maps);
    if (rc != 0 && rc != -EFBIG) {
        dp_buf_free(&maps);
        return rc;
    }
    const char *m = maps.base ? maps.base : "";
    attest_loaded_t seen = ATTEST_LOADED_NOT_SEEN;
    for (size_t i = 0; i < snap->count && seen == ATTEST_LOADED_NOT_SEEN; i++) {
        const attest_file_t *f = &snap->files[i];
        if (attest_maps_has(m, maps.len, f->dev, f->ino, names ? names[i] : NULL))
            seen = ATTEST_LOADED_MAPPED;
    }
    snprintf(path, sizeof(path), "%s/%d/fd", proc, (int)pid);
    DIR *fds = seen == ATTEST_LOADED_NOT_SEEN ? opendir(path) : NULL;
    struct dirent *e;
    while (fds && seen == ATTEST_LOADED_NOT_SEEN && (e = readdir(fds)) != NULL) {
        struct stat st;
        if (e->d_name[0] == '.' || fstatat(dirfd(fds), e->d_name, &st, 0) != 0 ||
            !S_ISREG(st.st_mode))
            continue;
        for (size_t i = 0; i < snap->count; i++)
            if (snap->files[i].dev == (uint64_t)st.st_dev &&
                snap->files[i].ino == (uint64_t)st.st_ino) {
                seen = ATTEST_LOADED_OPEN;
                break;
            }
        if (seen == ATTEST_LOADED_NOT_SEEN && other && other->len == 0) {
            char link[4096];
            ssize_t n = readlinkat(dirfd(fds), e->d_name, link, sizeof(link) - 1);
            if (n > 0) {
                link[n] = '\0';
                if (is_gguf(link))
                    dp_buf_appends(other, link);
            }
        }
    }
    if (fds)
        closedir(fds);
    if (seen == ATTEST_LOADED_NOT_SEEN && other && other->len == 0)
        maps_first_gguf(m, maps.len, other);
    if (seen != ATTEST_LOADED_NOT_SEEN && other)
        dp_buf_reset(other);
    dp_buf_free(&maps);
    return (int)seen;
}

/* ---- flags against the engine's report ---------------------------------------------------- */

static void merge_field(const attest_report_t *engine, attest_field_t f, const char *field,
                        const char *flag, attest_report_t *ident)
{
    const char *v = attest_report_get(engine, f);
    ident->measured &= ~(1u << f);
    if (v == NULL) {
        /* The engine does not say: the flag is all there is (repeated, not measured). */
        attest_report_set(ident, f, flag);
        return;
    }
    char *keep = dp_xstrdup(v);
    attest_report_set(ident, f, keep);
    ident->measured |= 1u << f;
    /* "q8_0" and "Q8_0" are one GGUF type, "AWQ" and "awq" one method: spelling is no
     * contradiction. */
    if (flag && strcasecmp(flag, keep) != 0)
        attest_report_add_contradiction(ident, field, flag, keep);
    free(keep);
}

void attest_engine_merge(const attest_report_t *engine, const char *flag_quantization,
                         const char *flag_dtype, attest_report_t *ident)
{
    attest_report_clear_contradictions(ident);
    merge_field(engine, ATTEST_F_QUANTIZATION, "quantization", flag_quantization, ident);
    merge_field(engine, ATTEST_F_DTYPE, "dtype", flag_dtype, ident);
    static const attest_field_t from_engine[] = {
        ATTEST_F_FRAMEWORK_NAME, ATTEST_F_FRAMEWORK_VERSION, ATTEST_F_ENGINE_FINGERPRINT};
    for (size_t i = 0; i < DP_ARRAY_SIZE(from_engine); i++) {
        attest_field_t f = from_engine[i];
        if (attest_report_get(engine, f))
            ident->measured |= 1u << f;
        else
            ident->measured &= ~(1u << f);
    }
    free(ident->model_path);
    ident->model_path = engine->model_path ? dp_xstrdup(engine->model_path) : NULL;
}

/* ---- reading as the engine's user ------------------------------------------------------- */

/* The real id of a status line's ids: "Uid:\treal\teffective\tsaved\tfs". */
static bool status_real_id(const char *text, const char *key, unsigned long *out)
{
    const char *p = status_line(text, key);
    if (p == NULL)
        return false;
    char *end;
    errno = 0;
    *out = strtoul(p, &end, 10);
    return end != p && errno == 0 && *out <= UINT32_MAX;
}

int attest_proc_fs_ident(const char *proc, pid_t pid, unsigned long long start,
                         attest_fs_ident_t *out, dp_buf_t *err)
{
    memset(out, 0, sizeof(*out));
    char path[64];
    snprintf(path, sizeof(path), "%s/%d/status", proc, (int)pid);
    dp_buf_t b = {0};
    int rc = dp_read_file(path, 64 * 1024, &b);
    unsigned long uid, gid;
    if (rc == 0 && (b.len == 0 || !status_real_id(b.base, "Uid:", &uid) ||
                    !status_real_id(b.base, "Gid:", &gid)))
        rc = -EINVAL;
    /* Read, then its start time looked at: what was read is that process's. */
    if (rc == 0 && start != 0 && attest_proc_start_time(proc, pid) != start)
        rc = -ESRCH;
    if (rc != 0) {
        dp_buf_printf(err, "the engine's user (%s): %s", path,
                      rc == -EINVAL  ? "no Uid and Gid lines"
                      : rc == -ESRCH ? "another process than the engine's now"
                                     : strerror(-rc));
        dp_buf_free(&b);
        return rc;
    }
    out->uid = (uid_t)uid;
    out->gid = (gid_t)gid;
    out->cap_eff_known = status_caps(b.base, &out->cap_eff);
    /* Capabilities hold in the user namespace they were given in: an engine in one of its own
     * (root there, `unshare --user --map-root-user`) has none over the agent's files. */
    struct stat ens, ans;
    snprintf(path, sizeof(path), "%s/%d/ns/user", proc, (int)pid);
    if (stat(path, &ens) == 0 && stat("/proc/self/ns/user", &ans) == 0 &&
        (ens.st_dev != ans.st_dev || ens.st_ino != ans.st_ino)) {
        out->cap_eff = 0;
        out->cap_eff_known = true;
    }
    const char *g = status_line(b.base, "Groups:");
    if (g) {
        size_t cap = 0;
        for (;;) {
            while (*g == ' ' || *g == '\t')
                g++;
            if (*g < '0' || *g > '9') /* the line's end */
                break;
            char *end;
            errno = 0;
            unsigned long v = strtoul(g, &end, 10);
            if (errno != 0 || v > UINT32_MAX)
                break;
            if (out->ngroups == cap) {
                cap = cap ? cap * 2 : 16;
                out->groups = dp_xrealloc(out->groups, cap * sizeof(*out->groups));
            }
            out->groups[out->ngroups++] = (gid_t)v;
            g = end;
        }
    }
    dp_buf_free(&b);
    return 0;
}

/* Raw: glibc's setgroups changes every thread's groups, and its setfsuid/setfsgid are plain
 * calls already; each returns the id in force before. */
static long fs_setgroups(size_t n, const gid_t *g)
{
    return syscall(SYS_setgroups, n, g);
}

static uid_t fs_setuid(uid_t u)
{
    return (uid_t)syscall(SYS_setfsuid, u);
}

static gid_t fs_setgid(gid_t g)
{
    return (gid_t)syscall(SYS_setfsgid, g);
}

/* The calling thread's capabilities (pid 0: this thread alone). */
static int caps_get(struct __user_cap_data_struct d[2])
{
    struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    return syscall(SYS_capget, &h, d) == 0 ? 0 : -errno;
}

static int caps_set(struct __user_cap_data_struct d[2])
{
    struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    return syscall(SYS_capset, &h, d) == 0 ? 0 : -errno;
}

/* This thread's effective capabilities: those of them in `caps` (two 32-bit words), or, to
 * restore, `caps` as far as the permitted set holds them. */
static int caps_effective(const uint64_t caps[2], bool restore)
{
    struct __user_cap_data_struct d[2];
    int rc = caps_get(d);
    if (rc != 0)
        return rc;
    for (int i = 0; i < 2; i++)
        d[i].effective =
            restore ? (uint32_t)caps[i] & d[i].permitted : d[i].effective & (uint32_t)caps[i];
    return caps_set(d);
}

void attest_fs_ident_leave(attest_fs_ident_t *prev)
{
    if (prev->view)
        attest_view_leave();
    prev->view = false;
    if (!prev->taken)
        return;
    caps_effective(prev->caps, true);
    fs_setuid(prev->uid);
    fs_setgid(prev->gid);
    fs_setgroups(prev->ngroups, prev->groups);
    attest_fs_ident_free(prev);
}

int attest_fs_ident_enter(const attest_fs_ident_t *id, attest_fs_ident_t *prev, dp_buf_t *err)
{
    memset(prev, 0, sizeof(*prev));
    if (geteuid() != 0)
        return 0;
    struct __user_cap_data_struct d[2];
    int e = -caps_get(d);
    if (e != 0) {
        dp_buf_printf(err, "reading as the engine's user: capget: %s", strerror(e));
        return -e;
    }
    /* Kept while switched: the two that change back, and for an engine running as uid 0 the
     * capabilities it has itself (docker --cap-drop ALL leaves root none). Every other one goes:
     * CAP_SYS_PTRACE would open another process's /proc/PID/root and cwd (its files, past
     * folders the engine cannot enter), CAP_DAC_OVERRIDE any file. */
    uint64_t keep = (1ull << CAP_SETUID) | (1ull << CAP_SETGID);
    if (id->uid == 0) {
        uint64_t mine = (uint64_t)d[1].effective << 32 | d[0].effective;
        if (!id->cap_eff_known || (mine & ~id->cap_eff) == 0)
            return 0; /* root with all the agent has: nothing to change */
        keep |= id->cap_eff;
    }
    prev->uid = fs_setuid((uid_t)-1); /* an invalid id changes nothing and says the current */
    prev->gid = fs_setgid((gid_t)-1);
    int n = getgroups(0, NULL);
    if (n > 0) {
        prev->groups = dp_xcalloc((size_t)n, sizeof(*prev->groups));
        n = getgroups(n, prev->groups);
    }
    if (n < 0) {
        e = errno;
        dp_buf_printf(err, "reading as the engine's user: getgroups: %s", strerror(e));
        attest_fs_ident_free(prev);
        return -e;
    }
    prev->ngroups = (size_t)n;
    prev->caps[0] = d[0].effective;
    prev->caps[1] = d[1].effective;
    prev->taken = true;
    e = fs_setgroups(id->ngroups, id->groups) == 0 ? 0 : errno;
    if (e == 0) {
        fs_setgid(id->gid);
        e = fs_setgid((gid_t)-1) == id->gid ? 0 : EPERM;
    }
    if (e == 0) {
        fs_setuid(id->uid); /* the file-system capabilities go with a uid other than 0 */
        e = fs_setuid((uid_t)-1) == id->uid ? 0 : EPERM;
    }
    if (e == 0) {
        const uint64_t words[2] = {(uint32_t)keep, (uint32_t)(keep >> 32)};
        e = -caps_effective(words, false);
    }
    if (e != 0) {
        dp_buf_printf(err, "reading as the engine's user (uid %u, gid %u): %s", (unsigned)id->uid,
                      (unsigned)id->gid, strerror(e));
        attest_fs_ident_leave(prev);
        return -e;
    }
    return 0;
}

void attest_fs_ident_free(attest_fs_ident_t *id)
{
    free(id->groups);
    memset(id, 0, sizeof(*id));
}

int attest_as_process_enter(const char *proc, pid_t pid, unsigned long long start,
                            int64_t owner_uid, attest_fs_ident_t *prev, dp_buf_t *err)
{
    memset(prev, 0, sizeof(*prev));
    /* The root first, with the agent's own rights (the engine's user may not open it). */
    int rc = attest_view_enter(proc, pid, err);
    if (rc == 0 && pid > 0) {
        attest_fs_ident_t id;
        rc = attest_proc_fs_ident(proc, pid, start, &id, err);
        if (rc == 0)
            rc = attest_fs_ident_enter(&id, prev, err);
        attest_fs_ident_free(&id);
    } else if (rc == 0) {
        /* Out of sight, its process tells neither its groups nor its capabilities nor its
         * root: the socket's uid with no group and no capability, which reads what that user
         * could, or less; a socket of root's (bound before the engine dropped to another
         * user), or none seen, reads as nobody. Never as the agent. */
        attest_fs_ident_t id = {.uid = owner_uid > 0 ? (uid_t)owner_uid : ATTEST_NOBODY,
                                .gid = ATTEST_NOBODY,
                                .cap_eff_known = true};
        rc = attest_fs_ident_enter(&id, prev, err);
    }
    if (rc != 0) {
        attest_view_leave();
        return rc;
    }
    prev->view = true;
    return 0;
}
