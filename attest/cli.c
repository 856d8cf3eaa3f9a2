/* `detproxy attest hash|keygen|verify|oms`: the offline tools around attestation. Exit codes
 * (docs/README.md, "Commands"): 0 ok, 1 verification or match failed, 2 usage, 3 runtime
 * failure. Results go to stdout, diagnostics to stderr. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "attest/cli.h"
#include "attest/dsse.h"
#include "attest/hash.h"
#include "attest/match.h"
#include "common/args.h"
#include "common/jw.h"
#include "common/util.h"
#include "config/config.h"

/* ---- hash ----------------------------------------------------------------------------------- */

#define PROGRESS_MIN_BYTES ((uint64_t)256 << 20)

typedef struct {
    bool force, never, tty, shown;
    uint64_t start_ns, last_ns;
} progress_t;

static void print_progress(const attest_progress_t *p, progress_t *pr, bool final)
{
    double secs = (double)(dp_now_ns() - pr->start_ns) / 1e9;
    double mbps = secs > 0 ? (double)p->bytes_done / 1e6 / secs : 0;
    double gib = 1024.0 * 1024 * 1024;
    int pct = p->bytes_total ? (int)(p->bytes_done * 100 / p->bytes_total) : 100;
    char line[256];
    snprintf(line, sizeof(line), "%s %llu/%llu files, %.2f/%.2f GiB (%d%%), %.0f MB/s",
             final ? "hashed" : "hashing", (unsigned long long)p->files_done,
             (unsigned long long)p->files_total, (double)p->bytes_done / gib,
             (double)p->bytes_total / gib, pct, mbps);
    if (pr->tty)
        fprintf(stderr, "\r%s\033[K%s", line, final ? "\n" : "");
    else
        fprintf(stderr, "%s\n", line);
    pr->shown = true;
}

/* Progress on stderr for big trees only: a small directory hashes before anyone could read it.
 * A terminal gets one line rewritten in place up to 4 times a second; a log file or pipe gets
 * a plain line per second, so it stays readable there. */
static void hash_progress_cb(const attest_progress_t *p, void *data)
{
    progress_t *pr = data;
    if (pr->never || (!pr->force && p->bytes_total <= PROGRESS_MIN_BYTES))
        return;
    uint64_t now = dp_now_ns();
    uint64_t every = pr->tty ? 250000000u : 1000000000u;
    if (p->current == NULL) {
        print_progress(p, pr, true);
        return;
    }
    if (now - pr->last_ns < every)
        return; /* last_ns starts at the start time: the first line comes after one interval */
    pr->last_ns = now;
    print_progress(p, pr, false);
}

typedef struct {
    bool list, progress, no_progress;
    const char *dir_store[1];
    dp_arg_list_t dir;
} hash_opts_t;

static const dp_arg_t hash_table[] = {
    {.name = "--list",
     .kind = DP_ARG_FLAG,
     .off = offsetof(hash_opts_t, list),
     .help = "print the per-file lines instead (pipe them to sha256sum for the hash;\n"
             "for a FILE: its sha256sum line)"},
    {.name = "--progress",
     .kind = DP_ARG_FLAG,
     .off = offsetof(hash_opts_t, progress),
     .help = "always show progress on stderr (default: only above 256 MiB)"},
    {.name = "--no-progress",
     .kind = DP_ARG_FLAG,
     .off = offsetof(hash_opts_t, no_progress),
     .help = "never show progress"},
};

static const dp_args_t hash_spec = {
    .prog = "detproxy attest hash",
    .usage = "detproxy attest hash [--list] [--progress | --no-progress] DIR|FILE",
    .about =
        "Print the checkpoint hash of the model directory DIR (docs/attestation.md §1): SHA-256\n"
        "over one line \"<sha256>  <path>\\n\" per regular file (symlinks followed, dot-names\n"
        "skipped, sorted bytewise). Reproduce it with coreutils:\n"
        "  cd DIR && find -L . -type f ! -path '*/.*' -printf '%P\\n' | LC_ALL=C sort \\\n"
        "    | xargs -d '\\n' sha256sum | sha256sum\n"
        "A model that is one FILE (a GGUF) hashes to the SHA-256 of its bytes: what\n"
        "`sha256sum FILE` prints and Hugging Face shows for the file.",
    .opts = hash_table,
    .nopts = DP_ARRAY_SIZE(hash_table),
    .epilog = "Exit codes: 0 ok, 2 usage error, 3 the directory or file could not be hashed.",
    .positional = true,
    .pos_off = offsetof(hash_opts_t, dir),
};

