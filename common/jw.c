#include "common/jw.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

void dp_jw_init(dp_jw_t *w, dp_buf_t *out)
{
    memset(w, 0, sizeof(*w));
    w->out = out;
}

static void sep(dp_jw_t *w, const char *key)
{
    if (w->depth > 0) {
        if (w->need_comma[w->depth])
            dp_buf_appendc(w->out, ',');
        w->need_comma[w->depth] = true;
    }
    if (key) {
        dp_buf_appendc(w->out, '"');
        dp_json_escape(w->out, key, strlen(key));
        dp_buf_append(w->out, "\":", 2);
    }
}

static void push(dp_jw_t *w, char c)
{
    dp_buf_appendc(w->out, c);
    if (w->depth < DP_JW_MAX_DEPTH - 1)
        w->depth++;
    w->need_comma[w->depth] = false;
}

void dp_jw_obj_begin(dp_jw_t *w, const char *key)
{
    sep(w, key);
    push(w, '{');
}

void dp_jw_obj_end(dp_jw_t *w)
{
    dp_buf_appendc(w->out, '}');
    if (w->depth > 0)
        w->depth--;
}

void dp_jw_arr_begin(dp_jw_t *w, const char *key)
{
    sep(w, key);
    push(w, '[');
}

void dp_jw_arr_end(dp_jw_t *w)
{
    dp_buf_appendc(w->out, ']');
    if (w->depth > 0)
        w->depth--;
}

void dp_jw_str(dp_jw_t *w, const char *key, const char *s)
{
    if (s == NULL) {
        dp_jw_null(w, key);
        return;
    }
    dp_jw_strn(w, key, s, strlen(s));
}

void dp_jw_strn(dp_jw_t *w, const char *key, const char *s, size_t n)
{
    sep(w, key);
    dp_buf_appendc(w->out, '"');
    dp_json_escape(w->out, s, n);
    dp_buf_appendc(w->out, '"');
}

void dp_jw_int(dp_jw_t *w, const char *key, int64_t v)
{
    sep(w, key);
    if (v < 0) {
        dp_buf_appendc(w->out, '-');
        dp_buf_append_u64(w->out, (uint64_t)0 - (uint64_t)v);
    } else {
        dp_buf_append_u64(w->out, (uint64_t)v);
    }
}

void dp_jw_uint(dp_jw_t *w, const char *key, uint64_t v)
{
    sep(w, key);
    dp_buf_append_u64(w->out, v);
}

void dp_jw_double(dp_jw_t *w, const char *key, double v)
{
    sep(w, key);
    dp_json_double(w->out, v);
}

void dp_jw_bool(dp_jw_t *w, const char *key, bool v)
{
    sep(w, key);
    dp_buf_appends(w->out, v ? "true" : "false");
}

void dp_jw_null(dp_jw_t *w, const char *key)
{
    sep(w, key);
    dp_buf_append(w->out, "null", 4);
}

void dp_jw_raw(dp_jw_t *w, const char *key, const char *json, size_t n)
{
    sep(w, key);
    dp_buf_append(w->out, json, n);
}

void dp_json_double(dp_buf_t *out, double v)
{
    if (!isfinite(v)) {
        dp_buf_append(out, "null", 4);
        return;
    }
    if (v == 0) {
        dp_buf_appendc(out, '0');
        return;
    }
    if (fabs(v) < 9007199254740992.0 && v == (double)(int64_t)v) {
        char tmp[32];
        int n = snprintf(tmp, sizeof(tmp), "%lld", (long long)v);
        dp_buf_append(out, tmp, (size_t)n);
        return;
    }
    char tmp[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof(tmp), "%.*g", prec, v);
        if (strtod(tmp, NULL) == v)
            break;
    }
    dp_buf_appends(out, tmp);
}

void dp_json_escape(dp_buf_t *out, const char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)s;
    dp_buf_reserve(out, n + 2);
    size_t i = 0;
    while (i < n) {
        size_t run = i;
        /* Copy runs of plain ASCII in one append. */
        while (run < n && p[run] >= 0x20 && p[run] < 0x80 && p[run] != '"' && p[run] != '\\')
            run++;
        if (run > i) {
            dp_buf_append(out, s + i, run - i);
            i = run;
            if (i == n)
                break;
        }
        unsigned char c = p[i];
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            dp_buf_append(out, e, 2);
            i++;
        } else if (c < 0x20) {
            switch (c) {
            case '\n':
                dp_buf_append(out, "\\n", 2);
                break;
            case '\r':
                dp_buf_append(out, "\\r", 2);
                break;
            case '\t':
                dp_buf_append(out, "\\t", 2);
                break;
            default: {
                char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
                dp_buf_append(out, e, 6);
            }
            }
            i++;
        } else {
            size_t l = dp_utf8_len(p + i, n - i);
            if (l == 0) {
                dp_buf_append(out, "\xEF\xBF\xBD", 3);
                i++;
            } else {
                dp_buf_append(out, s + i, l);
                i += l;
            }
        }
    }
}
