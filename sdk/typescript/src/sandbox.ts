// The `Sandbox` class: create, connect to, list and kill sandboxes; `commands` and `files` hang off an instance.

import { Commands } from "./commands.js";
import { Connection, type ConnectionOpts, type RequestOpts, msToSeconds } from "./client.js";
import { HearthError, errorFromCode } from "./errors.js";
import { Files } from "./files.js";
import { type MountOpts, SandboxMounts, mountBody } from "./buckets.js";
import { type NetworkOpts, SandboxNetwork, policyBody } from "./network.js";
import { Pty } from "./pty.js";
import type { components } from "./generated/openapi.js";
import { readEvents } from "./sse.js";

type Schemas = components["schemas"];

/** Lifecycle state of a sandbox. */
export type SandboxState = Schemas["SandboxState"];

/** A sandbox as the daemon reports it. */
export interface SandboxInfo {
  /** The sandbox id (`sbx_...`). */
  id: string;
  state: SandboxState;
  template: string;
  vcpus: number;
  memoryMib: number;
  metadata: Record<string, string>;
  createdAt: Date;
  /** When the sandbox's timeout destroys it. */
  endAt: Date;
  /** VMM driving it (`qemu` or `firecracker`). */
  vmm: string;
  /** Why it failed, when `state` is `failed`. */
  error?: string | undefined;
  /** Whether calls that need the guest resume it by themselves while it is paused. */
  autoResume: boolean;
  /** What its timeout does: destroy it (`kill`) or pause it (`pause`). */
  onTimeout: OnTimeout;
  /** The sandbox it was forked from. */
  parentId?: string | undefined;
  /** The snapshot it was created from. */
  snapshotId?: string | undefined;
  /** How often its disk is synced to the daemon's storage bucket, in seconds (`diskSyncIntervalMs` at create). */
  diskSyncIntervalS?: number | undefined;
}

/** What `sbx.sync()` captured: a crash-consistent image of the running sandbox's disk. */
export interface DiskSyncInfo {
  sandboxId: string;
  /** Its object in the storage bucket (`sandboxes/<id>/sync`). */
  object: string;
  /** This image's version (its capture time in Unix milliseconds). */
  version: number;
  capturedAt: Date;
  sizeBytes: number;
  /** How long the guest's vCPUs were stopped for the capture. */
  stoppedMs: number;
  /** `reflink` or `sparse`: how the disk file was copied. */
  copy: string;
  /** `pending` (uploading in the background) or `synced`. */
  upload: string;
}

/** A snapshot: a sandbox's running state (memory, devices, disk) at one moment. */
export interface SnapshotInfo {
  /** The snapshot id (`snp_...`). */
  id: string;
  /** The sandbox it was taken from (which may since be gone). */
  sandboxId: string;
  createdAt: Date;
  sizeBytes: number;
  template: string;
  vcpus: number;
  memoryMib: number;
}

function toSnapshot(s: Schemas["SnapshotObject"]): SnapshotInfo {
  return {
    id: s.id,
    sandboxId: s.sandbox_id,
    createdAt: new Date(s.created_at),
    sizeBytes: s.size_bytes,
    template: s.template,
    vcpus: s.vcpus,
    memoryMib: s.memory_mib,
  };
}

/** What a sandbox's timeout does. */
export type OnTimeout = Schemas["OnTimeout"];

/** What happens when a sandbox's timeout passes, and how a paused sandbox comes back. */
export interface SandboxLifecycle {
  /** `kill` (default) destroys the sandbox when its timeout passes; `pause` pauses it instead. */
  onTimeout?: OnTimeout | undefined;
  /**
   * Whether a call that needs the guest (commands, files) resumes a paused sandbox by itself. Default true; with
   * false such calls reject with `ConflictError` until `sbx.resume()` or `Sandbox.connect(id)`.
   */
  autoResume?: boolean | undefined;
}

/** Resource use of one sandbox since its creation. */
export interface SandboxUsage {
  /** Seconds its VM ran (booting, running, pausing, resuming). */
  runningSeconds: number;
  /** Running seconds times vCPUs. */
  vcpuSeconds: number;
  /** Running seconds times guest memory in MiB. */
  mibSeconds: number;
  /** Seconds it was paused (no compute accrues). */
  pausedSeconds: number;
  /** Bytes on disk of its paused state. */
  snapshotBytes: number;
  /** Bytes read from mounted buckets since it was created. */
  bytesRead: number;
  /** Bytes written to mounted buckets since it was created. */
  bytesWritten: number;
}

