// `sbx.commands`: run commands (buffered, streamed over SSE, or in the background) and manage processes.

import { type Connection, type RequestBody, type RequestOpts, msToSeconds } from "./client.js";
import {
  type CommandResult,
  CommandExitError,
  HearthError,
  InvalidArgumentError,
  TimeoutError,
  errorFromCode,
} from "./errors.js";
import type { components } from "./generated/openapi.js";
import { readEvents } from "./sse.js";

type Schemas = components["schemas"];

/** Options of `commands.run`. */
export interface CommandOpts extends RequestOpts {
  /** Working directory in the guest. Default `/root`. */
  cwd?: string | undefined;
  /** Extra environment variables, added to the sandbox's own. */
  envs?: Record<string, string> | undefined;
  /**
   * Kill the command after this long (rejects with `TimeoutError`). Rounded up to whole seconds. Default: 60 s
   * for a foreground command, none for a background one. `0` means the longest the daemon allows (24 h).
   */
  timeoutMs?: number | undefined;
  /** Text written to the command's stdin, which is then closed. */
  stdin?: string | undefined;
  /** Start the command and resolve at once with a `CommandHandle`. */
  background?: boolean | undefined;
  /** Called with each chunk of stdout as it arrives (streams the command over server-sent events). */
  onStdout?: ((data: string) => void) | undefined;
  /** Called with each chunk of stderr as it arrives (streams the command over server-sent events). */
  onStderr?: ((data: string) => void) | undefined;
}

/** A process started by the agent, as `commands.list()` reports it. */
export interface ProcessInfo {
  pid: number;
  /** The command line as started. */
  cmd: string;
  background: boolean;
  /** Set once the process has exited. */
  exitCode: number | undefined;
}

/** Options of `CommandHandle.wait`. */
export interface WaitOpts extends RequestOpts {
  /** Give up after this long (rejects with `TimeoutError`; the process keeps running). Default: no limit. */
  timeoutMs?: number | undefined;
}

function toResult(r: Schemas["CommandResult"]): CommandResult {
  return {
    exitCode: r.exit_code,
    stdout: r.stdout,
    stderr: r.stderr,
    signal: r.signal ?? undefined,
    timedOut: r.timed_out ?? false,
    truncated: r.truncated ?? false,
  };
}

/** Throws for a command that timed out or failed; returns the result of one that exited 0. */
function checkResult(result: CommandResult): CommandResult {
  if (result.timedOut) {
    const err = new TimeoutError("timeout", "the command was killed because its timeout expired");
    throw Object.assign(err, { result });
  }
  if (result.exitCode !== 0) throw new CommandExitError(result);
  return result;
}

/** A background command. */
export class CommandHandle {
  /** The process id in the guest. */
  readonly pid: number;
  private readonly conn: Connection;
  private readonly sandboxId: string;

  /** @internal */
  constructor(conn: Connection, sandboxId: string, pid: number) {
    this.conn = conn;
    this.sandboxId = sandboxId;
    this.pid = pid;
  }

  /**
   * Waits for the process to exit. Resolves with its result (the tails of its output) when it exited 0, rejects
   * with `CommandExitError` otherwise.
   */
  async wait(opts: WaitOpts = {}): Promise<CommandResult> {
    const timeout_s = opts.timeoutMs === undefined ? undefined : msToSeconds(opts.timeoutMs, "timeoutMs");
    let data: Schemas["CommandResult"];
    try {
      ({ data } = await this.conn.call(opts, (signal) =>
        this.conn.api.POST("/v1/sandboxes/{id}/processes/{pid}/wait", {
          params: { path: { id: this.sandboxId, pid: this.pid }, query: { timeout_s } },
          signal,
        }),
      ));
    } catch (err) {
      if (timeout_s !== undefined && err instanceof HearthError && err.code === "conflict") {
        throw new TimeoutError("timeout", `process ${this.pid} still runs after ${timeout_s} s`, err.status);
      }
      throw err;
    }
    return checkResult(toResult(data));
  }

  /** Sends a signal (default SIGKILL) to the process and its group. Resolves false if it no longer exists. */
  async kill(opts: RequestOpts & { sig?: number } = {}): Promise<boolean> {
    return killProcess(this.conn, this.sandboxId, this.pid, opts);
  }

