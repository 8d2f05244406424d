// `Bucket` and `sbx.mounts` against a real daemon with networking (an uplink namespace that leads nowhere), a real
// S3 server on loopback (s3s-fs, installed by scripts/install-test-deps.sh) and a real VM: register (a bad secret
// as a typed error, the good one never shown), mount at create and at run time, write in the guest, bytes in
// usage, unmount, delete refused while mounted.

import assert from "node:assert/strict";
import { type ChildProcess, spawn } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { Bucket, ConflictError, HearthError, Sandbox } from "@hearth/sdk";

import { type Daemon, startDaemon } from "./daemon.js";

const RANGE = "10.213.74.0/24";
const KEY = "sdkkey";
const SECRET = "sdk-secret-0123456789";
const S3S_FS = process.env.HEARTH_S3S_FS ?? "/opt/hearth/test-tools/bin/s3s-fs";

let daemon: Daemon;
let s3: ChildProcess;
let s3dir: string;
let endpoint: string;

function conn() {
  return { url: daemon.url, apiKey: daemon.apiKey };
}

async function freePort(): Promise<number> {
  return new Promise((resolve) => {
    const srv = createServer().listen(0, "127.0.0.1", () => {
      const port = (srv.address() as { port: number }).port;
      srv.close(() => resolve(port));
    });
  });
}

before(async () => {
  assert.ok(existsSync(S3S_FS), `${S3S_FS} is missing: run \`sudo bash scripts/install-test-deps.sh\``);
  s3dir = mkdtempSync(join(tmpdir(), "hearth-sdk-s3-"));
  mkdirSync(join(s3dir, "bkt"));
  const port = await freePort();
  endpoint = `http://127.0.0.1:${port}`;
  s3 = spawn(S3S_FS, ["--host", "127.0.0.1", "--port", String(port), "--access-key", KEY, "--secret-key", SECRET, s3dir], {
    stdio: "ignore",
  });
  for (let i = 0; ; i++) {
    const up = await fetch(endpoint).then(
      () => true,
      () => false,
    );
    if (up) break;
    assert.ok(i < 200, "s3s-fs did not start");
    await new Promise((r) => setTimeout(r, 50));
  }
  daemon = await startDaemon({ sandboxNet: RANGE, args: ["--allow-private-bucket-endpoints"] });
});

after(async () => {
  if (daemon) assert.deepEqual(await daemon.stop(), [], "VMM processes outlived the daemon");
  s3?.kill("SIGKILL");
  if (s3dir) rmSync(s3dir, { recursive: true, force: true });
});

test("register a bucket, mount it at create and at run time, write through it", async () => {
  await assert.rejects(
    Bucket.create({ ...spec(), secretAccessKey: "wrong-secret" }, conn()),
    (err: unknown) => err instanceof HearthError && err.code === "bucket_access_denied",
  );
  const b = await Bucket.create(spec(), conn());
  assert.equal(b.url, "s3://bkt/sdk");
  assert.ok(!JSON.stringify(b).includes(SECRET), "the secret is never returned");
  assert.deepEqual(
    (await Bucket.list(conn())).map((x) => x.name),
    ["data"],
  );

  const sbx = await Sandbox.create("minimal", { ...conn(), mounts: [{ path: "/mnt/data", bucket: "data", prefix: "out" }] });
  try {
    await sbx.commands.run("echo from-sdk > /mnt/data/a.txt");
    await sbx.mounts.add({ path: "/mnt/in", bucket: "data", prefix: "out", readOnly: true });
    assert.equal((await sbx.commands.run("cat /mnt/in/a.txt")).stdout, "from-sdk\n");
    const ro = await sbx.commands.run("echo x > /mnt/in/b.txt").catch((e: unknown) => e);
    assert.match(String((ro as { stderr?: string }).stderr ?? ro), /Read-only file system/);
    const mounts = await sbx.mounts.list();
    assert.deepEqual(
      mounts.map((m) => [m.path, m.readOnly]),
      [
        ["/mnt/data", false],
        ["/mnt/in", true],
      ],
    );
    assert.ok(mounts[0]!.bytesWritten >= 9, JSON.stringify(mounts));
    await assert.rejects(Bucket.delete("data", conn()), ConflictError);
    await sbx.mounts.remove("/mnt/in");
    assert.equal((await sbx.mounts.list()).length, 1);
    const usage = await sbx.getUsage();
    assert.ok(usage.bytesWritten >= 9 && usage.bytesRead >= 9, JSON.stringify(usage));
  } finally {
    await sbx.kill();
  }
  assert.equal(await Bucket.delete("data", conn()), true);
});

function spec() {
  return { name: "data", url: "s3://bkt/sdk", endpoint, accessKeyId: KEY, secretAccessKey: SECRET };
}
