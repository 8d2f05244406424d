//! Helpers of the tenancy tests: keys of other projects and roles, requests with a chosen key, the routes of
//! the daemon's own OpenAPI document.

#![allow(dead_code)]

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::common::Daemon;

/// A key made through the API.
#[derive(Debug, Clone)]
pub struct Key {
    pub id: String,
    pub key: String,
}

/// One operation of the OpenAPI document.
#[derive(Debug, Clone)]
pub struct Route {
    pub method: Method,
    pub path: String,
    /// Whether it declares the `api_key` security scheme.
    pub secured: bool,
}

impl Route {
    pub fn mutating(&self) -> bool {
        !(self.method == Method::GET || self.method == Method::HEAD) || self.path.ends_with("/pty")
    }
}

/// Sends `body` (or nothing) with `key`; returns status, parsed body (Null when not JSON) and request id.
pub async fn call(
    d: &Daemon,
    key: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Value, String) {
    let mut req = d.http.request(method, d.url(path)).bearer_auth(key);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status();
    let rid = resp
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let text = resp.text().await.unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null), rid)
}

pub async fn create_project(d: &Daemon, name: &str, quota: Value) {
    let (s, v, _) = call(
        d,
        &d.key,
        Method::POST,
        "/v1/projects",
        Some(json!({"name": name, "quota": quota})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "create project {name}: {v}");
}

pub async fn create_key(d: &Daemon, project: &str, role: &str, expires_in_s: Option<u64>) -> Key {
    let mut body = json!({"project": project, "role": role});
    if let Some(e) = expires_in_s {
        body["expires_in_s"] = json!(e);
    }
    let (s, v, _) = call(d, &d.key, Method::POST, "/v1/keys", Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "create key: {v}");
    Key {
        id: v["id"].as_str().expect("id").to_string(),
        key: v["key"].as_str().expect("key").to_string(),
    }
}

/// Every operation of the document the running daemon serves.
pub async fn routes(d: &Daemon) -> Vec<Route> {
    let doc: Value = d
        .http
        .get(d.url("/openapi.json"))
        .send()
        .await
        .expect("openapi")
        .json()
        .await
        .expect("openapi json");
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("path item") {
            let Ok(method) = method.to_uppercase().parse::<Method>() else {
                continue;
            };
            let secured = op["security"]
                .as_array()
                .is_some_and(|s| s.iter().any(|r| r.get("api_key").is_some()));
            out.push(Route {
                method,
                path: path.clone(),
                secured,
            });
        }
    }
    assert!(
        out.len() > 50,
        "the document lists every route ({} found)",
        out.len()
    );
    out
}

/// `path` with each `{param}` replaced through `f`.
pub fn fill(path: &str, f: impl Fn(&str) -> String) -> String {
    let mut out = String::new();
    let mut rest = path;
    while let Some(i) = rest.find('{') {
        out.push_str(&rest[..i]);
        let j = rest[i..].find('}').expect("closing brace") + i;
        out.push_str(&f(&rest[i + 1..j]));
        rest = &rest[j + 1..];
    }
    out.push_str(rest);
    out
}
