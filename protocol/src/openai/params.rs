//! Normalized sampling parameters: what the engine's sampler needs from a validated request,
//! the server's [`Limits`] on them, and the request-side shapes shared by both endpoints.
//! Validation lives in `validate.rs`.

use super::error::ApiError;
use serde::{Deserialize, Serialize};

/// The most top logprobs a request may ask for per token.
pub const MAX_LOGPROBS: u32 = 20;

/// Server-side limits on what a request may ask for, and the defaults of what it leaves out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Largest `n` (parallel samples per request).
    pub max_n: u32,
    /// Largest `logprobs` / `top_logprobs`.
    pub max_logprobs: u32,
    /// Most stop strings; each is checked on every generated token.
    pub max_stop: usize,
    /// Longest stop string, in bytes.
    pub max_stop_len: usize,
    /// Most `stop_token_ids`. Each is checked on every generated token, and masked until
    /// `min_tokens`: a list as long as the vocabulary would leave nothing to sample.
    pub max_stop_token_ids: usize,
    /// Most `logit_bias` entries (OpenAI's limit); each is applied on every generated token.
    pub max_logit_bias: usize,
    /// The model's sampling defaults, for the fields a request leaves out.
    pub defaults: SamplingDefaults,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_n: 16,
            max_logprobs: MAX_LOGPROBS,
            max_stop: 16,
            max_stop_len: 256,
            max_stop_token_ids: 256,
            max_logit_bias: 300,
            defaults: SamplingDefaults::default(),
        }
    }
}

/// A model's default sampling parameters: what a request that leaves a field out gets, instead
/// of OpenAI's defaults (temperature 1, nothing filtered). They come from the model's
/// `generation_config.json` (the Hugging Face file; vLLM reads it the same way) and the engine's
/// `[sampling]` section, which overrides it field by field. A field set in the request wins.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingDefaults {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f64>,
}

impl SamplingDefaults {
    /// The sampling fields of a Hugging Face `generation_config.json`; the other fields (token
    /// ids, `max_length`, `do_sample`) are not sampling defaults and are ignored, as vLLM does.
    pub fn from_generation_config(json: &serde_json::Value) -> Self {
        let f = |k: &str| json.get(k).and_then(serde_json::Value::as_f64);
        SamplingDefaults {
            temperature: f("temperature"),
            top_p: f("top_p"),
            top_k: json.get("top_k").and_then(serde_json::Value::as_i64),
            min_p: f("min_p"),
            repetition_penalty: f("repetition_penalty"),
        }
    }

    /// `self`, with the fields it leaves unset taken from `fallback`.
    pub fn or(self, fallback: SamplingDefaults) -> Self {
        SamplingDefaults {
            temperature: self.temperature.or(fallback.temperature),
            top_p: self.top_p.or(fallback.top_p),
            top_k: self.top_k.or(fallback.top_k),
            min_p: self.min_p.or(fallback.min_p),
            repetition_penalty: self.repetition_penalty.or(fallback.repetition_penalty),
        }
    }

    /// Checks each default by the rules a request's own field must pass; the error names it.
    pub fn check(&self) -> Result<(), ApiError> {
        super::validate::RawSampling {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            max_tokens_param: "max_tokens",
            logprobs_param: "logprobs",
            ..Default::default()
        }
        .validate(&Limits::default())
        .map(drop)
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
    /// The grammar the whole output must match (structured outputs, required tool calls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grammar: Option<super::structured::Grammar>,
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
            grammar: None,
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
