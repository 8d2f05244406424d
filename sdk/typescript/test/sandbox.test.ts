// The SDK against a real daemon and real VMs. One sandbox is shared by most tests (each boot takes ~10-15 s
// under TCG); a second one checks the create options and `Sandbox.kill(id)`.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  AuthenticationError,
  CommandExitError,
  ConflictError,
  type FetchProgress,
  HearthError,
  InvalidArgumentError,
  NotFoundError,
  Sandbox,
  TimeoutError,
} from "@hearth/sdk";

import { type Daemon, startDaemon } from "./daemon.js";

let daemon: Daemon;
let sbx: Sandbox;

function conn() {
  return { url: daemon.url, apiKey: daemon.apiKey };
}

/** Asserts that `promise` rejects with an `AbortError` within `withinMs`. */
async function rejectsAborted(promise: Promise<unknown>, withinMs: number): Promise<void> {
  const start = Date.now();
  await assert.rejects(promise, (err: unknown) => {
    assert.ok(err instanceof Error, `not an Error: ${String(err)}`);
    assert.equal(err.name, "AbortError");
    return true;
  });
  assert.ok(Date.now() - start < withinMs, `took ${Date.now() - start} ms to abort`);
}

before(async () => {
  daemon = await startDaemon();
  sbx = await Sandbox.create({ ...conn(), metadata: { suite: "sdk-ts" }, envs: { SBX_LEVEL: "sandbox" } });
});

after(async () => {
  if (!daemon) return;
  const leftovers = await daemon.stop();
  assert.deepEqual(leftovers, [], "VMM processes outlived the daemon");
});

describe("sandboxes", () => {
  test("create, getInfo and list with filters", async () => {
    assert.match(sbx.id, /\S/);
    assert.equal(sbx.sandboxId, sbx.id);
    const info = await sbx.getInfo();
    assert.equal(info.id, sbx.id);
    assert.equal(info.state, "running");
    assert.equal(info.template, "minimal");
    assert.deepEqual(info.metadata, { suite: "sdk-ts" });
    assert.ok(info.createdAt instanceof Date && !Number.isNaN(info.createdAt.getTime()));
    assert.ok(info.endAt > info.createdAt);
    assert.ok(await sbx.isRunning());

    const mine = await Sandbox.list({ ...conn(), metadata: { suite: "sdk-ts" } });
    assert.deepEqual(
      mine.map((s) => s.id),
      [sbx.id],
    );
    assert.deepEqual(await Sandbox.list({ ...conn(), metadata: { suite: "other" } }), []);
    const running = await Sandbox.list({ ...conn(), state: "running" });
    assert.ok(running.some((s) => s.id === sbx.id));
    assert.deepEqual(await Sandbox.list({ ...conn(), state: "failed" }), []);
  });

  test("configuration from HEARTH_URL and HEARTH_API_KEY", async () => {
    const saved = { url: process.env.HEARTH_URL, key: process.env.HEARTH_API_KEY };
    process.env.HEARTH_URL = daemon.url;
    process.env.HEARTH_API_KEY = daemon.apiKey;
    try {
      const again = await Sandbox.connect(sbx.id);
      assert.equal(again.url, daemon.url);
      const { stdout } = await again.commands.run("echo connected");
      assert.equal(stdout, "connected\n");
    } finally {
      if (saved.url === undefined) delete process.env.HEARTH_URL;
      else process.env.HEARTH_URL = saved.url;
      if (saved.key === undefined) delete process.env.HEARTH_API_KEY;
      else process.env.HEARTH_API_KEY = saved.key;
    }
  });

  test("setTimeout moves the end of the sandbox's life", async () => {
    const info = await sbx.setTimeout(600_000);
    const left = info.endAt.getTime() - Date.now();
    assert.ok(left > 590_000 && left <= 601_000, `end_at is ${left} ms away`);
    await assert.rejects(sbx.setTimeout(0), InvalidArgumentError);
  });

  test("typed errors: unknown sandbox, wrong key, invalid argument, unreachable daemon", async () => {
    await assert.rejects(Sandbox.connect("sbx_doesnotexist", conn()), (err: unknown) => {
      assert.ok(err instanceof NotFoundError);
      assert.ok(err instanceof HearthError);
      assert.equal(err.code, "not_found");
      assert.equal(err.status, 404);
      assert.match(err.message, /\S/);
      return true;
    });
    assert.equal(await Sandbox.kill("sbx_doesnotexist", conn()), false);
    await assert.rejects(Sandbox.list({ url: daemon.url, apiKey: "hk_wrong" }), (err: unknown) => {
      assert.ok(err instanceof AuthenticationError);
      assert.equal(err.code, "unauthorized");
      assert.equal(err.status, 401);
      return true;
    });
    const noKey = Sandbox.connect(sbx.id, { url: daemon.url, apiKey: "" });
    await assert.rejects(noKey, AuthenticationError);
    await assert.rejects(Sandbox.create({ ...conn(), vcpus: 64 }), (err: unknown) => {
      assert.ok(err instanceof InvalidArgumentError);
      assert.equal(err.code, "invalid_argument");
      assert.match(err.message, /vcpus/);
      return true;
    });
    await assert.rejects(Sandbox.list({ url: "http://127.0.0.1:1", apiKey: "x" }), (err: unknown) => {
      assert.ok(err instanceof HearthError);
      assert.equal(err.code, "unknown");
      assert.match(err.message, /cannot reach/);
      return true;
    });
  });
});

