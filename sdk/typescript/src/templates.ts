// `Template`: list the daemon's templates, save a sandbox as one, build one from a recipe, delete one.

import { Connection, type ConnectionOpts, type RequestOpts } from "./client.js";
import { HearthError, errorFromCode } from "./errors.js";
import type { components } from "./generated/openapi.js";
import { readEvents } from "./sse.js";

type Schemas = components["schemas"];

/** A template: the root filesystem (and optionally the running memory) new sandboxes start from. */
export interface TemplateInfo {
  name: string;
  /** Built with the host (`images/build.sh`); cannot be deleted through the API. */
  builtin: boolean;
  /** The sandbox it was saved from. */
  fromSandbox?: string | undefined;
  /** Set when the template keeps running memory: its sandboxes start by restore, with its processes running. */
  snapshotId?: string | undefined;
  sizeBytes: number;
  /** Absent for built-in templates. */
  createdAt?: Date | undefined;
}

/** How to build a template: start from `base`, run `steps` (each with `/bin/sh -c`) in order, then optionally
 * start `startCmd` in the background and wait until `readyCmd` succeeds (the template then keeps the memory). */
export interface Recipe {
  base: string;
  steps: string[];
  envs?: Record<string, string> | undefined;
  startCmd?: string | undefined;
  readyCmd?: string | undefined;
}

/** A progress event of `Template.build` (see the API's `TemplateBuildEvent`). */
export type TemplateBuildEvent = Schemas["TemplateBuildEvent"];

/** Options of `Template.fromSandbox`. */
export interface FromSandboxOpts extends ConnectionOpts, RequestOpts {
  /** Name of the new template (`[a-z0-9-]`, 1-63 characters). */
  name: string;
  /** Also keep the sandbox's running memory: sandboxes of this template start with its processes running. */
  memory?: boolean | undefined;
}

/** Options of `Template.build`. */
export interface BuildOpts extends ConnectionOpts, RequestOpts {
  /** Called with each progress event (phases, each step's start, output lines and exit). */
  onEvent?: ((event: TemplateBuildEvent) => void) | undefined;
}

function toInfo(t: Schemas["Template"]): TemplateInfo {
  return {
    name: t.name,
    builtin: t.builtin,
    fromSandbox: t.from_sandbox ?? undefined,
    snapshotId: t.snapshot_id ?? undefined,
    sizeBytes: t.size_bytes,
    createdAt: t.created_at ? new Date(t.created_at) : undefined,
  };
}

/** Templates of the daemon: static methods only (`Template.list()`, `Template.fromSandbox(...)`, ...). */
export class Template {
  private constructor() {}

  /** Every template: the built-in ones and those saved or built through the API. */
  static async list(opts: ConnectionOpts & RequestOpts = {}): Promise<TemplateInfo[]> {
    const conn = new Connection(opts);
    const { data } = await conn.call(opts, (signal) => conn.api.GET("/v1/templates", { signal }));
    return data.templates.map(toInfo);
  }

  /** One template by name (rejects with `NotFoundError` if there is none). */
  static async get(name: string, opts: ConnectionOpts & RequestOpts = {}): Promise<TemplateInfo> {
    const conn = new Connection(opts);
    const { data } = await conn.call(opts, (signal) =>
      conn.api.GET("/v1/templates/{name}", { params: { path: { name } }, signal }),
    );
    return toInfo(data);
  }

  /**
   * Saves a running sandbox (a `Sandbox` or its id) as a template; the sandbox keeps running. With
   * `memory: true` its running memory is kept too.
   */
  static async fromSandbox(sandbox: string | { id: string }, opts: FromSandboxOpts): Promise<TemplateInfo> {
    const conn = new Connection(connectionOf(sandbox, opts));
    const body: Schemas["CreateTemplateRequest"] = {
      name: opts.name,
      from_sandbox: typeof sandbox === "string" ? sandbox : sandbox.id,
      include_memory: opts.memory ?? false,
    };
    const { data } = await conn.call(opts, (signal) => conn.api.POST("/v1/templates", { body, signal }));
    // The JSON answer (201); the event-stream variant is only asked for with `Accept: text/event-stream`.
    return toInfo(data as Schemas["Template"]);
  }

  /**
   * Builds a template from a recipe in a build sandbox (destroyed afterwards). A failing step rejects with an
   * error whose message carries that step's output.
   */
  static async build(name: string, recipe: Recipe, opts: BuildOpts = {}): Promise<TemplateInfo> {
    const conn = new Connection(opts);
    const body: Schemas["CreateTemplateRequest"] = {
      name,
      recipe: {
        base: recipe.base,
        steps: recipe.steps,
        env: recipe.envs ?? {},
        start_cmd: recipe.startCmd ?? null,
        ready_cmd: recipe.readyCmd ?? null,
      },
    };
    if (!opts.onEvent) {
      const { data } = await conn.call(opts, (signal) => conn.api.POST("/v1/templates", { body, signal }));
      return toInfo(data as Schemas["Template"]);
    }
    const { data: stream, signal } = await conn.call(opts, (signal) =>
      conn.api.POST("/v1/templates", {
        body,
        headers: { Accept: "text/event-stream" },
        parseAs: "stream",
        signal,
      }),
    );
    if (!stream) throw new HearthError("protocol", "the daemon sent no event stream");
    try {
      for await (const raw of readEvents(stream as ReadableStream<Uint8Array>, signal)) {
        const ev = JSON.parse(raw.data) as TemplateBuildEvent;
        opts.onEvent(ev);
        if (ev.type === "done") return toInfo(ev.template);
        if (ev.type === "failed") throw errorFromCode(ev.code, ev.message);
      }
    } catch (err) {
      throw conn.transportError(err, opts);
    }
    throw new HearthError("protocol", "the build's event stream ended before done or failed");
  }

  /** Deletes a saved template. Resolves false if there was none; rejects with `ConflictError` for built-in
   * templates and while sandboxes use it. */
  static async delete(name: string, opts: ConnectionOpts & RequestOpts = {}): Promise<boolean> {
    const conn = new Connection(opts);
    try {
      await conn.call(opts, (signal) =>
        conn.api.DELETE("/v1/templates/{name}", { params: { path: { name } }, signal }),
      );
      return true;
    } catch (err) {
      if (err instanceof HearthError && err.code === "not_found") return false;
      throw err;
    }
  }
}

/** A `Sandbox` passed in brings its connection (daemon URL and key) unless the options name them. */
function connectionOf(sandbox: string | { id: string }, opts: ConnectionOpts): ConnectionOpts {
  // `Sandbox.conn` is private to the SDK's public surface, not to the SDK.
  const own = typeof sandbox === "string" ? undefined : (sandbox as { conn?: Connection }).conn?.opts;
  return { ...own, ...definedOnly(opts) };
}

function definedOnly(opts: ConnectionOpts): ConnectionOpts {
  return Object.fromEntries(Object.entries(opts).filter(([, v]) => v !== undefined)) as ConnectionOpts;
}
