"""detproxy-sim, black box: flags, every flavor's endpoints, the toy model's determinism,
sampling, quantization drift and batching noise, streaming, faults, test-only endpoints and
the signed /attestation. Run: DETPROXY_SIM_BIN=build/.../detproxy-sim python3 test_sim.py"""

import base64
import concurrent.futures
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (SIM_BIN, SLOW, get_json, http, poll_until, post_json, raw_request,  # noqa
                     run_cmd, run_tests, sse, start_sim)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CKPT = "a" * 64


def complete(port, prompt="Count: one, two,", **params):
    body = {"model": MODEL, "prompt": prompt}
    body.update(params)
    r = post_json(port, "/v1/completions", body)
    assert r.status == 200, r
    return r.json()


def text_of(resp):
    return resp["choices"][0]["text"]


def chat(port, content="Say something.", **params):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    body.update(params)
    r = post_json(port, "/v1/chat/completions", body)
    assert r.status == 200, r
    return r.json()


def sim(*flags, flavor="vllm"):
    return start_sim("--flavor", flavor, "--model", MODEL, "--checkpoint-sha256", CKPT, *flags)


# ---- flags ---------------------------------------------------------------------------------------


def test_help_and_usage_errors():
    rc, out, err = run_cmd([SIM_BIN, "--help"])
    assert rc == 0 and "--flavor" in out and "--attest-key" in out, (rc, out, err)
    for argv in (["--bogus"], ["--flavor", "triton"], ["--noise", "1.5"], ["--noise", "x"],
                 ["--token-delay-ms", "-1"], ["--checkpoint-sha256", "ABC"],
                 ["--listen", "nope"], ["--listen", "127.0.0.1:99999"], ["--model"],
                 ["--model", ""], ["positional"], ["--log-level", "loud"]):
        rc, out, err = run_cmd([SIM_BIN] + argv)
        assert rc == 2, (argv, rc, err)
        lines = [l for l in err.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("detproxy-sim: "), (argv, err)


def test_missing_attest_key_is_a_usage_error():
    rc, _, err = run_cmd([SIM_BIN, "--listen", "127.0.0.1:0", "--attest-key", "/nonexistent.pem"])
    assert rc == 2, (rc, err)


def test_port_in_use_is_a_runtime_failure():
    with sim() as s:
        rc, _, err = run_cmd([SIM_BIN, "--listen", "127.0.0.1:%d" % s.port])
        assert rc == 3, (rc, err)


def test_listening_line_and_sigterm_exit_zero():
    s = sim("--quantization", "awq")
    rec = s.wait_log("listening")
    assert rec["port"] == s.port and rec["flavor"] == "vllm" and rec["quantization"] == "awq"
    assert rec["checkpoint_sha256"] == CKPT
    t0 = time.monotonic()
    s.stop(signal.SIGTERM)
    assert time.monotonic() - t0 < 2 * SLOW
    s2 = sim()
    s2.stop(signal.SIGINT)


def test_sigterm_with_requests_in_flight():
    s = sim("--token-delay-ms", "200")
    results = []

    def slow():
        try:
            results.append(post_json(s.port, "/v1/completions",
                                     {"prompt": "x", "max_tokens": 50}, timeout=20).status)
        except OSError as e:
            results.append(e)

    t = threading.Thread(target=slow)
    t.start()
    poll_until(lambda: get_json(s.port, "/_sim/stats")["inflight"] == 1, what="inflight")
    t0 = time.monotonic()
    s.stop()
    assert time.monotonic() - t0 < 3 * SLOW
    t.join(10)


# ---- flavors ------------------------------------------------------------------------------------


def test_vllm_metadata():
    with sim("--framework-version", "0.6.3") as s:
        assert http("GET", s.port, "/health").status == 200
        m = get_json(s.port, "/v1/models")
        assert m["object"] == "list" and len(m["data"]) == 1
        d = m["data"][0]
        assert d["id"] == MODEL and d["object"] == "model" and d["owned_by"] == "vllm"
        assert d["root"] == MODEL and d["parent"] is None and d["max_model_len"] > 0
        assert d["permission"][0]["object"] == "model_permission"
        assert get_json(s.port, "/version") == {"version": "0.6.3"}
        for path in ("/info", "/props", "/get_server_info"):
            r = http("GET", s.port, path)
            assert r.status == 404 and r.json() == {"detail": "Not Found"}, (path, r)


def test_tgi_metadata():
    with sim("--dtype", "bfloat16", flavor="tgi") as s:
        assert http("GET", s.port, "/health").status == 200
        i = get_json(s.port, "/info")
        assert i["model_id"] == MODEL and i["model_dtype"] == "torch.bfloat16"
        assert i["model_device_type"] == "cuda" and i["router"] == "text-generation-router"
        assert i["version"] == "2.0.4" and i["docker_label"].startswith("sha-")
        for k in ("model_sha", "model_pipeline_tag", "max_concurrent_requests", "max_best_of",
                  "max_stop_sequences", "max_input_tokens", "max_total_tokens",
                  "validation_workers", "max_client_batch_size", "sha"):
            assert k in i, k
        assert "quantization" not in i
        assert http("GET", s.port, "/version").status == 404
        r = chat(s.port, temperature=0)
        assert r["system_fingerprint"].startswith("2.0.4-sha-") and r["id"] == ""


def test_sglang_metadata():
    with sim("--quantization", "fp8", "--report-quantization", "awq", flavor="sglang") as s:
        g = get_json(s.port, "/get_server_info")
        assert g["model_path"] == MODEL and g["served_model_name"] == MODEL
        assert g["tokenizer_path"] == MODEL and g["dtype"] == "float16"
        assert g["quantization"] == "awq", "reports the lie"
        assert g["version"] == "0.3.5"
        assert get_json(s.port, "/get_model_info")["is_generation"] is True
        assert get_json(s.port, "/v1/models")["data"][0]["owned_by"] == "sglang"
    with sim(flavor="sglang") as s:
        assert get_json(s.port, "/get_server_info")["quantization"] is None


def test_llamacpp_metadata():
    with sim("--framework-version", "b4500", flavor="llamacpp") as s:
        assert get_json(s.port, "/health") == {"status": "ok"}
        p = get_json(s.port, "/props")
        dgs = p["default_generation_settings"]
        assert dgs["n_ctx"] > 0 and dgs["params"]["seed"] == 4294967295
        assert p["model_alias"] == MODEL and p["model_ftype"] == "F16"  # unquantized float16
        assert p["total_slots"] >= 1 and p["model_path"].endswith(".gguf")
        assert isinstance(p["chat_template"], str) and p["build_info"].startswith("b4500-")
        models = get_json(s.port, "/v1/models")
        assert list(models)[0] == "models"  # llama-server's Ollama-style list comes first
        m = models["data"][0]
        assert m["owned_by"] == "llamacpp" and m["meta"]["ftype"] == "F16"
        assert get_json(s.port, "/props")["media_marker"] == p["media_marker"]  # per process
        r = chat(s.port, temperature=0)
        assert r["system_fingerprint"] == p["build_info"]
        r = http("GET", s.port, "/version")
        assert r.status == 404


# ---- inference shapes ---------------------------------------------------------------------------


def test_completion_and_chat_shapes():
    with sim() as s:
        r = complete(s.port, temperature=0)
        assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
        assert r["model"] == MODEL and isinstance(r["created"], int)
        assert "system_fingerprint" not in r
        c = r["choices"][0]
        assert c["index"] == 0 and c["logprobs"] is None
        assert c["finish_reason"] in ("length", "stop") and c["text"].startswith(" ")
        u = r["usage"]
        assert u["prompt_tokens"] == 3 and u["total_tokens"] == 3 + u["completion_tokens"]
        if c["finish_reason"] == "length":
            assert u["completion_tokens"] == 16 and len(c["text"].split()) == 16

        r = chat(s.port, temperature=0, max_tokens=5)
        assert r["object"] == "chat.completion" and r["id"].startswith("chat-")
        m = r["choices"][0]["message"]
        assert m["role"] == "assistant" and not m["content"].startswith(" ")
        assert len(m["content"].split()) <= 5


def test_n_choices_and_batched_prompts():
    with sim() as s:
        r = complete(s.port, n=3, temperature=0.9, seed=7)
        assert [c["index"] for c in r["choices"]] == [0, 1, 2]
        assert len({c["text"] for c in r["choices"]}) == 3, "seeded choices differ"
        r2 = complete(s.port, n=3, temperature=0.9, seed=7)
        assert [c["text"] for c in r["choices"]] == [c["text"] for c in r2["choices"]]
        r = complete(s.port, prompt=["one two", "three"], n=2, temperature=0)
        assert len(r["choices"]) == 4
        assert r["choices"][0]["text"] == r["choices"][1]["text"], "greedy: n copies agree"
        assert r["usage"]["prompt_tokens"] == 3
        r = complete(s.port, prompt=[1, 2, 3], temperature=0, max_tokens=4)
        assert r["usage"]["prompt_tokens"] == 3


def test_bad_requests_are_openai_shaped_400():
    with sim() as s:
        for body in (b"{", b"[]", b'{"prompt": 5}', b'{"prompt":"x","temperature":"hot"}',
                     b'{"prompt":"x","seed":1.5}', b'{"prompt":"x","n":0}',
                     b'{"prompt":"x","stream":"yes"}', b""):
            r = http("POST", s.port, "/v1/completions", body=body,
                     headers={"Content-Type": "application/json"})
            assert r.status == 400, (body, r)
            e = r.json()["error"]
            assert set(e) >= {"message", "type", "param", "code"} and e["message"], e
        r = http("POST", s.port, "/v1/chat/completions", body={"model": MODEL, "messages": 3})
        assert r.status == 400 and r.json()["error"]["param"] == "messages"
        r = post_json(s.port, "/v1/completions", {"model": "other", "prompt": "x"})
        assert r.status == 404 and "does not exist" in r.json()["error"]["message"]
        r = http("GET", s.port, "/v1/completions")
        assert r.status == 405
        # still healthy
        complete(s.port, temperature=0)


def test_tgi_refuses_top_p_one():
    with sim(flavor="tgi") as s:
        r = post_json(s.port, "/v1/chat/completions",
                      {"model": "tgi", "messages": [{"role": "user", "content": "x"}],
                       "top_p": 1.0})
        assert r.status == 422 and r.json()["error_type"] == "validation", r
        r = post_json(s.port, "/v1/chat/completions",
                      {"model": "tgi", "messages": [{"role": "user", "content": "x"}],
                       "top_p": 0.99, "temperature": 0})
        assert r.status == 200 and r.json()["model"] == MODEL, "TGI reports its own model id"


# ---- the toy model -------------------------------------------------------------------------------


def test_greedy_is_deterministic_across_requests_and_replicas():
    with sim() as a, sim() as b:
        for prompt in ("Count: one, two,", "The capital of France is", "hello"):
            x = text_of(complete(a.port, prompt, temperature=0))
            assert x == text_of(complete(a.port, prompt, temperature=0))
            assert x == text_of(complete(b.port, prompt, temperature=0, seed=99))
        c1 = chat(a.port, "hi", temperature=0)["choices"][0]["message"]["content"]
        c2 = chat(b.port, "hi", temperature=0)["choices"][0]["message"]["content"]
        assert c1 == c2


def test_seeded_sampling_repeats_unseeded_varies():
    with sim() as s:
        a = text_of(complete(s.port, temperature=0.8, seed=1234))
        assert a == text_of(complete(s.port, temperature=0.8, seed=1234))
        assert a != text_of(complete(s.port, temperature=0.8, seed=1235))
        unseeded = {text_of(complete(s.port, temperature=0.8)) for _ in range(6)}
        assert len(unseeded) >= 4, unseeded
        greedy = text_of(complete(s.port, temperature=0))
        assert greedy != a


def test_quantization_changes_outputs():
    prompts = ["prompt %d" % i for i in range(8)]
    with sim() as base, sim("--quantization", "awq") as awq, \
            sim("--dtype", "bfloat16") as bf16:
        t_base = [text_of(complete(base.port, p, temperature=0)) for p in prompts]
        t_awq = [text_of(complete(awq.port, p, temperature=0)) for p in prompts]
        t_bf16 = [text_of(complete(bf16.port, p, temperature=0)) for p in prompts]
        assert sum(x != y for x, y in zip(t_base, t_awq)) >= 7
        assert sum(x != y for x, y in zip(t_base, t_bf16)) >= 7

        # A lying replica generates as awq but reports none.
        with sim("--quantization", "awq", "--report-quantization", "none",
                 flavor="sglang") as liar:
            assert get_json(liar.port, "/get_server_info")["quantization"] is None
            assert [text_of(complete(liar.port, p, temperature=0)) for p in prompts] == t_awq

        # Runtime change: the replica "changes model" while serving, then changes back.
        cfg = post_json(base.port, "/_sim/config", {"quantization": "awq"})
        assert cfg.status == 200 and cfg.json()["quantization"] == "awq"
        assert [text_of(complete(base.port, p, temperature=0)) for p in prompts] == t_awq
        post_json(base.port, "/_sim/config", {"quantization": "none", "checkpoint_sha256": "b" * 64})
        t_other = [text_of(complete(base.port, p, temperature=0)) for p in prompts]
        assert sum(x != y for x, y in zip(t_base, t_other)) >= 7
        post_json(base.port, "/_sim/config", {"checkpoint_sha256": CKPT})
        assert [text_of(complete(base.port, p, temperature=0)) for p in prompts] == t_base


def test_noise_only_under_concurrency():
    # p = 0.5: with p = 1 every concurrent request would flip the same near-ties and agree with
    # each other (while still differing from the sequential output).
    with sim("--noise", "0.5", "--token-delay-ms", "5") as s:
        body = {"model": MODEL, "prompt": "noise please", "temperature": 0, "max_tokens": 32}
        sequential = {text_of(post_json(s.port, "/v1/completions", body).json())
                      for _ in range(4)}
        assert len(sequential) == 1, sequential

        def one(_):
            return text_of(post_json(s.port, "/v1/completions", body).json())

        # Two rounds of 8 in flight: with near-ties flipped at p = 0.5, two distinct outputs
        # among 8 answers (and none new) happened by chance under a loaded CI machine.
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            parallel = set(ex.map(one, range(16)))
        st = get_json(s.port, "/_sim/stats")
        assert st["max_inflight_seen"] >= 2, st
        assert len(parallel | sequential) >= 3, (parallel, sequential)
    with sim("--token-delay-ms", "5") as s:  # no --noise: concurrency changes nothing
        body = {"model": MODEL, "prompt": "noise please", "temperature": 0, "max_tokens": 32}
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            outs = set(ex.map(lambda _: text_of(post_json(s.port, "/v1/completions",
                                                          body).json()), range(8)))
        assert len(outs) == 1


# ---- streaming ------------------------------------------------------------------------------------


def test_streaming_chat_chunks_spread_over_time():
    with sim("--token-delay-ms", "60") as s:
        whole = chat(s.port, "stream me", temperature=0, max_tokens=6)
        want = whole["choices"][0]["message"]["content"]
        head = {}

        def on_open(r):
            head["status"] = r.status
            head["ctype"] = r.getheader("Content-Type")

        events = list(sse(s.port, "/v1/chat/completions",
                          {"model": MODEL, "messages": [{"role": "user", "content": "stream me"}],
                           "temperature": 0, "max_tokens": 6, "stream": True,
                           "stream_options": {"include_usage": True}}, on_open=on_open))
        assert head["status"] == 200 and head["ctype"].startswith("text/event-stream")
        assert events[-1][1] == "[DONE]"
        chunks = [json.loads(d) for _, d in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
        assert text == want, (text, want)
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finals) == 1
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
        token_times = [t for (t, d), c in zip(events, chunks)
                       if c["choices"] and c["choices"][0]["delta"].get("content")]
        assert len(token_times) >= 4
        assert token_times[-1] - token_times[0] >= 0.15, token_times


def test_streaming_completion_and_flavors():
    for flavor in ("vllm", "tgi", "sglang", "llamacpp"):
        with sim(flavor=flavor) as s:
            whole = text_of(complete(s.port, "abc", temperature=0, max_tokens=8))
            events = list(sse(s.port, "/v1/completions",
                              {"model": MODEL, "prompt": "abc", "temperature": 0,
                               "max_tokens": 8, "stream": True}))
            assert events[-1][1] == "[DONE]", flavor
            chunks = [json.loads(d) for _, d in events[:-1]]
            assert all(c["object"] == "text_completion" for c in chunks), flavor
            assert "".join(c["choices"][0]["text"] for c in chunks) == whole, flavor
            # chat stream text equals chat text for every flavor
            want = chat(s.port, "q", temperature=0, max_tokens=5)["choices"][0]["message"]
            events = list(sse(s.port, "/v1/chat/completions",
                              {"model": MODEL, "messages": [{"role": "user", "content": "q"}],
                               "temperature": 0, "max_tokens": 5, "stream": True}))
            got = "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                          for _, d in events[:-1])
            assert got == want["content"], (flavor, got, want)


def test_non_streamed_waits_for_all_tokens():
    with sim("--token-delay-ms", "40") as s:
        t0 = time.monotonic()
        complete(s.port, temperature=0, max_tokens=5)
        assert time.monotonic() - t0 >= 0.15


def test_client_abort_stops_generation():
    with sim("--token-delay-ms", "20") as s:
        body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 1000,
                           "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(65536)
        sock.close()
        st = poll_until(lambda: (lambda x: x if x["aborted"] == 1 else None)(
            get_json(s.port, "/_sim/stats")), what="aborted == 1")
        assert st["inflight"] == 0
        tokens = st["tokens_generated"]
        time.sleep(0.2)
        assert get_json(s.port, "/_sim/stats")["tokens_generated"] == tokens, "still generating"
        assert tokens < 100


def test_backpressure_pauses_generation():
    with sim() as s:
        body = json.dumps({"model": MODEL, "prompt": "flood", "max_tokens": 4096, "n": 16,
                           "stream": True}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

        def stalled():
            a = get_json(s.port, "/_sim/stats")["tokens_generated"]
            time.sleep(0.3)
            b = get_json(s.port, "/_sim/stats")["tokens_generated"]
            return a == b and a > 0

        poll_until(stalled, timeout=20, what="generation paused by backpressure")
        st = get_json(s.port, "/_sim/stats")
        assert st["inflight"] == 1 and st["tokens_generated"] < 4096 * 16, st
        # Reading resumes generation.
        sock.settimeout(5)
        before = st["tokens_generated"]
        def drained_and_resumed():  # read until the sim is below its write watermark again
            sock.recv(65536)
            return get_json(s.port, "/_sim/stats")["tokens_generated"] > before

        poll_until(drained_and_resumed, interval=0, what="generation resumed")
        sock.close()
        poll_until(lambda: get_json(s.port, "/_sim/stats")["inflight"] == 0, what="abort")


# ---- test-only endpoints -------------------------------------------------------------------------


def test_last_request_and_request_log():
    with sim() as s:
        assert http("GET", s.port, "/_sim/last_request").status == 404
        raw = b'{"model": "%s", "prompt": "echo me",  "temperature": 0}' % MODEL.encode()
        r = http("POST", s.port, "/v1/completions", body=raw,
                 headers={"Content-Type": "application/json", "Authorization": "Bearer sk-1",
                          "X-Tenant": "bank"})
        assert r.status == 200
        lr = get_json(s.port, "/_sim/last_request")
        assert lr["path"] == "/v1/completions" and lr["method"] == "POST"
        assert lr["body"] == raw.decode(), "the raw body, byte for byte"
        assert lr["headers"]["authorization"] == "Bearer sk-1"
        assert lr["headers"]["x-tenant"] == "bank"
        assert lr["headers"]["content-type"] == "application/json"
        http("GET", s.port, "/v1/models")
        http("POST", s.port, "/v1/chat/completions", body=b"not json")
        lr = get_json(s.port, "/_sim/last_request")
        assert lr["path"] == "/v1/chat/completions" and lr["body"] == "not json"
        log = get_json(s.port, "/_sim/requests")["requests"]
        assert [x["path"] for x in log] == ["/v1/completions", "/v1/models",
                                           "/v1/chat/completions"]
        assert [x["inference"] for x in log] == [True, False, True]
        st = get_json(s.port, "/_sim/stats")
        assert st["requests"] == 2 and st["completed"] == 1
        post_json(s.port, "/_sim/reset", {})
        st = get_json(s.port, "/_sim/stats")
        assert st["requests"] == 0 and get_json(s.port, "/_sim/requests")["requests"] == []


def test_config_endpoint_validation():
    with sim() as s:
        c = get_json(s.port, "/_sim/config")
        assert c["quantization"] == "none" and c["fault"] == "none" and c["model"] == MODEL
        for bad in ({"quantization": 5}, {"noise": 2}, {"token_delay_ms": -1},
                    {"fault": "explode"}, {"checkpoint_sha256": "xyz"}, {"unknown": 1},
                    {"model": ""}, [1]):
            r = post_json(s.port, "/_sim/config", bad)
            assert r.status == 400, (bad, r)
        assert get_json(s.port, "/_sim/config") == c, "a bad request changes nothing"
        r = post_json(s.port, "/_sim/config", {"model": "new-model", "noise": 0.5,
                                              "token_delay_ms": 1})
        assert r.status == 200 and r.json()["model"] == "new-model"
        assert get_json(s.port, "/v1/models")["data"][0]["id"] == "new-model"
        assert post_json(s.port, "/v1/completions", {"model": MODEL, "prompt": "x"}).status == 404
        assert http("GET", s.port, "/_sim/nope").status == 404


# ---- faults -----------------------------------------------------------------------------------------


def _req_bytes(path="/v1/completions", body=None):
    body = body or json.dumps({"model": MODEL, "prompt": "x", "temperature": 0}).encode()
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))


