//! Which objects a route touches, who owns them, and what a project may see.
//!
//! A route names objects in its path (`{id}` of `/sandboxes/{id}...`) and in its JSON body (the template or
//! snapshot a sandbox starts from, the sandbox a template is saved from, a bucket to mount, networks to join).
//! A non-admin key reaches only objects its project owns; anything else is answered 404, exactly like an id
//! that does not exist. Built-in templates (not saved from a sandbox) are readable by every project. Objects
//! are recorded as owned when their create answers 2xx, forgotten when their delete does; lists are filtered.

use std::collections::HashMap;

use serde_json::Value;

use super::{Principal, Tenancy};
use crate::db::DbError;

/// Kinds of owned objects (the `kind` column of `owners`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Sandbox,
    Snapshot,
    Template,
    Network,
    Bucket,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Sandbox => "sandbox",
            Kind::Snapshot => "snapshot",
            Kind::Template => "template",
            Kind::Network => "network",
            Kind::Bucket => "bucket",
        }
    }
}

/// Whether `p` may reach the object (admins reach everything; a template that is not a saved one is built-in).
pub fn owns(t: &Tenancy, p: &Principal, kind: Kind, key: &str) -> Result<bool, DbError> {
    if p.is_admin() {
        return Ok(true);
    }
    match t.db().owner(kind.as_str(), key)? {
        Some(project) => Ok(project == p.project),
        None if kind == Kind::Template => Ok(!t.db().is_saved_template(key)?),
        None => Ok(false),
    }
}

/// The objects named by a route's path parameters.
pub fn path_refs(route: &str, params: &HashMap<String, String>) -> Vec<(Kind, String)> {
    let top = route.strip_prefix("/v1/").unwrap_or("");
    let first = top.split('/').next().unwrap_or("");
    let mut refs = Vec::new();
    for (name, value) in params {
        let kind = match (first, name.as_str()) {
            ("sandboxes", "id") => Kind::Sandbox,
            ("snapshots", "id") => Kind::Snapshot,
            ("templates", "name") => Kind::Template,
            ("buckets", "name") => Kind::Bucket,
            ("networks", "network") => Kind::Network,
            ("networks", "sandbox") => Kind::Sandbox,
            _ => continue,
        };
        refs.push((kind, value.clone()));
    }
    refs
}

/// Whether a route's JSON body may name objects or sizes (it is then read before the handler).
pub fn body_may_refer(method: &axum::http::Method, route: &str) -> bool {
    use axum::http::Method;
    matches!(
        (method, route),
        (&Method::POST, "/v1/sandboxes")
            | (&Method::POST, "/v1/sandboxes/{id}/fork")
            | (&Method::POST, "/v1/templates")
            | (&Method::PUT, "/v1/sandboxes/{id}/mounts")
    )
}

/// The objects a request body names.
pub fn body_refs(body: &Value) -> Vec<(Kind, String)> {
    let mut refs = Vec::new();
    let s = |v: &Value| v.as_str().map(str::to_string);
    if let Some(t) = body.get("template").and_then(s) {
        refs.push((Kind::Template, t));
    }
    if let Some(t) = body.get("recipe").and_then(|r| r.get("base")).and_then(s) {
        refs.push((Kind::Template, t));
    }
    if let Some(x) = body.get("snapshot").and_then(s) {
        refs.push((Kind::Snapshot, x));
    }
    if let Some(x) = body.get("from_sandbox").and_then(s) {
        refs.push((Kind::Sandbox, x));
    }
    if let Some(x) = body.get("from_sync").and_then(s) {
        refs.push((Kind::Sandbox, x));
    }
    if let Some(x) = body.get("bucket").and_then(s) {
        refs.push((Kind::Bucket, x));
    }
    for n in body
        .get("networks")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(n) = s(n) {
            refs.push((Kind::Network, n));
        }
    }
    for m in body.get("mounts").and_then(Value::as_array).into_iter().flatten() {
        if let Some(b) = m.get("bucket").and_then(s) {
            refs.push((Kind::Bucket, b));
        }
    }
    refs
}

