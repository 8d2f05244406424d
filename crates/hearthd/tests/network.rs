//! Sandbox networking on real VMs, against a fake internet of test hosts in namespaces this test made
//! (netfix). Covers the issue's "must be shown" list: egress policy by CIDR and domain over HTTP and TLS,
//! names resolving into private space refused, DNS refusals that never reach upstream, blocked direct DNS, the
//! host/metadata/other sandboxes unreachable, private networks by name with isolation and detach, no ingress,
//! exposed ports behind the key or a token, runtime policy changes, the audit log, and no leftovers after
//! destroy and restart.

#![allow(clippy::unwrap_used)]

mod common;
mod netfix;

use std::net::{Ipv4Addr, SocketAddr};

use common::Daemon;
use netfix::{DNS, FakeInternet, HOST_A, HOST_B, METADATA, PRIVATE, UPLINK_ADDR};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

const TEMPLATE: &str = "debian";

/// Runs the probes in the guest (one python3 process) and returns one `OK …`/`ERR …` line per probe.
async fn probe(d: &Daemon, id: &str, probes: Value) -> Vec<String> {
    let (status, _) = d
        .put_file(id, "/root/probe.py", netfix::PROBE_PY.as_bytes().to_vec())
        .await;
    assert!(status.is_success(), "upload probe: {status}");
    let r = d
        .run(
            id,
            json!({"argv": ["python3", "/root/probe.py", probes.to_string()], "timeout_s": 120}),
        )
        .await;
    assert_eq!(r.exit_code, 0, "probe failed: {} {}", r.stdout, r.stderr);
    serde_json::from_str(r.stdout.trim()).unwrap_or_else(|e| panic!("probe output {:?}: {e}", r.stdout))
}

fn ok(line: &str) -> bool {
    line.starts_with("OK ")
}

fn netns_exists(id: &str) -> bool {
    hearth_net::netns_path(id).exists()
}

/// The `hrth…` links in the uplink namespace.
fn uplink_links(fi: &FakeInternet) -> Vec<String> {
    let ns = fi.uplink().to_path_buf();
    hearth_net::netns::in_netns(&ns, || {
        let out = std::process::Command::new("ip")
            .args(["-o", "link", "show"])
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_string())
            .filter(|n| n.starts_with("hrth"))
            .collect())
    })
    .unwrap()
}

