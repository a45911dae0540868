//! kvgate's CUDA path on the CPU, for machines without a GPU (CI among them).
//!
//! `build.rs` compiles every `kernels/cuda/*.cu` file, unchanged, with the system C++ compiler
//! into `libkvgate_cuda_emu.so`, together with:
//! - the execution harness (`csrc/runtime.cpp`): a block's threads run as fibers that switch at
//!   every barrier and warp exchange; blocks run in parallel; launches that an H200 would refuse,
//!   accesses outside live allocations, divergent barriers and bad shuffle masks fail the launch
//!   with a message naming the kernel, block and thread;
//! - a stand-in CUDA driver (`csrc/driver.cpp`) and cuBLAS (`csrc/cublas.cpp`) exporting the entry
//!   points cudarc calls for kvgate's `Cuda` backend. With [`lib_dir`] first on `LD_LIBRARY_PATH`,
//!   `Cuda::new(0)` opens one emulated H200 and the backend's own code runs unchanged.
//!
//! [`Harness`] runs kernels directly (no driver), for the harness's own tests. `docs/cuda.md` says
//! what emulation proves and what only a GPU can.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::Path;

/// The stand-in library itself.
pub fn lib_path() -> &'static Path {
    Path::new(env!("KVGATE_CUDA_EMU_LIB"))
}

/// The folder holding `libcuda.so*` and `libcublas.so*` links to the stand-in, for
/// `LD_LIBRARY_PATH`.
pub fn lib_dir() -> &'static Path {
    Path::new(env!("KVGATE_CUDA_EMU_LIB_DIR"))
}

/// How a block's threads are ordered between switches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Forward, reverse and shuffled in turn, one per launch (the default).
    Rotate,
    Forward,
    Reverse,
    /// A seeded shuffle (a new one per launch).
    Shuffle(u64),
}

/// A failed launch: the CUresult and the emulator's explanation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchError {
    pub code: i32,
    pub message: String,
}

impl std::fmt::Display for LaunchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CUresult {}: {}", self.code, self.message)
    }
}

type RunFn = unsafe extern "C" fn(
    *const c_char,
    *const u32,
    *const u32,
    usize,
    usize,
    *mut *mut c_void,
    *mut c_char,
    usize,
) -> c_int;

/// Direct access to the emulator: device memory and kernel runs, without the driver's streams.
#[derive(Debug)]
pub struct Harness {
    lib: libloading::Library,
}

/// One kernel argument (its bytes are copied at launch, as the driver does).
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// The launch shape: grid, block, dynamic shared memory and its allowance.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub dyn_smem: usize,
    /// What `cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)` would allow (48 KiB by default).
    pub max_dyn_smem: usize,
}

impl Shape {
    /// `grid` blocks of `block` threads, no dynamic shared memory.
    pub fn linear(grid: u32, block: u32) -> Self {
        Shape {
            grid: [grid, 1, 1],
            block: [block, 1, 1],
            dyn_smem: 0,
            max_dyn_smem: 48 * 1024,
        }
    }
}

impl Harness {
    /// Loads the stand-in library.
    pub fn load() -> Result<Self, String> {
        // SAFETY: the library is ours; its initializers only register kernels.
        let lib = unsafe { libloading::Library::new(lib_path()) }.map_err(|e| e.to_string())?;
        Ok(Harness { lib })
    }

    fn sym<T: Copy>(&self, name: &[u8]) -> T {
        // SAFETY: each name below is an exported function of the given signature.
        unsafe { *self.lib.get::<T>(name).expect("symbol of the stand-in") }
    }

    /// `bytes` of device memory (uninitialized: every byte 0xff), or None when exhausted.
    pub fn alloc(&self, bytes: usize) -> Option<u64> {
        let f: unsafe extern "C" fn(usize) -> u64 = self.sym(b"kvgate_emu_malloc\0");
        // SAFETY: plain allocation.
        let p = unsafe { f(bytes) };
        (p != 0).then_some(p)
    }

    /// Device memory holding `data`.
    pub fn upload<T: Copy>(&self, data: &[T]) -> u64 {
        let bytes = std::mem::size_of_val(data);
        let p = self.alloc(bytes).expect("device memory");
        // SAFETY: p is a live allocation of `bytes` bytes, host-addressable in the emulator.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr() as *const u8, p as *mut u8, bytes) };
        p
    }

    /// `len` values read back from device memory at `p`.
    pub fn download<T: Copy + Default>(&self, p: u64, len: usize) -> Vec<T> {
        let mut v = vec![T::default(); len];
        // SAFETY: the caller names a live allocation of at least len values.
        unsafe {
            std::ptr::copy_nonoverlapping(
                p as *const u8,
                v.as_mut_ptr() as *mut u8,
                len * std::mem::size_of::<T>(),
            )
        };
        v
    }

    /// Frees device memory; its pages become inaccessible.
    pub fn free(&self, p: u64) {
        let f: unsafe extern "C" fn(u64) -> c_int = self.sym(b"kvgate_emu_free\0");
        // SAFETY: a pointer from alloc.
        unsafe { f(p) };
    }

    /// The thread order of later launches.
    pub fn set_schedule(&self, s: Schedule) {
        let f: unsafe extern "C" fn(c_int, u64) = self.sym(b"kvgate_emu_set_schedule\0");
        let (kind, seed) = match s {
            Schedule::Rotate => (0, 0),
            Schedule::Forward => (1, 0),
            Schedule::Reverse => (2, 0),
            Schedule::Shuffle(seed) => (3, seed),
        };
        // SAFETY: plain setter.
        unsafe { f(kind, seed) };
    }

    /// Runs kernel `name` to completion.
    pub fn run(&self, name: &str, shape: Shape, args: &[Arg]) -> Result<(), LaunchError> {
        let f: RunFn = self.sym(b"kvgate_emu_run\0");
        let name = CString::new(name).expect("kernel name");
        let mut values: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut b = [0u8; 8];
                match *a {
                    Arg::Ptr(p) => b.copy_from_slice(&p.to_ne_bytes()),
                    Arg::I64(v) => b.copy_from_slice(&v.to_ne_bytes()),
                    Arg::I32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                    Arg::F32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                }
                b
            })
            .collect();
        let mut params: Vec<*mut c_void> = values
            .iter_mut()
            .map(|v| v.as_mut_ptr() as *mut c_void)
            .collect();
        let mut err = vec![0 as c_char; 2048];
        // SAFETY: params point at argument values that outlive the call; err is writable.
        let code = unsafe {
            f(
                name.as_ptr(),
                shape.grid.as_ptr(),
                shape.block.as_ptr(),
                shape.dyn_smem,
                shape.max_dyn_smem,
                params.as_mut_ptr(),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if code == 0 {
            return Ok(());
        }
        // SAFETY: the emulator wrote a NUL-terminated message.
        let message = unsafe { CStr::from_ptr(err.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Err(LaunchError { code, message })
    }
}
