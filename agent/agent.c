/* `detproxy attest serve`: the replica-side attestation agent (docs/attestation.md §4).
 *
 * It hashes the model directory off the event loop (uv_queue_work), then answers
 * GET /attestation?nonce=N with a freshly signed DSSE envelope of
 * {model, checkpoint_sha256, quantization, dtype, framework{name,version}, nonce, issued_at}.
 *
 * Staying true over time: a timer lists the directory every --watch-interval-ms (stat only, also
 * on a worker thread) and compares with the listing the current hash was computed from. On any
 * difference in paths, sizes, mtimes, ctimes or inodes the agent stops vouching at once (503
 * until the new hash is done) and re-hashes. Polling rather than inotify: a model volume is often a
 * network or read-only shared mount where inotify sees nothing of changes made elsewhere.
 *
 * With --framework-url the framework name and version come from the co-located server through
 * the same check the proxy runs on a native replica (probe/probe.h: the adapter's endpoints,
 * then a 1-token probe completion whose system_fingerprint goes into the payload as
 * engine_fingerprint (docs/attestation.md §5, "The engine fingerprint"), so detproxy can check
 * every response against it), one adapter after the other until one names the framework,
 * refreshed every --framework-refresh-ms, so a restarted server on another version is reported
 * as such. Not recognised: both are reported null (unattested), never a stale value. Not
 * answering at all (connection refused, timed out, reset): GET /attestation answers 503
 * `framework_unreachable` naming the URL and the error, and the agent retries after 100 ms,
 * doubling up to 1 s, so an engine restart is seen within a second.
 *
 * With --framework-url the agent measures rather than repeats (docs/attestation.md §4, "What the
 * agent measures"): each read's quantization, dtype and model path are the engine's
 * (attest/engine.h merges them with the flags; a flag that differs is a contradiction the proxy
 * rejects), and what is hashed is the model the engine loaded, reached through
 * /proc/PID/root when the engine's process is visible (the one listening on the URL's port, or
 * --engine-pid). A new process on that port is noticed from /proc/net/tcp before every answer
 * and every watch tick: the agent stops vouching and measures it again at once. The target of
 * the hash changes with the engine's report: target_gen numbers the targets, so that a job
 * still running for an older one is cancelled and its result dropped.
 *
 * Threads: the loop thread owns everything; a job's worker touches only its job_t. Logging
 * happens on the loop thread only (common/log.h is single-threaded). */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <uv.h>

#include "agent/agent.h"
#include "attest/adapters.h"
#include "attest/check.h"
#include "attest/determinism.h"
#include "attest/dsse.h"
#include "attest/engine.h"
#include "attest/hash.h"
#include "attest/oms.h"
#include "attest/view.h"
#include "common/args.h"
#include "common/jw.h"
#include "common/log.h"
#include "common/util.h"
#include "config/config.h"
#include "net/client.h"
#include "net/resolve.h"
#include "net/server.h"
#include "net/tls.h"
#include "probe/probe.h"

#define DEFAULT_WATCH_MS 1000
#define DEFAULT_FW_REFRESH_MS 10000
#define FW_READ_MS 2000      /* the most one framework read may take, whole answers included */
#define FW_RETRY_MIN_MS 100  /* after a failed read: retry this soon, doubling ... */
#define FW_RETRY_MAX_MS 1000 /* ... up to this (or --framework-refresh-ms, if shorter) */
#define FW_ON_DEMAND_MS 250  /* an attestation request re-reads a framework read longer ago */
#define RETRY_MIN_MS 1000
#define RETRY_MAX_MS 60000
/* Files changed (or vanished) while being hashed: the directory is being written. Try again
 * soon, without the long backoff, so that once it settles it is served again within seconds. */
#define RETRY_CHANGING_MAX_MS 2000
/* A file changed less than this before a hash started may still be changing within the same
 * timestamp tick: not vouched for yet (attest_hash_opts_t.settled_ns). */
#define SETTLED_MS 1000
#define PROGRESS_LOG_MS 10000
/* A look for the engine's model is a stat and a 4-byte read: one that takes this long means the
 * storage under it does not answer, and the checkpoint is not vouched for until it does. */
#define LOOK_STALLED_MS 5000
/* On SIGTERM, work in flight gets this long to end; a thread stuck in a read of storage that
 * does not answer is then left to the exit. */
#define STOP_GRACE_MS 2000
/* Looks and hashes left running on storage that does not answer, so that a later model can be
 * looked at and hashed: at most this many, so that libuv's thread pool (4 threads) keeps one
 * for a look and one for a hash. */
#define MAX_ABANDONED 2
/* Open connections from one client address: proxies keep one or two each, so a host that
 * opens more is not a proxy, and must not take every slot (10,000) from the proxies. Room
 * for a hundred proxies behind one NAT address. */
#define DEFAULT_CONNS_PER_CLIENT 256

/* ST_MEASURING: the engine at --framework-url has not been read yet, or is another process
 * than the one measured: nothing is vouched for until its report is read again. */
typedef enum { ST_HASHING = 0, ST_READY, ST_FAILED, ST_MEASURING } agent_state_t;

typedef struct agent_s agent_t;

/* One unit of work for the thread pool: a full hash, or a listing only (change check), of the
 * model (a folder, or one file). */
typedef struct {
    uv_work_t work;
    agent_t *a;
    bool full;
    unsigned gen; /* the agent's target_gen when queued: a result for an older target is dropped */
    char *path;
    char hex[65];
    attest_snapshot_t snap;
    bool file; /* path is one file (its snapshot has one entry) */
    dp_buf_t err;
    int rc;
    uint64_t start_ns, end_ns;
    atomic_uint_fast64_t bytes_done, bytes_total;
    atomic_int cancel; /* set when the agent stops or measures another model */
    /* --oms-bundle: the bundle verified against the directory (full jobs), and what a later
     * check compares against (every job). */
    const char *oms_bundle;
    const oms_trust_t *oms_trust;
    oms_result_t oms;
    oms_watch_t oms_watch;
    /* pid > 0: which of the model's files the engine's process has open or mapped
     * (attest_loaded_t, or a negative errno), and another GGUF file it has instead. */
    pid_t pid;
    unsigned long long pid_start; /* its start time: the engine's, not a later one's pid */
    int64_t owner_uid;            /* pid 0: the uid owning the engine's socket (-1: unknown) */
    bool hidden;                  /* eng_t.hidden: nothing the engine names is read */
    bool abandoned;               /* left running on storage that does not answer */
    int loaded;
    dp_buf_t other;
    /* The path is the engine's own (target_measured): it must look like a model before it is
     * read, and what was hashed must still be one (attest_model_shaped, attest_model_still_shaped).
     */
    bool measured;
} job_t;

/* Reading name and version from the co-located framework: one adapter's check at a time
 * (probe_start), over one keep-alive upstream. */
typedef struct {
    net_upstream_t *up;
    cfg_url_t url;
    char *api_key;
    const attest_adapter_t *only; /* --framework given: just this adapter */
    size_t adapter;               /* index into the probe order */
    probe_t *probe;               /* the check in flight */
    bool running;
    int known; /* the last refresh found the framework: 1, did not: 0, none yet: -1 */
    dp_buf_t last_error;
    /* The last refresh could not connect at all: attestations answer 503 with this reason
     * ("framework at http://127.0.0.1:8000: connection refused"), so the proxy reads a dead
     * engine as unreachable rather than as an identity mismatch. Empty otherwise. */
    dp_buf_t unreachable;
    uint32_t retry_ms;   /* the next retry after a failure; 0 after a success */
    uint64_t started_ms; /* loop time the last refresh started */
} fw_t;

/* The engine process behind --framework-url, as far as /proc shows it (attest/engine.h). */
typedef struct {
    struct sockaddr_storage addr; /* the URL's address */
    uint64_t sock_ino;        /* the listening socket of the engine last measured; 0: none seen */
    int64_t sock_uid;         /* the uid owning it (-1: unknown) */
    int64_t read_ino;         /* the listener when the read in flight started (< 0: unknown) */
    pid_t pid;                /* its process; 0: not seen (other namespace, no access) */
    unsigned long long start; /* that process's start time */
    bool local;               /* an address of this host: its listener can be looked up */
    /* pid 0 although the agent sees every process (attest_proc_sees_every_process): the
     * socket's holder keeps it out of sight, and nothing the engine names is read. */
    bool hidden;
    pid_t fixed; /* --engine-pid, 0 without */
    unsigned long long fixed_start;
    int loaded_last; /* the last "loaded" result logged; -100 before the first */
} eng_t;

struct agent_s {
    uv_loop_t loop;
    net_server_t *srv;
    uv_signal_t sigterm, sigint, sigpipe;
    uv_timer_t watch, fw_timer;
    int closes_pending;
    bool stopping;

    char *dir; /* --model-dir; NULL when not given (only with --framework-url) */
    /* What the checkpoint hash is of: --model-dir, or, with --framework-url, the model the
     * engine reports having loaded as the agent reaches it (target_measured). NULL: nothing to
     * hash (the engine's model cannot be seen and there is no --model-dir to repeat). */
    char *target;
    bool target_measured;
    char *engine_path; /* the engine's own path for target (logs), NULL for --model-dir */
    unsigned target_gen;
    bool confirm; /* ST_MEASURING: a listing of the unchanged target decides */
    /* Why the checkpoint is not vouched for although (or because no) hash is at hand: the
     * engine's model is out of sight or the engine is not recognised (ckpt_why), or its
     * process has another model open or mapped (loaded_why). Empty: the hash stands. */
    dp_buf_t ckpt_why, loaded_why;
    char *flag_quant, *flag_dtype; /* --quantization, --dtype */
    attest_key_t *key;
    attest_report_t ident; /* the identity flags; checkpoint comes from the hash */
    uint32_t watch_ms, fw_refresh_ms;

    agent_state_t state;
    char hex[65];
    attest_snapshot_t snap; /* the listing hex was computed from */
    char *why_not_ready;
    uint64_t state_since_ms;
    uint64_t retry_at_ms, retry_delay_ms;
    uint64_t last_progress_log_ms;

    job_t *job;                /* at most one in flight */
    uint64_t job_cancelled_ms; /* when it was told to stop (retarget), 0: it was not */
    struct look_s *look;       /* the look for the engine's model in flight (look_run) */
    uv_timer_t look_timer;
    bool look_stalled;  /* it has outlasted LOOK_STALLED_MS */
    unsigned abandoned; /* looks and jobs stuck on storage, left to end by themselves */
    /* Bumped by a read that does not recognise the engine and by a change of its process:
     * a look begun before either is about an engine that is not there now. (A read that
     * recognises it waits for the look in flight, in pending, or starts one.) */
    unsigned report_gen;
    struct {
        bool waiting; /* a report read while a look was in flight: looked for when it ends */
        bool always_local, new_engine;
        char *model_path;
    } pending;
    struct {
        bool valid; /* the report the last look that stood was for */
        char *model_path;
        pid_t pid;
        unsigned long long start;
    } looked;
    char *dir_contra;      /* the engine's model path --model-dir contradicts, NULL: none */
    uv_timer_t stop_timer; /* STOP_GRACE_MS for work in flight at SIGTERM */

    fw_t fw;
    eng_t eng;
    bool sees_all; /* attest_proc_sees_every_process: a socket no process holds is hidden */

    char *oms_bundle; /* --oms-bundle, NULL without */
    oms_trust_t oms_trust;
    oms_watch_t oms_watch; /* what the OMS result is about */

    /* --determinism batch_invariant: the co-located vLLM's VLLM_BATCH_INVARIANT, re-read every
     * --watch-interval-ms (a restarted server is a new process). det.proc NULL: not checked. */
    attest_det_opts_t det;
    int det_last; /* the last result logged: 1, 0, -1; 2 before the first */
    dp_buf_t det_why;
};

