/* Finding a running proxy's admin relay and the replicas it serves (probe/relay.h). */
#include "probe/relay.h"

#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/util.h"
#include "net/fetch.h"
#include "net/resolve.h"

#define RELAY_LIST_MAX_BYTES ((size_t)16 << 20) /* /admin/replicas of a large discovered pool */

typedef struct {
    bool done;
    int status;
    dp_buf_t body, err;
} answer_t;

static void answered(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                     const char *detail, void *data)
{
    (void)f;
    answer_t *a = data;
    a->done = true;
    a->status = status;
    if (body && body->len)
        dp_buf_append(&a->body, body->base, body->len);
    if (status == 0)
        dp_buf_printf(&a->err, "%s%s%s", net_up_err_name(err), detail && *detail ? ": " : "",
                      detail ? detail : "");
}

/* The replicas array of /admin/replicas; -1 when the answer is not the admin API's. */
static int read_list(probe_relay_t *out, const dp_buf_t *body)
{
    cJSON *doc = cJSON_ParseWithLength(body->base ? body->base : "", body->len);
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(doc, "replicas");
    if (!cJSON_IsArray(arr)) {
        cJSON_Delete(doc);
        return -1;
    }
    size_t n = (size_t)cJSON_GetArraySize(arr);
    out->reps = dp_xcalloc(n ? n : 1, sizeof(*out->reps));
    const cJSON *it;
    cJSON_ArrayForEach(it, arr)
    {
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(it, "pool");
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(it, "name");
        const cJSON *u = cJSON_GetObjectItemCaseSensitive(it, "url");
        if (!cJSON_IsString(p) || !cJSON_IsString(nm) || !cJSON_IsString(u) ||
            strlen(p->valuestring) >= sizeof(out->reps->pool) ||
            strlen(nm->valuestring) >= sizeof(out->reps->name))
            continue;
        probe_relay_replica_t *r = &out->reps[out->nreps++];
        snprintf(r->pool, sizeof(r->pool), "%s", p->valuestring);
        snprintf(r->name, sizeof(r->name), "%s", nm->valuestring);
        r->url = dp_xstrdup(u->valuestring);
        r->serving = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(it, "serving"));
    }
    cJSON_Delete(doc);
    return 0;
}

int probe_relay_find(uv_loop_t *loop, const cfg_t *cfg, const char *host, uint16_t port,
                     probe_relay_t *out, dp_buf_t *note)
{
    memset(out, 0, sizeof(*out));
    if (host == NULL) {
        host = cfg->admin_listen.host;
        port = cfg->admin_listen.port;
    }
    if (port == 0 || host == NULL) {
        dp_buf_printf(note, "admin_listen has port 0: no running proxy to ask");
        return 0;
    }
    snprintf(out->host, sizeof(out->host), "%s", host);
    out->port = port;
    snprintf(out->hostport, sizeof(out->hostport), strchr(host, ':') ? "[%s]:%u" : "%s:%u", host,
             (unsigned)port);
    if (!net_resolve(host, port, &out->addr)) {
        dp_buf_printf(note, "admin host '%s' does not resolve", host);
        return 0;
    }
    out->bearer = cfg->admin_token;
    net_upstream_opts_t uo;
    probe_attest_upstream_opts(cfg, &uo);
    uo.max_idle = 0;
    net_upstream_t *u = net_upstream_new(loop, (struct sockaddr *)&out->addr, &uo);
    answer_t a = {0};
    net_fetch_opts_t o = {.method = "GET",
                          .hostport = out->hostport,
                          .target = "/admin/replicas",
                          .bearer = out->bearer,
                          .max_bytes = RELAY_LIST_MAX_BYTES};
    net_fetch(u, &o, answered, &a);
    while (!a.done)
        uv_run(loop, UV_RUN_ONCE);
    net_upstream_free(u);
    uv_run(loop, UV_RUN_NOWAIT);
    int found = 0;
    if (a.status == 200 && read_list(out, &a.body) == 0)
        found = 1;
    else if (a.status == 200)
        dp_buf_printf(note,
                      "admin %s answered GET /admin/replicas with what is not the admin API's "
                      "answer (no replicas array)",
                      out->hostport);
    else if (a.status == 401)
        dp_buf_printf(note, "admin %s refused the config's admin token", out->hostport);
    else if (a.status)
        dp_buf_printf(note, "admin %s answered GET /admin/replicas with HTTP %d", out->hostport,
                      a.status);
    else
        dp_buf_printf(note, "no detproxy answers on admin %s (%s)", out->hostport,
                      a.err.base ? a.err.base : "no answer");
    dp_buf_free(&a.body);
    dp_buf_free(&a.err);
    return found;
}

const probe_relay_replica_t *probe_relay_lookup(const probe_relay_t *rl, const char *pool,
                                                const cfg_url_t *u)
{
    dp_buf_t want = {0};
    dp_buf_printf(&want, "%s://%s%s", u->tls ? "https" : "http", u->hostport,
                  u->path ? u->path : "");
    const probe_relay_replica_t *hit = NULL;
    /* Its own pool first: the same server in two pools is two replicas to the proxy. */
    for (int pass = 0; pass < 2 && hit == NULL; pass++)
        for (size_t i = 0; i < rl->nreps && hit == NULL; i++)
            if ((pass == 1 || strcmp(rl->reps[i].pool, pool) == 0) &&
                strcmp(rl->reps[i].url, want.base) == 0)
                hit = &rl->reps[i];
    dp_buf_free(&want);
    return hit;
}

void probe_relay_free(probe_relay_t *rl)
{
    for (size_t i = 0; i < rl->nreps; i++)
        free(rl->reps[i].url);
    free(rl->reps);
    rl->reps = NULL;
    rl->nreps = 0;
}

void probe_relay_headers(const char *pool, const char *replica, dp_buf_t *out)
{
    dp_buf_printf(out, "x-detproxy-relay-pool: %s\r\nx-detproxy-relay-replica: %s\r\n", pool,
                  replica);
}
