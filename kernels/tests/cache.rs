//! KV pool round trips: `reshape_and_cache` stores exactly the (rounded) rows in their slots,
//! `copy_blocks` duplicates whole blocks and leaves the rest alone, and `transfer_blocks` moves
//! blocks to a host pool and back (also between storage types, through f32).

mod common;

use common::{random, rng, round};
use kvgate_kernels::cpu::CpuCache;
use kvgate_kernels::{AttnShape, Backend, Cpu, DType};

const SHAPE: AttnShape = AttnShape {
    num_heads: 6,
    num_kv_heads: 2,
    head_dim: 8,
    block_size: 4,
};

fn slot_values(c: &CpuCache, slot: usize) -> Vec<f32> {
    let mut v = vec![0.0; c.slot_len()];
    c.read_slot(slot, &mut v);
    v
}

fn block_values(c: &CpuCache, block: usize) -> Vec<f32> {
    (0..SHAPE.block_size)
        .flat_map(|o| slot_values(c, block * SHAPE.block_size + o))
        .collect()
}

#[test]
fn reshape_copy_and_transfer_round_trip() {
    let cpu = Cpu::new();
    let mut r = rng(9);
    let row = SHAPE.num_kv_heads * SHAPE.head_dim;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let mut kc = cpu.cache(6, SHAPE, dtype);
        let mut vc = cpu.cache(6, SHAPE, dtype);
        let slots = [5u32, 0, 23, 9, 10];
        let k = random(&mut r, slots.len() * row, 2.0);
        let v = random(&mut r, slots.len() * row, 2.0);
        cpu.reshape_and_cache(
            &cpu.upload(&k, slots.len(), row),
            &cpu.upload(&v, slots.len(), row),
            &mut kc,
            &mut vc,
            &slots,
        );
        for (i, &s) in slots.iter().enumerate() {
            let want: Vec<f32> = k[i * row..][..row]
                .iter()
                .map(|&x| round(x, dtype))
                .collect();
            assert_eq!(slot_values(&kc, s as usize), want, "{dtype:?} K slot {s}");
            let want: Vec<f32> = v[i * row..][..row]
                .iter()
                .map(|&x| round(x, dtype))
                .collect();
            assert_eq!(slot_values(&vc, s as usize), want, "{dtype:?} V slot {s}");
        }

        // Copy-on-write: block 2 (slots 8..12) into 4; block 1 into 3.
        let before: Vec<Vec<f32>> = (0..6).map(|b| block_values(&kc, b)).collect();
        cpu.copy_blocks(&mut kc, &[(2, 4), (1, 3)]);
        let after: Vec<Vec<f32>> = (0..6).map(|b| block_values(&kc, b)).collect();
        assert_eq!(after[4], before[2]);
        assert_eq!(after[3], before[1]);
        for b in [0, 1, 2, 5] {
            assert_eq!(after[b], before[b], "block {b} untouched");
        }

        // Swap out to a host pool (same and different storage type), and back in elsewhere.
        for host_dtype in [dtype, DType::F32] {
            let mut host = cpu.cache(3, SHAPE, host_dtype);
            cpu.transfer_blocks(&kc, &mut host, &[(2, 0), (5, 2)]);
            let mut back = cpu.cache(6, SHAPE, dtype);
            cpu.transfer_blocks(&host, &mut back, &[(0, 1), (2, 0)]);
            assert_eq!(block_values(&back, 1), after[2]);
            assert_eq!(block_values(&back, 0), after[5]);
        }
    }
}
