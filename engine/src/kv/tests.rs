//! Behaviour tests of the block manager, one per rule in the module docs.

use super::*;
use kvgate_protocol::KvEvent;

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

fn start(m: &mut KvCacheManager, seq: u64, scope: &str, tokens: &[u32]) -> usize {
    let scope = m.scope(scope);
    let p = m.hash_prompt(scope, tokens);
    m.allocate_prompt(SeqId(seq), &p, tokens)
        .unwrap()
        .cached_tokens
}

#[test]
fn prompt_allocation_hits_the_cached_prefix_but_computes_the_last_token() {
    let mut m = test_manager(16, 0, 4);
    let prompt = toks(0..10);
    assert_eq!(start(&mut m, 1, "a", &prompt), 0);
    assert_eq!(m.block_table(SeqId(1)).unwrap().blocks().len(), 3);
    // Same prompt again: two full blocks hit, the partial third is computed.
    assert_eq!(start(&mut m, 2, "a", &prompt), 8);
    let (t1, t2) = (
        m.block_table(SeqId(1)).unwrap(),
        m.block_table(SeqId(2)).unwrap(),
    );
    assert_eq!(t1.blocks()[..2], t2.blocks()[..2]);
    assert_ne!(t1.blocks()[2], t2.blocks()[2]);
    assert_eq!(m.pool().meta(t1.blocks()[0]).ref_count, 2);
    // A prompt of exactly two blocks hits only one: its last token must be computed.
    assert_eq!(start(&mut m, 3, "a", &toks(0..8)), 4);
    m.check_invariants().unwrap();
    let c = m.counters();
    assert_eq!((c.queried_tokens, c.hit_tokens), (28, 12));
}

#[test]
fn scopes_never_share_blocks() {
    let mut m = test_manager(16, 0, 4);
    let prompt = toks(0..9);
    start(&mut m, 1, "tenant-a", &prompt);
    assert_eq!(start(&mut m, 2, "tenant-b", &prompt), 0);
    assert_eq!(start(&mut m, 3, "tenant-a", &prompt), 8);
}

#[test]
fn freed_blocks_stay_cached_until_reused_and_tails_go_first() {
    let mut m = test_manager(4, 0, 4);
    start(&mut m, 1, "a", &toks(0..12));
    let blocks = m.block_table(SeqId(1)).unwrap().blocks().to_vec();
    m.free(SeqId(1)).unwrap();
    assert_eq!(m.usage().cached, 3);
    // Tail-first: the last logical block is next in line for eviction (after the never-used one).
    let order: Vec<_> = m.pool().free_list().collect();
    assert_eq!(&order[1..], &[blocks[2], blocks[1], blocks[0]]);
    // A new unrelated sequence of 2 blocks takes the empty block, then evicts the tail.
    start(&mut m, 2, "a", &toks(100..108));
    assert_eq!(m.counters().evicted_blocks, 1);
    assert_eq!(
        m.index()
            .get(m.hash_prompt(ScopeId(0), &toks(0..12)).hashes()[2]),
        None
    );
    // The surviving prefix still hits.
    m.free(SeqId(2)).unwrap();
    assert_eq!(start(&mut m, 3, "a", &toks(0..9)), 8);
    m.check_invariants().unwrap();
}

#[test]
fn blocks_filled_by_decode_are_registered_at_once() {
    let mut m = test_manager(8, 0, 4);
    start(&mut m, 1, "a", &toks(0..3));
    assert!(m.index().is_empty());
    m.append_slots(SeqId(1), &[3]).unwrap();
    assert_eq!(m.index().len(), 1);
    m.append_slots(SeqId(1), &[4, 5, 6, 7]).unwrap();
    assert_eq!(m.index().len(), 2);
    // A later turn of the conversation hits the generated tokens too.
    assert_eq!(start(&mut m, 2, "a", &toks(0..11)), 8);
    // The two blocks of one chain are published as one event.
    let events = m.drain_events();
    assert_eq!(events.len(), 1);
    let KvEvent::BlockStored { hashes, parent, .. } = &events[0].event else {
        panic!("expected BlockStored, got {events:?}");
    };
    assert_eq!(parent, &None);
    assert_eq!(hashes, m.hash_prompt(ScopeId(0), &toks(0..8)).hashes());
}

