/* `detproxy attest oms verify`: verify an OpenSSF Model Signing bundle against a model
 * directory offline (SPEC §19). One line per finding; exit 0 verified, 1 not, 2 usage, 3 a
 * file could not be read. */
#include <stdio.h>
#include <string.h>

#include "attest/cli.h"
#include "attest/oms.h"
#include "common/jw.h"
#include "common/util.h"

static const char oms_verify_usage[] =
    "usage: detproxy attest oms verify --model-dir DIR --bundle FILE\n"
    "           (--pubkey PEM | --ca-file PEM) [--json]\n"
    "\n"
    "Verify an OpenSSF Model Signing v1.0 bundle (what `model_signing sign` writes, e.g.\n"
    "model.sig) against the model directory DIR: the signature, the statement and predicate,\n"
    "then every file as the bundle's serialization records it (files or shards, ignore paths,\n"
    "symlink policy; .git, .gitignore, .gitattributes, .github and the bundle itself are\n"
    "never model files).\n"
    "\n"
    "  --model-dir DIR  the model directory\n"
    "  --bundle FILE    the OMS bundle (Sigstore bundle v0.3 JSON)\n"
    "  --pubkey PEM     the publisher's EC public key (P-256, P-384, P-521): method \"key\"\n"
    "  --ca-file PEM    CA certificates the signing certificate must chain to: method\n"
    "                   \"certificate\"\n"
    "  --json           one JSON object instead of lines\n"
    "\n"
    "Keyless (method \"sigstore\") bundles need the Sigstore trust root and Rekor and are not\n"
    "supported offline: they are refused.\n"
    "\n"
    "Prints \"verified: method M, signer S, root_digest R, N resources\" or one line per\n"
    "finding (\"changed file: P (...)\", \"extra file (not in the bundle): P\",\n"
    "\"missing file: P\", \"signature: ...\").\n"
    "Exit codes: 0 verified, 1 not verified, 2 usage error, 3 a file could not be read.\n";

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
    const char *dir = NULL, *bundle = NULL, *pubkey = NULL, *ca = NULL;
    bool json = false;
    const attest_opt_t opts[] = {
        {.name = "--model-dir", .has_value = true, .val = &dir},
        {.name = "--bundle", .has_value = true, .val = &bundle},
        {.name = "--pubkey", .has_value = true, .val = &pubkey},
        {.name = "--ca-file", .has_value = true, .val = &ca},
        {.name = "--json", .set = &json},
    };
    const char *pos[1];
    size_t npos;
    int r = attest_parse_args("oms verify", argc, argv, opts, DP_ARRAY_SIZE(opts), pos, 0, &npos);
    if (r == 1) {
        fputs(oms_verify_usage, stdout);
        return ATTEST_EXIT_OK;
    }
    if (r < 0)
        return ATTEST_EXIT_USAGE;
    if (!dir || !bundle || (!pubkey && !ca)) {
        fputs("detproxy attest oms verify: --model-dir, --bundle and one of --pubkey or "
              "--ca-file are required (try --help)\n",
              stderr);
        return ATTEST_EXIT_USAGE;
    }
    oms_trust_t trust = {0};
    dp_buf_t err = {0};
    if ((pubkey && oms_trust_load_pubkey(&trust, pubkey, &err) != 0) ||
        (ca && oms_trust_load_ca(&trust, ca, &err) != 0)) {
        fprintf(stderr, "detproxy attest oms verify: %s %s\n",
                pubkey && !trust.pubkey ? "--pubkey" : "--ca-file", err.base);
        oms_trust_free(&trust);
        dp_buf_free(&err);
        return ATTEST_EXIT_USAGE;
    }
    oms_result_t res = {0};
    int rc = oms_verify(bundle, dir, &trust, NULL, &res);
    if (json) {
        print_json(&res);
    } else if (res.verified) {
        printf("verified: method %s, signer %s, root_digest %s, %zu resources\n", res.method,
               res.signer, res.root_digest, oms_bundle_resource_count(res.bundle));
    } else {
        for (size_t i = 0; i < res.findings.count; i++)
            printf("%s\n", res.findings.items[i]);
    }
    r = rc == 0 ? ATTEST_EXIT_OK : rc > 0 ? ATTEST_EXIT_FAILED : ATTEST_EXIT_RUNTIME;
    if (fflush(stdout) != 0)
        r = ATTEST_EXIT_RUNTIME;
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
        fputs(oms_verify_usage, stdout);
        return ATTEST_EXIT_OK;
    }
    fputs("detproxy attest oms: expected 'verify' (try 'detproxy attest oms verify --help')\n",
          stderr);
    return ATTEST_EXIT_USAGE;
}
