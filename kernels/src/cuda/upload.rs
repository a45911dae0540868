//! Per-step metadata on the device: token ids, positions, slots, block tables, row lists.
//!
//! Every layer of a forward pass launches its kernels with the same positions, slots and block
//! tables, so each kind of metadata keeps its last upload and is copied again only when its
//! contents change: one host-to-device copy per kind per step instead of one per layer. A copy
//! from pageable host memory may wait for the stream, so fewer copies also means fewer stalls.
//! Rewriting a buffer that queued kernels still read is safe: the copy is queued on the same
//! stream, after them.

use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// What a buffer holds (one slot per kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Meta {
    Ids,
    Positions,
    Slots,
    Rows,
    Attention,
    Pairs,
    CachePtrs,
}

#[derive(Debug)]
struct Entry {
    kind: Meta,
    host: Vec<u32>,
    dev: CudaSlice<u32>,
}

/// The last upload of each kind.
#[derive(Debug, Default)]
pub(crate) struct Uploads {
    entries: Vec<Entry>,
}

impl Uploads {
    /// Device address of `data` (uploaded unless the last upload of `kind` was the same).
    pub(crate) fn get(
        &mut self,
        stream: &Arc<CudaStream>,
        kind: Meta,
        data: &[u32],
    ) -> Result<u64, cudarc::driver::DriverError> {
        let at = match self.entries.iter().position(|e| e.kind == kind) {
            Some(i) => i,
            None => {
                self.entries.push(Entry {
                    kind,
                    host: Vec::new(),
                    dev: stream.alloc_zeros::<u32>(data.len().max(64))?,
                });
                self.entries.len() - 1
            }
        };
        let e = &mut self.entries[at];
        if e.host != data {
            if e.dev.len() < data.len() {
                e.dev = stream.alloc_zeros::<u32>(data.len().next_power_of_two())?;
            }
            if !data.is_empty() {
                stream.memcpy_htod(data, &mut e.dev.slice_mut(..data.len()))?;
            }
            e.host.clear();
            e.host.extend_from_slice(data);
        }
        Ok(super::tensor::dptr(&e.dev, stream))
    }
}
