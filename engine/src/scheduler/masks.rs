//! The time grammar masks take, shared across tenants.
//!
//! A constrained sample's mask is computed on one thread beside the step's forward pass, so
//! masks cost a step nothing while together they take no longer than the pass. Each mask is
//! bounded (the grammar's parser limits), but their number is not: a tenant whose grammars make
//! every mask slow, with many constrained samples decoding, would lengthen every tenant's steps.
//!
//! So each step has a mask budget, the forward pass's recent time, and every tenant with requests
//! decoding beside another tenant's earns an equal share of it each step, as credit for the masks
//! of its constrained samples, at each sample's measured mask time. Its samples decode, least
//! recently decoded first, while the credit pays for their masks; the rest wait a step, so they
//! take turns (the samples of one `n > 1` request too). Credit is kept up to the tenant's
//! costliest mask (or one share), so a sample whose mask alone costs more than a share still
//! decodes, every few steps: a tenant's masks average no more than its share of the step.
//! Grammars whose masks are quick (a JSON schema's take about 0.05 ms) never meet the budget;
//! with one tenant decoding there is no one else to protect, and nothing waits.

use super::core::Scheduler;
use super::fairness::TenantId;
use super::sequence::{GroupId, SeqStatus};
use crate::kv::SeqId;
use std::collections::{HashMap, HashSet};

/// Weight of a sample's newest mask time in its running estimate.
const MASK_COST_RATE: f64 = 0.5;

/// Mask state of the constrained samples.
#[derive(Debug, Default)]
pub(super) struct MaskShares {
    /// Expected mask seconds per step of each constrained sample.
    cost: HashMap<SeqId, f64>,
    /// The step each constrained sample last decoded in.
    turn: HashMap<SeqId, u64>,
    /// Seconds one step's masks may take in all (0: unbounded).
    budget: f64,
    /// Each tenant's mask seconds earned and not yet spent.
    credit: HashMap<TenantId, f64>,
    /// Decodes held back a step, in all.
    pub(super) deferred: u64,
}

impl MaskShares {
    pub(super) fn forget(&mut self, seq: SeqId) {
        self.cost.remove(&seq);
        self.turn.remove(&seq);
    }
}

impl Scheduler {
    /// Records the time sample `seq`'s mask took in the last step.
    pub fn observe_mask(&mut self, seq: SeqId, secs: f64) {
        if !secs.is_finite() || secs < 0.0 || self.kv.block_table(seq).is_none() {
            return;
        }
        let cost = self.masks.cost.entry(seq).or_insert(secs);
        *cost += MASK_COST_RATE * (secs - *cost);
    }

    /// Sets the seconds one step's masks may take in all: the forward pass's time, which they
    /// run beside (0: unbounded).
    pub fn set_mask_budget(&mut self, secs: f64) {
        self.masks.budget = if secs.is_finite() { secs.max(0.0) } else { 0.0 };
    }

    /// Decodes held back a step for their tenant's share of the mask budget, in all.
    pub fn mask_deferrals(&self) -> u64 {
        self.masks.deferred
    }

    /// The samples of running groups whose decode waits this step (see the module docs).
    pub(super) fn mask_deferred(&mut self) -> HashSet<SeqId> {
        let mut out = HashSet::new();
        if self.masks.budget <= 0.0 || self.masks.cost.is_empty() {
            return out;
        }
        let mut decoding: HashSet<TenantId> = HashSet::new();
        let mut constrained: HashMap<TenantId, Vec<(u64, u64, SeqId, f64)>> = HashMap::new();
        for g in self.running_groups() {
            if g.status != SeqStatus::Running || g.in_prefill() {
                continue;
            }
            decoding.insert(g.tenant);
            for s in g.live() {
                if let Some(&cost) = self.masks.cost.get(&s.id) {
                    let turn = self.masks.turn.get(&s.id).copied().unwrap_or(0);
                    constrained
                        .entry(g.tenant)
                        .or_default()
                        .push((turn, g.arrival, s.id, cost));
                }
            }
        }
        if decoding.len() < 2 {
            self.masks.credit.clear();
            return out;
        }
        let share = self.masks.budget / decoding.len() as f64;
        let mut credit = HashMap::with_capacity(constrained.len());
        for (tenant, mut samples) in constrained {
            samples.sort_by_key(|&(turn, arrival, seq, _)| (turn, arrival, seq));
            let most = samples.iter().fold(share, |m, s| m.max(s.3));
            let earned = self.masks.credit.get(&tenant).copied().unwrap_or(0.0) + share;
            let mut left = earned.min(most);
            // Strictly in turn: a sample that cannot be paid for holds back the later ones, and
            // the credit left is saved toward it.
            let mut paying = true;
            for &(_, _, seq, cost) in &samples {
                paying &= cost <= left;
                if paying {
                    left -= cost;
                } else {
                    out.insert(seq);
                }
            }
            credit.insert(tenant, left.max(0.0));
        }
        self.masks.credit = credit;
        self.masks.deferred += out.len() as u64;
        out
    }

    /// Notes that the constrained samples among `decoded` decode in this step.
    pub(super) fn mask_turns(&mut self, decoded: impl Iterator<Item = SeqId>) {
        let step = self.stats.steps;
        for seq in decoded {
            if self.masks.cost.contains_key(&seq) {
                self.masks.turn.insert(seq, step);
            }
        }
    }

    /// Forgets the mask state of `group`'s samples.
    pub(super) fn forget_masks(&mut self, group: GroupId) {
        if self.masks.cost.is_empty() {
            return;
        }
        if let Some(g) = self.groups.get(&group) {
            for s in &g.seqs {
                self.masks.forget(s.id);
            }
        }
    }
}
