//! `kvgate bench --routing-sim`: the gateway's routing policies side by side on one simulated
//! trace (`kvgate_sim::routing`), and the cost of one full routing decision with the real
//! tokenizer.

use anyhow::{bail, Context, Result};
use clap::Args;
use kvgate_protocol::prompt::PromptRenderer;
use kvgate_sim::routing::{self as sim, DecisionTiming, PolicyResult, SimConfig, SimPolicy, Trace};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

/// Options of `--routing-sim` (defaults: 8 engines, 100 tenants, the gateway's routing defaults).
#[derive(Args, Debug, Clone)]
pub struct SimArgs {
    /// Simulated engines.
    #[arg(long, default_value_t = 8)]
    engines: usize,
    /// Tenants: of the simulation (with Zipf popularity), or of the multi-tenant workload (in
    /// a uniform seeded order).
    #[arg(long, default_value_t = 100)]
    pub tenants: usize,
    /// Zipf exponent of tenant popularity.
    #[arg(long, default_value_t = 1.0)]
    zipf_s: f64,
    /// Requests in the simulated trace.
    #[arg(long, default_value_t = 20_000)]
    sim_requests: usize,
    /// Prompt blocks each engine caches (default: a quarter of all system prompts' blocks).
    #[arg(long)]
    capacity_blocks: Option<usize>,
    /// Fleet utilization the arrival rate aims at, with system prompts cached.
    #[arg(long, default_value_t = 0.75)]
    utilization: f64,
    /// Arrival rate in requests/s (overrides --utilization).
    #[arg(long)]
    sim_rate: Option<f64>,
    /// Prefill tokens/s of one simulated engine.
    #[arg(long, default_value_t = 16_000.0)]
    prefill_tps: f64,
    /// Decode tokens/s of one sequence alone in a simulated engine's batch (with
    /// --sim-max-seqs 1, the engine's whole decode throughput amortized per request).
    #[arg(long, default_value_t = 2_000.0)]
    decode_tps: f64,
    /// Sequences in a simulated engine's running batch at most (1: a request at a time).
    #[arg(long, default_value_t = 1)]
    sim_max_seqs: usize,
    /// A simulated engine's step time by its tokens, as measured on a real engine:
    /// `TOKENS:MS,TOKENS:MS,...` in increasing tokens, joined by straight lines (default: a
    /// fixed time from --decode-tps plus 1 / --prefill-tps a token).
    #[arg(long, value_parser = step_curve)]
    sim_step_ms: Option<StepCurve>,
    /// Milliseconds each request adds to its engine's step that admits it, beyond the step
    /// curve and the context's time: what it costs the engine's compute that neither says.
    #[arg(long, default_value_t = 0.0)]
    sim_request_ms: f64,
    /// Microseconds a step's token takes for each token of context it attends to beyond its
    /// own chunk, beside the step curve (measured on new prompts): a prefill chunk's tokens
    /// over the prompt already cached, a decoding token over its prompt and answer so far.
    #[arg(long, default_value_t = 0.0)]
    sim_context_us: f64,
    /// Milliseconds to fetch one block from a peer engine.
    #[arg(long, default_value_t = kvgate_protocol::load::PRIOR_PEER_LOAD_SECS_PER_BLOCK * 1e3)]
    peer_load_ms_per_block: f64,
    /// Routing load factor (default: the gateway's).
    #[arg(long)]
    load_factor: Option<f64>,
    /// Policies to compare, comma-separated.
    #[arg(
        long,
        default_value = "prefix,round_robin,least_loaded,consistent_hash,oracle"
    )]
    policies: String,
    /// Iterations of the decision-time loop (0 skips it).
    #[arg(long, default_value_t = 20_000)]
    timing_iterations: usize,
    /// Host-tier blocks per engine: with it, every policy runs twice, tiers off and on, and the
    /// report compares them (0: no host tier).
    #[arg(long, default_value_t = 0)]
    host_blocks: usize,
    /// Milliseconds to bring one block back from the host tier.
    #[arg(long, default_value_t = 0.2)]
    host_load_ms_per_block: f64,
    /// Closed loop: this many clients, each sending its next request when its last one is
    /// answered (as `scripts/bench-routing` does), instead of Poisson arrivals.
    #[arg(long)]
    sim_clients: Option<usize>,
    /// Compute units the simulated engines share (engines on one machine's cores: with more
    /// busy than units, each runs slower); default: each engine its own.
    #[arg(long)]
    sim_cores: Option<usize>,
    /// Tokens of each tenant's system prompt: N or MIN-MAX (uniform).
    #[arg(long, value_parser = token_range, default_value = "200-2000")]
    sim_system_tokens: (usize, usize),
    /// Tokens of each request's own part: N or MIN-MAX.
    #[arg(long, value_parser = token_range, default_value = "20-200")]
    sim_user_tokens: (usize, usize),
    /// Output tokens of each request: N or MIN-MAX.
    #[arg(long, value_parser = token_range, default_value = "50-300")]
    sim_output_tokens: (usize, usize),
    /// Tokenizer for the decision-time loop (tokenizer.json, tokenizer_config.json).
    #[arg(long, default_value = "target/kvgate-test-assets/smollm2-f32")]
    tokenizer_dir: PathBuf,
}

