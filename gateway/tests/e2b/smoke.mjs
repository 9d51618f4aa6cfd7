// The unmodified E2B JS SDK (npm `e2b`, pinned in .ci/run) against sbxd's E2B API
// (gateway/tests/e2b_js.rs): a smaller run of what tests/e2b/control_plane.py does with the
// Python SDK.
//
// Environment: E2B_API_URL and E2B_SANDBOX_URL (sbxd's --e2b-listen), KEY_A (an sbx token of
// workspace a), KEY_B (of workspace b), E2B_NODE_PREFIX (the folder `npm install --prefix`
// put the SDK in: target/e2b-node). Prints one line per check; any failure throws.

import { randomBytes } from 'node:crypto'
import { createRequire } from 'node:module'
import { join } from 'node:path'
import { pathToFileURL } from 'node:url'

// An ES module's bare import does not read NODE_PATH: the SDK is resolved from its install
// folder, as `import 'e2b'` would resolve it from a project beside it.
const prefix = process.env.E2B_NODE_PREFIX
if (!prefix) throw new Error('E2B_NODE_PREFIX is not set')
const entry = createRequire(join(prefix, 'package.json')).resolve('e2b')
const {
  AuthenticationError,
  CommandExitError,
  NotFoundError,
  Sandbox,
} = await import(pathToFileURL(entry).href)

const KEY_A = process.env.KEY_A
const KEY_B = process.env.KEY_B

function check(what, ok, detail = '') {
  if (!ok) {
    throw new Error(`${what}: ${typeof detail === 'string' ? detail : JSON.stringify(detail)}`)
  }
  console.log(`ok ${what}`)
}

async function refused(what, call, kind) {
  try {
    await call()
  } catch (e) {
    check(what, e instanceof kind, `${e?.constructor?.name}: ${e?.message}`)
    return e
  }
  check(what, false, 'answered')
}

// Create, with metadata and a timeout; the answer names the sandbox by an E2B id.
const sbx = await Sandbox.create({
  metadata: { sandbox_test_id: 'js-1' },
  timeoutMs: 120_000,
  apiKey: KEY_A,
})
check('create', /^[a-z0-9]{32}$/.test(sbx.sandboxId), sbx.sandboxId)

// Commands, through the in-sandbox API.
let r = await sbx.commands.run('echo hello; echo oops >&2')
check('run: stdout', r.stdout === 'hello\n', r)
check('run: stderr', r.stderr === 'oops\n', r)
check('run: exit 0', r.exitCode === 0, r)
const e = await refused('run: a non-zero exit throws', () => sbx.commands.run('exit 3'), CommandExitError)
check('run: the exit code', e.exitCode === 3, e.exitCode)
r = await sbx.commands.run('echo $GREETING from $(pwd)', { envs: { GREETING: 'hi' }, cwd: '/tmp' })
check('run: envs and cwd', r.stdout === 'hi from /tmp\n', r)
const seen = []
await sbx.commands.run('for i in 1 2 3; do echo $i; sleep 0.1; done', {
  onStdout: (data) => seen.push(data),
})
check('run: streamed output', seen.join('').split(/\s+/).filter(Boolean).join() === '1,2,3', seen)
const bg = await sbx.commands.run('sleep 600', { background: true })
check('background: a pid', bg.pid > 0, bg.pid)
const listed = (await sbx.commands.list()).map((p) => p.pid)
check('background: listed', listed.includes(bg.pid), listed)
check('background: killed', (await sbx.commands.kill(bg.pid)) === true)
await refused('background: ends killed', () => bg.wait(), CommandExitError)
check('kill of what is gone', (await sbx.commands.kill(bg.pid)) === false)

