"""A FUSE server over /dev/fuse, in this process, that serves one file (`model.gguf` by default)
and can be told to hold every request it gets and later to answer the ones it held: storage
that stops answering and comes back, as an NFS server or a FUSE daemon does. Linux's FUSE
protocol (include/uapi/linux/fuse.h) at minor version 31, the few operations a stat, an open
and a read need. Needs root and /dev/fuse."""

import ctypes
import errno
import os
import struct
import tempfile
import threading
import time

LOOKUP, FORGET, GETATTR = 1, 2, 3
OPEN, READ, RELEASE, FLUSH = 14, 15, 18, 25
INIT, OPENDIR, READDIR, RELEASEDIR = 26, 27, 28, 29
ACCESS, INTERRUPT, DESTROY, BATCH_FORGET = 34, 36, 38, 42
NEVER_HELD = (INIT, FORGET, BATCH_FORGET, INTERRUPT)
FOPEN_KEEP_CACHE = 1 << 1  # an open keeps what the page cache has of the file


def _attr(ino, size, mode, when):
    # fuse_attr: ino size blocks atime mtime ctime, the three nsec, mode nlink uid gid rdev
    # blksize flags. The times stay those of the mount: a file whose times move is one being
    # written, which a hash does not take.
    return struct.pack("<QQQQQQIIIIIIIIII", ino, size, (size + 511) // 512, when, when, when,
                       0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


class FuseFile:
    def __init__(self, content, name="model.gguf"):
        self.content = content
        self.name = name.encode()
        self.when = int(time.time()) - 60
        self.where = tempfile.mkdtemp(prefix="detproxy-fuse-")
        self.fd = os.open("/dev/fuse", os.O_RDWR)
        opts = "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other" % self.fd
        if ctypes.CDLL(None, use_errno=True).mount(b"detproxy-fuse", self.where.encode(),
                                                   b"fuse", 0, opts.encode()) != 0:
            e = ctypes.get_errno()
            os.close(self.fd)
            os.rmdir(self.where)
            raise OSError(e, "mount fuse")
        self.lock = threading.Lock()
        self.holding = None  # None: answer; else the operations to hold (empty: all)
        self.held = []
        threading.Thread(target=self._loop, daemon=True).start()

    def path(self):
        return os.path.join(self.where, self.name.decode())

    def hold(self, only=()):
        """Hold every request from now on, or only those of the operations in `only` (READ:
        the file's bytes that are not in the page cache; opens keep it)."""
        with self.lock:
            self.holding = set(only)

    def answer(self):
        """Answer again, the held requests first; returns how many were held."""
        with self.lock:
            self.holding = None
            held, self.held = self.held, []
        for req in held:
            self._handle(req)
        return len(held)

    def close(self):
        """Ends the connection (every wait under the mount ends) and detaches the mount."""
        os.close(self.fd)
        ctypes.CDLL(None, use_errno=True).umount2(self.where.encode(), 2)  # MNT_DETACH
        os.rmdir(self.where)

    def _reply(self, unique, err=0, data=b""):
        try:
            os.write(self.fd, struct.pack("<IiQ", 16 + len(data), -err, unique) + data)
        except OSError:
            pass  # interrupted or aborted meanwhile

    def _loop(self):
        while True:
            try:
                req = os.read(self.fd, (1 << 20) + 4096)
            except OSError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                return  # closed
            if not req:
                return
            op = struct.unpack_from("<I", req, 4)[0]
            with self.lock:
                if self.holding is not None and op not in NEVER_HELD and (
                        not self.holding or op in self.holding):
                    self.held.append(req)
                    continue
            self._handle(req)

    def _handle(self, req):
        _, op, unique, node = struct.unpack_from("<IIQQ", req, 0)
        body = req[40:]
        if op == INIT:
            _, minor, readahead, _ = struct.unpack_from("<IIII", body, 0)
            out = struct.pack("<IIIIHHIIHHI", 7, min(minor, 31), readahead, 0, 16, 12, 65536, 1,
                              32, 0, 0)
            self._reply(unique, 0, out + b"\0" * (64 - len(out)))
        elif op in (FORGET, BATCH_FORGET, INTERRUPT):
            pass  # no answer is expected
        elif op == LOOKUP:
            if node == 1 and body.split(b"\0", 1)[0] == self.name:
                self._reply(unique, 0, struct.pack("<QQQQII", 2, 0, 0, 0, 0, 0) +
                            _attr(2, len(self.content), 0o100644, self.when))
            else:
                self._reply(unique, errno.ENOENT)
        elif op == GETATTR:
            a = (_attr(1, 0, 0o40755, self.when) if node == 1 else
                 _attr(2, len(self.content), 0o100644, self.when))
            self._reply(unique, 0, struct.pack("<QII", 0, 0, 0) + a)
        elif op in (OPEN, OPENDIR):
            self._reply(unique, 0, struct.pack("<QII", 0, FOPEN_KEEP_CACHE, 0))
        elif op == READ:
            _, off, size = struct.unpack_from("<QQI", body, 0)
            self._reply(unique, 0, self.content[off:off + size])
        elif op == READDIR:
            _, off, _ = struct.unpack_from("<QQI", body, 0)
            out = b""
            if off == 0:
                for i, (ino, nm, typ) in enumerate([(1, b".", 4), (1, b"..", 4),
                                                    (2, self.name, 8)]):
                    e = struct.pack("<QQII", ino, i + 1, len(nm), typ) + nm
                    out += e + b"\0" * ((8 - len(e) % 8) % 8)
            self._reply(unique, 0, out)
        elif op in (RELEASE, RELEASEDIR, FLUSH, ACCESS, DESTROY):
            self._reply(unique, 0)
        else:
            self._reply(unique, errno.ENOSYS)
