// Drives hearth's MCP server with an official TypeScript MCP client; run by tests/js_clients.rs.
//
// usage: node client.mjs <v1|v2> <stdio|http> <quick|full>
//   v1: @modelcontextprotocol/sdk (protocol 2025-11-25: initialize handshake, sessions over HTTP)
//   v2: @modelcontextprotocol/client pinned to 2026-07-28 (stateless)
//   quick: list tools, call list_sandboxes, check bad arguments come back as tool errors
//   full: quick, then create -> exec -> write/read/list files -> set_timeout -> kill with a real VM
//   network: quick, then create with an egress policy -> network_policy_set/get -> a bad rule -> kill (needs a
//     daemon with sandbox networking on)
// HEARTH_MCP_CONFIG is one server entry of an agent's MCP configuration, as docs/mcp.md shows it:
// {"command", "args", "env"} for stdio or {"url", "headers"} for HTTP.

import assert from "node:assert/strict";

const [sdk, transportKind, mode] = process.argv.slice(2);
const config = JSON.parse(process.env.HEARTH_MCP_CONFIG ?? "");
const log = (msg) => process.stderr.write(`[${sdk}/${transportKind}] ${msg}\n`);
// A VM boot under TCG takes 10-15 s, more on a loaded machine.
const TIMEOUT = 240_000;

async function connect() {
  const info = { name: "hearth-mcp-test", version: "1.0.0" };
  if (sdk === "v1") {
    const { Client } = await import("@modelcontextprotocol/sdk/client/index.js");
    const client = new Client(info);
    let transport;
    if (transportKind === "stdio") {
      const { StdioClientTransport } = await import("@modelcontextprotocol/sdk/client/stdio.js");
      transport = new StdioClientTransport({ ...config, stderr: "inherit" });
    } else {
      const { StreamableHTTPClientTransport } = await import(
        "@modelcontextprotocol/sdk/client/streamableHttp.js"
      );
      transport = new StreamableHTTPClientTransport(new URL(config.url), {
        requestInit: { headers: config.headers },
      });
    }
    await client.connect(transport);
    const call = (name, args) => client.callTool({ name, arguments: args }, undefined, { timeout: TIMEOUT });
    return { client, call, transport };
  }
  const { Client, StreamableHTTPClientTransport } = await import("@modelcontextprotocol/client");
  const client = new Client(info, { versionNegotiation: { mode: { pin: "2026-07-28" } } });
  let transport;
  if (transportKind === "stdio") {
    const { StdioClientTransport } = await import("@modelcontextprotocol/client/stdio");
    transport = new StdioClientTransport({ ...config, stderr: "inherit" });
  } else {
    transport = new StreamableHTTPClientTransport(new URL(config.url), {
      requestInit: { headers: config.headers },
    });
  }
  await client.connect(transport);
  assert.equal(client.getNegotiatedProtocolVersion(), "2026-07-28");
  const call = (name, args) => client.callTool({ name, arguments: args }, { timeout: TIMEOUT });
  return { client, call, transport };
}

/** The JSON a hearth tool answered with (structuredContent, also given as text). */
function json(result) {
  assert.ok(result.structuredContent, `no structuredContent in ${JSON.stringify(result)}`);
  const text = result.content?.[0]?.text;
  assert.deepEqual(JSON.parse(text), result.structuredContent);
  return result.structuredContent;
}

function ok(result) {
  assert.notEqual(result.isError, true, `tool failed: ${JSON.stringify(result)}`);
  return json(result);
}

function toolError(result) {
  assert.equal(result.isError, true, `expected a tool error, got ${JSON.stringify(result)}`);
  return result;
}

