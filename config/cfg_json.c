/* The validation context: JSON paths, error collection, and typed readers over cJSON values.
 * Everything here reports and carries on, so one pass finds every problem in a document. */
#include "config/cfg_internal.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* ---- errors and paths ---------------------------------------------------------------- */

void cfg_errors_free(cfg_errors_t *e)
{
    if (e == NULL)
        return;
    for (size_t i = 0; i < e->count; i++)
        free(e->items[i]);
    for (size_t i = 0; i < e->nwarnings; i++)
        free(e->warnings[i]);
    free(e->items);
    free(e->warnings);
    *e = (cfg_errors_t){0};
}

void cfg_ctx_init(cfg_ctx_t *c, cfg_errors_t *errs, const char *prefix, const char *root,
                  const char *dir)
{
    *c = (cfg_ctx_t){.errs = errs, .root = root, .dir = dir};
    if (prefix != NULL)
        dp_buf_appends(&c->path, prefix);
}

void cfg_ctx_free(cfg_ctx_t *c)
{
    dp_buf_free(&c->path);
}

/* Keys that are plain identifiers print as ".key"; anything else as ["key"] so the path stays
 * unambiguous. */
static bool is_ident(const char *s)
{
    if (*s == '\0')
        return false;
    for (; *s; s++) {
        char ch = *s;
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                  (ch >= '0' && ch <= '9') || ch == '_' || ch == '-';
        if (!ok)
            return false;
    }
    return true;
}

size_t cfg_path_key(cfg_ctx_t *c, const char *key)
{
    size_t mark = c->path.len;
    if (is_ident(key)) {
        if (c->path.len > 0)
            dp_buf_appendc(&c->path, '.');
        dp_buf_appends(&c->path, key);
    } else {
        dp_buf_appends(&c->path, "[\"");
        for (const char *s = key; *s; s++) {
            if (*s == '"' || *s == '\\')
                dp_buf_appendc(&c->path, '\\');
            dp_buf_appendc(&c->path, *s);
        }
        dp_buf_appends(&c->path, "\"]");
    }
    return mark;
}

size_t cfg_path_index(cfg_ctx_t *c, size_t i)
{
    size_t mark = c->path.len;
    dp_buf_printf(&c->path, "[%zu]", i);
    return mark;
}

void cfg_path_pop(cfg_ctx_t *c, size_t mark)
{
    assert(mark <= c->path.len); /* marks pop in the order they were pushed */
    c->path.len = mark;
    if (c->path.base != NULL)
        c->path.base[mark] = '\0';
}

/* Control bytes (from a config value or key) never reach the operator's terminal raw. */
static void append_printable(dp_buf_t *b, const char *s)
{
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch < 0x20 || ch == 0x7f)
            dp_buf_printf(b, "\\x%02x", ch);
        else
            dp_buf_appendc(b, (char)ch);
    }
}

static void push(char ***list, size_t *n, char *s)
{
    *list = dp_xrealloc(*list, (*n + 1) * sizeof(**list));
    (*list)[(*n)++] = s;
}

void cfg_errors_add(cfg_errors_t *e, const char *msg)
{
    push(&e->items, &e->count, dp_xstrdup(msg));
}

static void report(cfg_ctx_t *c, bool warn, const char *key, const char *fmt, va_list ap)
{
    char msg[1024];
    vsnprintf(msg, sizeof(msg), fmt, ap);

    size_t mark = key != NULL ? cfg_path_key(c, key) : c->path.len;
    dp_buf_t b = {0};
    append_printable(&b, c->path.len > 0 ? c->path.base : c->root);
    cfg_path_pop(c, mark);
    dp_buf_appends(&b, ": ");
    append_printable(&b, msg);
    if (c->file != NULL) {
        dp_buf_appends(&b, " (in ");
        append_printable(&b, c->file);
        dp_buf_appendc(&b, ')');
    }
    if (warn) {
        push(&c->errs->warnings, &c->errs->nwarnings, dp_buf_steal(&b));
    } else {
        push(&c->errs->items, &c->errs->count, dp_buf_steal(&b));
        c->nerrors++;
    }
}

