//! Routing policy: given the engines that may take a request (healthy, not draining), how much of
//! the request's prefix each already caches, each one's expected wait and its measured prefill
//! speed, pick one and say why. Pure: no IO, no clock; the same inputs give the same choice, so
//! the routing simulator (`kvgate bench --routing-sim`) runs exactly the code the gateway runs.
//!
//! `prefix` (the default) scores in time, at each engine's measured seconds per token. An
//! engine's cost for the request is its wait (the prefill queued ahead, a full batch or cache;
//! [`LoadReport::wait_secs`]), plus the prefill of the prompt tokens it does not cache, counted
//! once for every request that pays for it: the request itself; the cache its new blocks take
//! where they evict (other prefixes lose it and are computed again; blocks that fit in free
//! space cost nothing); each request in flight on that engine, whose steps the prefill
//! lengthens; and each one on every engine that shares its compute (engines on one machine's
//! cores: moving work between them gains no capacity). Plus the answer's decode steps beside the
//! requests in flight there, which lengthen its steps as it lengthens theirs (its `max_tokens`
//! x the requests in flight x the seconds per token, twice). The cheapest engine wins. So a cached prefix keeps its tenant on its engine until that engine's
//! queue costs more than recomputing the prefix elsewhere, everyone's share of the recompute
//! included: a busy fleet gains little from a second copy of a prefix, and an idle engine takes
//! a tenant over only when the wait it saves is worth the prefill. The engine admits waiting
//! requests by fair queuing across tenants, so a tenant that floods an engine lengthens its own
//! wait there, not the others': it is the one that spills. Over that, two bounded-load
//! guarantees. On the recent requests (the last [`TRAFFIC_WINDOW`] or so, each weighed down by
//! every later one): an engine that was given `load_factor` x its share of them
//! ([`TRAFFIC_SLACK`] more while few were routed) is passed over for now for an engine that
//! serves as much of the prompt from its cache or a peer's copy, so that the engine holding a
//! hot tenant's prefix does not take most of the requests once a second one can serve them. The
//! bound moves requests, not prefixes: where no other engine serves as much, or for a prompt
//! cached nowhere (its tenant's home), it does not apply (a first version, which made a second
//! engine compute the prefix, cost more cache and throughput than it evened out). On the
//! requests in flight, for requests that would start cold (no cached prefix there): an engine
//! whose running batch is full takes none while it has `load_factor` x its share of them
//! (rounded up, plus [`INFLIGHT_SLACK`]).
//!
//! With no match anywhere the request goes to the tenant's home engine: the first engine in
//! rendezvous order (of the tenant's system-prompt hash) that has had no more than its share of
//! the recent requests (and is home to at most twice its share of tenants), so that a tenant
//! that sends a third of the traffic is not given other tenants' homes beside it. While the
//! tenant's earlier requests are computing its prefix there (queued or in prefill; the gateway
//! counts a request's prompt as computing on its engine until the request ends), the home is
//! priced as a cached prefix is, by its wait, and kept while that wait costs no more than
//! computing the prompt on the cheapest engine; with none there, it is priced as any engine is,
//! and kept on a tie. Otherwise the tenant moves to where the request goes.
//!
//! `round_robin`, `least_loaded` (the shortest wait) and `consistent_hash` (plain rendezvous, no
//! load bound) are there for comparison.
//!
//! [`LoadReport::wait_secs`]: kvgate_protocol::LoadReport::wait_secs

pub mod index;
pub mod prefix;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Which policy routes (`routing.policy` in `gateway.toml`, by [`Policy::name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    Prefix,
    RoundRobin,
    LeastLoaded,
    ConsistentHash,
}

impl Policy {
    pub const ALL: [Policy; 4] = [
        Policy::Prefix,
        Policy::RoundRobin,
        Policy::LeastLoaded,
        Policy::ConsistentHash,
    ];

    pub fn parse(name: &str) -> Option<Policy> {
        Policy::ALL.into_iter().find(|p| p.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::Prefix => "prefix",
            Policy::RoundRobin => "round_robin",
            Policy::LeastLoaded => "least_loaded",
            Policy::ConsistentHash => "consistent_hash",
        }
    }
}

/// Why an engine was chosen (the `reason` label of `kvgate_gateway_route_decisions_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The cheapest engine, and it caches part of the prompt.
    Prefix,
    /// No engine caches the prefix: the tenant's home engine.
    Affinity,
    /// Waiting for a cached prefix costs more than computing it (or its engines were given
    /// their most of the recent requests), or waiting at the home engine costs more than
    /// computing the prompt elsewhere: the cheapest engine.
    LeastLoaded,
    RoundRobin,
    ConsistentHash,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Prefix => "prefix",
            Reason::Affinity => "affinity",
            Reason::LeastLoaded => "least_loaded",
            Reason::RoundRobin => "round_robin",
            Reason::ConsistentHash => "consistent_hash",
        }
    }
}

/// One engine that may take the request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// The engine's slot (its bit in the prefix index).
    pub slot: usize,
    /// A stable id for rendezvous hashing (a hash of the engine's name).
    pub id: u64,
    /// Leading blocks of the request this engine caches.
    pub matched_blocks: u32,
    /// Leading blocks another engine holds in its device pool or host tier, when the blocks
    /// beyond `matched_blocks` are worth fetching from it rather than computing them here
    /// ([`Candidate::fetch_pays`]; else 0): the gateway then tells this engine to fetch the
    /// difference from that peer instead of computing it.
    pub peer_blocks: u32,
    /// Requests in flight on it.
    pub inflight: u64,
    /// Requests in flight on every engine that shares its compute (one machine's cores, one
    /// device), itself included: at least `inflight`.
    pub compute_inflight: u64,
    /// Expected seconds before the request's own prefill starts there.
    pub wait_secs: f64,
    /// Of those, the time to load its matched blocks from the host tier or the disk: after its
    /// admission, so after any fetch from a peer.
    pub load_secs: f64,
    /// Its measured seconds per prefill token (engines that share compute: the median of theirs).
    pub secs_per_token: f64,
    /// Its measured seconds per block of a fetch from a peer
    /// ([`kvgate_protocol::LoadReport::peer_load_secs_per_block`]; one that has not fetched yet:
    /// the median of those that have; 0: none has, the prior).
    pub peer_secs_per_block: f64,
    /// Its running batch's limit (0: unknown).
    pub max_seqs: u32,
    /// KV blocks free and holding nothing (0 when unknown, and for engines that share their
    /// compute): a request's new blocks beyond these evict cached prefixes.
    pub free_blocks: u64,
    /// Where no candidate caches any of the prompt: the run of its leading blocks that requests
    /// routed here and not ended are computing (from the first block; blocks it holds count
    /// after that), else 0.
    pub computing_blocks: u32,
}

