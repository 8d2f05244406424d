//! The default template `base` (images/build.sh): every promised tool runs inside a real sandbox, and a daemon
//! started with neither `--default-template` nor `HEARTH_DEFAULT_TEMPLATE` uses it.

mod common;

use common::{Daemon, template_built};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn base_template_carries_every_toolchain() {
    assert!(
        template_built("base"),
        "rootfs/base.ext4 must be built (images/build.sh)"
    );
    let d = Daemon::start().await;
    // rustc compiles a real program: give it room under TCG (software emulation makes compilers slow).
    let s = d
        .create(json!({"template": "base", "vcpus": 2, "memory_mib": 2048, "timeout_s": 1200}))
        .await;

    let checks: &[(&str, &str)] = &[
        ("python3 -c 'import sys; print(sys.version_info[0])'", "3"),
        ("node -e 'console.log(6*7)'", "42"),
        ("bun -e 'console.log(6*7)'", "42"),
        ("pi --version 2>&1", "0.73"),
        ("git --version", "git version"),
        ("curl --version", "curl"),
        ("gcc --version", "gcc"),
        ("go version", "go version go1."),
        (
            "mkdir -p /tmp/r && cd /tmp/r && printf 'fn main(){println!(\"rust-ok\");}\\n' > m.rs && rustc m.rs -o m && ./m && cargo --version",
            "rust-ok",
        ),
    ];
    for (cmd, want) in checks {
        let r = d.run(&s.id, json!({"cmd": cmd, "timeout_s": 600})).await;
        assert_eq!(r.exit_code, 0, "{cmd}: {r:?}");
        assert!(
            r.stdout.contains(want),
            "{cmd}: stdout {:?} lacks {want:?}",
            r.stdout
        );
    }
    d.destroy(&s.id).await;
}

#[test]
fn base_is_the_default_template() {
    use clap::Parser;
    let args = hearthd::config::Args::try_parse_from(["hearthd"]).expect("the defaults parse");
    // HEARTH_DEFAULT_TEMPLATE, when set in the environment, overrides the default on purpose.
    let expected = std::env::var("HEARTH_DEFAULT_TEMPLATE").unwrap_or_else(|_| "base".to_owned());
    assert_eq!(args.default_template, expected);
}
