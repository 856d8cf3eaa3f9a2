#include "common/log.h"

#include <assert.h>
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"

static _Atomic dp_log_level_t g_level = DP_LOG_INFO; /* set on reload, read by workers */
static int g_fd = 2;
static _Thread_local dp_buf_t g_line; /* per thread: workers log too */
static _Thread_local dp_jw_t g_jw;
static const char *const level_names[] = {"debug", "info", "warn", "error"};

void dp_log_thread_free(void)
{
    dp_buf_free(&g_line);
}

void dp_log_set_level(dp_log_level_t lvl)
{
    g_level = lvl;
}

dp_log_level_t dp_log_get_level(void)
{
    return g_level;
}

void dp_log_set_fd(int fd)
{
    g_fd = fd;
}

int dp_log_level_parse(const char *s)
{
    for (int i = 0; i < 4; i++)
        if (strcmp(s, level_names[i]) == 0)
            return i;
    return -1;
}

dp_jw_t *dp_log_begin(dp_log_level_t lvl, const char *msg)
{
    assert(lvl >= DP_LOG_DEBUG && lvl <= DP_LOG_ERROR);
    if (lvl < g_level)
        return NULL;
    char ts[32];
    dp_iso8601(ts, dp_wall_ms());
    dp_buf_reset(&g_line);
    dp_jw_init(&g_jw, &g_line);
    dp_jw_obj_begin(&g_jw, NULL);
    dp_jw_str(&g_jw, "ts", ts);
    dp_jw_str(&g_jw, "level", level_names[lvl]);
    dp_jw_str(&g_jw, "msg", msg);
    return &g_jw;
}

void dp_log_end(dp_jw_t *w)
{
    if (w == NULL)
        return;
    assert(w == &g_jw); /* the line dp_log_begin started on this thread */
    dp_jw_obj_end(w);
    dp_buf_appendc(w->out, '\n');
    const char *p = w->out->base;
    size_t n = w->out->len;
    while (n > 0) {
        ssize_t r = write(g_fd, p, n);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            break; /* stderr gone: nothing sensible left to do with a log line */
        }
        p += r;
        n -= (size_t)r;
    }
    /* Keep a small line buffer around, but do not hold on to a huge one. */
    if (g_line.cap > 65536)
        dp_buf_free(&g_line);
}

void dp_log_msg(dp_log_level_t lvl, const char *msg, const char *detail)
{
    dp_jw_t *w = dp_log_begin(lvl, msg);
    if (w == NULL)
        return;
    if (detail)
        dp_jw_str(w, "detail", detail);
    dp_log_end(w);
}
