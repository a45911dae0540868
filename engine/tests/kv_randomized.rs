//! Seeded randomized test of the block manager: thousands of random operations, every invariant
//! checked after each one, against a shadow model of what each physical block holds.
//!
//! The shadow writes each appended token into its physical slot, carries out copy-on-write and
//! swap plans as the kernels would, and so can check that every cached hash points at a block
//! holding exactly the tokens that hash stands for. KV events are replayed into a second index,
//! which must equal the live one after every step.

use kvgate_engine::kv::{
    test_manager_tiered, KvCacheManager, ScopeId, SeqId, SwapPlan, TierConfig, TierOp,
};
use kvgate_protocol::{BlockHash, KvEvent, Tier};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

const BS: usize = 4;
const SCOPES: [&str; 3] = ["tenant-a", "tenant-b", "shared"];

struct Harness {
    m: KvCacheManager,
    rng: StdRng,
    /// Tokens of each live sequence.
    tokens: HashMap<SeqId, (ScopeId, Vec<u32>)>,
    /// Shadow device and host memory: the token in each slot.
    device: Vec<Vec<Option<u32>>>,
    host: Vec<Vec<Option<u32>>>,
    /// Hash -> the full token prefix it stands for.
    meaning: HashMap<BlockHash, Vec<u32>>,
    /// Shadow host-tier slots and disk files.
    tier_host: Vec<Vec<Option<u32>>>,
    disk: HashMap<BlockHash, Vec<Option<u32>>>,
    /// The fastest tier of each cached block, replayed from the events.
    replayed: HashMap<BlockHash, Tier>,
    next_seq: u64,
    last_event: u64,
}

impl Harness {
    fn new(seed: u64, tiers: TierConfig) -> Self {
        let (blocks, host) = (48, 24);
        Harness {
            m: test_manager_tiered(blocks, host, BS as u32, tiers),
            rng: StdRng::seed_from_u64(seed),
            tokens: HashMap::new(),
            device: vec![vec![None; BS]; blocks as usize],
            host: vec![vec![None; BS]; host as usize],
            meaning: HashMap::new(),
            tier_host: vec![vec![None; BS]; tiers.host_blocks as usize],
            disk: HashMap::new(),
            replayed: HashMap::new(),
            next_seq: 0,
            last_event: 0,
        }
    }

    fn random_prompt(&mut self) -> Vec<u32> {
        // Prompts share a few prefixes so that hits, sharing and eviction all happen.
        let base = self.rng.gen_range(0..3u32) * 1000;
        let shared = self.rng.gen_range(0..12);
        let own = self.rng.gen_range(1..10);
        let mut t: Vec<u32> = (0..shared).map(|i| base + i).collect();
        t.extend((0..own).map(|_| self.rng.gen_range(5000..5100)));
        t
    }

    fn remember_meaning(&mut self, scope: ScopeId, tokens: &[u32]) {
        let p = self.m.hash_prompt(scope, tokens);
        for (i, h) in p.hashes().iter().enumerate() {
            self.meaning.insert(*h, tokens[..(i + 1) * BS].to_vec());
        }
    }

    fn write_slots(&mut self, seq: SeqId, first_pos: usize, new: &[u32]) {
        let table = self.m.block_table(seq).expect("live sequence").clone();
        for (k, t) in new.iter().enumerate() {
            let slot = table.slot(first_pos + k, BS);
            self.device[slot / BS][slot % BS] = Some(*t);
        }
    }

    fn apply_swap(&mut self, plan: &SwapPlan) {
        for (d, h) in &plan.to_host {
            self.host[h.0 as usize] = self.device[d.0 as usize].clone();
        }
        for (h, d) in &plan.to_device {
            self.device[d.0 as usize] = self.host[h.0 as usize].clone();
        }
    }

