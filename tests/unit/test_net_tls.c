/* TLS in net/: a throwaway self-signed certificate made here with OpenSSL (P-256, SAN
 * DNS:localhost and IP:127.0.0.1, valid one hour around now), then the real server and client
 * over loopback (verification by name and by IP, failures and their reasons, keep-alive over
 * TLS, close_notify), and net_tls on its own over memory (ALPN, session resumption). */
#define _GNU_SOURCE /* memmem, mkdtemp */
#include "net_harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <openssl/ec.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509v3.h>

#include "net/client.h"
#include "net/fetch.h"
#include "net/server.h"
#include "net/tls.h"

static char g_dir[64], g_crt[128], g_key[128], g_other_crt[128], g_other_key[128];
static net_server_t *g_srv;
static bool g_srv_closed;
static net_tls_ctx_t *g_sctx;
static net_upstream_t *g_up;

static void write_cert(const char *cn, const char *san, const char *crt, const char *key)
{
    EVP_PKEY *pk = EVP_EC_gen("P-256");
    cr_assert_not_null(pk);
    X509 *x = X509_new();
    X509_set_version(x, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(x), 1);
    X509_gmtime_adj(X509_getm_notBefore(x), -3600);
    X509_gmtime_adj(X509_getm_notAfter(x), 3600);
    X509_set_pubkey(x, pk);
    X509_NAME *n = X509_get_subject_name(x);
    X509_NAME_add_entry_by_txt(n, "CN", MBSTRING_ASC, (const unsigned char *)cn, -1, -1, 0);
    X509_set_issuer_name(x, n);
    X509V3_CTX v3;
    X509V3_set_ctx_nodb(&v3);
    X509V3_set_ctx(&v3, x, x, NULL, NULL, 0);
    const char *exts[][2] = {{"subjectAltName", san},
                             {"basicConstraints", "critical,CA:TRUE"},
                             {"keyUsage", "critical,digitalSignature,keyCertSign"}};
    for (size_t i = 0; i < 3; i++) {
        X509_EXTENSION *e = X509V3_EXT_nconf(NULL, &v3, exts[i][0], exts[i][1]);
        cr_assert_not_null(e);
        X509_add_ext(x, e, -1);
        X509_EXTENSION_free(e);
    }
    cr_assert(X509_sign(x, pk, EVP_sha256()) > 0);
    FILE *f = fopen(crt, "w");
    PEM_write_X509(f, x);
    fclose(f);
    f = fopen(key, "w");
    PEM_write_PrivateKey(f, pk, NULL, NULL, 0, NULL, NULL);
    fclose(f);
    X509_free(x);
    EVP_PKEY_free(pk);
}

static void h_complete(net_req_t *r)
{
    if (r->path.len == 4 && memcmp(r->path.base, "/raw", 4) == 0) {
        /* A close-delimited body ended by a bare TCP close, no close_notify. */
        net_resp_raw_and_close(r, "HTTP/1.1 200 OK\r\n\r\nabc", 22);
        return;
    }
    if (r->http_minor == 0) {
        /* close-delimited: ends with close_notify */
        net_resp_start(r, 200, NULL, 0, -1);
        net_resp_write(r, "secure", 6);
        net_resp_end(r);
        return;
    }
    net_resp_send(r, 200, "text/plain", "secure", 6, NULL, 0);
}

static const net_handler_t handler = {.on_complete = h_complete};

static void srv_closed(void *d)
{
    (void)d;
    g_srv_closed = true;
}

