//! The slower tiers of the prefix cache: cached blocks evicted from the device pool live on in a
//! host-memory tier, and from there in a disk tier, until they are hit again or evicted for good.
//!
//! - A device block whose cached hash is evicted (its block is reused) **demotes** to the host
//!   tier: a copy to a host slot, planned here and done by the worker before the block is reused.
//! - A host slot whose block is evicted **spills** to the disk tier (a file) when the block is not
//!   on disk already; the disk tier keeps a block after it is loaded, so it spills once.
//! - A prompt whose cached run continues past the device pool into the host tier **promotes** that
//!   run: new device blocks, one batched copy before the step's forward pass. A run that continues
//!   on disk is read back into the host tier first, off the engine thread (the worker holds the
//!   request until the read ends, so other requests keep running meanwhile).
//!
//! Each tier is a fixed set of slots with a hash index and an O(1) intrusive LRU list. A block is in
//! the device pool or the host tier, never both (a promotion frees its host slot); the disk tier may
//! hold a copy of either. Block hashes keep their scope in the chain, so isolation holds in every
//! tier. This module only decides: it returns [`TierOp`]s in the order they must run.

use super::manager::KvCacheManager;
use super::prefix_index::HashMapByBlock;
use super::types::HashedPrompt;
use super::{BlockId, BlockTable, ScopeId};
use kvgate_protocol::{BlockHash, Tier};

const NIL: u32 = u32::MAX;

/// A copy the worker does for the tiers, before anything later in the same step touches the
/// blocks involved. Ops run in the order they were planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierOp {
    /// Device block -> host slot (the device block is about to be reused).
    Demote { device: BlockId, host: u32 },
    /// Host slot -> disk file (the host slot is about to be reused).
    Spill {
        host: u32,
        hash: BlockHash,
        scope: ScopeId,
    },
    /// Host slot -> device block (read by this step's forward pass).
    Promote { host: u32, device: BlockId },
    /// The disk file of `hash` is evicted or flushed.
    Delete { hash: BlockHash },
    /// Every disk file goes (a full flush).
    DeleteAll,
    /// Device block -> disk file, leaving the device copy (warm-restart persistence).
    Save {
        device: BlockId,
        hash: BlockHash,
        scope: ScopeId,
    },
}

/// A cached block in a slower tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierBlock {
    pub hash: BlockHash,
    pub scope: ScopeId,
    /// How a host-tier block got there (its promotion counts as a hit of that tier).
    pub origin: Origin,
}

/// Where a host-tier block came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Origin {
    /// Demoted from the device pool.
    #[default]
    Device,
    /// Read back from the disk tier.
    Disk,
    /// Fetched from a peer engine.
    Peer,
}

impl TierBlock {
    pub fn new(hash: BlockHash, scope: ScopeId) -> Self {
        TierBlock {
            hash,
            scope,
            origin: Origin::Device,
        }
    }
}

/// Fixed slots of cached blocks, least recently used first out.
#[derive(Debug, Clone, Default)]
pub struct TierStore {
    slots: Vec<Option<TierBlock>>,
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Least recently used.
    head: u32,
    /// Most recently used.
    tail: u32,
    free: Vec<u32>,
    map: HashMapByBlock<u32>,
}

impl TierStore {
    pub fn new(capacity: usize) -> Self {
        let n = capacity as u32;
        let mut map = HashMapByBlock::default();
        map.reserve(capacity);
        TierStore {
            slots: vec![None; capacity],
            prev: vec![NIL; capacity],
            next: vec![NIL; capacity],
            head: NIL,
            tail: NIL,
            free: (0..n).rev().collect(),
            map,
        }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.map.contains_key(&hash)
    }

    pub fn get(&self, hash: BlockHash) -> Option<u32> {
        self.map.get(&hash).copied()
    }

    pub fn block(&self, slot: u32) -> Option<TierBlock> {
        self.slots.get(slot as usize).copied().flatten()
    }

