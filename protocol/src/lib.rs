//! Wire types shared by the kvgate gateway and engine.
//!
//! - [`hash`]: the block-hash recipe. The gateway and every engine must turn the same tokens into
//!   the same 128-bit keys, so the recipe lives here and nowhere else.
//! - [`prompt`]: tokenizer and chat template, so gateway and engine tokenize alike.
//! - [`bpe`]: a fast byte-level BPE encoder giving the same ids as `tokenizers`, for the
//!   tokenizers it reproduces exactly; [`prompt`] uses it when it can.
//! - [`events`]: the KV events an engine publishes (`/kv/events`) so the gateway's prefix index
//!   mirrors the engine's cache.
//! - [`load`]: what an engine reports of its queue and speed, and the wait it implies, for the
//!   gateway's routing score.
//!
//! No network and no async.

pub mod bpe;
pub mod events;
pub mod hash;
pub mod load;
pub mod openai;
pub mod prompt;

pub use events::{KvEvent, KvEventRecord, Tier};
pub use hash::{parse_hash_seed, BlockHash, BlockHasher, Chain, HashParams};
pub use load::{Ask, LoadReport, StepCost};
