//! The paged KV cache's bookkeeping (PagedAttention): which physical block holds which tokens of
//! which sequence, which blocks are shared, and which cached blocks to evict next.
//!
//! The pipeline, one file each:
//! - [`block_pool`]: physical blocks with ref counts and holding tenants; free blocks in an O(1)
//!   intrusive LRU list.
//! - [`prefix_index`]: block hash -> block, longest-run lookup.
//! - [`block_table`]: per-sequence logical -> physical mapping.
//! - [`host_pool`]: host (CPU) blocks that preempted sequences are swapped into.
//! - [`tier`]: the host-memory and disk tiers that evicted cached blocks live on in.
//! - [`manager`]: [`KvCacheManager`], the API the scheduler calls.
//!
//! This module only decides; the kernels move the bytes (copy-on-write copies and swaps are
//! returned as plans).

pub mod block_pool;
pub mod block_table;
mod event_log;
pub mod host_pool;
mod invariants;
pub mod manager;
pub mod prefix_index;
mod swap;
pub mod tier;
pub mod types;

pub use block_pool::BlockPool;
pub use block_table::BlockTable;
pub use event_log::EventLog;
pub use manager::KvCacheManager;
pub use prefix_index::PrefixIndex;
pub use tier::{TierBlock, TierConfig, TierCounters, TierOp};
pub use types::{
    AppendOutcome, HashedPrompt, KvConfig, KvCounters, KvError, KvUsage, PromptAllocation, SwapPlan,
};

use std::fmt;

/// A physical block in the device pool.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// A block in the host (swap) pool.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostBlockId(pub u32);

/// A sequence: one stream of tokens (a request with `n = 4` has four).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// An interned cache scope (a tenant's own scope, or a shared one an operator assigned).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct ScopeId(pub u32);

/// A tenant, interned by the engine. KV quotas and per-tenant block counts belong to tenants,
/// not scopes: tenants that share a scope share cached prefixes, never each other's quota.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct TenantId(pub u32);

macro_rules! id_debug {
    ($($t:ident => $p:literal),*) => {$(
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($p, "{}"), self.0)
            }
        }
    )*};
}
id_debug!(BlockId => "b", HostBlockId => "h", SeqId => "seq");

#[cfg(test)]
mod tests;

/// A manager over a test deployment's hash recipe (model `test`, seed of zeros).
pub fn test_manager(num_blocks: u32, num_host_blocks: u32, block_size: u32) -> KvCacheManager {
    test_manager_tiered(
        num_blocks,
        num_host_blocks,
        block_size,
        TierConfig::default(),
    )
}

/// [`test_manager`] with slower tiers.
pub fn test_manager_tiered(
    num_blocks: u32,
    num_host_blocks: u32,
    block_size: u32,
    tiers: TierConfig,
) -> KvCacheManager {
    let params = kvgate_protocol::HashParams {
        model_id: "test".into(),
        weight_version: "0".into(),
        kv_dtype: "f32".into(),
        block_size,
        seed: [0; 32],
    };
    KvCacheManager::new(KvConfig {
        num_blocks,
        num_host_blocks,
        hasher: kvgate_protocol::BlockHasher::new(&params),
        tiers,
    })
}
