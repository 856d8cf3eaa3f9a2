/* Internal to attest/oms*.c: the parsed bundle (oms_bundle.c) that the verifier (oms.c) reads. */
#ifndef ATTEST_OMS_INT_H
#define ATTEST_OMS_INT_H

#include "attest/oms.h"

/* One resource: a whole file (files) or one byte range of a file (shards). */
typedef struct {
    char *name; /* as signed */
    char *path; /* the file: name, or name without ":<start>:<end>" */
    uint64_t start, end;
    uint8_t digest[64];
    bool seen;
} oms_res_t;

struct oms_bundle_s {
    oms_method_t method;
    char *key_hint;   /* publicKey.hint, or NULL */
    dp_buf_t key_raw; /* publicKey.rawBytes decoded (older bundles), empty if absent */
    dp_buf_t *certs;  /* x509CertificateChain.certificates[].rawBytes decoded, leaf first; for
                       * method sigstore the one verificationMaterial.certificate */
    size_t ncerts;
    void *material;   /* method sigstore: a copy of verificationMaterial (cJSON), else NULL */
    dp_buf_t payload; /* the decoded DSSE payload (the signed bytes) */
    dp_buf_t *sigs;   /* decoded signatures */
    size_t nsigs;
    char root_digest[65];
    bool shards;
    uint64_t shard_size;
    char hash_type[16];  /* "sha256", "blake2b" */
    const char *md_name; /* OpenSSL name */
    size_t digest_len;   /* bytes */
    bool allow_symlinks;
    char **ignore;
    size_t nignore;
    oms_res_t *res; /* as signed: sorted by name */
    size_t nres;
    oms_res_t **by_path; /* the same, sorted by (path, start) */
};

/* A value from the bundle for a message: sanitised and cut (attest_abbrev); tmp is reset. */
const char *oms_bundle_shown(const char *v, dp_buf_t *tmp);
bool oms_bundle_utf8_valid(const char *s);
/* strcmp for qsort/bsearch over an array of char *. */
int oms_bundle_cmp_strp(const void *a, const void *b);

#endif
