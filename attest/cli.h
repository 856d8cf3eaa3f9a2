/* The `detproxy attest ...` offline commands: hash, keygen, verify (cli.c) and oms verify
 * (oms_cli.c). The two that need the network, `attest serve` (agent/agent.h) and
 * `attest canary` (diagnose/diagnose.h), are dispatched by main.c. Options are parsed with
 * common/args.h; exit codes are its DP_EXIT_*. */
#ifndef ATTEST_CLI_H
#define ATTEST_CLI_H

/* `detproxy attest hash|keygen|verify|oms` (cli.c). argv[0] is "attest". Returns the exit
 * code. */
int attest_cmd_main(int argc, char **argv);
/* `detproxy attest oms ...` (oms_cli.c). argv[0] is "oms". Returns the exit code. */
int attest_oms_main(int argc, char **argv);

#endif
