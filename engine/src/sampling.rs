//! Token sampling for the scheduler: one [`Sampler`] per sequence turns a row of f32 logits into
//! the next token, and one [`StopChecker`] per sequence decides when it ends.
//!
//! A step, in vLLM's order: logit bias, then repetition / frequency / presence penalties
//! ([`penalties`]), EOS and stop tokens suppressed until `min_tokens`; logprobs (when asked) from
//! the log-softmax of those logits ([`logprobs`]); then greedy argmax (temperature 0, ties to the
//! lowest id) or temperature sampling restricted by top-k, top-p and min-p ([`select`]). A step
//! is O(V) passes over the row plus O(seen tokens); no full sort of the vocabulary unless top-p
//! needs most of it, and no allocation once the thread's [`Workspace`] is warm.
//!
//! Randomness: each sequence has its own `StdRng`. With a request seed `s`, sample `i` of `n`
//! uses [`derive_seed`]`(s, i)`, and `derive_seed(s, 0) == s`, so a request with `n = 1` and
//! seed `derive_seed(s, i)` reproduces sample `i` exactly. A non-greedy step draws exactly one
//! number, so the stream depends only on the seed and the sequence's own logits; a sampler kept
//! across preemption continues where it stopped, and the output is the same as without it.

pub mod grammar;
pub mod logprobs;
pub mod penalties;
pub mod select;
pub mod stop;

pub use grammar::{CompileGate, Constraint, GrammarCompiler, GrammarFailed};
pub use logprobs::{TokenLogprobs, MIN_LOGPROB};
pub use penalties::Penalties;
pub use select::Workspace;
pub use stop::{Finish, StopChecker, StopMatch};

use kvgate_protocol::openai::{ApiError, SamplingParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use select::Filter;

/// Why a step could not sample. Whose fault it is decides the response: the request's own
/// parameters are its 400, the engine's failures a 500 (which counts against the engine's health).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SamplingError {
    #[error("the logits row is empty")]
    EmptyLogits,
    /// The model gave no finite logit: an engine fault, whatever the request asked.
    #[error("the model produced no finite logit")]
    NoFiniteLogits,
    /// The request's own masks (EOS and stop tokens under `min_tokens`) and adjustments left
    /// no token to choose.
    #[error("every token is masked by the request's parameters")]
    AllMasked,
}

impl SamplingError {
    /// Stable code for logs and metrics.
    pub fn code(&self) -> &'static str {
        match self {
            SamplingError::EmptyLogits => "empty_logits",
            SamplingError::NoFiniteLogits => "no_finite_logits",
            SamplingError::AllMasked => "all_masked",
        }
    }

    /// Whether the request's parameters, not the engine, made the step fail.
    pub fn is_request_fault(&self) -> bool {
        matches!(self, SamplingError::AllMasked)
    }

    /// The error the request gets: 400 when its parameters are at fault, 500 otherwise.
    pub fn api_error(&self) -> ApiError {
        if self.is_request_fault() {
            ApiError::invalid_value(
                "min_tokens",
                "No token can be sampled: the request's stop_token_ids and EOS, suppressed until \
                 min_tokens, together with its logit_bias and penalties, exclude every token.",
            )
        } else {
            ApiError::internal("The engine could not sample the next token.")
        }
    }
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Present when the request asked for logprobs.
    pub logprobs: Option<TokenLogprobs>,
}

/// The seed of sample `index` of a request seeded with `seed`; `index` 0 keeps `seed`.
pub fn derive_seed(seed: u64, index: u32) -> u64 {
    if index == 0 {
        return seed;
    }
    splitmix64(seed ^ splitmix64(u64::from(index)))
}

/// SplitMix64's finalizer: a bijective mix of 64 bits.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Sampling state of one sequence. Build one per sample with its index rather than cloning:
/// a clone continues the same random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    /// `None`: greedy.
    filter: Option<Filter>,
    logit_bias: Vec<(u32, f32)>,
    penalties: Penalties,
    logprobs: Option<usize>,
    /// EOS and stop token ids, masked while fewer than `min_tokens` were generated.
    suppressed: Vec<u32>,
    min_tokens: u32,
    generated: u32,
    seed: u64,
    rng: StdRng,
}

impl Sampler {
    /// The sampler of sample `sample_index` of a request with `params` and `prompt` (for the
    /// repetition penalty); `eos_token_ids` are suppressed until `min_tokens`. Without a seed in
    /// `params`, a random one is drawn.
    pub fn new(
        params: &SamplingParams,
        prompt: &[u32],
        eos_token_ids: &[u32],
        sample_index: u32,
    ) -> Self {
        let seed = params
            .seed
            .map_or_else(rand::random, |s| derive_seed(s, sample_index));
        let greedy = params.is_greedy() || !params.temperature.is_finite();
        let mut suppressed = params.stop_token_ids.clone();
        if !params.ignore_eos {
            suppressed.extend_from_slice(eos_token_ids);
        }
        Sampler {
            filter: (!greedy).then(|| Filter {
                inv_t: (1.0 / params.temperature).max(f32::MIN_POSITIVE),
                top_k: params.top_k.filter(|&k| k > 0).map(|k| k as usize),
                top_p: params.top_p,
                min_p: params.min_p,
            }),
            logit_bias: params.logit_bias.clone(),
            penalties: Penalties::new(params, prompt),
            logprobs: params.logprobs.map(|k| k as usize),
            suppressed,
            min_tokens: params.min_tokens,
            generated: 0,
            seed,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// The seed this sequence's generator started from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Tokens sampled so far.
    pub fn generated(&self) -> u32 {
        self.generated
    }

    /// Samples the next token from `logits` (one row, modified in place: bias, penalties,
    /// masks) and records it for the penalties.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        ws: &mut Workspace,
    ) -> Result<Sampled, SamplingError> {
        if logits.is_empty() {
            return Err(SamplingError::EmptyLogits);
        }
        // Usually stops at the first logit; it tells a broken model from a request that masks
        // everything, which only the request's own 400 may answer.
        if !logits.iter().any(|&l| l > f32::NEG_INFINITY) {
            return Err(SamplingError::NoFiniteLogits);
        }
        self.adjust(logits);
        // NaN to -inf, +inf to f32::MAX, and the argmax (lowest id on ties), in one pass.
        let (argmax, max) =
            kvgate_kernels::cpu::logits::clean_argmax(logits).ok_or(SamplingError::AllMasked)?;
        let token = match &self.filter {
            None => argmax,
            Some(filter) => {
                let u: f64 = self.rng.gen();
                select::sample(logits, max, filter, u, ws)
            }
        };
        let logprobs = self
            .logprobs
            .map(|k| logprobs::token_logprobs(logits, max, token, k, ws));
        self.penalties.record(token);
        self.generated = self.generated.saturating_add(1);
        Ok(Sampled { token, logprobs })
    }

    /// Logit bias, penalties and the `min_tokens` mask.
    fn adjust(&self, logits: &mut [f32]) {
        for &(id, bias) in &self.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        self.penalties.apply(logits);
        if self.generated < self.min_tokens {
            for &id in &self.suppressed {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
