#!/usr/bin/env python3
"""The house holds: every arrow points down (docs/contributing/modules.md has the map).

    common < config < policy, attest, drift (pure) < net < probe
           < proxy/core, agent, diagnose, tests/sim, bench
           < proxy/obs, proxy/cli < proxy/data < proxy/control < proxy/main.c

Read from the sources:
- a file includes headers of its own module and of strictly lower layers only: nothing below
  includes anything above, and modules of one layer do not include each other;
- the pure layers (common, config, policy, attest, drift) include no libuv (<uv.h>);
- no two files include each other, directly or around a loop;
- every C file of the source tree belongs to a module listed here, so a new folder has to be
  placed in the order before it builds into the binary.
Read from the build's object files (`nm`: what each file defines and what it uses):
- a file calls (or reads a global of) its own module and strictly lower layers only;
- no two files call each other, directly or around a loop: two files that need each other are
  one job split wrong, or need a callback, an ops table or a message between them;
- a proxy file exports its own name: proxy/<plane>/<name>.c defines px_<name>* only (and
  px_cmd_<command>, the entry point of a command, where that command lives).
tests/unit and tests/fuzz may include anything (they test modules from outside).
"""
import collections
import glob
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from harness import run_tests  # noqa: E402

SRC = os.path.abspath(os.environ.get("DP_SOURCE_DIR",
                                     os.path.join(os.path.dirname(__file__), "..", "..")))
BUILD = os.environ.get("DP_BUILD_DIR", os.path.join(SRC, "build", "release"))

# Module -> layer. A path belongs to the module of its longest matching prefix.
LAYERS = {
    "common/": 0,
    "config/": 1,
    "policy/": 2,
    "attest/": 2,
    "drift/": 2,
    "net/": 3,
    "probe/": 4,
    "fleet/": 4,
    "proxy/core/": 5,
    "agent/": 5,
    "diagnose/": 5,
    "tests/sim/": 5,
    "bench/": 5,
    "proxy/obs/": 6,
    "proxy/cli/": 6,
    "proxy/data/": 7,
    "proxy/control/": 8,
    "proxy/main.c": 9,
}
PURE = 2  # layers up to this one link no libuv
EXEMPT = ("tests/unit/", "tests/fuzz/", "tests/oracle/", "tests/tlsclient/", "build", ".git/")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]', re.M)


def module_of(path):
    best = None
    for prefix in LAYERS:
        if (path == prefix or path.startswith(prefix)) and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def violations(files):
    """files: {repo-relative path: text}. Returns one message per broken include rule."""
    out = []
    for path, text in sorted(files.items()):
        if path.startswith(EXEMPT):
            continue
        mod = module_of(path)
        if mod is None:
            out.append("%s: in no module (add its folder to LAYERS in %s and to "
                       "docs/contributing/modules.md)" % (path, os.path.basename(__file__)))
            continue
        layer = LAYERS[mod]
        for kind, inc in INCLUDE.findall(text):
            if kind == "<":
                if inc == "uv.h" and layer <= PURE:
                    out.append("%s: includes <uv.h>, but %s is a pure layer" % (path, mod))
                continue
            target = module_of(inc)
            if target is None:
                if "/" in inc:
                    out.append("%s: includes \"%s\", which is in no module" % (path, inc))
                continue  # a header next to the file ("jcs_pow10.h")
            if target == mod or LAYERS[target] < layer:
                continue
            out.append("%s (%s, layer %d) includes \"%s\" (%s, layer %d): only lower layers "
                       "may be included" % (path, mod.rstrip("/"), layer, inc,
                                            target.rstrip("/"), LAYERS[target]))
    return out


