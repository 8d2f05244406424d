//! Host probe: what this machine can run, and which VMM hearth picks.
//!
//! [`probe`] looks at `/dev/kvm` (and asks it `KVM_GET_API_VERSION`), the PVM module, the QEMU and Firecracker
//! binaries and networking permissions. [`choose`] turns a [`HostProbe`] and the operator's
//! [`VmmPreference`] into a [`Choice`] with a human-readable reason, or a [`DetectError`] that says what is
//! missing. [`checks`] lists the findings for `hearth doctor` and `GET /v1/system`.
//!
//! PVM (`kvm_pvm`) answers the KVM API but only runs guest kernels built with `CONFIG_PVM_GUEST`; stock Debian
//! kernels hang or crash under it. So PVM counts as usable KVM only when the operator says the guest kernel is
//! a PVM one (`HEARTH_PVM_GUEST_KERNEL=1`).

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::{Accel, VmmKind};

/// Where install-deps puts Firecracker when no other is configured.
pub const FIRECRACKER_DEFAULT_PATH: &str = "/opt/hearth/firecracker/firecracker";
/// Default QEMU binary name, looked up on `PATH`.
pub const QEMU_BINARY: &str = "qemu-system-x86_64";

/// State of `/dev/kvm`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "detail")]
pub enum KvmStatus {
    /// No `/dev/kvm`.
    Missing,
    /// `/dev/kvm` exists but cannot be opened or queried.
    NoPermission(String),
    /// PVM nested virtualization, and no PVM guest kernel configured: stock kernels do not run.
    Pvm,
    /// Hardware-assisted KVM (or PVM with a PVM guest kernel); the KVM API version.
    Usable(i32),
}

impl KvmStatus {
    pub fn is_usable(&self) -> bool {
        matches!(self, KvmStatus::Usable(_))
    }
}

/// A VMM binary that was found and answered `--version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BinaryInfo {
    pub path: PathBuf,
    /// Short version, e.g. "QEMU 10.0.2" or "Firecracker v1.12.1".
    pub version: String,
}

/// Everything [`probe`] found out about the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostProbe {
    pub kvm: KvmStatus,
    /// `kvm_pvm` is loaded (also true when [`KvmStatus::Usable`] because a PVM guest kernel is configured).
    pub pvm: bool,
    /// QEMU binary, or why it is unusable.
    pub qemu: Result<BinaryInfo, String>,
    /// Firecracker binary, or why it is unusable.
    pub firecracker: Result<BinaryInfo, String>,
    /// Firecracker's jailer ([`find_jailer`]), or why there is none.
    pub jailer: Result<PathBuf, String>,
    /// `/dev/net/tun` can be opened, or why not.
    pub tun: Result<(), String>,
    /// Running as root (needed for taps, network namespaces and the Firecracker jailer).
    pub root: bool,
}

/// The operator's VMM preference (`--vmm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmmPreference {
    Auto,
    Qemu,
    Firecracker,
}

/// The VMM and acceleration hearth will use, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Choice {
    pub kind: VmmKind,
    pub accel: Accel,
    pub reason: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DetectError {
    /// Firecracker was asked for but cannot run guests here.
    #[error("firecracker cannot run here: {0}")]
    FirecrackerUnusable(String),
    /// No QEMU binary, and nothing else can run guests.
    #[error("no usable VMM: {0}")]
    NoVmm(String),
}

/// Outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckStatus {
    Ok,
    Warn,
    Fail,
}

impl CheckStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            CheckStatus::Ok => "ok",
            CheckStatus::Warn => "warn",
            CheckStatus::Fail => "fail",
        }
    }
}

/// One finding for `hearth doctor` / `GET /v1/system`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    pub name: String,
    pub status: CheckStatus,
    pub detail: String,
}

fn check(name: &str, status: CheckStatus, detail: impl Into<String>) -> Check {
    Check {
        name: name.to_string(),
        status,
        detail: detail.into(),
    }
}

/// Inspects the host. Runs each VMM binary's `--version`, so it takes a few milliseconds; call it once at start.
pub fn probe() -> HostProbe {
    let pvm = Path::new("/sys/module/kvm_pvm").exists();
    let pvm_guest_kernel = std::env::var("HEARTH_PVM_GUEST_KERNEL").is_ok_and(|v| v == "1");
    HostProbe {
        kvm: probe_kvm(Path::new("/dev/kvm"), pvm, pvm_guest_kernel),
        pvm,
        qemu: find_qemu().and_then(|p| binary_info(&p)),
        firecracker: find_firecracker().and_then(|p| binary_info(&p)),
        jailer: find_firecracker().and_then(|p| find_jailer(&p)),
        tun: OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .map(drop)
            .map_err(|e| format!("/dev/net/tun: {e}")),
        root: nix::unistd::geteuid().is_root(),
    }
}

