//! Log-probabilities for the `logprobs` option: the log-softmax of the logits after logit bias
//! and penalties, before temperature and filtering (what vLLM reports by default), for the chosen
//! token and the `k` most likely ones.
//!
//! One pass for the normalizer `max + ln Σ exp(l - max)`, one for the top `k` (k <= 20: a small
//! sorted buffer). Values are clamped at [`MIN_LOGPROB`] so JSON never meets `-inf`.

use super::select::{top_k_into, Workspace};

/// The smallest logprob reported (vLLM's floor); `-inf` is not valid JSON.
pub const MIN_LOGPROB: f32 = -9999.0;

/// Logprobs of one generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's logprob.
    pub logprob: f32,
    /// The most likely tokens with their logprobs, best first (ties to the lower id).
    pub top: Vec<(u32, f32)>,
}

/// `ln Σ exp(l)` over the row, given its finite maximum.
pub(super) fn log_normalizer(logits: &[f32], max: f32) -> f32 {
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    max + sum.ln() as f32
}

/// Logprobs of `token` and the top `k` of `logits`.
pub(super) fn token_logprobs(
    logits: &[f32],
    max: f32,
    token: u32,
    k: usize,
    ws: &mut Workspace,
) -> TokenLogprobs {
    let lse = log_normalizer(logits, max);
    let lp = |l: f32| (l - lse).max(MIN_LOGPROB);
    top_k_into(logits, k, &mut ws.top);
    TokenLogprobs {
        logprob: logits.get(token as usize).map_or(MIN_LOGPROB, |&l| lp(l)),
        top: ws.top.iter().map(|&(id, l)| (id, lp(l))).collect(),
    }
}
