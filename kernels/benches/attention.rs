//! Paged attention decode against dense (contiguous K/V) attention of the same shapes, run by
//! the same tile loop: batch 32, contexts 512 and 32, SmolLM2 heads (9 query, 3 kv, head_dim
//! 64), block 16, block tables shuffled across the pool. kvgate's target: paged at most 1.3x
//! the dense time. Throughput is K/V bytes read. At context 32 (the model bench's batches)
//! K and V stay in cache, so the time is the kernel's own.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvgate_kernels::cpu::{dense_attention, CpuTensor, DenseSeq};
use kvgate_kernels::{AttnSeq, AttnShape, Backend, Cpu, DType};

const SHAPE: AttnShape = AttnShape {
    num_heads: 9,
    num_kv_heads: 3,
    head_dim: 64,
    block_size: 16,
};
const BATCH: usize = 32;

fn decode(c: &mut Criterion) {
    decode_at(c, 512);
    decode_at(c, 32);
}

fn decode_at(c: &mut Criterion, context: usize) {
    let cpu = Cpu::new();
    let row = SHAPE.num_kv_heads * SHAPE.head_dim;
    let width = SHAPE.num_heads * SHAPE.head_dim;
    let tokens = BATCH * context;
    let kv: Vec<f32> = (0..tokens * row)
        .map(|i| ((i * 31) % 97) as f32 * 0.01 - 0.5)
        .collect();
    let q = CpuTensor::from_vec(
        (0..BATCH * width).map(|i| (i % 11) as f32 * 0.1).collect(),
        BATCH,
        width,
    );
    let scale = 0.125;

    // Pool: blocks dealt to sequences in a scrambled order (a multiplicative permutation).
    let per_seq = context / SHAPE.block_size;
    let num_blocks = BATCH * per_seq;
    let perm: Vec<u32> = (0..num_blocks)
        .map(|i| ((i * 577) % num_blocks) as u32)
        .collect();
    let tables: Vec<&[u32]> = perm.chunks(per_seq).collect();
    let mut g = c.benchmark_group(format!("attention_decode_b32_ctx{context}"));
    g.throughput(Throughput::Bytes((2 * tokens * row * 4) as u64));
    for dtype in [DType::F32, DType::F16] {
        let mut kc = cpu.cache(num_blocks, SHAPE, dtype);
        let mut vc = cpu.cache(num_blocks, SHAPE, dtype);
        for (s, table) in tables.iter().enumerate() {
            let slots: Vec<u32> = (0..context)
                .map(|t| {
                    table[t / SHAPE.block_size] * SHAPE.block_size as u32
                        + (t % SHAPE.block_size) as u32
                })
                .collect();
            let src = &kv[s * context * row..(s + 1) * context * row];
            let k = cpu.upload(src, context, row);
            cpu.reshape_and_cache(&k, &k, &mut kc, &mut vc, &slots);
        }
        let seqs: Vec<AttnSeq<'_>> = tables
            .iter()
            .enumerate()
            .map(|(i, t)| AttnSeq {
                query_start: i,
                query_len: 1,
                context_len: context,
                block_table: t,
            })
            .collect();
        let mut out = cpu.tensor(BATCH, width);
        g.bench_function(format!("paged_{}", dtype.name()), |b| {
            b.iter(|| cpu.paged_attention(&q, &kc, &vc, &seqs, scale, &mut out))
        });
    }
    let seqs: Vec<DenseSeq> = (0..BATCH)
        .map(|i| DenseSeq {
            query_start: i,
            query_len: 1,
            context_len: context,
            kv_start: i * context,
        })
        .collect();
    // Separate K and V arrays, as the pools are: the same bytes read as the paged kernel.
    let v: Vec<f32> = kv.iter().map(|x| -x).collect();
    let mut out = cpu.tensor(BATCH, width);
    g.bench_function("dense_f32", |b| {
        b.iter(|| dense_attention(&q, &kv, &v, &seqs, SHAPE, scale, &mut out))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = decode
}
criterion_main!(benches);
