#!/usr/bin/env python3
"""The documentation holds together:

- every relative link in README.md and docs/ names a file that exists, and every `#anchor` a
  heading of that file (GitHub's anchor rules), so an operator never lands on a dead link;
- no page refers to "SPEC §N": the contract is not in the repository, so each reference must be
  a link to the page that says it;
- the operator index (docs/README.md) links every operator page, and the contributors' pages
  are apart from them (docs/contributing/);
- every command of `detproxy --help` appears in the index's command list;
- the docs and the program name the same things, both ways: every error code, command-line flag
  and admin endpoint the docs name exists in the program, and every one the program has is in
  the docs. The program's sets come from the program itself: error codes from the source (the
  code argument of every call that answers an error), flags from the `--help` of every command
  (and of detproxy-sim), admin routes from proxy/control/admin.c and relay.c; neither `--help`
  nor deploy/ cites a section of the external contract instead of a docs/ page.
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
    deploy = [f for f in glob.glob(os.path.join(SRC, "deploy", "**", "*"), recursive=True)
              if os.path.isfile(f)]
    for f in pages() + deploy:
        with open(f) as fh:
            for n, line in enumerate(fh, 1):
                if re.search(r"SPEC\s*§", line):
                    hits.append("%s:%d: %s" % (os.path.relpath(f, SRC), n, line.strip()))
    for cmd, text in helps().items():
        if re.search(r"SPEC\s*§", text):
            hits.append("%s --help: %s" % (cmd, re.search(r".*SPEC\s*§.*", text).group(0)))
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


# ---- the docs and the program name the same things -------------------------------------------

SIM_BIN = os.environ.get("DETPROXY_SIM_BIN")
_HELPS = {}


def help_text(argv):
    cp = subprocess.run(argv + ["--help"], capture_output=True, text=True, timeout=30)
    return cp.stdout + cp.stderr


def commands(top):
    """The command names `detproxy --help` lists ("attest oms verify", ...)."""
    out = []
    for line in top[top.index("commands:"):].splitlines()[1:]:
        m = re.match(r"^  ([a-z]+(?: [a-z]+)*)", line)
        if m:
            out.append(m.group(1))
    return out


def helps():
    """{command: its --help text} for detproxy, each of its commands, and detproxy-sim."""
    if not _HELPS and DETPROXY_BIN:
        top = help_text([DETPROXY_BIN])
        _HELPS["detproxy"] = top
        for c in commands(top):
            if c != "version":
                _HELPS[c] = help_text([DETPROXY_BIN] + c.split())
        if SIM_BIN:
            _HELPS["detproxy-sim"] = help_text([SIM_BIN])
    return _HELPS


FLAG = r"(?<![\w-])(--[a-z][a-z0-9-]*)"


def program_flags():
    """{command: the long flags its --help lists under options:}."""
    out = {}
    for cmd, text in helps().items():
        if cmd == "detproxy":
            continue
        i = text.find("options:")
        out[cmd] = set(re.findall(FLAG, text[i:] if i >= 0 else text))
    return out


# Flags of other programs that the docs name on their own (as `--parallel 1`, not in a command
# line that says whose it is), each with its program; and the docs' placeholder for any flag.
OTHER_FLAGS = {
    "--no-mmap": "llama-server", "--parallel": "llama-server", "--kv-unified": "llama-server",
    "--no-slots": "llama-server",
    "--alias": "llama-server", "--served-model-name": "vllm serve",
    "--enable-deterministic-inference": "sglang", "--sampling-defaults": "vllm serve",
    "--network": "podman/docker run", "--pid": "podman/docker run",
    "--ignore-unsigned-files": "model_signing (OpenSSF)", "--flag": "placeholder",
    "--prefix": "etcdctl",
}


def code_contexts(text):
    """Each logical line of a fenced code block (backslash continuations joined) and each inline
    code span: the places a command line or a flag is written."""
    out = []

    def block(m):
        for line in re.sub(r"\\\n\s*", " ", m.group(1)).splitlines():
            out.append(line)
        return "\n" * m.group(0).count("\n")
    rest = re.sub(r"```[^\n]*\n(.*?)```", block, text, flags=re.S)
    out += [m.group(1) for m in re.finditer(r"`([^`]+?)`", rest) if "\n\n" not in m.group(1)]
    return out


CMD = re.compile(r"(?:^|[\s;|&($])(detproxy-sim|detproxy)((?: [a-z]+)*)")


def flag_drift(docs, prog):
    """(docs naming a flag its command lacks, program flags no page names). docs: {name: text};
    prog: {command: flags}."""
    union = set().union(*[v for k, v in prog.items() if k != "detproxy-sim"]) | {"--version"}
    bad, named = [], set()
    for name, text in docs.items():
        # One command per pipeline stage or list item: `detproxy run | check [--strict]`.
        for ctx in [c for x in code_contexts(text) for c in re.split(r"\s(?:\||;|&&)\s", x)]:
            m = CMD.search(ctx)
            if m:
                # What stands before the command word belongs to what runs it (podman run ...).
                flags = re.findall(FLAG, ctx[m.start():])
                who = m.group(1)
                if who == "detproxy":
                    words = m.group(2).split()
                    for n in range(len(words), 0, -1):
                        if " ".join(words[:n]) in prog:
                            who = " ".join(words[:n])
                            break
                allowed = prog.get(who, union)
            else:
                words = ctx.split()
                if not words or not words[0].startswith("--"):
                    continue  # another program's command line
                flags = re.findall(FLAG, ctx)
                who, allowed = "(a flag alone)", union | prog.get("detproxy-sim", set())
            for f in flags:
                named.add(f)
                if f not in allowed and f not in OTHER_FLAGS:
                    bad.append("%s: %s does not have %s: `%s`" % (name, who, f, ctx.strip()[:90]))
    undocumented = ["%s %s" % (c, f) for c, v in sorted(prog.items()) for f in sorted(v)
                    if f != "--help" and f not in named]
    return bad, undocumented


# What the code argument of each call that answers an error is (0-based): the client listener
# (policy, the data plane, the server's own refusals), the admin listener, the relay, the agent.
ERROR_CALLS = {"net_resp_error": 3, "policy_set_error": 2, "fail_client": 2,
               "fail_client_why": 2, "relay_fail": 2}
PROGRAM_DIRS = ("proxy", "net", "policy", "agent", "diagnose", "config", "attest", "probe",
                "common", "drift")


def call_args(text, i):
    """The top-level arguments of the call whose '(' ends just before i."""
    args, cur, depth, instr = [], "", 0, False
    while i < len(text):
        ch = text[i]
        if instr:
            cur += ch
            if ch == "\\":
                cur += text[i + 1]
                i += 2
                continue
            instr = ch != '"'
        elif ch == '"':
            instr = True
            cur += ch
        elif ch in "([{":
            depth += 1
            cur += ch
        elif ch in ")]}":
            if depth == 0:
                return args + [cur]
            depth -= 1
            cur += ch
        elif ch == "," and depth == 0:
            args.append(cur)
            cur = ""
        else:
            cur += ch
        i += 1
    return args


def program_error_codes(sources):
    """{code: files} from C sources {path: text}: the string literals in the code argument of
    every ERROR_CALLS call, in a status-to-code mapping (`const char *code = status == 431 ?
    ...`) and in `.code = ...` initialisers of error structs."""
    codes = {}
    lit = r'"([a-z][a-z0-9_]*)"'
    for path, text in sources.items():
        t = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
        found = []
        for m in re.finditer(r"\b(%s)\s*\(" % "|".join(ERROR_CALLS), t):
            args = call_args(t, m.end())
            if len(args) > ERROR_CALLS[m.group(1)]:
                found += re.findall(lit, args[ERROR_CALLS[m.group(1)]])
        for m in re.finditer(r"(?:const char \*code\s*=\s*status ==|\.code\s*=)([^;}]*)", t):
            found += re.findall(lit, m.group(1))
        found += re.findall(r"(?<![>.\w])code\s*=\s*" + lit + r"\s*;", t)  # chosen before a call
        for c in found:
            codes.setdefault(c, set()).add(path)
    return codes


# client_closed, drain_closed: the access log's codes for a stream cut without an answer (the
# client left; the shutdown drain ran out); no error body carries them.
NOT_ERROR_CODES = {"client_closed", "drain_closed"}


def doc_error_codes(docs):
    """{code: pages}: the codes of the docs' error tables (`| 404 | `code` | ...`), of a 4xx/5xx
    status written before a code (`404 `replica_not_found``, `503 with `"code":"x"``) and of
    error bodies in examples."""
    out = {}
    for name, text in docs.items():
        found = []
        for m in re.finditer(r"^\|\s*[1-5]\d\d\s*\|([^|]*)\|", text, re.M):
            found += re.findall(r"`([a-z][a-z0-9_]*)`", m.group(1))
        found += re.findall(r"\b[45]\d\d\)?\s+`([a-z][a-z0-9_]*)`", text)
        found += re.findall(r'"error"\s*:\s*\{[^}]*?"code"\s*:\s*"([a-z][a-z0-9_]*)"', text)
        found += re.findall(r'\b[45]\d\d\b[^\n`]{0,30}`"code"\s*:\s*"([a-z][a-z0-9_]*)"`', text)
        for c in found:
            if c not in NOT_ERROR_CODES:
                out.setdefault(c, set()).add(name)
    return out


def admin_routes(admin_c, relay_c):
    """The admin listener's routes, from its source (admin_c: every file of proxy/control): every
    path_is() literal and `path[] = "/admin/..."` constant, the per-replica actions under the
    replicas prefix, the relay's prefix. The status page `/` is left out."""
    routes = set(re.findall(r'path_is\(req, "([^"]+)"\)', admin_c))
    routes |= set(re.findall(r'\bpath\[\] = "(/admin/[^"]+)"', admin_c))
    prefix = re.search(r'prefix\[\] = "(/admin/[a-z/]+/)"', admin_c).group(1)
    for action in re.findall(r'memcmp\(slash \+ 1, "([a-z]+)"', admin_c):
        routes.add(prefix + "NAME/" + action)
    routes.add(re.search(r'#define RELAY_PREFIX "([^"]+)"', relay_c).group(1))
    routes.discard("/")
    return routes


