//! Constrained decoding: a request's [`Grammar`] (a JSON schema, a regex or a Lark grammar)
//! compiled by llguidance into a [`Constraint`] per sample, which gives the set of tokens that
//! keep the output inside the grammar (the mask) and follows each token sampled.
//!
//! - [`GrammarCompiler`]: one per engine. It holds the tokenizer's token trie (built once from
//!   `tokenizer.json`) and a bounded cache of compiled grammars, keyed by tenant and grammar, so
//!   that a tenant's repeated schema compiles once: at most [`CACHE_PER_TENANT`] entries each (a
//!   tenant's next evicts its own oldest), [`CACHE_ENTRIES`] in all, least recently used out
//!   first.
//! - Compiling runs on the HTTP side, on a thread with a large stack, behind a [`CompileGate`];
//!   never on the engine thread. A grammar that does not compile, or admits no output at all, is
//!   the request's 400 before it queues.
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

/// Bounds on one grammar's work, below llguidance's defaults where a step pays for them: each
/// mask at most 50,000 lexer steps and 20,000 Earley items (a few milliseconds; a JSON schema's
/// masks take about 0.1 ms), each sample's lexer at most 50,000 states (about 100 MB at worst).
/// A grammar that needs more fails with the request's 400.
fn limits() -> ParserLimits {
    ParserLimits {
        step_lexer_fuel: 50_000,
        step_max_items: 20_000,
        max_lexer_states: 50_000,
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// Grammars compiling at once, in all.
pub const COMPILE_SLOTS: usize = 2;

/// Bounds compiling: at most [`COMPILE_SLOTS`] grammars compile at once, and one per tenant, so
/// a tenant whose every request brings a new schema waits behind its own compiles while others'
/// go on. The permits live as long as the compile, even when its client has left.
#[derive(Debug)]
pub struct CompileGate {
    all: Arc<tokio::sync::Semaphore>,
    tenants: Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
}

/// A place to compile: the tenant's and one of all.
#[derive(Debug)]
pub struct CompilePermit {
    _tenant: tokio::sync::OwnedSemaphorePermit,
    _all: tokio::sync::OwnedSemaphorePermit,
}

impl Default for CompileGate {
    fn default() -> Self {
        CompileGate {
            all: Arc::new(tokio::sync::Semaphore::new(COMPILE_SLOTS)),
            tenants: Mutex::new(HashMap::new()),
        }
    }
}

impl CompileGate {
    /// Waits for a place to compile for `tenant`; `None` only if the gate was closed (it never
    /// is).
    pub async fn enter(&self, tenant: &str) -> Option<CompilePermit> {
        let mine = {
            let mut tenants = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
            // Tenants nobody holds or waits for are dropped: the map stays as small as the
            // compiles in progress.
            tenants.retain(|_, s| Arc::strong_count(s) > 1);
            tenants
                .entry(tenant.to_owned())
                .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(1)))
                .clone()
        };
        let tenant = mine.acquire_owned().await.ok()?;
        let all = self.all.clone().acquire_owned().await.ok()?;
        Some(CompilePermit {
            _tenant: tenant,
            _all: all,
        })
    }
}

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

/// llguidance reports a panic it caught as an error whose text starts so: an engine bug, never
/// the request's fault, and its text (a backtrace) is not the client's to see.
fn is_panic(reason: &str) -> bool {
    reason.starts_with("panic")
}

/// Why a grammar could not be compiled: the request's 400, or a 500 for a compiler panic.
fn compile_error(grammar: &Grammar, reason: impl std::fmt::Display) -> ApiError {
    let reason = reason.to_string();
    if is_panic(&reason) {
        tracing::error!(%reason, "the grammar compiler panicked");
        return ApiError::internal("The grammar compiler failed.");
    }
    ApiError::invalid_value(
        grammar.param(),
        format!(
            "Invalid '{}': the grammar does not compile: {reason}",
            grammar.param()
        ),
    )
}

/// Stack for compiling: llguidance follows a Lark grammar's rule references by recursion, and a
/// 64 KiB grammar can chain thousands of rules.
pub const COMPILE_STACK_BYTES: usize = 256 << 20;

#[derive(Default)]
struct Cache {
    entries: HashMap<(String, String), (Matcher, u64)>,
    clock: u64,
}

