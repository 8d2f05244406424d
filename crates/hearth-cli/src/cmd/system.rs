//! `system` (the daemon's report) and `doctor` (this host's checks, with or without a daemon).

use std::path::{Path, PathBuf};
use std::time::Duration;

use hearth_api::SystemInfo;
use hearth_vmm::detect::{self, Check, CheckStatus, VmmPreference};
use serde::Serialize;

use crate::Ctx;
use crate::output::{self, Style};

/// How long `doctor` waits for a daemon to answer.
const DAEMON_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

pub async fn system(ctx: &Ctx) -> anyhow::Result<u8> {
    let info = ctx.client()?.system().await?;
    let style = ctx.stdout_style();
    ctx.emit(&info, || output::system_details(&info, style))?;
    Ok(0)
}

/// The images directory as hearthd resolves it: `HEARTH_IMAGES`, else `$HEARTH_DATA_DIR/images`, else
/// `/var/lib/hearth/images` (where `images/build.sh` writes by default).
fn images_dir() -> PathBuf {
    let env_dir = |name: &str| {
        std::env::var_os(name)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
    };
    env_dir("HEARTH_IMAGES").unwrap_or_else(|| {
        env_dir("HEARTH_DATA_DIR")
            .unwrap_or_else(|| PathBuf::from(hearth_client::DEFAULT_DATA_DIR))
            .join("images")
    })
}

fn check(name: &str, status: CheckStatus, detail: impl Into<String>) -> Check {
    Check {
        name: name.to_owned(),
        status,
        detail: detail.into(),
    }
}

/// What `images/build.sh --check` looks for, one finding per artifact, each saying what to do.
pub fn image_checks(dir: &Path) -> Vec<Check> {
    use CheckStatus::{Fail, Ok as Good, Warn};
    let build = "build it with `bash images/build.sh` (as root)";
    if !dir.is_dir() {
        return vec![check(
            "images",
            Fail,
            format!(
                "{} does not exist: {build} (or set HEARTH_IMAGES to where the images are)",
                dir.display()
            ),
        )];
    }
    let present = |rel: &str| dir.join(rel).is_file();
    let mut out = Vec::new();
    out.push(if present("vmlinuz") {
        check("kernel", Good, format!("{}/vmlinuz", dir.display()))
    } else {
        check(
            "kernel",
            Fail,
            format!("no vmlinuz in {}: {build}", dir.display()),
        )
    });
    out.push(if present("vmlinux") {
        check(
            "vmlinux",
            Good,
            format!("{}/vmlinux (for Firecracker)", dir.display()),
        )
    } else {
        check(
            "vmlinux",
            Warn,
            format!(
                "no vmlinux in {}: Firecracker needs it (QEMU does not); {build}",
                dir.display()
            ),
        )
    });
    out.push(if present("initramfs.cpio.gz") {
        check("initramfs", Good, format!("{}/initramfs.cpio.gz", dir.display()))
    } else {
        check(
            "initramfs",
            Fail,
            format!("no initramfs.cpio.gz in {}: {build}", dir.display()),
        )
    });
    let templates = templates_in(&dir.join("rootfs"));
    out.push(if templates.is_empty() {
        check(
            "templates",
            Fail,
            format!("no rootfs/*.ext4 in {}: {build}", dir.display()),
        )
    } else {
        check("templates", Good, templates.join(", "))
    });
    if !present("manifest.json") {
        out.push(check(
            "manifest",
            Warn,
            format!(
                "no manifest.json in {}: the images were not built by images/build.sh or it did not finish",
                dir.display()
            ),
        ));
    }
    out
}

/// Names of `<rootfs>/*.ext4` that resolve to a regular file (a dangling symlink is no template), sorted.
fn templates_in(rootfs: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(rootfs) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_file())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.strip_suffix(".ext4").map(str::to_owned)
        })
        .collect();
    names.sort();
    names
}

/// Host checks without a daemon: the VMM probe's findings (its own images line replaced by the finer
/// [`image_checks`]) and the VMM hearthd would choose.
pub fn host_checks(images: &Path) -> Vec<Check> {
    let probe = detect::probe();
    let mut checks: Vec<Check> = detect::checks(&probe, images)
        .into_iter()
        .filter(|c| c.name != "images")
        .collect();
    checks.push(match detect::choose(VmmPreference::Auto, &probe) {
        Ok(choice) => check(
            "vmm",
            if choice.accel == hearth_vmm::Accel::Tcg {
                CheckStatus::Warn
            } else {
                CheckStatus::Ok
            },
            format!(
                "{} ({}): {}",
                choice.kind.as_str(),
                choice.accel.as_str(),
                choice.reason
            ),
        ),
        Err(e) => check(
            "vmm",
            CheckStatus::Fail,
            format!("{e}; install qemu-system-x86 (scripts/install-deps.sh)"),
        ),
    });
    checks.extend(image_checks(images));
    checks
}

#[derive(Serialize)]
struct DoctorReport<'a> {
    ok: bool,
    checks: &'a [Check],
    /// The daemon's report when one answered.
    daemon: Option<&'a SystemInfo>,
    /// Why no daemon report is included.
    #[serde(skip_serializing_if = "Option::is_none")]
    daemon_error: Option<String>,
}

