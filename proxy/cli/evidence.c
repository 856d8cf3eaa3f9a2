/* `detproxy audit verify` and `detproxy replay` (docs/operations.md, "Evidence: stored bodies,
 * chained audit, `audit verify`, `replay`"): the evidence commands.
 *
 * verify is offline (attest/audit.c does the work). replay reads the audit file and the body
 * store, attests the config's replicas itself with the proxy's check (probe/, judged by
 * attest/check.h, then the canary), and re-sends each stored forwarded body to a replica whose
 * accepted identity is the audited fingerprint: straight to the URL the config gives, with the
 * pool's credentials, or with --admin through the running proxy's send route. Nothing a remote
 * answer says picks a URL. The outputs are compared with the shadow comparator (drift/).
 * Requests go one at a time under one deadline: a replay is evidence, not a load test. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "attest/audit.h"
#include "common/args.h"
#include "common/jw.h"
#include "common/util.h"
#include "config/config.h"
#include "net/tls.h"
#include "proxy/cli/cli.h"
#include "drift/drift.h"
#include "proxy/core/px.h"
#include "proxy/cli/fetch.h"
#include "attest/check.h"
#include "attest/match.h"
#include "net/resolve.h"
#include "probe/probe.h"
#include "probe/relay.h"

/* ---- audit verify ---------------------------------------------------------------------------- */

/* The chain holds, but no signature shows who wrote it: no --pubkey, or a --pubkey that found
 * no checkpoint to check. */
#define EXIT_UNSIGNED 4
#define MAX_ANCHORS 64

typedef struct {
    const char *pubkey, *store;
    bool no_signatures;
    dp_arg_list_t files, anchors;
    uint64_t max_unsigned; /* UINT64_MAX: not given */
} audit_opts_t;

static const dp_arg_t audit_table[] = {
    {.name = "--pubkey",
     .kind = DP_ARG_STR,
     .off = offsetof(audit_opts_t, pubkey),
     .meta = "PEM",
     .help = "the public half of log.audit_signing_key: check the\n"
             "checkpoint signatures with it"},
    {.name = "--no-signatures",
     .kind = DP_ARG_FLAG,
     .off = offsetof(audit_opts_t, no_signatures),
     .help = "check the chain only, knowingly (exit 0, not 4, without\n"
             "--pubkey)"},
    {.name = "--store",
     .kind = DP_ARG_STR,
     .off = offsetof(audit_opts_t, store),
     .meta = "DIR",
     .help = "the body store (log.audit_store): check that every stored\n"
             "body is there and hashes to its name"},
    {.name = "--anchor",
     .kind = DP_ARG_LIST,
     .off = offsetof(audit_opts_t, anchors),
     .meta = "SEQ:SHA256",
     .help = "a checkpoint kept off the host (GET /admin/audit, the\n"
             "audit_checkpoint log line, the metric): the chain must hold\n"
             "it (repeatable)"},
    {.name = "--max-unsigned",
     .kind = DP_ARG_UINT,
     .off = offsetof(audit_opts_t, max_unsigned),
     .meta = "N",
     .min = 0,
     .max = 100000000, /* audit_checkpoint_lines' own bound */
     .help = "with --pubkey: at most N lines after the chain's last\n"
             "checkpoint (give log.audit_checkpoint_lines: a writer signs\n"
             "at least that often), else exit 4"},
};

static const dp_args_t audit_spec = {
    .prog = "detproxy audit verify",
    .usage = "detproxy audit verify FILE... [--pubkey PEM [--max-unsigned N] | --no-signatures]\n"
             "                             [--store DIR] [--anchor SEQ:SHA256]...",
    .about = "Check the hash chain of each audit file (several files: in rotation order, the\n"
             "chain carried from one to the next; a file set aside with a torn last line\n"
             "is followed by the file whose first line repairs it), the checkpoints' seq and\n"
             "signatures, the anchors and the stored bodies (docs/operations.md, \"Evidence\").\n"
             "Exit 1 at the first break, naming the line.",
    .opts = audit_table,
    .nopts = DP_ARRAY_SIZE(audit_table),
    .epilog = "Exit codes: 0 every file checks out, 1 a break, an anchor the chain lacks, or a\n"
              "file that cannot be read, 2 usage error or an unusable --pubkey, 4 the chain\n"
              "holds but signatures were NOT checked (no --pubkey, no --no-signatures), or\n"
              "--pubkey found no checkpoint to check: no line is signed, or more lines than\n"
              "--max-unsigned follow the last checkpoint.",
    .positional = true,
    .pos_off = offsetof(audit_opts_t, files),
};

