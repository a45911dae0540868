//! Writes into and copies between paged KV pools on the device (kernels in
//! `kernels/cuda/cache.cu`).
//!
//! - `reshape_and_cache`: one block per token narrows its K and V rows into its slot.
//! - `copy_blocks` (copy-on-write): every `(src, dst)` pair of a step, in every pool given (all
//!   layers' K and V), in one launch of grid `(pairs, pools)`; O(pairs * pools * block bytes).
//! - `transfer_blocks` (swap between a device pool and its pinned host pool): `cuMemcpyAsync`
//!   copies queued on the stream, one per run of consecutive blocks (a sequence's blocks are
//!   often adjacent on both sides), never waited for: later kernels and swaps are queued after
//!   them, and a host pool waits for them before it is freed.

use cudarc::driver::sys as drv;

use super::tensor::{CacheMem, CudaCache, CudaTensor};
use super::upload::Meta;
use super::{grid, launch, Cuda};
use crate::backend::{AttnShape, DType};
use half::{bf16, f16};

/// A zeroed pool in page-locked host memory.
pub(crate) fn host_cache(
    cuda: &Cuda,
    num_blocks: usize,
    shape: AttnShape,
    dtype: DType,
) -> CudaCache {
    let values = num_blocks * shape.block_size * shape.num_kv_heads * shape.head_dim;
    let bytes = (values * dtype.size_bytes()).max(16);
    // SAFETY: the memory is zeroed right below, before any use.
    let r = unsafe { cuda.context().alloc_pinned_with_flags::<u8>(bytes, 0) };
    let mut mem = cuda.check(r, "pinned host allocation");
    let r = mem.as_mut_slice();
    cuda.check(r, "pinned host memory").fill(0);
    CudaCache {
        mem: CacheMem::Host(mem, cuda.stream.clone()),
        dtype,
        num_blocks,
        shape,
    }
}

pub(crate) fn reshape_and_cache(
    cuda: &Cuda,
    k: &CudaTensor,
    v: &CudaTensor,
    k_cache: &mut CudaCache,
    v_cache: &mut CudaCache,
    slots: &[u32],
) {
    for (x, cache) in [(k, &*k_cache), (v, &*v_cache)] {
        assert!(!cache.is_host(), "reshape_and_cache: a host pool");
        assert_eq!(
            x.cols,
            cache.slot_len(),
            "reshape_and_cache: row width != kv_heads * head_dim"
        );
        assert_eq!(x.rows, slots.len(), "reshape_and_cache: one slot per row");
    }
    assert_eq!(
        k_cache.dtype, v_cache.dtype,
        "reshape_and_cache: K and V types differ"
    );
    let capacity = k_cache.num_blocks.min(v_cache.num_blocks) * k_cache.shape.block_size;
    if let Some(&bad) = slots.iter().find(|&&s| s as usize >= capacity) {
        panic!("reshape_and_cache: slot {bad} >= {capacity}");
    }
    if slots.is_empty() {
        return;
    }
    let (kp, vp, kc, vc) = (k.ptr(), v.ptr(), k_cache.ptr(), v_cache.ptr());
    let sp = cuda.meta(Meta::Slots, slots);
    let row = k.cols as i32;
    let name = format!("reshape_and_cache_{}", k_cache.dtype.name());
    launch!(cuda, name, grid(slots.len(), 256), kp, vp, kc, vc, sp, row);
}