const { client, call } = await connect();
try {
  const { tools } = await client.listTools();
  const names = tools.map((t) => t.name).sort();
  log(`tools: ${names.join(", ")}`);
  for (const want of [
    "create_sandbox", "create_template", "delete_template", "exec", "fork_sandbox", "kill_sandbox", "list_files", "list_sandboxes", "list_templates", "pause_sandbox",
    "read_file", "resume_sandbox", "sandbox_info", "set_timeout", "write_file", "network_policy_get",
    "network_policy_set", "network_log", "network_create", "network_list", "network_delete", "network_attach",
    "network_detach", "port_expose", "bucket_list", "mount_add", "mount_remove", "project_usage",
  ]) {
    assert.ok(names.includes(want), `missing tool ${want}`);
  }
  const exec = tools.find((t) => t.name === "exec");
  assert.ok(exec.description.includes("64 KiB"));
  assert.deepEqual([...exec.inputSchema.required].sort(), ["command", "sandbox_id"]);
  assert.equal(exec.inputSchema.properties.command.type, "string");

  const listed = ok(await call("list_sandboxes", {}));
  assert.ok(Array.isArray(listed.sandboxes));
  const templates = ok(await call("list_templates", {}));
  assert.ok(templates.templates.some((t) => t.name === "minimal" && t.builtin), JSON.stringify(templates));
  const createTemplate = tools.find((t) => t.name === "create_template");
  assert.deepEqual([...createTemplate.inputSchema.required].sort(), ["name", "sandbox_id"]);
  assert.equal(templates.default_template, "minimal");

  // Bad arguments and unknown sandboxes are tool errors the agent can read, not protocol failures.
  let r = toolError(await call("exec", { command: "true" }));
  assert.match(r.content[0].text, /sandbox_id/);
  r = toolError(await call("sandbox_info", { sandbox_id: "sb_doesnotexist" }));
  assert.equal(json(r).error.code, "not_found");
  r = toolError(await call("list_sandboxes", { state: "sleeping" }));
  assert.equal(json(r).error.code, "invalid_argument");
  r = toolError(await call("kill_sandbox", { sandbox_id: 42 }));
  assert.match(r.content[0].text, /invalid type|expected a string/);
  // The connection survives all of that.
  ok(await call("list_sandboxes", { state: "running" }));

  if (mode === "full") {
    log("create_sandbox");
    const sbx = ok(await call("create_sandbox", {
      template: "minimal", timeout_s: 600, env: { GREETING: "hello" }, metadata: { test: `mcp-${sdk}-${transportKind}` },
    }));
    assert.equal(sbx.state, "running");
    assert.equal(sbx.template, "minimal");
    const id = sbx.id;
    try {
      const info = ok(await call("sandbox_info", { sandbox_id: id }));
      assert.equal(info.id, id);
      const mine = ok(await call("list_sandboxes", { metadata: { test: `mcp-${sdk}-${transportKind}` } }));
      assert.deepEqual(mine.sandboxes.map((s) => s.id), [id]);

      log("exec");
      let out = ok(await call("exec", {
        sandbox_id: id, command: "echo $GREETING $EXTRA; echo oops >&2; pwd; exit 3", cwd: "/tmp",
        env: { EXTRA: "world" },
      }));
      assert.equal(out.exit_code, 3);
      assert.equal(out.stdout, "hello world\n/tmp\n");
      assert.equal(out.stderr, "oops\n");
      assert.equal(out.truncated, undefined);

      // Long output is cut at 64 KiB with a note on how to get the rest.
      out = ok(await call("exec", { sandbox_id: id, command: "head -c 100000 /dev/zero | tr '\\0' x" }));
      assert.equal(out.exit_code, 0);
      assert.equal(out.stdout.length, 65536);
      assert.match(out.truncated, /stdout was 100000 bytes/);
      assert.match(out.truncated, /read_file/);

      out = ok(await call("exec", { sandbox_id: id, command: "sleep 30", timeout_s: 1 }));
      assert.equal(out.timed_out, true);

      log("files");
      const written = ok(await call("write_file", {
        sandbox_id: id, path: "/root/new/dir/notes.txt", content: "line one\nsecond line ünïcode\n",
      }));
      assert.equal(written.size, Buffer.byteLength("line one\nsecond line ünïcode\n"));
      let read = ok(await call("read_file", { sandbox_id: id, path: "/root/new/dir/notes.txt" }));
      assert.equal(read.encoding, "text");
      assert.equal(read.content, "line one\nsecond line ünïcode\n");
      assert.equal(read.next_offset, undefined);
      read = ok(await call("read_file", { sandbox_id: id, path: "/root/new/dir/notes.txt", offset: 5, length: 4 }));
      assert.equal(read.content, "one\n");
      assert.equal(read.next_offset, 9);

      ok(await call("write_file", {
        sandbox_id: id, path: "/root/blob.bin", content: Buffer.from([0, 1, 2, 255]).toString("base64"),
        encoding: "base64",
      }));
      read = ok(await call("read_file", { sandbox_id: id, path: "/root/blob.bin" }));
      assert.equal(read.encoding, "base64");
      assert.equal(read.content, "AAEC/w==");
      assert.match(read.note, /base64/);
      out = ok(await call("exec", { sandbox_id: id, command: "od -An -tx1 /root/blob.bin" }));
      assert.equal(out.stdout.trim(), "00 01 02 ff");

      const listing = ok(await call("list_files", { sandbox_id: id, path: "/root/new/dir" }));
      assert.deepEqual(listing.entries.map((e) => [e.name, e.kind]), [["notes.txt", "file"]]);
      // /proc files report size 0 but have content.
      read = ok(await call("read_file", { sandbox_id: id, path: "/proc/self/status" }));
      assert.match(read.content, /^Name:/);
      r = toolError(await call("read_file", { sandbox_id: id, path: "/root/missing.txt" }));
      assert.equal(json(r).error.code, "not_found");
      r = toolError(await call("read_file", { sandbox_id: id, path: "/root" }));
      assert.match(json(r).error.message, /list_files/);

      const extended = ok(await call("set_timeout", { sandbox_id: id, timeout_s: 900 }));
      assert.ok(Date.parse(extended.end_at) > Date.parse(sbx.end_at));

      log("pause and resume");
      // A background process and a file survive the pause.
      ok(await call("exec", {
        sandbox_id: id, command: "setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > /root/sleeper.pid",
      }));
      const paused = ok(await call("pause_sandbox", { sandbox_id: id }));
      assert.equal(paused.state, "paused");
      assert.equal(ok(await call("sandbox_info", { sandbox_id: id })).state, "paused");
      const resumed = ok(await call("resume_sandbox", { sandbox_id: id }));
      assert.equal(resumed.state, "running");
      out = ok(await call("exec", {
        sandbox_id: id, command: "kill -0 $(cat /root/sleeper.pid) && cat /root/new/dir/notes.txt",
      }));
      assert.equal(out.exit_code, 0, JSON.stringify(out));
      assert.equal(out.stdout, "line one\nsecond line ünïcode\n");
      r = toolError(await call("resume_sandbox", { sandbox_id: "sb_doesnotexist" }));
      assert.equal(json(r).error.code, "not_found");

      log("fork");
      const forked = ok(await call("fork_sandbox", { sandbox_id: id }));
      assert.equal(forked.sandboxes.length, 1);
      const child = forked.sandboxes[0];
      assert.notEqual(child.id, id);
      assert.equal(child.state, "running");
      try {
        out = ok(await call("exec", { sandbox_id: child.id, command: "cat /root/new/dir/notes.txt; echo child > /root/who" }));
        assert.equal(out.stdout, "line one\nsecond line ünïcode\n");
        out = ok(await call("exec", { sandbox_id: id, command: "cat /root/who" }));
        assert.notEqual(out.exit_code, 0, "the child's write must not reach the parent");
      } finally {
        ok(await call("kill_sandbox", { sandbox_id: child.id }));
      }
      r = toolError(await call("fork_sandbox", { sandbox_id: id, count: 0 }));
      assert.equal(json(r).error.code, "invalid_argument");

      log("templates");
      const tplName = `mcp-${sdk}-${transportKind}`;
      const tpl = ok(await call("create_template", { sandbox_id: id, name: tplName }));
      assert.equal(tpl.name, tplName);
      assert.equal(tpl.from_sandbox, id);
      assert.equal(tpl.has_memory, false);
      const listedTpl = ok(await call("list_templates", {})).templates.find((t) => t.name === tplName);
      assert.equal(listedTpl?.builtin, false);
      r = toolError(await call("create_template", { sandbox_id: id, name: tplName }));
      assert.equal(json(r).error.code, "conflict");
      assert.equal(ok(await call("delete_template", { name: tplName })).deleted, tplName);
      r = toolError(await call("delete_template", { name: tplName }));
      assert.equal(json(r).error.code, "not_found");
    } finally {
      log("kill_sandbox");
      const killed = ok(await call("kill_sandbox", { sandbox_id: id }));
      assert.equal(killed.killed, id);
    }
    r = toolError(await call("sandbox_info", { sandbox_id: id }));
    assert.equal(json(r).error.code, "not_found");
  }
  if (mode === "network") {
    const setPolicy = tools.find((t) => t.name === "network_policy_set");
    assert.deepEqual([...setPolicy.inputSchema.required].sort(), ["default", "sandbox_id"]);
    assert.match(setPolicy.description, /CIDR/);
    assert.match(setPolicy.description, /\*\.example\.com/);

    log("create_sandbox with a policy");
    const sbx = ok(await call("create_sandbox", {
      template: "minimal", timeout_s: 600, deny_all: true, allow: ["203.0.113.0/24", "example.com"],
    }));
    const id = sbx.id;
    try {
      let net = ok(await call("network_policy_get", { sandbox_id: id }));
      assert.deepEqual(net.egress, { default: "deny", allow: ["203.0.113.0/24", "example.com"], deny: [] });
      assert.match(net.address, /^\d+\.\d+\.\d+\.\d+$/);

      log("network_policy_set");
      const want = { default: "allow", allow: [], deny: ["*.example.org", "198.51.100.0/24"] };
      net = ok(await call("network_policy_set", { sandbox_id: id, ...want }));
      assert.deepEqual(net.egress, want);
      assert.deepEqual(ok(await call("network_policy_get", { sandbox_id: id })).egress, want);

      // A bad rule is a tool error naming the rule; the policy stays.
      r = toolError(await call("network_policy_set", { sandbox_id: id, default: "deny", allow: ["exa mple.com"] }));
      assert.equal(json(r).error.code, "invalid_argument");
      assert.match(json(r).error.message, /exa mple\.com/);
      assert.deepEqual(ok(await call("network_policy_get", { sandbox_id: id })).egress, want);
      r = toolError(await call("network_policy_set", { sandbox_id: id, allow: ["203.0.113.0/24"] }));
      assert.match(r.content[0].text, /default/);
    } finally {
      ok(await call("kill_sandbox", { sandbox_id: id }));
    }
  }
  log("ok");
} finally {
  await client.close();
}
