// `sbx.pty` against a real daemon and a real VM: output through onData, typed input echoed, `stty size` before
// and after a resize, Ctrl-C interrupting `sleep 100`, the exit code from `wait()`, `kill()`, and typed errors.
// Needs a WebSocket (the test script runs Node with --experimental-websocket on Node 20).

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { InvalidArgumentError, NotFoundError, type PtyHandle, Sandbox } from "@hearth/sdk";

import { type Daemon, startDaemon } from "./daemon.js";

let daemon: Daemon;
let sbx: Sandbox;

before(async () => {
  daemon = await startDaemon();
  sbx = await Sandbox.create({ url: daemon.url, apiKey: daemon.apiKey });
});

after(async () => {
  if (!daemon) return;
  const leftovers = await daemon.stop();
  assert.deepEqual(leftovers, [], "VMM processes outlived the daemon");
});

/** Collects a terminal's output and waits for text in it. */
class Screen {
  text = "";
  private waiters: (() => void)[] = [];

  onData = (data: Uint8Array): void => {
    this.text += new TextDecoder().decode(data);
    for (const w of this.waiters.splice(0)) w();
  };

  async waitFor(want: string, withinMs = 30_000): Promise<void> {
    const deadline = Date.now() + withinMs;
    while (!this.text.includes(want)) {
      const left = deadline - Date.now();
      if (left <= 0) assert.fail(`${JSON.stringify(want)} never appeared; output:\n${this.text}`);
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, left);
        this.waiters.push(() => {
          clearTimeout(timer);
          resolve();
        });
      });
    }
  }
}

test("an interactive shell: size, resize, echo, Ctrl-C and the exit code", async () => {
  const screen = new Screen();
  const term: PtyHandle = await sbx.pty.create({ cols: 80, rows: 24, onData: screen.onData });
  await term.sendInput("stty size; echo term=$TERM\n");
  await screen.waitFor("24 80");
  await screen.waitFor("term=xterm-256color");

  await term.resize({ cols: 120, rows: 40 });
  await term.sendInput(new TextEncoder().encode("stty size\n"));
  await screen.waitFor("40 120");

  await term.sendInput("echo 'ab''cd'\n");
  await screen.waitFor("echo 'ab''cd'");
  await screen.waitFor("\nabcd");

  await term.sendInput("sleep 100\n");
  await new Promise((r) => setTimeout(r, 1000));
  const started = Date.now();
  await term.sendInput("\x03");
  await term.sendInput("echo status=$?\n");
  await screen.waitFor("status=130");
  assert.ok(Date.now() - started < 15_000, "sleep 100 was not interrupted");

  await term.sendInput("exit 4\n");
  assert.equal(await term.wait(), 4);
  await assert.rejects(term.sendInput("late\n"), /closed/);
});

test("a command with cwd and env, and kill()", async () => {
  const screen = new Screen();
  const term = await sbx.pty.create({
    cols: 100,
    rows: 30,
    cmd: "echo $GREETING $(pwd); sleep 100",
    cwd: "/tmp",
    envs: { GREETING: "hello" },
    onData: screen.onData,
  });
  await screen.waitFor("hello /tmp");
  assert.equal(await term.kill(), true);
  assert.equal(await term.wait(), 137);
  assert.equal(await term.kill(), false);
});

test("errors are typed", async () => {
  const missing = await Sandbox.connect("sbx_00000000000000ff", { url: daemon.url, apiKey: daemon.apiKey }).catch(
    (e: unknown) => e,
  );
  assert.ok(missing instanceof NotFoundError, String(missing));
  await assert.rejects(
    sbx.pty.create({ cols: 0, rows: 24, onData: () => undefined }),
    (e: unknown) => e instanceof InvalidArgumentError,
  );
  // A terminal in a sandbox that is gone: the REST answer explains the refused WebSocket.
  const other = await Sandbox.create({ url: daemon.url, apiKey: daemon.apiKey });
  await other.kill();
  await assert.rejects(
    other.pty.create({ cols: 80, rows: 24, onData: () => undefined }),
    (e: unknown) => e instanceof NotFoundError,
  );
});
