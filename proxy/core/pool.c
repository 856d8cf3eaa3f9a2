/* Pools: their replica lists, the questions every plane asks of them, and each thread's
 * cached metric series. */
#include <stdio.h>
#include <string.h>

#include "common/util.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"

void px_pool_push_replica(px_pool_t *p, px_replica_t *r)
{
    PX_ASSERT_CONTROL();
    if (p->nreplicas == p->cap) {
        p->cap = p->cap ? p->cap * 2 : 4;
        p->replicas = dp_xrealloc(p->replicas, p->cap * sizeof(*p->replicas));
    }
    p->replicas[p->nreplicas++] = r;
}

void px_pool_remove_replica(px_pool_t *p, px_replica_t *r)
{
    for (size_t i = 0; i < p->nreplicas; i++) {
        if (p->replicas[i] == r) {
            memmove(&p->replicas[i], &p->replicas[i + 1],
                    (p->nreplicas - i - 1) * sizeof(*p->replicas));
            p->nreplicas--;
            px_replica_unref(r);
            return;
        }
    }
}

bool px_pool_has_admitted(const px_pool_t *p)
{
    for (size_t i = 0; i < p->nreplicas; i++)
        if (px_replica_serving(p->replicas[i]))
            return true;
    return false;
}

bool px_pool_all_drained(const px_pool_t *p)
{
    size_t drained = 0;
    for (size_t i = 0; i < p->nreplicas; i++) {
        const px_replica_t *r = p->replicas[i];
        if (px_replica_state(r) != PX_REPLICA_ADMITTED)
            continue;
        if (!atomic_load(&r->drained))
            return false; /* admitted, not drained: out for another reason (suspect) */
        drained++;
    }
    return drained > 0;
}

void px_pool_why_unavailable(const px_pool_t *p, dp_buf_t *out)
{
    if (p->nreplicas == 0) {
        dp_buf_printf(out, "pool %s has no replicas", p->name);
        return;
    }
    dp_buf_printf(out, "pool %s has no admitted replica:", p->name);
    for (size_t i = 0; i < p->nreplicas; i++) {
        const px_replica_t *r = p->replicas[i];
        dp_buf_printf(
            out, " %s %s%s%s", r->name, px_replica_state_names[px_replica_state(r)],
            atomic_load(&r->drained) ? " drained" : "",
            atomic_load(&r->suspect) ? " (suspect: a worker just saw it fail; re-checking)" : "");
        char why[PX_WHY_BYTES];
        px_seqstr_get(&r->why, why); /* any thread: the control one owns r->reasons */
        if (why[0])
            dp_buf_printf(out, " (%s)", why);
        dp_buf_appendc(out, i + 1 < p->nreplicas ? ';' : '.');
    }
}

px_series_t *px_pool_requests_series(px_pool_t *p, const char *tenant, int status, const char *code)
{
    char st[12];
    if (p == NULL) { /* refused before a pool was chosen: rare enough for a hash probe */
        snprintf(st, sizeof(st), "%d", status);
        return px_metrics_get("detproxy_requests_total", "pool", "-", "tenant", tenant, "status",
                              st, "code", code, NULL);
    }
    px_pool_slot_t *sl = &p->slots[px_thread_slot()];
    size_t n = DP_ARRAY_SIZE(sl->m_requests);
    for (size_t i = 0; i < n && sl->m_requests[i].s; i++)
        if (sl->m_requests[i].tenant == tenant && sl->m_requests[i].status == status &&
            sl->m_requests[i].code == code)
            return sl->m_requests[i].s;
    snprintf(st, sizeof(st), "%d", status);
    px_series_t *s = px_metrics_get("detproxy_requests_total", "pool", p->name, "tenant", tenant,
                                    "status", st, "code", code, NULL);
    for (size_t i = 0; i < n; i++) {
        if (sl->m_requests[i].s == NULL) {
            sl->m_requests[i].tenant = tenant;
            sl->m_requests[i].status = status;
            sl->m_requests[i].code = code;
            sl->m_requests[i].s = s;
            break;
        }
    }
    return s;
}

void px_pool_tokens_series(px_pool_t *p, const char *tenant, px_series_t **prompt,
                           px_series_t **completion)
{
    px_pool_slot_t *sl = &p->slots[px_thread_slot()];
    size_t n = DP_ARRAY_SIZE(sl->m_tokens), i;
    for (i = 0; i < n && sl->m_tokens[i].prompt; i++) {
        if (sl->m_tokens[i].tenant == tenant) {
            *prompt = sl->m_tokens[i].prompt;
            *completion = sl->m_tokens[i].completion;
            return;
        }
    }
    *prompt = px_metrics_get("detproxy_tokens_total", "tenant", tenant, "pool", p->name, "kind",
                             "prompt", NULL);
    *completion = px_metrics_get("detproxy_tokens_total", "tenant", tenant, "pool", p->name, "kind",
                                 "completion", NULL);
    if (i < n) { /* more tenants than slots: the rest are looked up each time */
        sl->m_tokens[i].tenant = tenant;
        sl->m_tokens[i].prompt = *prompt;
        sl->m_tokens[i].completion = *completion;
    }
}