// Files: write, read, list, exists, rename, makeDir, remove; 5 MB byte-exact.
// The process driver's sandboxes share the host's /tmp: a directory of this sandbox's own,
// removed at the end.
const base = `/tmp/e2b-js-${sbx.sandboxId}`
const w = await sbx.files.write(`${base}/hello.txt`, 'hello files')
check('files: write', w.path === `${base}/hello.txt` && w.name === 'hello.txt', w)
check('files: read', (await sbx.files.read(`${base}/hello.txt`)) === 'hello files')
const names = (await sbx.files.list(base)).map((x) => x.name).sort()
check('files: list', names.join() === 'hello.txt', names)
check('files: exists', (await sbx.files.exists(`${base}/hello.txt`)) === true)
check('files: not exists', (await sbx.files.exists(`${base}/nope`)) === false)
const moved = await sbx.files.rename(`${base}/hello.txt`, `${base}/moved.txt`)
check('files: rename', moved.path === `${base}/moved.txt`, moved)
check('files: makeDir', (await sbx.files.makeDir(`${base}/sub/deeper`)) === true)
check('files: makeDir twice', (await sbx.files.makeDir(`${base}/sub/deeper`)) === false)
await sbx.files.remove(`${base}/moved.txt`)
check('files: remove', (await sbx.files.exists(`${base}/moved.txt`)) === false)
const big = randomBytes(5 * 1024 * 1024)
await sbx.files.write(`${base}/big.bin`, new Blob([big]))
const back = await sbx.files.read(`${base}/big.bin`, { format: 'bytes' })
check('files: 5 MB round trip', Buffer.from(back).equals(big), back.length)

// Watching a directory (the JS SDK's WatchDir stream): a create arrives while it watches.
const events = []
const watching = await sbx.files.watchDir(base, (event) => events.push(event))
await sbx.files.write(`${base}/watched.txt`, 'seen')
const waited = Date.now()
while (!events.some((e) => e.name === 'watched.txt' && e.type === 'create') && Date.now() - waited < 10_000) {
  await new Promise((resolve) => setTimeout(resolve, 100))
}
check('watchDir: a create arrives', events.some((e) => e.name === 'watched.txt' && e.type === 'create'), events)
await watching.stop()

await sbx.files.remove(base)
check('files: scratch removed', (await sbx.files.exists(base)) === false)

// getInfo and list by metadata.
const info = await sbx.getInfo()
check('getInfo running', info.state === 'running', info)
check('getInfo metadata', JSON.stringify(info.metadata) === '{"sandbox_test_id":"js-1"}', info.metadata)
const ahead = (info.endAt - info.startedAt) / 1000
check('getInfo endAt is the timeout', ahead >= 100 && ahead <= 130, ahead)
const other = await Sandbox.create({ metadata: { sandbox_test_id: 'js-2' }, timeoutMs: 120_000, apiKey: KEY_A })
const found = (
  await Sandbox.list({ query: { metadata: { sandbox_test_id: 'js-1' } }, apiKey: KEY_A }).nextItems()
).map((s) => s.sandboxId)
check('list by metadata', found.join() === sbx.sandboxId, found)

// Another workspace's key sees none of it and touches none of it.
const listedB = await Sandbox.list({ apiKey: KEY_B }).nextItems()
check('isolation: list', listedB.length === 0, listedB)
await refused('isolation: getInfo', () => Sandbox.getInfo(sbx.sandboxId, { apiKey: KEY_B }), NotFoundError)
check('isolation: kill', (await Sandbox.kill(sbx.sandboxId, { apiKey: KEY_B })) === false)
check('isolation: still there', (await sbx.getInfo()).state === 'running')

// A wrong key: refused.
await refused(
  'a wrong key is refused',
  () => Sandbox.list({ apiKey: 'e2b_' + '0'.repeat(40) }).nextItems(),
  AuthenticationError,
)

// setTimeout: gone once it passes.
await sbx.setTimeout(2_000)
await new Promise((done) => setTimeout(done, 4_500))
await refused('setTimeout deletes', () => sbx.getInfo(), NotFoundError)
check('isRunning once gone', (await sbx.isRunning()) === false)

// kill: true, then false for what is gone.
check('kill', (await other.kill()) === true)
check('kill again', (await Sandbox.kill(other.sandboxId, { apiKey: KEY_A })) === false)
console.log('done')
