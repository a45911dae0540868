//! Routing simulator (`kvgate bench --routing-sim`): the gateway's own policy code ([`Router`],
//! [`PrefixIndex`]) driven by a seeded multi-tenant trace against simulated engines, so policies
//! can be compared side by side on the same requests.
//!
//! The workload: `tenants` tenants with Zipf(`zipf_s`) popularity, each with a system prompt of a
//! uniform length in `system_tokens` (its tokens are synthetic ids, hashed with the real
//! [`BlockHasher`] in the tenant's scope), a per-request user part and an output length, arriving
//! as a Poisson process.
//!
//! With `clients`, arrivals are a closed loop instead: that many clients, each sending the next
//! request of the trace when its last one is answered (as `scripts/bench-routing` does). With
//! `cores`, the engines share that many compute units: while more engines are busy than units,
//! each runs at units / busy of its speed (its phases are rescheduled whenever that changes), and
//! the router sees, as the gateway does from the engines' compute reports, every engine's
//! requests in flight as sharing the compute. The simulated engines fetch nothing from peers.
//!
//! Each engine is one FIFO server: a request's service is its prefill (the prompt tokens its cache
//! does not hold, at `prefill_tps`) then its decode (`output / decode_tps`, the engine's batched
//! decode throughput amortized per request). Its prefix cache holds `capacity_blocks` prompt blocks
//! with LRU eviction at block granularity; blocks of one request are released tail first, so a
//! prefix loses its last blocks before its first ones (as the engine's block pool does). When a
//! prefill ends, the engine's new blocks are stored and evictions happen, and the gateway's
//! [`PrefixIndex`] gets the same inserts and removals (KV events, delivered instantly).
//!
//! The router sees what the gateway computes ([`kvgate_gateway::upstream::Registry::candidates`]):
//! `matched_blocks` from the index, the requests in flight on each engine, its seconds per
//! prefill token (`1 / prefill_tps`), and its wait: what a simulated engine would report, the
//! time until it has served everything routed to it so far (the prefill estimated at routing
//! time and the decode of every queued request; this engine serves one request at a time).
//!
//! With `host_blocks > 0` each engine also has a host tier: a second LRU of that many blocks that
//! takes the device cache's evictions (and drops its own oldest). A request whose cached run
//! continues there loads those blocks at `host_load_secs_per_block` each instead of computing
//! them, and they move back to the device cache. The index hears the same demotions as the
//! gateway's does (`BlockTier` events), and the router adds the load time of a candidate's
//! host-tier blocks to its wait, as the gateway does.
//!
//! The `oracle` knows every engine's true cache contents, including the blocks that requests
//! already queued there will store before this one runs, and picks the engine with the longest
//! cached prefix of the request; ties, or no match anywhere, go to the least loaded. It is greedy
//! for hits and blind to load, so it is a reference for the hit rate, not for balance.
//!
//! Unlike the rest of `routing`, this module reads the clock (decision times).

use kvgate_gateway::routing::index::{PrefixIndex, MAX_ENGINES};
use kvgate_gateway::routing::prefix::PromptHasher;
use kvgate_gateway::routing::{engine_id, Candidate, Policy, Router, RouterConfig};
use kvgate_gateway::upstream::{Registry, RouteRequest};
use kvgate_protocol::prompt::{ChatMessage, PromptError, PromptRenderer};
use kvgate_protocol::{BlockHash, BlockHasher, HashParams, LoadReport, Tier};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Arc;
use std::time::Instant;

/// The workload and the simulated fleet.
#[derive(Debug, Clone, Serialize)]
pub struct SimConfig {
    pub engines: usize,
    pub tenants: usize,
    /// Zipf exponent of tenant popularity.
    pub zipf_s: f64,
    pub requests: usize,
    pub seed: u64,
    pub block_size: u32,
    /// Inclusive ranges, uniform.
    pub system_tokens: (usize, usize),
    pub user_tokens: (usize, usize),
    pub output_tokens: (usize, usize),
    /// Prompt blocks each engine caches; `None`: a quarter of all tenants' system-prompt blocks.
    pub capacity_blocks: Option<usize>,
    /// Fleet utilization the arrival rate aims at, counting every system prompt as cached.
    pub utilization: f64,
    /// Requests per second; `None`: derived from `utilization`.
    pub rate: Option<f64>,
    /// Prefill throughput of one engine, tokens/s.
    pub prefill_tps: f64,
    /// Decode throughput of one engine (all of its batch), tokens/s.
    pub decode_tps: f64,
    pub load_factor: f64,
    /// Host-tier blocks per engine (0: no host tier).
    pub host_blocks: usize,
    /// Seconds to bring one block back from the host tier.
    pub host_load_secs_per_block: f64,
    /// Closed loop: this many clients, each sending the trace's next request as soon as its
    /// last one is answered (arrival times are then ignored). `None`: Poisson arrivals.
    pub clients: Option<usize>,
    /// Compute units the engines share (processor sharing: with more engines busy than units,
    /// each runs at units / busy of its speed), as engines on one machine's cores do. `None`:
    /// each engine has its own.
    pub cores: Option<usize>,
}

impl Default for SimConfig {
    fn default() -> Self {
        let routing = kvgate_gateway::config::RoutingSection::default();
        SimConfig {
            engines: 8,
            tenants: 100,
            zipf_s: 1.0,
            requests: 20_000,
            seed: 0,
            block_size: 16,
            system_tokens: (200, 2000),
            user_tokens: (20, 200),
            output_tokens: (50, 300),
            capacity_blocks: None,
            utilization: 0.75,
            rate: None,
            prefill_tps: 16_000.0,
            decode_tps: 2_000.0,
            load_factor: routing.load_factor,
            host_blocks: 0,
            host_load_secs_per_block: kvgate_protocol::load::PRIOR_HOST_LOAD_SECS_PER_BLOCK,
            clients: None,
            cores: None,
        }
    }
}

