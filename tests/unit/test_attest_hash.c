/* Checkpoint hashing (docs/attestation.md §1): the digest of a fixed tree, computed independently
 * with the coreutils pipeline when this test was written, and the failure modes: loops, unreadable,
 * vanished and changing files, unsupported names. */
#define _GNU_SOURCE
#include <criterion/criterion.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "attest/hash.h"

/* Computed with the coreutils pipeline of docs/attestation.md §1 (find -L, hidden paths filtered,
 * LC_ALL=C sort, xargs sha256sum, sha256sum) on the tree make_tree builds, when this test was
 * written. */
#define FIXTURE_DIGEST "bb28320c2afa0fda15467a619d18cc0bd08aadc034b6638df63903d042f4c93b"
#define EMPTY_DIGEST "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

static char g_dir[64];

static void pathf(char *out, size_t n, const char *rel)
{
    snprintf(out, n, "%s/%s", g_dir, rel);
}

static void put(const char *rel, const void *data, size_t n)
{
    char p[512];
    pathf(p, sizeof(p), rel);
    FILE *f = fopen(p, "wb");
    cr_assert_not_null(f, "create %s", p);
    if (n)
        cr_assert_eq(fwrite(data, 1, n, f), n);
    fclose(f);
}

static void puts_file(const char *rel, const char *s)
{
    put(rel, s, strlen(s));
}

static void mkd(const char *rel)
{
    char p[512];
    pathf(p, sizeof(p), rel);
    cr_assert_eq(mkdir(p, 0755), 0, "mkdir %s", p);
}

static void lnk(const char *target, const char *rel)
{
    char p[512];
    pathf(p, sizeof(p), rel);
    cr_assert_eq(symlink(target, p), 0, "symlink %s", p);
}

static void setup_dir(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/dp-attest-hash-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
    chmod(g_dir, 0755);
}

static void teardown_dir(void)
{
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "chmod -R u+rwX %s 2>/dev/null; rm -rf %s", g_dir, g_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "cleanup of %s failed\n", g_dir);
}

/* The tree the fixture digest was computed on: nested dirs, dotfiles at two levels, a symlinked
 * file, a symlinked directory, a dangling symlink, a name with a space, an empty file, and the
 * "a-b" / "a/b" pair whose order shows sorting is over whole paths, bytewise. */
static void make_tree(void)
{
    puts_file("a.txt", "hello\n");
    puts_file("a-b", "dash\n");
    mkd("a");
    puts_file("a/b", "nested\n");
    mkd("sub");
    mkd("sub/dir");
    mkd("sub/.cache");
    unsigned char deep[1000];
    for (int i = 0; i < 1000; i++)
        deep[i] = (unsigned char)(i % 251);
    put("sub/dir/deep.bin", deep, sizeof(deep));
    puts_file("with space.txt", "spaces\n");
    puts_file(".hidden", "secret\n");
    puts_file("sub/.cache/x", "skip\n");
    lnk("a.txt", "link-to-a.txt");
    lnk("sub", "linkdir");
    lnk("nonexistent", "broken");
    put("empty", "", 0);
}

TestSuite(attest_hash, .init = setup_dir, .fini = teardown_dir);

Test(attest_hash, fixture_digest_matches_coreutils)
{
    make_tree();
    char hex[65];
    dp_buf_t err = {0}, lines = {0};
    attest_snapshot_t snap;
    int rc = attest_hash_dir(g_dir, NULL, hex, &snap, &lines, &err);
    cr_assert_eq(rc, 0, "%s", err.base ? err.base : "");
    cr_assert_str_eq(hex, FIXTURE_DIGEST);
    /* The listing is the sorted set find -L would print. */
    static const char *const want[] = {"a-b",
                                       "a.txt",
                                       "a/b",
                                       "empty",
                                       "link-to-a.txt",
                                       "linkdir/dir/deep.bin",
                                       "sub/dir/deep.bin",
                                       "with space.txt"};
    cr_assert_eq(snap.count, sizeof(want) / sizeof(want[0]));
    for (size_t i = 0; i < snap.count; i++)
        cr_assert_str_eq(snap.files[i].relpath, want[i]);
    cr_assert_eq(snap.total_bytes, 5 + 6 + 7 + 0 + 6 + 1000 + 1000 + 7);
    cr_assert(strstr(lines.base,
                     "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03  a.txt\n"));
    attest_snapshot_free(&snap);
    dp_buf_free(&err);
    dp_buf_free(&lines);
}

