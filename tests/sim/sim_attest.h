/* detproxy-sim's /attestation: the identity it reports, signed as a DSSE envelope with the key
 * given by --attest-key (attest/dsse.h does the signing), or deliberately broken for tests. */
#ifndef SIM_ATTEST_H
#define SIM_ATTEST_H

#include "attest/dsse.h"
#include "common/buf.h"
#include "tests/sim/sim_flavor.h"
#include "tests/sim/sim_server.h"

/* Append the envelope answering `nonce` to out. The payload carries the *reported*
 * quantization (--report-quantization), the framework as the flavor's name and version.
 * Returns 0, or -1 with a reason in *err. */
int sim_attest_envelope(const attest_key_t *key, const sim_identity_t *id, const char *nonce,
                        sim_attest_fault_t fault, dp_buf_t *out, dp_buf_t *err);

#endif
