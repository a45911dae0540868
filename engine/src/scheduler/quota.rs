//! Per-tenant KV quotas at admission. A group is admitted only when its tenant's blocks, the
//! blocks its tenant's running prefills still have to take, and the new group's prompt fit the
//! quota together, so admitted prefills of one tenant cannot wedge each other half done. Decodes
//! that reach the quota preempt within the tenant (see `make_room` in `decode.rs`).
//! O(running groups of the tenant + prompt blocks) per admission.

use super::core::Scheduler;
use super::sequence::{GroupId, SeqGroup, SeqStatus};
use crate::kv::{HashedPrompt, KvError, TenantId};

impl Scheduler {
    /// Why `gid` can never run under its tenant's current quota (lowered since it was queued),
    /// if so.
    pub(super) fn never_fits_quota(&self, gid: GroupId) -> Option<String> {
        let group = self.group(gid)?;
        let quota = self.kv.quota(group.tenant)?;
        let worst = self.group_worst_blocks(gid)?;
        (worst > quota as usize).then(|| {
            format!("the request needs up to {worst} KV blocks, over its tenant's quota of {quota}")
        })
    }

    /// Refuses (for now) to start `gid` from `prompts` when its tenant's quota has no room for
    /// them beside what the tenant holds and its running prefills still need.
    pub(super) fn check_quota_for_prompts(
        &self,
        gid: GroupId,
        prompts: &[HashedPrompt],
    ) -> Result<(), KvError> {
        let Some(group) = self.group(gid) else {
            return Ok(());
        };
        let tenant = group.tenant;
        if self.kv.quota(tenant).is_none() {
            return Ok(());
        }
        // Samples recomputed after a preemption share their prompt's blocks, which each
        // prompt's count repeats: the group's worst case bounds the sum.
        let charged: usize = prompts
            .iter()
            .map(|p| self.kv.blocks_charged_for_prompt(p))
            .sum::<usize>()
            .min(self.group_worst_blocks(gid).unwrap_or(usize::MAX));
        self.kv
            .check_quota(Some(tenant), charged + self.prefill_blocks_owed(tenant))
    }

    /// Blocks the running prefills of `tenant` have yet to allocate.
    fn prefill_blocks_owed(&self, tenant: TenantId) -> usize {
        self.running_groups()
            .filter(|g| g.tenant == tenant && g.status == SeqStatus::Running && g.in_prefill())
            .map(|g| self.blocks_owed(g))
            .sum()
    }

    /// Blocks `group`'s sequences have yet to allocate for the tokens they already have.
    pub(super) fn blocks_owed(&self, group: &SeqGroup) -> usize {
        let b = self.kv.block_size();
        group
            .live()
            .map(|s| {
                let held = self.kv.block_table(s.id).map_or(0, |t| t.blocks().len());
                s.tokens.len().div_ceil(b).saturating_sub(held)
            })
            .sum()
    }
}