Test(attest_hash, small_reads_give_the_same_digest)
{
    make_tree();
    char hex[65];
    attest_hash_opts_t o = {.read_size = 7}; /* many reads per file, partial last read */
    cr_assert_eq(attest_hash_dir(g_dir, &o, hex, NULL, NULL, NULL), 0);
    cr_assert_str_eq(hex, FIXTURE_DIGEST);
}

Test(attest_hash, empty_directory_is_hash_of_nothing)
{
    puts_file(".only-hidden", "x");
    char hex[65];
    cr_assert_eq(attest_hash_dir(g_dir, NULL, hex, NULL, NULL, NULL), 0);
    cr_assert_str_eq(hex, EMPTY_DIGEST);
}

Test(attest_hash, fifo_is_skipped_not_opened)
{
    make_tree();
    char p[512];
    pathf(p, sizeof(p), "pipe");
    cr_assert_eq(mkfifo(p, 0644), 0);
    char hex[65];
    cr_assert_eq(attest_hash_dir(g_dir, NULL, hex, NULL, NULL, NULL), 0);
    cr_assert_str_eq(hex, FIXTURE_DIGEST);
}

Test(attest_hash, symlink_loop_to_ancestor_is_an_error)
{
    make_tree();
    lnk("..", "sub/dir/up");
    char hex[65];
    dp_buf_t err = {0};
    int rc = attest_hash_dir(g_dir, NULL, hex, NULL, NULL, &err);
    cr_assert_eq(rc, -ELOOP);
    cr_assert(strstr(err.base, "symlink loop") && strstr(err.base, "sub/dir/up"), "%s", err.base);
    dp_buf_free(&err);
}

Test(attest_hash, self_referencing_symlink_is_an_error)
{
    lnk("self", "self");
    char hex[65];
    dp_buf_t err = {0};
    cr_assert_eq(attest_hash_dir(g_dir, NULL, hex, NULL, NULL, &err), -ELOOP);
    cr_assert(strstr(err.base, "symlink loop"), "%s", err.base);
    dp_buf_free(&err);
}

Test(attest_hash, backslash_in_name_is_refused)
{
    puts_file("bad\\name", "x");
    char hex[65];
    dp_buf_t err = {0};
    cr_assert_eq(attest_hash_dir(g_dir, NULL, hex, NULL, NULL, &err), -EINVAL);
    cr_assert(strstr(err.base, "unsupported file name"), "%s", err.base);
    dp_buf_free(&err);
}

Test(attest_hash, a_name_with_control_bytes_is_reported_on_one_line)
{
    puts_file("x\nerror: forged\x1b[2J", "x");
    char hex[65];
    dp_buf_t err = {0};
    cr_assert_eq(attest_hash_dir(g_dir, NULL, hex, NULL, NULL, &err), -EINVAL);
    cr_assert(strstr(err.base, "x\\x0aerror: forged\\x1b[2J"), "%s", err.base);
    for (size_t i = 0; i < err.len; i++)
        cr_assert((unsigned char)err.base[i] >= 0x20, "a control byte in: %s", err.base);
    dp_buf_free(&err);
}

