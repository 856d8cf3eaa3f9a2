/* `detproxy rollout report -c CONFIG [--pool P] [--candidate C] [--fleet] [--json]
 * [--admin HOST:PORT]` (docs/rollouts.md): the running proxy's GET /admin/rollouts as a table,
 * or as JSON; --fleet: its "fleet" member instead (the fleet's pooled verdicts, docs/fleet.md).
 * Exit 1 when a candidate (or any tenant's samples of one) diverges, so a CD pipeline can gate a
 * rollout on it (--candidate: that one only); 0 otherwise; 2 usage; 3 when the admin API cannot be
 * read or its answer is not the admin API's. Only pools and candidates the config names are shown
 * or judged, and every string of the answer is escaped for the terminal. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/args.h"
#include "common/util.h"
#include "config/config.h"
#include "proxy/cli/cli.h"
#include "proxy/cli/fetch.h"

#define CMD "detproxy rollout report"

typedef struct {
    const char *config, *pool, *candidate, *admin;
    bool json, fleet;
    uint64_t timeout_s;
} rollout_opts_t;

#define ROLLOUT_TIMEOUT_S 30

static const dp_arg_t rollout_table[] = {
    {.name = "--config",
     .shortopt = 'c',
     .kind = DP_ARG_STR,
     .off = offsetof(rollout_opts_t, config),
     .meta = "CONFIG",
     .help = "the proxy's configuration (admin_listen, admin_token_file)",
     .flags = DP_ARG_REQUIRED},
    {.name = "--pool",
     .kind = DP_ARG_STR,
     .off = offsetof(rollout_opts_t, pool),
     .meta = "P",
     .help = "only the candidates of baseline pool P"},
    {.name = "--candidate",
     .kind = DP_ARG_STR,
     .off = offsetof(rollout_opts_t, candidate),
     .meta = "C",
     .help = "only candidate pool C (the exit code gates it alone)"},
    {.name = "--fleet",
     .kind = DP_ARG_FLAG,
     .off = offsetof(rollout_opts_t, fleet),
     .help = "the fleet's verdicts (samples pooled over its members) instead of this instance's"},
    {.name = "--json",
     .kind = DP_ARG_FLAG,
     .off = offsetof(rollout_opts_t, json),
     .help = "print the admin API's JSON instead of a table"},
    {.name = "--admin",
     .kind = DP_ARG_STR,
     .off = offsetof(rollout_opts_t, admin),
     .meta = "HOST:PORT",
     .help = "the admin API, when admin_listen does not say (port 0)"},
    {.name = "--timeout",
     .kind = DP_ARG_UINT,
     .off = offsetof(rollout_opts_t, timeout_s),
     .meta = "SECONDS",
     .min = 1,
     .max = 86400,
     .help = "give up on an admin API that has not answered by then (default 30):\n"
             "a gate does not wait on a wedged proxy"},
};

static const dp_args_t rollout_spec = {
    .prog = CMD,
    .usage = "detproxy rollout report -c CONFIG [--pool P] [--candidate C] [--fleet]\n"
             "                               [--json] [--admin HOST:PORT] [--timeout S]",
    .about = "Candidate pools (a pool's \"candidates\") judged against the baseline pool's own\n"
             "noise, read from the running proxy's GET /admin/rollouts: per candidate and per\n"
             "tenant, samples, exact-match rate, mean similarity, median divergence offset and\n"
             "a verdict (equivalent, diverges, insufficient_data) with its reasons\n"
             "(docs/rollouts.md).",
    .opts = rollout_table,
    .nopts = DP_ARRAY_SIZE(rollout_table),
    .epilog = "Exit codes: 0 no candidate diverges (--candidate: that one does not), 1 one\n"
              "does, 2 usage error, 3 the admin API could not be read, did not answer within\n"
              "--timeout, or did not answer with a rollouts array (--fleet: the proxy is in no\n"
              "fleet).",
};

static const char *str(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static double num(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static void pct(char *out, size_t n, double v)
{
    if (isnan(v))
        snprintf(out, n, "-");
    else
        snprintf(out, n, "%.1f%%", 100.0 * v);
}

/* One row: the overall line of a candidate (label = candidate) or a tenant's (indented). */
static void row(const char *pool, const char *label, const cJSON *o, const cJSON *noise)
{
    char exact[16], sim[16], off[24], nz[48], nr[16];
    pct(exact, sizeof(exact), num(o, "exact_match_rate"));
    double s = num(o, "mean_similarity");
    snprintf(sim, sizeof(sim), isnan(s) ? "-" : "%.3f", s);
    double m = num(o, "median_divergence_offset");
    snprintf(off, sizeof(off), isnan(m) ? "-" : "%.0f", m);
    if (noise && str(noise, "source")) {
        pct(nr, sizeof(nr), num(noise, "divergence_rate"));
        snprintf(nz, sizeof(nz), "%s (%s, n=%.0f)", nr, str(noise, "source"),
                 num(noise, "samples"));
    } else {
        snprintf(nz, sizeof(nz), noise ? "unknown" : "");
    }
    const char *v = str(o, "verdict");
    printf("%-16s %-22s %-18s %7.0f %7s %10s %10s  %s\n", px_fetch_safe(0, pool),
           px_fetch_safe(1, label), v ? px_fetch_safe(2, v) : "?", num(o, "samples"), exact, sim,
           off, px_fetch_safe(3, nz));
    const cJSON *it;
    cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(o, "reasons"))
    {
        if (cJSON_IsString(it))
            printf("%-16s   - %s\n", "", px_fetch_safe(0, it->valuestring));
    }
    const cJSON *ex = cJSON_GetObjectItemCaseSensitive(o, "example_request_ids");
    if (v && strcmp(v, "diverges") == 0 && cJSON_GetArraySize(ex) > 0) {
        printf("%-16s   - example request ids:", "");
        cJSON_ArrayForEach(it, ex)
        {
            if (cJSON_IsString(it))
                printf(" %s", px_fetch_safe(0, it->valuestring));
        }
        putchar('\n');
    }
}

