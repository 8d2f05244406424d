//! Real-VM template tests (QEMU TCG, `minimal`): a template saved from a sandbox carries its files into new
//! sandboxes (booted from the flattened image); a template with memory starts sandboxes by restore with a
//! process started before templating still running; deletion is refused while sandboxes use a template.

mod common;

use common::{Daemon, VM_LOCK};
use reqwest::{Method, StatusCode};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn templates_from_a_sandbox_with_and_without_memory() {
    let _serial = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    let src = d
        .create(json!({"template": "minimal", "memory_mib": 256}))
        .await
        .id;
    assert_eq!(
        d.sh(&src, "echo configured > /root/setup-done").await.exit_code,
        0
    );
    let (status, v) = d
        .run_raw(&src, json!({"cmd": "sleep 100000", "background": true}))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{v}");
    let sleeper = v["pid"].as_u64().expect("pid");

    // Disk only: a new sandbox boots from the flattened image and has the file.
    let (status, t) = d
        .call(
            Method::POST,
            "/v1/templates",
            Some(json!({"name": "tpl-disk", "from_sandbox": src})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{t}\n{}", d.log());
    assert_eq!(t["builtin"], false);
    let a = d
        .create(json!({"template": "tpl-disk", "memory_mib": 256}))
        .await
        .id;
    assert_eq!(d.sh(&a, "cat /root/setup-done").await.stdout, "configured\n");
    let r = d.sh(&a, &format!("tr '\\0' ' ' < /proc/{sleeper}/cmdline")).await;
    assert!(
        !r.stdout.contains("100000"),
        "a disk-only template boots fresh: {r:?}"
    );
    let (status, v) = d.call(Method::DELETE, "/v1/templates/tpl-disk", None).await;
    assert_eq!(status, StatusCode::CONFLICT, "{v}");
    d.destroy(&a).await;

    // With memory: the process started before templating runs in the new sandbox.
    let (status, t) = d
        .call(
            Method::POST,
            "/v1/templates",
            Some(json!({"name": "tpl-warm", "from_sandbox": src, "include_memory": true})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{t}\n{}", d.log());
    let b = d.create(json!({"template": "tpl-warm"})).await.id;
    let r = d.sh(&b, &format!("tr '\\0' ' ' < /proc/{sleeper}/cmdline")).await;
    assert!(
        r.stdout.contains("sleep 100000"),
        "the process runs in the new sandbox: {r:?}"
    );
    assert_eq!(d.sh(&b, "cat /root/setup-done").await.stdout, "configured\n");
    let (status, list) = d.call(Method::GET, "/v1/templates", None).await;
    assert_eq!(status, StatusCode::OK);
    let names: Vec<&str> = list["templates"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(
        names.contains(&"minimal") && names.contains(&"tpl-disk") && names.contains(&"tpl-warm"),
        "{list}"
    );
    d.destroy(&b).await;
    for name in ["tpl-disk", "tpl-warm"] {
        let (status, v) = d
            .call(Method::DELETE, &format!("/v1/templates/{name}"), None)
            .await;
        assert_eq!(status, StatusCode::NO_CONTENT, "{v}");
    }
    d.destroy(&src).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recipe_build_success_and_failing_step() {
    let _serial = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    let recipe = json!({
        "base": "minimal",
        "steps": ["echo built-by-recipe > /root/recipe-file", "mkdir -p /srv && echo $GREETING > /srv/greeting"],
        "env": {"GREETING": "hello-from-env"},
    });
    let (status, t) = d
        .call(
            Method::POST,
            "/v1/templates",
            Some(json!({"name": "tpl-recipe", "recipe": recipe})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{t}\n{}", d.log());
    let s = d
        .create(json!({"template": "tpl-recipe", "memory_mib": 256}))
        .await
        .id;
    assert_eq!(
        d.sh(&s, "cat /root/recipe-file /srv/greeting").await.stdout,
        "built-by-recipe\nhello-from-env\n"
    );
    d.destroy(&s).await;

    let recipe = json!({
        "base": "minimal",
        "steps": ["echo fine", "echo visible-output; echo to-stderr >&2; exit 3", "echo never"],
    });
    let (status, v) = d
        .call(
            Method::POST,
            "/v1/templates",
            Some(json!({"name": "tpl-broken", "recipe": recipe})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("step 2") && msg.contains("exit code 3"), "{msg}");
    assert!(
        msg.contains("visible-output") && msg.contains("to-stderr"),
        "{msg}"
    );
    let (status, _) = d.call(Method::GET, "/v1/templates/tpl-broken", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // No build sandbox is left behind.
    assert!(d.list_ids().await.is_empty());
}
