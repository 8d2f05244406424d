// `sbx.files.watchDir`: a directory's changes as server-sent events (`GET .../files/watch`), delivered to a
// callback until the handle is stopped, the caller's signal aborts, or the directory goes away.

import type { Connection, RequestOpts } from "./client.js";
import { HearthError, errorFromCode } from "./errors.js";
import type { components } from "./generated/openapi.js";
import { readEvents } from "./sse.js";

type WireEvent = components["schemas"]["WatchEvent"];

/** What happened to an entry of a watched directory. */
export type FilesystemEventType = "create" | "write" | "remove" | "rename" | "chmod" | "overflow";

/** One change in a watched directory. */
export interface FilesystemEvent {
  type: FilesystemEventType;
  /** Path relative to the watched directory (`sub/file.txt`); empty for `overflow`. */
  name: string;
  /** For `rename`: the new path, when the entry is still inside the watched directory. */
  newName?: string | undefined;
  /** The entry is a directory. */
  isDir: boolean;
}

/** Options of `files.watchDir`. */
export interface WatchOpts extends Pick<RequestOpts, "signal"> {
  /** Watch subdirectories too, including ones created while watching. Default false. */
  recursive?: boolean | undefined;
  /** Called once when the watch ends: without an error after `stop()` or when the directory was removed. */
  onExit?: ((err?: unknown) => void) | undefined;
}

/** A running watch, from `files.watchDir`. */
export class WatchHandle {
  /** Settles when the watch ends: resolves after `stop()` or when the directory was removed, rejects on errors. */
  readonly done: Promise<void>;
  private readonly controller: AbortController;

  /** @internal */
  constructor(controller: AbortController, done: Promise<void>) {
    this.controller = controller;
    this.done = done;
    // Nobody has to await `done`: a failure is also reported to `onExit`.
    done.catch(() => undefined);
  }

  /** Stops watching (the daemon stops the watch in the guest). Resolves once the stream is closed. */
  async stop(): Promise<void> {
    this.controller.abort();
    await this.done.catch(() => undefined);
  }
}

function toEvent(ev: WireEvent): FilesystemEvent | undefined {
  switch (ev.type) {
    case "create":
    case "remove":
    case "chmod":
      return { type: ev.type, name: ev.path, isDir: ev.is_dir ?? false };
    case "write":
      return { type: "write", name: ev.path, isDir: false };
    case "rename":
      return { type: "rename", name: ev.path, newName: ev.new_path ?? undefined, isDir: ev.is_dir ?? false };
    case "overflow":
      return { type: "overflow", name: "", isDir: false };
    default:
      return undefined;
  }
}

/** @internal Opens the watch and resolves once it is in place (after the daemon's `ready` event). */
export async function watchDir(
  conn: Connection,
  sandboxId: string,
  path: string,
  onEvent: (event: FilesystemEvent) => void | Promise<void>,
  opts: WatchOpts,
): Promise<WatchHandle> {
  const controller = new AbortController();
  const signal = opts.signal ? AbortSignal.any([opts.signal, controller.signal]) : controller.signal;
  // No request timeout: the stream lasts as long as the watch.
  const callOpts: RequestOpts = { signal, requestTimeoutMs: 0 };
  const { data: body } = await conn.call(callOpts, (s) =>
    conn.api.GET("/v1/sandboxes/{id}/files/watch", {
      params: { path: { id: sandboxId }, query: { path, recursive: opts.recursive ?? false } },
      headers: { Accept: "text/event-stream" },
      parseAs: "stream",
      signal: s,
    }),
  );
  if (!body) throw new HearthError("protocol", "the daemon sent no event stream");
  const events = readEvents(body as ReadableStream<Uint8Array>, signal);
  let first: IteratorResult<{ event: string; data: string }>;
  try {
    first = await events.next();
  } catch (err) {
    throw conn.transportError(err, callOpts);
  }
  if (first.done || (JSON.parse(first.value.data) as WireEvent).type !== "ready") {
    await events.return(undefined);
    throw new HearthError("protocol", "the watch stream did not start with a ready event");
  }

  const run = async (): Promise<void> => {
    try {
      for await (const raw of events) {
        const ev = JSON.parse(raw.data) as WireEvent;
        if (ev.type === "end") return;
        if (ev.type === "error") throw errorFromCode(ev.code, ev.message);
        const out = toEvent(ev);
        if (out) await onEvent(out);
      }
    } catch (err) {
      // `stop()` is a normal end; the caller's own signal rejects with its reason.
      if (controller.signal.aborted && !opts.signal?.aborted) return;
      throw conn.transportError(err, { signal: opts.signal });
    }
    if (!controller.signal.aborted) throw new HearthError("protocol", "the watch stream ended without an end event");
  };
  const done = run().then(
    () => opts.onExit?.(),
    (err: unknown) => {
      opts.onExit?.(err);
      throw err;
    },
  );
  return new WatchHandle(controller, done);
}