nix::ioctl_none!(kvm_get_api_version, 0xAE, 0x00);

fn probe_kvm(dev: &Path, pvm: bool, pvm_guest_kernel: bool) -> KvmStatus {
    let file = match OpenOptions::new().read(true).write(true).open(dev) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return KvmStatus::Missing,
        Err(e) => return KvmStatus::NoPermission(format!("{}: {e}", dev.display())),
    };
    // SAFETY: KVM_GET_API_VERSION takes no argument and only returns an int; the fd is a valid open file that
    // outlives the call.
    let version = match unsafe { kvm_get_api_version(file.as_raw_fd()) } {
        Ok(v) => v,
        Err(e) => return KvmStatus::NoPermission(format!("KVM_GET_API_VERSION on {}: {e}", dev.display())),
    };
    if pvm && !pvm_guest_kernel {
        KvmStatus::Pvm
    } else {
        KvmStatus::Usable(version)
    }
}

/// Looks a program up on `PATH` (an absolute or relative path with a `/` is taken as is).
pub fn which(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        return is_executable(Path::new(name)).then(|| PathBuf::from(name));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// QEMU: `HEARTH_QEMU` or `qemu-system-x86_64` on `PATH`.
pub fn find_qemu() -> Result<PathBuf, String> {
    let name = std::env::var("HEARTH_QEMU").unwrap_or_else(|_| QEMU_BINARY.to_string());
    which(&name).ok_or_else(|| format!("{name} not found on PATH (install qemu-system-x86)"))
}

/// Firecracker: `HEARTH_FIRECRACKER`, else `firecracker` on `PATH`, else [`FIRECRACKER_DEFAULT_PATH`].
pub fn find_firecracker() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("HEARTH_FIRECRACKER") {
        return which(&p).ok_or_else(|| format!("HEARTH_FIRECRACKER={p} is not an executable file"));
    }
    which("firecracker")
        .or_else(|| which(FIRECRACKER_DEFAULT_PATH))
        .ok_or_else(|| format!("firecracker not found on PATH nor at {FIRECRACKER_DEFAULT_PATH}"))
}

/// Firecracker's jailer: `HEARTH_JAILER_BIN`, else `jailer` next to the Firecracker binary (upstream releases
/// ship them together; they must be the same version), else `jailer` on `PATH`.
pub fn find_jailer(firecracker: &Path) -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("HEARTH_JAILER_BIN") {
        return which(&p).ok_or_else(|| format!("HEARTH_JAILER_BIN={p} is not an executable file"));
    }
    firecracker
        .parent()
        .map(|d| d.join("jailer"))
        .filter(|p| is_executable(p))
        .or_else(|| which("jailer"))
        .ok_or_else(|| {
            format!(
                "no jailer next to {} nor on PATH (it comes with Firecracker's release)",
                firecracker.display()
            )
        })
}