#[test]
fn fork_shares_blocks_and_copies_the_partial_block_on_write() {
    let mut m = test_manager(8, 0, 4);
    start(&mut m, 1, "a", &toks(0..6));
    m.fork(SeqId(1), SeqId(2)).unwrap();
    let shared = m.block_table(SeqId(1)).unwrap().blocks().to_vec();
    assert!(shared.iter().all(|b| m.pool().meta(*b).ref_count == 2));
    let out = m.append_slots(SeqId(2), &[60]).unwrap();
    let (src, dst) = out
        .cow
        .expect("write into a shared partial block copies it");
    assert_eq!(src, shared[1]);
    assert_eq!(m.block_table(SeqId(2)).unwrap().blocks(), &[shared[0], dst]);
    assert_eq!(m.pool().meta(src).ref_count, 1);
    assert_eq!(m.pool().meta(dst).filled, 3);
    // The original owns the old block alone now: no copy.
    assert_eq!(m.append_slots(SeqId(1), &[6]).unwrap().cow, None);
    assert_eq!(m.counters().cow_copies, 1);
    m.check_invariants().unwrap();
    m.free(SeqId(1)).unwrap();
    m.free(SeqId(2)).unwrap();
    assert_eq!(m.usage().used, 0);
}

#[test]
fn failed_operations_change_nothing() {
    let mut m = test_manager(3, 1, 4);
    start(&mut m, 1, "a", &toks(0..8));
    let before = m.usage();
    assert_eq!(
        m.append_slots(SeqId(1), &toks(0..9)),
        Err(KvError::OutOfBlocks { needed: 3, free: 1 })
    );
    let scope = m.scope("a");
    let p = m.hash_prompt(scope, &toks(50..62));
    assert!(matches!(
        m.allocate_prompt(SeqId(2), &p, &toks(50..62)),
        Err(KvError::OutOfBlocks { .. })
    ));
    assert_eq!(
        m.swap_out(&[SeqId(1)]).unwrap_err().code(),
        "out_of_host_blocks"
    );
    assert_eq!(m.usage(), before);
    assert_eq!(m.num_sequences(), 1);
    m.check_invariants().unwrap();
}

/// Starts `seq` for `tenant` in `scope`.
fn start_for(
    m: &mut KvCacheManager,
    seq: u64,
    tenant: u32,
    scope: &str,
    tokens: &[u32],
) -> Result<usize, KvError> {
    let scope = m.scope(scope);
    let p = m.hash_prompt(scope, tokens).for_tenant(TenantId(tenant));
    m.allocate_prompt(SeqId(seq), &p, tokens)
        .map(|a| a.cached_tokens)
}

#[test]
fn quotas_cap_a_tenant_and_not_the_tenants_sharing_its_scope() {
    let mut m = test_manager(16, 0, 4);
    let (a, b) = (TenantId(0), TenantId(1));
    m.set_quota(a, Some(2));
    start_for(&mut m, 1, 0, "shared", &toks(0..8)).unwrap();
    let err = m.append_slots(SeqId(1), &[1]).unwrap_err();
    assert_eq!(err.code(), "kv_quota_exceeded");
    // Tenant b, no quota, same scope: it hits a's two blocks and goes well past 2 blocks.
    assert_eq!(start_for(&mut m, 2, 1, "shared", &toks(0..20)).unwrap(), 8);
    m.append_slots(SeqId(2), &toks(0..8)).unwrap();
    // The shared blocks count for both: either tenant alone would keep them.
    assert_eq!((m.tenant_usage(a), m.tenant_usage(b)), (2, 7));
    // A quota removed is gone.
    m.set_quota(a, None);
    assert_eq!(m.quota(a), None);
    m.append_slots(SeqId(1), &[1]).unwrap();
    assert_eq!(m.tenant_usage(a), 3);
    m.check_invariants().unwrap();
    m.free(SeqId(1)).unwrap();
    m.free(SeqId(2)).unwrap();
    assert_eq!((m.tenant_usage(a), m.tenant_usage(b)), (0, 0));
    m.check_invariants().unwrap();
}

#[test]
fn a_hit_on_another_tenants_block_counts_against_the_quota() {
    let mut m = test_manager(16, 0, 4);
    start_for(&mut m, 1, 0, "shared", &toks(0..13)).unwrap();
    m.set_quota(TenantId(1), Some(2));
    // Three full blocks would be hit, all held by tenant 0 only: new to tenant 1.
    let err = start_for(&mut m, 2, 1, "shared", &toks(0..13)).unwrap_err();
    assert_eq!(err.code(), "kv_quota_exceeded");
    assert_eq!(m.num_sequences(), 1);
    m.check_invariants().unwrap();
}

