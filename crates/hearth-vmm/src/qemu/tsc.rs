//! The host's TSC frequency, which microvm guests need on their command line (`tsc_early_khz=`): without it a
//! guest booting on a loaded host can hang at "Marking TSC unstable" (docs ENVIRONMENT.md).

use std::io::Read;
use std::sync::OnceLock;

/// The host's TSC frequency in kHz, from the kernel log (`tsc: Refined TSC clocksource calibration` or
/// `tsc: Detected X MHz`) or else `/proc/cpuinfo`. Read once.
pub fn host_tsc_khz() -> Option<u64> {
    static KHZ: OnceLock<Option<u64>> = OnceLock::new();
    *KHZ.get_or_init(|| {
        tsc_from_kmsg().or_else(|| {
            let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
            info.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(mhz_to_khz)
        })
    })
}

fn tsc_from_kmsg() -> Option<u64> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
        .ok()?;
    let (mut detected, mut refined) = (None, None);
    let mut buf = vec![0u8; 8192];
    // One record per read; EAGAIN at the end of the buffer; EPIPE when a record was overwritten (go on).
    for _ in 0..100_000 {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let rec = String::from_utf8_lossy(&buf[..n]);
                let msg = rec.split_once(';').map(|(_, m)| m).unwrap_or(&rec);
                if let Some(rest) = msg.strip_prefix("tsc: Refined TSC clocksource calibration: ") {
                    refined = rest.split_whitespace().next().and_then(mhz_to_khz);
                } else if let Some(rest) = msg.strip_prefix("tsc: Detected ") {
                    detected = rest.split_whitespace().next().and_then(mhz_to_khz);
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    refined.or(detected)
}

/// "2445.406" (MHz) -> 2445406 (kHz).
fn mhz_to_khz(s: &str) -> Option<u64> {
    let s = s.trim();
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    let mut frac: String = frac.chars().take(3).collect();
    while frac.len() < 3 {
        frac.push('0');
    }
    let khz = int.parse::<u64>().ok()?.checked_mul(1000)? + frac.parse::<u64>().ok()?;
    (khz > 0).then_some(khz)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mhz_parsing() {
        assert_eq!(mhz_to_khz("2445.406"), Some(2_445_406));
        assert_eq!(mhz_to_khz(" 3000"), Some(3_000_000));
        assert_eq!(mhz_to_khz("1999.9"), Some(1_999_900));
        assert_eq!(mhz_to_khz("x"), None);
        assert!(
            host_tsc_khz().is_some_and(|k| k > 100_000),
            "host TSC frequency not found"
        );
    }
}
