//! `kvgate bench --tiers`: the time to first token of a request whose long prompt was evicted
//! from the KV pool, by where its blocks come back from, side by side in one run:
//!
//! - **recompute**: no slower tier; the prompt is computed again.
//! - **host**: the host tier holds the evicted blocks; they are copied back.
//! - **disk**: the engine was restarted; the disk tier's files are read back (the OS page cache
//!   may hold them: this is the warm-restart case, not a cold disk).
//!
//! Each run starts fresh engines in this process (loopback HTTP): the prompt is sent once, two
//! other prompts of the same length evict it, and then it is timed (one streamed token).

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
            target: Target::parse(&format!("http://{addr}"), None)?,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Time to first token and cached tokens of one greedy streamed token.
    fn ttft(&self, prompt: &str) -> Result<(f64, u64, u64)> {
        let job = Job {
            prompt: prompt.to_owned(),
            max_tokens: 1,
        };
        let out = client::stream_completion(&self.target, MODEL_ID, &job, None, None);
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
    let dir = crate::model_cmd::resolve(args.tier_model.as_deref())?;
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
    let base = format!("[kv]\nblocks = {blocks}\nhash_seed = \"{seed}\"\n");
    let mut results: Vec<ModeResult> = Vec::new();
    for mode in ["recompute", "host", "disk"] {
        let mut times = Vec::new();
        let (mut cached, mut prompt_tokens) = (0, 0);
        for run in 0..args.tier_runs {
            let (t, c, p) = match mode {
                "recompute" | "host" => {
                    let extra = if mode == "host" {
                        format!("host_cache_blocks = {host}\n")
                    } else {
                        String::new()
                    };
                    let e = LocalEngine::start(&format!("{base}{extra}"), &dir)?;
                    e.ttft(&main)?;
                    for o in &others {
                        e.ttft(o)?;
                    }
                    e.ttft(&main)?
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
    println!("peer       (peer fetch is not built)");
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&results)?;
        if path == "-" {
            println!("{text}");
        } else {
            std::fs::write(path, text).with_context(|| format!("writing {path}"))?;
        }
    }
    Ok(())
}
