// Many users on one daemon: projects and their quotas (`Project`), scoped API keys (`ApiKey`), short-lived access
// tokens for browsers and WebSockets (`AccessToken`) and the hash-chained audit log (`AuditLog`). Static methods
// only; keys, quotas and the audit log need an admin key (docs/tenancy.md).

import { Connection, type ConnectionOpts, type RequestOpts } from "./client.js";
import type { components } from "./generated/openapi.js";

type Schemas = components["schemas"];
type Opts = ConnectionOpts & RequestOpts;

/** A project's limits; an absent field is unlimited. */
export interface Quota {
  /** Sandboxes creating, running, pausing or resuming at once. */
  maxRunning?: number | undefined;
  /** Their vCPUs together. */
  maxVcpus?: number | undefined;
  /** Their memory together, in MiB. */
  maxMemoryMib?: number | undefined;
  /** Creates and forks per rolling minute. */
  maxCreatesPerMinute?: number | undefined;
  /** Seconds a sandbox may exist from its create; older ones are destroyed. */
  maxLifetimeS?: number | undefined;
  /** Credits the project may spend; once spent its running sandboxes are paused until it is raised. */
  budgetCredits?: number | undefined;
  /** Bytes of disk its sandboxes, snapshots and saved templates may use; at or over it, creates, forks,
   * snapshots and template saves are refused. */
  maxDiskBytes?: number | undefined;
}

export type Role = Schemas["Role"];

/** A project. */
export interface ProjectInfo {
  name: string;
  createdAt: Date;
  quota: Quota;
}

/** What a project holds against its quota. */
export interface ProjectUsage {
  project: string;
  quota: Quota;
  running: number;
  vcpus: number;
  memoryMib: number;
  /** Credits its sandboxes have spent so far (compare `quota.budgetCredits`). */
  spentCredits: number;
  /** Bytes its sandboxes, snapshots and saved templates use on the host's disk (compare `quota.maxDiskBytes`). */
  diskBytes: number;
}

/** A key as listed (never the secret). */
export type ApiKeyInfo = Schemas["ApiKeyInfo"];
/** One audit log entry. */
export type AuditEntry = Schemas["AuditEntry"];

function fromQuota(q: Schemas["Quota"]): Quota {
  return {
    maxRunning: q.max_running ?? undefined,
    maxVcpus: q.max_vcpus ?? undefined,
    maxMemoryMib: q.max_memory_mib ?? undefined,
    maxCreatesPerMinute: q.max_creates_per_minute ?? undefined,
    maxLifetimeS: q.max_lifetime_s ?? undefined,
    budgetCredits: q.budget_credits ?? undefined,
    maxDiskBytes: q.max_disk_bytes ?? undefined,
  };
}

function toQuota(q: Quota): Schemas["Quota"] {
  return {
    max_running: q.maxRunning ?? null,
    max_vcpus: q.maxVcpus ?? null,
    max_memory_mib: q.maxMemoryMib ?? null,
    max_creates_per_minute: q.maxCreatesPerMinute ?? null,
    max_lifetime_s: q.maxLifetimeS ?? null,
    budget_credits: q.budgetCredits ?? null,
    max_disk_bytes: q.maxDiskBytes ?? null,
  };
}

function toProject(p: Schemas["Project"]): ProjectInfo {
  return { name: p.name, createdAt: new Date(p.created_at), quota: fromQuota(p.quota) };
}

/** Projects: `Project.create(name, quota)`, `Project.list()`, `Project.usage(name)`, `Project.setQuota(...)`. */
export class Project {
  private constructor() {}

  /** Creates a project (admin key). */
  static async create(name: string, quota: Quota = {}, opts: Opts = {}): Promise<ProjectInfo> {
    const conn = new Connection(opts);
    const body: Schemas["CreateProjectRequest"] = { name, quota: toQuota(quota) };
    const { data } = await conn.call(opts, (signal) => conn.api.POST("/v1/projects", { body, signal }));
    return toProject(data);
  }

  /** Every project for an admin key, else the key's own. */
  static async list(opts: Opts = {}): Promise<ProjectInfo[]> {
    const conn = new Connection(opts);
    const { data } = await conn.call(opts, (signal) => conn.api.GET("/v1/projects", { signal }));
    return data.projects.map(toProject);
  }

  /** What a project holds against its quota, and the credits it has spent. */
  static async usage(name: string, opts: Opts = {}): Promise<ProjectUsage> {
    const conn = new Connection(opts);
    const { data } = await conn.call(opts, (signal) =>
      conn.api.GET("/v1/projects/{name}/usage", { params: { path: { name } }, signal }),
    );
    return {
      project: data.project,
      quota: fromQuota(data.quota),
      running: data.running,
      vcpus: data.vcpus,
      memoryMib: data.memory_mib,
      spentCredits: data.spent_credits,
      diskBytes: data.disk_bytes ?? 0,
    };
  }

