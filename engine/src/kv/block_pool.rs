//! The device block pool: ref counts, hashes and the free list of every physical KV block.
//!
//! Free blocks sit in one doubly linked list threaded through the block array (no allocation,
//! O(1) push, pop and unlink). Allocation pops the head. A freed block that holds a cached hash is
//! pushed at the tail (it may still be hit, and is evicted last: LRU); a freed block without one is
//! pushed at the head, so worthless blocks are reused before any cached block is evicted.
//!
//! The pool also counts the blocks in use per cache scope, and per tenant for quotas and metrics.
//! A tenant holds a block while at least one of its sequences does; a block that sequences of two
//! tenants share (a prefix hit in a shared scope) counts for both, since either one alone would
//! keep it. Each block keeps its holders with their reference counts: usually one entry, so every
//! operation stays O(1) in practice (O(holders of that block) at worst).

use super::{BlockId, ScopeId, TenantId};
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
    /// Tenants whose sequences hold the block, each with its share of `ref_count` (sequences
    /// without a tenant hold references that no tenant is charged for).
    holders: Vec<(TenantId, u32)>,
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
    used_per_tenant: Vec<u32>,
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
                holders: Vec::new(),
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
            used_per_tenant: Vec::new(),
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

    /// Blocks that sequences of `tenant` hold (each counted once, however many hold it).
    pub fn used_by_tenant(&self, tenant: TenantId) -> u32 {
        self.used_per_tenant
            .get(tenant.0 as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Whether a sequence of `tenant` holds `id`.
    pub fn is_held_by(&self, id: BlockId, tenant: TenantId) -> bool {
        self.blocks[id.0 as usize]
            .holders
            .iter()
            .any(|(t, _)| *t == tenant)
    }

    /// The tenants holding `id`, each with its references.
    pub fn holders(&self, id: BlockId) -> &[(TenantId, u32)] {
        &self.blocks[id.0 as usize].holders
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

    /// Takes the least recently used free block for a sequence of `scope` (and of `holder`, if
    /// it has a tenant), with ref count 1. Returns the block and the hash it held with that
    /// hash's scope, if it was cached (the caller unregisters it: an eviction).
    pub fn allocate(
        &mut self,
        scope: ScopeId,
        holder: Option<TenantId>,
    ) -> Option<(BlockId, Option<(BlockHash, ScopeId)>)> {
        if self.head == NIL {
            return None;
        }
        let id = BlockId(self.head);
        self.unlink(id);
        let meta = &mut self.blocks[id.0 as usize];
        let evicted = meta.hash.take().map(|h| (h, meta.scope));
        meta.ref_count = 1;
        meta.scope = scope;
        meta.filled = 0;
        meta.holders.clear();
        self.add_scope_use(scope, 1);
        self.hold(id, holder);
        Some((id, evicted))
    }

    /// Takes one more reference to `id`, for a sequence of `holder`. A free (cached) block
    /// leaves the free list.
    pub fn touch(&mut self, id: BlockId, holder: Option<TenantId>) {
        if self.blocks[id.0 as usize].ref_count == 0 {
            self.unlink(id);
            let meta = &self.blocks[id.0 as usize];
            let (scope, filled) = (meta.scope, meta.filled);
            self.filled_in_use += filled as usize;
            self.add_scope_use(scope, 1);
        }
        self.blocks[id.0 as usize].ref_count += 1;
        self.hold(id, holder);
    }

    /// Drops one reference to `id`, which a sequence of `holder` held; returns true when the
    /// block became free.
    pub fn release(&mut self, id: BlockId, holder: Option<TenantId>) -> bool {
        self.unhold(id, holder);
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

    fn hold(&mut self, id: BlockId, holder: Option<TenantId>) {
        let Some(t) = holder else {
            return;
        };
        let holders = &mut self.blocks[id.0 as usize].holders;
        match holders.iter_mut().find(|(h, _)| *h == t) {
            Some((_, refs)) => *refs += 1,
            None => {
                holders.push((t, 1));
                self.add_tenant_use(t, 1);
            }
        }
    }

    fn unhold(&mut self, id: BlockId, holder: Option<TenantId>) {
        let Some(t) = holder else {
            return;
        };
        let holders = &mut self.blocks[id.0 as usize].holders;
        let Some(i) = holders.iter().position(|(h, _)| *h == t) else {
            debug_assert!(false, "{id:?} released for {t:?}, which does not hold it");
            return;
        };
        holders[i].1 -= 1;
        if holders[i].1 == 0 {
            holders.swap_remove(i);
            self.add_tenant_use(t, -1);
        }
    }

    fn add_tenant_use(&mut self, tenant: TenantId, delta: i32) {
        let i = tenant.0 as usize;
        if i >= self.used_per_tenant.len() {
            self.used_per_tenant.resize(i + 1, 0);
        }
        self.used_per_tenant[i] = self.used_per_tenant[i].wrapping_add_signed(delta);
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
        let (a, _) = pool.allocate(s, None).unwrap();
        let (b, _) = pool.allocate(s, None).unwrap();
        let (c, _) = pool.allocate(s, None).unwrap();
        assert_eq!((a, b, c), (BlockId(0), BlockId(1), BlockId(2)));
        assert!(pool.allocate(s, None).is_none());
        assert_eq!(pool.used_by_scope(s), 3);
        pool.set_hash(a, h(1));
        pool.set_hash(b, h(2));
        // Freed cached blocks go to the tail in release order; the uncached one to the head.
        assert!(pool.release(a, None));
        assert!(pool.release(b, None));
        assert!(pool.release(c, None));
        assert_eq!(pool.free_list().collect::<Vec<_>>(), vec![c, a, b]);
        assert_eq!(pool.num_cached_free(), 2);
        let (x, evicted) = pool.allocate(s, None).unwrap();
        assert_eq!((x, evicted), (c, None));
        let (y, evicted) = pool.allocate(s, None).unwrap();
        assert_eq!((y, evicted), (a, Some((h(1), s))));
        assert_eq!(pool.num_cached_free(), 1);
    }

    #[test]
    fn touch_revives_a_cached_block_and_clear_hash_demotes_it() {
        let mut pool = BlockPool::new(2);
        let s = ScopeId(1);
        let (a, _) = pool.allocate(s, None).unwrap();
        pool.set_hash(a, h(7));
        pool.release(a, None);
        assert_eq!(pool.used_by_scope(s), 0);
        pool.touch(a, None);
        assert_eq!(pool.meta(a).ref_count, 1);
        assert!(!pool.is_free(a));
        assert_eq!(pool.used_by_scope(s), 1);
        pool.touch(a, None);
        assert!(!pool.release(a, None));
        assert!(pool.release(a, None));
        assert_eq!(pool.free_list().collect::<Vec<_>>(), vec![BlockId(1), a]);
        assert_eq!(pool.clear_hash(a), Some(h(7)));
        assert_eq!(pool.free_list().collect::<Vec<_>>(), vec![a, BlockId(1)]);
        assert_eq!(pool.num_cached_free(), 0);
        assert_eq!(pool.num_free(), 2);
    }

    #[test]
    fn a_block_counts_once_for_each_tenant_that_holds_it() {
        let mut pool = BlockPool::new(2);
        let (s, a, b) = (ScopeId(0), TenantId(0), TenantId(1));
        let (x, _) = pool.allocate(s, Some(a)).unwrap();
        pool.touch(x, Some(a));
        pool.touch(x, Some(b));
        assert_eq!((pool.used_by_tenant(a), pool.used_by_tenant(b)), (1, 1));
        assert!(pool.is_held_by(x, b));
        pool.release(x, Some(a));
        assert_eq!(pool.used_by_tenant(a), 1, "a still holds it once");
        pool.release(x, Some(a));
        assert_eq!((pool.used_by_tenant(a), pool.used_by_tenant(b)), (0, 1));
        assert!(!pool.is_held_by(x, a));
        assert!(pool.release(x, Some(b)));
        assert_eq!(pool.used_by_tenant(b), 0);
        assert_eq!(pool.holders(x), &[]);
    }
}
