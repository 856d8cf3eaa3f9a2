/* net/hdrs: header names and values gathered from llhttp's pieces, and the value spans the
 * server and the client work with (RFC 9110 §5.5: a field value has no surrounding
 * whitespace). */
#include <criterion/criterion.h>
#include <string.h>

#include "net/hdrs.h"

static net_hdrs_t g_h;

static void fini(void)
{
    net_hdrs_free(&g_h);
}

TestSuite(net_hdrs, .fini = fini);

static void name(const char *s)
{
    net_hdrs_field(&g_h, s, strlen(s));
}

static void value(const char *s)
{
    net_hdrs_value(&g_h, s, strlen(s));
}

static void expect(const net_header_t *h, const char *n, const char *v)
{
    cr_assert_eq(h->name.len, strlen(n), "%.*s", (int)h->name.len, h->name.base);
    cr_assert(memcmp(h->name.base, n, h->name.len) == 0);
    cr_assert_eq(h->value.len, strlen(v), "[%.*s] for [%s]", (int)h->value.len, h->value.base, v);
    cr_assert(memcmp(h->value.base, v, h->value.len) == 0);
}

Test(net_hdrs, pieces_join_into_one_header)
{
    name("Conte");
    name("nt-Type");
    value("applica");
    value("tion/json");
    name("X-A");
    value("1");
    const net_header_t *h = net_hdrs_spans(&g_h);
    cr_assert_eq(g_h.n, 2);
    expect(&h[0], "Content-Type", "application/json");
    expect(&h[1], "X-A", "1");
}

/* llhttp drops the whitespace before a value but hands over the whitespace after it: that is
 * not part of the value, so it is neither forwarded nor compared. */
Test(net_hdrs, trailing_whitespace_is_not_part_of_the_value)
{
    name("X-Tenant");
    value("acme \t ");
    name("X-Split");
    value("a b ");
    value("\t");
    name("X-Blank");
    value(" \t");
    name("X-Inner");
    value("a \t b");
    const net_header_t *h = net_hdrs_spans(&g_h);
    expect(&h[0], "X-Tenant", "acme");
    expect(&h[1], "X-Split", "a b");
    expect(&h[2], "X-Blank", "");
    expect(&h[3], "X-Inner", "a \t b");
}

Test(net_hdrs, reset_keeps_nothing_of_the_last_head)
{
    name("A");
    value("1 ");
    net_hdrs_spans(&g_h);
    net_hdrs_reset(&g_h);
    name("B");
    value("2");
    const net_header_t *h = net_hdrs_spans(&g_h);
    cr_assert_eq(g_h.n, 1);
    expect(&h[0], "B", "2");
}
