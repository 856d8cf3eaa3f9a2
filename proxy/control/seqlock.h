/* One sequence per engine across a fleet (docs/fleet.md, "One sequence per engine across the
 * fleet"). An engine a single_sequence pool names runs a request of this member only while the
 * member holds the engine's key, engines/<id> under the fleet's prefix, written on its lease
 * with a transaction that succeeds only when the key is absent. The member takes the key when
 * a request, of a client or its own, finds it missing (px_engine_t.want), lets go of it when
 * nothing has run on the engine for PX_SEQLOCK_IDLE_MS, or after holding it PX_SEQLOCK_HOLD_MS
 * while others may wait, and
 * does not take it again for PX_SEQLOCK_BACKOFF_MS after letting go, so members take turns.
 * Without etcd (not yet connected, lease lost) nothing new starts on such an engine: a member
 * that cannot know whether another runs a sequence there does not start one. A member that dies
 * holding a key holds it until its lease expires. A key let go of clean leaves a mark,
 * idle/<id>; one taken without it gets a start check on a llama.cpp engine before anything
 * starts there (seqlock.c). Control thread. */
#ifndef PX_SEQLOCK_H
#define PX_SEQLOCK_H

#include <stdbool.h>
#include <stdint.h>

#include "common/jw.h"
#include "fleet/etcd.h"
#include "proxy/core/types.h"

#define PX_SEQLOCK_TICK_MS 10
#define PX_SEQLOCK_HOLD_MS 1000
/* An idle key is kept this long after it was taken or last ran something: requests that look
 * for a slot on timers of their own (checks, relays: every 10 ms) find it held. */
#define PX_SEQLOCK_IDLE_MS 50
#define PX_SEQLOCK_BACKOFF_MS 20
/* How long a clean stop waits for its marked releases before its lease is revoked. */
#define PX_SEQLOCK_LEAVE_MS 500
#define PX_SEQLOCK_RETRY_MS                                                                        \
    100 /* a key held elsewhere is tried again this often, or at its delete */

typedef struct px_seqlock_s px_seqlock_t;

/* keys under prefix ("/detproxy/<fleet>/"), written with instance's name in them. */
px_seqlock_t *px_seqlock_start(px_t *px, fleet_etcd_t *etcd, const char *prefix,
                               const char *instance);
/* The member's lease now (0 while it has none: not connected), and until when it surely lives
 * (dp_now_ms: the send time of the grant or keep-alive that set it, plus its TTL). A new lease
 * loses every key held on the old one. */
void px_seqlock_lease(px_seqlock_t *s, int64_t lease, uint64_t until_ms);
/* A key under engines/ changed (rel: the key after the prefix; lease: the one it is on; rev:
 * the revision of the change, 0 when not known). */
void px_seqlock_kv(px_seqlock_t *s, const char *rel, int64_t lease, int64_t rev, bool deleted);
/* "engines": [...] into an open object. */
void px_seqlock_json(px_seqlock_t *s, dp_jw_t *w);
/* Nothing new starts on its engines any more, and answers to its calls in flight are not read
 * (the caller may now end them). */
void px_seqlock_stop(px_seqlock_t *s);
/* After px_seqlock_stop; s goes once its calls have ended. With `then`, at a clean stop (nothing
 * of this member runs on any engine) and with the client's other calls ended: each key held
 * and known clean is let go of marked, as at any release, so the next taker needs no check, and
 * then(data) runs on a later turn of the loop once those answers are in, or after
 * PX_SEQLOCK_LEAVE_MS (at once when s is NULL). Without it, or for a key not known clean, the
 * key goes with the lease. */
void px_seqlock_close(px_seqlock_t *s, void (*then)(void *data), void *data);

#endif
