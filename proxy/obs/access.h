/* The access log (`log.access`, docs/configuration.md "log.access"): one "access" JSON line per
 * client request at level info, written when the request ends. Fields beyond the fixed ones
 * (request_id, method, path, status, duration_ms) are chosen by log.access.fields; answers below
 * 400 are sampled by log.access.sample_rate, refusals and failures always logged. */
#ifndef PX_ACCESS_H
#define PX_ACCESS_H

#include <stdbool.h>
#include <stdint.h>

#include "config/config.h"
#include "policy/policy.h"

/* One finished request, as the request handler knows it. Strings are borrowed; NULL prints
 * null. */
typedef struct {
    const char *request_id;
    const char *method, *path;
    const char *remote;
    int status;
    const char *code; /* "upstream", "local", "client_closed" or detproxy's error code */
    const char *pool, *replica;
    uint64_t duration_ns;
    uint64_t upstream_ns; /* 0: no replica exchange ended */
    uint64_t ttfb_ns;     /* 0: no response head from a replica */
    /* The request's policy state (NULL: refused before a tenant matched, none, not parsed): */
    const char *tenant;
    const char *model; /* model_len bytes: a model name may hold NUL ("\u0000") */
    size_t model_len;
    const char *seed; /* the decimal seed sent upstream */
    bool has_usage;   /* the response reported token usage */
    int64_t prompt_tokens, completion_tokens;
    const policy_result_t *policy; /* the changes policy made */
} px_access_t;

void px_access_log(const cfg_access_log_t *cfg, const px_access_t *a);

#endif