    /// Every block held, least recently used first.
    pub fn iter(&self) -> impl Iterator<Item = (u32, TierBlock)> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let slot = cur;
            cur = self.next[slot as usize];
            self.slots[slot as usize].map(|b| (slot, b))
        })
    }

    /// Makes `hash` the most recently used; false if it is not held.
    pub fn touch(&mut self, hash: BlockHash) -> bool {
        let Some(slot) = self.get(hash) else {
            return false;
        };
        self.unlink(slot);
        self.push_mru(slot);
        true
    }

    /// Takes a slot for `block` (most recently used): a free one, or the least recently used,
    /// whose block comes back as evicted (with the slot, which the caller must empty first).
    /// `None` for a tier without slots. A block already held is only touched.
    pub fn insert(&mut self, block: TierBlock) -> Option<(u32, Option<TierBlock>)> {
        if let Some(slot) = self.get(block.hash) {
            self.touch(block.hash);
            return Some((slot, None));
        }
        let (slot, evicted) = match self.free.pop() {
            Some(s) => (s, None),
            None => {
                let s = self.head;
                if s == NIL {
                    return None;
                }
                let old = self.take_slot(s);
                (s, old)
            }
        };
        self.slots[slot as usize] = Some(block);
        self.map.insert(block.hash, slot);
        self.push_mru(slot);
        Some((slot, evicted))
    }

    /// Takes `hash` out; its slot stays reserved (neither free nor held) until [`Self::release`].
    pub fn take(&mut self, hash: BlockHash) -> Option<(u32, TierBlock)> {
        let slot = self.get(hash)?;
        self.take_slot(slot).map(|b| (slot, b))
    }

    /// Returns a slot from [`Self::take`] to the free slots.
    pub fn release(&mut self, slot: u32) {
        debug_assert!(self.slots[slot as usize].is_none());
        self.free.push(slot);
    }

    /// Drops `hash`, freeing its slot.
    pub fn remove(&mut self, hash: BlockHash) -> Option<TierBlock> {
        let (slot, b) = self.take(hash)?;
        self.release(slot);
        Some(b)
    }

    /// Drops every block of `scope` (every block when `None`), returning them.
    pub fn remove_scope(&mut self, scope: Option<ScopeId>) -> Vec<TierBlock> {
        let victims: Vec<BlockHash> = self
            .iter()
            .filter(|(_, b)| scope.is_none_or(|s| b.scope == s))
            .map(|(_, b)| b.hash)
            .collect();
        victims.into_iter().filter_map(|h| self.remove(h)).collect()
    }

    fn take_slot(&mut self, slot: u32) -> Option<TierBlock> {
        let b = self.slots[slot as usize].take()?;
        self.map.remove(&b.hash);
        self.unlink(slot);
        Some(b)
    }

    fn unlink(&mut self, slot: u32) {
        let (p, n) = (self.prev[slot as usize], self.next[slot as usize]);
        match p {
            NIL => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.prev[slot as usize] = NIL;
        self.next[slot as usize] = NIL;
    }

    fn push_mru(&mut self, slot: u32) {
        self.prev[slot as usize] = self.tail;
        self.next[slot as usize] = NIL;
        match self.tail {
            NIL => self.head = slot,
            t => self.next[t as usize] = slot,
        }
        self.tail = slot;
    }
}

/// Sizes of the slower tiers, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierConfig {
    /// Host-memory slots for evicted cached blocks (0: no host tier).
    pub host_blocks: u32,
    /// Disk slots (0: no disk tier). The disk tier spills from the host tier, so it needs one.
    pub disk_blocks: u32,
}

