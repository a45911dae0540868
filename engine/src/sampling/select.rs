//! Choosing a token from one row of logits: argmax, and temperature sampling restricted by
//! top-k, top-p and min-p.
//!
//! Every filter keeps a prefix of the vocabulary sorted by logit (descending, ties to the lower
//! id), so the survivors are found without sorting the whole vocabulary:
//! - no filter: two passes (sum of weights, then the draw), no copy;
//! - top-k: one pass keeping the best `k` (insertion into a sorted buffer for small `k`, else
//!   `select_nth_unstable`), O(V + k log k);
//! - min-p: one pass keeping tokens within `ln(min_p)` of the best (in temperature-scaled logits);
//! - top-p: its normalizer in one pass, then the candidates are sorted in growing chunks (64,
//!   256, ...) by partial selection until the kept mass reaches `p`: O(V) for peaked
//!   distributions, O(V log V) only when most of the vocabulary is needed.
//!
//! Weights are `exp((l - max) / T)` in f32, summed in f64. Order as in vLLM: top-k, then top-p
//! renormalized over the top-k survivors, then min-p. Buffers live in a [`Workspace`] that one
//! engine thread reuses for every sequence, so a step allocates nothing once warm.

use std::cmp::Ordering;

/// Up to this `k`, top-k keeps a sorted buffer instead of selecting over a copy of the row.
const INSERTION_MAX_K: usize = 64;
/// First chunk of the incremental sort for top-p.
const FIRST_CHUNK: usize = 64;

/// Reusable buffers for sampling; one per engine thread.
#[derive(Debug, Default)]
pub struct Workspace {
    pub(super) cand: Vec<(u32, f32)>,
    pub(super) top: Vec<(u32, f32)>,
}

impl Workspace {
    /// Empty buffers; they grow to the vocabulary size on first use.
    pub fn new() -> Self {
        Workspace::default()
    }
}

/// The sampling order: larger logit first, then lower id.
pub(super) fn better(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Temperature and filters of one sampling step.
#[derive(Debug, Clone, Copy)]
pub(super) struct Filter {
    /// 1 / temperature; positive and finite.
    pub inv_t: f32,
    pub top_k: Option<usize>,
    pub top_p: f32,
    pub min_p: f32,
}

impl Filter {
    fn is_off(&self, vocab: usize) -> bool {
        self.top_k.is_none_or(|k| k >= vocab) && self.top_p >= 1.0 && self.min_p <= 0.0
    }
}

/// The best `k` entries of `logits`, best first, into `out` (cleared first).
pub(super) fn top_k_into(logits: &[f32], k: usize, out: &mut Vec<(u32, f32)>) {
    out.clear();
    let k = k.min(logits.len());
    if k == 0 {
        return;
    }
    if k <= INSERTION_MAX_K {
        for (i, &l) in logits.iter().enumerate() {
            let e = (i as u32, l);
            if out.len() == k {
                match out.last() {
                    Some(last) if better(&e, last) == Ordering::Less => {
                        out.pop();
                    }
                    _ => continue,
                }
            }
            let at = out.partition_point(|x| better(x, &e) == Ordering::Less);
            out.insert(at, e);
        }
    } else {
        out.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        if k < out.len() {
            out.select_nth_unstable_by(k - 1, better);
            out.truncate(k);
        }
        out.sort_unstable_by(better);
    }
}

/// Samples a token from `logits` (no NaN; `max` is their finite maximum) with `u` uniform in
/// [0, 1).
pub(super) fn sample(logits: &[f32], max: f32, f: &Filter, u: f64, ws: &mut Workspace) -> u32 {
    let weight = |l: f32| ((l - max) * f.inv_t).exp();
    if f.is_off(logits.len()) {
        let total: f64 = logits.iter().map(|&l| f64::from(weight(l))).sum();
        return draw(
            logits.iter().enumerate().map(|(i, &l)| (i as u32, l)),
            &weight,
            u * total,
        );
    }
    let cand = candidates(logits, max, f, ws);
    let total: f64 = cand.iter().map(|&(_, l)| f64::from(weight(l))).sum();
    draw(cand.iter().copied(), &weight, u * total)
}

/// The first entry at which the running weight passes `target`; the last positive one when
/// rounding leaves `target` unreached.
fn draw(
    entries: impl Iterator<Item = (u32, f32)>,
    weight: &impl Fn(f32) -> f32,
    target: f64,
) -> u32 {
    let mut acc = 0.0f64;
    let mut last = None;
    for (id, l) in entries {
        let w = f64::from(weight(l));
        if w > 0.0 {
            acc += w;
            last = Some(id);
            if acc > target {
                return id;
            }
        }
    }
    last.unwrap_or(0)
}

/// The tokens that survive the filters, in `ws.cand` (sorted best first when top-k or top-p is
/// on; in id order otherwise).
pub(super) fn candidates<'w>(
    logits: &[f32],
    max: f32,
    f: &Filter,
    ws: &'w mut Workspace,
) -> &'w [(u32, f32)] {
    let scaled = |l: f32| (l - max) * f.inv_t;
    let weight = |l: f32| f64::from(scaled(l).exp());
    let min_scaled = if f.min_p > 0.0 {
        f.min_p.ln()
    } else {
        f32::NEG_INFINITY
    };
    let cand = &mut ws.cand;
    let sorted;
    let normalizer;
    match f.top_k.filter(|&k| k < logits.len()) {
        Some(k) => {
            top_k_into(logits, k, cand);
            sorted = true;
            // Top-p renormalizes over the top-k survivors (before min-p cuts them).
            normalizer = if f.top_p < 1.0 {
                cand.iter().map(|&(_, l)| weight(l)).sum()
            } else {
                0.0
            };
            let keep = cand.partition_point(|&(_, l)| scaled(l) >= min_scaled);
            cand.truncate(keep);
        }
        None => {
            cand.clear();
            let mut z = 0.0f64;
            for (i, &l) in logits.iter().enumerate() {
                let s = scaled(l);
                if f.top_p < 1.0 {
                    z += f64::from(s.exp());
                }
                if s >= min_scaled {
                    cand.push((i as u32, l));
                }
            }
            sorted = false;
            normalizer = z;
        }
    }
    if f.top_p < 1.0 {
        let keep = top_p_len(cand, sorted, f64::from(f.top_p) * normalizer, &weight);
        cand.truncate(keep);
    }
    cand
}

/// Length of the shortest best-first prefix of `cand` whose weight reaches `mass` (a token is
/// kept when the weight strictly before it is under `mass`). Sorts `cand` only as far as needed.
fn top_p_len(
    cand: &mut [(u32, f32)],
    sorted: bool,
    mass: f64,
    weight: &impl Fn(f32) -> f64,
) -> usize {
    let (mut done, mut chunk, mut acc) = (0, FIRST_CHUNK, 0.0f64);
    while done < cand.len() {
        let end = (done + chunk).min(cand.len());
        if !sorted {
            let rest = &mut cand[done..];
            if end - done < rest.len() {
                rest.select_nth_unstable_by(end - done - 1, better);
            }
            cand[done..end].sort_unstable_by(better);
        }
        for (i, &(_, l)) in cand.iter().enumerate().take(end).skip(done) {
            if acc >= mass && i > 0 {
                return i;
            }
            acc += weight(l);
        }
        done = end;
        chunk *= 4;
    }
    cand.len()
}
