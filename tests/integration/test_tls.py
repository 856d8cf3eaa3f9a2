"""TLS both ways (docs/security.md §3): the client listener (ALPN, mTLS, handshake timeout,
hostile handshakes, certificate reload) and verified upstreams (CA, SNI, host names, server_name,
client certificates, session resumption, truncation), with certificates made by the openssl CLI
(certs.py). After every hostile case the proxy serves the next request; under ASan stop() is
clean."""

import json
import os
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import tempfile
import threading
import time

import http.client as hc

from certs import (TlsUpstream, client_context, client_hello, completion_json, ok_response,
                   peer_closed, server_context, shared_pki, stalled_handshakes)
from harness import (DETPROXY_BIN, SLOW, TSAN, Response, get_json, http, poll_until, post_json,
                     run_cmd, run_tests, start_process, start_sim)
from proxyutil import (exchange, metric, parse_response, pool, read_until_close, rss_kb,
                       start_proxy, write_config)

PKI = shared_pki()
MODEL = "m1"
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 3}


# ---- helpers ----------------------------------------------------------------------------------


def tls_listener(pair=None, client_ca=None):
    pair = pair or PKI.server
    t = {"cert_file": pair.crt, "key_file": pair.key}
    if client_ca is not None:
        t["client_ca_file"] = client_ca.crt
    return t


def https(port, method="POST", path="/v1/completions", body=BODY, ctx=None, conn=None,
          host="127.0.0.1", headers=None, timeout=20):
    """One request over TLS; returns (Response, connection) so a test can send another on the
    same connection. The connection is verified against the test CA unless ctx says otherwise."""
    if conn is None:
        conn = hc.HTTPSConnection(host, port, timeout=timeout * SLOW,
                                  context=ctx or client_context(PKI.ca))
    data = json.dumps(body).encode() if body is not None and not isinstance(body, bytes) else body
    hdrs = {"content-type": "application/json"} if data else {}
    hdrs.update(headers or {})
    conn.request(method, path, body=data, headers=hdrs)
    r = conn.getresponse()
    b = r.read()
    return Response(r.status, r.reason, [(k.lower(), v) for k, v in r.getheaders()], b), conn


def https_ok(port, **kw):
    r, c = https(port, **kw)
    c.close()
    assert r.status == 200, r
    return r


def attempt(port, ctx, server_hostname="localhost"):
    """A whole request over TLS with ctx: ("ok", status) or ("error", text). With TLS 1.3 a
    server that refuses a client certificate says so only after the client's handshake ended,
    so the refusal may surface on the first read rather than in the handshake."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10 * SLOW) as raw:
            with ctx.wrap_socket(raw, server_hostname=server_hostname) as s:
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = s.recv(65536)
                    if not chunk:
                        return "error", "closed without a response (%r)" % data
                    data += chunk
                return "ok", int(data.split(b" ")[1])
    except (ssl.SSLError, OSError) as e:
        return "error", str(e)


def peer_cert(port, ctx=None):
    with socket.create_connection(("127.0.0.1", port), timeout=10 * SLOW) as raw:
        with (ctx or client_context(PKI.ca)).wrap_socket(raw, server_hostname="localhost") as s:
            return s.getpeercert()


def cn_of(cert):
    return dict(x[0] for x in cert["subject"])["commonName"]


def tls_sim(pair=None, *flags):
    pair = pair or PKI.server
    return start_sim("--model", MODEL, "--tls-cert", pair.crt, "--tls-key", pair.key, *flags)


def https_pool(name, models, urls, ca=PKI.ca, **extra):
    """A pool whose replicas are the given https URLs (or (url, extra) pairs)."""
    reps = []
    for i, u in enumerate(urls):
        u, more = (u, {}) if isinstance(u, str) else u
        d = {"name": "r%d" % (i + 1), "url": u}
        d.update(more)
        reps.append(d)
    p = {"name": name, "models": models, "replicas": reps}
    if ca is not None:
        p["upstream_tls"] = {"ca_file": ca.crt}
    p.update(extra)
    return p


def replicas(px):
    return {(r["pool"], r["name"]): r
            for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}


def serving(px, tls=True):
    """The proxy still answers (over TLS, or plaintext when tls is False)."""
    if tls:
        https_ok(px.port, method="GET", path="/v1/models", body=None)
    else:
        r = http("GET", px.port, "/v1/models")
        assert r.status == 200, r
    assert px.alive()


def listener_proxy(client_ca=None, limits=None, directory=None, tls=None):
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])],
                     tls=tls or tls_listener(client_ca=client_ca), limits=limits,
                     directory=directory)
    return sim, px


# ---- the client listener ------------------------------------------------------------------------


def test_https_request_negotiates_http11_and_shows_the_certificate():
    sim, px = listener_proxy()
    ctx = client_context(PKI.ca, alpn=["h2", "http/1.1"])
    r, conn = https(px.port, ctx=ctx, host="localhost")
    assert r.status == 200, r
    assert r.json()["choices"] and r.headers["x-detproxy-replica"] == "r1"
    assert conn.sock.selected_alpn_protocol() == "http/1.1"
    assert conn.sock.version() in ("TLSv1.3", "TLSv1.2")
    cert = conn.sock.getpeercert()
    assert cn_of(cert) == "detproxy-test" and int(cert["serialNumber"], 16) == PKI.server.serial
    # Keep-alive over TLS: the second request rides the same connection.
    sock = conn.sock
    r2, _ = https(px.port, conn=conn)
    assert r2.status == 200 and conn.sock is sock
    conn.close()
    # Verified by IP address too (the certificate carries IP:127.0.0.1), and without ALPN.
    assert https_ok(px.port, ctx=client_context(PKI.ca)).status == 200
    # Clients resume their sessions (tickets), TLS 1.3 and 1.2.
    for maxv in (None, ssl.TLSVersion.TLSv1_2):
        ctx = client_context(PKI.ca, maximum=maxv)
        sess = None
        reused = []
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", px.port)) as raw:
                with ctx.wrap_socket(raw, server_hostname="localhost", session=sess) as s:
                    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                    assert s.recv(65536).startswith(b"HTTP/1.1 200")
                    reused.append(s.session_reused)
                    sess = s.session
        assert reused == [False, True, True], (maxv, reused)
    # TLS 1.2 is accepted as well.
    ctx12 = client_context(PKI.ca, alpn=["http/1.1"], maximum=ssl.TLSVersion.TLSv1_2)
    r3, c3 = https(px.port, ctx=ctx12)
    assert r3.status == 200 and c3.sock.version() == "TLSv1.2"
    assert c3.sock.selected_alpn_protocol() == "http/1.1"
    c3.close()
    px.stop()


def test_a_client_offering_only_h2_is_refused():
    sim, px = listener_proxy()
    st, why = attempt(px.port, client_context(PKI.ca, alpn=["h2"]))
    assert st == "error" and "no application protocol" in why, (st, why)
    st, why = attempt(px.port, client_context(PKI.ca, alpn=["spdy/3", "h2c"]))
    assert st == "error" and "no application protocol" in why, (st, why)
    assert sim_client_requests(sim) == 0
    serving(px)
    px.stop()


def sim_client_requests(sim):
    return get_json(sim.port, "/_sim/stats")["requests"]


def test_protocol_versions_below_tls12_are_refused():
    sim, px = listener_proxy()
    for v in (ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1):
        ctx = client_context(PKI.ca, minimum=v, maximum=v)
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # let the client try: the refusal must be ours
        st, why = attempt(px.port, ctx)
        assert st == "error" and "protocol version" in why, (v, st, why)
    serving(px)
    px.stop()


def test_plaintext_http_to_the_tls_port_is_refused():
    sim, px = listener_proxy()
    t0 = time.monotonic()
    data, closed = exchange(px.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", timeout=5)
    took = time.monotonic() - t0
    assert closed and took < 2 * SLOW, (closed, took)
    assert b"HTTP/" not in data and b"models" not in data, data  # never answered in clear
    # A plaintext request with a body, and one byte at a time: the same.
    data, closed = exchange(px.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 2\r\n\r\n{}", timeout=5)
    assert closed and b"HTTP/" not in data
    with socket.create_connection(("127.0.0.1", px.port)) as s:
        for b in b"GET / HTTP/1.1\r\n":
            try:
                s.sendall(bytes([b]))
            except OSError:
                break
        got, closed = read_until_close(s, timeout=5)
        assert closed and b"HTTP/" not in got
    assert sim_client_requests(sim) == 0
    serving(px)
    px.stop()


def test_tls_to_a_plaintext_port_gets_400_and_the_port_keeps_serving():
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])])
    data, closed = exchange(px.port, client_hello(), timeout=5)
    assert closed, data
    resp = parse_response(data)
    assert resp.status == 400, resp
    st, why = attempt(px.port, client_context(PKI.ca))
    assert st == "error", (st, why)
    serving(px, tls=False)
    px.stop()


def test_mtls_requires_a_client_certificate_from_the_configured_ca():
    sim, px = listener_proxy(client_ca=PKI.ca)
    for maxv in (None, ssl.TLSVersion.TLSv1_2):
        # No certificate.
        st, why = attempt(px.port, client_context(PKI.ca, maximum=maxv))
        assert st == "error", (maxv, st, why)
        # A certificate from another CA.
        st, why = attempt(px.port, client_context(PKI.ca, cert=PKI.client_other, maximum=maxv))
        assert st == "error" and ("unknown ca" in why or "certificate" in why or
                                  "closed" in why), (maxv, st, why)
        # An expired client certificate from the right CA.
        st, why = attempt(px.port, client_context(PKI.ca, cert=PKI.client_expired, maximum=maxv))
        assert st == "error", (maxv, st, why)
        # A server certificate from the right CA presented as a client one: not a client cert.
        st, why = attempt(px.port, client_context(PKI.ca, cert=PKI.server2, maximum=maxv))
        assert st == "error", (maxv, st, why)
        # The right one.
        st, code = attempt(px.port, client_context(PKI.ca, cert=PKI.client, maximum=maxv))
        assert (st, code) == ("ok", 200), (maxv, st, code)
    assert sim_client_requests(sim) == 0  # /v1/models is answered by the proxy
    r = https_ok(px.port, ctx=client_context(PKI.ca, cert=PKI.client))
    assert r.json()["choices"]
    assert sim_client_requests(sim) == 1
    px.stop()


def close_time(port, payload, drip=None, timeout=10):
    """Open TCP, send payload (all at once, or drip bytes every `drip` seconds), and return how
    long until the proxy closed the connection (None when it did not within timeout)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout * SLOW) as s:
        if drip is None:
            s.sendall(payload)
        else:
            closed_at = []

            def watch():
                got, closed = read_until_close(s, timeout)
                if closed:
                    closed_at.append(time.monotonic())

            th = threading.Thread(target=watch, daemon=True)
            th.start()
            for b in payload:
                if closed_at:
                    break
                try:
                    s.sendall(bytes([b]))
                except OSError:
                    break
                time.sleep(drip)
            th.join(timeout * SLOW)
            return closed_at[0] - t0 if closed_at else None
        got, closed = read_until_close(s, timeout)
        assert b"HTTP/" not in got, got
        return time.monotonic() - t0 if closed else None


