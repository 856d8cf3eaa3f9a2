#!/usr/bin/env python3
"""Affinity routing on real llama.cpp replicas (docs/configuration.md, "Affinity routing"):
prompt-cache reuse, time to first token and load spread for `affinity` vs `least_inflight` vs
`round_robin`, and the determinism side (a pool with one `-fa off` replica).

    bench/affinity.py [--engine real|sim] [--results bench/RESULTS.md] [--only cache|det]

Part 1, conversations: three replicas, 30 conversations x 8 turns, a shared 2 KB system prompt
and growing history (each turn adds the model's own answer and a new question), streamed, with
at most --concurrency requests in flight (30 conversations open at once, like users thinking
between turns). Per balance, fresh replicas (cold caches). llama.cpp reports prompt-cache reuse
as usage.prompt_tokens_details.cached_tokens (and timings.cache_n); time to first token is
measured at the client, through detproxy. Load spread: /admin/replicas in-flight counts sampled
every 20 ms, max/mean over the replicas (mean over samples with anything in flight), and the
requests each replica served (max/mean).

Part 2, determinism: replicas r1, r2 default, r3 with `-fa off` (same file, same metadata,
other temperature-0 outputs on many prompts); 50 prompts sent 5 times each at temperature 0,
64 tokens. Counted: prompts that got more than one distinct answer. Each balance one request at
a time (the order alone decides), then affinity with --concurrency requests in flight, where the
load bound may spill a prompt to its second replica, and the same with load_factor 100 (never).

--engine real (default) starts llama-server through scripts/real-engine.sh (override with
DETPROXY_REAL_ENGINE=path; its state directory is DETPROXY_REAL_DIR). --engine sim runs the same
routing on detproxy-sim replicas (no prompt cache there: cache columns are empty). Writes
section "### 8." of --results (replacing an older one). Needs a release build (make build).
"""
import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
sys.path.insert(0, HERE)

from harness import get_json, start_sim  # noqa: E402
from proxyutil import start_proxy  # noqa: E402

BALANCES = ["affinity", "least_inflight", "round_robin"]
MODEL = "tiny"
# 2048 bytes of plain English: the shared system prompt.
SYSTEM = ("You are the support assistant of a small bookshop. Answer in one short sentence, "
          "politely, and never invent titles that are not in the catalogue. ") * 20
SYSTEM = SYSTEM[:2048]
ENGINE_FLAGS = ["-c", "16384", "--override-kv", "llama.context_length=int:8192"]


# ---- replicas -----------------------------------------------------------------------------

class RealEngines:
    """llama-server replicas via scripts/real-engine.sh; names are prefixed to stay ours."""

    def __init__(self, base_port):
        self.script = os.environ.get("DETPROXY_REAL_ENGINE",
                                     os.path.join(ROOT, "scripts", "real-engine.sh"))
        self.base_port = base_port
        self.names = []

    def info(self):
        out = subprocess.run([self.script, "info"], capture_output=True, text=True)
        return dict(l.split("=", 1) for l in out.stdout.splitlines() if "=" in l)

    def start(self, flags_per_replica):
        urls = []
        for i, flags in enumerate(flags_per_replica):
            name = "bench-aff-r%d" % (i + 1)
            port = self.base_port + i
            self.names.append(name)
            for attempt in range(3):  # start can misreport a live server as exited: retry
                subprocess.run([self.script, "stop", name], capture_output=True)
                out = subprocess.run([self.script, "start", name, str(port), "f16", "--"]
                                     + ENGINE_FLAGS + flags, capture_output=True, text=True)
                if out.returncode == 0:
                    break
            else:
                raise SystemExit("real-engine start %s failed: %s" % (name, out.stderr))
            urls.append("http://127.0.0.1:%d" % port)
        return urls

    def stop(self):
        if self.names:
            subprocess.run([self.script, "stop"] + self.names, capture_output=True)
        self.names = []


class SimEngines:
    def __init__(self):
        self.sims = []

    def info(self):
        return {"engine": "detproxy-sim"}

    def start(self, flags_per_replica):
        urls = []
        for flags in flags_per_replica:
            # `-fa off` stands for "another numerics": another dtype in the simulator.
            extra = ["--dtype", "bfloat16"] if "off" in flags else []
            s = start_sim("--model", MODEL, "--flavor", "llamacpp", "--token-delay-ms", "2", *extra)
            self.sims.append(s)
            urls.append("http://127.0.0.1:%d" % s.port)
        return urls

    def stop(self):
        for s in self.sims:
            s.stop()
        self.sims = []