  /** Writes to the process' stdin; `eof: true` closes it afterwards. */
  async sendStdin(data: string | Uint8Array, opts: RequestOpts & { eof?: boolean } = {}): Promise<void> {
    return sendStdin(this.conn, this.sandboxId, this.pid, data, opts);
  }
}

async function killProcess(
  conn: Connection,
  id: string,
  pid: number,
  opts: RequestOpts & { sig?: number },
): Promise<boolean> {
  try {
    await conn.call(opts, (signal) =>
      conn.api.POST("/v1/sandboxes/{id}/processes/{pid}/kill", {
        params: { path: { id, pid } },
        body: { signal: opts.sig ?? null },
        signal,
      }),
    );
    return true;
  } catch (err) {
    if (err instanceof HearthError && err.code === "not_found") {
      // Distinguish a gone process from a gone sandbox: only the first is a plain `false`.
      const { data } = await conn.call(opts, (signal) =>
        conn.api.GET("/v1/sandboxes/{id}/processes", { params: { path: { id } }, signal }),
      );
      if (!data.processes.some((p) => p.pid === pid && p.exit_code == null)) return false;
    }
    throw err;
  }
}

async function sendStdin(
  conn: Connection,
  id: string,
  pid: number,
  data: string | Uint8Array,
  opts: RequestOpts & { eof?: boolean },
): Promise<void> {
  const bytes = typeof data === "string" ? new TextEncoder().encode(data) : data;
  await conn.call(opts, (signal) =>
    conn.api.POST("/v1/sandboxes/{id}/processes/{pid}/stdin", {
      params: { path: { id, pid }, query: { eof: opts.eof ?? false } },
      // The route takes raw bytes; the generated type describes them as a number array.
      body: bytes as unknown as number[],
      bodySerializer: (b: unknown) => b as RequestBody,
      headers: { "Content-Type": "application/octet-stream" },
      signal,
    }),
  );
}

/** Runs and manages processes in one sandbox (`sbx.commands`). */
export class Commands {
  private readonly conn: Connection;
  private readonly sandboxId: string;

  /** @internal */
  constructor(conn: Connection, sandboxId: string) {
    this.conn = conn;
    this.sandboxId = sandboxId;
  }

