"""The unmodified E2B Python SDK against sbxd's E2B control plane (gateway/tests/e2b_sdk.rs).

Environment: E2B_API_URL and E2B_SANDBOX_URL (sbxd's --e2b-listen), KEY_A (an sbx token of
workspace a), KEY_B (of workspace b). Prints one line per check; any failure raises.
"""

import datetime
import os
import time

import e2b
from e2b import Sandbox, SandboxQuery

KEY_A = os.environ["KEY_A"]
KEY_B = os.environ["KEY_B"]


def check(what, ok, detail=""):
    if not ok:
        raise AssertionError(f"{what}: {detail}")
    print(f"ok {what}")


# Create, with metadata and a timeout; the answer names the sandbox by an E2B id.
sbx = Sandbox.create(metadata={"sandbox_test_id": "sdk-1"}, timeout=120, api_key=KEY_A)
check("create", len(sbx.sandbox_id) == 32 and sbx.sandbox_id.isalnum(), sbx.sandbox_id)
# The process driver's sandboxes share the host's /tmp (README, known limits): every file
# this script makes is under a directory of this sandbox's own, removed at the end.
scratch = f"/tmp/e2b-test-{sbx.sandbox_id}"

info = sbx.get_info()
check("get_info running", info.state.value == "running", info)
check("get_info metadata", info.metadata == {"sandbox_test_id": "sdk-1"}, info.metadata)
ahead = (info.end_at - info.started_at).total_seconds()
check("get_info end_at is the timeout", 110 <= ahead <= 130, ahead)

# A create retried with the same Idempotency-Key is the same sandbox; another key another.
once = Sandbox.create(idempotency_key="retry-1", timeout=60, api_key=KEY_A)
twice = Sandbox.create(idempotency_key="retry-1", timeout=60, api_key=KEY_A)
check("idempotent create", once.sandbox_id == twice.sandbox_id, (once.sandbox_id, twice.sandbox_id))
third = Sandbox.create(idempotency_key="retry-2", timeout=60, api_key=KEY_A)
check("another key, another sandbox", third.sandbox_id != once.sandbox_id)
check("idempotent sandboxes killed", once.kill() and third.kill())

# Usage samples: at least the one read now, in E2B's form.
samples = sbx.get_metrics()
check("metrics", len(samples) >= 1 and samples[-1].cpu_count >= 1 and samples[-1].mem_used > 0, samples)

# List, filtered by metadata, and paged.
other = Sandbox.create(metadata={"sandbox_test_id": "sdk-2"}, timeout=120, api_key=KEY_A)
listed = Sandbox.list(query=SandboxQuery(metadata={"sandbox_test_id": "sdk-1"}), api_key=KEY_A)
ids = [s.sandbox_id for s in listed.next_items()]
check("list by metadata", ids == [sbx.sandbox_id], ids)
# Newest first unless asked otherwise; by start time and template.
from e2b import SandboxQuery as Q

both = Q(metadata={"sandbox_test_id": "sdk-1"})
newest = [s.sandbox_id for s in Sandbox.list(api_key=KEY_A).next_items()]
check("list: newest first", newest[:2] == [other.sandbox_id, sbx.sandbox_id], newest)
oldest = [s.sandbox_id for s in Sandbox.list(order="asc", api_key=KEY_A).next_items()]
check("list: oldest first", oldest == list(reversed(newest)), oldest)
since = Sandbox.list(query=Q(started_after=info.started_at), api_key=KEY_A).next_items()
check("list: started after", {s.sandbox_id for s in since} == {sbx.sandbox_id, other.sandbox_id}, since)
later = Sandbox.list(
    query=Q(started_after=other.get_info().started_at + datetime.timedelta(seconds=1)), api_key=KEY_A
).next_items()
check("list: started after all of them", later == [], later)
check("list: by template", len(Sandbox.list(query=Q(template="base"), api_key=KEY_A).next_items()) == 2)
check("list: another template", Sandbox.list(query=Q(template="nope"), api_key=KEY_A).next_items() == [])
pages = Sandbox.list(limit=1, api_key=KEY_A)
first = pages.next_items()
check("list pages", len(first) == 1 and pages.has_next, (first, pages.has_next))
second = pages.next_items()
check("list second page", len(second) == 1 and second[0].sandbox_id != first[0].sandbox_id, second)
check("list: no third page", pages.has_next is False)

