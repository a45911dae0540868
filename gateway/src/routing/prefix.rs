//! A request's block hashes, exactly as the engine will compute them: the same tokenizer and
//! chat template ([`PromptRenderer`]), the same hash recipe ([`BlockHasher`]) and the tenant's
//! scope.
//!
//! Most requests of a tenant start with the same system prompt, so the tokens and hashes of each
//! system-prompt turn are cached, keyed by a hash of its rendered text and the scope. A chat
//! template ends each turn right before the next turn's special start token, and tokenizers split
//! on special tokens first, so encoding the prefix turn and the rest separately gives the same
//! ids as encoding the whole prompt; only the rest is tokenized per request.

use kvgate_protocol::prompt::{ChatMessage, PromptError, PromptRenderer};
use kvgate_protocol::{BlockHash, BlockHasher};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Most cached system prompts; past it the cache starts over.
const MAX_CACHED: usize = 4096;

/// What routing needs to know about a request's prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptHashes {
    /// Hashes of the prompt's full blocks, in order.
    pub hashes: Vec<BlockHash>,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Identifies the shared part of the prompt (scope + system prompt): the tenant's home key.
    pub affinity: u128,
}

#[derive(Debug)]
struct CachedPrefix {
    hashes: Vec<BlockHash>,
    /// Tokens after the last full block.
    tail: Vec<u32>,
    chain: kvgate_protocol::hash::Chain,
    tokens: usize,
}

/// Turns requests into block hashes, with the system-prompt cache.
#[derive(Debug)]
pub struct PromptHasher {
    renderer: Arc<PromptRenderer>,
    hasher: BlockHasher,
    cache: Mutex<HashMap<[u8; 32], Arc<CachedPrefix>>>,
}

impl PromptHasher {
    pub fn new(renderer: Arc<PromptRenderer>, hasher: BlockHasher) -> Self {
        PromptHasher {
            renderer,
            hasher,
            cache: Mutex::new(HashMap::new()),
        }
    }

    pub fn renderer(&self) -> &PromptRenderer {
        &self.renderer
    }

    pub fn block_size(&self) -> usize {
        self.hasher.block_size()
    }

    /// A chat request's hashes.
    pub fn chat(&self, scope: &str, messages: &[ChatMessage]) -> Result<PromptHashes, PromptError> {
        let full = self.renderer.render_chat(messages, true)?;
        let lead = messages
            .iter()
            .take_while(|m| m.role == "system" || m.role == "developer")
            .count();
        if lead > 0 {
            let prefix_text = self.renderer.render_chat(&messages[..lead], false)?;
            if !prefix_text.is_empty() && full.starts_with(&prefix_text) {
                let key = text_key(scope, &prefix_text);
                let prefix = self.cached_prefix(scope, &key, &prefix_text)?;
                let rest = self
                    .renderer
                    .encode_continuation(&full[prefix_text.len()..])?;
                return Ok(self.continue_prefix(&prefix, &rest, affinity(&key)));
            }
        }
        let tokens = self.renderer.encode(&full)?;
        Ok(self.tokens(scope, &tokens))
    }

    /// A completion request's hashes (text prompt).
    pub fn text(&self, scope: &str, text: &str) -> Result<PromptHashes, PromptError> {
        let tokens = self.renderer.encode(text)?;
        Ok(self.tokens(scope, &tokens))
    }

    /// Hashes of a prompt given as token ids. The affinity key is the first block's hash (or the
    /// scope's, for prompts shorter than a block).
    pub fn tokens(&self, scope: &str, tokens: &[u32]) -> PromptHashes {
        let (hashes, _) = self.hasher.hash_prefix(scope, tokens);
        let affinity = match hashes.first() {
            Some(h) => h.0,
            None => affinity(&text_key(scope, "")),
        };
        PromptHashes {
            hashes,
            prompt_tokens: tokens.len(),
            affinity,
        }
    }

    fn cached_prefix(
        &self,
        scope: &str,
        key: &[u8; 32],
        text: &str,
    ) -> Result<Arc<CachedPrefix>, PromptError> {
        if let Some(p) = self.lock().get(key) {
            return Ok(p.clone());
        }
        let tokens = self.renderer.encode(text)?;
        let full = tokens.len() / self.block_size() * self.block_size();
        let (hashes, chain) = self.hasher.hash_prefix(scope, &tokens[..full]);
        let prefix = Arc::new(CachedPrefix {
            hashes,
            tail: tokens[full..].to_vec(),
            chain,
            tokens: tokens.len(),
        });
        let mut cache = self.lock();
        if cache.len() >= MAX_CACHED {
            cache.clear();
        }
        cache.insert(*key, prefix.clone());
        Ok(prefix)
    }

    fn continue_prefix(&self, prefix: &CachedPrefix, rest: &[u32], affinity: u128) -> PromptHashes {
        let mut hashes = Vec::with_capacity(prefix.hashes.len() + rest.len() / self.block_size());
        hashes.extend_from_slice(&prefix.hashes);
        let mut after = Vec::with_capacity(prefix.tail.len() + rest.len());
        after.extend_from_slice(&prefix.tail);
        after.extend_from_slice(rest);
        let full = after.len() / self.block_size() * self.block_size();
        let (more, _) = self.hasher.extend(prefix.chain, &after[..full]);
        hashes.extend(more);
        PromptHashes {
            hashes,
            prompt_tokens: prefix.tokens + rest.len(),
            affinity,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Arc<CachedPrefix>>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets the cached system prompts.
    pub fn clear(&self) {
        self.lock().clear();
    }
}

fn text_key(scope: &str, text: &str) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&(scope.len() as u64).to_le_bytes());
    h.update(scope.as_bytes());
    h.update(text.as_bytes());
    *h.finalize().as_bytes()
}

fn affinity(key: &[u8; 32]) -> u128 {
    u128::from_le_bytes(key[..16].try_into().unwrap_or([0; 16]))
}
