/* The status page (docs/operations.md §2): `GET /` on the admin listener, one self-contained HTML
 * document.
 *
 * No script, no external asset (a strict Content-Security-Policy says so to the browser too),
 * a meta refresh every PX_STATUS_REFRESH_S seconds. Everything that is not a literal of this file
 * goes through esc(): replica names come from the operator, but reasons quote what replicas and
 * agents report (a model name, a framework version), and those are attacker-controlled.
 *
 * Also here: the gauges derived from replica and drift state (detproxy_drift_verdict,
 * detproxy_replica_quarantined), and the ring of recent replica state changes the page lists. */
#include "proxy/control/status.h"

#include <math.h>
#include <string.h>

#include "attest/match.h"
#include "attest/report.h"
#include "common/util.h"
#include "drift/drift.h"
#include "drift/rollout.h"
#include "proxy/control/attest.h"
#include "proxy/control/fleet.h"
#include "proxy/data/shadow.h"
#include "proxy/core/gen.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"

#define PX_STATUS_REFRESH_S 5
#define PX_STATUS_CHANGES 32

typedef struct {
    uint64_t at_ms; /* wall clock */
    char pool[64];
    char replica[64];
    px_replica_state_t from, to;
    char reason[200];
} change_t;

/* Loop-thread only, like the replicas whose transitions it records. */
static change_t changes[PX_STATUS_CHANGES];
static size_t nchanges; /* lifetime count; the ring holds the last PX_STATUS_CHANGES */

static void copy_trunc(char *dst, size_t cap, const char *src)
{
    size_t n = src ? strlen(src) : 0;
    if (n >= cap)
        n = cap - 1;
    memcpy(dst, src ? src : "", n);
    dst[n] = '\0';
}

void px_status_note_change(const px_replica_t *r, px_replica_state_t from)
{
    change_t *c = &changes[nchanges++ % PX_STATUS_CHANGES];
    c->at_ms = dp_wall_ms();
    copy_trunc(c->pool, sizeof(c->pool), r->pool_name);
    copy_trunc(c->replica, sizeof(c->replica), r->name);
    c->from = from;
    c->to = r->state;
    copy_trunc(c->reason, sizeof(c->reason), r->nreasons ? r->reasons[0] : "");
}

/* ---- gauges -------------------------------------------------------------------------------- */

void px_status_refresh_gauges(px_t *px)
{
    static const drift_verdict_kind_t kinds[] = {DRIFT_INSUFFICIENT_DATA, DRIFT_CONSISTENT,
                                                 DRIFT_BATCHING_NONDETERMINISM,
                                                 DRIFT_CROSS_REPLICA_DRIFT};
    for (size_t i = 0; i < px->gen->npools; i++) {
        const px_pool_t *p = &px->gen->pools[i];
        drift_verdict_t v;
        drift_pool_verdict(px_shadow_drift_pool(px, p->name), &v);
        for (size_t k = 0; k < DP_ARRAY_SIZE(kinds); k++)
            px_metrics_set(px_metrics_get("detproxy_drift_verdict", "pool", p->name, "verdict",
                                          drift_verdict_name(kinds[k]), NULL),
                           v.kind == kinds[k]);
        for (size_t k = 0; k < p->nreplicas; k++) {
            const px_replica_t *r = p->replicas[k];
            px_metrics_set(px_metrics_get("detproxy_replica_quarantined", "pool", p->name,
                                          "replica", r->name, NULL),
                           r->state == PX_REPLICA_QUARANTINED);
        }
    }
}

/* ---- HTML ---------------------------------------------------------------------------------- */

/* Text and attribute values alike: the five characters that matter in either. */
static void esc(dp_buf_t *b, const char *s)
{
    for (const char *p = s ? s : ""; *p; p++) {
        switch (*p) {
        case '&':
            dp_buf_appends(b, "&amp;");
            break;
        case '<':
            dp_buf_appends(b, "&lt;");
            break;
        case '>':
            dp_buf_appends(b, "&gt;");
            break;
        case '"':
            dp_buf_appends(b, "&quot;");
            break;
        case '\'':
            dp_buf_appends(b, "&#39;");
            break;
        default:
            dp_buf_appendc(b, *p);
        }
    }
}

static void tag_text(dp_buf_t *b, const char *open, const char *text, const char *close)
{
    dp_buf_appends(b, open);
    esc(b, text);
    dp_buf_appends(b, close);
}

static void when(dp_buf_t *b, uint64_t wall_ms)
{
    if (wall_ms == 0) {
        dp_buf_appends(b, "never");
        return;
    }
    char ts[32];
    dp_iso8601(ts, wall_ms);
    esc(b, ts);
}