static int parse_anchor(const char *s, audit_anchor_t *a)
{
    if (*s < '1' || *s > '9') /* digits only: strtoull takes a sign and spaces */
        return -1;
    char *end = NULL;
    errno = 0;
    unsigned long long seq = strtoull(s, &end, 10);
    if (errno == ERANGE || *end != ':' || strlen(end + 1) != 64)
        return -1;
    for (const char *p = end + 1; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f')))
            return -1;
    a->seq = seq;
    memcpy(a->sha256, end + 1, 65);
    a->found = false;
    return 0;
}

int px_cmd_audit(int argc, char **argv)
{
    int sub = dp_args_subcommand(&audit_spec, argc, argv, "verify");
    if (sub >= 0)
        return sub;
    argc--;
    argv++;
    /* Every argument could be a FILE. */
    audit_opts_t o = {
        .files = {.items = dp_xcalloc((size_t)argc, sizeof(char *)), .max = (size_t)argc},
        .anchors = {.items = dp_xcalloc(MAX_ANCHORS, sizeof(char *)), .max = MAX_ANCHORS},
        .max_unsigned = UINT64_MAX};
    audit_anchor_t anchors[MAX_ANCHORS];
    int pr = dp_args_parse(&audit_spec, argc, argv, &o);
    int rc = 0;
    attest_key_t *key = NULL;
    if (pr != 0 || o.files.n == 0) {
        rc = pr != 0 ? dp_args_exit(pr) : dp_args_usage_error(&audit_spec, "FILE is required");
        goto done;
    }
    if (o.pubkey && o.no_signatures) {
        rc = dp_args_usage_error(&audit_spec, "--pubkey and --no-signatures exclude each other");
        goto done;
    }
    if (o.max_unsigned != UINT64_MAX && o.pubkey == NULL) {
        rc = dp_args_usage_error(&audit_spec, "--max-unsigned needs --pubkey");
        goto done;
    }
    for (size_t i = 0; i < o.anchors.n; i++) {
        if (parse_anchor(o.anchors.items[i], &anchors[i]) != 0) {
            rc = dp_args_usage_error(&audit_spec,
                                     "--anchor wants SEQ:SHA256 (seq >= 1, 64 lowercase hex)");
            goto done;
        }
    }
    if (o.pubkey) {
        dp_buf_t err = {0};
        if (attest_key_load(o.pubkey, false, &key, &err) != 0) {
            fprintf(stderr, "detproxy audit verify: --pubkey %s: %.*s\n", o.pubkey, (int)err.len,
                    err.base ? err.base : "");
            dp_buf_free(&err);
            rc = 2;
            goto done;
        }
        dp_buf_free(&err);
    }
    char prev[65] = "";
    audit_torn_t torn = {0};
    uint64_t prev_seq = 0, first_seq = 0, last_seq = 0, lines = 0, signatures = 0;
    uint64_t tail = 0; /* lines after the chain's last checkpoint, over the files so far */
    bool first = true;
    for (size_t i = 0; i < o.files.n && rc == 0; i++) {
        const char *file = o.files.items[i];
        audit_verify_opts_t vo = {.pubkey = key,
                                  .store = o.store,
                                  .expect_prev = prev[0] ? prev : NULL,
                                  .expect_torn = torn.torn ? &torn : NULL,
                                  .allow_torn = i + 1 < o.files.n,
                                  .prev_seq = prev_seq,
                                  .anchors = anchors,
                                  .nanchors = o.anchors.n};
        audit_verify_result_t r;
        dp_buf_t why = {0};
        if (audit_verify_file(file, &vo, &r, &why) != 0) {
            if (r.bad_line)
                printf("%s: line %llu: %.*s\n", file, (unsigned long long)r.bad_line, (int)why.len,
                       why.base);
            else
                printf("%s: %.*s\n", file, (int)why.len, why.base);
            rc = 1;
            dp_buf_free(&why);
            break;
        }
        printf("%s: ok: %llu lines, %llu checkpoints", file, (unsigned long long)r.lines,
               (unsigned long long)r.checkpoints);
        if (r.first_seq)
            printf(" (seq %llu..%llu)", (unsigned long long)r.first_seq,
                   (unsigned long long)r.last_seq);
        if (key)
            printf(", %llu signatures verified", (unsigned long long)r.signatures_checked);
        else
            printf(", chain ok, signatures NOT checked (no --pubkey)");
        if (o.store)
            printf(", %llu stored bodies checked, %llu lines' attestation evidence found",
                   (unsigned long long)r.bodies_checked, (unsigned long long)r.evidence_checked);
        if (r.unstored)
            printf(", %llu lines say their bodies were not stored (the store failed as they were "
                   "written)",
                   (unsigned long long)r.unstored);
        if (r.unstored && o.store)
            printf(", %llu of their bodies absent from the store",
                   (unsigned long long)r.unstored_missing);
        if (key && r.unsigned_tail)
            printf(", %llu lines after the last checkpoint (not signed yet)",
                   (unsigned long long)r.unsigned_tail);
        putchar('\n');
        lines += r.lines;
        signatures += r.signatures_checked;
        tail = r.checkpoints ? r.unsigned_tail : tail + r.unsigned_tail;
        if (r.lines == 0 && !r.torn.torn) {
            /* Nothing in it: the chain (head, torn last line, seq) passes through unchanged. */
            if (prev[0])
                printf("%s: empty: the chain passes through it (the next file continues from "
                       "%.12s..)\n",
                       file, prev);
            else
                printf("%s: empty: the chain starts with the next file\n", file);
            dp_buf_free(&why);
            continue;
        }
        if (r.repaired)
            printf("%s: repair: starts after the torn last line of %s (%s at offset %llu; the "
                   "chain continues from its last complete line)\n",
                   file, px_fetch_safe(0, r.repaired_file),
                   torn.torn ? "checked" : "that file not given",
                   (unsigned long long)r.repaired_offset);
        if (r.torn.torn)
            printf("%s: torn last line: %llu bytes at offset %llu (SHA-256 %.12s..), repaired "
                   "by the next file\n",
                   file, (unsigned long long)r.torn.len, (unsigned long long)r.torn.offset,
                   r.torn.sha256);
        if (first && r.lines && strcmp(r.first_prev, AUDIT_GENESIS) != 0)
            printf("%s: note: the chain does not start here: its first line continues an earlier "
                   "file (%.12s..) that is not given; an --anchor older than this file's first "
                   "checkpoint tells whether earlier files were removed\n",
                   file, r.first_prev);
        first = false;
        if (r.first_seq && first_seq == 0)
            first_seq = r.first_seq;
        if (r.last_seq) {
            last_seq = r.last_seq;
            prev_seq = r.last_seq;
        }
        torn = r.torn;
        memcpy(prev, r.last, sizeof(prev));
        dp_buf_free(&why);
    }
    if (rc == 0 && torn.torn) {
        /* Only empty files followed the torn one: nothing repairs it. */
        printf("%s: the torn last line of an earlier file is not repaired: no later file "
               "starts with its repair line\n",
               o.files.items[o.files.n - 1]);
        rc = 1;
    }
    for (size_t i = 0; i < o.anchors.n && rc == 0; i++) {
        const audit_anchor_t *a = &anchors[i];
        if (a->found) {
            printf("anchor seq %llu: ok\n", (unsigned long long)a->seq);
            continue;
        }
        rc = 1;
        if (last_seq == 0)
            printf("anchor seq %llu: not in the chain: the files hold no numbered checkpoint\n",
                   (unsigned long long)a->seq);
        else if (a->seq > last_seq)
            printf("anchor seq %llu: not in the chain: it ends at checkpoint seq %llu (the file "
                   "was cut back, or newer files are missing)\n",
                   (unsigned long long)a->seq, (unsigned long long)last_seq);
        else
            printf("anchor seq %llu: not in the chain: it starts at checkpoint seq %llu (older "
                   "files were removed, or are not given)\n",
                   (unsigned long long)a->seq, (unsigned long long)first_seq);
    }
    if (rc == 0 && key == NULL && !o.no_signatures) {
        printf("chain ok, signatures NOT checked: give --pubkey (or --no-signatures to accept "
               "that)\n");
        rc = EXIT_UNSIGNED;
    }
    /* A chain anyone can recompute proves nothing about its writer: with --pubkey, at least one
     * checkpoint must vouch for the lines before it. Lines after the last one are reported
     * per file above. */
    if (rc == 0 && key && signatures == 0) {
        if (lines == 0)
            printf("no signature verified: the files hold no line\n");
        else
            printf("chain ok, but NO signature verified: no checkpoint covers any of the %llu "
                   "lines, so nothing shows they were written with the signing key (a trail "
                   "rewritten without the key looks the same). An honest trail has none yet "
                   "when it never reached audit_checkpoint_lines and was not stopped cleanly: "
                   "reload or stop detproxy to write a checkpoint, then verify again\n",
                   (unsigned long long)lines);
        rc = EXIT_UNSIGNED;
    }
    /* Lines appended after a genuine checkpoint chain on from it with no key. A writer signs
     * every audit_checkpoint_lines lines (a restart after a crash counts on from the lines it
     * finds), so an honest trail's tail is never longer than that. */
    if (rc == 0 && tail > o.max_unsigned) {
        printf("chain ok, but the last %llu lines are NOT signed: more than --max-unsigned %llu "
               "(lines appended after the last checkpoint without the key look the same)\n",
               (unsigned long long)tail, (unsigned long long)o.max_unsigned);
        rc = EXIT_UNSIGNED;
    }
done:
    attest_key_free(key);
    free(o.files.items);
    free(o.anchors.items);
    return rc;
}

/* ---- replay ---------------------------------------------------------------------------------- */

/* One replica of the config, as replay's own attestation judged it. */
typedef struct {
    const cfg_pool_t *pool;
    const cfg_replica_t *rc;
    bool admitted;
    char fp[20]; /* the accepted identity it matched (its answers carry it) */
    char *why;   /* not admitted: why */
    /* The running proxy's replica at this one's URL (probe/relay.h): every request to it goes
     * through that proxy's relay, under its admission slots. NULL: straight to the replica. */
    const probe_relay_replica_t *via;
    net_tls_ctx_t *tls;
    bool done;
    attest_outcome_t out;
    bool canary_ok, canary_answered;
    char *canary_err;
} rrep_t;

/* The upstream's own system_fingerprint, from a JSON body or the first SSE event carrying it. */
static char *upstream_fp(const char *b, size_t n)
{
    cJSON *doc = cJSON_ParseWithLength(b, n);
    char *fp = NULL;
    if (doc == NULL) {
        const char *p = b, *end = b + n;
        while (p < end && fp == NULL) {
            const char *nl = memchr(p, '\n', (size_t)(end - p));
            const char *le = nl ? nl : end;
            if (le - p > 6 && memcmp(p, "data: ", 6) == 0) {
                cJSON *ev = cJSON_ParseWithLength(p + 6, (size_t)(le - p - 6));
                const cJSON *s = cJSON_GetObjectItemCaseSensitive(ev, "system_fingerprint");
                if (cJSON_IsString(s))
                    fp = dp_xstrdup(s->valuestring);
                cJSON_Delete(ev);
            }
            p = le + 1;
        }
        return fp;
    }
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(doc, "system_fingerprint");
    if (cJSON_IsString(s))
        fp = dp_xstrdup(s->valuestring);
    cJSON_Delete(doc);
    return fp;
}

static int extract(const char *b, size_t n, bool stream, drift_output_t *out)
{
    if (!stream)
        return drift_extract_json(b, n, 0, out);
    drift_sse_t st = {0};
    if (drift_sse_feed(&st, b, n) == -1) {
        drift_sse_free(&st);
        return -1;
    }
    return drift_sse_finish(&st, out);
}

typedef struct {
    const cfg_t *cfg;
    const char *store;
    rrep_t *reps;
    size_t nreps;
    /* A running proxy (the config's admin_listen, or --admin): its relay, and the replicas it
     * serves. relayed: one answered. only_served (--admin): replay only on those. */
    probe_relay_t relay;
    bool relayed, only_served;
    attest_keyset_t keys;
    px_fetch_t w;
    bool json, deadline_hit;
    dp_jw_t jw;
    dp_buf_t jout;
    size_t reproduced, differs, not_replayable;
} replay_t;

static const char *jstr(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* ---- replay's own attestation: the proxy's check (probe/), judged as the proxy judges ---- */

static void rep_checked(attest_outcome_t *out, void *data)
{
    rrep_t *r = data;
    r->out = *out;
    memset(out, 0, sizeof(*out)); /* moved */
    r->done = true;
}

static void rep_canary(const probe_canary_result_t *res, void *data)
{
    rrep_t *r = data;
    r->canary_answered = res->answered;
    r->canary_ok = res->matched;
    if (!res->answered)
        r->canary_err = dp_xstrdup(res->error ? res->error : "no answer");
    r->done = true;
}

static bool wait_done(replay_t *rp, rrep_t *r)
{
    while (!r->done && (rp->w.deadline_ns == 0 || dp_now_ns() < rp->w.deadline_ns))
        uv_run(&rp->w.loop, UV_RUN_ONCE);
    return r->done;
}

static net_upstream_t *upstream_to(replay_t *rp, const cfg_url_t *u, net_tls_ctx_t *tls,
                                   const char *server_name, bool attest)
{
    struct sockaddr_storage ss;
    if (!net_resolve(u->host, u->port, &ss))
        return NULL;
    net_upstream_opts_t o;
    if (attest)
        probe_attest_upstream_opts(rp->cfg, &o);
    else
        probe_replica_upstream_opts(rp->cfg, &o);
    net_upstream_t *up = net_upstream_new(&rp->w.loop, (struct sockaddr *)&ss, &o);
    if (u->tls)
        net_upstream_set_tls(up, tls, server_name ? server_name : u->host);
    return up;
}

/* An upstream to the running proxy's admin listener (its relay). */
static net_upstream_t *relay_upstream(replay_t *rp, bool attest)
{
    net_upstream_opts_t o;
    if (attest)
        probe_attest_upstream_opts(rp->cfg, &o);
    else
        probe_replica_upstream_opts(rp->cfg, &o);
    return net_upstream_new(&rp->w.loop, (struct sockaddr *)&rp->relay.addr, &o);
}

static void attest_one(replay_t *rp, rrep_t *r)
{
    const cfg_replica_t *rc = r->rc;
    const cfg_pool_t *pc = r->pool;
    bool agent = rc->attest.source == CFG_ATTEST_AGENT;
    const cfg_url_t *au = agent ? &rc->attest.url : &rc->url;
    dp_buf_t terr = {0};
    if ((rc->url.tls || au->tls) &&
        (r->tls = net_tls_client_ctx(pc->upstream_tls ? pc->upstream_tls->ca_file : NULL,
                                     pc->upstream_tls ? pc->upstream_tls->client_cert_file : NULL,
                                     pc->upstream_tls ? pc->upstream_tls->client_key_file : NULL,
                                     &terr)) == NULL) {
        r->why = dp_buf_steal(&terr);
        return;
    }
    dp_buf_free(&terr);
    /* An agent is asked directly (it is no replica); a replica the running proxy serves only
     * through its relay, so the probe completion and the canary take a slot there. */
    dp_buf_t relay_h = {0};
    if (r->via)
        probe_relay_headers(r->via->pool, r->via->name, &relay_h);
    bool relay_att = r->via && !agent;
    net_upstream_t *up = relay_att
                             ? relay_upstream(rp, true)
                             : upstream_to(rp, au, r->tls, agent ? NULL : rc->server_name, true);
    if (up == NULL) {
        dp_buf_t why = {0};
        dp_buf_printf(&why, "host name '%s' did not resolve", au->host);
        r->why = dp_buf_steal(&why);
        dp_buf_free(&relay_h);
        return;
    }
    bool req_sig = cfg_pool_require_signature(rp->cfg, pc);
    probe_opts_t o = {.up = up,
                      .source = rc->attest.source,
                      .hostport = relay_att ? rp->relay.hostport : au->hostport,
                      .base = relay_att      ? PROBE_RELAY_BASE
                              : rc->url.path ? rc->url.path
                                             : "",
                      .agent_path = agent ? rc->attest.url.path : NULL,
                      .bearer = relay_att ? rp->relay.bearer : pc->api_key,
                      .extra_headers = relay_att ? relay_h.base : NULL,
                      .keys = &rp->keys,
                      .require_signature = req_sig,
                      .model = probe_canary_model(pc, NULL)};
    r->done = false;
    probe_t *pr = probe_start(&o, rep_checked, r);
    if (!wait_done(rp, r)) {
        probe_cancel(pr);
        r->why = dp_xstrdup("attestation: --timeout passed");
        net_upstream_free(up);
        dp_buf_free(&relay_h);
        return;
    }
    net_upstream_free(up);
    attest_check_judge(&r->out, pc->manifest, req_sig);
    if (r->out.verdict != ATTEST_V_ADMITTED) {
        r->why = dp_xstrdup(attest_outcome_reason(&r->out, "not admitted"));
        dp_buf_free(&relay_h);
        return;
    }
    const cfg_manifest_t *id = attest_manifest_identity(pc->manifest, &r->out.report);
    char pfp[20];
    cfg_manifest_fingerprint(pc->manifest, pfp);
    snprintf(r->fp, sizeof(r->fp), "%s", id ? id->fingerprint : pfp);
    if (id && id->canary) {
        /* The proxy admits a replica with a canary only once its output matches too. */
        net_upstream_t *cu = r->via ? relay_upstream(rp, false)
                                    : upstream_to(rp, &rc->url, r->tls, rc->server_name, false);
        if (cu == NULL) {
            r->why = dp_xstrdup("canary: host name did not resolve");
            dp_buf_free(&relay_h);
            return;
        }
        r->done = false;
        const probe_route_t to = {.hostport = r->via ? rp->relay.hostport : rc->url.hostport,
                                  .base = r->via         ? PROBE_RELAY_BASE
                                          : rc->url.path ? rc->url.path
                                                         : "",
                                  .bearer = r->via ? rp->relay.bearer : pc->api_key,
                                  .extra_headers = r->via ? relay_h.base : NULL};
        probe_canary_t *c = probe_canary_start(cu, pc, id, &to, rep_canary, r);
        bool done = wait_done(rp, r);
        if (!done)
            probe_canary_cancel(c);
        net_upstream_free(cu);
        if (!done || !r->canary_ok) {
            dp_buf_t why = {0};
            dp_buf_printf(&why, "canary %s",
                          !done                 ? "not answered: --timeout passed"
                          : !r->canary_answered ? "not answered"
                                                : "output differs");
            if (r->canary_err)
                dp_buf_printf(&why, ": %s", r->canary_err);
            r->why = dp_buf_steal(&why);
            dp_buf_free(&relay_h);
            return;
        }
    }
    dp_buf_free(&relay_h);
    r->admitted = true;
}

static void attest_all(replay_t *rp)
{
    const cfg_t *cfg = rp->cfg;
    size_t n = 0;
    for (size_t k = 0; k < cfg->npools; k++)
        n += cfg->pools[k].nreplicas;
    rp->reps = dp_xcalloc(n + 1, sizeof(*rp->reps));
    for (size_t k = 0; k < cfg->npools; k++) {
        for (size_t i = 0; i < cfg->pools[k].nreplicas; i++) {
            rrep_t *r = &rp->reps[rp->nreps++];
            r->pool = &cfg->pools[k];
            r->rc = &cfg->pools[k].replicas[i];
            r->via =
                rp->relayed ? probe_relay_lookup(&rp->relay, r->pool->name, &r->rc->url) : NULL;
            attest_one(rp, r);
            if (!rp->json)
                fprintf(stderr, "detproxy replay: %s/%s: %s%s%s\n", px_fetch_safe(0, r->pool->name),
                        px_fetch_safe(1, r->rc->name),
                        r->admitted ? "attested, identity " : "not admitted: ",
                        r->admitted ? r->fp : "", r->admitted ? "" : px_fetch_safe(2, r->why));
        }
    }
}

static bool read_stored(const replay_t *rp, const char *hex, dp_buf_t *out)
{
    if (rp->store == NULL || hex == NULL || strlen(hex) != 64 || strchr(hex, '/'))
        return false;
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", rp->store, hex);
    if (dp_read_file(path, PX_FETCH_MAX_BODY, out) != 0)
        return false;
    char got[65];
    dp_sha256_hex(out->base, out->len, got);
    return strcmp(got, hex) == 0; /* an altered body is no evidence */
}

typedef struct {
    const char *id, *result, *replica;
    dp_buf_t why;
    drift_result_t cmp;
    int fp_matches; /* -1 unknown */
} outcome_t;

static void report(replay_t *rp, outcome_t *o)
{
    if (strcmp(o->result, "reproduced") == 0)
        rp->reproduced++;
    else if (strcmp(o->result, "differs") == 0)
        rp->differs++;
    else
        rp->not_replayable++;
    bool differs = strcmp(o->result, "differs") == 0;
    if (rp->json) {
        dp_jw_obj_begin(&rp->jw, NULL);
        dp_jw_str(&rp->jw, "request_id", o->id);
        dp_jw_str(&rp->jw, "result", o->result);
        dp_jw_str(&rp->jw, "replica", o->replica);
        if (o->why.len)
            dp_jw_strn(&rp->jw, "why", o->why.base, o->why.len);
        if (differs) {
            dp_jw_int(&rp->jw, "divergence_offset", o->cmp.divergence_offset);
            dp_jw_double(&rp->jw, "similarity", drift_sample_similarity(&o->cmp));
            if (o->fp_matches < 0)
                dp_jw_null(&rp->jw, "fingerprint_matches");
            else
                dp_jw_bool(&rp->jw, "fingerprint_matches", o->fp_matches);
        }
        dp_jw_obj_end(&rp->jw);
        return;
    }
    /* Everything printed that came from a file or a replica is escaped for the terminal. */
    printf("%-36s %-15s", px_fetch_safe(0, o->id), o->result);
    if (o->replica)
        printf(" replica=%s", px_fetch_safe(1, o->replica));
    if (differs)
        printf(" offset=%lld similarity=%.3f fingerprint_matches=%s",
               (long long)o->cmp.divergence_offset, drift_sample_similarity(&o->cmp),
               o->fp_matches < 0 ? "unknown"
               : o->fp_matches   ? "yes"
                                 : "no");
    if (o->why.len)
        printf(" (%s)", px_fetch_safe(2, o->why.base));
    putchar('\n');
}

/* The replica to replay on: one admitted (by replay's own check) with the audited identity,
 * the one that answered first when it still has it. */
static const rrep_t *pick_replica(const replay_t *rp, const char *fp, const char *pool,
                                  const char *name)
{
    const rrep_t *any = NULL;
    for (size_t i = 0; i < rp->nreps; i++) {
        const rrep_t *r = &rp->reps[i];
        if (!r->admitted || strcmp(r->fp, fp) != 0 ||
            (rp->only_served && !(r->via && r->via->serving)))
            continue;
        if (pool && name && strcmp(r->pool->name, pool) == 0 && strcmp(r->rc->name, name) == 0)
            return r;
        if (any == NULL)
            any = r;
    }
    return any;
}

/* Send body to r: through the running proxy's relay when it serves r (its admission slots,
 * its credentials: probe/relay.h), else straight to r's URL from the config. The HTTP status,
 * or 0 with rp->w.err. */
static int send_replay(replay_t *rp, const rrep_t *r, const char *route, const dp_buf_t *body)
{
    if (r->via) {
        char target[512];
        snprintf(target, sizeof(target), "%s%s", PROBE_RELAY_BASE, route);
        dp_buf_t h = {0};
        probe_relay_headers(r->via->pool, r->via->name, &h);
        const cfg_addr_t admin = {.host = rp->relay.host, .port = rp->relay.port};
        int st = px_fetch_admin_post(&rp->w, "detproxy replay", rp->cfg, &admin, target, h.base,
                                     body->base, body->len);
        dp_buf_free(&h);
        return st;
    }
    const cfg_url_t *u = &r->rc->url;
    char target[512];
    snprintf(target, sizeof(target), "%s%s", u->path ? u->path : "", route);
    return px_fetch(&rp->w, rp->cfg, u->host, u->port, u->tls ? r->tls : NULL, r->rc->server_name,
                    u->hostport, "POST", target, r->pool->api_key, NULL, body->base, body->len);
}

/* The proxy's own refusal on the send route ({"error":{"code":...}}), or NULL. */
static char *proxy_error_code(const dp_buf_t *b)
{
    cJSON *doc = cJSON_ParseWithLength(b->base ? b->base : "", b->len);
    const char *c = jstr(cJSON_GetObjectItemCaseSensitive(doc, "error"), "code");
    char *out = c ? dp_xstrdup(c) : NULL;
    cJSON_Delete(doc);
    return out;
}

static const char *const replay_routes[] = {"/v1/completions", "/v1/chat/completions",
                                            "/v1/responses"};

static void replay_one(replay_t *rp, const cJSON *line)
{
    outcome_t o = {.id = jstr(line, "request_id"), .result = "not_replayable", .fp_matches = -1};
    if (o.id == NULL)
        o.id = "-";
    const char *fwd = jstr(line, "forwarded_body_sha256");
    const char *resp = jstr(line, "response_body_sha256");
    const char *fp = jstr(line, "fingerprint");
    const char *route = jstr(line, "route");
    const cJSON *seed = cJSON_GetObjectItemCaseSensitive(line, "seed");
    const cJSON *temp = cJSON_GetObjectItemCaseSensitive(line, "temperature");
    bool stream = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(line, "stream"));
    const cJSON *cut = cJSON_GetObjectItemCaseSensitive(line, "error");
    const char *cut_code = cJSON_IsObject(cut) ? jstr(cut, "code") : NULL;
    bool known_route = false;
    for (size_t i = 0; route && i < DP_ARRAY_SIZE(replay_routes); i++)
        known_route |= strcmp(route, replay_routes[i]) == 0;
    dp_buf_t req = {0}, old = {0};
    drift_output_t a = {0}, b = {0};
    char *got_fp = NULL;
    const rrep_t *pick = NULL;
    if (rp->deadline_hit) {
        dp_buf_appends(&o.why, "--timeout passed before its turn");
    } else if (fwd == NULL) {
        dp_buf_appends(&o.why, "no forwarded body: the request was refused before a replica");
    } else if (cJSON_IsObject(cut)) {
        /* An answer begun and then cut (docs/policy.md): its stored response is a part of
         * one, which a whole new answer would "differ" from. */
        dp_buf_printf(&o.why, "the answer was cut (error %s): no whole response to compare with",
                      cut_code ? cut_code : "?");
    } else if (!read_stored(rp, fwd, &req)) {
        if (cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(line, "bodies_stored")))
            dp_buf_printf(&o.why,
                          "no stored body %.12s..: its line says its bodies were not "
                          "stored (the store failed as it was written)",
                          fwd);
        else
            dp_buf_printf(&o.why, "no stored body %.12s.. (log.audit_store, or --store)", fwd);
    } else if (resp == NULL || !read_stored(rp, resp, &old)) {
        dp_buf_appends(&o.why, "no stored response body to compare with");
    } else if (!cJSON_IsNumber(seed) && !(cJSON_IsNumber(temp) && temp->valuedouble == 0)) {
        dp_buf_appends(&o.why, "unseeded sampling: no seed and temperature is not 0");
    } else if (!known_route || fp == NULL) {
        dp_buf_appends(&o.why, "the line names no inference route or no fingerprint");
    } else if ((pick = pick_replica(rp, fp, jstr(line, "pool"), jstr(line, "replica"))) == NULL) {
        dp_buf_printf(&o.why, "no replica of the config attests identity %s now%s", fp,
                      rp->only_served ? " and is served by the proxy" : "");
    } else {
        o.replica = pick->rc->name;
        int st = send_replay(rp, pick, route, &req);
        char *code = st != 200 && st ? proxy_error_code(&rp->w.body) : NULL;
        if (st != 200) {
            if (st == 0 && rp->w.err.len >= 8 && memcmp(rp->w.err.base, "deadline", 8) == 0)
                rp->deadline_hit = true;
            if (st && code)
                dp_buf_printf(&o.why, "%s answered HTTP %d %s", pick->via ? "proxy" : "replica", st,
                              code);
            else if (st)
                dp_buf_printf(&o.why, "replica answered HTTP %d", st);
            else
                dp_buf_printf(&o.why, "%s: %.*s", pick->via ? "proxy" : "replica",
                              (int)rp->w.err.len, rp->w.err.base);
        } else if (extract(old.base, old.len, stream, &a) != 0 ||
                   extract(rp->w.body.base, rp->w.body.len, stream, &b) != 0) {
            dp_buf_appends(&o.why, "no output text in the stored or the new response");
        } else {
            drift_compare(&a, &b, &o.cmp);
            o.result = o.cmp.match ? "reproduced" : "differs";
            const char *was = jstr(line, "upstream_fingerprint");
            got_fp = upstream_fp(rp->w.body.base, rp->w.body.len);
            if (was && got_fp)
                o.fp_matches = strcmp(was, got_fp) == 0;
        }
        free(code);
    }
    report(rp, &o);
    free(got_fp);
    drift_output_free(&a);
    drift_output_free(&b);
    dp_buf_free(&o.why);
    dp_buf_free(&req);
    dp_buf_free(&old);
}