describe("commands", () => {
  test("run a shell line and an argv", async () => {
    const r = await sbx.commands.run("echo hello; echo world >&2");
    assert.equal(r.exitCode, 0);
    assert.equal(r.stdout, "hello\n");
    assert.equal(r.stderr, "world\n");
    const argv = await sbx.commands.run(["printf", "%s|", "a b", "$HOME"]);
    assert.equal(argv.stdout, "a b|$HOME|");
  });

  test("streamed output reaches onStdout/onStderr chunk by chunk", async () => {
    const chunks: { text: string; at: number }[] = [];
    const errs: string[] = [];
    const start = Date.now();
    const r = await sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 1; done; printf 'caf\\303\\251' >&2", {
      onStdout: (text) => chunks.push({ text, at: Date.now() - start }),
      onStderr: (text) => errs.push(text),
    });
    assert.equal(r.exitCode, 0);
    assert.equal(chunks.map((c) => c.text).join(""), "line1\nline2\nline3\n");
    assert.equal(r.stdout, "line1\nline2\nline3\n");
    assert.equal(errs.join(""), "café");
    assert.equal(r.stderr, "café");
    assert.ok(chunks.length >= 2, `expected several chunks, got ${JSON.stringify(chunks)}`);
    const done = Date.now() - start;
    // The first line arrived while the command was still sleeping, not at the end.
    assert.ok(chunks[0]!.at < done - 1500, `first chunk at ${chunks[0]!.at} ms, command done at ${done} ms`);
  });

  test("non-zero exit throws CommandExitError, buffered and streamed", async () => {
    for (const stream of [false, true]) {
      const seen: string[] = [];
      const opts = stream ? { onStdout: (t: string) => seen.push(t) } : {};
      await assert.rejects(sbx.commands.run("echo out; echo bad >&2; exit 3", opts), (err: unknown) => {
        assert.ok(err instanceof CommandExitError, String(err));
        assert.ok(err instanceof HearthError);
        assert.equal(err.exitCode, 3);
        assert.equal(err.stdout, "out\n");
        assert.equal(err.stderr, "bad\n");
        assert.equal(err.result.exitCode, 3);
        assert.match(err.message, /code 3: bad/);
        return true;
      });
      if (stream) assert.equal(seen.join(""), "out\n");
    }
  });

  test("stdin, envs and cwd", async () => {
    assert.equal((await sbx.commands.run("cat; echo", { stdin: "from stdin" })).stdout, "from stdin\n");
    const r = await sbx.commands.run('echo "$FOO $SBX_LEVEL"; pwd', { envs: { FOO: "bar baz" }, cwd: "/tmp" });
    assert.equal(r.stdout, "bar baz sandbox\n/tmp\n");
  });

  test("timeoutMs kills the command and throws TimeoutError", async () => {
    const start = Date.now();
    await assert.rejects(sbx.commands.run("sleep 20", { timeoutMs: 1000 }), TimeoutError);
    assert.ok(Date.now() - start < 10_000);
  });

  test("background: pid, list, sendStdin, wait, kill", async () => {
    const h = await sbx.commands.run("read x; echo got $x; exit 4", { background: true });
    assert.ok(Number.isInteger(h.pid) && h.pid > 0);
    const listed = await sbx.commands.list();
    const mine = listed.find((p) => p.pid === h.pid);
    assert.ok(mine, `pid ${h.pid} not in ${JSON.stringify(listed)}`);
    assert.equal(mine.background, true);
    assert.match(mine.cmd, /read x/);
    await h.sendStdin("abc\n", { eof: true });
    await assert.rejects(h.wait(), (err: unknown) => {
      assert.ok(err instanceof CommandExitError);
      assert.equal(err.exitCode, 4);
      assert.equal(err.stdout, "got abc\n");
      return true;
    });

    const ok = await sbx.commands.run("echo fine", { background: true });
    assert.equal((await ok.wait()).stdout, "fine\n");

    const sleeper = await sbx.commands.run("sleep 300", { background: true });
    await assert.rejects(sleeper.wait({ timeoutMs: 1000 }), TimeoutError);
    assert.equal(await sleeper.kill(), true);
    await assert.rejects(sleeper.wait(), (err: unknown) => {
      assert.ok(err instanceof CommandExitError);
      assert.equal(err.signal, 9);
      assert.equal(err.exitCode, 137);
      return true;
    });
    assert.equal(await sbx.commands.kill(999_999), false);
    await assert.rejects(
      sbx.commands.run("true", { background: true, onStdout: () => undefined }),
      InvalidArgumentError,
    );
  });

  test("AbortSignal cancels commands and kills them in the guest; requestTimeoutMs gives TimeoutError", async () => {
    const ac = new AbortController();
    setTimeout(() => ac.abort(), 500);
    await rejectsAborted(sbx.commands.run("sleep 31", { signal: ac.signal }), 5000);

    const ac2 = new AbortController();
    const seen: string[] = [];
    const streamed = sbx.commands.run("echo first; sleep 32", {
      signal: ac2.signal,
      onStdout: (t) => {
        seen.push(t);
        ac2.abort();
      },
    });
    await rejectsAborted(streamed, 15_000);
    assert.deepEqual(seen, ["first\n"]);

    await rejectsAborted(sbx.getInfo({ signal: AbortSignal.abort() }), 1000);
    await assert.rejects(sbx.commands.run("sleep 33", { requestTimeoutMs: 500 }), TimeoutError);

    // The cancelled commands do not keep running in the guest.
    const deadline = Date.now() + 10_000;
    let left = "";
    do {
      const ps = await sbx.commands.run("ps -o args");
      left = ps.stdout
        .split("\n")
        .filter((l) => /^sleep 3[123]$/.test(l.trim()))
        .join(", ");
      if (!left) break;
      await new Promise((r) => setTimeout(r, 200));
    } while (Date.now() < deadline);
    assert.equal(left, "", "cancelled commands still run");
    const listed = await sbx.commands.list();
    for (const p of listed.filter((p) => /^sleep 3[123]$/.test(p.cmd))) {
      // Killed by a signal: the SDK's SIGKILL, or the daemon's own clean-up of an abandoned command.
      assert.ok(p.exitCode !== undefined && p.exitCode > 128, `${p.cmd} was not killed: ${JSON.stringify(p)}`);
    }
  });
});

