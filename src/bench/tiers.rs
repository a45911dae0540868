//! `kvgate bench --tiers`: the time to first token of a request whose long prompt was evicted
//! from the KV pool, by where its blocks come back from, side by side in one run:
//!
//! - **recompute**: no slower tier; the prompt is computed again.
//! - **host**: the host tier holds the evicted blocks; they are copied back.
//! - **disk**: the engine was restarted; the disk tier's files are read back (the OS page cache
//!   may hold them: this is the warm-restart case, not a cold disk).
//! - **peer**: a fresh engine is told (as the gateway tells it) that another engine holds the
//!   prompt, and fetches its blocks over loopback HTTP.
//!
//! Each run starts fresh engines in this process (loopback HTTP): the prompt is sent once, two
//! other prompts of the same length evict it, and then it is timed (one streamed token).
//!
//! `--tier-throughput` instead runs a shared-prefix workload whose system prompts are four times
//! the KV pool, tiers off against the host tier on: requests per second and TTFT p50/p99.
//!
//! `--tier-restart` restarts an engine whose tenants' system prompts were cached, once with its
//! disk tier kept (warm) and once with it emptied (cold), and times each restart from the start
//! of the process's engine to its first cached hit, with the hit rate of the first minute.

use super::client::{self, Target};
use super::Job;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvgate_engine::server::{self, config::EngineConfig, launch};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Args, Debug, Clone)]
pub struct TierArgs {
    /// Model directory (default: the default model, fetched on first use).
    #[arg(long, value_name = "DIR")]
    pub tier_model: Option<PathBuf>,
    /// Length of the evicted prompt, in tokens (about).
    #[arg(long, default_value_t = 2000)]
    pub tier_prompt_tokens: usize,
    /// Runs of each mode (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub tier_runs: usize,
    /// Run the shared-prefix throughput workload (system prompts 4x the pool) instead.
    #[arg(long)]
    pub tier_throughput: bool,
    /// Time a warm restart (the disk tier kept) against a cold one instead: the time from start
    /// to the first cached hit and the hit rate over the first `--tier-restart-secs`.
    #[arg(long)]
    pub tier_restart: bool,
    /// How long each restart is measured for, in seconds.
    #[arg(long, default_value_t = 60.0)]
    pub tier_restart_secs: f64,
}

const MODEL_ID: &str = "smollm2-135m-instruct";
const WORDS: [&str; 10] = [
    "harbor", "lantern", "meadow", "copper", "violin", "glacier", "orchard", "compass", "saddle",
    "pebble",
];

/// A prompt of about `tokens` tokens on `topic` (about 23 tokens per sentence).
fn prompt(topic: &str, tokens: usize) -> String {
    let mut s = format!("Notes on {topic}.\n");
    for i in 0..tokens / 23 {
        s.push_str(&format!(
            "Fact {i} about {topic}: the {} by the {} is {} years old.\n",
            WORDS[i % WORDS.len()],
            WORDS[(i / WORDS.len() + 3) % WORDS.len()],
            i + 7
        ));
    }
    s.push_str("Summary:");
    s
}

