"""The unmodified E2B Python SDK pausing sandboxes on the default driver (oci), for
gateway/tests/e2b_sdk.rs: `pause()` freezes the sandbox with its memory, and `connect()`
resumes it with a counter that counted on (not started again) and a file in /tmp kept;
`pause(keep_memory=False)` keeps its files only (the workload is stopped), and `connect()`
starts it again from them: the file kept, the counter started anew.

Environment: E2B_API_URL and E2B_SANDBOX_URL (sbxd's --e2b-listen), E2B_API_KEY. Prints one
line per check; any failure raises.
"""

import time

from e2b import Sandbox

COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done"


def check(what, ok, detail=""):
    if not ok:
        raise AssertionError(f"{what}: {detail!r}")
    print(f"ok {what}")


def count(sbx):
    return int(sbx.commands.run("cat /tmp/count").stdout.strip() or 0)


def counting(sbx, at_least):
    """The counter, once it reached `at_least` (within 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        n = count(sbx)
        if n >= at_least or time.monotonic() > deadline:
            return n
        time.sleep(0.1)


for memory in (True, False):
    what = "with its memory" if memory else "its files only"
    sbx = Sandbox.create(timeout=600)
    sbx.commands.run(COUNTER, background=True)
    sbx.files.write("/tmp/kept.txt", "kept")
    before = counting(sbx, 20)
    check(f"counting before a pause ({what})", before >= 20, before)
    check(f"pause ({what})", sbx.pause(keep_memory=memory) is True)
    info = Sandbox.get_info(sbx.sandbox_id)
    check(f"paused ({what})", info.state.value == "paused", info.state)
    again = Sandbox.connect(sbx.sandbox_id, timeout=600)
    check(f"connect ({what})", Sandbox.get_info(sbx.sandbox_id).state.value == "running")
    check(f"the file in /tmp kept ({what})", again.files.read("/tmp/kept.txt") == "kept")
    # The counter's shell, as `ps` inside sees it (1 while it runs).
    running = again.commands.run("ps -o args | grep -c '[w]hile :' || true").stdout.strip()
    if memory:
        check("the counter's process is still there", running == "1", running)
        after = counting(again, before + 5)
        check("the counter counted on from where it stood", after > before, (before, after))
    else:
        check("the counter's process is gone: the workload started again", running == "0", running)
    check(f"kill ({what})", again.kill() is True)
print("done")
