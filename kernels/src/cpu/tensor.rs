//! Host storage for the CPU backend: activations ([`CpuTensor`]), weights ([`CpuWeight`]) and
//! paged KV pools ([`CpuCache`]).
//!
//! Activations are always f32; weights and caches keep their storage type ([`Store`]; weights
//! may also be quantized blocks, [`WeightStore`]) and are widened to f32 inside the kernels, one
//! SIMD register at a time. Buffers are plain `Vec`s that
//! keep their capacity when a tensor is reshaped, so a forward pass that reuses its out-params
//! allocates only while batch sizes grow.

use half::{bf16, f16};

use crate::backend::{AttnShape, DType, WeightData};
use crate::quant::{self, BlockQ4_1, BlockQ8_0, QuantBlock};

/// An f32 row-major matrix `[rows, cols]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuTensor {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
    stamp: Stamp,
}

/// A value no other tensor, and no other state of this one, ever has: new at creation, at each
/// clone and at each mutable access. The quantized matmuls key their quantized copy of x by it,
/// so the Q, K and V projections of one input quantize it once.
#[derive(Debug)]
pub(crate) struct Stamp(u64);

impl Stamp {
    fn fresh() -> Stamp {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Stamp(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl Default for Stamp {
    fn default() -> Self {
        Stamp::fresh()
    }
}

impl Clone for Stamp {
    fn clone(&self) -> Self {
        Stamp::fresh()
    }
}

/// Tensors compare by their values; the stamp is not one.
impl PartialEq for Stamp {
    fn eq(&self, _: &Stamp) -> bool {
        true
    }
}

impl CpuTensor {
    /// A zeroed `[rows, cols]` matrix.
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Self::from_vec(vec![0.0; rows * cols], rows, cols)
    }

    /// Wraps `data` (`rows * cols` values, row-major).
    pub fn from_vec(data: Vec<f32>, rows: usize, cols: usize) -> Self {
        assert_eq!(data.len(), rows * cols, "tensor data length != rows * cols");
        CpuTensor {
            data,
            rows,
            cols,
            stamp: Stamp::fresh(),
        }
    }

    /// This tensor's current [`Stamp`]: equal stamps mean the same tensor, unchanged.
    pub(crate) fn stamp(&self) -> u64 {
        self.stamp.0
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The values, row-major.
    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    /// The values, row-major, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        self.stamp = Stamp::fresh();
        &mut self.data
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    /// Gives the tensor shape `[rows, cols]`, keeping the allocation when it is large enough.
    /// Contents are unspecified afterwards (kernels overwrite every value).
    pub fn set_shape(&mut self, rows: usize, cols: usize) {
        self.stamp = Stamp::fresh();
        self.data.resize(rows * cols, 0.0);
        self.rows = rows;
        self.cols = cols;
    }
}

/// Values in one of the storage types.
#[derive(Debug, Clone, PartialEq)]
pub enum Store {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Store {
    /// A zeroed store of `len` values.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => Store::F32(huge_zeroed(len)),
            DType::F16 => Store::F16(huge_zeroed(len)),
            DType::BF16 => Store::BF16(huge_zeroed(len)),
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Store::F32(v) => v.len(),
            Store::F16(v) => v.len(),
            Store::BF16(v) => v.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The storage type.
    pub fn dtype(&self) -> DType {
        match self {
            Store::F32(_) => DType::F32,
            Store::F16(_) => DType::F16,
            Store::BF16(_) => DType::BF16,
        }
    }

    /// Widens `self[start..start + out.len()]` into `out`.
    pub fn read_f32(&self, start: usize, out: &mut [f32]) {
        let end = start + out.len();
        match self {
            Store::F32(v) => out.copy_from_slice(&v[start..end]),
            Store::F16(v) => {
                use half::slice::HalfFloatSliceExt;
                v[start..end].convert_to_f32_slice(out)
            }
            Store::BF16(v) => {
                use half::slice::HalfFloatSliceExt;
                v[start..end].convert_to_f32_slice(out)
            }
        }
    }

    /// Narrows `src` into `self[start..start + src.len()]` (round to nearest even).
    pub fn write_f32(&mut self, start: usize, src: &[f32]) {
        let end = start + src.len();
        match self {
            Store::F32(v) => v[start..end].copy_from_slice(src),
            Store::F16(v) => {
                use half::slice::HalfFloatSliceExt;
                v[start..end].convert_from_f32_slice(src)
            }
            Store::BF16(v) => {
                use half::slice::HalfFloatSliceExt;
                v[start..end].convert_from_f32_slice(src)
            }
        }
    }

    /// Copies `len` values from `src_start` to `dst_start` (ranges may not overlap in meaning:
    /// they are whole blocks).
    pub fn copy_within(&mut self, src_start: usize, dst_start: usize, len: usize) {
        match self {
            Store::F32(v) => v.copy_within(src_start..src_start + len, dst_start),
            Store::F16(v) => v.copy_within(src_start..src_start + len, dst_start),
            Store::BF16(v) => v.copy_within(src_start..src_start + len, dst_start),
        }
    }
}

/// A zeroed vector whose pages the kernel is asked to back with huge pages (before they are
/// first touched: `vec![0; n]` of this size maps fresh zero pages without writing them).
fn huge_zeroed<T: Clone + Default>(len: usize) -> Vec<T> {
    let mut v = vec![T::default(); len];
    advise_huge_pages(&mut v);
    v
}

/// Moves a large weight into memory backed by huge pages (one copy, at load time).
fn huge_copy(data: WeightData) -> WeightStore {
    fn copy<T: Copy + Default>(v: Vec<T>) -> Vec<T> {
        if std::mem::size_of_val(v.as_slice()) < 4 << 20 || !cfg!(target_os = "linux") {
            return v;
        }
        let mut h = huge_zeroed(v.len());
        h.copy_from_slice(&v);
        h
    }
    match data {
        WeightData::F32(v) => WeightStore::Dense(Store::F32(copy(v))),
        WeightData::F16(v) => WeightStore::Dense(Store::F16(copy(v))),
        WeightData::BF16(v) => WeightStore::Dense(Store::BF16(copy(v))),
        WeightData::Q8_0(b) => WeightStore::Q8_0(copy(b)),
        WeightData::Q4_1(b) => WeightStore::Q4_1(copy(b)),
    }
}

/// Asks Linux to back `v`'s memory with transparent huge pages (`MADV_HUGEPAGE`; a no-op
/// elsewhere, for small buffers, or when THP is off). Paged attention jumps between blocks all
/// over the pool and a GEMV streams hundreds of MB: with 4 KiB pages both miss the TLB often.
pub(crate) fn advise_huge_pages<T>(v: &mut [T]) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let bytes = std::mem::size_of_val(v);
        if bytes < 4 << 20 {
            return;
        }
        let start = (v.as_mut_ptr() as usize).next_multiple_of(PAGE);
        let end = (v.as_mut_ptr() as usize + bytes) & !(PAGE - 1);
        // SAFETY: [start, end) is page-aligned and inside `v`'s allocation; MADV_HUGEPAGE only
        // changes how the kernel backs those pages, never their contents. Failure is harmless.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = v;
}

/// A weight's values: dense in a storage type, or quantized blocks (each row a whole number
/// of blocks).
#[derive(Debug, Clone, PartialEq)]
pub enum WeightStore {
    Dense(Store),
    Q8_0(Vec<BlockQ8_0>),
    Q4_1(Vec<BlockQ4_1>),
}

impl WeightStore {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            WeightStore::Dense(s) => s.len(),
            WeightStore::Q8_0(b) => b.len() * quant::QK,
            WeightStore::Q4_1(b) => b.len() * quant::QK,
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Widens `self[start..start + out.len()]` into `out`.
    pub fn read_f32(&self, start: usize, out: &mut [f32]) {
        fn blocks<B: QuantBlock>(b: &[B], start: usize, out: &mut [f32]) {
            let mut vals = [0.0f32; quant::QK];
            let mut i = start;
            while i < start + out.len() {
                b[i / quant::QK].dequantize(&mut vals);
                let from = i % quant::QK;
                let n = (quant::QK - from).min(start + out.len() - i);
                out[i - start..i - start + n].copy_from_slice(&vals[from..from + n]);
                i += n;
            }
        }
        match self {
            WeightStore::Dense(s) => s.read_f32(start, out),
            WeightStore::Q8_0(b) => blocks(b, start, out),
            WeightStore::Q4_1(b) => blocks(b, start, out),
        }
    }

    /// Bytes in memory.
    pub fn size_bytes(&self) -> usize {
        match self {
            WeightStore::Dense(s) => s.len() * s.dtype().size_bytes(),
            WeightStore::Q8_0(b) => std::mem::size_of_val(b.as_slice()),
            WeightStore::Q4_1(b) => std::mem::size_of_val(b.as_slice()),
        }
    }

    /// All values widened to f32 (small weights: norms, biases).
    pub(crate) fn to_f32(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.len()];
        self.read_f32(0, &mut v);
        v
    }
}

/// A weight matrix `[rows, cols]` (a vector has one row) in its storage type.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuWeight {
    pub(crate) store: WeightStore,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl CpuWeight {
    /// Wraps `data` as a `[rows, cols]` matrix. Quantized data needs whole blocks per row
    /// (`cols` a multiple of 32).
    pub fn new(data: WeightData, rows: usize, cols: usize) -> Self {
        assert_eq!(data.len(), rows * cols, "weight data length != rows * cols");
        assert!(
            data.quant().is_none() || cols.is_multiple_of(quant::QK),
            "quantized weight rows must be whole blocks of {} (cols = {cols})",
            quant::QK
        );
        CpuWeight {
            store: huge_copy(data),
            rows,
            cols,
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Storage type of dense weights; `None` for quantized ones.
    pub fn dtype(&self) -> Option<DType> {
        match &self.store {
            WeightStore::Dense(s) => Some(s.dtype()),
            _ => None,
        }
    }

    /// The stored values.
    pub fn store(&self) -> &WeightStore {
        &self.store
    }

    /// Bytes of weight data (what a GEMV streams from memory).
    pub fn size_bytes(&self) -> usize {
        self.store.size_bytes()
    }
}

/// One layer's paged K or V pool: `[num_blocks, block_size, num_kv_heads, head_dim]`.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuCache {
    pub(crate) store: Store,
    pub(crate) num_blocks: usize,
    pub(crate) shape: AttnShape,
}

impl CpuCache {
    /// A zeroed pool of `num_blocks` blocks.
    pub fn new(num_blocks: usize, shape: AttnShape, dtype: DType) -> Self {
        let len = num_blocks * shape.block_size * shape.num_kv_heads * shape.head_dim;
        CpuCache {
            store: Store::zeros(dtype, len),
            num_blocks,
            shape,
        }
    }

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
        self.store.dtype()
    }

    /// Values in one slot (`block * block_size + offset`): `num_kv_heads * head_dim`.
    pub fn slot_len(&self) -> usize {
        self.shape.num_kv_heads * self.shape.head_dim
    }

    /// Values in one block.
    pub fn block_len(&self) -> usize {
        self.shape.block_size * self.slot_len()
    }

    /// The stored values.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Reads one slot as f32 (`out.len() == slot_len()`), e.g. for tests and debugging.
    pub fn read_slot(&self, slot: usize, out: &mut [f32]) {
        self.store.read_f32(slot * self.slot_len(), out);
    }
}
