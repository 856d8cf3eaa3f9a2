/* Output extraction: whole JSON bodies and incremental SSE streams (docs/drift.md §1).
 *
 * Both paths collect text per choice index and concatenate in index order at the end, so a
 * streamed n>1 response (whose choices' deltas interleave) yields the same bytes as the same
 * response unstreamed. The cap counts captured text across all choices. */
#include "drift/drift.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct drift_choice {
    dp_buf_t text;
    char finish[32]; /* finish reasons are short words; longer ones are cut */
    bool seen;
};

void drift_output_free(drift_output_t *o)
{
    dp_buf_free(&o->text);
    dp_buf_free(&o->finish);
    o->truncated = false;
    o->done = false;
}

static size_t cap_of(size_t max_output_bytes)
{
    return max_output_bytes ? max_output_bytes : DRIFT_DEFAULT_MAX_OUTPUT;
}

static void acc_free(drift_acc_t *a)
{
    for (uint32_t i = 0; i < a->n; i++)
        dp_buf_free(&a->v[i].text);
    free(a->v);
    a->v = NULL;
    a->n = 0;
}

static struct drift_choice *acc_slot(drift_acc_t *a, uint32_t idx)
{
    if (idx >= a->n) {
        a->v = dp_xrealloc(a->v, (size_t)(idx + 1) * sizeof(*a->v));
        memset(a->v + a->n, 0, (size_t)(idx + 1 - a->n) * sizeof(*a->v));
        a->n = idx + 1;
    }
    a->v[idx].seen = true;
    return &a->v[idx];
}

/* Append a JSON string's text to a choice, within the capture cap. */
static void acc_text(drift_acc_t *a, struct drift_choice *c, const cJSON *t)
{
    if (!cJSON_IsString(t) || t->valuestring == NULL)
        return;
    size_t n = strlen(t->valuestring);
    if (n > a->cap - a->captured) {
        n = a->cap - a->captured;
        a->truncated = true;
    }
    dp_buf_append(&c->text, t->valuestring, n);
    a->captured += n;
}

static void acc_finish_reason(struct drift_choice *c, const cJSON *f)
{
    if (!cJSON_IsString(f) || f->valuestring == NULL)
        return;
    size_t n = strlen(f->valuestring);
    if (n >= sizeof(c->finish))
        n = sizeof(c->finish) - 1;
    memcpy(c->finish, f->valuestring, n);
    c->finish[n] = '\0';
}

/* One choice object, from a full response or a chunk. The index comes from "index" when it is
 * a small non-negative integer, else from the array position. -1 when out of range. */
static int acc_choice(drift_acc_t *a, const cJSON *ch, int pos)
{
    if (!cJSON_IsObject(ch))
        return -1;
    double idxd = pos;
    const cJSON *ix = cJSON_GetObjectItemCaseSensitive(ch, "index");
    if (cJSON_IsNumber(ix))
        idxd = ix->valuedouble;
    if (!(idxd >= 0 && idxd < DRIFT_MAX_CHOICES) || idxd != (double)(int)idxd)
        return -1;
    struct drift_choice *c = acc_slot(a, (uint32_t)idxd);

    const cJSON *t = cJSON_GetObjectItemCaseSensitive(ch, "text");
    if (!cJSON_IsString(t)) {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(ch, "delta");
        if (!cJSON_IsObject(m))
            m = cJSON_GetObjectItemCaseSensitive(ch, "message");
        t = cJSON_IsObject(m) ? cJSON_GetObjectItemCaseSensitive(m, "content") : NULL;
    }
    acc_text(a, c, t);
    acc_finish_reason(c, cJSON_GetObjectItemCaseSensitive(ch, "finish_reason"));
    return 0;
}

/* /v1/responses. A whole response ("object": "response") has its text in the output_text parts
 * of its message items, in order, and its finish in "status" ("completed", "incomplete"). A
 * stream's events carry a "type": response.output_text.delta adds its delta, the terminal
 * response.completed / response.incomplete gives the status (its embedded copy of the whole output
 * is not added again), response.failed and error are errors, and every other event type is ignored.
 * All text goes to choice 0, so both forms give the same bytes. 1 when root was a Responses object
 * or event (handled), 0 when it is not one. -1 on error. */
