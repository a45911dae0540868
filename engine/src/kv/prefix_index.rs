//! Block hash -> physical block, for prefix-cache hits.
//!
//! Keys are BLAKE3 outputs, already uniformly random, so the map hashes them by taking their low
//! 64 bits instead of running SipHash again. Lookup of a request's longest cached prefix walks its
//! hashes in order and stops at the first miss: O(matched blocks).

use super::BlockId;
use kvgate_protocol::BlockHash;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

pub use kvgate_protocol::hash::PrehashedHasher;

/// A map keyed by block hashes.
pub type HashMapByBlock<V> = HashMap<BlockHash, V, BuildHasherDefault<PrehashedHasher>>;

/// The engine's prefix index.
#[derive(Debug, Clone, Default)]
pub struct PrefixIndex {
    map: HashMapByBlock<BlockId>,
}

impl PrefixIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// An index for a pool of `num_blocks` blocks. The table is sized at twice the most entries
    /// it can hold (one per block): with constant evict-and-insert churn, a fuller table fills
    /// with tombstones and rehashes in place every few thousand inserts.
    pub fn with_blocks(num_blocks: usize) -> Self {
        PrefixIndex {
            map: HashMapByBlock::with_capacity_and_hasher(num_blocks * 2, Default::default()),
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn get(&self, hash: BlockHash) -> Option<BlockId> {
        self.map.get(&hash).copied()
    }

    /// Registers `hash` at `id` unless the hash is already cached elsewhere (two sequences
    /// computed the same block at once): returns whether it was inserted.
    pub fn insert(&mut self, hash: BlockHash, id: BlockId) -> bool {
        use std::collections::hash_map::Entry;
        match self.map.entry(hash) {
            Entry::Occupied(_) => false,
            Entry::Vacant(v) => {
                v.insert(id);
                true
            }
        }
    }

    /// Removes `hash` if it still points at `id`.
    pub fn remove(&mut self, hash: BlockHash, id: BlockId) -> bool {
        if self.map.get(&hash) == Some(&id) {
            self.map.remove(&hash);
            true
        } else {
            false
        }
    }

    /// The blocks of the longest run of `hashes`, from the first, that are all cached.
    pub fn longest_prefix(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes.iter().map_while(|h| self.get(*h)).collect()
    }

    /// How many of `hashes`, from the first, are cached (no allocation).
    pub fn longest_prefix_len(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.get(**h).is_some())
            .count()
    }

    pub fn iter(&self) -> impl Iterator<Item = (BlockHash, BlockId)> + '_ {
        self.map.iter().map(|(h, b)| (*h, *b))
    }

    pub fn clear(&mut self) {
        self.map.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_prefix_stops_at_the_first_miss() {
        let mut idx = PrefixIndex::new();
        assert!(idx.insert(BlockHash(1), BlockId(10)));
        assert!(idx.insert(BlockHash(2), BlockId(11)));
        assert!(idx.insert(BlockHash(4), BlockId(12)));
        assert!(!idx.insert(BlockHash(1), BlockId(99)), "first writer wins");
        let hashes = [1, 2, 3, 4].map(BlockHash);
        assert_eq!(idx.longest_prefix(&hashes), vec![BlockId(10), BlockId(11)]);
        assert!(!idx.remove(BlockHash(2), BlockId(99)));
        assert!(idx.remove(BlockHash(2), BlockId(11)));
        assert_eq!(idx.longest_prefix(&hashes), vec![BlockId(10)]);
    }
}
