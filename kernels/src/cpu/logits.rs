//! A row of logits made safe to sample from, and its argmax, in one pass.
//!
//! Every sampler starts here: NaN becomes -inf (never picked), +inf becomes `f32::MAX` (so
//! softmax stays finite), and the largest value and its lowest index come out for the greedy
//! pick and for the softmax's shift. A greedy batch of 32 decodes runs this on 32 rows of the
//! vocabulary (49,152 values each for SmolLM2) every step, on the engine's thread while the
//! kernels' other threads wait, so it is written in AVX-512 and AVX2 as well as plain Rust. All
//! three give the same row and the same answer.

use super::simd::Isa;
use std::sync::OnceLock;

/// Cleans `logits` in place (NaN becomes -inf, +inf becomes `f32::MAX`) and returns the index
/// of the largest value (the lowest such index on ties) and that value, or `None` when no value
/// is finite or `f32::MAX` (all NaN or -inf).
pub fn clean_argmax(logits: &mut [f32]) -> Option<(u32, f32)> {
    static ISA: OnceLock<Isa> = OnceLock::new();
    clean_argmax_with(*ISA.get_or_init(Isa::detect), logits)
}

/// [`clean_argmax`] with the instruction set `isa` (which this CPU must support: the SIMD paths
/// are taken only where [`Isa::available`] lists it).
pub fn clean_argmax_with(isa: Isa, logits: &mut [f32]) -> Option<(u32, f32)> {
    // The SIMD lanes count indices in i32.
    assert!(
        i32::try_from(logits.len()).is_ok(),
        "clean_argmax: a row longer than i32 indices"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if isa.avx512() {
            // SAFETY: the AVX-512 ISAs are only detected with AVX-512F.
            return unsafe { avx512(logits) };
        }
        if isa == Isa::Avx2 {
            // SAFETY: Isa::Avx2 is only detected with AVX2.
            return unsafe { avx2(logits) };
        }
    }
    let _ = isa;
    portable(logits)
}

/// One value cleaned.
#[inline(always)]
fn clean(l: f32) -> f32 {
    if l.is_nan() {
        f32::NEG_INFINITY
    } else if l > f32::MAX {
        f32::MAX
    } else {
        l
    }
}

/// The plain-Rust version, and the SIMD versions' tail.
fn portable(logits: &mut [f32]) -> Option<(u32, f32)> {
    fold_tail(logits, 0, f32::NEG_INFINITY, 0)
}

/// Cleans `logits[from..]` and folds it into a running maximum `max` at index `at` (strictly
/// greater values win, so the lowest index stays on ties); `None` if the maximum is -inf.
#[inline(always)]
fn fold_tail(logits: &mut [f32], from: usize, mut max: f32, mut at: usize) -> Option<(u32, f32)> {
    for (i, l) in logits.iter_mut().enumerate().skip(from) {
        *l = clean(*l);
        if *l > max {
            max = *l;
            at = i;
        }
    }
    (max != f32::NEG_INFINITY).then_some((at as u32, max))
}

/// 16 lanes, each with its own maximum and the first index where it occurred.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512(logits: &mut [f32]) -> Option<(u32, f32)> {
    use std::arch::x86_64::*;
    const LANES: usize = 16;
    let n = logits.len() / LANES * LANES;
    if n == 0 {
        return portable(logits);
    }
    let p = logits.as_mut_ptr();
    let big = _mm512_set1_ps(f32::MAX);
    let none = _mm512_set1_ps(f32::NEG_INFINITY);
    let step = _mm512_set1_epi32(LANES as i32);
    let mut idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let (mut best, mut best_at) = (none, _mm512_setzero_si512());
    for i in (0..n).step_by(LANES) {
        // SAFETY: i + 16 <= n <= len; AVX-512F per the caller.
        unsafe {
            let v = _mm512_loadu_ps(p.add(i));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            // `vminps` returns its second operand where the first is NaN; the blend then makes
            // those -inf.
            let v = _mm512_mask_blend_ps(nan, _mm512_min_ps(v, big), none);
            _mm512_storeu_ps(p.add(i), v);
            let gt = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, best);
            best = _mm512_mask_blend_ps(gt, best, v);
            best_at = _mm512_mask_blend_epi32(gt, best_at, idx);
        }
        idx = _mm512_add_epi32(idx, step);
    }
    let max = _mm512_reduce_max_ps(best);
    // The lowest index among the lanes that hold the maximum.
    let at = _mm512_mask_reduce_min_epi32(
        _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(best, _mm512_set1_ps(max)),
        best_at,
    );
    fold_tail(logits, n, max, at as usize)
}

