//! KV events: what an engine tells the gateway about its prefix cache.
//!
//! The engine numbers its events with a sequence number that grows by one per event. A consumer
//! that sees a gap (or reconnects) re-syncs from a snapshot: `AllCleared` followed by
//! `BlockStored` events for every cached block.

use crate::hash::BlockHash;
use serde::{Deserialize, Serialize};

/// Where an engine holds a cached block, fastest first: its device pool, its host-memory tier, or
/// its disk tier. A block is reported at the fastest tier that holds it.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    #[default]
    Device,
    Host,
    Disk,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

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
    /// These cached blocks are now held at best in `tier` (evicted from a faster tier into a
    /// slower one, or loaded from disk into host memory).
    BlockTier { hashes: Vec<BlockHash>, tier: Tier },
    /// These blocks are no longer cached in any tier (evicted or flushed).
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
