// The `Sandbox` class: create, connect to, list and kill sandboxes; `commands` and `files` hang off an instance.

import { Commands } from "./commands.js";
import { Connection, type ConnectionOpts, type RequestOpts, msToSeconds } from "./client.js";
import { HearthError } from "./errors.js";
import { Files } from "./files.js";
import type { components } from "./generated/openapi.js";

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
}

/** Options of `Sandbox.create`. */
export interface SandboxOpts extends ConnectionOpts, RequestOpts {
  /** Template to start from; the first argument of `create` takes precedence. Default: the daemon's. */
  template?: string | undefined;
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
  private readonly conn: Connection;

  private constructor(conn: Connection, id: string) {
    this.conn = conn;
    this.id = id;
    this.commands = new Commands(conn, id);
    this.files = new Files(conn, id);
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
    };
    const { data } = await conn.call(opts, (signal) => conn.api.POST("/v1/sandboxes", { body, signal }));
    return new Sandbox(conn, data.id);
  }

  /** Connects to an existing sandbox. Rejects with `NotFoundError` if there is none with this id. */
  static async connect(id: string, opts: ConnectionOpts & RequestOpts = {}): Promise<Sandbox> {
    const conn = new Connection(opts);
    await conn.call(opts, (signal) => conn.api.GET("/v1/sandboxes/{id}", { params: { path: { id } }, signal }));
    return new Sandbox(conn, id);
  }

  /** Lists sandboxes, optionally filtered by state and metadata. */
  static async list(opts: SandboxListOpts = {}): Promise<SandboxInfo[]> {
    const conn = new Connection(opts);
    const query = new URLSearchParams();
    if (opts.state) query.set("state", opts.state);
    for (const [k, v] of Object.entries(opts.metadata ?? {})) query.set(`metadata.${k}`, v);
    const { data } = await conn.call(opts, (signal) =>
      conn.api.GET("/v1/sandboxes", { querySerializer: () => query.toString(), signal }),
    );
    return data.sandboxes.map(toInfo);
  }

  /** Destroys a sandbox by id. Resolves false if there was none. */
  static async kill(id: string, opts: ConnectionOpts & RequestOpts = {}): Promise<boolean> {
    return killById(new Connection(opts), id, opts);
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
