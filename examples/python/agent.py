# An agent's first 30 lines against sbx, with stock grpcio on sbxd's Unix socket.
import io, os, sys, tarfile, time
import grpc
from sbx.v1 import sbx_pb2 as pb, sbx_pb2_grpc as rpc

# Where sbx looks, in order: $SBX_ENDPOINT (unix:///PATH), the package's service, root's data dir.
places = [os.environ.get("SBX_ENDPOINT", "").removeprefix("unix://"), "/run/sbx/sbxd.sock", "/var/lib/sbx/sbxd.sock"]
channel = grpc.insecure_channel("unix:" + next((p for p in places if p and os.path.exists(p)), places[1]))
sandboxes = rpc.SandboxServiceStub(channel)
ref = pb.SandboxRef(name=sys.argv[1] if len(sys.argv) > 1 else "py-agent")

sandboxes.CreateSandbox(pb.CreateSandboxRequest(name=ref.name, spec=pb.SandboxSpec(command=["sleep", "infinity"])))
for _ in range(300):  # Ready within 30 s
    if sandboxes.GetSandbox(pb.GetSandboxRequest(sandbox=ref)).phase == pb.PHASE_READY:
        break
    time.sleep(0.1)

def run(*command):  # -> (stdout, exit code)
    out, code = b"", None
    for chunk in sandboxes.Exec(iter([pb.ExecInput(start=pb.ExecRequest(sandbox=ref, command=command))])):
        out += chunk.stdout
        code = chunk.exit.code if chunk.HasField("exit") else code
    return out.decode(), code

tar = io.BytesIO()
with tarfile.open(fileobj=tar, mode="w") as t:  # files go in and out as tar, as with docker cp
    info = tarfile.TarInfo("note.txt")
    info.size = 6
    t.addfile(info, io.BytesIO(b"hello\n"))
start = pb.CopyToSandboxInput(start=pb.CopyToSandboxStart(sandbox=ref, path="/sandbox"))
sandboxes.CopyToSandbox(iter([start, pb.CopyToSandboxInput(data=tar.getvalue())]))
print(run("sh", "-c", "wc -c < /sandbox/note.txt; exit 3"))  # ('6\n', 3)
got = b"".join(c.data for c in sandboxes.CopyFromSandbox(pb.CopyFromSandboxRequest(sandbox=ref, path="/sandbox/note.txt")))
print(tarfile.open(fileobj=io.BytesIO(got)).extractfile("note.txt").read())  # b'hello\n'
sandboxes.DeleteSandbox(pb.DeleteSandboxRequest(sandbox=ref))
