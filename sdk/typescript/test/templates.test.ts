// `Template` against a real daemon and real VMs: list, save a sandbox (with and without a `Sandbox` object),
// start sandboxes from it, build from a recipe (progress events; a failing step), delete.

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { ConflictError, HearthError, Sandbox, Template, type TemplateBuildEvent } from "@hearth/sdk";

import { type Daemon, startDaemon } from "./daemon.js";

let daemon: Daemon;

function conn() {
  return { url: daemon.url, apiKey: daemon.apiKey };
}

before(async () => {
  daemon = await startDaemon();
});

after(async () => {
  if (!daemon) return;
  assert.deepEqual(await daemon.stop(), [], "VMM processes outlived the daemon");
});

test("list shows the built-in templates", async () => {
  const all = await Template.list(conn());
  const minimal = all.find((t) => t.name === "minimal");
  assert.ok(minimal, JSON.stringify(all));
  assert.equal(minimal.builtin, true);
  assert.ok(minimal.sizeBytes > 0);
  await assert.rejects(Template.delete("minimal", conn()), ConflictError);
});

test("fromSandbox saves a sandbox's files; new sandboxes start from it; delete", async () => {
  const sbx = await Sandbox.create("minimal", conn());
  await sbx.files.write("/etc/hearth-sdk-template", "saved by the SDK test\n");
  // A `Sandbox` brings its own connection.
  const tpl = await Template.fromSandbox(sbx, { name: "sdk-saved" });
  assert.equal(tpl.name, "sdk-saved");
  assert.equal(tpl.builtin, false);
  assert.equal(tpl.fromSandbox, sbx.id);
  assert.equal(tpl.snapshotId, undefined);
  assert.ok(tpl.createdAt instanceof Date);
  assert.ok((await Template.list(conn())).some((t) => t.name === "sdk-saved"));
  assert.equal((await Template.get("sdk-saved", conn())).name, "sdk-saved");
  // The name is taken now.
  await assert.rejects(Template.fromSandbox(sbx.id, { ...conn(), name: "sdk-saved" }), ConflictError);
  await sbx.kill();

  const child = await Sandbox.create("sdk-saved", conn());
  assert.equal(await child.files.read("/etc/hearth-sdk-template"), "saved by the SDK test\n");
  await assert.rejects(Template.delete("sdk-saved", conn()), ConflictError); // in use
  await child.kill();
  assert.equal(await Template.delete("sdk-saved", conn()), true);
  assert.equal(await Template.delete("sdk-saved", conn()), false);
});

test("build runs a recipe with progress events; a failing step rejects with its output", async () => {
  const events: TemplateBuildEvent[] = [];
  const tpl = await Template.build(
    "sdk-built",
    { base: "minimal", steps: ["echo built-by-recipe > /etc/recipe", "echo step two"] },
    { ...conn(), onEvent: (e) => events.push(e) },
  );
  assert.equal(tpl.name, "sdk-built");
  const types = events.map((e) => e.type);
  assert.equal(types[0], "started");
  assert.equal(types.at(-1), "done");
  assert.ok(events.some((e) => e.type === "step_output" && e.line === "step two"), JSON.stringify(events));
  const sbx = await Sandbox.create("sdk-built", conn());
  assert.equal(await sbx.files.read("/etc/recipe"), "built-by-recipe\n");
  await sbx.kill();

  await assert.rejects(
    Template.build("sdk-broken", { base: "minimal", steps: ["echo about to fail; exit 3"] }, conn()),
    (err: unknown) => {
      assert.ok(err instanceof HearthError, String(err));
      assert.match(err.message, /about to fail/);
      return true;
    },
  );
  assert.ok(!(await Template.list(conn())).some((t) => t.name === "sdk-broken"));
});
