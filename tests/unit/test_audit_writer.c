/* proxy/obs/audit: the writer's locks across a reload onto another audit_path. Lines queued
 * before the reopen, and the batch in flight, still go to the old file: its locks are held
 * until they are written, so no second writer can start on the old trail meanwhile. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include <uv.h>

#include "proxy/obs/audit.h"

static uv_loop_t g_loop;
static char g_dir[64];
static int g_done;

static void setup(void)
{
    uv_loop_init(&g_loop);
    snprintf(g_dir, sizeof(g_dir), "/tmp/dp-audit-writer-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
    g_done = 0;
}

static void teardown(void)
{
    uv_run(&g_loop, UV_RUN_DEFAULT);
    uv_loop_close(&g_loop);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(audit_writer, .init = setup, .fini = teardown);

static void written(void *data, int status)
{
    (void)data;
    cr_assert_eq(status, 0, "%s", uv_strerror(status));
    g_done++;
}

/* Whether another process could take the lock file's lock now (flock locks are per open file
 * description: a fresh open here conflicts with the writer's as another process's would). */
static bool lockable(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
    bool free_ = flock(fd, LOCK_EX | LOCK_NB) == 0;
    close(fd);
    return free_;
}

static size_t count_lines(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    size_t n = 0;
    for (int c; (c = fgetc(f)) != EOF;)
        n += c == '\n';
    fclose(f);
    return n;
}

Test(audit_writer, the_old_path_stays_locked_until_its_lines_are_written)
{
    char a_path[128], b_path[128], a_lock[136];
    snprintf(a_path, sizeof(a_path), "%s/a.jsonl", g_dir);
    snprintf(b_path, sizeof(b_path), "%s/b.jsonl", g_dir);
    snprintf(a_lock, sizeof(a_lock), "%s.lock", a_path);
    px_audit_t *a = px_audit_open(&g_loop, a_path, NULL);
    cr_assert_not_null(a);
    cr_assert_not(lockable(a_lock));
    const char *line = "{\"request_id\":\"x\"}\n";
    for (int i = 0; i < 3; i++)
        px_audit_write(a, line, strlen(line), written, NULL);
    cr_assert_eq(px_audit_reopen(a, b_path, NULL), 0); /* the lines above are the old file's */
    px_audit_write(a, line, strlen(line), written, NULL);
    /* Nothing has run on the loop yet: every line is still to be written, three of them to a. */
    cr_assert_not(lockable(a_lock), "a's lock went while its lines were still to be written");
    cr_assert_not(lockable(a_path), "a's file lock went while its lines were still to be written");
    while (g_done < 4)
        uv_run(&g_loop, UV_RUN_ONCE);
    cr_assert_eq(count_lines(a_path), 3);
    cr_assert_eq(count_lines(b_path), 1);
    /* a is written no more: its locks are free for whoever takes the old trail on. */
    cr_assert(lockable(a_lock));
    cr_assert(lockable(a_path));
    cr_assert_not(lockable(b_path));
    px_audit_close(a);
}
