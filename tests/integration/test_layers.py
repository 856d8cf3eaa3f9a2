#!/usr/bin/env python3
"""The module layers hold (issue 13; docs/contributing/modules.md has the map):

    common < config < policy, attest, proxy/drift (pure) < net < probe
           < proxy, agent, diagnose, tests/sim, bench < proxy/main.c

- a file includes headers of its own module and of strictly lower layers only: nothing below
  includes anything above, and modules of one layer do not include each other;
- the pure layers (common, config, policy, attest, proxy/drift) include no libuv (<uv.h>);
- every C file of the source tree belongs to a module listed here, so a new folder has to be
  placed in the order before it builds into the binary.
tests/unit and tests/fuzz may include anything (they test modules from outside).
"""
import glob
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))
from harness import run_tests  # noqa: E402

SRC = os.path.abspath(os.environ.get("DP_SOURCE_DIR",
                                     os.path.join(os.path.dirname(__file__), "..", "..")))

# Module -> layer. A path belongs to the module of its longest matching prefix.
LAYERS = {
    "common/": 0,
    "config/": 1,
    "policy/": 2,
    "attest/": 2,
    "drift/": 2,
    "net/": 3,
    "probe/": 4,
    "proxy/": 5,
    "agent/": 5,
    "diagnose/": 5,
    "tests/sim/": 5,
    "bench/": 5,
    "proxy/main.c": 6,
}
PURE = 2  # layers up to this one link no libuv
EXEMPT = ("tests/unit/", "tests/fuzz/", "build", ".git/")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]', re.M)


def module_of(path):
    best = None
    for prefix in LAYERS:
        if (path == prefix or path.startswith(prefix)) and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def violations(files):
    """files: {repo-relative path: text}. Returns one message per broken rule."""
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


def source_files():
    files = {}
    for p in glob.glob(os.path.join(SRC, "**", "*.[ch]"), recursive=True):
        rel = os.path.relpath(p, SRC)
        if rel.startswith(EXEMPT):
            continue
        with open(p, encoding="utf-8", errors="replace") as f:
            files[rel] = f.read()
    return files


def test_no_lower_layer_includes_a_higher_one():
    files = source_files()
    assert len(files) > 100, "found only %d source files under %s" % (len(files), SRC)
    bad = violations(files)
    assert not bad, "layer violations:\n  " + "\n  ".join(bad)


def test_the_check_catches_each_kind_of_violation():
    """The rules themselves, on made-up files: each kind of violation is reported."""
    bad = violations({
        "attest/x.c": '#include "net/fetch.h"\n#include <uv.h>\n#include "attest/x.h"\n',
        "net/y.c": '#include "probe/probe.h"\n',
        "agent/z.c": '  #  include "diagnose/diagnose.h"\n#include "probe/probe.h"\n',
        "drift/d.c": '#include "proxy/core/px.h"\n',
        "proxy/p.c": '#include "drift/drift.h"\n#include "agent/agent.h"\n',
        "newdir/n.c": '#include "common/util.h"\n',
        "probe/q.c": '#include "nowhere/h.h"\n#include "local.h"\n',
        "proxy/main.c": '#include "agent/agent.h"\n#include "diagnose/diagnose.h"\n',
        "tests/unit/test_x.c": '#include "proxy/px.h"\n',
    })
    text = "\n".join(bad)
    for want in ['attest/x.c (attest, layer 2) includes "net/fetch.h"',
                 "attest/x.c: includes <uv.h>",
                 'net/y.c (net, layer 3) includes "probe/probe.h"',
                 'agent/z.c (agent, layer 5) includes "diagnose/diagnose.h"',
                 'drift/d.c (drift, layer 2) includes "proxy/core/px.h"',
                 'proxy/p.c (proxy, layer 5) includes "agent/agent.h"',
                 "newdir/n.c: in no module",
                 'probe/q.c: includes "nowhere/h.h", which is in no module']:
        assert want in text, (want, bad)
    assert len(bad) == 8, bad  # main.c, the unit test and the allowed includes pass


if __name__ == "__main__":
    run_tests(globals())
