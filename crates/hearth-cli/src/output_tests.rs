use std::collections::BTreeMap;

use hearth_api::{Capacity, Check, SandboxList};
use time::macros::datetime;

use super::*;

fn now() -> OffsetDateTime {
    datetime!(2026-11-29 20:30:00 UTC)
}

fn sandboxes() -> Vec<Sandbox> {
    vec![
        Sandbox {
            id: "sbx_0123456789abcdef".into(),
            state: SandboxState::Running,
            template: "minimal".into(),
            vcpus: 1,
            memory_mib: 512,
            created_at: "2026-11-29T20:25:00Z".into(),
            end_at: "2026-11-29T20:30:42Z".into(),
            metadata: BTreeMap::from([("owner".into(), "agent-7".into())]),
            vmm: "qemu".into(),
            error: None,
            auto_resume: true,
            on_timeout: Default::default(),
            parent_id: None,
            snapshot_id: None,
            disk_sync_interval_s: None,
            storage: None,
        },
        Sandbox {
            id: "sbx_fedcba9876543210".into(),
            state: SandboxState::Failed,
            template: "trixie-python".into(),
            vcpus: 16,
            memory_mib: 16384,
            created_at: "2026-11-27T08:00:00Z".into(),
            end_at: "2026-11-29T20:00:00Z".into(),
            metadata: BTreeMap::new(),
            vmm: "firecracker".into(),
            error: Some("agent did not answer\x1b[2J within 30 s".into()),
            auto_resume: true,
            on_timeout: Default::default(),
            parent_id: None,
            snapshot_id: None,
            disk_sync_interval_s: None,
            storage: None,
        },
    ]
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[test]
fn sandbox_list_table() {
    insta::assert_snapshot!(sandbox_table(&sandboxes(), now(), Style::PLAIN));
}

#[test]
fn empty_sandbox_list_is_just_the_header() {
    assert_eq!(
        sandbox_table(&[], now(), Style::PLAIN),
        "ID  STATE  TEMPLATE  VCPUS  MEM  CREATED  ENDS\n"
    );
}

#[test]
fn colour_does_not_change_the_layout() {
    let style = Style { color: true };
    let coloured = sandbox_table(&sandboxes(), now(), style);
    assert!(coloured.contains("\x1b[32mrunning\x1b[0m"));
    assert!(coloured.contains("\x1b[31mfailed\x1b[0m"));
    assert_eq!(
        strip_ansi(&coloured),
        sandbox_table(&sandboxes(), now(), Style::PLAIN)
    );
}

#[test]
fn sandbox_list_json() {
    let list = SandboxList {
        sandboxes: sandboxes(),
        next_cursor: None,
    };
    insta::assert_snapshot!(json(&list).unwrap());
}

#[test]
fn sandbox_info_escapes_control_characters() {
    let text = sandbox_details(&sandboxes()[1], now());
    assert!(!text.contains('\x1b'));
    insta::assert_snapshot!(text);
}

#[test]
fn wide_characters_align_by_display_width() {
    let rows = vec![
        vec!["日本".to_owned(), "x".to_owned()],
        vec!["ab".to_owned(), "y".to_owned()],
    ];
    assert_eq!(
        table(&["N", "V"], &rows, Style::PLAIN),
        "N     V\n日本  x\nab    y\n"
    );
}

#[test]
fn processes_table() {
    let procs = vec![
        ProcessInfo {
            pid: 7,
            cmd: "python3 -m http.server".into(),
            background: true,
            exit_code: None,
        },
        ProcessInfo {
            pid: 1234,
            cmd: "sh -c 'exit 7'".into(),
            background: false,
            exit_code: Some(7),
        },
    ];
    insta::assert_snapshot!(process_table(&procs, Style::PLAIN));
}

fn files() -> Vec<FileInfo> {
    vec![
        FileInfo {
            name: "bin".into(),
            path: "/bin".into(),
            kind: FileKind::Symlink,
            size: 7,
            mode: 0o777,
            mtime: 1_764_000_000,
            link_target: Some("usr/bin".into()),
        },
        FileInfo {
            name: "etc".into(),
            path: "/etc".into(),
            kind: FileKind::Dir,
            size: 4096,
            mode: 0o755,
            mtime: 1_764_400_000,
            link_target: None,
        },
        FileInfo {
            name: "evil\rname".into(),
            path: "/evil\rname".into(),
            kind: FileKind::File,
            size: 123_456_789,
            mode: 0o4640,
            mtime: 0,
            link_target: None,
        },
    ]
}

#[test]
fn files_table_and_stat() {
    let table = file_table(&files(), Style::PLAIN);
    assert!(!table.contains('\r'), "guest-chosen names cannot move the cursor");
    insta::assert_snapshot!("files_table", table);
    insta::assert_snapshot!("file_stat", file_details(&files()[2]));
}

#[test]
fn modes() {
    assert_eq!(mode_string(FileKind::Dir, 0o755), "drwxr-xr-x");
    assert_eq!(mode_string(FileKind::File, 0o640), "-rw-r-----");
    assert_eq!(mode_string(FileKind::Other, 0), "?---------");
}

#[test]
fn durations_and_times() {
    assert_eq!(short_duration(-5), "0s");
    assert_eq!(short_duration(59), "59s");
    assert_eq!(short_duration(60), "1m");
    assert_eq!(short_duration(7200), "2h");
    assert_eq!(short_duration(200_000), "2d");
    assert_eq!(ago("not a time", now()), "not a time");
    assert_eq!(until("2026-11-29T20:29:59Z", now()), "expired");
    assert_eq!(until("2026-11-29T21:30:00+01:00", now()), "expired");
    assert_eq!(until("2026-11-29T21:30:00Z", now()), "in 1h");
    assert_eq!(utc_time(0), "1970-01-01 00:00:00 UTC");
}

#[test]
fn system_report() {
    let info = SystemInfo {
        version: "0.1.0".into(),
        vmm: "qemu".into(),
        accel: "tcg".into(),
        vmm_reason: "/dev/kvm is PVM (kvm_pvm loaded) and no PVM guest kernel is configured".into(),
        checks: vec![
            Check {
                name: "kvm".into(),
                status: "warn".into(),
                detail: "PVM nested virtualization".into(),
            },
            Check {
                name: "qemu-system-x86_64".into(),
                status: "ok".into(),
                detail: "QEMU emulator version 10.0.2".into(),
            },
        ],
        capacity: Capacity {
            host_cpus: 2,
            host_memory_mib: 24000,
            sandboxes_running: 1,
            vcpus_allocated: 1,
            memory_mib_allocated: 512,
        },
        templates: vec!["minimal".into(), "trixie".into()],
        default_template: "minimal".into(),
    };
    insta::assert_snapshot!(system_details(&info, Style::PLAIN));
}