/// 8 lanes, as [`avx512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2(logits: &mut [f32]) -> Option<(u32, f32)> {
    use std::arch::x86_64::*;
    const LANES: usize = 8;
    let n = logits.len() / LANES * LANES;
    if n == 0 {
        return portable(logits);
    }
    let p = logits.as_mut_ptr();
    let big = _mm256_set1_ps(f32::MAX);
    let none = _mm256_set1_ps(f32::NEG_INFINITY);
    let step = _mm256_set1_epi32(LANES as i32);
    let mut idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let (mut best, mut best_at) = (none, _mm256_setzero_si256());
    for i in (0..n).step_by(LANES) {
        // SAFETY: i + 8 <= n <= len; AVX2 per the caller.
        unsafe {
            let v = _mm256_loadu_ps(p.add(i));
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v);
            let v = _mm256_blendv_ps(_mm256_min_ps(v, big), none, nan);
            _mm256_storeu_ps(p.add(i), v);
            let gt = _mm256_cmp_ps::<_CMP_GT_OQ>(v, best);
            best = _mm256_blendv_ps(best, v, gt);
            best_at = _mm256_castps_si256(_mm256_blendv_ps(
                _mm256_castsi256_ps(best_at),
                _mm256_castsi256_ps(idx),
                gt,
            ));
        }
        idx = _mm256_add_epi32(idx, step);
    }
    let mut lanes = [0f32; LANES];
    let mut ats = [0i32; LANES];
    // SAFETY: both arrays hold 8 values.
    unsafe {
        _mm256_storeu_ps(lanes.as_mut_ptr(), best);
        _mm256_storeu_si256(ats.as_mut_ptr().cast(), best_at);
    }
    let max = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let at = lanes
        .iter()
        .zip(ats)
        .filter(|(l, _)| **l == max)
        .map(|(_, a)| a)
        .min()
        .unwrap_or(0);
    fold_tail(logits, n, max, at as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: clean, then the first position of the maximum, in the plainest Rust.
    fn reference(logits: &mut [f32]) -> Option<(u32, f32)> {
        for l in logits.iter_mut() {
            *l = clean(*l);
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return None;
        }
        let at = logits.iter().position(|&l| l == max)?;
        Some((at as u32, max))
    }

    #[test]
    fn every_instruction_set_cleans_and_picks_as_the_reference() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for len in [0usize, 1, 7, 8, 15, 16, 17, 33, 100, 1000, 49_152, 49_155] {
            for case in 0..8 {
                let mut row: Vec<f32> = (0..len)
                    .map(|_| ((next() % 2001) as f32 - 1000.0) / 37.0)
                    .collect();
                let mut spot = |v: f32, row: &mut Vec<f32>| {
                    if !row.is_empty() {
                        let i = (next() as usize) % row.len();
                        row[i] = v;
                    }
                };
                match case {
                    // Ties at the maximum in several lanes: the lowest index must win.
                    1 => (0..5).for_each(|_| spot(500.0, &mut row)),
                    2 => (0..3).for_each(|_| spot(f32::NAN, &mut row)),
                    3 => (0..3).for_each(|_| spot(f32::INFINITY, &mut row)),
                    4 => row.iter_mut().for_each(|l| *l = f32::NAN),
                    5 => row.iter_mut().for_each(|l| *l = f32::NEG_INFINITY),
                    6 => {
                        row.iter_mut().for_each(|l| *l = f32::NEG_INFINITY);
                        spot(-3.0e38, &mut row);
                    }
                    7 => {
                        // Only the tail (past the last whole vector) holds the maximum.
                        if let Some(l) = row.last_mut() {
                            *l = 1.0e6;
                        }
                    }
                    _ => {}
                }
                let mut want_row = row.clone();
                let want = reference(&mut want_row);
                for isa in Isa::available() {
                    let mut got_row = row.clone();
                    let got = clean_argmax_with(isa, &mut got_row);
                    assert_eq!(got, want, "{isa:?}, length {len}, case {case}");
                    let bits = |r: &[f32]| r.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got_row),
                        bits(&want_row),
                        "{isa:?}, length {len}, case {case}"
                    );
                }
            }
        }
    }
}