def doc_routes(docs):
    """{route: pages} for every admin path the docs name (`/admin/...`, /healthz, /readyz,
    /metrics); a replica's name in a drain/enable path reads as NAME, anything under the relay as
    the relay, a wildcard (`/admin/*`) as nothing."""
    out = {}
    for name, text in docs.items():
        for m in re.finditer(r"(?<![\w.:/-])(/admin(?:/[A-Za-z0-9_{}<>.*-]+)*|/healthz|/readyz|"
                             r"/metrics)(?![\w-])", text):
            p = m.group(1).rstrip("/.")
            r = re.match(r"^(/admin/replicas/)[^/]+/(drain|enable)$", p)
            if r:
                p = r.group(1) + "NAME/" + r.group(2)
            elif p.startswith("/admin/relay"):
                p = "/admin/relay"
            if "*" not in p:
                out.setdefault(p, set()).add(name)
    return out


def doc_texts():
    return {os.path.relpath(p, SRC): open(p).read() for p in pages()}


def both_ways(named, has, what):
    out = ["the docs name %s %s, which the program does not have (%s)" %
           (what, k, ", ".join(sorted(v))) for k, v in sorted(named.items()) if k not in has]
    out += ["the program has %s %s, which no page names (%s)" %
            (what, k, ", ".join(sorted(v)) if isinstance(v, set) else v)
            for k, v in sorted(has.items()) if k not in named]
    return out


