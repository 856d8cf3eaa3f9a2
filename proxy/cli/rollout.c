/* `detproxy rollout report -c CONFIG [--pool P] [--json] [--admin HOST:PORT]` (docs/rollouts.md):
 * the running proxy's GET /admin/rollouts as a table, or as it is with --json. Exit 1 when any
 * candidate (or any tenant's samples of one) diverges, so a CD pipeline can gate a rollout on
 * it; 0 otherwise; 2 usage; 3 when the admin API cannot be read. */
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
    const char *config, *pool, *admin;
    bool json;
} rollout_opts_t;

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
    {.name = "--json",
     .kind = DP_ARG_FLAG,
     .off = offsetof(rollout_opts_t, json),
     .help = "print the admin API's JSON instead of a table"},
    {.name = "--admin",
     .kind = DP_ARG_STR,
     .off = offsetof(rollout_opts_t, admin),
     .meta = "HOST:PORT",
     .help = "the admin API, when admin_listen does not say (port 0)"},
};

static const dp_args_t rollout_spec = {
    .prog = CMD,
    .usage = "detproxy rollout report -c CONFIG [--pool P] [--json] [--admin HOST:PORT]",
    .about = "Candidate pools (a pool's \"candidates\") judged against the baseline pool's own\n"
             "noise, read from the running proxy's GET /admin/rollouts: per candidate and per\n"
             "tenant, samples, exact-match rate, mean similarity, median divergence offset and\n"
             "a verdict (equivalent, diverges, insufficient_data) with its reasons\n"
             "(docs/rollouts.md).",
    .opts = rollout_table,
    .nopts = DP_ARRAY_SIZE(rollout_table),
    .epilog = "Exit codes: 0 no candidate diverges, 1 one does, 2 usage error, 3 the admin API\n"
              "could not be read.",
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
    printf("%-16s %-22s %-18s %7.0f %7s %10s %10s  %s\n", pool, label, v ? v : "?",
           num(o, "samples"), exact, sim, off, nz);
    const cJSON *it;
    cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(o, "reasons"))
    {
        if (cJSON_IsString(it))
            printf("%-16s   - %s\n", "", it->valuestring);
    }
    const cJSON *ex = cJSON_GetObjectItemCaseSensitive(o, "example_request_ids");
    if (v && strcmp(v, "diverges") == 0 && cJSON_GetArraySize(ex) > 0) {
        printf("%-16s   - example request ids:", "");
        cJSON_ArrayForEach(it, ex)
        {
            if (cJSON_IsString(it))
                printf(" %s", it->valuestring);
        }
        putchar('\n');
    }
}

static void table(const cJSON *doc, const char *only)
{
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(doc, "rollouts");
    if (cJSON_GetArraySize(arr) == 0) {
        if (only)
            printf("pool %s has no candidates\n", only);
        else
            printf("no pool has candidates (a pool's \"candidates\": [{\"pool\", \"rate\"}])\n");
        return;
    }
    printf("%-16s %-22s %-18s %7s %7s %10s %10s  %s\n", "POOL", "CANDIDATE", "VERDICT", "SAMPLES",
           "EXACT", "SIMILARITY", "MEDIAN_OFF", "BASELINE NOISE");
    const cJSON *r;
    cJSON_ArrayForEach(r, arr)
    {
        const char *pool = str(r, "pool"), *cand = str(r, "candidate");
        if (!pool || !cand)
            continue;
        row(pool, cand, r, cJSON_GetObjectItemCaseSensitive(r, "baseline_noise"));
        const cJSON *t;
        cJSON_ArrayForEach(t, cJSON_GetObjectItemCaseSensitive(r, "tenants"))
        {
            char label[160];
            snprintf(label, sizeof(label), "  tenant %s", t->string);
            row("", label, t, NULL);
        }
    }
}

static bool any_diverges(const cJSON *doc)
{
    const cJSON *r;
    cJSON_ArrayForEach(r, cJSON_GetObjectItemCaseSensitive(doc, "rollouts"))
    {
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
    if (argc < 2 || strcmp(argv[1], "report") != 0) {
        if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
            dp_args_help(&rollout_spec, stdout);
            return 0;
        }
        if (argc >= 2)
            fprintf(stderr, "detproxy rollout: unknown subcommand '%s'\n", argv[1]);
        dp_args_help(&rollout_spec, stderr);
        return 2;
    }
    rollout_opts_t o = {0};
    int r = dp_args_parse(&rollout_spec, argc - 1, argv + 1, &o);
    if (r != 0)
        return dp_args_exit(r);
    const char *cpath = o.config, *pool = o.pool, *admin = o.admin;
    bool json = o.json;
    cfg_t *cfg = px_fetch_config(cpath);
    if (cfg == NULL)
        return 2;
    if (pool && cfg_pool_by_name(cfg, pool) == NULL) {
        fprintf(stderr, CMD ": --pool %s: the configuration has no pool of that name\n", pool);
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
    int rc = 3;
    if (px_fetch_admin_get(&w, CMD, cfg, &addr, target) == 0) {
        cJSON *doc = cJSON_ParseWithLength(w.body.base, w.body.len);
        if (!cJSON_IsObject(doc)) {
            fprintf(stderr, CMD ": GET %s: the answer is not a JSON object\n", target);
        } else {
            if (json)
                printf("%.*s\n", (int)w.body.len, w.body.base);
            else
                table(doc, pool);
            rc = any_diverges(doc) ? 1 : 0;
        }
        cJSON_Delete(doc);
    }
    px_fetch_free(&w);
    free(addr.host);
    cfg_free(cfg);
    return rc;
}
