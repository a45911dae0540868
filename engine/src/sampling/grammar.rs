//! Constrained decoding: a request's [`Grammar`] (a JSON schema, a regex or a Lark grammar)
//! compiled by llguidance into a [`Constraint`] per sample, which gives the set of tokens that
//! keep the output inside the grammar (the mask) and follows each token sampled.
//!
//! - [`GrammarCompiler`]: one per engine. It holds the tokenizer's token trie (built once from
//!   `tokenizer.json`) and a bounded cache of compiled grammars, keyed by tenant and grammar, so
//!   that a tenant's repeated schema compiles once and a tenant cannot evict another's: at most
//!   [`CACHE_PER_TENANT`] entries each, [`CACHE_ENTRIES`] in all, least recently used out first.
//! - Compiling runs on the HTTP side (the blocking pool), never on the engine thread; a grammar
//!   that does not compile, or admits no output at all, is the request's 400 before it queues.
//! - The engine thread computes the masks of a step's constrained samples on a second thread
//!   while the model runs the step's forward pass ([`crate::worker`]), so a mask costs the step
//!   nothing unless it takes longer than the forward pass.
//!
//! llguidance's parser state is per sample and advanced by one token per step; it is kept
//! through preemption (the tokens it followed stay in the sequence), so recompute and swap need
//! nothing rebuilt. Its errors never carry the prompt or output (`verbose_errors` is off).

use kvgate_protocol::openai::{ApiError, Grammar};
use kvgate_protocol::prompt::PromptRenderer;
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Compiled grammars kept per tenant.
pub const CACHE_PER_TENANT: usize = 32;
/// Compiled grammars kept in all.
pub const CACHE_ENTRIES: usize = 1024;

/// The tokenizer as llguidance sees it: each token's bytes, and kvgate's own encoder for text.
struct Vocabulary {
    trie: TokTrie,
    renderer: Arc<PromptRenderer>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Text, never control tokens: a grammar's literal that spells `<|im_end|>` is text.
        let text = String::from_utf8_lossy(s);
        self.renderer
            .encode_continuation(&self.renderer.quote(&text))
            .unwrap_or_else(|_| self.trie.greedy_tokenize(s))
    }
}

/// Why a grammar could not be compiled.
fn compile_error(grammar: &Grammar, reason: impl std::fmt::Display) -> ApiError {
    ApiError::invalid_value(
        grammar.param(),
        format!(
            "Invalid '{}': the grammar does not compile: {reason}",
            grammar.param()
        ),
    )
}

#[derive(Default)]
struct Cache {
    entries: HashMap<(String, String), (Matcher, u64)>,
    clock: u64,
}

impl Cache {
    fn get(&mut self, key: &(String, String)) -> Option<Matcher> {
        self.clock += 1;
        let clock = self.clock;
        self.entries.get_mut(key).map(|(m, used)| {
            *used = clock;
            m.clone()
        })
    }

    fn insert(&mut self, key: (String, String), m: Matcher) {
        self.clock += 1;
        let tenant_entries = self.entries.keys().filter(|k| k.0 == key.0).count();
        if tenant_entries >= CACHE_PER_TENANT {
            self.evict(|k| k.0 == key.0);
        }
        if self.entries.len() >= CACHE_ENTRIES {
            self.evict(|_| true);
        }
        self.entries.insert(key, (m, self.clock));
    }

    /// Drops the least recently used entry among those `pick` selects.
    fn evict(&mut self, pick: impl Fn(&(String, String)) -> bool) {
        let oldest = self
            .entries
            .iter()
            .filter(|(k, _)| pick(k))
            .min_by_key(|(_, (_, used))| *used)
            .map(|(k, _)| k.clone());
        if let Some(k) = oldest {
            self.entries.remove(&k);
        }
    }
}

