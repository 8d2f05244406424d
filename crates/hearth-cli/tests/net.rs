//! The network commands against a real `hearthd` with sandbox networking on and a real QEMU guest (the
//! `minimal` template): `hearth net create|ls|rm|attach|detach|show|policy|log`, `hearth create` with egress
//! flags, a network and a name, `hearth expose`, and bad rules refused with a message naming them.
//!
//! The daemon's uplink is an empty namespace this test made (no route anywhere), so whatever the guest sends
//! cannot leave it.

#![allow(clippy::unwrap_used)]

mod support;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use hearth_api::{EgressLog, NetworkInfo, NetworkList, SandboxNetwork};
use support::{Daemon, TestNetns, ok, stderr, stdout};

/// Sandbox addresses of this test's daemon (distinct from every other test's range).
const RANGE: &str = "10.213.50.0/24";

fn networks(d: &Daemon) -> NetworkList {
    serde_json::from_str(&ok(d.run(&["--json", "net", "ls"]))).unwrap()
}

fn show(d: &Daemon, id: &str) -> SandboxNetwork {
    serde_json::from_str(&ok(d.run(&["--json", "net", "show", id]))).unwrap()
}

/// `GET` of `url` (plain HTTP/1.0 on the daemon's loopback address): (status code, body).
fn http_get(url: &str) -> (u16, String) {
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_at(rest.find('/').unwrap());
    let mut s = std::net::TcpStream::connect(host).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

#[test]
fn network_commands() {
    // Declared first so that it is removed last, after the daemon and its sandboxes.
    let uplink = TestNetns::new("hct-net");
    let d = Daemon::start_networked(&uplink, RANGE);

    // Bad rules are refused before anything is created, naming the rule.
    let out = d.run(&["create", "--deny-all", "--allow", "not a rule"]);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(stderr(&out).contains("not a rule"), "{}", stderr(&out));
    assert!(ok(d.run(&["ls"])).lines().count() <= 1, "nothing created");

    // net create / ls.
    let blue = ok(d.run(&["net", "create", "blue"])).trim().to_owned();
    assert!(blue.starts_with("net_"), "{blue}");
    ok(d.run(&["net", "create", "green"]));
    let table = ok(d.run(&["net", "ls"]));
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["ID", "NAME", "MEMBERS", "CREATED"], "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&format!("{blue}  blue  ")) && l.split_whitespace().nth(2) == Some("0")),
        "{table}"
    );
    let out = d.run(&["net", "create", "blue"]);
    assert!(!out.status.success(), "a second network named blue");

    // create with an egress policy, a network and a name; net show reports all of it.
    let id = ok(d.run(&[
        "create",
        "--template",
        "minimal",
        "--deny-all",
        "--allow",
        "example.com",
        "--network",
        "blue",
        "--name",
        "web",
    ]))
    .trim()
    .to_owned();
    assert!(hearth_api::is_valid_sandbox_id(&id), "{id:?}");
    let text = ok(d.run(&["net", "show", &id]));
    let net = show(&d, &id);
    assert!(
        net.address.parse::<std::net::Ipv4Addr>().is_ok() && net.address.starts_with("10.213.50."),
        "{net:?}"
    );
    for (key, value) in [
        ("address", net.address.as_str()),
        ("egress default", "deny"),
        ("allow", "example.com"),
        ("networks", "blue"),
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(key) && l.trim_end().ends_with(value)),
            "{key} {value} in:\n{text}"
        );
    }
    assert_eq!(net.egress.default, hearth_api::EgressDefault::Deny);
    assert_eq!(net.egress.allow, ["example.com"]);
    assert_eq!(net.networks, ["blue"]);
    let list = networks(&d);
    let b = list.networks.iter().find(|n| n.name == "blue").unwrap();
    assert_eq!(b.members, [id.as_str()]);

    // net policy replaces the policy, effective at once; a bad rule leaves it as it was.
    assert_eq!(
        ok(d.run(&["net", "policy", &id, "--deny-all", "--allow", "203.0.113.0/24"])).trim(),
        id
    );
    let net = show(&d, &id);
    assert_eq!(net.egress.default, hearth_api::EgressDefault::Deny);
    assert_eq!(net.egress.allow, ["203.0.113.0/24"]);
    let out = d.run(&["net", "policy", &id, "--allow", "not a rule"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("not a rule"), "{}", stderr(&out));
    assert_eq!(show(&d, &id).egress.allow, ["203.0.113.0/24"]);
    // No flags does not silently open everything.
    let out = d.run(&["net", "policy", &id]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--reset"), "{}", stderr(&out));
    assert_eq!(show(&d, &id).egress.default, hearth_api::EgressDefault::Deny);

    // attach / detach.
    let out = ok(d.run(&["net", "attach", "green", &id]));
    assert_eq!(out.trim(), format!("{id} attached to green"));
    let mut nets = show(&d, &id).networks;
    nets.sort();
    assert_eq!(nets, ["blue", "green"]);
    let info: NetworkInfo =
        serde_json::from_str(&ok(d.run(&["--json", "net", "detach", "green", &id]))).unwrap();
    assert_eq!(info.name, "green");
    assert!(info.members.is_empty(), "{info:?}");
    assert_eq!(show(&d, &id).networks, ["blue"]);

    // net log: an allowed and a denied attempt from the guest. The uplink namespace has no route, so even the
    // allowed one goes nowhere.
    d.run(&[
        "exec",
        &id,
        "--",
        "nc -w 1 203.0.113.7 8080 </dev/null; nc -w 1 198.51.100.7 8080 </dev/null; true",
    ]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let log = loop {
        let log: EgressLog = serde_json::from_str(&ok(d.run(&["--json", "net", "log", &id]))).unwrap();
        let seen = |dest: &str, allowed: bool| {
            log.events.iter().any(|e| {
                e.destination.as_deref() == Some(dest) && e.port == Some(8080) && e.allowed == allowed
            })
        };
        if seen("203.0.113.7", true) && seen("198.51.100.7", false) {
            break log;
        }
        assert!(Instant::now() < deadline, "attempts not logged: {log:?}");
        std::thread::sleep(Duration::from_millis(300));
    };
    let table = ok(d.run(&["net", "log", &id]));
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["AT", "PROTO", "DESTINATION", "PORT", "NAME", "VERDICT", "REASON"],
        "{table}"
    );
    let denied = log
        .events
        .iter()
        .find(|e| e.destination.as_deref() == Some("198.51.100.7"))
        .unwrap();
    assert!(
        table.lines().any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.get(2) == Some(&"198.51.100.7")
                && cols.get(3) == Some(&"8080")
                && cols.get(5) == Some(&"deny")
                && cols.get(6) == Some(&denied.reason.as_str())
        }),
        "{table}"
    );

    // expose: a URL with a token that opens the guest's port without the key, and only with the token.
    ok(d.run(&[
        "exec",
        &id,
        "-b",
        "--",
        "mkdir -p /srv && echo served-by-web > /srv/index.html && exec busybox httpd -f -p 8000 -h /srv",
    ]));
    let url = ok(d.run(&["expose", &id, "8000"])).trim().to_owned();
    assert!(
        url.starts_with(&format!("{}/v1/sandboxes/{id}/ports/8000/", d.url)) && url.contains("hearth_token="),
        "{url}"
    );
    let index = url.replacen("/ports/8000/?", "/ports/8000/index.html?", 1);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = http_get(&index);
        if status == 200 {
            assert_eq!(body.trim(), "served-by-web");
            break;
        }
        // The server may still be starting (a gateway error), never an authentication failure.
        assert_ne!(status, 401, "the token was refused");
        assert!(
            Instant::now() < deadline,
            "exposed port never answered: {status} {body}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let (status, _) = http_get(&format!("{}/v1/sandboxes/{id}/ports/8000/index.html", d.url));
    assert_eq!(status, 401, "no token, no key");
    let json: serde_json::Value =
        serde_json::from_str(&ok(d.run(&["--json", "expose", &id, "8000", "--ttl", "60"]))).unwrap();
    assert!(json["token"].as_str().is_some_and(|t| !t.is_empty()), "{json}");

    // net rm: refused while a sandbox is attached, then works.
    let out = d.run(&["net", "rm", "blue"]);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("blue: ") && stderr(&out).contains("sandboxes attached"),
        "{}",
        stderr(&out)
    );
    assert!(networks(&d).networks.iter().any(|n| n.name == "blue"));
    assert_eq!(ok(d.run(&["rm", &id])).trim(), id);
    assert_eq!(ok(d.run(&["net", "rm", "blue", "green"])), "blue\ngreen\n");
    assert!(networks(&d).networks.is_empty());
    assert!(ok(d.run(&["net", "ls"])).lines().count() == 1, "only the header");
}
