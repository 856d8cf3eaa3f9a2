"""Shared by the tests/real suites: scripts/real-engine.sh (DETPROXY_REAL_ENGINE overrides the
path), the skip when it cannot run, and llama-server replicas started and stopped by name.

    from realutil import require_engine, servers, stop_servers
    require_engine()                      # SKIPPED + exit 77 when no engine can be had
    urls = servers("det", [FLAGS, FLAGS])  # one llama-server per flag list, f16 model
    log = server_log()                    # the last one's log
    stop_servers()"""

import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))

from harness import SOURCE_DIR, free_port  # noqa: E402

SCRIPT = os.environ.get("DETPROXY_REAL_ENGINE") or os.path.join(SOURCE_DIR, "scripts",
                                                                "real-engine.sh")
# The script's state: its chroot (root/; a file an engine reads goes under root/) and run/.
REAL_DIR = os.environ.get("DETPROXY_REAL_DIR", "/var/cache/detproxy/real")
_started = []


def engine(*args, check=True):
    r = subprocess.run([SCRIPT] + list(args), capture_output=True, text=True, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError("real-engine.sh %s: rc %d\n%s" % (" ".join(args), r.returncode,
                                                              r.stderr[-2000:]))
    return r


def skip(why):
    print("SKIPPED: " + why, flush=True)
    sys.exit(77)


def require_engine():
    if not os.access(SCRIPT, os.X_OK):
        skip("no %s (real llama.cpp engine script)" % SCRIPT)
    r = engine("setup", check=False)
    if r.returncode == 77:
        skip("the Debian archive cannot be reached to build the llama.cpp chroot")
    assert r.returncode == 0, r.stderr


def servers(prefix, flag_lists, model="f16"):
    """Start one llama-server per entry of flag_lists (each a list of flags); their URLs."""
    urls = []
    for flags in flag_lists:
        name = "%s-%d-%d" % (prefix, os.getpid(), len(_started))
        port = free_port()
        _started.append(name)
        for _ in range(3):  # start may misreport a live server as exited: try again
            engine("stop", name)
            if engine("start", name, str(port), model, "--", *flags, check=False).returncode == 0:
                break
        else:
            raise AssertionError("cannot start llama-server %s" % name)
        urls.append("http://127.0.0.1:%d" % port)
    return urls


def server_log(n=-1):
    """The log of the n-th server started (llama-server's own lines: slots launched, released)."""
    with open(os.path.join(REAL_DIR, "run", _started[n] + ".log"), errors="replace") as f:
        return f.read()


def stop_servers():
    if _started:
        engine("stop", *_started, check=False)
        del _started[:]
