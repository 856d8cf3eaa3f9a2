#include "net/hdrs.h"

#include <assert.h>
#include <stdlib.h>

void net_hdrs_field(net_hdrs_t *h, const char *at, size_t n)
{
    if (h->in_value || h->n == 0) {
        if (h->n == h->cap) {
            h->cap = h->cap ? h->cap * 2 : 16;
            h->off = dp_xrealloc(h->off, h->cap * sizeof(*h->off));
        }
        net_hdrs_off_t *o = &h->off[h->n++];
        o->no = (uint32_t)h->buf.len;
        o->nl = o->vo = o->vl = 0;
        h->in_value = false;
    }
    h->off[h->n - 1].nl += (uint32_t)n;
    dp_buf_append(&h->buf, at, n);
}

void net_hdrs_value(net_hdrs_t *h, const char *at, size_t n)
{
    /* llhttp reports a value only after its name. */
    assert(h->n > 0);
    net_hdrs_off_t *o = &h->off[h->n - 1];
    if (!h->in_value) {
        h->in_value = true;
        o->vo = (uint32_t)h->buf.len;
    }
    o->vl += (uint32_t)n;
    dp_buf_append(&h->buf, at, n);
}

net_header_t *net_hdrs_spans(net_hdrs_t *h)
{
    if (h->list_cap < h->n) {
        h->list_cap = h->n;
        h->list = dp_xrealloc(h->list, h->list_cap * sizeof(*h->list));
    }
    for (size_t i = 0; i < h->n; i++) {
        const net_hdrs_off_t *o = &h->off[i];
        assert((size_t)o->no + o->nl <= h->buf.len && (size_t)o->vo + o->vl <= h->buf.len);
        h->list[i].name = (dp_iovec_t){h->buf.base + o->no, o->nl};
        /* llhttp drops the whitespace before a value, not after it: it is not part of the
         * value (RFC 9110 §5.5), so it is neither compared nor forwarded. */
        const char *v = h->buf.base + o->vo;
        size_t vl = o->vl;
        while (vl > 0 && (v[vl - 1] == ' ' || v[vl - 1] == '\t'))
            vl--;
        h->list[i].value = (dp_iovec_t){v, vl};
    }
    return h->list;
}

void net_hdrs_reset(net_hdrs_t *h)
{
    dp_buf_reset(&h->buf);
    h->n = 0;
    h->in_value = false;
}

void net_hdrs_free(net_hdrs_t *h)
{
    dp_buf_free(&h->buf);
    free(h->off);
    h->off = NULL;
    free(h->list);
    h->list = NULL;
    h->cap = h->n = h->list_cap = 0;
    h->in_value = false;
}
