//! The scheduling algorithm (see the module docs of [`crate::scheduler`]).

use super::fairness::{FairQueues, TenantId};
use super::masks::MaskShares;
use super::plan::{PreemptMode, StepPlan};
use super::sequence::{FinishReason, GroupId, SeqGroup, SeqStatus, Sequence};
use crate::kv::{KvCacheManager, ScopeId, SeqId};
use kvgate_protocol::BlockHash;
use std::collections::HashMap;

/// Limits of one step and the preemption mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_batched_tokens: usize,
    /// The most prompt tokens a step that also decodes computes: a long prefill is spread over
    /// steps instead of holding every running request's next token back.
    pub decode_step_prefill_tokens: usize,
    pub max_seqs: usize,
    pub preempt_mode: PreemptMode,
}

/// Cumulative counters, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub preempted_recompute: u64,
    pub preempted_swap: u64,
    pub steps: u64,
}

/// What the queue holds: the rest of the prefills in progress (which go before any admission),
/// the uncached prompt tokens of waiting groups per tenant (net of the prefix the cache holds for
/// them now), and the fewest tokens a running group may still generate before its `max_tokens`
/// ends it (`None` with nothing decoding).
#[derive(Debug, Clone, Default)]
pub struct Backlog {
    pub running_prefill: u64,
    pub waiting: HashMap<TenantId, u64>,
    pub next_end: Option<usize>,
}

/// A new request for [`Scheduler::add`].
#[derive(Debug, Clone)]
pub struct NewGroup {
    pub id: GroupId,
    pub tenant: TenantId,
    /// Tenant priority weight (higher: served more, preempted last).
    pub priority: f64,
    pub scope: ScopeId,
    pub prompt: Vec<u32>,
    pub n: usize,
    pub max_tokens: usize,
}

