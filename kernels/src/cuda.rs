//! The CUDA backend: [`Cuda`] runs every [`Backend`] operation on one GPU through cudarc (driver,
//! NVRTC, cuBLAS, all loaded at run time, so this builds with no CUDA toolkit installed).
//!
//! One context, one stream, one cuBLAS handle per backend. The kernels of `kernels/cuda` are
//! compiled by NVRTC for the device's architecture at start-up (once per process: [`compile`]).
//! Every operation is queued on the stream and returns at once; only [`Backend::download`] (the
//! logits at the end of a forward pass) waits for the GPU. cudarc's per-buffer event tracking is
//! turned off: with a single stream, stream order already orders every read after its write.
//!
//! Layout, one file per kind of work:
//! - [`tensor`]: device storage (activations, weights, device and pinned-host KV pools);
//! - [`ops`]: embedding, RMSNorm, RoPE, SiLU-and-multiply, residual add, row gather;
//! - [`matmul`]: `x @ w^T` through cuBLAS (f32 sgemm, or f16/bf16 tensor cores);
//! - [`attention`]: paged attention (decode v1/v2 + reduce, flash-style prefill);
//! - [`cache`]: `reshape_and_cache`, copy-on-write in one launch, batched swap copies;
//! - [`upload`]: per-step metadata (positions, slots, block tables), uploaded once per step.
//!
//! A missing driver, library or device is a [`CudaError`] from [`Cuda::new`], never a panic:
//! cudarc panics when a library is absent, so presence is checked before the first call.

mod attention;
mod cache;
pub mod compile;
mod error;
mod matmul;
mod ops;
pub mod tensor;
mod upload;

pub use error::CudaError;
pub use tensor::{CudaCache, CudaTensor, CudaWeight};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig};
use half::{bf16, f16};

use crate::backend::{AttnSeq, AttnShape, Backend, DType, RopeConfig, WeightData};
use crate::cpu::CpuRope;
use tensor::{CacheMem, DevStore};
use upload::Uploads;

/// Launches kernel `$name` on `$cuda`'s stream with `$cfg` and the given arguments (local
/// variables: the launch reads them by reference); a launch error panics with the kernel's name.
macro_rules! launch {
    ($cuda:expr, $name:expr, $cfg:expr, $($arg:ident),+ $(,)?) => {{
        let name: &str = &$name;
        let f = $cuda.func(name);
        let mut b = $cuda.stream.launch_builder(f);
        $( cudarc::driver::PushKernelArg::arg(&mut b, &$arg); )+
        // SAFETY: the argument list matches the kernel's `extern "C"` signature in kernels/cuda
        // (pointers as u64, `int` as i32, `long` as i64, `float` as f32), every pointer is a live
        // allocation of the size the kernel reads, and all work is ordered on the one stream.
        let r = unsafe { b.launch($cfg) };
        $cuda.check(r.map(|_| ()), name);
    }};
}
pub(crate) use launch;

/// The CUDA backend on one device.
#[derive(Debug)]
pub struct Cuda {
    ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    funcs: HashMap<String, CudaFunction>,
    pub(crate) uploads: Mutex<Uploads>,
    /// Activations narrowed to 16 bits for a half-precision GEMM (grown as needed).
    pub(crate) half_scratch: Mutex<Option<cudarc::driver::CudaSlice<u16>>>,
    /// Held while one operation queues its work: the metadata buffers and the scratch above are
    /// shared, so two threads' uploads and launches must not interleave on the stream (thread
    /// B's upload landing between thread A's upload and A's kernel would hand A B's block tables).
    op: Mutex<()>,
    device_name: String,
    arch: String,
    ordinal: usize,
}

