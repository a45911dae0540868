//! Row-wise ops against formulas computed here in f64: RMSNorm, RoPE (plain and with Llama-3
//! scaling, written out from Hugging Face's `_compute_llama3_parameters`), SiLU-and-multiply,
//! embedding lookup, row gather and residual add.

mod common;

use common::{assert_close, backends, random, rng, round, weight_data};
use kvgate_kernels::{Backend, DType, Llama3RopeScaling, RopeConfig};

#[test]
fn rms_norm_matches_formula() {
    let mut r = rng(1);
    for cpu in backends() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for &(rows, cols) in &[(1, 576), (3, 17), (130, 576)] {
                let x = random(&mut r, rows * cols, 3.0);
                let w = random(&mut r, cols, 1.0);
                let eps = 1e-5;
                let mut out = cpu.tensor(0, 0);
                let wt = cpu.weight(weight_data(&w, dtype), 1, cols);
                cpu.rms_norm(&cpu.upload(&x, rows, cols), &wt, eps, &mut out);
                let mut want = Vec::new();
                for row in x.chunks(cols) {
                    let ms: f64 =
                        row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / cols as f64;
                    let inv = 1.0 / (ms + eps as f64).sqrt();
                    want.extend(
                        row.iter()
                            .zip(&w)
                            .map(|(&v, &g)| v as f64 * inv * round(g, dtype) as f64),
                    );
                }
                assert_close(
                    &cpu.download(&out),
                    &want,
                    2e-6,
                    &format!("rms_norm {rows}x{cols}"),
                );
            }
        }
    }
}

/// Hugging Face's inverse frequencies, in f64, with optional Llama-3 scaling.
fn hf_inv_freq(theta: f64, d: usize, s: Option<Llama3RopeScaling>) -> Vec<f64> {
    let base: Vec<f64> = (0..d / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / d as f64))
        .collect();
    let Some(s) = s else { return base };
    let (factor, lo, hi) = (
        s.factor as f64,
        s.low_freq_factor as f64,
        s.high_freq_factor as f64,
    );
    let old = s.original_max_position_embeddings as f64;
    let (low_wavelen, high_wavelen) = (old / lo, old / hi);
    base.iter()
        .map(|&f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            let scaled = if wavelen > low_wavelen { f / factor } else { f };
            let smooth = (old / wavelen - lo) / (hi - lo);
            let smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled;
            let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
            if medium {
                smoothed
            } else {
                scaled
            }
        })
        .collect()
}

#[test]
fn rope_matches_formula_with_and_without_llama3_scaling() {
    let scaling = Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let mut r = rng(2);
    for cpu in backends() {
        for (theta, hd, sc) in [
            (10_000.0, 64, None),
            (500_000.0, 64, Some(scaling)),
            (1e6, 128, Some(scaling)),
        ] {
            let config = RopeConfig {
                theta,
                head_dim: hd,
                max_positions: 300,
                llama3_scaling: sc,
            };
            let rope = cpu.rope(&config);
            let inv = hf_inv_freq(theta as f64, hd, sc);
            if sc.is_some() {
                // Scaling must change some frequencies and keep the high ones.
                let plain = hf_inv_freq(theta as f64, hd, None);
                assert_eq!(inv[0], plain[0]);
                assert!(inv
                    .iter()
                    .zip(&plain)
                    .any(|(a, b)| (a - b).abs() > 1e-3 * b));
            }
            let heads = 3;
            // Positions inside the table and past it (computed on the fly).
            let positions: Vec<u32> = vec![0, 1, 7, 299, 300, 1000];
            let x = random(&mut r, positions.len() * heads * hd, 1.0);
            let mut t = cpu.upload(&x, positions.len(), heads * hd);
            cpu.apply_rope(&rope, &mut t, &positions);
            let half = hd / 2;
            let mut want = vec![0.0f64; x.len()];
            for (i, &pos) in positions.iter().enumerate() {
                for h in 0..heads {
                    let base = (i * heads + h) * hd;
                    for j in 0..half {
                        let a = pos as f64 * inv[j];
                        let (s, c) = a.sin_cos();
                        let (x1, x2) = (x[base + j] as f64, x[base + j + half] as f64);
                        want[base + j] = x1 * c - x2 * s;
                        want[base + j + half] = x2 * c + x1 * s;
                    }
                }
            }
            // f32 angles: pos * inv_freq rounds to ~pos * 6e-8 radians.
            assert_close(
                &cpu.download(&t),
                &want,
                2e-4,
                &format!("rope theta={theta} hd={hd}"),
            );
        }
    }
}

#[test]
fn silu_mul_matches_formula() {
    let mut r = rng(3);
    for cpu in backends() {
        for &(rows, ffn) in &[(1, 1536), (5, 37), (70, 1536)] {
            let gu = random(&mut r, rows * 2 * ffn, 12.0);
            let mut out = cpu.tensor(0, 0);
            cpu.silu_mul(&cpu.upload(&gu, rows, 2 * ffn), &mut out);
            assert_eq!(cpu.shape(&out), (rows, ffn));
            let want: Vec<f64> = gu
                .chunks(2 * ffn)
                .flat_map(|row| {
                    let (g, u) = row.split_at(ffn);
                    g.iter()
                        .zip(u)
                        .map(|(&g, &u)| {
                            let g = g as f64;
                            g / (1.0 + (-g).exp()) * u as f64
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            assert_close(&cpu.download(&out), &want, 1e-6, "silu_mul");
        }
    }
}

#[test]
fn embedding_gather_and_add() {
    let mut r = rng(4);
    for cpu in backends() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let (vocab, dim) = (50, 24);
            let table = random(&mut r, vocab * dim, 1.0);
            let w = cpu.weight(weight_data(&table, dtype), vocab, dim);
            let ids = [3u32, 0, 49, 3];
            let mut out = cpu.tensor(1, 1);
            cpu.embedding(&w, &ids, &mut out);
            let want: Vec<f32> = ids
                .iter()
                .flat_map(|&i| {
                    table[i as usize * dim..][..dim]
                        .iter()
                        .map(|&v| round(v, dtype))
                })
                .collect();
            assert_eq!(cpu.download(&out), want);

            let mut g = cpu.tensor(0, 0);
            cpu.gather_rows(&out, &[2, 0], &mut g);
            assert_eq!(
                cpu.download(&g),
                [&want[2 * dim..3 * dim], &want[..dim]].concat()
            );

            let y = random(&mut r, ids.len() * dim, 1.0);
            cpu.add_assign(&mut out, &cpu.upload(&y, ids.len(), dim));
            let sum: Vec<f32> = want.iter().zip(&y).map(|(a, b)| a + b).collect();
            assert_eq!(cpu.download(&out), sum);
        }
    }
}
