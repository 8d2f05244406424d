"""The official E2B Python SDK (e2b 2.63.0), unchanged, against a real hearthd: E2B_API_URL and E2B_SANDBOX_URL
point at the daemon, E2B_API_KEY is its key. Run by tests/sdks.rs, which checks for "[py] ok" on stderr; every
step asserts what the SDK returned, and the first failure exits non-zero."""

import asyncio
import io
import os
import sys
import time

from e2b import (
    AsyncSandbox,
    CommandExitException,
    FileNotFoundException,
    FileType,
    Sandbox,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
)

TEMPLATE = os.environ.get("HEARTH_E2B_TEMPLATE", "minimal")
SUITE = f"py-{os.getpid()}-{int(time.time() * 1000)}"


def log(*a):
    print("[py]", *a, file=sys.stderr, flush=True)


def wait_for(what, cond, secs=20.0):
    end = time.monotonic() + secs
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def raises(exc_type, fn, check=lambda e: True):
    try:
        fn()
    except exc_type as e:
        assert check(e), f"unexpected {exc_type.__name__}: {e!r}"
        return e
    raise AssertionError(f"expected {exc_type.__name__}")


# create
sbx = Sandbox.create(TEMPLATE, timeout=600, metadata={"suite": SUITE}, envs={"FROM_CREATE": "yes"})
info = sbx.get_info()
assert info.state == SandboxState.RUNNING, info
assert info.template_id == TEMPLATE
assert info.metadata == {"suite": SUITE}, info.metadata
log("created", sbx.sandbox_id)

# commands.run: output streams (the first line arrives well before the command ends), env, cwd, exit code
chunks = []
t0 = time.monotonic()
r = sbx.commands.run(
    "for i in 1 2 3; do echo line$i; sleep 1; done; echo $FROM_CREATE $FROM_CMD; pwd; echo warn >&2",
    envs={"FROM_CMD": "ok"},
    cwd="/tmp",
    on_stdout=lambda d: chunks.append((time.monotonic() - t0, d)),
)
took = time.monotonic() - t0
assert r.exit_code == 0
assert r.stdout == "line1\nline2\nline3\nyes ok\n/tmp\n", repr(r.stdout)
assert r.stderr == "warn\n", repr(r.stderr)
assert len(chunks) >= 3, chunks
assert chunks[0][0] < took - 1.5, (chunks, took)
raises(
    CommandExitException,
    lambda: sbx.commands.run("echo bad >&2; exit 7"),
    lambda e: e.exit_code == 7 and e.stderr == "bad\n",
)
log("commands ok")

# background command + stdin + kill; close_stdin; connect to a running command. (The sync SDK delivers a
# background command's output while the handle is iterated or waited for.)
cat = sbx.commands.run("cat", background=True, stdin=True)
sbx.commands.send_stdin(cat.pid, "ping\n")
echoed = ""
for stdout, _, _ in cat:
    echoed += stdout or ""
    if "ping\n" in echoed:
        break
procs = sbx.commands.list()
listed = [p for p in procs if p.pid == cat.pid]
assert listed and listed[0].cmd == "/bin/bash" and listed[0].args == ["-l", "-c", "cat"], procs
assert sbx.commands.kill(cat.pid) is True
raises(CommandExitException, cat.wait, lambda e: e.exit_code == -1)
assert sbx.commands.kill(cat.pid) is False
wc = sbx.commands.run("wc -c", background=True, stdin=True)
sbx.commands.send_stdin(wc.pid, "abcd")
sbx.commands.close_stdin(wc.pid)
assert wc.wait().stdout.strip() == "4"
ticker = sbx.commands.run("i=0; while true; do i=$((i+1)); echo tick$i; sleep 0.3; done", background=True)
ticker.disconnect()
attached = sbx.commands.connect(ticker.pid)
seen = []
for stdout, _, _ in attached:
    if stdout:
        seen.append(stdout)
    if any("tick" in s for s in seen):
        break
assert attached.kill() is True
log("background ok")

# files: write, read, list, rename, remove, watch (the Python SDK polls a watcher)
sbx.files.make_dir("/root/watched")
watch = sbx.files.watch_dir("/root/watched")
w = sbx.files.write("notes.txt", "some notes")
assert w.path == "/root/notes.txt", w
assert sbx.files.read("/root/notes.txt") == "some notes"
data = bytes(range(256))
sbx.files.write("/root/deep/er/bytes.bin", data)
assert sbx.files.read("/root/deep/er/bytes.bin", format="bytes") == data
big = os.urandom(3 * 1024 * 1024)
sbx.files.write("/root/big.bin", io.BytesIO(big))  # a file-like body goes as application/octet-stream
assert sbx.files.read("/root/big.bin", format="bytes") == big
assert sbx.files.get_info("/root/big.bin").size == len(big)
assert sbx.files.make_dir("/root/dir/sub") is True
assert sbx.files.make_dir("/root/dir/sub") is False
names = [e.name for e in sbx.files.list("/root")]
for n in ["notes.txt", "deep", "dir", "watched"]:
    assert n in names, (n, names)
