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
    uint64_t deadline_ns; /* dp_now_ns() past which an exchange is cut (0: none) */
    bool done, timed_out;
    int status;    /* of the last exchange; 0 when it failed (err says why) */
    dp_buf_t body; /* its response body */
    dp_buf_t err;
} px_fetch_t;

void px_fetch_init(px_fetch_t *w);
/* Runs the loop out, then closes it. */
void px_fetch_free(px_fetch_t *w);

/* One exchange with host:port (tls: verified as the proxy verifies its replicas; NULL for
 * plain HTTP). Returns the HTTP status, or 0 with w->err set ("deadline" once w->deadline_ns
 * has passed: a replica dripping bytes resets every per-phase timeout, never this one). */
int px_fetch(px_fetch_t *w, const cfg_t *cfg, const char *host, uint16_t port, net_tls_ctx_t *tls,
             const char *server_name, const char *hostport, const char *method, const char *target,
             const char *bearer, const char *extra_headers, const char *body, size_t len);

/* Load and validate the config at path; NULL after printing every error ("PATH: path: msg"). */
cfg_t *px_fetch_config(const char *path);

/* Where the running proxy's admin API is: `flag` (--admin HOST:PORT) when given, else the
 * config's admin_listen. 0, or 2 (the usage exit code) after printing why, prefixed by cmd. A
 * host in *out is a copy: release it with free(out->host) (never the config's). */
int px_fetch_admin_addr(const char *cmd, const cfg_t *cfg, const char *flag, cfg_addr_t *out);

/* POST body to target on the admin API with the config's admin token (and extra header lines,
 * or NULL): the HTTP status (w->body holds the answer), or 0 after printing, prefixed by cmd,
 * why it could not connect. */
int px_fetch_admin_post(px_fetch_t *w, const char *cmd, const cfg_t *cfg, const cfg_addr_t *admin,
                        const char *target, const char *extra_headers, const char *body,
                        size_t len);

/* Append s[0..n) to out for a terminal: control characters (ESC, CR, ...) and DEL as \xHH, so
 * text from a replica or an admin API can neither move the cursor nor forge a line. */
void px_fetch_escape(const char *s, size_t n, dp_buf_t *out);
/* The same into a static buffer per call slot (0..3), for printf: valid until that slot is
 * used again. NULL prints as "". */
const char *px_fetch_safe(unsigned slot, const char *s);

/* GET target from the admin API with the config's admin token. 0 on 200 (w->body holds it);
 * otherwise -1 after printing, prefixed by cmd, the status or why it could not connect. */
int px_fetch_admin_get(px_fetch_t *w, const char *cmd, const cfg_t *cfg, const cfg_addr_t *admin,
                       const char *target);

#endif
