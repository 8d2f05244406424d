//! Percentiles and the Markdown table.

use std::time::Duration;

#[derive(Debug, Default, Clone)]
pub struct Samples(Vec<Duration>);

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }

    fn sorted(&self) -> Vec<Duration> {
        let mut v = self.0.clone();
        v.sort();
        v
    }

    /// Nearest-rank percentile (`q` in 0..=100); zero when empty.
    pub fn percentile(&self, q: f64) -> Duration {
        let v = self.sorted();
        if v.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((q / 100.0) * v.len() as f64).ceil() as usize;
        v[rank.clamp(1, v.len()) - 1]
    }

    pub fn p50(&self) -> Duration {
        self.percentile(50.0)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn extend(&mut self, other: &Samples) {
        self.0.extend_from_slice(&other.0);
    }
}

pub struct Row {
    name: String,
    n: String,
    p50: String,
    p95: String,
}

pub fn fmt_d(d: Duration) -> String {
    if d < Duration::from_millis(10) {
        format!("{:.2} ms", d.as_secs_f64() * 1e3)
    } else if d < Duration::from_secs(1) {
        format!("{:.0} ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{:.2} s", d.as_secs_f64())
    }
}

impl Row {
    pub fn samples(name: &str, s: &Samples) -> Row {
        Row {
            name: name.to_owned(),
            n: s.len().to_string(),
            p50: fmt_d(s.p50()),
            p95: fmt_d(s.percentile(95.0)),
        }
    }

    pub fn value(name: &str, value: String) -> Row {
        Row {
            name: name.to_owned(),
            n: "1".to_owned(),
            p50: value,
            p95: String::new(),
        }
    }

    /// A row of `n` samples summarised by the caller (e.g. a rate at the median and at the best sample).
    pub fn value_with(name: &str, n: usize, p50: String, p95: String) -> Row {
        Row {
            name: name.to_owned(),
            n: n.to_string(),
            p50,
            p95,
        }
    }

    pub fn ratio(name: &str, r: f64) -> Row {
        Row::value(name, format!("{r:.2}x"))
    }
}

pub fn render(rows: &[Row]) -> String {
    let mut out = String::from("| measurement | n | p50 / value | p95 |\n|---|---:|---:|---:|\n");
    for r in rows {
        out.push_str(&format!("| {} | {} | {} | {} |\n", r.name, r.n, r.p50, r.p95));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut s = Samples::default();
        for ms in [5, 1, 4, 2, 3, 10, 9, 8, 7, 6] {
            s.push(Duration::from_millis(ms));
        }
        assert_eq!(s.p50(), Duration::from_millis(5));
        assert_eq!(s.percentile(95.0), Duration::from_millis(10));
        assert_eq!(Samples::default().p50(), Duration::ZERO);
    }

    #[test]
    fn table_has_header_and_rows() {
        let t = render(&[Row::ratio("x", 1.5)]);
        assert!(t.starts_with("| measurement |"));
        assert!(t.contains("| x | 1 | 1.50x |  |"));
    }
}
