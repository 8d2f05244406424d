//! Directory watches (`WatchDir`) through the real protocol, on the host's inotify.

mod common;

use std::time::Duration;

use common::*;
use hearth_proto::ErrorKind;
use hearth_proto::client::DirWatcher;
use hearth_proto::watch::{WatchEvent, WatchEventKind};

/// Collects events until `done` says the list is complete (or fails after 10 s, showing what came).
async fn collect(w: &mut DirWatcher, done: impl Fn(&[WatchEvent]) -> bool) -> Vec<WatchEvent> {
    let mut all = Vec::new();
    let res = tokio::time::timeout(T, async {
        while !done(&all) {
            match w.next_batch().await {
                Some(Ok(batch)) => all.extend(batch),
                Some(Err(e)) => panic!("watch failed: {e}"),
                None => break,
            }
        }
    })
    .await;
    assert!(res.is_ok(), "timed out; events so far: {all:#?}");
    all
}

/// Events as `kind path[->new]` strings, writes coalesced across batches, chmods dropped (their timing
/// depends on the file system).
fn summary(events: &[WatchEvent]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for e in events {
        if e.kind == WatchEventKind::Chmod {
            continue;
        }
        let s = match &e.new_path {
            Some(n) => format!("{:?} {}->{}", e.kind, e.path, n),
            None => format!("{:?} {}", e.kind, e.path),
        };
        if out.last() != Some(&s) {
            out.push(s);
        }
    }
    out
}

#[tokio::test]
async fn create_write_rename_remove_in_order() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let root = dir.path().to_owned();
    let mut w = c
        .watch_dir(root.to_str().expect("utf-8"), false)
        .await
        .expect("watch");
    std::fs::write(root.join("a.txt"), b"one").expect("write");
    std::fs::write(root.join("a.txt"), b"two").expect("write again");
    std::fs::rename(root.join("a.txt"), root.join("b.txt")).expect("rename");
    std::fs::remove_file(root.join("b.txt")).expect("remove");
    let events = collect(&mut w, |e| e.iter().any(|e| e.kind == WatchEventKind::Remove)).await;
    assert_eq!(
        summary(&events),
        [
            "Create a.txt",
            "Write a.txt",
            "Rename a.txt->b.txt",
            "Remove b.txt"
        ],
        "{events:#?}"
    );
    assert!(events.iter().all(|e| !e.is_dir));
}

#[tokio::test]
async fn chmod_and_moves_in_and_out() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let outside = scratch();
    let root = dir.path().to_owned();
    std::fs::write(outside.path().join("in.txt"), b"x").expect("write outside");
    std::fs::write(root.join("leaving.txt"), b"x").expect("write");
    let mut w = c
        .watch_dir(root.to_str().expect("utf-8"), false)
        .await
        .expect("watch");
    std::fs::rename(outside.path().join("in.txt"), root.join("in.txt")).expect("move in");
    std::fs::rename(root.join("leaving.txt"), outside.path().join("left.txt")).expect("move out");
    std::fs::set_permissions(
        root.join("in.txt"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .expect("chmod");
    let events = collect(&mut w, |e| e.iter().any(|e| e.kind == WatchEventKind::Chmod)).await;
    let kinds: Vec<(WatchEventKind, &str, Option<&str>)> = events
        .iter()
        .map(|e| (e.kind, e.path.as_str(), e.new_path.as_deref()))
        .collect();
    assert_eq!(
        kinds,
        [
            (WatchEventKind::Create, "in.txt", None),
            (WatchEventKind::Rename, "leaving.txt", None),
            (WatchEventKind::Chmod, "in.txt", None),
        ]
    );
}

#[tokio::test]
async fn recursive_watch_follows_new_and_renamed_subdirectories() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let root = dir.path().to_owned();
    std::fs::create_dir(root.join("old")).expect("mkdir");
    let mut w = c
        .watch_dir(root.to_str().expect("utf-8"), true)
        .await
        .expect("watch");
    // A subdirectory that existed before, one made now with content at once, one renamed. The pauses let
    // the agent see each step before the next (without them the order of what it reports depends on when it
    // reads, e.g. `new` may be gone before its watch is added; that case is covered below).
    let pause = || tokio::time::sleep(Duration::from_millis(100));
    std::fs::write(root.join("old/f1"), b"1").expect("write in old");
    pause().await;
    std::fs::create_dir_all(root.join("new/deep")).expect("mkdir -p");
    std::fs::write(root.join("new/deep/f2"), b"2").expect("write in new");
    pause().await;
    std::fs::rename(root.join("new"), root.join("moved")).expect("rename dir");
    pause().await;
    std::fs::write(root.join("moved/deep/f3"), b"3").expect("write in moved");
    let events = collect(&mut w, |e| e.iter().any(|e| e.path == "moved/deep/f3")).await;
    let s = summary(&events);
    let pos = |want: &str| {
        s.iter()
            .position(|x| x == want)
            .unwrap_or_else(|| panic!("no {want:?} in {s:#?}"))
    };
    assert!(pos("Create old/f1") < pos("Create new"));
    assert!(pos("Create new") < pos("Create new/deep/f2"));
    assert!(pos("Create new/deep/f2") < pos("Rename new->moved"));
    assert!(pos("Rename new->moved") < pos("Create moved/deep/f3"));
    assert!(
        events
            .iter()
            .any(|e| e.path == "new" && e.is_dir && e.kind == WatchEventKind::Create)
    );
}

