//! Routing policy: given the engines that may take a request (healthy, not draining), how much of
//! the request's prefix each already caches, each one's expected wait and its measured prefill
//! speed, pick one and say why. Pure: no IO, no clock; the same inputs give the same choice, so
//! the routing simulator (`kvgate bench --routing-sim`) runs exactly the code the gateway runs.
//!
//! `prefix` (the default) scores in time, at each engine's measured seconds per token. An
//! engine's cost for the request is its wait (the prefill queued ahead, a full batch or cache;
//! [`LoadReport::wait_secs`]), plus the prefill of the prompt tokens it does not cache, counted
//! three times: the request waits for it; the requests that queue behind it wait for it; and
//! its new blocks are cache that other prefixes lose, now or later, to be computed again. The
//! cheapest engine wins. So a cached prefix keeps its tenant on its engine until that engine's
//! queue costs more than recomputing the prefix elsewhere does, the fleet's share included: only
//! then does the tenant spill to a second engine. The engine admits waiting requests by fair queuing across tenants,
//! so a tenant that floods an engine lengthens its own wait there, not the others': it is the
//! one that spills. Over that, a bounded-load guarantee for requests that would start cold (no
//! cached prefix there): an engine whose running batch is full takes none while it has
//! `load_factor` x its share of the requests in flight (rounded up, plus [`INFLIGHT_SLACK`]).
//! With no match anywhere the request goes to the tenant's home engine, chosen by rendezvous
//! hashing of the tenant's system-prompt hash with bounded load (no engine is home to more than
//! `load_factor` x its share of tenants), unless the home is at its in-flight cap and its extra
//! wait exceeds the request's own prefill (then the tenant moves to where the request goes): the
//! tenant's earlier requests, still in prefill there, will have stored the prefix for the later
//! ones.
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
    /// Waiting for a cached prefix costs more than computing it (or its engines are at their
    /// in-flight cap), or the home engine is at its cap: the cheapest engine.
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
    /// Requests in flight on it.
    pub inflight: u64,
    /// Expected seconds before the request's own prefill starts there.
    pub wait_secs: f64,
    /// Its measured seconds per prefill token.
    pub secs_per_token: f64,
    /// Its running batch's limit (0: unknown).
    pub max_seqs: u32,
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
    /// Bounded load factor (>= 1), on requests in flight and on tenants' homes.
    pub load_factor: f64,
    /// Tokens per block.
    pub block_size: u32,
    /// Seconds per prefill token of an engine that has not reported its own.
    pub prior_secs_per_token: f64,
}

/// How many times the cost counts a prompt token an engine does not cache (see
/// `Router::cost`).
const UNCACHED_WEIGHT: usize = 3;

/// Requests an engine may have in flight beyond `load_factor` x the mean: with a handful in
/// flight, a share of the mean alone is too small a number to bound anything but cache reuse.
pub const INFLIGHT_SLACK: u64 = 2;

/// Most tenant homes remembered; past it the table starts over (homes are re-derived the same
/// way, so forgetting only loses balance history).
const MAX_HOMES: usize = 1 << 16;

/// The policy and the little state it keeps: the round-robin cursor and tenants' home engines.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    next: AtomicUsize,
    homes: Mutex<HashMap<u128, u64>>,
}

impl Router {
    pub fn new(config: RouterConfig) -> Self {
        Router {
            config,
            next: AtomicUsize::new(0),
            homes: Mutex::new(HashMap::new()),
        }
    }

    pub fn config(&self) -> RouterConfig {
        self.config
    }

