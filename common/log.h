/* JSON-lines logging to stderr: one object per line, always with ts, level and msg, so an
 * operator can grep or jq them. Single-threaded by design (the event loop); worker threads
 * (uv_queue_work) must hand results back to the loop instead of logging. */
#ifndef DP_LOG_H
#define DP_LOG_H

#include "common/jw.h"

typedef enum { DP_LOG_DEBUG = 0, DP_LOG_INFO, DP_LOG_WARN, DP_LOG_ERROR } dp_log_level_t;

void dp_log_set_level(dp_log_level_t lvl);
dp_log_level_t dp_log_get_level(void);
/* Parse "debug|info|warn|error"; returns -1 when unknown. */
int dp_log_level_parse(const char *s);
/* Redirect log output (tests); default is fd 2. */
void dp_log_set_fd(int fd);
/* Free the calling thread's line buffer (a thread that ends). Lines are built per thread and
 * written with one write(2) each, so threads never interleave within a line. */
void dp_log_thread_free(void);

/* Start a line; returns NULL when the level is filtered out (callers skip building fields).
 * Add fields with dp_jw_* then finish with dp_log_end, which writes the line in one write(2). */
dp_jw_t *dp_log_begin(dp_log_level_t lvl, const char *msg);
void dp_log_end(dp_jw_t *w);

/* Convenience: a line with only a message and an optional "detail" string. */
void dp_log_msg(dp_log_level_t lvl, const char *msg, const char *detail);

#endif
