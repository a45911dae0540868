//! `kvgate bench`: a load generator for any OpenAI-compatible server (an engine, a gateway).
//!
//! It sends streaming completions from a workload at a fixed request rate (Poisson) or with a
//! fixed number of concurrent clients, measures time to first token, inter-token latency and
//! throughput from the client side, reads the server's prefix-cache and preemption counters from
//! `/metrics` before and after, and prints a table (or `--json`).
//!
//! Workloads:
//! - `shared-prefix`: every request is one long few-shot prefix (about 341 tokens, like the
//!   PagedAttention paper's translation test) plus a short question. `--no-prefix-cache` gives
//!   every request its own cache scope (header `x-kvgate-scope`), which turns sharing off on the
//!   same server in the same run.
//! - `sharegpt`: first human turns of the ShareGPT file as prompts (cut to `--max-prompt-chars`),
//!   with their answer lengths as `max_tokens` (capped by `--max-tokens`).
//! - `multi-tenant`: `--tenants` tenants, each with its own system prompt of `--system-tokens`;
//!   every request is one tenant's prompt (in a seeded order) plus a question of its own. With
//!   more tenants than a server has slots, a server that caches a prompt per slot loses them.
//!
//! `--tiers` starts its own engines: the time to first token of an evicted prompt by the tier
//! its blocks come back from, the tiers' throughput, and warm against cold restarts ([`tiers`]).
//!
//! `--routing-sim` needs no server: it compares the gateway's routing policies on a simulated
//! fleet ([`routing_sim`]).

mod client;
mod report;
mod routing_sim;
mod tiers;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use report::{Outcome, Report};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Server base URL, e.g. http://127.0.0.1:8080.
    #[arg(long, required_unless_present_any = ["routing_sim", "tiers"])]
    url: Option<String>,
    /// Model name to send.
    #[arg(long, default_value = "smollm2-135m-instruct")]
    model: String,
    /// shared-prefix, sharegpt or multi-tenant (`--tenants` system prompts, each request a
    /// tenant's prompt and a question of its own, tenants in a seeded order).
    #[arg(long, default_value = "shared-prefix")]
    workload: String,
    /// Before the timed requests, send every distinct prefix of the workload once, one at a time
    /// (each tenant's system prompt, the shared prefix), untimed: the steady state of a service
    /// whose tenants come back.
    #[arg(long)]
    warmup: bool,
    /// Length of each tenant's system prompt in the multi-tenant workload, in tokens (about).
    #[arg(long, default_value_t = 500)]
    system_tokens: usize,
    /// Requests to send.
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Concurrent clients (ignored with --rate).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Requests per second, Poisson arrivals (default: closed loop with --concurrency).
    #[arg(long)]
    rate: Option<f64>,
    /// Stop sending after this many seconds.
    #[arg(long)]
    duration: Option<f64>,
    /// Cap on generated tokens per request.
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// ShareGPT prompts are cut to this many characters.
    #[arg(long, default_value_t = 1200)]
    max_prompt_chars: usize,
    /// Give each request its own cache scope, so nothing is shared (an engine honours the scope
    /// header only with its engine token: pass it as --api-key).
    #[arg(long)]
    no_prefix_cache: bool,
    /// API key (sent as a bearer token), for a gateway.
    #[arg(long)]
    api_key: Option<String>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A `response_format` for every request (JSON, as the API takes it): measures constrained
    /// decoding. Requests then end where the format does, not at `--max-tokens` regardless.
    #[arg(long, value_name = "JSON")]
    response_format: Option<String>,
    /// Label for this run in the report.
    #[arg(long)]
    label: Option<String>,
    /// Print the report as JSON; with a PATH, write it there instead.
    #[arg(long, num_args = 0..=1, default_missing_value = "-", value_name = "PATH")]
    json: Option<String>,
    /// Simulate the gateway's routing policies instead of measuring a server.
    #[arg(long)]
    routing_sim: bool,
    #[command(flatten)]
    sim: routing_sim::SimArgs,
    /// Time the first token of an evicted long prompt by tier (recompute, host, disk), on
    /// engines this process starts.
    #[arg(long)]
    tiers: bool,
    #[command(flatten)]
    tier: tiers::TierArgs,
}

/// One request to send.
#[derive(Debug, Clone)]
pub struct Job {
    pub prompt: String,
    pub max_tokens: u32,
}

