/* Hooks on the proxy path. This first version routes inference requests by model; tenant
 * policy, audit and shadow sampling plug in here. */
#include <string.h>

#include <cjson/cJSON.h>

#include "proxy/px_hooks.h"

void px_hooks_init(px_hooks_req_t *h)
{
    memset(h, 0, sizeof(*h));
    h->tenant = "-";
}

const char *px_hooks_tenant(const px_hooks_req_t *h)
{
    return h->tenant;
}

int px_hooks_tenant_gate(px_hooks_req_t *h, px_t *px, px_gen_t *g, px_req_t *req)
{
    (void)h;
    (void)px;
    (void)g;
    (void)req;
    return 0;
}

int px_hooks_inference(px_hooks_req_t *h, px_t *px, px_gen_t *g, px_req_t *req, bool chat,
                       dp_buf_t *body, px_hooks_result_t *res)
{
    (void)px;
    (void)chat;
    h->inference = true;
    cJSON *doc = cJSON_ParseWithLength(req->body.base ? req->body.base : "", req->body.len);
    if (doc == NULL || !cJSON_IsObject(doc)) {
        cJSON_Delete(doc);
        *res = (px_hooks_result_t){400, "invalid_json", NULL, "request body is not a JSON object",
                                   NULL};
        return -1;
    }
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(doc, "model");
    if (!cJSON_IsString(model)) {
        cJSON_Delete(doc);
        *res = (px_hooks_result_t){400, "invalid_request", "model", "\"model\" must be a string",
                                   NULL};
        return -1;
    }
    px_pool_t *pool = px_gen_pool_for_model(g, model->valuestring, strlen(model->valuestring));
    cJSON_Delete(doc);
    if (pool == NULL) {
        *res = (px_hooks_result_t){404, "model_not_found", "model",
                                   "no pool serves this model", NULL};
        return -1;
    }
    res->pool = pool;
    dp_buf_append(body, req->body.base, req->body.len);
    return 0;
}

void px_hooks_response_headers(px_hooks_req_t *h, const px_pool_t *pool, px_header_t *out,
                               size_t *n)
{
    if (!h->inference || pool == NULL)
        return;
    out[(*n)++] = (px_header_t){DP_IOV("x-detproxy-fingerprint"),
                                {pool->fingerprint, strlen(pool->fingerprint)}};
}

bool px_hooks_hold_response(px_hooks_req_t *h, int status, const px_header_t *hdrs, size_t n)
{
    (void)h;
    (void)status;
    (void)hdrs;
    (void)n;
    return false;
}

void px_hooks_rewrite_response(px_hooks_req_t *h, const px_pool_t *pool, dp_buf_t *body,
                               px_header_t *extra, size_t *nextra)
{
    (void)h;
    (void)pool;
    (void)body;
    (void)extra;
    (void)nextra;
}

void px_hooks_dispatched(px_hooks_req_t *h, px_t *px, px_pool_t *pool, px_replica_t *r,
                         const px_req_t *req, const char *body, size_t len)
{
    (void)h;
    (void)px;
    (void)pool;
    (void)r;
    (void)req;
    (void)body;
    (void)len;
}

void px_hooks_response_bytes(px_hooks_req_t *h, const char *p, size_t n)
{
    (void)h;
    (void)p;
    (void)n;
}

void px_hooks_upstream_failed(px_hooks_req_t *h, px_t *px, px_replica_t *r, px_up_err_t err)
{
    (void)h;
    (void)px;
    (void)r;
    (void)err;
}

void px_hooks_finish(px_hooks_req_t *h, px_t *px, px_pool_t *pool, px_replica_t *r, int status,
                     const char *request_id)
{
    (void)h;
    (void)px;
    (void)pool;
    (void)r;
    (void)status;
    (void)request_id;
}
