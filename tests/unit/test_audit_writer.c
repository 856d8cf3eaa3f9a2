/* proxy/obs/audit: the writer's locks across a reload onto another audit_path or audit_store,
 * or one that removes the trail. Lines queued before the reopen (or the retirement), and the
 * batch in flight, still go to the old file and store: their locks are held until they are
 * written, so no second writer can start on the old trail meanwhile, and are released then. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
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

/* A writer on path storing bodies in store (a folder made here). */
static px_audit_t *open_storing(const char *path, const char *store)
{
    cr_assert_eq(mkdir(store, 0700), 0);
    px_audit_t *a = px_audit_open(&g_loop, path, NULL);
    cr_assert_not_null(a);
    int lock = px_audit_store_lock(a, store, NULL);
    cr_assert_geq(lock, 0);
    px_audit_configure(a, store, lock, NULL, 0, true);
    return a;
}

static void lines_in_flight(px_audit_t *a, int n, const char *sha)
{
    const char *line = "{\"request_id\":\"x\"}\n";
    px_audit_body_t body = {sha, "body", 4, NULL};
    for (int i = 0; i < n; i++)
        px_audit_write_bodies(a, line, strlen(line), &body, 1, written, NULL);
}

Test(audit_writer, a_retired_writer_writes_its_queued_lines_then_lets_go_of_every_lock)
{
    char path[128], lock[136], store[128], store_lock[136];
    snprintf(path, sizeof(path), "%s/a.jsonl", g_dir);
    snprintf(lock, sizeof(lock), "%s.lock", path);
    snprintf(store, sizeof(store), "%s/store", g_dir);
    snprintf(store_lock, sizeof(store_lock), "%s/.lock", store);
    px_audit_t *a = open_storing(path, store);
    /* The first line's batch goes in flight, the two after it wait for it. */
    lines_in_flight(a, 3, "1111111111111111111111111111111111111111111111111111111111111111");
    px_audit_retire(a);
    cr_assert_not(lockable(lock), "the path's lock went while its lines were still to be written");
    cr_assert_not(lockable(path), "the file lock went while its lines were still to be written");
    cr_assert_not(lockable(store_lock), "the store's lock went while bodies were to be stored");
    while (g_done < 3)
        uv_run(&g_loop, UV_RUN_ONCE);
    cr_assert_eq(count_lines(path), 3);
    /* Written, and nothing more comes: the trail is free for whoever takes it on. */
    cr_assert(lockable(lock));
    cr_assert(lockable(path));
    cr_assert(lockable(store_lock));
    px_audit_close(a);
}

Test(audit_writer, the_old_store_stays_locked_until_the_batch_in_flight_is_done)
{
    char path[128], s1[128], s2[128], l1[136], l2[136];
    snprintf(path, sizeof(path), "%s/a.jsonl", g_dir);
    snprintf(s1, sizeof(s1), "%s/s1", g_dir);
    snprintf(s2, sizeof(s2), "%s/s2", g_dir);
    snprintf(l1, sizeof(l1), "%s/.lock", s1);
    snprintf(l2, sizeof(l2), "%s/.lock", s2);
    cr_assert_eq(mkdir(s2, 0700), 0);
    px_audit_t *a = open_storing(path, s1);
    const char *sha = "2222222222222222222222222222222222222222222222222222222222222222";
    lines_in_flight(a, 1, sha); /* its batch, storing into s1, is in flight */
    int lock = px_audit_store_lock(a, s2, NULL);
    cr_assert_geq(lock, 0);
    px_audit_configure(a, s2, lock, NULL, 0, true);
    cr_assert_not(lockable(l1), "s1's lock went while a body was being stored there");
    /* Back onto s1 before that batch is done: its lock is still the writer's own. */
    lock = px_audit_store_lock(a, s1, NULL);
    cr_assert_geq(lock, 0, "s1's lock, still held for the batch in flight, was not shared");
    px_audit_configure(a, s1, lock, NULL, 0, true);
    cr_assert_not(lockable(l2));
    while (g_done < 1)
        uv_run(&g_loop, UV_RUN_ONCE);
    char body[256];
    snprintf(body, sizeof(body), "%s/%s", s1, sha);
    cr_assert_eq(access(body, F_OK), 0, "the body is not in the store its batch began with");
    cr_assert(lockable(l2), "s2's lock was kept after the batch was done");
    cr_assert_not(lockable(l1), "s1's lock went with the store still in use");
    px_audit_close(a);
}
