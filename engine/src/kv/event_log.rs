//! The buffer of KV events a manager produces.
//!
//! Changes are recorded flat (one fixed-size entry per block, no allocation once the buffer has
//! grown) and turned into numbered [`KvEventRecord`]s when drained, with consecutive blocks of one
//! chain, and consecutive removals, coalesced into one event each. Numbers are assigned at drain
//! time, so they have no gaps.

use super::ScopeId;
use kvgate_protocol::{BlockHash, KvEvent, KvEventRecord, Tier};

#[derive(Debug, Clone, Copy)]
enum Raw {
    Stored {
        hash: BlockHash,
        parent: Option<BlockHash>,
        scope: ScopeId,
    },
    Removed(BlockHash),
    Tier(BlockHash, Tier),
    Cleared,
}

/// KV changes waiting to be published.
#[derive(Debug, Clone, Default)]
pub struct EventLog {
    raw: Vec<Raw>,
    /// Sequence number of the last event drained (0: none yet).
    last_seq: u64,
}

impl EventLog {
    /// Sequence number of the newest drained event (0 before the first).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// Whether changes are waiting to be drained.
    pub fn has_pending(&self) -> bool {
        !self.raw.is_empty()
    }

    /// Takes every pending change as numbered events, oldest first. `scopes` names scope ids.
    pub fn drain(&mut self, scopes: &[String]) -> Vec<KvEventRecord> {
        let mut out: Vec<KvEventRecord> = Vec::new();
        let mut i = 0;
        while i < self.raw.len() {
            let start = i;
            let event = match self.raw[i] {
                Raw::Stored { parent, scope, .. } => {
                    i += 1;
                    while let (
                        Raw::Stored { hash: prev, .. },
                        Some(Raw::Stored {
                            parent: p,
                            scope: s,
                            ..
                        }),
                    ) = (self.raw[i - 1], self.raw.get(i))
                    {
                        if *s != scope || *p != Some(prev) {
                            break;
                        }
                        i += 1;
                    }
                    let mut hashes = Vec::with_capacity(i - start);
                    hashes.extend(self.raw[start..i].iter().filter_map(|r| match r {
                        Raw::Stored { hash, .. } => Some(*hash),
                        _ => None,
                    }));
                    KvEvent::BlockStored {
                        hashes,
                        parent,
                        scope: scopes[scope.0 as usize].clone(),
                    }
                }
                Raw::Removed(_) => {
                    while matches!(self.raw.get(i), Some(Raw::Removed(_))) {
                        i += 1;
                    }
                    let mut hashes = Vec::with_capacity(i - start);
                    hashes.extend(self.raw[start..i].iter().filter_map(|r| match r {
                        Raw::Removed(h) => Some(*h),
                        _ => None,
                    }));
                    KvEvent::BlockRemoved { hashes }
                }
                Raw::Tier(_, tier) => {
                    while matches!(self.raw.get(i), Some(Raw::Tier(_, t)) if *t == tier) {
                        i += 1;
                    }
                    let mut hashes = Vec::with_capacity(i - start);
                    hashes.extend(self.raw[start..i].iter().filter_map(|r| match r {
                        Raw::Tier(h, _) => Some(*h),
                        _ => None,
                    }));
                    KvEvent::BlockTier { hashes, tier }
                }
                Raw::Cleared => {
                    i += 1;
                    KvEvent::AllCleared
                }
            };
            self.last_seq += 1;
            out.push(KvEventRecord {
                seq: self.last_seq,
                event,
            });
        }
        self.raw.clear();
        out
    }

    pub(crate) fn stored(&mut self, hash: BlockHash, parent: Option<BlockHash>, scope: ScopeId) {
        self.raw.push(Raw::Stored {
            hash,
            parent,
            scope,
        });
    }

    pub(crate) fn removed(&mut self, hash: BlockHash) {
        self.raw.push(Raw::Removed(hash));
    }

    pub(crate) fn removed_many(&mut self, hashes: impl IntoIterator<Item = BlockHash>) {
        self.raw.extend(hashes.into_iter().map(Raw::Removed));
    }

    /// A cached block now held at best in `tier`.
    pub(crate) fn tier(&mut self, hash: BlockHash, tier: Tier) {
        self.raw.push(Raw::Tier(hash, tier));
    }

    pub(crate) fn cleared(&mut self) {
        self.raw.push(Raw::Cleared);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesces_chains_and_removals() {
        let mut log = EventLog::default();
        let (a, b) = (ScopeId(0), ScopeId(1));
        log.stored(BlockHash(1), None, a);
        log.stored(BlockHash(2), Some(BlockHash(1)), a);
        log.stored(BlockHash(3), Some(BlockHash(2)), b);
        log.stored(BlockHash(9), Some(BlockHash(5)), b);
        log.removed(BlockHash(1));
        log.removed(BlockHash(2));
        log.tier(BlockHash(7), Tier::Host);
        log.tier(BlockHash(8), Tier::Host);
        log.tier(BlockHash(9), Tier::Disk);
        log.cleared();
        let scopes = ["a".to_owned(), "b".to_owned()];
        let events = log.drain(&scopes);
        assert_eq!(events.len(), 7);
        assert_eq!(events[0].seq, 1);
        assert_eq!(
            events[0].event,
            KvEvent::BlockStored {
                hashes: vec![BlockHash(1), BlockHash(2)],
                parent: None,
                scope: "a".into()
            }
        );
        assert_eq!(
            events[1].event,
            KvEvent::BlockStored {
                hashes: vec![BlockHash(3)],
                parent: Some(BlockHash(2)),
                scope: "b".into()
            }
        );
        assert_eq!(
            events[3].event,
            KvEvent::BlockRemoved {
                hashes: vec![BlockHash(1), BlockHash(2)]
            }
        );
        assert_eq!(
            events[4].event,
            KvEvent::BlockTier {
                hashes: vec![BlockHash(7), BlockHash(8)],
                tier: Tier::Host
            }
        );
        assert_eq!(events[6].event, KvEvent::AllCleared);
        assert_eq!(log.last_seq(), 7);
        assert!(log.drain(&scopes).is_empty());
        log.removed(BlockHash(4));
        assert_eq!(log.drain(&scopes)[0].seq, 8);
    }
}
