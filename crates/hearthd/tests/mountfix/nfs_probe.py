# A guest that bypasses its kernel's NFS client and speaks raw ONC RPC to the mount server on its gateway
# (172.16.0.1:2049), trying to leave its export's prefix or to write through a read-only export.
# argv[1]: JSON {"rw": "/<export>", "ro": "/<export>"} (read from /proc/mounts by the test).
# Prints one JSON object: check name -> status (or "closed"/"ok").
import json, os, random, socket, struct, sys

SERVER = ("172.16.0.1", 2049)
NFS, MOUNT = 100003, 100005


class Conn:
    def __init__(self):
        self.s = socket.create_connection(SERVER, timeout=30)
        self.xid = random.randint(1, 1 << 30)

    def raw(self, record):
        self.s.sendall(struct.pack(">I", 0x80000000 | len(record)) + record)
        head = self.recv(4)
        n = struct.unpack(">I", head)[0] & 0x7FFFFFFF
        return self.recv(n)

    def recv(self, n):
        out = b""
        while len(out) < n:
            chunk = self.s.recv(n - len(out))
            if not chunk:
                raise EOFError("closed")
            out += chunk
        return out

    def call(self, prog, proc, args):
        self.xid += 1
        cred = struct.pack(">I", 0) + opaque(b"guest") + struct.pack(">III", 0, 0, 0)
        hdr = struct.pack(">IIIIII", self.xid, 0, 2, prog, 3, proc) + struct.pack(">I", 1) + opaque(cred)
        hdr += struct.pack(">II", 0, 0)
        reply = self.raw(hdr + args)
        xid, mtype, rstat = struct.unpack(">III", reply[:12])
        assert xid == self.xid and mtype == 1 and rstat == 0, reply[:16]
        vlen = struct.unpack(">I", reply[16:20])[0]
        at = 20 + ((vlen + 3) // 4) * 4
        accept = struct.unpack(">I", reply[at : at + 4])[0]
        return accept, reply[at + 4 :]


def opaque(b):
    return struct.pack(">I", len(b)) + b + b"\0" * ((4 - len(b) % 4) % 4)


def read_opaque(b, at):
    n = struct.unpack(">I", b[at : at + 4])[0]
    return b[at + 4 : at + 4 + n], at + 4 + ((n + 3) // 4) * 4


def status(body):
    return struct.unpack(">I", body[:4])[0]


def sattr(size=None):
    out = struct.pack(">III", 0, 0, 0)
    out += struct.pack(">IQ", 1, size) if size is not None else struct.pack(">I", 0)
    return out + struct.pack(">II", 0, 0)


def mnt(c, path):
    accept, body = c.call(MOUNT, 1, opaque(path.encode()))
    st = status(body)
    if st != 0:
        return st, None
    fh, _ = read_opaque(body, 4)
    return 0, fh


def lookup(c, dirfh, name):
    _, body = c.call(NFS, 3, opaque(dirfh) + opaque(name))
    st = status(body)
    return st, (read_opaque(body, 4)[0] if st == 0 else None)


def main():
    ex = json.loads(sys.argv[1])
    c = Conn()
    out = {}
    st, rw = mnt(c, ex["rw"])
    out["mnt rw"] = st
    st, ro = mnt(c, ex["ro"])
    out["mnt ro"] = st
    for bad in ["/", "/0000000000000000", "/../", ex["rw"] + "/..", "/etc/exports"]:
        out["mnt " + bad] = mnt(c, bad)[0]

    # Leaving the root by name.
    st, up = lookup(c, rw, b"..")
    out["lookup .. is the root"] = "ok" if st == 0 and up == rw else "escaped"
    for name in [b"../outside.txt", b"..%2foutside.txt", b"a/../../outside.txt", b"/outside.txt", b"sibling.txt"]:
        out["lookup " + name.decode()] = lookup(c, rw, name)[0]

    # Forged handles: ids never handed out, the other export's key, wrong lengths.
    key_rw, key_ro = rw[:8], ro[:8]
    for i, fid in enumerate([0, 2, 15, 16, 0xDEADBEEF, random.getrandbits(64), (1 << 64) - 1]):
        _, body = c.call(NFS, 1, opaque(key_rw + struct.pack(">Q", fid)))
        out["getattr forged %d" % i] = status(body)
    _, body = c.call(NFS, 1, opaque(b"\x13" * 8 + struct.pack(">Q", 1)))
    out["getattr unknown export"] = status(body)
    _, body = c.call(NFS, 1, opaque(b"\x00" * 64))
    out["getattr 64 zero bytes"] = status(body)
    st, inside_rw = lookup(c, rw, b"a.txt")
    _, body = c.call(NFS, 6, opaque(key_ro + inside_rw[8:]) + struct.pack(">QI", 0, 100))
    out["read rw id through ro key"] = status(body)

    # Every change through the read-only export.
    st, a = lookup(c, ro, b"a.txt")
    out["lookup ro a.txt"] = st
    _, body = c.call(NFS, 7, opaque(a) + struct.pack(">QII", 0, 1, 2) + opaque(b"X"))
    out["write ro file_sync"] = status(body)
    _, body = c.call(NFS, 7, opaque(a) + struct.pack(">QII", 0, 1, 0) + opaque(b"X"))
    out["write ro unstable"] = status(body)
    _, body = c.call(NFS, 21, opaque(a) + struct.pack(">QI", 0, 0))
    out["commit ro"] = status(body)
    _, body = c.call(NFS, 2, opaque(a) + sattr(0) + struct.pack(">I", 0))
    out["setattr size 0 ro"] = status(body)
    _, body = c.call(NFS, 8, opaque(ro) + opaque(b"new.txt") + struct.pack(">I", 0) + sattr())
    out["create ro"] = status(body)
    _, body = c.call(NFS, 8, opaque(ro) + opaque(b"new.txt") + struct.pack(">I", 2) + b"\x01" * 8)
    out["create exclusive ro"] = status(body)
    _, body = c.call(NFS, 9, opaque(ro) + opaque(b"d") + sattr())
    out["mkdir ro"] = status(body)
    _, body = c.call(NFS, 12, opaque(ro) + opaque(b"a.txt"))
    out["remove ro"] = status(body)
    _, body = c.call(NFS, 13, opaque(ro) + opaque(b"sub"))
    out["rmdir ro"] = status(body)
    _, body = c.call(NFS, 14, opaque(ro) + opaque(b"a.txt") + opaque(ro) + opaque(b"b.txt"))
    out["rename ro"] = status(body)
    _, body = c.call(NFS, 14, opaque(ro) + opaque(b"a.txt") + opaque(rw) + opaque(b"stolen.txt"))
    out["rename ro to rw"] = status(body)
    _, body = c.call(NFS, 10, opaque(ro) + opaque(b"l") + sattr() + opaque(b"/etc/passwd"))
    out["symlink ro"] = status(body)

    # What the writable export lists: its prefix only.
    _, body = c.call(NFS, 16, opaque(rw) + struct.pack(">Q", 0) + b"\0" * 8 + struct.pack(">I", 8192))
    names, at = [], 4
    if struct.unpack(">I", body[at : at + 4])[0]:
        at += 4 + 84
    else:
        at += 4
    at += 8
    while struct.unpack(">I", body[at : at + 4])[0]:
        name, at = read_opaque(body, at + 12)
        names.append(name.decode())
        at += 8
    out["readdir rw"] = sorted(names)

    # A record claiming 2 GiB closes the connection; the server keeps serving others.
    bad = Conn()
    bad.s.sendall(struct.pack(">I", 0x7FFFFFFF) + b"\0" * 64)
    try:
        bad.recv(4)
        out["huge record"] = "answered"
    except (EOFError, ConnectionResetError, socket.timeout):
        out["huge record"] = "closed"
    again = Conn()
    out["mnt rw after abuse"] = mnt(again, ex["rw"])[0]
    print(json.dumps(out, sort_keys=True))


main()
