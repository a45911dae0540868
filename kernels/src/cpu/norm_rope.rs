//! Row-wise ops around the matmuls: embedding lookup, RMSNorm, rotary embeddings (rotate-half
//! layout with Llama-3 frequency scaling), SiLU-and-multiply and residual add.
//!
//! All are O(rows * cols) and memory-bound; large inputs (prefill) split rows across threads.
//! RoPE tables (`cos`, `sin`: `[max_positions, head_dim / 2]`) are computed once, in f32 with
//! the same formulas as Hugging Face (`_compute_default_rope_parameters`,
//! `_compute_llama3_parameters`) and candle, so positions match them bit for bit.

use super::simd::{Elem, Isa};
use super::tensor::{CpuTensor, CpuWeight, Store, WeightStore};
use crate::backend::RopeConfig;

/// Below this many values a row-wise op stays on the calling thread.
const PARALLEL_MIN_VALUES: usize = 1 << 16;

/// The same for SiLU, whose `exp` costs about 0.5 ns a value on one core: a batch of 32 decodes
/// (49,152 values of SmolLM2) takes about 25 us, and handing half to another thread about 1 us.
const SILU_PARALLEL_MIN_VALUES: usize = 1 << 13;

/// Runs `f(row_index, row)` over the rows of `data` (`cols` wide), in parallel from
/// `parallel_min` values on.
fn for_rows(
    data: &mut [f32],
    cols: usize,
    parallel_min: usize,
    f: impl Fn(usize, &mut [f32]) + Sync + Send,
) {
    if cols == 0 {
        return;
    }
    if data.len() < parallel_min {
        data.chunks_exact_mut(cols)
            .enumerate()
            .for_each(|(i, r)| f(i, r));
    } else {
        let rows = data.len() / cols;
        let pool = super::pool::pool();
        let per_task = rows.div_ceil(4 * pool.threads()).max(1);
        pool.run_parts(data.chunks_mut(per_task * cols), |t, part| {
            for (i, row) in part.chunks_exact_mut(cols).enumerate() {
                f(t * per_task + i, row);
            }
        });
    }
}

/// `out[i] = table[ids[i]]`; `out` becomes `[ids.len(), dim]`.
pub(crate) fn embedding(table: &CpuWeight, ids: &[u32], out: &mut CpuTensor) {
    let dim = table.cols;
    out.set_shape(ids.len(), dim);
    for (row, &id) in out.as_mut_slice().chunks_exact_mut(dim.max(1)).zip(ids) {
        let id = id as usize;
        assert!(
            id < table.rows,
            "embedding: id {id} >= vocab {}",
            table.rows
        );
        table.store.read_f32(id * dim, row);
    }
}

/// `out = x / sqrt(mean(x^2) + eps) * w` per row; `out` takes x's shape.
pub(crate) fn rms_norm(x: &CpuTensor, w: &CpuWeight, eps: f32, out: &mut CpuTensor) {
    let cols = x.cols();
    assert_eq!(w.store.len(), cols, "rms_norm: weight length != columns");
    out.set_shape(x.rows(), cols);
    let xs = x.as_slice();
    match &w.store {
        WeightStore::Dense(Store::F32(ws)) => norm_rows(xs, ws, eps, cols, out.as_mut_slice()),
        WeightStore::Dense(Store::F16(ws)) => norm_rows(xs, ws, eps, cols, out.as_mut_slice()),
        WeightStore::Dense(Store::BF16(ws)) => norm_rows(xs, ws, eps, cols, out.as_mut_slice()),
        quantized => norm_rows(xs, &quantized.to_f32(), eps, cols, out.as_mut_slice()),
    }
}

fn norm_rows<E: Elem>(x: &[f32], w: &[E], eps: f32, cols: usize, out: &mut [f32]) {
    for_rows(out, cols, PARALLEL_MIN_VALUES, |i, o| {
        let xr = &x[i * cols..(i + 1) * cols];
        let scale = 1.0 / (sum_squares(xr) / cols as f32 + eps).sqrt();
        for ((o, &xv), &wv) in o.iter_mut().zip(xr).zip(w) {
            *o = xv * scale * wv.to_f32();
        }
    });
}

/// Sum of squares with 16 partial sums (vectorizes; more accurate than one running sum).
fn sum_squares(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let chunks = x.chunks_exact(16);
    let rest: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for l in 0..16 {
            acc[l] += c[l] * c[l];
        }
    }
    acc.iter().sum::<f32>() + rest
}

/// `x += y`.
pub(crate) fn add_assign(x: &mut CpuTensor, y: &CpuTensor) {
    assert_eq!(
        x.as_slice().len(),
        y.as_slice().len(),
        "add_assign: shapes differ"
    );
    let cols = x.cols();
    let ys = y.as_slice();
    for_rows(x.as_mut_slice(), cols, PARALLEL_MIN_VALUES, |i, r| {
        for (a, b) in r.iter_mut().zip(&ys[i * cols..]) {
            *a += b;
        }
    });
}

/// `out` becomes rows `rows` of `x`, in that order.
pub(crate) fn gather_rows(x: &CpuTensor, rows: &[u32], out: &mut CpuTensor) {
    let cols = x.cols();
    out.set_shape(rows.len(), cols);
    for (dst, &r) in out.as_mut_slice().chunks_exact_mut(cols.max(1)).zip(rows) {
        assert!(
            (r as usize) < x.rows(),
            "gather_rows: row {r} >= {}",
            x.rows()
        );
        dst.copy_from_slice(x.row(r as usize));
    }
}

