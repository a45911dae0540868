//! Routing policy: given the engines that may take a request (healthy, not draining), how much of
//! the request's prefix each already caches, and each one's load, pick one and say why. Pure: no
//! IO, no clock; the same inputs give the same choice, so the routing simulator
//! (`kvgate bench --routing-sim`) runs exactly the code the gateway runs.
//!
//! `prefix` (the default) scores `matched_blocks * B - alpha * load` and takes the best; with no
//! match anywhere it sends the request to the tenant's home engine, chosen by rendezvous hashing
//! of the tenant's system-prompt hash with bounded load (no engine is home to more than
//! `load_factor` x its share of tenants, and a home that is busier than `load_factor` x the mean
//! is passed over), so each tenant's prefix is computed once and stays on one engine until that
//! engine is saturated. `round_robin`, `least_loaded` and `consistent_hash` (plain rendezvous,
//! no load bound) are there for comparison.

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
    /// The longest cached prefix, net of load.
    Prefix,
    /// No engine caches the prefix: the tenant's home engine.
    Affinity,
    /// Load outweighed any cached prefix, or the home engine was saturated.
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
    /// Load in tokens: prefill tokens this gateway has queued on it plus its KV usage, weighted.
    pub load: f64,
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
    /// Tokens of cached prefix worth one token of load.
    pub alpha: f64,
    /// Bounded load factor (>= 1).
    pub load_factor: f64,
    /// Tokens per block.
    pub block_size: u32,
}

/// Blocks of queued work by which an engine must exceed `load_factor` x the mean load before it
/// counts as saturated.
const SATURATION_SLACK: f64 = 64.0;

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

    /// Picks an engine among `candidates` (non-empty, or `None`). `affinity` identifies the
    /// tenant's shared prefix (its scope and system prompt).
    pub fn choose(&self, affinity: u128, candidates: &[Candidate]) -> Option<Choice> {
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
            Policy::Prefix => return Some(self.prefix(affinity, candidates)),
        })
    }

    fn prefix(&self, affinity: u128, candidates: &[Candidate]) -> Choice {
        let b = f64::from(self.config.block_size);
        let mean = candidates.iter().map(|c| c.load).sum::<f64>() / candidates.len() as f64;
        // Saturated: busier than load_factor x the mean by more than SATURATION_SLACK blocks of
        // work (small absolute differences are noise, not hot spots).
        let slack = SATURATION_SLACK * b;
        let saturated = |c: &Candidate| c.load > self.config.load_factor * mean + slack;
        let score = |c: &Candidate| f64::from(c.matched_blocks) * b - self.config.alpha * c.load;
        let best = candidates
            .iter()
            .filter(|c| !saturated(c))
            .max_by(|x, y| score(x).total_cmp(&score(y)).then(y.slot.cmp(&x.slot)));
        if let Some(best) = best.filter(|c| c.matched_blocks > 0) {
            return Choice {
                slot: best.slot,
                reason: Reason::Prefix,
                matched_blocks: best.matched_blocks,
            };
        }
        if candidates.iter().any(|c| c.matched_blocks > 0) && best.is_some() {
            // A cached prefix exists, but only on engines whose load outweighs it.
            let best = least_loaded(candidates);
            return Choice {
                slot: best.slot,
                reason: Reason::LeastLoaded,
                matched_blocks: best.matched_blocks,
            };
        }
        let home = self.home(affinity, candidates);
        match candidates.iter().find(|c| c.id == home) {
            Some(c) if !saturated(c) => Choice {
                slot: c.slot,
                reason: Reason::Affinity,
                matched_blocks: 0,
            },
            _ => {
                let c = least_loaded(candidates);
                Choice {
                    slot: c.slot,
                    reason: Reason::LeastLoaded,
                    matched_blocks: c.matched_blocks,
                }
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

    /// Forgets every tenant's home (after an engine leaves or a cache flush).
    pub fn forget_homes(&self) {
        self.homes.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

fn least_loaded(candidates: &[Candidate]) -> &Candidate {
    candidates
        .iter()
        .min_by(|x, y| x.load.total_cmp(&y.load).then(x.slot.cmp(&y.slot)))
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

    fn router(policy: Policy) -> Router {
        Router::new(RouterConfig {
            policy,
            alpha: 1.0,
            load_factor: 1.25,
            block_size: 16,
        })
    }

    fn cands(matched: &[u32], load: &[f64]) -> Vec<Candidate> {
        matched
            .iter()
            .zip(load)
            .enumerate()
            .map(|(i, (&m, &l))| Candidate {
                slot: i,
                id: engine_id(&format!("e{i}")),
                matched_blocks: m,
                load: l,
            })
            .collect()
    }

    #[test]
    fn longest_prefix_wins_until_load_outweighs_it() {
        let r = router(Policy::Prefix);
        let c = r.choose(1, &cands(&[2, 10, 0], &[0.0, 0.0, 0.0])).unwrap();
        assert_eq!((c.slot, c.reason), (1, Reason::Prefix));
        // 10 blocks = 160 tokens of prefix against 100 tokens more load: still engine 1.
        let c = r
            .choose(1, &cands(&[2, 10, 0], &[100.0, 200.0, 100.0]))
            .unwrap();
        assert_eq!(c.slot, 1);
        // Engine 1 is saturated: the next best prefix.
        let c = r
            .choose(1, &cands(&[2, 10, 0], &[100.0, 5000.0, 100.0]))
            .unwrap();
        assert_eq!((c.slot, c.reason), (0, Reason::Prefix));
    }

    #[test]
    fn no_match_goes_home_and_homes_are_balanced() {
        let r = router(Policy::Prefix);
        let c = cands(&[0, 0, 0], &[0.0, 0.0, 0.0]);
        let mut per_engine = [0usize; 3];
        for tenant in 0..6u128 {
            let first = r.choose(tenant * 7919, &c).unwrap();
            assert_eq!(first.reason, Reason::Affinity);
            // The same tenant keeps its home.
            assert_eq!(r.choose(tenant * 7919, &c).unwrap().slot, first.slot);
            per_engine[first.slot] += 1;
        }
        // Six tenants on three engines: two each.
        assert_eq!(per_engine, [2, 2, 2]);
        // A saturated home is passed over.
        let home = r.choose(0, &c).unwrap().slot;
        let mut busy = c.clone();
        busy[home].load = 10_000.0;
        let other = r.choose(0, &busy).unwrap();
        assert_ne!(other.slot, home);
        assert_eq!(other.reason, Reason::LeastLoaded);
    }

    #[test]
    fn comparison_policies() {
        let c = cands(&[0, 9, 0], &[5.0, 9.0, 1.0]);
        let rr = router(Policy::RoundRobin);
        let slots: Vec<_> = (0..3).map(|_| rr.choose(0, &c).unwrap().slot).collect();
        assert_eq!(slots, [0, 1, 2]);
        assert_eq!(router(Policy::LeastLoaded).choose(0, &c).unwrap().slot, 2);
        let ch = router(Policy::ConsistentHash);
        let a = ch.choose(42, &c).unwrap().slot;
        assert_eq!(ch.choose(42, &c).unwrap().slot, a);
        assert!(router(Policy::Prefix).choose(0, &[]).is_none());
    }
}
