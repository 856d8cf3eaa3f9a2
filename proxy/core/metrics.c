#include "proxy/core/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "common/jw.h"
#include "common/util.h"
#include "common/version.h"

#define NBUCKETS 1024 /* hash buckets; the series count is small (pools x replicas x labels) */

typedef struct family_s {
    char *name;
    char *help;
    px_metric_type_t type;
    struct family_s *next;
} family_t;

static _Atomic(px_series_t *) g_table[NBUCKETS];
static family_t *g_families;
static size_t g_nseries;
static px_series_t *g_retired; /* dropped series, freed at reset (px_metrics_drop) */
static px_cell_t g_sink_cells[1 + 64];
static px_series_t g_sink = {.cells = g_sink_cells}; /* never rendered */
/* Creating, dropping, rendering and resetting: never a look-up of an existing series. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned g_nthreads = 1;
_Thread_local unsigned px_metrics_thread;

void px_metrics_set_threads(unsigned n)
{
    pthread_mutex_lock(&g_mu);
    /* Cells are sized at creation: changing it with series alive would overrun them. */
    if (g_nseries == 0 && n >= 1 && n <= DP_ARRAY_SIZE(g_sink_cells))
        g_nthreads = n;
    pthread_mutex_unlock(&g_mu);
}

unsigned px_metrics_threads(void)
{
    return g_nthreads;
}

const double px_metrics_latency_bounds[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                            1,     2.5,  5,     10,   30,  60,   120};
const size_t px_metrics_latency_nbounds =
    sizeof(px_metrics_latency_bounds) / sizeof(px_metrics_latency_bounds[0]);

static uint32_t hash(const char *s)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

void px_metrics_family(const char *name, px_metric_type_t type, const char *help)
{
    pthread_mutex_lock(&g_mu);
    family_t *f;
    for (f = g_families; f; f = f->next)
        if (strcmp(f->name, name) == 0)
            break;
    if (f == NULL) {
        f = dp_xcalloc(1, sizeof(*f));
        f->name = dp_xstrdup(name);
        f->help = dp_xstrdup(help);
        f->type = type;
        f->next = g_families;
        g_families = f;
    }
    pthread_mutex_unlock(&g_mu);
}

/* The series key, name{k="v",...}, built into a caller's stack buffer: looking up an existing
 * series (every request) allocates nothing. Returns the length, or 0 if it does not fit. */
static size_t build_key(char *out, size_t cap, const char *name, va_list ap, size_t *labels_at)
{
    size_t n = 0;
#define PUT(c)                                                                                     \
    do {                                                                                           \
        if (n + 1 >= cap)                                                                          \
            return 0;                                                                              \
        out[n++] = (c);                                                                            \
    } while (0)
    for (const char *p = name; *p; p++)
        PUT(*p);
    PUT('{');
    *labels_at = n;
    bool first = true;
    for (;;) {
        const char *k = va_arg(ap, const char *);
        if (k == NULL)
            break;
        const char *v = va_arg(ap, const char *);
        if (!first)
            PUT(',');
        first = false;
        for (; *k; k++)
            PUT(*k);
        PUT('=');
        PUT('"');
        for (v = v ? v : ""; *v; v++) {
            if (*v == '\\' || *v == '"')
                PUT('\\');
            if (*v == '\n') {
                PUT('\\');
                PUT('n');
                continue;
            }
            PUT(*v);
        }
        PUT('"');
    }
    PUT('}');
#undef PUT
    out[n] = '\0';
    return n;
}

/* The series for name and its labels, created on first use. A histogram's bounds are set
 * before the series is published and never written again, so a thread that finds it without
 * the lock reads them as they will stay. */
