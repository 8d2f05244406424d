// The README's examples: every file under examples/ appears verbatim in README.md, and runs against a real
// daemon (configured only through HEARTH_URL / HEARTH_API_KEY, like a user's program) with the output shown.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { type Daemon, PACKAGE_DIR } from "./daemon.js";
import { startDaemon } from "./daemon.js";

/** What each example must print (in order, as whole lines). */
const EXPECTED: Record<string, string[]> = {
  "quickstart.ts": [
    "kernel: Linux",
    "tick 1",
    "tick 2",
    "tick 3",
    "read back: hello from the host; directory holds hello.txt",
  ],
  "errors-and-background.ts": [
    'exit 1, stdout "hi\\n"',
    /^pid \d+ said: hello world$/.source,
    "cancelled: AbortError",
    "missing: true",
  ],
  "pause-resume.ts": [
    "state: paused",
    "state: running",
    "notes: work in progress",
    "counter still running: true",
    "paused for more than 0 s: true",
  ],
};

let daemon: Daemon;

before(async () => {
  daemon = await startDaemon();
});

after(async () => {
  if (!daemon) return;
  assert.deepEqual(await daemon.stop(), [], "VMM processes outlived the daemon");
});

function run(script: string, env: NodeJS.ProcessEnv): Promise<{ code: number | null; out: string; err: string }> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [script], { cwd: PACKAGE_DIR, env });
    let out = "";
    let err = "";
    child.stdout.on("data", (d: Buffer) => (out += d.toString()));
    child.stderr.on("data", (d: Buffer) => (err += d.toString()));
    child.on("error", reject);
    child.on("close", (code) => resolve({ code, out, err }));
  });
}

const readme = readFileSync(join(PACKAGE_DIR, "README.md"), "utf8");
const examples = readdirSync(join(PACKAGE_DIR, "examples")).filter((f) => f.endsWith(".ts"));

test("every example is covered here", () => {
  assert.deepEqual(examples.sort(), Object.keys(EXPECTED).sort());
});

for (const file of examples) {
  test(`README example ${file}`, async () => {
    const source = readFileSync(join(PACKAGE_DIR, "examples", file), "utf8");
    assert.ok(readme.includes("```ts\n" + source + "```\n"), `README.md does not include examples/${file} verbatim`);

    const compiled = join(PACKAGE_DIR, ".test-build/examples", file.replace(/\.ts$/, ".js"));
    const { code, out, err } = await run(compiled, daemon.env);
    assert.equal(code, 0, `examples/${file} failed:\n${out}\n${err}`);
    const lines = out.split("\n").filter((l) => l !== "");
    const want = EXPECTED[file]!;
    assert.equal(lines.length, want.length, `examples/${file} printed:\n${out}`);
    want.forEach((w, i) => {
      const ok = w.startsWith("^") ? new RegExp(w).test(lines[i]!) : lines[i] === w;
      assert.ok(ok, `line ${i + 1} of examples/${file}: ${JSON.stringify(lines[i])} does not match ${w}`);
    });
  });
}
