/* `detproxy diagnose` (docs/diagnose.md): what the four isolation steps collect, the rules that
 * turn it into findings, and the two renderings (aligned tables, one JSON object).
 *
 * Split in two so the judgement is testable without a network:
 *   diagnose.c  the command: flags, config, its own uv loop, every request; it fills a
 *               dg_run_t step by step;
 *   report.c    pure: dg_analyse() judges a filled run (no libuv, no sockets) and
 *               dg_print_text() / dg_print_json() render it.
 *
 * Ownership: a dg_run_t owns its replicas, their outputs, reports and findings; borrowed
 * pointers (cfg, pool, model, prompt) must outlive it. dg_run_free releases what it owns.
 * The verdict rules are written down in docs/diagnose.md; keep the two in step. */
#ifndef DG_DIAGNOSE_H
#define DG_DIAGNOSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "attest/check.h"
#include "attest/report.h"
#include "common/buf.h"
#include "config/config.h"

#define DG_MAX_TOKENS 32   /* long enough for a near-tie to show, short enough to be quick */
#define DG_TEMPERATURE 0.8 /* step 2 sampling temperature (docs/diagnose.md, "2. Sampling") */
#define DG_SEED 1234       /* step 2 fixed seed */
#define DG_SAMPLES 4       /* step 2 per replica: unseeded, unseeded, seeded, seeded */
#define DG_DEFAULT_REPEAT 8
#define DG_DEFAULT_CONCURRENCY 4
#define DG_MAX_REPEAT 1000 /* unique counting is O(repeat^2) comparisons per replica */
#define DG_MAX_CONCURRENCY 256
#define DG_DEFAULT_PROMPT "Explain in two sentences why the sky is blue."

/* One completion request's result. */
typedef struct {
    bool done;  /* answered, failed or skipped */
    bool ok;    /* HTTP 200 with an output text */
    char *text; /* the output text (drift_extract_json), NUL-terminated; NULL unless ok */
    size_t len;
    char *err; /* why not ok: "HTTP 404: ...", "connect: ...", "skipped: ..." */
} dg_out_t;

typedef struct {
    size_t requests; /* sent or skipped */
    size_t ok;
    size_t unique; /* distinct texts among the ok ones */
    int first_ok;  /* index of the first ok output, -1 when none */
    const char *first_err;
} dg_phase_t;

/* Step results per replica, filled by dg_analyse. Tri-states: -1 unknown (a request failed),
 * 0 equal, 1 differ. */
typedef struct {
    int unseeded, seeded;
    dg_phase_t seq, conc;
    size_t conc_differ;        /* ok concurrent outputs that differ from the sequential one */
    size_t total_unique;       /* distinct texts over sequential and concurrent together */
    bool answered;             /* at least one completion request (any step) succeeded */
    size_t sent, failed;       /* completion requests of every step, and those not ok */
    bool stable;               /* sequential: at least one ok, all ok ones identical */
    bool meta_odd;             /* named by a step 1 difference */
    int group;                 /* step 4: index into run->groups, -1 when not compared */
    bool out_odd;              /* step 4: outside the reference group */
    int64_t divergence_offset; /* step 4, vs the reference output (-1 when equal) */
    double similarity;
} dg_stats_t;

typedef struct {
    char *name;
    char *url; /* display form, "http://10.0.0.11:8000" */
    cfg_attest_source_t source;
    /* step 1 */
    attest_verdict_t verdict; /* the attestation check's (attest/check.h), before the canary */
    bool att_ok;              /* a report was obtained (source none: /v1/models answered) */
    char *att_err;            /* why not */
    attest_report_t report;   /* source none: only model (from /v1/models), source "none" */
    bool admitted; /* what the proxy would decide (the check's verdict, then the canary) */
    attest_reasons_t admit_reasons; /* the check's reasons (as the proxy's), then the canary's */
    /* step 1, behaviour: the manifest's canary (docs/attestation.md §6) sent as the proxy sends
     * it, for the identity the replica matched (a manifest "accept" entry may carry its own) */
    struct {
        bool ran;          /* the manifest has a canary and it was sent */
        bool answered;     /* HTTP 200 with choices[0].text */
        bool matched;      /* its SHA-256 equals expected */
        char sha256[65];   /* of the output text, when answered */
        char expected[65]; /* the pinned expected_sha256; "" when not recorded */
        char *err;         /* why not answered */
    } canary;
    /* steps 2 and 3 */
    dg_out_t sampling[DG_SAMPLES];
    dg_out_t *seq; /* run->repeat each */
    dg_out_t *conc;
    char *skip_reason; /* given up on (unresolvable, unreachable): later requests skipped */
    dg_stats_t st;
} dg_replica_t;

