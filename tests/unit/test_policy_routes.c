/* Route classification and the default-deny rule (policy/routes.h), with pools' passthrough
 * lists parsed and validated by config/ (errors at their JSON path). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/routes.h"

static dp_iovec_t iov(const char *s)
{
    return (dp_iovec_t){s, strlen(s)};
}

static policy_class_t cls(const char *method, const char *path)
{
    return policy_routes_classify(iov(method), iov(path));
}

/* ---- classification ------------------------------------------------------------------------ */

Test(classify, policed_routes)
{
    cr_assert_eq(cls("POST", "/v1/completions"), POLICY_CLASS_COMPLETIONS);
    cr_assert_eq(cls("POST", "/v1/completions/"), POLICY_CLASS_COMPLETIONS);
    cr_assert_eq(cls("POST", "/v1/chat/completions"), POLICY_CLASS_CHAT);
    cr_assert_eq(cls("POST", "/v1/responses"), POLICY_CLASS_RESPONSES);
    cr_assert_eq(cls("GET", "/v1/models"), POLICY_CLASS_MODELS);
    /* Another method on a policed path is not policed (the replica answers 405). */
    cr_assert_eq(cls("GET", "/v1/completions"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("post", "/v1/completions"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("POST", "/v1/completionsX"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("POST", "/v1/models"), POLICY_CLASS_PASS);
}

/* No engine-generation pattern matches a policed path (with or without its trailing '/'):
 * classification tries the policed routes first, which is only the same answer because of
 * this. A method that is neither POST nor a read shows it: only a generation route would
 * classify such a request as anything but a pass. */
Test(classify, no_generation_pattern_matches_a_policed_path)
{
    static const char *const paths[] = {"/v1/completions",      "/v1/completions/",
                                        "/v1/chat/completions", "/v1/chat/completions/",
                                        "/v1/responses",        "/v1/responses/"};
    for (size_t i = 0; i < sizeof(paths) / sizeof(paths[0]); i++) {
        cr_assert_eq(cls("PUT", paths[i]), POLICY_CLASS_PASS, "%s", paths[i]);
        cr_assert_eq(cls("GET", paths[i]), POLICY_CLASS_PASS, "%s", paths[i]);
    }
}

Test(classify, engine_generation_routes_whatever_the_method)
{
    static const char *const paths[] = {
        "/completion",
        "/completions",
        "/chat/completions",
        "/infill",
        "/v1/messages",
        "/api/chat",
        "/api/generate",
        "/vertex",
        "/generate",
        "/generate_stream",
        "/invocations",
        "/inference/v1/generate",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/vertex_generate",
        "/v2/models/m/infer",
        "/v2/models/llama-3/versions/1/infer",
        "/v2/models/m/generate",
        "/v2/models/m/generate_stream",
        "/generate/",
    };
    static const char *const methods[] = {"POST", "PUT", "GET", "DELETE", "PATCH"};
    for (size_t i = 0; i < sizeof(paths) / sizeof(paths[0]); i++)
        for (size_t k = 0; k < sizeof(methods) / sizeof(methods[0]); k++)
            cr_assert_eq(cls(methods[k], paths[i]), POLICY_CLASS_GENERATION, "%s %s", methods[k],
                         paths[i]);
}

Test(classify, tgi_root_generates_on_post_only)
{
    cr_assert_eq(cls("POST", "/"), POLICY_CLASS_GENERATION);
    cr_assert_eq(cls("PUT", "/"), POLICY_CLASS_GENERATION);
    cr_assert_eq(cls("GET", "/"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("HEAD", "/"), POLICY_CLASS_PASS);
}

/* A batch's POST runs the requests of an uploaded file; its state is read with GET. */
Test(classify, batch_creation_is_refused_its_state_is_read)
{
    cr_assert_eq(cls("POST", "/v1/batches"), POLICY_CLASS_GENERATION);
    cr_assert_eq(cls("POST", "/v1/batches/"), POLICY_CLASS_GENERATION);
    cr_assert_eq(cls("GET", "/v1/batches"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("HEAD", "/v1/batches"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("GET", "/v1/batches/b1"), POLICY_CLASS_PASS);
}

Test(classify, near_misses_pass)
{
    cr_assert_eq(cls("POST", "/v2/models/m"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("GET", "/v2/models/m/ready"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("POST", "/v2/models/m/infer/x"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("POST", "/v2/models/a/b/infer"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("POST", "/generatex"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("POST", "/x/generate"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("GET", "/metrics"), POLICY_CLASS_PASS);
    cr_assert_eq(cls("POST", ""), POLICY_CLASS_PASS);
}

/* ---- which tenants are policed ----------------------------------------------------------------
 */

static cfg_tenant_t tenant(void)
{
    cfg_tenant_t t;
    memset(&t, 0, sizeof(t));
    t.name = "t";
    t.match_kind = CFG_MATCH_ANY;
    t.shadow_rate = -1;
    return t;
}

Test(policed, any_constraint_makes_a_tenant_policed)
{
    cfg_tenant_t t = tenant();
    cr_assert_not(policy_routes_tenant_policed(&t));
    cr_assert_not(policy_routes_tenant_policed(NULL));
    t.rate_rps = 5; /* a rate limit holds on every route already */
    cr_assert_not(policy_routes_tenant_policed(&t));
    for (int p = 0; p < CFG_PARAM__COUNT; p++) {
        cfg_tenant_t u = tenant();
        u.rules[p].has_max = true;
        u.rules[p].max = 1;
        cr_assert(policy_routes_tenant_policed(&u), "rule on %s", cfg_param_names[p]);
    }
    cfg_tenant_t u = tenant();
    u.rules[CFG_PARAM_SEED].derive = true;
    cr_assert(policy_routes_tenant_policed(&u));
    u = tenant();
    u.audit = true;
    cr_assert(policy_routes_tenant_policed(&u));
    u = tenant();
    char *deny[] = {"logit_bias"};
    u.deny_params = deny;
    u.ndeny_params = 1;
    cr_assert(policy_routes_tenant_policed(&u));
    u = tenant();
    u.allow_params = deny;
    u.nallow_params = 1;
    cr_assert(policy_routes_tenant_policed(&u));
    u = tenant();
    u.require_determinism = CFG_DETERMINISM_SINGLE_SEQUENCE;
    cr_assert(policy_routes_tenant_policed(&u));
}

/* ---- passthrough lists, from config -------------------------------------------------------- */

static char *q(const char *s)
{
    char *d = strdup(s);
    for (char *p = d; *p; p++)
        if (*p == '\'')
            *p = '"';
    return d;
}

#define POOLF(fields)                                                                              \
    "{'pools':[{'name':'p','models':['*'],'replicas':[{'name':'r1','url':'http://"                 \
    "127.0.0.1:8001'}]" fields "}]}"

static int load(const char *sq, cfg_t **out, cfg_errors_t *e)
{
    char *json = q(sq);
    int rc = cfg_load_string(json, strlen(json), "/nonexistent-config-dir", out, e);
    free(json);
    return rc;
}

static bool has_error(const cfg_errors_t *e, const char *path, const char *msg)
{
    size_t pl = strlen(path);
    for (size_t i = 0; i < e->count; i++)
        if (strncmp(e->items[i], path, pl) == 0 && strncmp(e->items[i] + pl, ": ", 2) == 0 &&
            strstr(e->items[i] + pl, msg))
            return true;
    return false;
}

static void expect_error(const char *sq, const char *path, const char *msg)
{
    cfg_t *cfg = NULL;
    cfg_errors_t e = {0};
    cr_assert_neq(load(sq, &cfg, &e), 0, "%s: should be invalid", sq);
    bool found = has_error(&e, path, msg);
    for (size_t i = 0; !found && i < e.count; i++)
        fprintf(stderr, "  error: %s\n", e.items[i]);
    cr_assert(found, "want %s: ...%s...", path, msg);
    cfg_errors_free(&e);
}

Test(passthrough_config, parsed)
{
    cfg_t *cfg = NULL;
    cfg_errors_t e = {0};
    int rc =
        load(POOLF(",'passthrough':['/metrics','/tokenize*','POST /detokenize','/v1/files/*']"),
             &cfg, &e);
    for (size_t i = 0; i < e.count; i++)
        fprintf(stderr, "  error: %s\n", e.items[i]);
    cr_assert_eq(rc, 0);
    const cfg_pool_t *p = &cfg->pools[0];
    cr_assert_eq(p->npassthrough, 4);
    cr_assert_null(p->passthrough[0].method);
    cr_assert_str_eq(p->passthrough[0].path, "/metrics");
    cr_assert_not(p->passthrough[0].prefix);
    cr_assert_str_eq(p->passthrough[1].path, "/tokenize");
    cr_assert(p->passthrough[1].prefix);
    cr_assert_str_eq(p->passthrough[2].method, "POST");
    cr_assert_str_eq(p->passthrough[2].path, "/detokenize");
    cr_assert_str_eq(p->passthrough[3].path, "/v1/files/");
    cr_assert_str_eq(p->passthrough[3].text, "/v1/files/*");
    cfg_errors_free(&e);
    cfg_free(cfg);
}

Test(passthrough_config, invalid_entries_name_their_path)
{
    expect_error(POOLF(",'passthrough':'/metrics'"), "pools[0].passthrough", "expected an array");
    expect_error(POOLF(",'passthrough':[5]"), "pools[0].passthrough[0]", "expected a string");
    expect_error(POOLF(",'passthrough':['']"), "pools[0].passthrough[0]", "expected a string");
    expect_error(POOLF(",'passthrough':['/ok','metrics']"), "pools[0].passthrough[1]",
                 "must start with '/'");
    expect_error(POOLF(",'passthrough':['/a*b']"), "pools[0].passthrough[0]", "only at the end");
    expect_error(POOLF(",'passthrough':['*']"), "pools[0].passthrough[0]", "must start with '/'");
    expect_error(POOLF(",'passthrough':['/a?x=1']"), "pools[0].passthrough[0]", "query");
    expect_error(POOLF(",'passthrough':['/a%20b']"), "pools[0].passthrough[0]", "percent");
    expect_error(POOLF(",'passthrough':['//a']"), "pools[0].passthrough[0]", "'//'");
    expect_error(POOLF(",'passthrough':['/a/../b']"), "pools[0].passthrough[0]", "'..'");
    expect_error(POOLF(",'passthrough':['/a/.']"), "pools[0].passthrough[0]", "'.'");
    expect_error(POOLF(",'passthrough':['/a b']"), "pools[0].passthrough[0]", "spaces");
    expect_error(POOLF(",'passthrough':['POST  /a']"), "pools[0].passthrough[0]", "start with");
    expect_error(POOLF(",'passthrough':[' /a']"), "pools[0].passthrough[0]", "one space");
    expect_error(POOLF(",'passthrough':['PO(ST /a']"), "pools[0].passthrough[0]", "HTTP token");
    expect_error(POOLF(",'passthrough':['/a','/a']"), "pools[0].passthrough[1]", "duplicate");
}

Test(passthrough_config, a_prefix_may_end_in_dots)
{
    cfg_t *cfg = NULL;
    cfg_errors_t e = {0};
    cr_assert_eq(load(POOLF(",'passthrough':['/a/.*','/v1.*']"), &cfg, &e), 0);
    cfg_errors_free(&e);
    cfg_free(cfg);
}

static cfg_t *load_ok(const char *sq)
{
    cfg_t *cfg = NULL;
    cfg_errors_t e = {0};
    cr_assert_eq(load(sq, &cfg, &e), 0);
    cfg_errors_free(&e);
    return cfg;
}

static bool allowed(const cfg_pool_t *p, const cfg_tenant_t *t, const char *m, const char *path)
{
    return policy_routes_passthrough(p, t, iov(m), iov(path));
}

Test(passthrough, default_deny_for_a_policed_tenant_only)
{
    cfg_t *cfg = load_ok(POOLF(",'passthrough':['/metrics','/tokenize*','POST /detokenize']"));
    const cfg_pool_t *p = &cfg->pools[0];
    cfg_tenant_t plain = tenant(), bank = tenant();
    bank.rules[CFG_PARAM_TEMPERATURE].has_force = true;
    /* No policy: everything passes, as before. */
    cr_assert(allowed(p, &plain, "POST", "/anything"));
    cr_assert(allowed(p, NULL, "DELETE", "/x"));
    /* Policed: GET and HEAD pass, the rest only by the list. */
    cr_assert(allowed(p, &bank, "GET", "/anything"));
    cr_assert(allowed(p, &bank, "HEAD", "/anything"));
    cr_assert_not(allowed(p, &bank, "POST", "/anything"));
    cr_assert_not(allowed(p, &bank, "OPTIONS", "/anything"));
    cr_assert(allowed(p, &bank, "POST", "/metrics"));
    cr_assert_not(allowed(p, &bank, "POST", "/metrics/")); /* exact means exact */
    cr_assert_not(allowed(p, &bank, "POST", "/metricsx"));
    cr_assert(allowed(p, &bank, "POST", "/tokenize"));
    cr_assert(allowed(p, &bank, "PUT", "/tokenizer/x"));
    cr_assert_not(allowed(p, &bank, "POST", "/tokeniz"));
    cr_assert(allowed(p, &bank, "POST", "/detokenize"));
    cr_assert_not(allowed(p, &bank, "PUT", "/detokenize"));
    cr_assert_not(allowed(p, &bank, "post", "/detokenize"));
    cfg_free(cfg);
}

Test(passthrough, no_list_closes_every_write)
{
    cfg_t *cfg = load_ok(POOLF(""));
    cfg_tenant_t bank = tenant();
    bank.audit = true;
    cr_assert_not(allowed(&cfg->pools[0], &bank, "POST", "/tokenize"));
    cr_assert_not(allowed(&cfg->pools[0], &bank, "POST", "/"));
    cr_assert(allowed(&cfg->pools[0], &bank, "GET", "/health"));
    cfg_free(cfg);
}
