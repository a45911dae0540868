//! `matmul` over Q8_0 and Q4_1 weights against a dequantize-then-multiply reference in f64, on
//! every instruction set this CPU has, at the row counts of the integer path (decode and batches
//! of decodes, up to `QUANT_GEMV_MAX_ROWS`; every row count on 16-row tiles, AMX or AVX-512
//! VNNI) and of the widening GEMM (prefill elsewhere).
//!
//! Tolerances:
//! - GEMM (x stays f32): 1e-5 of `sum |x_p * w_p|`, as for dense weights.
//! - Integer path (x quantized to 8 bits per 32-value block, as llama.cpp does): the rounding of each
//!   x value moves it by at most half its block's step `max|x| / 127`, so an output may differ
//!   from the reference by `sum over blocks of sum |w| * step / 2`, plus 2^-10 of
//!   `sum |x_p * w_p|` for the f16 rounding of the block scales.

mod common;

use common::{backends, random, rng};
use kvgate_kernels::cpu::{quantized_x_max_rows, QUANT_GEMV_MAX_ROWS};
use kvgate_kernels::quant::{self, BlockQ4_1, BlockQ8_0, QuantBlock, QK};
use kvgate_kernels::{Backend, Cpu, Quant, WeightData};

fn dequantized(data: &WeightData) -> Vec<f32> {
    fn widen<B: QuantBlock>(b: &[B]) -> Vec<f32> {
        let mut v = vec![0.0; b.len() * QK];
        quant::dequantize(b, &mut v);
        v
    }
    match data {
        WeightData::Q8_0(b) => widen(b),
        WeightData::Q4_1(b) => widen(b),
        _ => unreachable!("quantized data only"),
    }
}

/// `n` values whose 32-value blocks each have a scale of their own (0.05 to 4 times `amp`), so
/// that a kernel that applies a neighbouring block's scale gets a visibly wrong answer.
fn blocky(r: &mut rand::rngs::StdRng, n: usize, amp: f32, offset: f32) -> Vec<f32> {
    use rand::Rng;
    let mut v = random(r, n, amp);
    for block in v.chunks_mut(QK) {
        let scale: f32 = r.gen_range(0.05..4.0);
        block.iter_mut().for_each(|x| *x = *x * scale + offset);
    }
    v
}

fn check(cpu: &Cpu, seed: u64, m: usize, n: usize, k: usize, q: Quant) {
    let mut r = rng(seed);
    let x = blocky(&mut r, m * k, 1.0, 0.0);
    // Weights with an offset, so Q4_1's minimum matters.
    let w = blocky(&mut r, n * k, 0.5, 0.1);
    let data = WeightData::quantized(&w, q);
    let wq = dequantized(&data);
    let wt = cpu.weight(data, n, k);
    let mut out = cpu.tensor(2, 3);
    cpu.matmul(&cpu.upload(&x, m, k), &wt, None, &mut out);
    assert_eq!(cpu.shape(&out), (m, n));
    let got = cpu.download(&out);
    let gemv = m <= quantized_x_max_rows(cpu.isa());
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for j in 0..n {
            let wr = &wq[j * k..(j + 1) * k];
            let (mut sum, mut mag, mut rounding) = (0.0f64, 0.0f64, 0.0f64);
            for (xb, wb) in xr.chunks(QK).zip(wr.chunks(QK)) {
                let step = xb.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                for (&a, &b) in xb.iter().zip(wb) {
                    let t = a as f64 * b as f64;
                    sum += t;
                    mag += t.abs();
                    rounding += (b as f64).abs() * step / 2.0;
                }
            }
            let tol = if gemv {
                rounding * 1.001 + mag / 1024.0
            } else {
                1e-5 * mag
            } + 1e-6;
            let g = got[i * n + j] as f64;
            assert!(
                (g - sum).abs() <= tol,
                "{} {q:?} m={m} n={n} k={k}: out[{i},{j}] = {g}, want {sum} (allowed {tol:.3e})",
                cpu.name()
            );
        }
    }
}