void cfg_err(cfg_ctx_t *c, const char *key, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    report(c, false, key, fmt, ap);
    va_end(ap);
}

void cfg_warn(cfg_ctx_t *c, const char *key, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    report(c, true, key, fmt, ap);
    va_end(ap);
}

/* ---- documents and keys ---------------------------------------------------------------- */

/* Line and column (from 1) of byte off of json. */
static void position(const char *json, size_t off, size_t *line, size_t *col)
{
    *line = 1, *col = 1;
    for (size_t i = 0; i < off; i++, (*col)++) {
        if (json[i] == '\n') {
            (*line)++;
            *col = 0;
        }
    }
}

size_t cfg_json_nul_escape(const char *json, size_t len)
{
    bool in_string = false;
    for (size_t i = 0; i < len; i++) {
        if (json[i] == '"') {
            in_string = !in_string;
        } else if (in_string && json[i] == '\\' && i + 1 < len) {
            if (json[i + 1] == 'u' && i + 6 <= len && memcmp(json + i + 2, "0000", 4) == 0)
                return i;
            i++; /* the escaped byte (a quote or backslash among them) */
        }
    }
    return len;
}

/* Is p[0..n) a number as JSON writes it: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
static bool json_number(const char *p, size_t n)
{
    size_t i = 0;
    i += i < n && p[i] == '-';
    if (i < n && p[i] == '0')
        i++;
    else if (i < n && p[i] >= '1' && p[i] <= '9')
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
    else
        return false;
    if (i < n && p[i] == '.') {
        size_t d = ++i;
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
        if (i == d)
            return false;
    }
    if (i < n && (p[i] == 'e' || p[i] == 'E')) {
        i++;
        i += i < n && (p[i] == '+' || p[i] == '-');
        size_t d = i;
        while (i < n && p[i] >= '0' && p[i] <= '9')
            i++;
        if (i == d)
            return false;
    }
    return i == n;
}

/* One pass over json's text: outside its strings, the offset of the first number JSON would not
 * take (*loose; len when none); the offset of the first control byte that is not JSON's
 * whitespace between tokens, or any inside a string, which JSON writes escaped (*ctl; len when
 * none; *ctl_quoted says which); and how many arrays and objects are open at offset `at` (*depth).
 * cJSON reads a number with strtod, which takes 01 and 1. as 1, and skips every byte up to 0x20
 * between tokens (vertical tab, form feed, ...): a config is read as JSON writes it, as every other
 * reader of the file (jq, an editor, Kubernetes) reads it. And cJSON stops at
 * CJSON_NESTING_LIMIT levels, saying no more than where. */
static void scan_text(const char *json, size_t len, size_t at, size_t *loose, size_t *ctl,
                      bool *ctl_quoted, size_t *depth)
{
    bool in_string = false;
    *loose = len;
    *ctl = len;
    *ctl_quoted = false;
    *depth = 0;
    for (size_t i = 0; i < len; i++) {
        char ch = json[i];
        if (in_string) {
            if (ch == '\\')
                i++;
            else if (ch == '"')
                in_string = false;
            else if ((unsigned char)ch < 0x20 && *ctl == len) {
                *ctl = i; /* even a tab or a line feed */
                *ctl_quoted = true;
            }
        } else if (ch == '"') {
            in_string = true;
        } else if ((unsigned char)ch < 0x20 && ch != '\t' && ch != '\n' && ch != '\r') {
            if (*ctl == len)
                *ctl = i;
        } else if ((ch == '[' || ch == '{') && i < at) {
            ++*depth;
        } else if ((ch == ']' || ch == '}') && i<at && * depth> 0) {
            --*depth;
        } else if ((ch == '-' || (ch >= '0' && ch <= '9')) && *loose == len) {
            size_t end = i;
            while (end < len && json[end] && strchr("0123456789+-.eE", json[end]) != NULL)
                end++;
            if (!json_number(json + i, end - i))
                *loose = i;
            i = end - 1;
        }
    }
}