/// Cumulative tier counters, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// Prompt tokens served by promoting blocks the host tier kept.
    pub host_hit_tokens: u64,
    /// Prompt tokens served by blocks read from the disk tier (then promoted from the host).
    pub disk_hit_tokens: u64,
    /// Prompt tokens served by blocks fetched from a peer engine (then promoted).
    pub peer_hit_tokens: u64,
    /// Blocks fetched from peers into the host tier.
    pub imported_blocks: u64,
    /// Blocks written to disk to persist the cache (a drain, a stop).
    pub saved_blocks: u64,
    /// Blocks promoted host -> device.
    pub promoted_blocks: u64,
    /// Blocks loaded disk -> host.
    pub loaded_blocks: u64,
    /// Blocks demoted device -> host.
    pub demoted_blocks: u64,
    /// Blocks spilled host -> disk.
    pub spilled_blocks: u64,
    /// Blocks evicted from the last tier that held them.
    pub dropped_blocks: u64,
}

impl KvCacheManager {
    /// How many blocks of `prompt` after its first `from` (its device hits) continue the cached
    /// run in the host tier (never the block holding the last prompt token).
    pub(super) fn host_run_len(&self, prompt: &HashedPrompt, from: usize) -> usize {
        self.host_run(self.hit_hashes(&prompt.hashes, prompt.num_tokens), from)
    }

    /// How many of `hits` from `from` on the host tier holds, in a row.
    fn host_run(&self, hits: &[BlockHash], from: usize) -> usize {
        if self.host_tier.is_empty() {
            return 0;
        }
        hits[from.min(hits.len())..]
            .iter()
            .take_while(|h| self.host_tier.contains(**h))
            .count()
    }

    /// Promotes `n` host-tier blocks of `prompt`, from its block `from` on, into new device
    /// blocks appended to `table`: one [`TierOp::Promote`] each. The caller counted the free
    /// blocks and the quota.
    pub(super) fn promote_run(
        &mut self,
        prompt: &HashedPrompt,
        from: usize,
        n: usize,
        table: &mut BlockTable,
    ) {
        if n == 0 {
            return;
        }
        // Take the run out of the host tier first: the demotions the new device blocks cause
        // must not evict the rest of it.
        let run: Vec<(u32, BlockHash)> = prompt.hashes[from..from + n]
            .iter()
            .filter_map(|h| {
                let (slot, b) = self.host_tier.take(*h)?;
                let tokens = self.block_size as u64;
                let c = &mut self.tier_counters;
                match b.origin {
                    Origin::Device => c.host_hit_tokens += tokens,
                    Origin::Disk => c.disk_hit_tokens += tokens,
                    Origin::Peer => c.peer_hit_tokens += tokens,
                }
                Some((slot, *h))
            })
            .collect();
        debug_assert_eq!(run.len(), n);
        for (i, &(slot, hash)) in run.iter().enumerate() {
            let parent = (from + i).checked_sub(1).map(|p| prompt.hashes[p]);
            let id = self.allocate_block(prompt.scope, prompt.tenant);
            self.pool.set_filled(id, self.block_size as u32);
            self.index_block(hash, id, parent, prompt.scope);
            self.tier_ops.push(TierOp::Promote {
                host: slot,
                device: id,
            });
            table.push(id);
        }
        for &(slot, _) in &run {
            self.host_tier.release(slot);
        }
        self.tier_counters.promoted_blocks += run.len() as u64;
    }

    /// Device block `device`, cached as `hash` in `scope`, is being reused: its block moves to
    /// the host tier. False when there is no host tier and no disk copy (the block is gone).
    pub(super) fn demote(&mut self, hash: BlockHash, scope: ScopeId, device: BlockId) -> bool {
        let Some((slot, evicted)) = self.host_tier.insert(TierBlock::new(hash, scope)) else {
            return self.disk_on()
                && self.disk_tier.as_ref().is_some_and(|d| d.contains(hash))
                && {
                    self.events.tier(hash, Tier::Disk);
                    true
                };
        };
        if let Some(old) = evicted {
            self.spill(slot, old);
        }
        self.tier_ops.push(TierOp::Demote { device, host: slot });
        self.tier_counters.demoted_blocks += 1;
        self.events.tier(hash, Tier::Host);
        true
    }

