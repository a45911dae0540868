//! The bench's figures: per-request outcomes folded into one report.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

/// What one request saw.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub ttft: Option<Duration>,
    pub itl: Vec<Duration>,
    pub latency: Duration,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    pub error: Option<String>,
}

/// The run's report (`--json` prints it as one object).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    pub label: String,
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub total_tokens_per_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    pub latency_p50_ms: f64,
    pub mean_prompt_tokens: f64,
    pub cached_fraction: f64,
    pub preemptions: f64,
    pub server_hit_tokens: f64,
    pub first_error: Option<String>,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Report {
    pub fn new(
        label: &str,
        outcomes: &[Outcome],
        elapsed: Duration,
        before: &HashMap<String, f64>,
        after: &HashMap<String, f64>,
    ) -> Self {
        let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
        let secs = elapsed.as_secs_f64().max(1e-9);
        let out: u64 = ok.iter().map(|o| o.output_tokens).sum();
        let prompt: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
        let cached: u64 = ok.iter().map(|o| o.cached_tokens).sum();
        let mut ttft: Vec<f64> = ok.iter().filter_map(|o| o.ttft).map(ms).collect();
        let mut itl: Vec<f64> = ok
            .iter()
            .flat_map(|o| o.itl.iter().copied().map(ms))
            .collect();
        let mut lat: Vec<f64> = ok.iter().map(|o| ms(o.latency)).collect();
        let delta =
            |k: &str| after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0);
        Report {
            label: label.to_owned(),
            completed: ok.len(),
            failed: outcomes.len() - ok.len(),
            duration_s: secs,
            requests_per_s: ok.len() as f64 / secs,
            output_tokens_per_s: out as f64 / secs,
            total_tokens_per_s: (out + prompt) as f64 / secs,
            ttft_p50_ms: pct(&mut ttft, 0.5),
            ttft_p99_ms: pct(&mut ttft, 0.99),
            itl_p50_ms: pct(&mut itl, 0.5),
            itl_p99_ms: pct(&mut itl, 0.99),
            latency_p50_ms: pct(&mut lat, 0.5),
            mean_prompt_tokens: prompt as f64 / ok.len().max(1) as f64,
            cached_fraction: cached as f64 / prompt.max(1) as f64,
            preemptions: delta("kvgate_preemptions_total"),
            server_hit_tokens: delta("kvgate_prefix_cache_hit_tokens_total"),
            first_error: outcomes.iter().find_map(|o| o.error.clone()),
        }
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{}: {} completed, {} failed in {:.1} s",
            self.label, self.completed, self.failed, self.duration_s
        );
        let _ = writeln!(
            s,
            "  throughput   {:.2} req/s, {:.1} output tok/s, {:.1} total tok/s",
            self.requests_per_s, self.output_tokens_per_s, self.total_tokens_per_s
        );
        let _ = writeln!(
            s,
            "  TTFT         p50 {:.0} ms, p99 {:.0} ms",
            self.ttft_p50_ms, self.ttft_p99_ms
        );
        let _ = writeln!(
            s,
            "  inter-token  p50 {:.1} ms, p99 {:.1} ms",
            self.itl_p50_ms, self.itl_p99_ms
        );
        let _ = writeln!(
            s,
            "  prompts      {:.0} tokens on average, {:.1}% from the prefix cache",
            self.mean_prompt_tokens,
            100.0 * self.cached_fraction
        );
        let _ = writeln!(s, "  preemptions  {:.0}", self.preemptions);
        if let Some(e) = &self.first_error {
            let _ = writeln!(s, "  first error  {e}");
        }
        s
    }
}
