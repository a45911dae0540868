//! Portable attention item: the same tiles and online softmax as the SIMD versions' prefill
//! path (which decodes take too here), in plain scalar Rust (one row at a time).

use super::{Job, KvLayout, Rows, TILE};
use crate::cpu::simd::Elem;

/// Runs one item (see the parent module).
///
/// # Safety
/// The item's rows are inside q and out, every offset the layout yields for tokens below each
/// row's limit is inside K and V, and no other thread writes this item's part of out.
pub(super) unsafe fn item<E: Elem, L: KvLayout>(
    job: &Job<'_, E>,
    layout: &L,
    kv_head: usize,
    rows: &Rows,
    scratch: &mut [f32],
) {
    let hd = job.shape.head_dim;
    let width = job.shape.num_heads * hd;
    let acc = &mut scratch[..hd];
    let mut offs = [0usize; TILE];
    for qi in 0..rows.queries {
        let limit = rows.first_limit + qi;
        for g in 0..rows.group {
            let src = (rows.first_token + qi) * width + (rows.first_head + g) * hd;
            let q = &job.q[src..src + hd];
            let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
            acc.fill(0.0);
            let mut t0 = 0;
            while t0 < limit {
                let n = TILE.min(limit - t0);
                layout.offsets(t0, n, kv_head, &mut offs);
                let mut s = [0.0f32; TILE];
                for t in 0..n {
                    let kr = &job.k[offs[t]..offs[t] + hd];
                    s[t] = q.iter().zip(kr).map(|(a, b)| a * b.to_f32()).sum::<f32>() * job.scale;
                }
                let m_new = s[..n].iter().fold(m, |a, &b| a.max(b));
                let corr = (m - m_new).exp();
                l *= corr;
                acc.iter_mut().for_each(|a| *a *= corr);
                for t in 0..n {
                    let p = (s[t] - m_new).exp();
                    l += p;
                    for (a, b) in acc.iter_mut().zip(&job.v[offs[t]..offs[t] + hd]) {
                        *a += p * b.to_f32();
                    }
                }
                m = m_new;
                t0 += n;
            }
            for (d, a) in acc.iter().enumerate() {
                // SAFETY: the row is inside out and owned by this item (the caller's contract).
                unsafe { *job.out.0.add(src + d) = a / l };
            }
        }
    }
}