    /// Carries out the tier copies planned so far, as the worker would.
    fn apply_tier_ops(&mut self) {
        for op in self.m.take_tier_ops() {
            match op {
                TierOp::Demote { device, host } => {
                    self.tier_host[host as usize] = self.device[device.0 as usize].clone()
                }
                TierOp::Promote { host, device } => {
                    self.device[device.0 as usize] = self.tier_host[host as usize].clone()
                }
                TierOp::Spill { host, hash, .. } => {
                    self.disk
                        .insert(hash, self.tier_host[host as usize].clone());
                }
                TierOp::Save { device, hash, .. } => {
                    self.disk
                        .insert(hash, self.device[device.0 as usize].clone());
                }
                TierOp::Delete { hash } => {
                    self.disk.remove(&hash);
                }
                TierOp::DeleteAll => self.disk.clear(),
            }
        }
    }

    /// A prompt whose cached run continues on disk is read back, as the disk thread would.
    fn op_load(&mut self) {
        let mut scope = self.m.scope(SCOPES[self.rng.gen_range(0..SCOPES.len())]);
        let mut tokens = self.random_prompt();
        // Half the time, the prompt of a block on disk (and one token more).
        let on_disk: Vec<(BlockHash, ScopeId)> = self
            .m
            .disk_tier()
            .map(|d| d.iter().map(|(_, b)| (b.hash, b.scope)).collect())
            .unwrap_or_default();
        if !on_disk.is_empty() && self.rng.gen_bool(0.5) {
            let (hash, s) = on_disk[self.rng.gen_range(0..on_disk.len())];
            scope = s;
            tokens = self.meaning[&hash].clone();
            tokens.push(1);
        }
        let prompt = self.m.hash_prompt(scope, &tokens);
        let run = self.m.disk_run(&prompt);
        self.m.touch_disk(&run);
        // The disk thread reads every file of the run before anything the load causes runs.
        let read: Vec<(BlockHash, Vec<Option<u32>>)> = run
            .iter()
            .map(|h| {
                (
                    *h,
                    self.disk.get(h).cloned().expect("a disk block has a file"),
                )
            })
            .collect();
        for (hash, data) in read {
            if let Some(slot) = self.m.load_from_disk(hash) {
                self.apply_tier_ops();
                self.tier_host[slot as usize] = data;
            }
        }
    }

    /// A peer sends the blocks of a prompt that no tier here holds, as a peer fetch would.
    fn op_import(&mut self) {
        let name = SCOPES[self.rng.gen_range(0..SCOPES.len())];
        let scope = self.m.scope(name);
        let tokens = self.random_prompt();
        self.remember_meaning(scope, &tokens);
        for hash in self.m.missing_run(name, &tokens).1 {
            let prefix = &self.meaning[&hash];
            let data: Vec<Option<u32>> = prefix[prefix.len() - BS..]
                .iter()
                .map(|t| Some(*t))
                .collect();
            if let Some(slot) = self.m.import_to_host(hash, scope) {
                self.apply_tier_ops();
                self.tier_host[slot as usize] = data;
            }
        }
    }

    fn op_start(&mut self) {
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        let scope = self.m.scope(SCOPES[self.rng.gen_range(0..SCOPES.len())]);
        let tokens = self.random_prompt();
        let prompt = self.m.hash_prompt(scope, &tokens);
        if let Ok(a) = self.m.allocate_prompt(seq, &prompt, &tokens) {
            self.apply_tier_ops();
            self.write_slots(seq, a.cached_tokens, &tokens[a.cached_tokens..]);
            self.remember_meaning(scope, &tokens);
            self.tokens.insert(seq, (scope, tokens));
        }
    }

    fn pick(&mut self) -> Option<SeqId> {
        let mut live: Vec<SeqId> = self.tokens.keys().copied().collect();
        live.sort();
        (!live.is_empty()).then(|| live[self.rng.gen_range(0..live.len())])
    }

