//! Scheduler behaviour without a model: steps are driven by hand, a sampled item gets a made-up
//! token.

use super::*;
use crate::kv::{test_manager, SeqId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;

fn scheduler(blocks: u32, mode: PreemptMode) -> Scheduler {
    Scheduler::new(
        SchedulerConfig {
            max_batched_tokens: 64,
            decode_step_prefill_tokens: 64,
            max_seqs: 8,
            preempt_mode: mode,
        },
        test_manager(blocks, 64, 4),
    )
}

fn add(s: &mut Scheduler, id: u64, tenant: u32, prompt_len: usize, n: usize, max_tokens: usize) {
    add_with(s, id, tenant, 1.0, prompt_len, n, max_tokens).unwrap();
}

fn add_with(
    s: &mut Scheduler,
    id: u64,
    tenant: u32,
    priority: f64,
    prompt_len: usize,
    n: usize,
    max_tokens: usize,
) -> Result<(), String> {
    let scope = format!("t{tenant}");
    add_in(s, id, tenant, &scope, priority, prompt_len, n, max_tokens)
}

/// Queues a request of `tenant` in cache scope `scope`; prompts of a scope share their start.
#[allow(clippy::too_many_arguments)]
fn add_in(
    s: &mut Scheduler,
    id: u64,
    tenant: u32,
    scope: &str,
    priority: f64,
    prompt_len: usize,
    n: usize,
    max_tokens: usize,
) -> Result<(), String> {
    let scope_id = s.kv.scope(scope);
    let base = 100 * scope.bytes().map(u32::from).sum::<u32>();
    let prompt = (0..prompt_len as u32).map(|i| i + base).collect();
    let scope = scope_id;
    s.add(NewGroup {
        id: GroupId(id),
        tenant: TenantId(tenant),
        priority,
        scope,
        prompt,
        n,
        max_tokens,
    })
}

/// What the model runner relies on: every item is a live sequence of a running group whose
/// table holds a slot for each planned token, and every copy-on-write lands in such a table.
fn check_plan(s: &Scheduler, plan: &StepPlan) {
    let bs = s.kv.block_size();
    let mut planned = HashSet::new();
    let mut tables = HashSet::new();
    for item in &plan.items {
        let g = s
            .group(item.group)
            .unwrap_or_else(|| panic!("{item:?}: the group is gone"));
        assert_eq!(g.status, SeqStatus::Running, "{item:?}: group not running");
        let seq = g
            .seqs
            .iter()
            .find(|x| x.id == item.seq)
            .unwrap_or_else(|| panic!("{item:?}: no such sequence"));
        assert!(seq.finished.is_none(), "{item:?}: sequence finished");
        assert!(planned.insert(item.seq), "{item:?}: planned twice");
        assert!(item.len > 0, "{item:?}: empty item");
        assert_eq!(seq.num_computed, item.start + item.len, "{item:?}");
        assert!(!s.kv.is_swapped_out(item.seq), "{item:?}: swapped out");
        let table =
            s.kv.block_table(item.seq)
                .unwrap_or_else(|| panic!("{item:?}: no block table"));
        assert!(!table.blocks().is_empty(), "{item:?}: empty block table");
        assert_eq!(table.num_tokens(), item.start + item.len, "{item:?}");
        assert!(table.blocks().len() * bs >= item.start + item.len);
        tables.extend(table.blocks().iter().copied());
    }
    for (src, dst) in &plan.cow {
        assert!(
            tables.contains(dst),
            "copy {src:?} -> {dst:?} writes a block no planned sequence holds"
        );
    }
}

/// Runs one step: every sampled item gets token 7 (or forks first for `n > 1`), and sequences
/// finish at their `max_tokens`. Returns the plan.
fn step(s: &mut Scheduler) -> StepPlan {
    let plan = s.schedule();
    check_plan(s, &plan);
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
    s.update_tenant(TenantId(0), 1.0, Some(12));
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
    assert!(s.kv.tenant_usage(TenantId(0)) <= 12);
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

/// A group preempted to be computed again still counts as computing its prompt while it waits:
/// a peer asking for those blocks waits for its next admission rather than getting nothing.
#[test]
fn a_preempted_groups_prompt_is_still_to_be_computed() {
    let mut s = scheduler(16, PreemptMode::Recompute);
    // Each its own tenant and scope, so its own prompt blocks.
    for i in 0..5 {
        add_with(&mut s, i, i as u32, 1.0, 8, 1, 24).unwrap();
    }
    let mut steps = 0;
    // A group that was admitted once (its first admission's hashes are gone) and waits again.
    let victim = loop {
        step(&mut s);
        let preempted = s
            .groups
            .values()
            .find(|g| g.status == SeqStatus::Waiting && g.preemptions > 0);
        if let Some(g) = preempted {
            break g.id;
        }
        steps += 1;
        assert!(steps < 1000, "no preempted group waited");
    };
    let g = &s.groups[&victim];
    let prompt = &g.seqs[0].tokens[..g.prompt_len];
    let hashed = s.kv.hash_prompt(g.scope, prompt);
    assert!(!hashed.hashes().is_empty());
    for &h in hashed.hashes() {
        assert!(
            s.will_compute(h),
            "a preempted prompt's block counts as not coming"
        );
    }
    // A block no request here has does not.
    let tokens = prompt.to_vec();
    let elsewhere = s.kv.scope("elsewhere");
    let other = s.kv.hash_prompt(elsewhere, &tokens);
    assert!(other.hashes().iter().all(|&h| !s.will_compute(h)));
}

/// A low-priority group that arrived first is decoded first; a later, higher-priority group then
/// needs the last block and takes it from the first, whose decode was already planned.
#[test]
fn a_victim_planned_this_step_leaves_the_plan() {
    for mode in [PreemptMode::Recompute, PreemptMode::Swap] {
        let mut s = scheduler(4, mode);
        // 5 tokens: one full block and one with room; 8 tokens: two full blocks.
        add_with(&mut s, 1, 0, 0.5, 5, 1, 3).unwrap();
        add_with(&mut s, 2, 1, 2.0, 8, 1, 3).unwrap();
        step(&mut s);
        assert_eq!(s.kv.num_free_blocks(), 0, "{mode:?}: the pool is full");
        let plan = step(&mut s);
        assert_eq!(plan.preempted, vec![(GroupId(1), mode)], "{mode:?}");
        assert!(
            plan.items.iter().all(|i| i.group == GroupId(2)),
            "{mode:?}: {:?}",
            plan.items
        );
        let mut steps = 0;
        while s.has_work() {
            step(&mut s);
            steps += 1;
            assert!(steps < 100, "{mode:?}: no progress");
        }
        assert_eq!(s.kv.usage().used, 0, "{mode:?}");
        assert_eq!(s.kv.usage().host_used, 0, "{mode:?}");
    }
}

/// Random arrivals of three tenants with mixed priorities, `n` samples and aborts over a pool
/// that is often full, in both preemption modes: every plan is one the model runner can run, the
/// block manager stays consistent, every request ends, and every block comes back.
#[test]
fn randomized_mixed_priorities_keep_plans_runnable_and_return_every_block() {
    for mode in [PreemptMode::Recompute, PreemptMode::Swap] {
        for seed in 0..48 {
            random_run(mode, seed);
        }
    }
}

fn random_run(mode: PreemptMode, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut s = Scheduler::new(
        SchedulerConfig {
            max_batched_tokens: 24,
            decode_step_prefill_tokens: 24,
            max_seqs: 6,
            preempt_mode: mode,
        },
        test_manager(20, 40, 4),
    );
    let priorities = [0.5, 1.0, 2.0, 4.0];
    let mut next = 0u64;
    for n in 0..300 {
        if n < 150 && rng.gen_bool(0.5) {
            let tenant = rng.gen_range(0..3);
            let priority = priorities[rng.gen_range(0..priorities.len())];
            let (len, samples, max) = (
                rng.gen_range(1..=14),
                rng.gen_range(1..=3),
                rng.gen_range(1..=10),
            );
            let _ = add_with(&mut s, next, tenant, priority, len, samples, max);
            next += 1;
        }
        if next > 0 && rng.gen_bool(0.03) {
            s.abort(GroupId(rng.gen_range(0..next)));
        }
        step(&mut s);
    }
    let mut steps = 0;
    while s.has_work() {
        step(&mut s);
        steps += 1;
        assert!(steps < 2000, "{mode:?} seed {seed}: no progress");
    }
    let usage = s.kv.usage();
    assert_eq!(
        (usage.used, usage.host_used, s.kv.num_sequences()),
        (0, 0, 0),
        "{mode:?} seed {seed}: blocks left behind"
    );
}

/// Runs steps until no work is left; panics after `limit` steps.
fn drain(s: &mut Scheduler, limit: usize) -> Vec<(GroupId, PreemptMode)> {
    let mut preempted = Vec::new();
    let mut steps = 0;
    while s.has_work() {
        preempted.extend(step(s).preempted);
        steps += 1;
        assert!(steps < limit, "no progress in {limit} steps");
    }
    assert_eq!(s.kv.usage().used, 0);
    assert_eq!(s.kv.usage().host_used, 0);
    preempted
}

/// Each request carries its tenant's settings, as the engine thread applies them.
fn submit(
    s: &mut Scheduler,
    id: u64,
    tenant: u32,
    quota: Option<u32>,
    scope: &str,
    prompt_len: usize,
    max_tokens: usize,
) -> Result<(), String> {
    s.update_tenant(TenantId(tenant), 1.0, quota);
    add_in(s, id, tenant, scope, 1.0, prompt_len, 1, max_tokens)
}

#[test]
fn quotas_belong_to_tenants_and_follow_their_updates() {
    let mut s = scheduler(64, PreemptMode::Recompute);
    // 8 prompt tokens and 4 generated: up to 2 + 1 + 1 = 4 blocks of 4 tokens.
    let err = submit(&mut s, 1, 0, Some(2), "shared", 8, 4).unwrap_err();
    assert!(err.contains("quota of 2"), "{err}");
    // Tenant 1 shares the scope and has no quota: tenant 0's is not its own.
    submit(&mut s, 2, 1, None, "shared", 8, 4).unwrap();
    // Tenant 0's quota is removed: its next request carries none.
    submit(&mut s, 3, 0, None, "shared", 8, 4).unwrap();
    assert_eq!(s.kv.quota(TenantId(0)), None);
    step(&mut s);
    assert!(s.kv.tenant_usage(TenantId(0)) > 0 && s.kv.tenant_usage(TenantId(1)) > 0);
    drain(&mut s, 100);
    // And set again: it holds from the next request on.
    let err = submit(&mut s, 4, 0, Some(3), "shared", 8, 4).unwrap_err();
    assert!(err.contains("quota of 3"), "{err}");
}

/// Two requests of one tenant that each fit its quota but not together: the later one is
/// preempted when their decodes reach the quota, instead of both waiting on each other.
#[test]
fn a_tenants_decodes_at_its_quota_preempt_within_the_tenant() {
    for mode in [PreemptMode::Recompute, PreemptMode::Swap] {
        let mut s = scheduler(64, mode);
        // 4 prompt tokens and 14 generated: up to 1 + 4 + 1 = 6 blocks; 5 are used; 10 > 8.
        submit(&mut s, 1, 0, Some(8), "t0", 4, 14).unwrap();
        submit(&mut s, 2, 0, Some(8), "t0", 4, 14).unwrap();
        submit(&mut s, 3, 1, None, "t1", 4, 14).unwrap();
        let mut steps = 0;
        let mut preempted = Vec::new();
        while s.has_work() {
            preempted.extend(step(&mut s).preempted);
            assert!(s.kv.tenant_usage(TenantId(0)) <= 8, "{mode:?}");
            steps += 1;
            assert!(
                steps < 200,
                "{mode:?}: the tenant's requests wait on each other"
            );
        }
        assert!(
            preempted.iter().all(|(g, _)| *g == GroupId(2)),
            "{mode:?}: only the tenant's later request yields: {preempted:?}"
        );
        assert!(!preempted.is_empty(), "{mode:?}");
    }
}

/// A quota lowered under what a running request needs: it is refused, not left waiting.
#[test]
fn a_quota_lowered_under_a_running_request_refuses_it() {
    let mut s = scheduler(64, PreemptMode::Recompute);
    submit(&mut s, 1, 0, Some(8), "t0", 4, 14).unwrap();
    step(&mut s);
    step(&mut s);
    s.update_tenant(TenantId(0), 1.0, Some(1));
    let mut rejected = Vec::new();
    for _ in 0..10 {
        rejected.extend(step(&mut s).rejected);
    }
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert!(rejected[0].1.contains("quota of 1"), "{rejected:?}");
    assert!(!s.has_work());
    assert_eq!(s.kv.usage().used, 0);
}

/// Random arrivals of four tenants in two shared scopes, whose quotas come and go with their
/// requests: nothing waits for ever, no tenant goes over a quota it had when a block was taken,
/// and every block comes back.
#[test]
fn randomized_quota_updates_in_shared_scopes_never_wedge() {
    for mode in [PreemptMode::Recompute, PreemptMode::Swap] {
        for seed in 0..32 {
            let mut rng = StdRng::seed_from_u64(1000 + seed);
            let mut s = Scheduler::new(
                SchedulerConfig {
                    max_batched_tokens: 24,
                    decode_step_prefill_tokens: 24,
                    max_seqs: 6,
                    preempt_mode: mode,
                },
                test_manager(24, 40, 4),
            );
            for id in 0..120 {
                if rng.gen_bool(0.5) {
                    let tenant = rng.gen_range(0..4);
                    let scope = ["a", "b"][tenant as usize % 2];
                    let quota = [None, Some(6), Some(10), Some(16)][rng.gen_range(0..4)];
                    s.update_tenant(TenantId(tenant), 1.0, quota);
                    let (len, n, max) = (
                        rng.gen_range(1..=14),
                        rng.gen_range(1..=2),
                        rng.gen_range(1..=10),
                    );
                    let _ = add_in(&mut s, id, tenant, scope, 1.0, len, n, max);
                }
                step(&mut s);
            }
            drain(&mut s, 3000);
            assert_eq!(s.kv.num_sequences(), 0, "{mode:?} seed {seed}");
        }
    }
}

/// A prefill in chunks whose tenant's quota is lowered under its prompt: refused, not left
/// waiting for room that never comes (no decode of the tenant would ever preempt for it).
#[test]
fn a_prefill_under_a_quota_lowered_below_its_prompt_is_refused() {
    for mode in [PreemptMode::Recompute, PreemptMode::Swap] {
        let mut s = Scheduler::new(
            SchedulerConfig {
                max_batched_tokens: 8,
                decode_step_prefill_tokens: 8,
                max_seqs: 8,
                preempt_mode: mode,
            },
            test_manager(64, 64, 4),
        );
        // 24 prompt tokens and 2 generated: up to 6 + 1 + 1 = 8 blocks; 8 tokens a step.
        submit(&mut s, 1, 0, Some(16), "t0", 24, 2).unwrap();
        step(&mut s);
        s.update_tenant(TenantId(0), 1.0, Some(4));
        let mut rejected = Vec::new();
        for _ in 0..10 {
            rejected.extend(step(&mut s).rejected);
        }
        assert_eq!(rejected.len(), 1, "{mode:?}: {rejected:?}");
        assert!(!s.has_work(), "{mode:?}");
        assert_eq!(s.kv.usage().used, 0, "{mode:?}");
    }
}

/// A step that decodes computes at most `decode_step_prefill_tokens` prompt tokens, so a long
/// prompt arriving does not hold the running requests' next tokens back for its whole prefill;
/// a step with nothing to decode uses the whole budget.
#[test]
fn a_step_that_decodes_caps_its_prefill() {
    let mut s = Scheduler::new(
        SchedulerConfig {
            max_batched_tokens: 64,
            decode_step_prefill_tokens: 16,
            max_seqs: 8,
            preempt_mode: PreemptMode::Recompute,
        },
        test_manager(256, 64, 4),
    );
    // Alone, a 60-token prompt is computed in one step.
    add(&mut s, 1, 0, 60, 1, 20);
    let plan = step(&mut s);
    assert_eq!(plan.items.iter().map(|i| i.len).sum::<usize>(), 60);
    // Now it decodes: the next prompt comes 16 tokens a step, beside that decode.
    add(&mut s, 2, 1, 60, 1, 20);
    for done in [16, 32, 48, 60] {
        let plan = step(&mut s);
        let prefill: Vec<&StepItem> = plan
            .items
            .iter()
            .filter(|i| i.group == GroupId(2))
            .collect();
        assert_eq!(prefill.len(), 1);
        assert_eq!(prefill[0].start + prefill[0].len, done);
        assert!(plan
            .items
            .iter()
            .any(|i| i.group == GroupId(1) && i.len == 1));
    }
    drain(&mut s, 100);
    assert_eq!(s.kv.num_sequences(), 0);
}

/// [`step`], then each constrained sample that decoded pays for its mask, as the engine does.
fn step_paying(s: &mut Scheduler, costs: &[(u32, SeqId, f64)]) -> StepPlan {
    let plan = step(s);
    for &(tenant, seq, secs) in costs {
        if plan.items.iter().any(|i| i.seq == seq) {
            s.observe_mask(TenantId(tenant), Some(seq), secs);
        }
    }
    plan
}

#[test]
fn a_tenant_with_slow_grammar_masks_takes_turns_within_its_share_of_the_step() {
    let mut s = scheduler(256, PreemptMode::Recompute);
    // Tenant 0: four constrained samples (one request, and one of n = 3) whose masks take 10 ms
    // each; tenant 1: two requests, one of them constrained with quick masks. A 20 ms forward
    // pass: 10 ms of masks for each tenant.
    add(&mut s, 1, 0, 4, 1, 40);
    add(&mut s, 2, 0, 4, 3, 40);
    add(&mut s, 5, 1, 4, 1, 12);
    add(&mut s, 6, 1, 4, 1, 12);
    step(&mut s);
    s.set_mask_budget(0.020);
    let slow: Vec<SeqId> = [1, 2]
        .iter()
        .flat_map(|&g| s.group(GroupId(g)).unwrap().seqs.iter().map(|q| q.id))
        .collect();
    assert_eq!(slow.len(), 4);
    let quick = s.group(GroupId(6)).unwrap().seqs[0].id;
    let mut costs: Vec<(u32, SeqId, f64)> = slow.iter().map(|&q| (0, q, 0.010)).collect();
    costs.push((1, quick, 0.000_05));
    for &(t, q, c) in &costs {
        s.observe_mask(TenantId(t), Some(q), c);
    }
    let mut turns = vec![0usize; slow.len()];
    let mut steps = 0;
    while s.group(GroupId(5)).is_some() {
        let plan = step_paying(&mut s, &costs);
        steps += 1;
        let decoded: HashSet<GroupId> = plan.items.iter().map(|i| i.group).collect();
        assert!(decoded.contains(&GroupId(5)) && decoded.contains(&GroupId(6)));
        let went: Vec<usize> = (0..slow.len())
            .filter(|&k| plan.items.iter().any(|i| i.seq == slow[k]))
            .collect();
        assert_eq!(
            went.len(),
            1,
            "step {steps}: samples {went:?} of the slow tenant"
        );
        turns[went[0]] += 1;
    }
    // Eleven steps to the light tenant's twelfth token; the slow samples took turns, those of
    // the n = 3 request among them.
    assert_eq!(steps, 11);
    assert!(turns.iter().all(|&t| t == 2 || t == 3), "{turns:?}");
    assert_eq!(s.mask_deferrals(), 3 * 11);
    // Alone, the slow tenant holds no one up: all of its samples decode every step.
    let plan = step_paying(&mut s, &costs);
    assert_eq!(plan.items.len(), 4);
    assert_eq!(s.mask_deferrals(), 3 * 11);
    drain(&mut s, 100);
}

/// Two tenants decoding one request each (groups 1 and 2, tenants 0 and 1) under a 20 ms mask
/// budget (10 ms a tenant); returns their samples.
fn two_decoding_tenants() -> (Scheduler, SeqId, SeqId) {
    let mut s = scheduler(256, PreemptMode::Recompute);
    add(&mut s, 1, 0, 4, 1, 40);
    add(&mut s, 2, 1, 4, 1, 40);
    step(&mut s);
    s.set_mask_budget(0.020);
    let seq = |s: &Scheduler, g| s.group(GroupId(g)).unwrap().seqs[0].id;
    let (a, b) = (seq(&s, 1), seq(&s, 2));
    (s, a, b)
}

#[test]
fn a_mask_that_costs_three_shares_decodes_every_third_step() {
    // The constrained sample's masks take 30 ms.
    let (mut s, slow, _) = two_decoding_tenants();
    let costs = [(0, slow, 0.030)];
    s.observe_mask(TenantId(0), Some(slow), 0.030);
    let went: Vec<bool> = (0..9)
        .map(|_| {
            step_paying(&mut s, &costs)
                .items
                .iter()
                .any(|i| i.seq == slow)
        })
        .collect();
    assert_eq!(went, [false, false, true].repeat(3));
    assert_eq!(s.mask_deferrals(), 6);
}

#[test]
fn a_step_never_empties_for_masks_alone() {
    let (mut s, a, b) = two_decoding_tenants();
    // Both tenants' only samples cost three shares: holding both back would leave a step with
    // nothing to run, so the one with more credit goes; they take turns.
    let costs = [(0, a, 0.030), (1, b, 0.030)];
    s.observe_mask(TenantId(0), Some(a), 0.030);
    s.observe_mask(TenantId(1), Some(b), 0.030);
    let (mut went_a, mut went_b) = (0, 0);
    for n in 0..12 {
        let plan = step_paying(&mut s, &costs);
        assert!(!plan.items.is_empty(), "step {n} ran nothing");
        went_a += usize::from(plan.items.iter().any(|i| i.seq == a));
        went_b += usize::from(plan.items.iter().any(|i| i.seq == b));
    }
    assert!(went_a >= 4 && went_b >= 4, "{went_a} {went_b}");
}

#[test]
fn masks_that_could_not_wait_are_owed() {
    // A sample whose masks take exactly tenant 0's share decodes every step...
    let (mut s, a, _) = two_decoding_tenants();
    let costs = [(0, a, 0.010)];
    s.observe_mask(TenantId(0), Some(a), 0.010);
    for _ in 0..3 {
        assert!(step_paying(&mut s, &costs).items.iter().any(|i| i.seq == a));
    }
    // ... until the tenant computes 50 ms of masks that could not wait (where a prompt ends):
    // it owes them, and its sample waits five steps while tenant 1 goes on.
    s.observe_mask(TenantId(0), None, 0.050);
    let went: Vec<bool> = (0..6)
        .map(|_| {
            let plan = step_paying(&mut s, &costs);
            assert!(plan.items.iter().any(|i| i.group == GroupId(2)));
            plan.items.iter().any(|i| i.seq == a)
        })
        .collect();
    assert_eq!(went, [false, false, false, false, false, true]);
}
