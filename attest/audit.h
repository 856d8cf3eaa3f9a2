/* The tamper-evident audit trail (docs/operations.md, "Evidence"): hash chain, signed checkpoints,
 * content-addressed body store, and the offline verifier behind `detproxy audit verify`.
 *
 * Chain: every line ends with "prev_sha256":"<hex>", the SHA-256 of the previous line's bytes as
 * written (without its '\n'). The first line of a file names the last line of the previous file
 * (a checkpoint when a signing key is configured), or 64 zeros when there is none.
 *
 * Checkpoint line (one line, fields in this order, "sig" last):
 *   {"checkpoint":{"reason":"interval|reopen|shutdown","time":"...","lines":N,"seq":S},
 *    "prev_sha256":"<hex>","keyid":"<hex>","sig":"<base64>"}
 * sig is Ed25519 (the attestation key format, attest/dsse.h) over the line's bytes up to, not
 * including, `,"sig":"`. `lines` counts the lines since the previous checkpoint of the chain;
 * `seq` numbers the chain's checkpoints from 1. Because prev_sha256 covers everything before
 * it, one signature vouches for the whole history, and a checkpoint's (seq, SHA-256 of its
 * line) kept elsewhere (an anchor) pins the chain up to it: a file cut back before it, or a
 * history rewritten under it, no longer has it.
 *
 * Repair line: after a crash tore the file's last line, that file is set aside and the next
 * file starts with
 *   {"repair":{"reason":"torn_tail","file":"<name>","torn_offset":O,"torn_bytes":N,
 *    "torn_sha256":"<hex>","time":"..."},"prev_sha256":"<last complete line>"}
 * so the chain continues from the last complete line and the torn bytes are accounted for.
 *
 * Store: DIR/<sha256 hex> holds the bytes whose hash names it (written to a temporary name,
 * fsynced, then renamed, so a name never points at partial bytes).
 *
 * A line written although its bodies could not be stored (a full disk under audit_fail open)
 * says so itself: "bodies_stored":false, the member just before prev_sha256. Being part of the
 * chained bytes it cannot be added afterwards without breaking the chain, and it excuses only a
 * body file absent from the store: a body present must still hash to its name, and the chain,
 * checkpoints and anchors are checked as for any line. */
#ifndef ATTEST_AUDIT_H
#define ATTEST_AUDIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attest/dsse.h"
#include "common/buf.h"

#define AUDIT_GENESIS "0000000000000000000000000000000000000000000000000000000000000000"
/* The longest line audit verify takes (without its newline), and what is read back of an
 * existing file to resume its chain: the longest line with the newlines around it, and a torn
 * fragment of another as long after it, so a trail of lines verify takes always resumes. */
#define AUDIT_LINE_MAX (1u << 20)
#define AUDIT_TAIL_MAX (2 * AUDIT_LINE_MAX + 2)

typedef struct {
    char prev[65];             /* hash of the last line appended */
    uint64_t since_checkpoint; /* lines appended since the last checkpoint */
    uint64_t seq;              /* the last checkpoint's seq (0: none yet) */
    char checkpoint[65];       /* the last checkpoint line's SHA-256 ("" none) */
} audit_chain_t;

/* Bytes after a file's last '\n': a line a crash cut short. */
typedef struct {
    bool torn;
    uint64_t offset, len; /* where the fragment starts, how long it is */
    char sha256[65];      /* of the fragment's bytes */
} audit_torn_t;

void audit_chain_init(audit_chain_t *c);
/* Resume from the last complete line of an existing file (absent or empty file: genesis), and
 * the seq of its last checkpoint. With torn non-NULL, a fragment after the last '\n' is
 * described there. 0, or a negative errno (the chain is then left at genesis). */
int audit_chain_resume(audit_chain_t *c, const char *path);
int audit_chain_resume_torn(audit_chain_t *c, const char *path, audit_torn_t *torn);
/* Append the repair line (see above) for the fragment t of the file now named `file` and
 * advance the chain. */
void audit_chain_repair(audit_chain_t *c, const audit_torn_t *t, const char *file, uint64_t wall_ms,
                        dp_buf_t *out);
/* Append one JSON-object line (a trailing '\n' is optional) to out, with prev_sha256 spliced in
 * as its last member and a '\n'; advance the chain. -1 (nothing appended) if line is not an
 * object. */
int audit_chain_append(audit_chain_t *c, const char *line, size_t n, dp_buf_t *out);
/* The member a line whose bodies could not be stored carries (see above). */
#define AUDIT_UNSTORED_MEMBER "\"bodies_stored\":false"
/* audit_chain_append, with AUDIT_UNSTORED_MEMBER spliced in just before prev_sha256. */
int audit_chain_append_unstored(audit_chain_t *c, const char *line, size_t n, dp_buf_t *out);
/* Append a signed checkpoint line (reason: interval, reopen, shutdown) and advance the chain. */
int audit_chain_checkpoint(audit_chain_t *c, const attest_key_t *key, const char *reason,
                           uint64_t wall_ms, dp_buf_t *out);

/* write(2) until all n bytes are written (EINTR retried). 0 or a negative errno. */
int audit_write_all(int fd, const void *p, size_t n);

/* Store bytes as DIR/<hex> unless already there (same name, same bytes). 0 or negative errno;
 * *op names the failing step ("open", "write", "fsync", "rename"). */
int audit_store_put(const char *dir, const char *hex, const void *p, size_t n, const char **op);

/* A checkpoint known from elsewhere: the chain must hold checkpoint `seq` with this SHA-256. */
typedef struct {
    uint64_t seq;
    char sha256[65];
    bool found; /* set by the verifier */
} audit_anchor_t;

typedef struct {
    const attest_key_t *pubkey;      /* NULL: checkpoint signatures are not checked (reported) */
    const char *store;               /* NULL: stored bodies are not checked */
    const char *expect_prev;         /* the first line must name this (previous file's last line) */
    const audit_torn_t *expect_torn; /* the previous file ended torn: the first line repairs it */
    bool allow_torn;   /* a torn last line is reported in r->torn, not a break (the next file
                        * must repair it) */
    uint64_t prev_seq; /* the previous file's last checkpoint seq (0: unknown) */
    audit_anchor_t *anchors;
    size_t nanchors;
} audit_verify_opts_t;

typedef struct {
    uint64_t lines, checkpoints, signatures_checked, bodies_checked;
    uint64_t evidence_checked;    /* lines whose attestation evidence was found in the store */
    uint64_t unstored;            /* lines that say their bodies were not stored */
    uint64_t unstored_missing;    /* bodies those lines name that the store lacks (--store) */
    uint64_t unsigned_tail;       /* lines after the last checkpoint */
    char first_prev[65];          /* what the first line names */
    char last[65];                /* hash of the last line: the next file's expect_prev (no
                                   * complete line: expect_prev, passed through) */
    uint64_t first_seq, last_seq; /* checkpoint seqs seen (0: none) */
    audit_torn_t torn;            /* with allow_torn: the torn last line */
    bool repaired;                /* the first line is a repair line */
    uint64_t repaired_offset;
    char repaired_file[256];
    uint64_t bad_line; /* 1-based line of the first break, 0 when intact */
} audit_verify_result_t;

/* Verify a whole file. 0 intact; -1 with the first break in *why (and r->bad_line; 0 when the
 * file itself cannot be read). */
int audit_verify_file(const char *path, const audit_verify_opts_t *o, audit_verify_result_t *r,
                      dp_buf_t *why);

#endif
