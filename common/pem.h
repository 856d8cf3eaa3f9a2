/* Keys from PEM text, by the one rule `detproxy check` and every reader at run time apply
 * (docs/configuration.md, "attestation"; docs/attestation.md): the Ed25519 keys of agents,
 * trust and the audit trail, and the EC keys of OMS publishers. */
#ifndef DP_PEM_H
#define DP_PEM_H

#include <stdbool.h>
#include <stddef.h>

#include "common/buf.h"

struct evp_pkey_st;

/* The most bytes a key file may hold: `detproxy check` and every reader at run time refuse a
 * larger one alike. A key's PEM block is a few hundred bytes (an Ed25519 public key's about
 * 120); the rest of the room is for the whitespace allowed after it. */
#define DP_PEM_KEY_MAX (64 * 1024)

/* The key pem[0..len) holds, of any type: a private key (PKCS#8) when is_private, else a public
 * key (SubjectPublicKeyInfo). The text is that key's PEM block alone: "-----BEGIN" at its first
 * byte and nothing but whitespace after the block's END line (OpenSSL alone skips text before
 * a block and ignores what follows it, so a file with junk around its key, or a second key,
 * would read as the first key). An encrypted key is refused, never a passphrase asked for.
 * 0 with *out the key (the caller's: EVP_PKEY_free; its type the caller's to check); -1 with
 * *out NULL and *err (may be NULL) saying why, without naming the file. */
int dp_pem_key(const char *pem, size_t len, bool is_private, struct evp_pkey_st **out,
               dp_buf_t *err);
/* dp_pem_key for an Ed25519 key: any other type is refused ("key type is EC, expected
 * Ed25519"). */
int dp_pem_ed25519(const char *pem, size_t len, bool is_private, struct evp_pkey_st **out,
                   dp_buf_t *err);

#endif