/* A long hex value (a checkpoint hash, a digest: 64 characters) would set its column's width
 * alone, and the identity table has one column per replica: it is shown as its first 12 and
 * last 4 characters, the whole value in the title attribute (the browser shows it on hover) and
 * in data-full. Shorter values and other text are shown whole and wrap where they must. */
#define PX_STATUS_SHORT_MIN 24
#define PX_STATUS_SHORT_HEAD 12
#define PX_STATUS_SHORT_TAIL 4

static bool long_hex(const char *s)
{
    size_t n = strlen(s);
    if (n < PX_STATUS_SHORT_MIN)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f') ||
              (s[i] >= 'A' && s[i] <= 'F')))
            return false;
    return true;
}

static void code_value(dp_buf_t *b, const char *v)
{
    if (!long_hex(v)) {
        tag_text(b, "<code>", v, "</code>");
        return;
    }
    size_t n = strlen(v);
    /* Hex only: nothing to escape. */
    dp_buf_printf(b, "<code class=\"short\" title=\"%s\" data-full=\"%s\">%.*s&hellip;%s</code>", v,
                  v, PX_STATUS_SHORT_HEAD, v, v + n - PX_STATUS_SHORT_TAIL);
}

static const char STYLE[] =
    "body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}"
    "h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.2em;margin:1.4em 0 .4em}"
    "h3{font-size:1em;margin:1em 0 .3em}"
    "table{border-collapse:collapse;margin:.3em 0;background:#fff}"
    "th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}"
    /* What replicas report may be one long word (a hash in a reason, a version string): it
     * breaks anywhere rather than widen the page; the page's own words never break. */
    "li.reason,td.reason,span.reason,table.identity td code{overflow-wrap:anywhere}"
    ".state{white-space:nowrap}code.short{white-space:nowrap;cursor:help;border-bottom:1px dotted "
    "#999}"
    "th{background:#eee}code{font-size:.95em}.muted{color:#777}"
    ".state{font-weight:600;padding:0 .4em;border-radius:3px}"
    ".state-admitted{background:#d4f4d4}.state-pending{background:#eee}"
    ".state-rejected{background:#f8d0d0}.state-unreachable{background:#f8e0c0}"
    ".state-quarantined{background:#e8d0f8}"
    "td.diff{background:#fde2e2;font-weight:600}td.same{background:#e6f6e6}"
    ".verdict{font-weight:600}.verdict-cross_replica_drift{color:#b00}"
    ".verdict-batching_nondeterminism{color:#a60}.verdict-consistent{color:#070}"
    "section.pool{border-top:2px solid #ccc;margin-top:1em}"
    "svg.hist{background:#fff;border:1px solid #ccc;margin-right:1em}";

static void page_head(dp_buf_t *b)
{
    dp_buf_printf(b,
                  "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                  "<meta http-equiv=\"refresh\" content=\"%d\">"
                  "<meta name=\"viewport\" content=\"width=device-width\">"
                  "<title>detproxy status</title><style>%s</style></head><body>\n",
                  PX_STATUS_REFRESH_S, STYLE);
}

static void replicas_table(dp_buf_t *b, const px_pool_t *p)
{
    dp_buf_appends(b, "<table class=\"replicas\"><tr><th>replica</th><th>url</th><th>state</th>"
                      "<th>reasons</th><th>in flight</th><th>requests</th>"
                      "<th>last attested</th></tr>\n");
    for (size_t k = 0; k < p->nreplicas; k++) {
        const px_replica_t *r = p->replicas[k];
        const char *st = px_replica_state_names[r->state];
        dp_buf_appends(b, "<tr class=\"replica\" data-replica=\"");
        esc(b, r->name);
        dp_buf_appends(b, "\" data-state=\"");
        esc(b, st);
        dp_buf_appends(b, "\">");
        tag_text(b, "<td><code>", r->name, "</code></td>");
        dp_buf_printf(b, "<td><code>%s://", r->url.tls ? "https" : "http");
        esc(b, r->url.hostport);
        esc(b, r->url.path);
        dp_buf_printf(b, "</code></td><td><span class=\"state state-%s\">%s</span></td><td>", st,
                      st);
        if (r->nreasons == 0)
            dp_buf_appends(b, "<span class=\"muted\">none</span>");
        else {
            dp_buf_appends(b, "<ul class=\"reasons\">");
            for (size_t i = 0; i < r->nreasons; i++)
                tag_text(b, "<li class=\"reason\">", r->reasons[i], "</li>");
            dp_buf_appends(b, "</ul>");
        }
        dp_buf_printf(b, "</td><td>%u</td><td>%llu</td><td>", r->slots->inflight,
                      (unsigned long long)r->requests);
        when(b, r->last_attested_at);
        dp_buf_appends(b, "</td></tr>\n");
    }
    dp_buf_appends(b, "</table>\n");
}

