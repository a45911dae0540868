//! `matmul` against a naive triple loop in f64, for f32/f16/bf16 weights, with and without
//! bias, at the decode (GEMV) and prefill (GEMM) row counts and at odd sizes (tails of every
//! register tile, packing panel and k block).
//!
//! Tolerance: each output may differ from the f64 sum by 1e-5 of `sum |x_p * w_p|` (f32
//! accumulation error grows with the magnitudes summed, not with the result).

mod common;

use common::{backends, random, rng, round, weight_data};
use kvgate_kernels::cpu::AVX2_GEMV_MAX_ROWS;
use kvgate_kernels::{Backend, Cpu, DType};

fn check(cpu: &Cpu, seed: u64, m: usize, n: usize, k: usize, dtype: DType, bias: bool) {
    let mut r = rng(seed);
    let x = random(&mut r, m * k, 1.0);
    let w = random(&mut r, n * k, 1.0);
    let b = random(&mut r, n, 1.0);
    let wt = cpu.weight(weight_data(&w, dtype), n, k);
    let bt = cpu.weight(weight_data(&b, dtype), 1, n);
    let xt = cpu.upload(&x, m, k);
    // A stale, wrongly shaped out-param: the op must reshape it.
    let mut out = cpu.tensor(3, 5);
    cpu.matmul(&xt, &wt, bias.then_some(&bt), &mut out);
    assert_eq!(cpu.shape(&out), (m, n));
    let got = cpu.download(&out);
    for i in 0..m {
        for j in 0..n {
            let (mut sum, mut mag) = (0.0f64, 0.0f64);
            for p in 0..k {
                let t = x[i * k + p] as f64 * round(w[j * k + p], dtype) as f64;
                sum += t;
                mag += t.abs();
            }
            if bias {
                sum += round(b[j], dtype) as f64;
                mag += round(b[j], dtype).abs() as f64;
            }
            let g = got[i * n + j] as f64;
            assert!(
                (g - sum).abs() <= 1e-5 * mag + 1e-30,
                "{} {dtype:?} m={m} n={n} k={k} bias={bias}: out[{i},{j}] = {g}, want {sum}",
                cpu.name()
            );
        }
    }
}

/// [`check`] on every backend, for f32, f16 and bf16 weights, each shape with the biases given.
fn check_shapes(seed: u64, shapes: &[(usize, usize, usize)], biases: impl Fn(DType) -> Vec<bool>) {
    for cpu in backends() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for &(m, n, k) in shapes {
                for bias in biases(dtype) {
                    check(&cpu, seed, m, n, k, dtype, bias);
                }
            }
        }
    }
}

#[test]
fn gemv_shapes() {
    let shapes = [
        (1, 577, 576),
        (3, 64, 577),
        (1, 7, 15),
        (2, 33, 17),
        (8, 9, 64),
        // Batches of decodes: the AVX2 kernels' GEMV takes up to 64 rows.
        (32, 20, 576),
        (AVX2_GEMV_MAX_ROWS, 9, 64),
    ];
    check_shapes(1, &shapes, |_| vec![false, true]);
}

#[test]
fn gemm_shapes() {
    let shapes = [
        (64, 577, 64),
        (64, 96, 577),
        (9, 33, 300),
        (29, 31, 1),
        // Past the AVX2 kernels' GEMV rows too.
        (AVX2_GEMV_MAX_ROWS + 1, 40, 300),
        (AVX2_GEMV_MAX_ROWS + 7, 577, 64),
    ];
    check_shapes(2, &shapes, |_| vec![false, true]);
}

#[test]
fn decode_batch_shapes() {
    // Batches of 9 to 64 decodes (AVX-512 runs them with x transposed): one to four vectors of
    // x rows, partial ones, weight-row tails of each microkernel (12, 8 and 6 rows), k tails,
    // several k blocks summed (x^T is cut at 384 KiB: past 3,072 deep at 32 rows, 2,048 at 48,
    // 1,536 at 64), several column tasks and partial 16-column tiles of the final transpose.
    let shapes = [
        (9, 13, 17),
        (16, 577, 300),
        (17, 1000, 577),
        (31, 49, 1536),
        (32, 600, 530),
        (32, 1, 16),
        (20, 45, 4100),
        (33, 70, 200),
        (48, 97, 576),
        (64, 131, 1600),
        (40, 30, 2100),
        (57, 77, 1700),
    ];
    check_shapes(6, &shapes, |dtype| vec![dtype == DType::F16]);
}

#[test]
fn gemm_large_multi_block() {
    // Several k blocks, several L2 row blocks, several column tasks.
    let cpu = Cpu::new();
    check(&cpu, 3, 160, 600, 700, DType::F32, true);
    check(&cpu, 4, 150, 256, 530, DType::F16, false);
}

#[test]
fn empty_and_degenerate_shapes() {
    for cpu in backends() {
        check(&cpu, 5, 0, 8, 8, DType::F32, true);
        check(&cpu, 5, 4, 0, 8, DType::F32, false);
        check(&cpu, 5, 70, 5, 0, DType::F32, true);
        check(&cpu, 5, 1, 1, 1, DType::F16, true);
    }
}
