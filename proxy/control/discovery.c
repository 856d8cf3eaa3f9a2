/* DNS discovery (docs/configuration.md "discovery"): every refresh_ms, resolve the name's A/AAAA
 * records off the loop (uv_getaddrinfo runs in the thread pool), add new addresses as `pending`
 * replicas (attested before use), and drain removed ones: they leave the pool at once, and requests
 * already on them finish (those hold references). A failed lookup keeps the last good set.
 *
 * Discovered replicas are owned here (one reference each) and pushed into the pool of the
 * current generation, so a reload keeps them (and their attestation state).
 *
 * Bounds, so a DNS answer cannot grow the process without limit: at most `max_replicas` addresses
 * per pool (addresses already known keep their place; the rest of a larger answer is ignored and
 * logged). An address that leaves is kept aside, unattested, for GONE_REFRESHES refreshes: if it
 * comes back it is the same replica (its counters and series continue) but attested again before
 * any traffic; if not, it is freed and its metric series go with it. Attestation itself is paced by
 * attest.c. */
#include "proxy/control/discovery.h"

#include <netdb.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "proxy/control/attest.h"
#include "proxy/data/admission.h"
#include "proxy/data/shadow.h"
#include "proxy/core/gen.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"
#include "proxy/data/worker.h"

typedef struct disc_s {
    px_t *px;
    char *pool; /* pool name */
    char *key;  /* dns + port + attest: a reload that changes these starts over */
    uv_timer_t timer;
    uv_getaddrinfo_t req;
    bool resolving;
    bool dead;
    bool timer_closed; /* freed once the timer closed and no lookup is running */
    px_replica_t **reps;
    size_t nreps;
    struct {
        px_replica_t *r;
        uint64_t left_ms;
    } * gone; /* addresses that left DNS lately, oldest first (see above) */
    size_t ngone;
    size_t last_capped; /* addresses ignored at the last refresh (logged when it changes) */
    size_t last_taken;  /* addresses whose name a configured replica has (logged the same way) */
    struct disc_s *next;
} disc_t;

#define GONE_REFRESHES 10

struct px_discovery_s {
    disc_t *list;
};
typedef struct px_discovery_s disc_ctx_t;

/* Everything discovered replicas were attested against: a reload that changes any of it
 * (the name, the port, how to attest, or the manifest they must match) starts over, so every
 * discovered replica is pending again until it is attested against the new definition. */
static char *disc_key(const cfg_pool_t *p)
{
    const cfg_discovery_t *d = p->discovery;
    const cfg_manifest_t *m = p->manifest;
    dp_buf_t k = {0};
    dp_buf_printf(&k, "%s:%u:%d:%u:%s:%s", d->dns, d->port, (int)d->attest_source, d->attest_port,
                  m ? m->fingerprint : "",
                  m && m->canary && m->canary->expected_sha256 ? m->canary->expected_sha256 : "");
    return dp_buf_steal(&k);
}

static void addr_name(const struct sockaddr *sa, char *out, size_t n, char *ip, size_t iplen)
{
    if (sa->sa_family == AF_INET6) {
        uv_ip6_name((const struct sockaddr_in6 *)sa, ip, iplen);
        snprintf(out, n, "[%s]", ip);
    } else {
        uv_ip4_name((const struct sockaddr_in *)sa, ip, iplen);
        snprintf(out, n, "%s", ip);
    }
}

/* Make pool p of the current generation hold exactly its static replicas plus ours. */
static bool in_set(const disc_t *d, const px_replica_t *r)
{
    for (size_t k = 0; k < d->nreps; k++)
        if (d->reps[k] == r)
            return true;
    return false;
}

static bool pool_matches(const disc_t *d, const px_pool_t *p)
{
    size_t ours = 0;
    for (size_t i = 0; i < p->nreplicas; i++) {
        if (!p->replicas[i]->discovered)
            continue;
        if (!in_set(d, p->replicas[i]))
            return false;
        ours++;
    }
    return ours == d->nreps;
}