static px_series_t *lookup(const char *name, px_metric_type_t type, const double *bounds,
                           size_t nbounds, va_list ap)
{
    char stack[512];
    size_t labels_at = 0;
    size_t n = build_key(stack, sizeof(stack), name, ap, &labels_at);
    if (n == 0)
        return &g_sink; /* absurdly long labels: counted nowhere rather than crash */
    uint32_t h = hash(stack) % NBUCKETS;
    /* Lock-free: a chain only ever grows at its head (release store below) or loses members
     * whose memory stays valid (px_metrics_drop). */
    for (px_series_t *s = atomic_load_explicit(&g_table[h], memory_order_acquire); s;
         s = atomic_load_explicit(&s->next, memory_order_acquire))
        if (strcmp(s->key, stack) == 0)
            return s;
    pthread_mutex_lock(&g_mu);
    px_series_t *s; /* again, under the lock: another thread may have just created it */
    for (s = atomic_load_explicit(&g_table[h], memory_order_relaxed); s;
         s = atomic_load_explicit(&s->next, memory_order_relaxed))
        if (strcmp(s->key, stack) == 0)
            break;
    if (s == NULL) {
        s = dp_xcalloc(1, sizeof(*s));
        s->key = dp_xstrdup(stack);
        s->name = dp_xstrdup(name);
        s->labels = dp_xstrndup(stack + labels_at, n - labels_at - 1);
        s->type = type;
        if (bounds) {
            s->nbounds = nbounds < PX_HIST_MAX_BUCKETS ? nbounds : PX_HIST_MAX_BUCKETS;
            s->bounds = bounds;
        }
        s->cells = dp_xcalloc(g_nthreads, sizeof(*s->cells));
        atomic_store_explicit(&s->next, atomic_load_explicit(&g_table[h], memory_order_relaxed),
                              memory_order_relaxed);
        atomic_store_explicit(&g_table[h], s, memory_order_release);
        g_nseries++;
    }
    pthread_mutex_unlock(&g_mu);
    return s;
}

px_series_t *px_metrics_get(const char *name, ...)
{
    va_list ap;
    va_start(ap, name);
    px_series_t *s = lookup(name, PX_COUNTER, NULL, 0, ap);
    va_end(ap);
    return s;
}

px_series_t *px_metrics_hist(const char *name, const double *bounds, size_t nbounds, ...)
{
    va_list ap;
    va_start(ap, nbounds);
    px_series_t *s = lookup(name, PX_HISTOGRAM, bounds, nbounds, ap);
    va_end(ap);
    return s;
}

static void bump(_Atomic uint64_t *c, uint64_t n)
{
    atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + n,
                          memory_order_relaxed);
}

void px_metrics_observe(px_series_t *s, double v)
{
    /* Buckets are stored non-cumulative and summed at render: one increment per observation. */
    px_cell_t *c = &s->cells[px_metrics_thread];
    size_t i = 0;
    while (i < s->nbounds && v > s->bounds[i])
        i++;
    if (i < s->nbounds)
        bump(&c->buckets[i], 1);
    bump(&c->count, 1);
    atomic_store_explicit(&c->sum, atomic_load_explicit(&c->sum, memory_order_relaxed) + v,
                          memory_order_relaxed);
}

static uint64_t sum_u64(const px_series_t *s, size_t bucket) /* bucket SIZE_MAX: count */
{
    uint64_t n = 0;
    for (unsigned t = 0; t < g_nthreads; t++)
        n += atomic_load_explicit(bucket == SIZE_MAX ? &s->cells[t].count
                                                     : &s->cells[t].buckets[bucket],
                                  memory_order_relaxed);
    return n;
}

uint64_t px_metrics_bucket(const px_series_t *s, size_t i)
{
    return sum_u64(s, i);
}

uint64_t px_metrics_count(const px_series_t *s)
{
    return sum_u64(s, SIZE_MAX);
}

double px_metrics_value(const px_series_t *s)
{
    double v = atomic_load_explicit(&s->gauge, memory_order_relaxed);
    for (unsigned t = 0; t < g_nthreads; t++)
        v += atomic_load_explicit(s->type == PX_HISTOGRAM ? &s->cells[t].sum : &s->cells[t].value,
                                  memory_order_relaxed);
    return v;
}

static void series_free(px_series_t *s)
{
    free(s->key);
    free(s->name);
    free(s->labels);
    free(s->cells);
    free(s);
}

