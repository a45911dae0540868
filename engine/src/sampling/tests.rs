//! Sampler tests: distributions under each filter (fixed seeds, so deterministic, with
//! tolerances of about four standard deviations), the partial-selection filters against a
//! full-sort reference on a 49,152-token vocabulary, reproducibility, penalties, masks and
//! logprobs.

use super::select::{self, better, Filter};
use super::*;

const DRAWS: usize = 20_000;

fn logits_of(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|&p| p.ln() as f32).collect()
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// Empirical frequencies of each token over [`DRAWS`] steps on the same row.
fn frequencies(params: &SamplingParams, logits: &[f32]) -> Vec<f64> {
    let mut sampler = Sampler::new(params, &[], &[], 0);
    let mut ws = Workspace::new();
    let mut counts = vec![0usize; logits.len()];
    let mut row = logits.to_vec();
    for _ in 0..DRAWS {
        row.copy_from_slice(logits);
        counts[sampler.sample(&mut row, &mut ws).unwrap().token as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / DRAWS as f64).collect()
}

#[track_caller]
fn assert_distribution(params: SamplingParams, probs: &[f64], want: &[f64]) {
    let got = frequencies(&params, &logits_of(probs));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = if w == 0.0 {
            0.0
        } else {
            4.0 * (w * (1.0 - w) / DRAWS as f64).sqrt() + 1e-3
        };
        assert!(
            (g - w).abs() <= tol,
            "token {i}: got {g:.4}, want {w:.4} (all: {got:?})"
        );
    }
}

fn normalized(w: &[f64]) -> Vec<f64> {
    let s: f64 = w.iter().sum();
    w.iter().map(|x| x / s).collect()
}

#[test]
fn temperature_one_follows_softmax() {
    assert_distribution(seeded(1), &[0.5, 0.3, 0.2], &[0.5, 0.3, 0.2]);
}

#[test]
fn temperature_sharpens_and_flattens() {
    let p = [0.5, 0.3, 0.2];
    let sharp = SamplingParams {
        temperature: 0.5,
        ..seeded(2)
    };
    assert_distribution(sharp, &p, &normalized(&p.map(|x| x * x)));
    let flat = SamplingParams {
        temperature: 2.0,
        ..seeded(3)
    };
    assert_distribution(flat, &p, &normalized(&p.map(f64::sqrt)));
}

#[test]
fn top_k_renormalizes_over_the_k_best() {
    let params = SamplingParams {
        top_k: Some(2),
        ..seeded(4)
    };
    assert_distribution(params, &[0.2, 0.5, 0.3], &[0.0, 0.625, 0.375]);
}

#[test]
fn top_p_keeps_the_token_that_crosses_p() {
    let p = [0.5, 0.3, 0.15, 0.05];
    let params = SamplingParams {
        top_p: 0.7,
        ..seeded(5)
    };
    assert_distribution(params, &p, &[0.625, 0.375, 0.0, 0.0]);
    let params = SamplingParams {
        top_p: 0.85,
        ..seeded(6)
    };
    assert_distribution(params, &p, &normalized(&[0.5, 0.3, 0.15, 0.0]));
}

#[test]
fn top_p_is_renormalized_after_top_k() {
    // Over the top 3 the masses are 4/9, 3/9, 2/9: the third token starts at 7/9 >= 0.75 and is
    // cut, which it would not be over the whole vocabulary (it starts at 0.7 there).
    let params = SamplingParams {
        top_k: Some(3),
        top_p: 0.75,
        ..seeded(7)
    };
    assert_distribution(
        params,
        &[0.4, 0.3, 0.2, 0.1],
        &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0],
    );
}

#[test]
fn min_p_is_relative_to_the_best_after_temperature() {
    let p = [0.5, 0.3, 0.15, 0.05];
    let params = SamplingParams {
        min_p: 0.35,
        ..seeded(8)
    };
    assert_distribution(params, &p, &[0.625, 0.375, 0.0, 0.0]);
    // At T = 2 the scaled probabilities are proportional to sqrt(p): 0.387 / 0.707 >= 0.5.
    let params = SamplingParams {
        min_p: 0.5,
        temperature: 2.0,
        ..seeded(9)
    };
    assert_distribution(
        params,
        &p,
        &normalized(&[0.5f64.sqrt(), 0.3f64.sqrt(), 0.15f64.sqrt(), 0.0]),
    );
}

/// The plain scan the vectorized greedy pass must agree with: NaN is -inf, the first strict
/// maximum wins, +inf counts as `f32::MAX`.
fn scan_argmax(row: &[f32]) -> Option<u32> {
    let (mut best, mut max) = (None, f32::NEG_INFINITY);
    for (i, &l) in row.iter().enumerate() {
        let l = if l.is_nan() {
            f32::NEG_INFINITY
        } else {
            l.min(f32::MAX)
        };
        if l > max {
            (best, max) = (Some(i as u32), l);
        }
    }
    best
}