/* ---- logging helpers -------------------------------------------------------------------- */

static void log_kv(dp_log_level_t lvl, const char *msg, const char *k1, const char *v1,
                   const char *k2, const char *v2)
{
    dp_jw_t *w = dp_log_begin(lvl, msg);
    if (w == NULL)
        return;
    if (k1)
        dp_jw_str(w, k1, v1);
    if (k2)
        dp_jw_str(w, k2, v2);
    dp_log_end(w);
}

static void set_not_ready(agent_t *a, agent_state_t st, const char *why)
{
    a->state = st;
    free(a->why_not_ready);
    a->why_not_ready = why ? dp_xstrdup(why) : NULL;
    a->state_since_ms = dp_wall_ms();
}

/* The checkpoint the payload carries, from the hash and what withdraws it. */
static void publish_checkpoint(agent_t *a)
{
    attest_report_t *r = &a->ident;
    const dp_buf_t *why = a->loaded_why.len ? &a->loaded_why : &a->ckpt_why;
    r->measured &= ~(1u << ATTEST_F_CHECKPOINT);
    if (why->len) {
        attest_report_set_unattested(r, ATTEST_F_CHECKPOINT, why->base);
    } else if (a->hex[0]) {
        attest_report_set(r, ATTEST_F_CHECKPOINT, a->hex);
        if (a->target_measured)
            r->measured |= 1u << ATTEST_F_CHECKPOINT;
    } else {
        attest_report_set(r, ATTEST_F_CHECKPOINT, NULL);
    }
}

/* ---- hashing jobs ----------------------------------------------------------------------- */

static void job_progress_cb(const attest_progress_t *p, void *data)
{
    job_t *j = data;
    atomic_store(&j->bytes_done, p->bytes_done);
    atomic_store(&j->bytes_total, p->bytes_total);
}

/* ---- OMS (--oms-bundle, docs/attestation.md §9)
 * ---------------------------------------------------------- */

static void oms_done(agent_t *a, job_t *j)
{
    if (a->oms_bundle == NULL)
        return;
    oms_watch_free(&a->oms_watch);
    a->oms_watch = j->oms_watch;
    memset(&j->oms_watch, 0, sizeof(j->oms_watch));
    attest_report_t *r = &a->ident;
    r->oms_reported = true;
    r->oms_verified = j->oms.verified;
    snprintf(r->oms_signer, sizeof(r->oms_signer), "%s", j->oms.verified ? j->oms.signer : "");
    snprintf(r->oms_root_digest, sizeof(r->oms_root_digest), "%s",
             j->oms.verified ? j->oms.root_digest : "");
    bool keyless = j->oms.verified && j->oms.signed_at > 0;
    snprintf(r->oms_identity, sizeof(r->oms_identity), "%s", keyless ? a->oms_trust.identity : "");
    snprintf(r->oms_issuer, sizeof(r->oms_issuer), "%s", keyless ? a->oms_trust.issuer : "");
    dp_jw_t *w = dp_log_begin(j->oms.verified ? DP_LOG_INFO : DP_LOG_ERROR,
                              j->oms.verified ? "oms_verified" : "oms_not_verified");
    if (w) {
        dp_jw_str(w, "bundle", a->oms_bundle);
        dp_jw_str(w, "method", j->oms.method);
        dp_jw_str(w, "signer", j->oms.signer[0] ? j->oms.signer : NULL);
        dp_jw_str(w, "root_digest", j->oms.root_digest[0] ? j->oms.root_digest : NULL);
        if (keyless) {
            dp_jw_str(w, "identity", r->oms_identity);
            dp_jw_str(w, "issuer", r->oms_issuer);
            dp_jw_int(w, "signed_at", j->oms.signed_at);
        }
        dp_jw_arr_begin(w, "findings");
        for (size_t i = 0; i < j->oms.findings.count && i < 100; i++)
            dp_jw_str(w, NULL, j->oms.findings.items[i]);
        dp_jw_arr_end(w);
        dp_jw_uint(w, "findings_total", j->oms.findings.count);
        dp_log_end(w);
    }
}

/* In the engine's view when it is on (a path the engine names: attest/view.h). */
static bool is_regular_file(const char *path)
{
    struct stat st;
    return attest_view_stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* Why nothing is read for an engine whose socket's holder hides (eng_t.hidden). */
static int engine_hidden(dp_buf_t *why)
{
    dp_buf_appends(why, "no process holds the engine's listening socket, though the agent sees "
                        "every process (its holder keeps it out of its open files): nothing the "
                        "engine names is read");
    return -EPERM;
}

static void job_run(uv_work_t *w)
{
    job_t *j = dp_container_of(w, job_t, work);
    j->start_ns = dp_now_ns();
    /* A path the engine names is read with the engine user's rights, in the engine's root
     * (docs/attestation.md, "What the agent measures"). */
    attest_fs_ident_t prev = {0};
    if (j->measured && j->hidden)
        j->rc = engine_hidden(&j->err);
    else if (j->measured)
        j->rc =
            attest_as_process_enter("/proc", j->pid, j->pid_start, j->owner_uid, &prev, &j->err);
    /* An OMS bundle covers a folder (docs/attestation.md §9): a one-file model has none. Looked
     * at in the engine's view: through the agent's root, a link in the engine's root would
     * say whether the agent has a file where it leads. */
    bool oms = j->rc == 0 && j->oms_bundle && !is_regular_file(j->path);
    if (j->rc != 0) {
        /* neither read nor hashed */
    } else if (j->measured && !attest_model_shaped(j->path, j->path, &j->err)) {
        j->rc = -EINVAL; /* looked at again for every job: the path may name another thing now */
    } else if (j->full) {
        attest_hash_opts_t o = {.progress = job_progress_cb,
                                .progress_data = j,
                                .cancel = &j->cancel,
                                .settled_ns = SETTLED_MS * 1000000ull};
        dp_buf_t lines = {0};
        if (oms) {
            j->rc = oms_watch_take(j->oms_bundle, j->path, &j->oms_watch, &j->err);
            if (j->rc == 0)
                j->rc = attest_hash_dir(j->path, &o, j->hex, &j->snap, &lines, &j->err);
            if (j->rc == 0) {
                attest_hash_opts_t oo = {.cancel = &j->cancel};
                oms_verify_checkpoint(j->oms_bundle, j->path, j->oms_trust, &oo, &j->snap, &lines,
                                      &j->oms);
            }
        } else {
            j->rc = attest_hash_path(j->path, &o, j->hex, &j->snap, &j->file, &j->err);
            if (j->rc == 0 && j->oms_bundle)
                attest_reasons_add(&j->oms.findings,
                                   "%s is one file: an OMS bundle covers a model directory",
                                   j->path);
        }
        dp_buf_free(&lines);
        if (j->rc == 0 && j->measured &&
            !attest_model_still_shaped(j->path, j->file, &j->snap, &j->err)) {
            j->rc = -EINVAL; /* what was hashed is not a model: never shown */
            memset(j->hex, 0, sizeof(j->hex));
        }
    } else {
        j->rc = attest_snapshot_take_path(j->path, &j->snap, &j->file, &j->err);
        if (j->rc == 0 && oms)
            j->rc = oms_watch_take(j->oms_bundle, j->path, &j->oms_watch, &j->err);
    }
    /* The files' names as the engine's maps show them, taken in its view; its maps and open
     * files are then read as the agent. */
    char **names = NULL;
    if (j->rc == 0 && j->pid > 0) {
        /* A one-file snapshot is listed from the file's folder (attest_hash_path). */
        const char *slash = strrchr(j->path, '/');
        char *root = !j->file           ? dp_xstrdup(j->path)
                     : slash == NULL    ? dp_xstrdup(".")
                     : slash == j->path ? dp_xstrdup("/")
                                        : dp_xstrndup(j->path, (size_t)(slash - j->path));
        names = attest_loaded_names(root, &j->snap);
        free(root);
    }
    attest_fs_ident_leave(&prev);
    if (names) {
        j->loaded = attest_proc_loaded("/proc", j->pid, names, &j->snap, &j->other);
        attest_loaded_names_free(names, j->snap.count);
    }
    j->end_ns = dp_now_ns();
}

static void job_free(job_t *j)
{
    attest_snapshot_free(&j->snap);
    oms_watch_free(&j->oms_watch);
    oms_result_clear(&j->oms);
    dp_buf_free(&j->err);
    dp_buf_free(&j->other);
    free(j->path);
    free(j);
}

static void schedule_retry(agent_t *a, int rc)
{
    uint64_t cap = rc == -ESTALE || rc == -ENOENT ? RETRY_CHANGING_MAX_MS : RETRY_MAX_MS;
    a->retry_delay_ms = a->retry_delay_ms ? a->retry_delay_ms * 2 : RETRY_MIN_MS;
    if (a->retry_delay_ms > cap)
        a->retry_delay_ms = cap;
    a->retry_at_ms = dp_now_ms() + a->retry_delay_ms;
}

static void start_job(agent_t *a, bool full);

/* What the engine's process has open or mapped of the model it reports (logged when it
 * changes). Its having another GGUF file and none of the reported one means the engine runs
 * something else than it says: the checkpoint is then not vouched for. */
static void loaded_done(agent_t *a, job_t *j)
{
    if (j->pid <= 0 || !a->target_measured)
        return;
    dp_buf_reset(&a->loaded_why);
    if (j->loaded == ATTEST_LOADED_NOT_SEEN && j->other.len)
        dp_buf_printf(&a->loaded_why,
                      "the engine reports %.200s, but its process has %.200s open or mapped "
                      "instead",
                      a->engine_path ? a->engine_path : a->target, j->other.base);
    publish_checkpoint(a);
    if (j->loaded == a->eng.loaded_last)
        return;
    a->eng.loaded_last = j->loaded;
    dp_jw_t *w = dp_log_begin(j->loaded == ATTEST_LOADED_NOT_SEEN ? DP_LOG_WARN : DP_LOG_INFO,
                              "engine_loaded");
    if (w) {
        dp_jw_int(w, "pid", j->pid);
        dp_jw_str(w, "model_path", a->engine_path);
        dp_jw_str(w, "seen",
                  j->loaded == ATTEST_LOADED_MAPPED     ? "mapped"
                  : j->loaded == ATTEST_LOADED_OPEN     ? "open"
                  : j->loaded == ATTEST_LOADED_NOT_SEEN ? "neither open nor mapped"
                                                        : strerror(-j->loaded));
        if (j->other.len)
            dp_jw_str(w, "instead", j->other.base);
        dp_log_end(w);
    }
}

static void hash_done(agent_t *a, job_t *j)
{
    if (j->rc != 0) {
        const char *e = j->err.base ? j->err.base : strerror(-j->rc);
        bool changing = j->rc == -ESTALE || j->rc == -ENOENT;
        dp_buf_t why = {0};
        dp_buf_printf(&why, "%s%s", e,
                      changing ? j->file ? "; re-hashing once the file settles"
                                         : "; re-hashing once the directory settles"
                               : "");
        set_not_ready(a, ST_FAILED, why.base);
        dp_buf_free(&why);
        schedule_retry(a, j->rc);
        dp_jw_t *w = dp_log_begin(changing ? DP_LOG_WARN : DP_LOG_ERROR, "hash_failed");
        if (w) {
            dp_jw_str(w, "dir", a->target);
            dp_jw_str(w, "error", e);
            dp_jw_uint(w, "retry_in_ms", a->retry_delay_ms);
            dp_log_end(w);
        }
        return;
    }
    double secs = (double)(j->end_ns - j->start_ns) / 1e9;
    char previous[65];
    memcpy(previous, a->hex, sizeof(previous));
    memcpy(a->hex, j->hex, sizeof(a->hex));
    attest_snapshot_free(&a->snap);
    a->snap = j->snap;
    memset(&j->snap, 0, sizeof(j->snap));
    set_not_ready(a, ST_READY, NULL);
    a->retry_delay_ms = 0;
    publish_checkpoint(a);
    oms_done(a, j);
    loaded_done(a, j);
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "hashed");
    if (w) {
        dp_jw_str(w, "dir", a->target);
        if (a->engine_path)
            dp_jw_str(w, "model_path", a->engine_path);
        dp_jw_bool(w, "measured", a->target_measured);
        dp_jw_str(w, "checkpoint_sha256", a->hex);
        if (previous[0])
            dp_jw_str(w, "previous", previous);
        else
            dp_jw_null(w, "previous");
        dp_jw_uint(w, "files", a->snap.count);
        dp_jw_uint(w, "bytes", a->snap.total_bytes);
        dp_jw_double(w, "seconds", secs);
        dp_jw_double(w, "mb_per_s", secs > 0 ? (double)a->snap.total_bytes / 1e6 / secs : 0);
        dp_log_end(w);
    }
}