static void push_into_pool(disc_t *d)
{
    px_pool_t *p = px_gen_pool_by_name(d->px->gen, d->pool);
    if (p == NULL || pool_matches(d, p))
        return;
    /* Workers read the published generation's pools: change a copy, then publish it. */
    p = px_gen_pool_by_name(px_gen_writable(d->px), d->pool);
    /* Drop discovered replicas that are no longer in our set. */
    for (size_t i = 0; i < p->nreplicas;) {
        px_replica_t *r = p->replicas[i];
        bool keep = !r->discovered;
        for (size_t k = 0; !keep && k < d->nreps; k++)
            keep = d->reps[k] == r;
        if (keep) {
            i++;
            continue;
        }
        px_pool_remove_replica(p, r); /* shifts the array */
    }
    for (size_t k = 0; k < d->nreps; k++) {
        /* One the config took over (gen.c) is the config's to place: a reload that listed it
         * and then dropped it again has dropped it. The next refresh lets go of it. */
        bool present = !d->reps[k]->discovered;
        for (size_t i = 0; i < p->nreplicas && !present; i++)
            present = p->replicas[i] == d->reps[k];
        if (!present) {
            px_replica_ref(d->reps[k]);
            px_pool_push_replica(p, d->reps[k]);
        }
    }
}

static void timer_cb(uv_timer_t *t);

static void gone_drop(disc_t *d, size_t i)
{
    px_replica_unref(d->gone[i].r);
    memmove(&d->gone[i], &d->gone[i + 1], (d->ngone - i - 1) * sizeof(*d->gone));
    d->ngone--;
}

/* An address left DNS: out of the pool (by the caller), no more attestation, kept aside. */
static void gone_add(disc_t *d, px_replica_t *r, uint32_t max)
{
    px_attest_replica_free(r);
    while (d->ngone >= max)
        gone_drop(d, 0);
    d->gone = dp_xrealloc(d->gone, (d->ngone + 1) * sizeof(*d->gone));
    d->gone[d->ngone].r = r;
    d->gone[d->ngone].left_ms = uv_now(d->px->loop);
    d->ngone++;
}

/* The replica called `name` that left lately, taken back (one reference), or NULL. It is
 * attested again before it gets traffic: the address may now be another pod. */
static px_replica_t *gone_take(disc_t *d, const char *name)
{
    for (size_t i = 0; i < d->ngone; i++) {
        px_replica_t *r = d->gone[i].r;
        if (!r->discovered || strcmp(r->name, name) != 0)
            continue; /* (a replica the config took over is no longer ours to bring back) */
        memmove(&d->gone[i], &d->gone[i + 1], (d->ngone - i - 1) * sizeof(*d->gone));
        d->ngone--;
        const char *why[] = {"back in DNS: attesting again", NULL};
        px_replica_set_state(r, PX_REPLICA_PENDING, why);
        return r;
    }
    return NULL;
}

static void gone_expire(disc_t *d, uint64_t keep_ms)
{
    uint64_t now = uv_now(d->px->loop);
    while (d->ngone && now - d->gone[0].left_ms >= keep_ms)
        gone_drop(d, 0);
}

/* A new address in the answer: the replica that left from it lately, or a new one (one
 * reference either way). */
static px_replica_t *adopt_address(disc_t *d, px_pool_t *p, const cfg_discovery_t *dc,
                                   const char *host, const char *name)
{
    px_replica_t *r = gone_take(d, name);
    bool returned = r != NULL;
    if (r == NULL) {
        cfg_replica_t def = {0};
        def.name = (char *)name;
        char url[128];
        snprintf(url, sizeof(url), "http://%s:%u", host, dc->port);
        const char *why;
        cfg_parse_url(url, &def.url, &why);
        def.attest.source = dc->attest_source;
        if (dc->attest_source == CFG_ATTEST_AGENT) {
            snprintf(url, sizeof(url), "http://%s:%u/attestation", host, dc->attest_port);
            cfg_parse_url(url, &def.attest.url, &why);
        }
        r = px_replica_new_detached(d->px, p, &def);
        r->discovered = true;
        cfg_url_free(&def.url);
        cfg_url_free(&def.attest.url);
    }
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, returned ? "discovery_returned" : "discovery_added");
    if (w) {
        dp_jw_str(w, "pool", d->pool);
        dp_jw_str(w, "replica", name);
        dp_log_end(w);
    }
    return r;
}

