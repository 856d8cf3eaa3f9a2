/* `detproxy audit verify` and `detproxy replay` (docs/operations.md, "Evidence: stored bodies,
 * chained audit, `audit verify`, `replay`"): the evidence commands.
 *
 * verify is offline (attest/audit_chain.c does the work). replay reads the audit file and the
 * body store, asks the running proxy's admin API which replicas are admitted, and re-sends each
 * stored forwarded body straight to an admitted replica of a pool whose fingerprint (computed
 * from the config's manifests, as the proxy does) is the audited one; the outputs are compared
 * with the shadow comparator (drift/). Requests go one at a time: a replay is evidence, not
 * a load test. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* ---- audit verify ---------------------------------------------------------------------------- */

typedef struct {
    const char *pubkey, *store;
    dp_arg_list_t files;
} audit_opts_t;

static const dp_arg_t audit_table[] = {
    {.name = "--pubkey",
     .kind = DP_ARG_STR,
     .off = offsetof(audit_opts_t, pubkey),
     .meta = "PEM",
     .help = "the public half of log.audit_signing_key: check the\n"
             "checkpoint signatures with it"},
    {.name = "--store",
     .kind = DP_ARG_STR,
     .off = offsetof(audit_opts_t, store),
     .meta = "DIR",
     .help = "the body store (log.audit_store): check that every stored\n"
             "body is there and hashes to its name"},
};

static const dp_args_t audit_spec = {
    .prog = "detproxy audit verify",
    .usage = "detproxy audit verify FILE... [--pubkey PEM] [--store DIR]",
    .about = "Check the hash chain of each audit file (several files: in rotation order, the\n"
             "chain carried from one to the next), the checkpoint signatures and the stored\n"
             "bodies (docs/operations.md, \"Evidence\"). Exit 1 at the first break, naming the\n"
             "line.",
    .opts = audit_table,
    .nopts = DP_ARRAY_SIZE(audit_table),
    .epilog = "Exit codes: 0 every file checks out, 1 a break (or a file that cannot be read),\n"
              "2 usage error or an unusable --pubkey.",
    .positional = true,
    .pos_off = offsetof(audit_opts_t, files),
};

int px_cmd_audit(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "verify") != 0) {
        if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
            dp_args_help(&audit_spec, stdout);
            return 0;
        }
        dp_args_help(&audit_spec, stderr);
        return 2;
    }
    argc--;
    argv++;
    /* Every argument could be a FILE. */
    audit_opts_t o = {
        .files = {.items = dp_xcalloc((size_t)argc, sizeof(char *)), .max = (size_t)argc}};
    int pr = dp_args_parse(&audit_spec, argc, argv, &o);
    if (pr != 0 || o.files.n == 0) {
        free(o.files.items);
        return pr != 0 ? dp_args_exit(pr) : dp_args_usage_error(&audit_spec, "FILE is required");
    }
    const char *pub = o.pubkey, *store = o.store;
    attest_key_t *key = NULL;
    if (pub) {
        dp_buf_t err = {0};
        if (attest_key_load(pub, false, &key, &err) != 0) {
            fprintf(stderr, "detproxy audit verify: --pubkey %s: %.*s\n", pub, (int)err.len,
                    err.base ? err.base : "");
            dp_buf_free(&err);
            free(o.files.items);
            return 2;
        }
        dp_buf_free(&err);
    }
    int rc = 0;
    char prev[65] = "";
    for (size_t i = 0; i < o.files.n && rc == 0; i++) {
        const char *file = o.files.items[i];
        audit_verify_opts_t vo = {
            .pubkey = key, .store = store, .expect_prev = prev[0] ? prev : NULL};
        audit_verify_result_t r;
        dp_buf_t why = {0};
        if (audit_verify_file(file, &vo, &r, &why) != 0) {
            if (r.bad_line)
                printf("%s: line %llu: %.*s\n", file, (unsigned long long)r.bad_line, (int)why.len,
                       why.base);
            else
                printf("%s: %.*s\n", file, (int)why.len, why.base);
            rc = 1;
        } else {
            printf("%s: ok: %llu lines, %llu checkpoints, ", file, (unsigned long long)r.lines,
                   (unsigned long long)r.checkpoints);
            if (key)
                printf("%llu signatures verified", (unsigned long long)r.signatures_checked);
            else
                printf("signatures not checked (no --pubkey)");
            if (store)
                printf(", %llu stored bodies checked", (unsigned long long)r.bodies_checked);
            if (key && r.unsigned_tail)
                printf(", %llu lines after the last checkpoint (not signed yet)",
                       (unsigned long long)r.unsigned_tail);
            putchar('\n');
            memcpy(prev, r.last, sizeof(prev));
        }
        dp_buf_free(&why);
    }
    attest_key_free(key);
    free(o.files.items);
    return rc;
}

