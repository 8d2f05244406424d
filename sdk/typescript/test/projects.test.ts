// `Project`, `ApiKey`, `AccessToken` and `AuditLog` against a real daemon (no VM): a project with a quota and its
// usage, a member key that sees only its project, an access token that works until its key is revoked, and an
// audit log that recorded all of it as one unbroken chain.

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { AccessToken, ApiKey, AuditLog, AuthenticationError, HearthError, Project } from "@hearth/sdk";

import { type Daemon, startDaemon } from "./daemon.js";

let daemon: Daemon;

before(async () => {
  daemon = await startDaemon();
});

after(async () => {
  await daemon?.stop();
});

test("projects, keys, access tokens and the audit log", async () => {
  const admin = { url: daemon.url, apiKey: daemon.apiKey };
  const made = await Project.create("sdk-team", { maxRunning: 2, budgetCredits: 500, maxDiskBytes: 2 ** 34 }, admin);
  assert.equal(made.name, "sdk-team");
  assert.deepEqual([made.quota.maxRunning, made.quota.budgetCredits, made.quota.maxDiskBytes], [2, 500, 2 ** 34]);
  const usage = await Project.usage("sdk-team", admin);
  assert.deepEqual(
    [usage.running, usage.spentCredits, usage.diskBytes, usage.quota.maxRunning, usage.quota.maxDiskBytes],
    [0, 0, 0, 2, 2 ** 34],
  );
  const raised = await Project.setQuota("sdk-team", { maxRunning: 3, maxLifetimeS: 3600 }, admin);
  assert.deepEqual([raised.quota.maxRunning, raised.quota.maxLifetimeS, raised.quota.budgetCredits], [3, 3600, undefined]);

  const key = await ApiKey.create({ project: "sdk-team", role: "member", name: "sdk test" }, admin);
  assert.match(key.key, /^hk_[0-9a-f]{64}$/);
  const listed = await ApiKey.list(admin);
  assert.ok(listed.some((k) => k.id === key.id && k.project === "sdk-team"));
  assert.ok(!JSON.stringify(listed).includes(key.key), "keys are never listed");

  // A member key sees its own project only; an access token minted by it does too, until the key is revoked.
  const member = { url: daemon.url, apiKey: key.key };
  assert.deepEqual((await Project.list(member)).map((p) => p.name), ["sdk-team"]);
  const minted = await AccessToken.create({ purpose: "api", ttlS: 60 }, member);
  assert.ok(minted.expiresAt.getTime() > Date.now());
  const viaToken = { url: daemon.url, apiKey: minted.token };
  assert.deepEqual((await Project.list(viaToken)).map((p) => p.name), ["sdk-team"]);
  await assert.rejects(Project.create("not-allowed", {}, member), (e: unknown) => e instanceof HearthError);
  await ApiKey.revoke(key.id, admin);
  await assert.rejects(Project.list(viaToken), (e: unknown) => e instanceof AuthenticationError);

  const entries = await AuditLog.all({}, admin);
  assert.ok(entries.some((e) => e.action === "POST /v1/projects" && e.status === 201));
  assert.ok(entries.some((e) => e.action === "POST /v1/tokens" && e.key_id === key.id));
  assert.ok(entries.some((e) => e.action === "DELETE /v1/keys/{id}" && e.target.includes(key.id)));
  entries.forEach((e, i) => {
    assert.equal(e.seq, i + 1);
    if (i > 0) assert.equal(e.prev_hash, entries[i - 1]?.hash);
  });
  const page = await AuditLog.page({ project: "sdk-team", limit: 1 }, admin);
  assert.equal(page.entries.length, 1);
});
