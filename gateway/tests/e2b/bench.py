"""The E2B SDK against the sbx CLI on the same sbxd, interleaved (gateway/tests/e2b_bench.rs).

Environment: E2B_API_URL, E2B_SANDBOX_URL, KEY (a token of workspace w), SBX (the sbx binary),
SBX_ENDPOINT and SBX_TOKEN for it, ROUNDS. Prints one line per figure.
"""

import os
import statistics
import subprocess
import tempfile
import time

from e2b import Sandbox

KEY = os.environ["KEY"]
SBX = os.environ["SBX"]
ROUNDS = int(os.environ.get("ROUNDS", "20"))


def cli(*args):
    subprocess.run([SBX, *args], check=True, stdout=subprocess.DEVNULL)


def timed(f):
    began = time.perf_counter()
    f()
    return time.perf_counter() - began


def show(what, sdk, sbx):
    p50 = lambda xs: statistics.median(xs) * 1000
    print(f"{what}: E2B SDK p50 {p50(sdk):.1f} ms, sbx CLI p50 {p50(sbx):.1f} ms, ratio {p50(sdk) / p50(sbx):.2f}")


box = Sandbox.create(timeout=600, api_key=KEY)
name = [s for s in subprocess.run([SBX, "sandbox", "list", "-w", "w", "-o", "name"], check=True, capture_output=True, text=True).stdout.split() if s][0].split("/", 1)[1]

# commands.run("true") against `sbx sandbox exec -- true`, interleaved.
sdk, sbx = [], []
for _ in range(ROUNDS):
    sdk.append(timed(lambda: box.commands.run("true")))
    sbx.append(timed(lambda: cli("sandbox", "exec", "-w", "w", name, "--", "true")))
show("exec of `true`", sdk, sbx)

# Create to usable (a command ran) against `sbx sandbox create` + exec.
sdk, sbx = [], []
for i in range(max(3, ROUNDS // 4)):
    def e2b_create():
        s = Sandbox.create(timeout=600, api_key=KEY)
        s.commands.run("true")
        s.kill()
    def sbx_create():
        cli("sandbox", "create", "-w", "w", f"bench-{i}", "--", "sleep", "infinity")
        cli("sandbox", "exec", "-w", "w", f"bench-{i}", "--", "true")
    sdk.append(timed(e2b_create))
    sbx.append(timed(sbx_create))
    cli("sandbox", "delete", "-w", "w", f"bench-{i}")
show("create to a command run", sdk, sbx)

# 50 MB in and out: files.write/read against `sbx sandbox cp`.
data = os.urandom(50 * 1024 * 1024)
with tempfile.TemporaryDirectory() as tmp:
    local = os.path.join(tmp, "big.bin")
    with open(local, "wb") as f:
        f.write(data)
    w_sdk, w_sbx, r_sdk, r_sbx = [], [], [], []
    # The process driver's sandboxes share the host's /tmp: a directory of this sandbox's own.
    scratch = f"/tmp/e2b-bench-{box.sandbox_id}"
    box.files.make_dir(scratch)
    for _ in range(3):
        w_sdk.append(timed(lambda: box.files.write(f"{scratch}/e2b-big.bin", data)))
        w_sbx.append(timed(lambda: cli("sandbox", "cp", "-w", "w", local, f"{name}:{scratch}/sbx-big.bin")))
        r_sdk.append(timed(lambda: box.files.read(f"{scratch}/e2b-big.bin", format="bytes")))
        r_sbx.append(timed(lambda: cli("sandbox", "cp", "-w", "w", f"{name}:{scratch}/sbx-big.bin", os.path.join(tmp, "back.bin"))))
    box.commands.run(f"rm -rf {scratch}")
    mb = 50
    for what, sdk, sbx in [("write 50 MB", w_sdk, w_sbx), ("read 50 MB", r_sdk, r_sbx)]:
        s, c = statistics.median(sdk), statistics.median(sbx)
        print(f"{what}: E2B SDK {mb / s:.1f} MB/s, sbx cp {mb / c:.1f} MB/s, throughput ratio {(mb / s) / (mb / c):.2f}")
box.kill()
