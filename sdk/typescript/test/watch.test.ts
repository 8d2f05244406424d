// `files.watchDir` against a real daemon and a real VM: events in order, recursive watches, stop(), signals,
// errors, and the end of a watch whose directory is removed.

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { type FilesystemEvent, NotFoundError, Sandbox } from "@hearth/sdk";

import { type Daemon, startDaemon } from "./daemon.js";

let daemon: Daemon;
let sbx: Sandbox;

before(async () => {
  daemon = await startDaemon();
  sbx = await Sandbox.create({ url: daemon.url, apiKey: daemon.apiKey });
});

after(async () => {
  if (!daemon) return;
  assert.deepEqual(await daemon.stop(), [], "VMM processes outlived the daemon");
});

/** Resolves once `pred` holds for the events collected so far (rejects after 30 s, showing them). */
function until(events: FilesystemEvent[], pred: (e: FilesystemEvent[]) => boolean): Promise<void> {
  return new Promise((resolve, reject) => {
    const start = Date.now();
    const tick = () => {
      if (pred(events)) return resolve();
      if (Date.now() - start > 30_000) return reject(new Error(`timed out; events: ${JSON.stringify(events)}`));
      setTimeout(tick, 50);
    };
    tick();
  });
}

/** `type name[->newName]`, chmods dropped, repeated writes coalesced. */
function summary(events: FilesystemEvent[]): string[] {
  const out: string[] = [];
  for (const e of events) {
    if (e.type === "chmod") continue;
    const s = `${e.type} ${e.name}${e.newName ? `->${e.newName}` : ""}`;
    if (out.at(-1) !== s) out.push(s);
  }
  return out;
}

test("watchDir reports create, write, rename and remove in order, then stops", async () => {
  await sbx.files.makeDir("/srv/w");
  const events: FilesystemEvent[] = [];
  let exited: unknown = "not yet";
  const handle = await sbx.files.watchDir("/srv/w", (e) => void events.push(e), {
    onExit: (err) => (exited = err),
  });
  await sbx.commands.run("cd /srv/w && echo one > a.txt && sleep 0.2 && echo two >> a.txt && mv a.txt b.txt && rm b.txt");
  await until(events, (e) => e.some((x) => x.type === "remove"));
  assert.deepEqual(summary(events), ["create a.txt", "write a.txt", "rename a.txt->b.txt", "remove b.txt"]);
  await handle.stop();
  assert.equal(exited, undefined);
  await handle.done;
  // Nothing arrives after stop().
  const seen = events.length;
  await sbx.files.write("/srv/w/late.txt", "x");
  await new Promise((r) => setTimeout(r, 500));
  assert.equal(events.length, seen);
});

test("recursive watches cover new subdirectories; removing the directory ends the watch", async () => {
  await sbx.files.makeDir("/srv/r/old");
  const events: FilesystemEvent[] = [];
  const handle = await sbx.files.watchDir("/srv/r", (e) => void events.push(e), { recursive: true });
  await sbx.commands.run("cd /srv/r && echo 1 > old/f1 && mkdir sub && sleep 0.3 && echo 2 > sub/f2");
  await until(events, (e) => e.some((x) => x.name === "sub/f2" && x.type === "write"));
  const s = summary(events);
  for (const want of ["create old/f1", "create sub", "create sub/f2"]) assert.ok(s.includes(want), `${want}: ${s}`);
  assert.ok(events.find((e) => e.name === "sub")?.isDir);
  await sbx.files.remove("/srv/r");
  await handle.done; // resolves: the directory is gone
});

test("a missing directory rejects with NotFoundError; an aborted signal ends the watch with its reason", async () => {
  await assert.rejects(sbx.files.watchDir("/srv/nope", () => undefined), NotFoundError);
  await sbx.files.makeDir("/srv/s");
  const ac = new AbortController();
  const handle = await sbx.files.watchDir("/srv/s", () => undefined, { signal: ac.signal });
  ac.abort(new Error("enough"));
  await assert.rejects(handle.done, /enough/);
});