async fn log_of(d: &Daemon, id: &str) -> Vec<Value> {
    let resp = d
        .req(Method::GET, &format!("/v1/sandboxes/{id}/network/log"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let v: Value = resp.json().await.unwrap();
    v["events"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_policy_by_cidr_and_domain_with_dns_and_audit() {
    let fi = FakeInternet::new();
    let flags = fi.daemon_flags("10.213.21.0/24");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let d = Daemon::start_with(&flags).await;

    // A default-allow sandbox reaches the fake internet directly.
    let open = d.create(json!({"template": TEMPLATE})).await;
    // A default-deny sandbox that may reach a.test by name (and, to prove those are refused anyway, names
    // that resolve into private and metadata space).
    let closed = d
        .create(json!({"template": TEMPLATE, "network": {"egress": {
            "default": "deny", "allow": ["a.test", "private.test", "meta.test"]}}}))
        .await;
    let host_seen = fi.uplink_server(2222);

    let r = probe(
        &d,
        &open.id,
        json!([
            ["http", format!("http://{HOST_A}/")],
            ["udp", HOST_A.to_string(), 5353],
            ["resolve", "www.a.test"],
        ]),
    )
    .await;
    assert!(
        ok(&r[0]) && r[0].contains(&format!("host={HOST_A}")),
        "default allow reaches host A: {r:?}"
    );
    assert!(ok(&r[1]), "default allow: UDP too: {r:?}");
    assert_eq!(
        r[2],
        format!("OK {HOST_A}"),
        "default allow resolves any name: {r:?}"
    );

    let open_net: Value = d
        .req(Method::GET, &format!("/v1/sandboxes/{}/network", open.id))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let open_addr = open_net["address"].as_str().unwrap().to_string();

    let r = probe(
        &d,
        &closed.id,
        json!([
            ["http", "http://a.test/"],                              // 0 allowed by name
            ["tls", "a.test", 443, "a.test"],                        // 1 allowed by SNI
            ["resolve", "b.test"],                                   // 2 not in the allowlist: refused
            ["http", format!("http://{HOST_B}/")],                   // 3 B by address
            ["http", format!("http://{HOST_B}/"), {"Host": "a.test"}], // 4 Host fronting to B's address
            ["tcp", HOST_B.to_string(), 8080],                       // 5 B, a port the proxy does not see
            ["udp", HOST_A.to_string(), 5353],                       // 6 UDP to the allowed host
            ["http", "http://private.test/"],                        // 7 allowed name resolving into 10/8
            ["http", "http://meta.test/"],                           // 8 ... and to the metadata address
            ["http", format!("http://{METADATA}/")],                       // 9 metadata by address
            ["tcp", UPLINK_ADDR.to_string(), 2222],                  // 10 the host (uplink) address
            ["dns", DNS.to_string(), "direct.test"],                 // 11 DNS to another resolver
            ["tcp", DNS.to_string(), 53],                            // 12 DNS over TCP to it
            ["tcp", open_addr.clone(), 22],                          // 13 another sandbox
            ["tcp", hearth_net::GATEWAY.to_string(), 22],            // 14 the gateway's other ports
            ["tcp", METADATA.to_string(), 8080],                     // 15 metadata, a port the proxy does not see
        ]),
    )
    .await;
    assert!(
        ok(&r[0]) && r[0].contains(&format!("host={HOST_A}")),
        "a.test over HTTP: {r:?}"
    );
    assert!(
        ok(&r[1]) && r[1].contains("sni=a.test") && r[1].contains(&format!("host={HOST_A}")),
        "a.test over TLS: {r:?}"
    );
    assert!(!ok(&r[2]), "b.test must not resolve: {r:?}");
    assert!(
        !fi.seen.queried("b.test"),
        "the refused name must not reach upstream: {:?} {r:?}",
        fi.seen.queries.lock().unwrap()
    );
    assert!(!ok(&r[3]), "B's address must be refused: {r:?}");
    assert!(
        !ok(&r[4]) || !r[4].contains(&format!("host={HOST_B}")),
        "fronting must not reach B: {r:?}"
    );
    assert!(!ok(&r[5]), "B on another port must be refused: {r:?}");
    assert!(!ok(&r[6]), "UDP is not allowed by a domain rule: {r:?}");
    assert!(!ok(&r[7]), "a name resolving to 10/8 must be refused: {r:?}");
    assert!(
        !ok(&r[8]),
        "a name resolving to the metadata address must be refused: {r:?}"
    );
    assert!(!ok(&r[9]), "metadata address: {r:?}");
    assert!(!ok(&r[15]), "metadata address, kernel path: {r:?}");
    assert!(!ok(&r[10]), "the host's address: {r:?}");
    assert!(!ok(&r[11]), "direct DNS: {r:?}");
    assert!(
        !fi.seen.queried("direct.test"),
        "direct DNS must not reach the resolver"
    );
    assert!(!ok(&r[12]), "DNS over TCP: {r:?}");
    assert!(!ok(&r[13]), "another sandbox: {r:?}");
    assert!(!ok(&r[14]), "the gateway serves only DNS and the proxy: {r:?}");
    assert_eq!(fi.seen.conns_to(HOST_B), 0, "nothing reached host B");
    assert_eq!(fi.seen.conns_to(METADATA) + fi.seen.conns_to(PRIVATE), 0);
    assert_eq!(*host_seen.lock().unwrap(), 0, "nothing reached the host");

    // The audit log has the allowed and the denied attempts, with reasons.
    let log = log_of(&d, &closed.id).await;
    let has = |f: &dyn Fn(&Value) -> bool| log.iter().any(f);
    assert!(
        has(&|e| e["allowed"] == true && e["name"] == "a.test"),
        "allowed a.test logged: {log:?}"
    );
    assert!(
        has(&|e| e["allowed"] == false && e["name"].as_str().is_some_and(|n| n.starts_with("b.test"))),
        "denied b.test logged: {log:?}"
    );
    assert!(
        has(&|e| e["allowed"] == false && e["reason"] == "resolves_to_denied"),
        "{log:?}"
    );
    assert!(
        has(&|e| e["allowed"] == false && e["protocol"] == "udp"),
        "kernel-path denial logged: {log:?}"
    );

    // A runtime policy change takes effect for the next connection.
    let resp = d
        .req(Method::PATCH, &format!("/v1/sandboxes/{}/network", closed.id))
        .json(&json!({"egress": {"default": "deny", "allow": ["a.test", "b.test", format!("{HOST_B}/32")]}}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        StatusCode::OK,
        "{}",
        resp.text().await.unwrap_or_default()
    );
    let r = probe(
        &d,
        &closed.id,
        json!([["http", "http://b.test/"], ["tcp", HOST_B.to_string(), 8080]]),
    )
    .await;
    assert!(
        ok(&r[0]) && r[0].contains(&format!("host={HOST_B}")),
        "b.test allowed now: {r:?}"
    );
    assert!(ok(&r[1]), "B's CIDR allowed now: {r:?}");

    // A bad policy is refused with the rule named, and the old one stays.
    let resp = d
        .req(Method::PATCH, &format!("/v1/sandboxes/{}/network", closed.id))
        .json(&json!({"egress": {"allow": ["not a rule"]}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_argument", "{body}");

    // The metrics count egress attempts.
    let metrics = d
        .http
        .get(d.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("hearth_egress_attempts_total"),
        "egress metrics: {metrics}"
    );

    // Destroying leaves nothing behind.
    for id in [&open.id, &closed.id] {
        d.destroy(id).await;
        assert!(!netns_exists(id), "namespace of {id} left behind");
    }
    assert!(
        uplink_links(&fi).is_empty(),
        "uplink links left: {:?}",
        uplink_links(&fi)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_networks_ingress_exposed_ports_and_restart() {
    let fi = FakeInternet::new();
    let flags = fi.daemon_flags("10.213.22.0/24");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut d = Daemon::start_with(&flags).await;

    for name in ["blue", "green"] {
        let resp = d
            .req(Method::POST, "/v1/networks")
            .json(&json!({"name": name}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::CREATED);
    }
    let web = d
        .create(json!({"template": TEMPLATE, "name": "web", "networks": ["blue"]}))
        .await;
    let client = d
        .create(json!({"template": TEMPLATE, "networks": ["blue"]}))
        .await;
    let outsider = d
        .create(json!({"template": TEMPLATE, "networks": ["green"]}))
        .await;

    let (status, body) = d
        .run_raw(&web.id, json!({"cmd": "cd /root && echo served-by-web > index.html && exec python3 -m http.server 8000 >/dev/null 2>&1", "background": true}))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let web_addr: String = {
        let v: Value = d
            .req(Method::GET, &format!("/v1/sandboxes/{}/network", web.id))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["networks"], json!(["blue"]));
        v["address"].as_str().unwrap().to_string()
    };
    // Give the server a moment to listen (TCG).
    let mut reached = Vec::new();
    for _ in 0..10 {
        reached = probe(
            &d,
            &client.id,
            json!([
                ["http", "http://web.blue.internal:8000/index.html"],
                ["http", format!("http://{}.blue.internal:8000/index.html", web.id)],
                ["http", format!("http://{web_addr}:8000/index.html")],
            ]),
        )
        .await;
        if ok(&reached[0]) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    assert!(
        reached.iter().all(|l| ok(l) && l.contains("served-by-web")),
        "peers talk by name and address: {reached:?}"
    );

    let r = probe(
        &d,
        &outsider.id,
        json!([["tcp", web_addr.clone(), 8000], ["resolve", "web.blue.internal"]]),
    )
    .await;
    assert!(!ok(&r[0]), "a sandbox on another network reaches nothing: {r:?}");
    assert!(!ok(&r[1]), "nor resolves the other network's names: {r:?}");

    // Nothing from the uplink side connects to a sandbox.
    let web_ip: Ipv4Addr = web_addr.parse().unwrap();
    assert!(
        !fi.connect_from_internet(SocketAddr::from((web_ip, 8000))),
        "ingress must be blocked"
    );

    // Exposed port: with the key, with a token, not without either.
    let path = format!("/v1/sandboxes/{}/ports/8000/index.html", web.id);
    let resp = d.req(Method::GET, &path).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.text().await.unwrap().trim(), "served-by-web");
    let resp = d.http.get(d.url(&path)).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let token: Value = d
        .req(
            Method::POST,
            &format!("/v1/sandboxes/{}/ports/8000/token", web.id),
        )
        .json(&json!({"ttl_s": 60}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let t = token["token"].as_str().unwrap();
    let resp = d
        .http
        .get(d.url(&format!("{path}?hearth_token={t}")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    // A token for another port, or a tampered one, does not open this port.
    let resp = d
        .http
        .get(d.url(&format!("/v1/sandboxes/{}/ports/8001/?hearth_token={t}", web.id)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let flipped = if t.ends_with('0') { '1' } else { '0' };
    let tampered = format!("{}{flipped}", &t[..t.len() - 1]);
    let resp = d
        .http
        .get(d.url(&format!("{path}?hearth_token={tampered}")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);

    // Upgrades (WebSocket and the like) pass through the exposed port both ways.
    upgrade_round_trip(&d, &web.id).await;

    // Deleting a network in use is refused; detaching cuts the link at once.
    let resp = d.req(Method::DELETE, "/v1/networks/blue").send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::CONFLICT);
    let resp = d
        .req(
            Method::DELETE,
            &format!("/v1/networks/blue/members/{}", client.id),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let r = probe(&d, &client.id, json!([["tcp", web_addr.clone(), 8000]])).await;
    assert!(!ok(&r[0]), "detached: {r:?}");

    // A daemon restart keeps the running sandboxes connected ...
    d.kill9_and_restart().await;
    let resp = d
        .req(Method::PUT, &format!("/v1/networks/blue/members/{}", client.id))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let r = probe(
        &d,
        &client.id,
        json!([["http", "http://web.blue.internal:8000/index.html"]]),
    )
    .await;
    assert!(ok(&r[0]), "connected again after restart: {r:?}");

    // ... and a namespace nobody owns (a create killed half-way) is removed at the next start.
    let orphan = "sbx_00000000deadbeef";
    let plane = hearth_net::plane::Plane::new(hearth_net::plane::PlaneConfig {
        uplink_netns: fi.uplink().to_path_buf(),
        sandbox_net: "10.213.22.0/24".parse().unwrap(),
        sandbox_net6: None,
    })
    .unwrap();
    plane
        .create_sandbox(&hearth_net::plane::SandboxNet {
            id: orphan.into(),
            address: "10.213.22.250".parse().unwrap(),
            default_allow: true,
            allow: vec![],
            deny: vec![],
            proxy_tcp: false,
            peers: vec![],
            extra_denied: vec![],
            guest_link: hearth_net::plane::GuestLink::Tap,
        })
        .unwrap();
    assert!(netns_exists(orphan));
    d.kill9_and_restart().await;
    assert!(!netns_exists(orphan), "orphan namespace swept at start");

    for id in [&web.id, &client.id, &outsider.id] {
        d.destroy(id).await;
        assert!(!netns_exists(id));
    }
    assert!(
        uplink_links(&fi).is_empty(),
        "uplink links left: {:?}",
        uplink_links(&fi)
    );
    for name in ["blue", "green"] {
        let resp = d
            .req(Method::DELETE, &format!("/v1/networks/{name}"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::NO_CONTENT);
    }
}

async fn address_of(d: &Daemon, id: &str) -> String {
    let v: Value = d
        .req(Method::GET, &format!("/v1/sandboxes/{id}/network"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["address"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_and_forked_sandboxes_keep_working_connectivity() {
    let fi = FakeInternet::new();
    let flags = fi.daemon_flags("10.213.23.0/24");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let d = Daemon::start_with(&flags).await;
    let resp = d
        .req(Method::POST, "/v1/networks")
        .json(&json!({"name": "lab"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    let parent = d
        .create(json!({"template": TEMPLATE, "networks": ["lab"],
            "network": {"egress": {"default": "deny", "allow": ["a.test"]}}}))
        .await;
    let reach = json!([["http", "http://a.test/"], ["tcp", HOST_B.to_string(), 8080]]);
    let r = probe(&d, &parent.id, reach.clone()).await;
    assert!(ok(&r[0]) && !ok(&r[1]), "before pause: {r:?}");

    // Pause to zero and resume: same address, the network works again, the policy still holds.
    let before = address_of(&d, &parent.id).await;
    let resp = d
        .req(Method::POST, &format!("/v1/sandboxes/{}/pause", parent.id))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        StatusCode::OK,
        "{}",
        resp.text().await.unwrap_or_default()
    );
    let resp = d
        .req(Method::POST, &format!("/v1/sandboxes/{}/resume", parent.id))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        StatusCode::OK,
        "{}",
        resp.text().await.unwrap_or_default()
    );
    assert_eq!(address_of(&d, &parent.id).await, before);
    let r = probe(&d, &parent.id, reach.clone()).await;
    assert!(ok(&r[0]) && !ok(&r[1]), "after resume: {r:?}");

    // Forks: each child its own address, working egress under the inherited policy, and on the parent's
    // private network.
    let resp = d
        .req(Method::POST, &format!("/v1/sandboxes/{}/fork", parent.id))
        .json(&json!({"count": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        StatusCode::CREATED,
        "{}",
        resp.text().await.unwrap_or_default()
    );
    let fork: Value = resp.json().await.unwrap();
    let children: Vec<String> = fork["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    let mut addrs = vec![before.clone()];
    for child in &children {
        let a = address_of(&d, child).await;
        assert!(!addrs.contains(&a), "child {child} got a taken address {a}");
        addrs.push(a);
        let r = probe(&d, child, reach.clone()).await;
        assert!(ok(&r[0]) && !ok(&r[1]), "child {child}: {r:?}");
    }
    let (status, body) = d
        .run_raw(&children[0], json!({"cmd": "exec python3 -m http.server 8000 --directory /etc >/dev/null 2>&1", "background": true}))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let mut r = Vec::new();
    for _ in 0..10 {
        r = probe(
            &d,
            &children[1],
            json!([[
                "http",
                format!("http://{}.lab.internal:8000/hostname", children[0])
            ]]),
        )
        .await;
        if ok(&r[0]) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    assert!(ok(&r[0]), "siblings talk on the inherited network: {r:?}");
    assert!(
        r[0].contains(&children[0].replace('_', "-")),
        "the sibling answered with its own hostname: {r:?}"
    );

    for id in children.iter().chain([&parent.id]) {
        d.destroy(id).await;
        assert!(!netns_exists(id));
    }
}

/// A guest server that answers an upgrade with 101 and then echoes in upper case.
const UPGRADE_SERVER_PY: &str = r#"
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8001))
s.listen(4)
while True:
    c, _ = s.accept()
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = c.recv(1024)
        if not d:
            break
        buf += d
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
    while True:
        d = c.recv(1024)
        if not d:
            break
        c.sendall(d.upper())
    c.close()
"#;

/// Opens `/v1/sandboxes/{id}/ports/8001/` with `Connection: Upgrade` over a raw TCP connection to the daemon,
/// expects 101, then sends bytes through and reads the guest's echo.
async fn upgrade_round_trip(d: &Daemon, id: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (status, _) = d
        .put_file(id, "/root/upgrade.py", UPGRADE_SERVER_PY.as_bytes().to_vec())
        .await;
    assert!(status.is_success());
    let (status, body) = d
        .run_raw(
            id,
            json!({"cmd": "exec python3 /root/upgrade.py >/dev/null 2>&1", "background": true}),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let mut last = String::new();
    for _ in 0..20 {
        let mut s = tokio::net::TcpStream::connect(&d.addr).await.unwrap();
        let req = format!(
            "GET /v1/sandboxes/{id}/ports/8001/ HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n",
            d.key
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut byte)).await {
                Ok(Ok(1)) => head.push(byte[0]),
                _ => break,
            }
        }
        last = String::from_utf8_lossy(&head).to_string();
        if last.starts_with("HTTP/1.1 101") {
            s.write_all(b"through the port").await.unwrap();
            let mut echo = vec![0u8; 16];
            tokio::time::timeout(std::time::Duration::from_secs(10), s.read_exact(&mut echo))
                .await
                .expect("echo in time")
                .unwrap();
            assert_eq!(echo, b"THROUGH THE PORT");
            return;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    panic!("no upgrade through the exposed port: {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_egress_follows_the_cidr_rules() {
    use netfix::{HOST_V6, ULA_V6};
    let fi = FakeInternet::new();
    let mut flags = fi.daemon_flags("10.213.24.0/24");
    flags.extend(["--sandbox-net6".to_string(), "2001:db8:24::/64".to_string()]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let d = Daemon::start_with(&flags).await;
    let v6 = HOST_V6.to_string();
    let open = d.create(json!({"template": TEMPLATE})).await;
    let r = probe(
        &d,
        &open.id,
        json!([
            ["tcp", v6.clone(), 8080],
            ["tcp", ULA_V6.to_string(), 8080],
            ["tcp", "fd00:ec2::254", 80],
            ["tcp", HOST_A.to_string(), 8080],
        ]),
    )
    .await;
    assert!(
        ok(&r[0]) && r[0].contains(&format!("host={v6}")),
        "default allow reaches the IPv6 host: {r:?}"
    );
    assert!(!ok(&r[1]), "a ULA destination is always denied: {r:?}");
    assert!(!ok(&r[2]), "the IPv6 metadata address is always denied: {r:?}");
    assert!(ok(&r[3]), "IPv4 still works: {r:?}");

    // Default deny: only the allowed IPv6 CIDR; and with domain rules, IPv6 to the proxied ports is refused at
    // once (clients fall back to IPv4, where the proxy enforces the names).
    let closed = d
        .create(json!({"template": TEMPLATE, "network": {"egress": {
            "default": "deny", "allow": ["2001:db8:1::/64", "a.test"], "deny": ["2001:db8:1::10/128"]}}}))
        .await;
    let r = probe(
        &d,
        &closed.id,
        json!([["tcp", v6.clone(), 8080], ["tcp", v6.clone(), 80]]),
    )
    .await;
    assert!(!ok(&r[0]), "deny wins over allow for IPv6: {r:?}");
    assert!(
        r[1].contains("ConnectionRefused") || r[1].contains("reset"),
        "proxied port over IPv6 is reset: {r:?}"
    );
    let resp = d
        .req(Method::PATCH, &format!("/v1/sandboxes/{}/network", closed.id))
        .json(&json!({"egress": {"default": "deny", "allow": ["2001:db8:1::/64"]}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let r = probe(
        &d,
        &closed.id,
        json!([["tcp", v6.clone(), 8080], ["tcp", HOST_A.to_string(), 8080]]),
    )
    .await;
    assert!(ok(&r[0]), "the allowed IPv6 CIDR: {r:?}");
    assert!(!ok(&r[1]), "IPv4 not named stays denied: {r:?}");
    assert_eq!(fi.seen.conns_to_v6(ULA_V6), 0);
    for id in [&open.id, &closed.id] {
        d.destroy(id).await;
    }
}