def test_docs_and_program_name_the_same_error_codes():
    srcs = {}
    for d in PROGRAM_DIRS:
        for p in glob.glob(os.path.join(SRC, d, "**", "*.c"), recursive=True):
            with open(p) as f:
                srcs[os.path.relpath(p, SRC)] = f.read()
    prog = program_error_codes(srcs)
    assert {"no_attested_replica", "replica_not_found", "bad_request", "model_not_found",
            "bad_nonce"} <= set(prog), sorted(prog)  # the scan itself found them
    bad = both_ways(doc_error_codes(doc_texts()), prog, "error code")
    assert not bad, "\n".join(bad)


def test_docs_and_program_name_the_same_flags():
    if not DETPROXY_BIN:
        return
    prog = program_flags()
    assert len(prog) >= 14 and "--pool" in prog["diagnose"], prog  # the parse found them
    bad, undocumented = flag_drift(doc_texts(), prog)
    assert not bad and not undocumented, "\n".join(
        bad + ["no page names %s" % u for u in undocumented])


def test_docs_and_program_name_the_same_admin_endpoints():
    control = os.path.join(SRC, "proxy", "control")
    admin = ""
    for name in sorted(os.listdir(control)):
        if name.endswith(".c"):
            with open(os.path.join(control, name)) as f:
                admin += f.read()
    with open(os.path.join(control, "relay.c")) as f:
        relay = f.read()
    routes = admin_routes(admin, relay)
    assert {"/admin/replicas", "/admin/replicas/NAME/drain", "/admin/relay", "/readyz"} <= routes
    bad = both_ways(doc_routes(doc_texts()), {r: "proxy/control" for r in routes}, "endpoint")
    assert not bad, "\n".join(bad)


