//! Prometheus metrics: counters and histograms recorded through the `metrics` facade, rendered on `/metrics`.
//!
//! The recorder is process-global (installed once, even when tests build several routers); gauges that describe
//! current state (sandboxes by state) are computed from the database at scrape time.

use std::sync::OnceLock;
use std::time::Duration;

use hearth_api::SandboxState;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

const CREATE_SECONDS: &str = "hearth_sandbox_create_seconds";

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the global recorder (first call) and returns the handle that renders it.
pub fn install() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Full(CREATE_SECONDS.to_string()),
                    &[0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0],
                )
                .ok()?;
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            match metrics::set_global_recorder(recorder) {
                Ok(()) => Some(handle),
                Err(e) => {
                    tracing::warn!(error = %e, "metrics recorder already installed; /metrics is empty");
                    None
                }
            }
        })
        .clone()
}

pub fn sandbox_created(ok: bool, took: Duration) {
    metrics::counter!("hearth_sandbox_creates_total", "result" => if ok { "ok" } else { "error" })
        .increment(1);
    if ok {
        metrics::histogram!(CREATE_SECONDS).record(took.as_secs_f64());
    }
}

pub fn sandbox_destroyed(reason: &'static str) {
    metrics::counter!("hearth_sandbox_destroys_total", "reason" => reason).increment(1);
}

pub fn sandbox_failed() {
    metrics::counter!("hearth_sandbox_failures_total").increment(1);
}

pub fn sandbox_paused(took: Duration) {
    metrics::counter!("hearth_sandbox_pauses_total").increment(1);
    metrics::histogram!("hearth_sandbox_pause_seconds").record(took.as_secs_f64());
}

pub fn sandbox_resumed(took: Duration) {
    metrics::counter!("hearth_sandbox_resumes_total").increment(1);
    metrics::histogram!("hearth_sandbox_resume_seconds").record(took.as_secs_f64());
}

pub fn command_run(kind: &'static str) {
    metrics::counter!("hearth_commands_total", "kind" => kind).increment(1);
}

/// Counts one answered request. The method label is one of the standard methods or `other`: a client may send
/// any token as its method, and every distinct label value is kept in memory for good.
pub fn http_request(route: String, method: &str, status: u16) {
    const KNOWN: [&str; 9] = [
        "GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "CONNECT", "TRACE",
    ];
    let method = KNOWN.iter().find(|m| **m == method).copied().unwrap_or("other");
    metrics::counter!("hearth_http_requests_total", "route" => route, "method" => method,
        "status" => status.to_string())
    .increment(1);
}

/// Sets the per-state sandbox gauges from current counts.
pub fn set_sandbox_counts(counts: &[(SandboxState, usize)]) {
    for (state, n) in counts {
        metrics::gauge!("hearth_sandboxes", "state" => state.as_str()).set(*n as f64);
    }
}