#[derive(Debug)]
struct Tenant {
    affinity: u128,
    system_tokens: usize,
}

#[derive(Debug)]
struct Request {
    at: f64,
    tenant: u32,
    hashes: Vec<BlockHash>,
    prompt_tokens: u32,
    output_tokens: u32,
}

/// A generated trace: the same requests for every policy.
#[derive(Debug)]
pub struct Trace {
    pub config: SimConfig,
    /// Blocks each engine caches.
    pub capacity_blocks: usize,
    /// Arrival rate, requests/s.
    pub rate: f64,
    tenants: Vec<Tenant>,
    requests: Vec<Request>,
}

/// Vocabulary of the synthetic token ids (SmolLM2's size).
const VOCAB: u32 = 49_152;

fn mean(range: (usize, usize)) -> f64 {
    (range.0 + range.1) as f64 / 2.0
}

impl Trace {
    pub fn generate(config: &SimConfig) -> Trace {
        assert!(config.engines >= 1 && config.engines <= MAX_ENGINES);
        assert!(config.tenants >= 1);
        let b = config.block_size as usize;
        let mut rng = StdRng::seed_from_u64(config.seed);
        let hasher = BlockHasher::new(&HashParams {
            model_id: "routing-sim".into(),
            weight_version: "1".into(),
            kv_dtype: "f32".into(),
            block_size: config.block_size,
            seed: [7; 32],
        });
        let mut prefixes = Vec::with_capacity(config.tenants);
        let mut tenants = Vec::with_capacity(config.tenants);
        let mut system_blocks = 0usize;
        for t in 0..config.tenants {
            let scope = format!("tenant-{t}");
            let len = rng.gen_range(config.system_tokens.0..=config.system_tokens.1);
            let tokens: Vec<u32> = (0..len).map(|_| rng.gen_range(0..VOCAB)).collect();
            let full = len / b * b;
            let (hashes, chain) = hasher.hash_prefix(&scope, &tokens[..full]);
            system_blocks += hashes.len();
            let mut key = blake3::Hasher::new();
            key.update(scope.as_bytes());
            for tok in &tokens {
                key.update(&tok.to_le_bytes());
            }
            let key = key.finalize();
            tenants.push(Tenant {
                affinity: u128::from_le_bytes(key.as_bytes()[..16].try_into().unwrap_or([0; 16])),
                system_tokens: len,
            });
            prefixes.push((hashes, chain, tokens[full..].to_vec()));
        }
        let capacity_blocks = config.capacity_blocks.unwrap_or((system_blocks / 4).max(1));
        // Work of a request whose system prompt is cached: the user part and the system prompt's
        // last partial block (half a block on average), then the decode.
        let cached_work = (mean(config.user_tokens) + b as f64 / 2.0) / config.prefill_tps
            + mean(config.output_tokens) / config.decode_tps;
        let rate = config
            .rate
            .unwrap_or(config.utilization * config.engines as f64 / cached_work);
        let weights: Vec<f64> = (0..config.tenants)
            .map(|k| 1.0 / ((k + 1) as f64).powf(config.zipf_s))
            .collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf: Vec<f64> = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        let mut at = 0.0;
        let mut requests = Vec::with_capacity(config.requests);
        for _ in 0..config.requests {
            let u: f64 = rng.gen_range(f64::EPSILON..1.0);
            at += -u.ln() / rate;
            let pick: f64 = rng.gen();
            let tenant = cdf.partition_point(|&c| c < pick).min(config.tenants - 1);
            let user = rng.gen_range(config.user_tokens.0..=config.user_tokens.1);
            let output = rng.gen_range(config.output_tokens.0..=config.output_tokens.1);
            let (sys_hashes, chain, tail) = &prefixes[tenant];
            let mut after = tail.clone();
            after.extend((0..user).map(|_| rng.gen_range(0..VOCAB)));
            let full = after.len() / b * b;
            let mut hashes = sys_hashes.clone();
            hashes.extend(hasher.extend(*chain, &after[..full]).0);
            requests.push(Request {
                at,
                tenant: tenant as u32,
                hashes,
                prompt_tokens: (tenants[tenant].system_tokens + user) as u32,
                output_tokens: output as u32,
            });
        }
        let max_blocks = requests.iter().map(|r| r.hashes.len()).max().unwrap_or(0);
        assert!(
            capacity_blocks >= 2 * max_blocks,
            "capacity of {capacity_blocks} blocks is under twice the longest prompt ({max_blocks} blocks)"
        );
        Trace {
            config: config.clone(),
            capacity_blocks,
            rate,
            tenants,
            requests,
        }
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Hit rate with one engine of unbounded cache: every request after a tenant's first finds
    /// its system prompt's full blocks.
    pub fn ideal_hit_rate(&self) -> f64 {
        let b = self.config.block_size as u64;
        let mut seen = vec![false; self.tenants.len()];
        let (mut hit, mut total) = (0u64, 0u64);
        for r in &self.requests {
            let t = r.tenant as usize;
            if seen[t] {
                hit += (self.tenants[t].system_tokens as u64) / b * b;
            }
            seen[t] = true;
            total += u64::from(r.prompt_tokens);
        }
        hit as f64 / total.max(1) as f64
    }
}

/// A policy to simulate: one of the gateway's, or the oracle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimPolicy {
    Router(Policy),
    Oracle,
}

impl SimPolicy {
    pub const ALL: [SimPolicy; 5] = [
        SimPolicy::Router(Policy::Prefix),
        SimPolicy::Router(Policy::RoundRobin),
        SimPolicy::Router(Policy::LeastLoaded),
        SimPolicy::Router(Policy::ConsistentHash),
        SimPolicy::Oracle,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SimPolicy::Router(p) => p.name(),
            SimPolicy::Oracle => "oracle",
        }
    }

    pub fn parse(name: &str) -> Option<SimPolicy> {
        match name {
            "oracle" => Some(SimPolicy::Oracle),
            other => Policy::parse(other).map(SimPolicy::Router),
        }
    }
}

