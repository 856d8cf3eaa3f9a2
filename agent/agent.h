/* agent/: `detproxy attest serve`, the replica-side attestation agent (docs/attestation.md §4).
 * It hashes the model directory (attest/hash.h), signs envelopes (attest/dsse.h), reads its
 * co-located framework through the proxy's own check (probe/probe.h) and serves
 * GET /attestation over net/. */
#ifndef AGENT_AGENT_H
#define AGENT_AGENT_H

/* `detproxy attest serve ...`. argv[0] is "serve". Returns the exit code (DP_EXIT_* of
 * common/args.h). */
int agent_cmd_serve(int argc, char **argv);

#endif
