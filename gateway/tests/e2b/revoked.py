"""A sandbox's access token dies with the key that made it (gateway/tests/e2b_sdk.rs): a
sandbox made with KEY runs a command, writes and reads a file and reaches a port; then the
test revokes the key (sbxd token revoke) and says so on stdin; after it, every call through
the token the SDK holds — a command, a file read, a write, the port, /health — is refused as
unauthenticated, the sandbox object unchanged. Prints `ready` before the revoke, one line per
check, `done` at the end; any failure raises.

Environment: E2B_API_URL, E2B_SANDBOX_URL, KEY.
"""

import os
import sys
import urllib.error
import urllib.request

from e2b import Sandbox

KEY = os.environ["KEY"]
URL = os.environ["E2B_SANDBOX_URL"]


def check(what, ok, detail=""):
    if not ok:
        raise AssertionError(f"{what}: {detail}")
    print(f"ok {what}", flush=True)


def raw(path, token, port=None):
    """A GET of `path` in the sandbox (its daemon, or `port`) with `token`: the status."""
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": token}
    if port is not None:
        headers["E2b-Sandbox-Port"] = str(port)
    req = urllib.request.Request(URL + path, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def refused(what, call):
    try:
        call()
    except Exception as e:  # the SDK's AuthenticationException (or another, named)
        text = f"{type(e).__name__}: {e}"
        check(what, "auth" in text.lower() or "401" in text or "token" in text.lower(), text)
        return
    raise AssertionError(f"{what}: went through after the key was revoked")


sbx = Sandbox.create(timeout=300, api_key=KEY)
token = sbx._envd_access_token
check("a command runs", sbx.commands.run("echo hi").stdout == "hi\n")
sbx.files.write("/sandbox/note", "kept")
check("a file is read", sbx.files.read("/sandbox/note") == "kept")
check("health with the token", raw("/health", token) == 204, raw("/health", token))
check("health without it", raw("/health", "") == 401, raw("/health", ""))
check("a port with the token", raw("/", token, port=8080) != 401)
check("a forged token", raw("/health", token[:-4] + "0000") == 401)
print(f"token {token} {sbx.sandbox_id}", flush=True)
print("ready", flush=True)
sys.stdin.readline()  # the key is revoked now

refused("a command after the revoke", lambda: sbx.commands.run("echo hi"))
refused("a file read after the revoke", lambda: sbx.files.read("/sandbox/note"))
refused("a write after the revoke", lambda: sbx.files.write("/sandbox/x", "no"))
check("a port after the revoke", raw("/", token, port=8080) == 401)
check("health after the revoke", raw("/health", token) == 401)
print("done", flush=True)
