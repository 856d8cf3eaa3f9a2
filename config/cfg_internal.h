/* Private to config/: the validation context and the typed JSON readers every section parser
 * shares. Not part of the module's contract; other modules use config/config.h only.
 *
 * Every reader takes the object and a key, reports a problem at "<path>.<key>" and returns false
 * when the value is absent (or JSON null, which means absent everywhere) or invalid, leaving *out
 * untouched, so callers set defaults first and read over them. */
#ifndef DP_CFG_INTERNAL_H
#define DP_CFG_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/buf.h"
#include "common/jw.h"
#include "config/config.h"

/* Largest config, manifest or policy file read. */
#define CFG_DOC_MAX (4u << 20)
/* Longest duration a config accepts: a day. */
#define CFG_MS_MAX 86400000u

/* Where validation is. `path` is the JSON path of the value being read ("pools[1].manifest");
 * `file` is the referenced manifest or policy file being read, as the config names it (NULL in
 * the main document), shown as " (in FILE)" after each message; `root` names the document when
 * the path is empty ("config", "manifest"). */
typedef struct {
    cfg_errors_t *errs;
    dp_buf_t path;
    const char *file;
    const char *root;
    const char *dir; /* folder relative paths resolve against (absolute) */
    size_t nerrors;  /* errors this context added */
} cfg_ctx_t;

void cfg_ctx_init(cfg_ctx_t *c, cfg_errors_t *errs, const char *prefix, const char *root,
                  const char *dir);
void cfg_ctx_free(cfg_ctx_t *c);