#[tokio::test]
async fn recursive_watch_catches_a_directory_renamed_before_it_was_watched() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let root = dir.path().to_owned();
    let mut w = c
        .watch_dir(root.to_str().expect("utf-8"), true)
        .await
        .expect("watch");
    // All at once, before the agent can react to the first step.
    std::fs::create_dir_all(root.join("new/deep")).expect("mkdir -p");
    std::fs::rename(root.join("new"), root.join("moved")).expect("rename dir");
    tokio::time::sleep(Duration::from_millis(300)).await;
    std::fs::write(root.join("moved/deep/f3"), b"3").expect("write in moved");
    let events = collect(&mut w, |e| e.iter().any(|e| e.path == "moved/deep/f3")).await;
    assert!(
        summary(&events).contains(&"Rename new->moved".to_owned()),
        "{events:#?}"
    );
}

#[tokio::test]
async fn non_recursive_watch_ignores_subdirectory_content() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let root = dir.path().to_owned();
    std::fs::create_dir(root.join("sub")).expect("mkdir");
    let mut w = c
        .watch_dir(root.to_str().expect("utf-8"), false)
        .await
        .expect("watch");
    std::fs::write(root.join("sub/hidden"), b"x").expect("write in sub");
    std::fs::write(root.join("top"), b"x").expect("write top");
    let events = collect(&mut w, |e| e.iter().any(|e| e.path == "top")).await;
    assert!(events.iter().all(|e| !e.path.contains("hidden")), "{events:#?}");
}

#[tokio::test]
async fn removing_the_watched_directory_ends_the_stream() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let root = dir.path().join("w");
    std::fs::create_dir(&root).expect("mkdir");
    std::fs::write(root.join("f"), b"x").expect("write");
    let mut w = c
        .watch_dir(root.to_str().expect("utf-8"), false)
        .await
        .expect("watch");
    std::fs::remove_dir_all(&root).expect("rm -r");
    let events = collect(&mut w, |_| false).await;
    assert_eq!(summary(&events), ["Remove f"]);
    assert!(w.next_batch().await.is_none());
}

#[tokio::test]
async fn bad_paths_are_refused() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").expect("write");
    let kind =
        |r: Result<DirWatcher, hearth_proto::client::ClientError>| r.err().and_then(|e| e.guest_kind());
    assert_eq!(
        kind(c.watch_dir("/nonexistent/hearth-watch", false).await),
        Some(ErrorKind::NotFound)
    );
    assert_eq!(
        kind(c.watch_dir(file.to_str().expect("utf-8"), false).await),
        Some(ErrorKind::NotADirectory)
    );
    assert_eq!(
        kind(c.watch_dir("relative", false).await),
        Some(ErrorKind::InvalidPath)
    );
}

#[tokio::test]
async fn a_host_that_does_not_read_gets_an_overflow_not_unbounded_memory() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let root = dir.path().to_owned();
    let mut w = c
        .watch_dir(root.to_str().expect("utf-8"), false)
        .await
        .expect("watch");
    // Far more events than the 1 MiB window and the agent's queue hold, while nobody reads.
    let names: Vec<String> = (0..12_000).map(|i| format!("{i:0>200}")).collect();
    for n in &names {
        std::fs::write(root.join(n), b"").expect("create");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    std::fs::write(root.join("last"), b"").expect("create last");
    let events = collect(&mut w, |e| e.iter().any(|e| e.path == "last")).await;
    let overflows = events
        .iter()
        .filter(|e| e.kind == WatchEventKind::Overflow)
        .count();
    assert!(overflows >= 1, "no overflow in {} events", events.len());
    assert!(events.len() < names.len(), "nothing was dropped");
    // What did arrive before the overflow is in order.
    let creates: Vec<&str> = events
        .iter()
        .take_while(|e| e.kind != WatchEventKind::Overflow)
        .map(|e| e.path.as_str())
        .collect();
    assert!(!creates.is_empty());
    assert!(creates.windows(2).all(|p| p[0] < p[1]));
}

#[tokio::test]
async fn dropping_the_watcher_stops_the_watch() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let w = c
        .watch_dir(dir.path().to_str().expect("utf-8"), false)
        .await
        .expect("watch");
    drop(w);
    // The agent stays responsive, and a new watch works after the old one is gone.
    c.ping().await.expect("ping");
    let mut w = c
        .watch_dir(dir.path().to_str().expect("utf-8"), false)
        .await
        .expect("second watch");
    std::fs::write(dir.path().join("x"), b"").expect("write");
    let events = collect(&mut w, |e| !e.is_empty()).await;
    assert_eq!(events[0].path, "x");
}