describe("files", () => {
  test("write and read text, bytes and streams", async () => {
    const info = await sbx.files.write("/tmp/sdk/nested/hello.txt", "héllo\n");
    assert.equal(info.path, "/tmp/sdk/nested/hello.txt");
    assert.equal(info.name, "hello.txt");
    assert.equal(info.type, "file");
    assert.equal(info.size, 7);
    assert.equal(await sbx.files.read("/tmp/sdk/nested/hello.txt"), "héllo\n");
    assert.equal((await sbx.commands.run("cat /tmp/sdk/nested/hello.txt")).stdout, "héllo\n");

    const bytes = new Uint8Array(256 * 1024);
    for (let i = 0; i < bytes.length; i++) bytes[i] = (i * 7 + (i >> 8)) & 0xff;
    await sbx.files.write("/tmp/sdk/blob.bin", bytes);
    const back = await sbx.files.read("/tmp/sdk/blob.bin", { format: "bytes" });
    assert.ok(back instanceof Uint8Array);
    assert.equal(back.length, bytes.length);
    assert.ok(Buffer.from(back).equals(Buffer.from(bytes)), "binary round trip differs");
    const sum = (await sbx.commands.run("sha256sum /tmp/sdk/blob.bin")).stdout.split(" ")[0];
    const { createHash } = await import("node:crypto");
    assert.equal(sum, createHash("sha256").update(bytes).digest("hex"));

    const stream = await sbx.files.read("/tmp/sdk/blob.bin", { format: "stream" });
    let total = 0;
    for await (const chunk of stream) total += chunk.length;
    assert.equal(total, bytes.length);

    const upload = new ReadableStream<Uint8Array>({
      start(c) {
        c.enqueue(new TextEncoder().encode("streamed "));
        c.enqueue(new TextEncoder().encode("upload"));
        c.close();
      },
    });
    await sbx.files.write("/tmp/sdk/streamed.txt", upload);
    assert.equal(await sbx.files.read("/tmp/sdk/streamed.txt"), "streamed upload");

    await sbx.files.write("/tmp/sdk/empty", "");
    assert.equal(await sbx.files.read("/tmp/sdk/empty"), "");
    assert.equal((await sbx.files.read("/tmp/sdk/empty", { format: "bytes" })).length, 0);
  });

  test("write many, list, exists, getInfo, makeDir, rename, remove", async () => {
    const written = await sbx.files.write([
      { path: "/tmp/many/a.txt", data: "A" },
      { path: "/tmp/many/b.txt", data: new TextEncoder().encode("BB") },
      { path: "/tmp/many/sub/c.txt", data: new Blob(["CCC"]) },
    ]);
    assert.deepEqual(
      written.map((w) => [w.path, w.size]),
      [
        ["/tmp/many/a.txt", 1],
        ["/tmp/many/b.txt", 2],
        ["/tmp/many/sub/c.txt", 3],
      ],
    );
    const entries = await sbx.files.list("/tmp/many");
    assert.deepEqual(
      entries.map((e) => [e.name, e.type]),
      [
        ["a.txt", "file"],
        ["b.txt", "file"],
        ["sub", "dir"],
      ],
    );
    assert.equal(await sbx.files.exists("/tmp/many/a.txt"), true);
    assert.equal(await sbx.files.exists("/tmp/many/nope"), false);
    const info = await sbx.files.getInfo("/tmp/many/sub");
    assert.equal(info.type, "dir");
    assert.ok(Math.abs(info.modifiedTime.getTime() - Date.now()) < 10 * 60_000, "mtime is not recent");

    assert.equal(await sbx.files.makeDir("/tmp/made/deep/er"), true);
    assert.equal(await sbx.files.makeDir("/tmp/made/deep/er"), false);
    assert.equal((await sbx.files.getInfo("/tmp/made/deep/er")).type, "dir");

    const moved = await sbx.files.rename("/tmp/many/a.txt", "/tmp/made/a-moved.txt");
    assert.equal(moved.path, "/tmp/made/a-moved.txt");
    assert.equal(moved.size, 1);
    assert.equal(await sbx.files.exists("/tmp/many/a.txt"), false);
    assert.equal(await sbx.files.read("/tmp/made/a-moved.txt"), "A");

    await sbx.files.remove("/tmp/made/a-moved.txt");
    assert.equal(await sbx.files.exists("/tmp/made/a-moved.txt"), false);
    await assert.rejects(sbx.files.remove("/tmp/many", { recursive: false }));
    await sbx.files.remove("/tmp/many");
    assert.equal(await sbx.files.exists("/tmp/many"), false);
    assert.equal((await sbx.commands.run("ls /tmp/many 2>&1 || true")).stdout.includes("No such file"), true);
  });

  test("missing files give NotFoundError", async () => {
    await assert.rejects(sbx.files.read("/tmp/does/not/exist"), NotFoundError);
    await assert.rejects(sbx.files.getInfo("/tmp/does/not/exist"), NotFoundError);
    await assert.rejects(sbx.files.list("/tmp/does/not/exist"), NotFoundError);
  });
});