impl Candidate {
    /// Blocks it would fetch from a peer rather than compute: the peer's lead over its own
    /// match, at most [`MAX_PEER_FETCH_BLOCKS`].
    pub fn fetched_blocks(&self) -> u32 {
        self.peer_blocks
            .saturating_sub(self.matched_blocks)
            .min(MAX_PEER_FETCH_BLOCKS)
    }

    /// Requests whose steps a prefill here lengthens: those in flight on it, or on every
    /// engine that shares its compute.
    pub fn beside(&self) -> f64 {
        self.inflight.max(self.compute_inflight) as f64
    }

    /// Whether this engine should fetch `gain` more leading blocks of a prompt from a peer that
    /// holds them rather than compute them: always for [`PEER_MIN_GAIN_BLOCKS`] or more (the
    /// transfer spares its compute); a shorter gain where the transfer
    /// ([`Candidate::fetch_secs`]) takes less time than their prefill here, counted for the
    /// request and for every request whose steps it lengthens (as [`Router`]'s cost counts a
    /// prefill). On a CPU one block's prefill takes longer than a transfer of several, so a gain
    /// of one block is fetched; on a fast device it is computed.
    pub fn fetch_pays(&self, gain: u32, block_size: u32) -> bool {
        if gain >= PEER_MIN_GAIN_BLOCKS {
            return true;
        }
        let compute =
            f64::from(gain) * f64::from(block_size) * self.secs_per_token * (1.0 + self.beside());
        gain > 0 && self.fetch_secs(gain) < compute
    }

    /// Seconds a fetch of `blocks` blocks from a peer takes here, at its measured rate, at most
    /// the fetch's time limit (past it the engine computes what has not come).
    pub fn fetch_secs(&self, blocks: u32) -> f64 {
        let blocks = blocks as usize;
        let secs = kvgate_protocol::load::peer_fetch_secs(blocks, self.peer_secs_per_block);
        secs.min(kvgate_protocol::load::peer_fetch_limit_secs(blocks))
    }

    /// When a request routed here now (`now_ms`) is expected to have computed its prompt: once
    /// its wait here and the prefill of its `prefill` uncached tokens are over (`u64::MAX`:
    /// not known). What [`crate::routing::index::PrefixIndex::route_ready`] records.
    pub fn ready_ms(&self, prefill: u64, now_ms: u64) -> u64 {
        let secs = self.wait_secs + prefill as f64 * self.secs_per_token;
        if !secs.is_finite() {
            return u64::MAX;
        }
        now_ms.saturating_add((secs.clamp(0.0, 86_400.0) * 1e3) as u64)
    }

    /// The share of the new blocks that `tokens` computed here take (blocks of `block` tokens)
    /// that evicts cached prefixes: those its free blocks do not hold.
    pub fn evicting_share(&self, tokens: usize, block: usize) -> f64 {
        let new_blocks = tokens.div_ceil(block.max(1)) as u64;
        if new_blocks == 0 {
            return 0.0;
        }
        new_blocks.saturating_sub(self.free_blocks) as f64 / new_blocks as f64
    }
}

/// The choice and its reason.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    pub slot: usize,
    pub reason: Reason,
    pub matched_blocks: u32,
}

/// Policy parameters.
#[derive(Debug, Clone, Copy)]
pub struct RouterConfig {
    pub policy: Policy,
    /// Bounded load factor (>= 1), on the recent requests and on those in flight.
    pub load_factor: f64,
    /// Tokens per block.
    pub block_size: u32,
    /// Seconds per prefill token of an engine that has not reported its own.
    pub prior_secs_per_token: f64,
}

/// Most answer tokens the cost counts (a request without `max_tokens` may write to the end of
/// the context; answers mostly end long before).
const MAX_ANSWER_TOKENS: u32 = 256;

/// The recent requests the homes' balance looks at: each decision weighs the past ones by
/// `1 - 1 / TRAFFIC_WINDOW`.
pub const TRAFFIC_WINDOW: f64 = 64.0;

/// A gain of this many blocks over what the chosen engine holds is always fetched from a peer
/// that holds them: the transfer spares the chosen engine's compute, which every later request
/// there needs, even where computing them would end sooner ([`Candidate::fetch_pays`]). It is
/// also the least an engine still computing the prefix must be ahead for the gateway to name
/// it: the request may wait up to the fetch limit for it, which a block or two's prefill is
/// not worth.
pub const PEER_MIN_GAIN_BLOCKS: u32 = 4;

/// Most blocks a peer fetch is counted for (an engine with the staging host tier fetches at
/// most half of its 256 blocks; the rest it computes).
pub const MAX_PEER_FETCH_BLOCKS: u32 = 128;

/// Requests an engine may have in flight beyond `load_factor` x the mean: with a handful in
/// flight, a share of the mean alone is too small a number to bound anything but cache reuse.
pub const INFLIGHT_SLACK: u64 = 2;

/// Recent requests an engine may be given beyond its share (the mean over the engines) where
/// `load_factor` x the share is less: with a handful of requests routed so far, a tenant's
/// first few go to the engine that holds its prefix.
pub const TRAFFIC_SLACK: f64 = 2.0;

/// Most tenant homes remembered; past it the table starts over (homes are re-derived the same
/// way, so forgetting only loses balance history).
const MAX_HOMES: usize = 1 << 16;

/// Most tenants an engine is home to, as a multiple of its share: the backstop behind balancing
/// homes by traffic.
const HOME_SPREAD: f64 = 2.0;

/// The policy and the little state it keeps: the round-robin cursor, tenants' home engines
/// and the recent requests each engine was given.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    next: AtomicUsize,
    homes: Mutex<HashMap<u128, u64>>,
    /// Engine id -> requests routed to it, each weighed down by every later decision (see
    /// [`TRAFFIC_WINDOW`]): the engines that were candidates in the last decision.
    traffic: Mutex<HashMap<u64, f64>>,
}

impl Router {
    pub fn new(config: RouterConfig) -> Self {
        Router {
            config,
            next: AtomicUsize::new(0),
            homes: Mutex::new(HashMap::new()),
            traffic: Mutex::new(HashMap::new()),
        }
    }

