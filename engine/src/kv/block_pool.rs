//! The device block pool: ref counts, hashes and the free list of every physical KV block.
//!
//! Free blocks sit in one doubly linked list threaded through the block array (no allocation,
//! O(1) push, pop and unlink). Allocation pops the head. A freed block that holds a cached hash is
//! pushed at the tail (it may still be hit, and is evicted last: LRU); a freed block without one is
//! pushed at the head, so worthless blocks are reused before any cached block is evicted.
//!
//! The pool also counts the blocks in use per cache scope, for quotas and metrics.

use super::{BlockId, ScopeId};
use kvgate_protocol::BlockHash;

const NIL: u32 = u32::MAX;

/// State of one physical block.
#[derive(Debug, Clone)]
pub struct BlockMeta {
    /// Number of block tables that hold this block.
    pub ref_count: u32,
    /// Set once the block is full and registered in the prefix index.
    pub hash: Option<BlockHash>,
    /// Scope of the sequence that allocated it.
    pub scope: ScopeId,
    /// Token slots written so far (the block is full at `block_size`).
    pub filled: u32,
    prev: u32,
    next: u32,
    in_free_list: bool,
}

/// Physical device blocks and their free list.
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<BlockMeta>,
    head: u32,
    tail: u32,
    num_free: usize,
    num_cached_free: usize,
    filled_in_use: usize,
    used_per_scope: Vec<u32>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks, none cached.
    pub fn new(num_blocks: u32) -> Self {
        let blocks = (0..num_blocks)
            .map(|i| BlockMeta {
                ref_count: 0,
                hash: None,
                scope: ScopeId(0),
                filled: 0,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == num_blocks { NIL } else { i + 1 },
                in_free_list: true,
            })
            .collect();
        BlockPool {
            blocks,
            head: if num_blocks == 0 { NIL } else { 0 },
            tail: if num_blocks == 0 { NIL } else { num_blocks - 1 },
            num_free: num_blocks as usize,
            num_cached_free: 0,
            filled_in_use: 0,
            used_per_scope: Vec::new(),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks with ref count 0 (cached or not).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Free blocks that still hold a cached hash.
    pub fn num_cached_free(&self) -> usize {
        self.num_cached_free
    }

    /// Blocks in use by sequences of `scope`.
    pub fn used_by_scope(&self, scope: ScopeId) -> u32 {
        self.used_per_scope
            .get(scope.0 as usize)
            .copied()
            .unwrap_or(0)
    }

    pub fn meta(&self, id: BlockId) -> &BlockMeta {
        &self.blocks[id.0 as usize]
    }

    /// Token slots written across the blocks in use.
    pub fn filled_in_use(&self) -> usize {
        self.filled_in_use
    }

    /// Records that `filled` slots of block `id` (in use) now hold tokens.
    pub fn set_filled(&mut self, id: BlockId, filled: u32) {
        let meta = &mut self.blocks[id.0 as usize];
        debug_assert!(meta.ref_count > 0);
        self.filled_in_use = self.filled_in_use + filled as usize - meta.filled as usize;
        meta.filled = filled;
    }

    /// Takes the least recently used free block for `scope`, with ref count 1. Returns the block
    /// and the hash it held, if it was cached (the caller unregisters it: an eviction).
    pub fn allocate(&mut self, scope: ScopeId) -> Option<(BlockId, Option<BlockHash>)> {
        if self.head == NIL {
            return None;
        }
        let id = BlockId(self.head);
        self.unlink(id);
        let meta = &mut self.blocks[id.0 as usize];
        let evicted = meta.hash.take();
        meta.ref_count = 1;
        meta.scope = scope;
        meta.filled = 0;
        self.add_scope_use(scope, 1);
        Some((id, evicted))
    }

    /// Takes one more reference to `id`. A free (cached) block leaves the free list.
    pub fn touch(&mut self, id: BlockId) {
        if self.blocks[id.0 as usize].ref_count == 0 {
            self.unlink(id);
            let meta = &self.blocks[id.0 as usize];
            let (scope, filled) = (meta.scope, meta.filled);
            self.filled_in_use += filled as usize;
            self.add_scope_use(scope, 1);
        }
        self.blocks[id.0 as usize].ref_count += 1;
    }

    /// Drops one reference to `id`; returns true when the block became free.
    pub fn release(&mut self, id: BlockId) -> bool {
        let meta = &mut self.blocks[id.0 as usize];
        debug_assert!(meta.ref_count > 0, "release of a free block {id:?}");
        meta.ref_count -= 1;
        if meta.ref_count > 0 {
            return false;
        }
        let (scope, cached, filled) = (meta.scope, meta.hash.is_some(), meta.filled);
        self.filled_in_use -= filled as usize;
        self.add_scope_use(scope, -1);
        if cached {
            self.push_tail(id);
        } else {
            self.push_head(id);
        }
        true
    }

    /// Marks a block full and cached under `hash`.
    pub fn set_hash(&mut self, id: BlockId, hash: BlockHash) {
        debug_assert!(!self.blocks[id.0 as usize].in_free_list);
        self.blocks[id.0 as usize].hash = Some(hash);
    }

    /// Forgets a block's hash (a flush). A free block moves to the head: it is worth nothing now.
    pub fn clear_hash(&mut self, id: BlockId) -> Option<BlockHash> {
        let hash = self.blocks[id.0 as usize].hash.take()?;
        if self.blocks[id.0 as usize].in_free_list {
            self.num_cached_free -= 1;
            self.unlink_raw(id);
            self.push_head(id);
        }
        Some(hash)
    }

    /// Free blocks from least to most recently used (the eviction order).
    pub fn free_list(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let id = BlockId(cur);
            cur = self.blocks[cur as usize].next;
            Some(id)
        })
    }

    /// Every block id, in order.
    pub fn ids(&self) -> impl Iterator<Item = BlockId> {
        (0..self.blocks.len() as u32).map(BlockId)
    }

    pub fn is_free(&self, id: BlockId) -> bool {
        self.blocks[id.0 as usize].in_free_list
    }

    fn add_scope_use(&mut self, scope: ScopeId, delta: i32) {
        let i = scope.0 as usize;
        if i >= self.used_per_scope.len() {
            self.used_per_scope.resize(i + 1, 0);
        }
        self.used_per_scope[i] = self.used_per_scope[i].wrapping_add_signed(delta);
    }

    fn unlink(&mut self, id: BlockId) {
        if self.blocks[id.0 as usize].hash.is_some() {
            self.num_cached_free -= 1;
        }
        self.unlink_raw(id);
        self.num_free -= 1;
        self.blocks[id.0 as usize].in_free_list = false;
    }

    fn unlink_raw(&mut self, id: BlockId) {
        let (prev, next) = {
            let m = &self.blocks[id.0 as usize];
            debug_assert!(m.in_free_list);
            (m.prev, m.next)
        };
        match prev {
            NIL => self.head = next,
            p => self.blocks[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.blocks[n as usize].prev = prev,
        }
    }

    fn push_tail(&mut self, id: BlockId) {
        let i = id.0;
        let tail = self.tail;
        let m = &mut self.blocks[i as usize];
        if m.hash.is_some() {
            self.num_cached_free += 1;
        }
        if !m.in_free_list {
            self.num_free += 1;
        }
        m.in_free_list = true;
        m.prev = tail;
        m.next = NIL;
        match tail {
            NIL => self.head = i,
            t => self.blocks[t as usize].next = i,
        }
        self.tail = i;
    }

    fn push_head(&mut self, id: BlockId) {
        let i = id.0;
        let head = self.head;
        let m = &mut self.blocks[i as usize];
        if m.hash.is_some() {
            self.num_cached_free += 1;
        }
        if !m.in_free_list {
            self.num_free += 1;
        }
        m.in_free_list = true;
        m.prev = NIL;
        m.next = head;
        match head {
            NIL => self.tail = i,
            h => self.blocks[h as usize].prev = i,
        }
        self.head = i;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u128) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn allocates_in_order_and_frees_lru() {
        let mut pool = BlockPool::new(3);
        let s = ScopeId(0);
        let (a, _) = pool.allocate(s).unwrap();
        let (b, _) = pool.allocate(s).unwrap();
        let (c, _) = pool.allocate(s).unwrap();
        assert_eq!((a, b, c), (BlockId(0), BlockId(1), BlockId(2)));
        assert!(pool.allocate(s).is_none());
        assert_eq!(pool.used_by_scope(s), 3);
        pool.set_hash(a, h(1));
        pool.set_hash(b, h(2));
        // Freed cached blocks go to the tail in release order; the uncached one to the head.
        assert!(pool.release(a));
        assert!(pool.release(b));
        assert!(pool.release(c));
        assert_eq!(pool.free_list().collect::<Vec<_>>(), vec![c, a, b]);
        assert_eq!(pool.num_cached_free(), 2);
        let (x, evicted) = pool.allocate(s).unwrap();
        assert_eq!((x, evicted), (c, None));
        let (y, evicted) = pool.allocate(s).unwrap();
        assert_eq!((y, evicted), (a, Some(h(1))));
        assert_eq!(pool.num_cached_free(), 1);
    }

    #[test]
    fn touch_revives_a_cached_block_and_clear_hash_demotes_it() {
        let mut pool = BlockPool::new(2);
        let s = ScopeId(1);
        let (a, _) = pool.allocate(s).unwrap();
        pool.set_hash(a, h(7));
        pool.release(a);
        assert_eq!(pool.used_by_scope(s), 0);
        pool.touch(a);
        assert_eq!(pool.meta(a).ref_count, 1);
        assert!(!pool.is_free(a));
        assert_eq!(pool.used_by_scope(s), 1);
        pool.touch(a);
        assert!(!pool.release(a));
        assert!(pool.release(a));
        assert_eq!(pool.free_list().collect::<Vec<_>>(), vec![BlockId(1), a]);
        assert_eq!(pool.clear_hash(a), Some(h(7)));
        assert_eq!(pool.free_list().collect::<Vec<_>>(), vec![a, BlockId(1)]);
        assert_eq!(pool.num_cached_free(), 0);
        assert_eq!(pool.num_free(), 2);
    }
}