/// For each `(src, dst)`, block `dst` of every pool becomes a copy of its block `src`.
pub(crate) fn copy_blocks(cuda: &Cuda, caches: &mut [&mut CudaCache], pairs: &[(u32, u32)]) {
    let Some(first) = caches.first() else {
        return;
    };
    let block_bytes = first.block_bytes();
    for c in caches.iter() {
        assert!(!c.is_host(), "copy_blocks: a host pool");
        assert_eq!(
            c.block_bytes(),
            block_bytes,
            "copy_blocks: block sizes differ"
        );
        for &(s, d) in pairs {
            for b in [s, d] {
                assert!(
                    (b as usize) < c.num_blocks,
                    "copy_blocks: block {b} >= {}",
                    c.num_blocks
                );
            }
        }
    }
    let pairs: Vec<(u32, u32)> = pairs.iter().copied().filter(|(s, d)| s != d).collect();
    if pairs.is_empty() {
        return;
    }
    if !block_bytes.is_multiple_of(16) {
        // The kernel copies 16 bytes per thread; other shapes take one copy per block.
        for c in caches.iter() {
            for &(s, d) in &pairs {
                let base = c.ptr();
                let bb = block_bytes as u64;
                copy_async(
                    cuda,
                    base + d as u64 * bb,
                    base + s as u64 * bb,
                    block_bytes,
                );
            }
        }
        return;
    }
    let flat: Vec<u32> = pairs.iter().flat_map(|&(s, d)| [s, d]).collect();
    let ptrs: Vec<u32> = caches
        .iter()
        .flat_map(|c| {
            let p = c.ptr();
            [p as u32, (p >> 32) as u32]
        })
        .collect();
    let pp = cuda.meta(Meta::Pairs, &flat);
    let cp = cuda.meta(Meta::CachePtrs, &ptrs);
    let bb = block_bytes as i64;
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (pairs.len() as u32, caches.len() as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(cuda, "copy_blocks", cfg, cp, pp, bb);
}

/// For each `(src, dst)`, block `dst` of `to` becomes a copy of block `src` of `from`.
pub(crate) fn transfer_blocks(
    cuda: &Cuda,
    from: &CudaCache,
    to: &mut CudaCache,
    pairs: &[(u32, u32)],
) {
    let bb = from.block_bytes();
    assert_eq!(bb, to.block_bytes(), "transfer_blocks: block shapes differ");
    assert_eq!(
        from.dtype, to.dtype,
        "transfer_blocks: storage types differ"
    );
    for &(s, d) in pairs {
        assert!(
            (s as usize) < from.num_blocks,
            "transfer_blocks src: block {s} >= {}",
            from.num_blocks
        );
        assert!(
            (d as usize) < to.num_blocks,
            "transfer_blocks dst: block {d} >= {}",
            to.num_blocks
        );
    }
    let (src, dst) = (from.ptr(), to.ptr());
    let mut i = 0;
    while i < pairs.len() {
        // Extend a run while both sides stay consecutive.
        let (s0, d0) = pairs[i];
        let mut n = 1;
        while i + n < pairs.len() && pairs[i + n] == (s0 + n as u32, d0 + n as u32) {
            n += 1;
        }
        copy_async(
            cuda,
            dst + d0 as u64 * bb as u64,
            src + s0 as u64 * bb as u64,
            n * bb,
        );
        i += n;
    }
}

/// Appends block `block`'s bytes to `out` (waits for the stream: the copies queued before it
/// land first).
pub(crate) fn read_block(cuda: &Cuda, cache: &CudaCache, block: u32, out: &mut Vec<u8>) {
    let bb = cache.block_bytes();
    assert!(
        (block as usize) < cache.num_blocks,
        "read_block: block {block} >= {}",
        cache.num_blocks
    );
    let start = out.len();
    out.resize(start + bb, 0);
    copy_async(
        cuda,
        out[start..].as_mut_ptr() as u64,
        cache.ptr() + block as u64 * bb as u64,
        bb,
    );
    cuda.synchronize();
}

/// Overwrites block `block` with `bytes` (waits for the copy: `bytes` is the caller's).
pub(crate) fn write_block(cuda: &Cuda, cache: &mut CudaCache, block: u32, bytes: &[u8]) {
    let bb = cache.block_bytes();
    assert!(
        (block as usize) < cache.num_blocks,
        "write_block: block {block} >= {}",
        cache.num_blocks
    );
    assert_eq!(bytes.len(), bb, "write_block: wrong byte count");
    copy_async(
        cuda,
        cache.ptr() + block as u64 * bb as u64,
        bytes.as_ptr() as u64,
        bb,
    );
    cuda.synchronize();
}

/// Queues a copy of `bytes` bytes; the driver infers the direction (unified addressing).
fn copy_async(cuda: &Cuda, dst: u64, src: u64, bytes: usize) {
    let r = cuda.context().bind_to_thread();
    cuda.check(r, "bind context");
    // SAFETY: both ranges lie inside live pools of this context (bounds checked by the callers)
    // and are distinct blocks; the copy is ordered on the backend's stream.
    let r = unsafe { drv::cuMemcpyAsync(dst, src, bytes, cuda.stream.cu_stream()) }.result();
    cuda.check(r, "cuMemcpyAsync");
}

/// The whole pool as f32 (waits for the GPU).
pub(crate) fn read_cache(cuda: &Cuda, cache: &CudaCache) -> Vec<f32> {
    let bytes = cache.num_blocks * cache.block_bytes();
    let mut raw = vec![0u8; bytes];
    if bytes > 0 {
        copy_async(cuda, raw.as_mut_ptr() as u64, cache.ptr(), bytes);
        cuda.synchronize();
    }
    match cache.dtype {
        DType::F32 => raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        DType::F16 => raw
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::BF16 => raw
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    }
}
