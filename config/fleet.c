/* The "fleet" section (docs/fleet.md, "Configuration"): the etcd cluster many instances share
 * their verdicts through, this instance's name in it, and its lease. */
#include "config/cfg_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"

static const char *const fleet_keys[] = {"name", "instance", "etcd", "lease_ttl_ms", NULL};
static const char *const etcd_keys[] = {"endpoints", "tls", "username", "password_file", NULL};
static const char *const etcd_tls_keys[] = {"ca", "cert", "key", NULL};

/* Fleet and instance names are segments of etcd keys (and instance names metric labels):
 * letters, digits and the characters of extra, never '/'. */
static bool key_segment(const char *s, const char *extra)
{
    size_t n = strlen(s);
    if (n == 0 || n > CFG_NAME_MAX)
        return false;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              strchr(extra, ch) != NULL))
            return false;
    }
    return true;
}

static void parse_endpoints(cfg_ctx_t *c, const cJSON *o, cfg_fleet_t *f)
{
    const cJSON *a = cfg_get_arr(c, o, "endpoints", true);
    if (a == NULL)
        return;
    size_t mark = cfg_path_key(c, "endpoints");
    int n = cJSON_GetArraySize(a);
    if (n == 0)
        cfg_err(c, NULL, "must name at least one etcd endpoint");
    if (n > CFG_FLEET_MAX_ENDPOINTS)
        cfg_err(c, NULL, "at most %d endpoints", CFG_FLEET_MAX_ENDPOINTS);
    f->endpoints = dp_xcalloc(n > 0 ? (size_t)n : 1, sizeof(*f->endpoints));
    for (int i = 0; i < n && i < CFG_FLEET_MAX_ENDPOINTS; i++) {
        size_t k = cfg_path_index(c, (size_t)i);
        const cJSON *v = cJSON_GetArrayItem(a, i);
        const char *why = NULL;
        cfg_url_t u;
        if (!cJSON_IsString(v)) {
            cfg_err(c, NULL, "expected a URL string (http://host:2379)");
        } else if (cfg_parse_url(v->valuestring, &u, &why) != 0) {
            cfg_err(c, NULL, "%s", why);
        } else if (u.path && u.path[0]) {
            cfg_err(c, NULL, "an etcd endpoint has no path (http://host:2379)");
            cfg_url_free(&u);
        } else {
            f->endpoints[f->nendpoints++] = u;
        }
        cfg_path_pop(c, k);
    }
    cfg_path_pop(c, mark);
}

static void parse_etcd_tls(cfg_ctx_t *c, const cJSON *o, cfg_fleet_t *f)
{
    const cJSON *t = cfg_get_obj(c, o, "tls", false);
    if (t == NULL)
        return;
    size_t mark = cfg_path_key(c, "tls");
    cfg_check_keys(c, t, etcd_tls_keys);
    if (cfg_get_path(c, t, "ca", false, &f->ca_file))
        cfg_check_ca_file(c, "ca", f->ca_file, false);
    bool cert = cfg_get_path(c, t, "cert", false, &f->cert_file);
    bool key = cfg_get_path(c, t, "key", false, &f->key_file);
    if (cert != key)
        cfg_err(c, cert ? "key" : "cert", "cert and key go together (a client certificate)");
    else if (cert)
        cfg_check_key_pair(c, "cert", f->cert_file, "key", f->key_file);
    bool https = false;
    for (size_t i = 0; i < f->nendpoints; i++)
        https |= f->endpoints[i].tls;
    if (!https)
        cfg_err(c, NULL, "set, but no endpoint is https://");
    cfg_path_pop(c, mark);
}

