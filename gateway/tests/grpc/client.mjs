// A stock Node.js gRPC client (@grpc/grpc-js, with @grpc/proto-loader reading sbx.proto) on
// sbxd's Unix socket: gateway info, then a sandbox made, run in and deleted.
// Usage: node client.mjs NODE_MODULES PROTO_ROOT SOCKET NAME
import { createRequire } from "node:module";
const [modules, protoRoot, socket, name] = process.argv.slice(2);
const require = createRequire(modules + "/");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const def = loader.loadSync("sbx/v1/sbx.proto", { includeDirs: [protoRoot], enums: String, keepCase: true });
const sbx = grpc.loadPackageDefinition(def).sbx.v1;
const creds = grpc.credentials.createInsecure();
const target = "unix:" + socket;
const gateway = new sbx.GatewayService(target, creds);
const sandboxes = new sbx.SandboxService(target, creds);
const call = (client, method, req) =>
  new Promise((ok, fail) =>
    client[method](req, { deadline: Date.now() + 20000 }, (e, r) => (e ? fail(e) : ok(r))));

const info = await call(gateway, "GetGatewayInfo", {});
console.log("driver", info.default_driver);
const ref = { name };
await call(sandboxes, "CreateSandbox", { name, spec: { command: ["sleep", "infinity"] } });
let phase = "";
for (let i = 0; i < 300 && phase !== "PHASE_READY"; i++) {
  phase = (await call(sandboxes, "GetSandbox", { sandbox: ref })).phase;
  if (phase !== "PHASE_READY") await new Promise((r) => setTimeout(r, 100));
}
console.log("phase", phase);
const exec = sandboxes.Exec({ deadline: Date.now() + 20000 });
let out = "";
const code = await new Promise((ok, fail) => {
  exec.on("data", (m) => {
    if (m.stdout) out += Buffer.from(m.stdout).toString();
    if (m.exit) ok(m.exit.code);
  });
  exec.on("error", fail);
  exec.write({ start: { sandbox: ref, command: ["sh", "-c", "echo from-node; exit 5"] } });
  exec.end();
});
console.log("exec", JSON.stringify(out), code);
const deleted = await call(sandboxes, "DeleteSandbox", { sandbox: ref });
console.log("deleted", deleted.deleted);
gateway.close();
sandboxes.close();
