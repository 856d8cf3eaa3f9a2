/* One command-line parser for every command: each command describes its options in a static
 * table (dp_arg_t: name, short name, kind, where the value goes, help text) and this file both
 * parses argv by that table and prints the --help option list from it, so the two cannot
 * disagree. Pure: no libuv, no global state; only dp_args_parse and dp_args_help print.
 *
 * What every command accepts (docs/README.md, "Commands"):
 *   --name value and --name=value; -c value and -cvalue (a leading '=' is dropped: -c=value);
 *   options and positional arguments in any order; "--" ends the options; "-" is positional;
 *   -h and --help print the help on stdout (exit 0) wherever they stand, unless an error
 *   comes before them. Long names match exactly: no abbreviations.
 * A usage error is one line on stderr, "PROG: <reason> (try --help)", naming the flag as it was
 * typed (an unknown one by its name only, never its =value: it may be a secret), and the
 * command exits 2. */
#ifndef DP_ARGS_H
#define DP_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* The exit codes every command uses (docs/README.md, "Commands"). */
enum { DP_EXIT_OK = 0, DP_EXIT_FAILED = 1, DP_EXIT_USAGE = 2, DP_EXIT_RUNTIME = 3 };

typedef enum {
    DP_ARG_FLAG, /* no value: the bool at off becomes true */
    DP_ARG_STR,  /* const char * at off, borrowed from argv; the last one given wins */
    DP_ARG_LIST, /* repeatable: appended to the dp_arg_list_t at off */
    DP_ARG_UINT, /* strict decimal in [min, max] into the uint64_t at off */
    DP_ARG_CALL, /* cb checks the value and stores it at off */
} dp_arg_kind_t;

/* dp_arg_t.flags */
#define DP_ARG_ONCE 1u     /* a second occurrence is a usage error, not "the last one wins" */
#define DP_ARG_EMPTY_OK 2u /* an empty value ("--x=", "--x ''") is a value, not an error */
#define DP_ARG_REQUIRED 4u /* absent: "PROG: -c CONFIG is required" */

/* Values for a DP_ARG_LIST option, or the positional arguments: the caller points items at an
 * array of max entries before parsing; one more is a usage error. Entries borrow from argv. */
typedef struct {
    const char **items;
    size_t n, max;
} dp_arg_list_t;

#define DP_ARG_LIST_OF(array)                                                                      \
    ((dp_arg_list_t){.items = (array), .max = sizeof(array) / sizeof(*(array))})

/* A DP_ARG_CALL check: dst is the option's destination (the struct dp_args_parse fills, plus
 * the option's off: a field, or a sub-struct of several), val the value (borrowed from argv).
 * 0, or -1 with why set to the reason without the flag's name ("expected vllm or tgi, got
 * 'x'"): the parser prints "PROG: FLAG: WHY (try --help)". */
typedef int (*dp_arg_cb)(void *dst, const char *val, char *why, size_t whylen);

/* For a dp_arg_cb: format the reason into why and return -1. */
int dp_arg_fail(char *why, size_t whylen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

typedef struct {
    const char *name; /* "--config", with its dashes; NULL for a short-only option */
    char shortopt;    /* 'c' for -c; 0 for none */
    dp_arg_kind_t kind;
    size_t off;        /* offsetof the destination in the struct dp_args_parse fills */
    const char *meta;  /* the value's name in the help ("FILE"); NULL for a flag */
    const char *help;  /* its lines in the help, separated by '\n' */
    unsigned flags;    /* DP_ARG_ONCE | DP_ARG_EMPTY_OK | DP_ARG_REQUIRED */
    uint64_t min, max; /* DP_ARG_UINT */
    dp_arg_cb cb;      /* DP_ARG_CALL */
} dp_arg_t;

/* One command's command line. The --help output is "usage: " usage, a blank line, about, a blank
 * line, "options:" and one entry per option (then -h, --help), a blank line and epilog; about
 * and epilog may be NULL. Text blocks have no trailing newline. */
typedef struct {
    const char *prog;  /* "detproxy attest hash": the start of every error line */
    const char *usage; /* the synopsis; its later lines carry their own indentation */
    const char *about;
    const dp_arg_t *opts; /* at most DP_ARGS_MAX_OPTS */
    size_t nopts;
    const char *epilog;
    bool positional; /* positional arguments go to the dp_arg_list_t at pos_off; else an error */
    size_t pos_off;
} dp_args_t;

#define DP_ARGS_MAX_OPTS 64

/* A number macro as a string literal, for help text: "up to " DP_ARGS_STR(MAX_KEYS). */
#define DP_ARGS_STR(x) DP_ARGS_STR_(x)
#define DP_ARGS_STR_(x) #x

/* Parse argv[1..argc) into out (a struct of the caller's, filled at the offsets the table
 * gives; set its defaults and list arrays first). No output: returns 0 when parsed, 1 when -h
 * or --help was given, -1 with why set to a one-line reason for a usage error (no prefix, no
 * newline). */
int dp_args_scan(const dp_args_t *spec, int argc, char **argv, void *out, char *why, size_t whylen);

/* dp_args_scan, then: 1 after printing the help on stdout, -1 after printing the error line on
 * stderr, or 0. dp_args_exit(r) is the exit code for a nonzero r. */
int dp_args_parse(const dp_args_t *spec, int argc, char **argv, void *out);

static inline int dp_args_exit(int r)
{
    return r > 0 ? DP_EXIT_OK : DP_EXIT_USAGE;
}

/* The --help text, generated from spec (see dp_args_t). */
void dp_args_help(const dp_args_t *spec, FILE *f);

/* A usage error the command finds itself (a missing combination, a bad value): prints
 * "PROG: <fmt...> (try --help)" on stderr and returns DP_EXIT_USAGE. */
int dp_args_usage_error(const dp_args_t *spec, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* A command with one subcommand (`detproxy audit verify`): -1 when argv[1] is sub (parse the
 * rest); else the exit code after --help on stdout (0), or after a one-line usage error naming
 * the missing or unknown subcommand (2). */
int dp_args_subcommand(const dp_args_t *spec, int argc, char **argv, const char *sub);

#endif