    /// Host slot `slot`'s block `old` is evicted from the host tier: to disk, unless it is there.
    fn spill(&mut self, slot: u32, old: TierBlock) {
        let on = self.disk_on();
        let Some(disk) = self.disk_tier.as_mut().filter(|_| on) else {
            self.events.removed(old.hash);
            self.tier_counters.dropped_blocks += 1;
            return;
        };
        if disk.touch(old.hash) {
            self.events.tier(old.hash, Tier::Disk);
            return;
        }
        let Some((_, gone)) = disk.insert(TierBlock {
            origin: Origin::Device,
            ..old
        }) else {
            self.events.removed(old.hash);
            return;
        };
        if let Some(gone) = gone {
            self.drop_from_disk(gone);
        }
        self.tier_ops.push(TierOp::Spill {
            host: slot,
            hash: old.hash,
            scope: old.scope,
        });
        self.tier_counters.spilled_blocks += 1;
        self.events.tier(old.hash, Tier::Disk);
    }

    /// `gone` left the disk tier: its file is deleted, and unless a faster tier holds it, it is
    /// no longer cached.
    fn drop_from_disk(&mut self, gone: TierBlock) {
        self.tier_ops.push(TierOp::Delete { hash: gone.hash });
        if !self.is_faster_than_disk(gone.hash) {
            self.events.removed(gone.hash);
            self.tier_counters.dropped_blocks += 1;
        }
    }

    /// Whether the disk tier is on (configured, and not turned off by a full disk).
    pub(super) fn disk_on(&self) -> bool {
        self.disk_tier.is_some() && !self.disk_off
    }

    /// Whether the device pool or the host tier holds `hash`.
    pub(super) fn is_faster_than_disk(&self, hash: BlockHash) -> bool {
        self.index.get(hash).is_some() || self.host_tier.contains(hash)
    }

    /// Takes the tier copies planned since the last call, in the order they must run.
    pub fn take_tier_ops(&mut self) -> Vec<TierOp> {
        std::mem::take(&mut self.tier_ops)
    }

    pub fn tier_counters(&self) -> TierCounters {
        self.tier_counters
    }

    /// Whether the disk tier is on.
    pub fn has_disk_tier(&self) -> bool {
        self.disk_on()
    }

    /// The blocks of `prompt` that continue its cached run (device pool, then host tier) on disk:
    /// what a load must read before the prompt is admitted. Empty without a disk tier.
    pub fn disk_run(&self, prompt: &HashedPrompt) -> Vec<BlockHash> {
        let Some(disk) = self.disk_tier.as_ref().filter(|_| !self.disk_off) else {
            return Vec::new();
        };
        let cap = prompt.num_tokens.saturating_sub(1) / self.block_size;
        let cap = cap.min(prompt.hashes.len());
        let device = self.cached_prefix_len(prompt);
        let host = self.host_run_len(prompt, device);
        // A load never takes more than half the host tier, so it cannot evict itself.
        let most = self.host_tier.capacity() / 2;
        prompt.hashes[(device + host).min(cap)..cap]
            .iter()
            .take_while(|h| disk.contains(**h))
            .take(most)
            .copied()
            .collect()
    }

    /// Makes `run` the disk tier's most recently used blocks (a load is reading them: the
    /// spills it causes must not evict the rest of it).
    pub fn touch_disk(&mut self, run: &[BlockHash]) {
        if let Some(disk) = &mut self.disk_tier {
            for h in run {
                disk.touch(*h);
            }
        }
    }

    /// A block read back from disk enters the host tier: returns the host slot its bytes go to,
    /// or `None` when it is no longer on disk or already in a faster tier. Run the tier ops
    /// taken right after this before writing the slot (they may read its old block out).
    pub fn load_from_disk(&mut self, hash: BlockHash) -> Option<u32> {
        if self.is_faster_than_disk(hash) || !self.disk_on() {
            return None;
        }
        let disk = self.disk_tier.as_mut()?;
        let scope = disk.get(hash).and_then(|s| disk.block(s))?.scope;
        disk.touch(hash);
        let slot = self.enter_host(hash, scope, Origin::Disk)?;
        self.tier_counters.loaded_blocks += 1;
        Some(slot)
    }

