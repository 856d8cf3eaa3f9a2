/* Host resolution for upstream addresses.
 *
 * Numeric hosts never block; names use getaddrinfo once, at start or reload (the loop is not
 * yet serving, or the cost is a one-off) or in the one-shot diagnose command; DNS discovery
 * resolves off the loop and passes numeric addresses. */
#ifndef NET_RESOLVE_H
#define NET_RESOLVE_H

#include <stdbool.h>
#include <stdint.h>

#include <sys/socket.h>

/* host (numeric, or a name looked up with getaddrinfo: blocking) and port into out. */
bool net_resolve(const char *host, uint16_t port, struct sockaddr_storage *out);

#endif
