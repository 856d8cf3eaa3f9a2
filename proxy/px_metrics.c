#include "proxy/px_metrics.h"

#include <math.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "common/jw.h"

#define NBUCKETS 1024 /* hash buckets; the series count is small (pools x replicas x labels) */

typedef struct family_s {
    char *name;
    char *help;
    px_metric_type_t type;
    struct family_s *next;
} family_t;

static px_series_t *g_table[NBUCKETS];
static family_t *g_families;
static size_t g_nseries;
static px_series_t g_sink; /* never rendered */

const double px_latency_bounds[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                    1,     2.5,  5,     10,   30,  60,   120};
const size_t px_latency_nbounds = sizeof(px_latency_bounds) / sizeof(px_latency_bounds[0]);

static uint32_t hash(const char *s)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

void px_metrics_family(const char *name, px_metric_type_t type, const char *help)
{
    for (family_t *f = g_families; f; f = f->next)
        if (strcmp(f->name, name) == 0)
            return;
    family_t *f = dp_xcalloc(1, sizeof(*f));
    f->name = dp_xstrdup(name);
    f->help = dp_xstrdup(help);
    f->type = type;
    f->next = g_families;
    g_families = f;
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

static px_series_t *lookup(const char *name, px_metric_type_t type, va_list ap)
{
    char stack[512];
    size_t labels_at = 0;
    size_t n = build_key(stack, sizeof(stack), name, ap, &labels_at);
    if (n == 0)
        return &g_sink; /* absurdly long labels: counted nowhere rather than crash */
    uint32_t h = hash(stack) % NBUCKETS;
    for (px_series_t *s = g_table[h]; s; s = s->next)
        if (strcmp(s->key, stack) == 0)
            return s;
    px_series_t *s = dp_xcalloc(1, sizeof(*s));
    s->key = dp_xstrdup(stack);
    s->name = dp_xstrdup(name);
    s->labels = dp_xstrndup(stack + labels_at, n - labels_at - 1);
    s->type = type;
    s->next = g_table[h];
    g_table[h] = s;
    g_nseries++;
    return s;
}

px_series_t *px_metrics_get(const char *name, ...)
{
    va_list ap;
    va_start(ap, name);
    px_series_t *s = lookup(name, PX_COUNTER, ap);
    va_end(ap);
    return s;
}

px_series_t *px_metrics_hist(const char *name, const double *bounds, size_t nbounds, ...)
{
    va_list ap;
    va_start(ap, nbounds);
    px_series_t *s = lookup(name, PX_HISTOGRAM, ap);
    va_end(ap);
    if (s->bounds == NULL) {
        s->type = PX_HISTOGRAM;
        s->bounds = bounds;
        s->nbounds = nbounds < PX_HIST_MAX_BUCKETS ? nbounds : PX_HIST_MAX_BUCKETS;
    }
    return s;
}

void px_hist_observe(px_series_t *s, double v)
{
    /* Buckets are stored non-cumulative and summed at render: one increment per observation. */
    size_t i = 0;
    while (i < s->nbounds && v > s->bounds[i])
        i++;
    if (i < s->nbounds)
        s->buckets[i]++;
    s->count++;
    s->sum += v;
}

static void series_free(px_series_t *s)
{
    free(s->key);
    free(s->name);
    free(s->labels);
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
    /* O(series): a replica leaves rarely (discovery), and the table is small. */
    for (size_t b = 0; b < NBUCKETS; b++) {
        for (px_series_t **pp = &g_table[b]; *pp;) {
            px_series_t *s = *pp;
            if (strncmp(s->labels, want, wl) == 0 &&
                (s->labels[wl] == '\0' || s->labels[wl] == ',')) {
                *pp = s->next;
                series_free(s);
                g_nseries--;
                dropped++;
                continue;
            }
            pp = &s->next;
        }
    }
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
    px_series_t **all = dp_xmalloc((g_nseries ? g_nseries : 1) * sizeof(*all));
    size_t n = 0;
    for (size_t b = 0; b < NBUCKETS; b++)
        for (px_series_t *s = g_table[b]; s; s = s->next)
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
            render_value(o, s->value);
            continue;
        }
        uint64_t cum = 0;
        char le[48];
        for (size_t k = 0; k <= s->nbounds; k++) {
            if (k < s->nbounds) {
                cum += s->buckets[k];
                dp_buf_t tmp = {0};
                dp_json_double(&tmp, s->bounds[k]);
                snprintf(le, sizeof(le), "le=\"%s\"", tmp.base);
                dp_buf_free(&tmp);
            } else {
                cum = s->count;
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
        render_value(o, s->sum);
        dp_buf_appends(o, s->name);
        dp_buf_append(o, "_count", 6);
        render_labels(o, s->labels, NULL);
        render_value(o, (double)s->count);
    }
    free(all);
}

void px_metrics_reset(void)
{
    for (size_t b = 0; b < NBUCKETS; b++) {
        px_series_t *s = g_table[b];
        while (s) {
            px_series_t *next = s->next;
            series_free(s);
            s = next;
        }
        g_table[b] = NULL;
    }
    g_nseries = 0;
    while (g_families) {
        family_t *f = g_families;
        g_families = f->next;
        free(f->name);
        free(f->help);
        free(f);
    }
}