# Another workspace's key sees none of it and touches none of it.
listed_b = Sandbox.list(api_key=KEY_B).next_items()
check("isolation: list", listed_b == [], listed_b)
try:
    Sandbox.get_info(sbx.sandbox_id, api_key=KEY_B)
    check("isolation: get_info", False, "answered")
except e2b.SandboxNotFoundException:
    check("isolation: get_info", True)
check("isolation: kill", Sandbox.kill(sbx.sandbox_id, api_key=KEY_B) is False)
check("isolation: still there", sbx.get_info().state.value == "running")

# No key, or a wrong one: refused.
try:
    Sandbox.list(api_key="e2b_" + "0" * 40).next_items()
    check("a wrong key is refused", False, "answered")
except e2b.AuthenticationException:
    check("a wrong key is refused", True)

# connect to a running sandbox: 200, the deadline only ever extended.
again = Sandbox.connect(sbx.sandbox_id, timeout=5, api_key=KEY_A)
check("connect running", again.sandbox_id == sbx.sandbox_id)
after = sbx.get_info()
check("connect never shortens", after.end_at >= info.end_at, (after.end_at, info.end_at))

# pause on a driver that cannot: an error, and the sandbox runs on.
try:
    sbx.pause()
    check("pause refused where the driver cannot", False, "paused")
except e2b.SandboxException as e:
    check("pause refused where the driver cannot", "cannot pause" in str(e), str(e))
check("still running", sbx.get_info().state.value == "running")

# Commands, through the in-sandbox API: output, exit codes, envs, cwd, streaming, background.
r = sbx.commands.run("echo hello; echo oops >&2")
check("run: stdout", r.stdout == "hello\n", r)
check("run: stderr", r.stderr == "oops\n", r)
check("run: exit 0", r.exit_code == 0, r)
try:
    sbx.commands.run("exit 3")
    check("run: a non-zero exit raises", False, "returned")
except e2b.CommandExitException as e:
    check("run: a non-zero exit raises", e.exit_code == 3, e)
r = sbx.commands.run("echo $GREETING from $(pwd)", envs={"GREETING": "hi"}, cwd="/tmp")
check("run: envs and cwd", r.stdout == "hi from /tmp\n", r)
home = sbx.commands.run("cd && pwd").stdout.strip()
sbx.commands.run("mkdir -p ~/rel-dir")
r = sbx.commands.run("pwd", cwd="rel-dir")
check("run: a relative cwd is under the home directory", r.stdout == f"{home}/rel-dir\n", (home, r))
sbx.commands.run("rmdir ~/rel-dir")
try:
    sbx.commands.run("sleep 5", timeout=1)
    check("run: past its timeout", False, "returned")
except e2b.TimeoutException:
    check("run: past its timeout", True)
seen = []
sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done", on_stdout=lambda line: seen.append(line))
check("run: streamed output", "".join(seen).split() == ["1", "2", "3"], seen)
bg = sbx.commands.run("sleep 600", background=True)
check("background: a pid", bg.pid > 0, bg.pid)
check("background: listed", bg.pid in [p.pid for p in sbx.commands.list()])
check("background: killed", sbx.commands.kill(bg.pid) is True)
try:
    bg.wait()
    check("background: ends killed", False, "exited 0")
except e2b.CommandExitException as e:
    check("background: ends killed", e.exit_code != 0, e)
