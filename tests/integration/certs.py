"""Test certificates made with the `openssl` command line (no Python crypto package needed).

    from certs import shared_pki
    pki = shared_pki()            # made once per process, in a temp dir
    pki.ca.crt                  # the test CA
    pki.server.crt, pki.server.key   # CN=detproxy-test, SAN localhost, 127.0.0.1, ::1; pki.ca
    pki.expired / pki.self_signed / pki.wrong_host / pki.wrong_ca / pki.server2 / pki.other_name
    pki.client, pki.client_other     # clientAuth certificates from pki.ca and pki.ca2
    pki.client_c                     # a second clientAuth certificate from pki.ca
    pki.client_expired               # an expired clientAuth certificate from pki.ca
    pki.wildcard, pki.partial_wildcard   # *.llm.internal and r*.llm.internal, from pki.ca

Every leaf is signed with `openssl ca` so its validity dates can be set exactly (an expired
certificate needs a notAfter in the past, which `openssl x509 -req` cannot do on OpenSSL 3.0).
Keys are EC P-256 (fast to make) and written mode 0600 so the proxy has nothing to warn about.
Each leaf gets its own serial number, so a reloaded certificate is told apart by serial and CN.
"""

import os
import subprocess
import tempfile
import threading


class Pair:
    """A certificate and its key: .crt, .key (paths), .cn, .serial (int), .name."""

    def __init__(self, name, crt, key, cn, serial=None):
        self.name, self.crt, self.key, self.cn, self.serial = name, crt, key, cn, serial

    def __repr__(self):
        return "<Pair %s CN=%s serial=%s>" % (self.name, self.cn, self.serial)


def _run(argv, cwd=None):
    cp = subprocess.run(argv, cwd=cwd, capture_output=True, timeout=60)
    if cp.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(argv), cp.returncode,
                                                    cp.stderr.decode("utf-8", "replace")))
    return cp.stdout.decode("utf-8", "replace")


_CA_CONF = """
[ ca ]
default_ca = testca
[ testca ]
dir = {dir}
database = $dir/index.txt
new_certs_dir = $dir/newcerts
serial = $dir/serial
default_md = sha256
policy = anything
unique_subject = no
copy_extensions = none
email_in_dn = no
[ anything ]
commonName = supplied
organizationName = optional
[ req ]
distinguished_name = dn
prompt = no
[ dn ]
CN = unused
[ v3_ca ]
basicConstraints = critical, CA:true
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
"""


