//! Continuous batching at iteration level over the paged KV cache.
//!
//! Each step the scheduler builds a [`StepPlan`] within a token budget (`max_batched_tokens`) and
//! a sequence cap (`max_seqs`):
//! 1. every running sequence gets the slot for its next token (decode), oldest group first (a
//!    tenant's constrained groups within its share of the step's grammar-mask time); when
//!    blocks run out, the lowest-priority, latest-arrived group is preempted whole, by recompute
//!    (its full blocks stay cached, so the resume mostly hits) or by swap to host blocks; when a
//!    tenant's KV quota runs out, the same within that tenant. Every preemption happens before
//!    any slot of the step is allocated, so a victim never leaves work in the plan;
//! 2. swapped-out groups come back in arrival order while blocks (and their tenant's quota)
//!    allow;
//! 3. prefills: unfinished chunked prefills first, then new groups, chosen across tenants by
//!    weighted fair queuing (each tenant's served tokens divided by its weight) and FIFO within a
//!    tenant. A tenant at its KV quota waits; other tenants go on. A prompt is cut into chunks that
//!    fit what is left of the token budget, which in a step that decodes is at most
//!    `decode_step_prefill_tokens`: a long prompt is spread over steps instead of holding every
//!    running sequence's next token back (inter-token latency against time to first token).
//!
//! KV quotas belong to tenants, not cache scopes: tenants that share a scope share cached
//! prefixes, and each is held to its own quota, which every request restates
//! ([`Scheduler::update_tenant`]).
//!
//! A group that could never fit, even alone in an empty pool or within its tenant's quota (also
//! one lowered after it was queued), is rejected instead of being preempted or kept waiting for
//! ever.
//!
//! Files: [`sequence`] (groups and sequences), [`fairness`] (tenant queues), [`plan`] (the step
//! plan), [`core`] (the scheduler's state and the step), [`decode`] (decodes and preemption),
//! [`prefill`] (prefills and admission), [`quota`] (tenants' KV quotas at admission), [`masks`]
//! (tenants' shares of the grammar masks' time).

mod core;
mod decode;
pub mod fairness;
mod masks;
pub mod plan;
mod prefill;
mod quota;
pub mod sequence;

pub use self::core::{Backlog, NewGroup, Scheduler, SchedulerConfig, SchedulerStats};
pub use fairness::TenantId;
pub use plan::{PreemptMode, StepItem, StepPlan};
pub use sequence::{FinishReason, GroupId, SeqGroup, SeqStatus, Sequence};

#[cfg(test)]
mod tests;
