//! The kernels of `kernels/cuda`, embedded in the binary and compiled by NVRTC at start-up, once
//! per process and architecture (later [`super::Cuda`] instances reuse the images).
//!
//! Each `.cu` file is one program; `kvgate_common.cuh` is handed to NVRTC as an in-memory header,
//! so only the CUDA runtime headers (`cuda_fp16.h`, `cuda_bf16.h`) come from disk: from
//! `KVGATE_CUDA_INCLUDE`, `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include`,
//! or the `nvidia-cuda-runtime-cu12` wheel in `target/venv` (the first that has them). A real
//! architecture (`sm_90`) gives a cubin, a virtual one (`compute_90`) PTX for the driver's JIT.
//! Cost: a few seconds per file, the four files on parallel threads.

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result, sys, Ptx};

use super::error::CudaError;

const COMMON_HEADER: &str = include_str!("../../cuda/kvgate_common.cuh");

/// The `.cu` sources, by file name.
pub const SOURCES: [(&str, &str); 4] = [
    ("cache.cu", include_str!("../../cuda/cache.cu")),
    ("ops.cu", include_str!("../../cuda/ops.cu")),
    (
        "paged_attention_decode.cu",
        include_str!("../../cuda/paged_attention_decode.cu"),
    ),
    (
        "paged_attention_prefill.cu",
        include_str!("../../cuda/paged_attention_prefill.cu"),
    ),
];

/// One compiled `.cu` file.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub file: &'static str,
    /// Cubin for a real architecture, PTX text for a virtual one.
    pub image: Vec<u8>,
    pub is_cubin: bool,
}

impl Compiled {
    /// The image in the form `CudaContext::load_module` takes.
    pub fn ptx(&self) -> Ptx {
        if self.is_cubin {
            Ptx::from_binary(self.image.clone())
        } else {
            Ptx::from_src(String::from_utf8_lossy(&self.image).into_owned())
        }
    }
}

type Cache = Mutex<HashMap<String, Arc<Vec<Compiled>>>>;

/// Every source compiled for `arch` (`sm_90`, `compute_80`, ...), from the per-process cache when
/// it was compiled before.
pub fn compile_all(arch: &str) -> Result<Arc<Vec<Compiled>>, CudaError> {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(hit) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(arch) {
        return Ok(hit.clone());
    }
    // SAFETY: only tries to dlopen the library; nothing is called through it.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::LibraryMissing {
            library: "libnvrtc",
            hint: "install the CUDA toolkit or nvidia-cuda-nvrtc-cu12 and put its lib folder on \
                   LD_LIBRARY_PATH",
        });
    }
    let include = include_dirs();
    let results: Vec<Result<Compiled, CudaError>> = std::thread::scope(|s| {
        let handles: Vec<_> = SOURCES
            .iter()
            .map(|&(file, src)| s.spawn(|| compile_one(file, src, arch, &include)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(CudaError::Driver {
                        op: "nvrtc compile",
                        detail: "the compile thread panicked".into(),
                    })
                })
            })
            .collect()
    });
    let compiled = Arc::new(results.into_iter().collect::<Result<Vec<_>, _>>()?);
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(arch.to_owned(), compiled.clone());
    Ok(compiled)
}

/// Folders searched for the CUDA runtime headers, those that have `cuda_fp16.h`.
pub fn include_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(d) = std::env::var_os("KVGATE_CUDA_INCLUDE") {
        dirs.push(d.into());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(d) = std::env::var_os(var) {
            dirs.push(PathBuf::from(d).join("include"));
        }
    }
    dirs.push("/usr/local/cuda/include".into());
    let venv_lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/venv/lib");
    if let Ok(entries) = std::fs::read_dir(&venv_lib) {
        for e in entries.filter_map(Result::ok) {
            dirs.push(e.path().join("site-packages/nvidia/cuda_runtime/include"));
        }
    }
    dirs.retain(|d| d.join("cuda_fp16.h").is_file());
    dirs.truncate(1);
    dirs
}

fn compile_one(
    file: &'static str,
    src: &str,
    arch: &str,
    include: &[PathBuf],
) -> Result<Compiled, CudaError> {
    let err = |log: String| CudaError::Compile {
        file,
        arch: arch.to_owned(),
        log,
    };
    let src_c = CString::new(src).map_err(|e| err(e.to_string()))?;
    let name_c = CString::new(file).map_err(|e| err(e.to_string()))?;
    let header_c = CString::new(COMMON_HEADER).map_err(|e| err(e.to_string()))?;
    let header_name = c"kvgate_common.cuh";
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_owned(),
        "-default-device".to_owned(),
    ];
    opts.extend(
        include
            .iter()
            .map(|d| format!("--include-path={}", d.display())),
    );
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    let headers = [header_c.as_ptr()];
    let names = [header_name.as_ptr()];
    // SAFETY: every pointer is a live NUL-terminated string for the duration of the call; NVRTC
    // copies the sources.
    unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            src_c.as_ptr(),
            name_c.as_ptr(),
            1,
            headers.as_ptr(),
            names.as_ptr(),
        )
    }
    .result()
    .map_err(|e| err(format!("nvrtcCreateProgram: {e:?}")))?;
    let is_cubin = arch.starts_with("sm_");
    // SAFETY: `prog` is a live program, destroyed once at the end of this function.
    let out = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = result::get_program_log(prog)
            .map(|l| c_chars(&l))
            .unwrap_or_default();
        let image = match compiled {
            Err(e) => Err(format!("{e:?}\n{log}")),
            Ok(()) if is_cubin => cubin(prog),
            Ok(()) => result::get_ptx(prog)
                .map(|p| c_chars(&p).into_bytes())
                .map_err(|e| format!("nvrtcGetPTX: {e:?}")),
        };
        let _ = result::destroy_program(prog);
        image
    };
    Ok(Compiled {
        file,
        image: out.map_err(err)?,
        is_cubin,
    })
}

/// # Safety
/// `prog` must be a live, compiled program.
unsafe fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, String> {
    let mut size = 0usize;
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
    let mut image = vec![0u8; size];
    unsafe { sys::nvrtcGetCUBIN(prog, image.as_mut_ptr() as *mut c_char) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
    Ok(image)
}

fn c_chars(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Every kernel the launch wrappers call, by its `extern "C"` name (what a module must export).
pub fn kernel_names() -> Vec<String> {
    let mut names: Vec<String> = [
        "copy_blocks",
        "rope_rotate_half",
        "silu_and_mul",
        "gather_rows",
        "add_assign",
        "convert_f32_to_f16",
        "convert_f32_to_bf16",
        "paged_attention_v2_reduce_hd64",
        "paged_attention_v2_reduce_hd128",
    ]
    .map(String::from)
    .into();
    for t in ["f32", "f16", "bf16"] {
        for k in ["reshape_and_cache", "rms_norm", "embedding", "add_bias"] {
            names.push(format!("{k}_{t}"));
        }
        for hd in [64, 128] {
            for bs in [16, 32] {
                for k in ["paged_attention_v1", "paged_attention_v2", "paged_prefill"] {
                    names.push(format!("{k}_{t}_hd{hd}_bs{bs}"));
                }
            }
        }
    }
    names
}
