//! SECURITY promise 11 ("guest bytes never steer the host") at the driver level, with the real `qemu-img`: a
//! template image whose first bytes a guest wrote (qcow2 with a backing file, qcow2 with a `json:` backing name,
//! a VMDK descriptor, a VHDX identifier) is used as the raw image hearth's records say it is, and the host file
//! the header names is never opened. A control step first shows that each header does make a probing tool open
//! that file, so the test would fail if the drivers went back to guessing formats.

use std::path::{Path, PathBuf};
use std::process::Command;

use hearth_testkit::hostile_disk::{Canary, Header};
use hearth_vmm::firecracker::FirecrackerVmm;
use hearth_vmm::qemu::QemuVmm;
use hearth_vmm::{Accel, DiskFormat, Vmm, VmmError};

/// A 64 MiB raw "template image" whose first bytes are `header` (the rest holes, as after a flatten).
fn hostile_image(dir: &Path, name: &str, header: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, header).expect("writing the image");
    std::fs::File::options()
        .write(true)
        .open(&path)
        .and_then(|f| f.set_len(64 << 20))
        .expect("sizing the image");
    path
}

fn qemu_img(args: &[&str]) -> std::process::Output {
    Command::new("qemu-img")
        .args(args)
        .output()
        .expect("qemu-img runs (install qemu-utils)")
}