check("kill of what is gone", sbx.commands.kill(bg.pid) is False)
# Connect(pid) replays what a background command said before it, then follows it.
talker = sbx.commands.run("echo before; read go; echo after", background=True, stdin=True)
time.sleep(0.5)
again = sbx.commands.connect(talker.pid)
sbx.commands.send_stdin(talker.pid, "go\n")
heard = again.wait()
check("connect: replays the output before it, then follows", heard.stdout == "before\nafter\n",
      heard.stdout)
check("is_running", sbx.is_running() is True)

# A server inside the sandbox, reached through E2b-Sandbox-Port with the sandbox's token.
import httpx

site = f"{scratch}/site"
sbx.commands.run(f"mkdir -p {site} && echo served-from-inside > {site}/index.html")
server = sbx.commands.run(
    f"cd {site} && exec python3 -m http.server 8123 --bind 127.0.0.1", background=True
)
port_headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8123"}
url = os.environ["E2B_SANDBOX_URL"] + "/index.html"
answer = None
for _ in range(50):
    answer = httpx.get(url, headers={**port_headers, "X-Access-Token": sbx._envd_access_token})
    if answer.status_code == 200:
        break
    time.sleep(0.2)
check("port: served from inside", answer.text == "served-from-inside\n", (answer.status_code, answer.text))
traffic = httpx.get(url, headers={**port_headers, "e2b-traffic-access-token": sbx.traffic_access_token})
check("port: served with the create's trafficAccessToken", traffic.status_code == 200,
      (sbx.traffic_access_token is not None, traffic.status_code))
refused = httpx.get(url, headers=port_headers)
check("port: refused without the sandbox's token", refused.status_code == 401, refused.status_code)
nothing = httpx.get(
    url,
    headers={**port_headers, "E2b-Sandbox-Port": "8124", "X-Access-Token": sbx._envd_access_token},
)
check("port: nothing listening is 502", nothing.status_code == 502, nothing.status_code)
check("port: server stopped", sbx.commands.kill(server.pid) is True)

# Files: write, read, list, exists, get_info, rename, make_dir, remove; 50 MB byte-exact.
base = f"{scratch}/files"
info_w = sbx.files.write(f"{base}/hello.txt", "hello files")
check("files: write", info_w.path == f"{base}/hello.txt" and info_w.name == "hello.txt", info_w)
check("files: read", sbx.files.read(f"{base}/hello.txt") == "hello files")
sbx.files.make_dir(f"{base}/b-dir")
sbx.files.write(f"{base}/a.txt", "a")
names = [e.name for e in sbx.files.list(base)]
check("files: list, by name", names == ["a.txt", "b-dir", "hello.txt"], names)
sbx.files.remove(f"{base}/a.txt")
sbx.files.remove(f"{base}/b-dir")
check("files: exists", sbx.files.exists(f"{base}/hello.txt") is True)
check("files: not exists", sbx.files.exists(f"{base}/nope") is False)
got = sbx.files.get_info(f"{base}/hello.txt")
check("files: get_info", got.size == 11 and got.type.value == "file", got)
moved = sbx.files.rename(f"{base}/hello.txt", f"{base}/moved.txt")
check("files: rename", moved.path == f"{base}/moved.txt", moved)
check("files: make_dir", sbx.files.make_dir(f"{base}/sub/deeper") is True)
check("files: make_dir twice", sbx.files.make_dir(f"{base}/sub/deeper") is False)
sbx.files.remove(f"{base}/moved.txt")
check("files: remove", sbx.files.exists(f"{base}/moved.txt") is False)
sbx.files.remove(f"{base}/moved.txt")
check("files: removing what is not there", sbx.files.exists(f"{base}/moved.txt") is False)
try:
    sbx.files.read(f"{base}/nope")
    check("files: read of what is not there", False, "read")
except e2b.FileNotFoundException:
    check("files: read of what is not there", True)
# A device is no file's bytes: /dev/zero would never end (the gateway holds what it reads).
began = time.monotonic()
try:
    sbx.files.read("/dev/zero", format="bytes")
    check("files: a device is refused", False, "read")
