/* Loop detection and self-admission (see self.h). */
#define _GNU_SOURCE /* memmem */
#include "proxy/core/self.h"

#include <netinet/in.h>
#include <string.h>

#include "common/util.h"

#define VIA_NAME "via: 1.1 "
#define TOKEN_PREFIX "detproxy-"
#define TOKEN_HEX 16

static char g_line[sizeof(VIA_NAME) + sizeof(TOKEN_PREFIX) + TOKEN_HEX + 2];
static size_t g_line_len;

/* The token is drawn once per process: two detproxy instances in a chain see each other's
 * entries as foreign, and only the instance itself can recognise its own. */
static void init_token(void)
{
    if (g_line_len)
        return;
    uint8_t raw[TOKEN_HEX / 2];
    char hex[TOKEN_HEX + 1];
    dp_random_bytes(raw, sizeof(raw));
    dp_hex(raw, sizeof(raw), hex);
    g_line_len = (size_t)snprintf(g_line, sizeof(g_line), VIA_NAME TOKEN_PREFIX "%s\r\n", hex);
}

const char *px_self_via_line(size_t *len)
{
    init_token();
    if (len)
        *len = g_line_len;
    return g_line;
}

bool px_self_via_seen(const net_req_t *req)
{
    init_token();
    const char *tok = g_line + sizeof(VIA_NAME) - 1;
    size_t tl = sizeof(TOKEN_PREFIX) - 1 + TOKEN_HEX;
    for (size_t i = 0; i < req->nheaders; i++) {
        const net_header_t *h = &req->headers[i];
        if (!dp_strieq(h->name.base, h->name.len, "via") || h->value.len < tl)
            continue;
        if (memmem(h->value.base, h->value.len, tok, tl) != NULL)
            return true;
    }
    return false;
}

static bool is_loopback(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(a) || (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127);
}

static bool is_wildcard(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET)
        return ((const struct sockaddr_in *)sa)->sin_addr.s_addr == htonl(INADDR_ANY);
    return IN6_IS_ADDR_UNSPECIFIED(&((const struct sockaddr_in6 *)sa)->sin6_addr);
}

static uint16_t port_of(const struct sockaddr *sa)
{
    return ntohs(sa->sa_family == AF_INET6 ? ((const struct sockaddr_in6 *)sa)->sin6_port
                                           : ((const struct sockaddr_in *)sa)->sin_port);
}

/* Same IP (v4, v6, or v4 against a v4-mapped v6), ports ignored. */
static bool same_ip(const struct sockaddr *a, const struct sockaddr *b)
{
    uint8_t x[16], y[16];
    const struct sockaddr *in[2] = {a, b};
    uint8_t *out[2] = {x, y};
    for (int i = 0; i < 2; i++) {
        if (in[i]->sa_family == AF_INET) {
            memset(out[i], 0, 10);
            out[i][10] = out[i][11] = 0xff;
            memcpy(out[i] + 12, &((const struct sockaddr_in *)in[i])->sin_addr, 4);
        } else if (in[i]->sa_family == AF_INET6) {
            memcpy(out[i], &((const struct sockaddr_in6 *)in[i])->sin6_addr, 16);
        } else {
            return false;
        }
    }
    return memcmp(x, y, 16) == 0;
}

/* Is sa one of this host's addresses? Loopback always; others from the interface list (a
 * syscall per call: only attestation asks, once per check). */
static bool is_local(const struct sockaddr *sa)
{
    if (is_loopback(sa))
        return true;
    uv_interface_address_t *ifs = NULL;
    int n = 0;
    if (uv_interface_addresses(&ifs, &n) != 0)
        return false;
    bool found = false;
    for (int i = 0; i < n && !found; i++)
        found = same_ip(sa, (const struct sockaddr *)&ifs[i].address);
    uv_free_interface_addresses(ifs, n);
    return found;
}

bool px_self_is_listener(const px_t *px, const struct sockaddr *sa, const char **what)
{
    if (sa == NULL || (sa->sa_family != AF_INET && sa->sa_family != AF_INET6))
        return false;
    /* Connecting to the unspecified address reaches this host's loopback (0.0.0.0 is
     * 127.0.0.1, :: is ::1): judge it as that. */
    struct sockaddr_storage lo;
    if (is_wildcard(sa)) {
        memcpy(&lo, sa,
               sa->sa_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6));
        if (sa->sa_family == AF_INET)
            ((struct sockaddr_in *)&lo)->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        else
            ((struct sockaddr_in6 *)&lo)->sin6_addr = in6addr_loopback;
        sa = (const struct sockaddr *)&lo;
    }
    static const char *const names[2] = {"proxy", "admin"};
    for (int i = 0; i < 2; i++) {
        const struct sockaddr *l =
            i == 0
                ? (px->listen_bound.ss_family ? (const struct sockaddr *)&px->listen_bound : NULL)
            : px->admin ? net_server_bound(px->admin)
                        : NULL;
        if (l == NULL || port_of(l) != port_of(sa))
            continue;
        /* An IPv4 wildcard takes only IPv4 (and v4-mapped) peers; a v6 one, with the usual
         * dual-stack default, both. */
        bool v4ish = sa->sa_family == AF_INET ||
                     IN6_IS_ADDR_V4MAPPED(&((const struct sockaddr_in6 *)sa)->sin6_addr);
        bool hit =
            is_wildcard(l) ? (l->sa_family == AF_INET6 || v4ish) && is_local(sa) : same_ip(l, sa);
        if (hit) {
            if (what)
                *what = names[i];
            return true;
        }
    }
    return false;
}
