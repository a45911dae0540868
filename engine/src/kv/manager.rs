//! [`KvCacheManager`]: the block manager the scheduler calls.
//!
//! A sequence's life: [`KvCacheManager::hash_prompt`] once at admission, then
//! [`start_sequence`](KvCacheManager::start_sequence) (touches the longest cached prefix),
//! [`append_slots`](KvCacheManager::append_slots) for every prefill chunk and decode token,
//! optionally [`fork`](KvCacheManager::fork), [`swap_out`](KvCacheManager::swap_out) /
//! [`swap_in`](KvCacheManager::swap_in), and finally [`free`](KvCacheManager::free).
//!
//! Blocks are registered in the prefix index the moment their last slot is allocated: the forward
//! pass writes every new K/V row of a step (per layer, before attention), so a request that hits
//! such a block in the same step reads it after it is written.
//!
//! KV quotas are per tenant: a sequence started from a prompt [`for_tenant`](HashedPrompt::for_tenant)
//! counts against its tenant's quota, whatever scope it caches in.
//!
//! Every operation that can fail checks first and then acts: an error leaves no trace.
//! Costs: `start_sequence` O(hit blocks); `append_slots` O(new tokens), plus one hash per block
//! that fills with tokens not hashed at admission; `free` O(blocks).

use super::block_pool::BlockPool;
use super::event_log::EventLog;
use super::host_pool::HostPool;
use super::prefix_index::PrefixIndex;
use super::tier::{TierCounters, TierOp, TierStore};
use super::types::{
    AppendOutcome, HashedPrompt, KvConfig, KvCounters, KvError, KvUsage, PromptAllocation,
};
use super::{BlockId, BlockTable, HostBlockId, ScopeId, SeqId, TenantId};
use kvgate_protocol::{BlockHash, BlockHasher, Chain, KvEventRecord, Tier};
use std::collections::HashMap;

#[derive(Debug, Clone)]
pub(super) struct SeqState {
    pub(super) scope: ScopeId,
    /// The tenant charged for the sequence's blocks.
    pub(super) tenant: Option<TenantId>,
    /// Device blocks; empty while swapped out.
    pub(super) table: BlockTable,
    /// Host blocks while swapped out.
    pub(super) host: Option<Vec<HostBlockId>>,
    /// Known hashes of the sequence's full blocks, in order. Prompt hashes are known at admission,
    /// ahead of the blocks being filled.
    pub(super) hashes: Vec<BlockHash>,
    /// Chain after the last entry of `hashes`: what the next full block is hashed from.
    pub(super) chain: Chain,
    /// Tokens of the block being filled (cleared when it fills).
    pub(super) partial: Vec<u32>,
}

/// One cached block of a [`KvCacheManager::snapshot`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SnapshotBlock {
    pub scope: String,
    pub hash: BlockHash,
    pub tier: Tier,
}

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct HostMeta {
    pub(super) hash: Option<BlockHash>,
    pub(super) filled: u32,
}

/// The paged KV cache's block manager. See the module docs.
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pub(super) hasher: BlockHasher,
    pub(super) block_size: usize,
    pub(super) pool: BlockPool,
    pub(super) host: HostPool,
    pub(super) host_meta: Vec<HostMeta>,
    pub(super) index: PrefixIndex,
    pub(super) seqs: HashMap<SeqId, SeqState>,
    pub(super) scopes: Vec<String>,
    /// Each scope's start chain, computed once.
    pub(super) scope_chains: Vec<Chain>,
    pub(super) scope_ids: HashMap<String, ScopeId>,
    /// Block quota per tenant, by id.
    pub(super) quotas: Vec<Option<u32>>,
    pub(super) events: EventLog,
    pub(super) counters: KvCounters,
    /// Cached blocks evicted from the device pool (see [`super::tier`]).
    pub(super) host_tier: TierStore,
    /// Cached blocks spilled from the host tier, when the disk tier is configured.
    pub(super) disk_tier: Option<TierStore>,
    /// The disk tier turned itself off (a full disk): nothing goes to it or comes from it, but
    /// its index stays so that a flush still deletes its files.
    pub(super) disk_off: bool,
    /// Tier copies planned and not yet taken by the worker, in order.
    pub(super) tier_ops: Vec<TierOp>,
    pub(super) tier_counters: TierCounters,
}

