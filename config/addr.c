/* Listen addresses and upstream URLs. Strict on purpose: a listener takes a numeric address only
 * (no resolver at start, no surprise interface), and a URL is scheme://host[:port][/path] with no
 * user info, query or fragment, since credentials belong in api_key_file and the proxy appends
 * its own paths and queries. */
#include "config/cfg_internal.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/util.h"

/* Decimal port, 1-5 digits; 0 only when allow_zero. */
static int parse_port(const char *s, size_t n, bool allow_zero, uint16_t *out)
{
    uint64_t v;
    if (n > 5 || dp_parse_u64(s, n, &v) != 0 || v > 65535 || (v == 0 && !allow_zero))
        return -1;
    *out = (uint16_t)v;
    return 0;
}

static bool is_ipv4(const char *s)
{
    struct in_addr a;
    return inet_pton(AF_INET, s, &a) == 1;
}

static bool is_ipv6(const char *s)
{
    struct in6_addr a;
    return inet_pton(AF_INET6, s, &a) == 1;
}

/* Split "[v6]:port" or "host:port" (port optional) of length len. The host, without brackets,
 * is copied into host[hostcap]; *port is the port text or NULL when there is no ':'. */
static int split_hostport(const char *s, size_t len, char *host, size_t hostcap, bool *bracketed,
                          const char **port, const char **why)
{
    const char *end = s + len, *hs = s, *colon;
    size_t hlen;
    *bracketed = len > 0 && s[0] == '[';
    if (*bracketed) {
        const char *close = memchr(s, ']', len);
        if (close == NULL) {
            *why = "missing ']' after an IPv6 address";
            return -1;
        }
        hs = s + 1;
        hlen = (size_t)(close - hs);
        colon = close + 1 < end ? close + 1 : NULL;
        if (colon != NULL && *colon != ':') {
            *why = "expected ':' after ']'";
            return -1;
        }
    } else {
        colon = memchr(s, ':', len);
        if (colon != NULL && memchr(colon + 1, ':', (size_t)(end - colon - 1)) != NULL) {
            *why = "IPv6 addresses need brackets, as in [::1]:8080";
            return -1;
        }
        hlen = colon != NULL ? (size_t)(colon - s) : len;
    }
    if (hlen == 0) {
        *why = "missing host";
        return -1;
    }
    if (hlen >= hostcap) {
        *why = "host is too long";
        return -1;
    }
    memcpy(host, hs, hlen);
    host[hlen] = '\0';
    *port = colon != NULL ? colon + 1 : NULL;
    return 0;
}

int cfg_parse_addr(const char *s, cfg_addr_t *out, const char **why)
{
    *out = (cfg_addr_t){0};
    char host[64];
    bool bracketed;
    const char *port;
    if (split_hostport(s, strlen(s), host, sizeof(host), &bracketed, &port, why) != 0)
        return -1;
    if (port == NULL) {
        *why = "expected host:port, as in 127.0.0.1:8080";
        return -1;
    }
    if (bracketed ? !is_ipv6(host) : !is_ipv4(host)) {
        *why = bracketed ? "not a numeric IPv6 address"
                         : "host must be a numeric IP address (0.0.0.0 for every interface)";
        return -1;
    }
    if (parse_port(port, strlen(port), true, &out->port) != 0) {
        *why = "port must be between 0 and 65535";
        return -1;
    }
    out->host = dp_xstrdup(host);
    return 0;
}

/* RFC 3986 pchar plus '/': unreserved, sub-delims, ':', '@' and %XX. */
static bool valid_path(const char *p)
{
    static const char extra[] = "-._~!$&'()*+,;=:@/";
    for (; *p; p++) {
        char ch = *p;
        if ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
            strchr(extra, ch) != NULL)
            continue;
        if (ch == '%' && p[1] && p[2] && strchr("0123456789abcdefABCDEF", p[1]) &&
            strchr("0123456789abcdefABCDEF", p[2])) {
            p += 2;
            continue;
        }
        return false;
    }
    return true;
}

static int url_fail(cfg_url_t *u, const char **why, const char *reason)
{
    cfg_url_free(u);
    *why = reason;
    return -1;
}

_Static_assert(CFG_URL_PATH_MAX == 256, "the message below says 256");

int cfg_parse_url(const char *s, cfg_url_t *out, const char **why)
{
    *out = (cfg_url_t){0};
    const char *rest;
    if (strncasecmp(s, "http://", 7) == 0) {
        rest = s + 7;
    } else if (strncasecmp(s, "https://", 8) == 0) {
        out->tls = true;
        rest = s + 8;
    } else {
        return url_fail(out, why, "must start with http:// or https://");
    }
    if (strpbrk(rest, "?#") != NULL)
        return url_fail(out, why, "must not have a query string or fragment");
    size_t alen = strcspn(rest, "/");
    if (memchr(rest, '@', alen) != NULL)
        return url_fail(out, why, "must not carry user info (use api_key_file for credentials)");

    char host[256];
    bool bracketed;
    const char *port;
    if (split_hostport(rest, alen, host, sizeof(host), &bracketed, &port, why) != 0)
        return -1;
    /* All digits and dots is meant as IPv4: "10.0.0.256" must not pass as a host name. */
    bool dotted = strspn(host, "0123456789.") == strlen(host);
    bool ok_host = bracketed ? is_ipv6(host) : (dotted ? is_ipv4(host) : cfg_valid_hostname(host));
    if (!ok_host)
        return url_fail(out, why, bracketed ? "not a numeric IPv6 address" : "invalid host");
    out->port = out->tls ? 443 : 80;
    if (port != NULL && parse_port(port, (size_t)(rest + alen - port), false, &out->port) != 0)
        return url_fail(out, why, "port must be between 1 and 65535");

    const char *path = rest + alen;
    if (!valid_path(path))
        return url_fail(out, why, "path has characters that must be percent-encoded");
    size_t n = strlen(path);
    while (n > 0 && path[n - 1] == '/')
        n--;
    if (n > CFG_URL_PATH_MAX)
        return url_fail(out, why, "path longer than 256 bytes");
    out->host = dp_xstrdup(host);
    out->path = dp_xstrndup(path, n);
    char hp[300];
    snprintf(hp, sizeof(hp), bracketed ? "[%s]:%u" : "%s:%u", host, (unsigned)out->port);
    out->hostport = dp_xstrdup(hp);
    return 0;
}

