//! Real-VM template tests (QEMU TCG, `minimal`): a template saved from a sandbox carries its files into new
//! sandboxes (booted from the flattened image); a template with memory starts sandboxes by restore with a
//! process started before templating still running; deletion is refused while sandboxes use a template; recipe
//! builds succeed or report the failing step, as JSON or as progress events (SSE). On `debian`: a Debian
//! package built and installed with dpkg inside a sandbox is installed in sandboxes of its template.

mod common;

use common::{Daemon, VM_LOCK};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

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

/// `POST /v1/templates` asking for progress events; returns the status and the `(event, data)` pairs (the
/// stream ends after `done` or `failed`), or the JSON error body as the only data when the answer is not a
/// stream.
async fn build_sse(d: &Daemon, body: Value) -> (StatusCode, Vec<(String, Value)>) {
    let answer = d.post_sse(&d.key, "/v1/templates", body).await;
    if let Some(body) = answer.body {
        return (answer.status, vec![(String::new(), body)]);
    }
    for (name, value) in &answer.events {
        assert_eq!(value["type"], name.as_str(), "event name and type agree");
    }
    (answer.status, answer.events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recipe_build_streams_progress_events() {
    let _serial = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    let recipe = json!({
        "base": "minimal",
        "steps": [
            "echo first > /root/first",
            "echo line-one; echo line-two; echo on-stderr >&2; sleep 1; printf no-newline",
        ],
    });
    let (status, events) = build_sse(&d, json!({"name": "tpl-sse", "recipe": recipe})).await;
    assert_eq!(status, StatusCode::OK);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"started"), "{events:?}");
    assert_eq!(events[0].1["steps"], 2);
    assert_eq!(names.last(), Some(&"done"), "{events:?}\n{}", d.log());
    assert_eq!(
        events.last().map(|e| &e.1["template"]["name"]),
        Some(&json!("tpl-sse"))
    );
    let phases: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "phase")
        .map(|(_, v)| &v["phase"])
        .collect();
    assert_eq!(phases, [&json!("creating_sandbox"), &json!("saving")]);
    let pos = |want: &dyn Fn(&(String, Value)) -> bool| events.iter().position(want).expect("event");
    for step in [1, 2] {
        let started = pos(&|(n, v)| n == "step_started" && v["step"] == step);
        let finished = pos(&|(n, v)| n == "step_finished" && v["step"] == step);
        assert!(started < finished, "{events:?}");
        assert_eq!(events[finished].1["exit_code"], 0);
        assert!(events[finished].1["duration_ms"].is_u64());
    }
    let step2_ms = events[pos(&|(n, v)| n == "step_finished" && v["step"] == 2)].1["duration_ms"]
        .as_u64()
        .unwrap_or(0);
    assert!(step2_ms >= 1000, "step 2 sleeps 1 s: {step2_ms} ms");
    let lines: Vec<(String, String)> = events
        .iter()
        .filter(|(n, v)| n == "step_output" && v["step"] == 2)
        .map(|(_, v)| {
            (
                v["stream"].as_str().unwrap_or_default().to_string(),
                v["line"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let stdout: Vec<&str> = lines
        .iter()
        .filter(|(s, _)| s == "stdout")
        .map(|(_, l)| l.as_str())
        .collect();
    assert_eq!(stdout, ["line-one", "line-two", "no-newline"], "{lines:?}");
    assert!(
        lines.contains(&("stderr".into(), "on-stderr".into())),
        "{lines:?}"
    );
    // Output lines come between their step's start and end.
    let first_line = pos(&|(n, v)| n == "step_output" && v["step"] == 2);
    assert!(first_line > pos(&|(n, v)| n == "step_started" && v["step"] == 2));
    assert!(first_line < pos(&|(n, v)| n == "step_finished" && v["step"] == 2));
    let (status, _) = d.call(Method::GET, "/v1/templates/tpl-sse", None).await;
    assert_eq!(status, StatusCode::OK);

    // A failing step: its exit code, then `failed` with its output; nothing saved, no build sandbox left.
    let recipe = json!({"base": "minimal", "steps": ["echo before-failing; exit 4", "echo never"]});
    let (status, events) = build_sse(&d, json!({"name": "tpl-sse-broken", "recipe": recipe})).await;
    assert_eq!(status, StatusCode::OK);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "started",
            "phase",
            "step_started",
            "step_output",
            "step_finished",
            "failed"
        ],
        "{events:?}"
    );
    assert_eq!(events[4].1["exit_code"], 4);
    assert_eq!(events[5].1["code"], "guest_error");
    let msg = events[5].1["message"].as_str().unwrap_or_default();
    assert!(msg.contains("step 1") && msg.contains("before-failing"), "{msg}");
    let (status, _) = d.call(Method::GET, "/v1/templates/tpl-sse-broken", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(d.list_ids().await.is_empty());

    // A request that is wrong from the start gets a JSON error, not a stream.
    let (status, body) = build_sse(&d, json!({"name": "tpl-sse", "recipe": recipe})).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body:?}");
    assert_eq!(body[0].1["error"]["code"], "conflict");
    let (status, _) = d.call(Method::DELETE, "/v1/templates/tpl-sse", None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
}

/// Builds a Debian package inside the sandbox (a command and a Python module) and installs it with dpkg: no
/// network involved.
const INSTALL_PACKAGE: &str = r#"set -e
mkdir -p /root/pkg/DEBIAN /root/pkg/usr/bin /root/pkg/usr/lib/python3/dist-packages/hearth_hello
printf '%s\n' 'Package: hearth-hello' 'Version: 1.0' 'Architecture: all' \
    'Maintainer: hearth tests <tests@example.invalid>' 'Description: a package installed inside a sandbox' \
    > /root/pkg/DEBIAN/control
printf '#!/bin/sh\necho hello-from-package\n' > /root/pkg/usr/bin/hearth-hello
chmod 755 /root/pkg/usr/bin/hearth-hello
echo 'GREETING = "imported-from-package"' > /root/pkg/usr/lib/python3/dist-packages/hearth_hello/__init__.py
dpkg-deb --root-owner-group --build /root/pkg /root/hearth-hello.deb
dpkg -i /root/hearth-hello.deb
rm -rf /root/pkg /root/hearth-hello.deb
echo configured > /root/setup-done
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_carries_a_file_and_an_installed_package() {
    assert!(
        common::template_built("debian"),
        "rootfs/debian.ext4 must be built (images/build.sh)"
    );
    let _serial = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    let src = d
        .create(json!({"template": "debian", "memory_mib": 512}))
        .await
        .id;
    let r = d
        .run(&src, json!({"cmd": INSTALL_PACKAGE, "timeout_s": 300}))
        .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let (status, t) = d
        .call(
            Method::POST,
            "/v1/templates",
            Some(json!({"name": "tpl-package", "from_sandbox": src})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{t}\n{}", d.log());
    d.destroy(&src).await;

    let s = d
        .create(json!({"template": "tpl-package", "memory_mib": 512}))
        .await
        .id;
    assert_eq!(d.sh(&s, "cat /root/setup-done").await.stdout, "configured\n");
    let r = d
        .sh(&s, "dpkg-query -W -f='${Status} ${Version}' hearth-hello")
        .await;
    assert_eq!(r.stdout, "install ok installed 1.0", "{r:?}");
    assert_eq!(d.sh(&s, "hearth-hello").await.stdout, "hello-from-package\n");
    let r = d
        .sh(
            &s,
            "python3 -c 'import hearth_hello; print(hearth_hello.GREETING)'",
        )
        .await;
    assert_eq!(r.stdout, "imported-from-package\n", "{r:?}");
    d.destroy(&s).await;
}
