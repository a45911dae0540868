//! Workloads for the simulator: request lengths and arrival times, the same for every policy.
//!
//! - `sharegpt`: the ShareGPT file vLLM's serving benchmark uses, with its filter (first human
//!   turn = prompt, first gpt turn = output; drop when either is under 4 tokens, the prompt over
//!   1,024 or the sum over 2,048). The file is truncated mid-record, so it is parsed one
//!   conversation at a time and parsing stops at the first incomplete one.
//! - `alpaca-like`: synthetic short requests, inputs about 19 and outputs about 58 tokens on average
//!   (the PagedAttention paper's Alpaca statistics), geometric-like spread, seeded.
//! - `shared-prefix`: every request starts with one of K tenant system prompts, then a short
//!   question and answer.
//!
//! Arrivals are a seeded Poisson process at `rate` requests per step (the simulator's unit of time
//! is one model iteration).

use super::approx_tokens::approx_token_count;
use super::SimError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use std::path::Path;

/// One simulated request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Step at which it arrives.
    pub arrival: u64,
    pub prompt_len: usize,
    pub output_len: usize,
    /// Shared system prompt (index) and its length in tokens, if the request starts with one.
    pub prefix: Option<(usize, usize)>,
}

/// Counts text length in tokens: the model's tokenizer, or the documented approximation.
pub type TokenCounter<'a> = &'a dyn Fn(&str) -> usize;

/// The token counter used when no tokenizer is given.
pub fn approx_counter() -> impl Fn(&str) -> usize {
    approx_token_count
}

#[derive(Deserialize)]
struct Conversation {
    #[serde(default)]
    conversations: Vec<Turn>,
}

#[derive(Deserialize)]
struct Turn {
    from: String,
    value: String,
}

/// (prompt, output) token lengths of the ShareGPT file at `path`, filtered as vLLM does.
pub fn sharegpt_lengths(
    path: &Path,
    count_tokens: TokenCounter<'_>,
) -> Result<Vec<(usize, usize)>, SimError> {
    let bytes = std::fs::read(path).map_err(|e| SimError::Io(path.display().to_string(), e))?;
    let start = bytes
        .iter()
        .position(|b| *b == b'[')
        .ok_or_else(|| SimError::BadData(format!("{}: not a JSON array", path.display())))?;
    let mut pos = start + 1;
    let mut pairs = Vec::new();
    loop {
        while pos < bytes.len() && (bytes[pos].is_ascii_whitespace() || bytes[pos] == b',') {
            pos += 1;
        }
        if pos >= bytes.len() || bytes[pos] == b']' {
            break;
        }
        let mut stream =
            serde_json::Deserializer::from_slice(&bytes[pos..]).into_iter::<Conversation>();
        let Some(Ok(conv)) = stream.next() else {
            break; // the truncated tail
        };
        pos += stream.byte_offset();
        let [first, second, ..] = conv.conversations.as_slice() else {
            continue;
        };
        if first.from != "human" || second.from != "gpt" {
            continue;
        }
        let (p, o) = (count_tokens(&first.value), count_tokens(&second.value));
        if p < 4 || o < 4 || p > 1024 || p + o > 2048 {
            continue;
        }
        pairs.push((p, o));
    }
    if pairs.is_empty() {
        return Err(SimError::BadData(format!(
            "{}: no usable conversations",
            path.display()
        )));
    }
    Ok(pairs)
}

/// Poisson arrival steps for `n` requests at `rate` per step (`rate` infinite: all at step 0).
pub fn arrivals(n: usize, rate: f64, rng: &mut StdRng) -> Vec<u64> {
    let mut t = 0.0f64;
    (0..n)
        .map(|_| {
            if rate.is_finite() {
                let u: f64 = rng.gen_range(f64::EPSILON..1.0);
                t += -u.ln() / rate;
            }
            t as u64
        })
        .collect()
}

/// Requests from (prompt, output) pairs, with Poisson arrivals.
pub fn from_pairs(pairs: &[(usize, usize)], rate: f64, seed: u64) -> Vec<Request> {
    let mut rng = StdRng::seed_from_u64(seed);
    arrivals(pairs.len(), rate, &mut rng)
        .into_iter()
        .zip(pairs)
        .map(|(arrival, &(prompt_len, output_len))| Request {
            arrival,
            prompt_len,
            output_len,
            prefix: None,
        })
        .collect()
}

/// A length with the given mean, spread like real chat lengths (exponential, at least `min`).
fn spread(rng: &mut StdRng, mean: f64, min: usize, max: usize) -> usize {
    let u: f64 = rng.gen_range(f64::EPSILON..1.0);
    let extra = (mean - min as f64).max(0.0);
    ((min as f64 - u.ln() * extra).round() as usize).clamp(min, max)
}

/// Short instruction-following requests: inputs about 19, outputs about 58 tokens on average.
pub fn alpaca_like(n: usize, rate: f64, seed: u64) -> Vec<Request> {
    let mut rng = StdRng::seed_from_u64(seed);
    let pairs: Vec<_> = (0..n)
        .map(|_| {
            (
                spread(&mut rng, 19.0, 4, 512),
                spread(&mut rng, 58.0, 4, 512),
            )
        })
        .collect();
    from_pairs(&pairs, rate, seed ^ 0x5eed)
}

/// Alpaca-like requests that each start with one of `tenants` system prompts; each tenant's prompt
/// length is drawn once, from 200 to 1,000 tokens, so prompt + output stays within 2,048.
pub fn shared_prefix(n: usize, tenants: usize, rate: f64, seed: u64) -> Vec<Request> {
    let mut rng = StdRng::seed_from_u64(seed);
    let prefix_lens: Vec<usize> = (0..tenants.max(1))
        .map(|_| rng.gen_range(200..=1000))
        .collect();
    let mut reqs = alpaca_like(n, rate, seed);
    for r in &mut reqs {
        let t = rng.gen_range(0..prefix_lens.len());
        r.prefix = Some((t, prefix_lens[t]));
        r.prompt_len += prefix_lens[t];
    }
    reqs
}