/// Compiles grammars for one model's tokenizer, with a per-tenant cache.
pub struct GrammarCompiler {
    factory: ParserFactory,
    cache: Mutex<Cache>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// The compiler for the tokenizer in `dir/tokenizer.json`, whose logits rows have
    /// `vocab_size` entries; `eos` ends a finished grammar.
    pub fn from_dir(
        dir: &Path,
        renderer: Arc<PromptRenderer>,
        vocab_size: usize,
        eos: &[u32],
    ) -> Result<Self, String> {
        let path = dir.join("tokenizer.json");
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        // Rows past the tokenizer's ids (padding in the embedding) are never allowed.
        words.resize(vocab_size.max(words.len()), Vec::new());
        words.truncate(vocab_size);
        let first_eos = *eos.first().ok_or("the model has no EOS token")?;
        let info = TokRxInfo::new(vocab_size as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(Vocabulary { trie, renderer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(GrammarCompiler {
            factory,
            cache: Mutex::new(Cache::default()),
        })
    }

    /// `grammar` compiled for `tenant`, from the cache when it was compiled before. Errors are
    /// the request's 400: a grammar that does not compile, or that admits no output.
    /// Also returns the seconds compiling took, when it was not cached.
    pub fn compile(
        &self,
        tenant: &str,
        grammar: &Grammar,
    ) -> Result<(Constraint, Option<f64>), ApiError> {
        let key = (tenant.to_owned(), grammar.cache_key());
        let cached = self.lock().get(&key);
        let (matcher, secs) = match cached {
            Some(m) => (m, None),
            None => {
                let started = Instant::now();
                let m = self.compile_new(grammar)?;
                self.lock().insert(key, m.clone());
                (m, Some(started.elapsed().as_secs_f64()))
            }
        };
        Ok((
            Constraint {
                matcher,
                mask: None,
            },
            secs,
        ))
    }

    /// `grammar` compiled afresh, bypassing the cache (for measuring).
    pub fn compile_uncached(&self, grammar: &Grammar) -> Result<Constraint, ApiError> {
        Ok(Constraint {
            matcher: self.compile_new(grammar)?,
            mask: None,
        })
    }

    fn compile_new(&self, grammar: &Grammar) -> Result<Matcher, ApiError> {
        let top = match grammar {
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(s.clone()),
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
            Grammar::Lark(l) => TopLevelGrammar::from_lark(l.clone()),
        };
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| compile_error(grammar, e))?;
        let mut matcher = Matcher::new(Ok(parser));
        // The first mask: a grammar that allows no token and is not finished admits nothing.
        let mask = matcher
            .compute_mask()
            .map_err(|e| compile_error(grammar, e))?;
        let done = matcher.is_accepting().unwrap_or(false);
        if mask.is_zero() && !done {
            return Err(ApiError::invalid_value(
                grammar.param(),
                format!(
                    "Invalid '{}': the grammar admits no output.",
                    grammar.param()
                ),
            ));
        }
        Ok(matcher)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Compiled grammars in the cache.
    pub fn cached(&self) -> usize {
        self.lock().entries.len()
    }
}

/// One sample's grammar state.
pub struct Constraint {
    matcher: Matcher,
    /// The mask for the next token, once computed.
    mask: Option<Result<SimpleVob, String>>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("has_mask", &self.mask.is_some())
            .finish_non_exhaustive()
    }
}

impl Clone for Constraint {
    /// An independent copy of the state (for the samples of an `n > 1` request).
    fn clone(&self) -> Self {
        Constraint {
            matcher: self.matcher.deep_clone(),
            mask: None,
        }
    }
}

/// A grammar that could not be followed (its parser failed): the request's 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the output's grammar failed: {0}")]
pub struct GrammarFailed(pub String);

impl GrammarFailed {
    pub fn api_error(&self) -> ApiError {
        ApiError::invalid_value(
            "response_format",
            format!("The output's grammar could not be followed: {}", self.0),
        )
    }
}

impl Constraint {
    /// Computes the mask for the next token (the costly part; the engine runs it beside the
    /// forward pass). Returns the time it took.
    pub fn prepare(&mut self) -> f64 {
        let started = Instant::now();
        self.mask = Some(
            self.matcher
                .compute_mask_or_eos()
                .map_err(|e| e.to_string()),
        );
        started.elapsed().as_secs_f64()
    }

    /// Sets every logit outside the grammar to -inf (computing the mask first if
    /// [`Constraint::prepare`] was not called).
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), GrammarFailed> {
        if self.mask.is_none() {
            self.prepare();
        }
        let mask = match self.mask.as_ref() {
            Some(Ok(m)) => m,
            Some(Err(e)) => return Err(GrammarFailed(e.clone())),
            None => return Err(GrammarFailed("no mask".into())),
        };
        apply_mask(mask, logits);
        Ok(())
    }

    /// Advances the grammar past the token sampled (which the mask allowed).
    pub fn commit(&mut self, token: u32) -> Result<(), GrammarFailed> {
        self.mask = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarFailed(e.to_string()))
    }

    /// Whether the grammar is complete: nothing may follow but EOS.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// `logits[i] = -inf` wherever `mask` does not allow `i` (and past the mask's end), 32 tokens
/// per mask word.
pub fn apply_mask(mask: &SimpleVob, logits: &mut [f32]) {
    let words = mask.as_slice();
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if bits & (1 << b) == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}
