"""Deterministic pools in front of real llama.cpp servers (docs/configuration.md, "Deterministic
pools"): `--kv-unified` replicas under concurrency give other temperature-0 outputs than each
prompt alone; the same replicas in a `single_sequence` pool (one request in flight per replica,
cache_prompt false) give the sequential outputs every time. The throughput both ways is the price,
printed as a `measured: {...}` line (docs/policy.md quotes it).

Uses scripts/real-engine.sh (DETPROXY_REAL_ENGINE overrides the path); prints SKIPPED and exits
77 when it is missing or the Debian archive cannot be reached."""

import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from realutil import require_engine, servers, stop_servers  # noqa: E402
from harness import post_json, run_tests  # noqa: E402 (realutil puts it on the path)
from proxyutil import start_proxy  # noqa: E402

TMP = tempfile.mkdtemp(prefix="detproxy-real-det-")
# llama-server's unified KV cache (its default without -np) batches the slots' sequences
# together: the batch a prompt lands in changes its temperature-0 output. -t 1: two replicas
# share the two cores.
FLAGS = ["--kv-unified", "-np", "4", "-t", "1"]
PROMPTS = ["Entry %d of the ledger: the shop sold %d books and" % (i, 3 * i + 1)
           for i in range(20)]
MAX_TOKENS = 64
ROUNDS = 4
CONCURRENCY = 8

require_engine()


def proxy(urls, manifest=None):
    pool = {"name": "p", "models": ["*"], "max_inflight_per_replica": 4,
            "replicas": [{"name": "r%d" % (i + 1), "url": u} for i, u in enumerate(urls)]}
    if manifest:
        pool["manifest"] = manifest
    return start_proxy(pools=[pool], directory=TMP, timeout=30,
                       attestation={"interval_ms": 600000, "timeout_ms": 5000},
                       policy={"tenants": [{"name": "t", "match": {"any": True}}]})


def ask(px, prompt):
    r = post_json(px.port, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                               "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status == 200, r
    return r.json()["choices"][0]["text"]


def several(px, extra):
    """A completion asking for 3 answers of PROMPTS[0] (n, or llama.cpp's n_cmpl), or for one
    answer to each of 3 prompts: the engine runs them as 3 sequences at once."""
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    body.update(extra)
    return post_json(px.port, "/v1/completions", body)


SEVERAL = [("n", {"n": 3}), ("n_cmpl", {"n_cmpl": 3}), ("prompt", {"prompt": PROMPTS[:3]})]


def rounds(px, reference, more=0):
    """ROUNDS passes over PROMPTS, CONCURRENCY at a time, and up to `more` passes after them
    while no answer has differed yet. Returns (prompts whose answer ever differed from its
    sequential one, answers that differed, requests per second, requests)."""
    diverged, wrong, n = set(), 0, 0
    lock = threading.Lock()
    t0 = time.monotonic()
    for r in range(ROUNDS + more):
        if r >= ROUNDS and wrong:
            break
        todo = list(range(len(PROMPTS)))

        def worker():
            nonlocal wrong, n
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop()
                text = ask(px, PROMPTS[i])
                with lock:
                    n += 1
                    if text != reference[i]:
                        wrong += 1
                        diverged.add(i)
        ts = [threading.Thread(target=worker) for _ in range(CONCURRENCY)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return diverged, wrong, n / (time.monotonic() - t0), n


def test_single_sequence_gives_the_sequential_answers_under_concurrency():
    urls = servers("det", [FLAGS, FLAGS])
    try:
        seq = proxy(urls, manifest={"framework": {"name": "llamacpp"},
                                    "determinism": {"mode": "single_sequence"}})
        try:
            # The reference: each prompt alone on its replica.
            reference = [ask(seq, p) for p in PROMPTS]
            seq_div, seq_wrong, seq_rps, seq_n = rounds(seq, reference)
            for key, extra in SEVERAL:
                r = several(seq, extra)
                assert r.status == 400 and r.json()["error"]["param"] == key, r
        finally:
            seq.stop()
        plain = proxy(urls)
        try:
            # Whether a batch changes an answer depends on how the requests meet in the
            # engine: a slower proxy (a sanitizer build) may need more passes to show it.
            plain_div, plain_wrong, plain_rps, plain_n = rounds(plain, reference, more=12)
            for _, extra in SEVERAL:  # what the single_sequence pool refused: 3 answers
                r = several(plain, extra)
                assert r.status == 200 and len(r.json()["choices"]) == 3, r
        finally:
            plain.stop()
        print("measured: " + json.dumps({
            "flags": " ".join(FLAGS), "prompts": len(PROMPTS), "max_tokens": MAX_TOKENS,
            "single_sequence_requests": seq_n, "plain_requests": plain_n,
            "client_concurrency": CONCURRENCY,
            "plain_prompts_diverged": len(plain_div), "plain_answers_diverged": plain_wrong,
            "single_sequence_prompts_diverged": len(seq_div),
            "single_sequence_answers_diverged": seq_wrong,
            "plain_requests_per_s": round(plain_rps, 2),
            "single_sequence_requests_per_s": round(seq_rps, 2)}), flush=True)
        assert seq_wrong == 0, sorted(seq_div)
        assert plain_wrong > 0, "the unified KV cache did not diverge in %d requests" % plain_n
    finally:
        stop_servers()


if __name__ == "__main__":
    run_tests(globals())