    pub fn config(&self) -> RouterConfig {
        self.config
    }

    /// Picks an engine among `candidates` (non-empty, or `None`) for a request of
    /// `prompt_tokens` tokens whose answer may take `answer_tokens` (its `max_tokens`).
    /// `affinity` identifies the tenant's shared prefix (its scope and system prompt).
    pub fn choose(
        &self,
        affinity: u128,
        prompt_tokens: usize,
        answer_tokens: u32,
        candidates: &[Candidate],
    ) -> Option<Choice> {
        if candidates.is_empty() {
            return None;
        }
        let pick = |c: &Candidate, reason| Choice {
            slot: c.slot,
            reason,
            matched_blocks: c.matched_blocks,
        };
        Some(match self.config.policy {
            Policy::RoundRobin => {
                let i = self.next.fetch_add(1, Ordering::Relaxed) % candidates.len();
                pick(&candidates[i], Reason::RoundRobin)
            }
            Policy::LeastLoaded => pick(least_loaded(candidates), Reason::LeastLoaded),
            Policy::ConsistentHash => {
                let best = candidates
                    .iter()
                    .max_by_key(|c| rendezvous(affinity, c.id))
                    .unwrap_or(&candidates[0]);
                pick(best, Reason::ConsistentHash)
            }
            Policy::Prefix => {
                let choice = self.prefix(affinity, prompt_tokens, answer_tokens, candidates);
                if let Some(c) = candidates.iter().find(|c| c.slot == choice.slot) {
                    self.record(c.id, candidates);
                }
                return Some(choice);
            }
        })
    }

    /// What sending a request of `prompt_tokens` tokens to `c` costs, in seconds: its wait, and
    /// the prefill of the tokens it does not cache, counted once for each request that pays for
    /// it: the request itself waits for it, and every request in flight on `c`, or on an engine
    /// that shares its compute, has its steps lengthened by it (a continuous batch computes the
    /// prefill in the same steps as their decodes). The new blocks those tokens take count once
    /// more where they evict, for the share of them the engine's free blocks do not hold: that
    /// cache is other prefixes', to be computed again. New blocks in free space cost nothing.
    ///
    /// Blocks a peer can send ([`Candidate::peer_blocks`]) are not computed: they cost their
    /// transfer at the engine's measured rate, and the cache they take where they evict. The
    /// engine queues the request when its fetch has ended, and the queue ahead of it drains
    /// meanwhile: its prefill starts after the longer of the two, not after both (then its
    /// matched blocks in a slower tier are loaded).
    ///
    /// Then the answer: each of its decode steps runs beside the requests in flight there (or
    /// on the engines sharing its compute), each of which lengthens it by a token's time, and it
    /// lengthens each of theirs as much. Against an idle engine, that is twice the answer's
    /// tokens (at most [`MAX_ANSWER_TOKENS`]) x the requests in flight x the engine's seconds
    /// per token: what piling onto the busier batch costs, and what keeps the batches of two
    /// engines that both cache a prefix even.
    fn cost(&self, c: &Candidate, prompt_tokens: usize, answer_tokens: u32) -> f64 {
        let block = self.config.block_size as usize;
        let fetched = c.fetched_blocks() as usize;
        let uncached = self.uncached(c, prompt_tokens);
        let fetched_tokens = (fetched * block).min(uncached);
        let computed = (uncached - fetched_tokens) as f64;
        let beside = c.beside();
        let cache = uncached as f64 * c.secs_per_token * c.evicting_share(uncached, block);
        let fetch = c.fetch_secs(fetched_tokens.div_ceil(block.max(1)) as u32);
        let compute = computed * c.secs_per_token * (1.0 + beside);
        let answer = f64::from(answer_tokens.min(MAX_ANSWER_TOKENS));
        let decode = 2.0 * answer * beside * c.secs_per_token;
        let queue = (c.wait_secs - c.load_secs).max(0.0);
        queue.max(fetch) + c.load_secs + compute + cache + decode
    }

    /// Counts a request routed to engine `id` in the recent traffic of `candidates`' engines.
    fn record(&self, id: u64, candidates: &[Candidate]) {
        let mut traffic = self.traffic.lock().unwrap_or_else(|p| p.into_inner());
        let given = recent_requests(&traffic, candidates);
        // An engine that is not a candidate (gone, draining, down) is forgotten: when it is
        // back it counts as new, with the mean, not with the count it left with.
        traffic.clear();
        let keep = 1.0 - 1.0 / TRAFFIC_WINDOW;
        for (c, given) in candidates.iter().zip(given) {
            traffic.insert(c.id, given * keep + f64::from(u8::from(c.id == id)));
        }
    }

    fn uncached(&self, c: &Candidate, prompt_tokens: usize) -> usize {
        prompt_tokens.saturating_sub(c.matched_blocks as usize * self.config.block_size as usize)
    }

    /// An engine with this many requests in flight takes no more: `load_factor` x the fleet's
    /// mean after this request, rounded up, plus [`INFLIGHT_SLACK`]. Always above the least
    /// loaded engine's count, so some engine is always open.
    fn inflight_cap(&self, candidates: &[Candidate]) -> u64 {
        let total = candidates
            .iter()
            .fold(1u64, |sum, c| sum.saturating_add(c.inflight));
        let share = total as f64 / candidates.len() as f64;
        ((self.config.load_factor * share).ceil() as u64).saturating_add(INFLIGHT_SLACK)
    }

    /// The engines among `candidates` that were given their most of the recent requests: one
    /// more would take an engine's share of them past `load_factor` x the mean, or the mean plus
    /// [`TRAFFIC_SLACK`] where that is more. Never every engine: the least given is under the
    /// mean.
    fn over_share(&self, candidates: &[Candidate]) -> Vec<u64> {
        let given = {
            let traffic = self.traffic.lock().unwrap_or_else(|p| p.into_inner());
            recent_requests(&traffic, candidates)
        };
        let mean = (given.iter().sum::<f64>() + 1.0) / candidates.len() as f64;
        let bound = (self.config.load_factor * mean).max(mean + TRAFFIC_SLACK);
        candidates
            .iter()
            .zip(given)
            .filter(|(_, given)| given + 1.0 > bound + 1e-9)
            .map(|(c, _)| c.id)
            .collect()
    }