    fn op_append(&mut self, seq: SeqId) {
        let n = if self.rng.gen_bool(0.8) {
            1
        } else {
            self.rng.gen_range(2..7)
        };
        let new: Vec<u32> = (0..n).map(|_| self.rng.gen_range(0..50)).collect();
        let Ok(out) = self.m.append_slots(seq, &new) else {
            return;
        };
        self.apply_tier_ops();
        if let Some((src, dst)) = out.cow {
            self.device[dst.0 as usize] = self.device[src.0 as usize].clone();
        }
        self.write_slots(seq, out.first_pos, &new);
        let (scope, tokens) = self.tokens.get_mut(&seq).expect("live");
        tokens.extend(&new);
        let (scope, tokens) = (*scope, tokens.clone());
        self.remember_meaning(scope, &tokens);
    }

    fn op_swap(&mut self, seq: SeqId) {
        let plan = if self.m.is_swapped_out(seq) {
            self.m.swap_in(&[seq])
        } else {
            self.m.swap_out(&[seq])
        };
        if let Ok(plan) = plan {
            self.apply_tier_ops();
            self.apply_swap(&plan);
        }
    }

    fn step(&mut self) {
        let roll = self.rng.gen_range(0..100);
        let picked = self.pick();
        match (roll, picked) {
            (0..=29, _) => self.op_start(),
            (30..=64, Some(seq)) if !self.m.is_swapped_out(seq) => self.op_append(seq),
            (65..=72, Some(parent)) => {
                let child = SeqId(self.next_seq);
                self.next_seq += 1;
                if self.m.fork(parent, child).is_ok() {
                    let t = self.tokens[&parent].clone();
                    self.tokens.insert(child, t);
                }
            }
            (73..=87, Some(seq)) => {
                self.m.free(seq).expect("free of a live sequence");
                self.tokens.remove(&seq);
            }
            (88..=93, Some(seq)) => self.op_swap(seq),
            (94, _) => {
                let scope = self.m.scope(SCOPES[self.rng.gen_range(0..SCOPES.len())]);
                self.m.flush(Some(scope));
            }
            (95..=96, _) => self.op_load(),
            (97, _) if self.rng.gen_bool(0.5) => self.op_import(),
            (97, _) if self.rng.gen_bool(0.1) => {
                self.m.persist_to_disk(self.rng.gen_range(1..20));
            }
            (98.., _) if self.rng.gen_bool(0.3) => {
                self.m.flush(None);
            }
            _ => {}
        }
        self.apply_tier_ops();
    }

    fn check(&mut self, step: usize) {
        if let Err(e) = self.m.check_invariants() {
            panic!("step {step}: {e}");
        }
        // Every cached hash points at a block holding the last block of the tokens it stands for.
        for (hash, block) in self.m.index().iter() {
            let prefix = &self.meaning[&hash];
            let want: Vec<Option<u32>> = prefix[prefix.len() - BS..]
                .iter()
                .map(|t| Some(*t))
                .collect();
            assert_eq!(
                self.device[block.0 as usize], want,
                "step {step}: {hash} in {block:?}"
            );
        }
        // Likewise every block of the host tier, and every disk-tier block's file.
        let last_block = |prefix: &Vec<u32>| -> Vec<Option<u32>> {
            prefix[prefix.len() - BS..]
                .iter()
                .map(|t| Some(*t))
                .collect()
        };
        for (slot, b) in self.m.host_tier().iter() {
            assert_eq!(
                self.tier_host[slot as usize],
                last_block(&self.meaning[&b.hash]),
                "step {step}: host tier {}",
                b.hash
            );
        }
        if let Some(disk) = self.m.disk_tier() {
            for (_, b) in disk.iter() {
                assert_eq!(
                    self.disk.get(&b.hash),
                    Some(&last_block(&self.meaning[&b.hash])),
                    "step {step}: disk tier {}",
                    b.hash
                );
            }
        }
        // Every live sequence's table holds its tokens.
        for (seq, (_, tokens)) in &self.tokens {
            if self.m.is_swapped_out(*seq) {
                continue;
            }
            let table = self.m.block_table(*seq).expect("live");
            assert_eq!(table.num_tokens(), tokens.len(), "step {step}: {seq:?}");
            for (pos, t) in tokens.iter().enumerate() {
                let slot = table.slot(pos, BS);
                assert_eq!(
                    self.device[slot / BS][slot % BS],
                    Some(*t),
                    "step {step}: {seq:?}@{pos}"
                );
            }
        }
        // The events, replayed, rebuild the live index.
        for record in self.m.drain_events() {
            assert_eq!(
                record.seq,
                self.last_event + 1,
                "event numbers have no gaps"
            );
            self.last_event = record.seq;
            match record.event {
                KvEvent::BlockStored { hashes, .. } => self
                    .replayed
                    .extend(hashes.into_iter().map(|h| (h, Tier::Device))),
                KvEvent::BlockTier { hashes, tier } => {
                    self.replayed.extend(hashes.into_iter().map(|h| (h, tier)))
                }
                KvEvent::BlockRemoved { hashes } => hashes.iter().for_each(|h| {
                    self.replayed.remove(h);
                }),
                KvEvent::AllCleared => self.replayed.clear(),
            }
        }
        let (_, snap) = self.m.snapshot();
        let live: HashMap<BlockHash, Tier> = snap.iter().map(|b| (b.hash, b.tier)).collect();
        assert_eq!(
            snap.len(),
            live.len(),
            "step {step}: a block twice in the snapshot"
        );
        assert_eq!(
            self.replayed, live,
            "step {step}: replayed events differ from the tiers"
        );
    }
}