/// `--sim-step-ms`: (tokens, seconds) points.
#[derive(Debug, Clone)]
pub struct StepCurve(Vec<(usize, f64)>);

fn step_curve(s: &str) -> Result<StepCurve, String> {
    let mut points: Vec<(usize, f64)> = Vec::new();
    for part in s.split(',') {
        let (t, ms) = part
            .split_once(':')
            .ok_or_else(|| format!("{part:?} is not TOKENS:MS"))?;
        let t: usize = t
            .trim()
            .parse()
            .map_err(|_| format!("{t:?} is not a number of tokens"))?;
        let ms: f64 = ms
            .trim()
            .parse()
            .map_err(|_| format!("{ms:?} is not milliseconds"))?;
        if !(ms.is_finite() && ms >= 0.0) {
            return Err(format!("{ms} ms is not a time"));
        }
        if points.last().is_some_and(|p| p.0 >= t) {
            return Err("the points' tokens must increase".to_owned());
        }
        points.push((t, ms / 1e3));
    }
    if points.len() < 2 || points.iter().all(|p| p.1 == 0.0) {
        return Err("at least two points, not all of them 0 ms".to_owned());
    }
    Ok(StepCurve(points))
}

/// `N` or `MIN-MAX`, as an inclusive range.
fn token_range(s: &str) -> Result<(usize, usize), String> {
    let parse = |v: &str| {
        v.trim()
            .parse::<usize>()
            .map_err(|_| format!("{v:?} is not a number of tokens"))
    };
    let (lo, hi) = match s.split_once('-') {
        Some((a, b)) => (parse(a)?, parse(b)?),
        None => (parse(s)?, parse(s)?),
    };
    if lo > hi {
        return Err(format!("{lo} is above {hi}"));
    }
    Ok((lo, hi))
}

/// The routing targets kvgate holds itself to.
const TARGET_VS_ORACLE: f64 = 0.95;
const TARGET_MAX_OVER_MEAN: f64 = 1.25;
const TARGET_DECISION_US: f64 = 20.0;

#[derive(Debug, serde::Serialize)]
struct Output<'a> {
    config: &'a SimConfig,
    capacity_blocks: usize,
    rate_per_s: f64,
    requests: usize,
    ideal_hit_rate: f64,
    results: &'a [PolicyResult],
    /// The same trace with a host tier of `config.host_blocks` per engine.
    results_with_host_tier: Option<&'a [PolicyResult]>,
    decision_timing: Option<&'a DecisionTiming>,
}

