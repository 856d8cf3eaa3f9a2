/* RFC 8785 JSON Canonicalization Scheme (jcs.c): ECMAScript number printing and the canonical
 * form of a validated token tape (policy/jdoc.h). policy_jcs (policy.h) is the entry point that
 * takes JSON text; the seed derivation and the audit line use these directly. */
#ifndef DP_POLICY_JCS_H
#define DP_POLICY_JCS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "policy/jdoc.h"

/* v as ECMAScript's Number.prototype.toString prints it (shortest round-trip digits; 1e+21,
 * 1e-7, -0 -> "0"); NaN and infinities, which JSON cannot carry, print "null". out must hold 32
 * bytes; returns the length (NUL-terminated). Uses snprintf/strtod: assumes the "C" numeric
 * locale (the proxy never calls setlocale). */
size_t jcs_es_number(double v, char *out);

/* Canonical form of the subtree at tok. The tape must come from a parse without
 * JDOC_ALLOW_DUPS (objects carry their sorted member lists). */
void jcs_write(const jdoc_t *d, uint32_t tok, dp_buf_t *out);
/* A raw, validated JSON string literal (quotes included) re-escaped the JCS way. */
void jcs_write_raw_string(const char *raw, size_t n, bool has_escapes, dp_buf_t *out);

#endif