impl KvCacheManager {
    pub fn new(config: KvConfig) -> Self {
        KvCacheManager {
            block_size: config.hasher.block_size(),
            hasher: config.hasher,
            pool: BlockPool::new(config.num_blocks),
            host: HostPool::new(config.num_host_blocks),
            host_meta: vec![HostMeta::default(); config.num_host_blocks as usize],
            index: PrefixIndex::with_blocks(config.num_blocks as usize),
            seqs: HashMap::new(),
            scopes: Vec::new(),
            scope_chains: Vec::new(),
            scope_ids: HashMap::new(),
            quotas: Vec::new(),
            events: EventLog::default(),
            counters: KvCounters::default(),
            host_tier: TierStore::new(config.tiers.host_blocks as usize),
            disk_tier: (config.tiers.disk_blocks > 0 && config.tiers.host_blocks > 0)
                .then(|| TierStore::new(config.tiers.disk_blocks as usize)),
            disk_off: false,
            tier_ops: Vec::new(),
            tier_counters: TierCounters::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The id of scope `name`, interned on first use.
    pub fn scope(&mut self, name: &str) -> ScopeId {
        if let Some(id) = self.scope_ids.get(name) {
            return *id;
        }
        let id = ScopeId(self.scopes.len() as u32);
        self.scopes.push(name.to_owned());
        self.scope_chains.push(self.hasher.start(name));
        self.scope_ids.insert(name.to_owned(), id);
        id
    }

    /// The id of scope `name`, if it has been used here.
    pub fn known_scope(&self, name: &str) -> Option<ScopeId> {
        self.scope_ids.get(name).copied()
    }

    pub fn scope_name(&self, scope: ScopeId) -> &str {
        &self.scopes[scope.0 as usize]
    }

    /// Caps the blocks `tenant`'s sequences may hold at once (`None`: no cap). Sequences already
    /// over a lowered cap keep their blocks; they can only grow once back under it.
    pub fn set_quota(&mut self, tenant: TenantId, quota: Option<u32>) {
        let i = tenant.0 as usize;
        if i >= self.quotas.len() {
            if quota.is_none() {
                return;
            }
            self.quotas.resize(i + 1, None);
        }
        self.quotas[i] = quota;
    }

    pub fn quota(&self, tenant: TenantId) -> Option<u32> {
        self.quotas.get(tenant.0 as usize).copied().flatten()
    }

    /// Blocks held by `tenant`'s sequences, each counted once.
    pub fn tenant_usage(&self, tenant: TenantId) -> u32 {
        self.pool.used_by_tenant(tenant)
    }

    /// Blocks held by `scope`'s sequences.
    pub fn scope_usage(&self, scope: ScopeId) -> u32 {
        self.pool.used_by_scope(scope)
    }

    /// Hashes a prompt's full blocks in `scope` (done once per request).
    pub fn hash_prompt(&self, scope: ScopeId, tokens: &[u32]) -> HashedPrompt {
        let (hashes, chain) = self
            .hasher
            .extend(self.scope_chains[scope.0 as usize], tokens);
        HashedPrompt {
            scope,
            tenant: None,
            hashes,
            chain,
            num_tokens: tokens.len(),
        }
    }

    /// Cached blocks `prompt` would hit now: at most all but the block holding its last token,
    /// which is always computed (its logits are needed).
    pub fn cached_prefix(&self, prompt: &HashedPrompt) -> Vec<BlockId> {
        self.index
            .longest_prefix(self.hit_hashes(&prompt.hashes, prompt.num_tokens))
    }

    /// How many blocks [`Self::cached_prefix`] would return, without collecting them.
    pub fn cached_prefix_len(&self, prompt: &HashedPrompt) -> usize {
        self.index
            .longest_prefix_len(self.hit_hashes(&prompt.hashes, prompt.num_tokens))
    }

    /// Of a prompt's block `hashes` (`num_tokens` tokens), those a cache hit may cover: all but
    /// the block holding its last token.
    pub(super) fn hit_hashes<'a>(
        &self,
        hashes: &'a [BlockHash],
        num_tokens: usize,
    ) -> &'a [BlockHash] {
        let cap = num_tokens.saturating_sub(1) / self.block_size;
        &hashes[..cap.min(hashes.len())]
    }

