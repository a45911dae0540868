//! The buffer of KV events a manager produces, numbered, with adjacent events coalesced.

use kvgate_protocol::{BlockHash, KvEvent, KvEventRecord};

/// Numbered KV events waiting to be published.
#[derive(Debug, Clone, Default)]
pub struct EventLog {
    pending: Vec<KvEventRecord>,
    /// Sequence number of the last event created (0: none yet).
    last_seq: u64,
}

impl EventLog {
    /// Sequence number of the newest event (0 before the first).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// Takes every pending event, oldest first.
    pub fn drain(&mut self) -> Vec<KvEventRecord> {
        std::mem::take(&mut self.pending)
    }

    pub(crate) fn stored(&mut self, hash: BlockHash, parent: Option<BlockHash>, scope: &str) {
        // Consecutive blocks of one sequence become one event.
        if let Some(KvEventRecord {
            event: KvEvent::BlockStored {
                hashes, scope: s, ..
            },
            ..
        }) = self.pending.last_mut()
        {
            if s == scope && parent.is_some() && hashes.last() == parent.as_ref() {
                hashes.push(hash);
                return;
            }
        }
        self.push(KvEvent::BlockStored {
            hashes: vec![hash],
            parent,
            scope: scope.to_owned(),
        });
    }

    pub(crate) fn removed(&mut self, hash: BlockHash) {
        if let Some(KvEventRecord {
            event: KvEvent::BlockRemoved { hashes },
            ..
        }) = self.pending.last_mut()
        {
            hashes.push(hash);
            return;
        }
        self.push(KvEvent::BlockRemoved { hashes: vec![hash] });
    }

    pub(crate) fn push(&mut self, event: KvEvent) {
        self.last_seq += 1;
        self.pending.push(KvEventRecord {
            seq: self.last_seq,
            event,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesces_chains_and_removals() {
        let mut log = EventLog::default();
        log.stored(BlockHash(1), None, "a");
        log.stored(BlockHash(2), Some(BlockHash(1)), "a");
        log.stored(BlockHash(9), Some(BlockHash(5)), "a");
        log.removed(BlockHash(1));
        log.removed(BlockHash(2));
        log.push(KvEvent::AllCleared);
        let events = log.drain();
        assert_eq!(events.len(), 4);
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
            events[2].event,
            KvEvent::BlockRemoved {
                hashes: vec![BlockHash(1), BlockHash(2)]
            }
        );
        assert_eq!(events[3].seq, 4);
        assert_eq!(log.last_seq(), 4);
        assert!(log.drain().is_empty());
    }
}
