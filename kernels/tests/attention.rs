//! Paged attention against a naive dense reference that materializes each sequence's K/V as
//! contiguous arrays and runs softmax(q k^T * scale) v in f64.
//!
//! Covered: block sizes 1, 16, 32 (and 3, 5); context lengths that are not multiples of the
//! block size, and decodes whose context is a whole number of 16-token tiles; GQA ratios 1, 3,
//! 4; batches mixing decodes, full prefills and prefill chunks over a cached prefix (a last
//! chunk of one query among them); shuffled, non-contiguous block tables; f32, f16 and bf16
//! pools; head_dim 64, 128, 32 and 8 (the last two take the generic and portable paths).
//!
//! Tolerances: 1e-5 of the output's magnitude against a reference built from the values the
//! pool actually stores (so f16/bf16 pools are held to the same 1e-5: only accumulation order
//! differs), and 4e-3 (f16) / 3e-2 (bf16) against the unrounded f32 K/V, which bounds the
//! storage rounding itself.

mod common;

use common::{assert_close, backends, random, rng, round};
use kvgate_kernels::cpu::{dense_attention, CpuTensor, DenseSeq};
use kvgate_kernels::{AttnSeq, AttnShape, Backend, Cpu, DType};
use rand::seq::SliceRandom;
use rand::Rng;

/// One sequence of a test batch: `query_len` new tokens at the end of `context_len`.
#[derive(Clone, Copy, Debug)]
struct SeqSpec {
    context_len: usize,
    query_len: usize,
}

/// A batch with its data: per sequence K/V (`[ctx, kvh, hd]`), the batch Q, and block tables.
struct Batch {
    shape: AttnShape,
    specs: Vec<SeqSpec>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    q: Vec<f32>,
    tables: Vec<Vec<u32>>,
    num_blocks: usize,
}

fn make_batch(seed: u64, shape: AttnShape, specs: &[SeqSpec]) -> Batch {
    let mut r = rng(seed);
    let kv_row = shape.num_kv_heads * shape.head_dim;
    let k = specs
        .iter()
        .map(|s| random(&mut r, s.context_len * kv_row, 1.0))
        .collect();
    let v = specs
        .iter()
        .map(|s| random(&mut r, s.context_len * kv_row, 1.0))
        .collect();
    let tokens: usize = specs.iter().map(|s| s.query_len).sum();
    let q = random(&mut r, tokens * shape.num_heads * shape.head_dim, 2.0);
    // Shuffle every physical block, plus spares, and deal them out: tables are scattered.
    let needed: usize = specs
        .iter()
        .map(|s| s.context_len.div_ceil(shape.block_size))
        .sum();
    let num_blocks = needed + 7;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(&mut r);
    let mut next = 0;
    let tables = specs
        .iter()
        .map(|s| {
            let n = s.context_len.div_ceil(shape.block_size);
            next += n;
            ids[next - n..next].to_vec()
        })
        .collect();
    Batch {
        shape,
        specs: specs.to_vec(),
        k,
        v,
        q,
        tables,
        num_blocks,
    }
}

/// Dense reference in f64; `dtype` rounds K/V as the pool would.
fn reference(b: &Batch, dtype: DType, scale: f32) -> Vec<f64> {
    let AttnShape {
        num_heads,
        num_kv_heads,
        head_dim: hd,
        ..
    } = b.shape;
    let group = num_heads / num_kv_heads;
    let width = num_heads * hd;
    let mut out = vec![0.0f64; b.q.len()];
    let mut row0 = 0;
    for (s, spec) in b.specs.iter().enumerate() {
        let kv = |data: &[f32], t: usize, h: usize, d: usize| {
            round(data[(t * num_kv_heads + h) * hd + d], dtype) as f64
        };
        for j in 0..spec.query_len {
            let pos = spec.context_len - spec.query_len + j;
            for head in 0..num_heads {
                let h = head / group;
                let q = &b.q[(row0 + j) * width + head * hd..][..hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|t| {
                        let dot: f64 = (0..hd).map(|d| q[d] as f64 * kv(&b.k[s], t, h, d)).sum();
                        dot * scale as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    let o: f64 = (0..=pos).map(|t| e[t] * kv(&b.v[s], t, h, d)).sum();
                    out[(row0 + j) * width + head * hd + d] = o / sum;
                }
            }
        }
        row0 += spec.query_len;
    }
    out
}

/// Writes the batch into fresh pools with `reshape_and_cache` and runs paged attention.
fn run_paged(cpu: &Cpu, b: &Batch, dtype: DType, scale: f32) -> Vec<f32> {
    let kv_row = b.shape.num_kv_heads * b.shape.head_dim;
    let mut kc = cpu.cache(b.num_blocks, b.shape, dtype);
    let mut vc = cpu.cache(b.num_blocks, b.shape, dtype);
    for (s, spec) in b.specs.iter().enumerate() {
        let slots: Vec<u32> = (0..spec.context_len)
            .map(|t| {
                b.tables[s][t / b.shape.block_size] * b.shape.block_size as u32
                    + (t % b.shape.block_size) as u32
            })
            .collect();
        let k = cpu.upload(&b.k[s], spec.context_len, kv_row);
        let v = cpu.upload(&b.v[s], spec.context_len, kv_row);
        cpu.reshape_and_cache(&k, &v, &mut kc, &mut vc, &slots);
    }
    let mut start = 0;
    let seqs: Vec<AttnSeq<'_>> = b
        .specs
        .iter()
        .zip(&b.tables)
        .map(|(spec, table)| {
            let s = AttnSeq {
                query_start: start,
                query_len: spec.query_len,
                context_len: spec.context_len,
                block_table: table,
            };
            start += spec.query_len;
            s
        })
        .collect();
    let width = b.shape.num_heads * b.shape.head_dim;
    let q = cpu.upload(&b.q, start, width);
    let mut out = cpu.tensor(0, width);
    cpu.paged_attention(&q, &kc, &vc, &seqs, scale, &mut out);
    cpu.download(&out)
}

fn check(seed: u64, shape: AttnShape, specs: &[SeqSpec]) {
    let b = make_batch(seed, shape, specs);
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let want = reference(&b, dtype, scale);
        let exact = reference(&b, DType::F32, scale);
        for cpu in backends() {
            let got = run_paged(&cpu, &b, dtype, scale);
            let what = format!("{} {dtype:?} {shape:?} {specs:?}", cpu.name());
            assert_close(&got, &want, 1e-5, &what);
            let loose = match dtype {
                DType::F32 => 1e-5,
                DType::F16 => 4e-3,
                DType::BF16 => 3e-2,
            };
            assert_close(&got, &exact, loose, &format!("{what} vs unrounded"));
        }
    }
}

