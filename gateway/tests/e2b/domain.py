"""The E2B listener over TLS with --e2b-domain (gateway/tests/e2b_sdk.rs): the unmodified E2B
Python SDK over https, trusting the test's CA; and requests routed by Host as E2B's own domain
routes them (api.DOMAIN, PORT-ID.DOMAIN), sent with Python's http.client (the machine has no
DNS for DOMAIN, so the names travel as Host headers to the listener's address).

Environment: E2B_API_URL and E2B_SANDBOX_URL (https://127.0.0.1:PORT), E2B_API_KEY,
SSL_CERT_FILE (the test's CA), E2B_DOMAIN. Prints one line per check; any failure raises.
"""

import http.client
import json
import os
import ssl
from urllib.parse import urlparse

from e2b import Sandbox

DOMAIN = os.environ["E2B_DOMAIN"]
URL = urlparse(os.environ["E2B_API_URL"])
KEY = os.environ["E2B_API_KEY"]
TLS = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])


def check(what, ok, detail=""):
    if not ok:
        raise AssertionError(f"{what}: {detail}")
    print(f"ok {what}")


def by_host(host, method, path, headers=None, body=None):
    conn = http.client.HTTPSConnection(URL.hostname, URL.port, context=TLS, timeout=30)
    conn.request(method, path, body=body, headers={"Host": host, **(headers or {})})
    answer = conn.getresponse()
    data = answer.read()
    conn.close()
    return answer.status, data


sbx = Sandbox.create(timeout=120)
check("create over https", len(sbx.sandbox_id) == 32, sbx.sandbox_id)
r = sbx.commands.run("echo over tls")
check("a command over https", r.stdout == "over tls\n", r)
# The process driver's sandboxes share the host's /tmp: a file of this sandbox's own.
scratch = f"/tmp/e2b-tls-{sbx.sandbox_id}.txt"
sbx.files.write(scratch, "kept")
check("files over https", sbx.files.read(scratch) == "kept")
sbx.files.remove(scratch)

status, body = by_host(f"api.{DOMAIN}", "GET", "/v2/sandboxes", {"X-API-KEY": KEY})
listed = [s["sandboxID"] for s in json.loads(body)] if status == 200 else body
check("api.DOMAIN is the control plane", listed == [sbx.sandbox_id], (status, listed))
sandbox_host = f"49983-{sbx.sandbox_id}.{DOMAIN}"
status, _ = by_host(sandbox_host, "GET", "/health", {"X-Access-Token": sbx._envd_access_token})
check("49983-ID.DOMAIN is the sandbox's API", status == 204, status)
status, _ = by_host(sandbox_host, "GET", "/health")
check("its /health wants the sandbox's token", status == 401, status)
status, body = by_host(
    sandbox_host,
    "POST",
    "/process.Process/List",
    {"X-Access-Token": sbx._envd_access_token, "Content-Type": "application/json"},
    b"{}",
)
check("a call by host with the sandbox's token", status == 200 and b"processes" in body, (status, body))
status, _ = by_host(f"49983-{'0' * 32}.{DOMAIN}", "GET", "/health")
check("a host naming no sandbox", status == 502, status)
check("kill", sbx.kill() is True)
print("done")
