//! Logit adjustments for what a sequence has already seen: the Hugging Face repetition penalty
//! over prompt and output tokens, and OpenAI's frequency and presence penalties over output
//! tokens.
//!
//! For each token seen: repetition divides a positive logit by `r` and multiplies a negative one
//! by `r`; then `logit -= frequency * count + presence * (count > 0)` (vLLM's order). The state is
//! the sorted distinct prompt tokens and a count per distinct output token, so one step costs
//! O(distinct prompt tokens + distinct output tokens), independent of the vocabulary. Nothing is
//! kept when every penalty is off.

use kvgate_protocol::openai::SamplingParams;
use std::collections::HashMap;

/// Penalty state of one sequence.
#[derive(Debug, Clone, Default)]
pub struct Penalties {
    repetition: f32,
    frequency: f32,
    presence: f32,
    /// Distinct prompt tokens, sorted; empty unless the repetition penalty is on.
    prompt: Vec<u32>,
    /// Count of each generated token; empty when every penalty is off.
    output: HashMap<u32, u32>,
}

impl Penalties {
    /// The penalties of `params` for a sequence with `prompt`.
    pub fn new(params: &SamplingParams, prompt: &[u32]) -> Self {
        let mut p = Penalties {
            repetition: params.repetition_penalty,
            frequency: params.frequency_penalty,
            presence: params.presence_penalty,
            prompt: Vec::new(),
            output: HashMap::new(),
        };
        if p.repetition_on() {
            p.prompt = prompt.to_vec();
            p.prompt.sort_unstable();
            p.prompt.dedup();
        }
        p
    }

    fn repetition_on(&self) -> bool {
        self.repetition != 1.0 && self.repetition > 0.0 && self.repetition.is_finite()
    }

    /// Whether any penalty changes logits.
    pub fn is_active(&self) -> bool {
        self.repetition_on() || self.frequency != 0.0 || self.presence != 0.0
    }

    /// Counts a generated token.
    pub fn record(&mut self, token: u32) {
        if self.is_active() {
            *self.output.entry(token).or_insert(0) += 1;
        }
    }

    /// Count of `token` among generated tokens (0 when penalties are off).
    pub fn count(&self, token: u32) -> u32 {
        self.output.get(&token).copied().unwrap_or(0)
    }

    /// Applies the penalties to one row of logits. Ids outside the row are skipped.
    pub fn apply(&self, logits: &mut [f32]) {
        if self.repetition_on() {
            let r = self.repetition;
            let seen_in_prompt = |t: &u32| self.prompt.binary_search(t).is_ok();
            let output_only = self.output.keys().filter(|t| !seen_in_prompt(t));
            for &t in self.prompt.iter().chain(output_only) {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        if self.frequency != 0.0 || self.presence != 0.0 {
            for (&t, &count) in &self.output {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= self.frequency * count as f32 + self.presence;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(repetition: f32, frequency: f32, presence: f32) -> SamplingParams {
        SamplingParams {
            repetition_penalty: repetition,
            frequency_penalty: frequency,
            presence_penalty: presence,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn hand_computed() {
        // Prompt [0, 1, 1], output [2, 2, 3]; repetition 2, frequency 0.5, presence 0.25.
        let mut p = Penalties::new(&params(2.0, 0.5, 0.25), &[0, 1, 1, 99]);
        for t in [2, 2, 3] {
            p.record(t);
        }
        let mut logits = [2.0, -1.0, 0.5, 1.0, 3.0];
        p.apply(&mut logits);
        // 0: 2/2; 1: -1*2; 2: 0.5/2 - 2*0.5 - 0.25; 3: 1/2 - 0.5 - 0.25; 4: unseen.
        assert_eq!(logits, [1.0, -2.0, -1.0, -0.25, 3.0]);
        assert_eq!((p.count(2), p.count(3), p.count(0)), (2, 1, 0));
    }

    #[test]
    fn output_token_also_in_prompt_is_penalized_once() {
        let mut p = Penalties::new(&params(4.0, 0.0, 0.0), &[1]);
        p.record(1);
        p.record(1);
        let mut logits = [1.0, 8.0];
        p.apply(&mut logits);
        assert_eq!(logits, [1.0, 2.0]);
    }

    #[test]
    fn off_keeps_nothing_and_changes_nothing() {
        let mut p = Penalties::new(&SamplingParams::default(), &[0, 1, 2]);
        p.record(1);
        assert!(!p.is_active());
        assert!(p.prompt.is_empty() && p.output.is_empty());
        let mut logits = [0.5, -0.5, 1.5];
        p.apply(&mut logits);
        assert_eq!(logits, [0.5, -0.5, 1.5]);
    }

    #[test]
    fn negative_penalties_encourage() {
        let mut p = Penalties::new(&params(1.0, -1.0, -0.5), &[]);
        p.record(0);
        let mut logits = [0.0, 0.0];
        p.apply(&mut logits);
        assert_eq!(logits, [1.5, 0.0]);
    }
}
