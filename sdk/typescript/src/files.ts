// `sbx.files`: the sandbox's file system. Content streams both ways; paths are absolute paths in the guest.

import type { Connection, RequestBody, RequestOpts } from "./client.js";
import { HearthError } from "./errors.js";
import type { components } from "./generated/openapi.js";
import { readAll } from "./sse.js";
import { type FilesystemEvent, type WatchHandle, type WatchOpts, watchDir } from "./watch.js";

type Schemas = components["schemas"];

/** Kind of a file-system entry. */
export type FileType = Schemas["FileKind"];

/** Metadata of a file-system entry in the guest. */
export interface EntryInfo {
  /** Base name. */
  name: string;
  /** Absolute path. */
  path: string;
  type: FileType;
  size: number;
  /** Permission bits (e.g. `0o644`). */
  mode: number;
  modifiedTime: Date;
  /** Target of a symlink. */
  symlinkTarget?: string | undefined;
}

/** What `files.write` accepts as content. A stream is uploaded as it is read. */
export type FileData = string | Uint8Array | ArrayBuffer | Blob | ReadableStream<Uint8Array>;

/** One file of a multi-file `files.write`. */
export interface WriteEntry {
  path: string;
  data: FileData;
}

function toEntry(f: Schemas["FileInfo"]): EntryInfo {
  return {
    name: f.name,
    path: f.path,
    type: f.kind,
    size: f.size,
    mode: f.mode,
    modifiedTime: new Date(f.mtime * 1000),
    symlinkTarget: f.link_target ?? undefined,
  };
}

function toBody(data: FileData): RequestBody {
  if (typeof data === "string") return new TextEncoder().encode(data);
  return data as RequestBody;
}

/** Reads and writes files in one sandbox (`sbx.files`). */
export class Files {
  private readonly conn: Connection;
  private readonly sandboxId: string;

  /** @internal */
  constructor(conn: Connection, sandboxId: string) {
    this.conn = conn;
    this.sandboxId = sandboxId;
  }

  /** Reads a file: as UTF-8 text (default), as bytes, or as a stream of chunks. */
  read(path: string, opts?: RequestOpts & { format?: "text" }): Promise<string>;
  read(path: string, opts: RequestOpts & { format: "bytes" }): Promise<Uint8Array>;
  read(path: string, opts: RequestOpts & { format: "stream" }): Promise<ReadableStream<Uint8Array>>;
  async read(
    path: string,
    opts: RequestOpts & { format?: "text" | "bytes" | "stream" } = {},
  ): Promise<string | Uint8Array | ReadableStream<Uint8Array>> {
    const { data: body, signal } = await this.conn.call(opts, (signal) =>
      this.conn.api.GET("/v1/sandboxes/{id}/files", {
        params: { path: { id: this.sandboxId }, query: { path } },
        parseAs: "stream",
        signal,
      }),
    );
    // An empty file comes back without a body.
    const stream = (body as ReadableStream<Uint8Array> | null | undefined) ?? new Blob([]).stream();
    if (opts.format === "stream") return stream;
    let bytes: Uint8Array;
    try {
      bytes = await readAll(stream, signal);
    } catch (err) {
      throw this.conn.transportError(err, opts);
    }
    return opts.format === "bytes" ? bytes : new TextDecoder().decode(bytes);
  }

  /**
   * Writes one file (created or truncated; missing parent directories are created), or several given as
   * `[{ path, data }]`. Resolves with the written entries' metadata.
   */
  write(path: string, data: FileData, opts?: RequestOpts): Promise<EntryInfo>;
  write(files: WriteEntry[], opts?: RequestOpts): Promise<EntryInfo[]>;
  async write(
    pathOrFiles: string | WriteEntry[],
    dataOrOpts?: FileData | RequestOpts,
    maybeOpts?: RequestOpts,
  ): Promise<EntryInfo | EntryInfo[]> {
    if (Array.isArray(pathOrFiles)) {
      const opts = (dataOrOpts as RequestOpts | undefined) ?? {};
      const written: EntryInfo[] = [];
      for (const f of pathOrFiles) written.push(await this.writeOne(f.path, f.data, opts));
      return written;
    }
    if (dataOrOpts === undefined) throw new TypeError("files.write(path, data): data is missing");
    return this.writeOne(pathOrFiles, dataOrOpts as FileData, maybeOpts ?? {});
  }