#[test]
fn quantized_gemv_matches_the_dequantized_reference() {
    for cpu in backends() {
        for q in [Quant::Q8_0, Quant::Q4_1] {
            for &(m, n, k) in &[
                (1, 577, 576),
                (1, 7, 32),
                (2, 33, 64),
                (3, 64, 1536),
                (8, 9, 96),
                (32, 20, 576),
                (QUANT_GEMV_MAX_ROWS, 5, 64),
                // The tile kernels' shapes (AMX from 4 rows, AVX-512 VNNI from 2): whole tiles
                // of 16 weight rows and a rest, one and two groups of 16 x rows (VNNI: passes
                // of 8 x rows and tails of 4, 2 and 1), a partial group, an odd block count,
                // either side of the AMX threshold.
                (4, 48, 64),
                (5, 16, 96),
                (6, 32, 96),
                (7, 48, 160),
                (8, 32, 96),
                (10, 33, 96),
                (12, 48, 160),
                (15, 40, 160),
                (17, 40, 576),
                (33, 35, 1536),
                (QUANT_GEMV_MAX_ROWS, 64, 96),
                // One block a row, and odd block counts past three.
                (4, 32, 32),
                (20, 48, 160),
                (37, 17, 224),
            ] {
                check(&cpu, 1, m, n, k, q);
            }
        }
    }
}

/// Blocks at the extremes of the integer sums, where every output is exact in f32 (the scales
/// are powers of two, x is +-127 times its row's scale so it quantizes to +-127 exactly), so
/// every instruction set must give the reference bit for bit: Q8_0 weights of -128 (a value the
/// quantizer never makes, but a GGUF may hold) and 127, Q4_1 nibbles of 15 and 0 with an
/// offset, against x all positive or alternating; the largest block sum is 32 * 128 * 127. How
/// many of each changes with the weight row and the block, so a row or block taken for another
/// shows.
#[test]
fn extreme_blocks_give_exact_sums_on_every_instruction_set() {
    use half::f16;
    let nb = 3;
    let k = nb * QK;
    // x row i: scale 2^(i % 4) / 8, all positive (even rows) or alternating (odd rows).
    let x_row = |i: usize| -> Vec<f32> {
        let scale = (1 << (i % 4)) as f32 / 8.0;
        (0..k)
            .map(|p| {
                let sign = if i % 2 == 1 && p % 2 == 0 { -1.0 } else { 1.0 };
                sign * 127.0 * scale
            })
            .collect()
    };
    // Weight row j's block b: its first c values at one extreme, the rest at the other, c
    // different for neighbouring rows and blocks (0 and 32 among them).
    let count = |j: usize, b: usize| (j * 5 + b * 3) % (QK + 1);
    let q8 = |j: usize, b: usize| BlockQ8_0 {
        d: f16::from_f32(if j.is_multiple_of(2) { 1.0 } else { 0.5 }),
        qs: std::array::from_fn(|p| if p < count(j, b) { -128 } else { 127 }),
    };
    let q4 = |j: usize, b: usize| {
        let v = |p: usize| if p < count(j, b) { 15u8 } else { 0 };
        BlockQ4_1 {
            d: f16::from_f32(if j.is_multiple_of(2) { 1.0 } else { 0.5 }),
            m: f16::from_f32(-8.0),
            qs: std::array::from_fn(|p| v(p) | v(p + QK / 2) << 4),
        }
    };
    for &(m, n) in &[
        (1, 17),
        (2, 17),
        (4, 17),
        (6, 17),
        (7, 35),
        (8, 17),
        (10, 17),
        (12, 35),
        (15, 35),
        (17, 17),
        (33, 35),
    ] {
        let x: Vec<f32> = (0..m).flat_map(x_row).collect();
        for (q, data) in [
            (
                Quant::Q8_0,
                WeightData::Q8_0(
                    (0..n)
                        .flat_map(|j| (0..nb).map(move |b| q8(j, b)))
                        .collect(),
                ),
            ),
            (
                Quant::Q4_1,
                WeightData::Q4_1(
                    (0..n)
                        .flat_map(|j| (0..nb).map(move |b| q4(j, b)))
                        .collect(),
                ),
            ),
        ] {
            let w = dequantized(&data);
            let want: Vec<f32> = (0..m * n)
                .map(|o| {
                    let (xr, wr) = (&x[o / n * k..][..k], &w[o % n * k..][..k]);
                    xr.iter()
                        .zip(wr)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>() as f32
                })
                .collect();
            for cpu in backends() {
                let wt = cpu.weight(data.clone(), n, k);
                let mut out = cpu.tensor(0, 0);
                cpu.matmul(&cpu.upload(&x, m, k), &wt, None, &mut out);
                for (o, (g, e)) in cpu.download(&out).iter().zip(&want).enumerate() {
                    assert_eq!(
                        g,
                        e,
                        "{} {q:?} m={m} n={n}: out[{}, {}]",
                        cpu.name(),
                        o / n,
                        o % n
                    );
                }
            }
        }
    }
}

