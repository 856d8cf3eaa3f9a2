/* One request, the whole response body in memory (capped): for attestation, canaries,
 * shadow copies and diagnose. Built on px_creq_* so it shares every timeout and framing check
 * with client traffic. */
#ifndef PX_FETCH_H
#define PX_FETCH_H

#include <stddef.h>

#include "common/buf.h"
#include "net/client.h"

typedef struct px_fetch_s px_fetch_t;

/* status: the HTTP status (0 when the exchange failed: see err/detail). body is valid during
 * the call. truncated: the body exceeded max_bytes (the exchange was cut short). */
typedef void (*px_fetch_cb)(px_fetch_t *f, int status, const dp_buf_t *body, px_up_err_t err,
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
    const char *via;           /* the sender's Via line (loop detection, px_self.h) or NULL */
} px_fetch_opts_t;

/* Start; cb runs exactly once from the loop unless px_fetch_cancel is called first. */
px_fetch_t *px_fetch(px_upstream_t *u, const px_fetch_opts_t *o, px_fetch_cb cb, void *data);
void px_fetch_cancel(px_fetch_t *f);

#endif
