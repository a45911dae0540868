//! The gateway's view of every engine's prefix cache: block hash -> the set of engines (a bitmask
//! of engine slots) holding it, fed by each engine's `/kv/events`. Block hashes are already
//! uniform (BLAKE3), so the table uses them as their own hash.

use kvgate_protocol::hash::PrehashedHasher;
use kvgate_protocol::{BlockHash, Tier};
use std::collections::{HashMap, HashSet};
use std::hash::BuildHasherDefault;

/// Most engines one gateway routes to (one bit each).
pub const MAX_ENGINES: usize = 64;

type Fast = BuildHasherDefault<PrehashedHasher>;

/// Block hash -> engines, plus each engine's own set (for removal and re-sync). Each holder is
/// also marked when its copy is in a slower tier (host memory or disk) rather than its device
/// pool: such a match saves the prefill but costs a load.
///
/// Apart from those, the blocks of prompts this gateway has routed to an engine and that are
/// not finished there ([`PrefixIndex::route`]): the engine is computing them or about to (its
/// KV events, which confirm them, come a moment later), and holds them while the request runs.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    holders: HashMap<u128, Holders, Fast>,
    per_engine: Vec<HashSet<u128, Fast>>,
    /// Block hash -> engines it was routed to (a slot bitmask).
    routed: HashMap<u128, u64, Fast>,
    /// [`routed_key`] of (slot, block hash) -> the requests in flight there whose prompt has
    /// that block.
    routed_count: HashMap<u128, Routed, Fast>,
}

/// The requests in flight on one engine whose prompts have one block.
#[derive(Debug, Clone, Copy)]
struct Routed {
    count: u32,
    /// When the earliest of them was expected to have computed its prompt (gateway clock, ms;
    /// `u64::MAX` when not known, as after any of them ends: the others' times are not kept).
    ready_ms: u64,
}

/// The slots whose bits are set in `mask`, lowest first.
fn slots(mut mask: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let slot = (mask != 0).then(|| mask.trailing_zeros() as usize)?;
        mask &= mask - 1;
        Some(slot)
    })
}

/// One key for an engine slot and a block hash: the hash, with a constant of the slot mixed in.
/// Block hashes are uniform (BLAKE3, keyed by the deployment's seed), so two pairs collide with
/// probability 2^-128, and the key stays uniform for the prehashed table.
fn routed_key(slot: usize, hash: u128) -> u128 {
    const MIX: u128 = 0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835;
    hash ^ MIX.wrapping_mul(slot as u128 + 1)
}

/// Engines holding one block, as slot bitmasks: all of them, and those whose best copy is in
/// the host tier or on disk.
#[derive(Debug, Default, Clone, Copy)]
struct Holders {
    all: u64,
    host: u64,
    disk: u64,
}

/// How many leading blocks of a request one engine holds, and how many of those are in its
/// slower tiers.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TierMatch {
    pub blocks: u32,
    pub host: u32,
    pub disk: u32,
    /// Leading blocks held in the device pool or the host tier (before the first one on disk):
    /// what the engine can send a peer.
    pub fast: u32,
}

impl PrefixIndex {
    pub fn new() -> Self {
        PrefixIndex {
            holders: HashMap::default(),
            per_engine: (0..MAX_ENGINES).map(|_| HashSet::default()).collect(),
            routed: HashMap::default(),
            routed_count: HashMap::default(),
        }
    }

    /// A request whose prompt has these blocks was routed to engine `slot`: until
    /// [`Self::unroute`], they count as being computed there ([`Self::longest_routed`]).
    pub fn route(&mut self, slot: usize, hashes: &[BlockHash]) {
        self.route_ready(slot, hashes, u64::MAX);
    }

    /// [`Self::route`], for a request expected to have computed its prompt at `ready_ms`
    /// ([`Self::ready_ms`]).
    pub fn route_ready(&mut self, slot: usize, hashes: &[BlockHash], ready_ms: u64) {
        for h in hashes {
            let r = self
                .routed_count
                .entry(routed_key(slot, h.0))
                .or_insert(Routed { count: 0, ready_ms });
            r.count += 1;
            r.ready_ms = r.ready_ms.min(ready_ms);
            *self.routed.entry(h.0).or_default() |= 1 << slot;
        }
    }

    /// When engine `slot` can send block `hash` to a peer: now, where its device pool or host
    /// tier holds it; else when the earliest request in flight there whose prompt has it was
    /// expected to have computed it (`None`: no request in flight there has it, or none said
    /// when).
    pub fn ready_ms(&self, slot: usize, hash: BlockHash) -> Option<u64> {
        let bit = 1u64.checked_shl(u32::try_from(slot).ok()?)?;
        if self
            .holders
            .get(&hash.0)
            .is_some_and(|h| h.all & !h.disk & bit != 0)
        {
            return Some(0);
        }
        self.routed_count
            .get(&routed_key(slot, hash.0))
            .map(|r| r.ready_ms)
            .filter(|&ms| ms != u64::MAX)
    }

