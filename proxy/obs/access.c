#include "proxy/obs/access.h"

#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"

/* Sampling needs no cryptographic randomness: a xorshift64* stream, seeded once. */
static double sample_uniform(void)
{
    static _Thread_local uint64_t x; /* one stream per worker */
    if (x == 0)
        x = (dp_now_ns() ^ 0x9E3779B97F4A7C15ULL) | 1;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    return (double)((x * 0x2545F4914F6CDD1DULL) >> 11) / 9007199254740992.0;
}

/* Milliseconds with three decimals (microseconds), printed with integer arithmetic: the
 * shortest-round-trip double printer costs several snprintf calls, three per line. */
static void ms_value(dp_jw_t *w, const char *key, uint64_t ns)
{
    uint64_t us = ns / 1000;
    char b[32];
    int n =
        snprintf(b, sizeof(b), "%llu.%03u", (unsigned long long)(us / 1000), (unsigned)(us % 1000));
    dp_jw_raw(w, key, b, (size_t)n);
}

/* 0 means "did not happen": null. */
static void ms(dp_jw_t *w, const char *key, uint64_t ns)
{
    if (ns == 0)
        dp_jw_null(w, key);
    else
        ms_value(w, key, ns);
}

void px_access_log(const cfg_access_log_t *cfg, const px_access_t *a)
{
    if (!cfg->enabled)
        return;
    if (a->status < 400 && cfg->sample_rate < 1.0 && sample_uniform() >= cfg->sample_rate)
        return;
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "access");
    if (w == NULL)
        return;
    uint32_t f = cfg->fields;
#define HAS(x) (f & (1u << CFG_ACCESS_##x))
    dp_jw_str(w, "request_id", a->request_id);
    dp_jw_str(w, "method", a->method);
    dp_jw_str(w, "path", a->path);
    dp_jw_int(w, "status", a->status);
    ms_value(w, "duration_ms", a->duration_ns);
    if (HAS(CODE))
        dp_jw_str(w, "code", a->code);
    if (HAS(TENANT))
        dp_jw_str(w, "tenant", a->tenant);
    if (HAS(POOL))
        dp_jw_str(w, "pool", a->pool);
    if (HAS(REPLICA))
        dp_jw_str(w, "replica", a->replica);
    if (HAS(MODEL)) {
        /* Whole, escaped: routing reads every byte of it, so the log does too. */
        if (a->model)
            dp_jw_strn(w, "model", a->model, a->model_len);
        else
            dp_jw_null(w, "model");
    }
    if (HAS(REMOTE))
        dp_jw_str(w, "remote", a->remote);
    if (HAS(UPSTREAM_MS))
        ms(w, "upstream_ms", a->upstream_ns);
    if (HAS(TTFB_MS))
        ms(w, "ttfb_ms", a->ttfb_ns);
    if (HAS(TOKENS)) {
        if (a->has_usage) {
            dp_jw_int(w, "prompt_tokens", a->prompt_tokens);
            dp_jw_int(w, "completion_tokens", a->completion_tokens);
        } else {
            dp_jw_null(w, "prompt_tokens");
            dp_jw_null(w, "completion_tokens");
        }
    }
    if (HAS(SEED)) {
        if (a->seed)
            dp_jw_raw(w, "seed", a->seed, strlen(a->seed));
        else
            dp_jw_null(w, "seed");
    }
    if (HAS(POLICY)) {
        /* "param:action" for each change policy made. */
        dp_jw_arr_begin(w, "policy");
        for (size_t i = 0; a->policy && i < a->policy->nchanges; i++) {
            char item[64];
            snprintf(item, sizeof(item), "%s:%s", a->policy->changes[i].param,
                     policy_action_names[a->policy->changes[i].action]);
            dp_jw_str(w, NULL, item);
        }
        dp_jw_arr_end(w);
    }
#undef HAS
    dp_log_end(w);
}