def test_faults():
    with sim() as s:
        def fault(name, **kw):
            cfg = {"fault": name}
            cfg.update(kw)
            assert post_json(s.port, "/_sim/config", cfg).status == 200

        fault("close_before_response")
        assert raw_request(s.port, _req_bytes()) == b""

        fault("garbage")
        out = raw_request(s.port, _req_bytes())
        assert out and not out.startswith(b"HTTP/"), out

        fault("bad_framing")
        out = raw_request(s.port, _req_bytes(), timeout=1)
        head = out.split(b"\r\n\r\n")[0].lower()
        assert b"content-length:" in head and b"transfer-encoding: chunked" in head, out

        fault("error_500")
        r = post_json(s.port, "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert r.status == 500 and "error" in r.json()

        fault("die_mid_stream")
        body = json.dumps({"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 10})
        out = raw_request(s.port, _req_bytes(body=body.encode()))
        assert out.startswith(b"HTTP/1.1 200") and b"data: " in out
        assert b"[DONE]" not in out and not out.endswith(b"0\r\n\r\n"), out
        out = raw_request(s.port, _req_bytes())  # non-streamed: half a body, then close
        head, _, rest = out.partition(b"\r\n\r\n")
        cl = int([l.split(b":")[1] for l in head.split(b"\r\n")
                  if l.lower().startswith(b"content-length")][0])
        assert 0 < len(rest) < cl, (cl, len(rest))

        fault("hang")
        t0 = time.monotonic()
        out = raw_request(s.port, _req_bytes(), timeout=0.5)
        assert out == b"" and time.monotonic() - t0 >= 0.4
        assert get_json(s.port, "/_sim/stats")["hung"] == 1

        # Faults hit inference routes only, unless fault_scope is "all".
        assert http("GET", s.port, "/v1/models").status == 200
        fault("error_500", fault_scope="all")
        assert http("GET", s.port, "/v1/models").status == 500
        assert http("GET", s.port, "/_sim/stats").status == 200, "/_sim/ is never faulted"

        # fault_count: only the next N requests.
        fault("close_before_response", fault_scope="inference", fault_count=1)
        assert raw_request(s.port, _req_bytes()) == b""
        assert post_json(s.port, "/v1/completions", {"model": MODEL, "prompt": "x"}).status == 200
        assert get_json(s.port, "/_sim/config")["fault"] == "none"
        assert get_json(s.port, "/_sim/stats")["faults_injected"] >= 8


# ---- attestation -----------------------------------------------------------------------------------


def _pae(ptype, body):
    return b"DSSEv1 %d %s %d %s" % (len(ptype), ptype, len(body), body)


def test_attestation_envelope():
    openssl = shutil.which("openssl")
    if openssl is None:
        print("  (skipped: no openssl CLI)")
        return
    d = tempfile.mkdtemp()
    try:
        key, pub = os.path.join(d, "k.pem"), os.path.join(d, "p.pem")
        assert run_cmd([openssl, "genpkey", "-algorithm", "ed25519", "-out", key])[0] == 0
        assert run_cmd([openssl, "pkey", "-in", key, "-pubout", "-out", pub])[0] == 0
        rc, der, _ = run_cmd([openssl, "pkey", "-in", key, "-pubout", "-outform", "DER"])
        with sim("--attest-key", key, "--quantization", "awq", "--report-quantization", "none",
                 flavor="tgi") as s:
            env = get_json(s.port, "/attestation?nonce=abc-123")
            assert env["payloadType"] == "application/vnd.detproxy.attestation+json"
            payload = base64.b64decode(env["payload"])
            p = json.loads(payload)
            assert p["model"] == MODEL and p["checkpoint_sha256"] == CKPT
            assert p["quantization"] == "none", "the lying replica reports its lie"
            assert p["dtype"] == "float16"
            assert p["framework"] == {"name": "tgi", "version": "2.0.4"}
            assert p["nonce"] == "abc-123" and p["issued_at"].endswith("Z")
            sig = env["signatures"][0]
            assert len(sig["keyid"]) == 64
            pae = os.path.join(d, "pae.bin")
            sigf = os.path.join(d, "sig.bin")
            with open(pae, "wb") as f:
                f.write(_pae(env["payloadType"].encode(), payload))
            with open(sigf, "wb") as f:
                f.write(base64.b64decode(sig["sig"]))
            rc, out, err = run_cmd([openssl, "pkeyutl", "-verify", "-pubin", "-inkey", pub,
                                    "-rawin", "-in", pae, "-sigfile", sigf])
            assert rc == 0, (out, err)
            # keyid = sha256 of the SPKI DER
            rc, _, _ = run_cmd([openssl, "pkey", "-in", key, "-pubout", "-outform", "DER",
                                "-out", os.path.join(d, "pub.der")])
            with open(os.path.join(d, "pub.der"), "rb") as f:
                assert sig["keyid"] == hashlib.sha256(f.read()).hexdigest()

            assert http("GET", s.port, "/attestation").status == 400
            assert http("GET", s.port, "/attestation?nonce=a%20b").status == 400

            post_json(s.port, "/_sim/config", {"attest_fault": "wrong_nonce"})
            p = json.loads(base64.b64decode(get_json(s.port, "/attestation?nonce=n1")["payload"]))
            assert p["nonce"] != "n1"
            post_json(s.port, "/_sim/config", {"attest_fault": "unsigned"})
            assert get_json(s.port, "/attestation?nonce=n1")["signatures"] == []
            post_json(s.port, "/_sim/config", {"attest_fault": "bad_signature"})
            env = get_json(s.port, "/attestation?nonce=n1")
            with open(sigf, "wb") as f:
                f.write(base64.b64decode(env["signatures"][0]["sig"]))
            with open(pae, "wb") as f:
                f.write(_pae(env["payloadType"].encode(), base64.b64decode(env["payload"])))
            rc, _, _ = run_cmd([openssl, "pkeyutl", "-verify", "-pubin", "-inkey", pub,
                                "-rawin", "-in", pae, "-sigfile", sigf])
            assert rc != 0
            post_json(s.port, "/_sim/config", {"attest_fault": "garbage"})
            r = http("GET", s.port, "/attestation?nonce=n1")
            assert r.status == 200 and not r.body.startswith(b"{")
            post_json(s.port, "/_sim/config", {"attest_fault": "huge"})
            assert len(http("GET", s.port, "/attestation?nonce=n1").body) == 10 * 1024 * 1024
            post_json(s.port, "/_sim/config", {"attest_fault": "none"})
            post_json(s.port, "/_sim/config", {"report_quantization": ""})
            p = json.loads(base64.b64decode(get_json(s.port, "/attestation?nonce=n2")["payload"]))
            assert p["quantization"] == "awq"
        with sim() as s:  # no key: no /attestation
            assert http("GET", s.port, "/attestation?nonce=x").status == 404
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_bad_http_does_not_disturb_the_sim():
    with sim() as s:
        for junk in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: a\r\n bad fold\r\n\r\n",
                     b"\x00\x01\x02\x03", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"):
            raw_request(s.port, junk, timeout=1)
        complete(s.port, temperature=0)


if __name__ == "__main__":
    run_tests(globals())