static void check_done(agent_t *a, job_t *j)
{
    bool confirming = a->state == ST_MEASURING && a->confirm;
    if (a->state != ST_READY && !confirming)
        return; /* a hash finished or failed meanwhile: nothing to compare with */
    if (j->rc != 0) {
        const char *e = j->err.base ? j->err.base : strerror(-j->rc);
        a->confirm = false;
        set_not_ready(a, ST_FAILED, e);
        schedule_retry(a, j->rc);
        log_kv(DP_LOG_ERROR, "model_dir_unreadable", "dir", a->target, "error", e);
        return;
    }
    dp_buf_t why = {0};
    if (attest_snapshot_differs(&a->snap, &j->snap, &why) ||
        (a->oms_bundle && oms_watch_differs(&a->oms_watch, &j->oms_watch, &why))) {
        /* Stop vouching for the old hash now: it no longer describes the files on disk. */
        dp_buf_t msg = {0};
        dp_buf_printf(&msg, "model %s changed (%s); re-hashing", j->file ? "file" : "directory",
                      why.base);
        a->confirm = false;
        set_not_ready(a, ST_HASHING, msg.base);
        log_kv(DP_LOG_WARN, "model_changed", "dir", a->target, "change", why.base);
        dp_buf_free(&msg);
        dp_buf_free(&why);
        start_job(a, true);
        return;
    }
    dp_buf_free(&why);
    loaded_done(a, j);
    if (confirming) {
        /* A new engine process loaded the same, unchanged files: the hash still describes them. */
        a->confirm = false;
        set_not_ready(a, ST_READY, NULL);
    }
}

/* Start the work the state asks for, when none is in flight. */
static void kick(agent_t *a)
{
    if (a->job || a->stopping || a->target == NULL)
        return;
    if (a->state == ST_HASHING)
        start_job(a, true);
    else if (a->state == ST_MEASURING && a->confirm)
        start_job(a, false);
}

static void stop_when_idle(agent_t *a);

static void job_after(uv_work_t *w, int status)
{
    job_t *j = dp_container_of(w, job_t, work);
    agent_t *a = j->a;
    if (j->abandoned) {
        a->abandoned--;
        log_kv(DP_LOG_WARN, "hash_abandoned_ended", "dir", j->path, NULL, NULL);
        job_free(j);
        stop_when_idle(a);
        return;
    }
    a->job = NULL;
    a->job_cancelled_ms = 0;
    if (!a->stopping && status == 0 && j->gen == a->target_gen) {
        if (j->full)
            hash_done(a, j);
        else
            check_done(a, j);
    }
    job_free(j);
    if (!a->stopping)
        kick(a); /* the target changed while this one ran: its work now */
    else
        stop_when_idle(a);
}

static void start_job(agent_t *a, bool full)
{
    if (a->job || a->stopping || a->target == NULL)
        return;
    job_t *j = dp_xcalloc(1, sizeof(*j));
    j->a = a;
    j->full = full;
    j->gen = a->target_gen;
    j->path = dp_xstrdup(a->target);
    j->oms_bundle = a->oms_bundle;
    j->oms_trust = &a->oms_trust;
    j->pid = a->target_measured ? a->eng.pid : 0;
    j->pid_start = a->eng.start;
    j->owner_uid = a->target_measured ? a->eng.sock_uid : -1;
    j->hidden = a->eng.hidden;
    j->measured = a->target_measured;
    if (full) {
        if (a->state == ST_FAILED) {
            /* Keep the failure visible while retrying: it is what the operator must fix. */
            dp_buf_t msg = {0};
            dp_buf_printf(&msg, "retrying after: %s", a->why_not_ready);
            set_not_ready(a, ST_HASHING, msg.base);
            dp_buf_free(&msg);
        } else if (a->state != ST_HASHING) {
            set_not_ready(a, ST_HASHING, "hashing the model directory");
        }
        log_kv(DP_LOG_INFO, "hashing", "dir", a->target, "model_path", a->engine_path);
    }
    a->job = j;
    int r = uv_queue_work(&a->loop, &j->work, job_run, job_after);
    if (r != 0) {
        a->job = NULL;
        job_free(j);
        set_not_ready(a, ST_FAILED, "cannot queue hashing work");
        schedule_retry(a, r);
    }
}

/* A report that waits for the look in flight is about an engine that is not there now. */
static void pending_drop(agent_t *a)
{
    a->pending.waiting = false;
    a->pending.new_engine = false;
    free(a->pending.model_path);
    a->pending.model_path = NULL;
}

/* The running job is about an older target: it stops at its next read and its result is
 * dropped (job_after compares generations). */
static void retarget(agent_t *a)
{
    a->target_gen++;
    dp_buf_reset(&a->loaded_why); /* it was about the files of the old target */
    if (a->job) {
        atomic_store(&a->job->cancel, 1);
        if (a->job_cancelled_ms == 0)
            a->job_cancelled_ms = dp_now_ms();
    }
}

/* ---- determinism (--determinism batch_invariant, docs/attestation.md §10)
 * -------------------------------- */

static void det_set(agent_t *a, int rc, const char *why)
{
    if (rc == 1)
        attest_report_set(&a->ident, ATTEST_F_DETERMINISM, "batch_invariant");
    else
        attest_report_set_unattested(&a->ident, ATTEST_F_DETERMINISM, why);
    if (rc != a->det_last) {
        a->det_last = rc;
        log_kv(rc == 1 ? DP_LOG_INFO : DP_LOG_WARN, "determinism", "batch_invariant",
               rc == 1   ? "true"
               : rc == 0 ? "false"
                         : "cannot_tell",
               "detail", why);
    }
}

/* SGLang and llama.cpp say it themselves (adapters.h): with --framework-url reading one of them,
 * their answer is the agent's, and /proc is not looked at. */
static bool det_by_adapter(const agent_t *a)
{
    const char *fw = a->ident.framework_name;
    return a->fw.url.host && a->fw.known == 1 && fw &&
           (strcmp(fw, "sglang") == 0 || strcmp(fw, "llamacpp") == 0);
}

static void det_from_adapter(agent_t *a, const attest_report_t *r)
{
    if (a->det.proc == NULL || !det_by_adapter(a))
        return;
    det_set(a, r->determinism ? 1 : 0,
            r->determinism ? "batch_invariant" : r->unattested_note[ATTEST_F_DETERMINISM]);
}

static void det_refresh(agent_t *a)
{
    if (a->det.proc == NULL || det_by_adapter(a))
        return;
    if (a->fw.url.host && a->fw.known == -1) {
        attest_report_set_unattested(&a->ident, ATTEST_F_DETERMINISM, "framework not read yet");
        return;
    }
    int rc = attest_vllm_batch_invariant(&a->det, &a->det_why);
    det_set(a, rc, a->det_why.base);
}

static void eng_check(agent_t *a);

static void on_watch(uv_timer_t *t)
{
    agent_t *a = t->data;
    uint64_t now = dp_now_ms();
    det_refresh(a);
    eng_check(a);
    if (a->job && a->job_cancelled_ms && now - a->job_cancelled_ms >= LOOK_STALLED_MS &&
        a->abandoned < MAX_ABANDONED) {
        /* Told to stop long ago, it waits on storage that does not answer: the model now
         * measured must not wait with it. */
        job_t *j = a->job;
        j->abandoned = true;
        a->abandoned++;
        a->job = NULL;
        a->job_cancelled_ms = 0;
        log_kv(DP_LOG_WARN, "hash_abandoned", "dir", j->path, "detail",
               "a hash of a model no longer measured has not stopped: its storage does not "
               "answer; it is left to end by itself");
        kick(a);
    }
    if (a->job) {
        /* Workers must not log: report their progress from here, now and then. */
        if (a->job->full && now - a->last_progress_log_ms >= PROGRESS_LOG_MS) {
            a->last_progress_log_ms = now;
            dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "hashing_progress");
            if (w) {
                dp_jw_uint(w, "bytes_done", atomic_load(&a->job->bytes_done));
                dp_jw_uint(w, "bytes_total", atomic_load(&a->job->bytes_total));
                dp_log_end(w);
            }
        }
        return;
    }
    if (a->state == ST_READY)
        start_job(a, false);
    else if (a->state == ST_FAILED && now >= a->retry_at_ms)
        start_job(a, true);
}

/* ---- measuring the engine (docs/attestation.md §4, "What the agent measures") ------------- */

static void fw_refresh(agent_t *a);

/* The listening socket of --framework-url's port, as the agent's network namespace shows it:
 * its inode, 0 when nothing listens, negative when /proc/net cannot be read; *uid (may be NULL)
 * the uid owning it. */
static int64_t eng_listener(const agent_t *a, uint32_t *uid)
{
    return attest_proc_listener("/proc", (const struct sockaddr *)&a->eng.addr, uid);
}

/* Has the engine become another process since it was measured? One read of /proc/net/tcp,
 * made before every answer and every watch tick, so that a restarted engine is measured again
 * at once instead of at the next framework refresh. */
static void eng_check(agent_t *a)
{
    if (a->fw.up == NULL || !a->eng.local || a->eng.sock_ino == 0)
        return; /* never seen listening (another host, another network namespace) */
    int64_t ino = eng_listener(a, NULL);
    if (ino < 0 || (uint64_t)ino == a->eng.sock_ino)
        return;
    if (ino == 0) {
        /* Nothing listens on the port: a connection is refused, as the next read will find. */
        if (a->fw.unreachable.len == 0) {
            dp_buf_printf(&a->fw.unreachable, "framework at http://%s%s: connection refused",
                          a->fw.url.hostport, a->fw.url.path);
            log_kv(DP_LOG_WARN, "engine_gone", "url", a->fw.url.hostport, "detail",
                   "its listening socket is closed");
        }
    } else {
        /* A look in flight, or a report waiting for one, is about the process before. */
        a->report_gen++;
        pending_drop(a);
    }
    if (ino > 0 && (a->state != ST_MEASURING || a->confirm)) {
        dp_buf_t msg = {0};
        dp_buf_printf(&msg,
                      "the engine at http://%s is another process now (its listening socket "
                      "changed); measuring it again",
                      a->fw.url.hostport);
        retarget(a); /* whatever ran was about the process measured before */
        a->confirm = false;
        set_not_ready(a, ST_MEASURING, msg.base);
        log_kv(DP_LOG_WARN, "engine_changed", "url", a->fw.url.hostport, "detail", msg.base);
        dp_buf_free(&msg);
    }
    /* A new process is read now (a read already under way started before the change and is
     * read again when it ends); a port nobody listens on waits for the retry schedule. */
    if (ino > 0 && !a->fw.running)
        fw_refresh(a);
}

