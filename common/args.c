/* The table-driven command-line parser and its help printer (args.h). */
#include "common/args.h"

#include <assert.h>
#include <stdarg.h>
#include <string.h>

#include "common/util.h"

/* Options whose label ("-c, --config FILE") is wider than this get their help on the next
 * line, so one long option does not push every description to the right. */
#define HELP_LABEL_MAX 30

int dp_arg_fail(char *why, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, n, fmt, ap);
    va_end(ap);
    return -1;
}

/* The name as typed, without any "=value" (which may be a secret), at most 63 bytes. */
static void typed_name(const char *arg, char *out, size_t n)
{
    size_t len = strcspn(arg, "=");
    if (len > 63)
        len = 63;
    snprintf(out, n, "%.*s", (int)len, arg);
}

static const dp_arg_t *find_long(const dp_args_t *spec, const char *name, size_t len)
{
    for (size_t k = 0; k < spec->nopts; k++) {
        const char *n = spec->opts[k].name;
        if (n && strlen(n) == len && strncmp(n, name, len) == 0)
            return &spec->opts[k];
    }
    return NULL;
}

static const dp_arg_t *find_short(const dp_args_t *spec, char c)
{
    for (size_t k = 0; k < spec->nopts; k++)
        if (spec->opts[k].shortopt && spec->opts[k].shortopt == c)
            return &spec->opts[k];
    return NULL;
}

static int list_add(dp_arg_list_t *l, const char *v)
{
    if (l->n >= l->max)
        return -1;
    l->items[l->n++] = v;
    return 0;
}

/* Store one value of option o (typed as flag) into out. */
static int store(const dp_arg_t *o, const char *flag, const char *v, void *out, char *why, size_t n)
{
    void *dst = (char *)out + o->off;
    switch (o->kind) {
    case DP_ARG_STR:
        *(const char **)dst = v;
        return 0;
    case DP_ARG_LIST:
        if (list_add(dst, v) != 0)
            return dp_arg_fail(why, n, "%s given too many times", flag);
        return 0;
    case DP_ARG_UINT: {
        uint64_t u;
        if (dp_parse_u64(v, strlen(v), &u) != 0 || u < o->min || u > o->max)
            return dp_arg_fail(why, n, "%s: expected an integer in [%llu, %llu], got '%s'", flag,
                               (unsigned long long)o->min, (unsigned long long)o->max, v);
        *(uint64_t *)dst = u;
        return 0;
    }
    case DP_ARG_CALL: {
        char reason[256] = "";
        if (o->cb(dst, v, reason, sizeof(reason)) != 0)
            return dp_arg_fail(why, n, "%s: %s", flag, reason[0] ? reason : "invalid value");
        return 0;
    }
    case DP_ARG_FLAG:
        break;
    }
    assert(!"a flag has no value to store");
    return -1;
}

/* How the help and the "is required" line name an option: "-c CONFIG", "--out PREFIX". */
static void display_name(const dp_arg_t *o, char *out, size_t n)
{
    if (o->shortopt)
        snprintf(out, n, "-%c%s%s", o->shortopt, o->meta ? " " : "", o->meta ? o->meta : "");
    else
        snprintf(out, n, "%s%s%s", o->name, o->meta ? " " : "", o->meta ? o->meta : "");
}

int dp_args_scan(const dp_args_t *spec, int argc, char **argv, void *out, char *why, size_t whylen)
{
    uint64_t seen = 0; /* bit k: opts[k] was given */
    assert(spec->nopts <= DP_ARGS_MAX_OPTS);
    if (spec->nopts > DP_ARGS_MAX_OPTS) /* a table this long is a bug: never shift past 63 */
        return dp_arg_fail(why, whylen, "%zu options in one table, at most %d", spec->nopts,
                           DP_ARGS_MAX_OPTS);
    bool only_pos = false;
    why[0] = '\0';
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!only_pos && strcmp(a, "--") == 0) {
            only_pos = true;
            continue;
        }
        if (only_pos || a[0] != '-' || a[1] == '\0') {
            if (!spec->positional || list_add((dp_arg_list_t *)((char *)out + spec->pos_off), a))
                return dp_arg_fail(why, whylen, "unexpected argument '%s'", a);
            continue;
        }
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0)
            return 1;
        char flag[64];
        typed_name(a, flag, sizeof(flag));
        const dp_arg_t *o;
        const char *inline_val = NULL; /* the value in the same word: --x=V, -xV, -x=V */
        if (a[1] == '-') {
            const char *eq = strchr(a, '=');
            o = find_long(spec, a, eq ? (size_t)(eq - a) : strlen(a));
            if (eq)
                inline_val = eq + 1;
        } else {
            o = find_short(spec, a[1]);
            snprintf(flag, sizeof(flag), "-%c", a[1]);
            if (a[2] != '\0')
                inline_val = a[2] == '=' ? a + 3 : a + 2;
            if (o == NULL)
                typed_name(a, flag, sizeof(flag));
        }
        if (o == NULL)
            return dp_arg_fail(why, whylen, "unknown option '%s'", flag);
        uint64_t bit = (uint64_t)1 << (o - spec->opts);
        if ((o->flags & DP_ARG_ONCE) && (seen & bit))
            return dp_arg_fail(why, whylen, "%s given more than once", flag);
        seen |= bit;
        if (o->kind == DP_ARG_FLAG) {
            if (inline_val)
                return dp_arg_fail(why, whylen, "%s takes no value", flag);
            *(bool *)((char *)out + o->off) = true;
            continue;
        }
        const char *v = inline_val;
        if (v == NULL) {
            if (i + 1 >= argc)
                return dp_arg_fail(why, whylen, "%s needs a value", flag);
            v = argv[++i];
        }
        if (v[0] == '\0' && !(o->flags & DP_ARG_EMPTY_OK))
            return dp_arg_fail(why, whylen, "%s: empty value", flag);
        if (store(o, flag, v, out, why, whylen) != 0)
            return -1;
    }
    for (size_t k = 0; k < spec->nopts; k++) {
        const dp_arg_t *o = &spec->opts[k];
        if ((o->flags & DP_ARG_REQUIRED) && !(seen & ((uint64_t)1 << k))) {
            char name[96];
            display_name(o, name, sizeof(name));
            return dp_arg_fail(why, whylen, "%s is required", name);
        }
    }
    return 0;
}