static int cmd_hash(int argc, char **argv)
{
    hash_opts_t o = {0};
    o.dir = DP_ARG_LIST_OF(o.dir_store);
    int r = dp_args_parse(&hash_spec, argc, argv, &o);
    if (r != 0)
        return dp_args_exit(r);
    if (o.dir.n != 1)
        return dp_args_usage_error(&hash_spec, "expected one directory or file");
    if (o.progress && o.no_progress)
        return dp_args_usage_error(&hash_spec,
                                   "--progress and --no-progress contradict each other");
    progress_t pr = {.force = o.progress, .never = o.no_progress};
    pr.tty = isatty(2);
    pr.start_ns = pr.last_ns = dp_now_ns();
    attest_hash_opts_t ho = {.progress = hash_progress_cb, .progress_data = &pr};
    char hex[65];
    dp_buf_t lines = {0}, err = {0};
    const char *target = o.dir.items[0];
    struct stat st;
    int rc;
    if (stat(target, &st) == 0 && S_ISREG(st.st_mode)) {
        rc = attest_hash_path(target, &ho, hex, NULL, NULL, &err);
        if (rc == 0 && o.list) /* the line sha256sum prints */
            dp_buf_printf(&lines, "%s  %s\n", hex, target);
    } else {
        rc = attest_hash_dir(target, &ho, hex, NULL, o.list ? &lines : NULL, &err);
    }
    if (rc != 0) {
        if (pr.shown && pr.tty)
            fputc('\n', stderr);
        fprintf(stderr, "detproxy attest hash: %s\n", err.base ? err.base : strerror(-rc));
        r = DP_EXIT_RUNTIME;
    } else {
        if (o.list)
            fwrite(lines.base ? lines.base : "", 1, lines.len, stdout);
        else
            printf("%s\n", hex);
        r = fflush(stdout) == 0 ? DP_EXIT_OK : DP_EXIT_RUNTIME;
    }
    dp_buf_free(&lines);
    dp_buf_free(&err);
    return r;
}

/* ---- keygen --------------------------------------------------------------------------------- */

typedef struct {
    const char *out;
} keygen_opts_t;

static const dp_arg_t keygen_table[] = {
    {.name = "--out",
     .kind = DP_ARG_STR,
     .off = offsetof(keygen_opts_t, out),
     .meta = "PREFIX",
     .help = "write PREFIX.key.pem and PREFIX.pub.pem",
     .flags = DP_ARG_REQUIRED},
};

static const dp_args_t keygen_spec = {
    .prog = "detproxy attest keygen",
    .usage = "detproxy attest keygen --out PREFIX",
    .about =
        "Write a new Ed25519 key pair: PREFIX.key.pem (PKCS#8, mode 0600; give it to the agent's\n"
        "--key) and PREFIX.pub.pem (SubjectPublicKeyInfo; list it in attestation.trusted_keys).\n"
        "Existing files are never overwritten. Prints the key id (hex SHA-256 of the public key\n"
        "DER), the keyid that signed envelopes carry.",
    .opts = keygen_table,
    .nopts = DP_ARRAY_SIZE(keygen_table),
    .epilog = "Exit codes: 0 ok, 2 usage error, 3 the files could not be written.",
};

