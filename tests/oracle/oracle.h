/* The request and response paths as the proxy ran them before the splice rewrite (a strict
 * parse into a token tape, a compact re-serialisation of a rewritten body, an in-memory canonical
 * copy hashed for a derived seed, a re-serialised response body), kept as the oracle the
 * differential fuzz target (tests/fuzz/fuzz_policy_oracle.c) and the corpus test
 * (tests/unit/test_oracle_diff.c) check the proxy's policy module against. Test-only: nothing
 * the proxy links uses it. Plain types only, so a file can include it beside policy/policy.h. */
#ifndef DP_ORACLE_H
#define DP_ORACLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "config/config.h"

typedef struct {
    int rc; /* 0 accepted, -1 refused */
    int status;
    char code[40];
    char param[64];
    bool rewritten;
    bool has_seed, seed_derived;
    uint64_t seed;
    size_t nchanges;
    dp_buf_t body; /* the forwarded body (accepted only) */
} oracle_result_t;

/* policy_parse + policy_apply_pool with the old implementation; route as policy_route_t. */
void oracle_police(int route, const char *body, size_t len, const cfg_tenant_t *t,
                   const cfg_pool_t *pool, oracle_result_t *out);
void oracle_result_free(oracle_result_t *r);
/* policy_jcs: 0 and the canonical form appended, or -1. */
int oracle_jcs(const char *json, size_t len, dp_buf_t *out);
/* policy_usage_feed over the whole body: found, and the counts. */
bool oracle_usage(const char *body, size_t len, int64_t *prompt, int64_t *completion);
/* policy_fp_rewrite_json. */
int oracle_fp_rewrite_json(const char *body, size_t len, const char *fp, dp_buf_t *out,
                           char prev[128]);

#endif