def test_the_name_checks_catch_drift_either_way():
    # Error codes: one the docs invent, one the program has that no page names.
    src = {"x.c": 'net_resp_error(req, 404, NULL, cond ? "gone_a" : "gone_b", NULL, "m", NULL, 0);'
                  '\nfail_client(q, 503, "busy_now", NULL, f("a", b));'
                  '\n/* fail_client(q, 1, "in_a_comment", NULL, 0); */'}
    prog = program_error_codes(src)
    assert set(prog) == {"gone_a", "gone_b", "busy_now"}, prog
    docs = {"a.md": "| 404 | `gone_a`, `gone_b` | x |\nanswers 503 `made_up`\n"}
    bad = both_ways(doc_error_codes(docs), prog, "error code")
    assert any("made_up" in b for b in bad) and any("busy_now" in b for b in bad), bad
    # Flags: a command's flag the docs misattribute, one nobody documents, another program's.
    prog = {"diagnose": {"--pool", "--json"}, "replay": {"--since"}}
    docs = {"a.md": "```sh\ndetproxy diagnose --pool p --bogus x\npodman run --rm img\n```\n"
                    "`--json` and `--parallel 1`"}
    bad, undocumented = flag_drift(docs, prog)
    assert len(bad) == 1 and "diagnose does not have --bogus" in bad[0], bad
    assert undocumented == ["replay --since"], undocumented
    # Endpoints: one the docs invent, one no page names.
    admin = ('static const char prefix[] = "/admin/replicas/";\nmemcmp(slash + 1, "drain", 5)'
             '\npath_is(req, "/admin/config")\npath_is(req, "/admin/secret")')
    routes = admin_routes(admin, '#define RELAY_PREFIX "/admin/relay"')
    docs = {"a.md": "`POST /admin/replicas/r2/drain`, `/admin/relay/v1/x`, `/admin/config`, "
                    "`/admin/replicas/r2/drain`, `/admin/*`, `/admin/nope`"}
    bad = both_ways(doc_routes(docs), {r: "src" for r in routes}, "endpoint")
    assert sorted(bad) == sorted([
        "the docs name endpoint /admin/nope, which the program does not have (a.md)",
        "the program has endpoint /admin/secret, which no page names (src)"]), bad


if __name__ == "__main__":
    run_tests(globals())