/* After a read: which process answered it. false: the listener changed while it ran (the
 * answer may be the old process's): read again. *changed: another process than measured. */
static bool eng_identify(agent_t *a, bool *changed)
{
    eng_t *e = &a->eng;
    *changed = false;
    uint32_t uid = 0;
    int64_t ino = eng_listener(a, &uid);
    if (e->read_ino >= 0 && ino >= 0 && ino != e->read_ino)
        return false;
    pid_t pid = e->pid;
    bool mixed = false, new_sock = false;
    if (!e->local)
        ino = -1; /* another host's port: a local listener on it is not the engine */
    if (ino > 0 && (uint64_t)ino != e->sock_ino) {
        new_sock = true;
        *changed = e->sock_ino != 0;
        e->sock_ino = (uint64_t)ino;
        e->sock_uid = uid;
        pid = e->fixed ? e->fixed
                       : attest_proc_socket_owner("/proc", (uint64_t)ino, getpid(), &mixed);
    } else if (ino > 0 && !e->fixed &&
               (pid == 0 || attest_proc_start_time("/proc", pid) != e->start)) {
        /* The same socket, its holder not seen or gone (a parent that bound it and exited,
         * leaving it to a child; a holder that hid it a moment): looked for again, never a
         * process given the old pid since. */
        pid = attest_proc_socket_owner("/proc", (uint64_t)ino, getpid(), &mixed);
    } else if (ino <= 0 && e->fixed) {
        pid = e->fixed;
    }
    if (e->fixed) {
        /* --engine-pid: that process while it lives, never one the kernel gave its pid since. */
        unsigned long long st = attest_proc_start_time("/proc", e->fixed);
        if (e->fixed_start == 0)
            e->fixed_start = st;
        if (st == 0 || st != e->fixed_start)
            pid = 0;
    }
    unsigned long long start = pid > 0 ? attest_proc_start_time("/proc", pid) : 0;
    bool hidden = a->sees_all && !e->fixed && ino > 0 && pid == 0 && !mixed;
    if (pid != e->pid || start != e->start || (new_sock && pid == 0) || hidden != e->hidden) {
        *changed = *changed || (e->pid != 0 && (pid != e->pid || start != e->start));
        e->pid = pid;
        e->start = start;
        e->hidden = hidden;
        dp_jw_t *w = dp_log_begin(pid > 0 ? DP_LOG_INFO : DP_LOG_WARN, "engine_process");
        if (w) {
            dp_jw_str(w, "url", a->fw.url.hostport);
            if (pid > 0) {
                dp_jw_int(w, "pid", pid);
                dp_jw_uint(w, "start_time", start);
            } else {
                dp_jw_null(w, "pid");
                dp_jw_str(w, "detail",
                          e->fixed ? "--engine-pid is gone or another process now"
                          : mixed  ? "the listening socket is held by processes that read "
                                     "with different rights (a root parent and its workers, "
                                     "socket activation): none is taken for the engine"
                          : hidden ? "no process holds the listening socket, though the agent "
                                     "sees every process: its holder keeps it out of its open "
                                     "files, and nothing the engine names is read"
                                   : "the process listening on the port is not visible (another "
                                     "PID namespace, or not the agent's uid)");
            }
            if (e->sock_ino)
                dp_jw_uint(w, "socket_inode", e->sock_ino);
            dp_log_end(w);
        }
    }
    return true;
}

static bool streq_null(const char *x, const char *y)
{
    return x == NULL ? y == NULL : y != NULL && strcmp(x, y) == 0;
}

/* ---- looking for the engine's model (off the loop) --------------------------------------- */

/* Where the model the engine reports is, from here: a stat, a 4-byte read and a comparison
 * with --model-dir, as the engine's user in its root. Looked at on the thread pool, not the
 * loop: a model on storage that does not answer (a stalled NFS server, a FUSE daemon that
 * hangs) blocks whoever looks, and the agent must go on answering that it cannot vouch for it.
 * One look is in flight at a time; a report read meanwhile waits for it (agent.pending), unless
 * the look has stalled and the report names another model or process: the stalled look is then
 * left to end by itself (at most MAX_ABANDONED of them) and the new one looked for. */
typedef struct look_s {
    uv_work_t work;
    agent_t *a;
    pid_t pid; /* the engine's process, as eng_identify saw it when the look began */
    unsigned long long start;
    int64_t owner_uid;
    bool hidden;      /* eng_t.hidden: nothing is looked at */
    char *model_path; /* the engine's report (NULL: it names none) */
    bool always_local;
    bool new_engine;
    bool abandoned; /* stalled, and left to end by itself: its result is dropped */
    unsigned gen;   /* agent.report_gen when it began */
    char *dir;      /* --model-dir, NULL without */
    uint64_t started_ms;
    attest_locate_t loc; /* the results */
    attest_located_t l;
    bool dir_ok;
    dp_buf_t why;
} look_t;

static void look_run(uv_work_t *w)
{
    look_t *k = dp_container_of(w, look_t, work);
    /* --model-dir (the operator's path, looked at as the agent) must be the loaded model or a
     * folder above it, in the engine's root: anything else names files it is not serving. */
    struct stat ds;
    k->dir_ok = k->dir == NULL || stat(k->dir, &ds) == 0;
    k->loc = ATTEST_LOC_NOT_VISIBLE;
    /* Looked for as the engine's user, as it is read (job_run): what the engine cannot see is
     * not there for it, and its answers say nothing of folders it cannot enter. */
    attest_fs_ident_t prev;
    if (k->hidden) {
        engine_hidden(&k->why);
        return;
    }
    if (attest_as_process_enter("/proc", k->pid, k->start, k->owner_uid, &prev, &k->why) != 0)
        return;
    k->loc = attest_engine_locate("/proc", k->pid, k->model_path, k->always_local, &k->l, &k->why);
    if (k->loc == ATTEST_LOC_FOUND && !attest_model_shaped(k->l.path, k->model_path, &k->why))
        k->loc = ATTEST_LOC_NOT_VISIBLE;
    if (k->loc == ATTEST_LOC_FOUND && k->dir && k->dir_ok)
        k->dir_ok = attest_located_under(&k->l, &ds);
    attest_fs_ident_leave(&prev);
}

static void look_free(look_t *k)
{
    attest_located_free(&k->l);
    dp_buf_free(&k->why);
    free(k->model_path);
    free(k->dir);
    free(k);
}

static void look_after(uv_work_t *w, int status);
static void on_look_stalled(uv_timer_t *t);

static void look_start(agent_t *a, const char *model_path, bool always_local, bool new_engine)
{
    look_t *k = dp_xcalloc(1, sizeof(*k));
    k->a = a;
    k->pid = a->eng.pid;
    k->start = a->eng.start;
    k->owner_uid = a->eng.sock_uid;
    k->hidden = a->eng.hidden;
    k->model_path = model_path ? dp_xstrdup(model_path) : NULL;
    k->always_local = always_local;
    k->new_engine = new_engine;
    k->dir = a->dir ? dp_xstrdup(a->dir) : NULL;
    k->gen = a->report_gen;
    k->started_ms = uv_now(&a->loop);
    int r = uv_queue_work(&a->loop, &k->work, look_run, look_after);
    if (r != 0) {
        /* Nothing looked at, nothing vouched for: the next read looks again. */
        dp_buf_reset(&a->ckpt_why);
        dp_buf_printf(&a->ckpt_why, "cannot queue the look for the engine's model: %s",
                      uv_strerror(r));
        publish_checkpoint(a);
        look_free(k);
        return;
    }
    a->look = k;
    uv_timer_start(&a->look_timer, on_look_stalled, LOOK_STALLED_MS, 0);
}

/* The look is taking longer than a look can: the storage under the model does not answer.
 * Stop vouching for the checkpoint now, with the reason, and answer on; the look's own end
 * (if it comes) measures as usual. */
static void on_look_stalled(uv_timer_t *t)
{
    agent_t *a = t->data;
    look_t *k = a->look;
    if (k == NULL)
        return;
    a->look_stalled = true;
    dp_buf_reset(&a->ckpt_why);
    dp_buf_printf(&a->ckpt_why, "looking for the model the engine reports (%.200s)",
                  k->model_path ? k->model_path : "none named");
    if (k->dir)
        dp_buf_printf(&a->ckpt_why, " and at --model-dir (%.200s)", k->dir);
    dp_buf_printf(&a->ckpt_why,
                  " has not ended in %u s: the storage under it does not answer (a stalled NFS "
                  "or FUSE mount?)",
                  LOOK_STALLED_MS / 1000);
    /* The engine was read: say what is known of it; unless another process took the port
     * since, whose first read is still to come. */
    if (a->state == ST_MEASURING && !a->confirm && k->gen == a->report_gen)
        set_not_ready(a, ST_READY, NULL);
    publish_checkpoint(a);
    log_kv(DP_LOG_ERROR, "model_look_stalled", "model_path", k->model_path, "detail",
           a->ckpt_why.base);
}

static void measure_located(agent_t *a, look_t *k);

static void look_ended_late(agent_t *a, const look_t *k)
{
    dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "model_look_ended");
    if (w) {
        dp_jw_str(w, "model_path", k->model_path);
        dp_jw_uint(w, "after_ms", uv_now(&a->loop) - k->started_ms);
        dp_jw_bool(w, "abandoned", k->abandoned);
        dp_log_end(w);
    }
}

static void look_after(uv_work_t *w, int status)
{
    look_t *k = dp_container_of(w, look_t, work);
    agent_t *a = k->a;
    if (k->abandoned) {
        a->abandoned--;
        look_ended_late(a, k);
        look_free(k);
        stop_when_idle(a);
        return;
    }
    a->look = NULL;
    uv_timer_stop(&a->look_timer);
    if (a->look_stalled) {
        a->look_stalled = false;
        look_ended_late(a, k);
    }
    if (a->stopping || status != 0) {
        look_free(k);
        stop_when_idle(a);
        return;
    }
    if (a->pending.waiting) {
        /* A newer report was read while this look ran: look for that one instead, without
         * losing that a new engine process was seen. */
        bool new_engine = a->pending.new_engine || k->new_engine;
        bool always_local = a->pending.always_local;
        char *model_path = a->pending.model_path;
        a->pending.model_path = NULL;
        pending_drop(a);
        look_free(k);
        look_start(a, model_path, always_local, new_engine);
        free(model_path);
        return;
    }
    if (k->gen != a->report_gen) {
        /* Since it began, a read did not recognise the engine, or another process took its
         * port: what it found is about an engine that is not there now. */
        look_free(k);
        return;
    }
    measure_located(a, k);
    look_free(k);
}

/* Is look k about this report of the engine as it is now? */
static bool look_is_for(const look_t *k, const agent_t *a, const char *model_path)
{
    return streq_null(k->model_path, model_path) && k->pid == a->eng.pid &&
           k->start == a->eng.start;
}

/* Whether pid (started at start) is another process than the one the last look that stood
 * was for; false before any look. */
static bool looked_at_another(const agent_t *a, pid_t pid, unsigned long long start)
{
    return a->looked.valid && (pid != a->looked.pid || start != a->looked.start);
}

/* A read of the engine recognised it: sign what it reports instead of the flags, then find the
 * model it loaded (look_run) and hash that (off the loop) when it is another one than hashed. */