/* Report at "<path>.<key>" (key NULL: at <path>). Messages must never contain secrets. */
void cfg_err(cfg_ctx_t *c, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void cfg_warn(cfg_ctx_t *c, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Descend into a key or an array index; returns a mark for cfg_path_pop. */
size_t cfg_path_key(cfg_ctx_t *c, const char *key);
size_t cfg_path_index(cfg_ctx_t *c, size_t i);
void cfg_path_pop(cfg_ctx_t *c, size_t mark);

/* Strings seen so far, each with a value (an index): for finding duplicates among a config's
 * entries in one pass, where comparing every pair would take minutes on a config of tens of
 * thousands of entries (a file may be 4 MiB). Keys are borrowed, not copied. */
typedef struct {
    const char **keys;
    size_t *vals;
    size_t cap, n;
} cfg_seen_t;
#define CFG_UNSEEN SIZE_MAX
/* The value key was first added with, or CFG_UNSEEN after adding it with val. */
size_t cfg_seen_add(cfg_seen_t *s, const char *key, size_t val);
/* The value key was added with, or CFG_UNSEEN; adds nothing. */
size_t cfg_seen_find(const cfg_seen_t *s, const char *key);
void cfg_seen_free(cfg_seen_t *s);

/* Parse a whole JSON document (no trailing bytes, no NUL inside). NULL after reporting
 * "invalid JSON at line L, column C" at the current path. */
cJSON *cfg_parse_json(cfg_ctx_t *c, const char *json, size_t len);

/* Report every key of obj not in the NULL-terminated `allowed` list, and duplicated keys.
 * Returns true when there were none. */
bool cfg_check_keys(cfg_ctx_t *c, const cJSON *obj, const char *const *allowed);
/* The value of key, or NULL when absent or JSON null. */
const cJSON *cfg_get(const cJSON *obj, const char *key);
/* obj[key] must be an object / array when present; reports otherwise. */
const cJSON *cfg_get_obj(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required);
const cJSON *cfg_get_arr(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required);

/* A non-empty string without control characters; *out is a fresh copy (free the old one). */
bool cfg_get_str(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required, char **out);
/* A path at obj[key], resolved against the config's folder. */
bool cfg_get_path(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required, char **out);
/* Free text (a prompt): any non-empty string, newlines included. */
bool cfg_get_text(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required, char **out);
bool cfg_get_uint(cfg_ctx_t *c, const cJSON *obj, const char *key, uint64_t lo, uint64_t hi,
                  uint64_t *out);
bool cfg_get_u32(cfg_ctx_t *c, const cJSON *obj, const char *key, uint32_t lo, uint32_t hi,
                 uint32_t *out);
bool cfg_get_num(cfg_ctx_t *c, const cJSON *obj, const char *key, double lo, double hi,
                 double *out);
bool cfg_get_bool(cfg_ctx_t *c, const cJSON *obj, const char *key, bool *out);
/* One of names[0..n-1]; *out is its index. */
bool cfg_get_enum(cfg_ctx_t *c, const cJSON *obj, const char *key, const char *const *names,
                  size_t n, int *out);
/* An array of non-empty strings (an empty array only when allow_empty). *out is replaced. */
bool cfg_get_str_array(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required,
                       bool allow_empty, char ***out, size_t *nout);
void cfg_str_array_free(char **a, size_t n);

/* Print a double as an operator wrote it: integral values without exponent. */
void cfg_fmt_num(char *out, size_t n, double v);

/* Identifier rule for pool, replica and tenant names: they end up in metric labels and response
 * headers. */
#define CFG_NAME_MAX 128
/* A name: 1-CFG_NAME_MAX of A-Z a-z 0-9 . _ - : /, with no empty, "." or ".." part between
 * slashes, and not "-" alone (the metrics' label value for no pool or tenant). CFG_NAME_RULE
 * says so, with CFG_NAME_MAX as its %d. */
bool cfg_valid_name(const char *s);
#define CFG_NAME_RULE                                                                              \
    "must be 1-%d characters of A-Z a-z 0-9 . _ - : /, with no empty, '.' or '..' part between "   \
    "slashes, and not '-' alone (the metrics' word for none)"
/* DNS host name (letters, digits, '-', '_' labels, 1-63 each, 253 total). */
bool cfg_valid_hostname(const char *s);
/* An HTTP field name (RFC 9110 token characters). */
bool cfg_valid_header_name(const char *s);
/* ASCII-lowercase s in place (header names are matched lowercase). */
void cfg_lowercase(char *s);

/* Join a possibly relative path onto dir. Caller frees. */
char *cfg_resolve(const char *dir, const char *p);

/* ---- addresses and URLs (addr.c) ---- */

/* An http(s) URL at obj[key]. */
bool cfg_get_url(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required, cfg_url_t *out);

/* ---- files (files.c) ---- */

/* Read a file of at most max bytes into out; reports "cannot read ..." at key. */
bool cfg_read_file(cfg_ctx_t *c, const char *key, const char *path, size_t max, dp_buf_t *out);
/* Kubernetes mounts a ConfigMap or a Secret as a folder whose files are links into `..data`, a
 * link to the current version's folder that the kubelet swaps when the object changes. Between
 * cfg_versions_begin and cfg_versions_end (one load), every file cfg_read_file reads through
 * such a link is read from the version the folder's first read found, so a swap during a load
 * cannot mix two versions of one object (the config of one, the policy of the other). */
void cfg_versions_begin(void);
void cfg_versions_end(void);
/* Did a read since cfg_versions_begin find its version removed (the kubelet deletes the old
 * one right after a swap)? Then the load is worth doing again, at the new version. */
bool cfg_versions_gone(void);
/* Read and parse the manifest or policy file a config value names (relative to the config).
 * On success c->file is set to rel, so errors inside name the file; the caller clears it. */
cJSON *cfg_read_referenced(cfg_ctx_t *c, const char *rel);
/* Read a secret: trailing whitespace trimmed, non-empty, at most 4 KiB, no control characters.
 * Warns when group or others may access it. NULL after reporting; never echoes content. */
char *cfg_read_secret(cfg_ctx_t *c, const char *key, const char *path);
/* Wipe, then free. */
void cfg_secret_free(char *s);
/* Warn when a secret file is accessible by group or others. */
void cfg_check_secret_mode(cfg_ctx_t *c, const char *key, const char *path);
/* PEM checks, each reporting at key. */
bool cfg_check_cert_file(cfg_ctx_t *c, const char *key, const char *path);
/* A CA file: readable, and every certificate in it one the TLS library loads (client_list: as
 * a listener's list of client CAs too). */
bool cfg_check_ca_file(cfg_ctx_t *c, const char *key, const char *path, bool client_list);
bool cfg_check_key_pair(cfg_ctx_t *c, const char *cert_key, const char *cert_path,
                        const char *key_key, const char *key_path);
bool cfg_check_ed25519_pubkey(cfg_ctx_t *c, const char *key, const char *path);
bool cfg_check_ed25519_privkey(cfg_ctx_t *c, const char *key, const char *path);

/* ---- config.c ---- */

/* Every limits.* key with its value (config.c owns the table of them). */
void cfg_limits_dump(const cfg_limits_t *l, dp_jw_t *w);

/* ---- fleet.c ---- */

void cfg_parse_fleet(cfg_ctx_t *c, const cJSON *doc, cfg_t *cfg);
void cfg_fleet_free(cfg_fleet_t *f);
void cfg_fleet_dump(const cfg_fleet_t *f, dp_jw_t *w);

/* ---- pool.c ---- */

void cfg_parse_pools(cfg_ctx_t *c, const cJSON *doc, cfg_t *cfg);
void cfg_pool_free(cfg_pool_t *p);

/* ---- manifest.c / policy.c: parse an already-parsed node at the context's path ----
 * They return what they could read even when they reported errors (NULL only when the node is
 * not an object), so checks across sections still run; the caller discards it on errors. */

cfg_manifest_t *cfg_manifest_from_json(cfg_ctx_t *c, const cJSON *node);
cfg_policy_t *cfg_policy_from_json(cfg_ctx_t *c, const cJSON *node);
/* The policy used when the config has none: one tenant "default" matching any request. */
cfg_policy_t *cfg_policy_default(void);
/* True when the manifest pins at least one identity field (canary does not count). */
bool cfg_manifest_pins(const cfg_manifest_t *m);

#endif
