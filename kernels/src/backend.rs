//! The `Backend` trait: every operation the engine's forward pass runs, on one device.
//!
//! Activations are f32 row-major matrices (`rows` tokens x `cols` features). Weights are stored in
//! f32, f16, bf16 or a block-quantized format ([`crate::quant`]) and always accumulated in f32. The KV cache of one layer is a paged pool:
//! `[num_blocks, block_size, num_kv_heads, head_dim]`, one pool for K and one for V, indexed by
//! physical slot `block * block_size + offset` (the block manager's slot numbering).
//!
//! The CPU implementation (`cpu::Cpu`) is the reference every other backend is tested
//! against.

use half::{bf16, f16};

use crate::quant::{self, BlockQ4_1, BlockQ8_0, Quant, QuantBlock};

/// Storage type of weights and KV caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (the top half of an f32).
    BF16,
}

impl DType {
    /// Bytes per value.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Lower-case name (`f32`, `f16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
}

/// Host-side weight data handed to [`Backend::weight`].
#[derive(Debug, Clone)]
pub enum WeightData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    /// Q8_0 blocks, row-major: each row is `cols / 32` blocks.
    Q8_0(Vec<BlockQ8_0>),
    /// Q4_1 blocks, row-major: each row is `cols / 32` blocks.
    Q4_1(Vec<BlockQ4_1>),
}

impl WeightData {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            WeightData::F32(v) => v.len(),
            WeightData::F16(v) => v.len(),
            WeightData::BF16(v) => v.len(),
            WeightData::Q8_0(b) => b.len() * quant::QK,
            WeightData::Q4_1(b) => b.len() * quant::QK,
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Storage type of the values; `None` for quantized blocks ([`WeightData::quant`]).
    pub fn dtype(&self) -> Option<DType> {
        match self {
            WeightData::F32(_) => Some(DType::F32),
            WeightData::F16(_) => Some(DType::F16),
            WeightData::BF16(_) => Some(DType::BF16),
            WeightData::Q8_0(_) | WeightData::Q4_1(_) => None,
        }
    }

    /// The block format of quantized data.
    pub fn quant(&self) -> Option<Quant> {
        match self {
            WeightData::Q8_0(_) => Some(Quant::Q8_0),
            WeightData::Q4_1(_) => Some(Quant::Q4_1),
            _ => None,
        }
    }

    /// Bytes the values take in memory.
    pub fn size_bytes(&self) -> usize {
        match (self.dtype(), self.quant()) {
            (Some(d), _) => self.len() * d.size_bytes(),
            (None, Some(q)) => self.len() / quant::QK * q.block_bytes(),
            (None, None) => unreachable!("every weight is dense or quantized"),
        }
    }

    /// Quantized data widened to `dtype` (for backends without quantized kernels); dense data
    /// is returned as it is.
    pub fn dequantize(self, dtype: DType) -> WeightData {
        fn widen<B: QuantBlock>(blocks: &[B], dtype: DType) -> WeightData {
            let mut values = vec![0.0f32; blocks.len() * quant::QK];
            quant::dequantize(blocks, &mut values);
            WeightData::from_f32(values, dtype)
        }
        match self {
            WeightData::Q8_0(b) => widen(&b, dtype),
            WeightData::Q4_1(b) => widen(&b, dtype),
            dense => dense,
        }
    }

    /// `values` stored as `dtype`.
    pub fn from_f32(values: Vec<f32>, dtype: DType) -> WeightData {
        match dtype {
            DType::F32 => WeightData::F32(values),
            DType::F16 => WeightData::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            DType::BF16 => WeightData::BF16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
        }
    }

    /// `values` quantized to `quant` (a multiple of 32 long).
    pub fn quantized(values: &[f32], quant: Quant) -> WeightData {
        match quant {
            Quant::Q8_0 => WeightData::Q8_0(quant::quantize(values)),
            Quant::Q4_1 => WeightData::Q4_1(quant::quantize(values)),
        }
    }
}

/// Shape of a layer's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (a divisor of `num_heads`; each serves `num_heads / num_kv_heads`).
    pub num_kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Tokens per cache block.
    pub block_size: usize,
}

/// One sequence in an attention batch. Its `query_len` queries are rows
/// `query_start..query_start + query_len` of the batch's Q, and they are the last `query_len`
/// positions of its `context_len` tokens, whose K/V are already in the cache (this step's rows
/// were written by `reshape_and_cache` first). Query j sits at position
/// `context_len - query_len + j` and attends causally to positions `0..=` its own.
/// A decode is `query_len == 1`; a prefill chunk over a cached prefix has `query_len` > 1.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    pub query_start: usize,
    pub query_len: usize,
    pub context_len: usize,
    /// Physical block of each logical block of the sequence.
    pub block_table: &'a [u32],
}

/// Rotary embedding parameters (rotate-half layout, as in Hugging Face Llama).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// Base of the frequencies (`rope_theta`).
    pub theta: f32,
    /// Values per head (rotated as two halves).
    pub head_dim: usize,
    /// Positions to precompute tables for.
    pub max_positions: usize,
    /// Llama-3 style frequency scaling, when the model uses it.
    pub llama3_scaling: Option<Llama3RopeScaling>,
}

/// Llama-3 rope scaling (`rope_scaling` with `rope_type: "llama3"` in config.json).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    /// Divisor of the low frequencies.
    pub factor: f32,
    /// Wavelengths above `original / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: f32,
    /// Wavelengths below `original / high_freq_factor` are kept.
    pub high_freq_factor: f32,
    /// Context length of the unscaled model.
    pub original_max_position_embeddings: usize,
}

