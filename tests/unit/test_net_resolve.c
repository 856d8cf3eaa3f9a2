/* net_resolve: numeric IPv4 and IPv6 without a lookup, a name through getaddrinfo (localhost,
 * from /etc/hosts), and a failure. */
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <string.h>

#include <uv.h>

#include "net/resolve.h"

Test(net_resolve, numeric_ipv4)
{
    struct sockaddr_storage ss;
    cr_assert(net_resolve("127.0.0.1", 8080, &ss));
    cr_assert_eq(ss.ss_family, AF_INET);
    const struct sockaddr_in *a = (const struct sockaddr_in *)&ss;
    cr_assert_eq(ntohs(a->sin_port), 8080);
    cr_assert_eq(ntohl(a->sin_addr.s_addr), 0x7f000001u);
}

Test(net_resolve, numeric_ipv6)
{
    struct sockaddr_storage ss;
    cr_assert(net_resolve("::1", 443, &ss));
    cr_assert_eq(ss.ss_family, AF_INET6);
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&ss;
    cr_assert_eq(ntohs(a->sin6_port), 443);
    cr_assert(memcmp(&a->sin6_addr, &in6addr_loopback, sizeof(in6addr_loopback)) == 0);
}

Test(net_resolve, name_is_looked_up)
{
    struct sockaddr_storage ss;
    cr_assert(net_resolve("localhost", 9000, &ss));
    char ip[64] = "";
    uint16_t port;
    if (ss.ss_family == AF_INET) {
        uv_ip4_name((const struct sockaddr_in *)&ss, ip, sizeof(ip));
        port = ntohs(((const struct sockaddr_in *)&ss)->sin_port);
    } else {
        cr_assert_eq(ss.ss_family, AF_INET6);
        uv_ip6_name((const struct sockaddr_in6 *)&ss, ip, sizeof(ip));
        port = ntohs(((const struct sockaddr_in6 *)&ss)->sin6_port);
    }
    cr_assert(strcmp(ip, "127.0.0.1") == 0 || strcmp(ip, "::1") == 0, "localhost is %s", ip);
    cr_assert_eq(port, 9000);
}

Test(net_resolve, unknown_name_and_malformed_address_fail)
{
    struct sockaddr_storage ss;
    cr_assert_not(net_resolve("nonexistent.invalid", 80, &ss));
    cr_assert_not(net_resolve("", 80, &ss));
    cr_assert_not(net_resolve("999.1.1.1", 80, &ss));
}
