//! Writes into and copies between paged KV pools.
//!
//! - `reshape_and_cache`: token i's K and V rows (`kv_heads * head_dim` values, exactly one
//!   slot's layout) are narrowed to the cache's storage type and written to slot `slots[i]`.
//!   O(tokens * kv_heads * head_dim).
//! - `copy_blocks` (copy-on-write) and `transfer_blocks` (swap between the device and host
//!   pools): whole-block `memcpy`s, O(pairs * block_len); a transfer between pools of different
//!   storage types converts through f32.

use super::tensor::{CpuCache, CpuTensor, Store};

/// Writes row i of `k` / `v` into slot `slots[i]` of `k_cache` / `v_cache`.
pub(crate) fn reshape_and_cache(
    k: &CpuTensor,
    v: &CpuTensor,
    k_cache: &mut CpuCache,
    v_cache: &mut CpuCache,
    slots: &[u32],
) {
    write_rows(k, k_cache, slots);
    write_rows(v, v_cache, slots);
}

fn write_rows(x: &CpuTensor, cache: &mut CpuCache, slots: &[u32]) {
    let slot_len = cache.slot_len();
    assert_eq!(
        x.cols(),
        slot_len,
        "reshape_and_cache: row width != kv_heads * head_dim"
    );
    assert_eq!(x.rows(), slots.len(), "reshape_and_cache: one slot per row");
    let capacity = cache.num_blocks * cache.shape.block_size;
    for (i, &slot) in slots.iter().enumerate() {
        let slot = slot as usize;
        assert!(
            slot < capacity,
            "reshape_and_cache: slot {slot} >= {capacity}"
        );
        cache.store.write_f32(slot * slot_len, x.row(i));
    }
}

/// For each `(src, dst)`, block `dst` becomes a copy of block `src`.
pub(crate) fn copy_blocks(cache: &mut CpuCache, pairs: &[(u32, u32)]) {
    let len = cache.block_len();
    for &(src, dst) in pairs {
        check_block(cache, src, "copy_blocks src");
        check_block(cache, dst, "copy_blocks dst");
        if src != dst {
            cache
                .store
                .copy_within(src as usize * len, dst as usize * len, len);
        }
    }
}

/// For each `(src, dst)`, block `dst` of `to` becomes a copy of block `src` of `from`.
pub(crate) fn transfer_blocks(from: &CpuCache, to: &mut CpuCache, pairs: &[(u32, u32)]) {
    let len = from.block_len();
    assert_eq!(len, to.block_len(), "transfer_blocks: block shapes differ");
    let mut buf = Vec::new();
    for &(src, dst) in pairs {
        check_block(from, src, "transfer_blocks src");
        check_block(to, dst, "transfer_blocks dst");
        let (s, d) = (src as usize * len, dst as usize * len);
        match (&from.store, &mut to.store) {
            (Store::F32(a), Store::F32(b)) => b[d..d + len].copy_from_slice(&a[s..s + len]),
            (Store::F16(a), Store::F16(b)) => b[d..d + len].copy_from_slice(&a[s..s + len]),
            (Store::BF16(a), Store::BF16(b)) => b[d..d + len].copy_from_slice(&a[s..s + len]),
            (a, b) => {
                buf.resize(len, 0.0);
                a.read_f32(s, &mut buf);
                b.write_f32(d, &buf);
            }
        }
    }
}

/// Appends block `block`'s values, little-endian, to `out`.
pub(crate) fn read_block(cache: &CpuCache, block: u32, out: &mut Vec<u8>) {
    check_block(cache, block, "read_block");
    let len = cache.block_len();
    let s = block as usize * len;
    match &cache.store {
        Store::F32(v) => out.extend(v[s..s + len].iter().flat_map(|x| x.to_le_bytes())),
        Store::F16(v) => out.extend(v[s..s + len].iter().flat_map(|x| x.to_bits().to_le_bytes())),
        Store::BF16(v) => out.extend(v[s..s + len].iter().flat_map(|x| x.to_bits().to_le_bytes())),
    }
}

/// Overwrites block `block` with values from [`read_block`].
pub(crate) fn write_block(cache: &mut CpuCache, block: u32, bytes: &[u8]) {
    check_block(cache, block, "write_block");
    let len = cache.block_len();
    let s = block as usize * len;
    let width = cache.store.dtype().size_bytes();
    assert_eq!(bytes.len(), len * width, "write_block: wrong byte count");
    match &mut cache.store {
        Store::F32(v) => {
            for (x, b) in v[s..s + len].iter_mut().zip(bytes.chunks_exact(4)) {
                *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Store::F16(v) => {
            for (x, b) in v[s..s + len].iter_mut().zip(bytes.chunks_exact(2)) {
                *x = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        Store::BF16(v) => {
            for (x, b) in v[s..s + len].iter_mut().zip(bytes.chunks_exact(2)) {
                *x = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]]));
            }
        }
    }
}

fn check_block(cache: &CpuCache, block: u32, what: &str) {
    assert!(
        (block as usize) < cache.num_blocks,
        "{what}: block {block} >= {}",
        cache.num_blocks
    );
}
