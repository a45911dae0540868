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
//! each runs at units / busy of its speed (its steps are rescheduled whenever that changes), and
//! the router sees, as the gateway does from the engines' compute reports, every engine's
//! requests in flight as sharing the compute.
//!
//! Each engine runs a continuous batch as the engine's scheduler does: every step decodes a token
//! for each sequence past its prefill and, within the token budget (`max_batched_tokens`; at most
//! `decode_step_prefill_tokens` beside decodes), computes chunks of the prefills in progress and
//! then of new sequences, admitted while the batch has a seat (`max_seqs`) and the pool the
//! blocks of their prompt and answer, across tenants by fair queuing. A step takes the time that
//! `step_curve` (measured on a real engine) gives for its tokens, or a fixed time plus a time per
//! token, and the engine reports the fit of its steps' times ([`StepCost`]) as an engine does. The pool holds `capacity_blocks` blocks: those
//! sequences hold, and the full prompt blocks none holds, cached and evicted least recently used
//! at block granularity; a finished sequence releases its blocks tail first, so a prefix loses
//! its last blocks before its first ones (as the engine's block pool does). With `max_seqs` 1 an
//! engine serves one request at a time. A new sequence's blocks enter the index when the step
//! that computes them ends (those found cached are there already), evicted ones leave it: the
//! gateway's [`PrefixIndex`] gets the same inserts and removals (KV events, delivered at once).
//!
//! The router is the gateway's own: the simulator gives each engine's state as the gateway sees
//! it ([`EngineView`]: the engine's [`LoadReport`], built as the engine's worker builds it, fresh
//! at every decision; the requests in flight; the prompt tokens routed whose first token has not
//! come back) to the same [`candidates`] and [`Router::choose`] the gateway calls. When the
//! gateway would name a peer ([`peer_for`]: one holding more than the chosen engine, where
//! fetching that costs less than computing it, [`Candidate::fetch_pays`]; else one computing the
//! prompt for a request routed there that it expects to have computed it within the fetch's time
//! limit, from the due times the simulator records as the gateway does), the request waits for the peer to have computed the blocks asked for (a holder's
//! answer waits for the step that computes them), at most the fetch's time limit, then reaches
//! its engine after the transfer (`peer_load_secs_per_block` a block, and one block's more for
//! the ask); the blocks the peer still holds then are stored there, cached. Where the limit
//! runs out first, what the peer has computed by then comes, and the engine computes the rest.
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
use kvgate_gateway::routing::{
    engine_id, Candidate, Policy, Router, RouterConfig, MAX_PEER_FETCH_BLOCKS, PEER_MIN_GAIN_BLOCKS,
};
use kvgate_gateway::upstream::{candidates, peer_for, EngineView, Peer, Registry, RouteRequest};
use kvgate_protocol::prompt::{ChatMessage, PromptError, PromptRenderer};
use kvgate_protocol::{BlockHash, BlockHasher, HashParams, LoadReport, StepCost, Tier};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet, VecDeque};
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
    /// Fleet utilization the arrival rate aims at, counting every system prompt as cached and
    /// one request at a time at `prefill_tps` and `decode_tps` (neither the batch nor
    /// `step_curve`: with those, set `rate` or `clients`).
    pub utilization: f64,
    /// Requests per second; `None`: derived from `utilization`.
    pub rate: Option<f64>,
    /// Prefill throughput of one engine, tokens/s: a step's seconds per token are its inverse.
    pub prefill_tps: f64,
    /// Decode tokens/s of one sequence alone in its engine's batch: a step's fixed seconds are
    /// `1 / decode_tps` less one token's. With `max_seqs` 1 (a request at a time), the
    /// engine's whole decode throughput amortized per request.
    pub decode_tps: f64,
    /// Sequences in an engine's running batch at most (`scheduler.max_seqs`).
    pub max_seqs: usize,
    /// Tokens of one step at most (`scheduler.max_batched_tokens`).
    pub max_batched_tokens: usize,
    /// Prompt tokens of a step that also decodes at most (0: no such limit).
    pub decode_step_prefill_tokens: usize,
    /// Seconds to fetch one block from a peer engine.
    pub peer_load_secs_per_block: f64,
    /// A step's seconds at full speed by its tokens, as measured on an engine: points
    /// `(tokens, secs)` in increasing tokens, joined by straight lines and extended past the last
    /// with the last segment's slope (never below the quickest point). Fewer than two points:
    /// the line of `prefill_tps` and `decode_tps`.
    pub step_curve: Vec<(usize, f64)>,
    /// Seconds each request adds to the step that admits it, beside `step_curve`'s: what a
    /// request costs its engine's compute that a step's tokens do not say. On a machine whose
    /// engines share their CPUs with the gateway and the clients, their work per request.
    pub request_secs: f64,
    /// Seconds a step's token takes for each token of context it attends to beyond its own
    /// chunk, beside `step_curve`'s (measured on new prompts, whose attention is within their
    /// chunk): a prefill chunk's tokens over the prompt tokens already in the cache (found
    /// cached, or computed by earlier chunks), a decoding sequence's token over the tokens
    /// already in the cache (its prompt, and the answer before the token it feeds).
    pub context_secs: f64,
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
            max_seqs: 1,
            max_batched_tokens: 2048,
            decode_step_prefill_tokens: 256,
            peer_load_secs_per_block: kvgate_protocol::load::PRIOR_PEER_LOAD_SECS_PER_BLOCK,
            step_curve: Vec::new(),
            request_secs: 0.0,
            context_secs: 0.0,
            load_factor: routing.load_factor,
            host_blocks: 0,
            host_load_secs_per_block: kvgate_protocol::load::PRIOR_HOST_LOAD_SECS_PER_BLOCK,
            clients: None,
            cores: None,
        }
    }
}

