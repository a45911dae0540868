//! Block-manager benchmarks (criterion). Per-block figures are the reported time divided by the
//! blocks in the operation (2,048-token prompt = 128 blocks of 16; lookups: 64 blocks).
//!
//! cargo bench -p kvgate-engine --bench kv

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvgate_engine::kv::{test_manager, HashedPrompt, KvCacheManager, SeqId};
use std::hint::black_box;
use std::time::Duration;

const BS: u32 = 16;

fn prompt_tokens(shared: usize, total: usize, salt: u32) -> Vec<u32> {
    (0..total as u32)
        .map(|i| {
            if (i as usize) < shared {
                i
            } else {
                i.wrapping_mul(31) ^ (salt << 12)
            }
        })
        .collect()
}

/// Hashing 16 tokens plus the index lookup, per block, over a fully cached 1,024-token prompt.
fn lookup(c: &mut Criterion) {
    let mut m = test_manager(1024, 0, BS);
    let scope = m.scope("tenant");
    let tokens = prompt_tokens(1024, 1025, 0);
    let p = m.hash_prompt(scope, &tokens);
    m.allocate_prompt(SeqId(0), &p, &tokens).unwrap();
    let mut g = c.benchmark_group("lookup");
    g.throughput(Throughput::Elements(64));
    g.bench_function("hash_and_match_64_blocks", |b| {
        b.iter(|| {
            let p = m.hash_prompt(scope, black_box(&tokens));
            black_box(m.cached_prefix(&p).len())
        })
    });
    g.bench_function("match_only_64_blocks", |b| {
        b.iter(|| black_box(m.cached_prefix(&p).len()))
    });
    let hasher = test_hasher();
    let chain = hasher.start("tenant");
    g.throughput(Throughput::Elements(1));
    g.bench_function("hash_one_block", |b| {
        b.iter(|| black_box(hasher.next(&chain, black_box(&tokens[..16]))))
    });
    g.finish();
}

fn test_hasher() -> kvgate_protocol::BlockHasher {
    kvgate_protocol::BlockHasher::new(&kvgate_protocol::HashParams {
        model_id: "test".into(),
        weight_version: "0".into(),
        kv_dtype: "f32".into(),
        block_size: BS,
        seed: [0; 32],
    })
}

/// Allocate + free of 2,048-token prompts, hashes computed at admission (outside the timing),
/// KV events drained every 8 prompts (one scheduler step's admissions).
fn allocate_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("allocate_free_2048");
    g.throughput(Throughput::Elements(128));
    for (name, shared) in [("no_cached_prefix", 0), ("cached_prefix_1024", 1024)] {
        let mut m = test_manager(4096, 0, BS);
        let scope = m.scope("tenant");
        // A ring of distinct prompts, so every allocation misses past the shared part and the
        // pool keeps evicting, as a busy engine does.
        let prompts: Vec<(HashedPrompt, Vec<u32>)> = (0..64)
            .map(|salt| {
                let t = prompt_tokens(shared, 2048, salt + 1);
                (m.hash_prompt(scope, &t), t)
            })
            .collect();
        let mut i = 0;
        g.bench_function(name, |b| {
            b.iter(|| {
                let (p, t) = &prompts[i % prompts.len()];
                i += 1;
                m.allocate_prompt(SeqId(1), p, t).unwrap();
                m.free(SeqId(1)).unwrap();
                // The engine publishes events once per step, which admits several requests.
                if i % 8 == 0 {
                    black_box(m.drain_events());
                }
            })
        });
    }
    g.finish();
}

/// fork of a 2,048+8-token sequence (129 blocks shared), one append that copies the partial
/// block, and the child's free.
fn fork_cow(c: &mut Criterion) {
    let mut m: KvCacheManager = test_manager(4096, 0, BS);
    let scope = m.scope("tenant");
    let t = prompt_tokens(0, 2056, 9);
    let p = m.hash_prompt(scope, &t);
    m.allocate_prompt(SeqId(0), &p, &t).unwrap();
    let mut g = c.benchmark_group("fork_cow");
    g.throughput(Throughput::Elements(129));
    g.bench_function("fork_append_free_129_blocks", |b| {
        b.iter_batched(
            || (),
            |_| {
                m.fork(SeqId(0), SeqId(1)).unwrap();
                let out = m.append_slots(SeqId(1), &[7]).unwrap();
                black_box(out.cow.unwrap());
                m.free(SeqId(1)).unwrap();
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
}

criterion_group! { name = benches; config = config(); targets = lookup, allocate_free, fork_cow }
criterion_main!(benches);
