#!/usr/bin/env python3
"""The official `openai` npm client's Responses API through detproxy (docs/policy.md, "/v1/responses"): create (whole
and streamed, via the client's own event parser), its output_text helper, headers via
withResponse(), and a policy refusal surfacing as the client's APIError with status, code and
param.

The package is installed from the npm registry into <build>/npm on first use (DP_NPM_DIR
overrides). Without node/npm, or when the registry cannot be reached, this exits 77: ctest shows
it skipped, never passed."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

from harness import SLOW, get_json, run_tests, start_sim
from proxyutil import pool, start_proxy

SKIP = 77
OPENAI_VERSION = "4.104.0"  # pinned: the client whose behaviour this test describes
KEY = "sk-node-bank-1"


def skip(why):
    print("SKIP test_openai_node: %s" % why, flush=True)
    sys.exit(SKIP)


def npm_dir():
    d = os.environ.get("DP_NPM_DIR")
    if not d:
        art = os.environ.get("DP_ARTIFACT_DIR")
        d = os.path.join(os.path.dirname(art), "npm") if art else "/tmp/detproxy-npm"
    return d


def openai_package():
    if shutil.which("node") is None or shutil.which("npm") is None:
        skip("node and npm are needed (apt-get install nodejs npm)")
    d = npm_dir()
    pkg = os.path.join(d, "node_modules", "openai")
    meta = os.path.join(pkg, "package.json")
    if os.path.exists(meta):
        with open(meta) as f:
            if json.load(f)["version"] == OPENAI_VERSION:
                return pkg
    os.makedirs(d, exist_ok=True)
    cp = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", d,
                         "openai@" + OPENAI_VERSION], capture_output=True, text=True,
                        timeout=300 * SLOW)
    if cp.returncode != 0 or not os.path.exists(meta):
        skip("npm install openai@%s failed (registry unreachable?): %s" % (
            OPENAI_VERSION, cp.stderr.strip()[-500:]))
    return pkg


PKG = openai_package()

SCRIPT = r"""
const OpenAI = require(process.env.OPENAI_PKG);
const client = new OpenAI({baseURL: process.env.BASE_URL, apiKey: process.env.API_KEY,
                           maxRetries: 0});
(async () => {
  const out = {};
  const {data, response} = await client.responses.create(
    {model: 'm1', input: 'hello from node', temperature: 0.9, max_output_tokens: 50})
    .withResponse();
  out.text = data.output_text;
  out.status = data.status;
  out.system_fingerprint = data.system_fingerprint;
  out.headers = {fingerprint: response.headers.get('x-detproxy-fingerprint'),
                 seed: response.headers.get('x-detproxy-seed'),
                 tenant: response.headers.get('x-detproxy-tenant')};
  const stream = await client.responses.create(
    {model: 'm1', input: 'hello from node', max_output_tokens: 50, stream: true});
  out.deltas = [];
  out.types = [];
  for await (const ev of stream) {
    out.types.push(ev.type);
    if (ev.type === 'response.output_text.delta') out.deltas.push(ev.delta);
    if (ev.type === 'response.completed' || ev.type === 'response.incomplete')
      out.final_text = ev.response.output.flatMap(o => o.content || [])
        .filter(p => p.type === 'output_text').map(p => p.text).join('');
  }
  try {
    await client.responses.create({model: 'm1', input: 'x', tools: []});
    out.refused = null;
  } catch (e) {
    out.refused = {name: e.constructor.name, status: e.status, code: e.code, param: e.param,
                   message: e.message};
  }
  console.log(JSON.stringify(out));
})().catch(e => { console.error(e); process.exit(1); });
"""


def test_openai_node_responses_api():
    sim = start_sim("--model", "m1")
    px = start_proxy(
        pools=[pool("p", ["m1"], [sim], manifest={"framework": {"name": "vllm",
                                                               "version": "0.6.3"}})],
        policy={"tenants": [
            {"name": "bank",
             "match": {"api_keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]},
             "sampling": {"temperature": {"force": 0}, "seed": {"force": 77},
                          "max_tokens": {"max": 8}},
             "deny_params": ["tools"]}]})
    env = dict(os.environ, OPENAI_PKG=PKG, API_KEY=KEY,
               BASE_URL="http://127.0.0.1:%d/v1" % px.port)
    cp = subprocess.run(["node", "-e", SCRIPT], capture_output=True, text=True, env=env,
                        timeout=60 * SLOW)
    assert cp.returncode == 0, cp.stderr[-3000:]
    out = json.loads(cp.stdout.strip().splitlines()[-1])
    got = json.loads(get_json(sim.port, "/_sim/last_request")["body"])
    # The policy reached the replica: the client's 0.9 and 50 became 0 and 8, seed 77.
    assert got["temperature"] == 0 and got["max_output_tokens"] == 8 and got["seed"] == 77, got
    assert out["headers"]["tenant"] == "bank" and out["headers"]["seed"] == "77", out
    assert out["system_fingerprint"] == out["headers"]["fingerprint"], out
    assert out["status"] == "incomplete" and len(out["text"].split()) == 8, out
    # The client's stream parser saw every event; deltas add up to the final text, which is
    # the unstreamed text (same forced seed, temperature 0).
    assert out["types"][0] == "response.created", out["types"]
    assert "".join(out["deltas"]) == out["final_text"] == out["text"], out
    r = out["refused"]
    assert r and r["name"] == "BadRequestError" and r["status"] == 400, r
    assert r["code"] == "policy_violation" and r["param"] == "tools", r
    print("openai %s: responses.create and its stream through detproxy" % OPENAI_VERSION)
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