/// Runs `<binary> --version` and shortens the answer ("QEMU 10.0.2", "Firecracker v1.12.1").
pub fn binary_info(path: &Path) -> Result<BinaryInfo, String> {
    let out = Command::new(path)
        .arg("--version")
        .output()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if !out.status.success() {
        return Err(format!("{} --version failed: {}", path.display(), out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let version = short_version(text.lines().next().unwrap_or_default()).ok_or_else(|| {
        format!(
            "{} --version: unexpected answer {:?}",
            path.display(),
            text.trim()
        )
    })?;
    Ok(BinaryInfo {
        path: path.to_path_buf(),
        version,
    })
}

fn short_version(line: &str) -> Option<String> {
    if let Some(rest) = line.strip_prefix("QEMU emulator version ") {
        return Some(format!("QEMU {}", rest.split_whitespace().next()?));
    }
    if line.starts_with("Firecracker ") {
        return Some(line.split_whitespace().take(2).collect::<Vec<_>>().join(" "));
    }
    None
}

/// `qemu-img` (sandbox disks are qcow2 overlays made with it): next to the QEMU binary, else on `PATH`.
pub fn qemu_img_for(qemu: &Path) -> Option<PathBuf> {
    qemu.parent()
        .map(|d| d.join("qemu-img"))
        .filter(|p| is_executable(p))
        .or_else(|| which("qemu-img"))
}

/// Picks the VMM. Auto: Firecracker when KVM is usable and its binary exists, else QEMU with KVM when KVM is
/// usable, else QEMU under TCG (correct but slow).
pub fn choose(pref: VmmPreference, probe: &HostProbe) -> Result<Choice, DetectError> {
    let kvm_why = kvm_unusable_reason(&probe.kvm);
    match pref {
        VmmPreference::Firecracker => {
            if let Some(why) = kvm_why {
                return Err(DetectError::FirecrackerUnusable(format!(
                    "{why}; use --vmm qemu{}",
                    if probe.pvm {
                        " or a PVM guest kernel (HEARTH_PVM_GUEST_KERNEL=1)"
                    } else {
                        ""
                    }
                )));
            }
            let fc = probe
                .firecracker
                .as_ref()
                .map_err(|e| DetectError::FirecrackerUnusable(e.clone()))?;
            Ok(Choice {
                kind: VmmKind::Firecracker,
                accel: Accel::Kvm,
                reason: format!("firecracker requested; KVM usable; {}", fc.version),
            })
        }
        VmmPreference::Qemu => qemu_choice(probe, "qemu requested"),
        VmmPreference::Auto => {
            if kvm_why.is_none()
                && let Ok(fc) = &probe.firecracker
            {
                return Ok(Choice {
                    kind: VmmKind::Firecracker,
                    accel: Accel::Kvm,
                    reason: format!("auto: KVM usable and {} found", fc.version),
                });
            }
            let prefix = match (&kvm_why, &probe.firecracker) {
                (None, Err(e)) => format!("auto: KVM usable but no Firecracker ({e})"),
                _ => "auto".to_string(),
            };
            qemu_choice(probe, &prefix)
        }
    }
}

fn qemu_choice(probe: &HostProbe, prefix: &str) -> Result<Choice, DetectError> {
    let qemu = probe.qemu.as_ref().map_err(|e| DetectError::NoVmm(e.clone()))?;
    Ok(match kvm_unusable_reason(&probe.kvm) {
        None => Choice {
            kind: VmmKind::Qemu,
            accel: Accel::Kvm,
            reason: format!("{prefix}: {} with KVM", qemu.version),
        },
        Some(why) => Choice {
            kind: VmmKind::Qemu,
            accel: Accel::Tcg,
            reason: format!(
                "{prefix}: {} with TCG (software emulation, slow) because {why}",
                qemu.version
            ),
        },
    })
}

/// Why KVM cannot run stock guest kernels, or `None` when it can.
fn kvm_unusable_reason(kvm: &KvmStatus) -> Option<String> {
    match kvm {
        KvmStatus::Usable(_) => None,
        KvmStatus::Missing => Some("/dev/kvm does not exist".to_string()),
        KvmStatus::NoPermission(d) => Some(format!("/dev/kvm is not usable ({d})")),
        KvmStatus::Pvm => Some(
            "/dev/kvm is PVM nested virtualization (kvm_pvm loaded), which cannot run stock guest kernels"
                .to_string(),
        ),
    }
}

/// Artifacts a usable images directory holds (relative paths).
pub const REQUIRED_IMAGES: &[&str] = &[
    "vmlinuz",
    "initramfs.cpio.gz",
    "rootfs/debian.ext4",
    "manifest.json",
];

/// The findings, in a stable order: kvm, qemu, firecracker, jailer (when Firecracker is there), tun, root,
/// images.
pub fn checks(probe: &HostProbe, images_dir: &Path) -> Vec<Check> {
    use CheckStatus::{Fail, Ok as Good, Warn};
    let mut out = Vec::new();
    out.push(match &probe.kvm {
        KvmStatus::Usable(v) if probe.pvm => {
            check("kvm", Good, format!("PVM with a PVM guest kernel (API {v})"))
        }
        KvmStatus::Usable(v) => check("kvm", Good, format!("/dev/kvm usable (API {v})")),
        other => check(
            "kvm",
            Warn,
            format!(
                "{}; guests run under TCG (slow)",
                kvm_unusable_reason(other).unwrap_or_default()
            ),
        ),
    });
    out.push(match &probe.qemu {
        Ok(b) => match qemu_img_for(&b.path) {
            Some(_) => check("qemu", Good, format!("{} at {}", b.version, b.path.display())),
            None => check(
                "qemu",
                Fail,
                format!(
                    "{} at {}, but no qemu-img next to it nor on PATH (install qemu-utils)",
                    b.version,
                    b.path.display()
                ),
            ),
        },
        Err(e) => check("qemu", Fail, e.clone()),
    });
    out.push(match &probe.firecracker {
        Ok(b) if probe.kvm.is_usable() => check(
            "firecracker",
            Good,
            format!("{} at {}", b.version, b.path.display()),
        ),
        Ok(b) => check(
            "firecracker",
            Warn,
            format!("{} at {} (unused: KVM not usable)", b.version, b.path.display()),
        ),
        Err(e) => check("firecracker", Warn, e.clone()),
    });
    if probe.firecracker.is_ok() {
        out.push(match (&probe.jailer, probe.root) {
            (Ok(j), true) => check(
                "jailer",
                Good,
                format!("Firecracker runs jailed ({})", j.display()),
            ),
            (Ok(j), false) => check(
                "jailer",
                Warn,
                format!(
                    "{} found, but the jailer needs root: Firecracker would run unjailed",
                    j.display()
                ),
            ),
            (Err(e), _) => check("jailer", Warn, format!("{e}: Firecracker would run unjailed")),
        });
    }
    out.push(match &probe.tun {
        Ok(()) => check("tun", Good, "/dev/net/tun can be opened"),
        Err(e) => check("tun", Warn, format!("{e}; sandbox networking unavailable")),
    });
    out.push(if probe.root {
        check("root", Good, "running as root")
    } else {
        check(
            "root",
            Warn,
            "not root: taps, network namespaces and the jailer need root",
        )
    });
    let missing: Vec<&str> = REQUIRED_IMAGES
        .iter()
        .copied()
        .filter(|a| !images_dir.join(a).exists())
        .collect();
    out.push(if missing.is_empty() {
        check(
            "images",
            Good,
            format!("guest images in {}", images_dir.display()),
        )
    } else {
        check(
            "images",
            Fail,
            format!(
                "missing in {}: {} (run images/build.sh)",
                images_dir.display(),
                missing.join(", ")
            ),
        )
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bin(v: &str) -> Result<BinaryInfo, String> {
        Ok(BinaryInfo {
            path: PathBuf::from("/usr/bin/x"),
            version: v.to_string(),
        })
    }

    fn host(kvm: KvmStatus, pvm: bool, fc: bool, qemu: bool) -> HostProbe {
        HostProbe {
            kvm,
            pvm,
            qemu: if qemu {
                bin("QEMU 10.0.2")
            } else {
                Err("qemu-system-x86_64 not found".into())
            },
            firecracker: if fc {
                bin("Firecracker v1.12.1")
            } else {
                Err("firecracker not found".into())
            },
            jailer: Ok(PathBuf::from("/usr/bin/jailer")),
            tun: Ok(()),
            root: true,
        }
    }

    #[test]
    fn auto_prefers_firecracker_on_real_kvm() {
        let c = choose(
            VmmPreference::Auto,
            &host(KvmStatus::Usable(12), false, true, true),
        )
        .expect("choice");
        assert_eq!((c.kind, c.accel), (VmmKind::Firecracker, Accel::Kvm));
        assert!(c.reason.contains("Firecracker v1.12.1"), "{}", c.reason);
    }

    #[test]
    fn auto_without_firecracker_is_qemu_kvm() {
        let c = choose(
            VmmPreference::Auto,
            &host(KvmStatus::Usable(12), false, false, true),
        )
        .expect("choice");
        assert_eq!((c.kind, c.accel), (VmmKind::Qemu, Accel::Kvm));
        assert!(c.reason.contains("no Firecracker"), "{}", c.reason);
    }

    #[test]
    fn auto_on_pvm_is_qemu_tcg_and_says_why() {
        let c = choose(VmmPreference::Auto, &host(KvmStatus::Pvm, true, true, true)).expect("choice");
        assert_eq!((c.kind, c.accel), (VmmKind::Qemu, Accel::Tcg));
        assert!(c.reason.contains("PVM"), "{}", c.reason);
    }

    #[test]
    fn auto_without_kvm_is_tcg() {
        for kvm in [KvmStatus::Missing, KvmStatus::NoPermission("EACCES".into())] {
            let c = choose(VmmPreference::Auto, &host(kvm, false, true, true)).expect("choice");
            assert_eq!((c.kind, c.accel), (VmmKind::Qemu, Accel::Tcg));
        }
    }

    #[test]
    fn explicit_firecracker_on_pvm_is_a_clear_error() {
        let e = choose(
            VmmPreference::Firecracker,
            &host(KvmStatus::Pvm, true, true, true),
        )
        .expect_err("error");
        let msg = e.to_string();
        assert!(msg.contains("kvm_pvm") && msg.contains("--vmm qemu"), "{msg}");
    }

    #[test]
    fn explicit_firecracker_without_binary_or_kvm_fails() {
        let e = choose(
            VmmPreference::Firecracker,
            &host(KvmStatus::Usable(12), false, false, true),
        );
        assert!(matches!(e, Err(DetectError::FirecrackerUnusable(m)) if m.contains("not found")));
        let e = choose(
            VmmPreference::Firecracker,
            &host(KvmStatus::Missing, false, true, true),
        );
        assert!(matches!(e, Err(DetectError::FirecrackerUnusable(m)) if m.contains("does not exist")));
    }

    #[test]
    fn explicit_qemu_uses_kvm_when_usable() {
        let c = choose(
            VmmPreference::Qemu,
            &host(KvmStatus::Usable(12), false, true, true),
        )
        .expect("choice");
        assert_eq!((c.kind, c.accel), (VmmKind::Qemu, Accel::Kvm));
        let c = choose(VmmPreference::Qemu, &host(KvmStatus::Pvm, true, true, true)).expect("choice");
        assert_eq!((c.kind, c.accel), (VmmKind::Qemu, Accel::Tcg));
    }

    #[test]
    fn no_qemu_and_no_kvm_is_an_error() {
        let e = choose(VmmPreference::Auto, &host(KvmStatus::Pvm, true, true, false));
        assert!(matches!(e, Err(DetectError::NoVmm(_))));
    }

    #[test]
    fn versions_are_shortened() {
        assert_eq!(
            short_version("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)").as_deref(),
            Some("QEMU 10.0.2")
        );
        assert_eq!(
            short_version("Firecracker v1.12.1").as_deref(),
            Some("Firecracker v1.12.1")
        );
        assert_eq!(short_version("something else"), None);
    }

    #[test]
    fn checks_report_missing_images() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = checks(&host(KvmStatus::Pvm, true, true, true), dir.path());
        let names: Vec<&str> = c.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            ["kvm", "qemu", "firecracker", "jailer", "tun", "root", "images"]
        );
        let images = c.last().expect("images check");
        assert_eq!(images.status, CheckStatus::Fail);
        assert!(images.detail.contains("vmlinuz"), "{}", images.detail);
        assert_eq!(c[0].status, CheckStatus::Warn);
    }

    #[test]
    fn checks_accept_a_complete_images_dir() {
        let dir = tempfile::tempdir().expect("tempdir");
        for a in REQUIRED_IMAGES {
            let p = dir.path().join(a);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(&p, b"x").expect("write");
        }
        let c = checks(&host(KvmStatus::Usable(12), false, true, true), dir.path());
        let status = |n: &str| c.iter().find(|c| c.name == n).map(|c| c.status);
        assert_eq!(status("images"), Some(CheckStatus::Ok));
        assert_eq!(status("kvm"), Some(CheckStatus::Ok));
        assert_eq!(status("firecracker"), Some(CheckStatus::Ok));
        assert_eq!(status("jailer"), Some(CheckStatus::Ok));
        let mut no_jailer = host(KvmStatus::Usable(12), false, true, true);
        no_jailer.jailer = Err("no jailer".into());
        let c = checks(&no_jailer, dir.path());
        let jailer = c.iter().find(|c| c.name == "jailer").expect("jailer check");
        assert_eq!(jailer.status, CheckStatus::Warn);
        assert!(jailer.detail.contains("unjailed"), "{}", jailer.detail);
        let without_fc = checks(&host(KvmStatus::Usable(12), false, false, true), dir.path());
        assert!(without_fc.iter().all(|c| c.name != "jailer"));
    }

    /// The build and CI machines are PVM guests (docs ENVIRONMENT.md): the probe must say so.
    #[test]
    fn this_machine_is_pvm() {
        if std::env::var_os("HEARTH_PVM_GUEST_KERNEL").is_some() {
            // An operator override changes the answer by design; the assertion below is about the default.
            assert!(probe().pvm);
            return;
        }
        let p = probe();
        assert!(p.pvm, "kvm_pvm not loaded: {p:?}");
        assert_eq!(p.kvm, KvmStatus::Pvm);
        let q = p.qemu.as_ref().expect("qemu installed");
        assert!(q.version.starts_with("QEMU "), "{}", q.version);
        let c = choose(VmmPreference::Auto, &p).expect("choice");
        assert_eq!((c.kind, c.accel), (VmmKind::Qemu, Accel::Tcg));
    }
}