#[test]
fn swap_out_and_in_round_trips_and_reuses_cached_blocks() {
    let mut m = test_manager(8, 8, 4);
    start(&mut m, 1, "a", &toks(0..10));
    m.fork(SeqId(1), SeqId(2)).unwrap();
    let plan = m.swap_out(&[SeqId(1), SeqId(2)]).unwrap();
    assert_eq!(plan.to_host.len(), 3, "shared blocks get one host copy");
    assert!(m.is_swapped_out(SeqId(1)));
    assert_eq!(m.usage().used, 0);
    assert_eq!(
        m.append_slots(SeqId(1), &[1]).unwrap_err().code(),
        "swapped_out"
    );
    m.check_invariants().unwrap();
    // The two full blocks are still cached on the device: only the partial one is copied back.
    let plan = m.swap_in(&[SeqId(1), SeqId(2)]).unwrap();
    assert_eq!(plan.to_device.len(), 1);
    assert_eq!(m.usage().host_used, 0);
    let t1 = m.block_table(SeqId(1)).unwrap();
    assert_eq!(t1.num_tokens(), 10);
    assert_eq!(t1.blocks(), m.block_table(SeqId(2)).unwrap().blocks());
    m.check_invariants().unwrap();
    assert_eq!(m.counters().swapped_out_blocks, 3);
    assert_eq!(m.counters().swapped_in_blocks, 1);
}

#[test]
fn flush_drops_cached_prefixes_of_one_scope_or_all() {
    let mut m = test_manager(16, 0, 4);
    start(&mut m, 1, "a", &toks(0..9));
    start(&mut m, 2, "b", &toks(0..9));
    m.free(SeqId(1)).unwrap();
    m.drain_events();
    let a = m.scope("a");
    assert_eq!(m.flush(Some(a)), 2);
    assert_eq!(start(&mut m, 3, "a", &toks(0..9)), 0);
    assert_eq!(start(&mut m, 4, "b", &toks(0..9)), 8);
    assert!(matches!(
        m.drain_events()[0].event,
        KvEvent::BlockRemoved { ref hashes } if hashes.len() == 2
    ));
    m.flush(None);
    assert!(m.index().is_empty());
    assert_eq!(m.drain_events().last().unwrap().event, KvEvent::AllCleared);
    assert_eq!(start(&mut m, 5, "b", &toks(0..9)), 0);
    m.check_invariants().unwrap();
}

#[test]
fn usage_counts_used_cached_free_and_filled_slots() {
    let mut m = test_manager(10, 0, 4);
    start(&mut m, 1, "a", &toks(0..6));
    start(&mut m, 2, "a", &toks(100..104));
    m.free(SeqId(2)).unwrap();
    let u = m.usage();
    assert_eq!((u.capacity, u.used, u.cached, u.free), (10, 2, 1, 7));
    assert_eq!(u.filled_slots, 6);
}

#[test]
fn bad_calls_are_errors() {
    let mut m = test_manager(4, 0, 4);
    let s = m.scope("a");
    let empty = m.hash_prompt(s, &[]);
    assert_eq!(
        m.start_sequence(SeqId(1), &empty),
        Err(KvError::EmptyPrompt)
    );
    start(&mut m, 1, "a", &[1, 2]);
    let p = m.hash_prompt(s, &[1]);
    assert_eq!(
        m.start_sequence(SeqId(1), &p),
        Err(KvError::DuplicateSequence(SeqId(1)))
    );
    assert_eq!(m.free(SeqId(9)), Err(KvError::UnknownSequence(SeqId(9))));
    assert_eq!(
        m.fork(SeqId(1), SeqId(1)),
        Err(KvError::DuplicateSequence(SeqId(1)))
    );
    assert_eq!(
        m.swap_in(&[SeqId(1)]),
        Err(KvError::NotSwappedOut(SeqId(1)))
    );
}

fn tiered(num_blocks: u32, host: u32, disk: u32) -> KvCacheManager {
    let params = kvgate_protocol::HashParams {
        model_id: "test".into(),
        weight_version: "0".into(),
        kv_dtype: "f32".into(),
        block_size: 4,
        seed: [0; 32],
    };
    KvCacheManager::new(KvConfig {
        num_blocks,
        num_host_blocks: 0,
        hasher: kvgate_protocol::BlockHasher::new(&params),
        tiers: TierConfig {
            host_blocks: host,
            disk_blocks: disk,
        },
    })
}

