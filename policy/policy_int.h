/* Policy-internal helpers shared by the module's .c files; not part of the contract. */
#ifndef DP_POLICY_INT_H
#define DP_POLICY_INT_H

#include "policy/jdoc.h"
#include "policy/policy.h"

/* Fill err (status 400 unless told otherwise); message is printf-formatted and truncated. */
void policy_set_error(policy_error_t *err, int status, const char *code, const char *param,
                      const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Turn a failed jdoc_parse into a 400 with a clear message. */
void policy_json_error(const jdoc_t *d, policy_error_t *err);
/* The usage of a body parsed whole (see policy_usage_t). */
void policy_usage_take_json(policy_usage_t *u, const jdoc_t *d);

/* The parsed request's tape (root object at token 0) and its route; for the module's other
 * readers of a parsed request (affinity.c). Valid until policy_req_reset / policy_req_free. */
const jdoc_t *policy_req_doc(const policy_req_t *r, policy_route_t *route);

#endif