static void measure(agent_t *a, const attest_report_t *r, bool new_engine)
{
    attest_engine_merge(r, a->flag_quant, a->flag_dtype, &a->ident);
    if (a->dir_contra) /* until the look below says otherwise */
        attest_report_add_contradiction(&a->ident, "model_dir", a->dir, a->dir_contra);
    bool always_local = strcmp(r->source, "llamacpp") == 0; /* -m names a GGUF file */
    /* Another model or process than the last look measured: the checkpoint at hand is not this
     * one's until a look says it is (a reason already there withdraws it too). */
    if (a->ckpt_why.len == 0 &&
        (new_engine || !a->looked.valid || !streq_null(r->model_path, a->looked.model_path) ||
         looked_at_another(a, a->eng.pid, a->eng.start))) {
        dp_buf_printf(&a->ckpt_why, "looking for the model the engine now reports (%.200s)",
                      r->model_path ? r->model_path : "none named");
        publish_checkpoint(a);
    }
    look_t *k = a->look;
    if (k && a->look_stalled && !look_is_for(k, a, r->model_path)) {
        if (a->abandoned < MAX_ABANDONED) {
            /* The stalled look is for another model or process: this one must not wait. */
            k->abandoned = true;
            a->abandoned++;
            a->look = NULL;
            a->look_stalled = false;
            uv_timer_stop(&a->look_timer);
            k = NULL;
        } else {
            dp_buf_reset(&a->ckpt_why);
            dp_buf_printf(&a->ckpt_why,
                          "looking for the model the engine now reports (%.200s) waits for "
                          "looks at models on storage that does not answer (%u left running, "
                          "the most there may be)",
                          r->model_path ? r->model_path : "none named", a->abandoned + 1);
            publish_checkpoint(a);
        }
    }
    if (k == NULL) {
        new_engine = new_engine || a->pending.new_engine; /* a report waiting is older */
        pending_drop(a);
        look_start(a, r->model_path, always_local, new_engine);
        return;
    }
    free(a->pending.model_path);
    a->pending.model_path = r->model_path ? dp_xstrdup(r->model_path) : NULL;
    a->pending.always_local = always_local;
    a->pending.new_engine = a->pending.new_engine || new_engine;
    a->pending.waiting = true;
}

/* --model-dir contradicts the model the engine reports (engine_path), or (NULL) does not. Kept
 * across reads, whose merge lists the flags' contradictions afresh, until a look says
 * otherwise. */
static void set_dir_contradiction(agent_t *a, const char *engine_path)
{
    attest_report_drop_contradiction(&a->ident, "model_dir");
    free(a->dir_contra);
    a->dir_contra = engine_path ? dp_xstrdup(engine_path) : NULL;
    if (a->dir_contra)
        attest_report_add_contradiction(&a->ident, "model_dir", a->dir, a->dir_contra);
}

/* What the look found decides what is hashed and vouched for. */
static void measure_located(agent_t *a, look_t *k)
{
    const char *model_path = k->model_path;
    /* Another process than the last look's is a new engine, however the reads went between. */
    bool new_engine = k->new_engine || looked_at_another(a, k->pid, k->start);
    attest_locate_t loc = k->loc;
    dp_buf_t why = k->why;
    k->why = (dp_buf_t){0};
    char *target = NULL;
    bool measured = false;
    a->looked.valid = true;
    free(a->looked.model_path);
    a->looked.model_path = model_path ? dp_xstrdup(model_path) : NULL;
    a->looked.pid = k->pid;
    a->looked.start = k->start;
    set_dir_contradiction(a, loc == ATTEST_LOC_FOUND && !k->dir_ok ? model_path : NULL);
    if (loc == ATTEST_LOC_FOUND) {
        target = k->l.path;
        k->l.path = NULL;
        measured = true;
    } else if (a->dir) {
        target = dp_xstrdup(a->dir); /* a Hub id, or a path out of sight: the flag's folder */
    }
    if (loc == ATTEST_LOC_NOT_LOCAL && target == NULL) {
        dp_buf_reset(&why);
        dp_buf_printf(&why,
                      "the engine loaded %.200s, not a local path: give the agent --model-dir "
                      "for a content hash",
                      model_path ? model_path : "a model it does not name");
    }
    bool changed = !streq_null(target, a->target) || measured != a->target_measured;
    free(a->engine_path);
    a->engine_path = measured && model_path ? dp_xstrdup(model_path) : NULL;
    if (target == NULL) {
        /* The engine's model cannot be reached, and there is no --model-dir to repeat:
         * nothing is hashed, and the checkpoint is not vouched for, with the reason. */
        if (changed || a->state != ST_READY) {
            retarget(a);
            free(a->target);
            a->target = NULL;
            a->target_measured = false;
            a->hex[0] = '\0';
            attest_snapshot_free(&a->snap);
            a->confirm = false;
            set_not_ready(a, ST_READY, NULL);
            log_kv(DP_LOG_WARN, "checkpoint_unattested", "model_path", model_path, "detail",
                   why.base);
        }
        dp_buf_reset(&a->ckpt_why);
        dp_buf_appends(&a->ckpt_why, why.base);
        publish_checkpoint(a);
        dp_buf_free(&why);
        return;
    }
    dp_buf_free(&why);
    dp_buf_reset(&a->ckpt_why);
    if (changed) {
        /* Another model than the one hashed: vouch for nothing until it is hashed. */
        retarget(a);
        free(a->target);
        a->target = target;
        a->target_measured = measured;
        a->hex[0] = '\0';
        attest_snapshot_free(&a->snap);
        publish_checkpoint(a);
        a->confirm = false;
        dp_buf_t msg = {0};
        if (measured)
            dp_buf_printf(&msg, "hashing %.200s, the model the engine loaded",
                          model_path ? model_path : target);
        else
            dp_buf_appends(&msg, "hashing the model directory");
        set_not_ready(a, ST_HASHING, msg.base);
        dp_buf_free(&msg);
        kick(a);
        return;
    }
    free(target);
    publish_checkpoint(a); /* a note from an earlier read no longer applies */
    if (new_engine && a->hex[0]) {
        /* A new process loaded the same path: a listing shows whether the files are the ones
         * hashed (cheap), instead of reading gigabytes again. */
        retarget(a);
        a->confirm = true;
        set_not_ready(a, ST_MEASURING, "checking the model files of the new engine process");
        kick(a);
    } else if (a->state == ST_MEASURING && !a->confirm) {
        if (a->hex[0]) {
            set_not_ready(a, ST_READY, NULL);
        } else {
            set_not_ready(a, ST_HASHING, "hashing the model directory");
            kick(a);
        }
    }
}

/* ---- framework name and version from --framework-url ------------------------------------ */

static const cfg_attest_source_t probe_order[] = {CFG_ATTEST_TGI, CFG_ATTEST_SGLANG,
                                                  CFG_ATTEST_LLAMACPP, CFG_ATTEST_VLLM};

static const attest_adapter_t *fw_adapter(const fw_t *f)
{
    if (f->only)
        return f->adapter == 0 ? f->only : NULL;
    return f->adapter < DP_ARRAY_SIZE(probe_order) ? attest_adapter_for(probe_order[f->adapter])
                                                   : NULL;
}

static void fw_check(agent_t *a);
static void on_fw_timer(uv_timer_t *t);

/* The next refresh: the regular interval after a success; after a failure soon, with a
 * doubling, bounded delay, so an engine restart is noticed within about a second while a
 * framework that stays down costs a few requests a second at most. */
static void fw_schedule(agent_t *a, bool ok)
{
    fw_t *f = &a->fw;
    uint32_t cap = a->fw_refresh_ms < FW_RETRY_MAX_MS ? a->fw_refresh_ms : FW_RETRY_MAX_MS;
    uint32_t next = a->fw_refresh_ms;
    if (ok) {
        f->retry_ms = 0;
    } else {
        next = f->retry_ms ? f->retry_ms : FW_RETRY_MIN_MS;
        if (next > cap)
            next = cap;
        f->retry_ms = next * 2 > cap ? cap : next * 2;
    }
    if (!a->stopping)
        uv_timer_start(&a->fw_timer, on_fw_timer, next, 0);
}

static void fw_set(agent_t *a, const char *name, const char *version, const char *why)
{
    const char *old_n = a->ident.framework_name, *old_v = a->ident.framework_version;
    bool same = (name == NULL ? old_n == NULL : old_n && strcmp(name, old_n) == 0) &&
                (version == NULL ? old_v == NULL : old_v && strcmp(version, old_v) == 0);
    if (name)
        attest_report_set(&a->ident, ATTEST_F_FRAMEWORK_NAME, name);
    else
        attest_report_set_unattested(&a->ident, ATTEST_F_FRAMEWORK_NAME, why);
    if (version)
        attest_report_set(&a->ident, ATTEST_F_FRAMEWORK_VERSION, version);
    else
        attest_report_set_unattested(&a->ident, ATTEST_F_FRAMEWORK_VERSION, why);
    if (same && a->fw.known == (name != NULL))
        return; /* log transitions only: a refresh every few seconds must not flood */
    a->fw.known = name != NULL;
    if (name)
        log_kv(DP_LOG_INFO, "framework", "name", name, "version", version);
    else
        log_kv(DP_LOG_WARN, "framework_unknown", "url", a->fw.url.hostport, "error", why);
}

/* One adapter's check answered. */
static void fw_checked(attest_outcome_t *out, void *data)
{
    agent_t *a = data;
    fw_t *f = &a->fw;
    f->probe = NULL;
    if (out->verdict == ATTEST_V_UNREACHABLE && out->status == 0) {
        /* Nothing answers (refused, timed out, reset): every other adapter would fail alike. */
        f->running = false;
        dp_buf_reset(&f->unreachable);
        dp_buf_printf(&f->unreachable, "framework at http://%s%s: %s", f->url.hostport, f->url.path,
                      out->detail);
        fw_set(a, NULL, NULL, f->unreachable.base);
        fw_schedule(a, false);
        return;
    }
    const attest_report_t *r = &out->report;
    if (out->verdict == ATTEST_V_REPORTED && r->framework_name && r->framework_version) {
        f->running = false;
        bool new_engine = false;
        if (!eng_identify(a, &new_engine)) {
            /* Another process took the port while this read ran: it may have read the old
             * one. Read the one there now. */
            fw_refresh(a);
            return;
        }
        dp_buf_reset(&f->unreachable);
        fw_set(a, r->framework_name, r->framework_version, NULL);
        det_from_adapter(a, r);
        if (r->engine_fingerprint)
            attest_engine_fingerprint_set(&a->ident, r->engine_fingerprint);
        else
            attest_report_set_unattested(&a->ident, ATTEST_F_ENGINE_FINGERPRINT,
                                         r->unattested_note[ATTEST_F_ENGINE_FINGERPRINT]);
        measure(a, r, new_engine);
        fw_schedule(a, true);
        return;
    }
    /* Kept for the "not recognised" message: the operator needs to know what failed. */
    dp_buf_reset(&f->last_error);
    dp_buf_printf(&f->last_error, "%s: %s", fw_adapter(f)->name,
                  attest_outcome_reason(out, "no framework name and version"));
    log_kv(DP_LOG_DEBUG, "framework_check_failed", "url", f->url.hostport, "error",
           f->last_error.base);
    f->adapter++;
    if (fw_adapter(f)) {
        fw_check(a);
        return;
    }
    f->running = false;
    attest_report_set_unattested(&a->ident, ATTEST_F_ENGINE_FINGERPRINT,
                                 "the co-located framework was not recognised");
    dp_buf_reset(&f->unreachable); /* it answered: reachable, just not recognised */
    dp_buf_t msg = {0};
    dp_buf_printf(&msg, "framework at %s not recognised (last: %s)", f->url.hostport,
                  f->last_error.base);
    fw_set(a, NULL, NULL, msg.base);
    dp_buf_free(&msg);
    /* Nothing to measure: the flags are all there is (repeated). Before any read recognised
     * the engine, --model-dir is hashed as declared; after one did, the model hashed then is
     * kept (the files are still watched) but not vouched for: what this engine runs now is
     * unknown. */
    attest_report_t none = {0};
    bool new_engine = false;
    a->report_gen++;
    pending_drop(a); /* a report recognised before this one is not what runs now */
    eng_identify(a, &new_engine);
    if (a->target_measured) {
        attest_engine_merge(&none, a->flag_quant, a->flag_dtype, &a->ident);
        dp_buf_reset(&a->ckpt_why);
        dp_buf_printf(&a->ckpt_why, "the engine at %s was not recognised", f->url.hostport);
        publish_checkpoint(a);
    } else {
        measure(a, &none, new_engine);
    }
    fw_schedule(a, false);
}

