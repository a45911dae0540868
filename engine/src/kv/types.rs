//! The block manager's public value types: its configuration, errors, and the results of its
//! operations.

use super::tier::TierConfig;
use super::{BlockId, HostBlockId, ScopeId, SeqId, TenantId};
use kvgate_protocol::{BlockHash, BlockHasher, Chain};

/// Sizes of the pools and the hash recipe.
#[derive(Debug, Clone)]
pub struct KvConfig {
    /// Device blocks.
    pub num_blocks: u32,
    /// Host blocks for swapped-out sequences (0: swap disabled).
    pub num_host_blocks: u32,
    /// The deployment's block hasher; its block size is the pool's.
    pub hasher: BlockHasher,
    /// The slower tiers cached blocks demote to.
    pub tiers: TierConfig,
}

/// Why a KV operation was refused. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("unknown sequence {0:?}")]
    UnknownSequence(SeqId),
    #[error("sequence {0:?} already exists")]
    DuplicateSequence(SeqId),
    #[error("out of KV blocks: {needed} needed, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("out of host swap blocks: {needed} needed, {free} free")]
    OutOfHostBlocks { needed: usize, free: usize },
    #[error(
        "tenant {tenant:?} is over its KV block quota: {used} used + {needed} needed > {quota}"
    )]
    QuotaExceeded {
        tenant: TenantId,
        used: u32,
        needed: usize,
        quota: u32,
    },
    #[error("sequence {0:?} is swapped out")]
    SwappedOut(SeqId),
    #[error("sequence {0:?} is not swapped out")]
    NotSwappedOut(SeqId),
    #[error("the prompt is empty")]
    EmptyPrompt,
}

impl KvError {
    /// A stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            KvError::UnknownSequence(_) => "unknown_sequence",
            KvError::DuplicateSequence(_) => "duplicate_sequence",
            KvError::OutOfBlocks { .. } => "out_of_blocks",
            KvError::OutOfHostBlocks { .. } => "out_of_host_blocks",
            KvError::QuotaExceeded { .. } => "kv_quota_exceeded",
            KvError::SwappedOut(_) => "swapped_out",
            KvError::NotSwappedOut(_) => "not_swapped_out",
            KvError::EmptyPrompt => "empty_prompt",
        }
    }
}

/// A prompt's block hashes in its scope, computed once at admission by
/// [`super::KvCacheManager::hash_prompt`] (the only constructor, so the hashes always match the tokens),
/// and the tenant its blocks are charged to, if any ([`HashedPrompt::for_tenant`]).
#[derive(Debug, Clone)]
pub struct HashedPrompt {
    pub(super) scope: ScopeId,
    pub(super) tenant: Option<TenantId>,
    pub(super) hashes: Vec<BlockHash>,
    /// Chain after the last full block (the scope's start chain when there is none).
    pub(super) chain: Chain,
    pub(super) num_tokens: usize,
}

impl HashedPrompt {
    /// Charges the sequence started from this prompt to `tenant`: its blocks count against the
    /// tenant's quota and in its block count.
    pub fn for_tenant(mut self, tenant: TenantId) -> Self {
        self.tenant = Some(tenant);
        self
    }

    pub fn scope(&self) -> ScopeId {
        self.scope
    }

    pub fn tenant(&self) -> Option<TenantId> {
        self.tenant
    }

    /// Hashes of the prompt's full blocks.
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
}

/// Result of [`super::KvCacheManager::allocate_prompt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptAllocation {
    /// Leading prompt tokens whose KV is already cached (a multiple of the block size).
    pub cached_tokens: usize,
}

/// Result of [`super::KvCacheManager::append_slots`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendOutcome {
    /// Logical position of the first appended token (its slot is `table.slot(pos)`).
    pub first_pos: usize,
    /// A copy-on-write the kernels must do before this step writes: `(src, dst)`.
    pub cow: Option<(BlockId, BlockId)>,
}

/// Block copies to carry out for a swap, before the next forward pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SwapPlan {
    /// Device -> host copies (swap out).
    pub to_host: Vec<(BlockId, HostBlockId)>,
    /// Host -> device copies (swap in).
    pub to_device: Vec<(HostBlockId, BlockId)>,
}

/// Occupancy of the pools, for metrics and the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvUsage {
    pub capacity: usize,
    /// Blocks held by at least one sequence.
    pub used: usize,
    /// Free blocks that still hold a cached prefix.
    pub cached: usize,
    /// Free blocks holding nothing.
    pub free: usize,
    /// Token slots written in used blocks.
    pub filled_slots: usize,
    pub host_capacity: usize,
    pub host_used: usize,
    /// Cached blocks in the host tier, and its slots.
    pub host_cached: usize,
    pub host_cache_capacity: usize,
    /// Cached blocks in the disk tier, and its slots (0 when it is off).
    pub disk_cached: usize,
    pub disk_capacity: usize,
}

/// Cumulative counters, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvCounters {
    pub queried_tokens: u64,
    pub hit_tokens: u64,
    pub evicted_blocks: u64,
    pub cow_copies: u64,
    pub swapped_out_blocks: u64,
    pub swapped_in_blocks: u64,
}
