#include "net/tls.h"

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <arpa/inet.h>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "common/util.h"

#define MAX_SESSIONS 64 /* client sessions kept for resumption, one per server name */

typedef struct sess_s {
    char *name;
    SSL_SESSION *s;
    struct sess_s *next;
} sess_t;

struct net_tls_ctx_s {
    atomic_int refs; /* a server context is shared by every worker's listener */
    SSL_CTX *ctx;
    bool server;
    sess_t *sessions;
    size_t nsessions;
};

struct net_tls_s {
    SSL *ssl;
    net_tls_ctx_t *ctx;
    bool server;
    bool done;
    bool failed; /* a fatal error: OpenSSL has already made the session unresumable */
    char *name;
    char err[256];
};

static int g_ex_index = -1;
static pthread_once_t g_ex_once = PTHREAD_ONCE_INIT; /* contexts are made on several threads */

static void ex_index_init(void)
{
    g_ex_index = SSL_get_ex_new_index(0, NULL, NULL, NULL, NULL);
}

static void openssl_error(dp_buf_t *err, const char *what)
{
    unsigned long e = ERR_get_error();
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    dp_buf_printf(err, "%s: %s", what, e ? buf : "unknown error");
    ERR_clear_error();
}

static net_tls_ctx_t *ctx_new(bool server, dp_buf_t *err)
{
    SSL_CTX *c = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    if (c == NULL) {
        openssl_error(err, "SSL_CTX_new");
        return NULL;
    }
    SSL_CTX_set_min_proto_version(c, TLS1_2_VERSION);
    /* Renegotiation is a DoS lever and never needed for HTTP/1.1 here. */
    SSL_CTX_set_options(c, SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_COMPRESSION |
                               SSL_OP_CIPHER_SERVER_PREFERENCE);
    SSL_CTX_set_mode(c, SSL_MODE_RELEASE_BUFFERS);
    net_tls_ctx_t *t = dp_xcalloc(1, sizeof(*t));
    t->refs = 1;
    t->ctx = c;
    t->server = server;
    pthread_once(&g_ex_once, ex_index_init);
    return t;
}

/* ALPN: HTTP/1.1 is all we speak. A client that offers ALPN without it gets a fatal alert
 * rather than a connection it cannot use. */
static int alpn_select(SSL *ssl, const unsigned char **out, unsigned char *outlen,
                       const unsigned char *in, unsigned int inlen, void *arg)
{
    (void)ssl;
    (void)arg;
    for (unsigned i = 0; i < inlen;) {
        unsigned l = in[i];
        if (i + 1 + l > inlen)
            break;
        if (l == 8 && memcmp(in + i + 1, "http/1.1", 8) == 0) {
            *out = in + i + 1;
            *outlen = 8;
            return SSL_TLSEXT_ERR_OK;
        }
        i += 1 + l;
    }
    return SSL_TLSEXT_ERR_ALERT_FATAL;
}

