"""Affinity routing in front of real llama.cpp servers (docs/configuration.md, "Affinity routing"):
the turns of one conversation meet one replica, whose prompt cache then covers each turn's whole
history; and in a pool where one replica runs `-fa off` (same file and metadata, other
temperature-0 outputs), every prompt gets one answer however often it is sent.

Uses scripts/real-engine.sh (DETPROXY_REAL_ENGINE overrides the path); prints SKIPPED and exits
77 when it is missing or the Debian archive cannot be reached. Measured numbers are printed as
`measured: {...}` lines; bench/affinity.py is the full measurement."""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from realutil import require_engine, servers, stop_servers  # noqa: E402
from harness import post_json, run_tests  # noqa: E402 (realutil puts it on the path)
from proxyutil import start_proxy  # noqa: E402

TMP = tempfile.mkdtemp(prefix="detproxy-real-affinity-")
# The model's context is lifted to 8192 so a slot holds a 2 KB system prompt and its history.
FLAGS = ["-c", "16384", "--override-kv", "llama.context_length=int:8192"]
SYSTEM = ("You are the support assistant of a small bookshop. Answer in one short sentence. "
          * 26)[:2048]

require_engine()


def replicas(*extra_flags):
    """One llama-server per entry of extra_flags (added to FLAGS); their URLs."""
    return servers("aff", [FLAGS + list(f) for f in extra_flags])


def proxy(urls):
    pool = {"name": "p", "models": ["*"], "balance": "affinity",
            "replicas": [{"name": "r%d" % (i + 1), "url": u} for i, u in enumerate(urls)]}
    return start_proxy(pools=[pool], directory=TMP, timeout=30,
                       policy={"tenants": [{"name": "t", "match": {"any": True}}]})


def test_a_conversation_stays_on_the_replica_holding_its_history():
    px = proxy(replicas([], [], []))
    try:
        stats = []
        for conv in range(4):
            msgs = [{"role": "system", "content": SYSTEM}]
            prev_prompt, home = None, None
            for turn in range(5):
                msgs.append({"role": "user", "content": "Customer %d, question %d: is book %d "
                             "in stock?" % (conv, turn, conv * 7 + turn)})
                r = post_json(px.port, "/v1/chat/completions",
                              {"model": "tiny", "messages": msgs, "max_tokens": 8,
                               "temperature": 0})
                assert r.status == 200, r
                rep = r.headers["x-detproxy-replica"]
                assert r.headers["x-detproxy-affinity"] == "hit", r.headers
                assert home in (None, rep), (conv, turn, home, rep)
                home = rep
                body = r.json()
                usage = body["usage"]
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                assert cached == body["timings"]["cache_n"], body["timings"]
                if prev_prompt is not None:
                    # The whole previous turn (its prompt and more) came from the cache.
                    assert cached >= prev_prompt, (conv, turn, cached, prev_prompt)
                prev_prompt = usage["prompt_tokens"]
                stats.append((cached, usage["prompt_tokens"]))
                msgs.append(body["choices"][0]["message"])
        later = [s for i, s in enumerate(stats) if i % 5]
        print("measured: " + json.dumps({
            "later_turns_cached_ratio": round(sum(c for c, _ in later) / sum(p for _, p in later),
                                              3)}), flush=True)
    finally:
        px.stop()
        stop_servers()


def test_one_prompt_one_answer_in_a_pool_with_a_fa_off_replica():
    px = proxy(replicas([], [], ["-fa", "off"]))
    try:
        answers = {}
        for send in range(3):
            for p in range(12):
                r = post_json(px.port, "/v1/completions",
                              {"model": "tiny", "prompt": "Note %d: the shop opens at nine and the"
                               % p, "max_tokens": 64, "temperature": 0})
                assert r.status == 200, r
                answers.setdefault(p, set()).add((r.headers["x-detproxy-replica"],
                                                  r.json()["choices"][0]["text"]))
        assert all(len(v) == 1 for v in answers.values()), {
            p: sorted(v) for p, v in answers.items() if len(v) > 1}
        met_r3 = sum(1 for v in answers.values() if next(iter(v))[0] == "r3")
        print("measured: " + json.dumps({"prompts": len(answers), "answers_per_prompt": 1,
                                         "prompts_homed_on_fa_off": met_r3}), flush=True)
    finally:
        px.stop()
        stop_servers()


if __name__ == "__main__":
    try:
        run_tests(globals())
    finally:
        stop_servers()
