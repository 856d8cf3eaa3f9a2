/* Live reload of the configuration and of the client listener's certificate. */
#ifndef PX_RELOAD_H
#define PX_RELOAD_H

#include "common/buf.h"
#include "proxy/core/px.h"

/* Reload the configuration (SIGHUP, POST /admin/reload; why names the trigger). 0 on success;
 * -1 when the new one is invalid, PX_RELOAD_UNAVAILABLE when it is valid but what it names
 * cannot be had (a certificate the TLS library refuses, an audit path or store another process
 * locks): either way the running one stays, with the errors in msg if given;
 * PX_RELOAD_DRAINING once the process is stopping (nothing reloaded). The audit file is
 * reopened in every case (log rotation). */
#define PX_RELOAD_DRAINING (-2)
#define PX_RELOAD_UNAVAILABLE (-3)
int px_reload_msg(px_t *px, const char *why, dp_buf_t *msg);
int px_reload(px_t *px, const char *why);
/* (Re)load the client listener's certificate from the current config (start, SIGHUP): new
 * connections use the new one, open ones keep theirs. 0, or -1 (logged; the old one stays). */
int px_reload_tls(px_t *px);

#endif
