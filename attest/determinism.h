/* Batch invariance of a co-located vLLM server (docs/attestation.md §10), for `attest serve
 * --determinism batch_invariant`: vLLM runs batch-invariant kernels when its process was started
 * with VLLM_BATCH_INVARIANT set to a non-zero integer (vllm/envs.py reads int(value) != 0), and
 * says so nowhere else, so the agent reads the server's environment from /proc/PID/environ.
 *
 * That needs the agent to see the server's processes (a pod with shareProcessNamespace: true,
 * or the same host PID namespace) and to be allowed to read them (the same uid, or
 * CAP_SYS_PTRACE): when it cannot, the answer is "cannot tell", never a guess.
 *
 * Synchronous reads of /proc (in-memory files, a few per process): called from the agent's
 * watch timer. */
#ifndef ATTEST_DETERMINISM_H
#define ATTEST_DETERMINISM_H

#include <stdbool.h>
#include <sys/types.h>

#include "common/buf.h"

typedef struct {
    const char *proc;    /* "/proc" (tests point it at a fake tree) */
    pid_t pid;           /* > 0: exactly this process (--determinism-pid) */
    const char *process; /* else every process whose command is this name (--determinism-process) */
    pid_t self;          /* never this one (the agent itself) */
    /* With pid: its start time (/proc/PID/stat starttime) at the first check, 0 before. A pid
     * the kernel reused for another process is not the server that was checked. */
    unsigned long long pid_start;
} attest_det_opts_t;

/* 1: every matching process has VLLM_BATCH_INVARIANT on; 0: one has it off or unset; -1: cannot
 * tell (no such process, unreadable environment). Either way other than 1, *why (reset first)
 * says why in a line short enough for a rejection reason ("VLLM_BATCH_INVARIANT is not set in
 * pid 123", "cannot tell: /proc/123/environ: Permission denied", "cannot tell: pid 123 is
 * another process now"); on 1 it names the pids. */
int attest_vllm_batch_invariant(attest_det_opts_t *o, dp_buf_t *why);

/* Does this command line (NUL-separated argv, as /proc/PID/cmdline) run `name`? argv[0]'s base
 * name is name ("vllm ..."), or argv[1]'s is (an interpreter running the script: "python3
 * /usr/local/bin/vllm serve"), or it is "python -m name[.module]". */
bool attest_cmdline_runs(const char *cmdline, size_t len, const char *name);

/* The value of VAR in a NUL-separated environment block: true with
 * *val and *vlen set, or false. */
bool attest_environ_get(const char *env, size_t len, const char *var, const char **val,
                        size_t *vlen);

/* vLLM's reading of a flag value: an integer (surrounding blanks allowed) that is not 0. */
bool attest_env_flag_on(const char *val, size_t len);

#endif