    /// A block fetched from a peer engine enters the host tier, in `scope` (the scope the
    /// requester hashed it in): returns the host slot its bytes go to, or `None` when a tier
    /// here holds it already. Run the tier ops taken right after this before writing the slot.
    pub fn import_to_host(&mut self, hash: BlockHash, scope: ScopeId) -> Option<u32> {
        if self.is_faster_than_disk(hash) {
            return None;
        }
        let slot = self.enter_host(hash, scope, Origin::Peer)?;
        self.tier_counters.imported_blocks += 1;
        Some(slot)
    }

    fn enter_host(&mut self, hash: BlockHash, scope: ScopeId, origin: Origin) -> Option<u32> {
        let (slot, evicted) = self.host_tier.insert(TierBlock {
            hash,
            scope,
            origin,
        })?;
        if let Some(old) = evicted {
            self.spill(slot, old);
        }
        self.events.tier(hash, Tier::Host);
        Some(slot)
    }

    /// The blocks of a prompt (its tokens in scope `scope`) whose cached run (from its first
    /// block) no tier here holds: what a peer could send, as the index of the first and the
    /// hashes. At most half the host tier. Reads only, so the engine thread answers it between
    /// the layers of a step too; a scope never used here is hashed without being registered.
    pub fn missing_run(&self, scope: &str, tokens: &[u32]) -> (usize, Vec<BlockHash>) {
        let start = match self.known_scope(scope) {
            Some(id) => self.scope_chains[id.0 as usize],
            None => self.hasher.start(scope),
        };
        let (hashes, _) = self.hasher.extend(start, tokens);
        let hits = self.hit_hashes(&hashes, tokens.len());
        let device = self.index.longest_prefix_len(hits);
        let mut from = device + self.host_run(hits, device);
        if let Some(disk) = self.disk_tier.as_ref().filter(|_| self.disk_on()) {
            from += hits[from..]
                .iter()
                .take_while(|h| disk.contains(**h))
                .count();
        }
        let run = hits[from..]
            .iter()
            .take(self.host_tier.capacity() / 2)
            .copied()
            .collect();
        (from, run)
    }

    /// A host slot that a load was to fill holds nothing usable (the read failed): forget it.
    pub fn unload_host(&mut self, hash: BlockHash) {
        if self.host_tier.remove(hash).is_some() && self.index.get(hash).is_none() {
            let on_disk = self.disk_tier.as_ref().is_some_and(|d| d.contains(hash));
            if on_disk {
                self.events.tier(hash, Tier::Disk);
            } else {
                self.events.removed(hash);
            }
        }
    }

    /// The disk copy of `hash` is unusable (corrupt, unreadable, or never written): it leaves
    /// the disk tier and its file is deleted.
    pub fn disk_lost(&mut self, hash: BlockHash) {
        if let Some(gone) = self.disk_tier.as_mut().and_then(|d| d.remove(hash)) {
            self.drop_from_disk(gone);
        }
    }

    /// Turns the disk tier off (the disk is full or failing): its blocks are no longer cached
    /// unless a faster tier holds them. Its files stay.
    /// Its index stays, so a flush still deletes the files it knows.
    pub fn disable_disk_tier(&mut self) {
        if !self.disk_on() {
            return;
        }
        self.disk_off = true;
        let gone: Vec<BlockHash> = self
            .disk_tier
            .iter()
            .flat_map(|d| d.iter())
            .map(|(_, b)| b.hash)
            .filter(|h| !self.is_faster_than_disk(*h))
            .collect();
        self.events.removed_many(gone);
    }

