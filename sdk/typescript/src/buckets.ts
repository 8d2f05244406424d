// Buckets as named credentials (`Bucket`: register, list, get, delete) and the buckets mounted in one sandbox
// (`sbx.mounts`: list, add, remove). The daemon keeps the secret; the guest only ever sees files.

import { Connection, type ConnectionOpts, type RequestOpts } from "./client.js";
import { HearthError } from "./errors.js";
import type { components } from "./generated/openapi.js";

type Schemas = components["schemas"];

/** What `Bucket.create` registers. */
export interface BucketSpec {
  /** 1-63 of `a-z`, `0-9`, `-`. */
  name: string;
  /** `s3://BUCKET` or `s3://BUCKET/PREFIX`: mounts see only what is under the prefix. */
  url: string;
  /** Endpoint of a non-AWS service (MinIO, `https://ACCOUNT.r2.cloudflarestorage.com`). */
  endpoint?: string | undefined;
  /** Default `us-east-1` (R2: `auto`). */
  region?: string | undefined;
  /** Path-style addressing; default true with an endpoint. */
  pathStyle?: boolean | undefined;
  accessKeyId: string;
  secretAccessKey: string;
}

/** A registered bucket (never its secret). */
export interface BucketInfo {
  name: string;
  url: string;
  endpoint?: string | undefined;
  region: string;
  pathStyle: boolean;
  /** The last four characters of the access key id. */
  accessKeyHint: string;
  createdAt: Date;
  /** Sandboxes that mount it now. */
  mountedBy: string[];
}

/** A mount asked for by `Sandbox.create({ mounts })` or `sbx.mounts.add`. */
export interface MountOpts {
  /** Absolute path in the guest, e.g. `/mnt/data` (not `/` nor a system directory). */
  path: string;
  /** A registered bucket's name. */
  bucket: string;
  /** A sub-prefix under the bucket's own prefix, e.g. `runs/42/`. */
  prefix?: string | undefined;
  /** Refuse every change (enforced on the host: writes fail with EROFS). */
  readOnly?: boolean | undefined;
}

/** A bucket mounted in a sandbox. */
export interface MountInfo {
  path: string;
  bucket: string;
  prefix: string;
  readOnly: boolean;
  bytesRead: number;
  bytesWritten: number;
}

function toBucket(b: Schemas["Bucket"]): BucketInfo {
  return {
    name: b.name,
    url: b.url,
    endpoint: b.endpoint ?? undefined,
    region: b.region,
    pathStyle: b.path_style,
    accessKeyHint: b.access_key_hint,
    createdAt: new Date(b.created_at),
    mountedBy: b.mounted_by ?? [],
  };
}

function toMount(m: Schemas["Mount"]): MountInfo {
  return {
    path: m.path,
    bucket: m.bucket,
    prefix: m.prefix,
    readOnly: m.read_only,
    bytesRead: m.bytes_read,
    bytesWritten: m.bytes_written,
  };
}

/** The API's mount body from the SDK's. */
export function mountBody(m: MountOpts): Schemas["MountSpec"] {
  return { path: m.path, bucket: m.bucket, prefix: m.prefix ?? null, read_only: m.readOnly ?? null };
}

/** Registered buckets: static methods only (`Bucket.create(spec)`, `Bucket.list()`, ...). */
export class Bucket {
  private constructor() {}

  /** Registers a bucket; the daemon probes it first (rejects with a `HearthError` whose code is
   * `bucket_not_found`, `bucket_access_denied` or `bucket_unreachable` when the probe fails). */
  static async create(spec: BucketSpec, opts: ConnectionOpts & RequestOpts = {}): Promise<BucketInfo> {
    const conn = new Connection(opts);
    const body: Schemas["CreateBucketRequest"] = {
      name: spec.name,
      url: spec.url,
      endpoint: spec.endpoint ?? null,
      region: spec.region ?? null,
      path_style: spec.pathStyle ?? null,
      access_key_id: spec.accessKeyId,
      secret_access_key: spec.secretAccessKey,
    };
    const { data } = await conn.call(opts, (signal) => conn.api.POST("/v1/buckets", { body, signal }));
    return toBucket(data);
  }

  /** Every registered bucket. */
  static async list(opts: ConnectionOpts & RequestOpts = {}): Promise<BucketInfo[]> {
    const conn = new Connection(opts);
    const { data } = await conn.call(opts, (signal) => conn.api.GET("/v1/buckets", { signal }));
    return data.buckets.map(toBucket);
  }

  /** One bucket (rejects with `NotFoundError` if there is none). */
  static async get(name: string, opts: ConnectionOpts & RequestOpts = {}): Promise<BucketInfo> {
    const conn = new Connection(opts);
    const { data } = await conn.call(opts, (signal) =>
      conn.api.GET("/v1/buckets/{name}", { params: { path: { name } }, signal }),
    );
    return toBucket(data);
  }

  /** Forgets a bucket. Resolves false if there was none; rejects with `ConflictError` while it is mounted. */
  static async delete(name: string, opts: ConnectionOpts & RequestOpts = {}): Promise<boolean> {
    const conn = new Connection(opts);
    try {
      await conn.call(opts, (signal) => conn.api.DELETE("/v1/buckets/{name}", { params: { path: { name } }, signal }));
      return true;
    } catch (err) {
      if (err instanceof HearthError && err.code === "not_found") return false;
      throw err;
    }
  }
}

/** `sbx.mounts`: the buckets mounted in one sandbox. */
export class SandboxMounts {
  /** @internal */
  constructor(
    private readonly conn: Connection,
    private readonly id: string,
  ) {}

  /** The mounts, with the bytes moved through each. */
  async list(opts: RequestOpts = {}): Promise<MountInfo[]> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.GET("/v1/sandboxes/{id}/mounts", { params: { path: { id: this.id } }, signal }),
    );
    return data.mounts.map(toMount);
  }

  /** Mounts a registered bucket at `mount.path` (a paused sandbox is resumed first). */
  async add(mount: MountOpts, opts: RequestOpts = {}): Promise<MountInfo> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.PUT("/v1/sandboxes/{id}/mounts", {
        params: { path: { id: this.id }, query: { path: mount.path } },
        body: { bucket: mount.bucket, prefix: mount.prefix ?? null, read_only: mount.readOnly ?? null },
        signal,
      }),
    );
    return toMount(data);
  }

  /** Unmounts `path` (written data reaches the bucket first). */
  async remove(path: string, opts: RequestOpts = {}): Promise<void> {
    await this.conn.call(opts, (signal) =>
      this.conn.api.DELETE("/v1/sandboxes/{id}/mounts", {
        params: { path: { id: this.id }, query: { path } },
        signal,
      }),
    );
  }
}