cJSON *cfg_parse_json(cfg_ctx_t *c, const char *json, size_t len)
{
    size_t line, col;
    const char *nul = memchr(json, '\0', len);
    if (nul != NULL) {
        position(json, (size_t)(nul - json), &line, &col);
        cfg_err(c, NULL, "invalid JSON at line %zu, column %zu: a NUL byte", line, col);
        return NULL;
    }
    if (len >= 3 && memcmp(json, "\xef\xbb\xbf", 3) == 0) {
        /* cJSON skips it; JSON has none (RFC 8259), and jq and Kubernetes refuse it. */
        cfg_err(c, NULL,
                "invalid JSON at line 1, column 1: a UTF-8 byte-order mark (EF BB BF): save the "
                "file without one");
        return NULL;
    }
    size_t bad = dp_utf8_invalid_at(json, len);
    if (bad < len) {
        /* JSON is UTF-8 (RFC 8259): a name read otherwise would be shown otherwise, too. */
        position(json, bad, &line, &col);
        cfg_err(c, NULL, "invalid JSON at line %zu, column %zu: not UTF-8", line, col);
        return NULL;
    }
    size_t esc = cfg_json_nul_escape(json, len);
    if (esc < len) {
        position(json, esc, &line, &col);
        cfg_err(c, NULL,
                "a string at line %zu, column %zu holds \\u0000 (NUL), which no name, "
                "path or value here may contain",
                line, col);
        return NULL;
    }
    size_t loose, ctl, depth;
    bool quoted;
    scan_text(json, len, len, &loose, &ctl, &quoted, &depth);
    if (ctl < len) {
        position(json, ctl, &line, &col);
        if (quoted)
            cfg_err(c, NULL,
                    "invalid JSON at line %zu, column %zu: control byte 0x%02x inside a string "
                    "(write it escaped: \\t, \\n, \\r or \\u00XX)",
                    line, col, (unsigned char)json[ctl]);
        else
            cfg_err(c, NULL,
                    "invalid JSON at line %zu, column %zu: control byte 0x%02x between tokens "
                    "(JSON's whitespace is space, tab, line feed and carriage return)",
                    line, col, (unsigned char)json[ctl]);
        return NULL;
    }
    if (loose < len) {
        position(json, loose, &line, &col);
        cfg_err(c, NULL,
                "invalid JSON at line %zu, column %zu: a number as JSON writes it (not 01, 1. "
                "or 1.e5)",
                line, col);
        return NULL;
    }
    /* cJSON checks for trailing bytes only against a NUL inside the given length. */
    char *copy = dp_xstrndup(json, len);
    const char *end = NULL;
    cJSON *doc = cJSON_ParseWithLengthOpts(copy, len + 1, &end, true);
    if (doc == NULL) {
        size_t off = end != NULL && end >= copy ? (size_t)(end - copy) : 0;
        position(copy, off < len ? off : len, &line, &col);
        scan_text(copy, len, off, &loose, &ctl, &quoted, &depth);
        if (depth >= CJSON_NESTING_LIMIT)
            cfg_err(c, NULL, "invalid JSON at line %zu, column %zu: nested deeper than %d levels",
                    line, col, CJSON_NESTING_LIMIT);
        else
            cfg_err(c, NULL, "invalid JSON at line %zu, column %zu", line, col);
    }
    free(copy);
    return doc;
}

/* Edit distance, for "did you mean" hints on misspelt keys. Long keys get no hint. */
static size_t edit_distance(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63)
        return SIZE_MAX;
    size_t row[64];
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

static void report_unknown(cfg_ctx_t *c, const char *key, const char *const *allowed)
{
    const char *hint = NULL;
    size_t best = 3; /* a hint for up to two typos, or a shortened name ("interval") */
    size_t klen = strlen(key);
    for (size_t i = 0; allowed[i] != NULL; i++) {
        size_t d = edit_distance(key, allowed[i]);
        if (klen >= 3 && strncmp(key, allowed[i], klen) == 0 && d > 2)
            d = 2;
        if (d < best) {
            best = d;
            hint = allowed[i];
        }
    }
    if (hint != NULL)
        cfg_err(c, key, "unknown key (did you mean \"%s\"?)", hint);
    else
        cfg_err(c, key, "unknown key");
}

