/* One request, the whole response body in memory (capped): for attestation, canaries,
 * shadow copies and diagnose. Built on net_creq_* so it shares every timeout and framing check
 * with client traffic. */
#ifndef NET_FETCH_H
#define NET_FETCH_H

#include <stddef.h>

#include "common/buf.h"
#include "net/client.h"

typedef struct net_fetch_s net_fetch_t;

/* status: the HTTP status (0 when the exchange failed: see err/detail). body is valid during
 * the call. A body over max_bytes (announced or streamed) ends the fetch as soon as it is seen,
 * with status 0, NET_UP_PROTOCOL and "response body larger than N bytes", told with the
 * exchange still open (net_fetch_open): made a drain then, the rest is read to its end;
 * otherwise the connection is reset. */
typedef void (*net_fetch_cb)(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                             const char *detail, void *data);

typedef struct {
    const char *method;   /* "GET", "POST" */
    const char *hostport; /* Host header */
    const char *target;   /* origin-form path (+query) */
    const char *bearer;   /* Authorization: Bearer ... or NULL */
    const char *body;     /* request body (JSON) or NULL */
    size_t body_len;
    size_t max_bytes;          /* response body cap */
    const char *extra_headers; /* raw "name: value\r\n" lines or NULL */
    const char *via;      /* the sender's Via line (loop detection, proxy/core/self.h) or NULL */
    bool length_required; /* net_creq_t.length_required */
    uint32_t deadline_ms; /* the whole answer within this (net_creq_set_deadline); 0: none */
} net_fetch_opts_t;

/* Start; cb runs exactly once from the loop unless net_fetch_cancel is called first. */
net_fetch_t *net_fetch(net_upstream_t *u, const net_fetch_opts_t *o, net_fetch_cb cb, void *data);
void net_fetch_cancel(net_fetch_t *f);
/* Make f's exchange a drain in set (net_creq_drain, for at most max_ms): the answer is read to
 * its end and dropped, done(data, left_ms) runs when it is over, and f is gone (its callback does
 * not run again). Allowed before f's callback has run, and from a callback told while the
 * exchange is still open (net_fetch_open: no answer within the first-byte timeout, one silent
 * mid-way for the idle timeout, or one over max_bytes). For a request the
 * engine may go on generating after its connection closes, whose slot must stay taken until it
 * has (docs/configuration.md, "Deterministic pools"). */
/* Is f's exchange still open while its callback runs? So for a timeout (status 0,
 * NET_UP_FIRST_BYTE_TIMEOUT or NET_UP_IDLE_TIMEOUT) or a body over max_bytes (NET_UP_PROTOCOL),
 * told before the exchange ends, when the callback may make it a drain; never for the callback
 * of an exchange that has ended. */
bool net_fetch_open(const net_fetch_t *f);
/* Did f's exchange, told to its callback with status and err, fail once the upstream had the
 * whole request, with nothing left to read (closed, cut mid-answer: net_up_err_may_run, and
 * not net_fetch_open)? The upstream may be generating it still. */
bool net_fetch_failed_running(const net_fetch_t *f, int status, net_up_err_t err);
/* Has every byte of f's request left (net_creq_sent)? Before that the upstream cannot be
 * running it, and there is nothing to drain. */
bool net_fetch_sent(const net_fetch_t *f);
void net_fetch_drain(net_fetch_t *f, net_drains_t *set, uint64_t max_ms, net_drain_done_fn done,
                     void *data);

#endif