fn ops_of(m: &mut KvCacheManager) -> (usize, usize, usize, usize) {
    let ops = m.take_tier_ops();
    let count = |f: fn(&TierOp) -> bool| ops.iter().filter(|o| f(o)).count();
    (
        count(|o| matches!(o, TierOp::Demote { .. })),
        count(|o| matches!(o, TierOp::Promote { .. })),
        count(|o| matches!(o, TierOp::Spill { .. })),
        count(|o| matches!(o, TierOp::Delete { .. } | TierOp::DeleteAll)),
    )
}

#[test]
fn evicted_blocks_demote_to_the_host_tier_and_are_promoted_back() {
    use kvgate_protocol::Tier;
    let mut m = tiered(4, 8, 0);
    let prompt = toks(0..13);
    assert_eq!(start(&mut m, 1, "a", &prompt), 0);
    m.free(SeqId(1)).unwrap();
    m.drain_events();
    // An unrelated prompt takes all four blocks: the three cached ones demote, none is lost.
    start(&mut m, 2, "a", &toks(100..113));
    assert_eq!(ops_of(&mut m), (3, 0, 0, 0));
    assert_eq!(m.usage().host_cached, 3);
    let events = m.drain_events();
    assert!(events.iter().any(
        |e| matches!(&e.event, KvEvent::BlockTier { hashes, tier: Tier::Host } if hashes.len() == 3)
    ));
    assert!(!events
        .iter()
        .any(|e| matches!(e.event, KvEvent::BlockRemoved { .. })));
    m.free(SeqId(2)).unwrap();
    // The first prompt again: its three full blocks come back from the host tier (the last
    // token is still computed), and the blocks they displace demote in turn.
    assert_eq!(start(&mut m, 3, "a", &prompt), 12);
    let ops = m.take_tier_ops();
    // A promotion's device block, if it held a cached block, was demoted before (its old
    // block read out before it is overwritten), never after.
    for (i, op) in ops.iter().enumerate() {
        if let TierOp::Promote { device, .. } = op {
            assert!(!ops[i..]
                .iter()
                .any(|d| matches!(d, TierOp::Demote { device: x, .. } if x == device)));
        }
    }
    assert!(ops.iter().any(|o| matches!(o, TierOp::Demote { .. })));
    assert_eq!(
        ops.iter()
            .filter(|o| matches!(o, TierOp::Promote { .. }))
            .count(),
        3
    );
    let c = m.tier_counters();
    assert_eq!((c.promoted_blocks, c.host_hit_tokens), (3, 12));
    // A block lives in the device pool or the host tier, never both.
    assert_eq!(
        m.usage().host_cached,
        3,
        "the second prompt's blocks took their place"
    );
    m.check_invariants().unwrap();
    // Another scope never hits them, in any tier.
    m.free(SeqId(3)).unwrap();
    assert_eq!(start(&mut m, 4, "b", &toks(100..113)), 0);
}

#[test]
fn what_a_peer_could_send_starts_past_every_tier_here_and_registers_no_scope() {
    let mut m = tiered(4, 8, 0);
    // Blocks of 4: 13 tokens have three full blocks before the one holding the last token,
    // which is always computed.
    let prompt = toks(0..13);
    let (from, run) = m.missing_run("never", &prompt);
    assert_eq!((from, run.len()), (0, 3));
    // Asked between a step's layers, it must not change anything: the scope stays unknown,
    // and its hashes are those it gets once used.
    assert!(m.known_scope("never").is_none());
    let scope = m.scope("never");
    assert_eq!(run, m.hash_prompt(scope, &prompt).hashes()[..3].to_vec());
    // Cached in the device pool: nothing is missing.
    start(&mut m, 1, "a", &prompt);
    m.free(SeqId(1)).unwrap();
    assert_eq!(m.missing_run("a", &prompt), (3, Vec::new()));
    // Demoted to the host tier by another prompt: still held here.
    start(&mut m, 2, "a", &toks(100..113));
    assert_eq!(m.usage().host_cached, 3);
    assert_eq!(m.missing_run("a", &prompt), (3, Vec::new()));
    // A prompt of exactly three blocks: the third holds its last token and is computed.
    assert_eq!(m.missing_run("a", &toks(0..12)), (2, Vec::new()));
    // A longer prompt misses the two full blocks past them.
    let (from, run) = m.missing_run("a", &toks(0..21));
    assert_eq!((from, run.len()), (3, 2));
    // Another scope holds none of them.
    assert_eq!(m.missing_run("b", &prompt).0, 0);
}