#[test]
fn greedy_matches_a_plain_scan_on_rows_of_every_length() {
    let mut s = Sampler::new(&SamplingParams::greedy(), &[], &[], 0);
    let mut ws = Workspace::new();
    let mut rng = StdRng::seed_from_u64(7);
    for len in [1, 7, 8, 9, 16, 63, 49_157] {
        // The maximum in a lane, in the tail past the last whole chunk, and tied across lanes,
        // with NaN and infinities about.
        for case in 0..6 {
            let mut row: Vec<f32> = (0..len).map(|_| rng.gen_range(-20.0..20.0)).collect();
            let at = |f: usize| f % len;
            match case {
                0 => row[at(len / 2)] = 30.0,
                1 => row[len - 1] = 30.0,
                2 => {
                    row[at(13)] = 30.0;
                    row[at(5)] = 30.0;
                }
                3 => {
                    row[at(3)] = f32::NAN;
                    row[at(2 * len - 2)] = f32::INFINITY;
                }
                4 => row.iter_mut().step_by(3).for_each(|l| *l = f32::NAN),
                _ => {
                    // Zeros of both signs tie for the maximum: the lower id wins.
                    row.fill(f32::NEG_INFINITY);
                    row[at(8)] = 0.0;
                    row[at(1)] = -0.0;
                }
            }
            let want = scan_argmax(&row);
            let got = s.sample(&mut row, &mut ws).ok().map(|t| t.token);
            assert_eq!(got, want, "len {len}, case {case}");
        }
    }
}

#[test]
fn greedy_takes_the_lowest_id_on_ties() {
    let mut s = Sampler::new(&SamplingParams::greedy(), &[], &[], 0);
    let mut ws = Workspace::new();
    assert_eq!(
        s.sample(&mut [1.0, 3.0, 3.0, 2.0], &mut ws).unwrap().token,
        1
    );
    assert_eq!(
        s.sample(&mut [f32::NAN, 1.0, 2.0], &mut ws).unwrap().token,
        2
    );
    assert_eq!(
        s.sample(&mut [0.0, f32::INFINITY, f32::INFINITY], &mut ws)
            .unwrap()
            .token,
        1
    );
    assert_eq!(s.sample(&mut [], &mut ws), Err(SamplingError::EmptyLogits));
    let mut masked = [f32::NEG_INFINITY, f32::NAN];
    assert_eq!(
        s.sample(&mut masked, &mut ws),
        Err(SamplingError::NoFiniteLogits)
    );
    assert_eq!(SamplingError::NoFiniteLogits.api_error().status, 500);
    assert_eq!(SamplingError::EmptyLogits.api_error().status, 500);
}

#[test]
fn a_request_that_masks_every_token_is_its_own_400() {
    // min_tokens suppresses EOS and the stop tokens; here they are the whole vocabulary.
    let params = SamplingParams {
        min_tokens: 2,
        stop_token_ids: vec![0, 1],
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(&params, &[], &[2], 0);
    let mut ws = Workspace::new();
    let err = s.sample(&mut [1.0, 2.0, 3.0], &mut ws).unwrap_err();
    assert_eq!(err, SamplingError::AllMasked);
    assert!(err.is_request_fault());
    let api = err.api_error();
    assert_eq!((api.status, api.type_), (400, "invalid_request_error"));
    // Once min_tokens is reached nothing is masked any more.
    let params = SamplingParams {
        min_tokens: 0,
        ..params
    };
    let mut s = Sampler::new(&params, &[], &[2], 0);
    assert_eq!(s.sample(&mut [1.0, 2.0, 3.0], &mut ws).unwrap().token, 2);
}

#[test]
fn top_k_one_is_greedy() {
    let params = SamplingParams {
        top_k: Some(1),
        ..seeded(10)
    };
    assert_distribution(params, &[0.3, 0.4, 0.3], &[0.0, 1.0, 0.0]);
}

/// The filters by the book: sort everything, cut top-k, top-p over the renormalized survivors,
/// then min-p.
fn reference(logits: &[f32], f: &Filter) -> Vec<u32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut all: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l))
        .collect();
    all.sort_by(better);
    all.truncate(f.top_k.unwrap_or(usize::MAX));
    let w: Vec<f64> = all
        .iter()
        .map(|&(_, l)| f64::from(((l - max) * f.inv_t).exp()))
        .collect();
    let z: f64 = w.iter().sum();
    let mut keep = all.len();
    let mut acc = 0.0;
    for (i, wi) in w.iter().enumerate() {
        if i > 0 && acc >= f64::from(f.top_p) * z {
            keep = i;
            break;
        }
        acc += wi;
    }
    all.truncate(keep);
    all.retain(|&(_, l)| f.min_p <= 0.0 || (l - max) * f.inv_t >= f.min_p.ln());
    let mut ids: Vec<u32> = all.iter().map(|&(id, _)| id).collect();
    ids.sort_unstable();
    ids
}