net_tls_ctx_t *net_tls_server_ctx(const char *cert_file, const char *key_file,
                                  const char *client_ca_file, dp_buf_t *err)
{
    net_tls_ctx_t *t = ctx_new(true, err);
    if (t == NULL)
        return NULL;
    SSL_CTX *c = t->ctx;
    if (SSL_CTX_use_certificate_chain_file(c, cert_file) != 1) {
        openssl_error(err, cert_file);
        goto fail;
    }
    if (SSL_CTX_use_PrivateKey_file(c, key_file, SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(c) != 1) {
        openssl_error(err, "private key");
        goto fail;
    }
    if (client_ca_file) {
        STACK_OF(X509_NAME) *names = SSL_load_client_CA_file(client_ca_file);
        if (names == NULL || SSL_CTX_load_verify_locations(c, client_ca_file, NULL) != 1) {
            sk_X509_NAME_pop_free(names, X509_NAME_free);
            openssl_error(err, client_ca_file);
            goto fail;
        }
        SSL_CTX_set_client_CA_list(c, names);
        SSL_CTX_set_verify(c, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    }
    SSL_CTX_set_alpn_select_cb(c, alpn_select, NULL);
    SSL_CTX_set_session_cache_mode(c, SSL_SESS_CACHE_SERVER);
    static const unsigned char sid[] = "detproxy";
    SSL_CTX_set_session_id_context(c, sid, sizeof(sid) - 1);
    return t;
fail:
    net_tls_ctx_unref(t);
    return NULL;
}

/* TLS 1.3 tickets arrive after the handshake: keep the newest session per server name. */
static int new_session_cb(SSL *ssl, SSL_SESSION *sess)
{
    net_tls_t *t = SSL_get_ex_data(ssl, g_ex_index);
    if (t == NULL || t->name == NULL)
        return 0;
    net_tls_ctx_t *c = t->ctx;
    /* A connection made under trust settings since replaced (net_tls_ctx_replace): resuming
     * its session later would skip verification against the new ones. */
    if (SSL_get_SSL_CTX(ssl) != c->ctx)
        return 0;
    for (sess_t *s = c->sessions; s; s = s->next) {
        if (strcmp(s->name, t->name) == 0) {
            SSL_SESSION_free(s->s);
            s->s = sess;
            return 1;
        }
    }
    if (c->nsessions >= MAX_SESSIONS)
        return 0;
    sess_t *s = dp_xcalloc(1, sizeof(*s));
    s->name = dp_xstrdup(t->name);
    s->s = sess;
    s->next = c->sessions;
    c->sessions = s;
    c->nsessions++;
    return 1; /* we keep the reference */
}

net_tls_ctx_t *net_tls_client_ctx(const char *ca_file, const char *cert_file, const char *key_file,
                                  dp_buf_t *err)
{
    net_tls_ctx_t *t = ctx_new(false, err);
    if (t == NULL)
        return NULL;
    SSL_CTX *c = t->ctx;
    int ok = ca_file ? SSL_CTX_load_verify_locations(c, ca_file, NULL)
                     : SSL_CTX_set_default_verify_paths(c);
    if (ok != 1) {
        openssl_error(err, ca_file ? ca_file : "system trust store");
        goto fail;
    }
    /* Always verify: there is deliberately no switch to turn this off. */
    SSL_CTX_set_verify(c, SSL_VERIFY_PEER, NULL);
    if (cert_file) {
        if (SSL_CTX_use_certificate_chain_file(c, cert_file) != 1 ||
            SSL_CTX_use_PrivateKey_file(c, key_file, SSL_FILETYPE_PEM) != 1 ||
            SSL_CTX_check_private_key(c) != 1) {
            openssl_error(err, "client certificate");
            goto fail;
        }
    }
    static const unsigned char alpn[] = "\x08http/1.1";
    SSL_CTX_set_alpn_protos(c, alpn, sizeof(alpn) - 1);
    SSL_CTX_set_session_cache_mode(c, SSL_SESS_CACHE_CLIENT | SSL_SESS_CACHE_NO_INTERNAL_STORE);
    SSL_CTX_sess_set_new_cb(c, new_session_cb);
    return t;
fail:
    net_tls_ctx_unref(t);
    return NULL;
}

static void sessions_free(net_tls_ctx_t *c)
{
    while (c->sessions) {
        sess_t *s = c->sessions;
        c->sessions = s->next;
        SSL_SESSION_free(s->s);
        free(s->name);
        free(s);
    }
    c->nsessions = 0;
}

void net_tls_ctx_replace(net_tls_ctx_t *c, net_tls_ctx_t *from)
{
    SSL_CTX_up_ref(from->ctx);
    SSL_CTX_free(c->ctx); /* live connections hold their own reference */
    c->ctx = from->ctx;
    c->server = from->server;
    sessions_free(c);
}

void net_tls_ctx_ref(net_tls_ctx_t *c)
{
    assert(atomic_load(&c->refs) > 0); /* a reference is taken from a live holder */
    c->refs++;
}

void net_tls_ctx_unref(net_tls_ctx_t *c)
{
    if (c == NULL)
        return;
    int refs = atomic_fetch_sub(&c->refs, 1);
    assert(refs > 0);
    if (refs > 1)
        return;
    sessions_free(c);
    SSL_CTX_free(c->ctx);
    free(c);
}

static net_tls_t *tls_new(net_tls_ctx_t *c, bool server)
{
    SSL *ssl = SSL_new(c->ctx);
    BIO *rb = BIO_new(BIO_s_mem()), *wb = BIO_new(BIO_s_mem());
    if (ssl == NULL || rb == NULL || wb == NULL) {
        SSL_free(ssl);
        BIO_free(rb);
        BIO_free(wb);
        return NULL;
    }
    /* An empty memory BIO reports "retry", not EOF: that is what makes it a pipe. */
    BIO_set_mem_eof_return(rb, -1);
    SSL_set_bio(ssl, rb, wb);
    net_tls_t *t = dp_xcalloc(1, sizeof(*t));
    t->ssl = ssl;
    t->ctx = c;
    t->server = server;
    net_tls_ctx_ref(c);
    SSL_set_ex_data(ssl, g_ex_index, t);
    if (server)
        SSL_set_accept_state(ssl);
    else
        SSL_set_connect_state(ssl);
    return t;
}

net_tls_t *net_tls_new_server(net_tls_ctx_t *c)
{
    return tls_new(c, true);
}

static bool is_ip_literal(const char *s)
{
    unsigned char buf[16];
    return inet_pton(AF_INET, s, buf) == 1 || inet_pton(AF_INET6, s, buf) == 1;
}

net_tls_t *net_tls_new_client(net_tls_ctx_t *c, const char *server_name)
{
    net_tls_t *t = tls_new(c, false);
    if (t == NULL)
        return NULL;
    if (server_name && server_name[0]) {
        t->name = dp_xstrdup(server_name);
        X509_VERIFY_PARAM *vp = SSL_get0_param(t->ssl);
        if (is_ip_literal(server_name)) {
            X509_VERIFY_PARAM_set1_ip_asc(vp, server_name);
        } else {
            SSL_set_tlsext_host_name(t->ssl, server_name);
            /* "*" matches one whole left-most label only: OpenSSL by default also lets
             * "r*.llm" match, which RFC 9525 §6.3 forbids. */
            SSL_set_hostflags(t->ssl, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
            SSL_set1_host(t->ssl, server_name);
        }
        for (sess_t *s = c->sessions; s; s = s->next)
            if (strcmp(s->name, server_name) == 0)
                SSL_set_session(t->ssl, s->s);
    }
    return t;
}

void net_tls_free(net_tls_t *t)
{
    if (t == NULL)
        return;
    /* HTTP closes connections without close_notify all the time (a pooled connection timing
     * out, a replica closing after its answer), and RFC 5246 §7.2.1 lets such a session be
     * resumed. Without this, SSL_free takes any connection it did not see shut down for a bad
     * one and marks its session not resumable (ssl_clear_bad_session), so no connection ever
     * resumed. Fatal errors and alerts have already removed the session inside OpenSSL. */
    if (t->done && !t->failed)
        SSL_set_shutdown(t->ssl, SSL_SENT_SHUTDOWN | SSL_RECEIVED_SHUTDOWN);
    SSL_free(t->ssl);
    net_tls_ctx_unref(t->ctx);
    free(t->name);
    free(t);
}

static int fail(net_tls_t *t, const char *what, int ssl_err)
{
    t->failed = true;
    unsigned long e = ERR_get_error();
    long vr = SSL_get_verify_result(t->ssl);
    if (vr != X509_V_OK) {
        snprintf(t->err, sizeof(t->err), "%s: certificate verify failed: %s", what,
                 X509_verify_cert_error_string(vr));
    } else if (e) {
        char buf[200];
        ERR_error_string_n(e, buf, sizeof(buf));
        snprintf(t->err, sizeof(t->err), "%s: %s", what, buf);
    } else {
        snprintf(t->err, sizeof(t->err), "%s: TLS error %d", what, ssl_err);
    }
    ERR_clear_error();
    return NET_TLS_ERROR;
}

int net_tls_handshake(net_tls_t *t)
{
    if (t->done)
        return NET_TLS_OK;
    /* SSL_get_error reads the thread's error queue: a stale entry left by any other OpenSSL
     * user on this thread would turn "want more input" into a fatal error. */
    ERR_clear_error();
    int r = SSL_do_handshake(t->ssl);
    if (r == 1) {
        t->done = true;
        return NET_TLS_OK;
    }
    int e = SSL_get_error(t->ssl, r);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE)
        return NET_TLS_OK;
    return fail(t, "handshake", e);
}

bool net_tls_handshake_done(const net_tls_t *t)
{
    return t->done;
}

int net_tls_feed(net_tls_t *t, const char *p, size_t n, dp_buf_t *plain)
{
    if (n && BIO_write(SSL_get_rbio(t->ssl), p, (int)n) != (int)n)
        return fail(t, "input", 0);
    if (!t->done) {
        int r = net_tls_handshake(t);
        if (r != NET_TLS_OK || !t->done)
            return r;
    }
    ERR_clear_error(); /* see net_tls_handshake */
    for (;;) {
        dp_buf_reserve(plain, 16384);
        int r = SSL_read(t->ssl, plain->base + plain->len, 16384);
        if (r > 0) {
            plain->len += (size_t)r;
            plain->base[plain->len] = '\0';
            continue;
        }
        int e = SSL_get_error(t->ssl, r);
        if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE)
            return NET_TLS_OK;
        if (e == SSL_ERROR_ZERO_RETURN)
            return NET_TLS_CLOSED;
        return fail(t, "read", e);
    }
}

int net_tls_write(net_tls_t *t, const char *p, size_t n)
{
    assert(t->done);
    ERR_clear_error(); /* see net_tls_handshake */
    while (n > 0) {
        int r = SSL_write(t->ssl, p, n > 1 << 30 ? 1 << 30 : (int)n);
        if (r <= 0)
            return fail(t, "write", SSL_get_error(t->ssl, r));
        p += r;
        n -= (size_t)r;
    }
    return NET_TLS_OK;
}

size_t net_tls_pending_out(const net_tls_t *t)
{
    return BIO_ctrl_pending(SSL_get_wbio(t->ssl));
}

void net_tls_take_out(net_tls_t *t, dp_buf_t *out)
{
    BIO *wb = SSL_get_wbio(t->ssl);
    size_t n = BIO_ctrl_pending(wb);
    if (n == 0)
        return;
    dp_buf_reserve(out, n);
    int r = BIO_read(wb, out->base + out->len, (int)n);
    if (r > 0) {
        out->len += (size_t)r;
        out->base[out->len] = '\0';
    }
}

void net_tls_shutdown(net_tls_t *t)
{
    if (t->done)
        SSL_shutdown(t->ssl);
    ERR_clear_error(); /* a failed close_notify is not worth an error, nor a stale queue entry */
}

const char *net_tls_error(const net_tls_t *t)
{
    return t->err[0] ? t->err : "TLS error";
}

const char *net_tls_alpn(const net_tls_t *t)
{
    static _Thread_local char buf[32]; /* per loop thread */
    const unsigned char *p = NULL;
    unsigned n = 0;
    SSL_get0_alpn_selected(t->ssl, &p, &n);
    if (n >= sizeof(buf))
        n = sizeof(buf) - 1;
    memcpy(buf, p ? (const char *)p : "", n);
    buf[n] = '\0';
    return buf;
}

bool net_tls_peer_closed(const net_tls_t *t)
{
    return (SSL_get_shutdown(t->ssl) & SSL_RECEIVED_SHUTDOWN) != 0;
}

bool net_tls_resumed(const net_tls_t *t)
{
    return SSL_session_reused(t->ssl) == 1;
}