static size_t seen_slot(const cfg_seen_t *s, const char *key)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)key; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    size_t i = (size_t)h & (s->cap - 1);
    while (s->keys[i] != NULL && strcmp(s->keys[i], key) != 0)
        i = (i + 1) & (s->cap - 1);
    return i;
}

size_t cfg_seen_find(const cfg_seen_t *s, const char *key)
{
    if (s->cap == 0)
        return CFG_UNSEEN;
    size_t i = seen_slot(s, key);
    return s->keys[i] ? s->vals[i] : CFG_UNSEEN;
}

size_t cfg_seen_add(cfg_seen_t *s, const char *key, size_t val)
{
    if (2 * (s->n + 1) > s->cap) { /* at most half full */
        cfg_seen_t g = {.cap = s->cap ? 2 * s->cap : 64};
        g.keys = dp_xcalloc(g.cap, sizeof(*g.keys));
        g.vals = dp_xcalloc(g.cap, sizeof(*g.vals));
        for (size_t i = 0; i < s->cap; i++)
            if (s->keys[i])
                cfg_seen_add(&g, s->keys[i], s->vals[i]);
        cfg_seen_free(s);
        *s = g;
    }
    size_t i = seen_slot(s, key);
    if (s->keys[i])
        return s->vals[i];
    s->keys[i] = key;
    s->vals[i] = val;
    s->n++;
    return CFG_UNSEEN;
}

void cfg_seen_free(cfg_seen_t *s)
{
    free(s->keys);
    free(s->vals);
    memset(s, 0, sizeof(*s));
}

bool cfg_check_keys(cfg_ctx_t *c, const cJSON *obj, const char *const *allowed)
{
    size_t before = c->nerrors, nallowed = 0;
    while (allowed[nallowed] != NULL)
        nallowed++;
    bool *seen = dp_xcalloc(nallowed + 1, sizeof(*seen)); /* a known key met already */
    for (const cJSON *it = obj->child; it != NULL; it = it->next) {
        size_t k = 0;
        while (k < nallowed && strcmp(it->string, allowed[k]) != 0)
            k++;
        if (k == nallowed)
            report_unknown(c, it->string, allowed);
        else if (seen[k])
            cfg_err(c, it->string, "duplicate key");
        else
            seen[k] = true;
    }
    free(seen);
    return c->nerrors == before;
}

const cJSON *cfg_get(const cJSON *obj, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNull(v) ? NULL : v;
}

static const cJSON *get_typed(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required,
                              cJSON_bool (*is)(const cJSON *), const char *what)
{
    const cJSON *v = cfg_get(obj, key);
    if (v == NULL) {
        if (required)
            cfg_err(c, key, "required");
        return NULL;
    }
    if (!is(v)) {
        cfg_err(c, key, "expected %s", what);
        return NULL;
    }
    return v;
}

const cJSON *cfg_get_obj(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required)
{
    return get_typed(c, obj, key, required, cJSON_IsObject, "an object");
}

const cJSON *cfg_get_arr(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required)
{
    return get_typed(c, obj, key, required, cJSON_IsArray, "an array");
}

/* ---- scalars --------------------------------------------------------------------------- */

/* Shared by cfg_get_str and array elements: the string rules, reported at key. */
static bool check_str(cfg_ctx_t *c, const char *key, const cJSON *v)
{
    if (!cJSON_IsString(v)) {
        cfg_err(c, key, "expected a string");
        return false;
    }
    const unsigned char *s = (const unsigned char *)v->valuestring;
    if (*s == '\0') {
        cfg_err(c, key, "must not be empty");
        return false;
    }
    for (; *s; s++) {
        if (*s < 0x20 || *s == 0x7f) {
            cfg_err(c, key, "must not contain control characters");
            return false;
        }
    }
    return true;
}

