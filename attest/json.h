/* Reading what a replica, an agent or an envelope says, as strictly as the proxy reads a
 * request body: cJSON alone takes things two readers of the same bytes disagree on, and an
 * identity must read one way to everyone (the proxy, `detproxy attest verify`, an auditor's
 * jq or Python):
 *   - a string holding a NUL ("F16\u0000Q8_0"): cJSON's C string ends at it ("F16");
 *   - a key twice in one object: cJSON finds the first, most readers keep the last;
 *   - bytes after the value: cJSON stops reading at its end.
 * Each is refused, with why. */
#ifndef DP_ATTEST_JSON_H
#define DP_ATTEST_JSON_H

#include <stddef.h>

#include <cjson/cJSON.h>

/* The document in json[0..len), or NULL with *why set to a static reason. */
cJSON *attest_json_parse(const char *json, size_t len, const char **why);

#endif