#[test]
fn random_operations_keep_every_invariant() {
    random_operations(TierConfig::default());
}

#[test]
fn random_operations_keep_every_invariant_with_host_and_disk_tiers() {
    random_operations(TierConfig {
        host_blocks: 8,
        disk_blocks: 16,
    });
}

fn random_operations(tiers: TierConfig) {
    // Promoted, demoted, spilled, loaded, imported, dropped, saved: over all seeds.
    let mut moved = [0u64; 7];
    for seed in 0..8 {
        let mut h = Harness::new(seed, tiers);
        for step in 0..3000 {
            h.step();
            h.check(step);
        }
        // The run must have exercised every mechanism, or it proves nothing.
        let c = h.m.counters();
        assert!(
            c.hit_tokens > 0 && c.cow_copies > 0 && c.evicted_blocks > 0,
            "{c:?}"
        );
        assert!(c.swapped_out_blocks > 0 && c.swapped_in_blocks > 0, "{c:?}");
        let t = h.m.tier_counters();
        for (sum, n) in moved.iter_mut().zip([
            t.promoted_blocks,
            t.demoted_blocks,
            t.spilled_blocks,
            t.loaded_blocks,
            t.imported_blocks,
            t.dropped_blocks,
            t.saved_blocks,
        ]) {
            *sum += n;
        }
        let live: Vec<SeqId> = h.tokens.keys().copied().collect();
        for seq in live {
            h.m.free(seq).unwrap();
        }
        h.m.check_invariants().unwrap();
        let usage = h.m.usage();
        assert_eq!(
            usage.used, 0,
            "seed {seed}: every block returns when all sequences end"
        );
        assert_eq!(usage.host_used, 0);
        assert_eq!(h.m.pool().num_free(), usage.capacity);
    }
    if tiers.disk_blocks > 0 {
        assert!(
            moved.iter().all(|n| *n > 0),
            "a tier move never happened: {moved:?}"
        );
    }
}

#[test]
fn snapshot_matches_the_index() {
    let mut h = Harness::new(99, TierConfig::default());
    for step in 0..500 {
        h.step();
        h.check(step);
    }
    let (seq, blocks) = h.m.snapshot();
    assert_eq!(seq, h.last_event);
    let snap: HashMap<BlockHash, Tier> = blocks.iter().map(|b| (b.hash, b.tier)).collect();
    assert_eq!(snap, h.replayed);
}
