/* The tamper-evident audit trail (docs/operations.md, "Evidence"): hash chain, signed checkpoints,
 * content-addressed body store, and the offline verifier behind `detproxy audit verify`.
 *
 * Chain: every line ends with "prev_sha256":"<hex>", the SHA-256 of the previous line's bytes as
 * written (without its '\n'). The first line of a file names the last line of the previous file
 * (a checkpoint when a signing key is configured), or 64 zeros when there is none.
 *
 * Checkpoint line (one line, fields in this order, "sig" last):
 *   {"checkpoint":{"reason":"interval|reopen|shutdown","time":"...","lines":N},
 *    "prev_sha256":"<hex>","keyid":"<hex>","sig":"<base64>"}
 * sig is Ed25519 (the attestation key format, attest/dsse.h) over the line's bytes up to, not
 * including, `,"sig":"`. `lines` counts the lines since the previous checkpoint of the chain.
 * Because prev_sha256 covers everything before it, one signature vouches for the whole history.
 *
 * Store: DIR/<sha256 hex> holds the bytes whose hash names it (written to a temporary name,
 * fsynced, then renamed, so a name never points at partial bytes). */
#ifndef ATTEST_AUDIT_H
#define ATTEST_AUDIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attest/dsse.h"
#include "common/buf.h"

#define AUDIT_GENESIS "0000000000000000000000000000000000000000000000000000000000000000"
/* What is read back of an existing file to resume its chain; a line is far shorter. */
#define AUDIT_TAIL_MAX (1u << 20)
#define AUDIT_LINE_MAX (1u << 20)

typedef struct {
    char prev[65];             /* hash of the last line appended */
    uint64_t since_checkpoint; /* lines appended since the last checkpoint */
} audit_chain_t;

void audit_chain_init(audit_chain_t *c);
/* Resume from the last complete line of an existing file (absent or empty file: genesis).
 * 0, or a negative errno (the chain is then left at genesis). */
int audit_chain_resume(audit_chain_t *c, const char *path);
/* Append one JSON-object line (a trailing '\n' is optional) to out, with prev_sha256 spliced in
 * as its last member and a '\n'; advance the chain. -1 (nothing appended) if line is not an
 * object. */
int audit_chain_append(audit_chain_t *c, const char *line, size_t n, dp_buf_t *out);
/* Append a signed checkpoint line (reason: interval, reopen, shutdown) and advance the chain. */
int audit_chain_checkpoint(audit_chain_t *c, const attest_key_t *key, const char *reason,
                           uint64_t wall_ms, dp_buf_t *out);

/* write(2) until all n bytes are written (EINTR retried). 0 or a negative errno. */
int audit_write_all(int fd, const void *p, size_t n);

/* Store bytes as DIR/<hex> unless already there (same name, same bytes). 0 or negative errno;
 * *op names the failing step ("open", "write", "fsync", "rename"). */
int audit_store_put(const char *dir, const char *hex, const void *p, size_t n, const char **op);

typedef struct {
    const attest_key_t *pubkey; /* NULL: checkpoint signatures are not checked (reported) */
    const char *store;          /* NULL: stored bodies are not checked */
    const char *expect_prev;    /* the first line must name this (previous file's last line) */
} audit_verify_opts_t;

typedef struct {
    uint64_t lines, checkpoints, signatures_checked, bodies_checked;
    uint64_t unsigned_tail; /* lines after the last checkpoint */
    char first_prev[65];    /* what the first line names */
    char last[65];          /* hash of the last line: the next file's expect_prev */
    uint64_t bad_line;      /* 1-based line of the first break, 0 when intact */
} audit_verify_result_t;

/* Verify a whole file. 0 intact; -1 with the first break in *why (and r->bad_line; 0 when the
 * file itself cannot be read). */
int audit_verify_file(const char *path, const audit_verify_opts_t *o, audit_verify_result_t *r,
                      dp_buf_t *why);

#endif
