/* detproxy-sim: a replica simulator for tests, demos and users' own CI
 * (docs/contributing/simulator.md). Flags in (common/args.h), sim_run out. */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/args.h"
#include "common/log.h"
#include "common/util.h"
#include "tests/sim/sim_flavor.h"
#include "tests/sim/sim_server.h"

/* "host:port" or "[v6]:port" into host and port. */
static int parse_listen(const char *s, char *host, size_t hostlen, uint16_t *port)
{
    const char *colon;
    const char *h = s;
    size_t hl;
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (close == NULL || close[1] != ':')
            return -1;
        h = s + 1;
        hl = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (colon == NULL || memchr(s, ':', (size_t)(colon - s)) != NULL)
            return -1;
        hl = (size_t)(colon - s);
    }
    uint64_t p;
    if (hl == 0 || hl >= hostlen || dp_parse_u64(colon + 1, strlen(colon + 1), &p) != 0 ||
        p > 65535)
        return -1;
    memcpy(host, h, hl);
    host[hl] = '\0';
    if (strcmp(host, "localhost") == 0)
        snprintf(host, hostlen, "127.0.0.1");
    *port = (uint16_t)p;
    return 0;
}

typedef struct {
    sim_config_t cfg;
    uint64_t token_delay_ms;
    bool version_given;
} sim_opts_t;

static int set_listen(void *dst, const char *v, char *why, size_t n)
{
    sim_config_t *c = dst;
    if (parse_listen(v, c->host, sizeof(c->host), &c->port) != 0)
        return dp_arg_fail(why, n, "expected host:port or [v6]:port, got '%s'", v);
    return 0;
}

static int set_flavor(void *dst, const char *v, char *why, size_t n)
{
    int f = sim_flavor_parse(v);
    if (f < 0)
        return dp_arg_fail(why, n, "expected vllm, tgi, sglang or llamacpp, got '%s'", v);
    *(sim_flavor_t *)dst = (sim_flavor_t)f;
    return 0;
}

/* An owned identity string (sim_identity_set). */
static int set_string(void *dst, const char *v, char *why, size_t n)
{
    sim_identity_set(dst, v);
    return 0;
}

/* dst is the whole sim_opts_t (the option's off is 0): the flavor's default version is filled in
 * after parsing unless this flag was given. */
static int set_version(void *dst, const char *v, char *why, size_t n)
{
    sim_opts_t *o = dst;
    sim_identity_set(&o->cfg.id.framework_version, v);
    o->version_given = true;
    return 0;
}

static int set_checkpoint(void *dst, const char *v, char *why, size_t n)
{
    if (!dp_is_lower_hex(v, 64))
        return dp_arg_fail(why, n, "expected 64 lowercase hex, got '%s'", v);
    sim_identity_set(dst, v);
    return 0;
}

static int set_noise(void *dst, const char *v, char *why, size_t n)
{
    char *end;
    errno = 0;
    double p = strtod(v, &end);
    if (errno != 0 || end == v || *end != '\0' || !(p >= 0 && p <= 1))
        return dp_arg_fail(why, n, "expected a probability in [0, 1], got '%s'", v);
    *(double *)dst = p;
    return 0;
}

static int set_log_level(void *dst, const char *v, char *why, size_t n)
{
    int lvl = dp_log_level_parse(v);
    if (lvl < 0)
        return dp_arg_fail(why, n, "expected debug, info, warn or error, got '%s'", v);
    dp_log_set_level((dp_log_level_t)lvl);
    return 0;
}

#define ID(field) offsetof(sim_opts_t, cfg.id.field)

