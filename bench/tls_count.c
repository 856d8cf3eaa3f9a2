/* LD_PRELOAD shim for wrk in bench scenario 7 (TLS): counts the client handshakes that
 * completed and how many of them resumed a session, and can force every handshake to be a
 * full one.
 *
 * wrk reuses one SSL object per connection slot: on reconnect it calls SSL_shutdown and
 * SSL_clear, and SSL_clear keeps the last session, so the next SSL_connect offers it (TLS 1.3
 * ticket / TLS 1.2 session id) and a server that accepts it skips the certificate and
 * signature. With BENCH_TLS_FULL=1 the shim drops that session right after SSL_clear, so each
 * new connection does a full handshake. At exit it prints one line to stdout:
 *   TLSJSON {"handshakes":N,"resumed":M,"protocol":"TLSv1.3","cipher":"..."}
 * (protocol and cipher of the last completed handshake).
 *
 * Build: cc -O2 -shared -fPIC bench/tls_count.c -o tls_count.so -ldl -lssl (bench/lib.sh). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <openssl/ssl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static atomic_ulong g_handshakes, g_resumed;
static char g_proto[32], g_cipher[64];
static int g_full = -1;

static int (*real_connect)(SSL *);
static int (*real_clear)(SSL *);

int SSL_connect(SSL *s)
{
    if (real_connect == NULL)
        real_connect = (int (*)(SSL *))dlsym(RTLD_NEXT, "SSL_connect");
    int r = real_connect(s);
    if (r == 1) {
        atomic_fetch_add(&g_handshakes, 1);
        if (SSL_session_reused(s))
            atomic_fetch_add(&g_resumed, 1);
        const char *p = SSL_get_version(s), *c = SSL_get_cipher_name(s);
        snprintf(g_proto, sizeof(g_proto), "%s", p ? p : "?");
        snprintf(g_cipher, sizeof(g_cipher), "%s", c ? c : "?");
    }
    return r;
}

int SSL_clear(SSL *s)
{
    if (real_clear == NULL)
        real_clear = (int (*)(SSL *))dlsym(RTLD_NEXT, "SSL_clear");
    if (g_full < 0) {
        const char *e = getenv("BENCH_TLS_FULL");
        g_full = e && strcmp(e, "1") == 0;
    }
    int r = real_clear(s);
    if (g_full)
        SSL_set_session(s, NULL); /* nothing to offer: the next handshake is a full one */
    return r;
}

__attribute__((destructor)) static void report(void)
{
    if (atomic_load(&g_handshakes) == 0 && g_proto[0] == 0)
        return; /* not wrk's https run (taskset, env, ...) */
    dprintf(1, "TLSJSON {\"handshakes\":%lu,\"resumed\":%lu,\"protocol\":\"%s\",\"cipher\":\"%s\"}\n",
            atomic_load(&g_handshakes), atomic_load(&g_resumed), g_proto, g_cipher);
}