void cfg_url_free(cfg_url_t *u)
{
    if (u == NULL)
        return;
    free(u->host);
    free(u->path);
    free(u->hostport);
    *u = (cfg_url_t){0};
}

/* The path as an engine's router, or a gateway's in front of several, reads it (RFC 3986
 * §6.2.2): %XX of an unreserved character decoded and other escapes in upper case, dot
 * segments removed, and empty ones dropped (nginx's merge_slashes); appended to out, "" for
 * the root. */
static void append_engine_path(dp_buf_t *out, const char *path)
{
    dp_buf_t dec = {0};
    for (const char *p = path; *p; p++) {
        int hi = p[0] == '%' ? dp_hexval((unsigned char)p[1]) : -1;
        int lo = hi >= 0 ? dp_hexval((unsigned char)p[2]) : -1;
        if (lo < 0) {
            dp_buf_appendc(&dec, *p);
            continue;
        }
        char c = (char)(hi << 4 | lo);
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
            c == '-' || c == '.' || c == '_' || c == '~')
            dp_buf_appendc(&dec, c);
        else
            dp_buf_printf(&dec, "%%%02X", (unsigned)(unsigned char)c);
        p += 2;
    }
    dp_iovec_t *seg = dp_xcalloc(dec.len + 1, sizeof(*seg));
    size_t nseg = 0;
    for (size_t i = 0; i < dec.len;) {
        const char *s = dec.base + i, *slash = memchr(s, '/', dec.len - i);
        size_t n = slash ? (size_t)(slash - s) : dec.len - i;
        if (n == 2 && s[0] == '.' && s[1] == '.')
            nseg -= nseg > 0;
        else if (n > 0 && !(n == 1 && s[0] == '.'))
            seg[nseg++] = (dp_iovec_t){s, n};
        i += n + 1;
    }
    for (size_t k = 0; k < nseg; k++) {
        dp_buf_appendc(out, '/');
        dp_buf_append(out, seg[k].base, seg[k].len);
    }
    free(seg);
    dp_buf_free(&dec);
}

void cfg_url_engine(const cfg_url_t *u, dp_buf_t *out)
{
    char host[256];
    size_t n = u->host ? strlen(u->host) : 0;
    if (n >= sizeof(host))
        n = sizeof(host) - 1;
    for (size_t i = 0; i < n; i++)
        host[i] = (char)(u->host[i] >= 'A' && u->host[i] <= 'Z' ? u->host[i] + 32 : u->host[i]);
    host[n] = '\0';
    struct in6_addr a6;
    struct in_addr a4;
    char v6[INET6_ADDRSTRLEN] = "";
    if (inet_pton(AF_INET6, host, &a6) == 1) {
        if (IN6_IS_ADDR_V4MAPPED(&a6))
            inet_ntop(AF_INET, &a6.s6_addr[12], host, sizeof(host));
        else if (IN6_IS_ADDR_LOOPBACK(&a6) || IN6_IS_ADDR_UNSPECIFIED(&a6))
            snprintf(host, sizeof(host), "127.0.0.1");
        else
            inet_ntop(AF_INET6, &a6, v6, sizeof(v6));
    } else if (inet_aton(host, &a4) != 0) {
        /* The resolver reads a name such as 0x7f000001 so (inet_aton's forms). */
        inet_ntop(AF_INET, &a4, host, sizeof(host));
    }
    /* A connection to the unspecified address reaches this host's loopback. */
    if (strcmp(host, "localhost") == 0 || strcmp(host, "0.0.0.0") == 0)
        snprintf(host, sizeof(host), "127.0.0.1");
    dp_buf_printf(out, v6[0] ? "%s://[%s]:%u" : "%s://%s:%u", u->tls ? "https" : "http",
                  v6[0] ? v6 : host, (unsigned)u->port);
    append_engine_path(out, u->path ? u->path : "");
}

bool cfg_addr_is_loopback(const char *host)
{
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) != 1)
        return false;
    if (IN6_IS_ADDR_LOOPBACK(&a6))
        return true;
    return IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127;
}

bool cfg_get_url(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required, cfg_url_t *out)
{
    char *s = NULL;
    if (!cfg_get_str(c, obj, key, required, &s))
        return false;
    cfg_url_t u;
    const char *why = NULL;
    bool ok = cfg_parse_url(s, &u, &why) == 0;
    if (ok) {
        cfg_url_free(out);
        *out = u;
    } else {
        cfg_err(c, key, "%s", why);
    }
    free(s);
    return ok;
}
