//! Scheduler behaviour without a model: steps are driven by hand, a sampled item gets a made-up
//! token.

use super::*;
use crate::kv::test_manager;

fn scheduler(blocks: u32, mode: PreemptMode) -> Scheduler {
    Scheduler::new(
        SchedulerConfig {
            max_batched_tokens: 64,
            max_seqs: 8,
            preempt_mode: mode,
        },
        test_manager(blocks, 64, 4),
    )
}

fn add(s: &mut Scheduler, id: u64, tenant: u32, prompt_len: usize, n: usize, max_tokens: usize) {
    let scope = s.kv.scope(&format!("t{tenant}"));
    let prompt = (0..prompt_len as u32).map(|i| i + 100 * tenant).collect();
    s.add(NewGroup {
        id: GroupId(id),
        tenant: TenantId(tenant),
        priority: 1.0,
        scope,
        prompt,
        n,
        max_tokens,
    })
    .unwrap();
}

/// Runs one step: every sampled item gets token 7 (or forks first for `n > 1`), and sequences
/// finish at their `max_tokens`. Returns the plan.
fn step(s: &mut Scheduler) -> StepPlan {
    let plan = s.schedule();
    for item in plan.items.iter().filter(|i| i.sample) {
        let Some(g) = s.group(item.group) else {
            continue;
        };
        let seqs = if g.n > 1 && g.seqs.len() == 1 {
            s.fork_samples(item.group)
        } else {
            vec![item.seq]
        };
        for seq in seqs {
            let g = s.group(item.group).unwrap();
            let generated =
                g.seqs.iter().find(|x| x.id == seq).unwrap().tokens.len() - g.prompt_len;
            if generated + 1 >= g.max_tokens {
                s.finish_seq(item.group, seq, FinishReason::Length);
            } else {
                s.push_token(item.group, seq, 7);
            }
        }
    }
    s.kv.check_invariants().unwrap();
    plan
}

#[test]
fn n_samples_share_the_prompt_blocks() {
    let mut s = scheduler(64, PreemptMode::Recompute);
    add(&mut s, 1, 0, 10, 4, 8);
    step(&mut s);
    let g = s.group(GroupId(1)).unwrap();
    assert_eq!(g.seqs.len(), 4);
    let first = s.kv.block_table(g.seqs[0].id).unwrap().blocks()[0];
    assert_eq!(
        s.kv.pool().meta(first).ref_count,
        4,
        "the prompt's full blocks are held once"
    );
    let plan = step(&mut s);
    // The shared partial block (10 tokens = 2 full + 2) is copied for all but the last writer.
    assert_eq!(plan.cow.len(), 3);
    while s.has_work() {
        step(&mut s);
    }
    assert_eq!(s.kv.usage().used, 0);
}

#[test]
fn a_flooding_tenant_does_not_starve_a_light_one() {
    // max_seqs = 8: tenant 0 fills the batch and has 52 more requests queued when tenant 1's
    // three arrive. Running requests are never preempted for fairness, so tenant 1 waits for the
    // first free slots (about `max_tokens` steps); then, with equal weights, the two tenants
    // alternate, so tenant 1's three start within the first six admissions instead of after
    // tenant 0's whole backlog.
    let mut s = scheduler(512, PreemptMode::Recompute);
    for i in 0..60 {
        add(&mut s, i, 0, 24, 1, 30);
    }
    step(&mut s);
    for i in 0..3 {
        add(&mut s, 1000 + i, 1, 24, 1, 30);
    }
    let mut seen = std::collections::HashSet::new();
    let mut started_after = Vec::new();
    for n in 1..=40 {
        let plan = step(&mut s);
        for g in plan.items.iter().map(|i| i.group) {
            if seen.insert(g) && n > 1 {
                started_after.push(g);
            }
        }
        if started_after.iter().filter(|g| g.0 >= 1000).count() == 3 {
            let last = started_after.iter().rposition(|g| g.0 >= 1000).unwrap();
            assert!(
                last < 6,
                "tenant 0's backlog went ahead of tenant 1: {started_after:?}"
            );
            return;
        }
    }
    panic!("tenant 1's requests did not all start within 40 steps: {started_after:?}");
}

#[test]
fn a_tenant_over_its_quota_waits_and_others_go_on() {
    let mut s = scheduler(256, PreemptMode::Recompute);
    let scope = s.kv.scope("t0");
    s.kv.set_quota(scope, Some(12));
    for i in 0..4 {
        add(&mut s, i, 0, 20, 1, 4); // 6 blocks each: two fit in the quota
    }
    add(&mut s, 100, 1, 20, 1, 4);
    let plan = step(&mut s);
    let groups: std::collections::HashSet<u64> = plan.items.iter().map(|i| i.group.0).collect();
    assert!(
        groups.contains(&100),
        "tenant 1 is not held back by tenant 0's quota"
    );
    assert!(s.kv.scope_usage(scope) <= 12);
    while s.has_work() {
        step(&mut s);
    }
    assert_eq!(s.kv.usage().used, 0);
}

#[test]
fn preemption_takes_the_latest_group_and_every_group_completes() {
    for mode in [PreemptMode::Recompute, PreemptMode::Swap] {
        let mut s = scheduler(16, mode);
        for i in 0..5 {
            add(&mut s, i, 0, 8, 1, 24);
        }
        let mut preempted = Vec::new();
        let mut steps = 0;
        while s.has_work() {
            preempted.extend(step(&mut s).preempted);
            steps += 1;
            assert!(steps < 1000, "{mode:?}: no progress");
        }
        assert!(
            !preempted.is_empty(),
            "{mode:?}: the pool is too small for five"
        );
        assert!(preempted.iter().all(|(_, m)| *m == mode));
        assert_ne!(
            preempted[0].0,
            GroupId(0),
            "the oldest group is preempted last"
        );
        assert_eq!(s.kv.usage().used, 0);
        assert_eq!(s.kv.usage().host_used, 0);
    }
}
