//! Helpers shared by the kernel tests: seeded random data, storage rounding, tolerance checks,
//! and the backends every test runs on (every instruction set this CPU has, portable included).

#![allow(dead_code)]

use half::{bf16, f16};
use kvgate_kernels::cpu::Isa;
use kvgate_kernels::{Cpu, DType, WeightData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The backends under test: one per instruction set this CPU has, the portable one first.
pub fn backends() -> Vec<Cpu> {
    Isa::available()
        .into_iter()
        .filter_map(Cpu::with_isa)
        .collect()
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `n` values uniform in `[-amp, amp)`.
pub fn random(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-amp..amp)).collect()
}

/// Rounds `v` to what `dtype` storage keeps.
pub fn round(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::F32 => v,
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::BF16 => bf16::from_f32(v).to_f32(),
    }
}

/// `values` as weight data of `dtype`.
pub fn weight_data(values: &[f32], dtype: DType) -> WeightData {
    match dtype {
        DType::F32 => WeightData::F32(values.to_vec()),
        DType::F16 => WeightData::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
        DType::BF16 => WeightData::BF16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
    }
}

/// Asserts `|got - want| <= tol * scale` elementwise, where `scale` is the largest `|want|`
/// (at least 1e-3), with a message naming the case.
pub fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1e-3f64, |a, b| a.max(b.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= tol * scale,
            "{what}: element {i}: got {g}, want {w} (err {err:.3e}, allowed {:.3e})",
            tol * scale
        );
    }
}