def cycles(graph):
    """Strongly connected components of more than one node (or a node that reaches itself):
    each a sorted list. graph: {node: set of nodes}."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        # Iterative Tarjan: the include and call graphs are deep enough to hit Python's
        # recursion limit on a bad day.
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1 or node in graph.get(node, ()):
                    out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def include_graph(files):
    """{file: set of files it includes}, for quoted includes that resolve to a file here."""
    g = collections.defaultdict(set)
    for path, text in files.items():
        if path.startswith(EXEMPT):
            continue
        for kind, inc in INCLUDE.findall(text):
            if kind != '"':
                continue
            for cand in (inc, os.path.normpath(os.path.join(os.path.dirname(path), inc))):
                if cand in files and cand != path:
                    g[path].add(cand)
                    break
    return g


def include_cycles(files):
    return ["include cycle: " + " -> ".join(c) for c in cycles(include_graph(files))]


def call_graph(symbols):
    """symbols: {source file: (set defined, set used)}. Returns {file: set of files whose
    definitions it uses}."""
    owner = {}
    for path, (defined, _) in symbols.items():
        for s in defined:
            owner[s] = path
    g = collections.defaultdict(set)
    for path, (_, used) in symbols.items():
        for s in used:
            o = owner.get(s)
            if o is not None and o != path:
                g[path].add(o)
    return g


def call_violations(symbols):
    """Calls up or sideways (between modules of one layer), and call cycles among files."""
    g = call_graph(symbols)
    out = []
    for path in sorted(g):
        mod = module_of(path)
        if mod is None:
            continue  # reported by the include check
        for target in sorted(g[path]):
            tmod = module_of(target)
            if tmod is None or tmod == mod or LAYERS[tmod] < LAYERS[mod]:
                continue
            out.append("%s (%s, layer %d) calls into %s (%s, layer %d): only lower layers may "
                       "be called" % (path, mod.rstrip("/"), LAYERS[mod], target,
                                      tmod.rstrip("/"), LAYERS[tmod]))
    out += ["call cycle: " + " -> ".join(c) for c in cycles(g)]
    return out


PROXY_FILE = re.compile(r"^proxy/[a-z]+/([a-z_]+)\.c$")


def name_violations(symbols):
    """A proxy file exports names with its own prefix (worker.c: px_worker_*, px_workers_*)."""
    out = []
    for path, (defined, _) in sorted(symbols.items()):
        m = PROXY_FILE.match(path)
        if not m:
            continue
        prefix = "px_" + m.group(1)
        for s in sorted(defined):
            # "__..." are the toolchain's (ASan's __odr_asan.NAME indicators), not the file's.
            if s.startswith(prefix) or s.startswith("px_cmd_") or s.startswith("__"):
                continue
            out.append("%s exports %s: a file exports its own prefix (%s*)" % (path, s, prefix))
    return out


def object_symbols(build):
    """{source file: (defined, used)} from the object files of the project's own modules."""
    out = {}
    for obj in glob.glob(os.path.join(build, "**", "CMakeFiles", "*.dir", "**", "*.c.o"),
                         recursive=True):
        rel_dir, rest = obj.split(os.sep + "CMakeFiles" + os.sep, 1)
        target, src = rest.split(os.sep, 1)
        if target == "llhttp.dir":
            continue
        path = os.path.normpath(os.path.join(os.path.relpath(rel_dir, build), src[:-2]))
        if path.startswith(EXEMPT) or not os.path.exists(os.path.join(SRC, path)):
            continue  # tests, and objects a moved or deleted file left behind
        defined, used = set(), set()
        res = subprocess.run(["nm", obj], capture_output=True, text=True, check=True)
        for line in res.stdout.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TDRBCV":
                defined.add(parts[2])
            elif len(parts) == 2 and parts[0] == "U":
                used.add(parts[1])
        out[path] = (defined, used)
    return out


def source_files():
    files = {}
    for p in glob.glob(os.path.join(SRC, "**", "*.[ch]"), recursive=True):
        rel = os.path.relpath(p, SRC)
        if rel.startswith(EXEMPT):
            continue
        with open(p, encoding="utf-8", errors="replace") as f:
            files[rel] = f.read()
    return files


def built_symbols():
    syms = object_symbols(BUILD)
    assert len(syms) > 60, ("found objects of only %d source files under %s: the checks on "
                             "calls need the build (DP_BUILD_DIR)" % (len(syms), BUILD))
    return syms


def test_no_lower_layer_includes_a_higher_one():
    files = source_files()
    assert len(files) > 100, "found only %d source files under %s" % (len(files), SRC)
    bad = violations(files)
    assert not bad, "layer violations:\n  " + "\n  ".join(bad)


def test_no_include_cycles():
    bad = include_cycles(source_files())
    assert not bad, "\n  ".join(bad)


def test_calls_point_down_and_never_loop():
    bad = call_violations(built_symbols())
    assert not bad, "call violations:\n  " + "\n  ".join(bad)


