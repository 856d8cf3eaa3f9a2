/* detproxy: one binary, one subcommand per command of docs/README.md, "Commands". The top
 * layer: the one file that includes every program module (proxy, agent, diagnose), to dispatch
 * to them. Each command parses its own options (common/args.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "agent/agent.h"
#include "attest/cli.h"
#include "common/args.h"
#include "common/version.h"
#include "config/config.h"
#include "diagnose/diagnose.h"
#include "proxy/cli/cli.h"

static void usage(FILE *f)
{
    fputs("usage: detproxy <command> [options]\n"
          "\n"
          "commands:\n"
          "  run -c CONFIG            run the proxy (foreground, JSON-lines logs on stderr)\n"
          "  check -c CONFIG          validate config, manifests, policy and keys\n"
          "                           (--strict: warnings fail the check too, for CI)\n"
          "  policy test -c CONFIG    show what the policy does to a request body\n"
          "  attest hash DIR          print the checkpoint hash of a model directory\n"
          "  attest keygen --out P    write an Ed25519 key pair P.key.pem, P.pub.pem\n"
          "  attest serve ...         run the replica-side attestation agent\n"
          "  attest verify ...        verify a signed attestation offline\n"
          "  attest canary ...        run a pool's canary on a replica; print the hash to pin\n"
          "  attest oms verify ...    verify a model directory against an OpenSSF Model Signing "
          "bundle\n"
          "  diagnose -c CONFIG       run the isolation steps against a pool's replicas\n"
          "  audit verify FILE        check an audit file's chain, signatures, stored bodies\n"
          "  replay -c CONFIG ...     re-send audited requests, say whether they reproduce\n"
          "  rollout report -c CONFIG candidate pools judged against the baseline's noise\n"
          "  version, --version       print the version and the git commit it was built from\n"
          "\n"
          "Run 'detproxy <command> --help' for a command's options.\n"
          "Exit codes: 0 ok, 1 check or diagnosis failed, 2 usage error, 3 runtime failure.\n",
          f);
}

static const dp_args_t version_spec = {
    .prog = "detproxy version",
    .usage = "detproxy version | detproxy --version",
    .about = "Print the version and the git commit it was built from.",
};

/* Started with stdin, stdout or stderr closed (some supervisors do), the next files opened would
 * take those numbers: libuv's epoll and signal pipe among them, the log lines then written into
 * its pipe and libuv aborting at exit. Each closed one is /dev/null instead, as daemons do. */
static void stdio_open(void)
{
    for (int fd = 0; fd <= 2; fd++) {
        if (fcntl(fd, F_GETFD) != -1 || errno != EBADF)
            continue;
        /* open takes the lowest free number: fd itself, those below it being open by now */
        if (open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY) < 0)
            return;
    }
}

int main(int argc, char **argv)
{
    stdio_open();
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0 || strcmp(cmd, "version") == 0) {
        int r = dp_args_parse(&version_spec, argc - 1, argv + 1, NULL);
        if (r != 0)
            return dp_args_exit(r);
        printf("detproxy %s (commit %s)\n", dp_version, dp_commit);
        return DP_EXIT_OK;
    }
    if (strcmp(cmd, "run") == 0)
        return px_cmd_run(argc - 1, argv + 1);
    if (strcmp(cmd, "check") == 0)
        return cfg_cmd_check(argc - 1, argv + 1);
    if (strcmp(cmd, "attest") == 0 && argc > 2 && strcmp(argv[2], "canary") == 0)
        return dg_cmd_attest_canary(argc - 2, argv + 2);
    if (strcmp(cmd, "attest") == 0 && argc > 2 && strcmp(argv[2], "serve") == 0)
        return agent_cmd_serve(argc - 2, argv + 2);
    if (strcmp(cmd, "attest") == 0)
        return attest_cmd_main(argc - 1, argv + 1);
    if (strcmp(cmd, "policy") == 0)
        return px_cmd_policy(argc - 1, argv + 1);
    if (strcmp(cmd, "audit") == 0)
        return px_cmd_audit(argc - 1, argv + 1);
    if (strcmp(cmd, "replay") == 0)
        return px_cmd_replay(argc - 1, argv + 1);
    if (strcmp(cmd, "rollout") == 0)
        return px_cmd_rollout(argc - 1, argv + 1);
    if (strcmp(cmd, "diagnose") == 0)
        return dg_cmd_diagnose(argc - 1, argv + 1);
    fprintf(stderr, "detproxy: unknown command '%s' (try --help)\n", cmd);
    return 2;
}
