/* Blocking HTTP exchanges for the command-line tools that talk to replicas or to a running
 * proxy's admin API (`replay`, `rollout report`): one exchange at a time on the tool's own
 * loop, built on net_fetch so it shares every timeout and framing check with the proxy. */
#ifndef PX_FETCH_H
#define PX_FETCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/buf.h"
#include "config/config.h"
#include "net/tls.h"

#define PX_FETCH_MAX_BODY (64u << 20)

typedef struct {
    uv_loop_t loop;
    bool done;
    int status;    /* of the last exchange; 0 when it failed (err says why) */
    dp_buf_t body; /* its response body */
    dp_buf_t err;
} px_fetch_t;

void px_fetch_init(px_fetch_t *w);
/* Runs the loop out, then closes it. */
void px_fetch_free(px_fetch_t *w);

/* One exchange with host:port (tls: verified as the proxy verifies its replicas; NULL for
 * plain HTTP). Returns the HTTP status, or 0 with w->err set. */
int px_fetch(px_fetch_t *w, const cfg_t *cfg, const char *host, uint16_t port, net_tls_ctx_t *tls,
             const char *server_name, const char *hostport, const char *method, const char *target,
             const char *bearer, const char *body, size_t len);

/* Load and validate the config at path; NULL after printing every error ("PATH: path: msg"). */
cfg_t *px_fetch_config(const char *path);

/* Where the running proxy's admin API is: `flag` (--admin HOST:PORT) when given, else the
 * config's admin_listen. 0, or 2 (the usage exit code) after printing why, prefixed by cmd. A
 * host in *out is a copy: release it with free(out->host) (never the config's). */
int px_fetch_admin_addr(const char *cmd, const cfg_t *cfg, const char *flag, cfg_addr_t *out);

/* GET target from the admin API with the config's admin token. 0 on 200 (w->body holds it);
 * otherwise -1 after printing, prefixed by cmd, the status or why it could not connect. */
int px_fetch_admin_get(px_fetch_t *w, const char *cmd, const cfg_t *cfg, const cfg_addr_t *admin,
                       const char *target);

#endif
