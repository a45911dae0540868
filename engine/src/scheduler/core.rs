//! The scheduling algorithm (see the module docs of [`crate::scheduler`]).

use super::fairness::{FairQueues, TenantId};
use super::plan::{PreemptMode, StepItem, StepPlan};
use super::sequence::{FinishReason, GroupId, SeqGroup, SeqStatus, Sequence};
use crate::kv::{KvCacheManager, KvError, ScopeId, SeqId};
use std::collections::HashMap;

/// Limits of one step and the preemption mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_batched_tokens: usize,
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
    config: SchedulerConfig,
    pub kv: KvCacheManager,
    groups: HashMap<GroupId, SeqGroup>,
    priorities: HashMap<GroupId, f64>,
    waiting: FairQueues,
    /// Running groups, oldest arrival first.
    running: Vec<GroupId>,
    /// Swapped-out groups, oldest arrival first.
    swapped: Vec<GroupId>,
    next_arrival: u64,
    next_seq: u64,
    stats: SchedulerStats,
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
        }
    }

    pub fn config(&self) -> SchedulerConfig {
        self.config
    }

    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    pub fn set_tenant_weight(&mut self, tenant: TenantId, weight: f64) {
        self.waiting.set_weight(tenant, weight);
    }

    /// Queues a request, or refuses it when it could never fit (livelock guard).
    pub fn add(&mut self, g: NewGroup) -> Result<(), String> {
        let b = self.kv.block_size();
        let worst = g.prompt.len().div_ceil(b) + g.n * (g.max_tokens.div_ceil(b) + 1);
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
        if let Some(q) = self.kv.quota(g.scope) {
            if worst > q as usize {
                return Err(format!(
                    "the request needs up to {worst} KV blocks, over its tenant's quota of {q}"
                ));
            }
        }
        let hashed = self.kv.hash_prompt(g.scope, &g.prompt);
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
        self.schedule_swap_ins(&mut plan);
        self.schedule_running_prefills(&mut plan, &mut budget);
        self.admit_waiting(&mut plan, &mut budget);
        plan
    }

    fn schedule_decodes(&mut self, plan: &mut StepPlan, budget: &mut Budget) {
        let order = self.running.clone();
        for gid in order {
            // An earlier group's preemption may have taken this one already.
            let Some(group) = self.groups.get(&gid) else {
                continue;
            };
            if group.status != SeqStatus::Running || group.in_prefill() {
                continue;
            }
            let seqs: Vec<SeqId> = group.live().map(|s| s.id).collect();
            if seqs.len() > budget.seqs || seqs.len() > budget.tokens {
                continue;
            }
            let needed: usize = seqs
                .iter()
                .map(|s| self.kv.blocks_needed_to_append(*s, 1).unwrap_or(0))
                .sum();
            if !self.make_room(gid, needed, plan) {
                continue;
            }
            let Some(group) = self.groups.get_mut(&gid) else {
                continue;
            };
            for seq in group.seqs.iter_mut().filter(|s| s.finished.is_none()) {
                let last = seq.tokens[seq.num_computed..].to_vec();
                // A quota reached by decode: this sequence waits a step.
                let Ok(out) = self.kv.append_slots(seq.id, &last) else {
                    continue;
                };
                plan.cow.extend(out.cow);
                plan.items.push(StepItem {
                    group: gid,
                    seq: seq.id,
                    start: seq.num_computed,
                    len: last.len(),
                    sample: true,
                });
                seq.num_computed = seq.tokens.len();
                budget.tokens -= last.len();
                budget.seqs -= 1;
            }
        }
    }

    /// Preempts lower-priority, later groups until `needed` blocks are free. Returns false when
    /// `gid` itself had to go.
    fn make_room(&mut self, gid: GroupId, needed: usize, plan: &mut StepPlan) -> bool {
        while needed > self.kv.num_free_blocks() {
            let Some(victim) = self.pick_victim() else {
                return false;
            };
            let alone = self.running.len() == 1;
            self.preempt(victim, plan);
            if victim == gid {
                if alone {
                    self.reject(gid, "the request no longer fits in the KV cache", plan);
                }
                return false;
            }
        }
        true
    }

    /// The lowest-priority group, latest arrival among equals.
    fn pick_victim(&self) -> Option<GroupId> {
        self.running
            .iter()
            .rev()
            .min_by(|a, b| self.priorities[a].total_cmp(&self.priorities[b]))
            .copied()
    }

    fn preempt(&mut self, gid: GroupId, plan: &mut StepPlan) {
        self.running.retain(|g| *g != gid);
        let Some(group) = self.groups.get_mut(&gid) else {
            return;
        };
        group.preemptions += 1;
        let seqs: Vec<SeqId> = group.live().map(|s| s.id).collect();
        if self.config.preempt_mode == PreemptMode::Swap {
            if let Ok(swap) = self.kv.swap_out(&seqs) {
                plan.swap_out.extend(swap.to_host);
                group.status = SeqStatus::Swapped;
                let arrival = group.arrival;
                let at = self
                    .swapped
                    .partition_point(|g| self.groups[g].arrival < arrival);
                self.swapped.insert(at, gid);
                plan.preempted.push((gid, PreemptMode::Swap));
                self.stats.preempted_swap += 1;
                return;
            }
        }
        // Recompute: free every block; full ones stay cached, so the resume mostly hits.
        for seq in group.seqs.iter_mut().filter(|s| s.finished.is_none()) {
            let _ = self.kv.free(seq.id);
            seq.num_computed = 0;
        }
        group.status = SeqStatus::Waiting;
        group.hashed = None;
        self.waiting.push_front(group.tenant, gid);
        plan.preempted.push((gid, PreemptMode::Recompute));
        self.stats.preempted_recompute += 1;
    }

    fn schedule_swap_ins(&mut self, plan: &mut StepPlan) {
        while let Some(&gid) = self.swapped.first() {
            let seqs: Vec<SeqId> = self.groups[&gid].live().map(|s| s.id).collect();
            let blocks: usize = seqs
                .iter()
                .filter_map(|s| self.kv.swapped_blocks(*s))
                .sum::<usize>()
                + seqs.len();
            if blocks > self.kv.num_free_blocks() {
                return;
            }
            let Ok(swap) = self.kv.swap_in(&seqs) else {
                return;
            };
            plan.swap_in.extend(swap.to_device);
            self.swapped.remove(0);
            self.mark_running(gid);
        }
    }

    /// Moves `gid` into the running list, which stays in arrival order.
    fn mark_running(&mut self, gid: GroupId) {
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

    fn schedule_running_prefills(&mut self, plan: &mut StepPlan, budget: &mut Budget) {
        let prefilling: Vec<GroupId> = self
            .running
            .iter()
            .copied()
            .filter(|g| self.groups[g].in_prefill())
            .collect();
        for gid in prefilling {
            if !self.prefill_group(gid, plan, budget) {
                return;
            }
        }
    }

    /// Schedules the next chunk of every uncomputed sequence of `gid`. Returns false when the
    /// budget or the memory ran out.
    fn prefill_group(&mut self, gid: GroupId, plan: &mut StepPlan, budget: &mut Budget) -> bool {
        let Some(group) = self.groups.get_mut(&gid) else {
            return true;
        };
        let mut complete = true;
        for seq in group.seqs.iter_mut().filter(|s| s.finished.is_none()) {
            let want = seq.num_uncomputed();
            if want == 0 {
                continue;
            }
            if budget.tokens == 0 || budget.seqs == 0 {
                complete = false;
                break;
            }
            let len = want
                .min(budget.tokens)
                .min(self.kv.appendable_tokens(seq.id));
            if len == 0 {
                complete = false;
                break;
            }
            let chunk = seq.tokens[seq.num_computed..seq.num_computed + len].to_vec();
            match self.kv.append_slots(seq.id, &chunk) {
                Ok(out) => plan.cow.extend(out.cow),
                Err(_) => {
                    complete = false;
                    break;
                }
            }
            plan.items.push(StepItem {
                group: gid,
                seq: seq.id,
                start: seq.num_computed,
                len,
                sample: len == want,
            });
            seq.num_computed += len;
            budget.tokens -= len;
            budget.seqs -= 1;
            complete &= len == want;
        }
        complete && budget.tokens > 0 && budget.seqs > 0
    }

    fn admit_waiting(&mut self, plan: &mut StepPlan, budget: &mut Budget) {
        let mut blocked: Vec<TenantId> = Vec::new();
        while budget.tokens > 0 && budget.seqs > 0 {
            let Some(tenant) = self
                .waiting
                .order()
                .into_iter()
                .find(|t| !blocked.contains(t))
            else {
                return;
            };
            let Some(gid) = self.waiting.front(tenant) else {
                return;
            };
            match self.start_group(gid) {
                Ok(()) => {}
                Err(KvError::QuotaExceeded { .. }) => {
                    blocked.push(tenant); // this tenant waits; others go on
                    continue;
                }
                Err(_) => return, // out of blocks: nobody else fits better in FIFO order
            }
            self.waiting.pop_front(tenant);
            // Fairness counts the work a tenant asks for (its prompt tokens), cached or not, so
            // a tenant whose requests hit the cache cannot take every free slot.
            let work: usize = self.groups[&gid].live().map(|s| s.tokens.len()).sum();
            self.waiting.charge(tenant, work);
            self.mark_running(gid);
            if !self.prefill_group(gid, plan, budget) {
                return;
            }
        }
    }

    /// Starts every live sequence of a waiting group on its cached prefix, all or nothing.
    fn start_group(&mut self, gid: GroupId) -> Result<(), KvError> {
        let group = &self.groups[&gid];
        let prompts: Vec<_> = match &group.hashed {
            Some(h) => vec![h.clone()],
            None => group
                .live()
                .map(|s| self.kv.hash_prompt(group.scope, &s.tokens))
                .collect(),
        };
        // Admit only when the whole prompt fits now: a long prompt then waits for room instead
        // of holding half its blocks while decodes preempt it.
        let needed: usize = prompts
            .iter()
            .map(|p| self.kv.blocks_needed_for_prompt(p))
            .sum();
        if needed > self.kv.num_free_blocks() {
            return Err(KvError::OutOfBlocks {
                needed,
                free: self.kv.num_free_blocks(),
            });
        }
        let ids: Vec<SeqId> = group.live().map(|s| s.id).collect();
        let mut started = Vec::new();
        for (id, prompt) in ids.iter().zip(&prompts) {
            match self.kv.start_sequence(*id, prompt) {
                Ok(cached) => started.push((*id, cached)),
                Err(e) => {
                    for (s, _) in started {
                        let _ = self.kv.free(s);
                    }
                    return Err(e);
                }
            }
        }
        let first = group.hashed.is_some();
        let Some(group) = self.groups.get_mut(&gid) else {
            return Ok(());
        };
        for (seq, (_, cached)) in group
            .seqs
            .iter_mut()
            .filter(|s| s.finished.is_none())
            .zip(&started)
        {
            seq.num_computed = *cached;
        }
        if first {
            group.cached_tokens = started.first().map_or(0, |s| s.1);
            group.hashed = None;
        }
        Ok(())
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

    fn reject(&mut self, gid: GroupId, reason: &str, plan: &mut StepPlan) {
        self.abort(gid);
        plan.rejected.push((gid, reason.to_owned()));
    }

    fn remove(&mut self, gid: GroupId) {
        self.groups.remove(&gid);
        self.priorities.remove(&gid);
        self.running.retain(|g| *g != gid);
        self.swapped.retain(|g| *g != gid);
        self.waiting.remove(gid);
    }
}

struct Budget {
    tokens: usize,
    seqs: usize,
}
