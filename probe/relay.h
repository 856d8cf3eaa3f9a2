/* How detproxy's own tools (diagnose, replay) reach a replica: directly, or, when a running
 * proxy serves that replica, through its admin relay (docs/operations.md §2, "Relay"), so their
 * requests take the pool's admission slots like every other request detproxy sends to it. */
#ifndef PROBE_RELAY_H
#define PROBE_RELAY_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include <uv.h>

#include "common/buf.h"
#include "config/config.h"
#include "probe/probe.h"

typedef struct {
    char pool[129], name[129];
    char *url; /* "scheme://host:port/path", as /admin/replicas writes it */
    bool serving;
} probe_relay_replica_t;

/* A running proxy's admin listener, and the replicas it has. */
typedef struct {
    char host[256];
    uint16_t port;
    struct sockaddr_storage addr;
    char hostport[300];
    const char *bearer; /* the config's admin token, or NULL */
    probe_relay_replica_t *reps;
    size_t nreps;
} probe_relay_t;

#define PROBE_RELAY_BASE "/admin/relay"

/* Ask the admin listener at host:port (NULL host: cfg's admin_listen) which replicas it has
 * (GET /admin/replicas with cfg's admin token). 1 and *out filled when a detproxy answered; 0
 * with *note saying why not (nothing listens, the token is refused, the answer is not the
 * admin API's, admin_listen has port 0). Runs loop until the answer (bounded by
 * attestation.timeout_ms). Free with probe_relay_free either way. */
int probe_relay_find(uv_loop_t *loop, const cfg_t *cfg, const char *host, uint16_t port,
                     probe_relay_t *out, dp_buf_t *note);
/* The running proxy's replica (its pool and name) at url u, of pool `pool` when it has it there,
 * or NULL when it has none: that replica is none of its live ones, and no slot is shared. */
const probe_relay_replica_t *probe_relay_lookup(const probe_relay_t *rl, const char *pool,
                                                const cfg_url_t *u);
void probe_relay_free(probe_relay_t *rl);
/* The header lines that name a replica to the relay. */
void probe_relay_headers(const char *pool, const char *replica, dp_buf_t *out);

#endif