assert [e.path for e in sbx.files.list("/root/dir", depth=2)] == ["/root/dir/sub"]
moved = sbx.files.rename("/root/notes.txt", "/root/moved/notes.txt")
assert moved.path == "/root/moved/notes.txt"
assert sbx.files.exists("/root/notes.txt") is False
st = sbx.files.get_info("/root/moved/notes.txt")
assert st.size == 10 and st.type == FileType.FILE, st
sbx.files.remove("/root/moved")
assert sbx.files.exists("/root/moved/notes.txt") is False
raises(FileNotFoundException, lambda: sbx.files.read("/root/nope.txt"))
sbx.files.write("/root/watched/seen.txt", "x")
sbx.files.rename("/root/watched/seen.txt", "/root/watched/renamed.txt")
sbx.files.remove("/root/watched/renamed.txt")
events = []


def polled():
    events.extend(f"{e.type.value}:{e.name}" for e in watch.get_new_events())
    return "remove:renamed.txt" in events


wait_for("watch events", polled)
watch.stop()
for e in ["create:seen.txt", "rename:seen.txt", "create:renamed.txt", "remove:renamed.txt"]:
    assert e in events, (e, events)
assert not any(".hearth-" in e for e in events), events
log("files ok")

# set_timeout
sbx.set_timeout(900)
left = sbx.get_info().end_at.timestamp() - time.time()
assert 850 < left < 950, left

# snapshots and forks: children continue the sandbox's state
snap = sbx.create_snapshot()
assert snap.snapshot_id.startswith("snp_"), snap
assert snap.snapshot_id in [s.snapshot_id for s in sbx.list_snapshots().next_items()]
child = Sandbox.create(snap.snapshot_id, timeout=120)
assert child.files.read("/root/deep/er/bytes.bin", format="bytes") == data
assert child.kill() is True
forks = sbx.fork(count=1)
assert len(forks) == 1 and isinstance(forks[0], Sandbox), forks
assert forks[0].files.read("/root/deep/er/bytes.bin", format="bytes") == data
assert forks[0].kill() is True
assert Sandbox.delete_snapshot(snap.snapshot_id) is True
log("snapshot/fork ok")

# pause, then connect resumes it with its state intact
sleeper = sbx.commands.run("sleep 1000", background=True)
sleeper.disconnect()
sbx.files.write("/root/before-pause.txt", "kept")
assert sbx.pause() is True
assert sbx.get_info().state == SandboxState.PAUSED
assert sbx.is_running() is False
paused = Sandbox.list(query=SandboxQuery(metadata={"suite": SUITE}, state=[SandboxState.PAUSED])).next_items()
assert [s.sandbox_id for s in paused] == [sbx.sandbox_id], paused
same = Sandbox.connect(sbx.sandbox_id)
assert same.get_info().state == SandboxState.RUNNING
assert same.is_running() is True
assert same.files.read("/root/before-pause.txt") == "kept"
after = same.commands.list()
assert any(p.pid == sleeper.pid and "sleep 1000" in p.args for p in after), after
log("pause/connect ok")

# list
running = Sandbox.list(query=SandboxQuery(metadata={"suite": SUITE})).next_items()
assert [(s.sandbox_id, s.state) for s in running] == [(sbx.sandbox_id, SandboxState.RUNNING)], running

# kill; an unknown sandbox is the SDK's not-found error
assert same.kill() is True
raises(SandboxNotFoundException, lambda: Sandbox.get_info(sbx.sandbox_id))
assert Sandbox.kill(sbx.sandbox_id) is False
raises(SandboxNotFoundException, lambda: Sandbox.connect(sbx.sandbox_id))
assert sbx.is_running() is False
log("kill ok")

# the asyncio flavour: its own transport, streamed watches (where the sync SDK polls), callbacks for background
# output


async def async_flow():
    a = await AsyncSandbox.create(TEMPLATE, timeout=300)
    out = []
    r = await a.commands.run("echo a; sleep 1; echo b", on_stdout=out.append)
    assert r.exit_code == 0 and out == ["a\n", "b\n"], (r, out)
    bg = []
    h = await a.commands.run("cat", background=True, stdin=True, on_stdout=bg.append)
    await a.commands.send_stdin(h.pid, "x\n")
    for _ in range(200):
        if bg:
            break
        await asyncio.sleep(0.1)
    assert bg == ["x\n"], bg
    assert await h.kill() is True
    events = []
    await a.files.make_dir("/root/w")
    w = await a.files.watch_dir("/root/w", on_event=lambda e: events.append(f"{e.type.value}:{e.name}"))
    await a.files.write("/root/w/f", "1")
    for _ in range(200):
        if "write:f" in events:
            break
        await asyncio.sleep(0.1)
    await w.stop()
    assert "create:f" in events and "write:f" in events, events
    try:
        await a.commands.run("exit 4")
        raise AssertionError("expected CommandExitException")
    except CommandExitException as e:
        assert e.exit_code == 4
    assert await a.kill() is True


asyncio.run(async_flow())
log("async ok")

# a template with bash runs commands with bash (minimal has only busybox sh)
bash_template = os.environ.get("HEARTH_E2B_BASH_TEMPLATE")
if bash_template:
    deb = Sandbox.create(bash_template, timeout=300)
    v = deb.commands.run('echo "bash=$BASH_VERSION"')
    assert v.stdout.startswith("bash=") and v.stdout[5:6].isdigit(), v.stdout
    deb.kill()
    log("bash ok")
log("ok")