    /// Picks an engine among `candidates` (non-empty, or `None`) for a request of
    /// `prompt_tokens` tokens. `affinity` identifies the tenant's shared prefix (its scope and
    /// system prompt).
    pub fn choose(
        &self,
        affinity: u128,
        prompt_tokens: usize,
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
            Policy::Prefix => return Some(self.prefix(affinity, prompt_tokens, candidates)),
        })
    }

    /// What sending a request of `prompt_tokens` tokens to `c` costs, in seconds: its wait, and
    /// the prefill of the tokens it does not cache, counted three times: the request waits for
    /// it; the requests queued behind it wait for it; and its new blocks are cache that other
    /// prefixes lose (now, when the pool is full, or later), to be computed again.
    fn cost(&self, c: &Candidate, prompt_tokens: usize) -> f64 {
        let uncached = self.uncached(c, prompt_tokens);
        c.wait_secs + (UNCACHED_WEIGHT * uncached) as f64 * c.secs_per_token
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

    fn prefix(&self, affinity: u128, prompt_tokens: usize, candidates: &[Candidate]) -> Choice {
        // Bounded load where a request would start cold: an engine whose batch still has room
        // takes more at the cost its wait shows, one that would queue is held to the cap. An
        // engine that caches part of the prompt is priced by its wait alone.
        let cap = self.inflight_cap(candidates);
        let allowed = |c: &&Candidate| {
            c.matched_blocks > 0 || c.inflight < cap || c.inflight < u64::from(c.max_seqs)
        };
        let cost = |c: &Candidate| self.cost(c, prompt_tokens);
        // The cheapest; on a tie the longer match, then the lower slot.
        let Some(best) = candidates.iter().filter(allowed).min_by(|x, y| {
            cost(x)
                .total_cmp(&cost(y))
                .then(y.matched_blocks.cmp(&x.matched_blocks))
                .then(x.slot.cmp(&y.slot))
        }) else {
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
            // its engines are at their in-flight cap): the tenant spills.
            return choice(best, Reason::LeastLoaded);
        }
        // Cached nowhere: the tenant's home (the tenant's earlier requests, still in prefill
        // there, store the prefix for its later ones), unless it is at its in-flight cap and
        // its extra wait exceeds the prefill the request costs anyway.
        let home = self.home(affinity, candidates);
        match candidates.iter().find(|c| c.id == home) {
            Some(c)
                if allowed(&c)
                    || c.wait_secs - best.wait_secs
                        <= self.uncached(c, prompt_tokens) as f64 * c.secs_per_token =>
            {
                choice(c, Reason::Affinity)
            }
            _ => {
                // The prefix will live where this request computes it: the tenant's next cold
                // requests (this one may still be in prefill) follow it there.
                self.move_home(affinity, best.id);
                choice(best, Reason::LeastLoaded)
            }
        }
    }

    /// The tenant's home engine: remembered while it is a candidate; otherwise the first engine
    /// in rendezvous order that is home to fewer than `load_factor` x its share of tenants.
    fn home(&self, affinity: u128, candidates: &[Candidate]) -> u64 {
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
        // At most the fair share (rounded up) plus (load_factor - 1) x the share (rounded down).
        let share = (placed + 1) as f64 / candidates.len() as f64;
        let cap =
            share.ceil() as usize + ((self.config.load_factor - 1.0) * share).floor() as usize;
        let mut order: Vec<&Candidate> = candidates.iter().collect();
        order.sort_by_key(|c| std::cmp::Reverse(rendezvous(affinity, c.id)));
        let id = order
            .iter()
            .find(|c| count[&c.id] < cap)
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

    /// Candidates with these matched blocks, waits (seconds) and requests in flight.
    fn cands(matched: &[u32], wait: &[f64], inflight: &[u64]) -> Vec<Candidate> {
        (0..matched.len())
            .map(|i| Candidate {
                slot: i,
                id: engine_id(&format!("e{i}")),
                matched_blocks: matched[i],
                inflight: inflight[i],
                wait_secs: wait[i],
                secs_per_token: SPT,
                max_seqs: 0,
            })
            .collect()
    }

    #[test]
    fn a_tenant_stays_on_its_engine_under_moderate_load() {
        let r = router(Policy::Prefix);
        // 16 cached blocks (256 tokens) of a 270-token prompt on engine 1: it saves 0.256 s.
        let c = r
            .choose(1, 270, &cands(&[0, 16, 0], &[0.0, 0.0, 0.0], &[0, 0, 0]))
            .unwrap();
        assert_eq!(
            (c.slot, c.reason, c.matched_blocks),
            (1, Reason::Prefix, 16)
        );
        // Engine 1 has 0.2 s of queue and two requests in flight; the others are idle. Waiting
        // (0.2 s) costs less than recomputing the prefix elsewhere (0.256 s, three times): it
        // stays.
        let c = r
            .choose(1, 270, &cands(&[0, 16, 0], &[0.0, 0.2, 0.0], &[0, 2, 1]))
            .unwrap();
        assert_eq!((c.slot, c.reason), (1, Reason::Prefix));
        // A longer prefix on a slower queue still wins while the saving covers the wait.
        let c = r
            .choose(1, 600, &cands(&[4, 30, 0], &[0.0, 0.3, 0.0], &[1, 1, 1]))
            .unwrap();
        assert_eq!(c.slot, 1);
    }

    #[test]
    fn a_tenant_spills_when_the_queue_costs_more_than_the_prefill_saved() {
        let r = router(Policy::Prefix);
        // 0.5 s of queue against 0.256 s saved, counted three times (the request's wait, the
        // work it adds, the cache its copy takes): it stays.
        let c = r
            .choose(1, 270, &cands(&[0, 16, 0], &[0.0, 0.5, 0.01], &[0, 1, 0]))
            .unwrap();
        assert_eq!((c.slot, c.reason), (1, Reason::Prefix));
        // 0.8 s of queue: computing it on an idle engine is cheaper (0.81 s against 0.842 s).
        let c = r
            .choose(1, 270, &cands(&[0, 16, 0], &[0.0, 0.8, 0.01], &[0, 1, 0]))
            .unwrap();
        assert_eq!(
            (c.slot, c.reason, c.matched_blocks),
            (0, Reason::LeastLoaded, 0)
        );
        // A second engine holding part of it is preferred to none.
        let c = r
            .choose(1, 270, &cands(&[8, 16, 0], &[0.0, 0.8, 0.0], &[0, 1, 0]))
            .unwrap();
        assert_eq!((c.slot, c.reason), (0, Reason::Prefix));
        // The bounded load holds where a request would go without a cached prefix: engine 0 is
        // at its cap of in-flight requests (1.25 x 9 / 3, rounded up, plus two: 6), so the
        // spill goes to engine 2.
        let c = r
            .choose(1, 270, &cands(&[0, 16, 0], &[0.0, 0.9, 0.0], &[6, 1, 1]))
            .unwrap();
        assert_eq!((c.slot, c.reason), (2, Reason::LeastLoaded));
        // With room in its batch (8 sequences), engine 0 is not held to the cap.
        let mut roomy = cands(&[0, 16, 0], &[0.0, 0.9, 0.0], &[6, 1, 1]);
        roomy[0].max_seqs = 8;
        assert_eq!(r.choose(1, 270, &roomy).unwrap().slot, 0);
        // An engine that caches the prefix is priced by its queue, not held to the cap: one
        // tenant's flood lengthens its own wait there (fair queuing), and it spills by cost.
        let c = r
            .choose(1, 270, &cands(&[0, 16, 0], &[0.0, 0.0, 0.0], &[1, 6, 1]))
            .unwrap();
        assert_eq!((c.slot, c.reason), (1, Reason::Prefix));
    }

    #[test]
    fn no_match_goes_home_and_homes_are_balanced() {
        let r = router(Policy::Prefix);
        let c = cands(&[0, 0, 0], &[0.0, 0.0, 0.0], &[0, 0, 0]);
        let mut per_engine = [0usize; 3];
        for tenant in 0..6u128 {
            let first = r.choose(tenant * 7919, 300, &c).unwrap();
            assert_eq!(first.reason, Reason::Affinity);
            // The same tenant keeps its home.
            assert_eq!(r.choose(tenant * 7919, 300, &c).unwrap().slot, first.slot);
            per_engine[first.slot] += 1;
        }
        // Six tenants on three engines: two each.
        assert_eq!(per_engine, [2, 2, 2]);
        // A busy home is kept (the tenant's requests in prefill there store its prefix for the
        // next ones); a home at its in-flight cap and with a long queue is passed over.
        let home = r.choose(0, 300, &c).unwrap().slot;
        let mut busy = c.clone();
        busy[home].wait_secs = 10.0;
        busy[home].inflight = 4;
        assert_eq!(r.choose(0, 300, &busy).unwrap().slot, home);
        busy[home].inflight = 5;
        let other = r.choose(0, 300, &busy).unwrap();
        assert_ne!(other.slot, home);
        assert_eq!(other.reason, Reason::LeastLoaded);
        // The tenant now lives where that request went: its next cold request follows it.
        busy[home].inflight = 0;
        assert_eq!(r.choose(0, 300, &busy).unwrap().slot, other.slot);
        // A home at its cap with a queue shorter than the request's own prefill (0.3 s) is kept.
        let t = 3 * 7919;
        let home = r.choose(t, 300, &c).unwrap().slot;
        let mut capped = c.clone();
        capped[home].inflight = 5;
        capped[home].wait_secs = 0.25;
        assert_eq!(r.choose(t, 300, &capped).unwrap().slot, home);
    }

    #[test]
    fn comparison_policies() {
        let c = cands(&[0, 9, 0], &[0.5, 0.9, 0.1], &[5, 9, 1]);
        let rr = router(Policy::RoundRobin);
        let slots: Vec<_> = (0..3)
            .map(|_| rr.choose(0, 100, &c).unwrap().slot)
            .collect();
        assert_eq!(slots, [0, 1, 2]);
        assert_eq!(
            router(Policy::LeastLoaded).choose(0, 100, &c).unwrap().slot,
            2
        );
        let ch = router(Policy::ConsistentHash);
        let a = ch.choose(42, 100, &c).unwrap().slot;
        assert_eq!(ch.choose(42, 100, &c).unwrap().slot, a);
        assert!(router(Policy::Prefix).choose(0, 100, &[]).is_none());
    }
}