/* The key of a label set with an empty family name: "{k1=\"v1\",...}". */
static size_t labels_key(char *out, size_t cap, size_t *labels_at, ...)
{
    va_list ap;
    va_start(ap, labels_at);
    size_t n = build_key(out, cap, "", ap, labels_at);
    va_end(ap);
    return n;
}

size_t px_metrics_drop(const char *k1, const char *v1, const char *k2, const char *v2)
{
    char pre[512];
    size_t labels_at = 0;
    size_t n = labels_key(pre, sizeof(pre), &labels_at, k1, v1, k2, v2, (const char *)NULL);
    if (n == 0)
        return 0;
    const char *want = pre + labels_at;
    size_t wl = n - labels_at - 1; /* without the closing brace */
    size_t dropped = 0;
    pthread_mutex_lock(&g_mu);
    /* O(series): a replica leaves rarely (discovery), and the table is small. */
    for (size_t b = 0; b < NBUCKETS; b++) {
        for (_Atomic(px_series_t *) *pp = &g_table[b]; atomic_load(pp);) {
            px_series_t *s = atomic_load(pp);
            if (strncmp(s->labels, want, wl) == 0 &&
                (s->labels[wl] == '\0' || s->labels[wl] == ',')) {
                /* Unlinked; s->next stays intact for a reader standing on s right now. */
                atomic_store_explicit(pp, atomic_load(&s->next), memory_order_release);
                s->retired_next = g_retired;
                g_retired = s;
                g_nseries--;
                dropped++;
                continue;
            }
            pp = &s->next;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return dropped;
}

static int cmp_series(const void *a, const void *b)
{
    const px_series_t *x = *(px_series_t *const *)a, *y = *(px_series_t *const *)b;
    int c = strcmp(x->name, y->name);
    return c ? c : strcmp(x->labels, y->labels);
}

static void render_labels(dp_buf_t *o, const char *labels, const char *extra)
{
    if (!labels[0] && !extra)
        return;
    dp_buf_appendc(o, '{');
    dp_buf_appends(o, labels);
    if (extra) {
        if (labels[0])
            dp_buf_appendc(o, ',');
        dp_buf_appends(o, extra);
    }
    dp_buf_appendc(o, '}');
}

static void render_value(dp_buf_t *o, double v)
{
    dp_buf_appendc(o, ' ');
    if (isinf(v))
        dp_buf_appends(o, v > 0 ? "+Inf" : "-Inf");
    else
        dp_json_double(o, v);
    dp_buf_appendc(o, '\n');
}

void px_metrics_render(dp_buf_t *o)
{
    pthread_mutex_lock(&g_mu);
    px_series_t **all = dp_xmalloc((g_nseries ? g_nseries : 1) * sizeof(*all));
    size_t n = 0;
    for (size_t b = 0; b < NBUCKETS; b++)
        for (px_series_t *s = atomic_load(&g_table[b]); s; s = atomic_load(&s->next))
            all[n++] = s;
    qsort(all, n, sizeof(*all), cmp_series);
    const char *family = NULL;
    for (size_t i = 0; i < n; i++) {
        px_series_t *s = all[i];
        if (family == NULL || strcmp(family, s->name) != 0) {
            family = s->name;
            for (family_t *f = g_families; f; f = f->next) {
                if (strcmp(f->name, s->name) == 0) {
                    static const char *const types[] = {"counter", "gauge", "histogram"};
                    dp_buf_printf(o, "# HELP %s %s\n# TYPE %s %s\n", f->name, f->help, f->name,
                                  types[f->type]);
                    break;
                }
            }
        }
        if (s->type != PX_HISTOGRAM) {
            dp_buf_appends(o, s->name);
            render_labels(o, s->labels, NULL);
            render_value(o, px_metrics_value(s));
            continue;
        }
        uint64_t cum = 0;
        char le[48];
        for (size_t k = 0; k <= s->nbounds; k++) {
            if (k < s->nbounds) {
                cum += sum_u64(s, k);
                dp_buf_t tmp = {0};
                dp_json_double(&tmp, s->bounds[k]);
                snprintf(le, sizeof(le), "le=\"%s\"", tmp.base);
                dp_buf_free(&tmp);
            } else {
                cum = sum_u64(s, SIZE_MAX);
                snprintf(le, sizeof(le), "le=\"+Inf\"");
            }
            dp_buf_appends(o, s->name);
            dp_buf_append(o, "_bucket", 7);
            render_labels(o, s->labels, le);
            render_value(o, (double)cum);
        }
        dp_buf_appends(o, s->name);
        dp_buf_append(o, "_sum", 4);
        render_labels(o, s->labels, NULL);
        render_value(o, px_metrics_value(s));
        dp_buf_appends(o, s->name);
        dp_buf_append(o, "_count", 6);
        render_labels(o, s->labels, NULL);
        render_value(o, (double)sum_u64(s, SIZE_MAX));
    }
    pthread_mutex_unlock(&g_mu);
    free(all);
}

void px_metrics_reset(void)
{
    pthread_mutex_lock(&g_mu);
    for (size_t b = 0; b < NBUCKETS; b++) {
        px_series_t *s = atomic_load(&g_table[b]);
        while (s) {
            px_series_t *next = atomic_load(&s->next);
            series_free(s);
            s = next;
        }
        atomic_store(&g_table[b], NULL);
    }
    while (g_retired) {
        px_series_t *s = g_retired;
        g_retired = s->retired_next;
        series_free(s);
    }
    g_nseries = 0;
    g_nthreads = 1;
    while (g_families) {
        family_t *f = g_families;
        g_families = f->next;
        free(f->name);
        free(f->help);
        free(f);
    }
    pthread_mutex_unlock(&g_mu);
}

void px_metrics_declare(void)
{
    px_metrics_family("detproxy_requests_total", PX_COUNTER,
                      "Client requests by pool, tenant, final status and code (what answered).");
    px_metrics_family("detproxy_tokens_total", PX_COUNTER,
                      "Tokens the replicas reported in usage, by tenant, pool and kind.");
    px_metrics_family("detproxy_replica_drained", PX_GAUGE,
                      "1 while the replica is drained (POST /admin/replicas/NAME/drain).");
    px_metrics_family("detproxy_request_duration_seconds", PX_HISTOGRAM,
                      "Time from the first request byte to the end of the response.");
    px_metrics_family("detproxy_upstream_errors_total", PX_COUNTER,
                      "Failed exchanges with replicas by kind.");
    px_metrics_family("detproxy_replica_admitted", PX_GAUGE,
                      "1 when the replica is admitted (gets traffic), else 0.");
    px_metrics_family("detproxy_attestations_total", PX_COUNTER, "Attestation checks by result.");
    px_metrics_family(
        "detproxy_fingerprint_mismatch_total", PX_COUNTER,
        "Responses whose system_fingerprint differed from the replica's attested one.");
    px_metrics_family("detproxy_policy_overrides_total", PX_COUNTER,
                      "Sampling parameters changed by policy.");
    px_metrics_family("detproxy_shadow_total", PX_COUNTER, "Shadow samples by kind and result.");
    px_metrics_family("detproxy_slot_holds_total", PX_COUNTER,
                      "Slots of single_sequence engines kept with no answer left to read, by "
                      "engine and how the hold ended (time, engine_idle).");
    px_metrics_family("detproxy_slot_drains_total", PX_COUNTER,
                      "Answers nobody reads, read to their end with their slot kept, by engine "
                      "and how the drain ended (whole, cut, time, stopped).");
    px_metrics_family("detproxy_engine_start_checks_total", PX_COUNTER,
                      "Engines new to this process whose slot was held until their /slots "
                      "said whether a generation left by an earlier process runs, by engine "
                      "and result (idle, unanswered, time, stopped).");
    px_metrics_family("detproxy_shadow_similarity", PX_HISTOGRAM,
                      "Word-level similarity of shadow samples.");
    px_metrics_family(
        "detproxy_candidate_total", PX_COUNTER,
        "Candidate-pool copies (docs/rollouts.md) by baseline pool, candidate and result.");
    px_metrics_family(
        "detproxy_drift_verdict", PX_GAUGE,
        "1 for the pool's current drift verdict (docs/drift.md §4), 0 for the others.");
    px_metrics_family("detproxy_replica_quarantined", PX_GAUGE,
                      "1 while the replica is quarantined for cross-replica drift.");
    px_metrics_family("detproxy_otel_spans_total", PX_COUNTER,
                      "OpenTelemetry spans by result (exported, dropped, failed).");
    px_metrics_family("detproxy_affinity_total", PX_COUNTER,
                      "Placements of affinity pools by result (hit, spill, fallback).");
    px_metrics_family("detproxy_policy_offloaded_total", PX_COUNTER,
                      "Request bodies policed on the thread pool: too large or too dense for "
                      "the event loop.");
    px_metrics_get("detproxy_policy_offloaded_total", NULL); /* shown from 0 */
    px_metrics_family("detproxy_response_offloaded_total", PX_COUNTER,
                      "Held non-streamed answers longer than 64 KiB, checked and given the "
                      "pool's fingerprint on the thread pool.");
    px_metrics_get("detproxy_response_offloaded_total", NULL);
    px_metrics_family("detproxy_offload_waiting", PX_GAUGE,
                      "Request bodies and answers waiting for a thread-pool thread to police or "
                      "check them (policing and checks take at most half the pool).");
    px_metrics_get("detproxy_offload_waiting", NULL);
    px_metrics_family("detproxy_body_stash_bytes", PX_GAUGE,
                      "Bytes of released request-body buffers a worker keeps for the next large "
                      "body (updated every 2 s).");
    px_metrics_family("detproxy_connections", PX_GAUGE, "Open client connections.");
    px_metrics_family("detproxy_inflight_requests", PX_GAUGE, "Client requests being handled.");
    px_metrics_family("detproxy_audit_write_errors_total", PX_COUNTER,
                      "Audit lines that could not be written.");
    px_metrics_family("detproxy_audit_store_errors_total", PX_COUNTER,
                      "Audit lines whose bodies could not be stored: written with "
                      "\"bodies_stored\":false under audit_fail open, not written under closed.");
    px_metrics_family("detproxy_audit_write_failures_total", PX_COUNTER,
                      "Audited requests whose audit line or stored bodies could not be written, "
                      "by what became of the answer (served under audit_fail open, refused "
                      "under closed).");
    px_metrics_family("detproxy_build_info", PX_GAUGE,
                      "Always 1; the labels name the running build.");
    px_metrics_set(
        px_metrics_get("detproxy_build_info", "version", dp_version, "commit", dp_commit, NULL), 1);
    px_metrics_family("detproxy_overload_rejections_total", PX_COUNTER,
                      "Requests refused 503 overloaded, by reason (body_budget, queue_full), and "
                      "request bodies shed from a full body budget (body_shed).");
    px_metrics_family("detproxy_worker_requests_total", PX_COUNTER,
                      "Client requests each worker thread took (workers).");
    px_metrics_family("detproxy_shadow_copies", PX_GAUGE,
                      "Shadow and candidate copies waiting for a free slot or running.");
    px_metrics_family("detproxy_handoff_dropped_total", PX_COUNTER,
                      "Messages from the workers the control thread's queue was too full to take.");
    px_metrics_family("detproxy_config_reloads_total", PX_COUNTER,
                      "Configuration reloads (SIGHUP, POST /admin/reload), by result (reloaded, "
                      "failed: the running configuration kept).");
    px_metrics_family("detproxy_config_last_reload_successful", PX_GAUGE,
                      "1 when the configuration file last read was taken, 0 when it was refused "
                      "and the process runs an older one.");
    px_metrics_family("detproxy_config_last_reload_success_timestamp_seconds", PX_GAUGE,
                      "When the configuration running was read (the start, or its reload).");
    px_metrics_set(px_metrics_get("detproxy_config_last_reload_successful", NULL), 1);
    px_metrics_set(px_metrics_get("detproxy_config_last_reload_success_timestamp_seconds", NULL),
                   (double)dp_wall_ms() / 1000.0);
}
