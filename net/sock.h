/* A TCP stream with the write discipline every connection here needs: try the socket first
 * (no allocation, no copy on the common path), queue only what the kernel did not take, count
 * queued bytes for backpressure, and report drain below a low-water mark.
 *
 * Reads go through one loop-wide buffer: a read callback must consume or copy what it is given
 * before returning ("the read buffer is reused: copy what you keep past this callback"). That
 * keeps an idle connection at the size of its structs, not of a read buffer.
 *
 * Small writes are batched per loop iteration: net_sock_write copies them into one loop-wide
 * buffer and a uv_check handle writes every connection's batch after the iteration's I/O
 * callbacks, so the peers' wake-ups come in one burst instead of one per callback (see
 * net/sock.c, "Write batching"). Closing, shutting down or a large write flushes a
 * connection's batch first, so bytes keep their order and are never dropped by a close.
 *
 * TLS slots in under this same interface: s->tls, when set, turns reads into decrypt-then-deliver
 * and writes into encrypt-then-write, so connection code above never knows which one it has. */
#ifndef NET_SOCK_H
#define NET_SOCK_H

#include <stdbool.h>
#include <stddef.h>

#include <uv.h>

#include "net/tls.h"

typedef struct net_sock_s net_sock_t;

/* Plaintext bytes read. n > 0. */
typedef void (*net_sock_read_cb)(net_sock_t *s, const char *p, size_t n);
/* The stream ended (UV_EOF) or failed (negative libuv error), on read or on write. Called at
 * most once; the owner decides whether to close. */
typedef void (*net_sock_error_cb)(net_sock_t *s, int status);
/* Queued bytes fell to the low-water mark after net_sock_write had queued above high-water. */
typedef void (*net_sock_drain_cb)(net_sock_t *s);
/* Connect finished (status 0 or a negative libuv error), including a TLS handshake if any. */
typedef void (*net_sock_connect_cb)(net_sock_t *s, int status);
/* TLS server side: the handshake completed. */
typedef void (*net_sock_handshake_cb)(net_sock_t *s);
/* Handle closed: the owner may free the memory holding this net_sock_t. */
typedef void (*net_sock_close_cb)(net_sock_t *s);
/* Where the next read may land instead of the loop's read buffer: *len bytes at the returned
 * address (they are then what on_read gets), or NULL for the read buffer, at most *len bytes
 * of it when *len is set (a read of a head alone, so that the body after it can land in its
 * own buffer). Plain TCP only. */
typedef char *(*net_sock_read_target_cb)(net_sock_t *s, size_t *len);

struct net_sock_s {
    uv_tcp_t tcp; /* tcp.data points at this net_sock_t; never moves */
    void *owner;
    net_sock_read_cb on_read;
    net_sock_error_cb on_error;
    net_sock_drain_cb on_drain;
    net_sock_connect_cb on_connect;
    net_sock_close_cb on_close;
    net_sock_handshake_cb on_handshake;  /* optional */
    net_sock_read_target_cb read_target; /* optional */
    uv_connect_t connect_req;
    net_tls_t *tls;
    size_t queued;       /* bytes handed to uv_write and not yet completed */
    size_t high_water;   /* above: backpressure (see net_sock_over) */
    size_t low_water;    /* drain reported when falling to this */
    uint64_t last_write; /* uv_now() of the last write progress seen (net_sock_last_progress) */
    uint64_t handed;     /* bytes ever written to the socket or handed to uv_write */
    uint64_t taken;      /* of them, acknowledged by the peer when last looked at */
    bool reading;
    bool closing;
    bool errored;
    bool above_high; /* crossed high_water; on_drain due when back under low_water */
    bool connecting; /* TLS client: on_connect waits for the handshake */
    bool write_shut; /* uv_shutdown requested: nothing more may be written (net_sock_shutdown) */
    bool batched;    /* on its loop's write batch (see net/sock.c) */
    bool in_batch;   /* batch_len bytes at batch_off wait for the end of the iteration */
    size_t batch_off, batch_len;
};

