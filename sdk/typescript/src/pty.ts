// `sbx.pty`: interactive terminals in a sandbox over the daemon's WebSocket route `GET /v1/sandboxes/{id}/pty`.
//
// Binary frames carry terminal bytes both ways; text frames carry JSON control messages (`resize` and `signal`
// from us, `exit` from the daemon before it closes). The key travels as the subprotocol entry `hearth.key.<key>`
// because WebSocket clients cannot set an Authorization header. Needs a global `WebSocket` (Node 22+, Node 20
// with `--experimental-websocket`, browsers, Bun, Deno) or the `ws` package installed next to the SDK.

import type { Connection, RequestOpts } from "./client.js";
import { HearthError, InvalidArgumentError } from "./errors.js";

/** Options of `sbx.pty.create`. */
export interface PtyCreateOpts extends RequestOpts {
  /** Terminal width in columns (1-4096). */
  cols: number;
  /** Terminal height in rows (1-4096). */
  rows: number;
  /** Shell command line to run instead of the guest's shell (bash if the guest has it, else sh). */
  cmd?: string | undefined;
  /** Working directory in the guest. Default `/root`. */
  cwd?: string | undefined;
  /** Extra environment variables, added to the sandbox's own (`TERM` defaults to `xterm-256color`). */
  envs?: Record<string, string> | undefined;
  /** Called with each chunk the terminal prints. */
  onData: (data: Uint8Array) => void;
}

/** The subset of the WebSocket API used here (the global one and the `ws` package both provide it). */
interface WebSocketLike {
  binaryType: string;
  readonly readyState: number;
  readonly protocol: string;
  send(data: string | Uint8Array): void;
  close(code?: number, reason?: string): void;
  onopen: ((ev: unknown) => void) | null;
  onmessage: ((ev: { data: unknown }) => void) | null;
  onerror: ((ev: unknown) => void) | null;
  onclose: ((ev: { code: number; reason: string }) => void) | null;
}

type WebSocketCtor = new (url: string, protocols?: string | string[]) => WebSocketLike;

const OPEN = 1;

/** The subprotocol the daemon selects. */
const PROTOCOL = "hearth.pty.v1";

async function webSocketCtor(): Promise<WebSocketCtor> {
  const global = (globalThis as { WebSocket?: WebSocketCtor }).WebSocket;
  if (global) return global;
  try {
    // An optional peer: only loaded where no global WebSocket exists. The name is a variable so that
    // TypeScript does not need its types.
    const name = "ws";
    const mod = (await import(name)) as { WebSocket?: WebSocketCtor; default?: WebSocketCtor };
    const ctor = mod.WebSocket ?? mod.default;
    if (ctor) return ctor;
  } catch {
    // fall through to the explanation below
  }
  throw new HearthError(
    "unknown",
    "sbx.pty needs a WebSocket implementation: use Node 22+ (or Node 20 with --experimental-websocket), " +
      "or install the `ws` package",
  );
}

function checkSize(what: string, n: number): void {
  if (!Number.isInteger(n) || n < 1 || n > 4096) {
    throw new InvalidArgumentError("invalid_argument", `${what} must be an integer between 1 and 4096, got ${n}`);
  }
}

/** Interactive terminals in one sandbox. */
export class Pty {
  constructor(
    private readonly conn: Connection,
    private readonly sandboxId: string,
  ) {}

  /**
   * Starts a program on a new terminal in the sandbox (resuming it if paused) and resolves once it runs.
   * Output goes to `onData`; the handle sends input, resizes, kills and waits for the exit code.
   */
  async create(opts: PtyCreateOpts): Promise<PtyHandle> {
    checkSize("cols", opts.cols);
    checkSize("rows", opts.rows);
    const Ctor = await webSocketCtor();
    const url = new URL(`${this.conn.url}/v1/sandboxes/${encodeURIComponent(this.sandboxId)}/pty`);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    url.searchParams.set("rows", String(opts.rows));
    url.searchParams.set("cols", String(opts.cols));
    if (opts.cmd !== undefined) url.searchParams.set("cmd", opts.cmd);
    if (opts.cwd !== undefined) url.searchParams.set("cwd", opts.cwd);
    if (opts.envs && Object.keys(opts.envs).length > 0) url.searchParams.set("env", JSON.stringify(opts.envs));
    const protocols = [PROTOCOL];
    if (this.conn.apiKey) protocols.push(`hearth.key.${this.conn.apiKey}`);
    const ws = new Ctor(url.toString(), protocols);
    ws.binaryType = "arraybuffer";
    const handle = new PtyHandle(ws, opts.onData);
    await handle.opened(this.conn.signal(opts), () => this.explainFailure(opts));
    return handle;
  }