/* A rollout the config has: baseline and candidate both pools of the config, the candidate
 * among the baseline's candidates, and the one asked for (--candidate). Anything else in the
 * answer is not shown and gates nothing. */
static bool wanted(const cfg_t *cfg, const cJSON *r, const char *cand_only)
{
    const char *pool = str(r, "pool"), *cand = str(r, "candidate");
    if (!pool || !cand || (cand_only && strcmp(cand, cand_only) != 0))
        return false;
    const cfg_pool_t *p = cfg_pool_by_name(cfg, pool);
    if (p == NULL || cfg_pool_by_name(cfg, cand) == NULL)
        return false;
    for (size_t i = 0; i < p->ncandidates; i++)
        if (strcmp(p->candidates[i].pool, cand) == 0)
            return true;
    return false;
}

static void table(const cfg_t *cfg, const cJSON *doc, const char *only, const char *cand_only)
{
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(doc, "rollouts");
    size_t shown = 0;
    const cJSON *r;
    cJSON_ArrayForEach(r, arr) shown += wanted(cfg, r, cand_only);
    if (shown == 0) {
        if (cand_only)
            printf("candidate %s has no rollout%s%s\n", cand_only, only ? " in pool " : "",
                   only ? only : "");
        else if (only)
            printf("pool %s has no candidates\n", only);
        else
            printf("no pool has candidates (a pool's \"candidates\": [{\"pool\", \"rate\"}])\n");
        return;
    }
    printf("%-16s %-22s %-18s %7s %7s %10s %10s  %s\n", "POOL", "CANDIDATE", "VERDICT", "SAMPLES",
           "EXACT", "SIMILARITY", "MEDIAN_OFF", "BASELINE NOISE");
    cJSON_ArrayForEach(r, arr)
    {
        const char *pool = str(r, "pool"), *cand = str(r, "candidate");
        if (!wanted(cfg, r, cand_only))
            continue;
        row(pool, cand, r, cJSON_GetObjectItemCaseSensitive(r, "baseline_noise"));
        const cJSON *t;
        cJSON_ArrayForEach(t, cJSON_GetObjectItemCaseSensitive(r, "tenants"))
        {
            char label[160];
            snprintf(label, sizeof(label), "  tenant %s", t->string ? t->string : "?");
            row("", label, t, NULL);
        }
    }
}

static bool any_diverges(const cfg_t *cfg, const cJSON *doc, const char *cand_only)
{
    const cJSON *r;
    cJSON_ArrayForEach(r, cJSON_GetObjectItemCaseSensitive(doc, "rollouts"))
    {
        if (!wanted(cfg, r, cand_only))
            continue;
        const char *v = str(r, "verdict");
        if (v && strcmp(v, "diverges") == 0)
            return true;
        const cJSON *t;
        cJSON_ArrayForEach(t, cJSON_GetObjectItemCaseSensitive(r, "tenants"))
        {
            v = str(t, "verdict");
            if (v && strcmp(v, "diverges") == 0)
                return true;
        }
    }
    return false;
}

