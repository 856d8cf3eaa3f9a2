#!/usr/bin/env python3
"""Write a long-context chat request (scenario 10): a RAG-style system prompt with retrieved
documents, then many user/assistant turns with long content, in the JSON shape OpenAI clients
send. Deterministic (fixed seed), so every run and every proxy gets the same bytes.

  gen_prompt.py OUT [KIB]        KIB: target size in KiB (default 256)

The content mixes prose, code with escaped quotes and backslashes, newlines, tabs and non-ASCII
text (raw UTF-8), so a proxy that parses the body meets every kind of string a real
prompt has. No "stream" key: the upstream answers with one JSON body."""
import json
import random
import sys

WORDS = ("the model replica request token cache prefix attention layer batch latency decode "
         "prefill context window gateway policy tenant seed temperature sampling stream "
         "kernel socket buffer queue worker thread memory page block weight tensor shard "
         "router affinity quarantine drift shadow manifest digest attestation envelope").split()
UNICODE = ["Grüße aus Zürich", "naïve café", "東京の天気", "Привет, мир", "λ-calculus",
           "emoji 🚀 and ✓", "Ünïcödé “quotes” — dashes"]
CODE = ['def f(x):\n\treturn "a\\\\b" + x  # {"k": [1, 2]}\n',
        'printf("%s\\n", "tab\\there");\n', 'SELECT * FROM t WHERE name = \'x\' AND v > 3;\n',
        '{"nested": {"json": ["in", "a", "string"]}, "n": 1.5e-3}\n']


def paragraph(rng, words):
    out = []
    for i in range(words):
        w = rng.choice(WORDS)
        if i % 17 == 0:
            w = w.capitalize()
        out.append(w)
        if i % 23 == 22:
            out.append(rng.choice(UNICODE))
    return " ".join(out) + "."


def content(rng, size):
    parts = []
    n = 0
    while n < size:
        r = rng.random()
        if r < 0.15:
            p = "```\n" + rng.choice(CODE) * rng.randint(1, 4) + "```"
        elif r < 0.25:
            p = "\n".join(f"- {paragraph(rng, rng.randint(5, 15))}" for _ in range(rng.randint(2, 6)))
        else:
            p = paragraph(rng, rng.randint(40, 160))
        parts.append(p)
        n += len(p.encode()) + 2
    return "\n\n".join(parts)


def main():
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    out = sys.argv[1]
    kib = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    target = kib * 1024
    rng = random.Random(13)
    docs = "\n\n".join(f"[doc {i}] {content(rng, 6000)}" for i in range(8))
    msgs = [{"role": "system",
             "content": "You are a helpful assistant. Answer from the retrieved documents.\n\n" + docs}]
    body = {"model": "bench-model", "messages": msgs, "temperature": 0.7, "top_p": 0.95,
            "max_tokens": 512, "user": "bench-user-13"}
    turn = 0
    while len(json.dumps(body, ensure_ascii=False).encode()) < target - 6000:
        role = "user" if turn % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": content(rng, rng.randint(1500, 5000))})
        turn += 1
    msgs.append({"role": "user", "content": "Summarise the thread above in five bullet points."})
    data = json.dumps(body, ensure_ascii=False).encode()
    with open(out, "wb") as f:
        f.write(data)
    print(f"{out}: {len(data)} bytes, {len(msgs)} messages", file=sys.stderr)


if __name__ == "__main__":
    main()