    /// New blocks (allocated or revived from the cache) that admitting `prompt` whole needs now.
    pub fn blocks_needed_for_prompt(&self, prompt: &HashedPrompt) -> usize {
        let hits = self.cached_prefix(prompt);
        let revived = hits
            .iter()
            .filter(|b| self.pool.meta(**b).ref_count == 0)
            .count();
        prompt.num_tokens.div_ceil(self.block_size) - hits.len() + revived
    }

    /// Blocks that admitting `prompt` whole adds to its tenant's count: every block but the hits
    /// the tenant already holds (0 for a prompt without a tenant).
    pub fn blocks_charged_for_prompt(&self, prompt: &HashedPrompt) -> usize {
        let Some(t) = prompt.tenant else {
            return 0;
        };
        let held = self
            .cached_prefix(prompt)
            .iter()
            .filter(|b| self.pool.is_held_by(**b, t))
            .count();
        prompt.num_tokens.div_ceil(self.block_size) - held
    }

    /// Starts `seq` with the longest cached prefix of `prompt`: those blocks are touched (ref+1)
    /// and their tokens need no computation. Returns the cached token count.
    pub fn start_sequence(&mut self, seq: SeqId, prompt: &HashedPrompt) -> Result<usize, KvError> {
        if prompt.num_tokens == 0 {
            return Err(KvError::EmptyPrompt);
        }
        if self.seqs.contains_key(&seq) {
            return Err(KvError::DuplicateSequence(seq));
        }
        let hits = self.cached_prefix(prompt);
        // The cached run goes on in the host tier: those blocks are promoted (new device blocks,
        // as many as the free ones allow).
        let revived = hits
            .iter()
            .filter(|b| self.pool.meta(**b).ref_count == 0)
            .count();
        let promote = self
            .host_run_len(prompt, hits.len())
            .min(self.pool.num_free().saturating_sub(revived));
        // Hits held only by other tenants (or by nobody) are new to this one.
        let new_to_tenant = prompt.tenant.map_or(0, |t| {
            hits.iter()
                .filter(|b| !self.pool.is_held_by(**b, t))
                .count()
                + promote
        });
        self.check_quota(prompt.tenant, new_to_tenant)?;
        let mut table = BlockTable::new();
        for &b in &hits {
            self.pool.touch(b, prompt.tenant);
            table.push(b);
        }
        self.promote_run(prompt, hits.len(), promote, &mut table);
        let cached = table.blocks().len() * self.block_size;
        table.set_num_tokens(cached);
        self.counters.queried_tokens += prompt.num_tokens as u64;
        self.counters.hit_tokens += cached as u64;
        self.seqs.insert(
            seq,
            SeqState {
                scope: prompt.scope,
                tenant: prompt.tenant,
                table,
                host: None,
                hashes: prompt.hashes.clone(),
                chain: prompt.chain,
                partial: Vec::with_capacity(self.block_size),
            },
        );
        Ok(cached)
    }

    /// Starts `seq` and allocates slots for the whole uncached rest of the prompt, atomically.
    pub fn allocate_prompt(
        &mut self,
        seq: SeqId,
        prompt: &HashedPrompt,
        tokens: &[u32],
    ) -> Result<PromptAllocation, KvError> {
        debug_assert_eq!(tokens.len(), prompt.num_tokens);
        let needed = self.blocks_needed_for_prompt(prompt);
        if needed > self.pool.num_free() {
            return Err(KvError::OutOfBlocks {
                needed,
                free: self.pool.num_free(),
            });
        }
        self.check_quota(prompt.tenant, self.blocks_charged_for_prompt(prompt))?;
        let cached_tokens = self.start_sequence(seq, prompt)?;
        self.append_slots(seq, &tokens[cached_tokens..])?;
        Ok(PromptAllocation { cached_tokens })
    }

    /// Blocks that appending `n` tokens to `seq` would allocate (copy-on-write included).
    pub fn blocks_needed_to_append(&self, seq: SeqId, n: usize) -> Result<usize, KvError> {
        let state = self.seqs.get(&seq).ok_or(KvError::UnknownSequence(seq))?;
        Ok(self.append_need(state, n).0)
    }

