#include "tests/sim/sim_attest.h"

#include <string.h>

#include "attest/report.h"
#include "common/util.h"

static void fill_report(attest_report_t *r, const sim_identity_t *id)
{
    attest_report_set(r, ATTEST_F_MODEL, id->model);
    attest_report_set(r, ATTEST_F_CHECKPOINT, id->checkpoint_sha256);
    attest_report_set(r, ATTEST_F_QUANTIZATION, sim_identity_reported_quantization(id));
    attest_report_set(r, ATTEST_F_DTYPE, id->dtype);
    attest_report_set(r, ATTEST_F_FRAMEWORK_NAME, sim_flavor_name(id->flavor));
    attest_report_set(r, ATTEST_F_FRAMEWORK_VERSION, id->framework_version);
}

/* An envelope with an empty signature list: what an agent without a key would send. */
static void unsigned_envelope(const attest_report_t *r, const char *nonce, dp_buf_t *out)
{
    char ts[32];
    dp_iso8601(ts, dp_wall_ms());
    attest_report_t view = *r;
    view.nonce = (char *)nonce;
    view.issued_at = ts;
    dp_buf_t payload = {0};
    attest_payload_build(&view, &payload);
    dp_buf_printf(out, "{\"payloadType\":\"%s\",\"payload\":\"", ATTEST_PAYLOAD_TYPE);
    dp_base64_encode(payload.base, payload.len, out);
    dp_buf_appends(out, "\",\"signatures\":[]}");
    dp_buf_free(&payload);
}

/* Flip one character of the first signature so it no longer verifies but still decodes. */
static void corrupt_signature(dp_buf_t *env, size_t from)
{
    static const char key[] = "\"sig\":\"";
    char *p = strstr(env->base + from, key);
    if (p == NULL)
        return;
    p += sizeof(key) - 1;
    *p = *p == 'A' ? 'B' : 'A';
}

int sim_attest_envelope(const attest_key_t *key, const sim_identity_t *id, const char *nonce,
                        sim_attest_fault_t fault, dp_buf_t *out, dp_buf_t *err)
{
    attest_report_t r = {0};
    fill_report(&r, id);
    int rc = 0;
    size_t start = out->len;
    switch (fault) {
    case SIM_AFAULT_UNSIGNED:
        unsigned_envelope(&r, nonce, out);
        break;
    case SIM_AFAULT_WRONG_NONCE: {
        /* A stale answer: signed correctly, for somebody else's nonce. */
        dp_buf_t other = {0};
        dp_buf_printf(&other, "replayed-%s", nonce);
        rc = attest_envelope_for(key, &r, other.base, 0, out, err);
        dp_buf_free(&other);
        break;
    }
    case SIM_AFAULT_BAD_SIGNATURE:
        rc = attest_envelope_for(key, &r, nonce, 0, out, err);
        if (rc == 0)
            corrupt_signature(out, start);
        break;
    default:
        rc = attest_envelope_for(key, &r, nonce, 0, out, err);
        break;
    }
    attest_report_clear(&r);
    return rc;
}
