/* The command-line parser (common/args.h): value forms, flags, lists, numbers, callbacks,
 * positional arguments, every usage error's wording, and the help printed from the table. */
#include <criterion/criterion.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/args.h"
#include "common/util.h"

typedef struct {
    const char *config, *name, *maybe_empty;
    bool json, verbose;
    uint64_t repeat;
    dp_arg_list_t hdrs, pos;
    const char *hdr_store[3], *pos_store[2];
    int color; /* set by the callback: 1 red, 2 blue */
} opts_t;

static int parse_color(void *dst, const char *v, char *why, size_t n)
{
    int *color = dst;
    if (strcmp(v, "red") == 0)
        *color = 1;
    else if (strcmp(v, "blue") == 0)
        *color = 2;
    else
        return dp_arg_fail(why, n, "expected red or blue, got '%s'", v);
    return 0;
}

static const dp_arg_t table[] = {
    {.name = "--config",
     .shortopt = 'c',
     .kind = DP_ARG_STR,
     .off = offsetof(opts_t, config),
     .meta = "FILE",
     .help = "the config file",
     .flags = DP_ARG_REQUIRED | DP_ARG_ONCE},
    {.name = "--name",
     .kind = DP_ARG_STR,
     .off = offsetof(opts_t, name),
     .meta = "NAME",
     .help = "a name\nover two lines"},
    {.name = "--maybe",
     .kind = DP_ARG_STR,
     .off = offsetof(opts_t, maybe_empty),
     .meta = "V",
     .help = "may be empty",
     .flags = DP_ARG_EMPTY_OK},
    {.name = "--json",
     .kind = DP_ARG_FLAG,
     .off = offsetof(opts_t, json),
     .help = "one JSON object"},
    {.name = "--verbose",
     .shortopt = 'v',
     .kind = DP_ARG_FLAG,
     .off = offsetof(opts_t, verbose),
     .help = "say more"},
    {.name = "--repeat",
     .kind = DP_ARG_UINT,
     .off = offsetof(opts_t, repeat),
     .meta = "N",
     .help = "how many (2..10)",
     .min = 2,
     .max = 10},
    {.name = "--header",
     .shortopt = 'H',
     .kind = DP_ARG_LIST,
     .off = offsetof(opts_t, hdrs),
     .meta = "H",
     .help = "a header (repeatable)"},
    {.name = "--color",
     .kind = DP_ARG_CALL,
     .off = offsetof(opts_t, color),
     .meta = "C",
     .help = "red or blue",
     .cb = parse_color},
    {.name = "--a-very-long-option-name",
     .kind = DP_ARG_STR,
     .off = offsetof(opts_t, name),
     .meta = "VALUE",
     .help = "its help goes on the next line"},
};

static const dp_args_t spec = {
    .prog = "detproxy thing",
    .usage = "detproxy thing -c FILE [options] [ARG ...]\n"
             "                      [--more]",
    .about = "Does a thing.",
    .opts = table,
    .nopts = DP_ARRAY_SIZE(table),
    .epilog = "Exit codes: 0 ok, 2 usage error.",
    .positional = true,
    .pos_off = offsetof(opts_t, pos),
};

static char why[512];

/* Scan a NULL-terminated argument list (argv[0] is the command's name). */
#define SCAN(o, ...)                                                                               \
    ({                                                                                             \
        char *argv_[] = {"thing", __VA_ARGS__, NULL};                                              \
        dp_args_scan(&spec, (int)DP_ARRAY_SIZE(argv_) - 1, argv_, &(o), why, sizeof(why));         \
    })

/* Fresh options with their defaults, the lists pointing at their own arrays. */
#define OPTS(o)                                                                                    \
    opts_t o = {.repeat = 8};                                                                      \
    o.hdrs = DP_ARG_LIST_OF(o.hdr_store);                                                          \
    o.pos = DP_ARG_LIST_OF(o.pos_store)