/// Routes whose 2xx answer names objects just created, and what to record.
pub fn creates(method: &axum::http::Method, route: &str) -> bool {
    use axum::http::Method;
    *method == Method::POST
        && matches!(
            route,
            "/v1/sandboxes"
                | "/v1/sandboxes/{id}/fork"
                | "/v1/sandboxes/{id}/snapshots"
                | "/v1/templates"
                | "/v1/networks"
                | "/v1/buckets"
        )
}

/// Records the objects a create's answer names as `project`'s.
pub fn record_created(t: &Tenancy, route: &str, answer: &Value, project: &str) -> Result<(), DbError> {
    let db = t.db();
    let s = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
    match route {
        "/v1/sandboxes" => {
            if let Some(id) = s(answer.get("id")) {
                db.set_owner(Kind::Sandbox.as_str(), &id, &[&id], project)?;
            }
        }
        "/v1/sandboxes/{id}/fork" => {
            for child in answer
                .get("sandboxes")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(id) = s(child.get("id")) {
                    db.set_owner(Kind::Sandbox.as_str(), &id, &[&id], project)?;
                }
            }
            if let Some(id) = s(answer.get("snapshot_id")) {
                db.set_owner(Kind::Snapshot.as_str(), &id, &[&id], project)?;
            }
        }
        "/v1/sandboxes/{id}/snapshots" => {
            if let Some(id) = s(answer.get("id")) {
                db.set_owner(Kind::Snapshot.as_str(), &id, &[&id], project)?;
            }
        }
        "/v1/templates" => {
            if let Some(name) = s(answer.get("name")) {
                db.set_owner(Kind::Template.as_str(), &name, &[&name], project)?;
            }
            if let Some(id) = s(answer.get("snapshot_id")) {
                db.set_owner(Kind::Snapshot.as_str(), &id, &[&id], project)?;
            }
        }
        "/v1/networks" => {
            if let (Some(id), Some(name)) = (s(answer.get("id")), s(answer.get("name"))) {
                db.set_owner(Kind::Network.as_str(), &id, &[&id, &name], project)?;
            }
        }
        "/v1/buckets" => {
            if let Some(name) = s(answer.get("name")) {
                db.set_owner(Kind::Bucket.as_str(), &name, &[&name], project)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// The object a successful DELETE removes, if the route deletes one.
pub fn deleted(route: &str, params: &HashMap<String, String>) -> Option<(Kind, String)> {
    let (kind, param) = match route {
        // A sandbox's owner row outlives it: ids are never reused, and the project's spent credits count the
        // running time of its destroyed sandboxes too.
        "/v1/snapshots/{id}" => (Kind::Snapshot, "id"),
        "/v1/templates/{name}" => (Kind::Template, "name"),
        "/v1/networks/{network}" => (Kind::Network, "network"),
        "/v1/buckets/{name}" => (Kind::Bucket, "name"),
        _ => return None,
    };
    params.get(param).map(|v| (kind, v.clone()))
}

/// List routes whose answers are filtered for non-admins: the array field, the id field of its items, and the
/// kind of object.
pub fn list_shape(route: &str) -> Option<(&'static str, &'static str, Kind)> {
    Some(match route {
        "/v1/sandboxes" => ("sandboxes", "id", Kind::Sandbox),
        "/v1/snapshots" => ("snapshots", "id", Kind::Snapshot),
        "/v1/templates" => ("templates", "name", Kind::Template),
        "/v1/networks" => ("networks", "id", Kind::Network),
        "/v1/buckets" => ("buckets", "name", Kind::Bucket),
        "/v1/usage" => ("sandboxes", "sandbox_id", Kind::Sandbox),
        _ => return None,
    })
}

/// Keeps only the items of a list answer that `p` may see.
pub fn filter_list(t: &Tenancy, p: &Principal, route: &str, answer: &mut Value) -> Result<(), DbError> {
    let Some((field, id_field, kind)) = list_shape(route) else {
        return Ok(());
    };
    let Some(items) = answer.get_mut(field).and_then(Value::as_array_mut) else {
        return Ok(());
    };
    let mut kept = Vec::with_capacity(items.len());
    for item in items.drain(..) {
        let builtin = item.get("builtin").and_then(Value::as_bool).unwrap_or(false);
        let id = item.get(id_field).and_then(Value::as_str).unwrap_or("");
        if builtin || owns(t, p, kind, id)? {
            kept.push(item);
        }
    }
    *items = kept;
    Ok(())
}
