//! In-process template tests with the fake VMM (`fake/`): saving a sandbox as a template with and without
//! memory, creating from it (boot vs restore), listing next to the built-in images, and the deletion rules;
//! recipe builds and the progress events they report.

mod fake;

use std::sync::atomic::Ordering;

use fake::*;
use hearth_api::{CreateSandboxRequest, CreateTemplateRequest, ErrorCode, TemplateBuildEvent};
use hearthd::service::templates::BuildProgress;

fn from(template: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        template: Some(template.into()),
        ..create_req(60)
    }
}

#[tokio::test]
async fn templates_from_sandboxes_with_and_without_memory() {
    let f = fixture(40);
    let src = f.svc.create(create_req(60)).await.expect("create");
    let t = f
        .svc
        .create_template(CreateTemplateRequest {
            name: "saved".into(),
            from_sandbox: Some(src.id.clone()),
            include_memory: false,
            ..Default::default()
        })
        .await
        .expect("template");
    assert!(!t.builtin && t.snapshot_id.is_none() && t.size_bytes > 0, "{t:?}");
    assert!(
        f.svc.list_snapshots().expect("snapshots").is_empty(),
        "the checkpoint was dropped"
    );
    let image = f.svc.settings().paths.user_template_image("saved");
    // The checkpoint's disk copy, flattened as the raw format its manifest records.
    assert_eq!(std::fs::read(&image).expect("image"), b"disk copy");
    let names: Vec<_> = f
        .svc
        .list_templates()
        .expect("list")
        .into_iter()
        .map(|t| (t.name, t.builtin))
        .collect();
    assert_eq!(
        names,
        vec![("minimal".to_string(), true), ("saved".to_string(), false)]
    );
    let dup = CreateTemplateRequest {
        name: "saved".into(),
        from_sandbox: Some(src.id.clone()),
        include_memory: false,
        ..Default::default()
    };
    assert_eq!(
        f.svc.create_template(dup).await.expect_err("taken").code(),
        ErrorCode::Conflict
    );

    let restores = f.vmm.restores.load(Ordering::SeqCst);
    let a = f.svc.create(from("saved")).await.expect("create from template");
    assert_eq!(a.template, "saved");
    assert_eq!(
        f.vmm.restores.load(Ordering::SeqCst),
        restores,
        "a disk-only template boots"
    );
    assert_eq!(
        f.svc.delete_template("saved").await.expect_err("in use").code(),
        ErrorCode::Conflict
    );
    f.svc.destroy(&a.id, "test").await.expect("destroy");
    f.svc.delete_template("saved").await.expect("delete");
    assert!(!image.exists());

    // With memory: creates restore the checkpoint.
    let t = f
        .svc
        .create_template(CreateTemplateRequest {
            name: "warm".into(),
            from_sandbox: Some(src.id.clone()),
            include_memory: true,
            ..Default::default()
        })
        .await
        .expect("template with memory");
    let snap = t.snapshot_id.clone().expect("snapshot kept");
    let b = f
        .svc
        .create(from("warm"))
        .await
        .expect("create from warm template");
    assert_eq!(b.template, "warm");
    assert_eq!(b.snapshot_id.as_deref(), Some(snap.as_str()));
    assert_eq!(
        f.vmm.restores.load(Ordering::SeqCst),
        restores + 1,
        "restored, not booted"
    );
    assert_eq!(
        f.svc.delete_snapshot(&snap).await.expect_err("template's").code(),
        ErrorCode::Conflict
    );
    assert_eq!(
        f.svc.delete_template("warm").await.expect_err("in use").code(),
        ErrorCode::Conflict
    );
    f.svc.destroy(&b.id, "test").await.expect("destroy");
    f.svc.delete_template("warm").await.expect("delete");
    assert!(f.svc.list_snapshots().expect("snapshots").is_empty());

    assert_eq!(
        f.svc
            .delete_template("minimal")
            .await
            .expect_err("builtin")
            .code(),
        ErrorCode::Conflict
    );
    assert_eq!(
        f.svc.delete_template("nope").await.expect_err("unknown").code(),
        ErrorCode::NotFound
    );
    let bad = CreateTemplateRequest {
        name: "../x".into(),
        from_sandbox: Some(src.id.clone()),
        include_memory: false,
        ..Default::default()
    };
    assert_eq!(
        f.svc.create_template(bad).await.expect_err("bad name").code(),
        ErrorCode::InvalidArgument
    );
}