#[test]
fn host_evictions_spill_to_disk_once_and_load_back() {
    let mut m = tiered(4, 2, 8);
    let prompt = toks(0..13);
    start(&mut m, 1, "a", &prompt);
    m.free(SeqId(1)).unwrap();
    start(&mut m, 2, "a", &toks(100..113));
    // Three demotions into a two-slot host tier: the oldest spills to disk.
    assert_eq!(ops_of(&mut m), (3, 0, 1, 0));
    assert_eq!((m.usage().host_cached, m.usage().disk_cached), (2, 1));
    m.free(SeqId(2)).unwrap();
    let scope = m.scope("a");
    let hashed = m.hash_prompt(scope, &prompt);
    // Freed tail first, block 2 was evicted first and spilled: the cached run is blocks 0 and
    // 1 in the host tier, then block 2 on disk.
    let run = m.disk_run(&hashed);
    assert_eq!(run, vec![hashed.hashes()[2]]);
    let slot = m.load_from_disk(run[0]).expect("a host slot");
    assert!(slot < 2);
    // Loading evicted a host block; it was not on disk yet, so it spills.
    assert_eq!(ops_of(&mut m).2, 1);
    assert!(
        m.load_from_disk(run[0]).is_none(),
        "already in the host tier"
    );
    m.check_invariants().unwrap();
    // Corrupt on disk: it leaves the tier and its file is deleted.
    let on_disk = m.snapshot_after_drain().len();
    m.disk_lost(hashed.hashes()[2]);
    assert_eq!(ops_of(&mut m).3, 1);
    assert_eq!(
        m.snapshot_after_drain().len(),
        on_disk,
        "the host copy still counts"
    );
}

#[test]
fn flush_reaches_every_tier_of_its_scope_only() {
    let mut m = tiered(4, 2, 8);
    start(&mut m, 1, "a", &toks(0..13));
    m.free(SeqId(1)).unwrap();
    start(&mut m, 2, "b", &toks(100..113));
    m.free(SeqId(2)).unwrap();
    start(&mut m, 3, "b", &toks(200..213));
    m.take_tier_ops();
    let a = m.scope("a");
    let before = m.usage();
    assert!(before.host_cached + before.disk_cached >= 3);
    let dropped = m.flush(Some(a));
    assert_eq!(dropped, 3, "a's three blocks, wherever they were");
    let (_, _, _, deletes) = ops_of(&mut m);
    assert!(deletes >= 1, "a's disk files are deleted");
    let snap = m.snapshot_after_drain();
    assert!(snap.iter().all(|b| b.scope == "b"));
    m.flush(None);
    assert!(m.take_tier_ops().contains(&TierOp::DeleteAll));
    assert!(m.snapshot_after_drain().is_empty());
    m.check_invariants().unwrap();
}

#[test]
fn persisting_writes_device_and_host_blocks_not_yet_on_disk() {
    let mut m = tiered(8, 2, 16);
    start(&mut m, 1, "a", &toks(0..13));
    m.free(SeqId(1)).unwrap();
    start(&mut m, 2, "a", &toks(100..109));
    m.take_tier_ops();
    assert_eq!(m.persist_to_disk(2), 2, "as many as asked for");
    assert_eq!(m.persist_to_disk(100), 3);
    let ops = m.take_tier_ops();
    assert_eq!(
        ops.iter()
            .filter(|o| matches!(o, TierOp::Save { .. }))
            .count(),
        5
    );
    assert_eq!(m.persist_to_disk(100), 0, "everything is on disk now");
    // A restart finds them: the restored tier answers the same run.
    let blocks: Vec<_> = m
        .snapshot_after_drain()
        .into_iter()
        .map(|b| (b.hash, b.scope))
        .collect();
    let mut fresh = tiered(8, 2, 16);
    fresh.restore_disk_tier(blocks);
    let scope = fresh.scope("a");
    let hashed = fresh.hash_prompt(scope, &toks(0..13));
    assert_eq!(
        fresh.disk_run(&hashed).len(),
        1,
        "half the two-slot host tier at most"
    );
}
