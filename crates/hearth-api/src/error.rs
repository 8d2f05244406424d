use serde::{Deserialize, Serialize};

/// Stable machine-readable error codes. Clients match on these, never on messages.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The body is not valid JSON or does not match the schema (wrong type, unknown field).
    InvalidJson,
    /// A field or parameter has a value outside what is allowed.
    InvalidArgument,
    /// No or wrong API key.
    Unauthorized,
    /// No such sandbox, template, process or file.
    NotFound,
    /// The request body exceeds the route's limit.
    PayloadTooLarge,
    /// The request conflicts with the resource's state (e.g. not running, already exists).
    Conflict,
    /// The host has no room for the requested shape.
    CapacityExceeded,
    /// The VMM could not start the machine, or it did not become ready in time.
    VmmFailed,
    /// The guest agent could not be reached or broke the protocol.
    AgentUnavailable,
    /// The operation in the guest failed (e.g. permission denied); see the message.
    GuestError,
    /// The route does not exist.
    UnknownRoute,
    /// Wrong HTTP method for the route.
    MethodNotAllowed,
    /// A snapshot's files do not match its manifest (truncated, altered or missing): it is refused before the
    /// VMM reads it.
    SnapshotCorrupt,
    /// The bucket named in a registration does not exist at its endpoint.
    BucketNotFound,
    /// The bucket refused the credentials (or they lack a permission the probe needs: list, put, get, delete).
    BucketAccessDenied,
    /// The bucket's endpoint could not be reached (address, DNS, TLS, timeout) or is not allowed.
    BucketUnreachable,
    /// The operation needs the sandbox's network (mounts are served on its gateway); the daemon runs with
    /// networking off.
    NetworkRequired,
    /// The sandbox's agent predates the operation (e.g. a sandbox restored from an old snapshot).
    AgentTooOld,
    /// The key is valid but its role may not do this (a viewer mutating, a member managing keys), or the
    /// request's `Origin`/`Host` is neither local nor allowed.
    Forbidden,
    /// A project quota would be exceeded; the message names the limit and its value.
    QuotaExceeded,
    /// This key sends requests faster than the daemon allows; retry after `Retry-After` seconds.
    RateLimited,
    /// A paused state, snapshot or template fetched from the storage bucket failed verification (a missing or
    /// corrupted chunk, a damaged manifest); the message names the object.
    StorageCorrupt,
    /// The storage bucket is needed (the local copy is gone) but cannot be reached or has no copy yet.
    StorageUnavailable,
    /// The operation needs a storage bucket and the daemon runs without one (`hearthd --storage`).
    StorageNotConfigured,
    /// The sandbox has no synced disk (`POST /v1/sandboxes/{id}/sync` was never done, or not since it was
    /// created).
    NoDiskSync,
    /// Something unexpected went wrong in the daemon.
    Internal,
    /// Any code this client version does not know yet.
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    /// The HTTP status this code is served with.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidJson | ErrorCode::InvalidArgument | ErrorCode::NetworkRequired => 400,
            ErrorCode::BucketNotFound | ErrorCode::BucketAccessDenied | ErrorCode::BucketUnreachable => 422,
            ErrorCode::AgentTooOld => 409,
            ErrorCode::StorageCorrupt => 422,
            ErrorCode::StorageUnavailable => 503,
            ErrorCode::StorageNotConfigured => 409,
            ErrorCode::NoDiskSync => 404,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::QuotaExceeded | ErrorCode::RateLimited => 429,
            ErrorCode::NotFound | ErrorCode::UnknownRoute => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::Conflict => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::GuestError | ErrorCode::SnapshotCorrupt => 422,
            ErrorCode::CapacityExceeded => 503,
            ErrorCode::VmmFailed | ErrorCode::AgentUnavailable => 502,
            ErrorCode::Internal | ErrorCode::Unknown => 500,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidJson => "invalid_json",
            ErrorCode::InvalidArgument => "invalid_argument",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::QuotaExceeded => "quota_exceeded",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::NotFound => "not_found",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::Conflict => "conflict",
            ErrorCode::CapacityExceeded => "capacity_exceeded",
            ErrorCode::VmmFailed => "vmm_failed",
            ErrorCode::AgentUnavailable => "agent_unavailable",
            ErrorCode::GuestError => "guest_error",
            ErrorCode::UnknownRoute => "unknown_route",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::SnapshotCorrupt => "snapshot_corrupt",
            ErrorCode::BucketNotFound => "bucket_not_found",
            ErrorCode::BucketAccessDenied => "bucket_access_denied",
            ErrorCode::BucketUnreachable => "bucket_unreachable",
            ErrorCode::NetworkRequired => "network_required",
            ErrorCode::AgentTooOld => "agent_too_old",
            ErrorCode::StorageCorrupt => "storage_corrupt",
            ErrorCode::StorageUnavailable => "storage_unavailable",
            ErrorCode::StorageNotConfigured => "storage_not_configured",
            ErrorCode::NoDiskSync => "no_disk_sync",
            ErrorCode::Internal => "internal",
            ErrorCode::Unknown => "unknown",
        }
    }
}

/// Every non-2xx response has this body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    pub code: ErrorCode,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_is_tolerated() {
        let j = serde_json::to_string(&ErrorCode::PayloadTooLarge).expect("serializes");
        assert_eq!(j, "\"payload_too_large\"");
        assert_eq!(ErrorCode::PayloadTooLarge.as_str(), "payload_too_large");
        let c: ErrorCode = serde_json::from_str("\"brand_new_code\"").expect("parses");
        assert_eq!(c, ErrorCode::Unknown);
    }
}
