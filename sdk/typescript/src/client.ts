// Connection settings and the typed transport (openapi-fetch over the generated `paths`), plus the helpers
// that turn its `{ data, error, response }` answers into values or typed errors.

import createClient, { type Client } from "openapi-fetch";

import { HearthError, InvalidArgumentError, TimeoutError, errorFromResponse } from "./errors.js";
import type { paths } from "./generated/openapi.js";

/** What `fetch` accepts as a request body. */
export type RequestBody = NonNullable<RequestInit["body"]>;

/** Where the daemon listens when neither `url` nor `HEARTH_URL` says otherwise. */
export const DEFAULT_URL = "http://127.0.0.1:7070";

/** How to reach the daemon; every option falls back to the environment, then to a default. */
export interface ConnectionOpts {
  /** API key (`hk_...`). Default: `HEARTH_API_KEY`. */
  apiKey?: string | undefined;
  /** Daemon URL. Default: `HEARTH_URL`, else `http://127.0.0.1:7070`. */
  url?: string | undefined;
  /** Give up on each HTTP request after this long (rejects with `TimeoutError`). Default: no limit. */
  requestTimeoutMs?: number | undefined;
}

/** Per-call options shared by every method. */
export interface RequestOpts {
  /** Abort the call: the promise rejects with the signal's reason. */
  signal?: AbortSignal | undefined;
  /** Overrides the connection's `requestTimeoutMs` for this call. */
  requestTimeoutMs?: number | undefined;
}

/** Resolved connection settings and the HTTP client built from them. */
export class Connection {
  readonly url: string;
  readonly apiKey: string | undefined;
  readonly requestTimeoutMs: number | undefined;
  readonly api: Client<paths>;

  constructor(opts: ConnectionOpts = {}) {
    const env = typeof process === "object" ? process.env : {};
    this.url = (opts.url ?? env.HEARTH_URL ?? DEFAULT_URL).replace(/\/+$/, "");
    this.apiKey = opts.apiKey ?? env.HEARTH_API_KEY ?? undefined;
    this.requestTimeoutMs = opts.requestTimeoutMs;
    const headers: Record<string, string> = {};
    if (this.apiKey) headers.Authorization = `Bearer ${this.apiKey}`;
    this.api = createClient<paths>({ baseUrl: this.url, headers });
  }

  /** The settings to hand to another object talking to the same daemon. */
  get opts(): ConnectionOpts {
    return { url: this.url, apiKey: this.apiKey, requestTimeoutMs: this.requestTimeoutMs };
  }

  /** Whether a call with these options can be cancelled (by its signal or a request timeout). */
  cancellable(opts: RequestOpts = {}): boolean {
    return opts.signal !== undefined || (opts.requestTimeoutMs ?? this.requestTimeoutMs ?? 0) > 0;
  }

  /** The signal for one request: the caller's, combined with the request timeout if there is one. */
  signal(opts: RequestOpts = {}): AbortSignal | undefined {
    const ms = opts.requestTimeoutMs ?? this.requestTimeoutMs;
    const signals: AbortSignal[] = [];
    if (opts.signal) signals.push(opts.signal);
    if (ms !== undefined && ms > 0) signals.push(AbortSignal.timeout(ms));
    if (signals.length === 0) return undefined;
    return signals.length === 1 ? signals[0] : AbortSignal.any(signals);
  }

  /**
   * Runs one request and maps failures: a caller's abort rejects with its reason, a request timeout with
   * `TimeoutError`, a transport failure with `HearthError` (code `unknown`), a non-2xx answer with its typed error.
   */
  async call<T>(
    opts: RequestOpts,
    send: (signal: AbortSignal | undefined) => Promise<{ data?: T; error?: unknown; response: Response }>,
  ): Promise<{ data: T; response: Response; signal: AbortSignal | undefined }> {
    const signal = this.signal(opts);
    let result: { data?: T; error?: unknown; response: Response };
    try {
      result = await send(signal);
    } catch (err) {
      throw this.transportError(err, opts);
    }
    if (!result.response.ok) throw errorFromResponse(result.response.status, result.error);
    return { data: result.data as T, response: result.response, signal };
  }

  /** Maps an exception thrown while talking to the daemon (also used while reading a streamed body). */
  transportError(err: unknown, opts: RequestOpts): unknown {
    if (opts.signal?.aborted) return opts.signal.reason;
    if (err instanceof HearthError) return err;
    if (err instanceof DOMException && err.name === "TimeoutError") {
      return new TimeoutError("timeout", "the request to the daemon timed out", undefined, { cause: err });
    }
    const detail = err instanceof Error ? err.message : String(err);
    return new HearthError("unknown", `cannot reach the hearth daemon at ${this.url}: ${detail}`, undefined, {
      cause: err,
    });
  }
}

/** Milliseconds to whole seconds for the API (rounded up, at least 1). */
export function msToSeconds(ms: number, what: string): number {
  if (!Number.isFinite(ms) || ms <= 0) {
    throw new InvalidArgumentError("invalid_argument", `${what} must be a positive number of milliseconds, got ${ms}`);
  }
  return Math.max(1, Math.ceil(ms / 1000));
}
