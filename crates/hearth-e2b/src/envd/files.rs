//! envd's plain HTTP file routes, streamed both ways (nothing is held whole in the daemon):
//! - `GET /files?path=P` downloads a file;
//! - `POST /files?path=P` uploads one: the body itself (`application/octet-stream`), or `multipart/form-data`
//!   with one or more parts named `file` (a part's file name is its path when the query names none). Parent
//!   directories are created, as envd does. The answer lists what was written:
//!   `[{"name", "type": "file", "path"}]`.
//!
//! `username` is accepted and ignored (everything runs as root). File metadata (`X-Metadata-*` headers) and
//! gzip-compressed uploads are refused with a 400 that says so.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequest, Multipart, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::TryStreamExt;
use tokio::sync::mpsc;

use super::connect::{Code, Fault};
use super::filesystem::ensure_parent;
use super::{Envd, http_error};
use crate::Shared;

/// The `path` query parameter (`username` and anything else are ignored).
fn query_path(query: Option<&str>) -> Option<String> {
    form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .find(|(k, _)| k == "path")
        .map(|(_, v)| v.into_owned())
        .filter(|v| !v.is_empty())
}

fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

pub async fn download(
    _: State<Arc<Shared>>,
    envd: Result<Envd, Fault>,
    RawQuery(query): RawQuery,
) -> Response {
    let envd = match envd {
        Ok(e) => e,
        Err(f) => return http_error(&f),
    };
    let path = match query_path(query.as_deref()).map(|p| envd.resolve(&p)) {
        Some(Ok(p)) => p,
        Some(Err(f)) => return http_error(&f),
        None => return http_error(&Fault::invalid("the path query parameter is required")),
    };
    let stream = match envd.api.download_stream(&envd.sandbox, &path).await {
        Ok(s) => s,
        Err(e) => {
            let f = envd.fault(e).await;
            let f = match f.code {
                Code::NotFound => Fault::new(Code::NotFound, format!("path '{path}' does not exist")),
                Code::FailedPrecondition => Fault::invalid(format!("path '{path}' is a directory")),
                _ => f,
            };
            return http_error(&f);
        }
    };
    let body = Body::from_stream(stream.map_err(std::io::Error::other));
    let disposition = format!("attachment; filename=\"{}\"", base_name(&path).replace('"', ""));
    let mut resp = (StatusCode::OK, body).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    if let Ok(v) = HeaderValue::from_str(&disposition) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    resp
}

fn refuse_unsupported(headers: &HeaderMap) -> Result<(), Fault> {
    if headers.keys().any(|k| k.as_str().starts_with("x-metadata-")) {
        return Err(Fault::invalid(
            "file metadata (X-Metadata-* headers) is not supported by hearth",
        ));
    }
    let encoding = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("identity");
    if !encoding.eq_ignore_ascii_case("identity") {
        return Err(Fault::invalid(format!(
            "Content-Encoding {encoding} is not supported: upload without gzip"
        )));
    }
    Ok(())
}

pub async fn upload(
    State(st): State<Arc<Shared>>,
    envd: Result<Envd, Fault>,
    RawQuery(query): RawQuery,
    req: Request,
) -> Response {
    let envd = match envd {
        Ok(e) => e,
        Err(f) => return http_error(&f),
    };
    let result = async {
        refuse_unsupported(req.headers())?;
        let path = query_path(query.as_deref());
        let multipart = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.to_ascii_lowercase().starts_with("multipart/form-data"));
        if multipart {
            let m = Multipart::from_request(req, &st)
                .await
                .map_err(|e| Fault::invalid(format!("invalid multipart body: {e}")))?;
            upload_parts(&envd, path, m).await
        } else {
            let path =
                envd.resolve(&path.ok_or_else(|| Fault::invalid("the path query parameter is required"))?)?;
            let chunks = req.into_body().into_data_stream();
            write(&envd, &path, chunks).await?;
            Ok(vec![written(&path)])
        }
    };
    match result.await {
        Ok(files) => (StatusCode::OK, axum::Json(files)).into_response(),
        Err(f) => http_error(&f),
    }
}

fn written(path: &str) -> serde_json::Value {
    serde_json::json!({ "name": base_name(path), "type": "file", "path": path })
}

/// Streams `chunks` into `path` (its parent directories created first).
async fn write<S, E>(envd: &Envd, path: &str, chunks: S) -> Result<(), Fault>
where
    S: futures::Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
{
    ensure_parent(envd, path).await?;
    match envd.api.upload_stream(&envd.sandbox, path, chunks).await {
        Ok(_) => Ok(()),
        Err(e) => {
            let f = envd.fault(e).await;
            Err(match f.code {
                Code::FailedPrecondition => Fault::invalid(format!("path '{path}' is a directory")),
                _ => f,
            })
        }
    }
}

/// Each `file` part to its path: the query's path for the first part when given, else the part's file name.
async fn upload_parts(
    envd: &Envd,
    mut path: Option<String>,
    mut m: Multipart,
) -> Result<Vec<serde_json::Value>, Fault> {
    let mut out = Vec::new();
    while let Some(mut field) = m
        .next_field()
        .await
        .map_err(|e| Fault::invalid(format!("invalid multipart body: {e}")))?
    {
        if field.name() != Some("file") {
            continue;
        }
        let target = path
            .take()
            .or_else(|| field.file_name().map(str::to_owned))
            .ok_or_else(|| Fault::invalid("a file part names no path (and the query gives none)"))?;
        let target = envd.resolve(&target)?;
        // hearth's upload reads a 'static stream: the part's chunks go to it through a small channel, fed here.
        let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(4);
        let chunks = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
        let feed = async move {
            let fed = loop {
                match field.chunk().await {
                    Ok(Some(c)) => {
                        if tx.send(Ok(c)).await.is_err() {
                            break Ok(());
                        }
                    }
                    Ok(None) => break Ok(()),
                    Err(e) => {
                        let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
                        break Err(Fault::invalid(format!("invalid multipart body: {e}")));
                    }
                }
            };
            // The upload sees the end of its stream only once the sender is gone.
            drop(tx);
            fed
        };
        let (wrote, fed) = tokio::join!(write(envd, &target, chunks), feed);
        fed?;
        wrote?;
        out.push(written(&target));
    }
    if out.is_empty() {
        return Err(Fault::invalid("the multipart body has no part named file"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_comes_from_the_query() {
        assert_eq!(
            query_path(Some("path=%2Froot%2Fa+b.txt&username=user")).as_deref(),
            Some("/root/a b.txt")
        );
        assert_eq!(query_path(Some("username=user")), None);
        assert_eq!(query_path(Some("path=")), None);
        assert_eq!(base_name("/root/x.txt"), "x.txt");
        let mut h = HeaderMap::new();
        assert!(refuse_unsupported(&h).is_ok());
        h.insert("x-metadata-owner", HeaderValue::from_static("me"));
        assert!(refuse_unsupported(&h).is_err());
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        assert!(refuse_unsupported(&h).is_err());
    }
}
