//! Seeded randomized test of the block manager: thousands of random operations, every invariant
//! checked after each one, against a shadow model of what each physical block holds.
//!
//! The shadow writes each appended token into its physical slot, carries out copy-on-write and
//! swap plans as the kernels would, and so can check that every cached hash points at a block
//! holding exactly the tokens that hash stands for. KV events are replayed into a second index,
//! which must equal the live one after every step.

use kvgate_engine::kv::{test_manager, KvCacheManager, ScopeId, SeqId, SwapPlan};
use kvgate_protocol::{BlockHash, KvEvent};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};

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
    replayed: HashSet<BlockHash>,
    next_seq: u64,
    last_event: u64,
}

impl Harness {
    fn new(seed: u64) -> Self {
        let (blocks, host) = (48, 24);
        Harness {
            m: test_manager(blocks, host, BS as u32),
            rng: StdRng::seed_from_u64(seed),
            tokens: HashMap::new(),
            device: vec![vec![None; BS]; blocks as usize],
            host: vec![vec![None; BS]; host as usize],
            meaning: HashMap::new(),
            replayed: HashSet::new(),
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

    fn op_start(&mut self) {
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        let scope = self.m.scope(SCOPES[self.rng.gen_range(0..SCOPES.len())]);
        let tokens = self.random_prompt();
        let prompt = self.m.hash_prompt(scope, &tokens);
        if let Ok(a) = self.m.allocate_prompt(seq, &prompt, &tokens) {
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
            (94..=96, _) => {
                let scope = self.m.scope(SCOPES[self.rng.gen_range(0..SCOPES.len())]);
                self.m.flush(Some(scope));
            }
            (97.., _) if self.rng.gen_bool(0.3) => {
                self.m.flush(None);
            }
            _ => {}
        }
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
                KvEvent::BlockStored { hashes, .. } => self.replayed.extend(hashes),
                KvEvent::BlockRemoved { hashes } => hashes.iter().for_each(|h| {
                    self.replayed.remove(h);
                }),
                KvEvent::AllCleared => self.replayed.clear(),
            }
        }
        let live: HashSet<BlockHash> = self.m.index().iter().map(|(h, _)| h).collect();
        assert_eq!(
            self.replayed, live,
            "step {step}: replayed events differ from the index"
        );
    }
}

#[test]
fn random_operations_keep_every_invariant() {
    for seed in 0..8 {
        let mut h = Harness::new(seed);
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
}

#[test]
fn snapshot_matches_the_index() {
    let mut h = Harness::new(99);
    for step in 0..500 {
        h.step();
        h.check(step);
    }
    let (seq, blocks) = h.m.snapshot();
    assert_eq!(seq, h.last_event);
    let snap: HashSet<BlockHash> = blocks.iter().map(|(_, b)| *b).collect();
    assert_eq!(snap, h.replayed);
}