def proxy_for(urls, balance, load_factor=None):
    pool = {"name": "p", "models": ["*"], "balance": balance,
            "replicas": [{"name": "r%d" % (i + 1), "url": u} for i, u in enumerate(urls)]}
    if load_factor is not None:
        pool["affinity"] = {"load_factor": load_factor}
    return start_proxy(pools=[pool], policy={"tenants": [{"name": "bench",
                                                          "match": {"any": True}}]},
                       timeout=30)


# ---- one request ----------------------------------------------------------------------------

def stream(port, path, body):
    """POST a streamed request; returns (replica, affinity header, ttft s, text, usage, timings)."""
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path),
                                 json.dumps(body).encode(), {"content-type": "application/json"})
    t0 = time.monotonic()
    ttft = None
    text, usage, timings = [], None, None
    with urllib.request.urlopen(req, timeout=300) as r:
        rep, aff = r.headers.get("x-detproxy-replica"), r.headers.get("x-detproxy-affinity")
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ch.get("text") or ""
                if piece:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    text.append(piece)
            usage = ev.get("usage") or usage
            timings = ev.get("timings") or timings
    if ttft is None:
        ttft = time.monotonic() - t0
    return rep, aff, ttft, "".join(text), usage, timings


class LoadSampler(threading.Thread):
    """In-flight per replica from /admin/replicas every 20 ms."""

    def __init__(self, admin_port):
        super().__init__(daemon=True)
        self.port, self.ratios, self.peak = admin_port, [], {}
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            try:
                reps = get_json(self.port, "/admin/replicas")["replicas"]
            except Exception:
                reps = []
            inf = [r["inflight"] for r in reps]
            for r in reps:
                self.peak[r["name"]] = max(self.peak.get(r["name"], 0), r["inflight"])
            if inf and sum(inf):
                self.ratios.append(max(inf) / (sum(inf) / len(inf)))
            self.done.wait(0.02)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))] if xs else float("nan")


# ---- part 1: conversations ------------------------------------------------------------------

