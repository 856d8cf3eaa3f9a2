/* A small streaming JSON writer into a dp_buf_t. Used for logs, errors, admin output and audit
 * lines, where building a cJSON tree only to print it would allocate per field.
 *
 * The writer tracks whether a comma is due; keys are given with each value inside objects and
 * are NULL inside arrays. Strings are escaped per RFC 8259; invalid UTF-8 is replaced with
 * U+FFFD so a log line is always valid JSON whatever a client sent. */
#ifndef DP_JW_H
#define DP_JW_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"

#define DP_JW_MAX_DEPTH 32

typedef struct {
    dp_buf_t *out;
    int depth;
    bool need_comma[DP_JW_MAX_DEPTH];
} dp_jw_t;

void dp_jw_init(dp_jw_t *w, dp_buf_t *out);
void dp_jw_obj_begin(dp_jw_t *w, const char *key);
void dp_jw_obj_end(dp_jw_t *w);
void dp_jw_arr_begin(dp_jw_t *w, const char *key);
void dp_jw_arr_end(dp_jw_t *w);
void dp_jw_str(dp_jw_t *w, const char *key, const char *s);
void dp_jw_strn(dp_jw_t *w, const char *key, const char *s, size_t n);
void dp_jw_int(dp_jw_t *w, const char *key, int64_t v);
void dp_jw_uint(dp_jw_t *w, const char *key, uint64_t v);
/* Doubles print with %.17g trimmed to the shortest form that reads back the same. */
void dp_jw_double(dp_jw_t *w, const char *key, double v);
void dp_jw_bool(dp_jw_t *w, const char *key, bool v);
void dp_jw_null(dp_jw_t *w, const char *key);
/* Insert already-serialised JSON verbatim. */
void dp_jw_raw(dp_jw_t *w, const char *key, const char *json, size_t n);

/* Append s escaped as JSON string contents (no quotes). */
void dp_json_escape(dp_buf_t *out, const char *s, size_t n);
/* Shortest round-trip representation of a double (as ECMAScript prints numbers where they agree:
 * integers without ".0", no "+" in exponents is not guaranteed; see policy/jcs for RFC 8785). */
void dp_json_double(dp_buf_t *out, double v);

#endif