#[test]
fn quantized_gemm_matches_the_dequantized_reference() {
    for cpu in backends() {
        for q in [Quant::Q8_0, Quant::Q4_1] {
            // On 16-row tiles (AMX, AVX-512 VNNI) these run the integer path too: a partial group of 16 x rows past 64,
            // a tail of weight rows past whole tiles, and a prefill-sized down projection.
            let m0 = QUANT_GEMV_MAX_ROWS + 1;
            for &(m, n, k) in &[
                (m0, 577, 64),
                (m0 + 8, 33, 320),
                (2 * m0, 96, 576),
                (200, 48, 1536),
                (100, 50, 160),
                // More rows than the tile path quantizes at once: two passes.
                (600, 40, 64),
            ] {
                check(&cpu, 2, m, n, k, q);
            }
        }
    }
}

#[test]
fn every_instruction_set_gives_the_portable_answer() {
    // The integer dot products are exact; only the float scaling may round differently.
    let all = backends();
    let portable = &all[0];
    for (q, m) in [
        (Quant::Q8_0, 2),
        (Quant::Q4_1, 2),
        (Quant::Q8_0, 20),
        (Quant::Q4_1, 20),
    ] {
        let mut r = rng(3);
        let (n, k) = (40, 576);
        let x = random(&mut r, m * k, 2.0);
        let w = random(&mut r, n * k, 1.0);
        let outs: Vec<Vec<f32>> = all
            .iter()
            .map(|cpu| {
                let wt = cpu.weight(WeightData::quantized(&w, q), n, k);
                let mut out = cpu.tensor(0, 0);
                cpu.matmul(&cpu.upload(&x, m, k), &wt, None, &mut out);
                cpu.download(&out)
            })
            .collect();
        for (cpu, out) in all.iter().zip(&outs) {
            for (a, b) in out.iter().zip(&outs[0]) {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "{} vs {}: {a} vs {b}",
                    cpu.name(),
                    portable.name()
                );
            }
        }
    }
}

#[test]
fn a_prefill_on_the_integer_path_matches_the_portable_integer_path_row_for_row() {
    // Where the integer path takes more than QUANT_GEMV_MAX_ROWS rows (16-row tiles), a
    // prefill must give what the portable integer path gives for the same rows in slices of at
    // most QUANT_GEMV_MAX_ROWS: x is quantized per row, so only the f32 sums' order differs.
    // Elsewhere such a prefill runs the widening GEMM, held to the reference above.
    let all = backends();
    let portable = &all[0];
    if !all
        .iter()
        .any(|c| quantized_x_max_rows(c.isa()) > QUANT_GEMV_MAX_ROWS)
    {
        eprintln!("skipped: no instruction set here runs the integer path past {QUANT_GEMV_MAX_ROWS} rows (AMX or AVX-512 VNNI)");
        return;
    }
    for q in [Quant::Q8_0, Quant::Q4_1] {
        for &(m, n, k) in &[(100, 40, 160), (600, 33, 64)] {
            let mut r = rng(5);
            let x = blocky(&mut r, m * k, 2.0, 0.0);
            let w = blocky(&mut r, n * k, 1.0, 0.1);
            let mut want = Vec::new();
            let pw = portable.weight(WeightData::quantized(&w, q), n, k);
            for rows in x.chunks(QUANT_GEMV_MAX_ROWS * k) {
                let mut out = portable.tensor(0, 0);
                portable.matmul(
                    &portable.upload(rows, rows.len() / k, k),
                    &pw,
                    None,
                    &mut out,
                );
                want.extend(portable.download(&out));
            }
            for cpu in all.iter().filter(|c| quantized_x_max_rows(c.isa()) >= m) {
                let wt = cpu.weight(WeightData::quantized(&w, q), n, k);
                let mut out = cpu.tensor(0, 0);
                cpu.matmul(&cpu.upload(&x, m, k), &wt, None, &mut out);
                for (i, (a, b)) in cpu.download(&out).iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                        "{} {q:?} m={m} n={n} k={k}: out[{}, {}] = {a}, portable {b}",
                        cpu.name(),
                        i / n,
                        i % n
                    );
                }
            }
        }
    }
}