    fn prefix(
        &self,
        affinity: u128,
        prompt_tokens: usize,
        answer_tokens: u32,
        candidates: &[Candidate],
    ) -> Choice {
        // Bounded load on the requests in flight, where a request would start cold: an engine
        // whose batch still has room takes more at the cost its wait shows, one that would queue
        // is held to the cap. An engine that caches part of the prompt is priced by its wait
        // alone.
        let cap = self.inflight_cap(candidates);
        let open = |c: &&Candidate| {
            c.matched_blocks > 0 || c.inflight < cap || c.inflight < u64::from(c.max_seqs)
        };
        let cost = |c: &Candidate| self.cost(c, prompt_tokens, answer_tokens);
        // The cheapest; on a tie the longer match, then the fewer in flight, then the lower
        // slot.
        let cheapest = |passed_over: &[u64]| {
            candidates
                .iter()
                .filter(open)
                .filter(|c| !passed_over.contains(&c.id))
                .min_by(|x, y| {
                    cost(x)
                        .total_cmp(&cost(y))
                        .then(y.matched_blocks.cmp(&x.matched_blocks))
                        .then(x.inflight.cmp(&y.inflight))
                        .then(x.slot.cmp(&y.slot))
                })
        };
        // Bounded load over the recent requests: the engines that were given `load_factor` x
        // their share of them are passed over, so that one hot tenant cannot swamp the engine
        // that holds its prefix once a second one can serve it; but only for an engine that
        // serves as much of the prompt from its cache or a peer's copy. The bound moves
        // requests, not prefixes: a bound that made another engine compute the prefix cost a
        // tenant its cache (and the fleet its throughput) for a count.
        let over = self.over_share(candidates);
        let covered = |c: &Candidate| c.matched_blocks + c.fetched_blocks();
        let best = match cheapest(&over) {
            Some(b)
                if candidates
                    .iter()
                    .any(|c| over.contains(&c.id) && covered(c) > covered(b)) =>
            {
                cheapest(&[])
            }
            None => cheapest(&[]),
            best => best,
        };
        let Some(best) = best else {
            let c = least_loaded(candidates);
            return Choice {
                slot: c.slot,
                reason: Reason::LeastLoaded,
                matched_blocks: c.matched_blocks,
            };
        };
        let choice = |c: &Candidate, reason| Choice {
            slot: c.slot,
            reason,
            matched_blocks: c.matched_blocks,
        };
        if best.matched_blocks > 0 {
            return choice(best, Reason::Prefix);
        }
        if candidates.iter().any(|c| c.matched_blocks > 0) {
            // A cached prefix exists, but waiting for it costs more than computing it here (or
            // its engines were given their most of the recent requests): the tenant spills.
            return choice(best, Reason::LeastLoaded);
        }
        // Cached nowhere: the tenant's home, over its share of the recent requests or not. Where
        // its earlier requests are computing the prefix there (still queued, or in prefill),
        // they store it for this one, so the home is priced as a cached prefix is, by its wait,
        // and taken while that wait costs no more than computing the prompt on the cheapest
        // engine, under its in-flight cap or not: going elsewhere would compute it twice. (Its
        // wait and the compute of the prompt's tail beyond the blocks they compute, as `cost`
        // prices a cached prefix, was measured too: 0.89-0.96x the requests/s in the 16-client
        // short cells.)
        // (Taking any home under the cap kept tenants queueing behind a busy home while the
        // engine beside it sat idle: with four clients on two engines, a tenant's first request
        // waited a second behind three others, and the fleet ran 7% below the load-only
        // policies.) Where none is, this request computes it wherever it goes, so the home is
        // priced as any engine is, and kept on a tie. (Priced by its wait alone, a tenant's
        // first request queued behind the other tenants' first prefills at their common home
        // while the engine serving a hot tenant from cache, whose batch a prefill lengthens,
        // looked dearer: its later requests then computed the prefix again beside it.)
        let home = self.home(affinity, candidates);
        let home_price = |c: &Candidate| {
            if c.computing_blocks > 0 {
                c.wait_secs
            } else {
                cost(c)
            }
        };
        match candidates.iter().find(|c| c.id == home) {
            Some(c) if home_price(c) <= cost(best) => choice(c, Reason::Affinity),
            _ => {
                // The prefix will live where this request computes it: the tenant's next cold
                // requests (this one may still be in prefill) follow it there.
                self.move_home(affinity, best.id);
                choice(best, Reason::LeastLoaded)
            }
        }
    }