typedef struct {
    const char *config, *audit, *id, *since, *store, *admin;
    uint64_t timeout_s;
    bool all, json;
} replay_opts_t;

static const dp_arg_t replay_table[] = {
    {.name = "--config",
     .shortopt = 'c',
     .kind = DP_ARG_STR,
     .off = offsetof(replay_opts_t, config),
     .meta = "CONFIG",
     .help = "the proxy's configuration (pools, replicas, manifests, keys)"},
    {.name = "--audit",
     .kind = DP_ARG_STR,
     .off = offsetof(replay_opts_t, audit),
     .meta = "FILE",
     .help = "the audit file"},
    {.name = "--request-id",
     .kind = DP_ARG_STR,
     .off = offsetof(replay_opts_t, id),
     .meta = "ID",
     .help = "replay this request"},
    {.name = "--all",
     .kind = DP_ARG_FLAG,
     .off = offsetof(replay_opts_t, all),
     .help = "replay every request of the file"},
    {.name = "--since",
     .kind = DP_ARG_STR,
     .off = offsetof(replay_opts_t, since),
     .meta = "T",
     .help = "with --all: lines whose time is T or later (RFC 3339, e.g.\n"
             "2026-12-01T09:00:00Z, or a date: its midnight UTC)"},
    {.name = "--store",
     .kind = DP_ARG_STR,
     .off = offsetof(replay_opts_t, store),
     .meta = "DIR",
     .help = "the body store (default: log.audit_store)"},
    {.name = "--admin",
     .kind = DP_ARG_STR,
     .off = offsetof(replay_opts_t, admin),
     .meta = "HOST:PORT",
     .help = "the running proxy whose relay (/admin/relay: its admission\n"
             "slots) the replays go through (default: the config's\n"
             "admin_listen, when a proxy answers there); with it, one\n"
             "must answer, and only replicas it serves are replayed on"},
    {.name = "--timeout",
     .kind = DP_ARG_UINT,
     .off = offsetof(replay_opts_t, timeout_s),
     .meta = "SECONDS",
     .min = 1,
     .max = 86400,
     .help = "the whole run's deadline, attestation included (default 600)"},
    {.name = "--json",
     .kind = DP_ARG_FLAG,
     .off = offsetof(replay_opts_t, json),
     .help = "one JSON object: results[] and a summary"},
};