def test_a_stalled_handshake_is_cut_off_by_the_header_timeout():
    hto = int(800 * min(SLOW, 2.5))  # a handshake beside it is served well within it
    sim, px = listener_proxy(limits={"client_header_timeout_ms": hto,
                                     "client_idle_timeout_ms": 60000})
    hello = client_hello()
    lo, hi = hto / 1000.0 * 0.9, hto / 1000.0 + 1.0 * SLOW
    # Half a ClientHello, then nothing.
    t = close_time(px.port, hello[:len(hello) // 2])
    assert t is not None and lo <= t <= hi, t
    print("    partial ClientHello cut off after %.0f ms" % (t * 1000))
    # A ClientHello dripped a byte every 50 ms: progress does not extend the deadline.
    t = close_time(px.port, hello, drip=0.05)
    assert t is not None and lo <= t <= hi, t
    print("    dripped ClientHello cut off after %.0f ms" % (t * 1000))
    # A complete handshake and then no request: the same bound (the head never started).
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", px.port)) as raw:
        with client_context(PKI.ca).wrap_socket(raw, server_hostname="localhost") as s:
            s.settimeout(10 * SLOW)
            try:
                got = s.recv(100)
            except (ssl.SSLError, OSError):
                got = b""
            t = time.monotonic() - t0
            assert got == b"" and lo <= t <= hi, (got, t)
    # Meanwhile other connections were served at once.
    stalled = socket.create_connection(("127.0.0.1", px.port))
    stalled.sendall(hello[:10])
    t0 = time.monotonic()
    serving(px)
    assert time.monotonic() - t0 < hto / 1000.0, "a stalled handshake delayed another client"
    stalled.close()
    px.stop()


def collect(p):
    """Read a child's stdout as it comes (s_client prints its handshake before any input)."""
    out = bytearray()

    def run():
        for chunk in iter(lambda: p.stdout.read1(65536), b""):
            out.extend(chunk)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return out, th


def test_renegotiation_is_refused_and_key_update_works():
    sim, px = listener_proxy()
    p = subprocess.Popen(["openssl", "s_client", "-connect", "127.0.0.1:%d" % px.port,
                          "-tls1_2", "-CAfile", PKI.ca.crt, "-servername", "localhost", "-crlf"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    out, reader = collect(p)
    poll_until(lambda: b"Verify return code: 0" in out, timeout=10, what="s_client handshake")
    for line, pause in ((b"R\n", 0.5), (b"GET /v1/models HTTP/1.1\nHost: x\n"
                                           b"Connection: close\n\n", 0)):
        try:  # "R": s_client renegotiates; then a request, if the connection survived
            p.stdin.write(line)
            p.stdin.flush()
        except BrokenPipeError:
            break
        time.sleep(pause * SLOW)
    try:
        p.wait(timeout=10 * SLOW)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("s_client still connected after renegotiating: %s" % out[-800:])
    reader.join(5)
    text = out.decode("utf-8", "replace")
    assert "RENEGOTIATING" in text, text[-800:]
    assert "no renegotiation" in text or "alert" in text, text[-800:]
    assert '"object":"list"' not in text, "answered on a renegotiated connection"
    serving(px)
    # TLS 1.3 KeyUpdate is not renegotiation: the connection keeps working across it.
    p = subprocess.Popen(["openssl", "s_client", "-connect", "127.0.0.1:%d" % px.port,
                          "-tls1_3", "-CAfile", PKI.ca.crt, "-servername", "localhost", "-crlf"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    out, reader = collect(p)
    poll_until(lambda: b"Verify return code: 0" in out, timeout=10, what="s_client handshake")
    p.stdin.write(b"K\n")  # KeyUpdate, update_requested
    p.stdin.flush()
    time.sleep(0.3 * SLOW)
    p.stdin.write(b"GET /v1/models HTTP/1.1\nHost: x\nConnection: close\n\n")
    p.stdin.flush()
    try:
        p.wait(timeout=10 * SLOW)
    except subprocess.TimeoutExpired:
        p.kill()
    reader.join(5)
    text = out.decode("utf-8", "replace")
    assert "KEYUPDATE" in text and "HTTP/1.1 200" in text, text[-800:]
    serving(px)
    px.stop()


def record(body, typ=0x16, ver=b"\x03\x01", claim=None):
    return bytes([typ]) + ver + struct.pack(">H", len(body) if claim is None else claim) + body


def test_a_huge_client_hello_is_refused_without_harm():
    sim, px = listener_proxy()
    junk = os.urandom(120000)
    cases = {
        # A ClientHello claiming 16 MB in one record.
        "claims 16 MB": record(b"\x01\xff\xff\xff" + b"\x03\x03" + junk[:16378]),
        # A ClientHello claiming 100 KB, sent in full over seven records.
        "100 KB over records": b"".join(
            record((b"\x01" + (100000).to_bytes(3, "big") + b"\x03\x03" + junk[:16378])
                   if i == 0 else junk[i:i + 16384]) for i in range(0, 100004, 16384)),
        # A record header claiming 65535 bytes (above the TLS maximum), then 100 KB.
        "oversized record": record(b"", claim=0xFFFF) + junk[:100000],
        # 100 KB of records of the wrong content type before any handshake.
        "application data first": b"".join(record(junk[i:i + 16384], typ=0x17)
                                           for i in range(0, 100000, 16384)),
    }
    for name, data in cases.items():
        t0 = time.monotonic()
        got, closed = exchange(px.port, data, timeout=10)
        assert closed, name
        assert time.monotonic() - t0 < 5 * SLOW, name
        assert b"HTTP/" not in got, (name, got)
        serving(px)
    px.stop()


def no_sanitizer_report(text):
    for marker in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:"):
        assert marker not in text, text[-4000:]


def install(pair, d):
    shutil.copyfile(pair.crt, os.path.join(d, "proxy.crt"))
    shutil.copyfile(pair.key, os.path.join(d, "proxy.key"))
    os.chmod(os.path.join(d, "proxy.key"), 0o600)


def reloads_seen(px):
    return len(px.find_logs("reloaded")) + len(px.find_logs("reload_failed"))


def sighup(px):
    n = reloads_seen(px)
    px.send_signal(signal.SIGHUP)
    poll_until(lambda: reloads_seen(px) > n, timeout=10, what="reload logged")
    return [r for r in px.logs if r.get("msg") in ("reloaded", "reload_failed")][-1]


def test_certificate_reload_on_sighup_keeps_open_connections():
    d = tempfile.mkdtemp(prefix="detproxy-tls-reload-")
    install(PKI.server, d)
    sim = start_sim("--model", MODEL)
    # Relative paths resolve against the config's folder.
    px = start_proxy(pools=[pool("p", [MODEL], [sim])], directory=d,
                     tls={"cert_file": "proxy.crt", "key_file": "proxy.key"})
    first = peer_cert(px.port)
    assert int(first["serialNumber"], 16) == PKI.server.serial
    # A keep-alive connection opened before the reload.
    r, old = https(px.port)
    assert r.status == 200
    assert cn_of(old.sock.getpeercert()) == "detproxy-test"
    # Swap the files and SIGHUP: new connections get the new certificate.
    install(PKI.server2, d)
    sighup(px)
    assert px.find_logs("reloaded"), px.stderr_text()[-2000:]
    poll_until(lambda: int(peer_cert(px.port)["serialNumber"], 16) == PKI.server2.serial,
               timeout=5, what="new certificate served")
    assert cn_of(peer_cert(px.port)) == "detproxy-test-reloaded"
    # The old connection still works, on its old session.
    r, _ = https(px.port, conn=old)
    assert r.status == 200, r
    assert cn_of(old.sock.getpeercert()) == "detproxy-test"
    # A broken certificate file: the reload fails, the current certificate stays.
    with open(os.path.join(d, "proxy.crt"), "w") as f:
        f.write("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    rec = sighup(px)
    assert rec["msg"] == "reload_failed", rec
    assert "cert_file" in json.dumps(rec), rec
    assert int(peer_cert(px.port)["serialNumber"], 16) == PKI.server2.serial
    # A key that does not match the certificate: refused as well.
    shutil.copyfile(PKI.server.crt, os.path.join(d, "proxy.crt"))
    shutil.copyfile(PKI.server2.key, os.path.join(d, "proxy.key"))
    rec = sighup(px)
    assert rec["msg"] == "reload_failed", rec
    assert int(peer_cert(px.port)["serialNumber"], 16) == PKI.server2.serial
    # A pair the TLS library refuses (an RSA key below its security level): `check` says so as
    # `run` would, and the reload fails whole, the certificate served kept.
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:1024", "-nodes", "-subj",
                    "/CN=weak", "-days", "2", "-keyout", os.path.join(d, "proxy.key"), "-out",
                    os.path.join(d, "proxy.crt")], check=True, capture_output=True)
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", px.config_path])
    assert rc == 1 and "tls.cert_file" in err and "too small" in err, (rc, out, err)
    rec = sighup(px)
    assert rec["msg"] == "reload_failed" and "too small" in json.dumps(rec), rec
    assert int(peer_cert(px.port)["serialNumber"], 16) == PKI.server2.serial
    # The whole file counts, as the listener loads it: a corrupt block after a good certificate,
    # and in a client CA file.
    with open(os.path.join(d, "proxy.crt"), "w") as f:
        f.write(open(PKI.server.crt).read() + "-----BEGIN CERTIFICATE-----\nnot base64\n"
                "-----END CERTIFICATE-----\n")
    shutil.copyfile(PKI.server.key, os.path.join(d, "proxy.key"))
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", px.config_path])
    assert rc == 1 and "tls.cert_file" in err and "bad base64 decode" in err, (rc, out, err)
    r, _ = https(px.port, conn=old)
    assert r.status == 200
    old.close()
    # Turning on client certificates by reload: new connections need one, old ones go on.
    install(PKI.server, d)
    shutil.copyfile(PKI.ca.crt, os.path.join(d, "clients-ca.crt"))
    r, keep = https(px.port)
    cfg = json.load(open(px.config_path))
    cfg["tls"]["client_ca_file"] = "clients-ca.crt"
    write_config(cfg, d)
    rec = sighup(px)
    assert rec["msg"] == "reloaded", rec
    st, why = attempt(px.port, client_context(PKI.ca))
    assert st == "error", (st, why)
    assert attempt(px.port, client_context(PKI.ca, cert=PKI.client)) == ("ok", 200)
    r, _ = https(px.port, conn=keep)
    assert r.status == 200
    keep.close()
    px.stop()


def test_tls_turned_on_by_reload_applies_to_new_connections():
    d = tempfile.mkdtemp(prefix="detproxy-tls-on-")
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])], directory=d)
    old = hc.HTTPConnection("127.0.0.1", px.port, timeout=10 * SLOW)
    old.request("GET", "/v1/models")
    assert old.getresponse().read()
    cfg = json.load(open(px.config_path))
    cfg["tls"] = tls_listener()
    write_config(cfg, d)
    assert sighup(px)["msg"] == "reloaded"
    assert https_ok(px.port, method="GET", path="/v1/models", body=None)
    data, closed = exchange(px.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", timeout=5)
    assert closed and b"HTTP/" not in data, data
    old.request("GET", "/v1/models")  # the plaintext connection from before goes on
    r = old.getresponse()
    assert r.status == 200 and r.read()
    old.close()
    # Turning it off again needs a restart: the listener keeps TLS and says so.
    del cfg["tls"]
    write_config(cfg, d)
    assert sighup(px)["msg"] == "reloaded"
    assert px.find_logs("tls_unchanged")
    assert https_ok(px.port, method="GET", path="/v1/models", body=None)
    # /admin/config shows what runs, as for the listen addresses: TLS, and the workers a reload
    # cannot change either.
    shown = get_json(px.admin_port, "/admin/config")
    assert shown["tls"] and shown["tls"]["cert_file"] == PKI.server.crt, shown["tls"]
    workers = shown["workers"]
    cfg["workers"] = 3
    write_config(cfg, d)
    assert sighup(px)["msg"] == "reloaded"
    assert px.find_logs("reload_workers_unchanged")
    assert get_json(px.admin_port, "/admin/config")["workers"] == workers
    px.stop()


def test_many_tls_clients_and_a_streamed_response():
    sim = start_sim("--model", MODEL, "--token-delay-ms", "2")
    px = start_proxy(pools=[pool("p", [MODEL], [sim])], tls=tls_listener())
    errors = []

    def client(i):
        try:
            for _ in range(3):
                r = https_ok(px.port, body={"model": MODEL, "prompt": "c%d" % i,
                                            "max_tokens": 4})
                assert r.json()["choices"]
        except Exception as e:  # noqa: BLE001 - report every failure
            errors.append(repr(e))

    ts = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60 * SLOW)
    assert not errors, errors[:3]
    # SSE over TLS arrives as events, ends with [DONE].
    ctx = client_context(PKI.ca)
    conn = hc.HTTPSConnection("127.0.0.1", px.port, context=ctx, timeout=20 * SLOW)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": MODEL, "prompt": "stream", "max_tokens": 40, "stream": True, "temperature": 0}),
        headers={"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    events = [l for l in r.read().split(b"\n") if l.startswith(b"data: ")]
    assert len(events) >= 40 and events[-1] == b"data: [DONE]", events[-3:]
    conn.close()
    px.stop()


# ---- upstream TLS -------------------------------------------------------------------------------


def test_https_replica_verified_against_the_ca_file():
    sim = tls_sim()
    p = https_pool("p", [MODEL], ["https://127.0.0.1:%d" % sim.port,
                                  "https://localhost:%d" % sim.port])
    px = start_proxy(pools=[p])
    poll_until(lambda: all(r["state"] == "admitted" for r in replicas(px).values()),
               what="both TLS replicas admitted")
    seen = set()
    for i in range(6):
        r = post_json(px.port, "/v1/completions", dict(BODY, prompt="p%d" % i))
        assert r.status == 200, r
        seen.add(r.headers["x-detproxy-replica"])
    assert seen == {"r1", "r2"}, seen
    # Streamed over TLS to the replica, too.
    r = http("POST", px.port, "/v1/chat/completions", body={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
        "stream": True})
    assert r.status == 200 and r.body.rstrip().endswith(b"data: [DONE]"), r
    px.stop()
    sim.stop()


def test_bad_replica_certificates_are_refused_with_the_reason():
    cases = {
        "expired": (PKI.expired, "certificate has expired"),
        "selfsigned": (PKI.self_signed, "self-signed certificate"),
        "wronghost": (PKI.wrong_host, "mismatch"),
        "wrongca": (PKI.wrong_ca, "unable to get local issuer certificate"),
    }
    sims = {n: tls_sim(pair) for n, (pair, _) in cases.items()}
    good = tls_sim()
    pools = [https_pool(n, ["m-" + n], ["https://127.0.0.1:%d" % s.port]) for n, s in sims.items()]
    pools.append(https_pool("good", [MODEL], ["https://127.0.0.1:%d" % good.port]))
    px = start_proxy(pools=pools, ready=False,
                     attestation={"interval_ms": 300, "timeout_ms": 1000})
    poll_until(lambda: replicas(px)[("good", "r1")]["state"] == "admitted", what="good admitted")
    poll_until(lambda: all(replicas(px)[(n, "r1")]["state"] == "unreachable" for n in cases),
               what="every bad certificate refused")
    reps = replicas(px)
    for n, (_, phrase) in cases.items():
        why = " ".join(reps[(n, "r1")]["reasons"])
        assert "certificate" in why and phrase in why, (n, why)
        # The replica's only pool has nothing to route to: 503 naming the pool (the reasons
        # are for the admin listener and the log, not for clients: docs/requests.md §4).
        r = post_json(px.port, "/v1/completions", dict(BODY, model="m-" + n))
        assert r.status == 503, r
        err = r.json()["error"]
        assert err["code"] == "no_attested_replica" and phrase not in err["message"], err
        assert ("pool %s " % n) in err["message"], err
        assert metric(px, "detproxy_replica_admitted", pool=n, replica="r1") == 0
    for n, s in sims.items():
        r, c = https(s.port, method="GET", path="/_sim/stats", body=None,
                     ctx=client_context(None))
        c.close()
        assert r.json()["requests"] == 0, n  # no byte of HTTP reached it
    r = post_json(px.port, "/v1/completions", BODY)
    assert r.status == 200, r
    # The same certificates are also refused without a ca_file (system store).
    p = https_pool("sys", [MODEL], ["https://127.0.0.1:%d" % good.port], ca=None)
    px2 = start_proxy(pools=[p], ready=False, attestation={"interval_ms": 300, "timeout_ms": 1000})
    poll_until(lambda: replicas(px2)[("sys", "r1")]["state"] == "unreachable",
               what="unknown CA refused via the system store")
    assert "certificate" in " ".join(replicas(px2)[("sys", "r1")]["reasons"])
    px2.stop()
    px.stop()
    for s in list(sims.values()) + [good]:
        s.stop()


def test_server_name_overrides_the_name_checked():
    sim = tls_sim(PKI.wrong_host)  # a certificate for r1.llm.internal only
    url = "https://127.0.0.1:%d" % sim.port
    p = https_pool("p", [MODEL], [(url, {"server_name": "r1.llm.internal"}),
                                  (url, {"server_name": "r2.llm.internal"})])
    px = start_proxy(pools=[p], ready=False, attestation={"interval_ms": 300, "timeout_ms": 1000})
    poll_until(lambda: replicas(px)[("p", "r1")]["state"] == "admitted", what="r1 admitted")
    poll_until(lambda: replicas(px)[("p", "r2")]["state"] == "unreachable", what="r2 refused")
    assert "hostname mismatch" in " ".join(replicas(px)[("p", "r2")]["reasons"])
    for _ in range(3):
        r = post_json(px.port, "/v1/completions", BODY)
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "r1", r
    px.stop()
    sim.stop()


def test_an_ipv6_replica_is_verified_by_address():
    sim = start_sim("--model", MODEL, "--tls-cert", PKI.server.crt, "--tls-key", PKI.server.key,
                    listen="[::1]:0")
    other = start_sim("--model", MODEL, "--tls-cert", PKI.wrong_host.crt, "--tls-key",
                      PKI.wrong_host.key, listen="[::1]:0")
    p = https_pool("p", [MODEL], ["https://[::1]:%d" % sim.port, "https://[::1]:%d" % other.port])
    px = start_proxy(pools=[p], ready=False, attestation={"interval_ms": 300, "timeout_ms": 1000})
    poll_until(lambda: replicas(px)[("p", "r1")]["state"] == "admitted", what="[::1] admitted")
    poll_until(lambda: replicas(px)[("p", "r2")]["state"] == "unreachable", what="r2 refused")
    assert "IP address mismatch" in " ".join(replicas(px)[("p", "r2")]["reasons"])
    r = post_json(px.port, "/v1/completions", BODY)
    assert r.status == 200 and r.headers["x-detproxy-replica"] == "r1", r
    px.stop()


def test_wildcard_names_match_one_whole_label_only():
    whole = tls_sim(PKI.wildcard)           # *.llm.internal
    partial = tls_sim(PKI.partial_wildcard)  # r*.llm.internal
    cases = {  # pool: (sim, server_name, admitted?)
        "whole": (whole, "r1.llm.internal", True),
        "bare": (whole, "llm.internal", False),
        "deeper": (whole, "a.r1.llm.internal", False),
        "partial": (partial, "r1.llm.internal", False),
    }
    pools = [https_pool(n, ["m-" + n], [("https://127.0.0.1:%d" % sim.port,
                                         {"server_name": name})])
             for n, (sim, name, _) in cases.items()]
    px = start_proxy(pools=pools, ready=False, attestation={"interval_ms": 300,
                                                            "timeout_ms": 1000})
    want = {n: "admitted" if ok else "unreachable" for n, (_, _, ok) in cases.items()}
    try:
        poll_until(lambda: {n: replicas(px)[(n, "r1")]["state"] for n in cases} == want,
                   timeout=5, what="wildcards judged")
    except AssertionError:
        got = {n: (replicas(px)[(n, "r1")]["state"], replicas(px)[(n, "r1")]["reasons"])
               for n in cases}
        raise AssertionError("want %r, got %r" % (want, got))
    for n, (_, _, ok) in cases.items():
        if not ok:
            assert "hostname mismatch" in " ".join(replicas(px)[(n, "r1")]["reasons"]), n
    px.stop()


def test_scheme_mismatches_are_refused_with_a_reason():
    plain = start_sim("--model", MODEL)
    tls = tls_sim()
    p = https_pool("p", [MODEL], ["https://127.0.0.1:%d" % plain.port,
                                  "http://127.0.0.1:%d" % tls.port])
    px = start_proxy(pools=[p], ready=False, attestation={"interval_ms": 300, "timeout_ms": 1000})
    poll_until(lambda: all(r["state"] in ("unreachable", "rejected")
                           for r in replicas(px).values()), what="both refused")
    reps = replicas(px)
    print("    https to plaintext: %s" % reps[("p", "r1")]["reasons"])
    print("    http to TLS: %s" % reps[("p", "r2")]["reasons"])
    assert reps[("p", "r1")]["state"] == "unreachable"
    assert "wrong version number" in " ".join(reps[("p", "r1")]["reasons"]) or \
        "record" in " ".join(reps[("p", "r1")]["reasons"]), reps[("p", "r1")]
    assert get_json(plain.port, "/_sim/stats")["requests"] == 0
    r = post_json(px.port, "/v1/completions", BODY)
    assert r.status == 503, r
    px.stop()


def test_a_replica_that_stalls_the_handshake_times_out():
    up = TlsUpstream(server_context(PKI.server),
                     script=lambda k, c: (ok_response(completion_json(), close=True), "close"),
                     close_each=True)
    p = https_pool("p", [MODEL], ["https://127.0.0.1:%d" % up.port])
    px = start_proxy(pools=[p], limits={"upstream_connect_timeout_ms": 500},
                     attestation={"interval_ms": 60000, "timeout_ms": 2000})
    assert post_json(px.port, "/v1/completions", BODY).status == 200
    up.stall = True
    t0 = time.monotonic()
    r = post_json(px.port, "/v1/completions", BODY)
    took = time.monotonic() - t0
    print("    stalled handshake answered %d after %.0f ms (%d connection attempts)"
          % (r.status, took * 1000, len(up.stalled)))
    assert r.status in (502, 503, 504), r
    assert 0.45 <= took <= 0.5 + 3.0 * SLOW, took
    assert up.stalled, "the proxy never connected"
    poll_until(lambda: replicas(px)[("p", "r1")]["state"] == "unreachable",
               what="re-attested as unreachable")
    why = " ".join(replicas(px)[("p", "r1")]["reasons"])
    assert "timeout" in why or "timed out" in why, why
    up.stall = False
    poll_until(lambda: replicas(px)[("p", "r1")]["state"] == "admitted", timeout=10,
               what="re-admitted once the handshake works")
    assert post_json(px.port, "/v1/completions", BODY).status == 200
    px.stop()
    up.stop()


def test_sni_alpn_and_names_sent_to_replicas():
    up = TlsUpstream(server_context(PKI.server))
    up_named = TlsUpstream(server_context(PKI.wrong_host))
    p = https_pool("p", [MODEL], ["https://localhost:%d" % up.port,
                                  "https://127.0.0.1:%d" % up.port,
                                  ("https://127.0.0.1:%d" % up_named.port,
                                   {"server_name": "r1.llm.internal"})])
    px = start_proxy(pools=[p])
    poll_until(lambda: all(r["state"] == "admitted" for r in replicas(px).values()),
               what="all admitted")
    for _ in range(6):
        assert post_json(px.port, "/v1/completions", BODY).status == 200
    hs = up.handshakes() + up_named.handshakes()
    assert hs and all(c["alpn"] == "http/1.1" for c in hs), hs
    assert all(c["version"] == "TLSv1.3" for c in hs), hs
    snis = {c["sni"] for c in up.handshakes()}
    # localhost is sent as SNI; an IP literal never is (RFC 6066).
    assert snis == {"localhost", None}, snis
    assert {c["sni"] for c in up_named.handshakes()} == {"r1.llm.internal"}
    # Host header: the URL's host:port, not the server_name.
    heads = [q for c in up_named.handshakes() for q in c["requests"]]
    assert heads and all(b"\r\nhost: 127.0.0.1:%d\r\n" % up_named.port in h.lower()
                         for h in heads), heads[:1]
    px.stop()
    up.stop()
    up_named.stop()


def test_client_certificates_are_presented_to_replicas():
    up = TlsUpstream(server_context(PKI.server, client_ca=PKI.ca, require_client_cert=True))
    up12 = TlsUpstream(server_context(PKI.server, client_ca=PKI.ca, require_client_cert=True,
                                      maximum=ssl.TLSVersion.TLSv1_2))

    def mtls_pool(name, port, cert):
        p = https_pool(name, [name], ["https://127.0.0.1:%d" % port])
        if cert:
            p["upstream_tls"].update(client_cert_file=cert.crt, client_key_file=cert.key)
        return p

    pools = [mtls_pool("good", up.port, PKI.client), mtls_pool("none", up.port, None),
             mtls_pool("other", up.port, PKI.client_other),
             mtls_pool("good12", up12.port, PKI.client), mtls_pool("none12", up12.port, None),
             mtls_pool("other12", up12.port, PKI.client_other)]
    px = start_proxy(pools=pools, ready=False,
                     attestation={"interval_ms": 300, "timeout_ms": 1000})
    state = lambda n: replicas(px)[(n, "r1")]["state"]  # noqa: E731
    poll_until(lambda: state("good") == "admitted" and state("good12") == "admitted",
               what="mTLS replicas admitted")
    bad = ("none", "other", "none12", "other12")
    poll_until(lambda: all(state(n) == "unreachable" for n in bad),
               what="replicas refused without the right client certificate")
    for n in ("good", "good12"):
        r = post_json(px.port, "/v1/completions", dict(BODY, model=n))
        assert r.status == 200, r
    for u in (up, up12):
        peers = {c["peer"] for c in u.handshakes()}
        assert peers == {"client-a"}, u.conns
    for n in bad:
        r = post_json(px.port, "/v1/completions", dict(BODY, model=n))
        assert r.status == 503, r
        why = " ".join(replicas(px)[(n, "r1")]["reasons"])
        print("    %s: %s" % (n, why))
    # Over TLS 1.2 the replica's refusal is part of the handshake: the reason names its alert.
    assert "handshake failure" in " ".join(replicas(px)[("none12", "r1")]["reasons"])
    assert "unknown ca" in " ".join(replicas(px)[("other12", "r1")]["reasons"])
    px.stop()
    up.stop()
    up12.stop()


def test_upstream_tls_files_are_reloaded():
    """Certificates are rotated in place (cert-manager, Vault agents): after SIGHUP, new upstream
    connections must use the new client certificate and the new CA file."""
    d = tempfile.mkdtemp(prefix="detproxy-tls-rotate-")
    shutil.copyfile(PKI.ca.crt, os.path.join(d, "replicas-ca.crt"))
    shutil.copyfile(PKI.client.crt, os.path.join(d, "client.crt"))
    shutil.copyfile(PKI.client.key, os.path.join(d, "client.key"))
    os.chmod(os.path.join(d, "client.key"), 0o600)
    sctx = server_context(PKI.server, client_ca=PKI.ca, require_client_cert=True)
    sctx.load_verify_locations(PKI.ca2.crt)  # accepts client certificates from both CAs
    up = TlsUpstream(sctx, script=lambda k, c: (ok_response(completion_json(), close=True),
                                                "close"), close_each=True)
    p = https_pool("p", [MODEL], ["https://127.0.0.1:%d" % up.port], ca=None,
                   upstream_tls={"ca_file": "replicas-ca.crt", "client_cert_file": "client.crt",
                                 "client_key_file": "client.key"})
    px = start_proxy(pools=[p], directory=d, attestation={"interval_ms": 60000,
                                                          "timeout_ms": 2000})
    assert post_json(px.port, "/v1/completions", BODY).status == 200
    assert up.handshakes()[-1]["peer"] == "client-a"
    # 1. The config pointing at other files.
    shutil.copyfile(PKI.client_other.crt, os.path.join(d, "client2.crt"))
    shutil.copyfile(PKI.client_other.key, os.path.join(d, "client2.key"))
    os.chmod(os.path.join(d, "client2.key"), 0o600)
    cfg = json.load(open(px.config_path))
    cfg["pools"][0]["upstream_tls"].update(client_cert_file="client2.crt",
                                           client_key_file="client2.key")
    write_config(cfg, d)
    problems = []

    def presented(want, what):
        assert sighup(px)["msg"] == "reloaded"
        n = len(up.handshakes())
        assert post_json(px.port, "/v1/completions", BODY).status == 200
        peers = [c["peer"] for c in up.handshakes()[n:]]
        if peers[-1:] != [want]:
            problems.append("%s: the replica saw %r, want %s" % (what, peers, want))

    presented("client-b", "client_cert_file changed in the config")
    # 2. The same files replaced in place.
    shutil.copyfile(PKI.client_c.crt, os.path.join(d, "client2.crt"))
    shutil.copyfile(PKI.client_c.key, os.path.join(d, "client2.key"))
    presented("client-c", "client certificate replaced in place")
    # 3. The CA file replaced by one that does not sign the replica: trust is withdrawn.
    shutil.copyfile(PKI.ca2.crt, os.path.join(d, "replicas-ca.crt"))
    assert sighup(px)["msg"] == "reloaded"
    r = post_json(px.port, "/v1/completions", BODY)
    if r.status == 200:
        problems.append("CA file replaced: a replica the new CA does not sign still served")
    assert not problems, "\n".join(problems)
    px.stop()
    up.stop()


# Each thread keeps its own TLS session cache (the control thread's probes, each worker's
# requests: docs/configuration.md, "Top level", `workers`): each one's first handshake is a full one.
RESUME_WORKERS = 2


def resumption_case(maximum):
    """Every request on a new TLS connection (the replica closes after each answer): all but the
    first handshake of each thread should resume."""
    up = TlsUpstream(server_context(PKI.server, maximum=maximum),
                     script=lambda k, c: (ok_response(completion_json(), close=True), "close"),
                     close_each=True)
    p = https_pool("p", [MODEL], ["https://localhost:%d" % up.port])
    px = start_proxy(pools=[p], attestation={"interval_ms": 60000, "timeout_ms": 2000},
                     workers=RESUME_WORKERS)
    for _ in range(6):
        r = post_json(px.port, "/v1/completions", BODY)
        assert r.status == 200, r
    hs = up.handshakes()
    assert len(hs) >= 7, hs  # the probe + 6 requests, each its own connection
    resumed = [c["resumed"] for c in hs]
    px.stop()
    up.stop()
    return resumed, hs


def test_session_resumption_to_replicas_tls13():
    resumed, hs = resumption_case(None)
    assert hs[0]["version"] == "TLSv1.3"
    # TLS 1.3 tickets arrive after the handshake: a thread's second connection may be full too.
    assert resumed[0] is False and resumed.count(False) <= 1 + 2 * RESUME_WORKERS, resumed
    print("    TLS 1.3: %d of %d connections resumed" % (sum(resumed), len(resumed)))


def test_session_resumption_to_replicas_tls12():
    resumed, hs = resumption_case(ssl.TLSVersion.TLSv1_2)
    assert hs[0]["version"] == "TLSv1.2"
    assert resumed[0] is False and resumed.count(False) <= 1 + RESUME_WORKERS, resumed
    print("    TLS 1.2: %d of %d connections resumed" % (sum(resumed), len(resumed)))


def chunked_head():
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")


def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)


def one_response(port, data, timeout=10):
    """Send raw bytes; read until one response is complete or the connection closes:
    (RawResponse, closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout * SLOW) as s:
        s.sendall(data)
        got = b""
        deadline = time.monotonic() + timeout * SLOW
        while time.monotonic() < deadline:
            if b"\r\n\r\n" in got and parse_response(got).complete:
                return parse_response(got), False
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return parse_response(got), True
            got += chunk
        raise AssertionError("neither complete nor closed: %r" % got[:300])


def test_a_replica_dropping_tls_mid_stream_gives_an_incomplete_response():
    part = b'data: {"choices":[{"text":"partial"}]}\n\n'
    # Event streams, as the streamed request asks for (another type is refused 502 at once).
    cl_head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Content-Length: 1000\r\n\r\n")
    nolen_head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                  b"Connection: close\r\n\r\n")
    # name: (bytes the replica sends, how it ends the connection, whole response expected)
    cases = {
        # Head + one chunk, then the TCP connection ends without close_notify.
        "chunked, dropped": (chunked_head() + chunk(part), "drop", False),
        # The same ended by a clean close_notify: still a truncated HTTP body.
        "chunked, close_notify": (chunked_head() + chunk(part), "close", False),
        # Content-Length promised 1000 bytes; 20 came.
        "content-length, dropped": (cl_head + b"x" * 20, "drop", False),
        # No length at all: only close_notify ends such a body; a bare TCP close may be an
        # attacker cutting it short (RFC 8446 §6.1, RFC 9112 §9.8).
        "close-delimited, close_notify": (nolen_head + b"the whole body", "close", True),
        "close-delimited, dropped": (nolen_head + b"first half", "drop", False),
    }
    order = list(cases)
    up = TlsUpstream(server_context(PKI.server),
                     script=lambda k, c: cases[order[k % len(order)]][:2])
    p = https_pool("p", [MODEL], ["https://127.0.0.1:%d" % up.port])
    px = start_proxy(pools=[p], attestation={"interval_ms": 60000, "timeout_ms": 2000})
    body = json.dumps(dict(BODY, stream=True)).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    results = {}
    for name in order:
        resp, closed = one_response(px.port, req)
        results[name] = resp
        print("    %s: status %s, complete=%s, client connection closed=%s"
              % (name, resp.status, resp.complete, closed))
    bad = []
    for name, resp in results.items():
        whole = cases[name][2]
        if whole and not (resp.status == 200 and resp.complete and
                          resp.body == b"the whole body"):
            bad.append("%s: want the whole response, got %r" % (name, resp))
        if not whole and resp.status == 200 and resp.complete:
            bad.append("%s: a truncated response reached the client as complete: %r"
                       % (name, resp))
        if not whole and resp.status not in (200, 502):
            bad.append("%s: status %s" % (name, resp.status))
    assert not bad, "\n".join(bad)
    assert results["chunked, dropped"].status == 200
    assert b"partial" in results["chunked, dropped"].body
    assert metric(px, "detproxy_upstream_errors_total", pool="p", replica="r1",
                  kind="truncated") >= 4
    serving(px, tls=False)
    px.stop()
    up.stop()


def test_a_record_that_does_not_decrypt_after_the_request_is_not_taken_for_a_request_cut_short():
    """The replica reads the whole request, then a TLS record that does not decrypt arrives (a
    corrupt record, a forged one) and the connection closes. detproxy answers the record with
    an alert, written after the request: those bytes are not the request's, so the request
    counts as taken whole (`closed`, 502) and is not sent again (docs/requests.md, "Retries"):
    the engine may be running it. Counted at the replica: once."""
    up = TlsUpstream(server_context(PKI.server), script=lambda k, c: (b"", "garbage"))
    p = https_pool("p", [MODEL], ["https://127.0.0.1:%d" % up.port])
    px = start_proxy(pools=[p], attestation={"interval_ms": 600000, "timeout_ms": 2000})
    for i in range(3):
        before = up.nreq
        r = post_json(px.port, "/v1/completions", BODY)
        assert r.status == 502 and r.json()["error"]["code"] == "upstream_error", r
        assert "(closed)" in r.json()["error"]["message"], r.json()
        assert up.nreq == before + 1, (i, up.nreq - before)
    assert metric(px, "detproxy_upstream_errors_total", pool="p", replica="r1", kind="send") == 0
    serving(px, tls=False)
    px.stop()
    up.stop()


# ---- the attestation agent over TLS -------------------------------------------------------------


def agent(pair, key, model_dir, name="agent"):
    return start_process([DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0",
                          "--model-dir", model_dir, "--model", MODEL, "--quantization", "awq",
                          "--dtype", "float16", "--framework", "vllm", "--framework-version",
                          "0.6.3", "--key", key, "--tls-cert", pair.crt, "--tls-key", pair.key,
                          "--watch-interval-ms", "200"], name=name)


def test_attestation_agent_over_tls_admits_the_replica():
    d = tempfile.mkdtemp(prefix="detproxy-tls-agent-")
    model_dir = os.path.join(d, "model")
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "weights.bin"), "wb") as f:
        f.write(b"weights" * 1000)
    rc, out, err = run_cmd([DETPROXY_BIN, "attest", "hash", model_dir])
    assert rc == 0, err
    ckpt = out.split()[0]
    rc, _, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", os.path.join(d, "k")])
    assert rc == 0, err
    key, pub = os.path.join(d, "k.key.pem"), os.path.join(d, "k.pub.pem")
    good = agent(PKI.server, key, model_dir)
    bad = agent(PKI.self_signed, key, model_dir, name="agent-selfsigned")
    # The agent speaks TLS only: plaintext to it gets no attestation.
    data, closed = exchange(good.port, b"GET /attestation?nonce=ab HTTP/1.1\r\nHost: x\r\n\r\n",
                            timeout=5)
    assert b"payload" not in data
    sim = start_sim("--model", MODEL, "--checkpoint-sha256", ckpt, "--quantization", "awq",
                    "--dtype", "float16", "--framework-version", "0.6.3")
    man = {"model": MODEL, "checkpoint_sha256": ckpt, "quantization": "awq", "dtype": "float16",
           "framework": {"name": "vllm", "version": "0.6.3"}}
    p = pool("p", [MODEL], [sim, sim], manifest=man, upstream_tls={"ca_file": PKI.ca.crt})
    p["replicas"][0]["attest"] = {"source": "agent",
                                  "url": "https://localhost:%d/attestation" % good.port}
    p["replicas"][1]["attest"] = {"source": "agent",
                                  "url": "https://127.0.0.1:%d/attestation" % bad.port}
    px = start_proxy(pools=[p], ready=False,
                     attestation={"interval_ms": 300, "timeout_ms": 2000,
                                  "require_signature": True, "trusted_keys": [pub]})
    poll_until(lambda: replicas(px)[("p", "r1")]["state"] == "admitted", timeout=20,
               what="replica admitted through the TLS agent")
    rep = replicas(px)[("p", "r1")]
    assert rep["attestation"]["report"]["checkpoint_sha256"] == ckpt, rep
    poll_until(lambda: replicas(px)[("p", "r2")]["state"] == "unreachable", what="r2 refused")
    why = " ".join(replicas(px)[("p", "r2")]["reasons"])
    assert "self-signed certificate" in why, why
    for _ in range(3):
        r = post_json(px.port, "/v1/completions", BODY)
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "r1", r
    px.stop()
    good.stop()
    bad.stop()


def test_diagnose_reaches_https_replicas_verified_as_the_proxy_does():
    good = tls_sim()
    bad = tls_sim(PKI.wrong_ca)
    cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
           "pools": [https_pool("p", [MODEL], ["https://localhost:%d" % good.port,
                                               "https://127.0.0.1:%d" % good.port,
                                               "https://127.0.0.1:%d" % bad.port])]}
    path = write_config(cfg)
    rc, out, err = run_cmd([DETPROXY_BIN, "diagnose", "-c", path, "--repeat", "2",
                            "--concurrency", "2", "--json"], timeout=120)
    no_sanitizer_report(err)
    assert rc in (0, 1), (rc, err[-2000:])
    res = json.loads(out)
    single = {r["name"]: r for r in res["steps"]["single_replica"]["replicas"]}
    meta = {r["name"]: r for r in res["steps"]["metadata"]["replicas"]}
    for n in ("r1", "r2"):
        assert single[n]["sequential"]["ok"] == 2, (n, single[n], meta[n])
        assert single[n]["concurrent"]["ok"] == 2, (n, single[n])
    assert single["r3"]["sequential"]["ok"] == 0
    assert "certificate verify failed" in (meta["r3"]["error"] or ""), meta["r3"]


# ---- configuration -------------------------------------------------------------------------------


def test_there_is_no_switch_to_skip_verification():
    d = tempfile.mkdtemp(prefix="detproxy-tls-check-")
    for key in ("insecure_skip_verify", "verify", "insecure"):
        cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
               "pools": [{"name": "p", "models": ["*"],
                          "upstream_tls": {"ca_file": PKI.ca.crt, key: False},
                          "replicas": [{"name": "r1", "url": "https://127.0.0.1:1"}]}]}
        path = write_config(cfg, d)
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
        no_sanitizer_report(err)
        assert rc == 1 and key in err, (rc, out, err)
    # A CA file that is not a certificate, a key that does not match: errors naming the path.
    cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
           "tls": {"cert_file": PKI.server.crt, "key_file": PKI.server2.key},
           "pools": [{"name": "p", "models": ["*"], "upstream_tls": {"ca_file": PKI.ca.key},
                      "replicas": [{"name": "r1", "url": "https://127.0.0.1:1"}]}]}
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", write_config(cfg, d)])
    assert rc == 1, (rc, out, err)
    assert "tls.key_file" in err and "upstream_tls.ca_file" in err, err
    assert "BEGIN" not in err  # never the key's contents


def test_stalled_handshakes_are_bounded_oldest_first():
    """A stalled handshake holds ~47 KB of OpenSSL state until the header timeout: at the
    default max_connections that was ~460 MB. limits.max_pending_handshakes bounds them; at
    the bound the oldest pending one is closed, so a client that completes its handshake in a
    round trip is still served while the flood goes on."""
    bound = 8
    sim, px = listener_proxy(limits={"max_pending_handshakes": bound,
                                     "client_header_timeout_ms": 60000})
    base = rss_kb(px)
    socks = stalled_handshakes(px.port, 200)

    # Each worker closes its own oldest (a share of the bound each, docs/configuration.md `workers`): the
    # survivors are the newest of each worker's, so among the newest few times the bound.
    poll_until(lambda: sum(1 for s in socks if not peer_closed(s)) == bound,
               what="all but %d stalled handshakes closed" % bound)
    assert not any(not peer_closed(s) for s in socks[:-4 * bound])
    grew = rss_kb(px) - base
    print("    200 stalled handshakes, bound %d: RSS grew %d kB" % (bound, grew))
    if not TSAN:  # ThreadSanitizer's shadow memory makes the process's RSS say nothing here
        assert grew < 4 * 1024 * SLOW, grew  # unbounded: ~9.4 MB here (47 KB each), more under ASan
    px.wait_log("tls_handshake_limit")
    t0 = time.monotonic()
    serving(px)  # completes its handshake at once, pushing out one more stalled one
    assert time.monotonic() - t0 < 2 * SLOW
    for s in socks:
        s.close()
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
