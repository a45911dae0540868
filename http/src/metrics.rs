//! The one histogram type of kvgate's Prometheus metrics (engine and gateway), rendered in the
//! text exposition format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// A histogram with fixed upper bounds; observed from any thread without a lock.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_micros
            .fetch_add((v.max(0.0) * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// `# HELP`, `# TYPE`, the cumulative buckets, the sum and the count.
    pub fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_sum_and_count_add_up() {
        let h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.5, 5.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "An example.");
        for line in [
            "# TYPE x histogram",
            "x_bucket{le=\"0.1\"} 1",
            "x_bucket{le=\"1\"} 3",
            "x_bucket{le=\"+Inf\"} 4",
            "x_sum 6.05",
            "x_count 4",
        ] {
            assert!(out.contains(line), "{line} missing from\n{out}");
        }
    }
}