  /** Replaces a project's quota (admin key; limits not given are lifted). */
  static async setQuota(name: string, quota: Quota, opts: Opts = {}): Promise<ProjectInfo> {
    const conn = new Connection(opts);
    const { data } = await conn.call(opts, (signal) =>
      conn.api.PUT("/v1/projects/{name}/quota", { params: { path: { name } }, body: toQuota(quota), signal }),
    );
    return toProject(data);
  }
}

/** What `ApiKey.create` makes. */
export interface ApiKeySpec {
  project: string;
  role: Role;
  /** Seconds until the key stops working; absent: it does not expire. */
  expiresInS?: number | undefined;
  /** A label for people. */
  name?: string | undefined;
}

/** A new key: `key` is shown this once (the daemon keeps only its hash). */
export interface CreatedApiKey {
  id: string;
  key: string;
  project: string;
  role: Role;
  expiresAt?: Date | undefined;
}

/** API keys (admin key): `ApiKey.create(spec)`, `ApiKey.list()`, `ApiKey.revoke(id)`. */
export class ApiKey {
  private constructor() {}

  static async create(spec: ApiKeySpec, opts: Opts = {}): Promise<CreatedApiKey> {
    const conn = new Connection(opts);
    const body: Schemas["CreateKeyRequest"] = {
      project: spec.project,
      role: spec.role,
      expires_in_s: spec.expiresInS ?? null,
      name: spec.name ?? null,
    };
    const { data } = await conn.call(opts, (signal) => conn.api.POST("/v1/keys", { body, signal }));
    return {
      id: data.id,
      key: data.key,
      project: data.project,
      role: data.role,
      expiresAt: data.expires_at ? new Date(data.expires_at) : undefined,
    };
  }

  static async list(opts: Opts = {}): Promise<ApiKeyInfo[]> {
    const conn = new Connection(opts);
    const { data } = await conn.call(opts, (signal) => conn.api.GET("/v1/keys", { signal }));
    return data.keys;
  }

  /** Revokes a key, effective at once (its access tokens stop working too). */
  static async revoke(id: string, opts: Opts = {}): Promise<void> {
    const conn = new Connection(opts);
    await conn.call(opts, (signal) => conn.api.DELETE("/v1/keys/{id}", { params: { path: { id } }, signal }));
  }
}

/** What `AccessToken.create` mints. */
export interface AccessTokenSpec {
  /** The key's whole project, or one sandbox. Default: the project. */
  sandbox?: string | undefined;
  /** `api` (the /v1 routes), `mcp` (/mcp only) or `pty` (the terminal route only). */
  purpose: Schemas["TokenPurpose"];
  /** Lifetime in seconds (1-3600, default 300). */
  ttlS?: number | undefined;
  /** At most the minting key's role (the default). */
  role?: Role | undefined;
}

/** Short-lived signed tokens for browsers and WebSocket clients, presented like a key (never in a URL). */
export class AccessToken {
  private constructor() {}

  static async create(spec: AccessTokenSpec, opts: Opts = {}): Promise<{ token: string; expiresAt: Date }> {
    const conn = new Connection(opts);
    const body: Schemas["CreateTokenRequest"] = {
      scope: spec.sandbox === undefined ? "project" : { sandbox: spec.sandbox },
      purpose: spec.purpose,
      ttl_s: spec.ttlS ?? null,
      role: spec.role ?? null,
    };
    const { data } = await conn.call(opts, (signal) => conn.api.POST("/v1/tokens", { body, signal }));
    return { token: data.token, expiresAt: new Date(data.expires_at) };
  }
}

/** Filters of the audit log. */
export interface AuditFilter {
  /** Entries after this sequence number. */
  after?: number | undefined;
  project?: string | undefined;
  keyId?: string | undefined;
  /** Only entries at or after this unix millisecond. */
  sinceMs?: number | undefined;
}

/** The audit log (admin key): `AuditLog.page(filter)`, `AuditLog.all(filter)`. */
export class AuditLog {
  private constructor() {}

  /** One page (at most `limit`, 1-1000, default 100) and the `after` of the next one. */
  static async page(
    filter: AuditFilter & { limit?: number | undefined } = {},
    opts: Opts = {},
  ): Promise<{ entries: AuditEntry[]; nextAfter?: number | undefined }> {
    const conn = new Connection(opts);
    const query = {
      after: filter.after,
      limit: filter.limit,
      project: filter.project,
      key_id: filter.keyId,
      since_ms: filter.sinceMs,
    };
    const { data } = await conn.call(opts, (signal) => conn.api.GET("/v1/audit", { params: { query }, signal }));
    return { entries: data.entries, nextAfter: data.next_after ?? undefined };
  }

  /** Every entry matching `filter`, page by page, in sequence order. */
  static async all(filter: AuditFilter = {}, opts: Opts = {}): Promise<AuditEntry[]> {
    const out: AuditEntry[] = [];
    let after = filter.after;
    for (;;) {
      const page = await AuditLog.page({ ...filter, after, limit: 1000 }, opts);
      out.push(...page.entries);
      if (page.nextAfter === undefined) return out;
      after = page.nextAfter;
    }
  }
}
