/* Subcommands of the detproxy binary. Each takes argc/argv starting at its own name and returns
 * the process exit code (SPEC §2: 0 ok, 1 check/diagnosis failed, 2 usage, 3 runtime). */
#ifndef PX_CLI_H
#define PX_CLI_H

int px_cmd_run(int argc, char **argv);      /* proxy/px_main.c */
int cfg_cmd_check(int argc, char **argv);   /* config/check.c */
int attest_cmd_main(int argc, char **argv); /* attest/cli.c: hash, keygen, serve, verify */
int dg_cmd_diagnose(int argc, char **argv); /* diagnose/diagnose.c */
int px_cmd_policy(int argc, char **argv);   /* proxy/px_policy_cli.c: policy test */
/* `attest canary` needs the proxy's client, so main.c dispatches it here (proxy/probe_canary_cmd.c)
 * rather than through attest_cmd_main. */
int dg_cmd_attest_canary(int argc, char **argv);

int px_cmd_audit(int argc, char **argv);  /* proxy/px_evidence_cli.c: audit verify */
int px_cmd_replay(int argc, char **argv); /* proxy/px_evidence_cli.c */

#endif