impl SimConfig {
    /// Seconds of a step of `tokens` tokens at full speed: on `step_curve`, or a fixed time
    /// (`1 / decode_tps` less a token's) plus `1 / prefill_tps` a token.
    pub fn step_secs(&self, tokens: usize) -> f64 {
        let x = tokens as f64;
        let c = &self.step_curve;
        if c.len() < 2 {
            let per_token = 1.0 / self.prefill_tps;
            return (1.0 / self.decode_tps - per_token).max(0.0) + x * per_token;
        }
        let k = c.partition_point(|p| p.0 < tokens).clamp(1, c.len() - 1);
        let ((x0, y0), (x1, y1)) = (c[k - 1], c[k]);
        let slope = (y1 - y0) / (x1 as f64 - x0 as f64).max(1.0);
        // Never quicker than the quickest point (a falling last segment, extended).
        let floor = c.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
        (y0 + slope * (x - x0 as f64)).max(floor)
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
    /// [`Trace::try_generate`], for a configuration known to be good (panics otherwise).
    pub fn generate(config: &SimConfig) -> Trace {
        Trace::try_generate(config).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The seeded requests of `config`: an error where its pools cannot hold two of its longest
    /// requests (a fleet that could not serve them side by side).
    pub fn try_generate(config: &SimConfig) -> Result<Trace, String> {
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
        let max_blocks = requests
            .iter()
            .map(|r| (r.prompt_tokens + r.output_tokens).div_ceil(config.block_size) as usize)
            .max()
            .unwrap_or(0);
        if capacity_blocks < 2 * max_blocks {
            return Err(format!(
                "a pool of {capacity_blocks} blocks is under twice the longest request \
                 ({max_blocks} blocks): more requests, a higher utilization or --capacity-blocks"
            ));
        }
        Ok(Trace {
            config: config.clone(),
            capacity_blocks,
            rate,
            tenants,
            requests,
        })
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

/// What happens next: an engine's step ends (the second field is the engine's step count when
/// it was scheduled: a step rescheduled after a change of speed leaves its earlier event
/// stale), a request's prefix has come from a peer (engine, request, peer, and the most
/// leading blocks that came), or a request's wait for its peer has run out (the request).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Step(usize, u64),
    Fetched(usize, usize, usize, usize),
    FetchDue(usize),
}

/// A request whose engine has asked a peer for its prefix, waiting for the peer to have
/// computed the blocks asked for (as a holder's answer waits for the step that computes them).
#[derive(Debug, Clone, Copy)]
struct FetchWait {
    req: usize,
    slot: usize,
    peer: usize,
    /// Leading blocks of the prompt asked for.
    blocks: usize,
    /// Of those, the ones the engine holds itself.
    own: usize,
    /// When the engine stops waiting: its fetch's time limit after the ask.
    due: f64,
}

/// An engine's step in progress.
#[derive(Debug, Clone, Copy)]
struct Phase {
    /// Seconds of work left at full speed, as of `since`.
    left: f64,
    since: f64,
    generation: u64,
}

/// A sequence in an engine's running batch.
#[derive(Debug)]
struct Seq {
    req: usize,
    /// Prompt tokens in the KV cache: found cached, or computed.
    prefilled: usize,
    /// Prompt tokens the step in progress computes for it.
    chunk: usize,
    /// Tokens generated (the first by the step that ends its prefill).
    generated: u32,
    /// Blocks it holds outside the index: its prompt's last partial block and its answer's.
    private: usize,
}

#[derive(Debug)]
struct Engine {
    slot: usize,
    id: u64,
    /// Full prompt blocks no sequence holds: the prefix cache, evicted LRU.
    cache: Lru,
    /// Full prompt blocks sequences hold, each with how many hold it.
    held: HashMap<u128, u32>,
    /// Of those, the ones computed: found cached, or passed by a sequence's prefill. A block a
    /// sequence was admitted with while another still computes it is not, until that one has.
    computed: HashSet<u128>,
    /// Blocks sequences hold outside the index.
    private: usize,
    /// The host tier: the device pool's evictions, until evicted in turn.
    host: Lru,
    /// Requests waiting for a seat in the batch, in arrival order.
    waiting: VecDeque<usize>,
    /// Their prompt tokens not cached when they arrived, per tenant (what the engine reports).
    waiting_tokens: BTreeMap<u32, u64>,
    running: Vec<Seq>,
    /// The step in progress (`None`: idle).
    phase: Option<Phase>,
    /// Steps begun: the next one's generation.
    steps: u64,
    /// The step in progress: its tokens and when it began.
    step_tokens: usize,
    step_began: f64,
    /// The fit of its steps' times that it reports, as an engine's worker keeps it.
    cost: StepCost,
    /// Prompt tokens each tenant has had computed here (fair queuing across tenants).
    served: HashMap<u32, u64>,
    /// Blocks that routed, unfinished prefills will store (the oracle's foresight).
    pending: HashMap<u128, u32>,
    /// Requests routed here and not answered.
    inflight: u64,
    /// Prompt tokens routed here whose first token has not come back (the gateway's count).
    queued_prefill: u64,
    requests: u64,
    computed_tokens: u64,
    busy_s: f64,
}

impl Engine {
    /// Blocks free and holding nothing, of a pool of `capacity`.
    fn free(&self, capacity: usize) -> usize {
        capacity.saturating_sub(self.cache.len() + self.held.len() + self.private)
    }

    fn holds(&self, h: BlockHash) -> bool {
        self.cache.contains(h) || self.held.contains_key(&h.0)
    }

    /// Leading blocks of `hashes` in the device pool.
    fn device_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.holds(**h)).count()
    }

    /// Leading blocks of `hashes` it could send a peer: in the device pool or the host tier.
    fn fast_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.holds(**h) || self.host.contains(**h))
            .count()
    }

    /// Leading blocks of `hashes` it has computed, and could send a peer: cached, in the host
    /// tier, or held and computed. A block admitted but not yet computed is not there yet.
    fn computed_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| {
                self.cache.contains(**h) || self.host.contains(**h) || self.computed.contains(&h.0)
            })
            .count()
    }

    /// Makes one block free, evicting the least recently used cached block if none is (to the
    /// host tier when it has one; the index hears of it). False when every block is held.
    fn make_room(
        &mut self,
        capacity: usize,
        host_capacity: usize,
        index: &mut PrefixIndex,
    ) -> bool {
        if self.free(capacity) > 0 {
            return true;
        }
        let Some(old) = self.cache.evict_oldest() else {
            return false;
        };
        if host_capacity == 0 {
            index.remove(self.slot, BlockHash(old));
        } else {
            // Demoted, not lost; the host tier drops its own oldest to make room.
            if self.host.len() >= host_capacity {
                if let Some(gone) = self.host.evict_oldest() {
                    index.remove(self.slot, BlockHash(gone));
                }
            }
            self.host.touch(old);
            index.insert_at(self.slot, BlockHash(old), Tier::Host);
        }
        true
    }

    /// Makes `h` a block of the device pool that one more sequence holds: from the cache, from
    /// the host tier or newly computed (`make_room` has made a block free for the last two). A
    /// cached block is computed and indexed already; a new one enters the index once a step has
    /// computed it, as an engine's KV events report it (`plan` marks those it loads from the
    /// host tier). A host-tier copy past the prompt's cached run is not loaded but computed
    /// anew: it leaves the tier and the index.
    fn hold(&mut self, h: BlockHash, index: &mut PrefixIndex) {
        if let Some(n) = self.held.get_mut(&h.0) {
            *n += 1;
            return;
        }
        if self.cache.remove(h.0) {
            self.computed.insert(h.0);
        } else if self.host.remove(h.0) {
            index.remove(self.slot, h);
        }
        self.held.insert(h.0, 1);
    }
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
    /// Requests told to fetch their prefix from a peer, and the prompt tokens that came over.
    pub peer_fetches: u64,
    pub peer_tokens: u64,
    /// Of those fetches, the ones for fewer than `PEER_MIN_GAIN_BLOCKS` blocks (worth a
    /// transfer only where it takes less time than their prefill).
    pub peer_short_fetches: u64,
    /// Of those fetches, the ones from an engine still computing the prefix for a request
    /// routed there.
    pub peer_computing_fetches: u64,
    /// Of those fetches, the ones whose time limit ran out before the peer had computed all
    /// the blocks asked for (what it had came, the engine computed the rest).
    pub peer_fetch_timeouts: u64,
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
    sim.run();
    sim.result()
}

impl Simulation<'_> {
    /// Every request sent and answered.
    fn run(&mut self) {
        let trace = self.trace;
        loop {
            let arrival = match trace.config.clients {
                _ if self.next >= trace.requests.len() => None,
                Some(clients) => (self.outstanding < clients).then_some(self.now),
                None => Some(trace.requests[self.next].at),
            };
            let event_at = self.events.peek().map(|e| (e.0).0 .0);
            match (arrival, event_at) {
                (None, None) => break,
                (Some(a), Some(t)) if t <= a => self.next_event(),
                (None, Some(_)) => self.next_event(),
                (Some(_), _) => self.arrive(),
            }
        }
    }
}

