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
    if (strict && rc == 0 && errs.nwarnings > 0) {
        fprintf(stderr, "error: --strict: %zu %s\n", errs.nwarnings,
                plural(errs.nwarnings, "warning", "warnings"));
        rc = 1;
    }
    if (cfg != NULL && rc == 0)
        print_summary(cfg);
    cfg_free(cfg);
    cfg_errors_free(&errs);
    return rc;
}