/// One engine's prompt-block cache: LRU at block granularity.
#[derive(Debug, Default)]
struct Lru {
    stamp: HashMap<u128, u64>,
    order: BTreeMap<u64, u128>,
    clock: u64,
}

impl Lru {
    fn len(&self) -> usize {
        self.stamp.len()
    }

    fn contains(&self, h: BlockHash) -> bool {
        self.stamp.contains_key(&h.0)
    }

    /// Leading blocks of `hashes` held.
    fn prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.contains(**h)).count()
    }

    fn touch(&mut self, h: u128) {
        self.clock += 1;
        if let Some(old) = self.stamp.insert(h, self.clock) {
            self.order.remove(&old);
        }
        self.order.insert(self.clock, h);
    }

    fn evict_oldest(&mut self) -> Option<u128> {
        let (_, h) = self.order.pop_first()?;
        self.stamp.remove(&h);
        Some(h)
    }

    fn remove(&mut self, h: u128) -> bool {
        match self.stamp.remove(&h) {
            Some(st) => {
                self.order.remove(&st);
                true
            }
            None => false,
        }
    }
}

/// Ordered f64 event time (never NaN).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Time(f64);

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Time {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// An engine's current request reaching the end of a phase; the second field is the engine's
/// phase generation when it was scheduled (a phase rescheduled after a change of speed leaves
/// its earlier event stale).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    PrefillDone(usize, u64),
    Done(usize, u64),
}

/// The phase an engine's current request is in, and the work left in it.
#[derive(Debug, Clone, Copy)]
struct Phase {
    decoding: bool,
    /// Seconds of work left at full speed, as of `since`.
    left: f64,
    since: f64,
    generation: u64,
}

#[derive(Debug)]
struct Engine {
    slot: usize,
    id: u64,
    cache: Lru,
    /// The host tier: the device cache's evictions, until evicted in turn.
    host: Lru,
    queue: VecDeque<usize>,
    current: Option<usize>,
    phase: Option<Phase>,
    /// When it will have served everything routed to it, as estimated at routing time.
    free_at: f64,
    /// Blocks that queued and in-service requests will store (the oracle's foresight).
    pending: HashMap<u128, u32>,
    requests: u64,
    computed_tokens: u64,
    busy_s: f64,
}

/// One policy's figures on one trace.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyResult {
    pub policy: String,
    /// Cached prompt tokens / prompt tokens (host-tier hits included).
    pub hit_rate: f64,
    /// Prompt tokens loaded from the host tier / prompt tokens.
    pub host_hit_rate: f64,
    /// `hit_rate` / the oracle's (filled in by [`run_all`]).
    pub vs_oracle: Option<f64>,
    /// Max / mean over engines of requests served.
    pub requests_max_over_mean: f64,
    /// Max / mean over engines of tokens computed (uncached prompt tokens plus output tokens).
    pub tokens_max_over_mean: f64,
    /// Max / mean over engines of busy time (prefill plus decode).
    pub busy_max_over_mean: f64,
    /// Busy time / (engines x makespan).
    pub fleet_busy: f64,
    /// Engine time per request (prefill plus decode): the fleet's peak throughput is inversely
    /// proportional to it.
    pub work_ms_per_request: f64,
    pub mean_ttft_ms: f64,
    pub p99_ttft_ms: f64,
    pub mean_queue_ms: f64,
    /// Requests answered per second of the whole run.
    pub requests_per_s: f64,
    /// Mean time of one decision in the simulator: index lookup, candidates, choice.
    pub decision_us: f64,
    pub per_engine_requests: Vec<u64>,
    pub per_engine_tokens: Vec<u64>,
    /// Decisions per reason.
    pub reasons: BTreeMap<String, u64>,
}

fn max_over_mean(v: &[f64]) -> f64 {
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    if mean <= 0.0 {
        return 1.0;
    }
    v.iter().copied().fold(0.0, f64::max) / mean
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Runs `policy` over `trace`. With `verify`, checks after every KV event batch that the index
/// equals the engines' caches (slow; for tests).
pub fn run(trace: &Trace, policy: SimPolicy, verify: bool) -> PolicyResult {
    let mut sim = Simulation::new(trace, policy, verify);
    loop {
        let arrival = match trace.config.clients {
            _ if sim.next >= trace.requests.len() => None,
            Some(clients) => (sim.outstanding < clients).then_some(sim.now),
            None => Some(trace.requests[sim.next].at),
        };
        let event_at = sim.events.peek().map(|e| (e.0).0 .0);
        match (arrival, event_at) {
            (None, None) => break,
            (Some(a), Some(t)) if t <= a => sim.next_event(),
            (None, Some(_)) => sim.next_event(),
            (Some(_), _) => sim.arrive(),
        }
    }
    sim.result()
}

/// The state of one policy's run: the engines, the index the router reads, the pending events
/// and the figures so far. One method per event: an arrival, a prefill finishing, a request
/// finishing.
struct Simulation<'a> {
    trace: &'a Trace,
    policy: SimPolicy,
    verify: bool,
    router: Router,
    index: PrefixIndex,
    engines: Vec<Engine>,
    /// Every engine's bit.
    mask: u64,
    /// Per request: blocks found cached (device and host), start.
    cached_blocks: Vec<usize>,
    /// Per request: of those, blocks loaded from the host tier.
    host_blocks: Vec<usize>,
    host_hit_tokens: u64,
    started: Vec<f64>,
    /// Per request: when it was sent (its arrival time, or when its client was free).
    sent: Vec<f64>,
    /// Requests sent and not yet answered.
    outstanding: usize,
    /// Engines with a request in service.
    busy: usize,
    events: BinaryHeap<std::cmp::Reverse<(Time, u64, Event)>>,
    /// Tie-breaker of events at the same time: the order they were scheduled.
    seq: u64,
    /// The next request to arrive.
    next: usize,
    now: f64,
    ttft: Vec<f64>,
    queue_s: f64,
    hit_tokens: u64,
    prompt_tokens: u64,
    decision_ns: u128,
    reasons: BTreeMap<String, u64>,
}