static void resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    disc_t *d = req->data;
    d->resolving = false;
    if (d->dead) {
        uv_freeaddrinfo(res);
        if (d->timer_closed) {
            free(d->pool);
            free(d->key);
            free(d);
        }
        return;
    }
    px_pool_t *p = px_gen_pool_by_name(d->px->gen, d->pool);
    const cfg_discovery_t *dc = p ? p->cfg->discovery : NULL;
    if (status != 0 || dc == NULL) {
        dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "discovery_failed");
        if (w) {
            dp_jw_str(w, "pool", d->pool);
            dp_jw_str(w, "error", status ? uv_strerror(status) : "pool gone");
            dp_jw_uint(w, "kept", d->nreps);
            dp_log_end(w);
        }
        uv_freeaddrinfo(res);
        if (dc)
            uv_timer_start(&d->timer, timer_cb, dc->refresh_ms, 0);
        return;
    }
    /* The new set, by name ("10.0.0.11:8000"); duplicates (A records repeated per socktype)
     * collapse. */
    px_replica_t **next = NULL;
    size_t nnext = 0, capped = 0, taken = 0;
    bool changed = false;
    /* Two passes: addresses already known first, so a larger answer never displaces them. */
    for (int pass = 0; pass < 2; pass++) {
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
            if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6)
                continue;
            char host[64], ip[INET6_ADDRSTRLEN];
            addr_name(ai->ai_addr, host, sizeof(host), ip, sizeof(ip));
            char name[96];
            snprintf(name, sizeof(name), "%s:%u", host, dc->port);
            bool dup = false;
            for (size_t k = 0; k < nnext && !dup; k++)
                dup = strcmp(next[k]->name, name) == 0;
            if (dup)
                continue;
            /* A configured replica of the pool already has this name: two replicas of one name
             * would share its metrics, its admin drain and, in a fleet, its etcd keys. (A reload
             * that configures an address discovery found takes over that very replica, as its
             * definition is the same: it is the config's from then on.) */
            bool named = false;
            for (size_t k = 0; k < p->nreplicas && !named; k++)
                named = !p->replicas[k]->discovered && strcmp(p->replicas[k]->name, name) == 0;
            if (named) {
                taken += pass == 0;
                continue;
            }
            px_replica_t *r = NULL;
            for (size_t k = 0; k < d->nreps && r == NULL; k++)
                if (d->reps[k]->discovered && strcmp(d->reps[k]->name, name) == 0)
                    r = d->reps[k];
            if ((r != NULL) != (pass == 0))
                continue;
            if (nnext >= dc->max_replicas) {
                capped++;
                continue;
            }
            if (r) {
                px_replica_ref(r);
            } else {
                r = adopt_address(d, p, dc, host, name);
                changed = true;
            }
            next = dp_xrealloc(next, (nnext + 1) * sizeof(*next));
            next[nnext++] = r;
        }
    }
    uv_freeaddrinfo(res);
    if (taken != d->last_taken) {
        d->last_taken = taken;
        dp_jw_t *w = dp_log_begin(taken ? DP_LOG_WARN : DP_LOG_INFO, "discovery_name_taken");
        if (w) {
            dp_jw_str(w, "pool", d->pool);
            dp_jw_uint(w, "ignored", taken);
            dp_jw_str(w, "detail",
                      "an address named like a configured replica of the pool is "
                      "that replica's, not a second one");
            dp_log_end(w);
        }
    }
    if (capped != d->last_capped) {
        d->last_capped = capped;
        dp_jw_t *w = dp_log_begin(capped ? DP_LOG_WARN : DP_LOG_INFO, "discovery_capped");
        if (w) {
            dp_jw_str(w, "pool", d->pool);
            dp_jw_uint(w, "max_replicas", dc->max_replicas);
            dp_jw_uint(w, "ignored", capped);
            dp_log_end(w);
        }
    }
    gone_expire(d, (uint64_t)dc->refresh_ms * GONE_REFRESHES);
    for (size_t k = 0; k < d->nreps; k++) {
        bool kept = false;
        for (size_t j = 0; j < nnext && !kept; j++)
            kept = next[j] == d->reps[k];
        if (!kept && !d->reps[k]->discovered) {
            px_replica_unref(d->reps[k]); /* taken over by the config: not ours to drain */
            continue;
        }
        if (!kept) {
            changed = true;
            dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "discovery_removed");
            if (w) {
                dp_jw_str(w, "pool", d->pool);
                dp_jw_str(w, "replica", d->reps[k]->name);
                dp_jw_str(w, "detail", "draining: in-flight requests finish, no new ones");
                dp_log_end(w);
            }
            px_shadow_forget_replica(d->px, d->pool, d->reps[k]->name);
            gone_add(d, d->reps[k], dc->max_replicas); /* takes our reference */
            continue;
        }
        px_replica_unref(d->reps[k]);
    }
    free(d->reps);
    d->reps = next;
    d->nreps = nnext;
    if (changed) {
        px_admission_check_engines(d->px);
        push_into_pool(d);
        px_workers_publish(d->px);
        px_attest_sync(d->px);
    }
    uv_timer_start(&d->timer, timer_cb, dc->refresh_ms, 0);
}

