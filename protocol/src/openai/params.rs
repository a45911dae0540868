//! Normalized sampling parameters, validated once from either endpoint's request.
//!
//! Both request types carry the same sampling fields in slightly different shapes; each builds a
//! [`RawSampling`] view of them and [`RawSampling::validate`] turns it into a [`SamplingParams`]
//! or the first [`ApiError`] found, naming the field. Ranges follow vLLM, which is more liberal
//! than OpenAI (any finite temperature, for one). Validation is O(number of stop strings and
//! logit biases).

use super::error::ApiError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A temperature below this samples greedily (vLLM's epsilon).
pub const GREEDY_EPSILON: f64 = 1e-5;
/// The most top logprobs a request may ask for per token.
pub const MAX_LOGPROBS: u32 = 20;

/// Server-side limits on what a request may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest `n` (parallel samples per request).
    pub max_n: u32,
    /// Largest `logprobs` / `top_logprobs`.
    pub max_logprobs: u32,
    /// Most stop strings; each is checked on every generated token.
    pub max_stop: usize,
    /// Longest stop string, in bytes.
    pub max_stop_len: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_n: 16,
            max_logprobs: MAX_LOGPROBS,
            max_stop: 16,
            max_stop_len: 256,
        }
    }
}

/// How to pick each token and when to stop: the engine's view of a validated request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 samples greedily (argmax, ties to the lowest token id); otherwise finite and positive.
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1 is off.
    pub top_p: f32,
    /// Keep the `k` most likely tokens; `None` is off (never `Some(0)`).
    pub top_k: Option<u32>,
    /// Drop tokens below `min_p` times the top token's probability; 0 is off.
    pub min_p: f32,
    /// Base seed; `None` draws one from entropy. Sample `i` of `n` uses a seed derived from it.
    pub seed: Option<u64>,
    /// OpenAI presence penalty in [-2, 2], over generated tokens.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty in [-2, 2], over generated tokens.
    pub frequency_penalty: f32,
    /// Hugging Face repetition penalty (> 0, 1 is off), over prompt and generated tokens.
    pub repetition_penalty: f32,
    /// Added to the logit of each token id, sorted by id.
    pub logit_bias: Vec<(u32, f32)>,
    /// Stop strings (non-empty); the text is cut before the first match.
    pub stop: Vec<String>,
    /// Token ids that end generation (in addition to EOS).
    pub stop_token_ids: Vec<u32>,
    /// Most tokens to generate; `None` fills the context (see [`SamplingParams::max_tokens_for`]).
    pub max_tokens: Option<u32>,
    /// EOS and stop tokens are suppressed until this many tokens were generated.
    pub min_tokens: u32,
    /// Parallel samples, at least 1.
    pub n: u32,
    /// Return the chosen token's logprob plus this many top logprobs per token.
    pub logprobs: Option<u32>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    /// OpenAI's defaults: temperature 1, nothing filtered, one sample, no limit but the context.
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            max_tokens: None,
            min_tokens: 0,
            n: 1,
            logprobs: None,
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding with the other defaults.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }
    }

    /// Whether tokens are chosen by argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// The number of tokens to generate for a prompt of `prompt_tokens` in a context of
    /// `context_len`: `max_tokens`, or all the room left when it is `None`. Errors when the
    /// prompt is empty or prompt plus `max_tokens` do not fit.
    pub fn max_tokens_for(
        &self,
        prompt_tokens: usize,
        context_len: usize,
    ) -> Result<u32, ApiError> {
        if prompt_tokens == 0 {
            return Err(ApiError::invalid_value("prompt", "The prompt is empty."));
        }
        let wanted = self.max_tokens.map_or(1, |m| m as usize);
        if prompt_tokens + wanted > context_len {
            return Err(ApiError::context_length_exceeded(
                context_len,
                prompt_tokens,
                wanted,
            ));
        }
        let room = context_len - prompt_tokens;
        Ok(self
            .max_tokens
            .unwrap_or(u32::try_from(room).unwrap_or(u32::MAX)))
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `"usage": null` before it is known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
}