const FEW_SHOT: &str = "Translate English to French.\n\n\
sea otter => loutre de mer\npeppermint => menthe poivrée\nplush giraffe => girafe en peluche\n\
cheese => fromage\nThe weather is lovely today. => Il fait très beau aujourd'hui.\n\
Where is the train station? => Où est la gare ?\nI would like a cup of coffee, please. => \
Je voudrais une tasse de café, s'il vous plaît.\nThe library opens at nine in the morning and \
closes at six in the evening. => La bibliothèque ouvre à neuf heures du matin et ferme à six \
heures du soir.\nMy brother lives in a small village near the mountains, where the winters are \
long and cold. => Mon frère habite dans un petit village près des montagnes, où les hivers sont \
longs et froids.\nWe visited the museum yesterday and saw paintings from the seventeenth century. \
=> Nous avons visité le musée hier et avons vu des tableaux du dix-septième siècle.\n\
Could you please tell me how to get to the nearest pharmacy? => Pourriez-vous me dire comment \
aller à la pharmacie la plus proche ?\nThe children played in the garden until the sun went down. \
=> Les enfants ont joué dans le jardin jusqu'au coucher du soleil.\n";

const WORDS: [&str; 12] = [
    "apple", "river", "window", "bread", "mountain", "letter", "garden", "clock", "bridge",
    "candle", "forest", "teacher",
];

fn jobs(args: &BenchArgs) -> Result<Vec<Job>> {
    match args.workload.as_str() {
        "shared-prefix" => Ok((0..args.requests)
            .map(|i| Job {
                prompt: format!(
                    "{FEW_SHOT}The {} near the {} is {} years old. =>",
                    WORDS[i % WORDS.len()],
                    WORDS[(i / WORDS.len() + 3) % WORDS.len()],
                    i + 2
                ),
                max_tokens: args.max_tokens,
            })
            .collect()),
        "sharegpt" => {
            let path = crate::assets::sharegpt()?;
            let pairs = client::sharegpt_prompts(&path, args.requests, args.max_prompt_chars)?;
            Ok(pairs
                .into_iter()
                .map(|(prompt, answer_tokens)| Job {
                    prompt,
                    max_tokens: (answer_tokens as u32).clamp(1, args.max_tokens),
                })
                .collect())
        }
        "multi-tenant" => {
            if args.sim.tenants == 0 || args.system_tokens < 23 {
                bail!("--tenants must be positive and --system-tokens at least 23");
            }
            let systems = tiers::tenant_prompts(args.sim.tenants, args.system_tokens);
            let mut x = args.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            Ok((0..args.requests)
                .map(|i| tiers::tenant_job(&systems, i, tiers::xorshift(&mut x), args.max_tokens))
                .collect())
        }
        other => {
            bail!("unknown workload {other:?} (expected shared-prefix, sharegpt or multi-tenant)")
        }
    }
}

