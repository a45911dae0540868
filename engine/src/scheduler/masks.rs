//! The time grammar masks take, shared across tenants.
//!
//! A constrained sample's mask is computed on one thread beside the step's forward pass, so
//! masks cost a step nothing while together they take no longer than the pass. Each mask is
//! bounded (the grammar's parser limits), but their number is not: a tenant whose grammars make
//! every mask slow, with many constrained samples, would lengthen every tenant's steps.
//!
//! So each step has a mask budget (the recent time of a forward pass that only decodes), and
//! while two or more tenants have requests running, each earns an equal share of it every step
//! as credit. Every mask computed for a tenant is paid from its credit at its measured time,
//! also those that cannot wait (the first masks where a prompt ends), which leave a debt. Its
//! decoding samples, least recently decoded first, decode while the credit covers their expected
//! mask times (each sample's running mean); the rest wait a step, so they take turns (the
//! samples of one `n > 1` request too). Credit is kept up to the tenant's costliest mask (or one
//! share), so a sample whose mask alone costs more than a share still decodes, every few steps:
//! over time a tenant's masks average no more than its share of the step. If every decode of
//! every tenant would wait and nothing prefills, the front sample of the tenant with the most
//! credit goes, so a step is never empty for masks alone.
//!
//! Grammars whose masks are quick (a JSON schema's take about 0.05 ms) never meet the budget,
//! and a tenant running alone is never held back.

use super::core::Scheduler;
use super::fairness::TenantId;
use super::sequence::{GroupId, SeqStatus};
use crate::kv::SeqId;
use std::collections::{HashMap, HashSet};

/// Weight of a sample's newest mask time in its running estimate.
const MASK_COST_RATE: f64 = 0.5;

/// Most a tenant may owe, in seconds of masks.
const MAX_DEBT_SECS: f64 = 10.0;

/// Mask state of the constrained samples and of the tenants sharing the budget.
#[derive(Debug, Default)]
pub(super) struct MaskShares {
    /// Expected mask seconds per step of each constrained sample.
    cost: HashMap<SeqId, f64>,
    /// The step each constrained sample last decoded in (or was first seen).
    turn: HashMap<SeqId, u64>,
    /// Seconds one step's masks may take in all (0: unbounded).
    budget: f64,
    /// Mask seconds each tenant with running requests has earned and not spent (negative: owed),
    /// while the budget is shared; empty otherwise.
    credit: HashMap<TenantId, f64>,
    /// Decodes held back a step, in all.
    pub(super) deferred: u64,
}

impl MaskShares {
    fn forget(&mut self, seq: SeqId) {
        self.cost.remove(&seq);
        self.turn.remove(&seq);
    }
}

impl Scheduler {
    /// Records the time one mask of `tenant`'s took in the last step: paid from its credit,
    /// and, for sample `seq` (when known and still running), folded into that sample's expected
    /// time.
    pub fn observe_mask(&mut self, tenant: TenantId, seq: Option<SeqId>, secs: f64) {
        if !secs.is_finite() || secs < 0.0 {
            return;
        }
        if let Some(c) = self.masks.credit.get_mut(&tenant) {
            *c = (*c - secs).max(-MAX_DEBT_SECS);
        }
        let Some(seq) = seq.filter(|s| self.kv.block_table(*s).is_some()) else {
            return;
        };
        let step = self.stats.steps;
        self.masks.turn.entry(seq).or_insert(step);
        let cost = self.masks.cost.entry(seq).or_insert(secs);
        *cost += MASK_COST_RATE * (secs - *cost);
    }

    /// Sets the seconds one step's masks may take in all (0: unbounded).
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
        // No constrained sample is running: nothing can wait, and no step pays for this.
        if self.masks.cost.is_empty() {
            self.masks.credit.clear();
            return out;
        }
        let mut active: HashSet<TenantId> = HashSet::new();
        let mut prefilling = false;
        let mut decoding = 0usize;
        let mut constrained: HashMap<TenantId, Vec<(u64, u64, SeqId, f64)>> = HashMap::new();
        for g in self.running_groups() {
            if g.status != SeqStatus::Running {
                continue;
            }
            active.insert(g.tenant);
            if g.in_prefill() {
                prefilling = true;
                continue;
            }
            for s in g.live().filter(|s| s.num_uncomputed() > 0) {
                decoding += 1;
                if let Some(&cost) = self.masks.cost.get(&s.id) {
                    let turn = self.masks.turn.get(&s.id).copied().unwrap_or(0);
                    constrained
                        .entry(g.tenant)
                        .or_default()
                        .push((turn, g.arrival, s.id, cost));
                }
            }
        }
        if self.masks.budget <= 0.0 || active.len() < 2 {
            self.masks.credit.clear();
            return out;
        }
        let share = self.masks.budget / active.len() as f64;
        let mut credit = HashMap::with_capacity(active.len());
        // The first sample each tenant could not pay for, with its credit.
        let mut fronts: Vec<(f64, SeqId)> = Vec::new();
        for tenant in active {
            let mut samples = constrained.remove(&tenant).unwrap_or_default();
            samples.sort_by_key(|&(turn, arrival, seq, _)| (turn, arrival, seq));
            let most = samples.iter().fold(share, |m, s| m.max(s.3));
            let earned = self.masks.credit.get(&tenant).copied().unwrap_or(0.0) + share;
            let earned = earned.min(most);
            credit.insert(tenant, earned);
            // Strictly in turn: a sample that cannot be paid for holds back the later ones.
            let (mut left, mut paying) = (earned, true);
            for &(_, _, seq, cost) in &samples {
                if paying && cost <= left {
                    left -= cost;
                    continue;
                }
                if paying {
                    fronts.push((earned, seq));
                    paying = false;
                }
                out.insert(seq);
            }
        }
        self.masks.credit = credit;
        if !prefilling && out.len() == decoding {
            if let Some(&(_, seq)) = fronts.iter().max_by(|a, b| a.0.total_cmp(&b.0)) {
                out.remove(&seq);
            }
        }
        self.masks.deferred += out.len() as u64;
        out
    }

    /// Notes that the constrained samples among `decoded` decode in this step.
    pub(super) fn mask_turns(&mut self, decoded: impl Iterator<Item = SeqId>) {
        if self.masks.cost.is_empty() {
            return;
        }
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
