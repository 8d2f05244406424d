//! hearthd: the hearth daemon. Keeps the state of every sandbox (SQLite), drives one VMM process per sandbox
//! through `hearth-vmm`, talks to each guest's agent through `hearth-proto`'s client, and serves the HTTP API.
//!
//! # Layout
//! - [`config`]: flags (clap, env fallbacks) and the paths derived from them.
//! - [`daemon`]: start-up (directories, key, VMM choice, recovery, tasks, listener) and shutdown.
//! - [`db`]: the state database (sandbox rows with their intent state, the API key hash), migrations; usage
//!   intervals ([`db::usage`]), snapshot and template rows ([`db::snapshots`]).
//! - [`auth`]: API key creation, the key file, constant-time checks.
//! - [`service`]: the [`service::Sandboxes`] service: lifecycle, agent connections, commands, files, pause and
//!   resume, durable snapshots, forks, templates, usage. Typed errors, no HTTP.
//! - [`http`]: router ([`http::app`]), server ([`http::run`]), error mapping and extractors, one module per area,
//!   SSE.
//! - [`reaper`]: TTL reaper and health watcher tasks.
//! - [`adopt`]: start-up recovery (adopt running VMs, finish or roll back half-done operations including
//!   pauses and resumes, remove orphans, reconcile usage intervals).
//! - [`metrics`]: Prometheus counters/histograms and their rendering.
//! - [`openapi`]: the generated OpenAPI document (committed as `docs/openapi.json`).
//!
//! Trust: ids from paths are validated before any lookup and no host path is built from user input; everything
//! from the guest (agent messages, console output) is bounded and treated as untrusted.

pub mod adopt;
pub mod auth;
pub mod config;
pub mod daemon;
pub mod db;
pub mod http;
pub mod metrics;
pub mod openapi;
pub mod reaper;
pub mod service;
pub mod tenancy;

pub use http::{AppState, app, run, run_with};