/// One request per distinct prefix of the workload, one token out (`--warmup`).
fn warmup_jobs(args: &BenchArgs) -> Vec<Job> {
    let prompts = match args.workload.as_str() {
        "multi-tenant" => tiers::tenant_prompts(args.sim.tenants, args.system_tokens),
        "shared-prefix" => vec![FEW_SHOT.to_owned()],
        _ => Vec::new(),
    };
    prompts
        .into_iter()
        .map(|p| Job {
            prompt: format!("{p}\nWarm-up."),
            max_tokens: 1,
        })
        .collect()
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.routing_sim {
        return routing_sim::run(&args.sim, args.seed, args.json.as_deref());
    }
    if args.tiers {
        return tiers::run(&args.tier, args.json.as_deref());
    }
    if args.requests == 0 || args.concurrency == 0 {
        bail!("--requests and --concurrency must be positive");
    }
    if args.rate.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
        bail!("--rate must be a positive number");
    }
    let url = args.url.as_deref().context("--url is required")?;
    let target = client::Target::parse(url, args.api_key.clone())?;
    let jobs = jobs(&args)?;
    let format: Option<serde_json::Value> = args
        .response_format
        .as_deref()
        .map(serde_json::from_str)
        .transpose()
        .context("--response-format is not JSON")?;
    if args.warmup {
        for job in warmup_jobs(&args) {
            let o = client::stream_completion(&target, &args.model, &job, None, None);
            if let Some(e) = o.error {
                bail!("warm-up request failed: {e}");
            }
        }
    }
    let before = client::scrape(&target).context("reading /metrics before the run")?;
    let bar = ProgressBar::new(jobs.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message("requests");
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let deadline = args.duration.map(|d| start + Duration::from_secs_f64(d));
    let queue = Arc::new(Mutex::new(jobs.into_iter().enumerate().collect::<Vec<_>>()));
    queue
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .reverse();
    let send = {
        let (target, args, outcomes, bar, format) = (
            target.clone(),
            args.clone(),
            outcomes.clone(),
            bar.clone(),
            format.clone(),
        );
        move |i: usize, job: Job| {
            let scope = args
                .no_prefix_cache
                .then(|| format!("bench-{}-{i}", args.seed));
            let o = client::stream_completion(
                &target,
                &args.model,
                &job,
                scope.as_deref(),
                format.as_ref(),
            );
            bar.inc(1);
            if let Ok(mut v) = outcomes.lock() {
                v.push(o);
            }
        }
    };
    let mut handles = Vec::new();
    match args.rate {
        None => {
            for _ in 0..args.concurrency {
                let (queue, send) = (queue.clone(), send.clone());
                handles.push(std::thread::spawn(move || loop {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return;
                    }
                    let next = queue.lock().ok().and_then(|mut q| q.pop());
                    let Some((i, job)) = next else { return };
                    send(i, job);
                }));
            }
        }
        Some(rate) => {
            let arrivals = client::poisson(args.requests, rate, args.seed);
            let mut q = queue.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
            while let Some((i, job)) = q.pop() {
                let at = start + Duration::from_secs_f64(arrivals[i]);
                if deadline.is_some_and(|d| at >= d) {
                    break;
                }
                std::thread::sleep(at.saturating_duration_since(Instant::now()));
                let send = send.clone();
                handles.push(std::thread::spawn(move || send(i, job)));
            }
        }
    }
    for h in handles {
        let _ = h.join();
    }
    let elapsed = start.elapsed();
    bar.finish_and_clear();
    let after = client::scrape(&target).context("reading /metrics after the run")?;
    let outcomes: Vec<Outcome> =
        std::mem::take(&mut *outcomes.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
    let report = Report::new(
        &args.label.clone().unwrap_or_else(|| args.workload.clone()),
        &outcomes,
        elapsed,
        &before,
        &after,
    );
    if let Some(path) = args.json.as_deref() {
        let json = serde_json::to_string(&report)?;
        if path == "-" {
            println!("{json}");
        } else {
            std::fs::write(path, json + "\n").with_context(|| format!("writing {path}"))?;
        }
    } else {
        print!("{}", report.table());
    }
    if report.failed > 0 && report.completed == 0 {
        bail!(
            "every request failed; first error: {}",
            report.first_error.unwrap_or_default()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::collections::HashSet;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn args(extra: &[&str]) -> BenchArgs {
        let argv = [
            "bench",
            "--url",
            "http://127.0.0.1:1",
            "--workload",
            "multi-tenant",
        ];
        Cli::parse_from(argv.iter().chain(extra)).bench
    }

    /// Each request is one tenant's whole system prompt and a question of its own; a seed gives
    /// one order, another seed another; the warm-up sends each tenant's prompt exactly once.
    #[test]
    fn the_multi_tenant_workload_cycles_tenants_in_a_seeded_order() {
        let a = args(&[
            "--tenants",
            "12",
            "--system-tokens",
            "200",
            "--requests",
            "60",
        ]);
        let systems = tiers::tenant_prompts(12, 200);
        let owner = |j: &Job| {
            let owners: Vec<usize> = (0..12)
                .filter(|t| j.prompt.starts_with(&format!("{}\n", systems[*t])))
                .collect();
            assert_eq!(owners.len(), 1, "{:?}", &j.prompt[..40]);
            owners[0]
        };
        let first = jobs(&a).unwrap();
        assert_eq!(first.len(), 60);
        let tenants: Vec<usize> = first.iter().map(owner).collect();
        let distinct: HashSet<usize> = tenants.iter().copied().collect();
        assert!(distinct.len() >= 10, "{tenants:?}");
        assert_eq!(
            jobs(&a)
                .unwrap()
                .iter()
                .map(|j| &j.prompt)
                .collect::<Vec<_>>(),
            first.iter().map(|j| &j.prompt).collect::<Vec<_>>()
        );
        let other = args(&["--tenants", "12", "--system-tokens", "200", "--seed", "1"]);
        assert_ne!(
            jobs(&other)
                .unwrap()
                .iter()
                .map(owner)
                .take(20)
                .collect::<Vec<_>>(),
            tenants[..20]
        );
        let warm: Vec<usize> = warmup_jobs(&a).iter().map(owner).collect();
        assert_eq!(warm, (0..12).collect::<Vec<_>>());
        assert!(jobs(&args(&["--tenants", "0"])).is_err());
    }
}