static int acc_responses(drift_acc_t *a, const cJSON *root)
{
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(root, "type");
    const cJSON *object = cJSON_GetObjectItemCaseSensitive(root, "object");
    const cJSON *resp = NULL;
    if (cJSON_IsString(type) && strncmp(type->valuestring, "response.", 9) == 0) {
        const char *ty = type->valuestring + 9;
        if (strcmp(ty, "output_text.delta") == 0) {
            acc_text(a, acc_slot(a, 0), cJSON_GetObjectItemCaseSensitive(root, "delta"));
            return 1;
        }
        if (strcmp(ty, "failed") == 0)
            return -1;
        if (strcmp(ty, "completed") != 0 && strcmp(ty, "incomplete") != 0)
            return 1;
        resp = cJSON_GetObjectItemCaseSensitive(root, "response");
        if (!cJSON_IsObject(resp))
            return -1;
        acc_finish_reason(acc_slot(a, 0), cJSON_GetObjectItemCaseSensitive(resp, "status"));
        return 1;
    }
    if (cJSON_IsString(type) && strcmp(type->valuestring, "error") == 0)
        return -1;
    if (!cJSON_IsString(object) || strcmp(object->valuestring, "response") != 0)
        return 0;
    const cJSON *error = cJSON_GetObjectItemCaseSensitive(root, "error");
    if (error != NULL && !cJSON_IsNull(error))
        return -1;
    struct drift_choice *c = acc_slot(a, 0);
    const cJSON *output = cJSON_GetObjectItemCaseSensitive(root, "output");
    if (!cJSON_IsArray(output))
        return -1;
    const cJSON *item, *part;
    cJSON_ArrayForEach(item, output)
    {
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(item, "type");
        if (!cJSON_IsString(it) || strcmp(it->valuestring, "message") != 0)
            continue; /* reasoning, tool calls: not compared */
        cJSON_ArrayForEach(part, cJSON_GetObjectItemCaseSensitive(item, "content"))
        {
            const cJSON *pt = cJSON_GetObjectItemCaseSensitive(part, "type");
            if (cJSON_IsString(pt) && strcmp(pt->valuestring, "output_text") == 0)
                acc_text(a, c, cJSON_GetObjectItemCaseSensitive(part, "text"));
        }
    }
    acc_finish_reason(c, cJSON_GetObjectItemCaseSensitive(root, "status"));
    return 1;
}

/* A parsed response or chunk: its choices go into a. -1 for an error object or a bad shape.
 * A chunk without "choices" (a usage-only chunk) is fine when allow_missing is set. */
static int acc_object(drift_acc_t *a, const cJSON *root, bool allow_missing)
{
    if (!cJSON_IsObject(root))
        return -1;
    int rs = acc_responses(a, root);
    if (rs != 0)
        return rs < 0 ? -1 : 0;
    if (cJSON_GetObjectItemCaseSensitive(root, "error") != NULL)
        return -1;
    const cJSON *choices = cJSON_GetObjectItemCaseSensitive(root, "choices");
    if (choices == NULL && allow_missing)
        return 0;
    if (!cJSON_IsArray(choices))
        return -1;
    int pos = 0;
    const cJSON *ch;
    cJSON_ArrayForEach(ch, choices)
    {
        if (acc_choice(a, ch, pos++) < 0)
            return -1;
    }
    return 0;
}

/* Move the accumulated choices into out, in index order; a->v is released. A single choice's
 * buffer is handed over without a copy. */
static void acc_finish(drift_acc_t *a, drift_output_t *out)
{
    bool first = true;
    for (uint32_t i = 0; i < a->n; i++) {
        struct drift_choice *c = &a->v[i];
        if (!c->seen)
            continue;
        if (out->text.base == NULL) {
            out->text = c->text;
            memset(&c->text, 0, sizeof(c->text));
        } else {
            dp_buf_append(&out->text, c->text.base, c->text.len);
        }
        if (!first)
            dp_buf_appendc(&out->finish, ',');
        dp_buf_appends(&out->finish, c->finish);
        first = false;
    }
    /* Callers compare and hash base: never leave it NULL. */
    dp_buf_reserve(&out->text, 0);
    dp_buf_reserve(&out->finish, 0);
    out->text.base[out->text.len] = '\0';
    out->finish.base[out->finish.len] = '\0';
    if (out->text.len > a->cap) {
        out->text.len = a->cap;
        out->text.base[a->cap] = '\0';
        a->truncated = true;
    }
    out->truncated = a->truncated;
    acc_free(a);
}

int drift_extract_json(const char *body, size_t len, size_t max_output_bytes, drift_output_t *out)
{
    drift_output_free(out);
    /* Capture everything, then cut in index order in acc_finish: the body is already whole. */
    drift_acc_t a = {.cap = SIZE_MAX};
    cJSON *root = cJSON_ParseWithLength(body, len);
    if (root == NULL)
        goto fail_parse;
    if (acc_object(&a, root, false) < 0)
        goto fail_shape;
    cJSON_Delete(root);
    a.cap = cap_of(max_output_bytes);
    acc_finish(&a, out);
    return 0;

fail_shape:
    cJSON_Delete(root);
    acc_free(&a);
fail_parse:
    return -EINVAL;
}

/* ---- SSE ----------------------------------------------------------------------------------- */

static size_t event_cap(const drift_sse_t *st)
{
    return cap_of(st->max_output_bytes) + DRIFT_SSE_EVENT_SLACK;
}