#[test]
fn partial_selection_matches_a_full_sort_on_a_real_vocabulary() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut ws = Workspace::new();
    let filters = [
        (None, 0.9, 0.0),
        (None, 0.999, 0.0),
        (None, 0.3, 0.0),
        (Some(50), 1.0, 0.0),
        (Some(1000), 1.0, 0.0),
        (Some(1000), 0.95, 0.0),
        (Some(40), 0.5, 0.05),
        (None, 1.0, 0.01),
        (None, 0.9, 0.001),
    ];
    for round in 0..4 {
        // Peaked rows (top-p stops early) and flat rows (it needs most of the vocabulary).
        let scale = if round % 2 == 0 { 12.0 } else { 0.5 };
        let logits: Vec<f32> = (0..49_152)
            .map(|_| scale * rng.gen::<f32>().powi(3))
            .collect();
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for &(top_k, top_p, min_p) in &filters {
            for temperature in [0.7f32, 1.0, 1.5] {
                let f = Filter {
                    inv_t: 1.0 / temperature,
                    top_k,
                    top_p,
                    min_p,
                };
                let mut got: Vec<u32> = select::candidates(&logits, max, &f, &mut ws)
                    .iter()
                    .map(|&(id, _)| id)
                    .collect();
                got.sort_unstable();
                assert_eq!(got, reference(&logits, &f), "round {round} filter {f:?}");
            }
        }
    }
}

#[test]
fn top_k_insertion_and_selection_agree() {
    let mut rng = StdRng::seed_from_u64(12);
    // Many ties, to check the order is total.
    let logits: Vec<f32> = (0..5000)
        .map(|_| (rng.gen::<f32>() * 50.0).floor())
        .collect();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    select::top_k_into(&logits, 64, &mut a);
    select::top_k_into(&logits, 65, &mut b);
    assert_eq!(a[..], b[..64]);
    let mut all: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l))
        .collect();
    all.sort_by(better);
    assert_eq!(b[..], all[..65]);
    select::top_k_into(&logits, 10_000, &mut b);
    assert_eq!(b, all);
}

/// Tokens of `steps` steps over rows that change with the step.
fn run(params: &SamplingParams, index: u32, steps: usize) -> Vec<u32> {
    let mut s = Sampler::new(params, &[1, 2, 3], &[], index);
    let mut ws = Workspace::new();
    let mut row_rng = StdRng::seed_from_u64(99);
    (0..steps)
        .map(|_| {
            let mut row: Vec<f32> = (0..1000).map(|_| row_rng.gen::<f32>() * 4.0).collect();
            s.sample(&mut row, &mut ws).unwrap().token
        })
        .collect()
}

#[test]
fn seeded_sampling_is_reproducible() {
    let params = SamplingParams {
        top_p: 0.9,
        top_k: Some(100),
        presence_penalty: 0.5,
        ..seeded(42)
    };
    assert_eq!(run(&params, 0, 200), run(&params, 0, 200));
    assert_ne!(run(&params, 0, 200), run(&seeded(43), 0, 200));
}

#[test]
fn sample_i_alone_reproduces_sample_i_of_the_group() {
    let params = SamplingParams {
        temperature: 0.8,
        ..seeded(7)
    };
    let group: Vec<Vec<u32>> = (0..4).map(|i| run(&params, i, 50)).collect();
    for (i, tokens) in group.iter().enumerate() {
        let alone = SamplingParams {
            seed: Some(derive_seed(7, i as u32)),
            ..params.clone()
        };
        assert_eq!(&run(&alone, 0, 50), tokens, "sample {i}");
    }
    assert_eq!(derive_seed(7, 0), 7);
    for i in 0..4 {
        for j in i + 1..4 {
            assert_ne!(group[i], group[j]);
        }
    }
}

#[test]
fn unseeded_samplers_differ() {
    let params = SamplingParams::default();
    let (a, b) = (
        Sampler::new(&params, &[], &[], 0),
        Sampler::new(&params, &[], &[], 0),
    );
    assert_ne!(a.seed(), b.seed());
    assert_ne!(run(&params, 0, 64), run(&params, 0, 64));
}