Test(attest_hash, missing_directory_is_an_error)
{
    char hex[65];
    dp_buf_t err = {0};
    cr_assert_eq(attest_hash_dir("/nonexistent/dp-attest", NULL, hex, NULL, NULL, &err), -ENOENT);
    cr_assert(strstr(err.base, "/nonexistent/dp-attest"), "%s", err.base);
    dp_buf_free(&err);
}

/* Hash g_dir with an effective uid that cannot bypass permissions (root ignores mode bits), so
 * an unreadable file really is unreadable. seteuid, not fork: Criterion's test process has
 * threads, and a forked child of a threaded process can deadlock in malloc. The saved uid stays
 * 0, so privileges come back for the teardown. */
static void hash_unprivileged(char *out, size_t n)
{
    bool root = geteuid() == 0;
    if (root)
        cr_assert_eq(seteuid(65534), 0);
    char hex[65];
    dp_buf_t err = {0};
    int rc = attest_hash_dir(g_dir, NULL, hex, NULL, NULL, &err);
    if (root)
        cr_assert_eq(seteuid(0), 0);
    snprintf(out, n, "%d %s", rc, rc == 0 ? hex : err.base);
    dp_buf_free(&err);
}

Test(attest_hash, unreadable_file_is_an_error)
{
    make_tree();
    char p[512];
    pathf(p, sizeof(p), "a/b");
    cr_assert_eq(chmod(p, 0), 0);
    char res[512];
    hash_unprivileged(res, sizeof(res));
    cr_assert(strstr(res, "cannot open") && strstr(res, "a/b") && strstr(res, "Permission denied"),
              "%s", res);
}

Test(attest_hash, unreadable_directory_is_an_error)
{
    make_tree();
    char p[512];
    pathf(p, sizeof(p), "sub/dir");
    cr_assert_eq(chmod(p, 0), 0);
    char res[512];
    hash_unprivileged(res, sizeof(res));
    cr_assert(strstr(res, "sub/dir") && strstr(res, "Permission denied"), "%s", res);
}

/* ---- files that change under the hasher: driven from the progress callback, which runs on
 * the hashing thread between reads, so the timing is exact. */

typedef struct {
    const char *when; /* relpath being hashed that triggers the action */
    int action;       /* 0 unlink target, 1 append to target, 2 rewrite target in place */
    const char *target;
    int skip; /* matching callbacks to let pass first (1: after the first read) */
    bool done;
} mutate_t;

static void mutate_cb(const attest_progress_t *p, void *data)
{
    mutate_t *m = data;
    if (m->done || p->current == NULL || strcmp(p->current, m->when) != 0)
        return;
    if (m->skip-- > 0)
        return;
    m->done = true;
    char path[512];
    pathf(path, sizeof(path), m->target);
    if (m->action == 0) {
        cr_assert_eq(unlink(path), 0);
    } else {
        int fd = open(path, O_WRONLY | (m->action == 1 ? O_APPEND : 0));
        cr_assert(fd >= 0);
        cr_assert_eq(write(fd, "XXXX", 4), 4);
        close(fd);
    }
}

static void age(const char *rel)
{
    char p[512];
    pathf(p, sizeof(p), rel);
    struct timespec ts[2] = {{1000000000, 0}, {1000000000, 0}};
    cr_assert_eq(utimensat(AT_FDCWD, p, ts, 0), 0);
}

Test(attest_hash, file_vanishing_mid_hash_is_a_clear_error)
{
    make_tree();
    mutate_t m = {.when = "a-b", .action = 0, .target = "a/b"};
    attest_hash_opts_t o = {.progress = mutate_cb, .progress_data = &m};
    char hex[65];
    dp_buf_t err = {0};
    cr_assert_eq(attest_hash_dir(g_dir, &o, hex, NULL, NULL, &err), -ENOENT);
    cr_assert(m.done);
    cr_assert(strstr(err.base, "file vanished during hashing: ") && strstr(err.base, "/a/b"), "%s",
              err.base);
    dp_buf_free(&err);
}