static void setup(void)
{
    harness_init();
    snprintf(g_dir, sizeof(g_dir), "/tmp/test_net_tls.XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
    snprintf(g_crt, sizeof(g_crt), "%s/server.crt", g_dir);
    snprintf(g_key, sizeof(g_key), "%s/server.key", g_dir);
    snprintf(g_other_crt, sizeof(g_other_crt), "%s/other.crt", g_dir);
    snprintf(g_other_key, sizeof(g_other_key), "%s/other.key", g_dir);
    write_cert("localhost", "DNS:localhost,IP:127.0.0.1", g_crt, g_key);
    write_cert("other", "DNS:other.test", g_other_crt, g_other_key);
    dp_buf_t err = {0};
    g_sctx = net_tls_server_ctx(g_crt, g_key, NULL, &err);
    cr_assert_not_null(g_sctx, "%s", err.base);
    g_srv = net_server_new(&g_loop, &handler, NULL, NULL);
    net_server_set_tls(g_srv, g_sctx);
    cr_assert_eq(net_server_listen(g_srv, "127.0.0.1", 0), 0);
}

static void teardown(void)
{
    if (g_up)
        net_upstream_free(g_up);
    net_server_close(g_srv, srv_closed, NULL);
    RUN_UNTIL(g_srv_closed);
    net_tls_ctx_unref(g_sctx);
    unlink(g_crt);
    unlink(g_key);
    unlink(g_other_crt);
    unlink(g_other_key);
    rmdir(g_dir);
    harness_fini();
}

TestSuite(net_tls, .init = setup, .fini = teardown);

/* An upstream to the TLS server trusting ca_file (NULL: the system store), named name. */
static void up_tls(const char *ca_file, const char *name)
{
    dp_buf_t err = {0};
    net_tls_ctx_t *c = net_tls_client_ctx(ca_file, NULL, NULL, &err);
    cr_assert_not_null(c, "%s", err.base);
    struct sockaddr_in a = loopback(net_server_port(g_srv));
    g_up = net_upstream_new(&g_loop, (struct sockaddr *)&a, NULL);
    net_upstream_set_tls(g_up, c, name);
    net_tls_ctx_unref(c); /* the upstream holds its own reference */
}

typedef struct {
    bool done;
    int status;
    net_up_err_t err;
    char detail[256];
    char body[64];
} fr_t;

static void fetched(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                    const char *detail, void *data)
{
    fr_t *r = data;
    (void)f;
    r->done = true;
    r->status = status;
    r->err = err;
    snprintf(r->detail, sizeof(r->detail), "%s", detail ? detail : "");
    snprintf(r->body, sizeof(r->body), "%.*s", (int)body->len, body->base ? body->base : "");
}

static void get(fr_t *r)
{
    memset(r, 0, sizeof(*r));
    net_fetch_opts_t o = {.method = "GET", .hostport = "localhost", .target = "/"};
    net_fetch(g_up, &o, fetched, r);
    RUN_UNTIL(r->done);
}

Test(net_tls, https_by_name_then_reused_over_keep_alive)
{
    up_tls(g_crt, "localhost");
    fr_t a, b;
    get(&a);
    cr_assert_eq(a.err, NET_UP_OK, "%s", a.detail);
    cr_assert_eq(a.status, 200);
    cr_assert_str_eq(a.body, "secure");
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    get(&b);
    cr_assert_eq(b.err, NET_UP_OK, "%s", b.detail);
    cr_assert_str_eq(b.body, "secure");
    cr_assert_eq(net_server_accepted(g_srv), 1);
}

Test(net_tls, https_by_ip_address_checks_the_ip_san)
{
    up_tls(g_crt, "127.0.0.1");
    fr_t a;
    get(&a);
    cr_assert_eq(a.err, NET_UP_OK, "%s", a.detail);
    cr_assert_str_eq(a.body, "secure");
}

Test(net_tls, name_not_in_the_certificate_fails_to_connect_and_says_why)
{
    up_tls(g_crt, "other.test");
    fr_t a;
    get(&a);
    cr_assert_eq(a.err, NET_UP_CONNECT);
    cr_assert_eq(a.status, 0);
    cr_assert_not_null(strstr(a.detail, "certificate verify failed: hostname mismatch"), "%s",
                       a.detail);
}

Test(net_tls, certificate_from_an_untrusted_issuer_fails_to_connect)
{
    up_tls(g_other_crt, "localhost");
    fr_t a;
    get(&a);
    cr_assert_eq(a.err, NET_UP_CONNECT);
    cr_assert_not_null(strstr(a.detail, "certificate verify failed"), "%s", a.detail);
}

/* A close-delimited body over TLS ends with close_notify (RFC 8446 §6.1): the server's lingering
 * close sends one, so the body is complete; a bare TCP close (net_resp_raw_and_close) may be an
 * attacker cutting the response short, so it is NET_UP_TRUNCATED. */
static void x_done(net_creq_t *c, net_up_err_t err, const char *detail)
{
    (void)detail;
    *(int *)c->data = (int)err + 1;
}

static net_up_err_t close_delimited(const char *req)
{
    static const net_creq_cb_t cb = {.on_done = x_done};
    up_tls(g_crt, "localhost");
    int done = 0;
    uv_buf_t b = uv_buf_init((char *)req, (unsigned)strlen(req));
    net_creq_start(g_up, &b, 1, false, false, &cb, &done);
    RUN_UNTIL(done != 0);
    return (net_up_err_t)(done - 1);
}

Test(net_tls, close_delimited_body_ended_by_close_notify_is_complete)
{
    net_up_err_t e = close_delimited("GET / HTTP/1.0\r\nhost: localhost\r\n\r\n");
    cr_assert_eq(e, NET_UP_OK, "got %s", net_up_err_name(e));
}

Test(net_tls, close_delimited_body_cut_without_close_notify_is_truncated)
{
    net_up_err_t e = close_delimited("GET /raw HTTP/1.1\r\nhost: localhost\r\n\r\n");
    cr_assert_eq(e, NET_UP_TRUNCATED, "got %s", net_up_err_name(e));
}

Test(net_tls, stalled_handshakes_beyond_the_bound_close_the_oldest)
{
    net_server_limits_t l;
    net_server_limits_default(&l);
    l.max_pending_handshakes = 1;
    net_server_set_limits(g_srv, &l);
    raw_t a, b;
    raw_connect(&a, net_server_port(g_srv)); /* TCP only: its handshake never starts */
    RUN_UNTIL(net_server_connections(g_srv) == 1);
    raw_connect(&b, net_server_port(g_srv));
    RUN_UNTIL(a.eof);
    run_idle();
    cr_assert_not(b.eof, "the newer handshake was closed");
    cr_assert_eq(net_server_connections(g_srv), 1);
    raw_close(&a);
    raw_close(&b);
}

Test(net_tls, plaintext_http_to_a_tls_listener_gets_no_http_answer)
{
    raw_t a;
    raw_connect(&a, net_server_port(g_srv));
    raw_sends(&a, "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(a.eof);
    cr_assert_eq(raw_count(&a, "HTTP/1.1"), 0);
    RUN_UNTIL(net_server_connections(g_srv) == 0);
    raw_close(&a);
}

Test(net_tls, server_context_errors_name_the_file)
{
    dp_buf_t err = {0};
    cr_assert_null(net_tls_server_ctx("/nonexistent/cert.pem", g_key, NULL, &err));
    cr_assert_not_null(strstr(err.base, "/nonexistent/cert.pem"), "%s", err.base);
    dp_buf_reset(&err);
    cr_assert_null(net_tls_server_ctx(g_crt, g_other_key, NULL, &err)); /* key of another cert */
    cr_assert_not_null(strstr(err.base, "private key"), "%s", err.base);
    dp_buf_free(&err);
}

/* ---- net_tls over memory: both ends in this process, bytes moved by hand ---------------- */

/* Move ciphertext both ways until neither side has anything to send (NET_TLS_CLOSED, the
 * peer's close_notify, is not a failure here). */
static void pump(net_tls_t *c, net_tls_t *s, dp_buf_t *cplain, dp_buf_t *splain)
{
    for (int i = 0; i < 20; i++) {
        dp_buf_t a = {0}, b = {0};
        net_tls_take_out(c, &a);
        net_tls_take_out(s, &b);
        if (a.len == 0 && b.len == 0)
            return;
        if (a.len)
            cr_assert_neq(net_tls_feed(s, a.base, a.len, splain), NET_TLS_ERROR, "%s",
                          net_tls_error(s));
        if (b.len)
            cr_assert_neq(net_tls_feed(c, b.base, b.len, cplain), NET_TLS_ERROR, "%s",
                          net_tls_error(c));
        dp_buf_free(&a);
        dp_buf_free(&b);
    }
    cr_assert_fail("handshake did not settle");
}

static bool session(net_tls_ctx_t *cctx, const char *msg)
{
    net_tls_t *c = net_tls_new_client(cctx, "localhost");
    net_tls_t *s = net_tls_new_server(g_sctx);
    dp_buf_t cp = {0}, sp = {0};
    cr_assert_eq(net_tls_handshake(c), NET_TLS_OK);
    pump(c, s, &cp, &sp);
    cr_assert(net_tls_handshake_done(c) && net_tls_handshake_done(s));
    cr_assert_str_eq(net_tls_alpn(c), "http/1.1");
    cr_assert_eq(net_tls_write(c, msg, strlen(msg)), NET_TLS_OK);
    pump(c, s, &cp, &sp);
    cr_assert_eq(sp.len, strlen(msg));
    cr_assert_eq(memcmp(sp.base, msg, sp.len), 0);
    bool resumed = net_tls_resumed(c);
    net_tls_shutdown(s);
    pump(c, s, &cp, &sp);
    cr_assert(net_tls_peer_closed(c));
    net_tls_free(c);
    net_tls_free(s);
    dp_buf_free(&cp);
    dp_buf_free(&sp);
    return resumed;
}

Test(net_tls, memory_pair_negotiates_http11_and_resumes_the_session)
{
    dp_buf_t err = {0};
    net_tls_ctx_t *cctx = net_tls_client_ctx(g_crt, NULL, NULL, &err);
    cr_assert_not_null(cctx, "%s", err.base);
    cr_assert(!session(cctx, "first"));
    cr_assert(session(cctx, "second"), "the second connection did not resume");
    net_tls_ctx_unref(cctx);
}