describe("pause and resume", () => {
  test("pause to zero, Sandbox.connect resumes with processes and files kept; calls auto-resume", async () => {
    const h = await sbx.commands.run("sleep 1000", { background: true });
    await sbx.files.write("/root/state.txt", "kept across pause");
    const paused = await sbx.pause();
    assert.equal(paused.state, "paused");
    assert.equal((await sbx.getInfo()).state, "paused");
    assert.deepEqual(
      (await Sandbox.list({ ...conn(), state: "paused" })).map((s) => s.id),
      [sbx.id],
    );

    const again = await Sandbox.connect(sbx.id, conn());
    assert.equal((await again.getInfo()).state, "running");
    assert.equal(await again.files.read("/root/state.txt"), "kept across pause");
    const proc = (await again.commands.list()).find((p) => p.pid === h.pid);
    assert.ok(proc && proc.exitCode === undefined, `background process lost: ${JSON.stringify(proc)}`);

    // With autoResume (the default), a command on a paused sandbox resumes it.
    await sbx.pause();
    assert.equal((await sbx.commands.run("echo back")).stdout, "back\n");
    assert.equal((await sbx.getInfo()).state, "running");
    assert.equal(await h.kill(), true);

    const usage = await sbx.getUsage();
    assert.ok(usage.runningSeconds > 1, JSON.stringify(usage));
    assert.ok(usage.pausedSeconds > 0, JSON.stringify(usage));
    assert.ok(usage.vcpuSeconds >= usage.runningSeconds);
    assert.ok(usage.mibSeconds > usage.runningSeconds);
  });
});

