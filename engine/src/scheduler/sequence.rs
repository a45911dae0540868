//! Sequence groups: one request, with its `n` parallel samples as sequences.

use super::fairness::TenantId;
use crate::kv::{HashedPrompt, ScopeId, SeqId};
use kvgate_protocol::BlockHash;

/// One request.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct GroupId(pub u64);

/// Why a sequence ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens`.
    Length,
    /// The client went away or the request was cancelled.
    Aborted,
    /// Refused by the scheduler (it can never fit), with the reason.
    Rejected(String),
}

/// Where a group is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    Running,
    Swapped,
}

/// One stream of tokens.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub id: SeqId,
    /// Prompt, then generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose K/V is in the cache (or being written by the step in flight).
    pub num_computed: usize,
    pub finished: Option<FinishReason>,
}

impl Sequence {
    /// Tokens not yet computed: the rest of a prompt, or the last sampled token.
    pub fn num_uncomputed(&self) -> usize {
        self.tokens.len() - self.num_computed
    }
}

/// A request: its samples, tenant, scope and place in line.
#[derive(Debug, Clone)]
pub struct SeqGroup {
    pub id: GroupId,
    pub tenant: TenantId,
    pub scope: ScopeId,
    /// Admission order: lower is older.
    pub arrival: u64,
    pub prompt_len: usize,
    /// Samples wanted: the prompt is prefilled once, then forked.
    pub n: usize,
    pub max_tokens: usize,
    pub seqs: Vec<Sequence>,
    pub status: SeqStatus,
    /// Prompt tokens that came from the prefix cache at first admission.
    pub cached_tokens: usize,
    /// The prompt's hashes, kept for the first admission.
    pub(crate) hashed: Option<HashedPrompt>,
    /// The prompt's block hashes, for as long as the group lives: a group waiting to be
    /// admitted again (preempted) computes them again ([`super::Scheduler::will_compute`]).
    pub(crate) prompt_hashes: std::sync::Arc<[BlockHash]>,
    /// Times this group was preempted.
    pub preemptions: u32,
}

impl SeqGroup {
    /// Sequences still generating.
    pub fn live(&self) -> impl Iterator<Item = &Sequence> {
        self.seqs.iter().filter(|s| s.finished.is_none())
    }

    pub fn is_finished(&self) -> bool {
        self.seqs.len() == self.n && self.seqs.iter().all(|s| s.finished.is_some())
    }

    /// Whether the prompt (and any recompute) is still being prefilled.
    pub fn in_prefill(&self) -> bool {
        self.live().any(|s| s.num_uncomputed() > 1)
            || (self.seqs.len() == 1 && self.seqs[0].num_computed < self.prompt_len)
    }
}
