/* DNS discovery of replicas (docs/configuration.md "discovery"). */
#ifndef PX_DISCOVERY_H
#define PX_DISCOVERY_H

#include "proxy/core/px.h"

/* Start discovering for pools that have `discovery`, stop for pools that lost it, and put the
 * discovered replicas into the current generation's pools (start-up and every reload). */
void px_discovery_sync(px_t *px);
/* Stop every lookup and release the discovered replicas (shutdown). */
void px_discovery_stop(px_t *px);

#endif
