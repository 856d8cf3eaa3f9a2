#include "fleet/etcdjson.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/jw.h"
#include "common/util.h"

void fleet_ej_range_end(const char *prefix, size_t n, dp_buf_t *out)
{
    while (n > 0 && (unsigned char)prefix[n - 1] == 0xff)
        n--;
    if (n == 0) {
        dp_buf_appendc(out, '\0');
        return;
    }
    dp_buf_append(out, prefix, n);
    out->base[out->len - 1] = (char)((unsigned char)out->base[out->len - 1] + 1);
}

static void b64_field(dp_jw_t *w, const char *key, const void *p, size_t n)
{
    dp_buf_t b = {0};
    dp_base64_encode(p, n, &b);
    dp_jw_strn(w, key, b.base ? b.base : "", b.len);
    dp_buf_free(&b);
}

/* 64-bit integers go as strings, as the gateway writes them. */
static void int_field(dp_jw_t *w, const char *key, int64_t v)
{
    char s[24];
    snprintf(s, sizeof(s), "%lld", (long long)v);
    dp_jw_str(w, key, s);
}

static void put_fields(dp_jw_t *w, const char *key, const char *val, size_t vlen, int64_t lease)
{
    b64_field(w, "key", key, strlen(key));
    b64_field(w, "value", val, vlen);
    if (lease)
        int_field(w, "lease", lease);
}

void fleet_ej_put(dp_buf_t *out, const char *key, const char *val, size_t vlen, int64_t lease)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    put_fields(&w, key, val, vlen, lease);
    dp_jw_obj_end(&w);
}

static void prefix_fields(dp_jw_t *w, const char *prefix)
{
    size_t n = strlen(prefix);
    b64_field(w, "key", prefix, n);
    dp_buf_t end = {0};
    fleet_ej_range_end(prefix, n, &end);
    b64_field(w, "range_end", end.base, end.len);
    dp_buf_free(&end);
}

void fleet_ej_range_prefix(dp_buf_t *out, const char *prefix)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    prefix_fields(&w, prefix);
    dp_jw_obj_end(&w);
}

void fleet_ej_range_latest(dp_buf_t *out, const char *prefix)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    prefix_fields(&w, prefix);
    dp_jw_str(&w, "limit", "1");
    dp_jw_str(&w, "sort_order", "DESCEND");
    dp_jw_str(&w, "sort_target", "MOD");
    dp_jw_bool(&w, "keys_only", true);
    dp_jw_obj_end(&w);
}

void fleet_ej_delete(dp_buf_t *out, const char *key)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    b64_field(&w, "key", key, strlen(key));
    dp_jw_obj_end(&w);
}

/* A transaction's opening up to its success list: key's mod_revision is mod_rev (0: key is
 * absent), or, when by_lease, key is on lease mod_rev. */
static void txn_begin(dp_jw_t *w, dp_buf_t *out, const char *key, int64_t mod_rev, bool by_lease)
{
    dp_jw_init(w, out);
    dp_jw_obj_begin(w, NULL);
    dp_jw_arr_begin(w, "compare");
    dp_jw_obj_begin(w, NULL);
    b64_field(w, "key", key, strlen(key));
    dp_jw_str(w, "result", "EQUAL");
    if (by_lease) {
        dp_jw_str(w, "target", "LEASE");
        int_field(w, "lease", mod_rev);
    } else if (mod_rev) {
        dp_jw_str(w, "target", "MOD");
        int_field(w, "mod_revision", mod_rev);
    } else {
        dp_jw_str(w, "target", "CREATE");
        int_field(w, "create_revision", 0);
    }
    dp_jw_obj_end(w);
    dp_jw_arr_end(w);
    dp_jw_arr_begin(w, "success");
    dp_jw_obj_begin(w, NULL);
}

static void txn_end(dp_jw_t *w)
{
    dp_jw_obj_end(w);
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
}

/* {"NAME": {"key": key}}: a request on one key. */
static void key_request(dp_jw_t *w, const char *name, const char *key)
{
    dp_jw_obj_begin(w, name);
    b64_field(w, "key", key, strlen(key));
    dp_jw_obj_end(w);
}

/* The next operation of a transaction's list (the one before it is closed). */
static void txn_next(dp_jw_t *w)
{
    dp_jw_obj_end(w);
    dp_jw_obj_begin(w, NULL);
}

/* A put under a compare; when it fails, the key is read instead if `read_on_failure`; when it
 * succeeds, `taken` (or NULL) is read and then deleted. */
static void txn_put(dp_buf_t *out, const char *key, int64_t mod_rev, const char *val, size_t vlen,
                    int64_t lease, bool read_on_failure, const char *taken)
{
    dp_jw_t w;
    txn_begin(&w, out, key, mod_rev, false);
    dp_jw_obj_begin(&w, "request_put");
    put_fields(&w, key, val, vlen, lease);
    dp_jw_obj_end(&w);
    if (taken) {
        txn_next(&w);
        key_request(&w, "request_range", taken);
        txn_next(&w);
        key_request(&w, "request_delete_range", taken);
    }
    if (read_on_failure) {
        dp_jw_obj_end(&w);
        dp_jw_arr_end(&w);
        dp_jw_arr_begin(&w, "failure");
        dp_jw_obj_begin(&w, NULL);
        key_request(&w, "request_range", key);
    }
    txn_end(&w);
}

void fleet_ej_txn_cas(dp_buf_t *out, const char *key, int64_t mod_rev, const char *val, size_t vlen,
                      int64_t lease)
{
    txn_put(out, key, mod_rev, val, vlen, lease, false, NULL);
}

void fleet_ej_txn_take(dp_buf_t *out, const char *key, const char *val, size_t vlen, int64_t lease,
                       const char *mark)
{
    txn_put(out, key, 0, val, vlen, lease, true, mark);
}

