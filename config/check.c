/* `detproxy check -c CONFIG [--strict]`: load the config as `run` would and print every
 * problem. Exit 0 valid, 1 invalid (or, with --strict, any warning), 2 usage (docs/README.md,
 * "Commands"). */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "config/config.h"

static void usage(FILE *f)
{
    fputs("usage: detproxy check -c CONFIG [--strict]\n"
          "\n"
          "Validate a config file with the manifests, policy, keys, certificates and secret\n"
          "files it names. Prints each problem as 'error: <json path>: <message>' (warnings as\n"
          "'warning: ...') on stderr, and a one-line summary on stdout when valid.\n"
          "\n"
          "options:\n"
          "  -c, --config FILE   config file to check\n"
          "  --strict            warnings are errors (for CI): a replica that can never be\n"
          "                      admitted, a secret file readable by others, ... exit 1\n"
          "  -h, --help          show this help\n"
          "\n"
          "exit codes: 0 valid, 1 invalid (or a warning under --strict), 2 usage error\n",
          f);
}

static int usage_error(const char *what, const char *arg)
{
    fprintf(stderr, "detproxy check: %s%s%s (try --help)\n", what, arg ? ": " : "", arg ? arg : "");
    return 2;
}

/* 0 with *config set, 1 for --help (already printed), or the exit code 2. */
static int parse_args(int argc, char **argv, const char **config, bool *strict)
{
    *config = NULL;
    *strict = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = NULL;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 1;
        }
        if (strcmp(a, "--strict") == 0) {
            *strict = true;
            continue;
        }
        if (strncmp(a, "--config=", 9) == 0) {
            val = a + 9;
        } else if (strcmp(a, "-c") == 0 || strcmp(a, "--config") == 0) {
            if (i + 1 >= argc)
                return usage_error("missing value for", a);
            val = argv[++i];
        } else {
            return usage_error(a[0] == '-' ? "unknown flag" : "unexpected argument", a);
        }
        if (*config != NULL)
            return usage_error("config given more than once", NULL);
        if (*val == '\0')
            return usage_error("empty value for", a);
        *config = val;
    }
    if (*config == NULL)
        return usage_error("missing -c CONFIG", NULL);
    return 0;
}

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
    const char *path;
    bool strict;
    int rc = parse_args(argc, argv, &path, &strict);
    if (rc != 0)
        return rc == 1 ? 0 : rc;

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
