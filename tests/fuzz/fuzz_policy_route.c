/* libFuzzer target for route classification and the default-deny rule (policy/routes.h).
 *
 * Input: byte 0 selects the method (bits 0-2) and the tenant (bit 3: policed or not); the rest
 * is the request path. Beyond "no crash, no UB" it checks, each an abort() when broken:
 *   - a policed class has its one method: POST for the inference routes, GET for /v1/models;
 *   - a trailing '/' names the same route (what an ASGI replica's redirect does);
 *   - GET and HEAD are never refused as a generation route unless a route generates on them
 *     whatever the method (then every method is refused);
 *   - a tenant without a policy passes everything; a policed one passes a non-GET/HEAD request
 *     exactly when an entry of the list matches, by a naive reference matcher.
 *
 * Seed corpus: tests/fuzz/corpus/policy_route/ (and corpus/policy/). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "policy/routes.h"

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c))                                                                                  \
            abort();                                                                               \
    } while (0)

static const char *const methods[] = {"GET",    "HEAD",  "POST",    "PUT",
                                      "DELETE", "PATCH", "OPTIONS", "get"};

static cfg_passthrough_t entries[] = {
    {"/metrics", NULL, "/metrics", 8, false},
    {"/tokenize*", NULL, "/tokenize", 9, true},
    {"POST /detokenize", "POST", "/detokenize", 11, false},
    {"PUT /v1/files/*", "PUT", "/v1/files/", 10, true},
    {"DELETE /*", "DELETE", "/", 1, true},
};

static bool reference_allows(const char *m, const char *path, size_t n)
{
    if (strcmp(m, "GET") == 0 || strcmp(m, "HEAD") == 0)
        return true;
    for (size_t i = 0; i < sizeof(entries) / sizeof(entries[0]); i++) {
        const cfg_passthrough_t *e = &entries[i];
        if (e->method && strcmp(e->method, m) != 0)
            continue;
        if (e->prefix ? (n >= e->len && strncmp(path, e->path, e->len) == 0)
                      : (n == e->len && memcmp(path, e->path, n) == 0))
            return true;
    }
    return false;
}

static policy_class_t cls(const char *m, const char *p, size_t n)
{
    return policy_routes_classify((dp_iovec_t){m, strlen(m)}, (dp_iovec_t){p, n});
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 4096)
        return 0;
    static cfg_tenant_t policed, plain;
    static cfg_pool_t pool;
    policed.name = "bank";
    policed.rules[CFG_PARAM_TEMPERATURE] = (cfg_rule_t){.has_force = true, .force = 0};
    plain.name = "open";
    pool.name = "p";
    pool.passthrough = entries;
    pool.npassthrough = sizeof(entries) / sizeof(entries[0]);

    const char *m = methods[data[0] & 7];
    const cfg_tenant_t *t = (data[0] & 8) ? &policed : &plain;
    const char *path = (const char *)data + 1;
    size_t n = size - 1;

    policy_class_t c = cls(m, path, n);
    CHECK(c == cls(m, path, n));
    if (c == POLICY_CLASS_COMPLETIONS || c == POLICY_CLASS_CHAT || c == POLICY_CLASS_RESPONSES)
        CHECK(strcmp(m, "POST") == 0);
    if (c == POLICY_CLASS_MODELS)
        CHECK(strcmp(m, "GET") == 0);

    /* The same path with a trailing '/' (the root has none to add). */
    if (n > 1 && path[n - 1] != '/') {
        char *slash = malloc(n + 1);
        memcpy(slash, path, n);
        slash[n] = '/';
        CHECK(cls(m, slash, n + 1) == c);
        free(slash);
    }

    /* A route refused to GET is refused to every method. */
    if (c == POLICY_CLASS_GENERATION && strcmp(m, "GET") == 0)
        for (size_t i = 0; i < sizeof(methods) / sizeof(methods[0]); i++)
            CHECK(cls(methods[i], path, n) == POLICY_CLASS_GENERATION);

    bool ok =
        policy_routes_passthrough(&pool, t, (dp_iovec_t){m, strlen(m)}, (dp_iovec_t){path, n});
    if (t == &plain)
        CHECK(ok);
    else
        CHECK(ok == reference_allows(m, path, n));
    return 0;
}