Test(attest_hash, file_growing_mid_hash_is_an_error)
{
    char big[16384];
    memset(big, 'b', sizeof(big));
    put("big", big, sizeof(big));
    mutate_t m = {.when = "big", .action = 1, .target = "big", .skip = 1};
    attest_hash_opts_t o = {.progress = mutate_cb, .progress_data = &m, .read_size = 4096};
    char hex[65];
    dp_buf_t err = {0};
    cr_assert_eq(attest_hash_dir(g_dir, &o, hex, NULL, NULL, &err), -ESTALE);
    cr_assert(m.done);
    cr_assert(strstr(err.base, "file changed during hashing") && strstr(err.base, "big") &&
                  strstr(err.base, "more than"),
              "%s", err.base);
    dp_buf_free(&err);
}

Test(attest_hash, file_rewritten_in_place_mid_hash_is_an_error)
{
    char big[16384];
    memset(big, 'b', sizeof(big));
    put("big", big, sizeof(big));
    age("big"); /* so the rewrite's mtime differs even on a coarse-clock filesystem */
    mutate_t m = {.when = "big", .action = 2, .target = "big", .skip = 1};
    attest_hash_opts_t o = {.progress = mutate_cb, .progress_data = &m, .read_size = 4096};
    char hex[65];
    dp_buf_t err = {0};
    cr_assert_eq(attest_hash_dir(g_dir, &o, hex, NULL, NULL, &err), -ESTALE);
    cr_assert(m.done);
    cr_assert(strstr(err.base, "modified while being read"), "%s", err.base);
    dp_buf_free(&err);
}

Test(attest_hash, file_changed_between_listing_and_hashing_is_an_error)
{
    make_tree();
    attest_snapshot_t snap;
    cr_assert_eq(attest_snapshot_take(g_dir, &snap, NULL), 0);
    puts_file("a.txt", "hello, longer\n");
    char hex[65];
    dp_buf_t err = {0};
    cr_assert_eq(attest_hash_snapshot(g_dir, &snap, NULL, hex, NULL, &err), -ESTALE);
    cr_assert(strstr(err.base, "a.txt"), "%s", err.base);
    attest_snapshot_free(&snap);
    dp_buf_free(&err);
}

static void count_cb(const attest_progress_t *p, void *data)
{
    attest_progress_t *last = data;
    cr_assert(p->bytes_done <= p->bytes_total);
    cr_assert(p->files_done <= p->files_total);
    *last = *p;
}

Test(attest_hash, progress_reaches_the_totals)
{
    make_tree();
    attest_progress_t last = {0};
    attest_hash_opts_t o = {.progress = count_cb, .progress_data = &last, .read_size = 64};
    char hex[65];
    cr_assert_eq(attest_hash_dir(g_dir, &o, hex, NULL, NULL, NULL), 0);
    cr_assert_eq(last.files_total, 8);
    cr_assert_eq(last.files_done, 8);
    cr_assert_eq(last.bytes_done, last.bytes_total);
    cr_assert_eq(last.bytes_total, 2031);
}

Test(attest_hash, cancel_stops_hashing)
{
    make_tree();
    atomic_int cancel = 1;
    attest_hash_opts_t o = {.cancel = &cancel};
    char hex[65];
    cr_assert_eq(attest_hash_dir(g_dir, &o, hex, NULL, NULL, NULL), -ECANCELED);
}

/* ---- snapshots ---------------------------------------------------------------------------- */

static bool differs_after(void (*change)(void), const char *expect)
{
    attest_snapshot_t a, b;
    cr_assert_eq(attest_snapshot_take(g_dir, &a, NULL), 0);
    change();
    cr_assert_eq(attest_snapshot_take(g_dir, &b, NULL), 0);
    dp_buf_t why = {0};
    bool d = attest_snapshot_differs(&a, &b, &why);
    if (expect)
        cr_assert(d && strstr(why.base, expect), "%s", why.base ? why.base : "(no diff)");
    attest_snapshot_free(&a);
    attest_snapshot_free(&b);
    dp_buf_free(&why);
    return d;
}