/** Options of `Sandbox.create`. */
export interface SandboxOpts extends ConnectionOpts, RequestOpts {
  /** Template to start from; the first argument of `create` takes precedence. Default: the daemon's. */
  template?: string | undefined;
  /**
   * Start from this snapshot (`snp_...`, from `sbx.createSnapshot()`) instead of booting a template: the new
   * sandbox continues the snapshot's processes, memory and files (template, vCPUs and memory are the snapshot's).
   */
  snapshot?: string | undefined;
  /** Virtual CPUs (1-16). Default 1. */
  vcpus?: number | undefined;
  /** Guest memory in MiB (128-16384). Default 512. */
  memoryMib?: number | undefined;
  /** Destroy the sandbox after this long (rounded up to seconds; at most 24 h). Default 5 minutes. */
  timeoutMs?: number | undefined;
  /** Environment variables every command in the sandbox starts with. */
  envs?: Record<string, string> | undefined;
  /** Free-form labels, usable as `Sandbox.list` filters. */
  metadata?: Record<string, string> | undefined;
  /** Pause instead of destroy on timeout; whether a paused sandbox resumes by itself. */
  lifecycle?: SandboxLifecycle | undefined;
  /** Egress policy (`{ egress: { default, allow, deny } }`). Default: everything but the always-denied. */
  network?: NetworkOpts | undefined;
  /** Private networks (names or `net_` ids) to attach the sandbox to. */
  networks?: string[] | undefined;
  /** A name unique among live sandboxes: network peers reach it as `<name>.<network>.internal`. */
  name?: string | undefined;
  /** Registered buckets to mount (`Bucket.create`); needs the daemon's networking. */
  mounts?: MountOpts[] | undefined;
  /**
   * Sync the disk to the daemon's storage bucket this often while the sandbox runs (rounded up to seconds; at
   * least 60 s; needs `hearthd --storage`).
   */
  diskSyncIntervalMs?: number | undefined;
  /**
   * Create a new sandbox (cold boot, same template, vCPUs and memory) whose disk is the last one synced from this
   * sandbox (`sbx.sync()`), e.g. after its host lost it.
   */
  fromSync?: string | undefined;
  /**
   * Called while a snapshot, saved template or synced disk the sandbox starts from is fetched from the daemon's
   * storage bucket (its copy left the host's cache); the create then streams its progress.
   */
  onFetch?: ((progress: FetchProgress) => void) | undefined;
}

/** Progress of a fetch from the daemon's storage bucket, for a create or resume whose state left the host. */
export interface FetchProgress {
  /** The object fetched, as `hearth storage status` names it (e.g. `sandboxes/<id>/pause`). */
  object: string;
  doneBytes: number;
  totalBytes: number;
}

/** Options of `sbx.resume()`. */
export interface ResumeOpts extends RequestOpts {
  /** Called while the paused state is fetched from the daemon's storage bucket (see `FetchProgress`). */
  onFetch?: ((progress: FetchProgress) => void) | undefined;
}

/** Options of `Sandbox.connect`. */
export interface ConnectOpts extends ConnectionOpts, RequestOpts {
  /** Resume the sandbox if it is paused (default true). */
  resume?: boolean | undefined;
  /** Called while a resume fetches the paused state from the daemon's storage bucket. */
  onFetch?: ((progress: FetchProgress) => void) | undefined;
}

/**
 * Follows the event stream of a create or resume asked for with `Accept: text/event-stream`: `fetch` events go
 * to `onFetch`, `done` is the sandbox, `failed` its error.
 */
async function startStreamed(
  conn: Connection,
  opts: RequestOpts,
  send: (signal: AbortSignal | undefined) => Promise<{ data?: unknown; error?: unknown; response: Response }>,
  onFetch: (progress: FetchProgress) => void,
): Promise<Schemas["Sandbox"]> {
  const { data: stream, signal } = await conn.call(opts, send);
  if (!stream) throw new HearthError("protocol", "the daemon sent no event stream");
  try {
    for await (const raw of readEvents(stream as ReadableStream<Uint8Array>, signal)) {
      if (raw.event !== "fetch" && raw.event !== "done" && raw.event !== "failed") continue;
      const ev = JSON.parse(raw.data) as Schemas["SandboxStartEvent"];
      if (ev.type === "fetch") {
        onFetch({ object: ev.object, doneBytes: ev.done_bytes, totalBytes: ev.total_bytes });
      } else if (ev.type === "done") {
        return ev.sandbox;
      } else {
        throw errorFromCode(ev.code, ev.message);
      }
    }
  } catch (err) {
    throw conn.transportError(err, opts);
  }
  throw new HearthError("protocol", "the event stream ended before the sandbox ran");
}