#[test]
fn penalties_steer_greedy_decoding() {
    let params = SamplingParams {
        frequency_penalty: 0.2,
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(&params, &[], &[], 0);
    let mut ws = Workspace::new();
    // Counts alternate the lead: 1.0 vs 0.9, then 0.8 vs 0.9, then 0.8 vs 0.7, ...
    let tokens: Vec<u32> = (0..4)
        .map(|_| s.sample(&mut [1.0, 0.9], &mut ws).unwrap().token)
        .collect();
    assert_eq!(tokens, [0, 1, 0, 1]);
    // The repetition penalty counts the prompt.
    let params = SamplingParams {
        repetition_penalty: 2.0,
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(&params, &[0], &[], 0);
    assert_eq!(s.sample(&mut [1.0, 0.6], &mut ws).unwrap().token, 1);
}

#[test]
fn logit_bias_and_min_tokens() {
    let mut ws = Workspace::new();
    let params = SamplingParams {
        logit_bias: vec![(2, 5.0), (99, 1.0)],
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(&params, &[], &[], 0);
    assert_eq!(s.sample(&mut [1.0, 0.0, 0.0], &mut ws).unwrap().token, 2);
    let params = SamplingParams {
        min_tokens: 2,
        stop_token_ids: vec![1],
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(&params, &[], &[0], 0);
    let tokens: Vec<u32> = (0..3)
        .map(|_| s.sample(&mut [3.0, 2.0, 1.0], &mut ws).unwrap().token)
        .collect();
    assert_eq!(tokens, [2, 2, 0]);
    assert_eq!(s.generated(), 3);
    // With ignore_eos only the stop tokens are held back.
    let params = SamplingParams {
        ignore_eos: true,
        ..params
    };
    let mut s = Sampler::new(&params, &[], &[0], 0);
    assert_eq!(s.sample(&mut [3.0, 2.0, 1.0], &mut ws).unwrap().token, 0);
}

#[test]
fn logprobs_are_a_distribution_before_temperature() {
    let mut rng = StdRng::seed_from_u64(13);
    let logits: Vec<f32> = (0..6).map(|_| rng.gen::<f32>() * 5.0 - 2.0).collect();
    let mut ws = Workspace::new();
    let lps: Vec<TokenLogprobs> = [0.3f32, 1.0, 0.0]
        .iter()
        .map(|&t| {
            let params = SamplingParams {
                temperature: t,
                logprobs: Some(6),
                ..seeded(1)
            };
            let mut s = Sampler::new(&params, &[], &[], 0);
            let out = s.sample(&mut logits.clone(), &mut ws).unwrap();
            let lp = out.logprobs.unwrap();
            let chosen = lp.top.iter().find(|&&(id, _)| id == out.token).unwrap().1;
            assert_eq!(lp.logprob, chosen);
            lp
        })
        .collect();
    let total: f64 = lps[0].top.iter().map(|&(_, lp)| f64::from(lp).exp()).sum();
    assert!((total - 1.0).abs() < 1e-5, "{total}");
    assert!(lps[0].top.windows(2).all(|w| w[0].1 >= w[1].1));
    assert_eq!(lps[0].top, lps[1].top);
    assert_eq!(lps[1].top, lps[2].top);
    // logprobs: 0 is the chosen token only; -inf is floored.
    let params = SamplingParams {
        logprobs: Some(0),
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(&params, &[], &[], 0);
    let lp = s
        .sample(&mut [0.0, f32::NEG_INFINITY], &mut ws)
        .unwrap()
        .logprobs
        .unwrap();
    assert_eq!((lp.logprob, lp.top.len()), (0.0, 0));
    let params = SamplingParams {
        logprobs: Some(2),
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(&params, &[], &[], 0);
    let lp = s
        .sample(&mut [0.0, f32::NEG_INFINITY], &mut ws)
        .unwrap()
        .logprobs
        .unwrap();
    assert_eq!(lp.top, vec![(0, 0.0), (1, MIN_LOGPROB)]);
}

#[test]
fn logprobs_see_the_penalties() {
    let params = SamplingParams {
        presence_penalty: 1.0,
        logprobs: Some(2),
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(&params, &[], &[], 0);
    let mut ws = Workspace::new();
    let first = s
        .sample(&mut [0.0, 0.0], &mut ws)
        .unwrap()
        .logprobs
        .unwrap();
    let second = s.sample(&mut [0.0, 0.0], &mut ws).unwrap();
    assert_eq!(second.token, 1);
    let lp = second.logprobs.unwrap();
    assert!((first.logprob - 0.5f32.ln()).abs() < 1e-6);
    assert!(lp.logprob > first.logprob && lp.top[1].0 == 0);
}
