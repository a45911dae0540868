//! One request through the real engine path: the block manager allocates the prompt's blocks (and
//! reports the cached prefix), the model prefills the rest with paged attention, then decodes one
//! token per step, each new token getting its slot from the block manager. `kvgate generate` and
//! the end-to-end golden tests run this; the scheduler batches the same steps for many requests.

use super::llama::{Batch, Llama};
use super::ModelError;
use crate::kv::{KvCacheManager, ScopeId, SeqId};
use kvgate_kernels::{AttnSeq, Backend};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How to sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    /// 0: greedy.
    pub temperature: f32,
    pub seed: u64,
}

/// What a generation produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    /// Whether it ended on an end-of-sequence token (else on `max_tokens`).
    pub stopped_on_eos: bool,
}

/// A model with its block manager, generating one request at a time.
#[derive(Debug)]
pub struct Generator<B: Backend> {
    pub model: Llama<B>,
    pub kv: KvCacheManager,
    scope: ScopeId,
    next_seq: u64,
}

impl<B: Backend> Generator<B> {
    pub fn new(model: Llama<B>, mut kv: KvCacheManager) -> Self {
        let scope = kv.scope("default");
        Generator {
            model,
            kv,
            scope,
            next_seq: 0,
        }
    }

    /// Generates from `prompt`; `eos` ends generation. Every block is freed at the end, on
    /// success or error.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        eos: &[u32],
        opts: GenerateOptions,
        mut on_token: impl FnMut(u32),
    ) -> Result<Generation, ModelError> {
        let max = self.model.config().max_position_embeddings;
        if prompt.is_empty() || prompt.len() + opts.max_tokens > max {
            return Err(ModelError::PromptTooLong {
                tokens: prompt.len() + opts.max_tokens,
                max,
            });
        }
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        let result = self.run(seq, prompt, eos, opts, &mut on_token);
        let _ = self.kv.free(seq);
        result
    }

    fn run(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        eos: &[u32],
        opts: GenerateOptions,
        on_token: &mut dyn FnMut(u32),
    ) -> Result<Generation, ModelError> {
        let hashed = self.kv.hash_prompt(self.scope, prompt);
        let cached = self.kv.allocate_prompt(seq, &hashed, prompt)?.cached_tokens;
        let mut logits = self.step(seq, &prompt[cached..], cached)?;
        let mut rng = StdRng::seed_from_u64(opts.seed);
        let mut out = Generation {
            tokens: Vec::new(),
            cached_tokens: cached,
            stopped_on_eos: false,
        };
        while out.tokens.len() < opts.max_tokens {
            let token = sample(&logits, opts.temperature, &mut rng);
            if eos.contains(&token) {
                out.stopped_on_eos = true;
                break;
            }
            out.tokens.push(token);
            on_token(token);
            if out.tokens.len() == opts.max_tokens {
                break;
            }
            let pos = prompt.len() + out.tokens.len() - 1;
            let appended = self.kv.append_slots(seq, &[token])?;
            if let Some((src, dst)) = appended.cow {
                self.model.copy_blocks(&[(src.0, dst.0)]);
            }
            logits = self.step(seq, &[token], pos)?;
        }
        Ok(out)
    }

    /// Forward pass over `tokens`, the new tokens of `seq` starting at position `start` (their
    /// slots are already allocated). Returns the logits of the last one.
    fn step(&mut self, seq: SeqId, tokens: &[u32], start: usize) -> Result<Vec<f32>, ModelError> {
        let bs = self.kv.block_size();
        let table = self
            .kv
            .block_table(seq)
            .ok_or(crate::kv::KvError::UnknownSequence(seq))?;
        let positions: Vec<u32> = (start..start + tokens.len()).map(|p| p as u32).collect();
        let slots: Vec<u32> = (start..start + tokens.len())
            .map(|p| table.slot(p, bs) as u32)
            .collect();
        let blocks: Vec<u32> = table.blocks().iter().map(|b| b.0).collect();
        let seqs = [AttnSeq {
            query_start: 0,
            query_len: tokens.len(),
            context_len: start + tokens.len(),
            block_table: &blocks,
        }];
        let last = [tokens.len() as u32 - 1];
        Ok(self.model.forward(&Batch {
            tokens,
            positions: &positions,
            slots: &slots,
            seqs: &seqs,
            logits_rows: &last,
        }))
    }
}

/// Greedy at temperature 0 (lowest id on ties), else softmax sampling at `temperature`.
pub fn sample(logits: &[f32], temperature: f32, rng: &mut StdRng) -> u32 {
    if temperature <= 0.0 {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        return best as u32;
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = logits
        .iter()
        .map(|&x| (((x - max) / temperature) as f64).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut r = rng.gen_range(0.0..total);
    for (i, w) in weights.iter().enumerate() {
        if r < *w {
            return i as u32;
        }
        r -= w;
    }
    (logits.len() - 1) as u32
}