pub fn run(args: &SimArgs, seed: u64, json: Option<&str>) -> Result<()> {
    let mut config = SimConfig {
        engines: args.engines,
        tenants: args.tenants,
        zipf_s: args.zipf_s,
        requests: args.sim_requests,
        seed,
        capacity_blocks: args.capacity_blocks,
        utilization: args.utilization,
        rate: args.sim_rate,
        prefill_tps: args.prefill_tps,
        decode_tps: args.decode_tps,
        max_seqs: args.sim_max_seqs,
        peer_load_secs_per_block: args.peer_load_ms_per_block / 1e3,
        step_curve: args.sim_step_ms.clone().map_or_else(Vec::new, |c| c.0),
        request_secs: args.sim_request_ms / 1e3,
        context_secs: args.sim_context_us / 1e6,
        host_blocks: 0,
        host_load_secs_per_block: args.host_load_ms_per_block / 1e3,
        clients: args.sim_clients,
        cores: args.sim_cores,
        system_tokens: args.sim_system_tokens,
        user_tokens: args.sim_user_tokens,
        output_tokens: args.sim_output_tokens,
        ..SimConfig::default()
    };
    if let Some(f) = args.load_factor {
        config.load_factor = f;
    }
    if !(1..=64).contains(&config.engines) || config.tenants == 0 || config.requests == 0 {
        bail!("--engines must be 1..=64, --tenants and --sim-requests positive");
    }
    if !(config.utilization > 0.0 && config.prefill_tps > 0.0 && config.decode_tps > 0.0) {
        bail!("--utilization, --prefill-tps and --decode-tps must be positive");
    }
    if config.load_factor < 1.0 {
        bail!("--load-factor must be >= 1");
    }
    if config.clients == Some(0) || config.cores == Some(0) || config.max_seqs == 0 {
        bail!("--sim-clients, --sim-cores and --sim-max-seqs must be positive");
    }
    for (flag, value) in [
        ("--peer-load-ms-per-block", args.peer_load_ms_per_block),
        ("--host-load-ms-per-block", args.host_load_ms_per_block),
        ("--sim-request-ms", args.sim_request_ms),
        ("--sim-context-us", args.sim_context_us),
    ] {
        if !(value >= 0.0 && value.is_finite()) {
            bail!("{flag} must be a non-negative number");
        }
    }
    if !config.zipf_s.is_finite() {
        bail!("--zipf-s must be a finite number");
    }
    if config.system_tokens.1 == 0 || config.system_tokens.0 + config.user_tokens.0 == 0 {
        bail!(
            "--sim-system-tokens must be positive, and with --sim-user-tokens at least one token"
        );
    }
    if config.output_tokens.0 == 0 {
        bail!("--sim-output-tokens must be at least 1 (the prefill's step gives the first)");
    }
    let policies = args
        .policies
        .split(',')
        .map(|p| {
            SimPolicy::parse(p.trim()).with_context(|| {
                format!("unknown policy {p:?} (prefix, round_robin, least_loaded, consistent_hash, oracle)")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let trace = Trace::try_generate(&config).map_err(anyhow::Error::msg)?;
    let results = sim::run_all(&trace, &policies);
    // The same requests (the trace does not depend on the tiers), with a host tier.
    let tiered = (args.host_blocks > 0).then(|| {
        let mut with = config.clone();
        with.host_blocks = args.host_blocks;
        sim::run_all(&Trace::generate(&with), &policies)
    });
    let timing = decision_timing(args, &config)?;
    let to_stdout = json == Some("-");
    if !to_stdout {
        print!("{}", table(&trace, &results, timing.as_ref()));
        if let Some(on) = &tiered {
            print!("{}", tier_table(args, &results, on));
        }
    }
    if let Some(path) = json {
        let out = serde_json::to_string_pretty(&Output {
            config: &config,
            capacity_blocks: trace.capacity_blocks,
            rate_per_s: trace.rate,
            requests: trace.len(),
            ideal_hit_rate: trace.ideal_hit_rate(),
            results: &results,
            results_with_host_tier: tiered.as_deref(),
            decision_timing: timing.as_ref(),
        })?;
        if to_stdout {
            println!("{out}");
        } else {
            std::fs::write(path, out + "\n").with_context(|| format!("writing {path}"))?;
            println!("\nJSON written to {path}");
        }
    }
    Ok(())
}

fn decision_timing(args: &SimArgs, config: &SimConfig) -> Result<Option<DecisionTiming>> {
    if args.timing_iterations == 0 {
        return Ok(None);
    }
    let dir = &args.tokenizer_dir;
    if !dir.join("tokenizer.json").is_file() {
        eprintln!(
            "note: no tokenizer at {} (./scripts/test downloads it there, or pass --tokenizer-dir); \
             skipping the decision-time measurement",
            dir.display()
        );
        return Ok(None);
    }
    let renderer = Arc::new(
        PromptRenderer::from_dir(dir)
            .with_context(|| format!("loading the tokenizer from {}", dir.display()))?,
    );
    // As in the simulated fleet: each engine's index holds a quarter of 100 tenants' prompts.
    let timing = sim::time_decisions(renderer, config, 2000, 1700, args.timing_iterations)
        .context("timing decisions")?;
    Ok(Some(timing))
}

fn table(trace: &Trace, results: &[PolicyResult], timing: Option<&DecisionTiming>) -> String {
    let c = &trace.config;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "routing simulation: {} engines{}, {} tenants (Zipf s={}), {} requests {}, seed {}",
        c.engines,
        c.cores
            .map_or(String::new(), |u| format!(" sharing {u} compute units")),
        c.tenants,
        c.zipf_s,
        trace.len(),
        match c.clients {
            Some(n) => format!("from {n} clients (closed loop)"),
            None => format!("at {:.1}/s (Poisson)", trace.rate),
        },
        c.seed
    );
    let _ = writeln!(
        s,
        "  prompts: system {}-{} + user {}-{} tokens, output {}-{}; block {}; cache {} blocks/engine",
        c.system_tokens.0,
        c.system_tokens.1,
        c.user_tokens.0,
        c.user_tokens.1,
        c.output_tokens.0,
        c.output_tokens.1,
        c.block_size,
        trace.capacity_blocks
    );
    let speed = if c.step_curve.is_empty() {
        format!(
            "prefill {} tok/s, decode {} tok/s",
            c.prefill_tps, c.decode_tps
        )
    } else {
        let points: Vec<String> = c
            .step_curve
            .iter()
            .map(|(t, secs)| format!("{t}:{:.0}", secs * 1e3))
            .collect();
        format!("steps (tokens:ms) {}", points.join(","))
    };
    let _ = writeln!(
        s,
        "  engine: {speed}, batch of {} (step budget {}, {} beside decodes); peer fetch {} \
         ms/block; routing load_factor {}",
        c.max_seqs,
        c.max_batched_tokens,
        c.decode_step_prefill_tokens,
        c.peer_load_secs_per_block * 1e3,
        c.load_factor
    );
    let _ = writeln!(
        s,
        "  ideal hit rate (one engine, unbounded cache): {:.1}%\n",
        trace.ideal_hit_rate() * 100.0
    );
    let _ = writeln!(
        s,
        "{:<16} {:>7} {:>8} {:>7} {:>9} {:>9} {:>8} {:>6} {:>8} {:>9} {:>9} {:>9} {:>8} {:>7}",
        "policy",
        "hit",
        "/oracle",
        "req/s",
        "req max/",
        "tok max/",
        "busy",
        "fleet",
        "work/req",
        "TTFT mean",
        "TTFT p99",
        "queue",
        "decide",
        "peer"
    );
    let _ = writeln!(
        s,
        "{:<16} {:>7} {:>8} {:>7} {:>9} {:>9} {:>8} {:>6} {:>8} {:>9} {:>9} {:>9} {:>8} {:>7}",
        "",
        "rate",
        "",
        "",
        "mean",
        "mean",
        "max/mean",
        "busy",
        "ms",
        "ms",
        "ms",
        "ms",
        "us",
        "fetches"
    );
    for r in results {
        let _ = writeln!(
            s,
            "{:<16} {:>6.1}% {:>8} {:>7.2} {:>9.2} {:>9.2} {:>8.2} {:>5.0}% {:>8.1} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>7}",
            r.policy,
            r.hit_rate * 100.0,
            r.vs_oracle
                .map_or("-".to_owned(), |v| format!("{:.1}%", v * 100.0)),
            r.requests_per_s,
            r.requests_max_over_mean,
            r.tokens_max_over_mean,
            r.busy_max_over_mean,
            r.fleet_busy * 100.0,
            r.work_ms_per_request,
            r.mean_ttft_ms,
            r.p99_ttft_ms,
            r.mean_queue_ms,
            r.decision_us,
            r.peer_fetches
        );
    }
    let find = |name: &str| results.iter().find(|r| r.policy == name);
    if let Some(p) = find("prefix") {
        let reasons: Vec<String> = p.reasons.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(s, "\nprefix decisions by reason: {}", reasons.join(", "));
        let _ = writeln!(s, "\nkvgate `prefix` against its targets:");
        if let Some(v) = p.vs_oracle {
            let _ = writeln!(
                s,
                "  hit rate vs oracle  {:>6.1}%   target >= {:.0}%   {}",
                v * 100.0,
                TARGET_VS_ORACLE * 100.0,
                verdict(v >= TARGET_VS_ORACLE)
            );
        }
        let _ = writeln!(
            s,
            "  max/mean requests   {:>6.2}    target <= {:.2}    {}",
            p.requests_max_over_mean,
            TARGET_MAX_OVER_MEAN,
            verdict(p.requests_max_over_mean <= TARGET_MAX_OVER_MEAN)
        );
        let _ = writeln!(
            s,
            "  max/mean tokens     {:>6.2}    target <= {:.2}    {}",
            p.tokens_max_over_mean,
            TARGET_MAX_OVER_MEAN,
            verdict(p.tokens_max_over_mean <= TARGET_MAX_OVER_MEAN)
        );
        if let Some(t) = timing {
            let _ = writeln!(
                s,
                "  decision, warm      {:>6.1} us (p99 {:.1})   target < {:.0} us   {}",
                t.warm_mean_us,
                t.warm_p99_us,
                TARGET_DECISION_US,
                verdict(t.warm_mean_us < TARGET_DECISION_US)
            );
        }
        let _ = writeln!(s, "\npublished anchors:");
        if let Some(rr) = find("round_robin").filter(|r| r.hit_rate > 0.0) {
            let _ = writeln!(
                s,
                "  SGLang cache-aware policy: 3.8x the hit rate of round robin; kvgate prefix here: {:.2}x",
                p.hit_rate / rr.hit_rate
            );
        }
        if let Some(ll) = find("least_loaded").filter(|_| p.work_ms_per_request > 0.0) {
            let _ = writeln!(
                s,
                "  llm-d precise scorer: 2x the throughput of load-only routing; kvgate prefix here: \
                 {:.2}x the peak throughput of least_loaded (engine time per request)",
                ll.work_ms_per_request / p.work_ms_per_request
            );
        }
    }
    if let Some(t) = timing {
        let _ = writeln!(
            s,
            "\ndecision time, full gateway path (PromptHasher::chat with the real tokenizer, \
             PrefixIndex::longest_matches over {} engines x {} blocks, Router::choose):",
            t.engines, t.index_blocks
        );
        let _ = writeln!(
            s,
            "  prompt {} tokens (system {}): warm mean {:.1} us, p99 {:.1} us ({} iterations; chat hashing {:.1} us of it)",
            t.prompt_tokens,
            t.system_tokens,
            t.warm_mean_us,
            t.warm_p99_us,
            t.warm_iterations,
            t.warm_hash_mean_us
        );
        let _ = writeln!(
            s,
            "  cold (system prompt not cached yet): mean {:.1} us, p99 {:.1} us ({} iterations)",
            t.cold_mean_us, t.cold_p99_us, t.cold_iterations
        );
    }
    s
}

/// Every policy with the host tier off and on: hit rate and TTFT.
fn tier_table(args: &SimArgs, off: &[PolicyResult], on: &[PolicyResult]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nwith a host tier of {} blocks per engine ({} ms per block loaded), same trace:",
        args.host_blocks, args.host_load_ms_per_block
    );
    let _ = writeln!(
        s,
        "{:<16} {:>9} {:>9} {:>9} {:>12} {:>12} {:>12} {:>12}",
        "policy",
        "hit off",
        "hit on",
        "from host",
        "TTFT mean",
        "TTFT mean",
        "TTFT p99",
        "TTFT p99"
    );
    let _ = writeln!(
        s,
        "{:<16} {:>9} {:>9} {:>9} {:>12} {:>12} {:>12} {:>12}",
        "", "", "", "", "off ms", "on ms", "off ms", "on ms"
    );
    for (a, b) in off.iter().zip(on) {
        let _ = writeln!(
            s,
            "{:<16} {:>8.1}% {:>8.1}% {:>8.1}% {:>12.1} {:>12.1} {:>12.1} {:>12.1}",
            a.policy,
            a.hit_rate * 100.0,
            b.hit_rate * 100.0,
            b.host_hit_rate * 100.0,
            a.mean_ttft_ms,
            b.mean_ttft_ms,
            a.p99_ttft_ms,
            b.p99_ttft_ms
        );
    }
    s
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "MISSED"
    }
}
