// `sbx.network` and `Network` against a real daemon with sandbox networking on (its uplink an empty namespace the
// harness made, so nothing a guest sends leaves it) and a real VM: create with a policy, a network and a name;
// get and set the policy, a bad rule as a typed error; private networks; the egress log of real attempts; an
// exposed port answering with the guest's HTTP server through Node's fetch.

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { ConflictError, InvalidArgumentError, Network, NotFoundError, Sandbox } from "@hearth/sdk";

import { type Daemon, startDaemon } from "./daemon.js";

/** This file's sandbox range (distinct from every other test's). */
const RANGE = "10.213.72.0/24";

let daemon: Daemon;
let sbx: Sandbox;

function conn() {
  return { url: daemon.url, apiKey: daemon.apiKey };
}

before(async () => {
  daemon = await startDaemon({ sandboxNet: RANGE });
});

after(async () => {
  if (!daemon) return;
  assert.deepEqual(await daemon.stop(), [], "VMM processes outlived the daemon");
});

test("create with an egress policy, a network and a name; get reports them", async () => {
  // A bad rule is refused before anything is created.
  await assert.rejects(
    Sandbox.create("minimal", { ...conn(), network: { egress: { default: "deny", allow: ["not a rule"] } } }),
    (err: unknown) => {
      assert.ok(err instanceof InvalidArgumentError, String(err));
      assert.equal(err.code, "invalid_argument");
      assert.match(err.message, /not a rule/);
      return true;
    },
  );
  assert.deepEqual(await Sandbox.list(conn()), []);

  const blue = await Network.create("sdk-blue", conn());
  assert.match(blue.id, /^net_[0-9a-f]{16}$/);
  assert.equal(blue.name, "sdk-blue");
  assert.deepEqual(blue.members, []);
  assert.ok(blue.createdAt instanceof Date && !Number.isNaN(blue.createdAt.getTime()));

  sbx = await Sandbox.create("minimal", {
    ...conn(),
    timeoutMs: 600_000,
    network: { egress: { default: "deny", allow: ["203.0.113.0/24", "example.com"] } },
    networks: ["sdk-blue"],
    name: "web",
  });
  const net = await sbx.network.get();
  assert.ok(net.address.startsWith("10.213.72."), net.address);
  assert.equal(net.guestAddress, "172.16.0.2");
  assert.deepEqual(net.egress, { default: "deny", allow: ["203.0.113.0/24", "example.com"], deny: [] });
  assert.deepEqual(net.networks, ["sdk-blue"]);
  // The name is taken among live sandboxes.
  await assert.rejects(Sandbox.create("minimal", { ...conn(), name: "web" }), ConflictError);
});

test("setPolicy replaces the policy; a bad rule rejects with InvalidArgumentError and changes nothing", async () => {
  const want = { default: "allow" as const, allow: [], deny: ["*.example.org", "198.51.100.0/24"] };
  const set = await sbx.network.setPolicy({ deny: want.deny });
  assert.deepEqual(set.egress, want);
  assert.deepEqual((await sbx.network.get()).egress, want);

  await assert.rejects(sbx.network.setPolicy({ default: "deny", allow: ["10.0.0.1/8"] }), (err: unknown) => {
    assert.ok(err instanceof InvalidArgumentError, String(err));
    assert.equal(err.code, "invalid_argument");
    assert.equal(err.status, 400);
    assert.match(err.message, /10\.0\.0\.1\/8/);
    return true;
  });
  assert.deepEqual((await sbx.network.get()).egress, want);

  // A sandbox reached by id has the same network.
  const again = await Sandbox.connect(sbx.id, conn());
  assert.deepEqual(await again.network.get(), await sbx.network.get());
});

