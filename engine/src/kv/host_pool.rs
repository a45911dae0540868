//! Host (CPU) blocks that hold the KV of swapped-out sequences. A plain free stack with ref
//! counts: swapped blocks are never shared with new requests, so no LRU or hashing is needed.

use super::HostBlockId;

/// Host swap space.
#[derive(Debug, Clone)]
pub struct HostPool {
    ref_counts: Vec<u32>,
    free: Vec<HostBlockId>,
}

impl HostPool {
    pub fn new(num_blocks: u32) -> Self {
        HostPool {
            ref_counts: vec![0; num_blocks as usize],
            free: (0..num_blocks).rev().map(HostBlockId).collect(),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn ref_count(&self, id: HostBlockId) -> u32 {
        self.ref_counts[id.0 as usize]
    }

    pub fn allocate(&mut self) -> Option<HostBlockId> {
        let id = self.free.pop()?;
        self.ref_counts[id.0 as usize] = 1;
        Some(id)
    }

    pub fn touch(&mut self, id: HostBlockId) {
        self.ref_counts[id.0 as usize] += 1;
    }

    /// Drops one reference; returns true when the block became free.
    pub fn release(&mut self, id: HostBlockId) -> bool {
        let rc = &mut self.ref_counts[id.0 as usize];
        debug_assert!(*rc > 0);
        *rc -= 1;
        if *rc == 0 {
            self.free.push(id);
            true
        } else {
            false
        }
    }
}
