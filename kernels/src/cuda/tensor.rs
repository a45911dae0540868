//! Device storage of the CUDA backend: activations ([`CudaTensor`], always f32), weights
//! ([`CudaWeight`], in their storage type) and paged KV pools ([`CudaCache`]: device memory, or
//! pinned host memory for the swap space).
//!
//! Buffers keep their allocation when a tensor shrinks, so a forward pass that reuses its
//! out-params allocates only while batch sizes grow. Kernels take raw device pointers
//! ([`CudaTensor::ptr`] and friends): the backend runs everything on one stream with cudarc's
//! event tracking off, so stream order alone orders every read after its write.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};

use crate::backend::{AttnShape, DType};

/// Raw device address of a slice (no event bookkeeping: see the module docs).
pub(crate) fn dptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// An f32 row-major matrix `[rows, cols]` in device memory.
#[derive(Debug)]
pub struct CudaTensor {
    pub(crate) buf: CudaSlice<f32>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl CudaTensor {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Number of values (`rows * cols`).
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether the tensor has no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn ptr(&self) -> u64 {
        dptr(&self.buf, self.buf.stream())
    }
}

/// Values in device memory: f32, or 16-bit (f16/bf16) kept as raw bits.
#[derive(Debug)]
pub(crate) enum DevStore {
    F32(CudaSlice<f32>),
    Half(CudaSlice<u16>),
}

impl DevStore {
    pub(crate) fn ptr(&self) -> u64 {
        match self {
            DevStore::F32(s) => dptr(s, s.stream()),
            DevStore::Half(s) => dptr(s, s.stream()),
        }
    }
}

/// A weight matrix `[rows, cols]` (a vector has one row) in its storage type.
#[derive(Debug)]
pub struct CudaWeight {
    pub(crate) store: DevStore,
    pub(crate) dtype: DType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl CudaWeight {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Storage type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes of weight data.
    pub fn size_bytes(&self) -> usize {
        self.rows * self.cols * self.dtype.size_bytes()
    }
}

/// Where a pool lives.
#[derive(Debug)]
pub(crate) enum CacheMem {
    Device(CudaSlice<u8>),
    /// Page-locked host memory (the swap space), reached by the copy engines through unified
    /// addressing. Keeps the stream so that dropping waits for copies still in flight.
    Host(PinnedHostSlice<u8>, Arc<CudaStream>),
}

/// One layer's paged K or V pool: `[num_blocks, block_size, num_kv_heads, head_dim]`.
#[derive(Debug)]
pub struct CudaCache {
    pub(crate) mem: CacheMem,
    pub(crate) dtype: DType,
    pub(crate) num_blocks: usize,
    pub(crate) shape: AttnShape,
}

impl CudaCache {
    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Attention shape the pool was made for.
    pub fn shape(&self) -> AttnShape {
        self.shape
    }

    /// Storage type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether the pool is in pinned host memory (the swap space).
    pub fn is_host(&self) -> bool {
        matches!(self.mem, CacheMem::Host(..))
    }

    /// Values in one slot: `num_kv_heads * head_dim`.
    pub fn slot_len(&self) -> usize {
        self.shape.num_kv_heads * self.shape.head_dim
    }

    /// Bytes in one block.
    pub fn block_bytes(&self) -> usize {
        self.shape.block_size * self.slot_len() * self.dtype.size_bytes()
    }

    /// Address of the pool: a device pointer, or the pinned host pointer (valid for the driver's
    /// copies under unified addressing).
    pub(crate) fn ptr(&self) -> u64 {
        match &self.mem {
            CacheMem::Device(s) => dptr(s, s.stream()),
            CacheMem::Host(h, _) => h.as_ptr().map_or(0, |p| p as u64),
        }
    }
}

impl Drop for CudaCache {
    fn drop(&mut self) {
        if let CacheMem::Host(_, stream) = &self.mem {
            // Copies into or out of this memory may still be queued: free it only after them.
            let _ = stream.synchronize();
        }
    }
}