    /// The tenant's home engine: remembered while it is a candidate; otherwise the first engine
    /// in rendezvous order that was given no more than its share of the recent requests and is
    /// home to fewer than [`HOME_SPREAD`] x its share of tenants (else the first that is home to
    /// fewer than that many).
    fn home(&self, affinity: u128, candidates: &[Candidate]) -> u64 {
        let traffic: HashMap<u64, f64> = {
            let t = self.traffic.lock().unwrap_or_else(|p| p.into_inner());
            let given = recent_requests(&t, candidates);
            candidates.iter().map(|c| c.id).zip(given).collect()
        };
        let fair_traffic = traffic.values().sum::<f64>() / candidates.len() as f64;
        let mut homes = self.homes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&id) = homes.get(&affinity) {
            if candidates.iter().any(|c| c.id == id) {
                return id;
            }
        }
        if homes.len() >= MAX_HOMES {
            homes.clear();
        }
        let mut count: HashMap<u64, usize> = candidates.iter().map(|c| (c.id, 0)).collect();
        let mut placed = 0usize;
        for id in homes.values() {
            if let Some(n) = count.get_mut(id) {
                *n += 1;
                placed += 1;
            }
        }
        // Homes are balanced by the traffic they bring (a new tenant goes where the recent
        // requests were fewest, in its rendezvous order), so a tenant that sends a third of the
        // requests is home to fewer others; the count of tenants is a backstop: at most
        // HOME_SPREAD x the fair share (rounded up).
        let share = (placed + 1) as f64 / candidates.len() as f64;
        let cap = (HOME_SPREAD * share).ceil() as usize;
        let mut order: Vec<&Candidate> = candidates.iter().collect();
        order.sort_by_key(|c| std::cmp::Reverse(rendezvous(affinity, c.id)));
        let id = order
            .iter()
            .find(|c| count[&c.id] < cap && traffic[&c.id] <= fair_traffic + 1e-9)
            .or_else(|| order.iter().find(|c| count[&c.id] < cap))
            .unwrap_or(&order[0])
            .id;
        homes.insert(affinity, id);
        id
    }

    /// Makes engine `id` the home of the tenant with this `affinity`.
    fn move_home(&self, affinity: u128, id: u64) {
        self.homes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(affinity, id);
    }

    /// Forgets every tenant's home (after an engine leaves or a cache flush).
    pub fn forget_homes(&self) {
        self.homes.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// Each candidate's recent requests in `traffic` (see [`TRAFFIC_WINDOW`]). An engine new to the
/// table counts as the mean of the others, as if it had had its share: it takes new tenants'
/// homes as readily as they do, and is not given every request until it catches up with them.
fn recent_requests(traffic: &HashMap<u64, f64>, candidates: &[Candidate]) -> Vec<f64> {
    let known: Vec<f64> = candidates
        .iter()
        .filter_map(|c| traffic.get(&c.id).copied())
        .collect();
    let newcomer = if known.is_empty() {
        0.0
    } else {
        known.iter().sum::<f64>() / known.len() as f64
    };
    candidates
        .iter()
        .map(|c| traffic.get(&c.id).copied().unwrap_or(newcomer))
        .collect()
}

/// The shortest wait; on a tie the fewest in flight, then the lower slot.
fn least_loaded(candidates: &[Candidate]) -> &Candidate {
    candidates
        .iter()
        .min_by(|x, y| {
            x.wait_secs
                .total_cmp(&y.wait_secs)
                .then(x.inflight.cmp(&y.inflight))
                .then(x.slot.cmp(&y.slot))
        })
        .unwrap_or(&candidates[0])
}

/// Rendezvous (highest random weight) score of `key` on engine `id`.
pub fn rendezvous(key: u128, id: u64) -> u64 {
    let mut x = (key as u64) ^ (key >> 64) as u64 ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    // splitmix64 finalizer: a well-mixed 64-bit value from the combined key.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A stable 64-bit id for an engine name.
pub fn engine_id(name: &str) -> u64 {
    let h = blake3::hash(name.as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or([0; 8]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1 ms per prefill token, blocks of 16.
    const SPT: f64 = 0.001;

    fn router(policy: Policy) -> Router {
        Router::new(RouterConfig {
            policy,
            load_factor: 1.25,
            block_size: 16,
            prior_secs_per_token: SPT,
        })
    }

    /// A fresh `prefix` router's choice for tenant 1's 270-token prompt among `c` (no recent
    /// requests counted against any engine).
    fn first_choice(c: &[Candidate]) -> Choice {
        router(Policy::Prefix).choose(1, 270, 0, c).unwrap()
    }

    /// Candidates with these matched blocks, waits (seconds) and requests in flight.
    fn cands(matched: &[u32], wait: &[f64], inflight: &[u64]) -> Vec<Candidate> {
        (0..matched.len())
            .map(|i| Candidate {
                slot: i,
                id: engine_id(&format!("e{i}")),
                matched_blocks: matched[i],
                peer_blocks: 0,
                inflight: inflight[i],
                compute_inflight: inflight[i],
                wait_secs: wait[i],
                load_secs: 0.0,
                secs_per_token: SPT,
                peer_secs_per_block: 0.0,
                max_seqs: 0,
                free_blocks: 0,
                computing_blocks: 0,
            })
            .collect()
    }

    #[test]
    fn a_tenant_stays_on_its_engine_under_moderate_load() {
        let r = router(Policy::Prefix);
        // 16 cached blocks (256 tokens) of a 270-token prompt on engine 1: it saves 0.256 s.
        let c = r
            .choose(1, 270, 0, &cands(&[0, 16, 0], &[0.0, 0.0, 0.0], &[0, 0, 0]))
            .unwrap();
        assert_eq!(
            (c.slot, c.reason, c.matched_blocks),
            (1, Reason::Prefix, 16)
        );
        // Engine 1 has 0.2 s of queue and two requests in flight; the others are idle. Waiting
        // (0.2 s) costs less than recomputing the prefix elsewhere (0.256 s, three times): it
        // stays.
        let c = r
            .choose(1, 270, 0, &cands(&[0, 16, 0], &[0.0, 0.2, 0.0], &[0, 2, 1]))
            .unwrap();
        assert_eq!((c.slot, c.reason), (1, Reason::Prefix));
        // A longer prefix on a slower queue still wins while the saving covers the wait.
        let c = r
            .choose(1, 600, 0, &cands(&[4, 30, 0], &[0.0, 0.3, 0.0], &[1, 1, 1]))
            .unwrap();
        assert_eq!(c.slot, 1);
    }

    #[test]
    fn a_recompute_into_free_blocks_costs_no_cache() {
        let r = router(Policy::Prefix);
        // Engine 1 caches 256 of the 270 tokens and has 0.4 s of queue. Engine 0 is idle with a
        // full pool: recomputing there evicts 17 blocks of other prefixes, 0.54 s in all. It
        // stays.
        let mut c = cands(&[0, 16], &[0.0, 0.4], &[0, 1]);
        assert_eq!(r.choose(1, 270, 0, &c).unwrap().slot, 1);
        // With 17 free blocks there, the recompute costs its own prefill alone (0.27 s): it
        // moves.
        c[0].free_blocks = 17;
        assert_eq!(r.choose(1, 270, 0, &c).unwrap().slot, 0);
        // With 8, half its blocks evict: 0.27 s + 0.143 s, still under the wait.
        c[0].free_blocks = 8;
        assert_eq!(r.choose(1, 270, 0, &c).unwrap().slot, 0);
        // A peer copy into free blocks costs its transfer and the 14 tokens left to compute,
        // 0.048 s (0.318 s with a full pool), against engine 1's 0.1 s of queue.
        c[0].peer_blocks = 16;
        c[0].free_blocks = 0;
        c[1].wait_secs = 0.1;
        assert_eq!(r.choose(1, 270, 0, &c).unwrap().slot, 1);
        c[0].free_blocks = 17;
        assert_eq!(r.choose(1, 270, 0, &c).unwrap().slot, 0);
    }

    #[test]
    fn a_long_answer_goes_to_the_emptier_batch() {
        let r = router(Policy::Prefix);
        // Engine 0 caches all 16 blocks of a 256-token prompt and has three requests in flight;
        // engine 1 caches 12 and has none: 64 tokens to compute there, 0.128 s with the cache
        // they take.
        let c = cands(&[16, 12], &[0.0, 0.0], &[3, 0]);
        // A one-token answer beside three costs 0.006 s of steps, its own and theirs: it stays
        // with the whole prefix.
        assert_eq!(r.choose(1, 256, 1, &c).unwrap().slot, 0);
        // A 64-token answer beside three costs 0.384 s: it goes to the empty batch.
        let long = r.choose(1, 256, 64, &c).unwrap();
        assert_eq!((long.slot, long.reason), (1, Reason::Prefix));
        // An answer without a limit (the context's room) counts as MAX_ANSWER_TOKENS: beside
        // one request that is 0.512 s of steps, less than recomputing a 400-token prompt
        // (0.8 s), so the tenant stays.
        let one = cands(&[25, 0], &[0.0, 0.0], &[1, 0]);
        assert_eq!(r.choose(1, 400, u32::MAX, &one).unwrap().slot, 0);
        // Both cache the whole prompt: even a short answer takes the batch with fewer in flight.
        let both = cands(&[16, 16], &[0.0, 0.0], &[2, 1]);
        assert_eq!(r.choose(1, 256, 4, &both).unwrap().slot, 1);
        // And with no answer to price, the tie goes to the fewer in flight too.
        assert_eq!(r.choose(1, 256, 0, &both).unwrap().slot, 1);
    }

    #[test]
    fn a_tenant_spills_when_the_queue_costs_more_than_the_prefill_saved() {
        let r = router(Policy::Prefix);
        // Engine 1 caches 256 of the 270 tokens and has 0.4 s of queue; engine 0 is idle.
        // Recomputing there costs the request's prefill (0.27 s) and the cache it takes
        // (0.27 s): 0.54 s against 0.442 s of waiting. It stays.
        let c = r
            .choose(
                1,
                270,
                0,
                &cands(&[0, 16, 0], &[0.0, 0.4, 0.01], &[0, 1, 0]),
            )
            .unwrap();
        assert_eq!((c.slot, c.reason), (1, Reason::Prefix));
        // 0.6 s of queue: computing it on the idle engine is cheaper (0.54 s against 0.642 s).
        let c = r
            .choose(
                1,
                270,
                0,
                &cands(&[0, 16, 0], &[0.0, 0.6, 0.01], &[0, 1, 0]),
            )
            .unwrap();
        assert_eq!(
            (c.slot, c.reason, c.matched_blocks),
            (0, Reason::LeastLoaded, 0)
        );
        // In a busy fleet the same queue is kept: the other engines have three requests in
        // flight each, and the prefill would lengthen their steps too (1.45 s against 0.642 s).
        let busy = cands(&[0, 16, 0], &[0.1, 0.6, 0.1], &[3, 1, 3]);
        assert_eq!(r.choose(1, 270, 0, &busy).unwrap().slot, 1);
        // Until the wait outgrows even that: 2 s of queue.
        let mut long = busy.clone();
        long[1].wait_secs = 2.0;
        let c = r.choose(1, 270, 0, &long).unwrap();
        assert_eq!((c.slot, c.reason), (0, Reason::LeastLoaded));
        // Engines that share their compute (one machine's cores) gain nothing from the spill:
        // the idle engine's prefill slows the busy ones' requests as much as its own.
        let mut shared = cands(&[0, 16, 0], &[0.0, 0.6, 0.01], &[0, 1, 0]);
        for c in &mut shared {
            c.compute_inflight = 6;
        }
        assert_eq!(r.choose(1, 270, 0, &shared).unwrap().slot, 1);
        // A peer copy makes the spill a transfer: engine 0 (two in flight) can fetch the 16
        // blocks from engine 1 (0.290 s with their cache share) and compute 14 tokens (0.056 s),
        // against 0.542 s of waiting. Without it, recomputing there (1.08 s) is dearer.
        let mut fetch = cands(&[0, 16, 0], &[0.0, 0.5, 0.0], &[2, 1, 2]);
        assert_eq!(r.choose(1, 270, 0, &fetch).unwrap().slot, 1);
        fetch[0].peer_blocks = 16;
        fetch[2].peer_blocks = 16;
        let c = r.choose(1, 270, 0, &fetch).unwrap();
        assert_eq!(
            (c.slot, c.reason, c.matched_blocks),
            (0, Reason::LeastLoaded, 0)
        );
        // The transfer is priced at the fetching engine's measured rate: where its fetches
        // have taken 40 ms a block (0.68 s for these 16), waiting is cheaper (a router of its
        // own: this one has given engine 1 its share of the recent requests).
        let mut slow = fetch.clone();
        slow[0].peer_secs_per_block = 0.04;
        slow[2].peer_secs_per_block = 0.04;
        assert_eq!(first_choice(&fetch).slot, 0);
        assert_eq!(first_choice(&slow).slot, 1);
        slow[2].peer_secs_per_block = 0.0;
        assert_eq!(first_choice(&slow).slot, 2);
        // The fetch runs while the queue ahead drains: engine 1 waits 0.6 s, engine 0 (free
        // blocks to spare) 0.4 s and its 0.34 s fetch, at once. In sequence they would take
        // 0.74 s, and the request would stay.
        let mut overlap = cands(&[0, 16], &[0.4, 0.6], &[0, 0]);
        overlap[0].peer_blocks = 16;
        overlap[0].peer_secs_per_block = 0.02;
        overlap[0].free_blocks = 1000;
        let c = first_choice(&overlap);
        assert_eq!((c.slot, c.reason), (0, Reason::LeastLoaded));
        // A match in a slower tier is loaded after the admission, so after the fetch: engine 0's
        // 0.3 s wait, 0.2 s of it such a load, starts the prefill after 0.54 s, not 0.34 s,
        // and engine 1, at 0.5 s, is cheaper.
        overlap[0].wait_secs = 0.3;
        overlap[0].load_secs = 0.2;
        overlap[1].wait_secs = 0.5;
        assert_eq!(first_choice(&overlap).slot, 1);
        // A fetch is priced at most at its time limit: past it the engine computes the rest.
        let mut stuck = overlap[0];
        stuck.peer_secs_per_block = 1.0;
        let limit = kvgate_protocol::load::peer_fetch_limit_secs(16);
        assert_eq!(stuck.fetch_secs(16), limit);
        assert!(limit < kvgate_protocol::load::peer_fetch_secs(16, 1.0));
        // A second engine holding part of it is preferred to none.
        let c = r
            .choose(1, 270, 0, &cands(&[8, 16, 0], &[0.0, 0.8, 0.0], &[0, 1, 0]))
            .unwrap();
        assert_eq!((c.slot, c.reason), (0, Reason::Prefix));
        // The bounded load holds where a request would go without a cached prefix: engine 0 is
        // at its cap of in-flight requests (1.25 x 15 / 3, rounded up, plus two: 9), so the
        // spill goes to engine 2 although engine 0 would be cheaper.
        let capped = cands(&[0, 16, 0], &[0.0, 5.0, 4.0], &[12, 1, 1]);
        let c = r.choose(1, 270, 0, &capped).unwrap();
        assert_eq!((c.slot, c.reason), (2, Reason::LeastLoaded));
        // With room in its batch (16 sequences), engine 0 is not held to the cap.
        let mut roomy = capped.clone();
        roomy[0].max_seqs = 16;
        assert_eq!(r.choose(1, 270, 0, &roomy).unwrap().slot, 0);
        // An engine that caches the prefix is priced by its queue, not held to the cap: one
        // tenant's flood lengthens its own wait there (fair queuing), and it spills by cost.
        let c = r
            .choose(1, 270, 0, &cands(&[0, 16, 0], &[0.0, 0.0, 0.0], &[1, 6, 1]))
            .unwrap();
        assert_eq!((c.slot, c.reason), (1, Reason::Prefix));
    }

    #[test]
    fn a_tenant_that_sends_most_requests_gets_fewer_neighbours() {
        let r = router(Policy::Prefix);
        let c = cands(&[0, 0, 0], &[0.0, 0.0, 0.0], &[0, 0, 0]);
        let hot = r.choose(1, 300, 0, &c).unwrap().slot;
        let mut homes = [0usize; 3];
        homes[hot] += 1;
        for tenant in 2..10u128 {
            // The hot tenant sends ten requests for each one of the others.
            for _ in 0..10 {
                assert_eq!(r.choose(1, 300, 0, &c).unwrap().slot, hot);
            }
            homes[r.choose(tenant * 7919, 300, 0, &c).unwrap().slot] += 1;
        }
        // Nine tenants: the hot one's engine is home to the fewest, and to more only once the
        // others reach their bound (1.25 x their share).
        let others: Vec<usize> = (0..3).filter(|&s| s != hot).map(|s| homes[s]).collect();
        assert!(
            others.iter().all(|&n| homes[hot] < n),
            "{homes:?}, hot {hot}"
        );
        // Without that traffic the same tenants spread by count alone.
        let even = router(Policy::Prefix);
        let mut count = [0usize; 3];
        for tenant in std::iter::once(1).chain(2..10u128) {
            let t = if tenant == 1 { 1 } else { tenant * 7919 };
            count[even.choose(t, 300, 0, &c).unwrap().slot] += 1;
        }
        assert_eq!(count, [3, 3, 3]);
    }

    #[test]
    fn one_hot_tenant_cannot_swamp_the_engine_that_holds_its_prefix() {
        let r = router(Policy::Prefix);
        // Two idle engines; engine 0 caches the tenant's prefix, and engine 1 can fetch it from
        // there (so a spill costs a transfer, not a prefill).
        let mut c = cands(&[16, 0], &[0.0, 0.0], &[0, 0]);
        c[1].peer_blocks = 16;
        let sent: Vec<Choice> = (0..256).map(|_| r.choose(1, 270, 0, &c).unwrap()).collect();
        // The first requests stay with the prefix (two beyond the mean while few were routed),
        let first = sent.iter().take_while(|x| x.slot == 0).count();
        assert_eq!(first, 4);
        // and from then on engine 0 takes no more than 1.25 x its share of the recent ones:
        // of each 64, at most 40 (62.5%), and still the most it can.
        for window in sent[64..].windows(64).step_by(16) {
            let on_0 = window.iter().filter(|x| x.slot == 0).count();
            assert!((36..=41).contains(&on_0), "{on_0} of 64 on engine 0");
        }
        let spill = sent.iter().find(|x| x.slot == 1).unwrap();
        assert_eq!(
            (spill.reason, spill.matched_blocks),
            (Reason::LeastLoaded, 0)
        );
        // Where engine 1 could only compute the prefix, engine 0 keeps the tenant however many
        // requests it was given: the bound moves requests, not prefixes.
        let mut alone = c.clone();
        alone[1].peer_blocks = 0;
        assert!((0..64).all(|_| r.choose(1, 270, 0, &alone).unwrap().slot == 0));
        // Round robin's even split is not forced: with no load term between them, each request
        // goes to the cheaper engine while it may.
        assert!(sent.iter().filter(|x| x.slot == 0).count() > 140);
    }

    #[test]
    fn the_bound_on_recent_requests_moves_requests_not_prefixes() {
        // Engine 0 caches the prompt, engine 1 can fetch it from there, engine 2 cannot.
        let r = router(Policy::Prefix);
        let mut c = cands(&[16, 0, 0], &[0.0, 0.0, 0.0], &[0, 0, 0]);
        c[1].peer_blocks = 16;
        let warm: Vec<usize> = (0..128)
            .map(|_| r.choose(1, 270, 0, &c).unwrap().slot)
            .collect();
        assert_eq!(warm.iter().filter(|&&s| s == 2).count(), 0, "{warm:?}");
        assert!(warm[64..].iter().filter(|&&s| s == 1).count() > 10);
        // Engine 1's queue grows to 5 s. Computing the prompt on the idle engine 2 costs less
        // than that, but engine 0, over its share, is passed over only for an engine that serves
        // as much of the prompt: engine 0 takes the requests until its queue costs more too.
        c[1].wait_secs = 5.0;
        for _ in 0..8 {
            assert_eq!(r.choose(1, 270, 0, &c).unwrap().slot, 0);
        }
        c[0].wait_secs = 5.0;
        assert_eq!(r.choose(1, 270, 0, &c).unwrap().slot, 2);
    }

    #[test]
    fn an_engine_that_joins_counts_as_having_had_its_share() {
        // Two engines that both cache the prompt, each at its share of the recent requests
        // (engine 0 takes them until it is over, then engine 1).
        let r = router(Policy::Prefix);
        let two = cands(&[16, 16], &[0.0, 0.0], &[0, 0]);
        for _ in 0..128 {
            r.choose(1, 270, 0, &two).unwrap();
        }
        // A third joins, which can fetch the prompt (its transfer makes it the dearer). Counted
        // as having had the mean, it takes what the cost gives it: nothing while the other two
        // have room under the bound. Counted from none, the other two would be over their share
        // for a while and it would take a run of requests, each a fetch.
        let mut three = cands(&[16, 16, 0], &[0.0, 0.0, 0.0], &[0, 0, 0]);
        three[2].peer_blocks = 16;
        let joined: Vec<usize> = (0..32)
            .map(|_| r.choose(1, 270, 0, &three).unwrap().slot)
            .collect();
        let on_new = joined.iter().filter(|&&s| s == 2).count();
        assert!(on_new <= 2, "{on_new} of 32 on the new engine: {joined:?}");
        // An engine that leaves and comes back counts as new again, not with the count it left
        // with: engine 0, last at its bound, takes the next request again.
        r.choose(1, 270, 0, &three[1..]).unwrap();
        assert_eq!(r.choose(1, 270, 0, &three).unwrap().slot, 0);
    }

    #[test]
    fn no_match_goes_home_and_homes_are_balanced() {
        let r = router(Policy::Prefix);
        let c = cands(&[0, 0, 0], &[0.0, 0.0, 0.0], &[0, 0, 0]);
        let mut per_engine = [0usize; 3];
        for tenant in 0..6u128 {
            let first = r.choose(tenant * 7919, 300, 0, &c).unwrap();
            assert_eq!(first.reason, Reason::Affinity);
            // The same tenant keeps its home.
            assert_eq!(
                r.choose(tenant * 7919, 300, 0, &c).unwrap().slot,
                first.slot
            );
            per_engine[first.slot] += 1;
        }
        // Six tenants on three engines: two each.
        assert_eq!(per_engine, [2, 2, 2]);
        // A busy home that computes the tenant's prompt for its earlier requests is kept while
        // its wait is shorter than computing the prompt elsewhere (those requests store the
        // prefix for this one); a home whose queue is longer is passed over, at its in-flight
        // cap or not: an idle engine beside it would otherwise wait while the tenant queues.
        let home = r.choose(0, 300, 0, &c).unwrap().slot;
        let mut busy = c.clone();
        busy[home].wait_secs = 0.25;
        busy[home].inflight = 4;
        busy[home].computing_blocks = 18;
        assert_eq!(r.choose(0, 300, 0, &busy).unwrap().slot, home);
        busy[home].wait_secs = 10.0;
        let other = r.choose(0, 300, 0, &busy).unwrap();
        assert_ne!(other.slot, home);
        assert_eq!(other.reason, Reason::LeastLoaded);
        // The tenant now lives where that request went: its next cold request follows it.
        busy[home].inflight = 0;
        assert_eq!(r.choose(0, 300, 0, &busy).unwrap().slot, other.slot);
        // A home at its cap with a queue shorter than computing the prompt elsewhere (0.6 s: its
        // prefill, for the request and for the cache it takes) is kept.
        let t = 3 * 7919;
        let home = r.choose(t, 300, 0, &c).unwrap().slot;
        let mut capped = c.clone();
        capped[home].inflight = 5;
        capped[home].wait_secs = 0.25;
        capped[home].computing_blocks = 18;
        assert_eq!(r.choose(t, 300, 0, &capped).unwrap().slot, home);
    }

    #[test]
    fn a_tenants_first_request_is_priced_at_its_home_as_anywhere() {
        // Engine 0 serves a hot tenant from cache: six requests in flight, no queue. Engine 1,
        // the new tenant's home, has a second of other tenants' prefills queued and four
        // requests in flight. Its wait alone (1 s) is less than a prefill beside engine 0's six
        // (0.3 s x 7 + the cache it takes, 2.4 s), but the request computes its prompt wherever
        // it goes: at the home that is the wait and a prefill beside four (1 + 0.3 x 5 + 0.3 =
        // 2.8 s). It goes to engine 0, and the tenant lives there now.
        let r = router(Policy::Prefix);
        // A tenant (of those `salt` picks) whose home, between two idle engines, is engine 1.
        let at_engine_1 = |salt: u128| {
            let idle = cands(&[0, 0], &[0.0, 0.0], &[0, 0]);
            (0..100u128)
                .map(|t| t * 7919 + salt)
                .find(|&t| {
                    router(Policy::Prefix)
                        .choose(t, 300, 0, &idle)
                        .unwrap()
                        .slot
                        == 1
                })
                .unwrap()
        };
        let tenant = at_engine_1(0);
        let c = cands(&[0, 0], &[0.0, 1.0], &[6, 4]);
        let first = r.choose(tenant, 300, 0, &c).unwrap();
        assert_eq!((first.slot, first.reason), (0, Reason::LeastLoaded));
        // Its next request, while the first computes the prompt on engine 0, follows it there,
        // priced by engine 0's wait (0.5 s), though a prefill there would now cost more than on
        // engine 1 (2.9 s against 2.8 s).
        let mut next = c.clone();
        next[0].wait_secs = 0.5;
        assert_eq!(r.choose(tenant, 300, 0, &next).unwrap().slot, 1);
        next[0].computing_blocks = 18;
        r.move_home(tenant, next[0].id);
        assert_eq!(r.choose(tenant, 300, 0, &next).unwrap().slot, 0);
        // Another new tenant whose home's earlier requests compute its prompt is kept there,
        // behind the same second of queue: going elsewhere would compute the prompt twice.
        let other = at_engine_1(1);
        let mut computing = c.clone();
        computing[1].computing_blocks = 18;
        let kept = r.choose(other, 300, 0, &computing).unwrap();
        assert_eq!((kept.slot, kept.reason), (1, Reason::Affinity));
    }

    #[test]
    fn comparison_policies() {
        let c = cands(&[0, 9, 0], &[0.5, 0.9, 0.1], &[5, 9, 1]);
        let rr = router(Policy::RoundRobin);
        let slots: Vec<_> = (0..3)
            .map(|_| rr.choose(0, 100, 0, &c).unwrap().slot)
            .collect();
        assert_eq!(slots, [0, 1, 2]);
        assert_eq!(
            router(Policy::LeastLoaded)
                .choose(0, 100, 0, &c)
                .unwrap()
                .slot,
            2
        );
        let ch = router(Policy::ConsistentHash);
        let a = ch.choose(42, 100, 0, &c).unwrap().slot;
        assert_eq!(ch.choose(42, 100, 0, &c).unwrap().slot, a);
        assert!(router(Policy::Prefix).choose(0, 100, 0, &[]).is_none());
    }
}
