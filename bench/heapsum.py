#!/usr/bin/env python3
"""Condense `heaptrack_print -a 1` output into allocation calls per request by call site.

  heapsum.py HEAPTRACK_PRINT_OUTPUT REQUESTS [MIN_PER_REQUEST]

heaptrack_print groups by allocator frame (dp_xrealloc, CRYPTO_zalloc, ...) and, under each,
by caller backtrace. For each backtrace we print: calls per request, the allocator entry point,
and the first three frames of the caller chain (file:line), which is where a fix would go.
"""
import re
import sys

WRAPPERS = {"dp_xrealloc", "dp_xmalloc", "dp_xcalloc", "dp_xstrdup", "dp_xstrndup",
            "dp_buf_reserve", "dp_buf_append", "dp_buf_appends", "dp_buf_appendc",
            "dp_buf_printf", "dp_buf_append_u64", "CRYPTO_malloc", "CRYPTO_zalloc",
            "CRYPTO_strndup", "CRYPTO_strdup", "CRYPTO_realloc"}


def parse(text):
    top = None        # allocator frames of the current top-level entry
    sub = None        # current sub-entry: [count, frames]
    out = []
    frame = None
    for line in text.splitlines():
        m = re.match(r"^(\d+) calls to allocation functions", line)
        if m:
            if sub:
                out.append((sub[0], top, sub[1]))
            top, sub = [], None
            continue
        m = re.match(r"^\s*(\d+) calls with .* from:", line)
        if m and top is not None:
            if sub:
                out.append((sub[0], top, sub[1]))
            sub = [int(m.group(1)), []]
            continue
        if top is None:
            continue
        s = line.strip()
        if not s or s.startswith("in "):
            continue
        if s.startswith("at "):
            loc = s[3:].replace("/work/main/", "")
            tgt = sub[1] if sub else top
            if tgt:
                tgt[-1] = (tgt[-1][0], loc)
            continue
        if re.match(r"^(PEAK|MOST|total|calls to|temporary|bytes|peak|MOST TEMPORARY)", s):
            if sub:
                out.append((sub[0], top, sub[1]))
            top, sub = None, None
            continue
        (sub[1] if sub else top).append((s, ""))
    if sub:
        out.append((sub[0], top, sub[1]))
    return out


def main():
    text = open(sys.argv[1], errors="replace").read()
    n = int(sys.argv[2])
    floor = float(sys.argv[3]) if len(sys.argv) > 3 else 0.25
    rows = []
    for count, top, frames in parse(text):
        per = count / n
        if per < floor:
            continue
        alloc = next((f for f, _ in top if f not in WRAPPERS), None) or (top[0][0] if top else "?")
        chain = [f for f in frames if f[0] not in WRAPPERS][:3]
        via = "/".join(f for f, _ in top[:2]) if top else ""
        rows.append((per, via, chain))
    rows.sort(key=lambda r: -r[0])
    total = sum(r[0] for r in rows)
    print(f"{'calls/req':>9}  {'allocator':<28}  call site <- callers")
    for per, via, chain in rows:
        site = " <- ".join(f"{f} ({loc})" if loc else f for f, loc in chain)
        print(f"{per:9.2f}  {via:<28}  {site}")
    print(f"{total:9.2f}  total of the sites listed (>= {floor} per request)")


if __name__ == "__main__":
    main()
