#include "attest/json.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"

static int key_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A key twice in one object, at any depth. Sorted, not compared pairwise: an object may have
 * as many keys as the body's size allows. */
static bool duplicate_key(const cJSON *v)
{
    for (; v != NULL; v = v->next) {
        if (cJSON_IsObject(v)) {
            size_t n = 0;
            for (const cJSON *m = v->child; m; m = m->next)
                n++;
            const char **keys = malloc((n ? n : 1) * sizeof(*keys));
            if (keys == NULL)
                return true; /* out of memory: not read as fine */
            n = 0;
            for (const cJSON *m = v->child; m; m = m->next)
                keys[n++] = m->string;
            qsort(keys, n, sizeof(*keys), key_cmp);
            bool dup = false;
            for (size_t i = 1; i < n && !dup; i++)
                dup = strcmp(keys[i - 1], keys[i]) == 0;
            free(keys);
            if (dup)
                return true;
        }
        if ((cJSON_IsObject(v) || cJSON_IsArray(v)) && duplicate_key(v->child))
            return true;
    }
    return false;
}

cJSON *attest_json_parse(const char *json, size_t len, const char **why)
{
    /* A NUL byte is nowhere in valid JSON text, and cJSON would stop reading at it. */
    if (json == NULL || memchr(json, '\0', len) != NULL) {
        *why = "not valid JSON";
        return NULL;
    }
    if (cfg_json_nul_escape(json, len) < len) {
        *why = "a string holds a NUL character";
        return NULL;
    }
    const char *end = NULL;
    cJSON *doc = cJSON_ParseWithLengthOpts(json, len, &end, false);
    if (doc == NULL) {
        *why = "not valid JSON";
        return NULL;
    }
    while (end < json + len && (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r'))
        end++;
    if (end != json + len) {
        *why = "bytes after the JSON value";
        cJSON_Delete(doc);
        return NULL;
    }
    if (duplicate_key(doc)) {
        *why = "a key appears twice in one object";
        cJSON_Delete(doc);
        return NULL;
    }
    return doc;
}
