//! Validation of the sampling fields both endpoints share.
//!
//! Each request type builds a [`RawSampling`] view of its fields (they differ in shape: chat has
//! `max_completion_tokens` and boolean `logprobs`), and [`RawSampling::validate`] turns it into
//! a [`SamplingParams`] or the first [`ApiError`] found, naming the field. Ranges follow vLLM,
//! which is more liberal than OpenAI (any finite temperature, for one). O(stop strings + logit
//! biases).

use super::error::ApiError;
use super::params::{Limits, SamplingParams, Stop};
use std::collections::BTreeMap;

/// A temperature below this samples greedily (vLLM's epsilon).
pub const GREEDY_EPSILON: f64 = 1e-5;

/// The sampling fields of a request as sent, borrowed from either request type.
#[derive(Debug, Default, Clone, Copy)]
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

/// `x` as the nearest f32 that keeps its meaning: beyond f32's range it saturates (not infinity),
/// and a nonzero value too small for an f32 stays nonzero (not 0.0, which would turn a "> 0"
/// parameter off).
fn to_f32(x: f64) -> f32 {
    let y = (x as f32).clamp(-f32::MAX, f32::MAX);
    if y == 0.0 && x != 0.0 {
        f32::MIN_POSITIVE.copysign(x as f32)
    } else {
        y
    }
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
        Some(x) if ok && x.is_finite() => Ok(to_f32(x)),
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
    /// A field the request leaves out takes the model's default ([`Limits::defaults`]) first.
    pub fn validate(&self, limits: &Limits) -> Result<SamplingParams, ApiError> {
        let d = &limits.defaults;
        let raw = RawSampling {
            temperature: self.temperature.or(d.temperature),
            top_p: self.top_p.or(d.top_p),
            top_k: self.top_k.or(d.top_k),
            min_p: self.min_p.or(d.min_p),
            repetition_penalty: self.repetition_penalty.or(d.repetition_penalty),
            ..*self
        };
        raw.validate_fields(limits)
    }

    fn validate_fields(&self, limits: &Limits) -> Result<SamplingParams, ApiError> {
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
            logit_bias: self.logit_bias(limits)?,
            stop: self.stop(limits)?,
            stop_token_ids: self.stop_token_ids(limits)?,
            max_tokens,
            min_tokens,
            n,
            logprobs,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            grammar: None,
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

    fn logit_bias(&self, limits: &Limits) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = self.logit_bias else {
            return Ok(Vec::new());
        };
        if map.len() > limits.max_logit_bias {
            return Err(ApiError::invalid_value(
                "logit_bias",
                format!(
                    "Invalid 'logit_bias': at most {} tokens may be biased, got {}.",
                    limits.max_logit_bias,
                    map.len()
                ),
            ));
        }
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

    /// Distinct, sorted stop token ids, at most [`Limits::max_stop_token_ids`] of them (counted
    /// as sent, so the check costs nothing before it fails).
    fn stop_token_ids(&self, limits: &Limits) -> Result<Vec<u32>, ApiError> {
        let ids = self.stop_token_ids.unwrap_or_default();
        if ids.len() > limits.max_stop_token_ids {
            return Err(ApiError::invalid_value(
                "stop_token_ids",
                format!(
                    "Invalid 'stop_token_ids': at most {} token ids are allowed, got {}.",
                    limits.max_stop_token_ids,
                    ids.len()
                ),
            ));
        }
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::ErrorCode;

    #[test]
    fn stop_token_ids_and_logit_bias_are_bounded() {
        let limits = Limits::default();
        // A list covering the vocabulary, with min_tokens, would leave the sampler nothing.
        let all: Vec<u32> = (0..49_152).collect();
        let raw = RawSampling {
            min_tokens: Some(2),
            stop_token_ids: Some(&all),
            ..RawSampling::default()
        };
        let e = raw.validate(&limits).unwrap_err();
        assert_eq!(
            (e.status, e.code, e.param.as_deref()),
            (400, ErrorCode::InvalidValue, Some("stop_token_ids"))
        );
        let few = [7, 3, 7];
        let raw = RawSampling {
            stop_token_ids: Some(&few),
            ..RawSampling::default()
        };
        assert_eq!(raw.validate(&limits).unwrap().stop_token_ids, [3, 7]);
        let bias: BTreeMap<String, f64> = (0..=limits.max_logit_bias)
            .map(|i| (i.to_string(), -1.0))
            .collect();
        let raw = RawSampling {
            logit_bias: Some(&bias),
            ..RawSampling::default()
        };
        let e = raw.validate(&limits).unwrap_err();
        assert_eq!((e.status, e.param.as_deref()), (400, Some("logit_bias")));
    }
}