static const dp_args_t replay_spec = {
    .prog = "detproxy replay",
    .usage = "detproxy replay -c CONFIG --audit FILE (--request-id ID | --all [--since T])\n"
             "                       [--store DIR] [--admin HOST:PORT] [--timeout S] [--json]",
    .about = "Attest the config's replicas with the proxy's own check (metadata, then the\n"
             "canary), then re-send each audited request's stored forwarded body to a replica\n"
             "that attests the audited identity (the one that answered, when it still does)\n"
             "and compare the output with the stored response: reproduced, differs (offset,\n"
             "similarity, whether the engine's fingerprint still matches) or not_replayable\n"
             "(why). Needs no running proxy and no writable audit path: only the config, the\n"
             "audit file and the store. See docs/operations.md, \"Evidence\".",
    .opts = replay_table,
    .nopts = DP_ARRAY_SIZE(replay_table),
    .epilog = "Exit codes: 0 nothing differs, 1 a replay differs (or the request id is not in\n"
              "the file), 2 usage error, unusable config, or an audit file that cannot be read\n"
              "or holds no audit line, 3 the admin API (--admin) could not be read, or\n"
              "--timeout passed.",
};

int px_cmd_replay(int argc, char **argv)
{
    replay_opts_t opt = {0};
    int r = dp_args_parse(&replay_spec, argc, argv, &opt);
    if (r != 0)
        return dp_args_exit(r);
    if (!opt.config || !opt.audit || (opt.id == NULL) == !opt.all || (opt.since && !opt.all))
        return dp_args_usage_error(&replay_spec,
                                   "need -c CONFIG, --audit FILE and exactly one of --request-id "
                                   "ID or --all (--since only with --all)");
    const char *audit = opt.audit, *id = opt.id;
    int64_t since = INT64_MIN;
    if (opt.since && dp_parse_time_ms(opt.since, &since) != 0)
        return dp_args_usage_error(&replay_spec, "--since: not an RFC 3339 time or date");
    cfg_errors_t errs = {0};
    cfg_t *cfg = NULL;
    if (cfg_load_reader(opt.config, &cfg, &errs) != 0)
        for (size_t i = 0; i < errs.count; i++)
            fprintf(stderr, "%s: %s\n", opt.config, errs.items[i]);
    cfg_errors_free(&errs);
    if (cfg == NULL)
        return 2;
    cfg_addr_t aaddr = {0};
    if (opt.admin && px_fetch_admin_addr("detproxy replay", cfg, opt.admin, &aaddr) != 0) {
        cfg_free(cfg);
        return 2;
    }
    int fd = dp_open_input(audit);
    FILE *f = fd >= 0 ? fdopen(fd, "r") : NULL;
    if (f == NULL) {
        fprintf(stderr, "detproxy replay: %s: %s\n", px_fetch_safe(0, audit),
                dp_input_strerror(fd < 0 ? fd : -errno));
        if (fd >= 0)
            close(fd);
        free(aaddr.host);
        cfg_free(cfg);
        return 2;
    }
    replay_t rp = {.cfg = cfg,
                   .store = opt.store ? opt.store : cfg->log.audit_store,
                   .json = opt.json,
                   .only_served = opt.admin != NULL};
    for (size_t i = 0; i < cfg->attestation.ntrusted_keys; i++) {
        dp_buf_t err = {0};
        if (attest_keyset_add_file(&rp.keys, cfg->attestation.trusted_keys[i], &err) != 0)
            fprintf(stderr, "detproxy replay: warning: trusted key %s: %s\n",
                    cfg->attestation.trusted_keys[i], err.base ? err.base : "unreadable");
        dp_buf_free(&err);
    }
    px_fetch_init(&rp.w);
    rp.w.deadline_ns = dp_now_ns() + (opt.timeout_s ? opt.timeout_s : 600) * 1000000000ull;
    int rc = 3;
    /* A running proxy (the config's, or the one --admin names) serves some replicas: replays to
     * them go through its relay, under its admission slots. Without --admin, none answering
     * means straight to the replicas; with it, an error. */
    dp_buf_t note = {0};
    rp.relayed = probe_relay_find(&rp.w.loop, cfg, opt.admin ? aaddr.host : NULL,
                                  opt.admin ? aaddr.port : 0, &rp.relay, &note) == 1;
    if (!rp.relayed && opt.admin)
        fprintf(stderr, "detproxy replay: --admin %s: %s\n", px_fetch_safe(0, opt.admin),
                px_fetch_safe(1, note.base));
    else if (!rp.relayed && !rp.json)
        fprintf(stderr, "detproxy replay: directly to the replicas: %s\n",
                px_fetch_safe(0, note.base));
    dp_buf_free(&note);
    if (rp.relayed || !opt.admin)
        attest_all(&rp);
    if (rp.relayed || !opt.admin) {
        if (rp.json) {
            dp_jw_init(&rp.jw, &rp.jout);
            dp_jw_obj_begin(&rp.jw, NULL);
            dp_jw_arr_begin(&rp.jw, "results");
        }
        char *line = NULL;
        size_t cap = 0, found = 0, lines = 0, skipped = 0, audited = 0;
        ssize_t n;
        while ((n = getline(&line, &cap, f)) > 0) {
            cJSON *o = cJSON_ParseWithLength(line, (size_t)n);
            lines++;
            skipped += !cJSON_IsObject(o); /* a torn last line, or not an audit file at all */
            const char *rid = jstr(o, "request_id");
            audited += rid && !cJSON_GetObjectItemCaseSensitive(o, "checkpoint");
            int64_t t;
            bool want =
                cJSON_IsObject(o) && !cJSON_GetObjectItemCaseSensitive(o, "checkpoint") && rid &&
                (id ? strcmp(rid, id) == 0
                    : !opt.since || (dp_parse_time_ms(jstr(o, "time"), &t) == 0 && t >= since));
            if (want) {
                found++;
                if (!rp.deadline_hit && rp.w.deadline_ns && dp_now_ns() >= rp.w.deadline_ns)
                    rp.deadline_hit = true;
                replay_one(&rp, o);
            }
            cJSON_Delete(o);
        }
        free(line);
        bool unread = ferror(f) != 0;
        if (unread)
            fprintf(stderr, "detproxy replay: %s: %s\n", px_fetch_safe(0, audit), strerror(errno));
        else if (audited == 0)
            fprintf(stderr,
                    "detproxy replay: %s: no audit line (%zu lines, %zu of them not JSON "
                    "objects)\n",
                    px_fetch_safe(0, audit), lines, skipped);
        else if (skipped)
            fprintf(stderr, "detproxy replay: %s: warning: %zu of %zu lines are not JSON objects\n",
                    px_fetch_safe(0, audit), skipped, lines);
        if (rp.json) {
            dp_jw_arr_end(&rp.jw);
            dp_jw_obj_begin(&rp.jw, "summary");
            dp_jw_uint(&rp.jw, "replayed", found);
            dp_jw_uint(&rp.jw, "reproduced", rp.reproduced);
            dp_jw_uint(&rp.jw, "differs", rp.differs);
            dp_jw_uint(&rp.jw, "not_replayable", rp.not_replayable);
            dp_jw_bool(&rp.jw, "deadline_passed", rp.deadline_hit);
            dp_jw_obj_end(&rp.jw);
            dp_jw_obj_end(&rp.jw);
            printf("%.*s\n", (int)rp.jout.len, rp.jout.base);
        } else {
            printf("%zu replayed: %zu reproduced, %zu differ, %zu not replayable%s\n", found,
                   rp.reproduced, rp.differs, rp.not_replayable,
                   rp.deadline_hit ? " (--timeout passed)" : "");
        }
        if (unread || audited == 0) {
            rc = 2;
        } else if (id && found == 0) {
            fprintf(stderr, "detproxy replay: request id %s is not in %s\n", px_fetch_safe(0, id),
                    audit);
            rc = 1;
        } else {
            rc = rp.differs ? 1 : rp.deadline_hit ? 3 : 0;
        }
    }
    fclose(f);
    for (size_t i = 0; i < rp.nreps; i++) {
        free(rp.reps[i].why);
        free(rp.reps[i].canary_err);
        attest_outcome_clear(&rp.reps[i].out);
        net_tls_ctx_unref(rp.reps[i].tls);
    }
    free(rp.reps);
    probe_relay_free(&rp.relay);
    attest_keyset_free(&rp.keys);
    dp_buf_free(&rp.jout);
    px_fetch_free(&rp.w);
    free(aaddr.host);
    cfg_free(cfg);
    return rc;
}
