//! Weighted fair queuing across tenants: each tenant's waiting groups in FIFO order, and a virtual
//! clock per tenant that advances by the prompt tokens it is admitted with divided by its weight. The
//! next group comes from the tenant with the smallest clock, so a tenant flooding the engine
//! cannot starve one that sends a few requests. A tenant that starts waiting again resumes at no
//! less than the smallest active clock, so idling earns no burst credit. O(tenants) per pick.

use super::sequence::GroupId;
pub use crate::kv::TenantId;
use std::collections::VecDeque;

#[derive(Debug, Clone)]
struct Tenant {
    weight: f64,
    clock: f64,
    queue: VecDeque<GroupId>,
}

/// Waiting groups per tenant.
#[derive(Debug, Clone, Default)]
pub struct FairQueues {
    tenants: Vec<Tenant>,
}

impl FairQueues {
    fn tenant(&mut self, t: TenantId) -> &mut Tenant {
        let i = t.0 as usize;
        if i >= self.tenants.len() {
            self.tenants.resize(
                i + 1,
                Tenant {
                    weight: 1.0,
                    clock: 0.0,
                    queue: VecDeque::new(),
                },
            );
        }
        &mut self.tenants[i]
    }

    /// Sets a tenant's priority weight (at least a small positive value).
    pub fn set_weight(&mut self, t: TenantId, weight: f64) {
        self.tenant(t).weight = weight.max(1e-3);
    }

    fn min_active_clock(&self) -> Option<f64> {
        self.tenants
            .iter()
            .filter(|t| !t.queue.is_empty())
            .map(|t| t.clock)
            .min_by(f64::total_cmp)
    }

    /// Queues a new group at the back of its tenant's line.
    pub fn push_back(&mut self, t: TenantId, g: GroupId) {
        let floor = self.min_active_clock();
        let tenant = self.tenant(t);
        if tenant.queue.is_empty() {
            if let Some(f) = floor {
                tenant.clock = tenant.clock.max(f);
            }
        }
        tenant.queue.push_back(g);
    }

    /// Puts a preempted group back at the front of its tenant's line.
    pub fn push_front(&mut self, t: TenantId, g: GroupId) {
        self.tenant(t).queue.push_front(g);
    }

    /// Tenants with waiting groups, smallest clock first (ties: lower id).
    pub fn order(&self) -> Vec<TenantId> {
        let mut ids: Vec<usize> = (0..self.tenants.len())
            .filter(|&i| !self.tenants[i].queue.is_empty())
            .collect();
        ids.sort_by(|&a, &b| {
            self.tenants[a]
                .clock
                .total_cmp(&self.tenants[b].clock)
                .then(a.cmp(&b))
        });
        ids.into_iter().map(|i| TenantId(i as u32)).collect()
    }

    pub fn front(&self, t: TenantId) -> Option<GroupId> {
        self.tenants.get(t.0 as usize)?.queue.front().copied()
    }

    pub fn pop_front(&mut self, t: TenantId) -> Option<GroupId> {
        self.tenant(t).queue.pop_front()
    }

    /// Charges `tokens` of service to tenant `t`.
    pub fn charge(&mut self, t: TenantId, tokens: usize) {
        let tenant = self.tenant(t);
        tenant.clock += tokens as f64 / tenant.weight;
    }

    /// Removes `g` wherever it waits (an abort).
    pub fn remove(&mut self, g: GroupId) -> bool {
        for t in &mut self.tenants {
            if let Some(i) = t.queue.iter().position(|x| *x == g) {
                t.queue.remove(i);
                return true;
            }
        }
        false
    }

    pub fn len(&self) -> usize {
        self.tenants.iter().map(|t| t.queue.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waiting groups of tenant `t`.
    pub fn waiting_of(&self, t: TenantId) -> usize {
        self.tenants.get(t.0 as usize).map_or(0, |x| x.queue.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lighter_tenant_goes_first_and_weights_scale_service() {
        let mut q = FairQueues::default();
        let (a, b) = (TenantId(0), TenantId(1));
        for i in 0..10 {
            q.push_back(a, GroupId(i));
        }
        q.charge(a, 500);
        q.push_back(b, GroupId(100));
        // b joins at a's clock (no credit for having been idle); ties go to the lower id.
        assert_eq!(q.order(), vec![a, b]);
        q.charge(a, 100);
        assert_eq!(q.order(), vec![b, a]);
        // With weight 4, b pays a quarter: 1,000 tokens cost it 250 (750 against a's 600).
        q.set_weight(b, 4.0);
        q.charge(b, 1000);
        assert_eq!(q.order(), vec![a, b]);
        q.charge(a, 200);
        assert_eq!(q.order(), vec![b, a]);
        assert_eq!(q.pop_front(b), Some(GroupId(100)));
        assert_eq!(q.order(), vec![a]);
        assert!(q.remove(GroupId(3)));
        assert_eq!(q.len(), 9);
    }
}
