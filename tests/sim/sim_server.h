/* detproxy-sim's HTTP side: routes, generation jobs driven by timers, faults, test-only
 * endpoints. sim_main.c parses flags into a sim_config_t and hands it over. */
#ifndef SIM_SERVER_H
#define SIM_SERVER_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "tests/sim/sim_flavor.h"

typedef enum {
    SIM_FAULT_NONE = 0,
    SIM_FAULT_CLOSE_BEFORE_RESPONSE, /* read the request, close without a byte of answer */
    SIM_FAULT_HANG,                  /* never answer */
    SIM_FAULT_GARBAGE,               /* non-HTTP bytes, then close */
    SIM_FAULT_DIE_MID_STREAM,        /* a few tokens, then close without the final chunk */
    SIM_FAULT_BAD_FRAMING,           /* both Content-Length and Transfer-Encoding */
    SIM_FAULT_ERROR_500,             /* an OpenAI-shaped 500 */
    SIM_FAULT_CODED,                 /* a 200 that says Content-Encoding: gzip */
    SIM_FAULT_WRONG_TYPE,            /* a 200 JSON answer sent as text/plain */
    SIM_FAULT_TRICKLE,               /* a 200 whose body comes a byte at a time, never ending */
    SIM_FAULT__COUNT
} sim_fault_t;

typedef enum {
    SIM_AFAULT_NONE = 0,
    SIM_AFAULT_WRONG_NONCE,   /* sign a different nonce (a replay) */
    SIM_AFAULT_BAD_SIGNATURE, /* corrupt the signature */
    SIM_AFAULT_UNSIGNED,      /* an envelope with no signatures */
    SIM_AFAULT_GARBAGE,       /* a body that is not JSON */
    SIM_AFAULT_HUGE,          /* a 10 MiB body */
    SIM_AFAULT_HANG,          /* never answer */
    SIM_AFAULT__COUNT
} sim_attest_fault_t;

typedef struct {
    sim_identity_t id;
    char host[64];
    uint16_t port;
    uint32_t token_delay_ms;
    /* A non-streamed generation whose client went away runs to its end (its answer dropped),
     * as llama.cpp's server does: it writes a non-streamed answer once, at the end, and only
     * then finds the connection gone. Without it the generation stops, as vLLM's does. */
    bool finish_abandoned;
    double noise;
    const char *attest_key_path; /* NULL: no /attestation */
    const char *tls_cert;        /* with tls_key: serve HTTPS (tests of upstream TLS) */
    const char *tls_key;
} sim_config_t;

/* "none", "close_before_response", ...; -1 when unknown. */
int sim_fault_parse(const char *s);
const char *sim_fault_name(sim_fault_t f);
int sim_attest_fault_parse(const char *s);
const char *sim_attest_fault_name(sim_attest_fault_t f);

/* Run the simulator until SIGTERM/SIGINT. Takes ownership of cfg->id. Returns the process exit
 * code: 0 on a clean stop, 2 for a bad --attest-key, 3 when the listener cannot start. */
int sim_run(sim_config_t *cfg);

#endif