/// `out = silu(gate) * up` with `gate_up = [gate | up]` per row; `out` becomes `[rows, ffn]`.
pub(crate) fn silu_mul(isa: Isa, gate_up: &CpuTensor, out: &mut CpuTensor) {
    let ffn = gate_up.cols() / 2;
    assert_eq!(gate_up.cols(), 2 * ffn, "silu_mul: odd column count");
    out.set_shape(gate_up.rows(), ffn);
    let gu = gate_up.as_slice();
    for_rows(out.as_mut_slice(), ffn, SILU_PARALLEL_MIN_VALUES, |i, o| {
        let (g, u) = gu[i * 2 * ffn..(i + 1) * 2 * ffn].split_at(ffn);
        silu_mul_row(isa, g, u, o);
    });
}

fn silu_mul_row(isa: Isa, g: &[f32], u: &[f32], o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.avx512() {
        // SAFETY: Isa::Avx512 is only detected on CPUs with AVX-512F/FMA/F16C.
        unsafe { silu_mul_avx512(g, u, o) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: Isa::Avx2 is only detected on CPUs with AVX2/FMA/F16C.
        unsafe { silu_mul_avx2(g, u, o) };
        return;
    }
    let _ = isa;
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn silu_mul_avx512(g: &[f32], u: &[f32], o: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = o.len().min(g.len()).min(u.len());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n, the length of all three slices.
        unsafe {
            let gv = _mm512_loadu_ps(g.as_ptr().add(i));
            let uv = _mm512_loadu_ps(u.as_ptr().add(i));
            let e = super::simd::exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            let s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0), e));
            _mm512_storeu_ps(o.as_mut_ptr().add(i), _mm512_mul_ps(s, uv));
        }
        i += 16;
    }
    for j in i..n {
        o[j] = g[j] / (1.0 + (-g[j]).exp()) * u[j];
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn silu_mul_avx2(g: &[f32], u: &[f32], o: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = o.len().min(g.len()).min(u.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n, the length of all three slices.
        unsafe {
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let uv = _mm256_loadu_ps(u.as_ptr().add(i));
            let e = super::simd::exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            let s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            _mm256_storeu_ps(o.as_mut_ptr().add(i), _mm256_mul_ps(s, uv));
        }
        i += 8;
    }
    for j in i..n {
        o[j] = g[j] / (1.0 + (-g[j]).exp()) * u[j];
    }
}

/// Precomputed rotary tables.
#[derive(Debug, Clone)]
pub struct CpuRope {
    inv_freq: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    max_positions: usize,
}

impl CpuRope {
    /// The `cos` and `sin` tables, `[max_positions, head_dim / 2]` row-major (what a GPU backend
    /// uploads).
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// Builds the tables for `config.max_positions` positions.
    pub fn new(config: &RopeConfig) -> Self {
        let inv_freq = inv_freq(config);
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(config.max_positions * half);
        let mut sin = Vec::with_capacity(config.max_positions * half);
        for pos in 0..config.max_positions {
            for &f in &inv_freq {
                let a = pos as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        CpuRope {
            inv_freq,
            cos,
            sin,
            max_positions: config.max_positions,
        }
    }

    /// Inverse frequencies (`head_dim / 2`), after any scaling.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Rotates row `x` (`heads * head_dim`) to position `pos`.
    fn rotate(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        if half == 0 {
            return;
        }
        let mut c_buf = [0.0f32; 256];
        let mut s_buf = [0.0f32; 256];
        let (c, s): (&[f32], &[f32]) = if pos < self.max_positions {
            let at = pos * half;
            (&self.cos[at..at + half], &self.sin[at..at + half])
        } else if half <= 256 {
            // Past the table (a longer context than configured): compute this position.
            for (i, &f) in self.inv_freq.iter().enumerate() {
                (s_buf[i], c_buf[i]) = (pos as f32 * f).sin_cos();
            }
            (&c_buf[..half], &s_buf[..half])
        } else {
            panic!("rope: position {pos} past the table and head_dim > 512");
        };
        for head in x.chunks_exact_mut(2 * half) {
            let (x1, x2) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/// Hugging Face's inverse frequencies, `1 / theta^(2i / d)`, with Llama-3 scaling if set.
fn inv_freq(config: &RopeConfig) -> Vec<f32> {
    let d = config.head_dim;
    let base: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / config.theta.powf((2 * i) as f32 / d as f32))
        .collect();
    let Some(s) = config.llama3_scaling else {
        return base;
    };
    let old = s.original_max_position_embeddings as f32;
    let low_wavelen = old / s.low_freq_factor;
    let high_wavelen = old / s.high_freq_factor;
    base.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f32::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

/// Rotates each head of each row of `x` by its token's position.
pub(crate) fn apply_rope(rope: &CpuRope, x: &mut CpuTensor, positions: &[u32]) {
    let cols = x.cols();
    assert_eq!(
        positions.len(),
        x.rows(),
        "apply_rope: one position per row"
    );
    for_rows(x.as_mut_slice(), cols, PARALLEL_MIN_VALUES, |i, r| {
        rope.rotate(r, positions[i] as usize)
    });
}