pub async fn doctor(ctx: &Ctx) -> anyhow::Result<u8> {
    let images = images_dir();
    let mut checks = tokio::task::spawn_blocking(move || host_checks(&images)).await?;
    // Only the host's own checks decide the status: a stopped daemon can be started.
    let ok = !checks.iter().any(|c| c.status == CheckStatus::Fail);

    let (daemon, daemon_error) = probe_daemon(ctx).await;
    checks.push(match (&daemon, &daemon_error) {
        (Some(info), _) => check(
            "daemon",
            CheckStatus::Ok,
            format!("hearthd {} answers at {}", info.version, ctx.url),
        ),
        (None, err) => check(
            "daemon",
            CheckStatus::Warn,
            err.clone().unwrap_or_else(|| "no answer".to_owned()),
        ),
    });

    if ctx.json {
        let report = DoctorReport {
            ok,
            checks: &checks,
            daemon: daemon.as_ref(),
            daemon_error,
        };
        print!("{}", output::json(&report)?);
    } else {
        let style = ctx.stdout_style();
        print!("{}", render_checks(&checks, style));
        if let Some(info) = &daemon {
            println!("\ndaemon report (GET /v1/system):");
            for line in output::system_details(info, style).lines() {
                println!("  {line}");
            }
        }
    }
    if !ok {
        eprintln!("hearth: this host cannot run sandboxes until the failed checks are fixed");
    }
    Ok(if ok { 0 } else { 1 })
}

/// The daemon's report, or why there is none (with the hint the error printer would give).
async fn probe_daemon(ctx: &Ctx) -> (Option<SystemInfo>, Option<String>) {
    let client = match ctx.client() {
        Ok(c) => c,
        Err(e) => return (None, Some(format!("{e:#}"))),
    };
    match tokio::time::timeout(DAEMON_PROBE_TIMEOUT, client.system()).await {
        Ok(Ok(info)) => (Some(info), None),
        Ok(Err(e)) => {
            let (msg, hint) = crate::report::describe(&anyhow::Error::new(e), &ctx.url);
            (None, Some(hint.map_or(msg.clone(), |h| format!("{msg}; {h}"))))
        }
        Err(_) => (
            None,
            Some(format!(
                "{} did not answer within {} s",
                ctx.url,
                DAEMON_PROBE_TIMEOUT.as_secs()
            )),
        ),
    }
}

fn render_checks(checks: &[Check], style: Style) -> String {
    output::check_lines(
        checks
            .iter()
            .map(|c| (c.status.as_str(), c.name.as_str(), c.detail.as_str())),
        style,
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn statuses(checks: &[Check]) -> Vec<(String, &'static str)> {
        checks
            .iter()
            .map(|c| (c.name.clone(), c.status.as_str()))
            .collect()
    }

    #[test]
    fn missing_images_dir_fails_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let checks = image_checks(&dir.path().join("nope"));
        assert_eq!(statuses(&checks), vec![("images".to_owned(), "fail")]);
        assert!(checks[0].detail.contains("images/build.sh"));
    }

    #[test]
    fn image_artifacts_are_checked_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("vmlinuz"), b"k").unwrap();
        std::fs::create_dir(d.join("rootfs")).unwrap();
        // A dangling template symlink does not count.
        std::os::unix::fs::symlink(d.join("rootfs/versions/gone.ext4"), d.join("rootfs/debian.ext4"))
            .unwrap();
        let checks = image_checks(d);
        assert_eq!(
            statuses(&checks),
            vec![
                ("kernel".to_owned(), "ok"),
                ("vmlinux".to_owned(), "warn"),
                ("initramfs".to_owned(), "fail"),
                ("templates".to_owned(), "fail"),
                ("manifest".to_owned(), "warn"),
            ]
        );

        for f in [
            "vmlinux",
            "initramfs.cpio.gz",
            "manifest.json",
            "rootfs/minimal.ext4",
            "rootfs/notes.txt",
        ] {
            std::fs::write(d.join(f), b"x").unwrap();
        }
        let checks = image_checks(d);
        assert!(checks.iter().all(|c| c.status == CheckStatus::Ok), "{checks:?}");
        let templates = checks.iter().find(|c| c.name == "templates").unwrap();
        assert_eq!(templates.detail, "minimal");
    }

    #[test]
    fn host_checks_always_say_which_vmm() {
        let dir = tempfile::tempdir().unwrap();
        let checks = host_checks(dir.path());
        let names: Vec<&str> = checks.iter().map(|c| c.name.as_str()).collect();
        assert!(
            names.contains(&"kvm") && names.contains(&"qemu") && names.contains(&"vmm"),
            "{names:?}"
        );
        assert!(!names.contains(&"images") || checks.iter().any(|c| c.detail.contains("build.sh")));
    }

    #[test]
    fn checks_render_aligned() {
        let checks = vec![
            check("kvm", CheckStatus::Warn, "PVM; guests run under TCG (slow)"),
            check("initramfs", CheckStatus::Fail, "no initramfs.cpio.gz: build it"),
            check(
                "daemon",
                CheckStatus::Ok,
                "hearthd 0.1.0 answers at http://127.0.0.1:7070",
            ),
        ];
        insta::assert_snapshot!(render_checks(&checks, Style::PLAIN));
    }
}