fn info_json(path: &Path, format: &str) -> serde_json::Value {
    let out = qemu_img(&[
        "info",
        "-U",
        "-f",
        format,
        "--output=json",
        path.to_str().expect("utf-8 path"),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("qemu-img info json")
}

#[tokio::test]
async fn guest_written_headers_never_make_the_host_open_a_file() {
    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let dir = tempfile::tempdir().expect("tempdir");
    let canary = Canary::new(dir.path());
    for header in Header::ALL {
        let bytes = header.bytes(&canary.path);
        let image = hostile_image(dir.path(), &format!("{header:?}.raw"), &bytes);

        // Control: a tool that guesses the format does follow the header to the canary.
        let _ = qemu_img(&["info", "--backing-chain", image.to_str().expect("utf-8 path")]);
        if header.names_a_host_file() {
            assert!(
                !canary.events().is_empty(),
                "control: probing a {header:?} header did not open the canary, so this test proves nothing"
            );
        } else {
            let probed = probe_error(&image);
            assert!(
                probed.contains("VHDX"),
                "control: a probe reads the image as VHDX: {probed}"
            );
            canary.events();
        }

        // The driver: an overlay over the image named raw; the canary stays closed.
        let run = tempfile::tempdir().expect("tempdir");
        let overlay = vmm
            .prepare_disk(&image, DiskFormat::Raw, run.path())
            .await
            .expect("prepare_disk");
        canary.assert_untouched(&format!("prepare_disk over a {header:?} header"));
        let info = info_json(&overlay, "qcow2");
        assert_eq!(info["backing-filename-format"], "raw", "{info}");
        assert_eq!(
            info["backing-filename"],
            std::fs::canonicalize(&image)
                .expect("test step")
                .to_str()
                .expect("utf-8 path")
        );

        // Flattening the overlay (a template from this sandbox) keeps the header as plain bytes.
        let flat = run.path().join("flat.raw");
        vmm.flatten_disk(&overlay, DiskFormat::Qcow2, &flat)
            .await
            .expect("flatten");
        canary.assert_untouched(&format!("flattening a disk with a {header:?} header"));
        let flat_bytes = std::fs::read(&flat).expect("flat image");
        assert_eq!(
            &flat_bytes[..bytes.len()],
            &bytes[..],
            "{header:?} header copied as data"
        );
        assert!(
            !flat_bytes
                .windows(canary.marker.len())
                .any(|w| w == canary.marker.as_bytes()),
            "the canary's bytes ended up in the image"
        );
    }
}

/// What a probing `qemu-img info` (no `-f`) says when it cannot use the image as the format it guessed.
fn probe_error(path: &Path) -> String {
    let out = qemu_img(&["info", "-U", path.to_str().expect("utf-8 path")]);
    assert!(!out.status.success(), "a probe read the image as raw");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn qcow2_bases_with_unsafe_backing_names_are_refused() {
    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let dir = tempfile::tempdir().expect("tempdir");
    let canary = Canary::new(dir.path());
    let target = canary.path.to_str().expect("utf-8 path").to_owned();
    let json =
        format!("json:{{\"driver\":\"raw\",\"file\":{{\"driver\":\"file\",\"filename\":\"{target}\"}}}}");
    // qcow2 images with backing names hearth never writes (`-u`: qemu-img does not open the backing).
    let cases: [(&str, Vec<&str>); 4] = [
        ("json", vec!["-F", "raw", "-b", &json]),
        ("relative", vec!["-F", "raw", "-b", "canary"]),
        ("vmdk-format", vec!["-F", "vmdk", "-b", &target]),
        ("nbd", vec!["-F", "raw", "-b", "nbd:127.0.0.1:1"]),
    ];
    for (name, backing) in cases {
        let evil = dir.path().join(format!("{name}.qcow2"));
        let mut args = vec!["create", "-q", "-u", "-f", "qcow2"];
        args.extend(backing);
        args.extend([evil.to_str().expect("utf-8 path"), "64M"]);
        let out = qemu_img(&args);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        canary.events();

        let run = tempfile::tempdir().expect("tempdir");
        let err = vmm
            .prepare_disk(&evil, DiskFormat::Qcow2, run.path())
            .await
            .expect_err(name);
        assert!(matches!(err, VmmError::Disk { .. }), "{name}: {err}");
        assert!(
            err.to_string().contains("refused") || err.to_string().contains("format"),
            "{name}: {err}"
        );
        assert!(!run.path().join("disk.qcow2").exists(), "{name}: nothing created");
        let flat = run.path().join("flat.raw");
        assert!(
            vmm.flatten_disk(&evil, DiskFormat::Qcow2, &flat).await.is_err(),
            "{name}"
        );
        canary.assert_untouched(&format!("a qcow2 base with a {name} backing name"));
    }

    // A chain hearth wrote is accepted: template (raw) <- overlay <- overlay.
    let base = hostile_image(dir.path(), "base.raw", b"plain");
    let run1 = tempfile::tempdir().expect("tempdir");
    let first = vmm
        .prepare_disk(&base, DiskFormat::Raw, run1.path())
        .await
        .expect("first");
    let run2 = tempfile::tempdir().expect("tempdir");
    let second = vmm
        .prepare_disk(&first, DiskFormat::Qcow2, run2.path())
        .await
        .expect("second");
    let chain = hearth_vmm::disk::check_qcow2_chain(Path::new("qemu-img"), &second)
        .await
        .expect("chain");
    let formats: Vec<DiskFormat> = chain.iter().map(|(_, f)| *f).collect();
    assert_eq!(formats, [DiskFormat::Qcow2, DiskFormat::Qcow2, DiskFormat::Raw]);
}

#[tokio::test]
async fn firecracker_copies_raw_disks_byte_for_byte_and_refuses_other_formats() {
    let vmm = FirecrackerVmm::new(hearth_vmm::firecracker::DEFAULT_BINARY)
        .unwrap_or_else(|e| panic!("{e} (run scripts/install-deps.sh)"));
    let dir = tempfile::tempdir().expect("tempdir");
    let canary = Canary::new(dir.path());
    let bytes = Header::Qcow2Backing.bytes(&canary.path);
    let image = hostile_image(dir.path(), "t.raw", &bytes);
    let run = tempfile::tempdir().expect("tempdir");
    let disk = vmm
        .prepare_disk(&image, DiskFormat::Raw, run.path())
        .await
        .expect("copy");
    assert_eq!(
        std::fs::read(&disk).expect("test step"),
        std::fs::read(&image).expect("test step")
    );
    let flat = run.path().join("flat.raw");
    vmm.flatten_disk(&disk, DiskFormat::Raw, &flat)
        .await
        .expect("flatten");
    assert_eq!(
        std::fs::read(&flat).expect("test step"),
        std::fs::read(&image).expect("test step")
    );
    canary.assert_untouched("Firecracker disk copies");
    let run2 = tempfile::tempdir().expect("tempdir");
    assert!(
        vmm.prepare_disk(&image, DiskFormat::Qcow2, run2.path())
            .await
            .is_err()
    );
    assert!(
        vmm.flatten_disk(&disk, DiskFormat::Qcow2, &run2.path().join("x"))
            .await
            .is_err()
    );
}