  /**
   * Runs `cmd` (a shell command line, or an argv array run without a shell). Resolves with `{ exitCode, stdout,
   * stderr }` when it exits 0; rejects with `CommandExitError` on another exit code and `TimeoutError` when
   * `timeoutMs` expired. With `onStdout`/`onStderr` the output is streamed to them as it is produced.
   */
  run(cmd: string | string[], opts: CommandOpts & { background: true }): Promise<CommandHandle>;
  run(cmd: string | string[], opts?: CommandOpts & { background?: false | undefined }): Promise<CommandResult>;
  run(cmd: string | string[], opts?: CommandOpts): Promise<CommandResult | CommandHandle>;
  async run(cmd: string | string[], opts: CommandOpts = {}): Promise<CommandResult | CommandHandle> {
    const body: Schemas["RunCommandRequest"] = {
      ...(Array.isArray(cmd) ? { argv: cmd } : { cmd }),
      cwd: opts.cwd ?? null,
      env: opts.envs ?? {},
      stdin: opts.stdin ?? null,
      background: opts.background ?? false,
    };
    if (opts.timeoutMs !== undefined) {
      body.timeout_s = opts.timeoutMs === 0 ? 86_400 : msToSeconds(opts.timeoutMs, "timeoutMs");
    }
    if (opts.background) {
      if (opts.onStdout || opts.onStderr) {
        throw new InvalidArgumentError(
          "invalid_argument",
          "onStdout/onStderr need a foreground command; read a background command's output from wait()",
        );
      }
      const { data, response } = await this.conn.call(opts, (signal) =>
        this.conn.api.POST("/v1/sandboxes/{id}/commands", {
          params: { path: { id: this.sandboxId } },
          body,
          signal,
        }),
      );
      const pid = (data as Partial<Schemas["BackgroundStarted"]>).pid;
      if (response.status !== 202 || typeof pid !== "number") {
        throw new HearthError("protocol", `unexpected answer to a background start (HTTP ${response.status})`);
      }
      return new CommandHandle(this.conn, this.sandboxId, pid);
    }
    // Streaming also tells the pid, so that a cancelled or timed-out call can kill its command.
    if (opts.onStdout || opts.onStderr || this.conn.cancellable(opts)) return checkResult(await this.stream(body, opts));
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.POST("/v1/sandboxes/{id}/commands", {
        params: { path: { id: this.sandboxId } },
        body,
        signal,
      }),
    );
    return checkResult(toResult(data as Schemas["CommandResult"]));
  }

  /**
   * Runs a command over the SSE route, calling back per chunk and collecting the whole output. When the call is
   * aborted or its request timeout expires after the command started, the command is killed (SIGKILL).
   */
  private async stream(body: Schemas["RunCommandRequest"], opts: CommandOpts): Promise<CommandResult> {
    const { data: events, signal } = await this.conn.call(opts, (signal) =>
      this.conn.api.POST("/v1/sandboxes/{id}/commands", {
        params: { path: { id: this.sandboxId } },
        body,
        headers: { Accept: "text/event-stream" },
        parseAs: "stream",
        signal,
      }),
    );
    if (!events) throw new HearthError("protocol", "the daemon sent no event stream");
    const out = { stdout: new TextDecoder(), stderr: new TextDecoder() };
    let stdout = "";
    let stderr = "";
    let pid: number | undefined;
    try {
      for await (const ev of readEvents(events, signal)) {
        const msg = JSON.parse(ev.data) as Schemas["CommandEvent"];
        switch (msg.type) {
          case "stdout": {
            const text = out.stdout.decode(Buffer.from(msg.data_b64, "base64"), { stream: true });
            stdout += text;
            if (text) opts.onStdout?.(text);
            break;
          }
          case "stderr": {
            const text = out.stderr.decode(Buffer.from(msg.data_b64, "base64"), { stream: true });
            stderr += text;
            if (text) opts.onStderr?.(text);
            break;
          }
          case "exit": {
            const restOut = out.stdout.decode();
            const restErr = out.stderr.decode();
            if (restOut) opts.onStdout?.(restOut);
            if (restErr) opts.onStderr?.(restErr);
            return {
              exitCode: msg.exit_code,
              stdout: stdout + restOut,
              stderr: stderr + restErr,
              signal: msg.signal ?? undefined,
              timedOut: msg.timed_out ?? false,
              truncated: false,
            };
          }
          case "start":
            pid = msg.pid;
            break;
          case "error":
            throw errorFromCode(msg.code, msg.message);
          default:
            break; // event kinds newer than this SDK
        }
      }
    } catch (err) {
      const mapped = this.conn.transportError(err, opts);
      const cancelled = opts.signal?.aborted || mapped instanceof TimeoutError;
      if (cancelled && pid !== undefined) {
        await killProcess(this.conn, this.sandboxId, pid, { requestTimeoutMs: 10_000 }).catch(() => undefined);
      }
      throw mapped;
    }
    throw new HearthError("protocol", "the event stream ended before the command exited");
  }

  /** Processes started in this sandbox (running ones, and recently finished ones with their exit code). */
  async list(opts: RequestOpts = {}): Promise<ProcessInfo[]> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.GET("/v1/sandboxes/{id}/processes", { params: { path: { id: this.sandboxId } }, signal }),
    );
    return data.processes.map((p) => ({
      pid: p.pid,
      cmd: p.cmd,
      background: p.background,
      exitCode: p.exit_code ?? undefined,
    }));
  }

  /** A handle on a running background process, by pid. */
  connect(pid: number): CommandHandle {
    return new CommandHandle(this.conn, this.sandboxId, pid);
  }

  /** Sends a signal (default SIGKILL) to a process. Resolves false if the process does not exist. */
  async kill(pid: number, opts: RequestOpts & { sig?: number } = {}): Promise<boolean> {
    return killProcess(this.conn, this.sandboxId, pid, opts);
  }

  /** Writes to a background process' stdin; `eof: true` closes it afterwards. */
  async sendStdin(pid: number, data: string | Uint8Array, opts: RequestOpts & { eof?: boolean } = {}): Promise<void> {
    return sendStdin(this.conn, this.sandboxId, pid, data, opts);
  }
}