/// The sampling fields of a request as sent, borrowed from either request type.
#[derive(Debug, Default)]
pub(crate) struct RawSampling<'a> {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<&'a serde_json::Number>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<&'a BTreeMap<String, f64>>,
    pub stop: Option<&'a Stop>,
    pub stop_token_ids: Option<&'a [u32]>,
    /// The field name `max_tokens` came from, for errors.
    pub max_tokens_param: &'static str,
    pub max_tokens: Option<i64>,
    pub min_tokens: Option<i64>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub logprobs_param: &'static str,
    pub logprobs: Option<i64>,
    pub ignore_eos: Option<bool>,
}

fn range_f32(
    param: &str,
    v: Option<f64>,
    default: f32,
    ok: bool,
    want: &str,
) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if ok && x.is_finite() => Ok(x as f32),
        Some(x) => Err(ApiError::invalid_value(
            param,
            format!("Invalid '{param}': expected {want}, but got {x}."),
        )),
    }
}

/// An integer field in `lo..=hi`, or `default` when absent.
fn count(param: &str, v: Option<i64>, default: u32, lo: u32, hi: u32) -> Result<u32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x >= i64::from(lo) && x <= i64::from(hi) => Ok(x as u32),
        Some(x) => Err(ApiError::invalid_value(
            param,
            format!("Invalid '{param}': expected an integer in [{lo}, {hi}], but got {x}."),
        )),
    }
}

fn in_range(v: Option<f64>, lo: f64, hi: f64) -> bool {
    v.is_none_or(|x| (lo..=hi).contains(&x))
}

