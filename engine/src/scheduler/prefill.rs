//! Prefills: unfinished chunked prefills first (oldest group first), then new groups, chosen
//! across tenants by weighted fair queuing and FIFO within a tenant. A group is admitted only when
//! its whole prompt fits now, in the pool and in its tenant's quota ([`super::quota`]); a prompt
//! is cut into chunks that fit what is left of the step's token budget. A tenant at its quota
//! waits while the other tenants go on.

use super::core::{Budget, Scheduler};
use super::fairness::TenantId;
use super::plan::{StepItem, StepPlan};
use super::sequence::GroupId;
use crate::kv::{KvError, SeqId};

impl Scheduler {
    pub(super) fn schedule_running_prefills(&mut self, plan: &mut StepPlan, budget: &mut Budget) {
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
                // The tenant waits for its own blocks; other groups' prefills go on.
                Err(KvError::QuotaExceeded { .. }) => return budget.tokens > 0 && budget.seqs > 0,
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

    pub(super) fn admit_waiting(&mut self, plan: &mut StepPlan, budget: &mut Budget) {
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
            if let Some(reason) = self.never_fits_quota(gid) {
                self.reject(gid, &reason, plan);
                continue;
            }
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
                .map(|s| {
                    self.kv
                        .hash_prompt(group.scope, &s.tokens)
                        .for_tenant(group.tenant)
                })
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
        self.check_quota_for_prompts(gid, &prompts)?;
        let group = &self.groups[&gid];
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
}