static const char fw_headers[] = "user-agent: detproxy-attest\r\n";

static void fw_check(agent_t *a)
{
    fw_t *f = &a->fw;
    probe_opts_t o = {.up = f->up,
                      .source = fw_adapter(f)->source,
                      .hostport = f->url.hostport,
                      .base = f->url.path,
                      .bearer = f->api_key,
                      .extra_headers = fw_headers,
                      .model = a->ident.model,
                      /* The agent's requests to its engine are outside the proxy's admission
                       * slots: where the metadata names the fingerprint, send no completion. */
                      .metadata_fingerprint = true,
                      /* A read that does not end leaves the last one's identity signed: an
                       * engine that trickles its answer is unreachable instead. */
                      .deadline_ms = FW_READ_MS};
    f->probe = probe_start(&o, fw_checked, a);
}

static void fw_refresh(agent_t *a)
{
    fw_t *f = &a->fw;
    if (f->up == NULL || f->running || a->stopping)
        return;
    f->running = true;
    f->started_ms = uv_now(&a->loop);
    a->eng.read_ino = a->eng.local ? eng_listener(a, NULL) : -1;
    dp_buf_reset(&f->last_error);
    f->adapter = 0;
    fw_check(a);
}

static void on_fw_timer(uv_timer_t *t)
{
    fw_refresh(t->data);
}

/* ---- HTTP ------------------------------------------------------------------------------- */

static bool path_is(const net_req_t *req, const char *p)
{
    return req->path.len == strlen(p) && memcmp(req->path.base, p, req->path.len) == 0;
}

static const net_header_t no_store[] = {{DP_IOV("Cache-Control"), DP_IOV("no-store")}};

static void answer_attestation(agent_t *a, net_req_t *req)
{
    char nonce[ATTEST_NONCE_MAX + 1];
    dp_buf_t nb = {0};
    bool ok = net_req_query(req, "nonce", &nb) == 1 && attest_nonce_copy(nb.base, nb.len, nonce);
    dp_buf_free(&nb);
    if (!ok) {
        net_resp_error(req, 400, "invalid_request_error", "bad_nonce", "nonce", ATTEST_NONCE_RULE,
                       NULL, 0);
        return;
    }
    /* An engine that is another process than the one measured is measured again first. */
    eng_check(a);
    /* Each attestation also starts a fresh framework read (at most every FW_ON_DEMAND_MS), so
     * the proxy's next check sees an engine that died since the last one, instead of waiting
     * for --framework-refresh-ms. This answer carries the previous read. */
    if (a->fw.up && uv_now(&a->loop) - a->fw.started_ms >= FW_ON_DEMAND_MS)
        fw_refresh(a);
    if (a->fw.unreachable.len) {
        /* Vouching for a model with no engine serving it would be wrong; saying so is the
         * agent's job, not an identity mismatch for the proxy to guess at. */
        net_resp_error(req, 503, "server_error", "framework_unreachable", NULL,
                       a->fw.unreachable.base, no_store, DP_ARRAY_SIZE(no_store));
        return;
    }
    if (a->state != ST_READY) {
        dp_buf_t msg = {0};
        uint64_t secs = (dp_wall_ms() - a->state_since_ms) / 1000;
        dp_buf_printf(&msg, "%s (for %llus)", a->why_not_ready ? a->why_not_ready : "not ready",
                      (unsigned long long)secs);
        net_resp_error(req, 503, "server_error",
                       a->state == ST_HASHING     ? "hashing"
                       : a->state == ST_MEASURING ? "measuring"
                                                  : "hash_failed",
                       NULL, msg.base, no_store, DP_ARRAY_SIZE(no_store));
        dp_buf_free(&msg);
        return;
    }
    dp_buf_t env = {0}, err = {0};
    if (attest_envelope_for(a->key, &a->ident, nonce, 0, &env, &err) == 0)
        net_resp_send(req, 200, "application/json", env.base, env.len, no_store,
                      DP_ARRAY_SIZE(no_store));
    else
        net_resp_error(req, 500, "server_error", "signing_failed", NULL,
                       err.base ? err.base : "signing failed", NULL, 0);
    dp_buf_free(&env);
    dp_buf_free(&err);
}

static net_body_mode_t on_head(net_req_t *req)
{
    agent_t *a = net_server_data(req->server);
    bool get = dp_strieq(req->method_name.base, req->method_name.len, "GET") ||
               dp_strieq(req->method_name.base, req->method_name.len, "HEAD");
    if (path_is(req, "/attestation") || path_is(req, "/healthz")) {
        if (!get) {
            static const net_header_t allow[] = {{DP_IOV("Allow"), DP_IOV("GET, HEAD")}};
            net_resp_error(req, 405, "invalid_request_error", "method_not_allowed", NULL, "use GET",
                           allow, 1);
        } else if (path_is(req, "/healthz")) {
            net_resp_send(req, 200, "text/plain", "ok\n", 3, NULL, 0);
        } else {
            answer_attestation(a, req);
        }
    } else {
        net_resp_error(req, 404, "invalid_request_error", "not_found", NULL,
                       "not found: this agent serves GET /attestation?nonce=N and /healthz", NULL,
                       0);
    }
    return NET_BODY_BUFFER;
}

static void on_complete(net_req_t *req)
{
    (void)req; /* every request was answered from on_head */
}

static void on_abort(net_req_t *req)
{
    (void)req; /* nothing per request outlives on_head */
}

/* ---- lifecycle ---------------------------------------------------------------------------- */

static void handle_closed(uv_handle_t *h)
{
    agent_t *a = h->data;
    a->closes_pending--;
}

static void server_closed(void *data)
{
    agent_t *a = data;
    a->closes_pending--;
}

/* Stopping, with no work in flight left to wait for: the last handle goes. */
static void stop_when_idle(agent_t *a)
{
    if (a->stopping && a->job == NULL && a->look == NULL && a->abandoned == 0 &&
        !uv_is_closing((uv_handle_t *)&a->stop_timer))
        uv_close((uv_handle_t *)&a->stop_timer, handle_closed);
}

/* Work in flight outlasted STOP_GRACE_MS: a thread waits on storage that does not answer, and
 * would hold the loop (and libuv's thread pool at exit) for as long. The process ends without
 * it; the kernel ends the thread's wait. */
static void on_stop_grace(uv_timer_t *t)
{
    agent_t *a = t->data;
    dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "stopped");
    if (w) {
        dp_jw_str(w, "detail",
                  a->look ? "a look for the engine's model did not end: exiting without it"
                          : "a read of the model did not end: exiting without it");
        dp_log_end(w);
    }
    _exit(DP_EXIT_OK);
}

static void agent_stop(agent_t *a, const char *why)
{
    if (a->stopping)
        return;
    a->stopping = true;
    if (a->job)
        atomic_store(&a->job->cancel, 1); /* a running hash stops at its next read */
    log_kv(DP_LOG_INFO, "stopping", "reason", why, NULL, NULL);
    probe_cancel(a->fw.probe);
    a->fw.probe = NULL;
    if (a->fw.up) {
        net_upstream_free(a->fw.up);
        a->fw.up = NULL;
    }
    a->closes_pending++;
    net_server_close(a->srv, server_closed, a);
    uv_handle_t *hs[] = {(uv_handle_t *)&a->sigterm,  (uv_handle_t *)&a->sigint,
                         (uv_handle_t *)&a->sigpipe,  (uv_handle_t *)&a->watch,
                         (uv_handle_t *)&a->fw_timer, (uv_handle_t *)&a->look_timer};
    for (size_t i = 0; i < DP_ARRAY_SIZE(hs); i++) {
        a->closes_pending++;
        uv_close(hs[i], handle_closed);
    }
    a->closes_pending++; /* the stop timer, closed by stop_when_idle */
    if (a->job || a->look || a->abandoned) {
        uv_timer_start(&a->stop_timer, on_stop_grace, STOP_GRACE_MS, 0);
        /* Closing the signal handles gave SIGTERM and SIGINT their default action back: a
         * second one during the grace would kill the process instead of its exit. */
        signal(SIGTERM, SIG_IGN);
        signal(SIGINT, SIG_IGN);
    }
    stop_when_idle(a);
}