Test(args, both_value_forms_short_and_long)
{
    OPTS(o);
    cr_assert_eq(SCAN(o, "--config", "a.json", "--name=n1"), 0, "%s", why);
    cr_assert_str_eq(o.config, "a.json");
    cr_assert_str_eq(o.name, "n1");
    OPTS(p);
    cr_assert_eq(SCAN(p, "-cb.json"), 0, "%s", why);
    cr_assert_str_eq(p.config, "b.json");
    OPTS(q);
    cr_assert_eq(SCAN(q, "-c=c.json"), 0, "%s", why);
    cr_assert_str_eq(q.config, "c.json");
    OPTS(r);
    cr_assert_eq(SCAN(r, "--config=", "x"), -1);
    cr_assert_str_eq(why, "--config: empty value");
}

Test(args, values_may_start_with_a_dash)
{
    OPTS(o);
    cr_assert_eq(SCAN(o, "-c", "x", "--name", "-v"), 0, "%s", why);
    cr_assert_str_eq(o.name, "-v");
    cr_assert_not(o.verbose);
}

Test(args, flags_and_the_last_value_wins)
{
    OPTS(o);
    cr_assert_eq(SCAN(o, "-c", "x", "--json", "-v", "--name", "a", "--name", "b"), 0, "%s", why);
    cr_assert(o.json && o.verbose);
    cr_assert_str_eq(o.name, "b");
    OPTS(p);
    cr_assert_eq(SCAN(p, "-c", "x", "--json=1"), -1);
    cr_assert_str_eq(why, "--json takes no value");
    OPTS(q);
    cr_assert_eq(SCAN(q, "-c", "x", "-vx"), -1);
    cr_assert_str_eq(why, "-v takes no value");
}

Test(args, once_and_required)
{
    OPTS(o);
    cr_assert_eq(SCAN(o, "-c", "x", "--config=y"), -1);
    cr_assert_str_eq(why, "--config given more than once");
    OPTS(p);
    cr_assert_eq(SCAN(p, "--json"), -1);
    cr_assert_str_eq(why, "-c FILE is required");
}

Test(args, empty_values)
{
    OPTS(o);
    cr_assert_eq(SCAN(o, "-c", "x", "--name", ""), -1);
    cr_assert_str_eq(why, "--name: empty value");
    OPTS(p);
    cr_assert_eq(SCAN(p, "-c", "x", "--maybe", ""), 0, "%s", why);
    cr_assert_str_eq(p.maybe_empty, "");
}

Test(args, missing_value)
{
    OPTS(o);
    cr_assert_eq(SCAN(o, "--config"), -1);
    cr_assert_str_eq(why, "--config needs a value");
    OPTS(p);
    cr_assert_eq(SCAN(p, "-c"), -1);
    cr_assert_str_eq(why, "-c needs a value");
}

Test(args, unknown_options_are_named_without_their_value)
{
    OPTS(o);
    cr_assert_eq(SCAN(o, "--secret=hunter2"), -1);
    cr_assert_str_eq(why, "unknown option '--secret'");
    OPTS(p);
    cr_assert_eq(SCAN(p, "-x"), -1);
    cr_assert_str_eq(why, "unknown option '-x'");
    OPTS(q);
    cr_assert_eq(SCAN(q, "--conf", "x"), -1, "no abbreviations");
    cr_assert_str_eq(why, "unknown option '--conf'");
    OPTS(r);
    cr_assert_eq(SCAN(r, "--help=1"), -1);
    cr_assert_str_eq(why, "unknown option '--help'");
}

Test(args, help_wherever_it_stands_unless_an_error_comes_first)
{
    OPTS(o);
    cr_assert_eq(SCAN(o, "--json", "-h"), 1);
    OPTS(p);
    cr_assert_eq(SCAN(p, "--help", "--bogus"), 1, "required options are not checked");
    OPTS(q);
    cr_assert_eq(SCAN(q, "--bogus", "--help"), -1);
}

Test(args, positional_arguments_anywhere_and_after_double_dash)
{
    OPTS(o);
    cr_assert_eq(SCAN(o, "one", "-c", "x", "--", "--two"), 0, "%s", why);
    cr_assert_eq(o.pos.n, 2);
    cr_assert_str_eq(o.pos.items[0], "one");
    cr_assert_str_eq(o.pos.items[1], "--two");
    OPTS(p);
    cr_assert_eq(SCAN(p, "-", "-c", "x"), 0, "%s", why);
    cr_assert_str_eq(p.pos.items[0], "-", "a lone dash is an argument (stdin)");
    OPTS(q);
    cr_assert_eq(SCAN(q, "a", "b", "c", "-c", "x"), -1);
    cr_assert_str_eq(why, "unexpected argument 'c'");

    static const dp_args_t none = {.prog = "p", .usage = "p", .opts = table, .nopts = 1};
    OPTS(r);
    char *argv[] = {"p", "-c", "x", "extra", NULL};
    cr_assert_eq(dp_args_scan(&none, 4, argv, &r, why, sizeof(why)), -1);
    cr_assert_str_eq(why, "unexpected argument 'extra'");
}

