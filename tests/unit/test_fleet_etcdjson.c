/* fleet/etcdjson.h: the etcd gateway's JSON (base64 keys, 64-bit integers as strings, prefix
 * ranges) and the splitter that cuts a watch stream into messages, whatever the chunks. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "common/util.h"
#include "fleet/etcdjson.h"

Test(etcdjson, range_end_increments_the_last_byte_below_ff)
{
    dp_buf_t b = {0};
    fleet_ej_range_end("/detproxy/t/", 12, &b);
    cr_assert_eq(b.len, 12);
    cr_assert(memcmp(b.base, "/detproxy/t0", 12) == 0);
    dp_buf_free(&b);
    fleet_ej_range_end("a\xff\xff", 3, &b);
    cr_assert(b.len == 1 && b.base[0] == 'b');
    dp_buf_free(&b);
    fleet_ej_range_end("\xff", 1, &b);
    cr_assert(b.len == 1 && b.base[0] == '\0'); /* every key */
    dp_buf_free(&b);
}

Test(etcdjson, put_and_txn_bodies_are_base64_with_string_integers)
{
    dp_buf_t b = {0};
    fleet_ej_put(&b, "k", "v", 1, 7587);
    cr_assert_str_eq(b.base, "{\"key\":\"aw==\",\"value\":\"dg==\",\"lease\":\"7587\"}");
    dp_buf_free(&b);
    fleet_ej_txn_cas(&b, "k", 0, "v", 1, 0);
    cJSON *d = cJSON_Parse(b.base);
    const cJSON *cmp = cJSON_GetArrayItem(cJSON_GetObjectItem(d, "compare"), 0);
    cr_assert_str_eq(cJSON_GetObjectItem(cmp, "target")->valuestring, "CREATE");
    cr_assert_str_eq(cJSON_GetObjectItem(cmp, "create_revision")->valuestring, "0");
    cJSON_Delete(d);
    dp_buf_free(&b);
    fleet_ej_txn_take(&b, "k", "v", 1, 9, NULL);
    cr_assert_str_eq(b.base, "{\"compare\":[{\"key\":\"aw==\",\"result\":\"EQUAL\",\"target\":"
                             "\"CREATE\",\"create_revision\":\"0\"}],\"success\":[{"
                             "\"request_put\":{\"key\":\"aw==\",\"value\":\"dg==\",\"lease\":"
                             "\"9\"}}],\"failure\":[{\"request_range\":{\"key\":\"aw==\"}}]}");
    dp_buf_free(&b);
    fleet_ej_txn_delete_on_lease(&b, "k", 42, NULL, NULL, 0);
    cr_assert_str_eq(b.base, "{\"compare\":[{\"key\":\"aw==\",\"result\":\"EQUAL\",\"target\":"
                             "\"LEASE\",\"lease\":\"42\"}],\"success\":[{"
                             "\"request_delete_range\":{\"key\":\"aw==\"}}]}");
    dp_buf_free(&b);
    /* A take that reads and deletes a mark; a delete that puts one (on no lease). */
    fleet_ej_txn_take(&b, "k", "v", 1, 9, "m");
    cr_assert_str_eq(b.base, "{\"compare\":[{\"key\":\"aw==\",\"result\":\"EQUAL\",\"target\":"
                             "\"CREATE\",\"create_revision\":\"0\"}],\"success\":[{"
                             "\"request_put\":{\"key\":\"aw==\",\"value\":\"dg==\",\"lease\":"
                             "\"9\"}},{\"request_range\":{\"key\":\"bQ==\"}},{"
                             "\"request_delete_range\":{\"key\":\"bQ==\"}}],\"failure\":[{"
                             "\"request_range\":{\"key\":\"aw==\"}}]}");
    dp_buf_free(&b);
    fleet_ej_txn_delete_on_lease(&b, "k", 42, "m", "v", 1);
    cr_assert_str_eq(b.base, "{\"compare\":[{\"key\":\"aw==\",\"result\":\"EQUAL\",\"target\":"
                             "\"LEASE\",\"lease\":\"42\"}],\"success\":[{"
                             "\"request_delete_range\":{\"key\":\"aw==\"}},{\"request_put\":{"
                             "\"key\":\"bQ==\",\"value\":\"dg==\"}}]}");
    dp_buf_free(&b);
    fleet_ej_watch_create(&b, "/p/", 12);
    cr_assert(strstr(b.base, "\"start_revision\":\"12\"") != NULL);
    cr_assert(strstr(b.base, "\"range_end\":\"L3Aw\"") != NULL); /* "/p0" */
    dp_buf_free(&b);
}