typedef enum {
    DG_CROSS_REPLICA_DRIFT = 0,
    DG_NONDETERMINISTIC_REPLICA,
    DG_BATCHING_NONDETERMINISM,
    DG_SEED_IGNORED,
    DG_UNSEEDED_SAMPLING,
    DG_UNATTESTED_REPLICA,
    DG_REPLICA_ERROR,
    DG__CAUSES
} dg_cause_t;

extern const char *const dg_cause_names[DG__CAUSES];

typedef struct {
    bool found;
    bool *replicas; /* [run->n]: the replicas this finding names */
    dp_buf_t detail;
} dg_finding_t;

/* A step 1 identity field on which the attested replicas disagree. */
typedef struct {
    bool differs;
    const char *reference; /* the manifest's pin, else the unique plurality value, else NULL */
    bool reference_pinned; /* reference comes from the manifest */
    bool *odd;             /* [run->n]: reports a value other than reference (all, if none) */
} dg_fielddiff_t;

/* Step 4: replicas whose sequential output is identical form a group. */
typedef struct {
    size_t first; /* a member replica (its output is the group's) */
    size_t count;
} dg_group_t;

typedef struct {
    /* inputs, borrowed */
    const cfg_t *cfg;
    const cfg_pool_t *pool;
    const char *model;
    const char *prompt;
    unsigned repeat, concurrency;
    /* through the running proxy's admin relay: the concurrent phase is bounded by the pool's
     * max_inflight_per_replica, as client traffic is */
    bool relayed;
    /* collected, owned */
    dg_replica_t *r;
    size_t n;
    /* judged by dg_analyse */
    dg_fielddiff_t diffs[ATTEST_F__COUNT];
    bool policy_pins;    /* every tenant that can reach the pool pins its sampling */
    dp_buf_t policy_why; /* one sentence saying why (or which tenant does not) */
    bool unseeded_varies, seeds_honoured;
    dg_group_t *groups;
    size_t ngroups;
    int ref_group;             /* -1: fewer than two replicas compared, or no majority */
    const char *tie_broken_by; /* a tie between groups decided by "step 1" or "step 3"; NULL */
    size_t compared;           /* replicas compared in step 4 */
    size_t answered;           /* replicas that answered at least one completion request */
    dg_finding_t findings[DG__CAUSES];
    size_t nfindings;
} dg_run_t;

/* Judge a run whose steps are filled in. Call once. */
void dg_analyse(dg_run_t *run);
/* Exit code for an analysed run (docs/diagnose.md, "Exit codes"): 0 consistent, 1 a finding,
 * 3 nobody answered. */
int dg_exit_code(const dg_run_t *run);
/* Render: tables per step and the verdict lines / one JSON object (with a trailing newline). */
void dg_print_text(const dg_run_t *run, FILE *f);
void dg_print_json(const dg_run_t *run, dp_buf_t *out);
void dg_run_free(dg_run_t *run);

/* Does the config's policy pin sampling for every tenant whose requests can reach pool? A tenant
 * pins it when it forces, defaults or derives `seed`, or makes `temperature` 0 for every request
 * (force 0, or default 0 with max 0). Tenants after the first `"any": true` one never match and
 * are ignored. Appends one sentence saying why to *why. */
bool dg_policy_pins(const cfg_t *cfg, const cfg_pool_t *pool, dp_buf_t *why);

/* The commands (docs/README.md, "Commands"): `detproxy diagnose` (diagnose.c) and
 * `detproxy attest canary` (canary_cmd.c). argv starts at the command's own name; they return
 * the exit code (DP_EXIT_* of common/args.h). */
int dg_cmd_diagnose(int argc, char **argv);
int dg_cmd_attest_canary(int argc, char **argv);

#endif
