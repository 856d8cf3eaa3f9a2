/* libFuzzer target: request bytes through the head scanner, llhttp (strict) and the header
 * checks, then the chunk scanner over whatever follows — the exact sequence the server runs. */
#include <llhttp.h>
#include <stdint.h>
#include <string.h>

#include "net/validate.h"

typedef struct {
    net_header_t h[64];
    size_t n;
    const char *url;
    size_t url_len;
    int in_value;
} ctx_t;

static int on_url(llhttp_t *p, const char *at, size_t n)
{
    ctx_t *c = p->data;
    if (!c->url)
        c->url = at;
    c->url_len += n;
    return 0;
}

static int on_field(llhttp_t *p, const char *at, size_t n)
{
    ctx_t *c = p->data;
    if (c->n < 64) {
        c->h[c->n].name = (dp_iovec_t){at, n};
        c->h[c->n].value = (dp_iovec_t){"", 0};
        c->n++;
    }
    return 0;
}

static int on_value(llhttp_t *p, const char *at, size_t n)
{
    ctx_t *c = p->data;
    if (c->n > 0 && c->n <= 64)
        c->h[c->n - 1].value = (dp_iovec_t){at, n};
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *p = (const char *)data;
    net_head_scan_t hs = {0};
    hs.max_bytes = 8192;
    hs.max_headers = 64;
    size_t used;
    int status;
    const char *why;
    if (net_head_scan(&hs, p, size, &used, &status, &why) != NET_SCAN_DONE)
        return 0;
    llhttp_settings_t st;
    llhttp_settings_init(&st);
    st.on_url = on_url;
    st.on_header_field = on_field;
    st.on_header_value = on_value;
    llhttp_t parser;
    llhttp_init(&parser, HTTP_REQUEST, &st);
    ctx_t c = {0};
    parser.data = &c;
    llhttp_errno_t e = llhttp_execute(&parser, p, used);
    if (e != HPE_OK && e != HPE_PAUSED_UPGRADE)
        return 0;
    net_framing_t f;
    if (net_request_check(c.h, c.n, llhttp_get_http_major(&parser), llhttp_get_http_minor(&parser),
                          llhttp_get_method(&parser), c.url ? c.url : "", c.url_len, &f, &why) != 0)
        return 0;
    if (f.chunked) {
        net_chunk_scan_t cs = {0};
        size_t u2;
        net_chunk_scan(&cs, p + used, size - used, &u2, &why);
    }
    return 0;
}