    /// Rebuilds the disk tier's index from the files found at start-up, least recently used
    /// first. Beyond its capacity the oldest are dropped (and deleted).
    pub fn restore_disk_tier(&mut self, blocks: impl IntoIterator<Item = (BlockHash, String)>) {
        for (hash, scope) in blocks {
            let scope = self.scope(&scope);
            let Some(disk) = self.disk_tier.as_mut() else {
                return;
            };
            if let Some((_, Some(gone))) = disk.insert(TierBlock::new(hash, scope)) {
                self.drop_from_disk(gone);
            }
        }
    }

    /// Plans writing up to `max` cached blocks that are not on disk yet to the disk tier (before
    /// a drain ends or the engine stops), the hottest first: device blocks in use, then cached
    /// device blocks and host-tier blocks from the most recently used down. Device blocks are
    /// saved, host-tier blocks spilled. Returns how many are planned; call again for the rest.
    pub fn persist_to_disk(&mut self, max: usize) -> usize {
        let Some(disk) = self.disk_tier.as_ref().filter(|_| !self.disk_off) else {
            return 0;
        };
        // Coldest first, then reversed.
        let mut todo: Vec<(Option<u32>, BlockId, BlockHash, ScopeId)> = self
            .host_tier
            .iter()
            .filter(|(_, b)| !disk.contains(b.hash))
            .map(|(slot, b)| (Some(slot), BlockId(0), b.hash, b.scope))
            .collect();
        todo.extend(
            self.pool
                .free_list()
                .chain(self.pool.ids().filter(|b| !self.pool.is_free(*b)))
                .filter_map(|b| {
                    let meta = self.pool.meta(b);
                    let hash = meta.hash?;
                    (!disk.contains(hash)).then_some((None, b, hash, meta.scope))
                }),
        );
        todo.reverse();
        // Never more than the disk holds.
        todo.truncate(max.min(disk.capacity()));
        // Inserted coldest first, so the hottest end up most recently used.
        todo.reverse();
        let n = todo.len();
        for (slot, id, hash, scope) in todo {
            let Some(disk) = self.disk_tier.as_mut() else {
                break;
            };
            if let Some((_, Some(gone))) = disk.insert(TierBlock::new(hash, scope)) {
                self.drop_from_disk(gone);
            }
            self.tier_ops.push(match slot {
                Some(host) => TierOp::Spill { host, hash, scope },
                None => TierOp::Save {
                    device: id,
                    hash,
                    scope,
                },
            });
        }
        self.tier_counters.saved_blocks += n as u64;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(i: u128) -> TierBlock {
        TierBlock::new(BlockHash(i), ScopeId(0))
    }

    #[test]
    fn evicts_least_recently_used_and_touch_refreshes() {
        let mut t = TierStore::new(2);
        assert_eq!(t.insert(b(1)), Some((0, None)));
        assert_eq!(t.insert(b(2)), Some((1, None)));
        assert!(t.touch(BlockHash(1)));
        // 2 is now the least recently used.
        assert_eq!(t.insert(b(3)), Some((1, Some(b(2)))));
        assert_eq!(t.iter().map(|(_, x)| x.hash.0).collect::<Vec<_>>(), [1, 3]);
        // Inserting a held block only touches it.
        assert_eq!(t.insert(b(1)), Some((0, None)));
        assert_eq!(t.iter().map(|(_, x)| x.hash.0).collect::<Vec<_>>(), [3, 1]);
        let (slot, _) = t.take(BlockHash(3)).unwrap();
        assert_eq!(t.len(), 1);
        // A taken slot is not reused until released.
        assert_eq!(t.insert(b(4)), Some((0, Some(b(1)))));
        t.release(slot);
        assert_eq!(t.insert(b(5)), Some((slot, None)));
        assert_eq!(t.remove_scope(None).len(), 2);
        assert!(t.is_empty());
        assert_eq!(TierStore::new(0).insert(b(1)), None);
    }
}