/* ---- replay ---------------------------------------------------------------------------------- */

typedef struct {
    char *pool, *name, *url;
    bool serving;
} admin_replica_t;

static int read_replicas(px_fetch_t *w, const cfg_t *cfg, const cfg_addr_t *admin,
                         admin_replica_t **out, size_t *n)
{
    if (px_fetch_admin_get(w, "detproxy replay", cfg, admin, "/admin/replicas") != 0)
        return -1;
    cJSON *doc = cJSON_ParseWithLength(w->body.base, w->body.len);
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(doc, "replicas");
    *n = 0;
    *out = dp_xcalloc((size_t)cJSON_GetArraySize(arr) + 1, sizeof(**out));
    const cJSON *it;
    cJSON_ArrayForEach(it, arr)
    {
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(it, "pool");
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(it, "name");
        const cJSON *u = cJSON_GetObjectItemCaseSensitive(it, "url");
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(it, "state");
        const cJSON *sv = cJSON_GetObjectItemCaseSensitive(it, "serving");
        if (!cJSON_IsString(p) || !cJSON_IsString(nm) || !cJSON_IsString(u) || !cJSON_IsString(s))
            continue;
        admin_replica_t *r = &(*out)[(*n)++];
        r->pool = dp_xstrdup(p->valuestring);
        r->name = dp_xstrdup(nm->valuestring);
        r->url = dp_xstrdup(u->valuestring);
        r->serving = strcmp(s->valuestring, "admitted") == 0 && !cJSON_IsFalse(sv);
    }
    cJSON_Delete(doc);
    return 0;
}

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
    admin_replica_t *reps;
    size_t nreps;
    char (*fps)[20]; /* per config pool */
    px_fetch_t w;
    bool json;
    dp_jw_t jw;
    dp_buf_t jout;
    size_t reproduced, differs, not_replayable;
} replay_t;

