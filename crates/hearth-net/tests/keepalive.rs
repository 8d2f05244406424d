//! The egress proxy judges every request of a kept-alive HTTP connection, over real connections: a guest
//! namespace dials through the data plane (real nftables redirect) to the daemon's proxy, which connects to a
//! keep-alive test host on the fake internet (see `stack_support`). Needs root.

#![allow(clippy::unwrap_used)]

mod plane_fixture;
mod proxy_support;
mod stack_support;

use hearth_api::{EgressDefault, EgressEvent, EgressPolicy};
use hearth_net::limits::NetLimits;
use hearth_net::policy::Policy;
use hearth_net::proxy::ProxyLimits;
use stack_support::{Client, Seen, Services, Stack, connect, web};

fn policy(default: EgressDefault, allow: &[&str]) -> Policy {
    Policy::parse(&EgressPolicy {
        default,
        allow: allow.iter().map(|s| s.to_string()).collect(),
        deny: vec![],
    })
    .unwrap()
}

fn allowed_only() -> Policy {
    policy(EgressDefault::Deny, &["allowed.test"])
}

fn sandbox(stack: &Stack, i: u8, policy: Policy) -> (plane_fixture::Sandbox, Services) {
    stack.sandbox(i, policy, NetLimits::for_nofile(4096), ProxyLimits::default())
}

fn get(path: &str, host: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n")
}

fn last_event(services: &Services) -> EgressEvent {
    services
        .ctx
        .audit
        .snapshot()
        .events
        .pop()
        .expect("an audit entry")
}

