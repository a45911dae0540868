//! `kvgate sim`: parses flags, builds the workload and prints the report.

use anyhow::{bail, Context, Result};
use clap::Args;
use kvgate_sim::memory::{self as sim, SimConfig, WorkloadKind};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct SimArgs {
    /// sharegpt, alpaca-like or shared-prefix.
    #[arg(long, default_value = "sharegpt")]
    workload: String,
    /// ShareGPT JSON file (default: fetched into the kvgate cache on first use).
    #[arg(long)]
    sharegpt: Option<PathBuf>,
    /// KV memory budget in tokens, the same for every policy.
    #[arg(long, default_value_t = 65536)]
    budget: usize,
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// The model's maximum length (what `max_len` reserves).
    #[arg(long, default_value_t = 2048)]
    max_len: usize,
    /// Requests to replay (default: all ShareGPT pairs, or 10,000 synthetic ones).
    #[arg(long)]
    requests: Option<usize>,
    /// Arrivals per step (Poisson), or `inf`: every request waiting from the start, so memory
    /// is what limits every policy.
    #[arg(long, default_value_t = f64::INFINITY)]
    rate: f64,
    /// Tenants (system prompts) of the shared-prefix workload.
    #[arg(long, default_value_t = 8)]
    tenants: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Policies to compare (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = sim::POLICIES.map(String::from))]
    policies: Vec<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: SimArgs) -> Result<()> {
    let workload = match args.workload.as_str() {
        "sharegpt" => WorkloadKind::ShareGpt {
            path: match args.sharegpt {
                Some(p) => p,
                None => crate::assets::sharegpt()?,
            },
        },
        "alpaca-like" => WorkloadKind::AlpacaLike,
        "shared-prefix" => WorkloadKind::SharedPrefix {
            tenants: args.tenants,
        },
        other => bail!(sim::SimError::UnknownWorkload(other.to_owned())),
    };
    let config = SimConfig {
        requests: args.requests.unwrap_or(match workload {
            WorkloadKind::ShareGpt { .. } => usize::MAX,
            _ => 10_000,
        }),
        workload,
        budget_tokens: args.budget,
        block_size: args.block_size,
        max_len: args.max_len,
        rate: args.rate,
        seed: args.seed,
        policies: args.policies,
    };
    let count = sim::workload::approx_counter();
    let reqs = sim::build_workload(&config, &count)?;
    let report = sim::run(&config, &reqs)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).context("serializing the report")?
        );
    } else {
        print!("{}", report.table());
    }
    Ok(())
}