impl Cache {
    /// A copy of the cached matcher that shares nothing with it. A plain clone shares the
    /// lexer, whose states grow with the text a request explores: the entry would keep every
    /// request's growth (up to the lexer's state limit) and each later request would start from
    /// it.
    fn get(&mut self, key: &(String, String)) -> Option<Matcher> {
        self.clock += 1;
        let clock = self.clock;
        self.entries.get_mut(key).map(|(m, used)| {
            *used = clock;
            m.deep_clone()
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
    /// The EOS ids: where the grammar may end, any of them may (llguidance allows only one).
    eos: Arc<[u32]>,
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
        *factory.limits_mut() = limits();
        Ok(GrammarCompiler {
            factory,
            cache: Mutex::new(Cache::default()),
            eos: eos.into(),
        })
    }

    /// `grammar` compiled for `tenant`, from the cache when it was compiled before. Errors are
    /// the request's 400: a grammar that does not compile, or that admits no output.
    /// `grammar`, if `tenant` has it compiled already.
    pub fn cached_for(&self, tenant: &str, grammar: &Grammar) -> Option<Constraint> {
        let key = (tenant.to_owned(), grammar.cache_key());
        let matcher = self.lock().get(&key)?;
        Some(self.constraint(matcher, grammar))
    }

    fn constraint(&self, matcher: Matcher, grammar: &Grammar) -> Constraint {
        Constraint {
            matcher,
            mask: None,
            eos: self.eos.clone(),
            param: grammar.param(),
        }
    }

    /// Also returns the seconds compiling took, when it was not cached. Call it on a thread with
    /// [`COMPILE_STACK_BYTES`] of stack.
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
                self.lock().insert(key, m.deep_clone());
                (m, Some(started.elapsed().as_secs_f64()))
            }
        };
        Ok((self.constraint(matcher, grammar), secs))
    }

    /// `grammar` compiled afresh, bypassing the cache (for measuring).
    pub fn compile_uncached(&self, grammar: &Grammar) -> Result<Constraint, ApiError> {
        let matcher = self.compile_new(grammar)?;
        Ok(self.constraint(matcher, grammar))
    }

    fn compile_new(&self, grammar: &Grammar) -> Result<Matcher, ApiError> {
        let top = match grammar {
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(s.clone()),
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
            Grammar::Lark(l) | Grammar::ToolCalls(l) => TopLevelGrammar::from_lark(l.clone()),
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
    eos: Arc<[u32]>,
    /// The request field the grammar came from, for errors.
    param: &'static str,
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
            eos: self.eos.clone(),
            param: self.param,
        }
    }
}

/// A grammar that could not be followed: its limits were exceeded (the request's 400), or its
/// parser failed on a token its own mask allowed, or panicked (an engine bug: a 500).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the output's grammar failed: {reason}")]
pub struct GrammarFailed {
    pub reason: String,
    pub param: &'static str,
    pub engine_fault: bool,
}

impl GrammarFailed {
    pub fn api_error(&self) -> ApiError {
        if self.engine_fault {
            tracing::error!(reason = %self.reason, "constrained decoding failed");
            return ApiError::internal("Constrained decoding failed in the engine.");
        }
        ApiError::invalid_value(
            self.param,
            format!(
                "The output's grammar could not be followed: {}",
                self.reason
            ),
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
            Some(Err(e)) => return Err(self.failed(e.clone(), false)),
            None => return Err(self.failed("no mask".into(), true)),
        };
        // Where the grammar may end, every EOS id may end it (the end of turn among them).
        let ends = self.eos.iter().any(|&t| mask.is_allowed(t));
        let eos_logits: Vec<(usize, f32)> = self
            .eos
            .iter()
            .filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l)))
            .collect();
        apply_mask(mask, logits);
        if ends {
            for (t, l) in eos_logits {
                logits[t] = l;
            }
        }
        Ok(())
    }

    /// Advances the grammar past the token sampled (which the mask allowed: a failure here is
    /// the engine's).
    pub fn commit(&mut self, token: u32) -> Result<(), GrammarFailed> {
        self.mask = None;
        match self.matcher.consume_token(token) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.failed(e.to_string(), true)),
        }
    }

    /// A failure of this grammar; llguidance's limits are the request's, its panics the engine's.
    pub fn failed(&self, reason: String, engine_fault: bool) -> GrammarFailed {
        GrammarFailed {
            engine_fault: engine_fault || is_panic(&reason),
            reason,
            param: self.param,
        }
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