impl Cuda {
    /// Opens device `ordinal`: checks that the driver, NVRTC and cuBLAS libraries load and that the
    /// device exists, then compiles (or reuses) the kernels and creates the stream and cuBLAS
    /// handle.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        check_libraries()?;
        let count = CudaContext::device_count().map_err(|e| CudaError::NoDevice {
            ordinal,
            detail: format!("cuDeviceGetCount: {e:?}"),
        })?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::NoDevice {
                ordinal,
                detail: format!("the driver reports {count} device(s)"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::driver("cuCtx", e))?;
        // SAFETY: the backend uses one stream only (see the module docs), so stream order is all
        // the synchronization buffers need; nothing was allocated before this call.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| CudaError::driver("cuStreamCreate", e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::Blas(format!("{e:?}")))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("compute capability", e))?;
        let arch = format!("sm_{major}{minor}");
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let mut funcs = HashMap::new();
        let wanted = compile::kernel_names();
        for module in compile::compile_all(&arch)?.iter() {
            let m = ctx
                .load_module(module.ptx())
                .map_err(|e| CudaError::driver("cuModuleLoadData", e))?;
            for name in &wanted {
                if let Ok(f) = m.load_function(name) {
                    funcs.insert(name.clone(), f);
                }
            }
        }
        if let Some(missing) = wanted.iter().find(|n| !funcs.contains_key(*n)) {
            return Err(CudaError::Driver {
                op: "cuModuleGetFunction",
                detail: format!("kernel {missing} is in no module"),
            });
        }
        Ok(Cuda {
            ctx,
            stream,
            blas,
            funcs,
            uploads: Mutex::new(Uploads::default()),
            half_scratch: Mutex::new(None),
            op: Mutex::new(()),
            device_name,
            arch,
            ordinal,
        })
    }

    /// The device's name (e.g. "NVIDIA H200").
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The architecture the kernels were compiled for (e.g. `sm_90`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx
            .mem_get_info()
            .map_err(|e| CudaError::driver("cuMemGetInfo", e))
    }

    /// Waits for all queued work (for benchmarks and tests).
    pub fn synchronize(&self) {
        let r = self.stream.synchronize();
        self.check(r, "synchronize");
    }

    /// The context (for benchmarks that time raw copies).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every operation runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Reads a whole pool back as f32 (tests and debugging).
    pub fn read_cache(&self, cache: &CudaCache) -> Vec<f32> {
        cache::read_cache(self, cache)
    }

    /// Serializes one operation's uploads and launches against other threads' (see `op`).
    fn serial(&self) -> std::sync::MutexGuard<'_, ()> {
        self.op.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn func(&self, name: &str) -> &CudaFunction {
        self.funcs
            .get(name)
            .unwrap_or_else(|| panic!("cuda: kernel {name} not loaded"))
    }

    /// Panics with the operation's name on a device error (the trait's operations are
    /// infallible; a failed kernel leaves the device unusable anyway).
    pub(crate) fn check<T, E: std::fmt::Debug>(&self, r: Result<T, E>, op: &str) -> T {
        match r {
            Ok(v) => v,
            Err(e) => panic!("cuda ({}): {op} failed: {e:?}", self.device_name),
        }
    }

    pub(crate) fn alloc_f32(&self, len: usize) -> cudarc::driver::CudaSlice<f32> {
        // Zero-length allocations are not portable across drivers: keep at least one value.
        let r = self.stream.alloc_zeros::<f32>(len.max(1));
        self.check(r, "alloc")
    }
}