    /// That request ended (or failed) on engine `slot`.
    pub fn unroute(&mut self, slot: usize, hashes: &[BlockHash]) {
        for h in hashes {
            let std::collections::hash_map::Entry::Occupied(mut n) =
                self.routed_count.entry(routed_key(slot, h.0))
            else {
                continue;
            };
            let r = n.get_mut();
            r.count -= 1;
            if r.count > 0 {
                // The earliest may have been the one that ended: when the others expect to
                // have computed it is not kept.
                r.ready_ms = u64::MAX;
                continue;
            }
            n.remove();
            if let Some(mask) = self.routed.get_mut(&h.0) {
                *mask &= !(1u64 << slot);
                if *mask == 0 {
                    self.routed.remove(&h.0);
                }
            }
        }
    }

    /// Blocks routed to engines and not finished there.
    pub fn routed_len(&self) -> usize {
        self.routed_count.len()
    }

    /// For each engine in `candidates`, how many leading blocks of `hashes` it holds in its
    /// device pool or host tier (what it can send a peer), or is computing for a request routed
    /// there ([`Self::route`]).
    pub fn longest_routed(&self, hashes: &[BlockHash], candidates: u64) -> [u32; MAX_ENGINES] {
        let mut matched = [0u32; MAX_ENGINES];
        let mut alive = candidates;
        for (i, h) in hashes.iter().enumerate() {
            if alive == 0 {
                break;
            }
            let held = self.holders.get(&h.0).map_or(0, |h| h.all & !h.disk)
                | self.routed.get(&h.0).copied().unwrap_or(0);
            for slot in slots(alive & !held) {
                matched[slot] = i as u32;
            }
            alive &= held;
        }
        for slot in slots(alive) {
            matched[slot] = hashes.len() as u32;
        }
        matched
    }

    /// Engine `slot` holds `hash` in its device pool.
    pub fn insert(&mut self, slot: usize, hash: BlockHash) {
        self.insert_at(slot, hash, Tier::Device);
    }

    /// Engine `slot` holds `hash`, at best in `tier`.
    pub fn insert_at(&mut self, slot: usize, hash: BlockHash, tier: Tier) {
        self.per_engine[slot].insert(hash.0);
        let h = self.holders.entry(hash.0).or_default();
        let bit = 1u64 << slot;
        h.all |= bit;
        h.host &= !bit;
        h.disk &= !bit;
        match tier {
            Tier::Device => {}
            Tier::Host => h.host |= bit,
            Tier::Disk => h.disk |= bit,
        }
    }

    pub fn remove(&mut self, slot: usize, hash: BlockHash) {
        if self.per_engine[slot].remove(&hash.0) {
            self.unhold(slot, hash.0);
        }
    }

    fn unhold(&mut self, slot: usize, hash: u128) {
        if let Some(h) = self.holders.get_mut(&hash) {
            let keep = !(1u64 << slot);
            h.all &= keep;
            h.host &= keep;
            h.disk &= keep;
            if h.all == 0 {
                self.holders.remove(&hash);
            }
        }
    }

    /// Forgets everything engine `slot` held (it cleared its cache, re-syncs, or left). What
    /// was routed there stays until its requests end.
    pub fn clear(&mut self, slot: usize) {
        for h in std::mem::take(&mut self.per_engine[slot]) {
            self.unhold(slot, h);
        }
    }

    /// Blocks engine `slot` holds.
    pub fn len(&self, slot: usize) -> usize {
        self.per_engine[slot].len()
    }

    pub fn is_empty(&self) -> bool {
        self.holders.is_empty() && self.routed.is_empty()
    }

    /// For each engine in `candidates` (a slot bitmask), how many leading blocks of `hashes` it
    /// holds: one table lookup per block, however many engines there are.
    pub fn longest_matches(&self, hashes: &[BlockHash], candidates: u64) -> [u32; MAX_ENGINES] {
        self.longest_tier_matches(hashes, candidates)
            .map(|m| m.blocks)
    }

    /// [`Self::longest_matches`], with how many of each engine's matched blocks sit in its
    /// host tier and on its disk.
    pub fn longest_tier_matches(
        &self,
        hashes: &[BlockHash],
        candidates: u64,
    ) -> [TierMatch; MAX_ENGINES] {
        let mut matched = [TierMatch::default(); MAX_ENGINES];
        let mut alive = candidates;
        let mut fast_alive = candidates;
        for (i, h) in hashes.iter().enumerate() {
            if alive == 0 {
                break;
            }
            let here = self.holders.get(&h.0).copied().unwrap_or_default();
            let held = here.all & alive;
            let fast = held & !here.disk & fast_alive;
            for slot in slots(fast_alive & !fast) {
                matched[slot].fast = i as u32;
            }
            fast_alive = fast;
            for slot in slots(alive & !held) {
                matched[slot].blocks = i as u32;
            }
            for slot in slots(here.host & held) {
                matched[slot].host += 1;
            }
            for slot in slots(here.disk & held) {
                matched[slot].disk += 1;
            }
            alive = held;
        }
        for slot in slots(alive) {
            matched[slot].blocks = hashes.len() as u32;
        }
        for slot in slots(fast_alive) {
            matched[slot].fast = hashes.len() as u32;
        }
        matched
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u128) -> BlockHash {
        BlockHash(i * 0x9e37_79b9_7f4a_7c15 + 1)
    }

