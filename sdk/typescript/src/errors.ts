// Typed errors. Every error this SDK throws on purpose is a `HearthError`; errors the daemon sent carry its
// stable `code` (see `ErrorCode` in docs/openapi.json) and the HTTP status. Cancellation through an
// `AbortSignal` is not wrapped: the promise rejects with the signal's reason (an `AbortError` by default),
// as `fetch` does.

import type { components } from "./generated/openapi.js";

/** The daemon's stable error codes, plus the SDK's own for conditions detected on the client. */
export type ErrorCode = components["schemas"]["ErrorCode"] | "timeout" | "command_exit" | "protocol";

/** Base class of every error the SDK throws. */
export class HearthError extends Error {
  /** Stable machine-readable code: match on this, never on `message`. */
  readonly code: ErrorCode;
  /** HTTP status of the daemon's answer, when the error came from one. */
  readonly status: number | undefined;

  constructor(code: ErrorCode, message: string, status?: number, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.code = code;
    this.status = status;
  }
}

/** The sandbox, process, file or template does not exist (`not_found`). */
export class NotFoundError extends HearthError {}

/** The API key is missing or wrong (`unauthorized`). */
export class AuthenticationError extends HearthError {}

/** The request was refused as invalid (`invalid_argument`, `invalid_json`, `payload_too_large`). */
export class InvalidArgumentError extends HearthError {}

/** The request conflicts with the current state, e.g. the sandbox is not running (`conflict`). */
export class ConflictError extends HearthError {}

/** The host cannot hold another sandbox of that size (`capacity_exceeded`). */
export class CapacityError extends HearthError {}

/**
 * Something took longer than allowed: a command killed by its `timeoutMs`, a `wait({ timeoutMs })` on a process
 * that still runs, or a request that exceeded `requestTimeoutMs`.
 */
export class TimeoutError extends HearthError {}

/** How a command ended (also what `CommandExitError` carries). */
export interface CommandResult {
  /** Exit code, or `128 + signal` when a signal killed the command. */
  exitCode: number;
  stdout: string;
  stderr: string;
  /** Signal that killed the command, if one did. */
  signal?: number | undefined;
  /** The command was killed because its timeout expired. */
  timedOut?: boolean | undefined;
  /** stdout or stderr were cut to the daemon's buffer limit (stream with `onStdout`/`onStderr` to get all). */
  truncated?: boolean | undefined;
}

/** A command exited with a non-zero code. The result is on the error. */
export class CommandExitError extends HearthError implements CommandResult {
  readonly exitCode: number;
  readonly stdout: string;
  readonly stderr: string;
  readonly signal: number | undefined;
  readonly timedOut: boolean | undefined;
  readonly truncated: boolean | undefined;

  constructor(result: CommandResult) {
    const tail = result.stderr.trim().split("\n").slice(-3).join("\n");
    super("command_exit", `command exited with code ${result.exitCode}${tail ? `: ${tail}` : ""}`);
    this.exitCode = result.exitCode;
    this.stdout = result.stdout;
    this.stderr = result.stderr;
    this.signal = result.signal;
    this.timedOut = result.timedOut;
    this.truncated = result.truncated;
  }

  /** The command's result as a plain object. */
  get result(): CommandResult {
    return {
      exitCode: this.exitCode,
      stdout: this.stdout,
      stderr: this.stderr,
      signal: this.signal,
      timedOut: this.timedOut,
      truncated: this.truncated,
    };
  }
}

/** Builds the typed error for a daemon error `code`. */
export function errorFromCode(code: string, message: string, status?: number): HearthError {
  switch (code) {
    case "not_found":
    case "no_disk_sync":
      return new NotFoundError(code, message, status);
    case "unauthorized":
      return new AuthenticationError(code, message, status);
    case "invalid_argument":
    case "invalid_json":
    case "payload_too_large":
    case "network_required":
      return new InvalidArgumentError(code, message, status);
    case "conflict":
    case "storage_not_configured":
      return new ConflictError(code, message, status);
    case "capacity_exceeded":
      return new CapacityError(code, message, status);
    default:
      return new HearthError(knownCode(code), message, status);
  }
}

// A record, not a list, so that the compiler asks for an update when the daemon's codes change.
const DAEMON_CODES: Record<components["schemas"]["ErrorCode"], true> = {
  invalid_json: true,
  invalid_argument: true,
  unauthorized: true,
  not_found: true,
  payload_too_large: true,
  conflict: true,
  capacity_exceeded: true,
  vmm_failed: true,
  agent_unavailable: true,
  guest_error: true,
  unknown_route: true,
  method_not_allowed: true,
  snapshot_corrupt: true,
  bucket_not_found: true,
  bucket_access_denied: true,
  bucket_unreachable: true,
  network_required: true,
  agent_too_old: true,
  storage_corrupt: true,
  storage_unavailable: true,
  storage_not_configured: true,
  no_disk_sync: true,
  forbidden: true,
  quota_exceeded: true,
  rate_limited: true,
  internal: true,
  unknown: true,
};

function knownCode(code: string): ErrorCode {
  return Object.hasOwn(DAEMON_CODES, code) ? (code as ErrorCode) : "unknown";
}

/** Builds the typed error for a non-2xx answer whose body was parsed by openapi-fetch (JSON or text). */
export function errorFromResponse(status: number, body: unknown): HearthError {
  if (typeof body === "object" && body !== null && "error" in body) {
    const detail = (body as { error: unknown }).error;
    if (typeof detail === "object" && detail !== null) {
      const { code, message } = detail as { code?: unknown; message?: unknown };
      if (typeof code === "string" && typeof message === "string") {
        return errorFromCode(code, message, status);
      }
    }
  }
  const text = typeof body === "string" && body ? body.slice(0, 500) : `HTTP ${status}`;
  const code = status === 401 ? "unauthorized" : status === 404 ? "not_found" : "unknown";
  return errorFromCode(code, text, status);
}