except e2b.SandboxException as e:
    check("files: a device is refused", "not a regular file" in str(e), e)
check("files: refused at once", time.monotonic() - began < 5, time.monotonic() - began)
big = os.urandom(50 * 1024 * 1024)
sbx.files.write(f"{base}/big.bin", big)
back = sbx.files.read(f"{base}/big.bin", format="bytes")
check("files: 50 MB round trip", bytes(back) == big, len(back))

# A terminal: input typed in, a resize, the output, the shell's exit; another one killed.
from e2b import PtySize
term = sbx.pty.create(PtySize(rows=24, cols=80))
sbx.pty.send_stdin(term.pid, b"stty size\n")
time.sleep(0.5)
sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
sbx.pty.send_stdin(term.pid, b"stty size; echo typed-$((6*7)); exit\n")
typed = []
term.wait(on_pty=lambda data: typed.append(bytes(data)))
out = b"".join(typed)
check("pty: input and output", b"typed-42" in out and b"24 80" in out, out[-300:])
check("pty: resize", b"30 100" in out, out[-300:])
other_term = sbx.pty.create(PtySize(rows=24, cols=80))
check("pty: killed", sbx.pty.kill(other_term.pid) is True)

# Watching a directory (the sync SDK's watcher calls): a write, a create, a nested create
# (recursive), a remove; a stopped watcher answers no more.
from e2b import FilesystemEventType

watched = f"{scratch}/watched"
sbx.files.make_dir(f"{watched}/sub")
sbx.files.write(f"{watched}/a.txt", "one")
handle = sbx.files.watch_dir(watched, recursive=True)
sbx.files.write(f"{watched}/a.txt", "one and two")
sbx.files.write(f"{watched}/b.txt", "new")
sbx.files.write(f"{watched}/sub/c.txt", "nested")
seen = {(e.name, e.type) for e in handle.get_new_events()}
check("watch: a write", ("a.txt", FilesystemEventType.WRITE) in seen, seen)
check("watch: a create", ("b.txt", FilesystemEventType.CREATE) in seen, seen)
check("watch: a nested create", ("sub/c.txt", FilesystemEventType.CREATE) in seen, seen)
sbx.files.remove(f"{watched}/b.txt")
seen = [(e.name, e.type) for e in handle.get_new_events()]
check("watch: a remove, and only it", seen == [("b.txt", FilesystemEventType.REMOVE)], seen)
check("watch: nothing new", handle.get_new_events() == [])
handle.stop()
try:
    handle.get_new_events()
    check("watch: stopped", False, "answered")
except e2b.SandboxException:
    check("watch: stopped", True)
try:
    sbx.files.watch_dir(f"{scratch}/nope")
    check("watch: a missing directory", False, "watched")
except e2b.SandboxException as e:
    check("watch: a missing directory", "does not exist" in str(e) or isinstance(e, e2b.FileNotFoundException), e)

sbx.commands.run(f"rm -rf {scratch}")
check("scratch removed", sbx.files.exists(scratch) is False)

# set_timeout: gone once it passes.
sbx.set_timeout(2)
time.sleep(4.5)
try:
    sbx.get_info()
    check("set_timeout deletes", False, "still there")
except e2b.SandboxNotFoundException:
    check("set_timeout deletes", True)
check("is_running once gone", sbx.is_running() is False)

# A sandbox killed while a command runs: the command's wait says the sandbox is gone (the
# SDK asks /health on an `unavailable` stream end), as on E2B.
running = other.commands.run("sleep 60", background=True)
check("kill", other.kill() is True)
try:
    running.wait()
    check("a command of a killed sandbox ends", False, "it ended normally")
except e2b.TimeoutException as e:
    check("a command of a killed sandbox says the sandbox is gone",
          "killed or reached its end of life" in str(e), str(e))
check("kill again", Sandbox.kill(other.sandbox_id, api_key=KEY_A) is False)
print("done")
