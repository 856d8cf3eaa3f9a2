/* detproxy-sim: a replica simulator for tests, demos and users' own CI
 * (docs/contributing/simulator.md). Flags in, sim_run out. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "tests/sim/sim_flavor.h"
#include "tests/sim/sim_server.h"

static void usage(FILE *f)
{
    fputs("usage: detproxy-sim [options]\n"
          "\n"
          "A simulated OpenAI-compatible LLM replica with a deterministic toy model.\n"
          "\n"
          "  --listen ADDR               host:port to listen on; port 0 picks a free port\n"
          "                              (default 127.0.0.1:8000; IPv6 as [::1]:8000)\n"
          "  --flavor NAME               vllm | tgi | sglang | llamacpp (default vllm)\n"
          "  --model NAME                served model name (default sim-model)\n"
          "  --framework-version V       reported framework version (default per flavor:\n"
          "                              vllm 0.6.3, tgi 2.0.4, sglang 0.3.5, llamacpp b11669)\n"
          "  --quantization Q            quantization the model generates with (default none)\n"
          "  --dtype D                   dtype (default float16)\n"
          "  --checkpoint-sha256 HEX     checkpoint hash, 64 lowercase hex\n"
          "                              (default sha256(\"sim\"))\n"
          "  --token-delay-ms N          delay per generated token (default 0)\n"
          "  --noise P                   with >= 2 requests in flight, flip each near-tied\n"
          "                              token with probability P (default 0)\n"
          "  --report-quantization Q     report Q while generating with --quantization\n"
          "                              (a lying replica)\n"
          "  --attest-key KEY.pem        also serve GET /attestation?nonce=N, signed with\n"
          "                              this Ed25519 private key\n"
          "  --tls-cert F, --tls-key F   serve HTTPS with this PEM certificate chain and key\n"
          "  --log-level LEVEL           debug | info | warn | error (default info)\n"
          "  --help                      print this help\n"
          "\n"
          "Logs are JSON lines on stderr; the first is {\"msg\":\"listening\",\"port\":N,...}.\n"
          "Test-only endpoints live under /_sim/ (see docs/contributing/simulator.md).\n"
          "Exit codes: 0 stopped by SIGTERM/SIGINT, 2 usage error, 3 runtime failure.\n",
          f);
}

static int bad(const char *fmt, const char *a, const char *b)
{
    fputs("detproxy-sim: ", stderr);
    fprintf(stderr, fmt, a, b);
    fputc('\n', stderr);
    return 2;
}

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

int main(int argc, char **argv)
{
    sim_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    sim_identity_defaults(&cfg.id);
    snprintf(cfg.host, sizeof(cfg.host), "127.0.0.1");
    cfg.port = 8000;
    bool version_given = false;
    int rc = 0;

    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            usage(stdout);
            goto out;
        }
        if (strncmp(arg, "--", 2) != 0) {
            rc = bad("unexpected argument '%s'%s (try --help)", arg, "");
            goto out;
        }
        /* --flag=value or --flag value */
        char name[64];
        const char *val = NULL;
        const char *eq = strchr(arg, '=');
        size_t nl = eq ? (size_t)(eq - arg) : strlen(arg);
        if (nl >= sizeof(name)) {
            rc = bad("unknown flag '%s'%s (try --help)", arg, "");
            goto out;
        }
        memcpy(name, arg, nl);
        name[nl] = '\0';
        static const char *const known[] = {"--listen",
                                            "--flavor",
                                            "--model",
                                            "--framework-version",
                                            "--quantization",
                                            "--dtype",
                                            "--checkpoint-sha256",
                                            "--token-delay-ms",
                                            "--noise",
                                            "--report-quantization",
                                            "--attest-key",
                                            "--tls-cert",
                                            "--tls-key",
                                            "--log-level"};
        bool ok = false;
        for (size_t k = 0; k < DP_ARRAY_SIZE(known); k++)
            ok = ok || strcmp(name, known[k]) == 0;
        if (!ok) {
            rc = bad("unknown flag '%s'%s (try --help)", name, "");
            goto out;
        }
        if (eq) {
            val = eq + 1;
        } else if (i + 1 < argc) {
            val = argv[++i];
        } else {
            rc = bad("%s needs a value%s", name, "");
            goto out;
        }

        if (strcmp(name, "--listen") == 0) {
            if (parse_listen(val, cfg.host, sizeof(cfg.host), &cfg.port) != 0) {
                rc = bad("--listen: expected host:port or [v6]:port, got '%s'%s", val, "");
                goto out;
            }
        } else if (strcmp(name, "--flavor") == 0) {
            int f = sim_flavor_parse(val);
            if (f < 0) {
                rc = bad("--flavor: expected vllm, tgi, sglang or llamacpp, got '%s'%s", val, "");
                goto out;
            }
            cfg.id.flavor = (sim_flavor_t)f;
        } else if (strcmp(name, "--checkpoint-sha256") == 0) {
            if (!dp_is_lower_hex(val, 64)) {
                rc = bad("--checkpoint-sha256: expected 64 lowercase hex, got '%s'%s", val, "");
                goto out;
            }
            sim_identity_set(&cfg.id.checkpoint_sha256, val);
        } else if (strcmp(name, "--token-delay-ms") == 0) {
            uint64_t v;
            if (dp_parse_u64(val, strlen(val), &v) != 0 || v > 600000) {
                rc = bad("--token-delay-ms: expected an integer 0..600000, got '%s'%s", val, "");
                goto out;
            }
            cfg.token_delay_ms = (uint32_t)v;
        } else if (strcmp(name, "--noise") == 0) {
            char *end;
            errno = 0;
            double p = strtod(val, &end);
            if (errno != 0 || end == val || *end != '\0' || !(p >= 0 && p <= 1)) {
                rc = bad("--noise: expected a probability in [0, 1], got '%s'%s", val, "");
                goto out;
            }
            cfg.noise = p;
        } else if (strcmp(name, "--attest-key") == 0) {
            if (val[0] == '\0') {
                rc = bad("--attest-key: expected a path%s%s", "", "");
                goto out;
            }
            cfg.attest_key_path = val;
        } else if (strcmp(name, "--tls-cert") == 0) {
            cfg.tls_cert = val;
        } else if (strcmp(name, "--tls-key") == 0) {
            cfg.tls_key = val;
        } else if (strcmp(name, "--log-level") == 0) {
            int lvl = dp_log_level_parse(val);
            if (lvl < 0) {
                rc = bad("--log-level: expected debug, info, warn or error, got '%s'%s", val, "");
                goto out;
            }
            dp_log_set_level((dp_log_level_t)lvl);
        } else {
            /* the string identity flags; --report-quantization may be empty (= no lie) */
            if (val[0] == '\0' && strcmp(name, "--report-quantization") != 0) {
                rc = bad("%s: expected a non-empty value%s", name, "");
                goto out;
            }
            if (strcmp(name, "--model") == 0)
                sim_identity_set(&cfg.id.model, val);
            else if (strcmp(name, "--framework-version") == 0) {
                sim_identity_set(&cfg.id.framework_version, val);
                version_given = true;
            } else if (strcmp(name, "--quantization") == 0)
                sim_identity_set(&cfg.id.quantization, val);
            else if (strcmp(name, "--dtype") == 0)
                sim_identity_set(&cfg.id.dtype, val);
            else if (strcmp(name, "--report-quantization") == 0)
                sim_identity_set(&cfg.id.report_quantization, val);
        }
    }
    if (!version_given)
        sim_identity_set(&cfg.id.framework_version, sim_flavor_default_version(cfg.id.flavor));
    return sim_run(&cfg);

out:
    sim_identity_free(&cfg.id);
    return rc;
}
