/* An etcd v3 client over the JSON gateway (HTTP/1.1, `/v3/...`), on libuv and net/'s client:
 * no gRPC. One per fleet: unary calls (kv, lease, txn), one watch of a key prefix, endpoints
 * tried in turn, TLS with client certificates, user + password (a token from
 * /v3/auth/authenticate sent as the Authorization field, renewed when refused).
 *
 * Bounded: every answer and every watch message is capped (max_answer); a bigger, endless or
 * malformed answer fails that call (or restarts the watch) and costs at most the cap. Callbacks
 * run on the loop, never inside the call that started them. */
#ifndef FLEET_ETCD_H
#define FLEET_ETCD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>
#include <uv.h>

#include "common/buf.h"
#include "config/config.h"
#include "fleet/etcdjson.h"

typedef struct fleet_etcd_s fleet_etcd_t;

typedef struct {
    const cfg_url_t *endpoints; /* http(s)://host:port, tried in this order */
    size_t nendpoints;
    const char *ca_file, *cert_file, *key_file; /* https: NULL ca_file is the system store */
    const char *username, *password;            /* NULL: no authentication */
    uint32_t timeout_ms;                        /* one request on one endpoint (default 2000) */
    size_t max_answer;                          /* default 4 MiB */
} fleet_etcd_opts_t;

/* NULL with err set when the TLS files or an endpoint's address cannot be used. */
fleet_etcd_t *fleet_etcd_new(uv_loop_t *loop, const fleet_etcd_opts_t *o, dp_buf_t *err);
/* Stops the watch (no callbacks) and ends every call in flight with a failure (its callback
 * runs now, res NULL); the memory goes once its timer has closed. */
void fleet_etcd_free(fleet_etcd_t *e);

/* Stops the watch (no callbacks) and ends every call in flight with a failure (its callback
 * runs now, res NULL); the client stays usable. */
void fleet_etcd_cancel(fleet_etcd_t *e);

/* The parsed answer (an object), or NULL with why (transport, HTTP status, etcd's error). */
typedef void (*fleet_etcd_cb)(const cJSON *res, const char *why, void *data);
/* POST body to path ("/v3/kv/put"). Failures of an endpoint (connect, timeout, 5xx, no leader)
 * move to the next, each endpoint once; a refused token is renewed once. */
void fleet_etcd_call(fleet_etcd_t *e, const char *path, const dp_buf_t *body, fleet_etcd_cb cb,
                     void *data);
/* The same with its own answer cap (the whole fleet state read at connect is larger than any
 * one answer should be). */
void fleet_etcd_call_max(fleet_etcd_t *e, const char *path, const dp_buf_t *body, size_t max_bytes,
                         fleet_etcd_cb cb, void *data);
/* The client's last call: what is in flight and the watch end as in fleet_etcd_free, body goes
 * to path, and the client is freed once it is answered or limit_ms have passed, whichever comes
 * first. cb is told once either way (res NULL and why "canceled: ..." at the limit). */
void fleet_etcd_free_after(fleet_etcd_t *e, const char *path, const dp_buf_t *body,
                           uint32_t limit_ms, fleet_etcd_cb cb, void *data);

/* The endpoint calls go to now ("127.0.0.1:2379"), and HTTP requests sent so far. */
const char *fleet_etcd_endpoint(const fleet_etcd_t *e);
uint64_t fleet_etcd_requests(const fleet_etcd_t *e);

/* The watch: every change under prefix from start_rev on. After a failure it reconnects by
 * itself (next endpoint, backoff) from the revision after the last it delivered; when etcd has
 * compacted that revision away it calls on_compacted instead, and the owner reads the prefix
 * again and restarts the watch from there. The watch asks for a leader: a member that loses
 * quorum cancels it rather than staying silent. */
typedef struct {
    void (*on_kv)(void *data, const fleet_kv_t *kv, bool deleted);
    /* Everything up to rev has been delivered (after a batch of events). */
    void (*on_rev)(void *data, int64_t rev);
    /* The events from the watch's revision on cannot be read through it: compacted away
     * (compact_rev), or a message it cannot read (0: over the cap, or malformed). */
    void (*on_compacted)(void *data, int64_t compact_rev);
    /* The stream went (why), or came (why NULL: the watch was created). */
    void (*on_link)(void *data, const char *why);
} fleet_etcd_watch_cb_t;

void fleet_etcd_watch(fleet_etcd_t *e, const char *prefix, int64_t start_rev,
                      const fleet_etcd_watch_cb_t *cb, void *data);
void fleet_etcd_watch_stop(fleet_etcd_t *e);
/* Drop the stream now and reconnect (the owner saw the endpoint fail). */
void fleet_etcd_watch_kick(fleet_etcd_t *e);
bool fleet_etcd_watching(const fleet_etcd_t *e);

#endif