/// A device that runs the model's operations.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// An f32 activation matrix on the device.
    type Tensor: Send;
    /// A weight matrix `[rows, cols]` (or a vector, rows = 1) in its storage type.
    type Weight: Send + Sync;
    /// One layer's paged K or V pool.
    type Cache: Send;
    /// Precomputed rotary tables.
    type Rope: Send + Sync;

    /// Short name of the backend (for logs and metrics).
    fn name(&self) -> &'static str;

    /// What this backend computes on, within its machine: `cpu:<the CPUs the process may run
    /// on>` or `cuda:<device ordinal>`. Two engines on one machine with the same unit share their
    /// compute (one's work slows the other), which the gateway's routing takes into account.
    fn compute_unit(&self) -> String;

    /// A zeroed `[rows, cols]` tensor.
    fn tensor(&self, rows: usize, cols: usize) -> Self::Tensor;
    /// Copies host data (`rows * cols` values) to a tensor.
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Self::Tensor;
    /// Copies a tensor to the host.
    fn download(&self, t: &Self::Tensor) -> Vec<f32>;
    /// Rows and columns of a tensor.
    fn shape(&self, t: &Self::Tensor) -> (usize, usize);
    /// Changes a tensor's row count, keeping its columns (contents unspecified): buffers are
    /// reused across steps of different batch sizes.
    fn resize_rows(&self, t: &mut Self::Tensor, rows: usize);

    /// Moves host weight data (`rows * cols` values, row-major) to the device.
    fn weight(&self, data: WeightData, rows: usize, cols: usize) -> Self::Weight;
    /// A zeroed pool of `num_blocks` blocks for one layer's K or V.
    fn cache(&self, num_blocks: usize, shape: AttnShape, dtype: DType) -> Self::Cache;
    /// A pool in host memory for swapped-out blocks (`transfer_blocks` moves blocks between it
    /// and a device pool). A backend whose device memory is host memory keeps the default.
    fn host_cache(&self, num_blocks: usize, shape: AttnShape, dtype: DType) -> Self::Cache {
        self.cache(num_blocks, shape, dtype)
    }
    /// Precomputes rotary tables.
    fn rope(&self, config: &RopeConfig) -> Self::Rope;

    /// `out[i] = table[ids[i]]` (table `[vocab, dim]`).
    fn embedding(&self, table: &Self::Weight, ids: &[u32], out: &mut Self::Tensor);
    /// `out = x / rms(x) * w` per row.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Weight, eps: f32, out: &mut Self::Tensor);
    /// `out = x @ w^T` (+ `bias`): x `[m, k]`, w `[n, k]`, out `[m, n]`.
    fn matmul(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        out: &mut Self::Tensor,
    );
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor);
    /// `out` becomes the rows `rows` of `x`, in that order (`out` is resized to `rows.len()`).
    fn gather_rows(&self, x: &Self::Tensor, rows: &[u32], out: &mut Self::Tensor);
    /// Rotates each head of `x` (`[tokens, heads * head_dim]`) by its token's position.
    fn apply_rope(&self, rope: &Self::Rope, x: &mut Self::Tensor, positions: &[u32]);
    /// `out = silu(gate) * up`, with `gate_up` = `[gate | up]` per row (`2 * ffn` columns).
    fn silu_mul(&self, gate_up: &Self::Tensor, out: &mut Self::Tensor);
    /// Writes row i of `k` and `v` (`[tokens, kv_heads * head_dim]`) into slot `slots[i]`.
    fn reshape_and_cache(
        &self,
        k: &Self::Tensor,
        v: &Self::Tensor,
        k_cache: &mut Self::Cache,
        v_cache: &mut Self::Cache,
        slots: &[u32],
    );
    /// Paged attention for a batch mixing prefill chunks and decodes, with grouped-query
    /// attention: `out` rows match `q` rows (`[tokens, heads * head_dim]`).
    fn paged_attention(
        &self,
        q: &Self::Tensor,
        k_cache: &Self::Cache,
        v_cache: &Self::Cache,
        seqs: &[AttnSeq<'_>],
        scale: f32,
        out: &mut Self::Tensor,
    );
    /// Copy-on-write: for each `(src, dst)`, block `dst` becomes a copy of block `src`.
    fn copy_blocks(&self, cache: &mut Self::Cache, pairs: &[(u32, u32)]);
    /// [`Backend::copy_blocks`] in every pool of `caches` (all layers' K and V of one step); a GPU
    /// backend does them all in one launch.
    fn copy_blocks_many(&self, caches: &mut [&mut Self::Cache], pairs: &[(u32, u32)]) {
        for cache in caches.iter_mut() {
            self.copy_blocks(cache, pairs);
        }
    }
    /// Copies blocks between two caches (device -> host swap and back): `(src in from, dst in to)`.
    fn transfer_blocks(&self, from: &Self::Cache, to: &mut Self::Cache, pairs: &[(u32, u32)]);
    /// Appends block `block`'s bytes (its storage type, little-endian) to `out`, after every copy
    /// queued before (files of the disk tier are made of these).
    fn read_block(&self, cache: &Self::Cache, block: u32, out: &mut Vec<u8>);
    /// Overwrites block `block` with `bytes` from [`Backend::read_block`] of a pool of the same
    /// shape and storage type.
    fn write_block(&self, cache: &mut Self::Cache, block: u32, bytes: &[u8]);
}
