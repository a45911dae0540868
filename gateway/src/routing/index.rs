//! The gateway's view of every engine's prefix cache: block hash -> the set of engines (a bitmask
//! of engine slots) holding it, fed by each engine's `/kv/events`. Block hashes are already
//! uniform (BLAKE3), so the table uses them as their own hash.

use kvgate_protocol::hash::PrehashedHasher;
use kvgate_protocol::BlockHash;
use std::collections::{HashMap, HashSet};
use std::hash::BuildHasherDefault;

/// Most engines one gateway routes to (one bit each).
pub const MAX_ENGINES: usize = 64;

type Fast = BuildHasherDefault<PrehashedHasher>;

/// Block hash -> engines, plus each engine's own set (for removal and re-sync).
#[derive(Debug, Default)]
pub struct PrefixIndex {
    holders: HashMap<u128, u64, Fast>,
    per_engine: Vec<HashSet<u128, Fast>>,
}

impl PrefixIndex {
    pub fn new() -> Self {
        PrefixIndex {
            holders: HashMap::default(),
            per_engine: (0..MAX_ENGINES).map(|_| HashSet::default()).collect(),
        }
    }

    pub fn insert(&mut self, slot: usize, hash: BlockHash) {
        if self.per_engine[slot].insert(hash.0) {
            *self.holders.entry(hash.0).or_insert(0) |= 1 << slot;
        }
    }

    pub fn remove(&mut self, slot: usize, hash: BlockHash) {
        if self.per_engine[slot].remove(&hash.0) {
            if let Some(mask) = self.holders.get_mut(&hash.0) {
                *mask &= !(1 << slot);
                if *mask == 0 {
                    self.holders.remove(&hash.0);
                }
            }
        }
    }

    /// Forgets everything engine `slot` held (it cleared its cache, re-syncs, or left).
    pub fn clear(&mut self, slot: usize) {
        for h in std::mem::take(&mut self.per_engine[slot]) {
            if let Some(mask) = self.holders.get_mut(&h) {
                *mask &= !(1 << slot);
                if *mask == 0 {
                    self.holders.remove(&h);
                }
            }
        }
    }

    /// Blocks engine `slot` holds.
    pub fn len(&self, slot: usize) -> usize {
        self.per_engine[slot].len()
    }

    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// For each engine in `candidates` (a slot bitmask), how many leading blocks of `hashes` it
    /// holds: one table lookup per block, however many engines there are.
    pub fn longest_matches(&self, hashes: &[BlockHash], candidates: u64) -> [u32; MAX_ENGINES] {
        let mut matched = [0u32; MAX_ENGINES];
        let mut alive = candidates;
        for (i, h) in hashes.iter().enumerate() {
            if alive == 0 {
                break;
            }
            let here = self.holders.get(&h.0).copied().unwrap_or(0) & alive;
            let mut lost = alive & !here;
            while lost != 0 {
                let slot = lost.trailing_zeros() as usize;
                matched[slot] = i as u32;
                lost &= lost - 1;
            }
            alive = here;
        }
        while alive != 0 {
            let slot = alive.trailing_zeros() as usize;
            matched[slot] = hashes.len() as u32;
            alive &= alive - 1;
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
}
