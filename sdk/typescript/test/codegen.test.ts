// The committed generated types match docs/openapi.json, and the normalisation of the document does what
// scripts/generate.mjs says. No daemon needed.

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { PACKAGE_DIR } from "./daemon.js";

interface Generator {
  generate(doc?: unknown): Promise<string>;
  normalise(doc: unknown): Record<string, any>;
  outPath: string;
  specPath: string;
}

const gen = (await import(join(PACKAGE_DIR, "scripts/generate.mjs"))) as Generator;

test("src/generated/openapi.ts is current (npm run check-generated)", () => {
  const run = spawnSync(process.execPath, ["scripts/generate.mjs", "--check"], { cwd: PACKAGE_DIR, encoding: "utf8" });
  assert.equal(run.status, 0, `${run.stdout}${run.stderr}`);
});

test("a change to the API document makes the committed types stale", async () => {
  const doc = JSON.parse(readFileSync(gen.specPath, "utf8"));
  const committed = readFileSync(gen.outPath, "utf8");
  assert.equal(await gen.generate(structuredClone(doc)), committed);
  doc.components.schemas.Sandbox.properties.brand_new = { type: "string" };
  const changed = await gen.generate(doc);
  assert.notEqual(changed, committed);
  assert.match(changed, /brand_new\?: string/);
});

test("normalise: stray path parameters become query parameters, duplicate operation ids get their tag", () => {
  const doc = {
    openapi: "3.1.0",
    info: { title: "t", version: "1" },
    paths: {
      "/a/{id}": {
        get: {
          operationId: "list",
          tags: ["files"],
          parameters: [
            { name: "id", in: "path", required: true, schema: { type: "string" } },
            { name: "path", in: "path", required: true, schema: { type: "string" } },
            { name: "timeout_s", in: "path", required: true, schema: { type: ["integer", "null"] } },
          ],
          responses: {},
        },
      },
      "/b": { get: { operationId: "list", tags: ["sandboxes"], responses: {} } },
      "/c": { get: { operationId: "only", tags: ["x"], responses: {} } },
    },
  };
  const out = gen.normalise(doc);
  const params = out.paths["/a/{id}"].get.parameters;
  assert.deepEqual(
    params.map((p: { name: string; in: string; required: boolean }) => [p.name, p.in, p.required]),
    [
      ["id", "path", true],
      ["path", "query", true],
      ["timeout_s", "query", false],
    ],
  );
  assert.equal(out.paths["/a/{id}"].get.operationId, "files_list");
  assert.equal(out.paths["/b"].get.operationId, "sandboxes_list");
  assert.equal(out.paths["/c"].get.operationId, "only");
  // The input is left alone.
  assert.equal(doc.paths["/a/{id}"].get.parameters[1]!.in, "path");
});
