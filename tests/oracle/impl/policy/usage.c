/* Token usage from responses, for detproxy_tokens_total and the access log's tokens
 * (docs/operations.md §6): an incremental scanner over a response body, JSON or SSE, that finds
 * each `"usage": {...}` object and keeps the last one's prompt_tokens and completion_tokens. Only
 * the usage object itself is copied (at most POLICY_USAGE_CAP bytes); everything else is one
 * state-machine step per byte. */
#include <cjson/cJSON.h>
#include <string.h>

#include "policy/policy.h"

enum { ST_SCAN = 0, ST_AFTER_KEY, ST_AFTER_COLON, ST_CAPTURE };

static bool number(const cJSON *o, const char *key, int64_t *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 1e15 ||
        v->valuedouble != (double)(int64_t)v->valuedouble)
        return false;
    *out = (int64_t)v->valuedouble;
    return true;
}

static void captured(policy_usage_t *u)
{
    cJSON *o = cJSON_ParseWithLength(u->cap, u->clen);
    int64_t p, c;
    if (cJSON_IsObject(o) && number(o, "prompt_tokens", &p)) {
        /* A usage chunk without completion_tokens (an embeddings-shaped body) counts 0. */
        if (!number(o, "completion_tokens", &c))
            c = 0;
        u->found = true;
        u->prompt_tokens = p;
        u->completion_tokens = c;
    }
    cJSON_Delete(o);
}

void policy_usage_feed(policy_usage_t *u, const char *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char ch = p[i];
        if (ch == '\n') {
            /* JSON strings hold no raw newline: a newline ends any string (and an SSE event
             * line), so a truncated event cannot leave the scanner inside a string. */
            u->in_str = u->esc = false;
            if (u->st != ST_CAPTURE)
                continue;
        }
        if (u->st == ST_CAPTURE && u->clen >= sizeof(u->cap)) {
            /* Not a usage object of any engine we know: skip it, and scan this byte on. */
            u->st = ST_SCAN;
            u->klen = 0xff; /* a string cut here is a value's, or a key inside the object */
        }
        if (u->st == ST_CAPTURE) {
            u->cap[u->clen++] = ch;
            if (u->in_str) {
                if (u->esc)
                    u->esc = false;
                else if (ch == '\\')
                    u->esc = true;
                else if (ch == '"')
                    u->in_str = false;
            } else if (ch == '"') {
                u->in_str = true;
            } else if (ch == '{') {
                u->depth++;
            } else if (ch == '}' && --u->depth == 0) {
                captured(u);
                u->st = ST_SCAN;
            }
            continue;
        }
        if (u->in_str) {
            if (u->esc) {
                u->esc = false;
                u->klen = 0xff; /* an escaped key is never "usage" as engines write it */
            } else if (ch == '\\') {
                u->esc = true;
            } else if (ch == '"') {
                u->in_str = false;
                u->st = u->klen == 5 && memcmp(u->key, "usage", 5) == 0 ? ST_AFTER_KEY : ST_SCAN;
            } else if (u->klen < sizeof(u->key)) {
                u->key[u->klen++] = ch;
            } else {
                u->klen = 0xff;
            }
            continue;
        }
        if (ch == ' ' || ch == '\t' || ch == '\r')
            continue;
        if (ch == '"') {
            u->in_str = true;
            u->klen = 0;
            u->st = ST_SCAN;
        } else if (u->st == ST_AFTER_KEY && ch == ':') {
            u->st = ST_AFTER_COLON;
        } else if (u->st == ST_AFTER_COLON && ch == '{') {
            u->st = ST_CAPTURE;
            u->depth = 1;
            u->clen = 0;
            u->cap[u->clen++] = ch;
        } else {
            u->st = ST_SCAN;
        }
    }
}