Test(etcdjson, integers_and_kvs_decode_and_bad_ones_are_refused)
{
    cJSON *o = cJSON_Parse("{\"a\":\"9223372036854775807\",\"b\":\"12x\",\"c\":5,\"d\":\"-3\"}");
    cr_assert_eq(fleet_ej_int(o, "a", -1), INT64_MAX);
    cr_assert_eq(fleet_ej_int(o, "b", -1), -1);
    cr_assert_eq(fleet_ej_int(o, "c", -1), 5);
    cr_assert_eq(fleet_ej_int(o, "d", 0), -3);
    cr_assert_eq(fleet_ej_int(o, "missing", 42), 42);
    cJSON_Delete(o);
    /* numbers out of int64_t's range saturate (a plain cast is undefined behaviour) */
    o = cJSON_Parse("{\"big\":1e300,\"small\":-1e300,\"edge\":9223372036854775808}");
    cr_assert_eq(fleet_ej_int(o, "big", 0), INT64_MAX);
    cr_assert_eq(fleet_ej_int(o, "small", 0), INT64_MIN);
    cr_assert_eq(fleet_ej_int(o, "edge", 0), INT64_MAX);
    cJSON_Delete(o);
    fleet_kv_t kv = {0};
    o = cJSON_Parse("{\"key\":\"Zm9v\",\"value\":\"YmFy\",\"mod_revision\":\"9\"}");
    cr_assert_eq(fleet_ej_kv(o, &kv), 0);
    cr_assert_str_eq(kv.key.base, "foo");
    cr_assert_str_eq(kv.value.base, "bar");
    cr_assert_eq(kv.mod_revision, 9);
    cJSON_Delete(o);
    o = cJSON_Parse("{\"key\":\"not base64!\"}");
    cr_assert_eq(fleet_ej_kv(o, &kv), -1);
    cJSON_Delete(o);
    o = cJSON_Parse("{\"value\":\"YmFy\"}");
    cr_assert_eq(fleet_ej_kv(o, &kv), -1); /* no key */
    cJSON_Delete(o);
    fleet_kv_free(&kv);
    o = cJSON_Parse("{\"error\":\"etcdserver: no leader\",\"code\":14}");
    cr_assert_str_eq(fleet_ej_error(o), "etcdserver: no leader");
    cJSON_Delete(o);
}

typedef struct {
    int n;
    char last[256];
} got_t;

static int collect(const char *p, size_t n, void *data)
{
    got_t *g = data;
    g->n++;
    snprintf(g->last, sizeof(g->last), "%.*s", (int)n, p);
    return 0;
}

Test(etcdjson, splitter_cuts_messages_whatever_the_chunks)
{
    const char *s = "{\"result\":{\"a\":\"}{\\\"\"}}\n  {\"result\":[1,{\"b\":2}]}\n";
    size_t n = strlen(s);
    for (size_t step = 1; step <= n; step++) {
        fleet_ej_split_t sp = {.max = 1024};
        got_t g = {0};
        for (size_t i = 0; i < n; i += step) {
            size_t k = n - i < step ? n - i : step;
            cr_assert_eq(fleet_ej_split_feed(&sp, s + i, k, collect, &g), 0);
        }
        cr_assert_eq(g.n, 2, "step %zu", step);
        cr_assert_str_eq(g.last, "{\"result\":[1,{\"b\":2}]}");
        fleet_ej_split_free(&sp);
    }
}

Test(etcdjson, splitter_refuses_oversized_and_garbage)
{
    fleet_ej_split_t sp = {.max = 16};
    got_t g = {0};
    cr_assert_eq(fleet_ej_split_feed(&sp, "{\"a\":\"0123456789abcdef\"}", 24, collect, &g), -1);
    fleet_ej_split_free(&sp);
    /* An endless object, fed in pieces: refused once it passes the cap, never buffered past it. */
    fleet_ej_split_t sp2 = {.max = 1000};
    int rc = 0;
    for (int i = 0; i < 1000 && rc == 0; i++)
        rc = fleet_ej_split_feed(&sp2, i == 0 ? "{\"x\":[" : "1,", i == 0 ? 6 : 2, collect, &g);
    cr_assert_eq(rc, -1);
    cr_assert_leq(sp2.cur.len, 1000);
    fleet_ej_split_free(&sp2);
    fleet_ej_split_t sp3 = {.max = 100};
    cr_assert_eq(fleet_ej_split_feed(&sp3, "garbage", 7, collect, &g), -1);
    fleet_ej_split_free(&sp3);
    cr_assert_eq(g.n, 0);
}

/* Whitespace between messages counts too: an endless stream of it is refused at the cap (one
 * core spun on it, connected and error-free, before), while the cap's worth is skipped. */
Test(etcdjson, splitter_refuses_endless_whitespace)
{
    fleet_ej_split_t sp = {.max = 64};
    got_t g = {0};
    char ws[64];
    memset(ws, '\n', sizeof(ws));
    cr_assert_eq(fleet_ej_split_feed(&sp, ws, sizeof(ws), collect, &g), 0);
    cr_assert_eq(fleet_ej_split_feed(&sp, "{}", 2, collect, &g), 0);
    cr_assert_eq(g.n, 1);
    cr_assert_eq(fleet_ej_split_feed(&sp, ws, sizeof(ws), collect, &g), 0);
    cr_assert_eq(fleet_ej_split_feed(&sp, " ", 1, collect, &g), -1);
    fleet_ej_split_free(&sp);
}

/* A revision no etcd gives (negative, or so large its next overflows) reads as none. */
Test(etcdjson, revisions_out_of_range_read_as_none)
{
    const char *docs[] = {"{\"header\":{\"revision\":\"9223372036854775807\"}}",
                          "{\"header\":{\"revision\":1e30}}", "{\"header\":{\"revision\":\"-5\"}}"};
    for (size_t i = 0; i < sizeof(docs) / sizeof(docs[0]); i++) {
        cJSON *d = cJSON_Parse(docs[i]);
        cr_assert_eq(fleet_ej_revision(d), 0, "%s", docs[i]);
        cJSON_Delete(d);
    }
    cJSON *d = cJSON_Parse("{\"header\":{\"revision\":\"42\"}}");
    cr_assert_eq(fleet_ej_revision(d), 42);
    cJSON_Delete(d);
}
