//! The start-up probe: list the probe prefix (is there a bucket?), then write, read back, list and delete one
//! small object under the prefix, with few retries so
//! a dead endpoint is reported in seconds, and say which step failed and why.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::config::StoreConfig;
use crate::error::{ProbeError, ProbeStep, RemoteError, RemoteErrorKind};
use crate::remote::Remote;

/// Checks that the bucket under `config` can be written, read, listed and deleted from. The error's
/// [`ProbeError::kind`] says whether the bucket is missing, the credentials are refused, the endpoint is
/// unreachable or this host's clock is off.
pub async fn probe(config: &StoreConfig) -> Result<(), ProbeError> {
    let mut config = config.clone();
    config.max_retries = config.max_retries.min(2);
    config.retry_timeout = config.retry_timeout.min(Duration::from_secs(10));
    config.request_timeout = config.request_timeout.min(Duration::from_secs(10));
    let remote = Remote::new(Arc::new(config)).map_err(|source| ProbeError {
        step: ProbeStep::Write,
        source,
    })?;
    let token = format!("{:032x}", rand::random::<u128>());
    let key = remote.probe_key(&token);
    let body = Bytes::from(format!("hearth-store probe {token}\n"));
    let at = |step| move |source| ProbeError { step, source };

    let probe_prefix = remote.prefix_path("probe");
    remote.list(&probe_prefix).await.map_err(at(ProbeStep::Bucket))?;
    remote
        .put(&key, body.clone())
        .await
        .map_err(at(ProbeStep::Write))?;
    let read = remote.get(&key).await.map_err(at(ProbeStep::Read))?;
    if read.as_ref() != Some(&body) {
        return Err(ProbeError {
            step: ProbeStep::Read,
            source: RemoteError {
                kind: RemoteErrorKind::Other,
                op: "GET",
                key: key.to_string(),
                message: "the object read back differs from the one written".to_owned(),
            },
        });
    }
    let listed = remote.list(&probe_prefix).await.map_err(at(ProbeStep::List))?;
    if !listed.iter().any(|m| m.location == key) {
        return Err(ProbeError {
            step: ProbeStep::List,
            source: RemoteError {
                kind: RemoteErrorKind::Other,
                op: "LIST",
                key: key.to_string(),
                message: "the object written is missing from the listing".to_owned(),
            },
        });
    }
    remote.delete(&key).await.map_err(at(ProbeStep::Delete))?;
    Ok(())
}