#[tokio::test]
async fn recipe_builds_succeed_or_report_the_failing_step() {
    let f = fixture(40);
    let recipe = |steps: &[&str]| hearth_api::Recipe {
        base: "minimal".into(),
        steps: steps.iter().map(|s| s.to_string()).collect(),
        start_cmd: Some("serve".into()),
        ready_cmd: Some("check".into()),
        ..Default::default()
    };
    let t = f
        .svc
        .create_template(CreateTemplateRequest {
            name: "built".into(),
            recipe: Some(recipe(&["echo one", "echo two"])),
            ..Default::default()
        })
        .await
        .expect("build");
    assert!(t.snapshot_id.is_some(), "a start_cmd keeps the memory");
    let e = f
        .svc
        .create_template(CreateTemplateRequest {
            name: "broken".into(),
            recipe: Some(recipe(&["echo one", "false # fails", "echo never"])),
            ..Default::default()
        })
        .await
        .expect_err("failing step");
    assert_eq!(e.code(), ErrorCode::GuestError);
    assert!(
        e.to_string()
            .contains("step 2 (false # fails) failed with exit code 1"),
        "{e}"
    );
    assert!(f.svc.get_template("broken").is_err());
    // Build sandboxes are gone either way.
    assert!(f.svc.list(&[], None).expect("list").0.is_empty());
    let both = CreateTemplateRequest {
        name: "x".into(),
        from_sandbox: Some("sbx_0000000000000000".into()),
        recipe: Some(recipe(&[])),
        ..Default::default()
    };
    assert_eq!(
        f.svc.create_template(both).await.expect_err("both").code(),
        ErrorCode::InvalidArgument
    );
}

/// Every event of a build, in order, as `name` or `name:detail` strings.
async fn build_events(f: &Fixture, name: &str, steps: &[&str]) -> (Vec<String>, Vec<TemplateBuildEvent>) {
    let (progress, mut rx) = BuildProgress::channel(8);
    let req = CreateTemplateRequest {
        name: name.into(),
        recipe: Some(hearth_api::Recipe {
            base: "minimal".into(),
            steps: steps.iter().map(|s| s.to_string()).collect(),
            start_cmd: Some("serve".into()),
            ready_cmd: Some("check".into()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let svc = f.svc.clone();
    let build = tokio::spawn(async move { svc.create_template_reporting(req, &progress).await });
    let mut events = Vec::new();
    while let Some(ev) = rx.recv().await {
        events.push(ev);
    }
    let _ = build.await.expect("build task");
    let names = events
        .iter()
        .map(|ev| match ev {
            TemplateBuildEvent::Started { steps, .. } => format!("started:{steps}"),
            TemplateBuildEvent::Phase { phase } => format!("phase:{phase:?}"),
            TemplateBuildEvent::StepStarted { step, cmd } => format!("step_started:{step}:{cmd}"),
            TemplateBuildEvent::StepOutput { step, stream, line } => {
                format!("step_output:{step}:{stream:?}:{line}")
            }
            TemplateBuildEvent::StepFinished { step, exit_code, .. } => {
                format!("step_finished:{step}:{exit_code}")
            }
            TemplateBuildEvent::Done { template } => format!("done:{}", template.name),
            TemplateBuildEvent::Failed { code, .. } => format!("failed:{code:?}"),
        })
        .collect();
    (names, events)
}

#[tokio::test]
async fn recipe_builds_report_their_progress() {
    let f = fixture(40);
    let (names, _) = build_events(&f, "reported", &["echo one", "echo two"]).await;
    assert_eq!(
        names,
        [
            "started:2",
            "phase:CreatingSandbox",
            "step_started:1:echo one",
            "step_output:1:Stdout:ran echo one with FOO=",
            "step_finished:1:0",
            "step_started:2:echo two",
            "step_output:2:Stdout:ran echo two with FOO=",
            "step_finished:2:0",
            "phase:StartCmd",
            "phase:WaitingReady",
            "phase:Saving",
            "done:reported",
        ]
    );
    assert!(f.svc.get_template("reported").is_ok());

    let (names, events) = build_events(&f, "failing", &["echo one", "false # fails", "echo never"]).await;
    assert_eq!(
        names,
        [
            "started:3",
            "phase:CreatingSandbox",
            "step_started:1:echo one",
            "step_output:1:Stdout:ran echo one with FOO=",
            "step_finished:1:0",
            "step_started:2:false # fails",
            "step_output:2:Stdout:ran false # fails with FOO=",
            "step_finished:2:1",
            "failed:GuestError",
        ]
    );
    let Some(TemplateBuildEvent::Failed { message, .. }) = events.last() else {
        panic!("no failed event: {events:?}");
    };
    assert!(
        message.contains("step 2 (false # fails) failed with exit code 1: ran false # fails"),
        "{message}"
    );
    assert!(f.svc.get_template("failing").is_err());
    assert!(
        f.svc.list(&[], None).expect("list").0.is_empty(),
        "build sandboxes removed"
    );

    // A reader that goes away does not stop the build.
    let (progress, rx) = BuildProgress::channel(1);
    drop(rx);
    let t = f
        .svc
        .create_template_reporting(
            CreateTemplateRequest {
                name: "unwatched".into(),
                recipe: Some(hearth_api::Recipe {
                    base: "minimal".into(),
                    steps: vec!["echo a".into(), "echo b".into()],
                    ..Default::default()
                }),
                ..Default::default()
            },
            &progress,
        )
        .await
        .expect("build without a reader");
    assert_eq!(t.name, "unwatched");
}