impl<'a> Simulation<'a> {
    fn new(trace: &'a Trace, policy: SimPolicy, verify: bool) -> Self {
        let cfg = &trace.config;
        let engines: Vec<Engine> = (0..cfg.engines)
            .map(|slot| Engine {
                slot,
                id: engine_id(&format!("engine-{slot}")),
                cache: Lru::default(),
                host: Lru::default(),
                queue: VecDeque::new(),
                current: None,
                phase: None,
                free_at: 0.0,
                pending: HashMap::new(),
                requests: 0,
                computed_tokens: 0,
                busy_s: 0.0,
            })
            .collect();
        let n = trace.requests.len();
        Simulation {
            trace,
            policy,
            verify,
            router: Router::new(RouterConfig {
                policy: match policy {
                    SimPolicy::Router(p) => p,
                    SimPolicy::Oracle => Policy::LeastLoaded,
                },
                load_factor: cfg.load_factor,
                block_size: cfg.block_size,
                prior_secs_per_token: 1.0 / cfg.prefill_tps,
            }),
            index: PrefixIndex::new(),
            mask: engines.iter().fold(0u64, |m, e| m | (1 << e.slot)),
            engines,
            cached_blocks: vec![0; n],
            host_blocks: vec![0; n],
            host_hit_tokens: 0,
            started: vec![0.0; n],
            sent: vec![0.0; n],
            outstanding: 0,
            busy: 0,
            events: BinaryHeap::new(),
            seq: 0,
            next: 0,
            now: 0.0,
            ttft: Vec::with_capacity(n),
            queue_s: 0.0,
            hit_tokens: 0,
            prompt_tokens: 0,
            decision_ns: 0,
            reasons: BTreeMap::new(),
        }
    }

    fn block_size(&self) -> usize {
        self.trace.config.block_size as usize
    }

    /// The engine's wait as it would report it: the time until it has served what it holds, at
    /// the speed it runs at now.
    fn wait(&self, e: &Engine) -> f64 {
        (e.free_at - self.now).max(0.0) / self.speed()
    }

    /// The share of its full speed a busy engine runs at: 1, or with shared compute the units
    /// over the busy engines.
    fn speed(&self) -> f64 {
        match self.trace.config.cores {
            Some(units) if self.busy > units => units as f64 / self.busy as f64,
            _ => 1.0,
        }
    }

    /// Brings every busy engine's phase up to now at the old speed, then, after the number of
    /// busy engines changed by `delta`, reschedules each phase's end at the new speed.
    fn set_busy(&mut self, delta: isize) {
        let old = self.speed();
        self.busy = self.busy.saturating_add_signed(delta);
        let new = self.speed();
        if old == new {
            return;
        }
        let now = self.now;
        let mut reschedule = Vec::new();
        for e in &mut self.engines {
            if let Some(p) = &mut e.phase {
                p.left = (p.left - (now - p.since) * old).max(0.0);
                p.since = now;
                p.generation += 1;
                reschedule.push((e.slot, *p));
            }
        }
        for (slot, p) in reschedule {
            self.schedule_phase(slot, p, new);
        }
    }

    /// Schedules the end of engine `slot`'s phase `p` at `speed`.
    fn schedule_phase(&mut self, slot: usize, p: Phase, speed: f64) {
        let at = self.now + p.left / speed;
        let event = if p.decoding {
            Event::Done(slot, p.generation)
        } else {
            Event::PrefillDone(slot, p.generation)
        };
        self.schedule(at, event);
    }

    /// Starts a phase of `work` seconds (at full speed) on engine `slot`.
    fn begin_phase(&mut self, slot: usize, decoding: bool, work: f64) {
        let generation = self.engines[slot].phase.map_or(0, |p| p.generation + 1);
        let p = Phase {
            decoding,
            left: work,
            since: self.now,
            generation,
        };
        self.engines[slot].phase = Some(p);
        self.schedule_phase(slot, p, self.speed());
    }

    fn schedule(&mut self, at: f64, event: Event) {
        self.seq += 1;
        self.events
            .push(std::cmp::Reverse((Time(at), self.seq, event)));
    }

    /// Routes the next request and queues it on the chosen engine.
    fn arrive(&mut self) {
        let trace = self.trace;
        let i = self.next;
        self.next += 1;
        let r = &trace.requests[i];
        if trace.config.clients.is_none() {
            self.now = r.at;
        }
        self.sent[i] = self.now;
        self.outstanding += 1;
        let t0 = Instant::now();
        let (slot, matched) = self.choose(r);
        self.decision_ns += t0.elapsed().as_nanos();
        let prefill = (r.prompt_tokens as usize).saturating_sub(matched * self.block_size()) as u64;
        let oracle = self.policy == SimPolicy::Oracle;
        let cfg = &trace.config;
        let e = &mut self.engines[slot];
        e.free_at = e.free_at.max(self.now)
            + prefill as f64 / cfg.prefill_tps
            + f64::from(r.output_tokens) / cfg.decode_tps;
        if oracle {
            for h in &r.hashes {
                *e.pending.entry(h.0).or_default() += 1;
            }
        }
        e.queue.push_back(i);
        e.requests += 1;
        if e.current.is_none() {
            self.start(slot);
        }
    }

