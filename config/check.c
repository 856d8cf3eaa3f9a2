/* `detproxy check -c CONFIG [--strict]`: load the config as `run` would and print every
 * problem. Exit 0 valid, 1 invalid (or, with --strict, any warning), 2 usage (docs/README.md,
 * "Commands"). */
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "common/args.h"
#include "common/util.h"
#include "config/config.h"

typedef struct {
    const char *config;
    bool strict;
} check_opts_t;

static const dp_arg_t check_table[] = {
    {.name = "--config",
     .shortopt = 'c',
     .kind = DP_ARG_STR,
     .off = offsetof(check_opts_t, config),
     .meta = "CONFIG",
     .help = "config file to check",
     .flags = DP_ARG_REQUIRED | DP_ARG_ONCE},
    {.name = "--strict",
     .kind = DP_ARG_FLAG,
     .off = offsetof(check_opts_t, strict),
     .help = "warnings are errors (for CI): a replica that can never be\n"
             "admitted, a secret file readable by others, ... exit 1"},
};

static const dp_args_t check_spec = {
    .prog = "detproxy check",
    .usage = "detproxy check -c CONFIG [--strict]",
    .about = "Validate a config file with the manifests, policy, keys, certificates and secret\n"
             "files it names. Prints each problem as 'error: <json path>: <message>' (warnings as\n"
             "'warning: ...') on stderr, and a one-line summary on stdout when valid.",
    .opts = check_table,
    .nopts = DP_ARRAY_SIZE(check_table),
    .epilog = "exit codes: 0 valid, 1 invalid (or a warning under --strict), 2 usage error",
};

static const char *plural(size_t n, const char *one, const char *many)
{
    return n == 1 ? one : many;
}

static void print_summary(const cfg_t *cfg)
{
    size_t replicas = 0, discovered = 0;
    for (size_t i = 0; i < cfg->npools; i++) {
        replicas += cfg->pools[i].nreplicas;
        discovered += cfg->pools[i].discovery != NULL;
    }
    size_t tenants = cfg->policy->ntenants;
    printf("ok: %zu %s, %zu %s, %zu %s", cfg->npools, plural(cfg->npools, "pool", "pools"),
           replicas, plural(replicas, "replica", "replicas"), tenants,
           plural(tenants, "tenant", "tenants"));
    if (discovered > 0)
        printf(" (+ DNS discovery in %zu %s)", discovered, plural(discovered, "pool", "pools"));
    putchar('\n');
}

/* A pool whose model nothing is known to measure: its replicas are attested by an agent, which
 * measures its engine only when started with --framework-url (a flag of the agent, not of this
 * config), and its manifest has no canary, the one check of what the engine actually runs
 * (docs/attestation.md §4, §6). Native adapters read the engine's own report; a pool without a
 * manifest pins nothing. One warning per pool, at its first agent source. */
static size_t warn_unmeasured(const cfg_t *cfg)
{
    size_t n = 0;
    for (size_t i = 0; i < cfg->npools; i++) {
        const cfg_pool_t *p = &cfg->pools[i];
        if (p->manifest == NULL || p->manifest->canary != NULL)
            continue;
        char at[96] = "";
        for (size_t j = 0; j < p->nreplicas && at[0] == '\0'; j++)
            if (p->replicas[j].attest.source == CFG_ATTEST_AGENT)
                snprintf(at, sizeof(at), "pools[%zu].replicas[%zu].attest", i, j);
        if (at[0] == '\0' && p->discovery && p->discovery->attest_source == CFG_ATTEST_AGENT)
            snprintf(at, sizeof(at), "pools[%zu].discovery.attest", i);
        if (at[0] == '\0')
            continue;
        fprintf(stderr,
                "warning: %s: an agent measures its engine only when started with "
                "--framework-url, which this config cannot show, and the manifest has no canary: "
                "if the agent repeats its flags, nothing checks what the engine runs (add "
                "manifest.canary; docs/attestation.md §4)\n",
                at);
        n++;
    }
    return n;
}

int cfg_cmd_check(int argc, char **argv)
{
    check_opts_t o = {0};
    int rc = dp_args_parse(&check_spec, argc, argv, &o);
    if (rc != 0)
        return dp_args_exit(rc);
    const char *path = o.config;
    bool strict = o.strict;

    cfg_errors_t errs = {0};
    cfg_t *cfg = NULL;
    rc = cfg_load(path, &cfg, &errs) == 0 ? 0 : 1;
    for (size_t i = 0; i < errs.count; i++)
        fprintf(stderr, "error: %s\n", errs.items[i]);
    for (size_t i = 0; i < errs.nwarnings; i++)
        fprintf(stderr, "warning: %s\n", errs.warnings[i]);
    size_t nwarn = errs.nwarnings + (cfg != NULL ? warn_unmeasured(cfg) : 0);
    if (strict && rc == 0 && nwarn > 0) {
        fprintf(stderr, "error: --strict: %zu %s\n", nwarn, plural(nwarn, "warning", "warnings"));
        rc = 1;
    }
    if (cfg != NULL && rc == 0)
        print_summary(cfg);
    cfg_free(cfg);
    cfg_errors_free(&errs);
    return rc;
}
