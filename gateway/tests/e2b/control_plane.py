"""The unmodified E2B Python SDK against sbxd's E2B control plane (gateway/tests/e2b_sdk.rs).

Environment: E2B_API_URL and E2B_SANDBOX_URL (sbxd's --e2b-listen), KEY_A (an sbx token of
workspace a), KEY_B (of workspace b). Prints one line per check; any failure raises.
"""

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

info = sbx.get_info()
check("get_info running", info.state.value == "running", info)
check("get_info metadata", info.metadata == {"sandbox_test_id": "sdk-1"}, info.metadata)
ahead = (info.end_at - info.started_at).total_seconds()
check("get_info end_at is the timeout", 110 <= ahead <= 130, ahead)

# List, filtered by metadata, and paged.
other = Sandbox.create(metadata={"sandbox_test_id": "sdk-2"}, timeout=120, api_key=KEY_A)
listed = Sandbox.list(query=SandboxQuery(metadata={"sandbox_test_id": "sdk-1"}), api_key=KEY_A)
ids = [s.sandbox_id for s in listed.next_items()]
check("list by metadata", ids == [sbx.sandbox_id], ids)
pages = Sandbox.list(limit=1, api_key=KEY_A)
first = pages.next_items()
check("list pages", len(first) == 1 and pages.has_next, (first, pages.has_next))
second = pages.next_items()
check("list second page", len(second) == 1 and second[0].sandbox_id != first[0].sandbox_id, second)

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

# set_timeout: gone once it passes.
sbx.set_timeout(2)
time.sleep(4.5)
try:
    sbx.get_info()
    check("set_timeout deletes", False, "still there")
except e2b.SandboxNotFoundException:
    check("set_timeout deletes", True)

# kill: True, then False for what is gone.
check("kill", other.kill() is True)
check("kill again", Sandbox.kill(other.sandbox_id, api_key=KEY_A) is False)
print("done")