/* Rows: the identity fields; columns: the manifest, then each replica's attested value. A value
 * that differs from a pinned one is highlighted (class diff), an equal one marked same. */
static void identity_table(dp_buf_t *b, const px_pool_t *p)
{
    const cfg_manifest_t *m = p->cfg->manifest;
    dp_buf_appends(b, "<table class=\"identity\"><tr><th>field</th><th>manifest</th>");
    for (size_t k = 0; k < p->nreplicas; k++)
        tag_text(b, "<th><code>", p->replicas[k]->name, "</code></th>");
    dp_buf_appends(b, "</tr>\n");
    for (int f = 0; f < ATTEST_F__COUNT; f++) {
        const char *want = attest_manifest_get(m, (attest_field_t)f);
        dp_buf_appends(b, "<tr data-field=\"");
        esc(b, attest_field_names[f]);
        dp_buf_appends(b, "\">");
        tag_text(b, "<th>", attest_field_names[f], "</th>");
        if (want) {
            dp_buf_appends(b, "<td class=\"manifest\">");
            code_value(b, want);
            dp_buf_appends(b, "</td>");
        } else
            dp_buf_appends(b, "<td class=\"manifest muted\">not pinned</td>");
        for (size_t k = 0; k < p->nreplicas; k++) {
            const px_replica_t *r = p->replicas[k];
            const attest_report_t *rep = px_attest_report(r);
            const char *got = rep ? attest_report_get(rep, (attest_field_t)f) : NULL;
            const char *cls = want == NULL ? "" : got && strcmp(got, want) == 0 ? "same" : "diff";
            dp_buf_printf(b, "<td class=\"%s\" data-replica=\"", cls);
            esc(b, r->name);
            dp_buf_appends(b, "\">");
            if (got)
                code_value(b, got);
            else
                dp_buf_appends(b, rep ? "<span class=\"muted\">not reported</span>"
                                      : "<span class=\"muted\">no report</span>");
            dp_buf_appends(b, "</td>");
        }
        dp_buf_appends(b, "</tr>\n");
    }
    dp_buf_appends(b, "</table>\n");
}

/* One similarity histogram (detproxy_shadow_similarity{pool,kind}) as an inline SVG bar chart:
 * one bar per bucket, heights relative to the fullest bucket. */
static void similarity_svg(dp_buf_t *b, const char *pool, const char *kind)
{
    const px_series_t *s =
        px_metrics_hist("detproxy_shadow_similarity", px_shadow_similarity_bounds,
                        px_shadow_similarity_nbounds, "pool", pool, "kind", kind, NULL);
    const int W = 320, H = 120, top = 18, base = H - 22;
    size_t nb = s->nbounds;
    uint64_t max = 1;
    uint64_t count = px_metrics_count(s), buckets[PX_HIST_MAX_BUCKETS];
    for (size_t i = 0; i < nb; i++) {
        buckets[i] = px_metrics_bucket(s, i);
        if (buckets[i] > max)
            max = buckets[i];
    }
    dp_buf_printf(b,
                  "<svg class=\"hist\" data-kind=\"%s\" data-samples=\"%llu\" width=\"%d\" "
                  "height=\"%d\" viewBox=\"0 0 %d %d\" role=\"img\">"
                  "<title>%s similarity, %llu samples</title>"
                  "<text x=\"4\" y=\"13\" font-size=\"12\">%s: %llu samples</text>",
                  kind, (unsigned long long)count, W, H, W, H, kind, (unsigned long long)count,
                  kind, (unsigned long long)count);
    double bw = (double)(W - 8) / (double)nb;
    for (size_t i = 0; i < nb; i++) {
        double h = (double)(base - top) * (double)buckets[i] / (double)max;
        double x = 4 + bw * (double)i;
        dp_buf_printf(b,
                      "<rect class=\"bar\" data-le=\"%g\" data-count=\"%llu\" x=\"%.1f\" "
                      "y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\"><title>"
                      "similarity &#8804; %g: %llu</title></rect>"
                      "<text x=\"%.1f\" y=\"%d\" font-size=\"10\" text-anchor=\"middle\">%g"
                      "</text>",
                      s->bounds[i], (unsigned long long)buckets[i], x + 1, base - h, bw - 2, h,
                      s->bounds[i] >= 1.0 ? "#4a4" : "#c55", s->bounds[i],
                      (unsigned long long)buckets[i], x + bw / 2, H - 8, s->bounds[i]);
    }
    dp_buf_appends(b, "</svg>");
}