    /// How many tokens `seq` could append now without running out of free blocks (copy-on-write
    /// included).
    pub fn appendable_tokens(&self, seq: SeqId) -> usize {
        let Some(state) = self.seqs.get(&seq) else {
            return 0;
        };
        let b = self.block_size;
        let free = self.pool.num_free();
        let (_, cow) = self.append_need(state, 1);
        let filled = state.table.last_block_filled(b);
        let room = if state.table.blocks().is_empty() || filled == b {
            0
        } else {
            b - filled
        };
        let free_after_cow = free.saturating_sub(usize::from(cow));
        if cow && free == 0 {
            return 0;
        }
        room + free_after_cow * b
    }

    /// Total device blocks.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Free device blocks (cached ones included: they are evicted on demand).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// (blocks to allocate, copy-on-write needed) for appending `n` tokens.
    fn append_need(&self, state: &SeqState, n: usize) -> (usize, bool) {
        let b = self.block_size;
        let filled = state.table.last_block_filled(b);
        let room = if state.table.blocks().is_empty() || filled == b {
            0
        } else {
            b - filled
        };
        let cow = n > 0
            && room > 0
            && state
                .table
                .blocks()
                .last()
                .is_some_and(|l| self.pool.meta(*l).ref_count > 1);
        let fresh = n.saturating_sub(room).div_ceil(b);
        (fresh + usize::from(cow), cow)
    }

    /// Allocates slots for `tokens`, whose K/V the next forward pass writes. Blocks that fill are
    /// registered in the prefix index at once. A write into a shared partial block copies it first.
    pub fn append_slots(&mut self, seq: SeqId, tokens: &[u32]) -> Result<AppendOutcome, KvError> {
        let state = self.seqs.get(&seq).ok_or(KvError::UnknownSequence(seq))?;
        if state.host.is_some() {
            return Err(KvError::SwappedOut(seq));
        }
        let (needed, cow) = self.append_need(state, tokens.len());
        if needed > self.pool.num_free() {
            return Err(KvError::OutOfBlocks {
                needed,
                free: self.pool.num_free(),
            });
        }
        let (scope, tenant) = (state.scope, state.tenant);
        self.check_quota(tenant, needed)?;
        let mut state = self
            .seqs
            .remove(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        let cow = if cow {
            Some(self.copy_on_write(&mut state))
        } else {
            None
        };
        state.table.reserve(needed);
        let first_pos = state.table.num_tokens();
        let b = self.block_size;
        // Take every new block first: the evictions, then the registrations, each come out as
        // one run of events instead of alternating.
        let fresh = needed - usize::from(cow.is_some());
        for _ in 0..fresh {
            let id = self.allocate_block(scope, tenant);
            state.table.push(id);
        }
        let mut rest = tokens;
        while !rest.is_empty() {
            let pos = state.table.num_tokens();
            let take = rest.len().min(b - pos % b);
            let (now, later) = rest.split_at(take);
            rest = later;
            state.partial.extend_from_slice(now);
            let filled = pos % b + take;
            state.table.set_num_tokens(pos + take);
            let logical = pos / b;
            let id = state.table.blocks()[logical];
            self.pool.set_filled(id, filled as u32);
            if filled == b {
                self.register_full_block(&mut state, logical, id);
            }
        }
        self.seqs.insert(seq, state);
        Ok(AppendOutcome { first_pos, cow })
    }

    fn copy_on_write(&mut self, state: &mut SeqState) -> (BlockId, BlockId) {
        let logical = state.table.blocks().len() - 1;
        let src = state.table.blocks()[logical];
        let dst = self.allocate_block(state.scope, state.tenant);
        let filled = self.pool.meta(src).filled;
        self.pool.set_filled(dst, filled);
        self.pool.release(src, state.tenant);
        state.table.set(logical, dst);
        self.counters.cow_copies += 1;
        (src, dst)
    }

    /// Takes a free block, evicting the cached prefix it held, if any. The caller checked that a
    /// free block exists.
    pub(super) fn allocate_block(&mut self, scope: ScopeId, tenant: Option<TenantId>) -> BlockId {
        let Some((id, evicted)) = self.pool.allocate(scope, tenant) else {
            unreachable!("free blocks were counted before allocating");
        };
        if let Some((hash, old_scope)) = evicted {
            if self.index.remove(hash, id) && !self.demote(hash, old_scope, id) {
                self.events.removed(hash);
            }
            self.counters.evicted_blocks += 1;
        }
        id
    }

    /// Makes full block `id` the device copy of `hash`, unless another block is already: the
    /// prefix index, the block's hash, the event, and the end of any host-tier copy (a block is
    /// never in both). Returns whether it was registered.
    pub(super) fn index_block(
        &mut self,
        hash: BlockHash,
        id: BlockId,
        parent: Option<BlockHash>,
        scope: ScopeId,
    ) -> bool {
        if !self.index.insert(hash, id) {
            return false;
        }
        self.pool.set_hash(id, hash);
        self.host_tier.remove(hash);
        self.events.stored(hash, parent, scope);
        true
    }

    /// Whether a sequence here will compute block `hash`: one of its prompt blocks that its
    /// prefill has not reached yet (a peer asking for it may wait for the step that does).
    pub fn will_compute(&self, hash: BlockHash) -> bool {
        let b = self.block_size;
        self.seqs.values().any(|s| {
            s.host.is_none()
                && s.hashes
                    .iter()
                    .skip(s.table.num_tokens() / b)
                    .any(|&h| h == hash)
        })
    }

    fn register_full_block(&mut self, state: &mut SeqState, logical: usize, id: BlockId) {
        let parent = logical.checked_sub(1).map(|p| state.hashes[p]);
        // Prompt blocks were hashed at admission; later blocks (generated tokens) now.
        let hash = if logical < state.hashes.len() {
            state.hashes[logical]
        } else {
            state.chain = self.hasher.next(&state.chain, &state.partial);
            let h = state.chain.key();
            state.hashes.push(h);
            h
        };
        state.partial.clear();
        self.index_block(hash, id, parent, state.scope);
    }

    /// Refuses `needed` more blocks for `tenant` past its quota (nothing without one).
    pub(crate) fn check_quota(
        &self,
        tenant: Option<TenantId>,
        needed: usize,
    ) -> Result<(), KvError> {
        let Some((tenant, quota)) = tenant.and_then(|t| Some((t, self.quota(t)?))) else {
            return Ok(());
        };
        let used = self.pool.used_by_tenant(tenant);
        if used as usize + needed > quota as usize {
            return Err(KvError::QuotaExceeded {
                tenant,
                used,
                needed,
                quota,
            });
        }
        Ok(())
    }

    /// `child` shares every block of `parent` (ref+1 each); the first write into the shared
    /// partial last block copies it.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), KvError> {
        if self.seqs.contains_key(&child) {
            return Err(KvError::DuplicateSequence(child));
        }
        let state = self
            .seqs
            .get(&parent)
            .ok_or(KvError::UnknownSequence(parent))?;
        if state.host.is_some() {
            return Err(KvError::SwappedOut(parent));
        }
        let state = state.clone();
        for &b in state.table.blocks() {
            self.pool.touch(b, state.tenant);
        }
        self.seqs.insert(child, state);
        Ok(())
    }