static int cmd_keygen(int argc, char **argv)
{
    keygen_opts_t o = {0};
    int r = dp_args_parse(&keygen_spec, argc, argv, &o);
    if (r != 0)
        return dp_args_exit(r);
    const char *out = o.out;
    char id[65];
    dp_buf_t err = {0};
    if (attest_keygen(out, id, &err) != 0) {
        fprintf(stderr, "detproxy attest keygen: %s\n", err.base ? err.base : "failed");
        dp_buf_free(&err);
        return DP_EXIT_RUNTIME;
    }
    printf("wrote %s.key.pem (private, mode 0600) and %s.pub.pem\nkeyid %s\n", out, out, id);
    dp_buf_free(&err);
    return DP_EXIT_OK;
}

/* ---- verify --------------------------------------------------------------------------------- */

#define MAX_PUBKEYS 16

typedef struct {
    const char *envelope, *manifest, *nonce;
    const char *pubkey_store[MAX_PUBKEYS];
    dp_arg_list_t pubkeys;
    bool json;
} verify_opts_t;

static const dp_arg_t verify_table[] = {
    {.name = "--envelope",
     .kind = DP_ARG_STR,
     .off = offsetof(verify_opts_t, envelope),
     .meta = "FILE",
     .help = "the signed attestation (DSSE envelope JSON)"},
    {.name = "--pubkey",
     .kind = DP_ARG_LIST,
     .off = offsetof(verify_opts_t, pubkeys),
     .meta = "PEM",
     .help = "a trusted Ed25519 public key (repeatable, up to " DP_ARGS_STR(MAX_PUBKEYS) ")"},
    {.name = "--manifest",
     .kind = DP_ARG_STR,
     .off = offsetof(verify_opts_t, manifest),
     .meta = "FILE",
     .help = "also match the attested identity against this manifest"},
    {.name = "--nonce",
     .kind = DP_ARG_STR,
     .off = offsetof(verify_opts_t, nonce),
     .meta = "N",
     .help = "the nonce the attestation must answer"},
    {.name = "--json",
     .kind = DP_ARG_FLAG,
     .off = offsetof(verify_opts_t, json),
     .help = "print {verified, reason, attestation, manifest} as one JSON object"},
};

static const dp_args_t verify_spec = {
    .prog = "detproxy attest verify",
    .usage = "detproxy attest verify --envelope FILE --pubkey PEM [--pubkey PEM ...]\n"
             "                              [--manifest FILE] [--nonce N] [--json]",
    .about =
        "Verify a signed attestation offline: the DSSE envelope's Ed25519 signature by one of the\n"
        "trusted public keys, the payload's shape, and with --nonce that it answers that nonce.\n"
        "With --manifest, also check the attested identity against the pinned manifest\n"
        "(docs/configuration.md, \"Manifest\"; the canary is behavioural and cannot be checked\n"
        "offline). A payload listing contradictions (a flag of the agent that its engine\n"
        "contradicts, docs/attestation.md §4) fails as the proxy rejects it. FILE may be - for\n"
        "stdin.",
    .opts = verify_table,
    .nopts = DP_ARRAY_SIZE(verify_table),
    .epilog = "Exit codes: 0 verified (and matched), 1 verification or manifest match failed\n"
              "(an envelope that is not one, garbage included) or a contradiction is listed,\n"
              "2 usage error, 3 a file could not be read, or a --manifest or --pubkey could not\n"
              "be parsed.",
};

static void print_field(const char *label, const char *v, const char *note)
{
    if (v)
        printf("  %-18s %s\n", label, v);
    else
        printf("  %-18s (not reported%s%s)\n", label, note ? ": " : "", note ? note : "");
}

