//! Matmul throughput at SmolLM2-135M's shapes (hidden 576, kv 192, FFN 1536, vocab 49152).
//!
//! - `gemv/*`: one token (m = 1), throughput in bytes of weights read. The `cold` variants cycle
//!   through enough copies of the matrix (over 600 MB) that every call streams from DRAM, as a
//!   real decode does; the plain ones are cache-resident.
//! - `decode_token/*`: every matmul of one decoded token (30 layers + logits), the bound on
//!   single-stream decode tokens/s.
//! - `gemm/*`: prefill, 512 x 576 x 1536, throughput in FLOPs (`elem/s` = FLOP/s); and
//!   `prefill_512/*`: every matmul of a 512-token prefill (no logits).
//! - `quant_batch/*`: quantized weights (Q8_0, Q4_1) at 576 x 1536 times batches of 1 to 32
//!   decodes, throughput in FLOPs, x quantized in every call: where the integer kernels change
//!   over (streamed, staged, 16-row tiles).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::f16;
use kvgate_kernels::cpu::{CpuTensor, CpuWeight};
use kvgate_kernels::{Backend, Cpu, DType, Quant, WeightData};

/// `n * k` weight values in [-1, 1), a different matrix for each seed.
fn values(n: usize, k: usize, seed: usize) -> impl Iterator<Item = f32> {
    (0..n * k).map(move |i| ((i * 7919 + seed * 104_729) % 2001) as f32 * 1e-3 - 1.0)
}

fn weight(cpu: &Cpu, n: usize, k: usize, dtype: DType, seed: usize) -> CpuWeight {
    let data = match dtype {
        DType::F32 => WeightData::F32(values(n, k, seed).collect()),
        DType::F16 => WeightData::F16(values(n, k, seed).map(f16::from_f32).collect()),
        DType::BF16 => unreachable!("not benchmarked"),
    };
    cpu.weight(data, n, k)
}

fn input(m: usize, k: usize) -> CpuTensor {
    CpuTensor::from_vec(
        (0..m * k).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect(),
        m,
        k,
    )
}

const SHAPES: [(&str, usize, usize); 3] = [
    ("576x1536", 1536, 576),
    ("1536x576", 576, 1536),
    ("576x49152", 49152, 576),
];

fn gemv(c: &mut Criterion) {
    let cpu = Cpu::new();
    let mut g = c.benchmark_group("gemv");
    for dtype in [DType::F32, DType::F16] {
        for (name, n, k) in SHAPES {
            let bytes = n * k * dtype.size_bytes();
            g.throughput(Throughput::Bytes(bytes as u64));
            let x = input(1, k);
            let mut out = cpu.tensor(1, n);
            let w = weight(&cpu, n, k, dtype, 0);
            g.bench_function(BenchmarkId::new(dtype.name(), name), |b| {
                b.iter(|| cpu.matmul(&x, &w, None, &mut out))
            });
            let copies = (600 << 20) / bytes + 1;
            let ws: Vec<CpuWeight> = (0..copies).map(|s| weight(&cpu, n, k, dtype, s)).collect();
            let mut next = 0;
            g.bench_function(
                BenchmarkId::new(format!("{}_cold", dtype.name()), name),
                |b| {
                    b.iter(|| {
                        next = (next + 1) % copies;
                        cpu.matmul(&x, &ws[next], None, &mut out)
                    })
                },
            );
        }
    }
    g.finish();
}

/// (n, k) of one layer's matmuls: q, k, v, o, gate, up, down.
const LAYER: [(usize, usize); 7] = [
    (576, 576),
    (192, 576),
    (192, 576),
    (576, 576),
    (1536, 576),
    (1536, 576),
    (576, 1536),
];

