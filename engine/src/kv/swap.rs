//! Swap preemption: a sequence group's blocks move to host memory and back.
//!
//! A group (every sequence forked from one request) is swapped as a unit, so a block shared within
//! the group gets exactly one host copy. Swap-in first looks each block's hash up in the device
//! index: a prefix still cached on the device is touched instead of copied back.

use super::manager::{HostMeta, KvCacheManager};
use super::types::{KvError, SwapPlan};
use super::{BlockId, BlockTable, HostBlockId, SeqId};
use std::collections::HashMap;

impl KvCacheManager {
    /// Moves `group` to host blocks. The caller copies `plan.to_host` before the next forward
    /// pass writes (the device blocks are free from now on).
    pub fn swap_out(&mut self, group: &[SeqId]) -> Result<SwapPlan, KvError> {
        let mut distinct: Vec<BlockId> = Vec::new();
        let mut seen: HashMap<BlockId, usize> = HashMap::new();
        for &seq in group {
            let state = self.seqs.get(&seq).ok_or(KvError::UnknownSequence(seq))?;
            if state.host.is_some() {
                return Err(KvError::SwappedOut(seq));
            }
            for &b in state.table.blocks() {
                seen.entry(b).or_insert_with(|| {
                    distinct.push(b);
                    distinct.len() - 1
                });
            }
        }
        if distinct.len() > self.host.num_free() {
            return Err(KvError::OutOfHostBlocks {
                needed: distinct.len(),
                free: self.host.num_free(),
            });
        }
        let mut host_of = Vec::with_capacity(distinct.len());
        let mut plan = SwapPlan::default();
        for &b in &distinct {
            let Some(h) = self.host.allocate() else {
                unreachable!("host blocks were counted before allocating");
            };
            let meta = self.pool.meta(b);
            self.host_meta[h.0 as usize] = HostMeta {
                hash: meta.hash,
                filled: meta.filled,
            };
            host_of.push(h);
            plan.to_host.push((b, h));
        }
        let mut first_use = vec![true; distinct.len()];
        for &seq in group {
            let Some(state) = self.seqs.get_mut(&seq) else {
                continue;
            };
            let blocks = state.table.blocks().to_vec();
            let host: Vec<HostBlockId> = blocks
                .iter()
                .map(|b| {
                    let i = seen[b];
                    if !std::mem::replace(&mut first_use[i], false) {
                        self.host.touch(host_of[i]);
                    }
                    host_of[i]
                })
                .collect();
            state.host = Some(host);
            state.table.replace_all(Vec::new());
            for &b in blocks.iter().rev() {
                self.pool.release(b, state.tenant);
            }
        }
        self.counters.swapped_out_blocks += plan.to_host.len() as u64;
        Ok(plan)
    }

    /// Distinct host blocks a swapped-out group holds (blocks its sequences share count once):
    /// the most device blocks its swap-in takes.
    pub fn swapped_group_blocks(&self, group: &[SeqId]) -> usize {
        let mut seen = std::collections::HashSet::new();
        for seq in group {
            if let Some(host) = self.seqs.get(seq).and_then(|s| s.host.as_ref()) {
                seen.extend(host.iter().copied());
            }
        }
        seen.len()
    }

    /// Brings `group` back to device blocks. The caller copies `plan.to_device` before the next
    /// forward pass reads them.
    pub fn swap_in(&mut self, group: &[SeqId]) -> Result<SwapPlan, KvError> {
        let mut distinct: Vec<HostBlockId> = Vec::new();
        let mut parents = Vec::new();
        // The sequence that first uses each block takes its first reference, in its tenant's name.
        let mut first_tenant = Vec::new();
        let mut seen: HashMap<HostBlockId, usize> = HashMap::new();
        for &seq in group {
            let state = self.seqs.get(&seq).ok_or(KvError::UnknownSequence(seq))?;
            let Some(host) = &state.host else {
                return Err(KvError::NotSwappedOut(seq));
            };
            for (logical, &h) in host.iter().enumerate() {
                seen.entry(h).or_insert_with(|| {
                    distinct.push(h);
                    parents.push(logical.checked_sub(1).map(|p| state.hashes[p]));
                    first_tenant.push(state.tenant);
                    distinct.len() - 1
                });
            }
        }
        // Blocks whose prefix is still cached on the device are reused, not copied.
        let reuse: Vec<Option<BlockId>> = distinct
            .iter()
            .map(|h| {
                self.host_meta[h.0 as usize]
                    .hash
                    .and_then(|hash| self.index.get(hash))
            })
            .collect();
        let needed = reuse
            .iter()
            .filter(|r| r.is_none_or(|b| self.pool.meta(b).ref_count == 0))
            .count();
        if needed > self.pool.num_free() {
            return Err(KvError::OutOfBlocks {
                needed,
                free: self.pool.num_free(),
            });
        }
        let scope = self.seqs[&group[0]].scope;
        let mut device_of = Vec::with_capacity(distinct.len());
        let mut plan = SwapPlan::default();
        for (((&h, r), parent), tenant) in
            distinct.iter().zip(&reuse).zip(parents).zip(first_tenant)
        {
            let id = match r {
                Some(b) => {
                    self.pool.touch(*b, tenant);
                    *b
                }
                None => {
                    let b = self.allocate_block(scope, tenant);
                    let meta = self.host_meta[h.0 as usize];
                    self.pool.set_filled(b, meta.filled);
                    if let Some(hash) = meta.hash {
                        self.index_block(hash, b, parent, scope);
                    }
                    plan.to_device.push((h, b));
                    b
                }
            };
            device_of.push(id);
        }
        let mut first_use = vec![true; distinct.len()];
        for &seq in group {
            let Some(state) = self.seqs.get_mut(&seq) else {
                continue;
            };
            let Some(host) = state.host.take() else {
                continue;
            };
            let mut table = BlockTable::new();
            for h in &host {
                let i = seen[h];
                if !std::mem::replace(&mut first_use[i], false) {
                    self.pool.touch(device_of[i], state.tenant);
                }
                table.push(device_of[i]);
            }
            table.set_num_tokens(state.table.num_tokens());
            state.table = table;
            for &h in host.iter().rev() {
                self.host.release(h);
            }
        }
        self.counters.swapped_in_blocks += plan.to_device.len() as u64;
        Ok(plan)
    }
}