class Factory:
    """Makes CAs and leaves under one directory."""

    def __init__(self, directory=None):
        self.dir = directory or tempfile.mkdtemp(prefix="detproxy-certs-")
        os.makedirs(self.dir, exist_ok=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def key(self, name):
        p = self.path(name + ".key")
        _run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
              "-out", p])
        os.chmod(p, 0o600)
        return p

    def ca(self, name, cn=None):
        """A self-signed CA with its own `openssl ca` database."""
        d = self.path(name + ".db")
        os.makedirs(os.path.join(d, "newcerts"), exist_ok=True)
        open(os.path.join(d, "index.txt"), "w").close()
        with open(os.path.join(d, "serial"), "w") as f:
            # Distinct serial ranges per CA, so no two test certificates share one.
            f.write("%08x\n" % (0x1000 + sum(map(ord, name)) * 0x100))
        conf = os.path.join(d, "ca.cnf")
        with open(conf, "w") as f:
            f.write(_CA_CONF.format(dir=d))
        key = self.key(name)
        crt = self.path(name + ".crt")
        _run(["openssl", "req", "-x509", "-new", "-key", key, "-out", crt, "-days", "3650",
              "-subj", "/CN=" + (cn or name), "-config", conf, "-extensions", "v3_ca"])
        p = Pair(name, crt, key, cn or name)
        p.conf = conf
        return p

    def leaf(self, ca, name, cn, dns=(), ips=(), client=False, start=None, end=None,
             days=365):
        """A leaf signed by ca. start/end: "YYYYMMDDHHMMSSZ" (both or neither). client="both":
        server and client use (etcd's gateway dials its own server with its certificate)."""
        key = self.key(name)
        csr = self.path(name + ".csr")
        _run(["openssl", "req", "-new", "-key", key, "-out", csr, "-subj", "/CN=" + cn])
        ext = self.path(name + ".ext")
        sans = ["DNS:" + d for d in dns] + ["IP:" + i for i in ips]
        with open(ext, "w") as f:
            f.write("[ leaf ]\nbasicConstraints = critical, CA:false\n"
                    "keyUsage = critical, digitalSignature, keyEncipherment\n")
            f.write("extendedKeyUsage = %s\n" % ("serverAuth, clientAuth" if client == "both"
                                                  else "clientAuth" if client else "serverAuth"))
            if sans:
                f.write("subjectAltName = %s\n" % ", ".join(sans))
        crt = self.path(name + ".crt")
        argv = ["openssl", "ca", "-batch", "-notext", "-config", ca.conf, "-cert", ca.crt,
                "-keyfile", ca.key, "-in", csr, "-out", crt, "-extfile", ext,
                "-extensions", "leaf"]
        if start:
            argv += ["-startdate", start, "-enddate", end]
        else:
            argv += ["-days", str(days)]
        _run(argv)
        serial = int(_run(["openssl", "x509", "-in", crt, "-noout", "-serial"])
                     .strip().split("=", 1)[1], 16)
        return Pair(name, crt, key, cn, serial)

    def self_signed(self, name, cn, dns=(), ips=()):
        key = self.key(name)
        crt = self.path(name + ".crt")
        sans = ",".join(["DNS:" + d for d in dns] + ["IP:" + i for i in ips])
        argv = ["openssl", "req", "-x509", "-new", "-key", key, "-out", crt, "-days", "365",
                "-subj", "/CN=" + cn, "-addext", "basicConstraints=critical,CA:false",
                "-addext", "extendedKeyUsage=serverAuth"]
        if sans:
            argv += ["-addext", "subjectAltName=" + sans]
        _run(argv)
        serial = int(_run(["openssl", "x509", "-in", crt, "-noout", "-serial"])
                     .strip().split("=", 1)[1], 16)
        return Pair(name, crt, key, cn, serial)


LOCAL_DNS = ("localhost",)
LOCAL_IPS = ("127.0.0.1", "::1")


class PKI:
    """The standard set of test certificates (see the module doc)."""

    def __init__(self, directory=None):
        f = self.factory = Factory(directory)
        self.dir = f.dir
        self.ca = f.ca("ca", "detproxy test CA")
        self.ca2 = f.ca("ca2", "another CA")
        self.server = f.leaf(self.ca, "server", "detproxy-test", LOCAL_DNS, LOCAL_IPS)
        self.server2 = f.leaf(self.ca, "server2", "detproxy-test-reloaded", LOCAL_DNS, LOCAL_IPS)
        self.expired = f.leaf(self.ca, "expired", "expired", LOCAL_DNS, LOCAL_IPS,
                              start="20200101000000Z", end="20200201000000Z")
        self.self_signed = f.self_signed("selfsigned", "selfsigned", LOCAL_DNS, LOCAL_IPS)
        # Right CA, valid, but for a name that is neither localhost nor 127.0.0.1.
        self.wrong_host = f.leaf(self.ca, "wronghost", "r1.llm.internal", ("r1.llm.internal",))
        self.wrong_ca = f.leaf(self.ca2, "wrongca", "wrongca", LOCAL_DNS, LOCAL_IPS)
        self.client = f.leaf(self.ca, "client", "client-a", client=True)
        self.client_other = f.leaf(self.ca2, "client-other", "client-b", client=True)
        self.client_c = f.leaf(self.ca, "client-c", "client-c", client=True)
        self.client_expired = f.leaf(self.ca, "client-expired", "client-expired", client=True,
                                     start="20200101000000Z", end="20200201000000Z")
        # Wildcards: a whole left-most label (valid), and a partial one (RFC 9525 §6.3: must
        # not match).
        self.wildcard = f.leaf(self.ca, "wildcard", "wildcard", ("*.llm.internal",))
        self.partial_wildcard = f.leaf(self.ca, "partial-wildcard", "partial",
                                       ("r*.llm.internal",))