    /// Ends `seq` and releases its blocks, last block first, so its tail is evicted before its
    /// prefix. Full blocks stay cached until reused.
    pub fn free(&mut self, seq: SeqId) -> Result<(), KvError> {
        let state = self
            .seqs
            .remove(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        for &b in state.table.blocks().iter().rev() {
            self.pool.release(b, state.tenant);
        }
        if let Some(host) = state.host {
            for &h in host.iter().rev() {
                self.host.release(h);
            }
        }
        Ok(())
    }

    /// Drops cached prefixes: every one, or those of one scope. Blocks in use stay with their
    /// sequences but can no longer be hit. Returns the number of hashes dropped.
    /// Every tier is flushed: the host tier's blocks, and the disk tier's files.
    pub fn flush(&mut self, scope: Option<ScopeId>) -> usize {
        let victims: Vec<(BlockHash, BlockId)> = self
            .index
            .iter()
            .filter(|(_, b)| scope.is_none_or(|s| self.pool.meta(*b).scope == s))
            .collect();
        for &(hash, id) in &victims {
            self.index.remove(hash, id);
            self.pool.clear_hash(id);
        }
        let mut dropped: Vec<BlockHash> = victims.iter().map(|(h, _)| *h).collect();
        dropped.extend(self.host_tier.remove_scope(scope).iter().map(|b| b.hash));
        if let Some(disk) = &mut self.disk_tier {
            let gone = disk.remove_scope(scope);
            match scope {
                None => self.tier_ops.push(TierOp::DeleteAll),
                Some(_) => self
                    .tier_ops
                    .extend(gone.iter().map(|b| TierOp::Delete { hash: b.hash })),
            }
            dropped.extend(gone.iter().map(|b| b.hash));
        }
        dropped.sort_unstable();
        dropped.dedup();
        match scope {
            None => self.events.cleared(),
            Some(_) => self.events.removed_many(dropped.iter().copied()),
        }
        dropped.len()
    }

    pub fn usage(&self) -> KvUsage {
        let free = self.pool.num_free();
        KvUsage {
            capacity: self.pool.num_blocks(),
            used: self.pool.num_blocks() - free,
            cached: self.pool.num_cached_free(),
            free: free - self.pool.num_cached_free(),
            filled_slots: self.pool.filled_in_use(),
            host_capacity: self.host.num_blocks(),
            host_used: self.host.num_blocks() - self.host.num_free(),
            host_cached: self.host_tier.len(),
            host_cache_capacity: self.host_tier.capacity(),
            disk_cached: self.disk_tier.as_ref().map_or(0, TierStore::len),
            disk_capacity: self.disk_tier.as_ref().map_or(0, TierStore::capacity),
        }
    }

    pub fn counters(&self) -> KvCounters {
        self.counters
    }

    /// Takes the KV events produced since the last call.
    pub fn drain_events(&mut self) -> Vec<KvEventRecord> {
        self.events.drain(&self.scopes)
    }

    /// Every cached hash with its scope and the fastest tier holding it, and the sequence number
    /// of the last event it reflects: a consumer re-syncs by replacing its index with this, then
    /// applying events after `seq`. Call it after draining pending events.
    pub fn snapshot(&self) -> (u64, Vec<SnapshotBlock>) {
        debug_assert!(!self.events.has_pending(), "drain events before a snapshot");
        let block = |scope: ScopeId, hash, tier| SnapshotBlock {
            scope: self.scope_name(scope).to_owned(),
            hash,
            tier,
        };
        let mut blocks: Vec<SnapshotBlock> = self
            .index
            .iter()
            .map(|(h, b)| block(self.pool.meta(b).scope, h, Tier::Device))
            .collect();
        blocks.extend(
            self.host_tier
                .iter()
                .map(|(_, b)| block(b.scope, b.hash, Tier::Host)),
        );
        if let Some(disk) = self.disk_tier.as_ref().filter(|_| !self.disk_off) {
            blocks.extend(
                disk.iter()
                    .filter(|(_, b)| !self.is_faster_than_disk(b.hash))
                    .map(|(_, b)| block(b.scope, b.hash, Tier::Disk)),
            );
        }
        (self.events.last_seq(), blocks)
    }

    /// Drains pending events, then snapshots (for tests).
    #[cfg(test)]
    pub(crate) fn snapshot_after_drain(&mut self) -> Vec<SnapshotBlock> {
        self.drain_events();
        self.snapshot().1
    }

    pub fn block_table(&self, seq: SeqId) -> Option<&BlockTable> {
        self.seqs.get(&seq).map(|s| &s.table)
    }

    /// Host blocks a swapped-out sequence holds.
    pub fn swapped_blocks(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq)?.host.as_ref().map(Vec::len)
    }

    pub fn is_swapped_out(&self, seq: SeqId) -> bool {
        self.seqs.get(&seq).is_some_and(|s| s.host.is_some())
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// The host tier's blocks by slot.
    pub fn host_tier(&self) -> &TierStore {
        &self.host_tier
    }

    /// The disk tier's blocks, when it is on.
    pub fn disk_tier(&self) -> Option<&TierStore> {
        self.disk_tier.as_ref().filter(|_| !self.disk_off)
    }

    /// A public fingerprint of the hash recipe for `purpose` (see `BlockHasher::fingerprint`).
    pub fn fingerprint(&self, purpose: &str) -> [u8; 16] {
        self.hasher.fingerprint(purpose)
    }

    /// A secret key derived from the hash recipe for `purpose` (see `BlockHasher::secret_key`).
    pub fn secret_key(&self, purpose: &str) -> [u8; 32] {
        self.hasher.secret_key(purpose)
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }
}
