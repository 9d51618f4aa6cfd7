"""Large files through the unmodified E2B Python SDK's `files` (gateway/tests/e2b_sdk.rs):
a file of SIZE_MIB MiB made in the sandbox is read back as a stream by COPIES readers at
once, each counting its bytes and hashing them; then a file of the same size is written
from here (an octet stream, as envd 0.5.7 takes it) and its hash read back in the sandbox,
and a small one as an octet stream and as gzip. Prints `ready` when the sandbox is made (the
test takes sbxd's resident size then) and one line per check; any failure raises.

Environment: E2B_API_URL, E2B_SANDBOX_URL, KEY (an E2B key of sbxd), SIZE_MIB, COPIES.
"""

import hashlib
import os
import sys
import threading
import time

from e2b import Sandbox

KEY = os.environ["KEY"]
SIZE = int(os.environ["SIZE_MIB"]) << 20
COPIES = int(os.environ["COPIES"])


def check(what, ok, detail=""):
    if not ok:
        raise AssertionError(f"{what}: {detail}")
    print(f"ok {what}", flush=True)


sbx = Sandbox.create(timeout=600, api_key=KEY)
made = sbx.commands.run(
    f"head -c {SIZE} /dev/urandom > /sandbox/big && sha256sum /sandbox/big", timeout=300
)
want = made.stdout.split()[0]
print("ready", flush=True)
sys.stdin.readline()  # the test has its baseline

results = [None] * COPIES


def read(i):
    h, n = hashlib.sha256(), 0
    for chunk in sbx.files.read("/sandbox/big", format="stream"):
        h.update(chunk)
        n += len(chunk)
    results[i] = (n, h.hexdigest())


began = time.monotonic()
threads = [threading.Thread(target=read, args=(i,)) for i in range(COPIES)]
for t in threads:
    t.start()
for t in threads:
    t.join()
took = time.monotonic() - began
for i, r in enumerate(results):
    check(f"download {i} whole", r == (SIZE, want), (r, SIZE, want))
print(f"downloaded {COPIES} x {SIZE >> 20} MiB in {took:.1f} s", flush=True)


class Generated:
    """A file-like object of SIZE pseudo-random bytes, made as it is read."""

    def __init__(self):
        self.left, self.h, self.seed = SIZE, hashlib.sha256(), b"sbx"

    def read(self, n=-1):
        if self.left == 0:
            return b""
        n = self.left if n is None or n < 0 else min(n, self.left)
        out = bytearray()
        while len(out) < n:
            self.seed = hashlib.sha256(self.seed).digest()
            out += self.seed * 64
        out = bytes(out[:n])
        self.left -= n
        self.h.update(out)
        return out


data = Generated()
began = time.monotonic()
sbx.files.write("/sandbox/up", data)
took = time.monotonic() - began
got = sbx.commands.run("sha256sum /sandbox/up; stat -c %s /sandbox/up").stdout.split()
check("upload whole", got[0] == data.h.hexdigest() and int(got[2]) == SIZE, got)
print(f"uploaded {SIZE >> 20} MiB in {took:.1f} s", flush=True)

# envd 0.5.7's uploads: the body is the file (the streamed one above went so too), gzip on ask.
small = os.urandom(3 << 20)
for name, options in [("octets", {"use_octet_stream": True}), ("gz", {"gzip": True})]:
    sbx.files.write(f"/sandbox/{name}", small, **options)
    got = sbx.commands.run(f"sha256sum /sandbox/{name}").stdout.split()[0]
    check(f"a {name} upload byte-exact", got == hashlib.sha256(small).hexdigest(), got)
sbx.kill()
print("done", flush=True)
