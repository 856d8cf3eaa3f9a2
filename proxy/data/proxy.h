/* The client listener's request handler: one px_preq_t per client request, from its head to
 * the end of its response (docs/requests.md). */
#ifndef PX_PROXY_H
#define PX_PROXY_H

#include "net/server.h"
#include "proxy/data/worker.h"

extern const net_handler_t px_proxy_handler;
/* What the workers run: this handler, with its overload count, wake-up and thread exit. */
extern const px_worker_ops_t px_proxy_worker_ops;
/* detproxy_overload_rejections_total{reason} (also the client server's 503 callback). */
void px_proxy_count_overload(const char *reason);
/* Release this thread's recycled request contexts (a loop thread that ends). */
void px_proxy_free_caches(void);

#endif
