// Test harness: a real `hearthd` (target/debug/hearthd, or $HEARTHD_BIN) on a temporary data directory,
// listening on a free loopback port, with the guest images of /var/lib/hearth/images (or $HEARTH_IMAGES) and
// `minimal` as the default template, sandbox networking off unless asked for. `stop()` destroys every sandbox it
// still has through the API, then stops the daemon (SIGTERM, SIGKILL after 10 s) and removes the directory (and
// the uplink namespace of a networked daemon).

import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, openSync, readFileSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

/** The package directory (sdk/typescript), wherever the compiled test runs from. */
export const PACKAGE_DIR = (() => {
  let dir = dirname(fileURLToPath(import.meta.url));
  while (!existsSync(join(dir, "package.json"))) dir = dirname(dir);
  return dir;
})();

const REPO_ROOT = resolve(PACKAGE_DIR, "../..");

export interface Daemon {
  url: string;
  apiKey: string;
  dataDir: string;
  /** Environment for a child process using this daemon through HEARTH_URL / HEARTH_API_KEY. */
  env: NodeJS.ProcessEnv;
  /** The daemon's log so far (for failure messages). */
  log(): string;
  /** Destroys the daemon's sandboxes, stops it, kills any VMM process left under its directory (returning
   * their pids, which a test can assert is empty) and removes the directory. */
  stop(): Promise<number[]>;
}

/** Pids of processes whose command line mentions `dir` (the VMM processes a daemon started under it). */
function processesUnder(dir: string): number[] {
  const pids: number[] = [];
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue;
    try {
      if (readFileSync(`/proc/${entry}/cmdline`, "utf8").includes(dir)) pids.push(Number(entry));
    } catch {
      // exited meanwhile
    }
  }
  return pids;
}

async function waitForLine(path: string, child: ChildProcess, log: () => string, withinMs: number): Promise<string> {
  const deadline = Date.now() + withinMs;
  for (;;) {
    if (existsSync(path)) {
      const text = readFileSync(path, "utf8");
      if (text.endsWith("\n")) return text.trim();
    }
    if (child.exitCode !== null || child.signalCode !== null) {
      throw new Error(`hearthd exited (${child.exitCode ?? child.signalCode}) before writing ${path}:\n${log()}`);
    }
    if (Date.now() > deadline) throw new Error(`hearthd did not write ${path} in time:\n${log()}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** Options of `startDaemon`. */
export interface DaemonOpts {
  /**
   * Turn sandbox networking on (it is off otherwise), with this sandbox range (e.g. `10.213.72.0/24`, distinct
   * from every other test's) and as uplink an empty network namespace made for this daemon (`ip netns add`,
   * removed by `stop()`): it has no route anywhere, so nothing a guest sends leaves it. Needs root and `nft`.
   */
  sandboxNet?: string | undefined;
  /** Extra hearthd flags. */
  args?: string[] | undefined;
}

function ip(...args: string[]): void {
  const r = spawnSync("ip", args, { encoding: "utf8" });
  if (r.status !== 0) throw new Error(`ip ${args.join(" ")}: ${r.stderr || r.error}`);
}

export async function startDaemon(opts: DaemonOpts = {}): Promise<Daemon> {
  const bin = process.env.HEARTHD_BIN ?? join(REPO_ROOT, "target/debug/hearthd");
  if (!existsSync(bin)) throw new Error(`${bin} is missing: run \`cargo build -p hearthd\` first`);
  const images = process.env.HEARTH_IMAGES ?? "/var/lib/hearth/images";
  const root = mkdtempSync(join(tmpdir(), "hearth-sdk-test-"));
  const state = join(root, "state");
  const logPath = join(root, "hearthd.log");
  const logFd = openSync(logPath, "w");
  const args = ["--listen", "127.0.0.1:0", "--data-dir", state, "--images-dir", images, "--default-template", "minimal"];
  const env: NodeJS.ProcessEnv = { ...process.env, RUST_LOG: "info", HEARTH_NETWORK: "off" };
  let netns: string | undefined;
  const removeNetns = () => {
    if (netns) spawnSync("ip", ["netns", "del", netns]);
    netns = undefined;
  };
  if (opts.sandboxNet) {
    netns = `hsdk-${process.pid}-${Date.now().toString(16).slice(-6)}`;
    try {
      ip("netns", "add", netns);
      ip("-n", netns, "link", "set", "lo", "up");
    } catch (err) {
      removeNetns();
      throw err;
    }
    delete env.HEARTH_NETWORK;
    // Nothing answers at the DNS upstream: the uplink namespace has no route anywhere.
    args.push("--network", "on", "--uplink-netns", `/run/netns/${netns}`, "--sandbox-net", opts.sandboxNet);
    args.push("--dns-upstream", "192.0.2.53:53");
  }
  args.push(...(opts.args ?? []));
  const child = spawn(bin, args, { stdio: ["ignore", logFd, logFd], env });
  const log = () => (existsSync(logPath) ? readFileSync(logPath, "utf8") : "");
  let addr: string;
  try {
    addr = await waitForLine(join(state, "listen-addr"), child, log, 60_000);
  } catch (err) {
    child.kill("SIGKILL");
    removeNetns();
    throw err;
  }
  const apiKey = readFileSync(join(state, "api-key"), "utf8").trim();
  const url = `http://${addr}`;
  const exited = new Promise<void>((r) => child.once("exit", () => r()));

  const stop = async (): Promise<number[]> => {
    let leftovers: number[] = [];
    try {
      const headers = { Authorization: `Bearer ${apiKey}` };
      const res = await fetch(`${url}/v1/sandboxes`, { headers });
      const { sandboxes } = (await res.json()) as { sandboxes: { id: string }[] };
      for (const s of sandboxes) {
        const del = await fetch(`${url}/v1/sandboxes/${s.id}`, { method: "DELETE", headers });
        if (del.status !== 204 && del.status !== 404) {
          console.error(`cleanup: DELETE ${s.id} answered ${del.status}: ${await del.text()}`);
        }
      }
    } finally {
      if (child.exitCode === null && child.signalCode === null) {
        child.kill("SIGTERM");
        const timer = setTimeout(() => child.kill("SIGKILL"), 10_000);
        await exited;
        clearTimeout(timer);
      }
      leftovers = processesUnder(root);
      for (const pid of leftovers) {
        try {
          process.kill(pid, "SIGKILL");
        } catch {
          // already gone
        }
      }
      rmSync(root, { recursive: true, force: true });
      removeNetns();
    }
    return leftovers;
  };

  return {
    url,
    apiKey,
    dataDir: state,
    env: { ...process.env, HEARTH_URL: url, HEARTH_API_KEY: apiKey },
    log,
    stop,
  };
}