static int cmd_verify(int argc, char **argv)
{
    verify_opts_t o = {0};
    o.pubkeys = DP_ARG_LIST_OF(o.pubkey_store);
    int r = dp_args_parse(&verify_spec, argc, argv, &o);
    if (r != 0)
        return dp_args_exit(r);
    if (o.envelope == NULL || o.pubkeys.n == 0)
        return dp_args_usage_error(&verify_spec,
                                   "--envelope FILE and at least one --pubkey PEM are required");
    const char *env_path = o.envelope, *manifest_path = o.manifest, *nonce = o.nonce;

    int rc = DP_EXIT_RUNTIME;
    attest_keyset_t ks = {0};
    dp_buf_t env = {0}, mjson = {0}, err = {0}, why = {0}, out = {0};
    cfg_manifest_t *m = NULL;
    cfg_errors_t merrs = {0};
    attest_report_t rep = {0};
    attest_reasons_t mism = {0};

    for (size_t i = 0; i < o.pubkeys.n; i++) {
        dp_buf_reset(&err);
        if (attest_keyset_add_file(&ks, o.pubkeys.items[i], &err) != 0) {
            fprintf(stderr, "detproxy attest verify: --pubkey %s\n", err.base);
            goto out;
        }
    }
    /* Read one byte past the limit so "too large" is the verifier's precise reason. */
    int e = dp_read_input(env_path, ATTEST_ENVELOPE_MAX_BYTES + 1, &env);
    if (e != 0 && e != -EFBIG) {
        fprintf(stderr, "detproxy attest verify: --envelope %s: %s\n", env_path,
                dp_input_strerror(e));
        goto out;
    }
    if (manifest_path) {
        e = dp_read_input(manifest_path, 1 << 20, &mjson);
        if (e != 0) {
            fprintf(stderr, "detproxy attest verify: --manifest %s: %s\n", manifest_path,
                    dp_input_strerror(e));
            goto out;
        }
        m = cfg_manifest_parse(mjson.base ? mjson.base : "", mjson.len, NULL, &merrs);
        if (m == NULL) {
            for (size_t i = 0; i < merrs.count; i++)
                fprintf(stderr, "detproxy attest verify: --manifest %s: %s\n", manifest_path,
                        merrs.items[i]);
            if (merrs.count == 0)
                fprintf(stderr, "detproxy attest verify: --manifest %s: invalid manifest\n",
                        manifest_path);
            goto out;
        }
    }

    attest_verify_opts_t vo = {.trusted = &ks, .require_signature = true, .expected_nonce = nonce};
    bool verified = attest_envelope_verify(env.base ? env.base : "", env.len, &vo, &rep, &why) == 0;
    /* The proxy's judgement, the signature aside (checked above): contradictions, then the
     * manifest. */
    int nmis = verified ? attest_admit(m, &rep, false, &mism) : 0;
    rc = verified && nmis == 0 ? DP_EXIT_OK : DP_EXIT_FAILED;

    if (o.json) {
        dp_jw_t w;
        dp_jw_init(&w, &out);
        dp_jw_obj_begin(&w, NULL);
        dp_jw_bool(&w, "verified", verified);
        if (verified)
            dp_jw_null(&w, "reason");
        else
            dp_jw_str(&w, "reason", why.base);
        if (verified)
            attest_report_write_json(&rep, &w, "attestation");
        else
            dp_jw_null(&w, "attestation");
        if (m && verified) {
            dp_jw_obj_begin(&w, "manifest");
            dp_jw_bool(&w, "match", nmis == 0);
            dp_jw_arr_begin(&w, "reasons");
            for (size_t i = 0; i < mism.count; i++)
                dp_jw_str(&w, NULL, mism.items[i]);
            dp_jw_arr_end(&w);
            dp_jw_bool(&w, "canary_checked", false);
            dp_jw_obj_end(&w);
        } else {
            dp_jw_null(&w, "manifest");
        }
        dp_jw_obj_end(&w);
        printf("%s\n", out.base);
    } else if (!verified) {
        printf("verification FAILED: %s\n", why.base);
    } else {
        printf("signature: ok, key %s\n", rep.keyid);
        print_field("model", rep.model, rep.unattested_note[ATTEST_F_MODEL]);
        print_field("checkpoint_sha256", rep.checkpoint_sha256,
                    rep.unattested_note[ATTEST_F_CHECKPOINT]);
        print_field("quantization", rep.quantization, rep.unattested_note[ATTEST_F_QUANTIZATION]);
        print_field("dtype", rep.dtype, rep.unattested_note[ATTEST_F_DTYPE]);
        print_field("framework.name", rep.framework_name,
                    rep.unattested_note[ATTEST_F_FRAMEWORK_NAME]);
        print_field("framework.version", rep.framework_version,
                    rep.unattested_note[ATTEST_F_FRAMEWORK_VERSION]);
        if (rep.model_path)
            printf("  %-18s %s\n", "model_path", rep.model_path);
        for (size_t i = 0; i < rep.ncontradictions; i++)
            printf("  %-18s %s %s, the engine %s\n", "CONTRADICTION",
                   attest_contradiction_flag(rep.contradictions[i].field)
                       ? attest_contradiction_flag(rep.contradictions[i].field)
                       : rep.contradictions[i].field,
                   rep.contradictions[i].flag, rep.contradictions[i].engine);
        printf("  %-18s %s%s\n", "nonce", rep.nonce, nonce ? " (matches --nonce)" : "");
        printf("  %-18s %s\n", "issued_at", rep.issued_at);
        if (m) {
            if (nmis == 0) {
                printf("manifest: match\n");
            } else {
                printf("manifest: MISMATCH\n");
                for (size_t i = 0; i < mism.count; i++)
                    printf("  - %s\n", mism.items[i]);
            }
            if (m->canary)
                printf("manifest: canary not checked (behavioural; the proxy runs it)\n");
        }
    }
    fflush(stdout);
out:
    attest_reasons_free(&mism);
    attest_report_clear(&rep);
    cfg_manifest_free(m);
    cfg_errors_free(&merrs);
    attest_keyset_free(&ks);
    dp_buf_free(&env);
    dp_buf_free(&mjson);
    dp_buf_free(&err);
    dp_buf_free(&why);
    dp_buf_free(&out);
    return rc;
}

