/* `detproxy attest oms verify`: verify an OpenSSF Model Signing bundle against a model
 * directory offline (docs/attestation.md §9). One line per finding; exit 0 verified, 1 not,
 * 2 usage, 3 a file could not be read. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "attest/cli.h"
#include "attest/oms.h"
#include "common/args.h"
#include "common/jw.h"
#include "common/util.h"

/* More ignore paths than this is a mistake, not a model layout. */
#define OMS_MAX_IGNORE 256

typedef struct {
    const char *dir, *bundle, *pubkey, *ca, *root, *identity, *issuer;
    dp_arg_list_t ignore;
    const char *ignore_store[OMS_MAX_IGNORE];
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
    {.name = "--trusted-root",
     .kind = DP_ARG_STR,
     .off = offsetof(oms_opts_t, root),
     .meta = "FILE",
     .help = "a Sigstore trusted_root.json (Fulcio CAs, Rekor and CT log keys): method\n"
             "\"sigstore\" (keyless), with --identity and --issuer"},
    {.name = "--identity",
     .kind = DP_ARG_STR,
     .off = offsetof(oms_opts_t, identity),
     .meta = "ID",
     .help = "the signer's identity the certificate must name (its email, URI or\nusername SAN)"},
    {.name = "--issuer",
     .kind = DP_ARG_STR,
     .off = offsetof(oms_opts_t, issuer),
     .meta = "URL",
     .help = "the OIDC issuer that vouched for the identity (e.g.\n"
             "https://accounts.google.com, https://github.com/login/oauth)"},
    {.name = "--ignore-path",
     .kind = DP_ARG_LIST,
     .off = offsetof(oms_opts_t, ignore),
     .meta = "P",
     .help = "leave P out of the model (repeatable; absolute or relative to the\n"
             "working directory, inside DIR), as `model_signing verify --ignore-paths`"},
    {.name = "--json",
     .kind = DP_ARG_FLAG,
     .off = offsetof(oms_opts_t, json),
     .help = "one JSON object instead of lines"},
};

static const dp_args_t oms_verify_spec = {
    .prog = "detproxy attest oms verify",
    .usage = "detproxy attest oms verify --model-dir DIR --bundle FILE\n"
             "           (--pubkey PEM | --ca-file PEM |\n"
             "            --trusted-root FILE --identity ID --issuer URL)\n"
             "           [--ignore-path P]... [--json]",
    .about =
        "Verify an OpenSSF Model Signing v1.0 bundle (what `model_signing sign` writes, e.g.\n"
        "model.sig) against the model directory DIR: the signature, the statement and predicate,\n"
        "then every file as the bundle's serialization records it (files or shards, ignore paths,\n"
        "symlink policy; .git, .gitignore, .gitattributes, .github and the bundle itself are\n"
        "never model files).",
    .opts = oms_verify_table,
    .nopts = DP_ARRAY_SIZE(oms_verify_table),
    .epilog =
        "Keyless (method \"sigstore\") bundles are verified offline against --trusted-root: the\n"
        "certificate chains to a Fulcio CA valid at the signing time and names --identity and\n"
        "--issuer, its SCT verifies, the Rekor entry's signed entry timestamp, inclusion proof\n"
        "and checkpoint verify, and the entry records this envelope. Findings name the step\n"
        "(\"sigstore SCT: ...\").\n"
        "\n"
        "Prints \"verified: method M, signer S, root_digest R, N resources\" or one line per\n"
        "finding (\"changed file: P (...)\", \"extra file (not in the bundle): P\",\n"
        "\"missing file: P\", \"signature: ...\").\n"
        "Exit codes: 0 verified, 1 not verified, 2 usage error, 3 a file could not be read.",
};

static void print_json(const oms_result_t *r, const oms_trust_t *t)
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
    if (r->signed_at > 0) { /* verified keyless: who signed, and when */
        dp_jw_str(&w, "identity", t->identity);
        dp_jw_str(&w, "issuer", t->issuer);
        dp_jw_int(&w, "signed_at", r->signed_at);
    }
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
    o.ignore = DP_ARG_LIST_OF(o.ignore_store);
    int r = dp_args_parse(&oms_verify_spec, argc, argv, &o);
    if (r != 0)
        return dp_args_exit(r);
    if (!o.dir || !o.bundle || (!o.pubkey + !o.ca + !o.root) != 2)
        return dp_args_usage_error(&oms_verify_spec,
                                   "--model-dir, --bundle and one of --pubkey, --ca-file or "
                                   "--trusted-root are required (one: each is a trust of its own)");
    if (!o.root != !o.identity || !o.root != !o.issuer)
        return dp_args_usage_error(&oms_verify_spec,
                                   "--trusted-root, --identity and --issuer go together");
    oms_trust_t trust = {0};
    dp_buf_t err = {0};
    const char *bad = NULL;
    if (o.pubkey && oms_trust_load_pubkey(&trust, o.pubkey, &err) != 0)
        bad = "--pubkey";
    else if (o.ca && oms_trust_load_ca(&trust, o.ca, &err) != 0)
        bad = "--ca-file";
    else if (o.root && oms_trust_load_sigstore(&trust, o.root, o.identity, o.issuer, &err) != 0)
        bad = "--trusted-root";
    for (size_t i = 0; !bad && i < o.ignore.n; i++)
        if (oms_trust_add_ignore(&trust, o.dir, o.ignore.items[i], &err) != 0)
            bad = "--ignore-path";
    if (bad) {
        fprintf(stderr, "detproxy attest oms verify: %s %s\n", bad, err.base);
        oms_trust_free(&trust);
        dp_buf_free(&err);
        return DP_EXIT_USAGE;
    }
    const char *dir = o.dir, *bundle = o.bundle;
    oms_result_t res = {0};
    int rc = oms_verify(bundle, dir, &trust, NULL, &res);
    if (o.json) {
        print_json(&res, &trust);
    } else if (res.verified && res.signed_at > 0) {
        char when[32];
        time_t t = (time_t)res.signed_at;
        struct tm tm;
        strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&t, &tm));
        printf("verified: method %s, identity %s, issuer %s, signed %s, signer %s, root_digest "
               "%s, %zu resources\n",
               res.method, trust.identity, trust.issuer, when, res.signer, res.root_digest,
               oms_bundle_resource_count(res.bundle));
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