fn paths(seen: &[Seen]) -> Vec<&str> {
    seen.iter().map(|s| s.path.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_on_a_kept_alive_connection_is_judged() {
    let stack = Stack::new(40);
    let (sb, services) = sandbox(&stack, 2, allowed_only());
    let mut c = Client::new(connect(&sb.guest.path, web()).await);

    c.send(&get("/1", "allowed.test")).await;
    assert_eq!(
        c.response().await,
        Some((200, "ten host=allowed.test path=/1 body=0".into()))
    );
    // A body that looks like a request for another host is a body: framed by its length, not judged.
    let smuggled = get("/smuggled", "other.test");
    c.send(&format!(
        "POST /2 HTTP/1.1\r\nHost: Allowed.Test:80\r\nContent-Length: {}\r\n\r\n{smuggled}",
        smuggled.len()
    ))
    .await;
    let (status, body) = c.response().await.unwrap();
    let n = smuggled.len();
    assert_eq!(
        (status, body),
        (200, format!("ten host=Allowed.Test:80 path=/2 body={n}"))
    );
    // The same in chunks, with an extension and a trailer.
    let (a, b) = smuggled.split_at(10);
    c.send(&format!(
        "PUT /3 HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n{:x};x=y\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\nX-T: 1\r\n\r\n",
        a.len(),
        b.len()
    ))
    .await;
    assert_eq!(
        c.response().await.unwrap().1,
        format!("ten host=allowed.test path=/3 body={n}")
    );

    // Another host on the same connection: refused, and the connection ends.
    c.send(&get("/4", "other.test")).await;
    let (status, body) = c.response().await.unwrap();
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("host_changed"), "{body}");
    assert!(c.closed().await);

    assert_eq!(paths(&stack.seen()), ["/1", "/2", "/3"]);
    assert_eq!(stack.seen()[1].body, smuggled.as_bytes());
    assert_eq!(
        stack.host_connections.load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    let e = last_event(&services);
    assert_eq!(
        (e.allowed, e.reason.as_str(), e.name.as_deref(), e.port),
        (false, "host_changed", Some("other.test"), Some(80))
    );
    assert_eq!(e.destination.as_deref(), Some("203.0.113.10"));
    // The allowed later requests added no entry: one for the connection, one for the refusal.
    let log = services.ctx.audit.snapshot().events;
    assert_eq!(log.len(), 2, "{log:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_judged_one_by_one() {
    let stack = Stack::new(41);
    let (sb, _services) = sandbox(&stack, 2, allowed_only());
    let mut c = Client::new(connect(&sb.guest.path, web()).await);
    // Three requests in one write: the second names another host.
    c.send(&format!(
        "{}{}{}",
        get("/a", "allowed.test"),
        get("/b", "other.test"),
        get("/c", "allowed.test")
    ))
    .await;
    assert_eq!(c.response().await.unwrap().0, 200);
    assert_eq!(c.response().await.unwrap().0, 403);
    assert!(c.closed().await);
    assert_eq!(paths(&stack.seen()), ["/a"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_change_applies_to_the_next_request_of_an_open_connection() {
    let stack = Stack::new(42);
    let (sb, services) = sandbox(&stack, 2, allowed_only());
    let mut c = Client::new(connect(&sb.guest.path, web()).await);
    c.send(&get("/before", "allowed.test")).await;
    assert_eq!(c.response().await.unwrap().0, 200);
    services
        .ctx
        .set_policy(policy(EgressDefault::Deny, &["other.test"]));
    c.send(&get("/after", "allowed.test")).await;
    let (status, body) = c.response().await.unwrap();
    assert_eq!(status, 403);
    assert!(body.contains("default_deny"), "{body}");
    assert_eq!(paths(&stack.seen()), ["/before"]);
    assert_eq!(last_event(&services).reason, "default_deny");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_cannot_be_framed_are_refused() {
    let stack = Stack::new(43);
    let (sb, services) = sandbox(&stack, 2, allowed_only());
    // A first request with both lengths: refused before any connection is made.
    let mut c = Client::new(connect(&sb.guest.path, web()).await);
    c.send(
        "POST / HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    .await;
    let (status, body) = c.response().await.unwrap();
    assert_eq!(status, 400, "{body}");
    assert_eq!(last_event(&services).reason, "malformed_http");
    // An upgrade to h2c (whose streams could name any host): refused too.
    let mut c = Client::new(connect(&sb.guest.path, web()).await);
    c.send("GET / HTTP/1.1\r\nHost: allowed.test\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n")
        .await;
    assert_eq!(c.response().await.unwrap().0, 400);
    assert_eq!(
        stack.host_connections.load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    // A later request with a bad length: the earlier one is answered, then 400.
    let mut c = Client::new(connect(&sb.guest.path, web()).await);
    c.send(&format!(
        "{}POST /bad HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 1, 2\r\n\r\nx",
        get("/ok", "allowed.test")
    ))
    .await;
    assert_eq!(c.response().await.unwrap().0, 200);
    assert_eq!(c.response().await.unwrap().0, 400);
    assert!(c.closed().await);
    assert_eq!(paths(&stack.seen()), ["/ok"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_connection_is_opaque_only_after_the_server_switches() {
    let stack = Stack::new(44);
    let (sb, _services) = sandbox(&stack, 2, allowed_only());
    let upgrade = |path: &str| {
        format!(
            "GET {path} HTTP/1.1\r\nHost: allowed.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
             Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
    };
    // Switched: what follows is WebSocket data, echoed by the host, whatever it looks like.
    let mut c = Client::new(connect(&sb.guest.path, web()).await);
    c.send(&upgrade("/ws")).await;
    assert_eq!(c.response().await.unwrap().0, 101);
    let frame = get("/not-a-request", "other.test");
    c.send(&frame).await;
    assert_eq!(c.bytes(frame.len()).await.unwrap(), frame.as_bytes());
    // Not switched (the server answers 200): the connection stays framed and judged.
    let mut c = Client::new(connect(&sb.guest.path, web()).await);
    c.send(&upgrade("/no-upgrade")).await;
    assert_eq!(c.response().await.unwrap().0, 200);
    c.send(&get("/next", "other.test")).await;
    assert_eq!(c.response().await.unwrap().0, 403);
    // An upgrade as a later request: refused (the answer to it could not be told apart).
    let mut c = Client::new(connect(&sb.guest.path, web()).await);
    c.send(&format!("{}{}", get("/first", "allowed.test"), upgrade("/ws")))
        .await;
    assert_eq!(c.response().await.unwrap().0, 200);
    assert_eq!(c.response().await.unwrap().0, 400);
    assert_eq!(paths(&stack.seen()), ["/ws", "/no-upgrade", "/first"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_decided_without_a_name_cannot_name_one_later() {
    let stack = Stack::new(45);
    // The test host's address is allowed by CIDR; `allowed.test` by name would go there too.
    let (sb, services) = sandbox(
        &stack,
        2,
        policy(EgressDefault::Deny, &["203.0.113.10", "other.test"]),
    );
    let mut c = Client::new(connect(&sb.guest.path, "203.0.113.10:80".parse().unwrap()).await);
    c.send(&get("/ip", "203.0.113.10")).await;
    assert_eq!(c.response().await.unwrap().0, 200);
    c.send(&get("/name", "other.test")).await;
    assert_eq!(c.response().await.unwrap().0, 403);
    assert_eq!(paths(&stack.seen()), ["/ip"]);
    assert_eq!(last_event(&services).reason, "host_changed");
}