bool cfg_get_str(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required, char **out)
{
    const cJSON *v = cfg_get(obj, key);
    if (v == NULL) {
        if (required)
            cfg_err(c, key, "required");
        return false;
    }
    if (!check_str(c, key, v))
        return false;
    free(*out);
    *out = dp_xstrdup(v->valuestring);
    return true;
}

bool cfg_get_path(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required, char **out)
{
    char *rel = NULL;
    if (!cfg_get_str(c, obj, key, required, &rel))
        return false;
    free(*out);
    *out = cfg_resolve(c->dir, rel);
    free(rel);
    return true;
}

bool cfg_get_text(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required, char **out)
{
    const cJSON *v = cfg_get(obj, key);
    if (v == NULL) {
        if (required)
            cfg_err(c, key, "required");
        return false;
    }
    if (!cJSON_IsString(v) || v->valuestring[0] == '\0') {
        cfg_err(c, key, cJSON_IsString(v) ? "must not be empty" : "expected a string");
        return false;
    }
    free(*out);
    *out = dp_xstrdup(v->valuestring);
    return true;
}

void cfg_fmt_num(char *out, size_t n, double v)
{
    if (v == floor(v) && fabs(v) < 1e17) {
        snprintf(out, n, "%.0f", v);
        return;
    }
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(out, n, "%.*g", prec, v);
        if (strtod(out, NULL) == v)
            return;
    }
}

bool cfg_get_uint(cfg_ctx_t *c, const cJSON *obj, const char *key, uint64_t lo, uint64_t hi,
                  uint64_t *out)
{
    const cJSON *v = cfg_get(obj, key);
    if (v == NULL)
        return false;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) ||
        !isfinite(v->valuedouble)) {
        cfg_err(c, key, "expected an integer");
        return false;
    }
    double d = v->valuedouble;
    if (d < (double)lo || d > (double)hi) {
        cfg_err(c, key, "must be between %llu and %llu", (unsigned long long)lo,
                (unsigned long long)hi);
        return false;
    }
    *out = (uint64_t)d;
    return true;
}

bool cfg_get_u32(cfg_ctx_t *c, const cJSON *obj, const char *key, uint32_t lo, uint32_t hi,
                 uint32_t *out)
{
    uint64_t v;
    if (!cfg_get_uint(c, obj, key, lo, hi, &v))
        return false;
    *out = (uint32_t)v;
    return true;
}

bool cfg_get_num(cfg_ctx_t *c, const cJSON *obj, const char *key, double lo, double hi, double *out)
{
    const cJSON *v = cfg_get(obj, key);
    if (v == NULL)
        return false;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) {
        cfg_err(c, key, "expected a number");
        return false;
    }
    if (v->valuedouble < lo || v->valuedouble > hi) {
        char a[32], b[32];
        cfg_fmt_num(a, sizeof(a), lo);
        cfg_fmt_num(b, sizeof(b), hi);
        cfg_err(c, key, "must be between %s and %s", a, b);
        return false;
    }
    *out = v->valuedouble;
    return true;
}

bool cfg_get_bool(cfg_ctx_t *c, const cJSON *obj, const char *key, bool *out)
{
    const cJSON *v = cfg_get(obj, key);
    if (v == NULL)
        return false;
    if (!cJSON_IsBool(v)) {
        cfg_err(c, key, "expected true or false");
        return false;
    }
    *out = cJSON_IsTrue(v);
    return true;
}

bool cfg_get_enum(cfg_ctx_t *c, const cJSON *obj, const char *key, const char *const *names,
                  size_t n, int *out)
{
    const cJSON *v = cfg_get(obj, key);
    if (v == NULL)
        return false;
    if (cJSON_IsString(v)) {
        for (size_t i = 0; i < n; i++) {
            if (strcmp(v->valuestring, names[i]) == 0) {
                *out = (int)i;
                return true;
            }
        }
    }
    dp_buf_t list = {0};
    for (size_t i = 0; i < n; i++)
        dp_buf_printf(&list, "%s%s", i ? ", " : "", names[i]);
    cfg_err(c, key, "must be one of %s", list.base);
    dp_buf_free(&list);
    return false;
}