def conversations(engines, balance, load_factor, args):
    """One run: fresh replicas, one proxy, every conversation; returns its raw observations."""
    urls = engines.start([[] for _ in range(3)])
    px = proxy_for(urls, balance, load_factor)
    sem = threading.Semaphore(args.concurrency)
    recs, lock, errors = [], threading.Lock(), []

    def converse(i):
        msgs = [{"role": "system", "content": SYSTEM}]
        for t in range(args.turns):
            msgs.append({"role": "user", "content": "Customer %d, question %d: do you have "
                         "book number %d in stock, and when could it ship?" % (i, t, i * 10 + t)})
            body = {"model": MODEL, "messages": msgs, "max_tokens": 16, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            with sem:
                try:
                    rep, aff, ttft, text, usage, timings = stream(px.port, "/v1/chat/completions",
                                                                  body)
                except Exception as e:  # noqa: BLE001 - counted and reported
                    errors.append(repr(e))
                    return
            usage = usage or {}
            with lock:
                recs.append({"conv": i, "turn": t, "replica": rep, "affinity": aff, "ttft": ttft,
                             "prompt_tokens": usage.get("prompt_tokens") or 0,
                             "cached_tokens": (usage.get("prompt_tokens_details") or {})
                             .get("cached_tokens") or 0,
                             "cache_n": (timings or {}).get("cache_n")})
            msgs.append({"role": "assistant", "content": text})

    sampler = LoadSampler(px.admin_port)
    sampler.start()
    t0 = time.monotonic()
    threads = [threading.Thread(target=converse, args=(i,)) for i in range(args.conversations)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    sampler.done.set()
    sampler.join()
    px.stop()
    engines.stop()
    return {"recs": recs, "ratios": sampler.ratios, "peak": sampler.peak, "wall": wall,
            "errors": errors}


def summarize_conversations(label, balance, load_factor, runs):
    """Pool the runs of one variant: token sums, TTFT percentiles over every request."""
    recs = [r for run in runs for r in run["recs"]]
    ratios = [x for run in runs for x in run["ratios"]]
    prompt = sum(r["prompt_tokens"] for r in recs)
    cached = sum(r["cached_tokens"] for r in recs)
    # A turn reused its whole history when the cache covered the previous turn's prompt.
    by_turn = {}
    for k, run in enumerate(runs):
        for r in run["recs"]:
            by_turn[(k, r["conv"], r["turn"])] = r
    later = [(r, by_turn.get((k, c, t - 1))) for (k, c, t), r in by_turn.items() if t > 0]
    reused = sum(1 for r, prev in later if prev and r["cached_tokens"] >= prev["prompt_tokens"])
    served, homes = {}, {}
    for k, run in enumerate(runs):
        for r in run["recs"]:
            served[(k, r["replica"])] = served.get((k, r["replica"]), 0) + 1
            homes.setdefault((k, r["conv"]), set()).add(r["replica"])
    per_run_spread = []
    for k in range(len(runs)):
        counts = [v for (kk, _), v in served.items() if kk == k]
        if counts:
            per_run_spread.append(max(counts) / (sum(counts) / 3.0))
    ttft = [r["ttft"] for r in recs]
    return {
        "part": "conversations", "label": label, "balance": balance, "load_factor": load_factor,
        "runs": len(runs), "requests": len(recs),
        "errors": sum(len(run["errors"]) for run in runs),
        "error_sample": [e for run in runs for e in run["errors"]][:3],
        "wall_s": [round(run["wall"], 1) for run in runs],
        "prompt_tokens": prompt, "cached_tokens": cached,
        "cached_ratio": cached / prompt if prompt else None,
        "history_reused": reused, "later_turns": len(later),
        "ttft_p50_ms": pct(ttft, 50) * 1000, "ttft_p95_ms": pct(ttft, 95) * 1000,
        "ttft_mean_ms": statistics.mean(ttft) * 1000 if ttft else float("nan"),
        "inflight_max_over_mean": statistics.mean(ratios) if ratios else None,
        "inflight_peak": [run["peak"] for run in runs],
        "served_max_over_mean": max(per_run_spread) if per_run_spread else None,
        "replicas_per_conversation": statistics.mean(len(v) for v in homes.values()),
        "affinity_results": {k: sum(1 for r in recs if r["affinity"] == k)
                             for k in ("hit", "spill", "fallback")},
    }


# ---- part 2: determinism --------------------------------------------------------------------

def determinism(engines, balance, args, concurrency, load_factor=None):
    urls = engines.start([[], [], ["-fa", "off"]])
    px = proxy_for(urls, balance, load_factor)
    answers = {}
    jobs = queue.Queue()
    for s in range(args.sends):
        for p in range(args.prompts):
            jobs.put(p)
    lock = threading.Lock()
    errors = []

    def worker():
        while True:
            try:
                p = jobs.get_nowait()
            except queue.Empty:
                return
            body = {"model": MODEL, "prompt": "Note %d: the shop opens at nine and the" % p,
                    "max_tokens": 64, "temperature": 0, "stream": True}
            try:
                rep, _, _, text, _, _ = stream(px.port, "/v1/completions", body)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                continue
            with lock:
                answers.setdefault(p, []).append((rep, text))

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    px.stop()
    engines.stop()
    two = sum(1 for v in answers.values() if len({t for _, t in v}) > 1)
    via_fa_off = sum(1 for v in answers.values() if any(r == "r3" for r, _ in v))
    # The flag's own effect: prompts whose r3 answer differs from an r1/r2 answer.
    return {"part": "determinism", "balance": balance, "concurrency": concurrency,
            "load_factor": load_factor, "prompts": len(answers),
            "sends": sum(len(v) for v in answers.values()), "errors": len(errors),
            "prompts_with_two_answers": two, "prompts_that_met_fa_off": via_fa_off,
            "replicas_per_prompt": statistics.mean(len({r for r, _ in v})
                                                   for v in answers.values())}


# ---- report ---------------------------------------------------------------------------------

def markdown(res, meta):
    conv = [r for r in res if r["part"] == "conversations"]
    det = [r for r in res if r["part"] == "determinism"]
    out = ["### 8. Affinity routing: prompt cache, time to first token, determinism",
           "",
           "- %s; engine: %s; detproxy %s; load average at start %s" % (
               meta["date"], meta["engine"], meta["version"], meta["load"]),
           "- command: `%s`" % meta["command"], ""]
    if conv:
        out += ["%d conversations x %d turns, shared 2 KB system prompt, growing history, "
                "16 tokens per answer, streamed, %d requests in flight at most, 3 replicas "
                "(fresh per run), %d run(s) per variant, order rotated; TTFT at the client, "
                "through detproxy." % (meta["conversations"], meta["turns"], meta["concurrency"],
                                        meta["rounds"]), "",
                "| balance | cached-token ratio | turns reusing their whole history | "
                "TTFT p50 / p95 / mean ms | in-flight max/mean | requests max/mean | "
                "replicas per conversation | placements hit / spill | errors |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in conv:
            a = r["affinity_results"]
            out.append("| %s | %.1f%% | %d of %d (%.0f%%) | %.0f / %.0f / %.0f | %.2f | %.2f | "
                       "%.2f | %s | %d |" % (
                           r["label"], 100 * (r["cached_ratio"] or 0), r["history_reused"],
                           r["later_turns"], 100.0 * r["history_reused"] / max(1, r["later_turns"]),
                           r["ttft_p50_ms"], r["ttft_p95_ms"], r["ttft_mean_ms"],
                           r["inflight_max_over_mean"] or 0, r["served_max_over_mean"] or 0,
                           r["replicas_per_conversation"],
                           "%d / %d" % (a["hit"], a["spill"]) if r["balance"] == "affinity"
                           else "-", r["errors"]))
        out.append("")
    if det:
        out += ["Determinism: r1, r2 default, r3 `-fa off` (same file, same metadata); "
                "%d prompts x %d sends (send-major order), temperature 0, 64 tokens." % (
                    meta["prompts"], meta["sends"]), "",
                "| balance | in flight | prompts with two answers | prompts that met r3 | "
                "replicas per prompt | errors |", "|---|---:|---:|---:|---:|---:|"]
        for r in det:
            label = r["balance"] + (" (load_factor %g)" % r["load_factor"]
                                    if r["load_factor"] is not None else "")
            out.append("| %s | %d | %d of %d | %d | %.2f | %d |" % (
                label, r["concurrency"], r["prompts_with_two_answers"], r["prompts"],
                r["prompts_that_met_fa_off"], r["replicas_per_prompt"], r["errors"]))
        out.append("")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["real", "sim"], default="real")
    ap.add_argument("--conversations", type=int, default=30)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--sends", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="runs per conversation variant")
    ap.add_argument("--only", choices=["cache", "det"])
    ap.add_argument("--balances", default=",".join(BALANCES))
    ap.add_argument("--base-port", type=int, default=18201)
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"),
                    help='RESULTS.md to put section 8 in ("-": only print)')
    ap.add_argument("--json", help="also write the raw results here (one object per line)")
    args = ap.parse_args()
    engines = RealEngines(args.base_port) if args.engine == "real" else SimEngines()
    version = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
    info = engines.info()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "engine": ("llama.cpp %s (llama.cpp-tools %s), tiny F16 GGUF %s" % (
                "llama-server", info.get("llama_cpp_tools", "?"),
                info.get("model_f16", "?").split()[-1][:12]) if args.engine == "real"
                else "detproxy-sim (no prompt cache: routing only)"),
            "version": version, "load": " ".join(open("/proc/loadavg").read().split()[:3]),
            "command": " ".join(["bench/affinity.py"] + sys.argv[1:]),
            "conversations": args.conversations, "turns": args.turns,
            "concurrency": args.concurrency, "prompts": args.prompts, "sends": args.sends,
            "rounds": args.rounds}
    res = []
    balances = args.balances.split(",")
    # Determinism one request at a time (no load: the order alone decides), then affinity under
    # concurrency, where the load bound spills, and with a load factor that never does.
    det_runs = [(b, 1, None) for b in balances]
    if "affinity" in balances:
        det_runs += [("affinity", args.concurrency, None), ("affinity", args.concurrency, 100)]
    conv_variants = [(b, None) for b in balances]
    if "affinity" in balances:
        conv_variants.insert(1, ("affinity", 2.0))
    try:
        if args.only in (None, "cache"):
            runs = {v: [] for v in conv_variants}
            for k in range(args.rounds):
                for j in range(len(conv_variants)):
                    v = conv_variants[(j + k) % len(conv_variants)]
                    runs[v].append(conversations(engines, v[0], v[1], args))
                    print("round %d %s: %d requests" % (k + 1, v, len(runs[v][-1]["recs"])),
                          flush=True)
            for b, lf in conv_variants:
                label = b + (" (load_factor %g)" % lf if lf is not None else "")
                r = summarize_conversations(label, b, lf, runs[(b, lf)])
                print(json.dumps(r), flush=True)
                res.append(r)
        if args.only in (None, "det"):
            for b, c, lf in det_runs:
                r = determinism(engines, b, args, c, lf)
                print(json.dumps(r), flush=True)
                res.append(r)
    finally:
        engines.stop()
    text = markdown(res, meta)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            for r in res:
                f.write(json.dumps(r) + "\n")
    if args.results != "-":
        from report import splice
        splice(args.results, text, res, meta)


if __name__ == "__main__":
    main()
