/* Knowing ourselves (docs/requests.md, docs/security.md): detproxy must never be its own replica.
 *
 * - Every request detproxy sends upstream (client traffic, shadow copies, attestation, canary)
 *   carries a `Via` entry with this process's random token; a request that arrives carrying it
 *   has come round in a loop and is answered 508, never forwarded.
 * - An address that is one of this process's listeners is never admitted as a replica, so the
 *   loop is not even tried when a replica URL or a discovered address names detproxy itself. */
#ifndef PX_SELF_H
#define PX_SELF_H

#include <stdbool.h>
#include <stddef.h>

#include <uv.h>

#include "proxy/core/px.h"

/* The header line to add to an upstream request: "via: 1.1 detproxy-<16 hex>\r\n" (NUL-
 * terminated; len may be NULL). */
const char *px_self_via_line(size_t *len);
/* Does any Via header of req carry this process's token? */
bool px_self_via_seen(const net_req_t *req);
/* Is sa (an upstream address) one of px's listeners? *what names which ("proxy", "admin"). A
 * wildcard listener (0.0.0.0, ::) is reached through every local address, loopback included. */
bool px_self_is_listener(const px_t *px, const struct sockaddr *sa, const char **what);

#endif