int dp_args_parse(const dp_args_t *spec, int argc, char **argv, void *out)
{
    char why[512];
    int r = dp_args_scan(spec, argc, argv, out, why, sizeof(why));
    if (r > 0)
        dp_args_help(spec, stdout);
    else if (r < 0)
        fprintf(stderr, "%s: %s (try --help)\n", spec->prog, why);
    return r;
}

int dp_args_usage_error(const dp_args_t *spec, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", spec->prog);
    vfprintf(stderr, fmt, ap);
    fputs(" (try --help)\n", stderr);
    va_end(ap);
    return DP_EXIT_USAGE;
}

int dp_args_subcommand(const dp_args_t *spec, int argc, char **argv, const char *sub)
{
    if (argc >= 2 && strcmp(argv[1], sub) == 0)
        return -1;
    if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        dp_args_help(spec, stdout);
        return DP_EXIT_OK;
    }
    /* The command without its subcommand: spec->prog is "detproxy audit verify". */
    size_t n = strlen(spec->prog), k = strlen(sub);
    if (n > k && spec->prog[n - k - 1] == ' ' && strcmp(spec->prog + n - k, sub) == 0)
        n -= k + 1;
    if (argc < 2)
        fprintf(stderr, "%.*s: missing subcommand (expected %s; try --help)\n", (int)n, spec->prog,
                sub);
    else
        fprintf(stderr, "%.*s: unknown subcommand '%s' (expected %s; try --help)\n", (int)n,
                spec->prog, argv[1], sub);
    return DP_EXIT_USAGE;
}

/* ---- help ----------------------------------------------------------------------------------- */

/* "  -c, --config FILE" or "      --list": the first column of an option's entry. */
static void label(const char *name, char shortopt, const char *meta, char *out, size_t n)
{
    if (shortopt && name)
        snprintf(out, n, "  -%c, %s", shortopt, name);
    else if (shortopt)
        snprintf(out, n, "  -%c", shortopt);
    else
        snprintf(out, n, "      %s", name);
    if (meta) {
        size_t l = strlen(out);
        snprintf(out + l, n - l, " %s", meta);
    }
}

static void entry(FILE *f, const char *lab, const char *help, int col)
{
    int len = (int)strlen(lab);
    fputs(lab, f);
    if (help == NULL || help[0] == '\0') {
        fputc('\n', f);
        return;
    }
    if (len + 2 > col)
        fprintf(f, "\n%*s", col, "");
    else
        fprintf(f, "%*s", col - len, "");
    for (const char *p = help;;) {
        const char *nl = strchr(p, '\n');
        size_t l = nl ? (size_t)(nl - p) : strlen(p);
        fprintf(f, "%.*s\n", (int)l, p);
        if (nl == NULL)
            break;
        p = nl + 1;
        fprintf(f, "%*s", col, "");
    }
}

void dp_args_help(const dp_args_t *spec, FILE *f)
{
    char lab[128];
    int col = (int)strlen("  -h, --help") + 2;
    for (size_t k = 0; k < spec->nopts; k++) {
        const dp_arg_t *o = &spec->opts[k];
        label(o->name, o->shortopt, o->meta, lab, sizeof(lab));
        int w = (int)strlen(lab) + 2;
        if (w <= HELP_LABEL_MAX + 2 && w > col)
            col = w;
    }
    fprintf(f, "usage: %s\n", spec->usage);
    if (spec->about)
        fprintf(f, "\n%s\n", spec->about);
    fputs("\noptions:\n", f);
    for (size_t k = 0; k < spec->nopts; k++) {
        const dp_arg_t *o = &spec->opts[k];
        label(o->name, o->shortopt, o->meta, lab, sizeof(lab));
        entry(f, lab, o->help, col);
    }
    entry(f, "  -h, --help", "show this help", col);
    if (spec->epilog)
        fprintf(f, "\n%s\n", spec->epilog);
}