#[test]
fn an_embedding_row_of_a_quantized_table_is_its_dequantized_row() {
    let cpu = Cpu::new();
    let mut r = rng(4);
    let (vocab, dim) = (10, 64);
    let table = random(&mut r, vocab * dim, 1.0);
    for q in [Quant::Q8_0, Quant::Q4_1] {
        let data = WeightData::quantized(&table, q);
        let want = dequantized(&data);
        let t = cpu.weight(data, vocab, dim);
        let mut out = cpu.tensor(0, 0);
        cpu.embedding(&t, &[7, 0, 7], &mut out);
        let got = cpu.download(&out);
        assert_eq!(&got[..dim], &want[7 * dim..8 * dim]);
        assert_eq!(&got[dim..2 * dim], &want[..dim]);
    }
}

#[test]
fn quantized_blocks_take_their_file_size_in_memory() {
    let cpu = Cpu::new();
    let (n, k) = (64, 576);
    let w = vec![0.5f32; n * k];
    let q8 = cpu.weight(WeightData::Q8_0(quant::quantize::<BlockQ8_0>(&w)), n, k);
    let q4 = cpu.weight(WeightData::Q4_1(quant::quantize::<BlockQ4_1>(&w)), n, k);
    assert_eq!(q8.size_bytes(), n * k / QK * 34);
    assert_eq!(q4.size_bytes(), n * k / QK * 20);
}

#[test]
fn one_input_is_quantized_once_for_several_projections_and_again_when_it_changes() {
    // The Q, K and V projections read one x: the first quantizes it, the others reuse that
    // while x is unchanged. Each output must equal the same matmul on a fresh copy of its input,
    // bit for bit, and a change to x in place must reach the next projection.
    for cpu in backends() {
        for q in [Quant::Q8_0, Quant::Q4_1] {
            for m in [1, 20, 32] {
                let (n, k) = (48, 576);
                let mut r = rng(m as u64 + 11);
                let x = blocky(&mut r, m * k, 1.0, 0.0);
                let x2: Vec<f32> = x.iter().map(|v| 0.5 - v).collect();
                let ws: Vec<_> = (0..2)
                    .map(|_| {
                        let w = blocky(&mut r, n * k, 0.5, 0.1);
                        cpu.weight(WeightData::quantized(&w, q), n, k)
                    })
                    .collect();
                let run = |xt: &kvgate_kernels::cpu::CpuTensor, w| {
                    let mut out = cpu.tensor(0, 0);
                    cpu.matmul(xt, w, None, &mut out);
                    cpu.download(&out)
                };
                let fresh = |xv: &[f32], w| run(&cpu.upload(xv, m, k), w);
                let want = [fresh(&x, &ws[0]), fresh(&x, &ws[1]), fresh(&x2, &ws[0])];
                let what = format!("{} {q:?} m={m}", cpu.name());
                let mut xt = cpu.upload(&x, m, k);
                assert_eq!(run(&xt, &ws[0]), want[0], "{what}: first projection");
                assert_eq!(run(&xt, &ws[1]), want[1], "{what}: second projection");
                xt.as_mut_slice().copy_from_slice(&x2);
                assert_eq!(run(&xt, &ws[0]), want[2], "{what}: after x changed");
            }
        }
    }
}
