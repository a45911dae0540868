//! A sequence's block table: logical block i of the sequence lives in physical block `blocks[i]`.

use super::BlockId;

/// Logical -> physical mapping of one sequence, plus how many token slots it fills.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
    num_tokens: usize,
}

impl BlockTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Physical blocks in logical order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Token slots filled across the whole table.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Slots filled in the last block (0 for an empty table).
    pub fn last_block_filled(&self, block_size: usize) -> usize {
        if self.blocks.is_empty() {
            0
        } else {
            self.num_tokens - (self.blocks.len() - 1) * block_size
        }
    }

    /// The physical slot (block * block_size + offset) of logical token position `pos`.
    pub fn slot(&self, pos: usize, block_size: usize) -> usize {
        self.blocks[pos / block_size].0 as usize * block_size + pos % block_size
    }

    pub(crate) fn reserve(&mut self, additional: usize) {
        self.blocks.reserve(additional);
    }

    pub(crate) fn push(&mut self, id: BlockId) {
        self.blocks.push(id);
    }

    pub(crate) fn set(&mut self, logical: usize, id: BlockId) {
        self.blocks[logical] = id;
    }

    pub(crate) fn set_num_tokens(&mut self, n: usize) {
        self.num_tokens = n;
    }

    pub(crate) fn replace_all(&mut self, blocks: Vec<BlockId>) {
        self.blocks = blocks;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_mapping() {
        let mut t = BlockTable::new();
        t.push(BlockId(5));
        t.push(BlockId(2));
        t.set_num_tokens(20);
        assert_eq!(t.last_block_filled(16), 4);
        assert_eq!(t.slot(0, 16), 80);
        assert_eq!(t.slot(17, 16), 33);
    }
}