    /// The engine for `r` and the prefix blocks it is believed to hold, by the policy.
    fn choose(&mut self, r: &Request) -> (usize, usize) {
        let (slot, matched, reason) = match self.policy {
            SimPolicy::Router(_) => {
                let m = self.index.longest_tier_matches(&r.hashes, self.mask);
                let load = self.trace.config.host_load_secs_per_block;
                let speed = self.speed();
                let fleet_inflight: u64 = self
                    .engines
                    .iter()
                    .map(|e| (e.queue.len() + usize::from(e.current.is_some())) as u64)
                    .sum();
                let shared = self.trace.config.cores.is_some();
                let candidates: Vec<Candidate> = self
                    .engines
                    .iter()
                    .map(|e| Candidate {
                        slot: e.slot,
                        id: e.id,
                        matched_blocks: m[e.slot].blocks,
                        // The simulated engines do not fetch from peers.
                        peer_blocks: 0,
                        inflight: (e.queue.len() + usize::from(e.current.is_some())) as u64,
                        // With shared compute, every engine's requests share it.
                        compute_inflight: if shared {
                            fleet_inflight
                        } else {
                            (e.queue.len() + usize::from(e.current.is_some())) as u64
                        },
                        // As the gateway does: a host-tier match costs its load.
                        wait_secs: self.wait(e) + f64::from(m[e.slot].host) * load,
                        // What the engine measures: its speed as it runs now.
                        secs_per_token: 1.0 / self.trace.config.prefill_tps / speed,
                        // One request at a time: any other in flight queues.
                        max_seqs: 1,
                        free_blocks: 0,
                    })
                    .collect();
                let affinity = self.trace.tenants[r.tenant as usize].affinity;
                // No answer tokens: a simulated engine serves one request at a time, and its
                // wait already holds the decodes queued there.
                let Some(choice) =
                    self.router
                        .choose(affinity, r.prompt_tokens as usize, 0, &candidates)
                else {
                    unreachable!("engines are never empty")
                };
                let matched = choice.matched_blocks as usize;
                (choice.slot, matched, choice.reason.as_str())
            }
            SimPolicy::Oracle => {
                let known = |e: &Engine| {
                    r.hashes
                        .iter()
                        .take_while(|h| {
                            e.cache.contains(**h)
                                || e.host.contains(**h)
                                || e.pending.contains_key(&h.0)
                        })
                        .count()
                };
                let (slot, matched) = self
                    .engines
                    .iter()
                    .map(|e| (known(e), e))
                    .max_by(|(ma, a), (mb, b)| {
                        ma.cmp(mb)
                            .then(self.wait(b).total_cmp(&self.wait(a)))
                            .then(b.slot.cmp(&a.slot))
                    })
                    .map(|(m, e)| (e.slot, m))
                    .unwrap_or((0, 0));
                let reason = if matched > 0 {
                    "prefix"
                } else {
                    "least_loaded"
                };
                (slot, matched, reason)
            }
        };
        *self.reasons.entry(reason.to_owned()).or_default() += 1;
        (slot, matched)
    }

    /// Starts the next queued request on engine `slot`, if any.
    fn start(&mut self, slot: usize) {
        let trace = self.trace;
        let (b, cfg) = (self.block_size(), &trace.config);
        let e = &mut self.engines[slot];
        let Some(i) = e.queue.pop_front() else {
            return;
        };
        let r = &trace.requests[i];
        let device = e.cache.prefix(&r.hashes);
        let host = r.hashes[device..]
            .iter()
            .take_while(|h| e.host.contains(**h))
            .count();
        let cached = device + host;
        self.cached_blocks[i] = cached;
        self.host_blocks[i] = host;
        self.started[i] = self.now;
        let computed = r.prompt_tokens as usize - cached * b;
        let prefill =
            computed as f64 / cfg.prefill_tps + host as f64 * cfg.host_load_secs_per_block;
        e.current = Some(i);
        e.computed_tokens += (computed + r.output_tokens as usize) as u64;
        e.busy_s += prefill + f64::from(r.output_tokens) / cfg.decode_tps;
        self.set_busy(1);
        self.begin_phase(slot, false, prefill);
    }

    fn next_event(&mut self) {
        let Some(std::cmp::Reverse((Time(t), _, event))) = self.events.pop() else {
            return;
        };
        self.now = t;
        let current = |slot: usize, generation| {
            self.engines[slot]
                .phase
                .is_some_and(|p| p.generation == generation)
        };
        match event {
            Event::PrefillDone(slot, g) if current(slot, g) => self.prefill_done(slot),
            Event::Done(slot, g) if current(slot, g) => {
                let e = &mut self.engines[slot];
                e.current = None;
                e.phase = None;
                self.outstanding -= 1;
                self.set_busy(-1);
                self.start(slot);
            }
            // Rescheduled after a change of speed.
            _ => {}
        }
    }

