/* `detproxy attest oms verify`: verify an OpenSSF Model Signing bundle against a model
 * directory offline (docs/attestation.md §9). One line per finding; exit 0 verified, 1 not,
 * 2 usage, 3 a file could not be read. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "attest/cli.h"
#include "attest/oms.h"
#include "common/args.h"
#include "common/jw.h"
#include "common/util.h"

typedef struct {
    const char *dir, *bundle, *pubkey, *ca;
    bool json;
} oms_opts_t;

static const dp_arg_t oms_verify_table[] = {
    {.name = "--model-dir",
     .kind = DP_ARG_STR,
     .off = offsetof(oms_opts_t, dir),
     .meta = "DIR",
     .help = "the model directory"},
    {.name = "--bundle",
     .kind = DP_ARG_STR,
     .off = offsetof(oms_opts_t, bundle),
     .meta = "FILE",
     .help = "the OMS bundle (Sigstore bundle v0.3 JSON)"},
    {.name = "--pubkey",
     .kind = DP_ARG_STR,
     .off = offsetof(oms_opts_t, pubkey),
     .meta = "PEM",
     .help = "the publisher's EC public key (P-256, P-384, P-521): method \"key\""},
    {.name = "--ca-file",
     .kind = DP_ARG_STR,
     .off = offsetof(oms_opts_t, ca),
     .meta = "PEM",
     .help = "CA certificates the signing certificate must chain to: method\n\"certificate\""},
    {.name = "--json",
     .kind = DP_ARG_FLAG,
     .off = offsetof(oms_opts_t, json),
     .help = "one JSON object instead of lines"},
};

static const dp_args_t oms_verify_spec = {
    .prog = "detproxy attest oms verify",
    .usage = "detproxy attest oms verify --model-dir DIR --bundle FILE\n"
             "           (--pubkey PEM | --ca-file PEM) [--json]",
    .about =
        "Verify an OpenSSF Model Signing v1.0 bundle (what `model_signing sign` writes, e.g.\n"
        "model.sig) against the model directory DIR: the signature, the statement and predicate,\n"
        "then every file as the bundle's serialization records it (files or shards, ignore paths,\n"
        "symlink policy; .git, .gitignore, .gitattributes, .github and the bundle itself are\n"
        "never model files).",
    .opts = oms_verify_table,
    .nopts = DP_ARRAY_SIZE(oms_verify_table),
    .epilog =
        "Keyless (method \"sigstore\") bundles need the Sigstore trust root and Rekor and are not\n"
        "supported offline: they are refused.\n"
        "\n"
        "Prints \"verified: method M, signer S, root_digest R, N resources\" or one line per\n"
        "finding (\"changed file: P (...)\", \"extra file (not in the bundle): P\",\n"
        "\"missing file: P\", \"signature: ...\").\n"
        "Exit codes: 0 verified, 1 not verified, 2 usage error, 3 a file could not be read.",
};

static void print_json(const oms_result_t *r)
{
    dp_buf_t out = {0};
    dp_jw_t w;
    dp_jw_init(&w, &out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_bool(&w, "verified", r->verified);
    if (r->method)
        dp_jw_str(&w, "method", r->method);
    else
        dp_jw_null(&w, "method");
    if (r->signer[0])
        dp_jw_str(&w, "signer", r->signer);
    else
        dp_jw_null(&w, "signer");
    if (r->root_digest[0])
        dp_jw_str(&w, "root_digest", r->root_digest);
    else
        dp_jw_null(&w, "root_digest");
    dp_jw_uint(&w, "resources", r->bundle ? oms_bundle_resource_count(r->bundle) : 0);
    dp_jw_arr_begin(&w, "findings");
    for (size_t i = 0; i < r->findings.count; i++)
        dp_jw_str(&w, NULL, r->findings.items[i]);
    dp_jw_arr_end(&w);
    dp_jw_obj_end(&w);
    printf("%s\n", out.base);
    dp_buf_free(&out);
}

static int cmd_oms_verify(int argc, char **argv)
{
    oms_opts_t o = {0};
    int r = dp_args_parse(&oms_verify_spec, argc, argv, &o);
    if (r != 0)
        return dp_args_exit(r);
    if (!o.dir || !o.bundle || (!o.pubkey && !o.ca))
        return dp_args_usage_error(
            &oms_verify_spec,
            "--model-dir, --bundle and one of --pubkey or --ca-file are required");
    const char *dir = o.dir, *bundle = o.bundle, *pubkey = o.pubkey, *ca = o.ca;
    oms_trust_t trust = {0};
    dp_buf_t err = {0};
    if ((pubkey && oms_trust_load_pubkey(&trust, pubkey, &err) != 0) ||
        (ca && oms_trust_load_ca(&trust, ca, &err) != 0)) {
        fprintf(stderr, "detproxy attest oms verify: %s %s\n",
                pubkey && !trust.pubkey ? "--pubkey" : "--ca-file", err.base);
        oms_trust_free(&trust);
        dp_buf_free(&err);
        return DP_EXIT_USAGE;
    }
    oms_result_t res = {0};
    int rc = oms_verify(bundle, dir, &trust, NULL, &res);
    if (o.json) {
        print_json(&res);
    } else if (res.verified) {
        printf("verified: method %s, signer %s, root_digest %s, %zu resources\n", res.method,
               res.signer, res.root_digest, oms_bundle_resource_count(res.bundle));
    } else {
        for (size_t i = 0; i < res.findings.count; i++)
            printf("%s\n", res.findings.items[i]);
    }
    r = rc == 0 ? DP_EXIT_OK : rc > 0 ? DP_EXIT_FAILED : DP_EXIT_RUNTIME;
    if (fflush(stdout) != 0)
        r = DP_EXIT_RUNTIME;
    oms_result_clear(&res);
    oms_trust_free(&trust);
    dp_buf_free(&err);
    return r;
}

int attest_oms_main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "verify") == 0)
        return cmd_oms_verify(argc - 1, argv + 1);
    if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        dp_args_help(&oms_verify_spec, stdout);
        return DP_EXIT_OK;
    }
    fputs("detproxy attest oms: expected 'verify' (try 'detproxy attest oms verify --help')\n",
          stderr);
    return DP_EXIT_USAGE;
}