  /**
   * A WebSocket that fails to open says nothing about why: ask the REST API about the sandbox, whose error
   * (not found, unauthorized, ...) is most likely the terminal's too.
   */
  private async explainFailure(opts: RequestOpts): Promise<unknown> {
    try {
      await this.conn.call(opts, (signal) =>
        this.conn.api.GET("/v1/sandboxes/{id}", { params: { path: { id: this.sandboxId } }, signal }),
      );
    } catch (err) {
      return err;
    }
    return new HearthError("unknown", `the daemon refused to open a terminal in ${this.sandboxId}`);
  }
}

/** A running terminal. */
export class PtyHandle {
  private exitCode: number | undefined;
  private readonly done: Promise<number>;
  private settle!: { resolve: (code: number) => void; reject: (err: unknown) => void };
  private isOpen = false;

  /** @internal */
  constructor(
    private readonly ws: WebSocketLike,
    onData: (data: Uint8Array) => void,
  ) {
    this.done = new Promise<number>((resolve, reject) => {
      this.settle = { resolve, reject };
    });
    // A `wait()` nobody calls must not become an unhandled rejection.
    this.done.catch(() => undefined);
    ws.onmessage = (ev) => {
      const data = ev.data;
      if (typeof data === "string") {
        this.onControl(data);
      } else if (data instanceof ArrayBuffer) {
        onData(new Uint8Array(data));
      } else if (ArrayBuffer.isView(data)) {
        onData(new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
      }
    };
  }

  /** @internal Resolves once the socket is open; rejects with `explain()`'s error if it cannot open. */
  async opened(signal: AbortSignal | undefined, explain: () => Promise<unknown>): Promise<void> {
    const ws = this.ws;
    const failed = await new Promise<boolean>((resolve) => {
      const onAbort = () => {
        ws.close();
        resolve(true);
      };
      signal?.addEventListener("abort", onAbort, { once: true });
      ws.onopen = () => {
        signal?.removeEventListener("abort", onAbort);
        resolve(false);
      };
      // Some implementations (Node 20's) report a refused handshake with `error` and never `close`.
      ws.onerror = () => {
        signal?.removeEventListener("abort", onAbort);
        resolve(true);
      };
      ws.onclose = () => {
        signal?.removeEventListener("abort", onAbort);
        resolve(true);
      };
    });
    if (failed) {
      if (signal?.aborted) throw signal.reason;
      throw await explain();
    }
    this.isOpen = true;
    ws.onerror = () => {
      if (this.exitCode === undefined) {
        this.settle.reject(new HearthError("unknown", "the terminal connection failed"));
      }
    };
    ws.onclose = (ev) => {
      this.isOpen = false;
      if (this.exitCode !== undefined) {
        this.settle.resolve(this.exitCode);
      } else {
        const why = ev.reason ? `: ${ev.reason}` : "";
        this.settle.reject(new HearthError("unknown", `the terminal closed before its program exited${why}`));
      }
    };
  }

  private onControl(text: string): void {
    let msg: { type?: unknown; exit_code?: unknown };
    try {
      msg = JSON.parse(text) as typeof msg;
    } catch {
      return;
    }
    if (msg.type === "exit" && typeof msg.exit_code === "number") {
      this.exitCode = msg.exit_code;
      // The close follows; resolving now does not make callers wait for it.
      this.settle.resolve(msg.exit_code);
    }
  }

  /** Open, and its program has not exited. */
  private running(): boolean {
    return this.isOpen && this.exitCode === undefined && this.ws.readyState === OPEN;
  }

  private send(data: string | Uint8Array): void {
    if (!this.running()) {
      throw new HearthError("unknown", "the terminal is closed");
    }
    this.ws.send(data);
  }

  /** Types into the terminal: bytes as they are, strings as UTF-8 (`"\x03"` is Ctrl-C). */
  async sendInput(data: Uint8Array | string): Promise<void> {
    this.send(typeof data === "string" ? new TextEncoder().encode(data) : data);
  }

  /** Changes the terminal size; the program gets SIGWINCH. */
  async resize(size: { cols: number; rows: number }): Promise<void> {
    checkSize("cols", size.cols);
    checkSize("rows", size.rows);
    this.send(JSON.stringify({ type: "resize", rows: size.rows, cols: size.cols }));
  }

  /** Kills the terminal's programs (SIGKILL to its process group); `wait()` then resolves with 137. Resolves
   * false when the terminal had already ended. */
  async kill(): Promise<boolean> {
    if (!this.running()) return false;
    this.send(JSON.stringify({ type: "signal", signal: 9 }));
    return true;
  }

  /** Resolves with the program's exit code (`128 + N` when killed by signal N). */
  async wait(): Promise<number> {
    return this.done;
  }

  /** Closes the connection; the terminal is hung up in the guest (SIGHUP) if its program still runs. */
  disconnect(): void {
    this.ws.close(1000);
  }
}
