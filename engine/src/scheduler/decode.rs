//! The decode pass and preemption. Every running group that is past its prompt gets the slot for
//! its next token, oldest group first (but for constrained samples over their tenant's share of
//! the step's mask time, [`super::masks`]), in two passes: the first reserves each group's blocks and
//! budget and does every preemption (for free blocks, or within a tenant's KV quota); the second
//! appends the slots. A victim is therefore only ever a reservation when it is taken: withdrawing
//! it returns its budget, and it has no item, copy-on-write or slot in the step yet, so the model
//! runner never meets a sequence that preemption emptied or freed.
//!
//! Victims: the lowest-priority running group, latest arrival among equals (within the tenant
//! for quotas), taken whole by recompute (its full blocks stay cached) or swap to host blocks.
//! O(running groups) per victim.

use super::core::{Budget, Scheduler};
use super::fairness::TenantId;
use super::plan::{PreemptMode, StepItem, StepPlan};
use super::sequence::{GroupId, SeqStatus};
use crate::kv::SeqId;
use std::collections::HashSet;

impl Scheduler {
    /// Plans this step's decodes (see the module docs).
    pub(super) fn schedule_decodes(&mut self, plan: &mut StepPlan, budget: &mut Budget) {
        let mut reserved = Reservations::default();
        let deferred = self.mask_deferred();
        for gid in self.running.clone() {
            self.reserve_decode(gid, &deferred, &mut reserved, plan, budget);
        }
        self.settle_prefill_quotas(&mut reserved, plan, budget);
        for r in reserved.list {
            self.append_decode(r.group, &deferred, plan, budget);
        }
        self.mask_turns(plan.items.iter().map(|i| i.seq));
    }

    fn reserve_decode(
        &mut self,
        gid: GroupId,
        deferred: &HashSet<SeqId>,
        reserved: &mut Reservations,
        plan: &mut StepPlan,
        budget: &mut Budget,
    ) {
        // An earlier group's preemption may have taken this one already.
        let Some(group) = self.groups.get(&gid) else {
            return;
        };
        if group.status != SeqStatus::Running || group.in_prefill() {
            return;
        }
        let tenant = group.tenant;
        let seqs: Vec<SeqId> = group
            .live()
            .filter(|s| s.num_uncomputed() > 0 && !deferred.contains(&s.id))
            .map(|s| s.id)
            .collect();
        if seqs.is_empty() || seqs.len() > budget.seqs || seqs.len() > budget.tokens {
            return;
        }
        let blocks: usize = seqs
            .iter()
            .map(|s| self.kv.blocks_needed_to_append(*s, 1).unwrap_or(0))
            .sum();
        let need = Reservation {
            group: gid,
            tenant,
            blocks,
            seqs: seqs.len(),
        };
        if !self.make_room(&need, Some(tenant), reserved, plan, budget)
            || !self.make_room(&need, None, reserved, plan, budget)
        {
            return;
        }
        budget.tokens -= need.seqs;
        budget.seqs -= need.seqs;
        reserved.list.push(need);
    }

    /// A running prefill whose tenant's quota has no room left for the rest of its prompt (the
    /// quota was lowered, or the tenant's decodes took the room) makes room within the tenant
    /// now, while preempting is still free of planned work; otherwise the tenant's prefills
    /// could wait on each other for ever.
    fn settle_prefill_quotas(
        &mut self,
        reserved: &mut Reservations,
        plan: &mut StepPlan,
        budget: &mut Budget,
    ) {
        for gid in self.running.clone() {
            let Some(group) = self.groups.get(&gid) else {
                continue;
            };
            if group.status != SeqStatus::Running
                || !group.in_prefill()
                || self.kv.quota(group.tenant).is_none()
            {
                continue;
            }
            let need = Reservation {
                group: gid,
                tenant: group.tenant,
                blocks: self.blocks_owed(group),
                seqs: 0,
            };
            self.make_room(&need, Some(group.tenant), reserved, plan, budget);
        }
    }