/// The state of one policy's run: the engines, the index the router reads, the pending events
/// and the figures so far. One method per event: an arrival, a step ending, a prefix arriving
/// from a peer.
struct Simulation<'a> {
    trace: &'a Trace,
    policy: SimPolicy,
    verify: bool,
    router: Router,
    index: PrefixIndex,
    engines: Vec<Engine>,
    /// Tenants as the engines name them.
    tenant_names: Vec<String>,
    /// Per request: blocks found cached (device and host) when it was admitted.
    cached_blocks: Vec<usize>,
    /// Per request: of those, blocks loaded from the host tier.
    host_blocks: Vec<usize>,
    host_hit_tokens: u64,
    /// Per request: when it was admitted to its engine's batch.
    started: Vec<f64>,
    /// Per request: when it was sent (its arrival time, or when its client was free).
    sent: Vec<f64>,
    /// Per request: the prompt tokens its engine was routed for (the gateway's queued count).
    routed_tokens: Vec<u64>,
    /// Whether request `i`'s prompt counts as computing on its engine in the index until it ends
    /// (as the gateway counts it: every request not told to fetch).
    computing: Vec<bool>,
    /// Per request: its prompt tokens not cached when it joined its engine's queue.
    queued_tokens: Vec<u64>,
    /// Requests sent and not yet answered.
    outstanding: usize,
    /// Engines with a step in progress.
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
    peer_fetches: u64,
    peer_tokens: u64,
    peer_short_fetches: u64,
    peer_computing_fetches: u64,
    peer_fetch_timeouts: u64,
    /// Fetches waiting for their peer to compute the blocks asked for.
    fetch_waits: Vec<FetchWait>,
}