    /// The request in service on `slot` has its first token: its prompt blocks are stored (the
    /// KV events reach the index) and it decodes until `Done`.
    fn prefill_done(&mut self, slot: usize) {
        let trace = self.trace;
        let (b, capacity) = (self.block_size(), trace.capacity_blocks);
        let Some(i) = self.engines[slot].current else {
            return;
        };
        let r = &trace.requests[i];
        let cached = self.cached_blocks[i];
        self.ttft.push(self.now - self.sent[i]);
        self.queue_s += self.started[i] - self.sent[i];
        self.hit_tokens += (cached * b) as u64;
        self.host_hit_tokens += (self.host_blocks[i] * b) as u64;
        self.prompt_tokens += u64::from(r.prompt_tokens);
        let host_capacity = trace.config.host_blocks;
        let e = &mut self.engines[slot];
        // The request's blocks in the host tier come back to the device cache (a block is in
        // one of the two, never both).
        for h in &r.hashes {
            e.host.remove(h.0);
        }
        // Keep the device-held blocks from being evicted for the new ones, store them, then
        // release every block of the request tail first (the head is evicted last).
        for h in &r.hashes {
            if e.cache.contains(*h) {
                e.cache.touch(h.0);
            }
        }
        for h in &r.hashes {
            if e.cache.contains(*h) {
                continue;
            }
            if e.cache.len() >= capacity {
                if let Some(old) = e.cache.evict_oldest() {
                    if host_capacity == 0 {
                        self.index.remove(slot, BlockHash(old));
                    } else {
                        // Demoted, not lost; the host tier drops its own oldest to make room.
                        if e.host.len() >= host_capacity {
                            if let Some(gone) = e.host.evict_oldest() {
                                self.index.remove(slot, BlockHash(gone));
                            }
                        }
                        e.host.touch(old);
                        self.index.insert_at(slot, BlockHash(old), Tier::Host);
                    }
                }
            }
            e.cache.touch(h.0);
            self.index.insert(slot, *h);
        }
        for h in r.hashes.iter().rev() {
            e.cache.touch(h.0);
        }
        if self.policy == SimPolicy::Oracle {
            for h in &r.hashes {
                if let Some(c) = e.pending.get_mut(&h.0) {
                    *c -= 1;
                    if *c == 0 {
                        e.pending.remove(&h.0);
                    }
                }
            }
        }
        if self.verify {
            assert_eq!(
                self.index.len(slot),
                e.cache.len() + e.host.len(),
                "index size, engine {slot}"
            );
            for h in e.cache.stamp.keys() {
                assert_eq!(
                    self.index.longest_matches(&[BlockHash(*h)], 1 << slot)[slot],
                    1,
                    "index lacks a cached block of engine {slot}"
                );
            }
        }
        self.begin_phase(
            slot,
            true,
            f64::from(r.output_tokens) / trace.config.decode_tps,
        );
    }

    fn result(mut self) -> PolicyResult {
        let cfg = &self.trace.config;
        let n = self.trace.requests.len();
        let makespan = self.now.max(f64::MIN_POSITIVE);
        self.ttft.sort_by(f64::total_cmp);
        let served = self.ttft.len().max(1) as f64;
        let per_engine_requests: Vec<u64> = self.engines.iter().map(|e| e.requests).collect();
        let per_engine_tokens: Vec<u64> = self.engines.iter().map(|e| e.computed_tokens).collect();
        let as_f64 = |v: &[u64]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let busy: Vec<f64> = self.engines.iter().map(|e| e.busy_s).collect();
        PolicyResult {
            policy: self.policy.name().to_owned(),
            hit_rate: self.hit_tokens as f64 / self.prompt_tokens.max(1) as f64,
            host_hit_rate: self.host_hit_tokens as f64 / self.prompt_tokens.max(1) as f64,
            vs_oracle: None,
            requests_max_over_mean: max_over_mean(&as_f64(&per_engine_requests)),
            tokens_max_over_mean: max_over_mean(&as_f64(&per_engine_tokens)),
            busy_max_over_mean: max_over_mean(&busy),
            fleet_busy: busy.iter().sum::<f64>() / (cfg.engines as f64 * makespan),
            work_ms_per_request: busy.iter().sum::<f64>() / n.max(1) as f64 * 1e3,
            mean_ttft_ms: self.ttft.iter().sum::<f64>() / served * 1e3,
            p99_ttft_ms: percentile(&self.ttft, 0.99) * 1e3,
            mean_queue_ms: self.queue_s / served * 1e3,
            requests_per_s: n as f64 / makespan,
            decision_us: self.decision_ns as f64 / n.max(1) as f64 / 1e3,
            per_engine_requests,
            per_engine_tokens,
            reasons: self.reasons,
        }
    }
}

/// Runs every policy in `policies` on `trace` and fills in each one's fraction of the oracle's
/// hit rate (when the oracle is among them).
pub fn run_all(trace: &Trace, policies: &[SimPolicy]) -> Vec<PolicyResult> {
    let mut results: Vec<PolicyResult> = policies.iter().map(|&p| run(trace, p, false)).collect();
    let oracle = results
        .iter()
        .find(|r| r.policy == SimPolicy::Oracle.name())
        .map(|r| r.hit_rate);
    if let Some(o) = oracle.filter(|&o| o > 0.0) {
        for r in &mut results {
            r.vs_oracle = Some(r.hit_rate / o);
        }
    }
    results
}

/// Cost of the gateway's whole decision for one chat request.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionTiming {
    pub prompt_tokens: usize,
    pub system_tokens: usize,
    pub engines: usize,
    pub index_blocks: usize,
    pub warm_iterations: usize,
    /// System prompt's tokens and hashes cached (every request after a tenant's first).
    pub warm_mean_us: f64,
    pub warm_p99_us: f64,
    /// Of which `PromptHasher::chat` (render, tokenize the rest, hash).
    pub warm_hash_mean_us: f64,
    pub cold_iterations: usize,
    /// Nothing cached: the whole prompt rendered, tokenized and hashed.
    pub cold_mean_us: f64,
    pub cold_p99_us: f64,
}

const WORDS: [&str; 24] = [
    "the",
    "customer",
    "account",
    "policy",
    "support",
    "answer",
    "always",
    "never",
    "refund",
    "order",
    "politely",
    "include",
    "reference",
    "number",
    "escalate",
    "manager",
    "shipping",
    "warranty",
    "within",
    "days",
    "product",
    "question",
    "clearly",
    "summarize",
];