static void on_signal(uv_signal_t *h, int signum)
{
    if (signum == SIGPIPE)
        return;
    agent_stop(h->data, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* ---- options -------------------------------------------------------------------------------- */

typedef struct {
    const char *listen, *dir, *model, *quant, *dtype;
    const char *fw_name, *fw_version, *fw_url, *fw_key_file, *key_path;
    const char *tls_cert, *tls_key, *oms_bundle, *oms_pubkey;
    const char *oms_root, *oms_identity, *oms_issuer;
    dp_arg_list_t oms_ignore;
    const char *oms_ignore_store[256];
    const char *det_mode, *det_pid, *det_process, *engine_pid;
    uint64_t watch_ms, refresh_ms, conns_per_client;
    int log_level; /* -1: not given */
} serve_opts_t;

static int parse_log_level(void *dst, const char *v, char *why, size_t n)
{
    int *level = dst;
    *level = dp_log_level_parse(v);
    if (*level < 0)
        return dp_arg_fail(why, n, "expected debug, info, warn or error, got '%s'", v);
    return 0;
}

static const dp_arg_t serve_table[] = {
    {.name = "--listen",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, listen),
     .meta = "ADDR",
     .help = "host:port to listen on (numeric host, e.g. 0.0.0.0:9101;\n"
             "[v6]:port; port 0 picks a free one and logs it)",
     .flags = DP_ARG_REQUIRED},
    {.name = "--model-dir",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, dir),
     .meta = "DIR",
     .help = "the model directory (or file) the replica serves from; with\n"
             "--framework-url the model the engine reports is hashed instead,\n"
             "and DIR must be it or a folder above it"},
    {.name = "--model",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, model),
     .meta = "NAME",
     .help = "the served model name (what clients send as \"model\")",
     .flags = DP_ARG_REQUIRED},
    {.name = "--quantization",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, quant),
     .meta = "Q",
     .help = "reported as given, unless --framework-url's engine reports\n"
             "its own (then a differing flag is a contradiction);\n"
             "omitted = not reported (unattested)"},
    {.name = "--dtype",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, dtype),
     .meta = "D",
     .help = "the same for the dtype"},
    {.name = "--framework",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, fw_name),
     .meta = "NAME",
     .help = "vllm, tgi, sglang or llamacpp"},
    {.name = "--framework-version",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, fw_version),
     .meta = "V",
     .help = "the serving framework's version"},
    {.name = "--framework-url",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, fw_url),
     .meta = "URL",
     .help = "measure the co-located server: name, version, quantization,\n"
             "dtype and the model it loaded from its own metadata endpoints\n"
             "(re-read every refresh, and at once when another process\n"
             "listens there), and hash that model"},
    {.name = "--engine-pid",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, engine_pid),
     .meta = "PID",
     .help = "the --framework-url server's pid (default: the process\n"
             "listening on its port, found through /proc)"},
    {.name = "--framework-api-key-file",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, fw_key_file),
     .meta = "F",
     .help = "bearer token for --framework-url (e.g. vLLM --api-key)"},
    {.name = "--key",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, key_path),
     .meta = "KEY.pem",
     .help = "signing key; without it envelopes are unsigned (a proxy\n"
             "with require_signature rejects them)"},
    {.name = "--watch-interval-ms",
     .kind = DP_ARG_UINT,
     .off = offsetof(serve_opts_t, watch_ms),
     .meta = "N",
     .help = "how often to look for changes (default " DP_ARGS_STR(DEFAULT_WATCH_MS) ")",
     .min = 10,
     .max = 86400000},
    {.name = "--framework-refresh-ms",
     .kind = DP_ARG_UINT,
     .off = offsetof(serve_opts_t, refresh_ms),
     .meta = "N",
     .help = "how often to re-read --framework-url (default " DP_ARGS_STR(
         DEFAULT_FW_REFRESH_MS) ";\n"
                                "after a failure: 100 ms, doubling up to 1 s)",
     .min = 10,
     .max = 86400000},
    {.name = "--max-connections-per-client",
     .kind = DP_ARG_UINT,
     .off = offsetof(serve_opts_t, conns_per_client),
     .meta = "N",
     .help = "open connections one client address (IPv6: /64) may hold;\n"
             "beyond it its new ones are closed at once (default " DP_ARGS_STR(
                 DEFAULT_CONNS_PER_CLIENT) ")",
     .min = 1,
     .max = 1000000},
    {.name = "--log-level",
     .kind = DP_ARG_CALL,
     .off = offsetof(serve_opts_t, log_level),
     .meta = "L",
     .help = "debug, info, warn, error (default info)",
     .cb = parse_log_level},
    {.name = "--oms-bundle",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, oms_bundle),
     .meta = "FILE",
     .help = "the publisher's OpenSSF Model Signing bundle: verified\n"
             "against the directory at start and on every re-hash; the\n"
             "attestation then carries oms {verified, signer, root_digest}\n"
             "(docs/attestation.md §9)"},
    {.name = "--oms-pubkey",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, oms_pubkey),
     .meta = "PEM",
     .help = "the publisher's EC public key the bundle must verify with"},
    {.name = "--oms-trusted-root",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, oms_root),
     .meta = "FILE",
     .help = "for a keyless (Sigstore) bundle instead: the trusted_root.json\n"
             "its certificate and Rekor entry must verify against, with\n"
             "--oms-identity and --oms-issuer"},
    {.name = "--oms-identity",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, oms_identity),
     .meta = "ID",
     .help = "the identity (email, URI) the keyless certificate must name"},
    {.name = "--oms-issuer",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, oms_issuer),
     .meta = "URL",
     .help = "the OIDC issuer the keyless certificate must name"},
    {.name = "--oms-ignore-path",
     .kind = DP_ARG_LIST,
     .off = offsetof(serve_opts_t, oms_ignore),
     .meta = "P",
     .help = "leave P (inside --model-dir; absolute, or relative to the\n"
             "working directory) out of the OMS verification (repeatable)"},
    {.name = "--determinism",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, det_mode),
     .meta = "batch_invariant",
     .help = "attest determinism.mode (docs/attestation.md §10) when the\n"
             "co-located vLLM runs with VLLM_BATCH_INVARIANT=1, read from\n"
             "its /proc/PID/environ (needs a shared process namespace and\n"
             "the server's uid or CAP_SYS_PTRACE; otherwise it says it\n"
             "cannot tell, and the replica is not admitted as\n"
             "batch_invariant); an SGLang or llama.cpp at --framework-url\n"
             "answers itself"},
    {.name = "--determinism-pid",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, det_pid),
     .meta = "PID",
     .help = "the vLLM server's pid (default: find it by name)"},
    {.name = "--determinism-process",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, det_process),
     .meta = "NAME",
     .help = "the command to look for in /proc (default vllm: \"vllm ...\",\n"
             "\"python3 .../vllm ...\" or \"python -m vllm....\"); every match\n"
             "must have the variable on"},
    {.name = "--tls-cert",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, tls_cert),
     .meta = "F",
     .help = "serve over TLS: the PEM certificate chain (with --tls-key)"},
    {.name = "--tls-key",
     .kind = DP_ARG_STR,
     .off = offsetof(serve_opts_t, tls_key),
     .meta = "F",
     .help = "and its PEM private key"},
};

static const dp_args_t serve_spec = {
    .prog = "detproxy attest serve",
    .usage = "detproxy attest serve --listen ADDR [--model-dir DIR] --model NAME\n"
             "           [--quantization Q] [--dtype D]\n"
             "           (--framework NAME --framework-version V --model-dir DIR |\n"
             "            --framework-url URL [--framework NAME] [--engine-pid PID])\n"
             "           [--key KEY.pem] [--framework-api-key-file F] [--watch-interval-ms N]\n"
             "           [--framework-refresh-ms N] [--log-level L]\n"
             "           [--oms-bundle FILE (--oms-pubkey PEM | --oms-trusted-root FILE\n"
             "            --oms-identity ID --oms-issuer URL) [--oms-ignore-path P]...]\n"
             "           [--tls-cert F --tls-key F]\n"
             "           [--determinism batch_invariant [--determinism-pid PID | "
             "--determinism-process NAME]]",
    .about =
        "The replica-side attestation agent (docs/attestation.md §4). Hashes DIR at start (off\n"
        "the event loop) and whenever a file's size, mtime, ctime or inode changes, and answers\n"
        "GET /attestation?nonce=N with a DSSE envelope signed by KEY.pem (Ed25519, from\n"
        "`detproxy attest keygen`). While hashing, or after a change until the new hash is\n"
        "ready, it answers 503 and vouches for nothing. With --framework-url it measures:\n"
        "the engine's own report and the model it loaded are signed, not the flags, and a\n"
        "flag the engine contradicts is listed so that the proxy rejects the replica.",
    .opts = serve_table,
    .nopts = DP_ARRAY_SIZE(serve_table),
    .epilog = "Exit codes: 0 stopped by SIGTERM/SIGINT, 2 usage error, 3 runtime failure.",
};

static int parse_determinism(const char *mode, const char *pid, const char *process, pid_t *out)
{
    if (mode == NULL) {
        if (pid || process)
            return dp_args_usage_error(&serve_spec, "--determinism-pid and --determinism-process "
                                                    "need --determinism batch_invariant");
        return 0;
    }
    if (strcmp(mode, "batch_invariant") != 0)
        return dp_args_usage_error(&serve_spec,
                                   "--determinism %s: expected batch_invariant (single_sequence "
                                   "is enforced by the proxy, there is nothing to attest)",
                                   mode);
    if (pid && process)
        return dp_args_usage_error(
            &serve_spec, "--determinism-pid and --determinism-process exclude each other");
    if (pid) {
        char *end;
        errno = 0;
        long v = strtol(pid, &end, 10);
        if (errno || *end || end == pid || v <= 0 || v > 0x3fffffff)
            return dp_args_usage_error(&serve_spec, "--determinism-pid %s: expected a process id",
                                       pid);
        *out = (pid_t)v;
    }
    if (process && (process[0] == '\0' || strchr(process, '/')))
        return dp_args_usage_error(
            &serve_spec, "--determinism-process %s: expected a command name without '/'", process);
    return 0;
}

static int parse_engine_pid(const char *pid, const char *fw_url, pid_t *out)
{
    if (pid == NULL)
        return 0;
    if (fw_url == NULL)
        return dp_args_usage_error(&serve_spec, "--engine-pid needs --framework-url");
    char *end;
    errno = 0;
    long v = strtol(pid, &end, 10);
    if (errno || *end || end == pid || v <= 0 || v > 0x3fffffff)
        return dp_args_usage_error(&serve_spec, "--engine-pid %s: expected a process id", pid);
    *out = (pid_t)v;
    return 0;
}

static char *read_secret(const char *path, dp_buf_t *err)
{
    dp_buf_t b = {0};
    int r = dp_read_file(path, 4096, &b);
    if (r != 0) {
        dp_buf_printf(err, "%s: %s", path, dp_input_strerror(r));
        dp_buf_free(&b);
        return NULL;
    }
    while (b.len && (b.base[b.len - 1] == '\n' || b.base[b.len - 1] == '\r' ||
                     b.base[b.len - 1] == ' ' || b.base[b.len - 1] == '\t'))
        b.base[--b.len] = '\0';
    if (b.len == 0 || strpbrk(b.base, "\r\n") != NULL) {
        dp_buf_printf(err, "%s: expected one line with the token", path);
        OPENSSL_cleanse(b.base, b.len);
        dp_buf_free(&b);
        return NULL;
    }
    return dp_buf_steal(&b);
}

static void warn_if_readable_by_others(const char *path, const char *what)
{
    struct stat st;
    if (stat(path, &st) == 0 && (st.st_mode & 077) != 0)
        log_kv(DP_LOG_WARN, "secret_file_permissions", what, path, "detail",
               "readable by group or others; chmod 600 it");
}

