//! `kvgate sim`: a KV memory simulator that shows why paging wins.
//!
//! It replays one workload (same lengths, same arrival times) against several allocation
//! policies on the same memory budget, with continuous batching and recompute preemption, and
//! reports how much of the memory holds real tokens and how many requests run at once. The
//! `paged` policy is kvgate's real block manager, not a model of it.
//!
//! Files: [`workload`] (requests), [`allocator`] (policies), [`buddy`] and [`first_fit`] (the
//! contiguous placements), [`runner`] (the step loop and statistics).
//!
//! Policies: `paged` (kvgate's block manager); `max_len` (reserve the model's maximum length,
//! first-fit); `pow2` (reserve the next power of two of prompt + output, first-fit); `oracle`
//! (reserve exactly prompt + output from a binary buddy allocator, as Orca did); `oracle_ideal`
//! (the same reservation with no external fragmentation at all).

pub mod allocator;
pub mod approx_tokens;
pub mod buddy;
pub mod first_fit;
pub mod runner;
pub mod workload;

use allocator::{Allocator, Contiguous, Paged, Placement, Reserve};
pub use runner::PolicyStats;
use std::fmt::Write as _;
use std::path::PathBuf;
use workload::Request;

/// Every policy, in report order.
pub const POLICIES: [&str; 5] = ["paged", "max_len", "pow2", "oracle", "oracle_ideal"];

/// Why a simulation could not run. Each is a one-line message for the CLI.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("unknown workload {0:?} (expected sharegpt, alpaca-like or shared-prefix)")]
    UnknownWorkload(String),
    #[error("unknown policy {0:?} (expected one of paged, max_len, pow2, oracle, oracle_ideal)")]
    UnknownPolicy(String),
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("cannot read {0}: {1}")]
    Io(String, std::io::Error),
    #[error("{0}")]
    BadData(String),
}

/// Which workload to replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkloadKind {
    ShareGpt { path: PathBuf },
    AlpacaLike,
    SharedPrefix { tenants: usize },
}

/// A simulation run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub workload: WorkloadKind,
    pub budget_tokens: usize,
    pub block_size: u32,
    /// Model maximum length (the `max_len` policy's reservation).
    pub max_len: usize,
    /// Requests to replay (at most the workload's size for ShareGPT).
    pub requests: usize,
    /// Arrivals per step (Poisson); infinite: all at once.
    pub rate: f64,
    pub seed: u64,
    pub policies: Vec<String>,
}

/// The report: the JSON object `kvgate sim --json` prints.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SimReport {
    pub workload: String,
    pub budget_tokens: usize,
    pub block_size: u32,
    pub requests: usize,
    pub mean_prompt_tokens: f64,
    pub mean_output_tokens: f64,
    pub policies: Vec<PolicyStats>,
}

impl SimConfig {
    fn validate(&self) -> Result<(), SimError> {
        let invalid = |field, reason: &str| {
            Err(SimError::Invalid {
                field,
                reason: reason.to_owned(),
            })
        };
        if self.budget_tokens == 0 {
            return invalid("budget", "must be positive");
        }
        if !(1..=1024).contains(&self.block_size) {
            return invalid("block-size", "must be 1 to 1024");
        }
        if (self.budget_tokens as u64) < self.block_size as u64 {
            return invalid("budget", "smaller than one block");
        }
        if self.requests == 0 {
            return invalid("requests", "must be positive");
        }
        if self.rate.is_nan() || self.rate <= 0.0 {
            return invalid("rate", "must be positive");
        }
        if let WorkloadKind::SharedPrefix { tenants: 0 } = self.workload {
            return invalid("tenants", "must be positive");
        }
        for p in &self.policies {
            if !POLICIES.contains(&p.as_str()) {
                return Err(SimError::UnknownPolicy(p.clone()));
            }
        }
        Ok(())
    }
}

