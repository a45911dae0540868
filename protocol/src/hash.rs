//! The block-hash recipe shared by the gateway and the engines (see `docs/block-hash.md`).
//!
//! A sequence of tokens is cut into blocks of `B` tokens; only full blocks are hashed. Each block's
//! key chains over every block before it and over the tenant's cache scope, so two requests share a
//! block exactly when they share the scope and every token up to the end of that block:
//!
//! ```text
//! root     = BLAKE3( f(STR,"kvgate/kv/v1") f(STR,model_id) f(STR,weight_version) f(STR,kv_dtype)
//!                    f(U32,B) f(BYTES,seed) )                          -- 32 bytes
//! chain(-1)= BLAKE3_keyed(root, f(STR,scope))                          -- 32 bytes
//! chain(i) = BLAKE3_keyed(chain(i-1), tokens(i))                       -- 32 bytes
//! key(i)   = chain(i)[..16] as a little-endian u128
//! f(tag, bytes) = tag:u8 | len(bytes):u64le | bytes;  tokens(i) = B tokens as u32 little-endian
//! ```
//!
//! Variable-length fields are type-tagged and length-prefixed, so no two field sequences encode the
//! same bytes. A block's tokens need neither: they are always exactly `4B` bytes, and `B` is bound
//! in the root. The chaining value is the BLAKE3 key of the next block, so every key depends on the
//! deployment secret, the scope and every earlier token, and a 16-token block (64 bytes) costs a
//! single BLAKE3 compression. Keys are 128 bits; the chain carries the full 256.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// Domain-separation string of version 1 of this recipe.
pub const RECIPE_DOMAIN: &str = "kvgate/kv/v1";

const TAG_STR: u8 = 0x01;
const TAG_U32: u8 = 0x02;
const TAG_BYTES: u8 = 0x03;

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

/// The deployment's hash seed as written in `engine.toml`, `gateway.toml` or
/// `KVGATE_HASH_SEED`: 64 hex digits, read byte by byte (the text may be anything from the
/// environment, non-ASCII included, so it is never sliced as a string). `None` when malformed.
pub fn parse_hash_seed(text: &str) -> Option<[u8; 32]> {
    let digits = text.as_bytes();
    if digits.len() != 64 {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; 32];
    for (b, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *b = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
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

/// The full 256-bit chaining value after a block (or, before the first block, after the scope).
/// The first 16 bytes are that block's key.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Chain([u8; 32]);

impl Chain {
    /// The 128-bit key of the block this chain ends with.
    pub fn key(&self) -> BlockHash {
        let mut key = [0u8; 16];
        key.copy_from_slice(&self.0[..16]);
        BlockHash(u128::from_le_bytes(key))
    }
}

impl fmt::Debug for Chain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Chain({})", self.key())
    }
}

/// Tokens as u32 little-endian bytes: a view of the slice itself on little-endian machines.
#[cfg(target_endian = "little")]
fn token_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    // SAFETY: u8 has no alignment requirement and every byte of a u32 is initialized; on a
    // little-endian target the in-memory bytes are exactly the LE encoding.
    let bytes =
        unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), tokens.len() * 4) };
    std::borrow::Cow::Borrowed(bytes)
}

#[cfg(not(target_endian = "little"))]
fn token_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
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

    /// The chain before the first block of a sequence in `scope`.
    pub fn start(&self, scope: &str) -> Chain {
        let mut h = blake3::Hasher::new_keyed(&self.root);
        field(&mut h, TAG_STR, scope.as_bytes());
        Chain(*h.finalize().as_bytes())
    }

    /// The chain after one more full block. `tokens` must hold exactly one block.
    pub fn next(&self, prev: &Chain, tokens: &[u32]) -> Chain {
        debug_assert_eq!(tokens.len(), self.block_size, "only full blocks are hashed");
        Chain(*blake3::keyed_hash(&prev.0, token_bytes(tokens).as_ref()).as_bytes())
    }

    /// Keys of every full block of `tokens`, in order, and the chain after the last of them (the
    /// start chain when there is no full block). A trailing partial block has no key.
    pub fn hash_prefix(&self, scope: &str, tokens: &[u32]) -> (Vec<BlockHash>, Chain) {
        self.extend(self.start(scope), tokens)
    }

    /// Like [`hash_prefix`](Self::hash_prefix), from a start chain computed once per scope.
    pub fn extend(&self, start: Chain, tokens: &[u32]) -> (Vec<BlockHash>, Chain) {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        let mut chain = start;
        for block in tokens.chunks_exact(self.block_size) {
            chain = self.next(&chain, block);
            out.push(chain.key());
        }
        (out, chain)
    }

    /// A public fingerprint of this deployment's recipe (model, weights, KV type, block size and
    /// seed) for `purpose`: equal for equal recipes, and telling nothing about the seed or the
    /// root. Files that outlive the process (the disk tier) carry it, so blocks of another model
    /// or seed are never read back.
    pub fn fingerprint(&self, purpose: &str) -> [u8; 16] {
        let mut h = blake3::Hasher::new_keyed(&self.root);
        field(&mut h, TAG_STR, b"kvgate/fingerprint");
        field(&mut h, TAG_STR, purpose.as_bytes());
        let mut out = [0u8; 16];
        out.copy_from_slice(&h.finalize().as_bytes()[..16]);
        out
    }

    /// A secret key for `purpose`, derived from the root: as secret as the seed (never log it).
    /// The disk tier authenticates its files with one, so a file that someone else wrote is
    /// never served.
    pub fn secret_key(&self, purpose: &str) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.root);
        field(&mut h, TAG_STR, b"kvgate/secret-key");
        field(&mut h, TAG_STR, purpose.as_bytes());
        *h.finalize().as_bytes()
    }

    /// Keys of every full block of `tokens` (see [`hash_prefix`](Self::hash_prefix)).
    pub fn block_keys(&self, scope: &str, tokens: &[u32]) -> Vec<BlockHash> {
        self.hash_prefix(scope, tokens).0
    }
}

/// Hasher for keys that are already cryptographic hashes (block hashes): folds the input into 64
/// bits instead of running SipHash again. For the engine's and the gateway's block-hash maps.
#[derive(Default, Debug, Clone, Copy)]
pub struct PrehashedHasher(u64);

impl std::hash::Hasher for PrehashedHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 ^= u64::from_le_bytes(b);
        }
    }

    fn write_u128(&mut self, i: u128) {
        self.0 ^= i as u64;
    }
}
