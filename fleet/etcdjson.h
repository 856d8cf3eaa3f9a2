/* The etcd v3 JSON gateway's wire format (docs/fleet.md, "etcd"), without I/O: request bodies,
 * the fields of answers, and the splitter that cuts a watch stream into its JSON messages.
 *
 * The gateway speaks protobuf's JSON mapping: keys and values are base64, 64-bit integers are
 * JSON strings ("revision":"12"), fields at their zero value are left out (a PUT event has no
 * "type"; a keep-alive of a lease that is gone has no "TTL"). */
#ifndef FLEET_ETCDJSON_H
#define FLEET_ETCDJSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/buf.h"

/* The range_end that makes [prefix, end) every key starting with prefix: prefix with its last
 * byte below 0xff incremented (bytes after it dropped); "\0" (every key) when all are 0xff. */
void fleet_ej_range_end(const char *prefix, size_t n, dp_buf_t *out);

/* Request bodies, appended to out. lease 0: none. */
void fleet_ej_put(dp_buf_t *out, const char *key, const char *val, size_t vlen, int64_t lease);
void fleet_ej_range_prefix(dp_buf_t *out, const char *prefix);
/* The key under prefix written last (highest mod_revision), its key only. */
void fleet_ej_range_latest(dp_buf_t *out, const char *prefix);
void fleet_ej_delete(dp_buf_t *out, const char *key);
/* Compare-and-set: put key only when its mod_revision is mod_rev (0: only when absent). */
void fleet_ej_txn_cas(dp_buf_t *out, const char *key, int64_t mod_rev, const char *val, size_t vlen,
                      int64_t lease);
/* Put key only when it is absent; when it is not, the answer's responses[0].response_range
 * holds it (who has it, on which lease). With `mark` (NULL: none), a put that succeeds reads
 * that key (responses[1].response_range) and deletes it, in the same revision. */
void fleet_ej_txn_take(dp_buf_t *out, const char *key, const char *val, size_t vlen, int64_t lease,
                       const char *mark);
/* Delete key only while it is on lease (a key we wrote on it, whenever), and with `mark` (NULL:
 * none) put that key, on no lease, to mval in the same revision. */
void fleet_ej_txn_delete_on_lease(dp_buf_t *out, const char *key, int64_t lease, const char *mark,
                                  const char *mval, size_t mlen);
void fleet_ej_watch_create(dp_buf_t *out, const char *prefix, int64_t start_rev);
void fleet_ej_lease_grant(dp_buf_t *out, int64_t ttl_s);
void fleet_ej_lease_id(dp_buf_t *out, int64_t id); /* keepalive, revoke */
void fleet_ej_auth(dp_buf_t *out, const char *user, const char *password);

/* A 64-bit integer field (a JSON string of digits, or a number); def when absent or invalid. */
int64_t fleet_ej_int(const cJSON *o, const char *name, int64_t def);
/* Revisions above this are refused as no etcd's (their next would overflow). */
#define FLEET_REVISION_MAX (INT64_MAX / 2)
/* header.revision of an answer (0 when absent, or not a revision: FLEET_REVISION_MAX). */
int64_t fleet_ej_revision(const cJSON *res);
/* Field `name` of o as a revision (0 when absent, or not one). */
int64_t fleet_ej_rev(const cJSON *o, const char *name);

/* One key-value of an answer or an event, decoded. */
typedef struct {
    dp_buf_t key, value; /* NUL-terminated after decoding */
    int64_t mod_revision, create_revision, lease;
} fleet_kv_t;

/* Decode kv ({"key":b64,"value":b64,...}): 0, or -1 when a field is not valid base64 or the key
 * is missing. out's buffers are reset first; free them with fleet_kv_free. */
int fleet_ej_kv(const cJSON *kv, fleet_kv_t *out);
void fleet_kv_free(fleet_kv_t *kv);

/* The error an answer carries ({"error":..,"code":N,"message":..}), or NULL. */
const char *fleet_ej_error(const cJSON *res);

/* Cuts a stream of JSON objects (a watch, a keep-alive) into whole objects, whatever the chunk
 * boundaries; whitespace between objects is skipped, up to max bytes of it in a row. Zero-
 * initialise, set max (the largest object accepted), feed bytes. */
typedef struct {
    size_t max;
    dp_buf_t cur; /* the object being read */
    size_t gap;   /* whitespace since the last object */
    int depth;
    bool in_str, esc;
} fleet_ej_split_t;

/* Each whole object is passed to cb (p, n valid during the call; cb returns 0 to go on, non-zero
 * to stop: returned as is). -1: an object, or the whitespace before one, is larger than max, or
 * a byte outside any object is not whitespace. The splitter is unusable after an error (free it).
 */
typedef int (*fleet_ej_obj_cb)(const char *p, size_t n, void *data);
int fleet_ej_split_feed(fleet_ej_split_t *s, const char *p, size_t n, fleet_ej_obj_cb cb,
                        void *data);
void fleet_ej_split_free(fleet_ej_split_t *s);

#endif