/** Options of `Sandbox.list`. */
export interface SandboxListOpts extends ConnectionOpts, RequestOpts {
  /** Only sandboxes in this state. */
  state?: SandboxState | undefined;
  /** Only sandboxes with all of these metadata values. */
  metadata?: Record<string, string> | undefined;
}

function toInfo(s: Schemas["Sandbox"]): SandboxInfo {
  return {
    id: s.id,
    state: s.state,
    template: s.template,
    vcpus: s.vcpus,
    memoryMib: s.memory_mib,
    metadata: s.metadata,
    createdAt: new Date(s.created_at),
    endAt: new Date(s.end_at),
    vmm: s.vmm,
    error: s.error ?? undefined,
    autoResume: s.auto_resume ?? true,
    onTimeout: s.on_timeout ?? "kill",
    parentId: s.parent_id ?? undefined,
    snapshotId: s.snapshot_id ?? undefined,
    diskSyncIntervalS: s.disk_sync_interval_s ?? undefined,
  };
}

/** A sandbox: one microVM with its own kernel, driven through the hearth daemon. */
export class Sandbox {
  /** The sandbox id. */
  readonly id: string;
  /** Run commands and manage processes. */
  readonly commands: Commands;
  /** Read and write files. */
  readonly files: Files;
  /** Egress policy, egress log and exposed ports. */
  readonly network: SandboxNetwork;
  /** The buckets mounted in this sandbox. */
  readonly mounts: SandboxMounts;
  /** Interactive terminals. */
  readonly pty: Pty;
  private readonly conn: Connection;

  private constructor(conn: Connection, id: string) {
    this.conn = conn;
    this.id = id;
    this.commands = new Commands(conn, id);
    this.files = new Files(conn, id);
    this.network = new SandboxNetwork(conn, id);
    this.mounts = new SandboxMounts(conn, id);
    this.pty = new Pty(conn, id);
  }

  /** Same as `id` (the name other sandbox SDKs use). */
  get sandboxId(): string {
    return this.id;
  }

  /** The daemon URL this sandbox is reached through. */
  get url(): string {
    return this.conn.url;
  }

  /** Creates a sandbox and resolves once a command can run in it. */
  static async create(opts?: SandboxOpts): Promise<Sandbox>;
  static async create(template: string, opts?: SandboxOpts): Promise<Sandbox>;
  static async create(templateOrOpts?: string | SandboxOpts, maybeOpts?: SandboxOpts): Promise<Sandbox> {
    const opts = (typeof templateOrOpts === "object" ? templateOrOpts : maybeOpts) ?? {};
    const template = typeof templateOrOpts === "string" ? templateOrOpts : opts.template;
    const conn = new Connection(opts);
    const body: Schemas["CreateSandboxRequest"] = {
      template: template ?? null,
      vcpus: opts.vcpus ?? null,
      memory_mib: opts.memoryMib ?? null,
      timeout_s: opts.timeoutMs === undefined ? null : msToSeconds(opts.timeoutMs, "timeoutMs"),
      env: opts.envs ?? {},
      metadata: opts.metadata ?? {},
      on_timeout: opts.lifecycle?.onTimeout ?? null,
      auto_resume: opts.lifecycle?.autoResume ?? null,
      snapshot: opts.snapshot ?? null,
      network: opts.network ? policyBody(opts.network.egress) : null,
      networks: opts.networks ?? [],
      name: opts.name ?? null,
      mounts: (opts.mounts ?? []).map(mountBody),
      disk_sync_interval_s:
        opts.diskSyncIntervalMs === undefined ? null : msToSeconds(opts.diskSyncIntervalMs, "diskSyncIntervalMs"),
      from_sync: opts.fromSync ?? null,
    };
    if (opts.onFetch) {
      const data = await startStreamed(
        conn,
        opts,
        (signal) =>
          conn.api.POST("/v1/sandboxes", {
            body,
            headers: { Accept: "text/event-stream" },
            parseAs: "stream",
            signal,
          }),
        opts.onFetch,
      );
      return new Sandbox(conn, data.id);
    }
    const { data } = await conn.call(opts, (signal) => conn.api.POST("/v1/sandboxes", { body, signal }));
    // The JSON answer (201); the event-stream variant is only asked for with `Accept: text/event-stream`.
    return new Sandbox(conn, (data as Schemas["Sandbox"]).id);
  }