static const char *jstr(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
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
    printf("%-36s %-15s", o->id, o->result);
    if (o->replica)
        printf(" replica=%s", o->replica);
    if (differs)
        printf(" offset=%lld similarity=%.3f fingerprint_matches=%s",
               (long long)o->cmp.divergence_offset, drift_sample_similarity(&o->cmp),
               o->fp_matches < 0 ? "unknown"
               : o->fp_matches   ? "yes"
                                 : "no");
    if (o->why.len)
        printf(" (%.*s)", (int)o->why.len, o->why.base);
    putchar('\n');
}

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
    dp_buf_t req = {0}, old = {0};
    drift_output_t a = {0}, b = {0};
    char *got_fp = NULL;
    if (fwd == NULL) {
        dp_buf_appends(&o.why, "no forwarded body: the request was refused before a replica");
    } else if (!read_stored(rp, fwd, &req)) {
        dp_buf_printf(&o.why, "no stored body %.12s.. (log.audit_store, or --store)", fwd);
    } else if (resp == NULL || !read_stored(rp, resp, &old)) {
        dp_buf_appends(&o.why, "no stored response body to compare with");
    } else if (!cJSON_IsNumber(seed) && !(cJSON_IsNumber(temp) && temp->valuedouble == 0)) {
        dp_buf_appends(&o.why, "unseeded sampling: no seed and temperature is not 0");
    } else if (route == NULL || fp == NULL) {
        dp_buf_appends(&o.why, "the line names no route or fingerprint");
    } else {
        const admin_replica_t *pick = NULL;
        for (size_t i = 0; i < rp->nreps && !pick; i++) {
            if (!rp->reps[i].serving)
                continue;
            for (size_t k = 0; k < rp->cfg->npools; k++)
                if (strcmp(rp->cfg->pools[k].name, rp->reps[i].pool) == 0 &&
                    strcmp(rp->fps[k], fp) == 0)
                    pick = &rp->reps[i];
        }
        cfg_url_t u = {0};
        const char *uwhy = NULL;
        const cfg_pool_t *pc = pick ? cfg_pool_by_name(rp->cfg, pick->pool) : NULL;
        const char *server_name = NULL;
        for (size_t k = 0; pc && k < pc->nreplicas; k++)
            if (strcmp(pc->replicas[k].name, pick->name) == 0)
                server_name = pc->replicas[k].server_name;
        net_tls_ctx_t *tls = NULL;
        dp_buf_t terr = {0};
        if (pick == NULL || pc == NULL) {
            dp_buf_printf(&o.why, "no admitted replica with fingerprint %s", fp);
        } else if (cfg_parse_url(pick->url, &u, &uwhy) != 0) {
            dp_buf_printf(&o.why, "replica %s: %s", pick->name, uwhy);
        } else if (u.tls && (tls = net_tls_client_ctx(
                                 pc->upstream_tls ? pc->upstream_tls->ca_file : NULL,
                                 pc->upstream_tls ? pc->upstream_tls->client_cert_file : NULL,
                                 pc->upstream_tls ? pc->upstream_tls->client_key_file : NULL,
                                 &terr)) == NULL) {
            dp_buf_printf(&o.why, "replica %s: TLS: %.*s", pick->name, (int)terr.len, terr.base);
        } else {
            o.replica = pick->name;
            char target[512];
            snprintf(target, sizeof(target), "%s%s", u.path ? u.path : "", route);
            int st = px_fetch(&rp->w, rp->cfg, u.host, u.port, tls, server_name, u.hostport, "POST",
                              target, pc->api_key, req.base, req.len);
            if (st != 200) {
                if (st)
                    dp_buf_printf(&o.why, "replica answered HTTP %d", st);
                else
                    dp_buf_printf(&o.why, "replica: %.*s", (int)rp->w.err.len, rp->w.err.base);
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
        }
        cfg_url_free(&u);
        net_tls_ctx_unref(tls);
        dp_buf_free(&terr);
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
    bool all, json;
} replay_opts_t;

static const dp_arg_t replay_table[] = {
    {.name = "--config",
     .shortopt = 'c',
     .kind = DP_ARG_STR,
     .off = offsetof(replay_opts_t, config),
     .meta = "CONFIG",
     .help = "the proxy's configuration (pools, manifests, admin_listen)"},
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
     .help = "with --all: lines whose time is T or later (ISO 8601, UTC)"},
    {.name = "--store",
     .kind = DP_ARG_STR,
     .off = offsetof(replay_opts_t, store),
     .meta = "DIR",
     .help = "the body store (default: log.audit_store)"},
    {.name = "--admin",
     .kind = DP_ARG_STR,
     .off = offsetof(replay_opts_t, admin),
     .meta = "HOST:PORT",
     .help = "the running proxy's admin API (default: admin_listen; give\n"
             "it when that port is 0)"},
    {.name = "--json",
     .kind = DP_ARG_FLAG,
     .off = offsetof(replay_opts_t, json),
     .help = "one JSON object: results[] and a summary"},
};