_pki = None
_lock = threading.Lock()


def shared_pki():
    """The process-wide PKI (made on first use: about a second)."""
    global _pki
    with _lock:
        if _pki is None:
            _pki = PKI()
        return _pki


def cert_text(path):
    """`openssl x509 -text` of a certificate file."""
    return _run(["openssl", "x509", "-in", path, "-noout", "-text"])


if __name__ == "__main__":
    pki = shared_pki()
    for n in ("ca", "ca2", "server", "server2", "expired", "self_signed", "wrong_host",
              "wrong_ca", "client", "client_other"):
        print(n, getattr(pki, n))
    print(pki.dir)


# ---- TLS peers for tests ------------------------------------------------------------------------
# (The helpers below need only the standard library's ssl module.)

import json as _json
import socket as _socket
import ssl as _ssl


def client_context(ca=None, cert=None, alpn=None, minimum=None, maximum=None):
    """An SSLContext for talking to detproxy's TLS listener: verify against ca (a Pair or a
    path; None: no verification), present cert (a Pair) if given, offer alpn (a list)."""
    ctx = _ssl.SSLContext(_ssl.PROTOCOL_TLS_CLIENT)
    if ca is None:
        ctx.check_hostname = False
        ctx.verify_mode = _ssl.CERT_NONE
    else:
        ctx.load_verify_locations(getattr(ca, "crt", ca))
    if cert is not None:
        ctx.load_cert_chain(cert.crt, cert.key)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    if minimum:
        ctx.minimum_version = minimum
    if maximum:
        ctx.maximum_version = maximum
    return ctx


def server_context(pair, client_ca=None, require_client_cert=False, maximum=None):
    ctx = _ssl.SSLContext(_ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pair.crt, pair.key)
    if client_ca is not None:
        ctx.load_verify_locations(getattr(client_ca, "crt", client_ca))
        ctx.verify_mode = _ssl.CERT_REQUIRED if require_client_cert else _ssl.CERT_OPTIONAL
    if maximum:
        ctx.maximum_version = maximum
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