static void parse_etcd(cfg_ctx_t *c, const cJSON *o, cfg_fleet_t *f)
{
    const cJSON *e = cfg_get_obj(c, o, "etcd", true);
    if (e == NULL)
        return;
    size_t mark = cfg_path_key(c, "etcd");
    cfg_check_keys(c, e, etcd_keys);
    parse_endpoints(c, e, f);
    parse_etcd_tls(c, e, f);
    bool user = cfg_get_str(c, e, "username", false, &f->username);
    bool pass = cfg_get_path(c, e, "password_file", false, &f->password_file);
    if (user && !pass)
        cfg_err(c, "password_file", "required with username");
    else if (pass && !user)
        cfg_err(c, "username", "required with password_file");
    else if (pass)
        f->password = cfg_read_secret(c, "password_file", f->password_file);
    cfg_path_pop(c, mark);
}

void cfg_parse_fleet(cfg_ctx_t *c, const cJSON *doc, cfg_t *cfg)
{
    const cJSON *o = cfg_get_obj(c, doc, "fleet", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "fleet");
    cfg_check_keys(c, o, fleet_keys);
    cfg_fleet_t *f = dp_xcalloc(1, sizeof(*f));
    cfg->fleet = f;
    f->lease_ttl_ms = 10000;
    if (cfg_get_str(c, o, "name", true, &f->name) && !key_segment(f->name, "-_.:"))
        cfg_err(c, "name", "use letters, digits, '-', '_', '.' and ':' (at most %d)", CFG_NAME_MAX);
    if (cfg_get_str(c, o, "instance", false, &f->instance) && !key_segment(f->instance, "-_.:"))
        cfg_err(c, "instance", "use letters, digits, '-', '_', '.' and ':' (at most %d)",
                CFG_NAME_MAX);
    cfg_get_u32(c, o, "lease_ttl_ms", 2000, 600000, &f->lease_ttl_ms);
    parse_etcd(c, o, f);
    if (f->instance == NULL) {
        /* The host name and the admin port: unique per pod, and per process on one host (with
         * admin_listen port 0, `run` puts the port it bound in place of the 0). */
        f->instance_default = true;
        char host[256] = "";
        if (gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0')
            snprintf(host, sizeof(host), "detproxy");
        dp_buf_t b = {0};
        dp_buf_printf(&b, "%s:%u", host, (unsigned)cfg->admin_listen.port);
        f->instance = dp_buf_steal(&b);
    }
    cfg_path_pop(c, mark);
}

void cfg_fleet_free(cfg_fleet_t *f)
{
    if (f == NULL)
        return;
    free(f->name);
    free(f->instance);
    for (size_t i = 0; i < f->nendpoints; i++)
        cfg_url_free(&f->endpoints[i]);
    free(f->endpoints);
    free(f->ca_file);
    free(f->cert_file);
    free(f->key_file);
    free(f->username);
    free(f->password_file);
    cfg_secret_free(f->password);
    free(f);
}

void cfg_fleet_dump(const cfg_fleet_t *f, dp_jw_t *w)
{
    if (f == NULL) {
        dp_jw_null(w, "fleet");
        return;
    }
    dp_jw_obj_begin(w, "fleet");
    dp_jw_str(w, "name", f->name);
    dp_jw_str(w, "instance", f->instance);
    dp_jw_obj_begin(w, "etcd");
    dp_jw_arr_begin(w, "endpoints");
    for (size_t i = 0; i < f->nendpoints; i++) {
        char url[300];
        snprintf(url, sizeof(url), "%s://%s", f->endpoints[i].tls ? "https" : "http",
                 f->endpoints[i].hostport);
        dp_jw_str(w, NULL, url);
    }
    dp_jw_arr_end(w);
    dp_jw_obj_begin(w, "tls");
    dp_jw_str(w, "ca", f->ca_file);
    dp_jw_str(w, "cert", f->cert_file);
    dp_jw_str(w, "key", f->key_file);
    dp_jw_obj_end(w);
    dp_jw_str(w, "username", f->username);
    dp_jw_str(w, "password_file", f->password_file);
    dp_jw_obj_end(w);
    dp_jw_uint(w, "lease_ttl_ms", f->lease_ttl_ms);
    dp_jw_obj_end(w);
}
