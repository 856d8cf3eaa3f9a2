/* The `detproxy attest ...` command line: its offline commands (cli.c, oms_cli.c), and the
 * pieces shared with the two that need the network, `attest serve` (agent/agent.c) and
 * `attest canary` (diagnose/canary_cmd.c). */
#ifndef ATTEST_CLI_H
#define ATTEST_CLI_H

#include <stdbool.h>
#include <stddef.h>

/* Exit codes (docs/README.md, "Commands"). */
enum { ATTEST_EXIT_OK = 0, ATTEST_EXIT_FAILED = 1, ATTEST_EXIT_USAGE = 2, ATTEST_EXIT_RUNTIME = 3 };

/* One long option. Values are borrowed from argv. A repeatable option appends to vals. */
typedef struct {
    const char *name; /* "--out" */
    bool has_value;
    const char **val;  /* single value (the last one given wins) */
    bool *set;         /* flags without a value */
    const char **vals; /* repeatable: array of at least max_vals */
    size_t *nvals;
    size_t max_vals;
} attest_opt_t;

/* Parse argv[1..] ("--name value", "--name=value", "--" ends options). Positional arguments go
 * to pos (at most maxpos). Returns 0, 1 when --help/-h was given, or -1 after printing a one-line
 * reason to stderr ("detproxy attest CMD: ..."). */
int attest_parse_args(const char *cmd, int argc, char **argv, const attest_opt_t *opts,
                      size_t nopts, const char **pos, size_t maxpos, size_t *npos);

/* `detproxy attest hash|keygen|verify|oms` (cli.c). argv[0] is "attest". `attest serve` (the
 * agent, agent/) and `attest canary` (diagnose/) need the network and are dispatched by main.c.
 * Returns the exit code. */
int attest_cmd_main(int argc, char **argv);
/* `detproxy attest oms ...` (oms_cli.c). argv[0] is "oms". Returns the exit code. */
int attest_oms_main(int argc, char **argv);

#endif