static void drift_summary_row(dp_buf_t *b, const char *kind, const drift_summary_t *s)
{
    dp_buf_printf(b, "<tr data-kind=\"%s\"><th>%s</th><td>%u</td><td>%u</td>", kind, kind,
                  s->samples, s->diverged);
    if (s->samples)
        dp_buf_printf(b, "<td>%.3f</td><td>%.3f</td></tr>", s->exact_match_rate,
                      s->mean_similarity);
    else
        dp_buf_appends(b, "<td class=\"muted\">-</td><td class=\"muted\">-</td></tr>");
}

/* The pool's candidates (docs/rollouts.md), one row each with the verdict's first reason. */
static void candidates_section(dp_buf_t *b, px_t *px, const px_pool_t *p)
{
    if (p->cfg->ncandidates == 0)
        return;
    dp_buf_appends(b, "<h3>Candidates</h3><table class=\"candidates\"><tr><th>candidate</th>"
                      "<th>rate</th><th>verdict</th><th>samples</th><th>exact match rate</th>"
                      "<th>why</th></tr>");
    for (size_t k = 0; k < p->cfg->ncandidates; k++) {
        const cfg_candidate_t *c = &p->cfg->candidates[k];
        drift_rollout_verdict_t v;
        px_shadow_rollout_verdict(px, p->name, c->pool, &v);
        const char *vn = drift_rollout_kind_name(v.kind);
        tag_text(b, "<tr data-candidate=\"", c->pool, "\"");
        dp_buf_printf(b, " data-verdict=\"%s\">", vn);
        tag_text(b, "<td><code>", c->pool, "</code></td>");
        dp_buf_printf(b, "<td>%g</td><td class=\"verdict\">%s</td><td>%u</td>", c->rate, vn,
                      v.candidate.samples);
        if (v.candidate.samples)
            dp_buf_printf(b, "<td>%.3f</td>", v.candidate.exact_match_rate);
        else
            dp_buf_appends(b, "<td class=\"muted\">-</td>");
        tag_text(b, "<td class=\"reason\">", v.nreasons ? v.reasons[0] : "", "</td></tr>");
    }
    dp_buf_appends(b, "</table>");
}

static void drift_section(dp_buf_t *b, px_t *px, const px_pool_t *p)
{
    const drift_pool_t *dp = px_shadow_drift_pool(px, p->name);
    drift_verdict_t v;
    drift_pool_verdict(dp, &v);
    const char *vn = drift_verdict_name(v.kind);
    dp_buf_printf(b,
                  "<div class=\"drift\" data-verdict=\"%s\"><h3>Drift</h3><p>verdict: "
                  "<span class=\"verdict verdict-%s\">%s</span>",
                  vn, vn, vn);
    if (v.has_suspect && v.suspect[0])
        tag_text(b, ", suspect <code class=\"suspect\">", v.suspect, "</code>");
    dp_buf_appends(b, "</p><ul class=\"drift-reasons\">");
    for (int i = 0; i < v.nreasons; i++)
        tag_text(b, "<li>", v.reasons[i], "</li>");
    dp_buf_appends(b, "</ul><table class=\"drift-summary\"><tr><th>kind</th><th>samples</th>"
                      "<th>diverged</th><th>exact match rate</th><th>mean similarity</th></tr>");
    drift_summary_t s;
    drift_pool_summary(dp, DRIFT_CROSS, &s);
    drift_summary_row(b, "cross", &s);
    drift_pool_summary(dp, DRIFT_SELF, &s);
    drift_summary_row(b, "self", &s);
    dp_buf_appends(b, "</table><div class=\"histograms\">");
    similarity_svg(b, p->name, "cross");
    similarity_svg(b, p->name, "self");
    dp_buf_appends(b, "</div></div>\n");
}

