//! The CPU backend: [`Cpu`] runs every [`Backend`] operation on the host, with AVX-512 kernels
//! when the CPU has them (detected once, at construction) and portable Rust otherwise, spread
//! over the kernels' own thread pool ([`pool`]: spinning between the calls of one step).
//!
//! Layout of the backend, one file per kind of work:
//! - [`tensor`]: storage (activations, weights, paged pools);
//! - [`matmul`]: `x @ w^T`, a bandwidth-bound GEMV for decode and a packed GEMM for prefill;
//! - [`attention`]: paged attention with an online softmax over block tables;
//! - [`norm_rope`]: embedding, RMSNorm, RoPE, SiLU-and-multiply, residual add;
//! - [`cache`]: `reshape_and_cache`, copy-on-write and swap copies;
//! - [`simd`]: ISA detection and shared AVX-512 helpers.
//!
//! Out-params are reshaped to the result's shape, keeping their allocation, so a forward pass
//! that reuses its buffers does not allocate once batch sizes stop growing.

pub mod attention;
mod cache;
pub mod logits;
mod matmul;
mod norm_rope;
mod pool;
pub mod simd;
pub mod tensor;

pub use attention::{dense_attention, DenseSeq};
pub use matmul::{quantized_x_max_rows, AVX2_GEMV_MAX_ROWS, QUANT_GEMV_MAX_ROWS};
pub use norm_rope::CpuRope;
pub use simd::Isa;
pub use tensor::{CpuCache, CpuTensor, CpuWeight, Store, WeightStore};

use crate::backend::{AttnSeq, AttnShape, Backend, DType, RopeConfig, WeightData};

/// The CPU backend.
#[derive(Debug, Clone, Copy)]
pub struct Cpu {
    isa: Isa,
}

impl Default for Cpu {
    fn default() -> Self {
        Self::new()
    }
}

impl Cpu {
    /// A backend using the best instruction set of this CPU.
    pub fn new() -> Self {
        Cpu { isa: Isa::detect() }
    }

    /// A backend restricted to the portable kernels (for testing the fallback path).
    pub fn portable() -> Self {
        Cpu { isa: Isa::Portable }
    }

    /// A backend using `isa`, if this CPU supports it (for testing and comparing the paths).
    pub fn with_isa(isa: Isa) -> Option<Self> {
        Isa::available().contains(&isa).then_some(Cpu { isa })
    }

    /// The instruction set the kernels use.
    pub fn isa(&self) -> Isa {
        self.isa
    }
}

/// Raw pointer to an output buffer that parallel tasks write in disjoint parts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);
// SAFETY: tasks that share it write disjoint elements (each kernel documents its partition), and
// the buffer is mutably borrowed by the calling op for as long as the tasks run.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The element `i` places past the start (a method, so closures capture the whole
    /// `SharedOut` and not its raw pointer).
    pub(crate) fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

impl Backend for Cpu {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Cache = CpuCache;
    type Rope = CpuRope;

    fn name(&self) -> &'static str {
        match self.isa {
            Isa::Amx => "cpu-amx",
            Isa::Avx512 => "cpu-avx512",
            Isa::Avx2 => "cpu-avx2",
            Isa::Portable => "cpu",
        }
    }

    fn compute_unit(&self) -> String {
        // The CPUs this process may run on (its affinity, as the kernel lists it); engines
        // pinned to disjoint CPUs do not share compute.
        let allowed = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                    .map(|v| v.trim().to_owned())
            })
            .unwrap_or_else(|| "all".to_owned());
        format!("cpu:{allowed}")
    }

    fn tensor(&self, rows: usize, cols: usize) -> CpuTensor {
        CpuTensor::zeros(rows, cols)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> CpuTensor {
        CpuTensor::from_vec(data.to_vec(), rows, cols)
    }

    fn download(&self, t: &CpuTensor) -> Vec<f32> {
        t.as_slice().to_vec()
    }

    fn shape(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows(), t.cols())
    }

    fn resize_rows(&self, t: &mut CpuTensor, rows: usize) {
        let cols = t.cols();
        t.set_shape(rows, cols);
    }

    fn weight(&self, data: WeightData, rows: usize, cols: usize) -> CpuWeight {
        CpuWeight::new(data, rows, cols)
    }

    fn cache(&self, num_blocks: usize, shape: AttnShape, dtype: DType) -> CpuCache {
        CpuCache::new(num_blocks, shape, dtype)
    }

    fn rope(&self, config: &RopeConfig) -> CpuRope {
        CpuRope::new(config)
    }

    fn embedding(&self, table: &CpuWeight, ids: &[u32], out: &mut CpuTensor) {
        norm_rope::embedding(table, ids, out)
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuWeight, eps: f32, out: &mut CpuTensor) {
        norm_rope::rms_norm(x, w, eps, out)
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuWeight, bias: Option<&CpuWeight>, out: &mut CpuTensor) {
        matmul::matmul(self.isa, x, w, bias, out)
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) {
        norm_rope::add_assign(x, y)
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[u32], out: &mut CpuTensor) {
        norm_rope::gather_rows(x, rows, out)
    }

    fn apply_rope(&self, rope: &CpuRope, x: &mut CpuTensor, positions: &[u32]) {
        norm_rope::apply_rope(rope, x, positions)
    }

    fn silu_mul(&self, gate_up: &CpuTensor, out: &mut CpuTensor) {
        norm_rope::silu_mul(self.isa, gate_up, out)
    }

    fn reshape_and_cache(
        &self,
        k: &CpuTensor,
        v: &CpuTensor,
        k_cache: &mut CpuCache,
        v_cache: &mut CpuCache,
        slots: &[u32],
    ) {
        cache::reshape_and_cache(k, v, k_cache, v_cache, slots)
    }

    fn paged_attention(
        &self,
        q: &CpuTensor,
        k_cache: &CpuCache,
        v_cache: &CpuCache,
        seqs: &[AttnSeq<'_>],
        scale: f32,
        out: &mut CpuTensor,
    ) {
        attention::paged_attention(self.isa, q, k_cache, v_cache, seqs, scale, out)
    }

    fn copy_blocks(&self, cache: &mut CpuCache, pairs: &[(u32, u32)]) {
        cache::copy_blocks(cache, pairs)
    }

    fn transfer_blocks(&self, from: &CpuCache, to: &mut CpuCache, pairs: &[(u32, u32)]) {
        cache::transfer_blocks(from, to, pairs)
    }

    fn read_block(&self, c: &CpuCache, block: u32, out: &mut Vec<u8>) {
        cache::read_block(c, block, out)
    }

    fn write_block(&self, c: &mut CpuCache, block: u32, bytes: &[u8]) {
        cache::write_block(c, block, bytes)
    }
}