describe("a second sandbox", () => {
  test("create options, lifecycle without auto-resume, isolation, Sandbox.kill(id)", async () => {
    // With `onFetch` the create and the resume below follow the daemon's event stream (this daemon has no
    // storage bucket, so nothing is fetched: the stream carries only the result).
    const fetches: FetchProgress[] = [];
    const other = await Sandbox.create("minimal", {
      ...conn(),
      vcpus: 2,
      memoryMib: 256,
      timeoutMs: 120_000,
      lifecycle: { onTimeout: "pause", autoResume: false },
      onFetch: (p) => fetches.push(p),
    });
    try {
      const info = await other.getInfo();
      assert.equal(info.vcpus, 2);
      assert.equal(info.memoryMib, 256);
      assert.equal(info.onTimeout, "pause");
      assert.equal(info.autoResume, false);
      const cpus = await other.commands.run("grep -c ^processor /proc/cpuinfo");
      assert.equal(cpus.stdout.trim(), "2");
      const mem = await other.commands.run("awk '/MemTotal/ {print $2}' /proc/meminfo");
      const kib = Number(mem.stdout.trim());
      assert.ok(kib > 150 * 1024 && kib <= 256 * 1024, `MemTotal ${kib} kB`);
      // Sandboxes are isolated: the other one does not see this one's files.
      await sbx.files.write("/tmp/only-here", "x");
      assert.equal(await other.files.exists("/tmp/only-here"), false);

      // Without auto-resume, a paused sandbox refuses guest calls until it is resumed.
      await other.pause();
      await assert.rejects(other.commands.run("true"), ConflictError);
      const still = await Sandbox.connect(other.id, { ...conn(), resume: false });
      assert.equal((await still.getInfo()).state, "paused");
      assert.equal((await other.resume({ onFetch: (p) => fetches.push(p) })).state, "running");
      assert.equal((await other.commands.run("echo resumed")).stdout, "resumed\n");
      assert.equal(fetches.length, 0, JSON.stringify(fetches));
    } finally {
      assert.equal(await Sandbox.kill(other.id, conn()), true);
    }
    assert.equal(await Sandbox.kill(other.id, conn()), false);
    // A streamed resume that fails before anything was fetched rejects with the usual typed error.
    await assert.rejects(other.resume({ onFetch: (p) => fetches.push(p) }), NotFoundError);
    const gone = await Sandbox.connect(other.id, conn()).catch((e: unknown) => e);
    assert.ok(gone instanceof NotFoundError);
  });
});