static void quarantines(dp_buf_t *b, px_t *px)
{
    dp_buf_appends(b, "<h2>Quarantined replicas</h2><ul id=\"quarantines\">");
    size_t n = 0;
    for (size_t i = 0; i < px->gen->npools; i++) {
        const px_pool_t *p = &px->gen->pools[i];
        for (size_t k = 0; k < p->nreplicas; k++) {
            const px_replica_t *r = p->replicas[k];
            if (r->state != PX_REPLICA_QUARANTINED)
                continue;
            n++;
            dp_buf_appends(b, "<li data-replica=\"");
            esc(b, r->name);
            dp_buf_appends(b, "\"><code>");
            esc(b, p->name);
            dp_buf_appends(b, "/");
            esc(b, r->name);
            dp_buf_appends(b, "</code>");
            if (r->nreasons)
                tag_text(b, ": ", r->reasons[0], "");
            dp_buf_appends(b, "</li>");
        }
    }
    if (n == 0)
        dp_buf_appends(b, "<li class=\"muted\">none</li>");
    dp_buf_appends(b, "</ul>\n");
}

static void recent_changes(dp_buf_t *b)
{
    dp_buf_appends(b, "<h2>Recent state changes</h2><table id=\"changes\"><tr><th>at</th>"
                      "<th>pool</th><th>replica</th><th>from</th><th>to</th><th>reason</th></tr>");
    size_t n = nchanges < PX_STATUS_CHANGES ? nchanges : PX_STATUS_CHANGES;
    for (size_t i = 0; i < n; i++) { /* newest first */
        const change_t *c = &changes[(nchanges - 1 - i) % PX_STATUS_CHANGES];
        dp_buf_appends(b, "<tr class=\"change\"><td>");
        when(b, c->at_ms);
        tag_text(b, "</td><td>", c->pool, "</td>");
        tag_text(b, "<td>", c->replica, "</td>");
        dp_buf_printf(b, "<td>%s</td><td><span class=\"state state-%s\">%s</span></td>",
                      px_replica_state_names[c->from], px_replica_state_names[c->to],
                      px_replica_state_names[c->to]);
        tag_text(b, "<td class=\"reason\">", c->reason, "</td></tr>");
    }
    if (n == 0)
        dp_buf_appends(b, "<tr><td colspan=\"6\" class=\"muted\">none yet</td></tr>");
    dp_buf_appends(b, "</table>\n");
}

void px_status_page(px_t *px, net_req_t *req)
{
    dp_buf_t b = {0};
    page_head(&b);
    char now[32];
    dp_iso8601(now, dp_wall_ms());
    dp_buf_printf(
        &b,
        "<h1>detproxy</h1><p class=\"muted\">%s &middot; up %llu s &middot; "
        "refreshes every %d s &middot; JSON: <code>/admin/replicas</code>, "
        "<code>/admin/drift</code>, <code>/admin/rollouts</code>, <code>/admin/fleet</code>, "
        "<code>/metrics</code></p>\n",
        now, (unsigned long long)((dp_wall_ms() - px->started_ms) / 1000), PX_STATUS_REFRESH_S);
    for (size_t i = 0; i < px->gen->npools; i++) {
        const px_pool_t *p = &px->gen->pools[i];
        dp_buf_appends(&b, "<section class=\"pool\" data-pool=\"");
        esc(&b, p->name);
        dp_buf_appends(&b, "\">");
        tag_text(&b, "<h2>Pool <code>", p->name, "</code></h2>");
        tag_text(&b, "<p>fingerprint <code class=\"fingerprint\">", p->fingerprint, "</code>");
        dp_buf_appends(&b, " &middot; models");
        for (size_t k = 0; k < p->cfg->nmodels; k++)
            tag_text(&b, " <code>", p->cfg->models[k], "</code>");
        dp_buf_appends(&b, "</p>\n<h3>Replicas</h3>");
        replicas_table(&b, p);
        dp_buf_appends(&b, "<h3>Attested identity against the manifest</h3>");
        identity_table(&b, p);
        drift_section(&b, px, p);
        candidates_section(&b, px, p);
        dp_buf_appends(&b, "</section>\n");
    }
    if (px_fleet_enabled(px)) {
        dp_buf_t fl = {0};
        px_fleet_summary(px, &fl);
        tag_text(&b, "<h2>Fleet</h2><p id=\"fleet\">", fl.base, "</p>\n");
        dp_buf_free(&fl);
    }
    quarantines(&b, px);
    recent_changes(&b);
    dp_buf_appends(&b, "</body></html>\n");
    static const net_header_t hdrs[] = {
        {DP_IOV("content-security-policy"),
         DP_IOV("default-src 'none'; style-src 'unsafe-inline'; form-action 'none'; "
                "frame-ancestors 'none'")},
        {DP_IOV("cache-control"), DP_IOV("no-store")},
        {DP_IOV("x-content-type-options"), DP_IOV("nosniff")},
    };
    net_resp_send(req, 200, "text/html; charset=utf-8", b.base, b.len, hdrs, DP_ARRAY_SIZE(hdrs));
    dp_buf_free(&b);
}
