#include "net/resolve.h"

#include <netdb.h>
#include <stdio.h>
#include <string.h>

#include <uv.h>

bool net_resolve(const char *host, uint16_t port, struct sockaddr_storage *out)
{
    memset(out, 0, sizeof(*out));
    if (uv_ip4_addr(host, port, (struct sockaddr_in *)out) == 0 ||
        uv_ip6_addr(host, port, (struct sockaddr_in6 *)out) == 0)
        return true;
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_socktype = SOCK_STREAM;
    char ports[8];
    snprintf(ports, sizeof(ports), "%u", port);
    if (getaddrinfo(host, ports, &hints, &res) != 0 || res == NULL)
        return false;
    memcpy(out, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return true;
}