/* Dispatch the buffered event. 0 normally, 1 for [DONE], -1 on error. */
static int dispatch(drift_sse_t *st)
{
    int rc = 0;
    if (st->skipping) {
        st->skipping = false;
        goto out;
    }
    if (st->data.len <= 1)
        goto out;   /* no data field, or empty data: nothing to extract */
    st->data.len--; /* each data line ends with '\n'; the last one is not part of the data */
    st->data.base[st->data.len] = '\0';
    if (st->data.len == 6 && memcmp(st->data.base, "[DONE]", 6) == 0) {
        rc = 1;
        goto out;
    }
    cJSON *root = cJSON_ParseWithLength(st->data.base, st->data.len);
    rc = root != NULL && acc_object(&st->acc, root, true) == 0 ? 0 : -1;
    cJSON_Delete(root);
out:
    dp_buf_reset(&st->data);
    return rc;
}

/* One complete, non-empty line (without its terminator) of an event not being skipped. */
static void on_field(drift_sse_t *st, const char *s, size_t n)
{
    if (s[0] == ':')
        return; /* comment */
    const char *colon = memchr(s, ':', n);
    size_t flen = colon ? (size_t)(colon - s) : n;
    if (flen != 4 || memcmp(s, "data", 4) != 0)
        return; /* event, id, retry and unknown fields do not change the output */
    const char *v = colon ? colon + 1 : s + n;
    size_t vlen = (size_t)(s + n - v);
    if (vlen > 0 && v[0] == ' ') {
        v++;
        vlen--;
    }
    if (st->data.len + vlen + 1 > event_cap(st)) {
        dp_buf_reset(&st->data);
        st->skipping = true;
        st->acc.truncated = true;
        return;
    }
    dp_buf_append(&st->data, v, vlen);
    dp_buf_appendc(&st->data, '\n');
}

/* Append part of a line to the line buffer, or start skipping when the event outgrows its cap.
 * line_bytes counts even skipped bytes: an empty line (the event's end) must stay visible. */
static void line_append(drift_sse_t *st, const char *p, size_t n)
{
    st->line_bytes += n;
    if (st->skipping || n == 0)
        return;
    if (st->line.len + st->data.len + n > event_cap(st)) {
        dp_buf_reset(&st->line);
        dp_buf_reset(&st->data);
        st->skipping = true;
        st->acc.truncated = true;
        return;
    }
    dp_buf_append(&st->line, p, n);
}

/* The current line is complete. Same return as dispatch. */
static int end_line(drift_sse_t *st)
{
    int rc = 0;
    if (st->line_bytes == 0)
        rc = dispatch(st);
    else if (!st->skipping)
        on_field(st, st->line.base, st->line.len);
    dp_buf_reset(&st->line);
    st->line_bytes = 0;
    return rc;
}

long drift_sse_feed(drift_sse_t *st, const char *p, size_t n)
{
    if (st->failed)
        return -1;
    st->acc.cap = cap_of(st->max_output_bytes);
    if (st->done) {
        /* The LF of the [DONE] event's final CRLF, when it arrives in a later read. */
        bool lf = st->cr_seen && n > 0 && p[0] == '\n';
        st->cr_seen = false;
        return lf ? 1 : 0;
    }
    size_t i = 0;
    while (i < n) {
        if (st->cr_seen) {
            st->cr_seen = false;
            if (p[i] == '\n') {
                i++; /* the LF of a CRLF split across two reads */
                continue;
            }
        }
        size_t j = i;
        while (j < n && p[j] != '\n' && p[j] != '\r')
            j++;
        line_append(st, p + i, j - i);
        if (j == n)
            break;
        st->cr_seen = p[j] == '\r';
        i = j + 1;
        int rc = end_line(st);
        if (rc < 0) {
            st->failed = true;
            return -1;
        }
        if (rc == 1) {
            /* cr_seen survives only when the CR was the last byte of this read */
            if (st->cr_seen && i < n) {
                if (p[i] == '\n')
                    i++;
                st->cr_seen = false;
            }
            st->done = true;
            return (long)i;
        }
    }
    return -2;
}

void drift_sse_free(drift_sse_t *st)
{
    acc_free(&st->acc);
    dp_buf_free(&st->line);
    dp_buf_free(&st->data);
    size_t max = st->max_output_bytes;
    memset(st, 0, sizeof(*st));
    st->max_output_bytes = max;
}

int drift_sse_finish(drift_sse_t *st, drift_output_t *out)
{
    drift_output_free(out);
    if (!st->failed && !st->done) {
        /* Lenient at EOF: a last line without terminator and an event without its blank line
         * still count (SSE would drop them; some servers close right after the last data). */
        int rc = 0;
        if (st->line_bytes > 0)
            rc = end_line(st);
        if (rc == 0)
            rc = end_line(st); /* the missing blank line */
        if (rc < 0)
            st->failed = true;
        else if (rc == 1)
            st->done = true;
    }
    if (st->failed) {
        drift_sse_free(st);
        return -1;
    }
    st->acc.cap = cap_of(st->max_output_bytes);
    acc_finish(&st->acc, out);
    out->done = st->done;
    drift_sse_free(st);
    return 0;
}
