// The ```ts test examples of docs/sdk.md: each is a whole program, stripped of its types and run with Node
// against a real daemon (configured only through HEARTH_URL / HEARTH_API_KEY, like a user's program). The
// ```text output block after an example lists lines it must print, in order.

import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";

import ts from "typescript";

import { type Daemon, PACKAGE_DIR, startDaemon } from "./daemon.js";

interface Example {
  line: number;
  source: string;
  expect: string[];
}

/** The ```ts test blocks of a markdown page, each with the lines of the ```text output block after it. */
export function examples(markdown: string): Example[] {
  const lines = markdown.split("\n");
  const out: Example[] = [];
  const fence = (i: number): [string, number] => {
    let j = i + 1;
    const body: string[] = [];
    while (j < lines.length && lines[j]!.trimEnd() !== "```") body.push(lines[j++]!);
    assert.ok(j < lines.length, `unclosed fence at line ${i + 1}`);
    return [body.join("\n") + "\n", j + 1];
  };
  for (let i = 0; i < lines.length; ) {
    const l = lines[i]!.trimEnd();
    if (l === "```ts test") {
      const [source, next] = fence(i);
      out.push({ line: i + 1, source, expect: [] });
      i = next;
    } else if (l === "```text output") {
      const [body, next] = fence(i);
      const last = out.at(-1);
      assert.ok(last, `output block at line ${i + 1} follows no example`);
      last.expect = body.split("\n").filter((s) => s !== "");
      i = next;
    } else i++;
  }
  return out;
}

const page = readFileSync(join(PACKAGE_DIR, "../../docs/sdk.md"), "utf8");
const found = examples(page);
let daemon: Daemon;

before(async () => {
  // Sandbox networking on (with a range of its own): the page's Networks section needs it.
  daemon = await startDaemon({ sandboxNet: "10.213.73.0/24" });
});

after(async () => {
  if (!daemon) return;
  assert.deepEqual(await daemon.stop(), [], "VMM processes outlived the daemon");
});

function run(script: string, env: NodeJS.ProcessEnv): Promise<{ code: number | null; out: string; err: string }> {
  return new Promise((resolve, reject) => {
    // The flag gives Node 20 its global WebSocket (sbx.pty); later versions have it anyway.
    const child = spawn(process.execPath, ["--experimental-websocket", script], { cwd: PACKAGE_DIR, env });
    let out = "";
    let err = "";
    child.stdout.on("data", (d: Buffer) => (out += d.toString()));
    child.stderr.on("data", (d: Buffer) => (err += d.toString()));
    child.on("error", reject);
    child.on("close", (code) => resolve({ code, out, err }));
  });
}

test("the page's examples are found with their output", () => {
  assert.ok(found.length >= 4, `only ${found.length} examples`);
  for (const ex of found) assert.ok(ex.expect.length > 0, `the example at line ${ex.line} has no output block`);
  const parsed = examples("```ts test\nconsole.log(1);\n```\n\n```text output\n1\n```\n```ts\nnot run\n```\n");
  assert.deepEqual(parsed, [{ line: 1, source: "console.log(1);\n", expect: ["1"] }]);
});

test("the page's examples type-check against the SDK's declarations", () => {
  const dir = join(PACKAGE_DIR, ".test-build/docs-src");
  rmSync(dir, { recursive: true, force: true });
  mkdirSync(dir, { recursive: true });
  const files = found.map((ex) => {
    const file = join(dir, `sdk-md-line-${ex.line}.ts`);
    writeFileSync(file, ex.source);
    return file;
  });
  const tsc = join(PACKAGE_DIR, "node_modules/typescript/bin/tsc");
  const flags = ["--noEmit", "--strict", "--module", "nodenext", "--moduleResolution", "nodenext"];
  const r = spawnSync(process.execPath, [tsc, ...flags, "--target", "es2022", "--types", "node", ...files], {
    cwd: PACKAGE_DIR,
    encoding: "utf8",
  });
  assert.equal(r.status, 0, `tsc:\n${r.stdout}${r.stderr}`);
});

for (const ex of found) {
  test(`docs/sdk.md example at line ${ex.line}`, async () => {
    // Inside the package, so `@hearth/sdk` resolves to it (a package can import itself by name).
    const dir = join(PACKAGE_DIR, ".test-build/docs");
    mkdirSync(dir, { recursive: true });
    const file = join(dir, `sdk-md-line-${ex.line}.mjs`);
    const js = ts.transpileModule(ex.source, {
      compilerOptions: { module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022 },
      reportDiagnostics: true,
    });
    assert.deepEqual(js.diagnostics ?? [], [], "the example does not parse");
    writeFileSync(file, js.outputText);
    const { code, out, err } = await run(file, daemon.env);
    assert.equal(code, 0, `the example at line ${ex.line} failed:\n${out}\n${err}`);
    const printed = out.split("\n");
    let at = 0;
    for (const want of ex.expect) {
      const p = printed.slice(at).findIndex((l) => l.trimEnd() === want);
      assert.ok(p >= 0, `the example at line ${ex.line} did not print ${JSON.stringify(want)} in order:\n${out}`);
      at += p + 1;
    }
  });
}