fn decode_token(c: &mut Criterion) {
    let cpu = Cpu::new();
    let mut g = c.benchmark_group("decode_token");
    for dtype in [DType::F32, DType::F16] {
        let mut ws = Vec::new();
        for layer in 0..30 {
            for (i, &(n, k)) in LAYER.iter().enumerate() {
                ws.push(weight(&cpu, n, k, dtype, layer * 7 + i));
            }
        }
        ws.push(weight(&cpu, 49152, 576, dtype, 999));
        let bytes: usize = ws.iter().map(|w| w.size_bytes()).sum();
        g.throughput(Throughput::Bytes(bytes as u64));
        let (x576, x1536) = (input(1, 576), input(1, 1536));
        let mut out = cpu.tensor(1, 49152);
        g.bench_function(dtype.name(), |b| {
            b.iter(|| {
                for w in &ws {
                    let x = if w.cols() == 576 { &x576 } else { &x1536 };
                    cpu.matmul(x, w, None, &mut out);
                }
            })
        });
    }
    g.finish();
}

fn gemm(c: &mut Criterion) {
    let cpu = Cpu::new();
    let mut g = c.benchmark_group("gemm");
    let (m, n, k) = (512, 1536, 576);
    g.throughput(Throughput::Elements((2 * m * n * k) as u64));
    for dtype in [DType::F32, DType::F16] {
        let w = weight(&cpu, n, k, dtype, 1);
        let x = input(m, k);
        let mut out = cpu.tensor(m, n);
        g.bench_function(BenchmarkId::new(dtype.name(), "512x576x1536"), |b| {
            b.iter(|| cpu.matmul(&x, &w, None, &mut out))
        });
    }
    // Batches of decodes.
    for dtype in [DType::F32, DType::F16] {
        let w = weight(&cpu, n, k, dtype, 1);
        for m in [8, 16, 32, 48, 64] {
            let x = input(m, k);
            let mut out = cpu.tensor(m, n);
            g.throughput(Throughput::Elements((2 * m * n * k) as u64));
            g.bench_function(
                BenchmarkId::new(dtype.name(), format!("{m}x576x1536")),
                |b| b.iter(|| cpu.matmul(&x, &w, None, &mut out)),
            );
        }
    }
    g.finish();

    let mut g = c.benchmark_group("prefill_512");
    g.sample_size(10);
    let ws: Vec<CpuWeight> = (0..30)
        .flat_map(|l| {
            LAYER
                .iter()
                .enumerate()
                .map(move |(i, &(n, k))| (l * 7 + i, n, k))
        })
        .map(|(s, n, k)| weight(&cpu, n, k, DType::F32, s))
        .collect();
    let flops: usize = ws.iter().map(|w| 2 * 512 * w.rows() * w.cols()).sum();
    g.throughput(Throughput::Elements(flops as u64));
    let (x576, x1536) = (input(512, 576), input(512, 1536));
    let mut out = cpu.tensor(512, 1536);
    g.bench_function("f32", |b| {
        b.iter(|| {
            for w in &ws {
                let x = if w.cols() == 576 { &x576 } else { &x1536 };
                cpu.matmul(x, w, None, &mut out);
            }
        })
    });
    g.finish();
}

fn quant_batch(c: &mut Criterion) {
    let cpu = Cpu::new();
    let mut g = c.benchmark_group("quant_batch");
    let (n, k) = (1536, 576);
    let values: Vec<f32> = values(n, k, 0).collect();
    for q in [Quant::Q8_0, Quant::Q4_1] {
        let w = cpu.weight(WeightData::quantized(&values, q), n, k);
        for m in [1, 2, 3, 4, 6, 8, 12, 16, 32] {
            let mut x = input(m, k);
            let mut out = cpu.tensor(m, n);
            g.throughput(Throughput::Elements((2 * m * n * k) as u64));
            g.bench_function(
                BenchmarkId::new(format!("{q:?}"), format!("{m}x576x1536")),
                |b| {
                    b.iter(|| {
                        // A fresh input each call, as in a forward pass: x is quantized every
                        // time (an unchanged tensor would reuse its quantized copy).
                        x.as_mut_slice();
                        cpu.matmul(&x, &w, None, &mut out)
                    })
                },
            );
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = gemv, decode_token, gemm, quant_batch
}
criterion_main!(benches);
