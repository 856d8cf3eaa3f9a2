/* Request-path normalisation, as nginx does it before routing (docs/requests.md §1, "Routes"):
 * what detproxy classifies must be what an ASGI replica (vLLM, SGLang), which percent-decodes
 * before routing, will serve. Pure: no libuv, fuzzed on its own. */
#ifndef NET_PATH_H
#define NET_PATH_H

#include <stddef.h>

/* Normalise the path p[0..n) in place (the result is never longer): decode percent-encoded
 * unreserved characters (ALPHA DIGIT - . _ ~), upper-case the hex of the escapes that stay,
 * merge runs of '/', resolve "." and ".." segments (a trailing "." or ".." leaves a trailing
 * '/'). p starts with '/'. Returns the new length, or 0 with *reason set for an encoded '/'
 * (%2F), a malformed escape, a '#', or a ".." above the root: the request is a 400. */
size_t net_path_normalize(char *p, size_t n, const char **reason);

#endif