Test(args, lists_fill_up_to_their_array)
{
    OPTS(o);
    cr_assert_eq(SCAN(o, "-c", "x", "-H", "a", "--header=b", "-Hc"), 0, "%s", why);
    cr_assert_eq(o.hdrs.n, 3);
    cr_assert_str_eq(o.hdrs.items[2], "c");
    OPTS(p);
    cr_assert_eq(SCAN(p, "-c", "x", "-H", "a", "-H", "b", "-H", "c", "-H", "d"), -1);
    cr_assert_str_eq(why, "-H given too many times");
}

Test(args, numbers_are_strict_and_in_range)
{
    OPTS(o);
    cr_assert_eq(SCAN(o, "-c", "x"), 0);
    cr_assert_eq(o.repeat, 8, "the default stays");
    cr_assert_eq(SCAN(o, "-c", "x", "--repeat", "10"), 0, "%s", why);
    cr_assert_eq(o.repeat, 10);
    const char *bad[] = {"1", "11", "abc", "-3", "3x", " 3", "99999999999999999999"};
    for (size_t i = 0; i < DP_ARRAY_SIZE(bad); i++) {
        OPTS(p);
        cr_assert_eq(SCAN(p, "-c", "x", "--repeat", (char *)bad[i]), -1, "%s", bad[i]);
        char want[128];
        snprintf(want, sizeof(want), "--repeat: expected an integer in [2, 10], got '%s'", bad[i]);
        cr_assert_str_eq(why, want);
    }
}

Test(args, callbacks_check_and_store)
{
    OPTS(o);
    cr_assert_eq(SCAN(o, "-c", "x", "--color", "blue"), 0, "%s", why);
    cr_assert_eq(o.color, 2);
    OPTS(p);
    cr_assert_eq(SCAN(p, "-c", "x", "--color=green"), -1);
    cr_assert_str_eq(why, "--color: expected red or blue, got 'green'");
}

Test(args, help_is_generated_from_the_table)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    dp_args_help(&spec, f);
    fclose(f);
    cr_assert_str_eq(text, "usage: detproxy thing -c FILE [options] [ARG ...]\n"
                           "                      [--more]\n"
                           "\n"
                           "Does a thing.\n"
                           "\n"
                           "options:\n"
                           "  -c, --config FILE  the config file\n"
                           "      --name NAME    a name\n"
                           "                     over two lines\n"
                           "      --maybe V      may be empty\n"
                           "      --json         one JSON object\n"
                           "  -v, --verbose      say more\n"
                           "      --repeat N     how many (2..10)\n"
                           "  -H, --header H     a header (repeatable)\n"
                           "      --color C      red or blue\n"
                           "      --a-very-long-option-name VALUE\n"
                           "                     its help goes on the next line\n"
                           "  -h, --help         show this help\n"
                           "\n"
                           "Exit codes: 0 ok, 2 usage error.\n");
    free(text);
}

Test(args, parse_prints_one_line_or_the_help)
{
    OPTS(o);
    fflush(stderr);
    char *argv[] = {"thing", "--bogus=secret", NULL};
    char *err = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&err, &len);
    FILE *saved = stderr;
    stderr = f;
    int r = dp_args_parse(&spec, 2, argv, &o);
    int code = dp_args_usage_error(&spec, "give %s", "--x");
    stderr = saved;
    fclose(f);
    cr_assert_eq(r, -1);
    cr_assert_eq(dp_args_exit(r), DP_EXIT_USAGE);
    cr_assert_eq(code, DP_EXIT_USAGE);
    cr_assert_str_eq(err, "detproxy thing: unknown option '--bogus' (try --help)\n"
                          "detproxy thing: give --x (try --help)\n");
    free(err);
    cr_assert_eq(dp_args_exit(1), DP_EXIT_OK);
}
