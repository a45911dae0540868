//! A first-fit contiguous allocator over token slots: free extents kept sorted by offset and
//! merged with their neighbours on free. What a plain contiguous KV allocator does when requests
//! come in many sizes. Alloc O(extents), free O(log extents).

use std::collections::BTreeMap;

#[derive(Debug, Clone)]
pub struct FirstFit {
    /// offset -> length of each free extent.
    free: BTreeMap<usize, usize>,
}

impl FirstFit {
    pub fn new(budget: usize) -> Self {
        FirstFit {
            free: BTreeMap::from([(0, budget)]),
        }
    }

    /// Offset of the lowest free extent that holds `size` slots.
    pub fn alloc(&mut self, size: usize) -> Option<usize> {
        let (&offset, &len) = self.free.iter().find(|(_, &len)| len >= size)?;
        self.free.remove(&offset);
        if len > size {
            self.free.insert(offset + size, len - size);
        }
        Some(offset)
    }

    pub fn free(&mut self, offset: usize, size: usize) {
        let (mut start, mut len) = (offset, size);
        if let Some((&prev, &plen)) = self.free.range(..offset).next_back() {
            if prev + plen == offset {
                self.free.remove(&prev);
                start = prev;
                len += plen;
            }
        }
        if let Some(&nlen) = self.free.get(&(offset + size)) {
            self.free.remove(&(offset + size));
            len += nlen;
        }
        self.free.insert(start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_splits_and_coalesces() {
        let mut f = FirstFit::new(10);
        assert_eq!(f.alloc(4), Some(0));
        assert_eq!(f.alloc(4), Some(4));
        f.free(0, 4);
        assert_eq!(f.alloc(3), Some(0));
        assert_eq!(f.alloc(3), None, "1 + 2 slots free, not adjacent");
        f.free(0, 3);
        f.free(4, 4);
        assert_eq!(f.alloc(10), Some(0));
    }
}