/// An engine serving in this process on loopback; stopped (and its cache persisted) on drop.
struct LocalEngine {
    target: Target,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The engine token of the engines this benchmark starts (peer transfer needs one).
const TOKEN: &str = "bench-engine-token";

impl LocalEngine {
    fn start(toml: &str, dir: &Path) -> Result<LocalEngine> {
        let mut config = EngineConfig::parse(toml).map_err(|e| anyhow::anyhow!("{e}"))?;
        config.model_id = Some(MODEL_ID.into());
        let state = launch::start(&config, dir).context("starting an engine")?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::bind("127.0.0.1:0").await else {
                    return;
                };
                let _ = addr_tx.send(listener.local_addr().ok());
                let _ = server::run(listener, state, async {
                    let _ = stopped.await;
                })
                .await;
            });
        });
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(30))
            .ok()
            .flatten()
            .context("the engine did not start listening")?;
        Ok(LocalEngine {
            target: Target::parse(&format!("http://{addr}"), Some(TOKEN.into()))?,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    fn url(&self) -> String {
        self.target.url()
    }

    /// Time to first token and cached tokens of one greedy streamed token.
    fn ttft(&self, prompt: &str) -> Result<(f64, u64, u64)> {
        self.ttft_via(prompt, None)
    }

    /// [`Self::ttft`], told that `peer` holds the prompt's prefix.
    fn ttft_via(&self, prompt: &str, peer: Option<&str>) -> Result<(f64, u64, u64)> {
        let job = Job {
            prompt: prompt.to_owned(),
            max_tokens: 1,
        };
        let headers: Vec<(&str, &str)> = peer
            .map(|p| ("x-kvgate-prefix-peer", p))
            .into_iter()
            .collect();
        let out = client::stream_completion_with(&self.target, MODEL_ID, &job, &headers, None);
        if let Some(e) = out.error {
            bail!("{e}");
        }
        let ttft = out.ttft.context("no token came back")?.as_secs_f64();
        Ok((ttft, out.cached_tokens, out.prompt_tokens))
    }
}

impl Drop for LocalEngine {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[derive(Debug, serde::Serialize)]
struct ModeResult {
    mode: &'static str,
    ttft_secs: Vec<f64>,
    median_ttft_secs: f64,
    cached_tokens: u64,
    prompt_tokens: u64,
    speedup_vs_recompute: f64,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}

pub fn run(args: &TierArgs, json: Option<&str>) -> Result<()> {
    if args.tier_runs == 0 || args.tier_prompt_tokens < 64 {
        bail!("--tier-runs must be positive and --tier-prompt-tokens at least 64");
    }
    let dir = crate::model_cmd::resolve(args.tier_model.as_deref(), false)?;
    // A pool that holds the prompt and one other: the next one evicts it.
    let blocks = (args.tier_prompt_tokens / 16 + 8) * 5 / 4;
    let host = blocks * 2;
    let seed = "5a".repeat(32);
    let main = prompt("lighthouses", args.tier_prompt_tokens);
    let others = [
        prompt("beekeeping", args.tier_prompt_tokens),
        prompt("typesetting", args.tier_prompt_tokens),
    ];
    let scratch = std::env::temp_dir().join(format!("kvgate-bench-tiers-{}", std::process::id()));
    let base = format!(
        "[auth]\nengine_token = \"{TOKEN}\"\n[kv]\nblocks = {blocks}\nhash_seed = \"{seed}\"\n"
    );
    if args.tier_throughput {
        return throughput(args, &dir, &base, json);
    }
    if args.tier_restart {
        return restart(args, &dir, &scratch, json);
    }
    let mut results: Vec<ModeResult> = Vec::new();
    for mode in ["recompute", "host", "disk", "peer"] {
        let mut times = Vec::new();
        let (mut cached, mut prompt_tokens) = (0, 0);
        for run in 0..args.tier_runs {
            let (t, c, p) = match mode {
                "recompute" | "host" => {
                    // With the engine token a staging host tier is on unless turned off.
                    let extra = if mode == "host" {
                        format!("host_cache_blocks = {host}\n")
                    } else {
                        "host_cache_blocks = 0\n".to_owned()
                    };
                    let e = LocalEngine::start(&format!("{base}{extra}"), &dir)?;
                    e.ttft(&main)?;
                    for o in &others {
                        e.ttft(o)?;
                    }
                    e.ttft(&main)?
                }
                "peer" => {
                    let holder = LocalEngine::start(&base, &dir)?;
                    holder.ttft(&main)?;
                    let taker =
                        LocalEngine::start(&format!("{base}host_cache_blocks = {host}\n"), &dir)?;
                    taker.ttft_via(&main, Some(&holder.url()))?
                }
                _ => {
                    let disk = scratch.join(format!("run{run}"));
                    let _ = std::fs::remove_dir_all(&disk);
                    let toml = format!("{base}disk_dir = {:?}\n", disk.display().to_string());
                    {
                        let e = LocalEngine::start(&toml, &dir)?;
                        e.ttft(&main)?;
                        // Stopping persists the cache to disk.
                    }
                    let e = LocalEngine::start(&toml, &dir)?;
                    e.ttft(&main)?
                }
            };
            eprintln!(
                "{mode} run {run}: TTFT {:.1} ms, {c} of {p} prompt tokens cached",
                t * 1e3
            );
            times.push(t);
            (cached, prompt_tokens) = (c, p);
        }
        results.push(ModeResult {
            mode,
            median_ttft_secs: median(&times),
            ttft_secs: times,
            cached_tokens: cached,
            prompt_tokens,
            speedup_vs_recompute: 0.0,
        });
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let base_ttft = results[0].median_ttft_secs;
    for r in &mut results {
        r.speedup_vs_recompute = base_ttft / r.median_ttft_secs.max(1e-9);
    }
    println!(
        "TTFT of an evicted {}-token prompt, median of {} runs (SmolLM2 on this machine):",
        results[0].prompt_tokens, args.tier_runs
    );
    println!(
        "{:<10} {:>10} {:>8} {:>10}",
        "mode", "TTFT ms", "cached", "speedup"
    );
    for r in &results {
        println!(
            "{:<10} {:>10.1} {:>8} {:>9.1}x",
            r.mode,
            r.median_ttft_secs * 1e3,
            r.cached_tokens,
            r.speedup_vs_recompute
        );
    }
    write_json(json, &results)
}

/// Prints `results` as JSON (`-`) or writes them to a file.
fn write_json(json: Option<&str>, results: &impl serde::Serialize) -> Result<()> {
    let Some(path) = json else {
        return Ok(());
    };
    let text = serde_json::to_string_pretty(results)?;
    if path == "-" {
        println!("{text}");
    } else {
        std::fs::write(path, text).with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let i = ((s.len() as f64 - 1.0) * p).round() as usize;
    s.get(i).copied().unwrap_or(0.0)
}

#[derive(Debug, serde::Serialize)]
struct ThroughputResult {
    mode: &'static str,
    requests: usize,
    requests_per_sec: f64,
    ttft_p50_secs: f64,
    ttft_p99_secs: f64,
    cached_fraction: f64,
}

/// `count` tenants' system prompts of about `tokens` tokens each.
pub(super) fn tenant_prompts(count: usize, tokens: usize) -> Vec<String> {
    (0..count)
        .map(|t| prompt(&format!("tenant {t} ({})", WORDS[t % WORDS.len()]), tokens))
        .collect()
}

/// A seeded xorshift stream: the same request order in every mode.
pub(super) fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// A question for tenant `x % tenants` (request `i`).
pub(super) fn tenant_job(systems: &[String], i: usize, x: u64, max_tokens: u32) -> Job {
    Job {
        prompt: format!(
            "{}\nQuestion {i}: what is fact {}?",
            systems[(x % systems.len() as u64) as usize],
            x % 97
        ),
        max_tokens,
    }
}

/// Runs `client` on `n` threads at once and gathers what they return.
fn run_clients<T: Send>(n: usize, client: impl Fn() -> Vec<T> + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n).map(|_| s.spawn(&client)).collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

#[derive(Debug, serde::Serialize)]
struct RestartResult {
    mode: &'static str,
    /// From the start of the engine (the model's load included) to listening.
    ready_secs: f64,
    /// From the start of the engine to the end of the first request that found its tenant's
    /// system prompt cached (`None`: none did in the window).
    first_hit_secs: Option<f64>,
    requests: usize,
    /// Cached prompt tokens over prompt tokens, the whole window.
    hit_rate: f64,
    /// Requests whose system prompt was cached.
    requests_hit: usize,
}

/// Warm restart against cold: 48 tenants' 400-token system prompts are cached (and, at the stop,
/// persisted), then the engine restarts with its disk tier kept, and again with it emptied;
/// each time 4 clients send the tenants' questions, in the same seeded order, from the moment
/// the engine starts, for `--tier-restart-secs`.
fn restart(args: &TierArgs, dir: &Path, scratch: &Path, json: Option<&str>) -> Result<()> {
    const TENANTS: usize = 48;
    const PROMPT_TOKENS: usize = 400;
    const CLIENTS: usize = 4;
    if !(args.tier_restart_secs > 0.0 && args.tier_restart_secs.is_finite()) {
        bail!("--tier-restart-secs must be a positive number");
    }
    let window = Duration::from_secs_f64(args.tier_restart_secs);
    let systems = tenant_prompts(TENANTS, PROMPT_TOKENS);
    let disk = scratch.join("restart");
    let _ = std::fs::remove_dir_all(&disk);
    // The pool holds every tenant: only the restart loses them.
    let toml = format!(
        "[auth]\nengine_token = \"{TOKEN}\"\n[kv]\nblocks = 2048\nhash_seed = \"{}\"\n\
         disk_dir = {:?}\n",
        "5a".repeat(32),
        disk.display().to_string()
    );
    {
        let e = LocalEngine::start(&toml, dir)?;
        for system in &systems {
            e.ttft(&format!("{system}\nWarm-up."))?;
        }
        // Stopping persists the cache to disk.
    }
    let mut results = Vec::new();
    for mode in ["warm restart", "cold restart"] {
        if mode == "cold restart" {
            std::fs::remove_dir_all(&disk).context("emptying the disk tier")?;
        }
        let started = std::time::Instant::now();
        let e = LocalEngine::start(&toml, dir)?;
        let ready = started.elapsed().as_secs_f64();
        let next = std::sync::Mutex::new((0usize, 0x2545_f491_4f6c_dd1du64));
        let outcomes: Vec<(f64, super::report::Outcome)> = run_clients(CLIENTS, || {
            let mut out = Vec::new();
            while started.elapsed() < window {
                let Ok(mut n) = next.lock() else { break };
                let i = n.0;
                n.0 += 1;
                let x = xorshift(&mut n.1);
                drop(n);
                let job = tenant_job(&systems, i, x, 4);
                let o = client::stream_completion(&e.target, MODEL_ID, &job, None, None);
                out.push((started.elapsed().as_secs_f64(), o));
            }
            out
        });
        if let Some(err) = outcomes.iter().find_map(|(_, o)| o.error.clone()) {
            bail!("{mode}: {err}");
        }
        // A hit: at least the system prompt's full blocks came from the cache.
        let hit =
            |o: &super::report::Outcome| o.cached_tokens >= (PROMPT_TOKENS as u64 / 16) * 16 / 2;
        let (cached, prompt): (u64, u64) = outcomes.iter().fold((0, 0), |(c, p), (_, o)| {
            (c + o.cached_tokens, p + o.prompt_tokens)
        });
        let r = RestartResult {
            mode,
            ready_secs: ready,
            first_hit_secs: outcomes
                .iter()
                .filter(|(_, o)| hit(o))
                .map(|(t, _)| *t)
                .min_by(f64::total_cmp),
            requests: outcomes.len(),
            hit_rate: cached as f64 / prompt.max(1) as f64,
            requests_hit: outcomes.iter().filter(|(_, o)| hit(o)).count(),
        };
        eprintln!("{r:?}");
        results.push(r);
    }
    let _ = std::fs::remove_dir_all(scratch);
    println!(
        "restart with {TENANTS} tenants' {PROMPT_TOKENS}-token system prompts cached, {CLIENTS} \
         clients from the start, {:.0} s:",
        args.tier_restart_secs
    );
    println!(
        "{:<13} {:>9} {:>14} {:>9} {:>9} {:>9}",
        "mode", "ready s", "first hit s", "requests", "hits", "hit rate"
    );
    for r in &results {
        println!(
            "{:<13} {:>9.2} {:>14} {:>9} {:>9} {:>9.3}",
            r.mode,
            r.ready_secs,
            r.first_hit_secs
                .map_or_else(|| "none".to_owned(), |t| format!("{t:.2}")),
            r.requests,
            r.requests_hit,
            r.hit_rate
        );
    }
    write_json(json, &results)
}

/// The shared-prefix workload whose system prompts are 4x the pool: 24 tenants' 400-token
/// prompts (25 blocks each, 600 in all) on a 150-block pool, 96 requests from 4 clients in a
/// seeded order, each a tenant's prompt and a short question of its own, 4 tokens out, after
/// every tenant has been seen once (untimed). The pool holds the four requests running at once,
/// not the tenants' prompts.
fn throughput(args: &TierArgs, dir: &Path, base: &str, json: Option<&str>) -> Result<()> {
    const TENANTS: usize = 24;
    const PROMPT_TOKENS: usize = 400;
    const REQUESTS: usize = 96;
    const CLIENTS: usize = 4;
    let systems = tenant_prompts(TENANTS, PROMPT_TOKENS);
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let jobs: Vec<Job> = (0..REQUESTS)
        .map(|i| tenant_job(&systems, i, xorshift(&mut x), 4))
        .collect();
    // A quarter of the blocks the tenants' prompts take.
    let pool_blocks = TENANTS * PROMPT_TOKENS.div_ceil(16) / 4;
    let pool = base.replace(
        &format!("blocks = {}", (args.tier_prompt_tokens / 16 + 8) * 5 / 4),
        &format!("blocks = {pool_blocks}"),
    );
    let mut results = Vec::new();
    for (mode, extra) in [
        ("tiers off", "host_cache_blocks = 0\n"),
        ("host tier", "host_cache_blocks = 1024\n"),
    ] {
        let e = LocalEngine::start(&format!("{pool}{extra}"), dir)?;
        // Every tenant has been seen once (not timed): the steady state of a service whose
        // tenants come back.
        for system in &systems {
            e.ttft(&format!("{system}\nWarm-up."))?;
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let started = std::time::Instant::now();
        let outcomes: Vec<super::report::Outcome> = run_clients(CLIENTS, || {
            let mut out = Vec::new();
            while let Some(job) = jobs.get(next.fetch_add(1, std::sync::atomic::Ordering::SeqCst)) {
                out.push(client::stream_completion(
                    &e.target, MODEL_ID, job, None, None,
                ));
            }
            out
        });
        let secs = started.elapsed().as_secs_f64();
        if let Some(err) = outcomes.iter().find_map(|o| o.error.clone()) {
            bail!("{mode}: {err}");
        }
        let ttft: Vec<f64> = outcomes
            .iter()
            .filter_map(|o| o.ttft.map(|t| t.as_secs_f64()))
            .collect();
        let (cached, prompt): (u64, u64) = outcomes.iter().fold((0, 0), |(c, p), o| {
            (c + o.cached_tokens, p + o.prompt_tokens)
        });
        let r = ThroughputResult {
            mode,
            requests: outcomes.len(),
            requests_per_sec: outcomes.len() as f64 / secs,
            ttft_p50_secs: percentile(&ttft, 0.5),
            ttft_p99_secs: percentile(&ttft, 0.99),
            cached_fraction: cached as f64 / prompt.max(1) as f64,
        };
        eprintln!("{r:?}");
        results.push(r);
    }
    println!(
        "shared prefix, system prompts 4x the pool ({TENANTS} x {PROMPT_TOKENS} tokens on \
         {pool_blocks} blocks), {REQUESTS} requests from {CLIENTS} clients:"
    );
    println!(
        "{:<10} {:>8} {:>12} {:>12} {:>8}",
        "mode", "req/s", "TTFT p50 ms", "TTFT p99 ms", "cached"
    );
    for r in &results {
        println!(
            "{:<10} {:>8.2} {:>12.0} {:>12.0} {:>8.3}",
            r.mode,
            r.requests_per_sec,
            r.ttft_p50_secs * 1e3,
            r.ttft_p99_secs * 1e3,
            r.cached_fraction
        );
    }
    let ratio = results[1].requests_per_sec / results[0].requests_per_sec.max(1e-9);
    println!("throughput, host tier against tiers off: {ratio:.2}x");
    write_json(json, &results)
}