describe("fork and snapshots", () => {
  test("fork continues memory and files; a snapshot starts new sandboxes; deleteSnapshot", async () => {
    await sbx.files.write("/root/lineage.txt", "from the parent");
    // A shell variable lives only in the memory of this background process: a fork must carry it over.
    const holder = await sbx.commands.run("secret=$((RANDOM + 1)); echo $secret > /tmp/secret; sleep 1000", {
      background: true,
    });
    await sbx.commands.run("while [ ! -s /tmp/secret ]; do sleep 0.1; done");

    const [child, ...more] = await sbx.fork({ count: 1 });
    assert.ok(child);
    assert.equal(more.length, 0);
    try {
      const info = await child.getInfo();
      assert.equal(info.state, "running");
      assert.equal(info.parentId, sbx.id);
      assert.notEqual(child.id, sbx.id);
      assert.equal(await child.files.read("/root/lineage.txt"), "from the parent");
      const inChild = (await child.commands.list()).find((p) => p.pid === holder.pid);
      assert.ok(inChild && inChild.exitCode === undefined, "the parent's process does not run in the child");
      // The child is its own machine from now on.
      await child.files.write("/root/lineage.txt", "changed in the child");
      assert.equal(await sbx.files.read("/root/lineage.txt"), "from the parent");
      assert.equal((await sbx.getInfo()).state, "running");
    } finally {
      assert.equal(await child.kill(), true);
    }

    const snap = await sbx.createSnapshot();
    assert.match(snap.id, /\S/);
    assert.equal(snap.sandboxId, sbx.id);
    assert.equal(snap.template, "minimal");
    assert.ok(snap.sizeBytes > 0);
    assert.ok((await Sandbox.listSnapshots(conn())).some((s) => s.id === snap.id));
    assert.equal((await sbx.commands.run("echo still here")).stdout, "still here\n");

    const restored = await Sandbox.create({ ...conn(), snapshot: snap.id });
    try {
      assert.equal((await restored.getInfo()).snapshotId, snap.id);
      assert.equal(await restored.files.read("/root/lineage.txt"), "from the parent");
      assert.equal(await restored.files.read("/tmp/secret"), await sbx.files.read("/tmp/secret"));
      await assert.rejects(Sandbox.deleteSnapshot(snap.id, conn()), ConflictError);
    } finally {
      assert.equal(await restored.kill(), true);
    }
    assert.equal(await Sandbox.deleteSnapshot(snap.id, conn()), true);
    assert.equal(await Sandbox.deleteSnapshot(snap.id, conn()), false);
    assert.equal(await holder.kill(), true);
  });
});

describe("kill", () => {
  test("sbx.kill destroys the sandbox", async () => {
    assert.equal(await sbx.kill(), true);
    assert.equal(await sbx.isRunning(), false);
    await assert.rejects(sbx.getInfo(), NotFoundError);
    await assert.rejects(sbx.commands.run("true"), NotFoundError);
    await assert.rejects(sbx.files.exists("/tmp"), NotFoundError);
    assert.equal(await sbx.kill(), false);
    assert.deepEqual(await Sandbox.list(conn()), []);
  });
});