/// Builds the workload's requests. `count_tokens` measures ShareGPT text.
pub fn build_workload(
    config: &SimConfig,
    count_tokens: workload::TokenCounter<'_>,
) -> Result<Vec<Request>, SimError> {
    let n = config.requests;
    Ok(match &config.workload {
        WorkloadKind::ShareGpt { path } => {
            let mut pairs = workload::sharegpt_lengths(path, count_tokens)?;
            pairs.truncate(n);
            workload::from_pairs(&pairs, config.rate, config.seed)
        }
        WorkloadKind::AlpacaLike => workload::alpaca_like(n, config.rate, config.seed),
        WorkloadKind::SharedPrefix { tenants } => {
            workload::shared_prefix(n, *tenants, config.rate, config.seed)
        }
    })
}

/// Runs every requested policy on `reqs`.
pub fn run(config: &SimConfig, reqs: &[Request]) -> Result<SimReport, SimError> {
    config.validate()?;
    let budget = config.budget_tokens;
    let tenants = match config.workload {
        WorkloadKind::SharedPrefix { tenants } => tenants,
        _ => 1,
    };
    let policies = config
        .policies
        .iter()
        .map(|name| {
            let mut alloc: Box<dyn Allocator> = match name.as_str() {
                "paged" => Box::new(Paged::new(budget, config.block_size, tenants)),
                "max_len" => Box::new(Contiguous::new(
                    Reserve::MaxLen(config.max_len),
                    budget,
                    Placement::FirstFit,
                )),
                "pow2" => Box::new(Contiguous::new(Reserve::Pow2, budget, Placement::FirstFit)),
                "oracle" => Box::new(Contiguous::new(Reserve::Exact, budget, Placement::Buddy)),
                "oracle_ideal" => {
                    Box::new(Contiguous::new(Reserve::Exact, budget, Placement::Ideal))
                }
                other => return Err(SimError::UnknownPolicy(other.to_owned())),
            };
            Ok(runner::simulate(name, alloc.as_mut(), reqs, budget))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let n = reqs.len().max(1) as f64;
    Ok(SimReport {
        workload: match &config.workload {
            WorkloadKind::ShareGpt { .. } => "sharegpt".into(),
            WorkloadKind::AlpacaLike => "alpaca-like".into(),
            WorkloadKind::SharedPrefix { .. } => "shared-prefix".into(),
        },
        budget_tokens: budget,
        block_size: config.block_size,
        requests: reqs.len(),
        mean_prompt_tokens: reqs.iter().map(|r| r.prompt_len as f64).sum::<f64>() / n,
        mean_output_tokens: reqs.iter().map(|r| r.output_len as f64).sum::<f64>() / n,
        policies,
    })
}

impl SimReport {
    /// A plain-text table, with each policy's concurrency relative to `paged`.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "workload {}: {} requests (prompt {:.0}, output {:.0} tokens on average), budget {} tokens, block size {}",
            self.workload, self.requests, self.mean_prompt_tokens, self.mean_output_tokens,
            self.budget_tokens, self.block_size
        );
        let _ = writeln!(
            out,
            "{:<13} {:>8} {:>8} {:>9} {:>6} {:>11} {:>10} {:>13}",
            "policy",
            "useful",
            "pool",
            "mean_conc",
            "peak",
            "paged/this",
            "preempt/r",
            "blocks_saved"
        );
        let paged = self.policies.iter().find(|p| p.name == "paged");
        for p in &self.policies {
            let ratio = paged.map_or(f64::NAN, |g| g.mean_concurrent / p.mean_concurrent);
            let _ = writeln!(
                out,
                "{:<13} {:>8.3} {:>8.3} {:>9.1} {:>6} {:>10.2}x {:>10.3} {:>13.1}",
                p.name,
                p.useful_fraction,
                p.pool_fraction,
                p.mean_concurrent,
                p.peak_concurrent,
                ratio,
                p.preemptions_per_request,
                p.blocks_saved_by_sharing
            );
        }
        out
    }
}