fn shape(num_heads: usize, num_kv_heads: usize, head_dim: usize, block_size: usize) -> AttnShape {
    AttnShape {
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
    }
}

/// A batch mixing decodes, a full prefill and prefill chunks over a cached prefix.
fn mixed_specs(r: &mut impl Rng) -> Vec<SeqSpec> {
    let mut specs = vec![
        SeqSpec {
            context_len: 1,
            query_len: 1,
        },
        SeqSpec {
            context_len: 37,
            query_len: 37,
        },
        SeqSpec {
            context_len: 70,
            query_len: 23,
        },
        SeqSpec {
            context_len: 17,
            query_len: 1,
        },
    ];
    for _ in 0..3 {
        let ctx = r.gen_range(1..90);
        let q = if r.gen_bool(0.5) {
            1
        } else {
            r.gen_range(1..=ctx)
        };
        specs.push(SeqSpec {
            context_len: ctx,
            query_len: q,
        });
    }
    specs
}

#[test]
fn mixed_batches_across_block_sizes_and_gqa() {
    let mut r = rng(7);
    for block_size in [1, 16, 32, 3, 5] {
        for (heads, kv_heads) in [(4, 4), (9, 3), (8, 2)] {
            let specs = mixed_specs(&mut r);
            check(r.gen(), shape(heads, kv_heads, 64, block_size), &specs);
        }
    }
}

#[test]
fn other_head_dims() {
    let mut r = rng(11);
    for head_dim in [128, 32, 8] {
        let specs = mixed_specs(&mut r);
        check(r.gen(), shape(6, 2, head_dim, 16), &specs);
    }
}

#[test]
fn long_prefill_chunk_over_cached_prefix() {
    // Several query chunks per item and tiles that straddle blocks.
    let specs = [
        SeqSpec {
            context_len: 300,
            query_len: 77,
        },
        SeqSpec {
            context_len: 129,
            query_len: 1,
        },
    ];
    check(3, shape(9, 3, 64, 16), &specs);
    check(4, shape(8, 2, 64, 32), &specs);
}

#[test]
fn decodes_at_whole_tiles_and_one_query_chunks() {
    // Decodes whose context ends on a tile (no partial tile), and prefills whose last chunk of
    // queries is a single query (it takes the decode's two-pass path).
    let spec = |context_len, query_len| SeqSpec {
        context_len,
        query_len,
    };
    let specs = [
        spec(16, 1),
        spec(32, 1),
        spec(48, 1),
        spec(17, 17),
        spec(40, 33),
        spec(2, 1),
    ];
    check(9, shape(9, 3, 64, 16), &specs);
    check(10, shape(6, 2, 128, 5), &specs);
}

#[test]
fn dense_kernel_matches_reference() {
    let mut r = rng(5);
    let sh = shape(9, 3, 64, 16);
    let specs = mixed_specs(&mut r);
    let b = make_batch(21, sh, &specs);
    let scale = 0.125;
    let want = reference(&b, DType::F32, scale);
    let (mut k, mut v, mut seqs) = (Vec::new(), Vec::new(), Vec::new());
    let mut start = 0;
    for (s, spec) in specs.iter().enumerate() {
        seqs.push(DenseSeq {
            query_start: start,
            query_len: spec.query_len,
            context_len: spec.context_len,
            kv_start: k.len() / (sh.num_kv_heads * sh.head_dim),
        });
        k.extend_from_slice(&b.k[s]);
        v.extend_from_slice(&b.v[s]);
        start += spec.query_len;
    }
    let width = sh.num_heads * sh.head_dim;
    let q = CpuTensor::from_vec(b.q.clone(), start, width);
    let mut out = CpuTensor::default();
    dense_attention(&q, &k, &v, &seqs, sh, scale, &mut out);
    assert_close(out.as_slice(), &want, 1e-5, "dense");
}