  /**
   * Connects to an existing sandbox, resuming it if it is paused (unless `resume: false`). Rejects with
   * `NotFoundError` if there is none with this id.
   */
  static async connect(id: string, opts: ConnectOpts = {}): Promise<Sandbox> {
    const sbx = new Sandbox(new Connection(opts), id);
    const info = await sbx.getInfo(opts);
    if ((opts.resume ?? true) && (info.state === "paused" || info.state === "pausing")) await sbx.resume(opts);
    return sbx;
  }

  /** Lists sandboxes, optionally filtered by state and metadata. */
  static async list(opts: SandboxListOpts = {}): Promise<SandboxInfo[]> {
    const conn = new Connection(opts);
    const query = new URLSearchParams();
    if (opts.state) query.set("state", opts.state);
    for (const [k, v] of Object.entries(opts.metadata ?? {})) query.set(`metadata.${k}`, v);
    // Every page: the daemon answers at most 1,000 sandboxes at a time, with a cursor for the next page.
    const all: SandboxInfo[] = [];
    for (;;) {
      const { data } = await conn.call(opts, (signal) =>
        conn.api.GET("/v1/sandboxes", { querySerializer: () => query.toString(), signal }),
      );
      all.push(...data.sandboxes.map(toInfo));
      const next = data.next_cursor;
      if (!next || next === query.get("cursor")) return all;
      query.set("cursor", next);
    }
  }

  /** Destroys a sandbox by id. Resolves false if there was none. */
  static async kill(id: string, opts: ConnectionOpts & RequestOpts = {}): Promise<boolean> {
    return killById(new Connection(opts), id, opts);
  }

  /** Lists snapshots. */
  static async listSnapshots(opts: ConnectionOpts & RequestOpts = {}): Promise<SnapshotInfo[]> {
    const conn = new Connection(opts);
    const { data } = await conn.call(opts, (signal) => conn.api.GET("/v1/snapshots", { signal }));
    return data.snapshots.map(toSnapshot);
  }

  /**
   * Deletes a snapshot. Resolves false if there was none; rejects with `ConflictError` while a sandbox created
   * from it exists.
   */
  static async deleteSnapshot(id: string, opts: ConnectionOpts & RequestOpts = {}): Promise<boolean> {
    const conn = new Connection(opts);
    try {
      await conn.call(opts, (signal) => conn.api.DELETE("/v1/snapshots/{id}", { params: { path: { id } }, signal }));
      return true;
    } catch (err) {
      if (err instanceof HearthError && err.code === "not_found") return false;
      throw err;
    }
  }