class TlsUpstream:
    """A replica played by Python over TLS, recording what each TLS connection looked like.

    .conns: one dict per accepted connection, filled in as it goes: "sni" (name sent, or None),
    "alpn", "resumed" (session_reused), "version", "peer" (client certificate subject CN or None),
    "error" (handshake failure text), "requests" (heads received).
    GET .../v1/models is answered 200 (the proxy's reachability probe). Every other request is
    answered by script(k, conn) -> (bytes, action) with action one of "keep" (keep-alive),
    "close" (close_notify then close), "drop" (close the TCP socket without close_notify),
    "garbage" (a TLS record that does not decrypt, written on the TCP socket, then a FIN).
    close_each: answer every request, probes included, with Connection: close (so each request
    needs a new TLS connection: what session resumption is for).
    .stall = True: new connections are accepted and then left without a ServerHello."""

    MODELS = (b'{"object":"list","data":[{"id":"m1","object":"model","created":1,'
              b'"owned_by":"tls-upstream"}]}')

    def __init__(self, ctx, script=None, close_each=False):
        self.ctx = ctx
        self.script = script or (lambda k, conn: (ok_response(b'{"ok":true}'), "keep"))
        self.close_each = close_each
        self.conns = []
        self.lock = threading.Lock()
        self.nreq = 0
        self.stall = False  # set: accept TCP, never answer the ClientHello
        self.stalled = []
        ctx.sni_callback = self._sni
        self.lsock = _socket.socket()
        self.lsock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.port = self.lsock.getsockname()[1]
        self.socks = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _sni(self, sslobj, name, ctx):
        sslobj._test_sni = name
        return None

    def _accept(self):
        while True:
            try:
                s, _ = self.lsock.accept()
            except OSError:
                return
            if self.stall:
                with self.lock:
                    self.stalled.append(s)  # TCP accepted, handshake never answered
                continue
            rec = {"sni": None, "alpn": None, "resumed": None, "version": None, "peer": None,
                   "error": None, "requests": []}
            with self.lock:
                self.conns.append(rec)
                self.socks.append(s)
            threading.Thread(target=self._serve, args=(s, rec), daemon=True).start()

    def _serve(self, raw, rec):
        raw.settimeout(30)
        try:
            s = self.ctx.wrap_socket(raw, server_side=True)
        except (OSError, _ssl.SSLError) as e:
            rec["error"] = str(e)
            raw.close()
            return
        rec["sni"] = getattr(s, "_test_sni", None)
        rec["alpn"] = s.selected_alpn_protocol()
        rec["resumed"] = s.session_reused
        rec["version"] = s.version()
        cert = s.getpeercert()
        if cert:
            rec["peer"] = dict(x[0] for x in cert["subject"]).get("commonName")
        from proxyutil import read_request
        buf = b""
        try:
            while True:
                got = read_request(s, buf)
                if got is None:
                    s.close()
                    return
                head, body, buf = got
                rec["requests"].append(head + b"\r\n\r\n" + body)
                if b" /v1/models " in head.split(b"\r\n")[0]:
                    out = ok_response(self.MODELS, close=self.close_each)
                    action = "close" if self.close_each else "keep"
                else:
                    with self.lock:
                        k = self.nreq
                        self.nreq += 1
                    out, action = self.script(k, rec)
                s.sendall(out)
                if action == "keep":
                    continue
                if action == "garbage":  # the client fails the record and sends an alert
                    import os
                    os.write(s.fileno(), b"\x17\x03\x03\x00\x20" + os.urandom(32))
                    s.close()
                elif action == "close":
                    try:
                        s.unwrap()  # close_notify
                    except (OSError, _ssl.SSLError):
                        pass
                    raw.close()
                else:  # "drop": the TCP connection ends with no close_notify
                    raw.shutdown(_socket.SHUT_RDWR)
                    raw.close()
                return
        except (OSError, _ssl.SSLError) as e:
            rec["error"] = rec["error"] or str(e)
            try:
                raw.close()
            except OSError:
                pass

    def handshakes(self):
        """Connections whose handshake succeeded."""
        with self.lock:
            return [c for c in self.conns if c["version"]]

    def stop(self):
        self.lsock.close()
        with self.lock:
            for s in self.socks + self.stalled:
                try:
                    s.close()
                except OSError:
                    pass


def ok_response(body, ctype=b"application/json", close=False):
    return (b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nContent-Length: %d\r\n" % len(body)
            + (b"Connection: close\r\n" if close else b"") + b"\r\n" + body)


def completion_json(text="hello"):
    return _json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m1",
                        "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}
                       ).encode()


def client_hello(server_name="localhost", alpn=("http/1.1",)):
    """The bytes of a real ClientHello (from Python's ssl over memory BIOs), for partial-
    handshake and TLS-to-plaintext tests."""
    ctx = client_context()
    if alpn:
        ctx.set_alpn_protocols(list(alpn))
    inc, out = _ssl.MemoryBIO(), _ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=server_name)
    try:
        obj.do_handshake()
    except _ssl.SSLWantReadError:
        pass
    return out.read()


def stalled_handshakes(port, n):
    """n connections to port that each send half a ClientHello and then nothing."""
    hello = client_hello()
    socks = []
    for _ in range(n):
        s = _socket.create_connection(("127.0.0.1", port))
        s.sendall(hello[:len(hello) // 2])
        socks.append(s)
    return socks


def peer_closed(s):
    """Has the other end closed s (reset counts)? Does not wait beyond 10 ms."""
    s.settimeout(0.01)
    try:
        return s.recv(1) == b""
    except _socket.timeout:
        return False
    except OSError:
        return True
