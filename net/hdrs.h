/* Header accumulation for llhttp, shared by the server (requests) and the client (responses).
 *
 * llhttp reports a header's name and value as spans of whatever it was fed, and may split
 * either across several on_header_field / on_header_value calls (one per read). Those spans
 * point into the read buffer, which is reused after the callback: net_hdrs_field and
 * net_hdrs_value copy each piece into `buf` and record where every name and value starts and
 * how long it is. Offsets, not pointers, because `buf` moves while it grows; once the head is
 * complete net_hdrs_spans turns them into name/value spans into `buf`.
 *
 * No limit is enforced here: net_head_scan has already bounded the head's bytes and header
 * lines before llhttp sees them. Pure: no libuv, no llhttp.
 *
 * Lifetimes: a net_hdrs_t is zero-initialised; net_hdrs_reset empties it for the next message
 * and keeps its memory; net_hdrs_free releases it. The spans from net_hdrs_spans are valid
 * until the next reset or free. */
#ifndef NET_HDRS_H
#define NET_HDRS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "net/validate.h"

/* Where one header's name and value lie in net_hdrs_t.buf. */
typedef struct {
    uint32_t no, nl; /* name offset and length */
    uint32_t vo, vl; /* value offset and length */
} net_hdrs_off_t;

typedef struct {
    /* Copies of the names and values. The owner may keep other bytes here before the first
     * header (the server keeps the request-target): offsets are into the whole buffer. */
    dp_buf_t buf;
    net_hdrs_off_t *off;
    size_t cap;         /* entries allocated in off */
    size_t n;           /* headers seen so far */
    net_header_t *list; /* net_hdrs_spans' result */
    size_t list_cap;
    bool in_value; /* the last piece was a value: the next name piece starts a new header */
} net_hdrs_t;

/* A piece of a header name (llhttp's on_header_field). */
void net_hdrs_field(net_hdrs_t *h, const char *at, size_t n);
/* A piece of the value of the header named last (llhttp's on_header_value). */
void net_hdrs_value(net_hdrs_t *h, const char *at, size_t n);
/* The head is complete, so buf no longer grows: h->n name/value spans into buf, each value
 * without the whitespace that followed it on its line. */
net_header_t *net_hdrs_spans(net_hdrs_t *h);
/* Empty for the next message, keeping the allocations. */
void net_hdrs_reset(net_hdrs_t *h);
void net_hdrs_free(net_hdrs_t *h);

#endif