static void resolve_now(disc_t *d)
{
    px_pool_t *p = px_gen_pool_by_name(d->px->gen, d->pool);
    if (p == NULL || p->cfg->discovery == NULL || d->resolving)
        return;
    const cfg_discovery_t *dc = p->cfg->discovery;
    struct addrinfo hints = {0};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    d->req.data = d;
    d->resolving = true;
    if (uv_getaddrinfo(d->px->loop, &d->req, resolved, dc->dns, NULL, &hints) != 0) {
        d->resolving = false;
        uv_timer_start(&d->timer, timer_cb, dc->refresh_ms, 0);
    }
}

static void timer_cb(uv_timer_t *t)
{
    resolve_now(t->data);
}

static void disc_timer_closed(uv_handle_t *h)
{
    disc_t *d = h->data;
    d->timer_closed = true;
    if (d->resolving)
        return; /* `resolved` frees it when the lookup comes back */
    free(d->pool);
    free(d->key);
    free(d);
}

static void disc_free(disc_t *d)
{
    d->dead = true;
    for (size_t k = 0; k < d->nreps; k++)
        px_replica_unref(d->reps[k]);
    free(d->reps);
    d->reps = NULL;
    d->nreps = 0;
    while (d->ngone)
        gone_drop(d, d->ngone - 1);
    free(d->gone);
    d->gone = NULL;
    if (d->resolving)
        uv_cancel((uv_req_t *)&d->req);
    uv_close((uv_handle_t *)&d->timer, disc_timer_closed);
}

void px_discovery_sync(px_t *px)
{
    disc_ctx_t *c = px->discovery;
    if (c == NULL)
        c = px->discovery = dp_xcalloc(1, sizeof(*c));
    /* Pools that no longer discover (or discover something else) stop. */
    for (disc_t **pp = &c->list; *pp;) {
        disc_t *d = *pp;
        px_pool_t *p = px_gen_pool_by_name(px->gen, d->pool);
        char *key = p && p->cfg->discovery ? disc_key(p->cfg) : NULL;
        bool keep = key && strcmp(key, d->key) == 0;
        free(key);
        if (keep) {
            push_into_pool(d);
            pp = &d->next;
            continue;
        }
        *pp = d->next;
        disc_free(d);
    }
    for (size_t i = 0; i < px->gen->npools; i++) {
        px_pool_t *p = &px->gen->pools[i];
        if (p->cfg->discovery == NULL)
            continue;
        bool have = false;
        for (disc_t *d = c->list; d && !have; d = d->next)
            have = strcmp(d->pool, p->name) == 0;
        if (have)
            continue;
        disc_t *d = dp_xcalloc(1, sizeof(*d));
        d->px = px;
        d->pool = dp_xstrdup(p->name);
        d->key = disc_key(p->cfg);
        uv_timer_init(px->loop, &d->timer);
        d->timer.data = d;
        d->next = c->list;
        c->list = d;
        resolve_now(d);
    }
}

void px_discovery_stop(px_t *px)
{
    disc_ctx_t *c = px->discovery;
    if (c == NULL)
        return;
    while (c->list) {
        disc_t *d = c->list;
        c->list = d->next;
        disc_free(d);
    }
    free(c);
    px->discovery = NULL;
}