    /// Appends the next token's slot to every live sequence of a reserved group (but those whose
    /// masks wait this step).
    fn append_decode(
        &mut self,
        gid: GroupId,
        deferred: &HashSet<SeqId>,
        plan: &mut StepPlan,
        budget: &mut Budget,
    ) {
        let Some(group) = self.groups.get_mut(&gid) else {
            return;
        };
        for seq in group.seqs.iter_mut().filter(|s| s.finished.is_none()) {
            if seq.num_uncomputed() == 0 || deferred.contains(&seq.id) {
                continue;
            }
            let last = seq.tokens[seq.num_computed..].to_vec();
            // The reservation covered the blocks; a sequence refused anyway waits a step and
            // gives its share of the budget back.
            let Ok(out) = self.kv.append_slots(seq.id, &last) else {
                budget.tokens += 1;
                budget.seqs += 1;
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
        }
    }

    /// Preempts lower-priority, later groups until the reservations and `need` fit: in the free
    /// blocks (`within` = `None`), or in the KV quota of tenant `within`, whose own latest,
    /// lowest-priority group then goes (without that, a tenant's running groups that together
    /// reach its quota, or a quota lowered under them, would wait on each other for ever).
    /// Returns false when `need`'s group itself had to go; it is refused when it went alone.
    fn make_room(
        &mut self,
        need: &Reservation,
        within: Option<TenantId>,
        reserved: &mut Reservations,
        plan: &mut StepPlan,
        budget: &mut Budget,
    ) -> bool {
        loop {
            let short_of = match within {
                None => {
                    (reserved.blocks() + need.blocks > self.kv.num_free_blocks()).then_some(None)
                }
                Some(t) => self
                    .kv
                    .quota(t)
                    .filter(|&quota| {
                        let held = self.kv.tenant_usage(t) as usize + reserved.blocks_of(t);
                        held + need.blocks > quota as usize
                    })
                    .map(Some),
            };
            let Some(quota) = short_of else {
                return true;
            };
            let Some(victim) = self.pick_victim(within) else {
                return false;
            };
            let alone = self
                .running
                .iter()
                .filter(|g| within.is_none_or(|t| self.tenant_of(**g) == Some(t)))
                .count()
                == 1;
            self.withdraw(victim, reserved, plan, budget);
            if victim == need.group {
                if alone {
                    let reason = match quota {
                        None => "the request no longer fits in the KV cache".to_owned(),
                        Some(q) => format!(
                            "the request no longer fits in its tenant's KV quota of {q} blocks"
                        ),
                    };
                    self.reject(victim, &reason, plan);
                }
                return false;
            }
        }
    }

    /// Preempts `victim`, first taking back its reservation, if it has one, with its budget.
    fn withdraw(
        &mut self,
        victim: GroupId,
        reserved: &mut Reservations,
        plan: &mut StepPlan,
        budget: &mut Budget,
    ) {
        if let Some(i) = reserved.list.iter().position(|r| r.group == victim) {
            let r = reserved.list.remove(i);
            budget.tokens += r.seqs;
            budget.seqs += r.seqs;
        }
        self.preempt(victim, plan);
    }

    fn tenant_of(&self, gid: GroupId) -> Option<TenantId> {
        self.groups.get(&gid).map(|g| g.tenant)
    }

    /// The lowest-priority running group (of `tenant`, when given), latest arrival among equals.
    fn pick_victim(&self, tenant: Option<TenantId>) -> Option<GroupId> {
        let priority = |g: &GroupId| self.priorities.get(g).copied().unwrap_or(1.0);
        self.running
            .iter()
            .rev()
            .filter(|g| tenant.is_none() || self.tenant_of(**g) == tenant)
            .min_by(|a, b| priority(a).total_cmp(&priority(b)))
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
}

/// A decode planned in the first pass of `schedule_decodes`: its blocks, and one
/// token and one sequence of the budget per sequence.
struct Reservation {
    group: GroupId,
    tenant: TenantId,
    blocks: usize,
    seqs: usize,
}

#[derive(Default)]
struct Reservations {
    list: Vec<Reservation>,
}

impl Reservations {
    fn blocks(&self) -> usize {
        self.list.iter().map(|r| r.blocks).sum()
    }

    fn blocks_of(&self, tenant: TenantId) -> usize {
        self.list
            .iter()
            .filter(|r| r.tenant == tenant)
            .map(|r| r.blocks)
            .sum()
    }
}