/// The device the CUDA test suites run on: device 0 (a GPU, or the emulated H200 of
/// `kernels/emu`), its name printed; or `None` with the reason printed ("skipped: ..."). With
/// `KVGATE_REQUIRE_CUDA` set, a missing device panics instead, so that CI cannot skip silently.
pub fn test_device() -> Option<Cuda> {
    match Cuda::new(0) {
        Ok(c) => {
            println!("on {} ({})", c.device_name(), c.arch());
            Some(c)
        }
        Err(e) if std::env::var_os("KVGATE_REQUIRE_CUDA").is_some() => {
            panic!("KVGATE_REQUIRE_CUDA is set and there is no CUDA device: {e}")
        }
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

/// Checks that the driver, NVRTC and cuBLAS libraries can be loaded (cudarc panics on the first
/// call into a missing one).
fn check_libraries() -> Result<(), CudaError> {
    // SAFETY: these only try to dlopen the libraries; nothing is called through them.
    let (driver, nvrtc, blas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
        )
    };
    if !driver {
        return Err(CudaError::LibraryMissing {
            library: "libcuda (the NVIDIA driver)",
            hint: "no NVIDIA driver on this machine; use device = \"cpu\"",
        });
    }
    if !nvrtc {
        return Err(CudaError::LibraryMissing {
            library: "libnvrtc",
            hint: "install the CUDA toolkit (or nvidia-cuda-nvrtc-cu12) and put its lib folder \
                   on LD_LIBRARY_PATH",
        });
    }
    if !blas {
        return Err(CudaError::LibraryMissing {
            library: "libcublas",
            hint: "install the CUDA toolkit (or nvidia-cublas-cu12) and put its lib folder on \
                   LD_LIBRARY_PATH",
        });
    }
    Ok(())
}

/// Grid of `n` blocks of `threads` threads, no dynamic shared memory.
pub(crate) fn grid(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid-stride launch over `n` elements.
pub(crate) fn strided(n: usize) -> LaunchConfig {
    grid(n.div_ceil(256).clamp(1, 8192), 256)
}

/// Precomputed rotary tables on the device: `[max_positions, head_dim / 2]` cos and sin.
#[derive(Debug)]
pub struct CudaRope {
    cos: cudarc::driver::CudaSlice<f32>,
    sin: cudarc::driver::CudaSlice<f32>,
    head_dim: usize,
    max_positions: usize,
}

impl Backend for Cuda {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Cache = CudaCache;
    type Rope = CudaRope;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn compute_unit(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn tensor(&self, rows: usize, cols: usize) -> CudaTensor {
        CudaTensor {
            buf: self.alloc_f32(rows * cols),
            rows,
            cols,
        }
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> CudaTensor {
        assert_eq!(data.len(), rows * cols, "tensor data length != rows * cols");
        let mut t = self.tensor(rows, cols);
        if !data.is_empty() {
            let r = self.stream.memcpy_htod(data, &mut t.buf);
            self.check(r, "upload");
        }
        t
    }

    fn download(&self, t: &CudaTensor) -> Vec<f32> {
        if t.is_empty() {
            return Vec::new();
        }
        let r = self.stream.clone_dtoh(&t.buf.slice(..t.len()));
        self.check(r, "download")
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn resize_rows(&self, t: &mut CudaTensor, rows: usize) {
        if rows * t.cols > t.buf.len() {
            t.buf = self.alloc_f32(rows * t.cols);
        }
        t.rows = rows;
    }

    fn weight(&self, data: WeightData, rows: usize, cols: usize) -> CudaWeight {
        assert_eq!(data.len(), rows * cols, "weight data length != rows * cols");
        // No quantized CUDA kernels yet: quantized blocks are widened to f16 on the host.
        let data = data.dequantize(DType::F16);
        let dtype = data.dtype().unwrap_or(DType::F16);
        let store = match data {
            WeightData::F32(v) => DevStore::F32(self.check(self.stream.clone_htod(&v), "weight")),
            WeightData::F16(v) => DevStore::Half(self.upload_bits(&v, f16::to_bits)),
            WeightData::BF16(v) => DevStore::Half(self.upload_bits(&v, bf16::to_bits)),
            WeightData::Q8_0(_) | WeightData::Q4_1(_) => {
                unreachable!("dequantized above")
            }
        };
        CudaWeight {
            store,
            dtype,
            rows,
            cols,
        }
    }

    fn cache(&self, num_blocks: usize, shape: AttnShape, dtype: DType) -> CudaCache {
        let bytes = num_blocks * shape.block_size * shape.num_kv_heads * shape.head_dim;
        let bytes = (bytes * dtype.size_bytes()).max(16);
        let r = self.stream.alloc_zeros::<u8>(bytes);
        CudaCache {
            mem: CacheMem::Device(self.check(r, "KV pool allocation")),
            dtype,
            num_blocks,
            shape,
        }
    }

    fn host_cache(&self, num_blocks: usize, shape: AttnShape, dtype: DType) -> CudaCache {
        cache::host_cache(self, num_blocks, shape, dtype)
    }

    fn rope(&self, config: &RopeConfig) -> CudaRope {
        // The CPU backend's tables (Llama-3 scaling included), uploaded once.
        let cpu = CpuRope::new(config);
        let (cos, sin) = cpu.tables();
        CudaRope {
            cos: self.check(self.stream.clone_htod(cos), "rope tables"),
            sin: self.check(self.stream.clone_htod(sin), "rope tables"),
            head_dim: config.head_dim,
            max_positions: config.max_positions,
        }
    }

    fn embedding(&self, table: &CudaWeight, ids: &[u32], out: &mut CudaTensor) {
        let _op = self.serial();
        ops::embedding(self, table, ids, out)
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaWeight, eps: f32, out: &mut CudaTensor) {
        ops::rms_norm(self, x, w, eps, out)
    }

    fn matmul(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        out: &mut CudaTensor,
    ) {
        let _op = self.serial();
        matmul::matmul(self, x, w, bias, out)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) {
        ops::add_assign(self, x, y)
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[u32], out: &mut CudaTensor) {
        let _op = self.serial();
        ops::gather_rows(self, x, rows, out)
    }

    fn apply_rope(&self, rope: &CudaRope, x: &mut CudaTensor, positions: &[u32]) {
        let _op = self.serial();
        ops::apply_rope(self, rope, x, positions)
    }

    fn silu_mul(&self, gate_up: &CudaTensor, out: &mut CudaTensor) {
        ops::silu_mul(self, gate_up, out)
    }

    fn reshape_and_cache(
        &self,
        k: &CudaTensor,
        v: &CudaTensor,
        k_cache: &mut CudaCache,
        v_cache: &mut CudaCache,
        slots: &[u32],
    ) {
        let _op = self.serial();
        cache::reshape_and_cache(self, k, v, k_cache, v_cache, slots)
    }

    fn paged_attention(
        &self,
        q: &CudaTensor,
        k_cache: &CudaCache,
        v_cache: &CudaCache,
        seqs: &[AttnSeq<'_>],
        scale: f32,
        out: &mut CudaTensor,
    ) {
        let _op = self.serial();
        attention::paged_attention(self, q, k_cache, v_cache, seqs, scale, out)
    }

    fn copy_blocks(&self, cache: &mut CudaCache, pairs: &[(u32, u32)]) {
        let _op = self.serial();
        cache::copy_blocks(self, &mut [cache], pairs)
    }

    fn copy_blocks_many(&self, caches: &mut [&mut CudaCache], pairs: &[(u32, u32)]) {
        let _op = self.serial();
        cache::copy_blocks(self, caches, pairs)
    }

    fn transfer_blocks(&self, from: &CudaCache, to: &mut CudaCache, pairs: &[(u32, u32)]) {
        cache::transfer_blocks(self, from, to, pairs)
    }

    fn read_block(&self, c: &CudaCache, block: u32, out: &mut Vec<u8>) {
        cache::read_block(self, c, block, out)
    }

    fn write_block(&self, c: &mut CudaCache, block: u32, bytes: &[u8]) {
        cache::write_block(self, c, block, bytes)
    }
}

impl Cuda {
    fn upload_bits<T: Copy>(&self, v: &[T], bits: fn(T) -> u16) -> cudarc::driver::CudaSlice<u16> {
        let raw: Vec<u16> = v.iter().map(|&x| bits(x)).collect();
        self.check(self.stream.clone_htod(&raw), "weight")
    }
}