static const dp_arg_t sim_table[] = {
    {.name = "--listen",
     .kind = DP_ARG_CALL,
     .off = offsetof(sim_opts_t, cfg),
     .meta = "ADDR",
     .help = "host:port to listen on; port 0 picks a free port\n"
             "(default 127.0.0.1:8000; IPv6 as [::1]:8000)",
     .cb = set_listen},
    {.name = "--flavor",
     .kind = DP_ARG_CALL,
     .off = ID(flavor),
     .meta = "NAME",
     .help = "vllm | tgi | sglang | llamacpp (default vllm)",
     .cb = set_flavor},
    {.name = "--model",
     .kind = DP_ARG_CALL,
     .off = ID(model),
     .meta = "NAME",
     .help = "served model name (default sim-model)",
     .cb = set_string},
    {.name = "--framework-version",
     .kind = DP_ARG_CALL,
     .meta = "V",
     .help = "reported framework version (default per flavor:\n"
             "vllm 0.6.3, tgi 2.0.4, sglang 0.3.5, llamacpp b11669)",
     .cb = set_version},
    {.name = "--quantization",
     .kind = DP_ARG_CALL,
     .off = ID(quantization),
     .meta = "Q",
     .help = "quantization the model generates with (default none)",
     .cb = set_string},
    {.name = "--dtype",
     .kind = DP_ARG_CALL,
     .off = ID(dtype),
     .meta = "D",
     .help = "dtype (default float16)",
     .cb = set_string},
    {.name = "--checkpoint-sha256",
     .kind = DP_ARG_CALL,
     .off = ID(checkpoint_sha256),
     .meta = "HEX",
     .help = "checkpoint hash, 64 lowercase hex\n"
             "(default sha256(\"sim\"))",
     .cb = set_checkpoint},
    {.name = "--token-delay-ms",
     .kind = DP_ARG_UINT,
     .off = offsetof(sim_opts_t, token_delay_ms),
     .meta = "N",
     .help = "delay per generated token (default 0)",
     .max = 600000},
    {.name = "--finish-abandoned",
     .kind = DP_ARG_FLAG,
     .off = offsetof(sim_opts_t, cfg.finish_abandoned),
     .help = "a non-streamed generation whose client left runs to its\n"
             "end, its answer dropped, and so does a stream with an\n"
             "x-conversation-id header (llama.cpp's server and its stream\n"
             "sessions; default: it stops, as vLLM's does)"},
    {.name = "--noise",
     .kind = DP_ARG_CALL,
     .off = offsetof(sim_opts_t, cfg.noise),
     .meta = "P",
     .help = "with >= 2 requests in flight, flip each near-tied\n"
             "token with probability P (default 0)",
     .cb = set_noise},
    {.name = "--report-quantization",
     .kind = DP_ARG_CALL,
     .off = ID(report_quantization),
     .meta = "Q",
     .help = "report Q while generating with --quantization\n"
             "(a lying replica; empty: no lie)",
     .flags = DP_ARG_EMPTY_OK,
     .cb = set_string},
    {.name = "--attest-key",
     .kind = DP_ARG_STR,
     .off = offsetof(sim_opts_t, cfg.attest_key_path),
     .meta = "KEY.pem",
     .help = "also serve GET /attestation?nonce=N, signed with\n"
             "this Ed25519 private key"},
    {.name = "--tls-cert",
     .kind = DP_ARG_STR,
     .off = offsetof(sim_opts_t, cfg.tls_cert),
     .meta = "F",
     .help = "serve HTTPS with this PEM certificate chain (and --tls-key)"},
    {.name = "--tls-key",
     .kind = DP_ARG_STR,
     .off = offsetof(sim_opts_t, cfg.tls_key),
     .meta = "F",
     .help = "and this PEM private key"},
    {.name = "--log-level",
     .kind = DP_ARG_CALL,
     .meta = "LEVEL",
     .help = "debug | info | warn | error (default info)",
     .cb = set_log_level},
};

static const dp_args_t sim_spec = {
    .prog = "detproxy-sim",
    .usage = "detproxy-sim [options]",
    .about = "A simulated OpenAI-compatible LLM replica with a deterministic toy model.",
    .opts = sim_table,
    .nopts = DP_ARRAY_SIZE(sim_table),
    .epilog =
        "Logs are JSON lines on stderr; the first is {\"msg\":\"listening\",\"port\":N,...}.\n"
        "Test-only endpoints live under /_sim/ (see docs/contributing/simulator.md).\n"
        "Exit codes: 0 stopped by SIGTERM/SIGINT, 2 usage error, 3 runtime failure.",
};

int main(int argc, char **argv)
{
    sim_opts_t o;
    memset(&o, 0, sizeof(o));
    sim_identity_defaults(&o.cfg.id);
    snprintf(o.cfg.host, sizeof(o.cfg.host), "127.0.0.1");
    o.cfg.port = 8000;
    int r = dp_args_parse(&sim_spec, argc, argv, &o);
    if (r != 0) {
        sim_identity_free(&o.cfg.id);
        return dp_args_exit(r);
    }
    o.cfg.token_delay_ms = (uint32_t)o.token_delay_ms;
    if (!o.version_given)
        sim_identity_set(&o.cfg.id.framework_version, sim_flavor_default_version(o.cfg.id.flavor));
    return sim_run(&o.cfg);
}
