/* The strict reading of what replicas, agents and envelopes say (attest/json.h): what cJSON
 * alone takes and other readers read otherwise is refused, the rest is read as cJSON reads it. */
#include <criterion/criterion.h>
#include <string.h>

#include "attest/json.h"
#include "attest/report.h"

static const char *refused(const char *json, size_t len)
{
    const char *why = NULL;
    cJSON *d = attest_json_parse(json, len, &why);
    cJSON_Delete(d);
    return d ? NULL : why;
}
#define REFUSED(s) refused(s, sizeof(s) - 1)

Test(attest_json, what_readers_disagree_on_is_refused)
{
    cr_assert_str_eq(REFUSED("{\"q\":\"F16\\u0000Q8_0\"}"), "a string holds a NUL character");
    cr_assert_str_eq(REFUSED("{\"q\\u0000x\":1}"), "a string holds a NUL character");
    cr_assert_str_eq(REFUSED("{\"q\":\"F16\"}\0"), "not valid JSON");
    cr_assert_str_eq(REFUSED("{\"q\":\"F16\0Q8_0\"}"), "not valid JSON");
    cr_assert_str_eq(REFUSED("{\"q\":\"F16\",\"q\":\"Q8_0\"}"),
                     "a key appears twice in one object");
    cr_assert_str_eq(REFUSED("{\"a\":[{\"b\":1},{\"c\":{\"d\":1,\"d\":2}}]}"),
                     "a key appears twice in one object");
    cr_assert_str_eq(REFUSED("{\"q\":\"F16\"} x"), "bytes after the JSON value");
    cr_assert_str_eq(REFUSED("{\"q\":\"F16\"}{}"), "bytes after the JSON value");
    cr_assert_str_eq(REFUSED("{\"q\":"), "not valid JSON");
}

Test(attest_json, what_reads_one_way_is_taken)
{
    cr_assert_null(REFUSED("{\"q\":\"F16\"}\r\n "));
    /* An escaped backslash before "u0000" is a backslash and text, not a NUL. */
    cr_assert_null(REFUSED("{\"p\":\"C:\\\\u0000\"}"));
    cr_assert_null(REFUSED("{\"p\":\"\\u0001\\\"\\u00e9\"}"));
    /* The same key in two objects is not a duplicate. */
    cr_assert_null(REFUSED("{\"a\":{\"k\":1},\"b\":{\"k\":1},\"k\":[{\"k\":1},{\"k\":2}]}"));
}

Test(attest_json, a_payload_that_reads_two_ways_is_refused)
{
    static const char p[] =
        "{\"model\":\"tiny\",\"quantization\":\"F16\",\"quantization\":\"Q8_0\"}";
    attest_report_t r = {0};
    dp_buf_t why = {0};
    cr_assert_neq(attest_payload_parse(p, sizeof(p) - 1, &r, &why), 0);
    cr_assert_str_eq(why.base, "payload: a key appears twice in one object");
    attest_report_clear(&r);
    dp_buf_free(&why);
}
