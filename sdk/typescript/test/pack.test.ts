// The package as a user gets it: `npm pack` (of the dist/ built by `npm test`; `--ignore-scripts` so the
// prepack build does not rewrite dist/ under the other test files), install the tarball into an empty folder
// (its one dependency comes from the registry), and run a plain script from there against a real daemon.

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { type Daemon, PACKAGE_DIR, startDaemon } from "./daemon.js";

let daemon: Daemon;
const work = mkdtempSync(join(tmpdir(), "hearth-sdk-pack-"));

before(async () => {
  daemon = await startDaemon();
});

after(async () => {
  rmSync(work, { recursive: true, force: true });
  if (!daemon) return;
  assert.deepEqual(await daemon.stop(), [], "VMM processes outlived the daemon");
});

function sh(cmd: string, args: string[], cwd: string, env: NodeJS.ProcessEnv = process.env) {
  const r = spawnSync(cmd, args, { cwd, env, encoding: "utf8", timeout: 300_000 });
  assert.equal(r.status, 0, `${cmd} ${args.join(" ")} failed:\n${r.stdout}\n${r.stderr}`);
  return r.stdout;
}

test("npm pack, install the tarball into an empty project, run a script against the daemon", async () => {
  const tarballs = join(work, "tarballs");
  const project = join(work, "project");
  sh("mkdir", ["-p", tarballs, project], work);
  const packArgs = ["pack", "--json", "--ignore-scripts", "--pack-destination", tarballs];
  const packed = JSON.parse(sh("npm", packArgs, PACKAGE_DIR)) as {
    filename: string;
    files: { path: string }[];
  }[];
  const files = packed[0]!.files.map((f) => f.path).sort();
  for (const f of ["package.json", "README.md", "dist/index.js", "dist/index.d.ts", "dist/generated/openapi.d.ts"]) {
    assert.ok(files.includes(f), `${f} missing from the tarball: ${files.join(", ")}`);
  }
  assert.ok(!files.some((f) => f.startsWith("src/") || f.startsWith("test/")), "sources or tests were packed");
  const tgz = readdirSync(tarballs).find((f) => f.endsWith(".tgz"));
  assert.ok(tgz, "npm pack wrote no tarball");

  writeFileSync(join(project, "package.json"), JSON.stringify({ name: "pack-check", private: true, type: "module" }));
  sh("npm", ["install", "--no-audit", "--no-fund", join(tarballs, tgz)], project);
  const deps = readdirSync(join(project, "node_modules")).sort();
  assert.ok(deps.includes("openapi-fetch") && deps.includes("@hearth"), deps.join(", "));

  writeFileSync(
    join(project, "main.mjs"),
    [
      'import { Sandbox, NotFoundError } from "@hearth/sdk";',
      "const sbx = await Sandbox.create();",
      'const { stdout } = await sbx.commands.run("echo $((6 * 7))");',
      'await sbx.files.write("/tmp/x", new Uint8Array([0, 1, 2, 255]));',
      'const bytes = await sbx.files.read("/tmp/x", { format: "bytes" });',
      "console.log(stdout.trim(), Array.from(bytes).join(','), (await Sandbox.list()).length);",
      "await sbx.kill();",
      "console.log(await Sandbox.connect(sbx.id).catch((e) => e instanceof NotFoundError));",
      "",
    ].join("\n"),
  );
  const out = sh(process.execPath, ["main.mjs"], project, daemon.env);
  assert.equal(out, "42 0,1,2,255 1\ntrue\n");
});