static void grow(void)
{
    puts_file("a.txt", "hello again\n");
}
static void touch_only(void)
{
    char p[512];
    pathf(p, sizeof(p), "a.txt");
    struct timespec ts[2] = {{2000000000, 0}, {2000000000, 0}};
    cr_assert_eq(utimensat(AT_FDCWD, p, ts, 0), 0);
}
static void replace_same_size_and_time(void)
{
    /* write-to-temp + rename, the usual way model files get updated, keeping size and mtime */
    puts_file("tmp-new", "HELLO AGAIN\n"); /* same size as a.txt after grow() */
    age("tmp-new");
    char from[512], to[512];
    pathf(from, sizeof(from), "tmp-new");
    pathf(to, sizeof(to), "a.txt");
    cr_assert_eq(rename(from, to), 0);
}
static void rewrite_in_place_keeping_mtime(void)
{
    /* Same size, same inode, mtime put back: only the ctime moved (it cannot be set back). */
    char p[512];
    pathf(p, sizeof(p), "a.txt");
    struct stat st;
    cr_assert_eq(stat(p, &st), 0);
    struct timespec ts[2] = {st.st_atim, st.st_mtim};
    FILE *f = fopen(p, "r+");
    cr_assert_not_null(f);
    fputs("HELLO", f);
    fclose(f);
    cr_assert_eq(utimensat(AT_FDCWD, p, ts, 0), 0);
}
static void add_one(void)
{
    puts_file("new.bin", "n");
}
static void remove_one(void)
{
    char p[512];
    pathf(p, sizeof(p), "empty");
    cr_assert_eq(unlink(p), 0);
}
static void nothing(void)
{
}
static void hidden_change(void)
{
    puts_file(".hidden", "changed and longer\n");
}

Test(attest_hash, snapshot_detects_changes)
{
    make_tree();
    age("a.txt");
    cr_assert(differs_after(grow, "a.txt: size 6 -> 12"));
    cr_assert(differs_after(touch_only, "a.txt: modified"));
    age("a.txt");
    cr_assert(differs_after(replace_same_size_and_time, "a.txt: replaced"));
    cr_assert(differs_after(rewrite_in_place_keeping_mtime, "a.txt: modified (ctime changed)"));
    cr_assert(differs_after(add_one, "added: new.bin"));
    cr_assert(differs_after(remove_one, "removed: empty"));
    cr_assert_not(differs_after(nothing, NULL));
    cr_assert_not(differs_after(hidden_change, NULL));
}

/* settled_ns: a file changed within the timestamp granularity may still be changing in the same
 * tick, so the hash is refused until every file has been quiet that long. */
Test(attest_hash, recently_changed_files_are_not_vouched_for)
{
    make_tree();
    /* A window far longer than making the tree takes on a loaded machine: still inside it. */
    attest_hash_opts_t recent = {.settled_ns = 60 * 1000000000ull};
    attest_hash_opts_t o = {.settled_ns = 50 * 1000000ull};
    char hex[65], plain[65];
    dp_buf_t err = {0};
    cr_assert_eq(attest_hash_dir(g_dir, &recent, hex, NULL, NULL, &err), -ESTALE);
    cr_assert(strstr(err.base, "changed less than 60000 ms ago"), "%s", err.base);
    dp_buf_free(&err);
    usleep(100 * 1000); /* the condition under test is elapsed time itself */
    cr_assert_eq(attest_hash_dir(g_dir, &o, hex, NULL, NULL, NULL), 0);
    cr_assert_eq(attest_hash_dir(g_dir, NULL, plain, NULL, NULL, NULL), 0);
    cr_assert_str_eq(hex, plain);
}
