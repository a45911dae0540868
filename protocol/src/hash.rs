//! The block-hash recipe shared by the gateway and the engines (see `docs/block-hash.md`).
//!
//! A sequence of tokens is cut into blocks of `B` tokens; only full blocks are hashed. Each block's
//! key chains over every block before it and over the tenant's cache scope, so two requests share a
//! block exactly when they share the scope and every token up to the end of that block:
//!
//! ```text
//! root  = BLAKE3( f(STR,"kvgate/kv/v1") f(STR,model_id) f(STR,weight_version) f(STR,kv_dtype)
//!                 f(U32,B) f(BYTES,seed) )                                   -- 32 bytes
//! h(0)  = BLAKE3_keyed(root, f(STR,scope)  f(TOKENS,tokens(0)))[..16]
//! h(i)  = BLAKE3_keyed(root, f(HASH,h(i-1)) f(TOKENS,tokens(i)))[..16]
//! f(tag, bytes) = tag:u8 | len(bytes):u64le | bytes;  tokens are u32 little-endian
//! ```
//!
//! Every field is type-tagged and length-prefixed, so no two field sequences encode the same bytes.
//! The root is the BLAKE3 key of every block hash, so it binds every block, not only the first; a
//! new deployment seed (a 32-byte secret) makes every old key unreachable. Keys are the first 16
//! bytes of the output read as a little-endian `u128`.
//!
//! Cost: two BLAKE3 compressions per block of 16 tokens (about 100 input bytes).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// Domain-separation string of version 1 of this recipe.
pub const RECIPE_DOMAIN: &str = "kvgate/kv/v1";

const TAG_STR: u8 = 0x01;
const TAG_U32: u8 = 0x02;
const TAG_BYTES: u8 = 0x03;
const TAG_HASH: u8 = 0x04;
const TAG_TOKENS: u8 = 0x05;

/// A 128-bit block key. Serialized as 32 lowercase hex digits (JSON has no 128-bit integers).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// The key as 16 little-endian bytes, as it is fed to the next block's hash.
    pub fn to_le_bytes(self) -> [u8; 16] {
        self.0.to_le_bytes()
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({self})")
    }
}

/// A block key that is not 32 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid block hash {0:?}: expected 32 hex digits")]
pub struct ParseBlockHashError(String);

impl FromStr for BlockHash {
    type Err = ParseBlockHashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 32 {
            return Err(ParseBlockHashError(s.to_owned()));
        }
        u128::from_str_radix(s, 16)
            .map(BlockHash)
            .map_err(|_| ParseBlockHashError(s.to_owned()))
    }
}

impl Serialize for BlockHash {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for BlockHash {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// What identifies a KV cache's contents: two engines share keys only when all of these match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashParams {
    /// Model id as served, for example `smollm2-135m-instruct`.
    pub model_id: String,
    /// Version of the weights (a checksum or release tag): new weights, new keys.
    pub weight_version: String,
    /// Storage type of the KV cache, for example `f32`, `f16`, `bf16`.
    pub kv_dtype: String,
    /// Tokens per block (`B`).
    pub block_size: u32,
    /// Deployment secret, stable across restarts and replicas. Rotating it clears every cache.
    pub seed: [u8; 32],
}

/// Computes block keys for one deployment (one [`HashParams`]). Cheap to clone.
#[derive(Clone)]
pub struct BlockHasher {
    root: [u8; 32],
    block_size: usize,
}

impl fmt::Debug for BlockHasher {
    // The root is derived from the deployment secret: never print it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockHasher")
            .field("block_size", &self.block_size)
            .finish_non_exhaustive()
    }
}

fn field(hasher: &mut blake3::Hasher, tag: u8, bytes: &[u8]) {
    hasher.update(&[tag]);
    hasher.update(&(bytes.len() as u64).to_le_bytes());
    hasher.update(bytes);
}

impl BlockHasher {
    /// Derives the root from `params`. Panics only if `block_size` is zero or over 4,096, which is
    /// a configuration error the caller validates first.
    pub fn new(params: &HashParams) -> Self {
        assert!(
            (1..=4096).contains(&params.block_size),
            "block size must be in 1..=4096"
        );
        let mut h = blake3::Hasher::new();
        field(&mut h, TAG_STR, RECIPE_DOMAIN.as_bytes());
        field(&mut h, TAG_STR, params.model_id.as_bytes());
        field(&mut h, TAG_STR, params.weight_version.as_bytes());
        field(&mut h, TAG_STR, params.kv_dtype.as_bytes());
        field(&mut h, TAG_U32, &params.block_size.to_le_bytes());
        field(&mut h, TAG_BYTES, &params.seed);
        BlockHasher {
            root: *h.finalize().as_bytes(),
            block_size: params.block_size as usize,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Key of one full block. `parent` is `None` for the first block of a sequence, which is bound
    /// to `scope` instead. `tokens` must hold exactly one block.
    pub fn hash_block(&self, parent: Option<BlockHash>, scope: &str, tokens: &[u32]) -> BlockHash {
        debug_assert_eq!(tokens.len(), self.block_size, "only full blocks are hashed");
        let mut h = blake3::Hasher::new_keyed(&self.root);
        match parent {
            None => field(&mut h, TAG_STR, scope.as_bytes()),
            Some(p) => field(&mut h, TAG_HASH, &p.to_le_bytes()),
        }
        h.update(&[TAG_TOKENS]);
        h.update(&((tokens.len() * 4) as u64).to_le_bytes());
        // Stack buffer: hashing one contiguous slice is faster than one update per token.
        let mut buf = [0u8; 4 * 64];
        for chunk in tokens.chunks(64) {
            for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..chunk.len() * 4]);
        }
        let out = h.finalize();
        let mut key = [0u8; 16];
        key.copy_from_slice(&out.as_bytes()[..16]);
        BlockHash(u128::from_le_bytes(key))
    }

    /// Keys of every full block of `tokens`, in order. A trailing partial block has no key.
    pub fn hash_prefix(&self, scope: &str, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        let mut parent = None;
        for block in tokens.chunks_exact(self.block_size) {
            let h = self.hash_block(parent, scope, block);
            out.push(h);
            parent = Some(h);
        }
        out
    }
}