  /**
   * Checkpoints the running sandbox into a snapshot (it is stopped only while it is captured). Start new
   * sandboxes from it with `Sandbox.create({ snapshot: id })`.
   */
  async createSnapshot(opts: RequestOpts = {}): Promise<SnapshotInfo> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.POST("/v1/sandboxes/{id}/snapshots", { params: { path: { id: this.id } }, signal }),
    );
    return toSnapshot(data);
  }

  /**
   * Forks the running sandbox into `count` children (1-16, default 1) that continue its processes, memory and
   * files, each with its own disk, hostname and fresh entropy; this sandbox keeps running.
   */
  async fork(opts: RequestOpts & { count?: number } = {}): Promise<Sandbox[]> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.POST("/v1/sandboxes/{id}/fork", {
        params: { path: { id: this.id } },
        body: { count: opts.count ?? null },
        signal,
      }),
    );
    return data.sandboxes.map((s) => new Sandbox(this.conn, s.id));
  }

  /** The sandbox's current state and settings. */
  async getInfo(opts: RequestOpts = {}): Promise<SandboxInfo> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.GET("/v1/sandboxes/{id}", { params: { path: { id: this.id } }, signal }),
    );
    return toInfo(data);
  }

  /** Whether the sandbox exists and is running. */
  async isRunning(opts: RequestOpts = {}): Promise<boolean> {
    try {
      return (await this.getInfo(opts)).state === "running";
    } catch (err) {
      if (err instanceof HearthError && err.code === "not_found") return false;
      throw err;
    }
  }

  /**
   * Pauses the sandbox to zero: its memory and device state go to disk and its VM process ends, so it uses no
   * CPU or memory until resumed (by `resume()`, `Sandbox.connect(id)`, or any call that needs the guest when
   * `autoResume` is on). Processes, memory and files are kept. Resolves with its info (state `paused`).
   */
  async pause(opts: RequestOpts = {}): Promise<SandboxInfo> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.POST("/v1/sandboxes/{id}/pause", { params: { path: { id: this.id } }, signal }),
    );
    return toInfo(data);
  }

  /**
   * Uploads a crash-consistent image of the running sandbox's disk to the daemon's storage bucket: the guest
   * flushes its file systems and is stopped only while its disk file is copied; the upload goes on in the
   * background (`upload: "pending"`). `Sandbox.create({ fromSync: id })` starts a new sandbox from the last image.
   * Rejects with `ConflictError` when the sandbox is paused (its pause holds its disk) or the daemon has no bucket.
   */
  async sync(opts: RequestOpts = {}): Promise<DiskSyncInfo> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.POST("/v1/sandboxes/{id}/sync", { params: { path: { id: this.id } }, signal }),
    );
    return {
      sandboxId: data.sandbox_id,
      object: data.object,
      version: data.version,
      capturedAt: new Date(data.captured_at),
      sizeBytes: data.size_bytes,
      stoppedMs: data.stopped_ms,
      copy: data.copy,
      upload: data.upload,
    };
  }

  /** Resumes a paused sandbox where it was. Resolves with its info (state `running`). */
  async resume(opts: ResumeOpts = {}): Promise<SandboxInfo> {
    const path = { id: this.id };
    if (opts.onFetch) {
      const data = await startStreamed(
        this.conn,
        opts,
        (signal) =>
          this.conn.api.POST("/v1/sandboxes/{id}/resume", {
            params: { path },
            headers: { Accept: "text/event-stream" },
            parseAs: "stream",
            signal,
          }),
        opts.onFetch,
      );
      return toInfo(data);
    }
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.POST("/v1/sandboxes/{id}/resume", { params: { path }, signal }),
    );
    // The JSON answer; the event-stream variant is only asked for with `Accept: text/event-stream`.
    return toInfo(data as Schemas["Sandbox"]);
  }

  /** Resource use since creation: running and paused time, vCPU- and MiB-seconds, bytes of paused state. */
  async getUsage(opts: RequestOpts = {}): Promise<SandboxUsage> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.GET("/v1/sandboxes/{id}/usage", { params: { path: { id: this.id } }, signal }),
    );
    return {
      runningSeconds: data.running_seconds,
      vcpuSeconds: data.vcpu_seconds,
      mibSeconds: data.mib_seconds,
      pausedSeconds: data.paused_seconds,
      snapshotBytes: data.snapshot_bytes,
      bytesRead: data.bytes_read ?? 0,
      bytesWritten: data.bytes_written ?? 0,
    };
  }

  /** Resets the sandbox's timeout: it is destroyed `timeoutMs` from now (rounded up to seconds). */
  async setTimeout(timeoutMs: number, opts: RequestOpts = {}): Promise<SandboxInfo> {
    const timeout_s = msToSeconds(timeoutMs, "timeoutMs");
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.POST("/v1/sandboxes/{id}/timeout", {
        params: { path: { id: this.id } },
        body: { timeout_s },
        signal,
      }),
    );
    return toInfo(data);
  }

  /** Destroys the sandbox. Resolves false if it was already gone. */
  async kill(opts: RequestOpts = {}): Promise<boolean> {
    return killById(this.conn, this.id, opts);
  }
}

async function killById(conn: Connection, id: string, opts: RequestOpts): Promise<boolean> {
  try {
    await conn.call(opts, (signal) => conn.api.DELETE("/v1/sandboxes/{id}", { params: { path: { id } }, signal }));
    return true;
  } catch (err) {
    if (err instanceof HearthError && err.code === "not_found") return false;
    throw err;
  }
}