bool cfg_get_str_array(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required,
                       bool allow_empty, char ***out, size_t *nout)
{
    const cJSON *arr = cfg_get_arr(c, obj, key, required);
    if (arr == NULL)
        return false;
    size_t n = (size_t)cJSON_GetArraySize(arr);
    if (n == 0 && !allow_empty) {
        cfg_err(c, key, "must not be empty");
        return false;
    }
    size_t before = c->nerrors;
    char **items = dp_xcalloc(n + 1, sizeof(*items));
    size_t mark = cfg_path_key(c, key), i = 0;
    for (const cJSON *it = arr->child; it != NULL; it = it->next, i++) {
        size_t m = cfg_path_index(c, i);
        if (check_str(c, NULL, it))
            items[i] = dp_xstrdup(it->valuestring);
        cfg_path_pop(c, m);
    }
    cfg_path_pop(c, mark);
    if (c->nerrors != before) {
        cfg_str_array_free(items, n);
        return false;
    }
    cfg_str_array_free(*out, *nout);
    *out = items;
    *nout = n;
    return true;
}

void cfg_str_array_free(char **a, size_t n)
{
    for (size_t i = 0; i < n && a != NULL; i++)
        free(a[i]);
    free(a);
}

/* ---- names, hosts, paths --------------------------------------------------------------- */

bool cfg_valid_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > CFG_NAME_MAX || strcmp(s, "-") == 0) /* "-": metrics' label for none */
        return false;
    size_t seg = 0; /* where the current '/'-separated segment starts */
    for (size_t i = 0; i <= n; i++) {
        char ch = s[i];
        if (ch == '/' || ch == '\0') {
            /* Names are parts of admin paths (/admin/replicas/NAME/drain), which are normalised
             * before routing: an empty, "." or ".." segment would name another path. */
            size_t len = i - seg;
            if (len == 0 || (len == 1 && s[seg] == '.') ||
                (len == 2 && s[seg] == '.' && s[seg + 1] == '.'))
                return false;
            seg = i + 1;
            continue;
        }
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                  (ch >= '0' && ch <= '9') || strchr("._-:", ch) != NULL;
        if (!ok)
            return false;
    }
    return true;
}

bool cfg_valid_header_name(const char *s)
{
    if (*s == '\0')
        return false;
    for (; *s; s++) {
        char ch = *s;
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                  (ch >= '0' && ch <= '9') || strchr("!#$%&'*+-.^_`|~", ch) != NULL;
        if (!ok)
            return false;
    }
    return true;
}

void cfg_lowercase(char *s)
{
    for (; *s; s++)
        if (*s >= 'A' && *s <= 'Z')
            *s = (char)(*s + 32);
}

bool cfg_valid_hostname(const char *s)
{
    size_t n = strlen(s), label = 0;
    if (n == 0 || n > 253)
        return false;
    for (size_t i = 0; i <= n; i++) {
        char ch = s[i];
        if (ch == '.' || ch == '\0') {
            if (label == 0 || label > 63 || s[i - 1] == '-' || s[i - label] == '-')
                return false;
            label = 0;
            continue;
        }
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                  (ch >= '0' && ch <= '9') || ch == '-' || ch == '_';
        if (!ok)
            return false;
        label++;
    }
    return true;
}

char *cfg_resolve(const char *dir, const char *p)
{
    if (p[0] == '/' || dir == NULL || dir[0] == '\0')
        return dp_xstrdup(p);
    dp_buf_t b = {0};
    dp_buf_appends(&b, dir);
    if (b.base[b.len - 1] != '/')
        dp_buf_appendc(&b, '/');
    dp_buf_appends(&b, p);
    return dp_buf_steal(&b);
}
