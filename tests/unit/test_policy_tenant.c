/* Tenant matching (docs/policy.md §1, `match`). */
#include <criterion/criterion.h>
#include <string.h>

#include "common/util.h"
#include "policy/policy.h"

static uint8_t keys_bank[2][32], keys_ops[1][32];
static cfg_tenant_t tenants[4];
static cfg_policy_t pol = {tenants, 4};
static policy_error_t err;

static void setup(void)
{
    memset(tenants, 0, sizeof(tenants));
    dp_sha256("sk-bank-1", 9, keys_bank[0]);
    dp_sha256("sk-bank-2", 9, keys_bank[1]);
    dp_sha256("sk-ops", 6, keys_ops[0]);
    tenants[0] = (cfg_tenant_t){
        .name = "bank", .match_kind = CFG_MATCH_API_KEYS, .api_keys = keys_bank, .napi_keys = 2};
    tenants[1] = (cfg_tenant_t){
        .name = "ops", .match_kind = CFG_MATCH_API_KEYS, .api_keys = keys_ops, .napi_keys = 1};
    tenants[2] = (cfg_tenant_t){.name = "hdr",
                                .match_kind = CFG_MATCH_HEADER,
                                .header_name = "x-tenant",
                                .header_value = "Bank"};
    tenants[3] = (cfg_tenant_t){.name = "default", .match_kind = CFG_MATCH_ANY};
    pol.ntenants = 4;
}

TestSuite(tenant, .init = setup);

#define H(n, v)                                                                                    \
    {                                                                                              \
        {n, sizeof(n) - 1},                                                                        \
        {                                                                                          \
            v, sizeof(v) - 1                                                                       \
        }                                                                                          \
    }

static const char *match(const policy_header_t *h, size_t n)
{
    policy_headers_t hs = {h, n};
    memset(&err, 0, sizeof(err));
    const cfg_tenant_t *t = policy_match_tenant(&pol, policy_headers_lookup, &hs, &err);
    return t ? t->name : NULL;
}

Test(tenant, api_keys)
{
    policy_header_t a[] = {H("Authorization", "Bearer sk-bank-1")};
    cr_assert_str_eq(match(a, 1), "bank");
    policy_header_t b[] = {H("authorization", "Bearer sk-bank-2")}; /* second key of the list */
    cr_assert_str_eq(match(b, 1), "bank");
    policy_header_t c[] = {H("AUTHORIZATION", "bearer sk-ops")}; /* scheme case-insensitive */
    cr_assert_str_eq(match(c, 1), "ops");
    policy_header_t d[] = {H("Authorization", "BEARER sk-ops  ")}; /* trailing OWS */
    cr_assert_str_eq(match(d, 1), "ops");
}

static const policy_header_t bad_credentials[][1] = {
    {H("Authorization", "Bearer sk-nope")},  {H("Authorization", "Bearer  sk-ops")},
    {H("Authorization", "Bearer sk-ops x")}, {H("Authorization", "Basic sk-ops")},
    {H("Authorization", "Bearer")},          {H("Authorization", "Bearer ")},
    {H("Authorization", "sk-ops")},          {H("Authorization", "Bearer sk-bank-1\t2")},
    {H("Authorization", "Bearersk-ops")},    {H("Authorization", "")},
};

/* A wrong key is not served as the catch-all tenant (docs/policy.md §1). */
Test(tenant, malformed_or_unknown_credentials_are_401_not_the_catch_all)
{
    for (size_t i = 0; i < sizeof(bad_credentials) / sizeof(bad_credentials[0]); i++) {
        cr_assert_null(match(bad_credentials[i], 1), "case %zu", i);
        cr_assert_eq(err.status, 401);
        cr_assert_str_eq(err.code, "invalid_api_key");
        cr_assert(strstr(err.message, "match no tenant"), "%s", err.message);
    }
    /* two Authorization fields are ambiguous: no key, and not the catch-all either */
    policy_header_t two[] = {H("Authorization", "Bearer sk-ops"), H("authorization", "Bearer x")};
    cr_assert_null(match(two, 2));
    cr_assert(strstr(err.message, "ambiguous"), "%s", err.message);
    /* no credentials at all: the catch-all */
    policy_header_t none[] = {H("X-Api-Key", "sk-ops")};
    cr_assert_str_eq(match(none, 1), "default");
    cr_assert_str_eq(match(NULL, 0), "default");
}

Test(tenant, unknown_keys_opt_out_takes_any_token)
{
    tenants[3].any_unknown_keys = true;
    for (size_t i = 0; i < sizeof(bad_credentials) / sizeof(bad_credentials[0]); i++)
        cr_assert_str_eq(match(bad_credentials[i], 1), "default", "case %zu", i);
    policy_header_t two[] = {H("Authorization", "Bearer sk-ops"), H("authorization", "Bearer x")};
    cr_assert_str_eq(match(two, 2), "default");
    /* known keys still win when their tenant comes first */
    policy_header_t a[] = {H("Authorization", "Bearer sk-ops")};
    cr_assert_str_eq(match(a, 1), "ops");
}

Test(tenant, header_match)
{
    policy_header_t a[] = {H("X-Tenant", "Bank")};
    cr_assert_str_eq(match(a, 1), "hdr");
    policy_header_t b[] = {H("x-tenant", "bank")}; /* values compare exactly */
    cr_assert_str_eq(match(b, 1), "default");
    policy_header_t e[] = {H("X-Tenant", "Bank"), H("Authorization", "Bearer gateway")};
    cr_assert_str_eq(match(e, 2), "hdr"); /* a header tenant does not look at credentials */
    policy_header_t c[] = {H("x-tenant", "Bank2")};
    cr_assert_str_eq(match(c, 1), "default");
    policy_header_t d[] = {H("x-tenant", "Bank"), H("x-tenant", "Bank")};
    cr_assert_str_eq(match(d, 2), "default");
}

Test(tenant, first_match_wins)
{
    policy_header_t a[] = {H("x-tenant", "Bank"), H("Authorization", "Bearer sk-ops")};
    cr_assert_str_eq(match(a, 2), "ops");
}

Test(tenant, no_match_is_401)
{
    pol.ntenants = 3; /* drop the catch-all */
    policy_header_t a[] = {H("Authorization", "Bearer sk-wrong")};
    cr_assert_null(match(a, 1));
    cr_assert_eq(err.status, 401);
    cr_assert_str_eq(err.code, "invalid_api_key");
    cr_assert_null(strstr(err.message, "sk-wrong"), "the token must not be echoed");
    cr_assert_null(match(NULL, 0));
    cr_assert_eq(err.status, 401);
    policy_headers_t hs = {NULL, 0};
    cr_assert_null(policy_match_tenant(NULL, policy_headers_lookup, &hs, &err));
    cr_assert_eq(err.status, 401);
}
