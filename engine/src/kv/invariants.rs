//! A full consistency check of the block manager, for tests (O(blocks + table entries)).

use super::manager::KvCacheManager;
use super::{BlockId, TenantId};
use std::collections::HashMap;

impl KvCacheManager {
    /// Checks every invariant the block manager relies on; the error names the first violation.
    ///
    /// - a block's ref count is the number of block-table entries that hold it, and likewise on
    ///   the host;
    /// - a block is in the free list exactly when its ref count is 0, and the counts agree;
    /// - the prefix index and the blocks' hashes agree both ways;
    /// - no block is both in the device pool and in the host tier;
    /// - each table has one block per started `block_size` tokens, every block but the last full;
    /// - per-scope usage and the filled-slot total match a recount;
    /// - each block's holding tenants and their references, and each tenant's block count, match
    ///   the tables of that tenant's sequences.
    pub fn check_invariants(&self) -> Result<(), String> {
        let b = self.block_size;
        let mut refs = vec![0u32; self.pool.num_blocks()];
        let mut host_refs = vec![0u32; self.host.num_blocks()];
        let mut holds: HashMap<(BlockId, TenantId), u32> = HashMap::new();
        for (seq, state) in &self.seqs {
            let n = state.table.num_tokens();
            if let Some(host) = &state.host {
                if host.len() != n.div_ceil(b) || !state.table.blocks().is_empty() {
                    return Err(format!("{seq:?}: swapped table has the wrong shape"));
                }
                host.iter().for_each(|h| host_refs[h.0 as usize] += 1);
                continue;
            }
            let blocks = state.table.blocks();
            if blocks.len() != n.div_ceil(b) {
                return Err(format!("{seq:?}: {} blocks for {n} tokens", blocks.len()));
            }
            for (i, id) in blocks.iter().enumerate() {
                refs[id.0 as usize] += 1;
                if let Some(t) = state.tenant {
                    *holds.entry((*id, t)).or_default() += 1;
                }
                let want = if i + 1 == blocks.len() { n - i * b } else { b };
                let filled = self.pool.meta(*id).filled as usize;
                if filled != want {
                    return Err(format!("{seq:?}: {id:?} filled {filled}, expected {want}"));
                }
            }
            if state.hashes.len() < n / b {
                return Err(format!("{seq:?}: full blocks without a hash"));
            }
        }
        let free: Vec<_> = self.pool.free_list().collect();
        if free.len() != self.pool.num_free() {
            return Err("free list length differs from its count".into());
        }
        let mut filled_in_use = 0;
        let mut per_scope: HashMap<u32, u32> = HashMap::new();
        let mut cached_free = 0;
        for id in self.pool.ids() {
            let meta = self.pool.meta(id);
            if meta.ref_count != refs[id.0 as usize] {
                return Err(format!(
                    "{id:?}: ref count {} but {} table entries",
                    meta.ref_count, refs[id.0 as usize]
                ));
            }
            if (meta.ref_count == 0) != self.pool.is_free(id) {
                return Err(format!("{id:?}: free flag disagrees with ref count"));
            }
            if meta.ref_count > 0 {
                filled_in_use += meta.filled as usize;
                *per_scope.entry(meta.scope.0).or_default() += 1;
            } else if meta.hash.is_some() {
                cached_free += 1;
            }
            if let Some(h) = meta.hash {
                if self.index.get(h) != Some(id) {
                    return Err(format!("{id:?} holds {h} but the index disagrees"));
                }
                if meta.filled as usize != b {
                    return Err(format!("{id:?} is cached but not full"));
                }
            }
        }
        for (h, id) in self.index.iter() {
            if self.pool.meta(id).hash != Some(h) {
                return Err(format!("index {h} -> {id:?}, which holds another hash"));
            }
        }
        if cached_free != self.pool.num_cached_free() {
            return Err("cached-free count is off".into());
        }
        if filled_in_use != self.pool.filled_in_use() {
            return Err("filled-slot count is off".into());
        }
        for (i, _) in self.scopes.iter().enumerate() {
            let want = per_scope.get(&(i as u32)).copied().unwrap_or(0);
            let got = self.pool.used_by_scope(super::ScopeId(i as u32));
            if want != got {
                return Err(format!("scope {i}: {got} blocks counted, {want} in use"));
            }
        }
        let mut by_block: HashMap<BlockId, Vec<(TenantId, u32)>> = HashMap::new();
        for ((id, t), n) in holds {
            by_block.entry(id).or_default().push((t, n));
        }
        let mut per_tenant: HashMap<TenantId, u32> = HashMap::new();
        for id in self.pool.ids() {
            let mut got = self.pool.holders(id).to_vec();
            got.sort_unstable();
            let mut want = by_block.remove(&id).unwrap_or_default();
            want.sort_unstable();
            if got != want {
                return Err(format!("{id:?}: holders {got:?}, tables say {want:?}"));
            }
            for (t, _) in want {
                *per_tenant.entry(t).or_default() += 1;
            }
        }
        let tenants = per_tenant.keys().map(|t| t.0 + 1).max().unwrap_or(0);
        for t in (0..tenants.max(self.quotas.len() as u32)).map(TenantId) {
            let want = per_tenant.get(&t).copied().unwrap_or(0);
            let got = self.pool.used_by_tenant(t);
            if want != got {
                return Err(format!("{t:?}: {got} blocks counted, {want} held"));
            }
        }
        for (_, block) in self.host_tier.iter() {
            if self.index.get(block.hash).is_some() {
                return Err(format!(
                    "{} is in both the device pool and the host tier",
                    block.hash
                ));
            }
        }
        for (i, want) in host_refs.iter().enumerate() {
            let got = self.host.ref_count(super::HostBlockId(i as u32));
            if *want != got {
                return Err(format!("host block {i}: ref count {got}, {want} entries"));
            }
        }
        Ok(())
    }
}
