//! A binary buddy allocator over token slots, the contiguous allocator Orca-style systems use.
//!
//! Requests are rounded up to a power of two; a free block of order k splits into two buddies of
//! order k-1, and a freed block merges with its buddy when both are free. A budget that is not a
//! power of two is cut into power-of-two arenas, largest first. Alloc and free are O(log budget).

use std::collections::BTreeSet;

#[derive(Debug, Clone)]
pub struct Buddy {
    /// Free block offsets per order (block size 2^order).
    free: Vec<BTreeSet<usize>>,
}

impl Buddy {
    pub fn new(budget: usize) -> Self {
        let orders = (usize::BITS - budget.leading_zeros()) as usize;
        let mut free = vec![BTreeSet::new(); orders.max(1)];
        let mut offset = 0;
        for order in (0..orders).rev() {
            if budget & (1 << order) != 0 {
                free[order].insert(offset);
                offset += 1 << order;
            }
        }
        Buddy { free }
    }

    /// Slots a request of `size` really takes.
    pub fn rounded(size: usize) -> usize {
        size.max(1).next_power_of_two()
    }

    /// Offset of a new block of at least `size` slots, or `None` when no block is large enough.
    pub fn alloc(&mut self, size: usize) -> Option<usize> {
        let want = Self::rounded(size).trailing_zeros() as usize;
        let have = (want..self.free.len()).find(|&o| !self.free[o].is_empty())?;
        let offset = self.free[have].pop_first()?;
        for order in (want..have).rev() {
            self.free[order].insert(offset + (1 << order));
        }
        Some(offset)
    }

    /// Returns the block at `offset` that was allocated for `size`.
    pub fn free(&mut self, mut offset: usize, size: usize) {
        let mut order = Self::rounded(size).trailing_zeros() as usize;
        while order + 1 < self.free.len() {
            let buddy = offset ^ (1 << order);
            if !self.free[order].remove(&buddy) {
                break;
            }
            offset = offset.min(buddy);
            order += 1;
        }
        self.free[order].insert(offset);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_and_merges() {
        let mut b = Buddy::new(16);
        let x = b.alloc(3).unwrap();
        let y = b.alloc(4).unwrap();
        let z = b.alloc(8).unwrap();
        assert_eq!((x, y, z), (0, 4, 8));
        assert_eq!(b.alloc(1), None);
        b.free(y, 4);
        b.free(x, 3);
        b.free(z, 8);
        assert_eq!(b.alloc(16), Some(0));
    }

    #[test]
    fn external_fragmentation_refuses_a_fitting_total() {
        let mut b = Buddy::new(8);
        let blocks: Vec<_> = (0..4).map(|_| b.alloc(2).unwrap()).collect();
        b.free(blocks[0], 2);
        b.free(blocks[2], 2);
        // Four slots are free, but not four adjacent buddies.
        assert_eq!(b.alloc(4), None);
    }

    #[test]
    fn budgets_that_are_not_a_power_of_two() {
        let mut b = Buddy::new(24);
        assert_eq!(b.alloc(16), Some(0));
        assert_eq!(b.alloc(8), Some(16));
        assert_eq!(b.alloc(1), None);
    }
}
