#!/usr/bin/env python3
"""The documentation holds together:

- every relative link in README.md and docs/ names a file that exists, and every `#anchor` a
  heading of that file (GitHub's anchor rules), so an operator never lands on a dead link;
- no page refers to "SPEC §N": the contract is not in the repository, so each reference must be
  a link to the page that says it;
- the operator index (docs/README.md) links every operator page, and the contributors' pages
  are apart from them (docs/contributing/);
- every command of `detproxy --help` appears in the index's command list.
"""
import glob
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from harness import run_tests  # noqa: E402

SRC = os.environ.get("DP_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
DETPROXY_BIN = os.environ.get("DETPROXY_BIN")


def pages():
    return sorted(glob.glob(os.path.join(SRC, "docs", "**", "*.md"), recursive=True)) + \
        [os.path.join(SRC, "README.md")]


def anchors(path):
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    out = set()
    for h in re.findall(r"^#+ (.*)$", text, re.M):
        out.add(re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-"))
    return out


def links(path):
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", text)


def broken_links(files):
    bad = []
    for f in files:
        for target, anchor in links(f):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            p = os.path.normpath(os.path.join(os.path.dirname(f), target)) if target else f
            if not os.path.exists(p):
                bad.append("%s: no file %s" % (os.path.relpath(f, SRC), target))
            elif anchor and p.endswith(".md") and anchor[1:] not in anchors(p):
                bad.append("%s: no heading %s in %s" % (os.path.relpath(f, SRC), anchor, target))
    return bad


def test_every_link_and_anchor_resolves():
    bad = broken_links(pages())
    assert not bad, "\n".join(bad)


def test_the_checker_catches_a_dead_link_and_a_dead_anchor(tmp=os.environ.get("TMPDIR", "/tmp")):
    d = os.path.join(tmp, "dp-docs-check")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "a.md"), "w") as f:
        f.write("# Title\n## Real heading\n[ok](#real-heading) [x](b.md) [y](a.md#gone)\n")
    bad = broken_links([os.path.join(d, "a.md")])
    assert len(bad) == 2, bad


def test_no_page_points_at_the_spec_by_section_number():
    hits = []
    for f in pages():
        with open(f) as fh:
            for n, line in enumerate(fh, 1):
                if re.search(r"SPEC\s*§", line):
                    hits.append("%s:%d: %s" % (os.path.relpath(f, SRC), n, line.strip()))
    assert not hits, "\n".join(hits)


def test_index_links_every_operator_page_and_contributors_are_apart():
    index = os.path.join(SRC, "docs", "README.md")
    linked = {os.path.normpath(os.path.join(os.path.dirname(index), t)) for t, _ in links(index)}
    for p in glob.glob(os.path.join(SRC, "docs", "*.md")) + \
            glob.glob(os.path.join(SRC, "docs", "contributing", "*.md")):
        if p != index:
            assert os.path.normpath(p) in linked, "docs/README.md does not link " + p
    for p in glob.glob(os.path.join(SRC, "docs", "*.md")):
        with open(p) as f:
            text = f.read()
        # C contracts live with the contributors, not on operator pages.
        assert "For module authors" not in text and "Threads and ownership" not in text, p


def test_index_names_every_command():
    if not DETPROXY_BIN:
        return
    out = subprocess.run([DETPROXY_BIN, "--help"], capture_output=True, text=True)
    text = out.stdout + out.stderr
    with open(os.path.join(SRC, "docs", "README.md")) as f:
        index = f.read()
    section = index[index.index("## Commands"):index.index("## For contributors")]
    cmds = []
    for line in text[text.index("commands:"):].splitlines()[1:]:
        m = re.match(r"^  ([a-z]+(?: [a-z]+)*)", line)
        if m:
            cmds.append(m.group(1))
    assert len(cmds) >= 10, cmds  # the parse itself must have found the list
    for cmd in cmds:
        assert cmd in section, "command %r of --help is not in docs/README.md" % cmd


if __name__ == "__main__":
    run_tests(globals())