test("Network create, attach, detach, list and delete", async () => {
  const green = await Network.create("sdk-green", conn());
  await assert.rejects(Network.create("sdk-green", conn()), ConflictError);
  await assert.rejects(Network.create("Not Valid", conn()), InvalidArgumentError);

  // A `Sandbox` brings its own connection; an id needs one.
  let info = await Network.attach("sdk-green", sbx);
  assert.deepEqual(info.members, [sbx.id]);
  assert.deepEqual((await sbx.network.get()).networks.sort(), ["sdk-blue", "sdk-green"]);
  info = await Network.detach(green.id, sbx.id, conn());
  assert.equal(info.name, "sdk-green");
  assert.deepEqual(info.members, []);
  assert.deepEqual((await sbx.network.get()).networks, ["sdk-blue"]);
  info = await Network.attach("sdk-green", sbx.id, conn());
  assert.deepEqual(info.members, [sbx.id]);

  const listed = await Network.list(conn());
  const byName = new Map(listed.map((n) => [n.name, n]));
  assert.deepEqual(byName.get("sdk-blue")?.members, [sbx.id]);
  assert.deepEqual(byName.get("sdk-green")?.members, [sbx.id]);
  assert.equal((await Network.get("sdk-green", conn())).id, green.id);
  await assert.rejects(Network.get("no-such-net", conn()), NotFoundError);

  // Refused while a sandbox is attached.
  await assert.rejects(Network.delete("sdk-green", conn()), ConflictError);
  await Network.detach("sdk-green", sbx);
  assert.equal(await Network.delete("sdk-green", conn()), true);
  assert.equal(await Network.delete("sdk-green", conn()), false);
  assert.ok(!(await Network.list(conn())).some((n) => n.name === "sdk-green"));
});

test("log lists the guest's egress attempts with their verdicts", async () => {
  await sbx.network.setPolicy({ default: "deny", allow: ["203.0.113.0/24"], deny: ["198.51.100.0/24"] });
  await sbx.commands.run("nc -w 1 203.0.113.7 8080 </dev/null; nc -w 1 198.51.100.7 8080 </dev/null; true");
  const deadline = Date.now() + 30_000;
  for (;;) {
    const log = await sbx.network.log();
    const seen = (dest: string) => log.events.find((e) => e.destination === dest && e.port === 8080);
    const allowed = seen("203.0.113.7");
    const denied = seen("198.51.100.7");
    if (allowed && denied) {
      assert.equal(allowed.allowed, true);
      assert.equal(allowed.reason, "allow_rule");
      assert.equal(denied.allowed, false);
      assert.equal(denied.reason, "deny_rule");
      assert.equal(denied.protocol, "tcp");
      assert.ok(denied.at instanceof Date && !Number.isNaN(denied.at.getTime()));
      assert.equal(log.dropped, 0);
      break;
    }
    assert.ok(Date.now() < deadline, `attempts not logged: ${JSON.stringify(log)}`);
    await new Promise((r) => setTimeout(r, 300));
  }
});

test("exposePort returns a URL that reaches the guest's HTTP server with its token only", async () => {
  await sbx.commands.run("echo served-by-sdk > /root/index.html");
  await sbx.commands.run("busybox httpd -f -p 8000 -h /root", { background: true });
  const before = Date.now();
  const port = await sbx.network.exposePort(8000, { ttlMs: 120_000 });
  assert.ok(port.url.startsWith(`${daemon.url}/v1/sandboxes/${sbx.id}/ports/8000/?`), port.url);
  assert.ok(port.url.endsWith(`hearth_token=${port.token}`), port.url);
  const ttl = port.expiresAt.getTime() - before;
  assert.ok(ttl > 100_000 && ttl <= 122_000, `expires in ${ttl} ms`);

  const index = port.url.replace("/ports/8000/?", "/ports/8000/index.html?");
  const deadline = Date.now() + 30_000;
  for (;;) {
    // No API key: the token alone opens the port.
    const res = await fetch(index);
    const body = await res.text();
    if (res.status === 200) {
      assert.equal(body, "served-by-sdk\n");
      break;
    }
    assert.ok(Date.now() < deadline, `${res.status}: ${body}`);
    await new Promise((r) => setTimeout(r, 300));
  }
  assert.equal((await fetch(index.split("?")[0]!)).status, 401);
  await assert.rejects(sbx.network.exposePort(0), InvalidArgumentError);
  await assert.rejects(sbx.network.exposePort(8000, { ttlMs: 2 * 86_400_000 }), InvalidArgumentError);
});

test("kill, then the network can go", async () => {
  await assert.rejects(Network.delete("sdk-blue", conn()), ConflictError);
  assert.equal(await sbx.kill(), true);
  assert.equal(await Network.delete("sdk-blue", conn()), true);
  await assert.rejects(sbx.network.get(), NotFoundError);
});