/* ---- dispatch ------------------------------------------------------------------------------- */

static const char attest_usage[] =
    "usage: detproxy attest <command> [options]\n"
    "\n"
    "commands:\n"
    "  hash DIR|FILE            print the checkpoint hash of a model directory or file\n"
    "  keygen --out PREFIX      write an Ed25519 key pair PREFIX.key.pem, PREFIX.pub.pem\n"
    "  oms verify --model-dir DIR --bundle FILE (--pubkey PEM | --ca-file PEM)\n"
    "                           verify an OpenSSF Model Signing bundle against a directory\n"
    "  serve ...                run the replica-side attestation agent\n"
    "  verify --envelope FILE --pubkey PEM [--manifest FILE] [--nonce N]\n"
    "                           verify a signed attestation offline\n"
    "  canary -c CONFIG --pool P (--replica R | --url URL) [--json]\n"
    "                           run the pool's canary as the proxy does; print the\n"
    "                           expected_sha256 to pin\n"
    "\n"
    "Run 'detproxy attest <command> --help' for a command's options.\n"
    "Exit codes: 0 ok, 1 verification failed, 2 usage error, 3 runtime failure.\n";

int attest_cmd_main(int argc, char **argv)
{
    if (argc < 2) {
        fputs(attest_usage, stderr);
        return DP_EXIT_USAGE;
    }
    const char *sub = argv[1];
    if (strcmp(sub, "--help") == 0 || strcmp(sub, "-h") == 0 || strcmp(sub, "help") == 0) {
        fputs(attest_usage, stdout);
        return DP_EXIT_OK;
    }
    if (strcmp(sub, "hash") == 0)
        return cmd_hash(argc - 1, argv + 1);
    if (strcmp(sub, "keygen") == 0)
        return cmd_keygen(argc - 1, argv + 1);
    if (strcmp(sub, "verify") == 0)
        return cmd_verify(argc - 1, argv + 1);
    if (strcmp(sub, "oms") == 0)
        return attest_oms_main(argc - 1, argv + 1);
    /* `serve` (agent/) and `canary` (diagnose/) are dispatched by main.c: they need net/. */
    fprintf(stderr, "detproxy attest: unknown command '%s' (try --help)\n", sub);
    return DP_EXIT_USAGE;
}