/// The gateway's decision path for one chat request, set up once: [`PromptHasher::chat`] on a
/// system prompt of about `system_tokens` tokens plus one of 64 ~50-token user messages, a
/// [`Registry`] of `engines` engines with load reports (engine `s` with `s` requests in flight
/// and `100 s` prefill tokens waiting) and `blocks_per_engine` blocks each in the prefix index
/// (the system prompt on engine 3), its candidates, and [`Router::choose`] with the `prefix`
/// policy. [`time_decisions`] and the criterion bench `decision` both measure it.
#[derive(Debug)]
pub struct DecisionPath {
    hasher: PromptHasher,
    registry: Registry,
    router: Router,
    messages: Vec<Vec<ChatMessage>>,
    system_tokens: usize,
}

/// The tenant (and cache scope) of every request of a [`DecisionPath`].
const DECISION_TENANT: &str = "tenant-0";

impl DecisionPath {
    pub fn new(
        renderer: Arc<PromptRenderer>,
        config: &SimConfig,
        system_tokens: usize,
        blocks_per_engine: usize,
    ) -> Result<Self, PromptError> {
        let mut rng = StdRng::seed_from_u64(config.seed);
        let word = |rng: &mut StdRng| WORDS[rng.gen_range(0..WORDS.len())];
        let mut system = String::from("You are the support assistant of Example Corp.");
        while renderer.encode(&system)?.len() < system_tokens {
            for i in 0..50 {
                system.push(' ');
                system.push_str(word(&mut rng));
                if i % 12 == 11 {
                    system.push('.');
                }
            }
        }
        let messages: Vec<Vec<ChatMessage>> = (0..64)
            .map(|i| {
                let mut user = format!("Question {i}:");
                for _ in 0..40 {
                    user.push(' ');
                    user.push_str(word(&mut rng));
                }
                user.push('?');
                vec![
                    ChatMessage {
                        role: "system".into(),
                        content: system.clone(),
                    },
                    ChatMessage {
                        role: "user".into(),
                        content: user,
                    },
                ]
            })
            .collect();
        let block_hasher = BlockHasher::new(&HashParams {
            model_id: "routing-sim".into(),
            weight_version: "1".into(),
            kv_dtype: "f32".into(),
            block_size: config.block_size,
            seed: [7; 32],
        });
        let hasher = PromptHasher::new(renderer.clone(), block_hasher);
        let first = hasher.chat(DECISION_TENANT, &messages[0])?;
        let engines = config.engines.clamp(1, MAX_ENGINES);
        let registry = Registry::new();
        for s in 0..engines {
            let Ok(e) = registry.add(
                &format!("engine-{s}"),
                &format!("http://127.0.0.1:{}", 9000 + s),
            ) else {
                break;
            };
            e.up.store(true, AtomicOrdering::SeqCst);
            e.inflight.store(s as u64, AtomicOrdering::Relaxed);
            e.set_report(Some(LoadReport {
                pending_prefill_tokens: 100 * s as u64,
                waiting_by_tenant: (0..12)
                    .map(|t| (format!("tenant-{t}"), 100 * s as u64 / 12))
                    .collect(),
                running: s as u32,
                max_seqs: 64,
                max_batched_tokens: 4096,
                available_blocks: 1000,
                free_blocks: 100,
                secs_per_token: 1.0 / config.prefill_tps,
                ..LoadReport::default()
            }));
        }
        {
            let mut index = registry.index.write().unwrap_or_else(|p| p.into_inner());
            for h in &first.hashes {
                index.insert(3 % engines, *h);
            }
            for slot in 0..engines {
                while index.len(slot) < blocks_per_engine {
                    index.insert(slot, BlockHash(rng.gen()));
                }
            }
        }
        let router = Router::new(RouterConfig {
            policy: Policy::Prefix,
            load_factor: config.load_factor,
            block_size: config.block_size,
            prior_secs_per_token: 1.0 / config.prefill_tps,
        });
        Ok(DecisionPath {
            system_tokens: renderer.encode(&system)?.len(),
            hasher,
            registry,
            router,
            messages,
        })
    }

    /// One decision, for the `i`-th user message: the prompt's tokens and the seconds spent
    /// hashing it.
    pub fn decide(&self, i: usize) -> Result<(usize, f64), PromptError> {
        let t0 = Instant::now();
        let ph = self
            .hasher
            .chat(DECISION_TENANT, &self.messages[i % self.messages.len()])?;
        let hashed = t0.elapsed().as_secs_f64();
        let req = RouteRequest::new(
            &ph.hashes,
            ph.prompt_tokens,
            DECISION_TENANT,
            &self.router.config(),
        );
        let (candidates, _) = self.registry.candidates(&req, 0, 0);
        std::hint::black_box(
            self.router
                .choose(ph.affinity, ph.prompt_tokens, 256, &candidates),
        );
        Ok((ph.prompt_tokens, hashed))
    }

    /// Forgets the system prompts' cached tokens and hashes: the next decision is cold.
    pub fn clear(&self) {
        self.hasher.clear();
    }
}