/* Initialise around a fresh uv_tcp_t (server side: call, then uv_accept into &s->tcp). */
int net_sock_init(uv_loop_t *loop, net_sock_t *s, void *owner);
/* Speak TLS on this stream (before reading or connecting); the sock owns t from here on.
 * Failures surface through on_error with UV_EPROTO; net_sock_tls_error says why. */
void net_sock_use_tls(net_sock_t *s, net_tls_t *t);
const char *net_sock_tls_error(const net_sock_t *s);
int net_sock_read_start(net_sock_t *s);
void net_sock_read_stop(net_sock_t *s);
/* Write bufs in order. Returns 0 (sent or queued) or a negative libuv error (the stream is
 * unusable; on_error is not called for it). Never keeps pointers into bufs. */
int net_sock_write(net_sock_t *s, const uv_buf_t *bufs, unsigned nbufs);
/* Connect to addr; on_connect fires once. */
int net_sock_connect(net_sock_t *s, const struct sockaddr *addr);
/* True while written bytes are not all in the kernel yet (queued in libuv, or in the loop's
 * write batch): net_sock_close now would lose them, net_sock_shutdown sends them first. */
static inline bool net_sock_sending(const net_sock_t *s)
{
    return s->queued > 0 || s->in_batch;
}
/* The socket's byte count once what was written so far has left (handed, plus the batch). */
static inline uint64_t net_sock_written(const net_sock_t *s)
{
    return s->handed + (s->in_batch ? s->batch_len : 0);
}
/* True while queued bytes are above the high-water mark. */
static inline bool net_sock_over(const net_sock_t *s)
{
    return s->queued > s->high_water;
}
/* uv_now() of the last time the peer was seen taking bytes: a write completing, or, looked at
 * now, bytes that left libuv's queue and the kernel's send queue since the last look. A write
 * completes only once all of it is in the kernel, and the kernel makes room for more only
 * when a third of its send buffer is free, so a peer reading slowly but steadily can complete
 * nothing for longer than any idle timeout while its bytes flow all along. For send-stall
 * timeouts: called when one expires, it cuts off a reader that took nothing for between one
 * and two of them. */
uint64_t net_sock_last_progress(net_sock_t *s);
/* Of the bytes written after the first `from` (a value of s->handed), how many the peer's TCP
 * has acknowledged: taken into its receive buffer, where its application can read them. Still
 * readable after the close; exact after a FIN (which carries the acknowledgement), while after
 * a reset it may lag what the peer read (an acknowledgement delayed, then never sent).
 * UINT64_MAX when the kernel cannot say. */
uint64_t net_sock_acked_since(net_sock_t *s, uint64_t from);
/* Close now (pending writes are cancelled). on_close fires once from the loop. */
void net_sock_close(net_sock_t *s);
/* Close now with a reset: the kernel also drops what it has not sent yet, and the peer learns
 * at once instead of after reading everything queued before the FIN (an abandoned upload to
 * a replica that stopped reading). on_close fires once from the loop. */
void net_sock_abort(net_sock_t *s);
/* Half-close the write side after queued bytes are written (lingering close). With TLS,
 * close_notify goes first when notify is set; without it, a peer reading to the close can tell
 * the stream was cut (an aborted answer). From here net_sock_write fails with UV_EPIPE, and
 * what TLS still produces on its own while reading is dropped (see tls_flush). */
void net_sock_shutdown(net_sock_t *s, bool notify);
/* "ip:port" of the peer into out (at least 48 bytes), and its address into *ss when ss is not
 * NULL. False when the socket has no peer (out is then empty). */
bool net_sock_peer(net_sock_t *s, char *out, size_t n, struct sockaddr_storage *ss);

/* The loop-wide read buffer size (also the most one read callback delivers). */
#define NET_READ_BUF_SIZE (64 * 1024)
/* Free this thread's scratch buffers (a loop thread that ends). */
void net_sock_thread_free(void);

#endif