  private async writeOne(path: string, data: FileData, opts: RequestOpts): Promise<EntryInfo> {
    const parent = path.replace(/\/+[^/]*$/, "");
    if (parent && parent !== path) await this.makeDir(parent, opts);
    const body = toBody(data);
    const { data: info } = await this.conn.call(opts, (signal) =>
      this.conn.api.PUT("/v1/sandboxes/{id}/files", {
        params: { path: { id: this.sandboxId }, query: { path } },
        // Raw bytes; the generated type describes them as a number array.
        body: body as unknown as number[],
        bodySerializer: (b: unknown) => b as RequestBody,
        headers: { "Content-Type": "application/octet-stream" },
        // Needed by fetch to send a stream as a request body.
        ...(body instanceof ReadableStream ? { duplex: "half" } : {}),
        signal,
      }),
    );
    return toEntry(info);
  }

  /** Lists a directory's entries, sorted by name. */
  async list(path: string, opts: RequestOpts = {}): Promise<EntryInfo[]> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.GET("/v1/sandboxes/{id}/files/list", {
        params: { path: { id: this.sandboxId }, query: { path } },
        signal,
      }),
    );
    return data.entries.map(toEntry);
  }

  /** Creates a directory and its missing parents. Resolves false if it already existed. */
  async makeDir(path: string, opts: RequestOpts = {}): Promise<boolean> {
    const existing = await this.stat(path, opts);
    if (existing?.type === "dir") return false;
    await this.conn.call(opts, (signal) =>
      this.conn.api.POST("/v1/sandboxes/{id}/files/mkdir", {
        params: { path: { id: this.sandboxId } },
        body: { path, parents: true },
        signal,
      }),
    );
    return true;
  }

  /** Removes a file, symlink or directory (with everything in it unless `recursive: false`). */
  async remove(path: string, opts: RequestOpts & { recursive?: boolean } = {}): Promise<void> {
    await this.conn.call(opts, (signal) =>
      this.conn.api.DELETE("/v1/sandboxes/{id}/files", {
        params: { path: { id: this.sandboxId }, query: { path, recursive: opts.recursive ?? true } },
        signal,
      }),
    );
  }

  /** Renames (moves) an entry. Resolves with the metadata at its new path. */
  async rename(oldPath: string, newPath: string, opts: RequestOpts = {}): Promise<EntryInfo> {
    await this.conn.call(opts, (signal) =>
      this.conn.api.POST("/v1/sandboxes/{id}/files/rename", {
        params: { path: { id: this.sandboxId } },
        body: { from: oldPath, to: newPath },
        signal,
      }),
    );
    return this.getInfo(newPath, opts);
  }

  /** Whether an entry exists at `path`. */
  async exists(path: string, opts: RequestOpts = {}): Promise<boolean> {
    return (await this.stat(path, opts)) !== undefined;
  }

  /** Metadata of the entry at `path`. */
  async getInfo(path: string, opts: RequestOpts = {}): Promise<EntryInfo> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.GET("/v1/sandboxes/{id}/files/stat", {
        params: { path: { id: this.sandboxId }, query: { path } },
        signal,
      }),
    );
    return toEntry(data);
  }

  /**
   * Watches a directory: `onEvent` gets every change (`create`, `write`, `remove`, `rename`, `chmod`, and
   * `overflow` if events were lost) with paths relative to `path`. Resolves once the watch is in place, so every
   * change made after that is reported; `handle.stop()` (or `opts.signal`) ends it.
   */
  async watchDir(
    path: string,
    onEvent: (event: FilesystemEvent) => void | Promise<void>,
    opts: WatchOpts = {},
  ): Promise<WatchHandle> {
    return watchDir(this.conn, this.sandboxId, path, onEvent, opts);
  }

  /** `getInfo`, or undefined when nothing is at `path` (a missing sandbox still rejects with NotFoundError). */
  private async stat(path: string, opts: RequestOpts): Promise<EntryInfo | undefined> {
    try {
      return await this.getInfo(path, opts);
    } catch (err) {
      if (!(err instanceof HearthError && err.code === "not_found")) throw err;
    }
    // Both a missing file and a missing sandbox answer not_found: ask about the sandbox to tell them apart.
    await this.conn.call(opts, (signal) =>
      this.conn.api.GET("/v1/sandboxes/{id}", { params: { path: { id: this.sandboxId } }, signal }),
    );
    return undefined;
  }
}