int agent_cmd_serve(int argc, char **argv)
{
    serve_opts_t o = {.watch_ms = DEFAULT_WATCH_MS,
                      .refresh_ms = DEFAULT_FW_REFRESH_MS,
                      .conns_per_client = DEFAULT_CONNS_PER_CLIENT,
                      .log_level = -1};
    o.oms_ignore = DP_ARG_LIST_OF(o.oms_ignore_store);
    int pr = dp_args_parse(&serve_spec, argc, argv, &o);
    if (pr != 0)
        return dp_args_exit(pr);
    const char *listen = o.listen, *dir = o.dir, *model = o.model;
    const char *fw_name = o.fw_name, *fw_version = o.fw_version, *fw_url = o.fw_url;
    const char *key_path = o.key_path, *oms_bundle = o.oms_bundle, *oms_pubkey = o.oms_pubkey;
    const char *det_mode = o.det_mode, *det_process = o.det_process;
    const char *fw_key_file = o.fw_key_file, *tls_cert = o.tls_cert, *tls_key = o.tls_key;

    if (fw_url == NULL && (fw_name == NULL || fw_version == NULL))
        return dp_args_usage_error(&serve_spec,
                                   "give --framework and --framework-version, or --framework-url");
    if (fw_url == NULL && dir == NULL)
        return dp_args_usage_error(&serve_spec,
                                   "--model-dir is required without --framework-url (with it, "
                                   "the model the engine reports is hashed)");
    if (fw_url && fw_version)
        return dp_args_usage_error(&serve_spec,
                                   "--framework-version and --framework-url exclude each other");
    const attest_adapter_t *only = NULL;
    if (fw_url && fw_name && (only = attest_adapter_by_name(fw_name)) == NULL)
        return dp_args_usage_error(&serve_spec,
                                   "--framework %s: with --framework-url it must be vllm, tgi, "
                                   "sglang or llamacpp",
                                   fw_name);
    pid_t det_pidv = 0, engine_pidv = 0;
    if (parse_determinism(det_mode, o.det_pid, det_process, &det_pidv) != 0 ||
        parse_engine_pid(o.engine_pid, fw_url, &engine_pidv) != 0)
        return DP_EXIT_USAGE;
    if ((tls_cert == NULL) != (tls_key == NULL))
        return dp_args_usage_error(&serve_spec, "--tls-cert and --tls-key go together");
    cfg_addr_t addr = {0};
    const char *why = NULL;
    if (cfg_parse_addr(listen, &addr, &why) != 0)
        return dp_args_usage_error(&serve_spec, "--listen %s: %s", listen,
                                   why ? why : "invalid address");
    if (o.log_level >= 0)
        dp_log_set_level((dp_log_level_t)o.log_level);

    int rc = DP_EXIT_RUNTIME;
    agent_t *a = dp_xcalloc(1, sizeof(*a));
    dp_buf_t err = {0};
    bool loop_up = false;
    a->dir = dir ? dp_xstrdup(dir) : NULL;
    /* Without --framework-url the flags are all there is: --model-dir is hashed. With it, the
     * first read of the engine says what to hash. */
    a->target = fw_url ? NULL : dp_xstrdup(dir);
    a->flag_quant = o.quant ? dp_xstrdup(o.quant) : NULL;
    a->flag_dtype = o.dtype ? dp_xstrdup(o.dtype) : NULL;
    a->eng.fixed = engine_pidv;
    a->eng.sock_uid = -1;
    a->eng.loaded_last = -100;
    a->watch_ms = (uint32_t)o.watch_ms;
    a->fw_refresh_ms = (uint32_t)o.refresh_ms;
    snprintf(a->ident.source, sizeof(a->ident.source), "agent");
    attest_report_set(&a->ident, ATTEST_F_MODEL, model);
    attest_report_set(&a->ident, ATTEST_F_QUANTIZATION, o.quant);
    attest_report_set(&a->ident, ATTEST_F_DTYPE, o.dtype);
    attest_report_set(&a->ident, ATTEST_F_FRAMEWORK_NAME, fw_url ? NULL : fw_name);
    attest_report_set(&a->ident, ATTEST_F_FRAMEWORK_VERSION, fw_version);
    if (fw_url)
        set_not_ready(a, ST_MEASURING, "reading the engine at --framework-url");
    else
        set_not_ready(a, ST_HASHING, "hashing the model directory");
    if (det_mode) {
        a->det = (attest_det_opts_t){.proc = "/proc",
                                     .pid = det_pidv,
                                     .process = det_process ? det_process : "vllm",
                                     .self = getpid()};
        a->det_last = 2;
        if (fw_url) /* which framework answers decides where to look: wait for its read */
            attest_report_set_unattested(&a->ident, ATTEST_F_DETERMINISM, "framework not read yet");
        else
            det_refresh(a);
    }

    if (key_path) {
        if (attest_key_load(key_path, true, &a->key, &err) != 0) {
            fprintf(stderr, "detproxy attest serve: --key %s\n", err.base);
            goto out;
        }
        warn_if_readable_by_others(key_path, "key");
    } else {
        log_kv(DP_LOG_WARN, "unsigned", "detail",
               "no --key: attestations are unsigned and a proxy with require_signature rejects "
               "them",
               NULL, NULL);
    }
    const char *oms_root = o.oms_root;
    bool oms_keyless = oms_root || o.oms_identity || o.oms_issuer;
    if (oms_keyless && (!oms_root || !o.oms_identity || !o.oms_issuer)) {
        fputs("detproxy attest serve: --oms-trusted-root, --oms-identity and --oms-issuer go "
              "together (try --help)\n",
              stderr);
        rc = DP_EXIT_USAGE;
        goto out;
    }
    if (!oms_bundle != !(oms_pubkey || oms_keyless) || (oms_pubkey && oms_keyless) ||
        (o.oms_ignore.n > 0 && !oms_bundle)) {
        fputs("detproxy attest serve: --oms-bundle goes with one of --oms-pubkey or "
              "--oms-trusted-root (try --help)\n",
              stderr);
        rc = DP_EXIT_USAGE;
        goto out;
    }
    if (o.oms_ignore.n > 0 && !dir) {
        fputs("detproxy attest serve: --oms-ignore-path needs --model-dir\n", stderr);
        rc = DP_EXIT_USAGE;
        goto out;
    }
    if (oms_bundle) {
        const char *bad = NULL;
        if (oms_pubkey && oms_trust_load_pubkey(&a->oms_trust, oms_pubkey, &err) != 0)
            bad = "--oms-pubkey";
        else if (oms_root && oms_trust_load_sigstore(&a->oms_trust, oms_root, o.oms_identity,
                                                     o.oms_issuer, &err) != 0)
            bad = "--oms-trusted-root";
        for (size_t i = 0; !bad && i < o.oms_ignore.n; i++)
            if (oms_trust_add_ignore(&a->oms_trust, dir, o.oms_ignore.items[i], &err) != 0)
                bad = "--oms-ignore-path";
        if (bad) {
            fprintf(stderr, "detproxy attest serve: %s %s\n", bad, err.base);
            rc = DP_EXIT_USAGE;
            goto out;
        }
        a->oms_bundle = dp_xstrdup(oms_bundle);
    }
    if (fw_url) {
        if (cfg_parse_url(fw_url, &a->fw.url, &why) != 0) {
            fprintf(stderr, "detproxy attest serve: --framework-url %s: %s\n", fw_url,
                    why ? why : "invalid URL");
            rc = DP_EXIT_USAGE;
            goto out;
        }
        if (a->fw.url.tls) {
            fputs("detproxy attest serve: --framework-url: use http:// to the co-located server "
                  "(it is reached over loopback or the pod network)\n",
                  stderr);
            rc = DP_EXIT_USAGE;
            goto out;
        }
        a->fw.only = only;
        a->fw.known = -1;
        if (fw_key_file) {
            a->fw.api_key = read_secret(fw_key_file, &err);
            if (a->fw.api_key == NULL) {
                fprintf(stderr, "detproxy attest serve: --framework-api-key-file %s\n", err.base);
                goto out;
            }
            warn_if_readable_by_others(fw_key_file, "framework_api_key_file");
        }
        attest_report_set_unattested(&a->ident, ATTEST_F_FRAMEWORK_NAME, "framework not read yet");
        attest_report_set_unattested(&a->ident, ATTEST_F_FRAMEWORK_VERSION,
                                     "framework not read yet");
    }

    if (uv_loop_init(&a->loop) != 0)
        goto out;
    loop_up = true;
    net_handler_t h = {.on_head = on_head, .on_complete = on_complete, .on_abort = on_abort};
    net_server_limits_t lim;
    net_server_limits_default(&lim);
    lim.max_body_bytes = 4096; /* GET only: every request is answered from its head */
    lim.max_connections_per_client = (uint32_t)o.conns_per_client;
    a->srv = net_server_new(&a->loop, &h, a, &lim);
    if (tls_cert) {
        warn_if_readable_by_others(tls_key, "tls_key");
        dp_buf_t terr = {0};
        net_tls_ctx_t *tc = net_tls_server_ctx(tls_cert, tls_key, NULL, &terr);
        if (tc == NULL) {
            fprintf(stderr, "detproxy attest serve: --tls-cert/--tls-key: %s\n", terr.base);
            dp_buf_free(&terr);
            rc = DP_EXIT_RUNTIME;
            goto out;
        }
        net_server_set_tls(a->srv, tc);
        net_tls_ctx_unref(tc); /* the server holds its own reference */
    }
    int r = net_server_listen(a->srv, addr.host, addr.port);
    if (r != 0) {
        fprintf(stderr, "detproxy attest serve: cannot listen on %s: %s\n", listen, uv_strerror(r));
        a->closes_pending++;
        net_server_close(a->srv, server_closed, a);
        uv_run(&a->loop, UV_RUN_DEFAULT);
        goto out;
    }
    if (fw_url) {
        struct sockaddr_storage ss;
        if (!net_resolve(a->fw.url.host, a->fw.url.port, &ss)) {
            fprintf(stderr, "detproxy attest serve: --framework-url: cannot resolve %s\n",
                    a->fw.url.host);
            a->closes_pending++;
            net_server_close(a->srv, server_closed, a);
            uv_run(&a->loop, UV_RUN_DEFAULT);
            goto out;
        }
        net_upstream_opts_t uo = {.connect_timeout_ms = 2000,
                                  .first_byte_timeout_ms = 5000,
                                  .idle_timeout_ms = 5000,
                                  /* closed before the engine's own 5 s keep-alive close
                                   * (vLLM, llama.cpp) could cross a request */
                                  .keepalive_ms = 4000,
                                  .max_idle = 1,
                                  .write_high_water = 65536};
        a->fw.up = net_upstream_new(&a->loop, (struct sockaddr *)&ss, &uo);
        a->eng.addr = ss;
        a->eng.local = attest_addr_is_local((struct sockaddr *)&ss);
        a->sees_all = attest_proc_sees_every_process("/proc");
    }

    uv_signal_init(&a->loop, &a->sigterm);
    uv_signal_init(&a->loop, &a->sigint);
    uv_signal_init(&a->loop, &a->sigpipe);
    a->sigterm.data = a->sigint.data = a->sigpipe.data = a;
    uv_signal_start(&a->sigterm, on_signal, SIGTERM);
    uv_signal_start(&a->sigint, on_signal, SIGINT);
    uv_signal_start(&a->sigpipe, on_signal, SIGPIPE);
    uv_timer_init(&a->loop, &a->watch);
    uv_timer_init(&a->loop, &a->fw_timer);
    uv_timer_init(&a->loop, &a->look_timer);
    uv_timer_init(&a->loop, &a->stop_timer);
    a->watch.data = a->fw_timer.data = a->look_timer.data = a->stop_timer.data = a;
    uv_timer_start(&a->watch, on_watch, a->watch_ms, a->watch_ms);
    if (a->fw.up)
        uv_timer_start(&a->fw_timer, on_fw_timer, 0, 0); /* then fw_schedule() */

    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "listening");
    if (w) {
        uint16_t port = net_server_port(a->srv);
        dp_buf_t hp = {0};
        dp_buf_printf(&hp, strchr(addr.host, ':') ? "[%s]:%u" : "%s:%u", addr.host, port);
        dp_jw_str(w, "service", "detproxy-attest");
        dp_jw_str(w, "addr", hp.base);
        dp_jw_uint(w, "port", port);
        dp_jw_int(w, "pid", getpid());
        dp_jw_str(w, "model_dir", a->dir);
        dp_jw_str(w, "model", model);
        if (a->key)
            dp_jw_str(w, "keyid", attest_key_id(a->key));
        else
            dp_jw_null(w, "keyid");
        dp_log_end(w);
        dp_buf_free(&hp);
    }
    start_job(a, true); /* --model-dir (without --framework-url; with it, measure() starts it) */
    uv_run(&a->loop, UV_RUN_DEFAULT);
    log_kv(DP_LOG_INFO, "stopped", NULL, NULL, NULL, NULL);
    rc = DP_EXIT_OK;
out:
    if (loop_up && uv_loop_close(&a->loop) != 0)
        log_kv(DP_LOG_WARN, "loop_not_empty_at_exit", NULL, NULL, NULL, NULL);
    dp_buf_free(&a->fw.last_error);
    dp_buf_free(&a->fw.unreachable);
    if (a->fw.api_key) {
        OPENSSL_cleanse(a->fw.api_key, strlen(a->fw.api_key));
        free(a->fw.api_key);
    }
    cfg_url_free(&a->fw.url);
    attest_snapshot_free(&a->snap);
    oms_watch_free(&a->oms_watch);
    oms_trust_free(&a->oms_trust);
    free(a->oms_bundle);
    dp_buf_free(&a->det_why);
    dp_buf_free(&a->ckpt_why);
    dp_buf_free(&a->loaded_why);
    attest_report_clear(&a->ident);
    attest_key_free(a->key);
    free(a->why_not_ready);
    free(a->dir);
    free(a->target);
    free(a->engine_path);
    free(a->pending.model_path);
    free(a->looked.model_path);
    free(a->dir_contra);
    free(a->flag_quant);
    free(a->flag_dtype);
    free(a);
    free(addr.host);
    dp_buf_free(&err);
    return rc;
}
