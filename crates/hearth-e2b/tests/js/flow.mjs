// The official E2B JavaScript SDK (e2b 2.51.0), unchanged, against a real hearthd: E2B_API_URL and
// E2B_SANDBOX_URL point at the daemon, E2B_API_KEY is its key. Run by tests/sdks.rs, which checks for
// "[js] ok" on stderr; every step asserts what the SDK returned, and the first failure exits non-zero.
import assert from 'node:assert/strict'
import {
  CommandExitError,
  FileNotFoundError,
  Sandbox,
  SandboxNotFoundError,
} from 'e2b'

const template = process.env.HEARTH_E2B_TEMPLATE ?? 'minimal'
const suite = `js-${process.pid}-${Date.now()}`
const log = (...a) => console.error('[js]', ...a)
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

async function waitFor(what, cond, ms = 20_000) {
  const end = Date.now() + ms
  while (!(await cond())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`)
    await sleep(100)
  }
}

// create
const sbx = await Sandbox.create(template, {
  timeoutMs: 600_000,
  metadata: { suite },
  envs: { FROM_CREATE: 'yes' },
})
// The E2B form of a hearth id: `-` for `_`, so that it is a valid TLS host label.
assert.match(sbx.sandboxId, /^sbx-[0-9a-f]{16}$/)
let info = await sbx.getInfo()
assert.equal(info.state, 'running')
assert.equal(info.templateId, template)
assert.deepEqual(info.metadata, { suite })
log('created', sbx.sandboxId)

// commands.run: output streams (the first line arrives well before the command ends), env, cwd, exit code
const chunks = []
const t0 = Date.now()
const r = await sbx.commands.run(
  'for i in 1 2 3; do echo line$i; sleep 1; done; echo $FROM_CREATE $FROM_CMD; pwd; echo warn >&2',
  { envs: { FROM_CMD: 'ok' }, cwd: '/tmp', onStdout: (d) => chunks.push([Date.now() - t0, d]) },
)
const took = Date.now() - t0
assert.equal(r.exitCode, 0)
assert.equal(r.stdout, 'line1\nline2\nline3\nyes ok\n/tmp\n')
assert.equal(r.stderr, 'warn\n')
assert.ok(chunks.length >= 3, `output in pieces: ${JSON.stringify(chunks)}`)
assert.ok(chunks[0][0] < took - 1500, `first line at ${chunks[0][0]} ms of ${took} ms`)
await assert.rejects(
  sbx.commands.run('echo bad >&2; exit 7'),
  (e) => e instanceof CommandExitError && e.exitCode === 7 && e.stderr === 'bad\n',
)
log('commands ok')

// background command + stdin + kill; closeStdin; connect to a running command
let bgOut = ''
const cat = await sbx.commands.run('cat', { background: true, stdin: true, onStdout: (d) => { bgOut += d } })
await sbx.commands.sendStdin(cat.pid, 'ping\n')
await waitFor('cat to echo stdin', () => bgOut.includes('ping\n'))
const procs = await sbx.commands.list()
const listed = procs.find((p) => p.pid === cat.pid)
assert.ok(listed, JSON.stringify(procs))
assert.equal(listed.cmd, '/bin/bash')
assert.deepEqual(listed.args, ['-l', '-c', 'cat'])
assert.equal(await sbx.commands.kill(cat.pid), true)
await assert.rejects(cat.wait(), (e) => e instanceof CommandExitError && e.exitCode === -1)
assert.equal(await sbx.commands.kill(cat.pid), false)
const wc = await sbx.commands.run('wc -c', { background: true, stdin: true })
await sbx.commands.sendStdin(wc.pid, 'abcd')
await sbx.commands.closeStdin(wc.pid)
assert.equal((await wc.wait()).stdout.trim(), '4')
const ticker = await sbx.commands.run('i=0; while true; do i=$((i+1)); echo tick$i; sleep 0.3; done', {
  background: true,
})
await ticker.disconnect()
let ticks = ''
const attached = await sbx.commands.connect(ticker.pid, { onStdout: (d) => { ticks += d } })
await waitFor('output of the reattached command', () => /tick\d+\n/.test(ticks))
assert.equal(await attached.kill(), true)
log('background ok')

// a terminal
let screen = ''
const term = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { screen += new TextDecoder().decode(d) } })
await sbx.pty.sendInput(term.pid, new TextEncoder().encode('echo term-$((6*7))\n'))
await sbx.pty.resize(term.pid, { cols: 100, rows: 30 })
await sbx.pty.sendInput(term.pid, new TextEncoder().encode('stty size; exit\n'))
assert.equal((await term.wait()).exitCode, 0)
assert.ok(screen.includes('term-42') && screen.includes('30 100'), screen)
log('pty ok')

// files: write, read, list, rename, remove, watch
const events = []
await sbx.files.makeDir('/root/watched')
const watch = await sbx.files.watchDir('/root/watched', (e) => events.push(`${e.type}:${e.name}`))
const w = await sbx.files.write('notes.txt', 'some notes')
assert.equal(w.path, '/root/notes.txt')
assert.equal(await sbx.files.read('/root/notes.txt'), 'some notes')
const bytes = Uint8Array.from({ length: 256 }, (_, i) => i)
await sbx.files.write('/root/deep/er/bytes.bin', bytes.buffer)
assert.deepEqual(await sbx.files.read('/root/deep/er/bytes.bin', { format: 'bytes' }), bytes)
const big = Uint8Array.from({ length: 3 * 1024 * 1024 }, (_, i) => (i * 7919) % 251)
await sbx.files.write('/root/big.bin', big.buffer)
assert.deepEqual(await sbx.files.read('/root/big.bin', { format: 'bytes' }), big)
assert.equal(await sbx.files.makeDir('/root/dir/sub'), true)
assert.equal(await sbx.files.makeDir('/root/dir/sub'), false)
const names = (await sbx.files.list('/root')).map((e) => e.name)
for (const n of ['notes.txt', 'deep', 'dir', 'watched']) assert.ok(names.includes(n), `${n} in ${names}`)
const deep = (await sbx.files.list('/root/dir', { depth: 2 })).map((e) => e.path)
assert.deepEqual(deep.sort(), ['/root/dir/sub'])
const moved = await sbx.files.rename('/root/notes.txt', '/root/moved/notes.txt')
assert.equal(moved.path, '/root/moved/notes.txt')
assert.equal(await sbx.files.exists('/root/notes.txt'), false)
const stat = await sbx.files.getInfo('/root/moved/notes.txt')
assert.equal(stat.size, 10)
assert.equal(stat.type, 'file')
await sbx.files.remove('/root/moved')
assert.equal(await sbx.files.exists('/root/moved/notes.txt'), false)
await assert.rejects(sbx.files.read('/root/nope.txt'), (e) => e instanceof FileNotFoundError)
await sbx.files.write('/root/watched/seen.txt', 'x')
await sbx.files.rename('/root/watched/seen.txt', '/root/watched/renamed.txt')
await sbx.files.remove('/root/watched/renamed.txt')
await waitFor('watch events', () => events.includes('remove:renamed.txt'))
await watch.stop()
for (const e of ['create:seen.txt', 'rename:seen.txt', 'create:renamed.txt', 'remove:renamed.txt']) {
  assert.ok(events.includes(e), `${e} in ${events}`)
}
assert.ok(!events.some((e) => e.includes('.hearth-')), `no agent temporaries in ${events}`)
log('files ok')

// setTimeout
await sbx.setTimeout(900_000)
info = await sbx.getInfo()
const left = info.endAt.getTime() - Date.now()
assert.ok(left > 850_000 && left < 950_000, `end in ${left} ms`)

// pause, then connect resumes it with its state intact
const sleeper = await sbx.commands.run('sleep 1000', { background: true })
await sleeper.disconnect()
await sbx.files.write('/root/before-pause.txt', 'kept')
assert.equal(await sbx.pause(), true)
assert.equal((await sbx.getInfo()).state, 'paused')
assert.equal(await sbx.isRunning(), false)
const paused = await Sandbox.list({ query: { metadata: { suite }, state: ['paused'] } }).nextItems()
assert.deepEqual(paused.map((s) => s.sandboxId), [sbx.sandboxId])
const same = await Sandbox.connect(sbx.sandboxId)
assert.equal((await same.getInfo()).state, 'running')
assert.equal(await same.isRunning(), true)
assert.equal(await same.files.read('/root/before-pause.txt'), 'kept')
const after = await same.commands.list()
assert.ok(after.some((p) => p.pid === sleeper.pid && p.args.includes('sleep 1000')), JSON.stringify(after))
log('pause/connect ok')

// list
const running = await Sandbox.list({ query: { metadata: { suite } } }).nextItems()
assert.deepEqual(running.map((s) => [s.sandboxId, s.state]), [[sbx.sandboxId, 'running']])

// kill; an unknown sandbox is the SDK's not-found error
assert.equal(await same.kill(), true)
await assert.rejects(Sandbox.getInfo(sbx.sandboxId), (e) => e instanceof SandboxNotFoundError)
assert.equal(await Sandbox.kill(sbx.sandboxId), false)
await assert.rejects(Sandbox.connect(sbx.sandboxId), (e) => e instanceof SandboxNotFoundError)
assert.equal(await sbx.isRunning(), false)
log('kill ok')

// a template with bash runs commands with bash (minimal has only busybox sh)
if (process.env.HEARTH_E2B_BASH_TEMPLATE) {
  const deb = await Sandbox.create(process.env.HEARTH_E2B_BASH_TEMPLATE, { timeoutMs: 300_000 })
  const v = await deb.commands.run('echo "bash=$BASH_VERSION"')
  assert.match(v.stdout, /^bash=\d/)
  await deb.kill()
  log('bash ok')
}
log('ok')