impl<'a> Simulation<'a> {
    fn new(trace: &'a Trace, policy: SimPolicy, verify: bool) -> Self {
        let cfg = &trace.config;
        let engines: Vec<Engine> = (0..cfg.engines)
            .map(|slot| Engine {
                slot,
                id: engine_id(&format!("engine-{slot}")),
                cache: Lru::default(),
                held: HashMap::new(),
                computed: HashSet::new(),
                private: 0,
                host: Lru::default(),
                waiting: VecDeque::new(),
                waiting_tokens: BTreeMap::new(),
                running: Vec::new(),
                phase: None,
                steps: 0,
                step_tokens: 0,
                step_began: 0.0,
                cost: StepCost::default(),
                served: HashMap::new(),
                pending: HashMap::new(),
                inflight: 0,
                queued_prefill: 0,
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
            engines,
            tenant_names: (0..trace.tenants.len())
                .map(|t| format!("tenant-{t}"))
                .collect(),
            cached_blocks: vec![0; n],
            host_blocks: vec![0; n],
            host_hit_tokens: 0,
            started: vec![0.0; n],
            sent: vec![0.0; n],
            routed_tokens: vec![0; n],
            computing: vec![false; n],
            queued_tokens: vec![0; n],
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
            peer_fetches: 0,
            peer_tokens: 0,
            peer_short_fetches: 0,
            peer_computing_fetches: 0,
            peer_fetch_timeouts: 0,
            fetch_waits: Vec::new(),
        }
    }

    fn block_size(&self) -> usize {
        self.trace.config.block_size as usize
    }

    /// The share of its full speed a busy engine runs at: 1, or with shared compute the units
    /// over the busy engines.
    fn speed(&self) -> f64 {
        match self.trace.config.cores {
            Some(units) if self.busy > units => units as f64 / self.busy as f64,
            _ => 1.0,
        }
    }

    /// Brings every busy engine's step up to now at the old speed, then, after the number of
    /// busy engines changed by `delta`, reschedules each step's end at the new speed.
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
                p.generation = e.steps;
                e.steps += 1;
                reschedule.push((e.slot, *p));
            }
        }
        for (slot, p) in reschedule {
            self.schedule(self.now + p.left / new, Event::Step(slot, p.generation));
        }
    }

    fn schedule(&mut self, at: f64, event: Event) {
        self.seq += 1;
        self.events
            .push(std::cmp::Reverse((Time(at), self.seq, event)));
    }

    /// What engine `slot` would report now ([`LoadReport`], as the engine's worker builds it):
    /// its queue, its batch, its pool, and the fit of the times its steps took.
    fn report(&self, e: &Engine) -> LoadReport {
        let cfg = &self.trace.config;
        let requests = &self.trace.requests;
        let (fixed, per_token) = e.cost.fit();
        let running_prefill: u64 = e
            .running
            .iter()
            .map(|s| (requests[s.req].prompt_tokens as usize - s.prefilled) as u64)
            .sum();
        let waiting_by_tenant: BTreeMap<String, u64> = e
            .waiting_tokens
            .iter()
            .map(|(&t, &n)| (self.tenant_names[t as usize].clone(), n))
            .collect();
        let next_end = e
            .running
            .iter()
            .map(|s| requests[s.req].output_tokens - s.generated)
            .min();
        let step = fixed + e.running.len() as f64 * per_token;
        let free = e.free(self.trace.capacity_blocks) as u64;
        LoadReport {
            pending_prefill_tokens: running_prefill + waiting_by_tenant.values().sum::<u64>(),
            running_prefill_tokens: running_prefill,
            waiting_by_tenant,
            running: e.running.len() as u32,
            max_seqs: cfg.max_seqs as u32,
            max_batched_tokens: cfg.max_batched_tokens as u32,
            decode_step_prefill_tokens: cfg.decode_step_prefill_tokens as u32,
            available_blocks: free + e.cache.len() as u64,
            free_blocks: free,
            secs_per_token: per_token,
            step_secs: fixed,
            next_finish_secs: next_end.map_or(0.0, |n| f64::from(n) * step),
            age_secs: 0.0,
            host_load_secs_per_block: cfg.host_load_secs_per_block,
            disk_load_secs_per_block: 0.0,
            peer_load_secs_per_block: cfg.peer_load_secs_per_block,
            compute: match cfg.cores {
                Some(_) => "shared".to_owned(),
                None => format!("engine-{}", e.slot),
            },
        }
    }

    /// Routes the next request and sends it to the chosen engine, by way of a peer's transfer
    /// when the gateway would tell it to fetch its prefix.
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
        let (slot, matched, chosen, candidates) = self.choose(r);
        let now_ms = self.now_ms();
        let t0 = Instant::now();
        // As the gateway does: the engine that holds the most of the prefix, when fetching the
        // rest from it costs the chosen one less than computing it; else one computing it for a
        // request routed there that will have it within the fetch's time limit.
        let block_size = trace.config.block_size;
        let all = self.engines.iter().fold(0u64, |m, e| m | (1 << e.slot));
        let peer = chosen.as_ref().and_then(|c| {
            peer_for(
                &self.index,
                &r.hashes,
                &candidates,
                c,
                (all, 0),
                block_size,
                now_ms,
            )
        });
        self.decision_ns += t0.elapsed().as_nanos();
        let routed = (r.prompt_tokens as usize).saturating_sub(matched * self.block_size()) as u64;
        self.routed_tokens[i] = routed;
        let oracle = self.policy == SimPolicy::Oracle;
        let e = &mut self.engines[slot];
        e.inflight += 1;
        e.requests += 1;
        e.queued_prefill += routed;
        if oracle {
            for h in &r.hashes {
                *e.pending.entry(h.0).or_default() += 1;
            }
        }
        if peer.is_none() && !oracle {
            // Expected to have computed its prompt when the gateway expects it.
            let ready_ms = chosen.map_or(u64::MAX, |c| c.ready_ms(routed, now_ms));
            self.index.route_ready(slot, &r.hashes, ready_ms);
            self.computing[i] = true;
        }
        match peer {
            Some(Peer {
                slot: from,
                blocks: n,
                computing,
            }) => {
                let blocks = n.saturating_sub(matched as u32).min(MAX_PEER_FETCH_BLOCKS);
                self.peer_fetches += 1;
                if blocks < PEER_MIN_GAIN_BLOCKS {
                    self.peer_short_fetches += 1;
                }
                if computing {
                    self.peer_computing_fetches += 1;
                }
                let due = self.now + kvgate_protocol::load::peer_fetch_limit_secs(blocks as usize);
                self.schedule(due, Event::FetchDue(i));
                self.fetch_waits.push(FetchWait {
                    req: i,
                    slot,
                    peer: from,
                    blocks: (matched + blocks as usize).min(r.hashes.len()),
                    own: matched,
                    due,
                });
                self.start_fetches(from);
            }
            None => self.enqueue(slot, i),
        }
    }

    /// The simulation's clock in milliseconds, as the gateway's due times are kept.
    fn now_ms(&self) -> u64 {
        (self.now * 1e3) as u64
    }

    /// Starts the transfers of the fetches waiting for engine `peer` that it has now computed
    /// all the blocks of. A transfer takes its blocks' time, and ends by the fetch's time limit
    /// at the latest (the holder sends blocks as they are computed, during the wait).
    fn start_fetches(&mut self, peer: usize) {
        let (trace, secs_per_block) = (self.trace, self.trace.config.peer_load_secs_per_block);
        let e = &self.engines[peer];
        let (ready, waiting): (Vec<FetchWait>, Vec<FetchWait>) =
            self.fetch_waits.iter().partition(|w| {
                w.peer == peer
                    && e.computed_prefix(&trace.requests[w.req].hashes[..w.blocks]) == w.blocks
            });
        self.fetch_waits = waiting;
        for w in ready {
            let at = self.now + (w.blocks - w.own + 1) as f64 * secs_per_block;
            let at = at.min(w.due).max(self.now);
            self.schedule(at, Event::Fetched(w.slot, w.req, w.peer, w.blocks));
        }
    }

    /// Request `i`'s wait for its peer has run out: the blocks the peer has computed come, and
    /// the engine computes the rest.
    fn fetch_due(&mut self, i: usize) {
        let Some(k) = self.fetch_waits.iter().position(|w| w.req == i) else {
            return;
        };
        let w = self.fetch_waits.swap_remove(k);
        let computed = self.engines[w.peer].computed_prefix(&self.trace.requests[i].hashes);
        self.peer_fetch_timeouts += 1;
        self.fetched(w.slot, i, w.peer, computed.min(w.blocks));
    }

    /// Request `i` joins engine `slot`'s queue.
    fn enqueue(&mut self, slot: usize, i: usize) {
        let r = &self.trace.requests[i];
        let b = self.block_size();
        let e = &mut self.engines[slot];
        let uncached = (r.prompt_tokens as usize).saturating_sub(e.device_prefix(&r.hashes) * b);
        self.queued_tokens[i] = uncached as u64;
        *e.waiting_tokens.entry(r.tenant).or_default() += uncached as u64;
        e.waiting.push_back(i);
        self.next_step(slot);
    }

    /// The engine for `r` and the prefix blocks it is believed to hold, by the policy, with its
    /// candidate and all the candidates (none for the oracle).
    fn choose(&mut self, r: &Request) -> (usize, usize, Option<Candidate>, Vec<Candidate>) {
        let (slot, matched, reason, chosen, candidates) = match self.policy {
            SimPolicy::Router(_) => {
                let reports: Vec<LoadReport> =
                    self.engines.iter().map(|e| self.report(e)).collect();
                let views: Vec<EngineView<'_>> = self
                    .engines
                    .iter()
                    .zip(&reports)
                    .map(|(e, report)| EngineView {
                        slot: e.slot,
                        id: e.id,
                        routable: true,
                        peer: true,
                        draining: false,
                        report,
                        age_secs: Some(0.0),
                        inflight: e.inflight,
                        queued_prefill: e.queued_prefill,
                    })
                    .collect();
                let req = RouteRequest {
                    hashes: &r.hashes,
                    prompt_tokens: r.prompt_tokens as usize,
                    tenant: &self.tenant_names[r.tenant as usize],
                    block_size: self.trace.config.block_size,
                    prior_secs_per_token: 1.0 / self.trace.config.prefill_tps,
                    prior_peer_secs_per_block: 0.0,
                };
                // The decision's time: from the engines' state as the gateway holds it (the
                // simulator's building of their reports is not counted).
                let t0 = Instant::now();
                let candidates = candidates(&views, &self.index, &req, 0);
                let affinity = self.trace.tenants[r.tenant as usize].affinity;
                let Some(choice) = self.router.choose(
                    affinity,
                    r.prompt_tokens as usize,
                    r.output_tokens,
                    &candidates,
                ) else {
                    unreachable!("engines are never empty")
                };
                self.decision_ns += t0.elapsed().as_nanos();
                let matched = choice.matched_blocks as usize;
                let chosen = candidates.iter().find(|c| c.slot == choice.slot).copied();
                (
                    choice.slot,
                    matched,
                    choice.reason.as_str(),
                    chosen,
                    candidates,
                )
            }
            SimPolicy::Oracle => {
                let t0 = Instant::now();
                let known = |e: &Engine| {
                    r.hashes
                        .iter()
                        .take_while(|h| {
                            e.holds(**h) || e.host.contains(**h) || e.pending.contains_key(&h.0)
                        })
                        .count()
                };
                let (slot, matched) = self
                    .engines
                    .iter()
                    .map(|e| (known(e), e))
                    .max_by(|(ma, a), (mb, b)| {
                        ma.cmp(mb)
                            .then(b.inflight.cmp(&a.inflight))
                            .then(b.slot.cmp(&a.slot))
                    })
                    .map(|(m, e)| (e.slot, m))
                    .unwrap_or((0, 0));
                self.decision_ns += t0.elapsed().as_nanos();
                let reason = if matched > 0 {
                    "prefix"
                } else {
                    "least_loaded"
                };
                (slot, matched, reason, None, Vec::new())
            }
        };
        *self.reasons.entry(reason.to_owned()).or_default() += 1;
        (slot, matched, chosen, candidates)
    }

    /// Request `i`'s prefix has come to engine `slot` from `peer`: of its first `blocks`, those
    /// the peer holds now beyond the engine's own are stored there (cached, as a transfer's
    /// are), and the request joins the engine's queue.
    fn fetched(&mut self, slot: usize, i: usize, peer: usize, blocks: usize) {
        let (capacity, host_capacity) = (self.trace.capacity_blocks, self.trace.config.host_blocks);
        let b = self.block_size();
        let r = &self.trace.requests[i];
        let sent = self.engines[peer].fast_prefix(&r.hashes).min(blocks);
        let e = &mut self.engines[slot];
        let own = e.device_prefix(&r.hashes);
        let sent = sent.min(own + MAX_PEER_FETCH_BLOCKS as usize);
        // The request's own cached blocks are made the newest, and at most as many blocks are
        // stored as the pool can take without evicting them: a transfer never pushes out the
        // head it continues.
        for h in r.hashes[..own].iter().rev() {
            if e.cache.contains(*h) {
                e.cache.touch(h.0);
            }
        }
        let own_cached = r.hashes[..own]
            .iter()
            .filter(|h| e.cache.contains(**h))
            .count();
        let mut room = e.free(capacity) + e.cache.len() - own_cached;
        let mut stored = 0;
        for &h in r.hashes.get(own..sent).unwrap_or(&[]) {
            if e.holds(h) {
                continue;
            }
            if room == 0 || !e.make_room(capacity, host_capacity, &mut self.index) {
                break;
            }
            room -= 1;
            // A block of its own host tier comes back from there, not from the peer.
            if !e.host.remove(h.0) {
                stored += 1;
            }
            e.cache.touch(h.0);
            self.index.insert(slot, h);
        }
        // Oldest first when evicted: the head of the prefix goes last.
        for h in r.hashes[..sent.max(own)].iter().rev() {
            if e.cache.contains(*h) {
                e.cache.touch(h.0);
            }
        }
        self.peer_tokens += (stored * b) as u64;
        self.check(slot);
        // What came is cached here: a fetch waiting for this engine may have it all now.
        if self.fetch_waits.iter().any(|w| w.peer == slot) {
            self.start_fetches(slot);
        }
        self.enqueue(slot, i);
    }

    /// If engine `slot` is idle, plans a step and starts it.
    fn next_step(&mut self, slot: usize) {
        if self.engines[slot].phase.is_some() {
            return;
        }
        let (tokens, work) = self.plan(slot);
        if tokens > 0 {
            self.set_busy(1);
            self.begin_step(slot, tokens, work);
        }
    }

    fn begin_step(&mut self, slot: usize, tokens: usize, work: f64) {
        let e = &mut self.engines[slot];
        e.step_tokens = tokens;
        e.step_began = self.now;
        let generation = e.steps;
        e.steps += 1;
        e.busy_s += work;
        e.phase = Some(Phase {
            left: work,
            since: self.now,
            generation,
        });
        let at = self.now + work / self.speed();
        self.schedule(at, Event::Step(slot, generation));
    }

    /// Plans engine `slot`'s next step as its scheduler does: a token for every sequence that
    /// decodes; then, within the token budget (in a step that decodes, at most
    /// `decode_step_prefill_tokens`), chunks of the prefills in progress, then new sequences
    /// admitted while the batch has a seat and the pool has their blocks (their prompt and
    /// their answer's; cached blocks are evicted least recently used first), chosen across
    /// tenants by fair queuing. Returns the step's tokens (0: nothing to do) and its seconds at
    /// full speed.
    fn plan(&mut self, slot: usize) -> (usize, f64) {
        let trace = self.trace;
        let cfg = &trace.config;
        let b = self.block_size();
        let (capacity, host_capacity) = (trace.capacity_blocks, cfg.host_blocks);
        let e = &mut self.engines[slot];
        let prompt = |s: &Seq| trace.requests[s.req].prompt_tokens as usize;
        let decodes = e
            .running
            .iter()
            .filter(|s| s.prefilled == prompt(s))
            .count();
        let mut budget = cfg.max_batched_tokens.saturating_sub(decodes);
        if decodes > 0 && cfg.decode_step_prefill_tokens > 0 {
            budget = budget.min(cfg.decode_step_prefill_tokens);
        }
        let mut prefill = 0;
        for s in e.running.iter_mut().filter(|s| s.prefilled < prompt(s)) {
            s.chunk = (prompt(s) - s.prefilled).min(budget);
            budget -= s.chunk;
            prefill += s.chunk;
        }
        let (mut host_loads, mut admitted) = (0, 0u32);
        while budget > 0 && e.running.len() < cfg.max_seqs && !e.waiting.is_empty() {
            // Fair queuing: the tenant served least so far, first come within a tenant.
            let Some(k) = (0..e.waiting.len()).min_by_key(|&k| {
                let t = trace.requests[e.waiting[k]].tenant;
                (e.served.get(&t).copied().unwrap_or(0), k)
            }) else {
                break;
            };
            let i = e.waiting[k];
            let r = &trace.requests[i];
            let device = e.device_prefix(&r.hashes);
            let host = r.hashes[device..]
                .iter()
                .take_while(|h| e.host.contains(**h))
                .count();
            let total = (r.prompt_tokens + r.output_tokens).div_ceil(b as u32) as usize;
            let pinned = r.hashes[..device]
                .iter()
                .filter(|h| e.cache.contains(**h))
                .count();
            if total - device > e.free(capacity) + e.cache.len() - pinned {
                break;
            }
            e.waiting.remove(k);
            if let Some(n) = e.waiting_tokens.get_mut(&r.tenant) {
                *n -= self.queued_tokens[i];
                if *n == 0 {
                    e.waiting_tokens.remove(&r.tenant);
                }
            }
            // The host tier's run leaves it first: the room made below for the new blocks
            // demotes cached ones there, and must not push out the blocks being loaded.
            for h in &r.hashes[device..device + host] {
                e.host.remove(h.0);
            }
            // The device prefix comes first and is held as it is; the rest take a block each.
            for h in &r.hashes {
                if !e.holds(*h) && !e.make_room(capacity, host_capacity, &mut self.index) {
                    unreachable!("admission counted the blocks");
                }
                e.hold(*h, &mut self.index);
            }
            // Blocks loaded from the host tier are back in the device pool with this step.
            for h in &r.hashes[device..device + host] {
                e.computed.insert(h.0);
                self.index.insert(slot, *h);
            }
            let private = total - r.hashes.len();
            for _ in 0..private {
                if !e.make_room(capacity, host_capacity, &mut self.index) {
                    unreachable!("admission counted the blocks");
                }
                e.private += 1;
            }
            let cached = device + host;
            // The last prompt token is always computed: it gives the first answer token.
            let prefilled = (cached * b).min(r.prompt_tokens as usize - 1);
            let chunk = (r.prompt_tokens as usize - prefilled).min(budget);
            budget -= chunk;
            prefill += chunk;
            host_loads += host;
            *e.served.entry(r.tenant).or_default() += (r.prompt_tokens as usize - prefilled) as u64;
            e.computed_tokens +=
                (r.prompt_tokens as usize - prefilled + r.output_tokens as usize) as u64;
            e.running.push(Seq {
                req: i,
                prefilled,
                chunk,
                generated: 0,
                private,
            });
            self.cached_blocks[i] = cached;
            self.host_blocks[i] = host;
            self.started[i] = self.now;
            admitted += 1;
        }
        self.check(slot);
        let tokens = decodes + prefill;
        if tokens == 0 {
            return (0, 0.0);
        }
        // Attention past each token's own chunk: over the cache's context.
        let context: usize = self.engines[slot]
            .running
            .iter()
            .map(|s| match prompt(s) {
                p if s.prefilled == p => p + s.generated as usize - 1,
                _ => s.chunk * s.prefilled,
            })
            .sum();
        let work = cfg.step_secs(tokens)
            + host_loads as f64 * cfg.host_load_secs_per_block
            + f64::from(admitted) * cfg.request_secs
            + context as f64 * cfg.context_secs;
        (tokens, work)
    }

    fn next_event(&mut self) {
        let Some(std::cmp::Reverse((Time(t), _, event))) = self.events.pop() else {
            return;
        };
        // A step rescheduled after a change of speed, or a fetch's time limit after its
        // transfer started, is nothing: the clock does not move for it (the run's length is
        // the clock's last time).
        let stale = match event {
            Event::Step(slot, g) => self.engines[slot].phase.is_none_or(|p| p.generation != g),
            Event::FetchDue(i) => !self.fetch_waits.iter().any(|w| w.req == i),
            Event::Fetched(..) => false,
        };
        if stale {
            return;
        }
        self.now = t;
        match event {
            Event::Step(slot, _) => self.step_done(slot),
            Event::Fetched(slot, i, peer, blocks) => self.fetched(slot, i, peer, blocks),
            Event::FetchDue(i) => self.fetch_due(i),
        }
    }

    /// Engine `slot`'s step has ended: chunks are computed, sequences whose prefill it ended
    /// have their first token, decoding ones their next, and finished ones release their
    /// blocks (the prompt's stay cached, tail first so that a prefix loses its last blocks
    /// before its first). Then the next step.
    fn step_done(&mut self, slot: usize) {
        let trace = self.trace;
        let b = self.block_size();
        let mut first = Vec::new();
        let mut finished = Vec::new();
        let e = &mut self.engines[slot];
        // What the engine measures: the step's time as it ran, slowed by shared compute.
        e.cost.observe(e.step_tokens, self.now - e.step_began);
        for s in &mut e.running {
            let r = &trace.requests[s.req];
            let prompt = r.prompt_tokens as usize;
            if s.chunk > 0 {
                s.prefilled += s.chunk;
                s.chunk = 0;
                // The full blocks its prefill has passed are computed (this step's, and those
                // it was admitted with from the host tier).
                for h in r.hashes.iter().take(s.prefilled / b) {
                    if e.computed.insert(h.0) {
                        self.index.insert(slot, *h);
                    }
                }
                if s.prefilled == prompt {
                    s.generated = 1;
                    first.push(s.req);
                }
            } else if s.prefilled == prompt {
                s.generated += 1;
            }
        }
        e.running.retain(|s| {
            let done = s.generated >= trace.requests[s.req].output_tokens;
            if done {
                finished.push((s.req, s.private));
            }
            !done
        });
        for &(i, private) in &finished {
            let r = &trace.requests[i];
            if std::mem::take(&mut self.computing[i]) {
                self.index.unroute(slot, &r.hashes);
            }
            e.private -= private;
            for h in r.hashes.iter().rev() {
                match e.held.get_mut(&h.0) {
                    Some(n) if *n > 1 => *n -= 1,
                    _ => {
                        e.held.remove(&h.0);
                        e.computed.remove(&h.0);
                        e.cache.touch(h.0);
                    }
                }
            }
            e.inflight -= 1;
        }
        for &i in &first {
            let r = &trace.requests[i];
            let e = &mut self.engines[slot];
            e.queued_prefill -= self.routed_tokens[i];
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
            self.ttft.push(self.now - self.sent[i]);
            self.queue_s += self.started[i] - self.sent[i];
            self.hit_tokens += (self.cached_blocks[i] * b) as u64;
            self.host_hit_tokens += (self.host_blocks[i] * b) as u64;
            self.prompt_tokens += u64::from(r.prompt_tokens);
        }
        self.outstanding -= finished.len();
        self.check(slot);
        if self.fetch_waits.iter().any(|w| w.peer == slot) {
            self.start_fetches(slot);
        }
        let (tokens, work) = self.plan(slot);
        if tokens > 0 {
            self.begin_step(slot, tokens, work);
        } else {
            self.engines[slot].phase = None;
            self.set_busy(-1);
        }
    }

    /// With `verify`: the index holds exactly engine `slot`'s blocks, and its pool its
    /// capacity at most.
    fn check(&self, slot: usize) {
        if !self.verify {
            return;
        }
        let e = &self.engines[slot];
        assert_eq!(
            self.index.len(slot),
            e.cache.len() + e.computed.len() + e.host.len(),
            "index size, engine {slot}"
        );
        assert!(
            e.cache.len() + e.held.len() + e.private <= self.trace.capacity_blocks,
            "engine {slot} holds more blocks than its pool"
        );
        assert!(
            e.computed.iter().all(|h| e.held.contains_key(h)),
            "engine {slot} counts a block computed that no sequence holds"
        );
        for h in e.cache.stamp.keys().chain(&e.computed) {
            assert_eq!(
                self.index.longest_matches(&[BlockHash(*h)], 1 << slot)[slot],
                1,
                "index lacks a block of engine {slot}"
            );
        }
    }

    fn result(mut self) -> PolicyResult {
        if self.verify {
            for e in &self.engines {
                assert!(
                    e.running.is_empty() && e.waiting.is_empty() && e.phase.is_none(),
                    "engine {} has work left",
                    e.slot
                );
                assert_eq!(
                    (e.held.len(), e.private, e.inflight, e.queued_prefill),
                    (0, 0, 0, 0),
                    "engine {} still holds blocks or counts requests",
                    e.slot
                );
            }
        }
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
            peer_fetches: self.peer_fetches,
            peer_tokens: self.peer_tokens,
            peer_short_fetches: self.peer_short_fetches,
            peer_computing_fetches: self.peer_computing_fetches,
            peer_fetch_timeouts: self.peer_fetch_timeouts,
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
/// (the system prompt on engine 3), its candidates, [`Router::choose`] with the `prefix`
/// policy, and what the gateway does next for the request: the peer to name (a holder, else an
/// engine computing the prefix) and the prompt's blocks counted as routed to the chosen engine
/// (and, when the request ends, no longer). [`time_decisions`] and the criterion bench
/// `decision` both measure it.
#[derive(Debug)]
pub struct DecisionPath {
    hasher: PromptHasher,
    registry: Arc<Registry>,
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
            registry: Arc::new(registry),
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
        if let Some(choice) = self
            .router
            .choose(ph.affinity, ph.prompt_tokens, 256, &candidates)
        {
            let block = self.router.config().block_size;
            let peer = (candidates.iter().find(|c| c.slot == choice.slot))
                .and_then(|c| (self.registry).peer_for(&ph.hashes, &candidates, c, 0, block, 0));
            std::hint::black_box(peer);
            drop(std::hint::black_box(self.registry.route(
                choice.slot,
                &ph.hashes,
                u64::MAX,
            )));
        }
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

    /// `a` is more than `k` times `b`.
    fn assert_above(a: f64, k: f64, b: f64) {
        assert!(a > k * b, "{a} is not above {k} x {b}");
    }

    fn small(capacity_blocks: Option<usize>) -> SimConfig {
        SimConfig {
            engines: 4,
            tenants: 24,
            requests: 600,
            system_tokens: (64, 300),
            user_tokens: (10, 40),
            output_tokens: (10, 60),
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
    fn a_host_tier_copy_past_the_cached_run_is_computed_anew() {
        let mut cfg = small(Some(1 << 20));
        cfg.host_blocks = 16;
        let trace = Trace::generate(&cfg);
        let i = (0..trace.len())
            .find(|&i| trace.requests[i].hashes.len() >= 4)
            .unwrap();
        let hashes = &trace.requests[i].hashes;
        let mut sim = Simulation::new(&trace, SimPolicy::Router(Policy::Prefix), true);
        // Engine 1's host tier has the prompt's second block, not its first.
        sim.engines[1].host.touch(hashes[1].0);
        sim.index.insert_at(1, hashes[1], Tier::Host);
        sim.engines[1].inflight += 1;
        sim.outstanding += 1;
        sim.engines[1].waiting.push_back(i);
        sim.next_step(1);
        // Nothing is cached in front of it: it is computed with the rest, and its host copy
        // leaves the tier (the index checked true at the admission and at the step's end).
        assert_eq!(sim.cached_blocks[i], 0);
        assert!(!sim.engines[1].host.contains(hashes[1]));
        sim.next_event();
        assert_eq!(sim.engines[1].computed_prefix(hashes), hashes.len());
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

    /// One client (a request at a time: the same steps whatever their length) on a roomy
    /// fleet, round robin: its configuration and policy.
    fn one_client() -> (SimConfig, SimPolicy) {
        let mut cfg = small(Some(1 << 20));
        cfg.clients = Some(1);
        (cfg, SimPolicy::Router(Policy::RoundRobin))
    }

    #[test]
    fn each_request_adds_its_own_time_to_the_step_that_admits_it() {
        let (mut cfg, policy) = one_client();
        let plain = run(&Trace::generate(&cfg), policy, true);
        cfg.request_secs = 0.025;
        let loaded = run(&Trace::generate(&cfg), policy, true);
        let added = loaded.work_ms_per_request - plain.work_ms_per_request;
        assert!((added - 25.0).abs() < 1e-6, "{added} ms a request");
        assert!(loaded.requests_per_s < plain.requests_per_s);
    }

    #[test]
    fn each_token_adds_the_time_of_the_context_it_attends_to() {
        // Prompts in chunks of at most 64 tokens (one client: nothing else in a step): each
        // chunk attends over the prompt tokens before it (cached, or earlier chunks'), then each
        // decode step's token over the prompt and the answer before it.
        let (mut cfg, policy) = one_client();
        cfg.max_batched_tokens = 64;
        let plain = run(&Trace::generate(&cfg), policy, true);
        cfg.context_secs = 1e-6;
        let trace = Trace::generate(&cfg);
        let mut sim = Simulation::new(&trace, policy, true);
        sim.run();
        let b = sim.block_size();
        let mut chunked = 0;
        let expected: usize = (trace.requests.iter().enumerate())
            .map(|(i, r)| {
                let (p, out) = (r.prompt_tokens as usize, r.output_tokens as usize);
                let mut before = (sim.cached_blocks[i] * b).min(p - 1);
                let mut pairs = 0;
                chunked += usize::from(p - before > 64);
                while before < p {
                    let chunk = (p - before).min(64);
                    pairs += chunk * before;
                    before += chunk;
                }
                pairs + (1..out).map(|g| p + g - 1).sum::<usize>()
            })
            .sum();
        assert!(chunked > 0, "some prompts in several chunks");
        assert!(
            sim.cached_blocks.iter().any(|&c| c > 0),
            "some prompts cached"
        );
        let loaded = sim.result();
        let added = loaded.work_ms_per_request - plain.work_ms_per_request;
        let want = expected as f64 * 1e-3 / trace.requests.len() as f64;
        assert!(
            (added - want).abs() < 1e-6,
            "{added} ms a request, {want} expected"
        );
        assert!(loaded.requests_per_s < plain.requests_per_s);
    }

    #[test]
    fn a_step_takes_the_time_its_curve_gives() {
        let mut cfg = SimConfig {
            prefill_tps: 1000.0,
            decode_tps: 50.0,
            ..SimConfig::default()
        };
        // The line: 19 ms fixed, 1 ms a token.
        assert!((cfg.step_secs(1) - 0.020).abs() < 1e-12);
        assert!((cfg.step_secs(101) - 0.120).abs() < 1e-12);
        // A measured curve, with a drop where the engine changes algorithm.
        cfg.step_curve = vec![(1, 0.03), (8, 0.1), (64, 0.8), (65, 0.5), (120, 0.8)];
        assert!((cfg.step_secs(1) - 0.03).abs() < 1e-12);
        assert!((cfg.step_secs(36) - 0.45).abs() < 1e-12);
        assert!((cfg.step_secs(65) - 0.5).abs() < 1e-12);
        // Past the last point, the last segment's slope.
        assert!((cfg.step_secs(175) - 1.1).abs() < 1e-12);
        // A falling last segment, extended, stops at the quickest point.
        cfg.step_curve = vec![(1, 0.03), (8, 0.02)];
        assert!((cfg.step_secs(100) - 0.02).abs() < 1e-12);
    }

    #[test]
    fn a_batch_serves_requests_side_by_side_and_releases_everything() {
        let mut cfg = small(Some(400));
        cfg.clients = Some(8);
        cfg.prefill_tps = 300.0;
        cfg.decode_tps = 25.0;
        let policy = SimPolicy::Router(Policy::RoundRobin);
        let one = run(&Trace::generate(&cfg), policy, true);
        cfg.max_seqs = 8;
        let batch = run(&Trace::generate(&cfg), policy, true);
        for r in [&one, &batch] {
            assert_eq!(r.per_engine_requests.iter().sum::<u64>(), 600);
        }
        // Two clients an engine: a step decodes both sequences for little more than one's time
        // (prefills, a token's time each, gain nothing).
        assert_above(batch.requests_per_s, 1.5, one.requests_per_s);
    }

    #[test]
    fn a_tight_pool_makes_requests_wait_for_blocks_and_keeps_the_index_true() {
        // Room for two of the longest requests: admissions wait for blocks, and cached prefixes
        // are evicted all the time.
        let mut cfg = small(Some(50));
        cfg.clients = Some(16);
        cfg.max_seqs = 8;
        let trace = Trace::generate(&cfg);
        for p in SimPolicy::ALL {
            let r = run(&trace, p, true);
            assert_eq!(
                r.per_engine_requests.iter().sum::<u64>(),
                600,
                "{}",
                r.policy
            );
        }
    }

    #[test]
    fn the_gateway_names_peers_and_their_prefixes_arrive_cached() {
        // Round robin sends every tenant everywhere: past a tenant's first requests, an engine
        // without its prefix is told where to fetch it, at a CPU's prefill rate (a block's
        // prefill, 8 ms, takes longer than its transfer).
        let mut cfg = small(Some(1 << 20));
        cfg.clients = Some(4);
        cfg.max_seqs = 8;
        cfg.prefill_tps = 2_000.0;
        let trace = Trace::generate(&cfg);
        let rr = run(&trace, SimPolicy::Router(Policy::RoundRobin), true);
        assert!(rr.peer_fetches > 50, "{}", rr.peer_fetches);
        assert!(rr.peer_tokens >= rr.peer_fetches * 16);
        // What came over is counted as cached: round robin hits nearly what the oracle does.
        let oracle = run(&trace, SimPolicy::Oracle, true);
        assert_above(rr.hit_rate, 0.9, oracle.hit_rate);
        // Where a block's prefill (0.06 ms at 256,000 tokens/s) is far cheaper than its
        // transfer, only gains of PEER_MIN_GAIN_BLOCKS or more are fetched (they spare the
        // engine's compute), and they still bring the prefixes.
        cfg.prefill_tps = 256_000.0;
        let trace = Trace::generate(&cfg);
        let fast = run(&trace, SimPolicy::Router(Policy::RoundRobin), true);
        assert!(fast.peer_fetches > 50, "{}", fast.peer_fetches);
        let oracle = run(&trace, SimPolicy::Oracle, true);
        assert_above(fast.hit_rate, 0.9, oracle.hit_rate);
        // Pools of 60 blocks lose prefixes' tails, so an engine often lacks only a few blocks
        // that another holds: a CPU fetches some of those short runs, the fast fleet none.
        cfg.capacity_blocks = Some(60);
        let short = |tps: f64| {
            let mut cfg = cfg.clone();
            cfg.prefill_tps = tps;
            let r = run(
                &Trace::generate(&cfg),
                SimPolicy::Router(Policy::RoundRobin),
                true,
            );
            (r.peer_fetches, r.peer_short_fetches)
        };
        let (fetches, cpu) = short(2_000.0);
        assert!(cpu > 0 && cpu < fetches, "{cpu} of {fetches}");
        let (fetches, fast) = short(256_000.0);
        assert!(fetches > 50 && fast == 0, "{fast} of {fetches}");
    }

    /// A trace of `small` with `config`'s changes, two of its requests whose prompts share at
    /// least 4 leading blocks, and how many they share.
    fn sharing(config: impl FnOnce(&mut SimConfig)) -> (Trace, usize, usize, usize) {
        let mut cfg = small(Some(1 << 20));
        config(&mut cfg);
        let trace = Trace::generate(&cfg);
        let (i, j, n) = sharing_in(&trace, 4);
        (trace, i, j, n)
    }

    /// Two requests of `trace` whose prompts share at least `blocks` leading blocks, and how
    /// many they share.
    fn sharing_in(trace: &Trace, blocks: usize) -> (usize, usize, usize) {
        let reqs = &trace.requests;
        let shared = |a: usize, b: usize| {
            (reqs[a].hashes.iter())
                .zip(&reqs[b].hashes)
                .take_while(|(x, y)| x == y)
                .count()
        };
        (0..reqs.len())
            .flat_map(|i| (i + 1..reqs.len()).map(move |j| (i, j)))
            .find(|&(i, j)| shared(i, j) >= blocks)
            .map(|(i, j)| (i, j, shared(i, j)))
            .unwrap()
    }

    /// A simulation of `trace` under `prefix` where requests `reqs` have arrived at engine 1 (as
    /// an arrival counts them) and the engine has planned its first step.
    fn started_on_engine_1<'a>(trace: &'a Trace, reqs: &[usize]) -> Simulation<'a> {
        let mut sim = Simulation::new(trace, SimPolicy::Router(Policy::Prefix), true);
        sim.engines[1].inflight += reqs.len() as u64;
        sim.outstanding += reqs.len();
        sim.engines[1].waiting.extend(reqs);
        sim.next_step(1);
        sim
    }

    #[test]
    fn a_fetch_waits_for_the_step_that_computes_its_blocks() {
        // Prefills of two blocks a step: a prompt is computed over several steps.
        let (trace, i, j, n) = sharing(|cfg| cfg.max_batched_tokens = 32);
        // Engine 1 admits request j, whose prompt starts as i's does, and starts its prefill;
        // engine 0 asks it for i's first n blocks.
        let asked = || {
            let mut sim = started_on_engine_1(&trace, &[j]);
            sim.fetch_waits.push(FetchWait {
                req: i,
                slot: 0,
                peer: 1,
                blocks: n,
                own: 0,
                due: 10.0,
            });
            sim.start_fetches(1);
            sim
        };
        let transfers = |sim: &Simulation| {
            (sim.events.iter())
                .filter(|e| matches!((e.0).2, Event::Fetched(0, r, 1, b) if r == i && b == n))
                .count()
        };
        let mut sim = asked();
        // It holds the blocks and has computed none: no transfer yet, and nothing in the index
        // (no KV event has said so).
        let indexed = |sim: &Simulation| {
            sim.index
                .longest_matches(&trace.requests[i].hashes[..n], 1 << 1)[1] as usize
        };
        assert_eq!(sim.engines[1].device_prefix(&trace.requests[i].hashes), n);
        assert_eq!(
            (indexed(&sim), transfers(&sim), sim.fetch_waits.len()),
            (0, 0, 1)
        );
        // The transfer starts with the step that computes the n-th block.
        for _ in 1..n.div_ceil(2) {
            sim.next_event();
            assert_eq!(transfers(&sim), 0);
        }
        sim.next_event();
        assert_eq!(
            (indexed(&sim), transfers(&sim), sim.fetch_waits.len()),
            (n, 1, 0)
        );
        while transfers(&sim) > 0 {
            sim.next_event();
        }
        // The n blocks came, and engine 0, idle, admitted the request at once with them.
        assert_eq!(
            (sim.peer_tokens, sim.cached_blocks[i]),
            ((n * 16) as u64, n)
        );
        assert_eq!(sim.peer_fetch_timeouts, 0);
        // Where the wait runs out after the first step, the two blocks computed come and engine
        // 0 computes the rest.
        let mut sim = asked();
        sim.next_event();
        sim.fetch_due(i);
        assert_eq!((sim.peer_tokens, sim.cached_blocks[i]), (32, 2));
        assert_eq!(sim.peer_fetch_timeouts, 1);
        // A wait already over is left alone when its time comes.
        sim.fetch_due(i);
        assert_eq!((sim.peer_tokens, sim.peer_fetch_timeouts), (32, 1));
    }

    #[test]
    fn a_block_admitted_beside_the_request_computing_it_is_not_sent_before_it_is_computed() {
        let (trace, i, j, n) = sharing(|cfg| cfg.max_seqs = 2);
        // Engine 1 admits requests i and j in one step: j's first n blocks are i's, held by both
        // and computed by neither yet.
        let mut sim = started_on_engine_1(&trace, &[i, j]);
        assert_eq!(sim.engines[1].running.len(), 2);
        let hashes = &trace.requests[j].hashes;
        assert_eq!(sim.engines[1].computed_prefix(hashes), 0);
        // Once the step ends they are.
        sim.next_event();
        assert!(sim.engines[1].computed_prefix(hashes) >= n);
    }

    #[test]
    fn a_request_sent_elsewhere_while_its_prefix_is_computed_fetches_it_when_computed() {
        // One tenant's first two requests at once, on two engines of a slow CPU (a step of 157
        // tokens takes 0.54 s): round robin sends the second to the other engine while the first
        // computes the system prompt, within the fetch's 1.3 s limit.
        let cfg = SimConfig {
            engines: 2,
            tenants: 1,
            requests: 2,
            system_tokens: (176, 190),
            user_tokens: (8, 16),
            output_tokens: (4, 4),
            capacity_blocks: Some(160),
            clients: Some(2),
            max_seqs: 8,
            step_curve: vec![
                (1, 0.033),
                (16, 0.072),
                (64, 0.206),
                (157, 0.539),
                (468, 1.532),
            ],
            ..SimConfig::default()
        };
        let trace = Trace::generate(&cfg);
        // The two share a system prompt of ten blocks or more.
        let (_, _, system_blocks) = sharing_in(&trace, 10);
        let rr = run(&trace, SimPolicy::Router(Policy::RoundRobin), true);
        // It waits for the first engine to have computed the prompt and fetches it, rather than
        // compute it a second time: as cached as where both go to one engine.
        assert_eq!(
            (rr.peer_computing_fetches, rr.peer_fetch_timeouts),
            (1, 0),
            "{rr:?}"
        );
        assert_eq!(rr.peer_tokens, (system_blocks * 16) as u64);
        let one = run(&trace, SimPolicy::Router(Policy::ConsistentHash), true);
        assert_eq!(one.per_engine_requests.iter().max(), Some(&2));
        assert_eq!(rr.hit_rate, one.hit_rate);
        assert!(rr.hit_rate > 0.4, "{rr:?}");
    }

    #[test]
    fn a_transfer_never_evicts_the_prefix_it_continues() {
        let trace = Trace::generate(&small(Some(60)));
        let i = (0..trace.len())
            .find(|&i| trace.requests[i].hashes.len() >= 8)
            .unwrap();
        let r = &trace.requests[i];
        let mut sim = Simulation::new(&trace, SimPolicy::Router(Policy::RoundRobin), true);
        // Engine 1 caches the whole prefix; engine 0 its first two blocks, the oldest of a full
        // pool of other tenants' blocks.
        for h in &r.hashes {
            sim.engines[1].cache.touch(h.0);
            sim.index.insert(1, *h);
        }
        for h in &r.hashes[..2] {
            sim.engines[0].cache.touch(h.0);
            sim.index.insert(0, *h);
        }
        for k in 0..58u128 {
            sim.engines[0].cache.touch(u128::MAX - k);
            sim.index.insert(0, BlockHash(u128::MAX - k));
        }
        sim.fetched(0, i, 1, usize::MAX);
        // The transfer evicted others' blocks, not the head it continues: the request, admitted
        // at once, found its whole prefix cached.
        assert_eq!(sim.cached_blocks[i], r.hashes.len());
        assert_eq!(sim.peer_tokens, ((r.hashes.len() - 2) * 16) as u64);
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