void fleet_ej_txn_delete_on_lease(dp_buf_t *out, const char *key, int64_t lease, const char *mark,
                                  const char *mval, size_t mlen)
{
    dp_jw_t w;
    txn_begin(&w, out, key, lease, true);
    key_request(&w, "request_delete_range", key);
    if (mark) {
        txn_next(&w);
        dp_jw_obj_begin(&w, "request_put");
        put_fields(&w, mark, mval, mlen, 0);
        dp_jw_obj_end(&w);
    }
    txn_end(&w);
}

void fleet_ej_watch_create(dp_buf_t *out, const char *prefix, int64_t start_rev)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_obj_begin(&w, "create_request");
    prefix_fields(&w, prefix);
    if (start_rev > 0)
        int_field(&w, "start_revision", start_rev);
    dp_jw_obj_end(&w);
    dp_jw_obj_end(&w);
}

void fleet_ej_lease_grant(dp_buf_t *out, int64_t ttl_s)
{
    dp_buf_printf(out, "{\"TTL\":\"%lld\"}", (long long)ttl_s);
}

void fleet_ej_lease_id(dp_buf_t *out, int64_t id)
{
    dp_buf_printf(out, "{\"ID\":\"%lld\"}", (long long)id);
}

void fleet_ej_auth(dp_buf_t *out, const char *user, const char *password)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "name", user);
    dp_jw_str(&w, "password", password);
    dp_jw_obj_end(&w);
}

int64_t fleet_ej_int(const cJSON *o, const char *name, int64_t def)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (cJSON_IsNumber(v))
        return dp_sat_i64(v->valuedouble);
    if (!cJSON_IsString(v) || v->valuestring[0] == '\0')
        return def;
    const char *s = v->valuestring;
    bool neg = *s == '-';
    s += neg;
    int64_t x = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || x > (INT64_MAX - (*s - '0')) / 10)
            return def;
        x = x * 10 + (*s - '0');
    }
    return neg ? -x : x;
}

/* A revision as etcd counts them, from 1 up: anything else (negative, or so large that the
 * next one would overflow) is not one, and reads as none (0). */
int64_t fleet_ej_rev(const cJSON *o, const char *name)
{
    int64_t r = fleet_ej_int(o, name, 0);
    return r > 0 && r < FLEET_REVISION_MAX ? r : 0;
}

int64_t fleet_ej_revision(const cJSON *res)
{
    return fleet_ej_rev(cJSON_GetObjectItemCaseSensitive(res, "header"), "revision");
}

static int b64_item(const cJSON *o, const char *name, dp_buf_t *out, bool required)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (v == NULL || cJSON_IsNull(v))
        return required ? -1 : 0;
    if (!cJSON_IsString(v))
        return -1;
    if (dp_base64_decode(v->valuestring, strlen(v->valuestring), out) != 0)
        return -1;
    return 0;
}

int fleet_ej_kv(const cJSON *kv, fleet_kv_t *out)
{
    dp_buf_reset(&out->key);
    dp_buf_reset(&out->value);
    if (!cJSON_IsObject(kv) || b64_item(kv, "key", &out->key, true) != 0 ||
        b64_item(kv, "value", &out->value, false) != 0)
        return -1;
    dp_buf_appendc(&out->key, '\0');
    out->key.len--;
    dp_buf_appendc(&out->value, '\0');
    out->value.len--;
    out->mod_revision = fleet_ej_rev(kv, "mod_revision");
    out->create_revision = fleet_ej_rev(kv, "create_revision");
    out->lease = fleet_ej_int(kv, "lease", 0);
    return 0;
}

void fleet_kv_free(fleet_kv_t *kv)
{
    dp_buf_free(&kv->key);
    dp_buf_free(&kv->value);
}

const char *fleet_ej_error(const cJSON *res)
{
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(res, "error");
    if (cJSON_IsString(e))
        return e->valuestring;
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(res, "message");
    if (cJSON_IsString(m) && cJSON_GetObjectItemCaseSensitive(res, "code"))
        return m->valuestring;
    return NULL;
}

int fleet_ej_split_feed(fleet_ej_split_t *s, const char *p, size_t n, fleet_ej_obj_cb cb,
                        void *data)
{
    size_t start = 0; /* where the part of p that belongs to the current object starts */
    for (size_t i = 0; i < n; i++) {
        char c = p[i];
        if (s->depth == 0) {
            if (c == ' ' || c == '\n' || c == '\r' || c == '\t') {
                if (++s->gap > s->max)
                    return -1; /* an endless stream of nothing counts as one */
                start = i + 1;
                continue;
            }
            if (c != '{')
                return -1;
            s->gap = 0;
            s->depth = 1;
            start = i;
            continue;
        }
        if (s->in_str) {
            if (s->esc)
                s->esc = false;
            else if (c == '\\')
                s->esc = true;
            else if (c == '"')
                s->in_str = false;
        } else if (c == '"') {
            s->in_str = true;
        } else if (c == '{' || c == '[') {
            s->depth++;
        } else if (c == '}' || c == ']') {
            s->depth--;
        }
        if (s->cur.len + (i + 1 - start) > s->max)
            return -1;
        if (s->depth == 0) {
            dp_buf_append(&s->cur, p + start, i + 1 - start);
            int rc = cb(s->cur.base, s->cur.len, data);
            dp_buf_reset(&s->cur);
            start = i + 1;
            if (rc != 0)
                return rc;
        }
    }
    if (s->depth > 0 && start < n)
        dp_buf_append(&s->cur, p + start, n - start);
    return 0;
}

void fleet_ej_split_free(fleet_ej_split_t *s)
{
    dp_buf_free(&s->cur);
}