int px_cmd_rollout(int argc, char **argv)
{
    int sub = dp_args_subcommand(&rollout_spec, argc, argv, "report");
    if (sub >= 0)
        return sub;
    rollout_opts_t o = {0};
    int r = dp_args_parse(&rollout_spec, argc - 1, argv + 1, &o);
    if (r != 0)
        return dp_args_exit(r);
    const char *cpath = o.config, *pool = o.pool, *admin = o.admin, *cand = o.candidate;
    bool json = o.json;
    cfg_t *cfg = px_fetch_config(cpath);
    if (cfg == NULL)
        return 2;
    if (pool && cfg_pool_by_name(cfg, pool) == NULL) {
        fprintf(stderr, CMD ": --pool %s: the configuration has no pool of that name\n", pool);
        cfg_free(cfg);
        return 2;
    }
    /* A gate on a pool that is not a candidate (of --pool, when given; of any pool else) would
     * pass without judging anything: a typo of another name. */
    const cfg_pool_t *cp = cand ? cfg_pool_by_name(cfg, cand) : NULL;
    bool tried = false;
    for (size_t i = 0; cp && i < cfg->npools; i++) {
        const cfg_pool_t *b = &cfg->pools[i];
        for (size_t k = 0; (!pool || strcmp(b->name, pool) == 0) && k < b->ncandidates; k++)
            tried |= strcmp(b->candidates[k].pool, cand) == 0;
    }
    if (cand && !tried) {
        fprintf(stderr, CMD ": --candidate %s: %s%s\n", px_fetch_safe(0, cand),
                cp == NULL ? "the configuration has no pool of that name"
                : pool     ? "not a candidate of pool "
                           : "no pool names it in its candidates",
                cp && pool ? px_fetch_safe(1, pool) : "");
        cfg_free(cfg);
        return 2;
    }
    cfg_addr_t addr;
    if (px_fetch_admin_addr(CMD, cfg, admin, &addr) != 0) {
        cfg_free(cfg);
        return 2;
    }
    /* Pool names are of A-Z a-z 0-9 . _ - : / (config rule): nothing to escape in a query. */
    char target[300];
    snprintf(target, sizeof(target), "/admin/rollouts%s%s", pool ? "?pool=" : "", pool ? pool : "");
    px_fetch_t w;
    px_fetch_init(&w);
    w.deadline_ns = dp_now_ns() + (o.timeout_s ? o.timeout_s : ROLLOUT_TIMEOUT_S) * 1000000000ull;
    int rc = 3;
    if (px_fetch_admin_get(&w, CMD, cfg, &addr, target) == 0) {
        cJSON *all = cJSON_ParseWithLength(w.body.base, w.body.len);
        cJSON *doc = all;
        if (o.fleet && cJSON_IsObject(all) &&
            cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(all, "rollouts")))
            doc = cJSON_GetObjectItemCaseSensitive(all, "fleet");
        if (o.fleet && doc == NULL) {
            fprintf(stderr,
                    CMD ": --fleet: the proxy is in no fleet (its config has no fleet section)\n");
        } else if (!cJSON_IsObject(doc) ||
                   !cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(doc, "rollouts"))) {
            fprintf(stderr,
                    CMD ": GET %s: the answer is not the admin API's (no JSON object with "
                        "a rollouts array)\n",
                    target);
        } else {
            if (json) {
                /* Re-printed from the parse, without the rollouts the config does not have. */
                cJSON *arr = cJSON_GetObjectItemCaseSensitive(doc, "rollouts");
                for (int i = cJSON_GetArraySize(arr) - 1; i >= 0; i--)
                    if (!wanted(cfg, cJSON_GetArrayItem(arr, i), cand))
                        cJSON_DeleteItemFromArray(arr, i);
                char *txt = cJSON_PrintUnformatted(doc);
                printf("%s\n", txt ? txt : "{}");
                free(txt);
            } else {
                table(cfg, doc, pool, cand);
            }
            rc = any_diverges(cfg, doc, cand) ? 1 : 0;
        }
        cJSON_Delete(all);
    }
    px_fetch_free(&w);
    free(addr.host);
    cfg_free(cfg);
    return rc;
}
