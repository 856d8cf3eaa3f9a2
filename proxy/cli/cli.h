/* The proxy's subcommands of the detproxy binary (main.c dispatches; the other modules' are in
 * their own headers: config/config.h `check`, attest/cli.h `attest`, agent/agent.h
 * `attest serve`, diagnose/diagnose.h `diagnose` and `attest canary`). Each takes argc/argv
 * starting at its own name, parses its options with common/args.h and returns the process exit
 * code (DP_EXIT_*: 0 ok, 1 check/diagnosis failed, 2 usage, 3 runtime; docs/README.md,
 * "Commands"). */
#ifndef PX_CLI_H
#define PX_CLI_H

int px_cmd_run(int argc, char **argv);     /* proxy/control/run.c */
int px_cmd_policy(int argc, char **argv);  /* proxy/cli/policy.c: policy test */
int px_cmd_audit(int argc, char **argv);   /* proxy/cli/evidence.c: audit verify */
int px_cmd_replay(int argc, char **argv);  /* proxy/cli/evidence.c */
int px_cmd_rollout(int argc, char **argv); /* proxy/cli/rollout.c: rollout report */

#endif