impl RawSampling<'_> {
    /// Checks every field against `limits` and normalizes: a temperature under
    /// [`GREEDY_EPSILON`] becomes greedy (and turns top-k/top-p/min-p off), `top_k` 0 or -1
    /// becomes `None`, empty stop strings are dropped.
    pub fn validate(&self, limits: &Limits) -> Result<SamplingParams, ApiError> {
        let t = self.temperature;
        let temperature = range_f32(
            "temperature",
            t,
            1.0,
            t.is_none_or(|x| x >= 0.0),
            "a finite number >= 0",
        )?;
        let top_p = range_f32(
            "top_p",
            self.top_p,
            1.0,
            self.top_p.is_none_or(|x| x > 0.0 && x <= 1.0),
            "a number in (0, 1]",
        )?;
        let min_p = range_f32(
            "min_p",
            self.min_p,
            0.0,
            in_range(self.min_p, 0.0, 1.0),
            "a number in [0, 1]",
        )?;
        let pp = self.presence_penalty;
        let presence_penalty = range_f32(
            "presence_penalty",
            pp,
            0.0,
            in_range(pp, -2.0, 2.0),
            "a number in [-2, 2]",
        )?;
        let fp = self.frequency_penalty;
        let frequency_penalty = range_f32(
            "frequency_penalty",
            fp,
            0.0,
            in_range(fp, -2.0, 2.0),
            "a number in [-2, 2]",
        )?;
        let rp = self.repetition_penalty;
        let repetition_penalty = range_f32(
            "repetition_penalty",
            rp,
            1.0,
            rp.is_none_or(|x| x > 0.0),
            "a finite number > 0",
        )?;
        let top_k = match self.top_k {
            None | Some(0) | Some(-1) => None,
            Some(k) if k > 0 => Some(u32::try_from(k).unwrap_or(u32::MAX)),
            Some(k) => {
                return Err(ApiError::invalid_value(
                    "top_k",
                    format!("Invalid 'top_k': expected -1 (off), 0 (off) or a positive integer, but got {k}."),
                ))
            }
        };
        let n = count("n", self.n, 1, 1, limits.max_n)?;
        self.check_best_of(n)?;
        let max_tokens = match self.max_tokens {
            None => None,
            m => Some(count(self.max_tokens_param, m, 1, 1, u32::MAX)?),
        };
        let min_tokens = count(
            "min_tokens",
            self.min_tokens,
            0,
            0,
            max_tokens.unwrap_or(u32::MAX),
        )?;
        let logprobs = match self.logprobs {
            None => None,
            k => Some(count(self.logprobs_param, k, 0, 0, limits.max_logprobs)?),
        };
        let mut params = SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            seed: self.seed()?,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            logit_bias: self.logit_bias()?,
            stop: self.stop(limits)?,
            stop_token_ids: self.stop_token_ids.map(<[u32]>::to_vec).unwrap_or_default(),
            max_tokens,
            min_tokens,
            n,
            logprobs,
            ignore_eos: self.ignore_eos.unwrap_or(false),
        };
        if f64::from(temperature) < GREEDY_EPSILON {
            params.temperature = 0.0;
            params.top_p = 1.0;
            params.top_k = None;
            params.min_p = 0.0;
        }
        // A temperature beyond f32 would make 1/T zero; it samples uniformly well before that.
        params.temperature = params.temperature.min(f32::MAX);
        Ok(params)
    }

    fn check_best_of(&self, n: u32) -> Result<(), ApiError> {
        match self.best_of {
            None => Ok(()),
            Some(b) if b == i64::from(n) => Ok(()),
            Some(b) if b < i64::from(n) => Err(ApiError::invalid_value(
                "best_of",
                format!("Invalid 'best_of': it must be at least n ({n}), but got {b}."),
            )),
            Some(_) => Err(ApiError::unsupported(
                "best_of",
                "'best_of' greater than 'n' is not supported.",
            )),
        }
    }

    fn seed(&self) -> Result<Option<u64>, ApiError> {
        let Some(num) = self.seed else {
            return Ok(None);
        };
        if let Some(s) = num.as_u64() {
            return Ok(Some(s));
        }
        // Negative seeds are valid 64-bit integers too; keep their bits.
        match num.as_i64() {
            Some(s) => Ok(Some(s as u64)),
            None => Err(ApiError::invalid_value(
                "seed",
                format!("Invalid 'seed': expected a 64-bit integer, but got {num}."),
            )),
        }
    }

    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = self.logit_bias else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(map.len());
        for (key, &bias) in map {
            let Ok(id) = key.trim().parse::<u32>() else {
                return Err(ApiError::invalid_value(
                    "logit_bias",
                    format!("Invalid 'logit_bias': key {key:?} is not a token id."),
                ));
            };
            if !(-100.0..=100.0).contains(&bias) {
                return Err(ApiError::invalid_value(
                    "logit_bias",
                    format!(
                        "Invalid 'logit_bias': bias {bias} for token {id} is outside [-100, 100]."
                    ),
                ));
            }
            out.push((id, bias as f32));
        }
        out.sort_by_key(|&(id, _)| id);
        out.dedup_by_key(|&mut (id, _)| id);
        Ok(out)
    }

    fn stop(&self, limits: &Limits) -> Result<Vec<String>, ApiError> {
        let list: Vec<String> = match self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        let list: Vec<String> = list.into_iter().filter(|s| !s.is_empty()).collect();
        if list.len() > limits.max_stop {
            return Err(ApiError::invalid_value(
                "stop",
                format!(
                    "Invalid 'stop': at most {} stop strings are allowed, got {}.",
                    limits.max_stop,
                    list.len()
                ),
            ));
        }
        if let Some(long) = list.iter().find(|s| s.len() > limits.max_stop_len) {
            return Err(ApiError::invalid_value(
                "stop",
                format!(
                    "Invalid 'stop': a stop string is {} bytes; the limit is {}.",
                    long.len(),
                    limits.max_stop_len
                ),
            ));
        }
        Ok(list)
    }
}