/// Times [`DecisionPath`] over `iterations` warm decisions and a twentieth as many cold ones.
pub fn time_decisions(
    renderer: Arc<PromptRenderer>,
    config: &SimConfig,
    system_tokens: usize,
    blocks_per_engine: usize,
    iterations: usize,
) -> Result<DecisionTiming, PromptError> {
    let path = DecisionPath::new(renderer, config, system_tokens, blocks_per_engine)?;
    // Warm up.
    for i in 0..16 {
        path.decide(i)?;
    }
    let mut warm = Vec::with_capacity(iterations);
    let mut hash_s = 0.0;
    let mut prompt_tokens = 0;
    for i in 0..iterations {
        let t0 = Instant::now();
        let (tokens, hashed) = path.decide(i)?;
        warm.push(t0.elapsed().as_secs_f64() * 1e6);
        hash_s += hashed;
        prompt_tokens = tokens;
    }
    let cold_iterations = (iterations / 20).max(10);
    let mut cold = Vec::with_capacity(cold_iterations);
    for i in 0..cold_iterations {
        path.clear();
        let t0 = Instant::now();
        path.decide(i)?;
        cold.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    let summarize = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (
            v.iter().sum::<f64>() / v.len().max(1) as f64,
            percentile(v, 0.99),
        )
    };
    let (warm_mean_us, warm_p99_us) = summarize(&mut warm);
    let (cold_mean_us, cold_p99_us) = summarize(&mut cold);
    Ok(DecisionTiming {
        prompt_tokens,
        system_tokens: path.system_tokens,
        engines: config.engines.clamp(1, MAX_ENGINES),
        index_blocks: blocks_per_engine,
        warm_iterations: iterations,
        warm_mean_us,
        warm_p99_us,
        warm_hash_mean_us: hash_s / iterations.max(1) as f64 * 1e6,
        cold_iterations,
        cold_mean_us,
        cold_p99_us,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(capacity_blocks: Option<usize>) -> SimConfig {
        SimConfig {
            engines: 4,
            tenants: 24,
            requests: 600,
            system_tokens: (64, 300),
            user_tokens: (10, 40),
            capacity_blocks,
            ..SimConfig::default()
        }
    }

    #[test]
    fn trace_is_deterministic_and_shaped() {
        let cfg = small(None);
        let a = Trace::generate(&cfg);
        let b = Trace::generate(&cfg);
        assert_eq!(a.len(), 600);
        assert_eq!(a.rate, b.rate);
        for (x, y) in a.requests.iter().zip(&b.requests) {
            assert_eq!((x.at, x.tenant, &x.hashes), (y.at, y.tenant, &y.hashes));
        }
        // Zipf: tenant 0 is the most popular.
        let mut count = vec![0; cfg.tenants];
        for r in &a.requests {
            count[r.tenant as usize] += 1;
        }
        assert_eq!(count.iter().max(), Some(&count[0]));
        // Same tenant, same leading hashes; other tenants (other scopes) share none.
        let t0: Vec<_> = a.requests.iter().filter(|r| r.tenant == 0).collect();
        let sys = a.tenants[0].system_tokens / 16;
        assert_eq!(t0[0].hashes[..sys], t0[1].hashes[..sys]);
        let other = a.requests.iter().find(|r| r.tenant != 0).unwrap();
        assert!(other.hashes.iter().all(|h| !t0[0].hashes.contains(h)));
    }

    #[test]
    fn index_stays_equal_to_the_caches() {
        // A tight cache, so eviction runs all the time.
        let cfg = small(Some(60));
        let trace = Trace::generate(&cfg);
        for p in SimPolicy::ALL {
            let r = run(&trace, p, true);
            assert_eq!(r.per_engine_requests.iter().sum::<u64>(), 600);
        }
    }

    #[test]
    fn oracle_bounds_every_policy_with_room_for_everything() {
        let trace = Trace::generate(&small(Some(1 << 20)));
        let results = run_all(&trace, &SimPolicy::ALL);
        let oracle = results.iter().find(|r| r.policy == "oracle").unwrap();
        // Unbounded cache and foresight: every request after a tenant's first hits its whole
        // system prompt, which is the most anyone can hit.
        assert!((oracle.hit_rate - trace.ideal_hit_rate()).abs() < 1e-12);
        for r in &results {
            assert!(r.hit_rate <= oracle.hit_rate + 1e-12, "{}", r.policy);
            assert!(r.vs_oracle.unwrap() <= 1.0 + 1e-12);
        }
    }

    #[test]
    fn a_host_tier_keeps_the_index_true_and_raises_every_policys_hit_rate() {
        let mut cfg = small(Some(60));
        let off = run_all(&Trace::generate(&cfg), &SimPolicy::ALL);
        cfg.host_blocks = 240;
        let trace = Trace::generate(&cfg);
        for p in SimPolicy::ALL {
            run(&trace, p, true);
        }
        let on = run_all(&trace, &SimPolicy::ALL);
        for (a, b) in off.iter().zip(&on) {
            assert_eq!(a.host_hit_rate, 0.0);
            assert!(b.host_hit_rate > 0.0, "{}", b.policy);
            assert!(
                b.hit_rate > a.hit_rate,
                "{}: {} -> {}",
                a.policy,
                a.hit_rate,
                b.hit_rate
            );
        }
    }

    #[test]
    fn a_closed_loop_sends_every_request_once_and_shared_compute_runs_slower() {
        let mut cfg = small(Some(1 << 20));
        cfg.clients = Some(4);
        let trace = Trace::generate(&cfg);
        let own = run(&trace, SimPolicy::Router(Policy::RoundRobin), true);
        assert_eq!(own.per_engine_requests.iter().sum::<u64>(), 600);
        // Four clients never have more than four requests anywhere: nothing queues behind a
        // busy engine for long, whatever the arrival times said.
        assert!(own.mean_queue_ms < own.mean_ttft_ms);
        // The same work on engines that share one compute unit takes longer: each request is
        // served at a fraction of the speed while others run.
        cfg.cores = Some(1);
        let shared = run(
            &Trace::generate(&cfg),
            SimPolicy::Router(Policy::RoundRobin),
            true,
        );
        assert_eq!(shared.per_engine_requests.iter().sum::<u64>(), 600);
        assert!(
            shared.requests_per_s < 0.7 * own.requests_per_s,
            "{} against {}",
            shared.requests_per_s,
            own.requests_per_s
        );
    }

    #[test]
    fn prefix_beats_the_load_only_policies_under_cache_pressure() {
        let trace = Trace::generate(&small(None));
        let results = run_all(&trace, &SimPolicy::ALL);
        let hit = |name: &str| results.iter().find(|r| r.policy == name).unwrap().hit_rate;
        assert!(hit("prefix") > hit("round_robin"));
        assert!(hit("prefix") > hit("least_loaded"));
    }
}
