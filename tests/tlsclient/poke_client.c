/* tls-poke-client: a TLS client that sends the server a post-handshake message in the middle of
 * reading an answer, for tests/integration/test_tls_linger.py (Python's ssl module cannot send
 * either message).
 *
 *   tls-poke-client [-m key_update|renegotiate|none] [-o FILE] PORT REQUEST FIRST
 *
 * Connects to 127.0.0.1:PORT (small receive buffer, so the server holds most of a large answer),
 * prints "port LOCALPORT", sends REQUEST as is, reads FIRST plaintext bytes, prints "read N",
 * then waits for one line on stdin (the test's signal that the server is where it wants it).
 * Then, by -m:
 *   key_update   (TLS 1.3, the default) a KeyUpdate with update_requested;
 *   renegotiate  (TLS 1.2) a renegotiation ClientHello: a server refusing renegotiation answers
 *                with a no_renegotiation alert while it reads, unasked;
 *   none         nothing.
 * It reads to the end, writing the plaintext to FILE if given, and prints
 *   "received TOTAL end=close_notify|eof|reset|... poked=P server_key_updates=K server_alerts=A"
 * (P: how many of its messages went out).
 * Blocking sockets; no certificate verification (a test against a throwaway CA). Exit 0 once the
 * answer was read to its end (whatever the end), 1 when it could not get that far. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/ssl.h>

static int g_server_key_updates, g_server_alerts;
static int g_hellos_sent, g_key_updates_sent;

/* Counts the messages sent that poke the server, and what it sends besides application data. */
static void msg_cb(int write_p, int version, int content_type, const void *buf, size_t len,
                   SSL *ssl, void *arg)
{
    (void)version;
    (void)ssl;
    (void)arg;
    if (len == 0)
        return;
    if (write_p) {
        unsigned char type = ((const unsigned char *)buf)[0];
        if (content_type == SSL3_RT_HANDSHAKE && type == SSL3_MT_CLIENT_HELLO)
            g_hellos_sent++;
        if (content_type == SSL3_RT_HANDSHAKE && type == SSL3_MT_KEY_UPDATE)
            g_key_updates_sent++;
        return;
    }
    if (content_type == SSL3_RT_HANDSHAKE && ((const unsigned char *)buf)[0] == SSL3_MT_KEY_UPDATE)
        g_server_key_updates++;
    if (content_type == SSL3_RT_ALERT)
        g_server_alerts++;
}

static int die(const char *what)
{
    char e[256] = "";
    unsigned long code = ERR_get_error();
    if (code)
        ERR_error_string_n(code, e, sizeof(e));
    fprintf(stderr, "tls-poke-client: %s: %s\n", what, code ? e : strerror(errno));
    return 1;
}

/* How SSL_read's result r ended the stream, into out. */
static void describe_end(SSL *ssl, int r, char *out, size_t n)
{
    int e = SSL_get_error(ssl, r);
    unsigned long code = ERR_peek_error();
    if (e == SSL_ERROR_ZERO_RETURN)
        snprintf(out, n, "close_notify");
    else if (e == SSL_ERROR_SSL && ERR_GET_REASON(code) == SSL_R_UNEXPECTED_EOF_WHILE_READING)
        snprintf(out, n, "eof"); /* a FIN without close_notify: a cut answer */
    else if (e == SSL_ERROR_SYSCALL && errno == ECONNRESET)
        snprintf(out, n, "reset");
    else if (e == SSL_ERROR_SYSCALL)
        snprintf(out, n, "syscall:%s", strerror(errno));
    else {
        char s[200] = "";
        ERR_error_string_n(code, s, sizeof(s));
        snprintf(out, n, "error:%d:%s", e, s);
    }
    ERR_clear_error();
}

int main(int argc, char **argv)
{
    const char *mode = "key_update";
    const char *out_path = NULL;
    int opt;
    while ((opt = getopt(argc, argv, "m:o:")) != -1) {
        if (opt == 'm')
            mode = optarg;
        else if (opt == 'o')
            out_path = optarg;
        else
            return 2;
    }
    int renegotiate = strcmp(mode, "renegotiate") == 0;
    int key_update = strcmp(mode, "key_update") == 0;
    if (argc - optind != 3 || (!renegotiate && !key_update && strcmp(mode, "none") != 0)) {
        fprintf(stderr,
                "usage: tls-poke-client [-m key_update|renegotiate|none] [-o FILE] PORT REQUEST "
                "FIRST\n");
        return 2;
    }
    int port = atoi(argv[optind]);
    const char *request = argv[optind + 1];
    long first = atol(argv[optind + 2]);

    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return die("socket");
    int rcvbuf = 16384, one = 1;
    struct timeval tv = {.tv_sec = 60};
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0)
        return die("connect");
    struct sockaddr_in me;
    socklen_t melen = sizeof(me);
    getsockname(fd, (struct sockaddr *)&me, &melen);
    printf("port %d\n", ntohs(me.sin_port));
    fflush(stdout);

    SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
    if (ctx == NULL)
        return die("SSL_CTX_new");
    int version = renegotiate ? TLS1_2_VERSION : TLS1_3_VERSION;
    SSL_CTX_set_min_proto_version(ctx, version);
    SSL_CTX_set_max_proto_version(ctx, version);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, NULL);
    SSL *ssl = SSL_new(ctx);
    if (ssl == NULL)
        return die("SSL_new");
    SSL_set_msg_callback(ssl, msg_cb);
    SSL_set_tlsext_host_name(ssl, "localhost");
    SSL_set_fd(ssl, fd);
    if (SSL_connect(ssl) != 1)
        return die("handshake");
    if (SSL_write(ssl, request, (int)strlen(request)) <= 0)
        return die("write");

    FILE *out = out_path ? fopen(out_path, "wb") : NULL;
    if (out_path && out == NULL)
        return die(out_path);
    char buf[16384];
    long total = 0;
    while (total < first) {
        long want = first - total < (long)sizeof(buf) ? first - total : (long)sizeof(buf);
        int r = SSL_read(ssl, buf, (int)want);
        if (r <= 0)
            return die("read before the poke");
        if (out)
            fwrite(buf, 1, (size_t)r, out);
        total += r;
    }
    printf("read %ld\n", total);
    fflush(stdout);
    char line[64];
    if (fgets(line, sizeof(line), stdin) == NULL)
        return die("stdin");

    if (key_update &&
        (SSL_key_update(ssl, SSL_KEY_UPDATE_REQUESTED) != 1 || SSL_do_handshake(ssl) != 1))
        return die("key update");
    /* The ClientHello goes out at the start of the next SSL_read, which goes on returning the
     * answer's bytes while the client waits for a ServerHello (SSL_do_handshake would fail on
     * them instead). */
    if (renegotiate && SSL_renegotiate(ssl) != 1)
        return die("renegotiate");
    char end[300];
    for (;;) {
        int r = SSL_read(ssl, buf, sizeof(buf));
        if (r <= 0) {
            describe_end(ssl, r, end, sizeof(end));
            break;
        }
        if (out)
            fwrite(buf, 1, (size_t)r, out);
        total += r;
    }
    if (out)
        fclose(out);
    /* poked: the message went out (a second ClientHello, or the KeyUpdate). */
    int poked = renegotiate ? g_hellos_sent - 1 : g_key_updates_sent;
    printf("received %ld end=%s poked=%d server_key_updates=%d server_alerts=%d\n", total, end,
           poked, g_server_key_updates, g_server_alerts);
    fflush(stdout);
    SSL_free(ssl);
    SSL_CTX_free(ctx);
    close(fd);
    return 0;
}