static const dp_args_t replay_spec = {
    .prog = "detproxy replay",
    .usage = "detproxy replay -c CONFIG --audit FILE (--request-id ID | --all [--since T])\n"
             "                       [--store DIR] [--admin HOST:PORT] [--json]",
    .about = "Re-send each audited request's stored forwarded body to an admitted replica whose\n"
             "pool has the audited fingerprint (the running proxy's admin API says which are\n"
             "admitted) and compare the output with the stored response: reproduced, differs\n"
             "(offset, similarity, whether the engine's fingerprint still matches) or\n"
             "not_replayable (why). See docs/operations.md, \"Evidence\".",
    .opts = replay_table,
    .nopts = DP_ARRAY_SIZE(replay_table),
    .epilog = "Exit codes: 0 nothing differs, 1 a replay differs (or the request id is not in\n"
              "the file), 2 usage error or unusable config, 3 the admin API could not be read.",
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
    const char *cpath = opt.config, *audit = opt.audit, *id = opt.id, *since = opt.since;
    const char *store = opt.store, *admin = opt.admin;
    bool json = opt.json;
    cfg_t *cfg = px_fetch_config(cpath);
    if (cfg == NULL)
        return 2;
    cfg_addr_t aaddr;
    if (px_fetch_admin_addr("detproxy replay", cfg, admin, &aaddr) != 0) {
        cfg_free(cfg);
        return 2;
    }
    FILE *f = fopen(audit, "re");
    if (f == NULL) {
        fprintf(stderr, "detproxy replay: %s: %s\n", audit, strerror(errno));
        free(aaddr.host);
        cfg_free(cfg);
        return 2;
    }
    replay_t rp = {.cfg = cfg, .store = store ? store : cfg->log.audit_store, .json = json};
    rp.fps = dp_xcalloc(cfg->npools + 1, sizeof(*rp.fps));
    for (size_t k = 0; k < cfg->npools; k++)
        cfg_manifest_fingerprint(cfg->pools[k].manifest, rp.fps[k]);
    px_fetch_init(&rp.w);
    int rc = 3;
    if (read_replicas(&rp.w, cfg, &aaddr, &rp.reps, &rp.nreps) == 0) {
        if (json) {
            dp_jw_init(&rp.jw, &rp.jout);
            dp_jw_obj_begin(&rp.jw, NULL);
            dp_jw_arr_begin(&rp.jw, "results");
        }
        char *line = NULL;
        size_t cap = 0, found = 0;
        ssize_t n;
        while ((n = getline(&line, &cap, f)) > 0) {
            cJSON *o = cJSON_ParseWithLength(line, (size_t)n);
            const char *rid = jstr(o, "request_id"), *t = jstr(o, "time");
            bool want = cJSON_IsObject(o) && !cJSON_GetObjectItemCaseSensitive(o, "checkpoint") &&
                        rid && (id ? strcmp(rid, id) == 0 : !since || (t && strcmp(t, since) >= 0));
            if (want) {
                found++;
                replay_one(&rp, o);
            }
            cJSON_Delete(o);
        }
        free(line);
        if (json) {
            dp_jw_arr_end(&rp.jw);
            dp_jw_obj_begin(&rp.jw, "summary");
            dp_jw_uint(&rp.jw, "replayed", found);
            dp_jw_uint(&rp.jw, "reproduced", rp.reproduced);
            dp_jw_uint(&rp.jw, "differs", rp.differs);
            dp_jw_uint(&rp.jw, "not_replayable", rp.not_replayable);
            dp_jw_obj_end(&rp.jw);
            dp_jw_obj_end(&rp.jw);
            printf("%.*s\n", (int)rp.jout.len, rp.jout.base);
        } else {
            printf("%zu replayed: %zu reproduced, %zu differ, %zu not replayable\n", found,
                   rp.reproduced, rp.differs, rp.not_replayable);
        }
        if (id && found == 0) {
            fprintf(stderr, "detproxy replay: request id %s is not in %s\n", id, audit);
            rc = 1;
        } else {
            rc = rp.differs ? 1 : 0;
        }
    }
    fclose(f);
    for (size_t i = 0; i < rp.nreps; i++) {
        free(rp.reps[i].pool);
        free(rp.reps[i].name);
        free(rp.reps[i].url);
    }
    free(rp.reps);
    free(rp.fps);
    dp_buf_free(&rp.jout);
    px_fetch_free(&rp.w);
    free(aaddr.host);
    cfg_free(cfg);
    return rc;
}
