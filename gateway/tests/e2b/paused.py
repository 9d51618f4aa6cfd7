"""The unmodified E2B Python SDK pausing a sandbox and connecting to it again, on a driver
that pauses (the vm driver: its memory is saved and restored), for gateway/tests/e2b_sdk.rs.

Environment: E2B_API_URL and E2B_SANDBOX_URL (sbxd's --e2b-listen), E2B_API_KEY. Prints one
line per check; any failure raises.
"""

import e2b
from e2b import Sandbox


def check(what, ok, detail=""):
    if not ok:
        raise AssertionError(f"{what}: {detail}")
    print(f"ok {what}")


sbx = Sandbox.create(timeout=600)
# The guest's /tmp is its memory: gone if the VM were booted again rather than resumed.
sbx.files.write("/tmp/kept.txt", "in memory")
check("written", sbx.files.read("/tmp/kept.txt") == "in memory")

check("pause", sbx.pause() is True)
info = Sandbox.get_info(sbx.sandbox_id)
check("get_info paused", info.state.value == "paused", info.state)
listed = Sandbox.list(query=e2b.SandboxQuery(state=[e2b.SandboxState.PAUSED])).next_items()
check("listed as paused", [s.sandbox_id for s in listed] == [sbx.sandbox_id], listed)
check("not running while paused", sbx.is_running() is False)
check("pause again", sbx.pause() is False)

again = Sandbox.connect(sbx.sandbox_id, timeout=600)
check("connect resumes", again.sandbox_id == sbx.sandbox_id)
check("running again", Sandbox.get_info(sbx.sandbox_id).state.value == "running")
check("memory kept", again.files.read("/tmp/kept.txt") == "in memory")
again.files.write("/tmp/after.txt", "after")
check("usable after", again.files.read("/tmp/after.txt") == "after")
check("kill", again.kill() is True)
print("done")