    #[test]
    fn longest_match_per_engine() {
        let mut idx = PrefixIndex::new();
        for i in 0..5 {
            idx.insert(0, h(i));
        }
        for i in 0..2 {
            idx.insert(2, h(i));
        }
        idx.insert(3, h(1)); // not a prefix: block 0 missing
        let req: Vec<_> = (0..8).map(h).collect();
        let m = idx.longest_matches(&req, 0b1111);
        assert_eq!(&m[..4], &[5, 0, 2, 0]);
        // Only candidates count.
        let m = idx.longest_matches(&req, 0b0100);
        assert_eq!(&m[..4], &[0, 0, 2, 0]);
        idx.remove(0, h(3));
        assert_eq!(idx.longest_matches(&req, 1)[0], 3);
        idx.clear(0);
        assert_eq!(idx.longest_matches(&req, 1)[0], 0);
        assert_eq!(idx.len(2), 2);
        idx.clear(2);
        idx.clear(3);
        assert!(idx.is_empty());
    }

    #[test]
    fn routed_blocks_count_until_their_requests_end() {
        let mut idx = PrefixIndex::new();
        let req: Vec<_> = (0..6).map(h).collect();
        for i in 0..2 {
            idx.insert(1, h(i));
        }
        // Two requests with the first four blocks go to engine 0, one with all six.
        idx.route(0, &req[..4]);
        idx.route(0, &req[..4]);
        idx.route(2, &req);
        let m = idx.longest_routed(&req, 0b111);
        assert_eq!(&m[..3], &[4, 2, 6]);
        // The held ones alone know nothing of them.
        assert_eq!(&idx.longest_matches(&req, 0b111)[..3], &[0, 2, 0]);
        // Held and routed join up: engine 1 is computing blocks 2 and 3 after its own 0 and 1.
        idx.route(1, &req[2..4]);
        assert_eq!(idx.longest_routed(&req, 0b010)[1], 4);
        idx.unroute(1, &req[2..4]);
        // A block on disk alone is not one to send: a peer's transfer reads the device pool
        // and the host tier.
        idx.insert_at(1, h(1), Tier::Disk);
        assert_eq!(idx.longest_routed(&req, 0b010)[1], 1);
        idx.insert_at(1, h(1), Tier::Host);
        assert_eq!(idx.longest_routed(&req, 0b010)[1], 2);
        // One of engine 0's requests ends: the other still counts.
        idx.unroute(0, &req[..4]);
        assert_eq!(idx.longest_routed(&req, 1)[0], 4);
        idx.unroute(0, &req[..4]);
        assert_eq!(idx.longest_routed(&req, 1)[0], 0);
        // An engine's cache cleared does not end its requests; unrouting twice is harmless.
        idx.clear(2);
        assert_eq!(idx.longest_routed(&req, 0b100)[2], 6);
        idx.unroute(2, &req);
        idx.unroute(2, &req);
        assert_eq!(idx.longest_routed(&req, 0b100)[2], 0);
        idx.clear(1);
        assert!(idx.is_empty());
        assert_eq!(idx.routed_len(), 0);
        // Due times: a held block now, a routed one when its request said, none past the slots.
        idx.insert(1, h(0));
        idx.route_ready(2, &req[..2], 5_000);
        assert_eq!(idx.ready_ms(1, h(0)), Some(0));
        assert_eq!(idx.ready_ms(2, h(1)), Some(5_000));
        assert_eq!(idx.ready_ms(0, h(1)), None);
        assert_eq!(idx.ready_ms(MAX_ENGINES, h(0)), None);
    }

    #[test]
    fn matches_count_the_blocks_in_slower_tiers() {
        let mut idx = PrefixIndex::new();
        for i in 0..4 {
            idx.insert(0, h(i));
            idx.insert(1, h(i));
        }
        // Engine 0 demoted blocks 2 and 3 to host memory, then block 3 to disk.
        idx.insert_at(0, h(2), Tier::Host);
        idx.insert_at(0, h(3), Tier::Host);
        idx.insert_at(0, h(3), Tier::Disk);
        let req: Vec<_> = (0..4).map(h).collect();
        let m = idx.longest_tier_matches(&req, 0b11);
        assert_eq!(
            m[0],
            TierMatch {
                blocks: 4,
                host: 1,
                disk: 1,
                fast: 3
            }
        );
        assert_eq!(
            m[1],
            TierMatch {
                blocks: 4,
                host: 0,
                disk: 0,
                fast: 4
            }
        );
        // Promoted back: a device copy again.
        idx.insert(0, h(3));
        assert_eq!(idx.longest_tier_matches(&req, 1)[0].disk, 0);
        idx.remove(0, h(2));
        assert_eq!(
            idx.longest_tier_matches(&req, 1)[0],
            TierMatch {
                blocks: 2,
                host: 0,
                disk: 0,
                fast: 2
            }
        );
    }
}