def test_proxy_files_export_their_own_names():
    bad = name_violations(built_symbols())
    assert not bad, "\n  ".join(bad)


def test_the_check_catches_each_kind_of_violation():
    """The include rules themselves, on made-up files: each kind of violation is reported."""
    bad = violations({
        "attest/x.c": '#include "net/fetch.h"\n#include <uv.h>\n#include "attest/x.h"\n',
        "net/y.c": '#include "probe/probe.h"\n',
        "agent/z.c": '  #  include "diagnose/diagnose.h"\n#include "probe/probe.h"\n',
        "drift/d.c": '#include "proxy/core/px.h"\n',
        "proxy/core/p.c": '#include "proxy/data/worker.h"\n#include "agent/agent.h"\n',
        "proxy/data/w.c": '#include "proxy/core/px.h"\n#include "proxy/obs/audit.h"\n',
        "newdir/n.c": '#include "common/util.h"\n',
        "probe/q.c": '#include "nowhere/h.h"\n#include "local.h"\n',
        "proxy/main.c": '#include "agent/agent.h"\n#include "diagnose/diagnose.h"\n',
        "tests/unit/test_x.c": '#include "proxy/control/run.h"\n',
    })
    text = "\n".join(bad)
    for want in ['attest/x.c (attest, layer 2) includes "net/fetch.h"',
                 "attest/x.c: includes <uv.h>",
                 'net/y.c (net, layer 3) includes "probe/probe.h"',
                 'agent/z.c (agent, layer 5) includes "diagnose/diagnose.h"',
                 'drift/d.c (drift, layer 2) includes "proxy/core/px.h"',
                 'proxy/core/p.c (proxy/core, layer 5) includes "proxy/data/worker.h"',
                 'proxy/core/p.c (proxy/core, layer 5) includes "agent/agent.h"',
                 "newdir/n.c: in no module",
                 'probe/q.c: includes "nowhere/h.h", which is in no module']:
        assert want in text, (want, bad)
    assert len(bad) == 9, bad  # main.c, data/w.c, the unit test and the allowed includes pass


def test_the_cycle_and_call_checks_catch_their_violations():
    """Include loops, calls up or sideways, call loops inside one module, and exported names,
    on made-up files and symbols."""
    inc = include_cycles({
        "net/a.h": '#include "net/b.h"\n',
        "net/b.h": '#include "c.h"\n',
        "net/c.h": '#include "net/a.h"\n',
        "net/d.c": '#include "net/a.h"\n',  # includes the loop, is not part of it
    })
    assert inc == ["include cycle: net/a.h -> net/b.h -> net/c.h"], inc

    syms = {
        "proxy/core/replica.c": ({"px_replica_ref", "px_attest_free"}, {"px_status_note"}),
        "proxy/control/status.c": ({"px_status_note"}, {"px_replica_ref"}),
        "proxy/data/a.c": ({"px_a_x"}, {"px_b_y"}),
        "proxy/data/b.c": ({"px_b_y"}, {"px_a_x", "px_replica_ref"}),
        "proxy/obs/log.c": ({"px_log_z"}, {"px_cli_w"}),
        "proxy/cli/fetch.c": ({"px_cli_w", "px_cmd_audit", "__odr_asan.px_cli_w"}, set()),
        "net/n.c": ({"net_n"}, {"malloc"}),
    }
    text = "\n".join(call_violations(syms))
    for want in ["proxy/core/replica.c (proxy/core, layer 5) calls into proxy/control/status.c",
                 "proxy/obs/log.c (proxy/obs, layer 6) calls into proxy/cli/fetch.c",
                 "call cycle: proxy/data/a.c -> proxy/data/b.c",
                 "call cycle: proxy/control/status.c -> proxy/core/replica.c"]:
        assert want in text, (want, text)
    assert "net/n.c" not in text and "proxy/data/b.c (proxy/data" not in text, text

    names = "\n".join(name_violations(syms))
    assert "proxy/core/replica.c exports px_attest_free" in names, names
    assert "proxy/cli/fetch.c exports px_cli_w" in names, names
    assert "px_replica_ref" not in names and "px_cmd_audit" not in names, names
    assert "__odr_asan" not in names, names


if __name__ == "__main__":
    run_tests(globals())
