//! KV events: what an engine tells the gateway about its prefix cache.
//!
//! The engine numbers its events with a sequence number that grows by one per event. A consumer
//! that sees a gap (or reconnects) re-syncs from a snapshot: `AllCleared` followed by
//! `BlockStored` events for every cached block.

use crate::hash::BlockHash;
use serde::{Deserialize, Serialize};

/// One change to an engine's prefix index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum KvEvent {
    /// Consecutive blocks of one sequence became cached. `hashes[0]` follows `parent` (`None` when
    /// it is the first block of the sequence); each later hash follows the one before it.
    BlockStored {
        hashes: Vec<BlockHash>,
        parent: Option<BlockHash>,
        scope: String,
    },
    /// These blocks are no longer cached (evicted or flushed).
    BlockRemoved { hashes: Vec<BlockHash> },
    /// Every cached block is gone.
    AllCleared,
}

/// A [`KvEvent`] with its sequence number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventRecord {
    pub seq: u64,
    #[serde(flatten)]
    pub event: KvEvent,
}