/// The engine's sequences and the policy that batches them.
#[derive(Debug)]
pub struct Scheduler {
    pub(super) config: SchedulerConfig,
    pub kv: KvCacheManager,
    pub(super) groups: HashMap<GroupId, SeqGroup>,
    pub(super) priorities: HashMap<GroupId, f64>,
    pub(super) waiting: FairQueues,
    /// Running groups, oldest arrival first.
    pub(super) running: Vec<GroupId>,
    /// Swapped-out groups, oldest arrival first.
    pub(super) swapped: Vec<GroupId>,
    pub(super) next_arrival: u64,
    pub(super) next_seq: u64,
    pub(super) stats: SchedulerStats,
    /// Constrained groups' mask times and each tenant's share of a step's.
    pub(super) masks: MaskShares,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, kv: KvCacheManager) -> Self {
        Scheduler {
            config,
            kv,
            groups: HashMap::new(),
            priorities: HashMap::new(),
            waiting: FairQueues::default(),
            running: Vec::new(),
            swapped: Vec::new(),
            next_arrival: 0,
            next_seq: 0,
            stats: SchedulerStats::default(),
            masks: MaskShares::default(),
        }
    }

    pub fn config(&self) -> SchedulerConfig {
        self.config
    }

    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// Applies what a request says of its tenant: its priority weight and its KV block quota.
    /// Every request carries the tenant's current settings, so `None` removes a quota the tenant
    /// had. Groups already queued are held to the new quota; those it can never fit are refused
    /// when their turn comes.
    pub fn update_tenant(&mut self, tenant: TenantId, weight: f64, kv_quota: Option<u32>) {
        self.waiting.set_weight(tenant, weight);
        self.kv.set_quota(tenant, kv_quota);
    }

    /// KV blocks a group may need at most: its prompt, and for each sample its tokens plus one
    /// block of copy-on-write.
    fn worst_blocks(&self, prompt_len: usize, n: usize, max_tokens: usize) -> usize {
        let b = self.kv.block_size();
        prompt_len.div_ceil(b) + n * (max_tokens.div_ceil(b) + 1)
    }

    pub(super) fn group_worst_blocks(&self, gid: GroupId) -> Option<usize> {
        let g = self.groups.get(&gid)?;
        Some(self.worst_blocks(g.prompt_len, g.n, g.max_tokens))
    }

    /// Running groups, oldest first.
    pub(super) fn running_groups(&self) -> impl Iterator<Item = &SeqGroup> {
        self.running.iter().filter_map(|g| self.groups.get(g))
    }

    /// Queues a request, or refuses it when it could never fit (livelock guard).
    pub fn add(&mut self, g: NewGroup) -> Result<(), String> {
        let worst = self.worst_blocks(g.prompt.len(), g.n, g.max_tokens);
        if worst > self.kv.num_blocks() {
            return Err(format!(
                "the request needs up to {worst} KV blocks ({} prompt tokens, max_tokens {}, n {}); \
                 this engine has {}",
                g.prompt.len(),
                g.max_tokens,
                g.n,
                self.kv.num_blocks()
            ));
        }
        if let Some(q) = self.kv.quota(g.tenant) {
            if worst > q as usize {
                return Err(format!(
                    "the request needs up to {worst} KV blocks, over its tenant's quota of {q}"
                ));
            }
        }
        let hashed = self.kv.hash_prompt(g.scope, &g.prompt).for_tenant(g.tenant);
        let seq = self.new_seq_id();
        self.groups.insert(
            g.id,
            SeqGroup {
                id: g.id,
                tenant: g.tenant,
                scope: g.scope,
                arrival: self.next_arrival,
                prompt_len: g.prompt.len(),
                n: g.n,
                max_tokens: g.max_tokens,
                seqs: vec![Sequence {
                    id: seq,
                    tokens: g.prompt,
                    num_computed: 0,
                    finished: None,
                }],
                status: SeqStatus::Waiting,
                cached_tokens: 0,
                prompt_hashes: hashed.hashes().into(),
                hashed: Some(hashed),
                preemptions: 0,
            },
        );
        self.priorities.insert(g.id, g.priority);
        self.next_arrival += 1;
        self.waiting.push_back(g.tenant, g.id);
        Ok(())
    }

    fn new_seq_id(&mut self) -> SeqId {
        self.next_seq += 1;
        SeqId(self.next_seq)
    }

    pub fn group(&self, id: GroupId) -> Option<&SeqGroup> {
        self.groups.get(&id)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_swapped(&self) -> usize {
        self.swapped.len()
    }

    pub fn has_work(&self) -> bool {
        !self.groups.is_empty()
    }

    /// Whether this engine will compute block `hash`: a prompt block that a running prefill has
    /// not reached yet, or one of a prompt waiting in the queue (its admission computes it,
    /// unless the cache holds it by then). A peer asking for the block may wait for the step
    /// that computes it.
    pub fn will_compute(&self, hash: BlockHash) -> bool {
        self.kv.will_compute(hash)
            || self.groups.values().any(|g| {
                // Waiting for its first admission, or preempted to be computed again.
                g.status == SeqStatus::Waiting && g.prompt_hashes.contains(&hash)
            })
    }

    /// What the queue holds, for the engine's load report.
    pub fn backlog(&self) -> Backlog {
        let block = self.kv.block_size();
        let mut b = Backlog::default();
        for g in self.groups.values() {
            match g.status {
                SeqStatus::Waiting => {
                    let uncached = match &g.hashed {
                        Some(h) => g.prompt_len - self.kv.cached_prefix_len(h) * block,
                        None => g.live().next().map_or(0, |s| s.num_uncomputed()),
                    };
                    *b.waiting.entry(g.tenant).or_default() += uncached as u64;
                }
                SeqStatus::Running if g.in_prefill() => {
                    b.running_prefill += g.live().next().map_or(0, |s| s.num_uncomputed()) as u64;
                }
                SeqStatus::Running => {
                    let left = g
                        .live()
                        .map(|s| {
                            let generated = s.tokens.len().saturating_sub(g.prompt_len);
                            g.max_tokens.saturating_sub(generated)
                        })
                        .max()
                        .unwrap_or(0);
                    b.next_end = Some(b.next_end.map_or(left, |n| n.min(left)));
                }
                SeqStatus::Swapped => {}
            }
        }
        b
    }

    /// Running groups per tenant.
    pub fn running_by_tenant(&self) -> HashMap<TenantId, usize> {
        let mut out = HashMap::new();
        for g in &self.running {
            *out.entry(self.groups[g].tenant).or_default() += 1;
        }
        out
    }

    /// Plans the next step and allocates its slots.
    pub fn schedule(&mut self) -> StepPlan {
        self.stats.steps += 1;
        let mut plan = StepPlan::default();
        let mut budget = Budget {
            tokens: self.config.max_batched_tokens,
            seqs: self.config.max_seqs,
        };
        self.schedule_decodes(&mut plan, &mut budget);
        if !plan.items.is_empty() {
            budget.tokens = budget.tokens.min(self.config.decode_step_prefill_tokens);
        }
        self.schedule_swap_ins(&mut plan);
        self.schedule_running_prefills(&mut plan, &mut budget);
        self.admit_waiting(&mut plan, &mut budget);
        plan
    }

    /// Brings swapped-out groups back, oldest first, while free blocks allow. A group whose
    /// tenant is at its quota stays out and the next one may come in; one that could never fit
    /// a lowered quota is refused.
    fn schedule_swap_ins(&mut self, plan: &mut StepPlan) {
        let mut i = 0;
        while let Some(&gid) = self.swapped.get(i) {
            let Some(group) = self.groups.get(&gid) else {
                self.swapped.remove(i);
                continue;
            };
            let tenant = group.tenant;
            let seqs: Vec<SeqId> = group.live().map(|s| s.id).collect();
            let held = self.kv.swapped_group_blocks(&seqs);
            // Room for each sequence's next block too, so it can decode once back.
            if held + seqs.len() > self.kv.num_free_blocks() {
                return;
            }
            if let Some(q) = self.kv.quota(tenant) {
                if held > q as usize {
                    let reason = format!(
                        "the request no longer fits in its tenant's KV quota of {q} blocks"
                    );
                    self.reject(gid, &reason, plan);
                    continue;
                }
                if self.kv.tenant_usage(tenant) as usize + held > q as usize {
                    i += 1;
                    continue;
                }
            }
            let Ok(swap) = self.kv.swap_in(&seqs) else {
                return;
            };
            plan.swap_in.extend(swap.to_device);
            self.swapped.remove(i);
            self.mark_running(gid);
        }
    }

    /// Moves `gid` into the running list, which stays in arrival order.
    pub(super) fn mark_running(&mut self, gid: GroupId) {
        let Some(group) = self.groups.get_mut(&gid) else {
            return;
        };
        group.status = SeqStatus::Running;
        let arrival = group.arrival;
        let at = self
            .running
            .partition_point(|g| self.groups[g].arrival < arrival);
        self.running.insert(at, gid);
    }

    /// Appends a sampled token to `seq` (its K/V is computed next step).
    pub fn push_token(&mut self, gid: GroupId, seq: SeqId, token: u32) {
        if let Some(s) = self
            .groups
            .get_mut(&gid)
            .and_then(|g| g.seqs.iter_mut().find(|s| s.id == seq))
        {
            s.tokens.push(token);
        }
    }

    /// After a group's prompt is computed, forks its sequence into `n` samples sharing the
    /// prompt's blocks. Returns every sample's id, the original first.
    pub fn fork_samples(&mut self, gid: GroupId) -> Vec<SeqId> {
        let Some(group) = self.groups.get(&gid) else {
            return Vec::new();
        };
        if group.seqs.len() >= group.n {
            return group.seqs.iter().map(|s| s.id).collect();
        }
        let parent = group.seqs[0].clone();
        let mut children = Vec::new();
        for _ in 1..group.n {
            let id = self.new_seq_id();
            if self.kv.fork(parent.id, id).is_ok() {
                children.push(Sequence {
                    id,
                    ..parent.clone()
                });
            }
        }
        let Some(group) = self.groups.get_mut(&gid) else {
            return Vec::new();
        };
        group.seqs.extend(children);
        group.seqs.iter().map(|s| s.id).collect()
    }

    /// Ends one sequence (stop, length): its blocks are freed. Returns true when its whole group
    /// is done (and removed).
    pub fn finish_seq(&mut self, gid: GroupId, seq: SeqId, reason: FinishReason) -> bool {
        let Some(group) = self.groups.get_mut(&gid) else {
            return false;
        };
        if let Some(s) = group.seqs.iter_mut().find(|s| s.id == seq) {
            if s.finished.is_none() {
                s.finished = Some(reason);
                let _ = self.kv.free(seq);
            }
        }
        if group.is_finished() {
            self.remove(gid);
            return true;
        }
        false
    }

    /// Aborts a group wherever it is; every block it held is freed.
    pub fn abort(&mut self, gid: GroupId) -> bool {
        let Some(group) = self.groups.get_mut(&gid) else {
            return false;
        };
        for s in group.seqs.iter_mut().filter(|s| s.finished.is_none()) {
            s.finished = Some(FinishReason::Aborted);
            let _ = self.kv.free(s.id);
        }
        self.remove(gid);
        true
    }

    pub(super) fn reject(&mut self, gid: GroupId, reason: &str, plan: &mut StepPlan) {
        self.abort(gid);
        plan.rejected.push((gid, reason.to_owned()));
    }

    fn remove(&mut self, gid: GroupId) {
        self.forget_masks(gid);
        self.groups.remove(&gid);
        self.priorities.remove(&gid);
        self.running.retain(|g| *g != gid);
        self.swapped.retain(|g| *g != gid);
        self.waiting.remove(gid);
    }
}

pub(super) struct Budget {
    pub(super) tokens: usize,
    pub(super) seqs: usize,
}
