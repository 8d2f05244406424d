// hearth's TypeScript SDK: `Sandbox` (create/connect/list/kill), `sbx.commands`, `sbx.files`, typed errors.
//
// Layout: client.ts (connection settings, openapi-fetch transport, error mapping), sandbox.ts, commands.ts,
// files.ts, watch.ts (files.watchDir), templates.ts, network.ts (sbx.network, Network), buckets.ts (Bucket,
// sbx.mounts), projects.ts (Project, ApiKey, AccessToken, AuditLog), sse.ts (event-stream
// reader), errors.ts; generated/openapi.ts is generated from docs/openapi.json.

export { Sandbox } from "./sandbox.js";
export type {
  ConnectOpts,
  DiskSyncInfo,
  FetchProgress,
  OnTimeout,
  ResumeOpts,
  SandboxInfo,
  SandboxLifecycle,
  SandboxListOpts,
  SandboxOpts,
  SandboxState,
  SandboxUsage,
  SnapshotInfo,
} from "./sandbox.js";
export { Commands, CommandHandle } from "./commands.js";
export type { CommandOpts, ProcessInfo, WaitOpts } from "./commands.js";
export { Files } from "./files.js";
export type { EntryInfo, FileData, FileType, WriteEntry } from "./files.js";
export { WatchHandle } from "./watch.js";
export type { FilesystemEvent, FilesystemEventType, WatchOpts } from "./watch.js";
export { Template } from "./templates.js";
export type { BuildOpts, FromSandboxOpts, Recipe, TemplateBuildEvent, TemplateInfo } from "./templates.js";
export { Pty, PtyHandle } from "./pty.js";
export type { PtyCreateOpts } from "./pty.js";
export { Network, SandboxNetwork } from "./network.js";
export type {
  EgressDefault,
  EgressEvent,
  EgressLog,
  EgressPolicy,
  ExposedPort,
  NetProtocol,
  NetworkInfo,
  NetworkOpts,
  SandboxNetworkInfo,
} from "./network.js";
export { Bucket, SandboxMounts } from "./buckets.js";
export type { BucketInfo, BucketSpec, MountInfo, MountOpts } from "./buckets.js";
export { AccessToken, ApiKey, AuditLog, Project } from "./projects.js";
export type {
  AccessTokenSpec,
  ApiKeyInfo,
  ApiKeySpec,
  AuditEntry,
  AuditFilter,
  CreatedApiKey,
  ProjectInfo,
  ProjectUsage,
  Quota,
  Role,
} from "./projects.js";
export { DEFAULT_URL } from "./client.js";
export type { ConnectionOpts, RequestOpts } from "./client.js";
export {
  HearthError,
  NotFoundError,
  AuthenticationError,
  InvalidArgumentError,
  ConflictError,
  CapacityError,
  TimeoutError,
  CommandExitError,
} from "./errors.js";
export type { CommandResult, ErrorCode } from "./errors.js";
export type { paths, components } from "./generated/openapi.js";
