/* TLS for net_sock_t (what it offers and checks: docs/security.md §3, "TLS"), with OpenSSL over
 * memory BIOs: the socket layer hands received ciphertext in and gets plaintext out, and encrypts
 * writes into bytes it sends with its ordinary write path. There is one code path for plaintext
 * and TLS above net_sock_t.
 *
 * Contexts are refcounted: a reload (SIGHUP) swaps in a new server context for new
 * connections while existing ones keep theirs. */
#ifndef NET_TLS_H
#define NET_TLS_H

#include <stdbool.h>
#include <stddef.h>

#include "common/buf.h"

typedef struct net_tls_ctx_s net_tls_ctx_t;
typedef struct net_tls_s net_tls_t;

/* Server context: certificate chain + key (PEM), TLS 1.2+, ALPN http/1.1, no renegotiation.
 * client_ca (may be NULL): require client certificates signed by it (mTLS). NULL + *err. */
net_tls_ctx_t *net_tls_server_ctx(const char *cert_file, const char *key_file,
                                  const char *client_ca_file, dp_buf_t *err);
/* Client context: verify servers against ca_file (NULL: the system store); optional client
 * certificate for mTLS. Session resumption is on (see net_tls_new_client). */
net_tls_ctx_t *net_tls_client_ctx(const char *ca_file, const char *cert_file, const char *key_file,
                                  dp_buf_t *err);
/* Make c use from's settings (certificates, CA, key) for connections made from now on, and
 * forget c's cached sessions (they were verified under the old settings). Connections already
 * open keep theirs. from keeps its own reference: unref it as usual. For a reload that must
 * reach every holder of c (each upstream of a replica) without finding them. */
void net_tls_ctx_replace(net_tls_ctx_t *c, net_tls_ctx_t *from);
void net_tls_ctx_ref(net_tls_ctx_t *c);
void net_tls_ctx_unref(net_tls_ctx_t *c);

/* Per connection. server_name (client side): the name sent as SNI (when it is not an IP
 * literal) and checked against the certificate (host name or IP address). */
net_tls_t *net_tls_new_server(net_tls_ctx_t *c);
net_tls_t *net_tls_new_client(net_tls_ctx_t *c, const char *server_name);
void net_tls_free(net_tls_t *t);

/* Results of feeding and writing. */
enum {
    NET_TLS_OK = 0,     /* progress; check net_tls_pending_out() */
    NET_TLS_CLOSED = 1, /* the peer sent close_notify */
    NET_TLS_ERROR = -1, /* fatal: see net_tls_error() */
};

/* Ciphertext received from the network. Decrypted application bytes are appended to plain
 * (possibly none, e.g. during the handshake). */
int net_tls_feed(net_tls_t *t, const char *p, size_t n, dp_buf_t *plain);
/* Start (client) or continue the handshake with no new input. */
int net_tls_handshake(net_tls_t *t);
bool net_tls_handshake_done(const net_tls_t *t);
/* Encrypt application bytes (only once the handshake is done). */
int net_tls_write(net_tls_t *t, const char *p, size_t n);
/* Ciphertext waiting to be sent: take it with net_tls_take_out (appends to out, clears). */
size_t net_tls_pending_out(const net_tls_t *t);
void net_tls_take_out(net_tls_t *t, dp_buf_t *out);
/* Queue a close_notify alert. */
void net_tls_shutdown(net_tls_t *t);
/* Why the last call failed ("certificate verify failed: hostname mismatch", ...). */
const char *net_tls_error(const net_tls_t *t);
/* The negotiated ALPN protocol ("" when none) and whether the session was resumed. */
const char *net_tls_alpn(const net_tls_t *t);
bool net_tls_resumed(const net_tls_t *t);
/* Whether the peer sent close_notify. A TCP close without it may be a truncation attack
 * (RFC 8446 §6.1): a body delimited only by the close is then incomplete. */
bool net_tls_peer_closed(const net_tls_t *t);

#endif
