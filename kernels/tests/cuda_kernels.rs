//! Every CUDA kernel against the CPU backend (the reference), on seeded random inputs.
//!
//! Without a GPU (no driver, no NVRTC/cuBLAS, or no device) each GPU test prints
//! `skipped: <reason>` and passes, unless `KVGATE_REQUIRE_CUDA=1` (then it fails). CI runs the file
//! with the emulator's stand-in driver first on `LD_LIBRARY_PATH` (kernels/emu): the device is then
//! "kvgate emulated H200 (CPU)", and every kernel below runs, unchanged, on the CPU harness. The
//! first test needs only NVRTC: it compiles the embedded kernels through the backend's own
//! module-build path and checks that every kernel the launchers call is exported.
//!
//! Tolerances, relative to the largest |reference value| of each case:
//! - exact (0): embedding, gathers, cache writes and block copies (same rounding on both sides:
//!   round-to-nearest-even narrowing);
//! - 1e-5: RMSNorm, RoPE, residual add, SiLU-and-multiply, f32 matmul (summation order only);
//! - 2e-4: paged attention, any KV type (both sides read identical cache values and accumulate
//!   in f32; they differ in summation order and in `__expf`);
//! - 2e-3 / 1e-2: f16 / bf16 weight matmuls, whose activations the GPU narrows to the weight's
//!   type for the tensor cores (the CPU keeps them in f32).

mod common;

use std::sync::OnceLock;

use common::{assert_close, random, rng, weight_data};
use kvgate_kernels::cuda::compile;
use kvgate_kernels::{AttnSeq, AttnShape, Backend, Cpu, Cuda, DType};
use rand::seq::SliceRandom;

/// The shared GPU backend, or why there is none (printed as the skip reason).
fn gpu() -> Option<&'static Cuda> {
    static GPU: OnceLock<Option<Cuda>> = OnceLock::new();
    let gpu = GPU.get_or_init(kvgate_kernels::cuda::test_device).as_ref();
    if gpu.is_none() {
        println!("skipped: no CUDA device (the first test says why)");
    }
    gpu
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn embedded_kernels_compile_and_export_every_launched_name() {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        println!("skipped: NVRTC not found (scripts/test installs it)");
        return;
    }
    if compile::include_dirs().is_empty() {
        println!("skipped: no CUDA runtime headers (set KVGATE_CUDA_INCLUDE)");
        return;
    }
    let ptx = compile::compile_all("compute_90").expect("NVRTC compiles the embedded kernels");
    let text: String = ptx
        .iter()
        .map(|m| String::from_utf8_lossy(&m.image).into_owned())
        .collect();
    for name in compile::kernel_names() {
        assert!(
            text.contains(&format!(".entry {name}(")),
            "kernel {name} is launched but not exported"
        );
    }
    let cubin = compile::compile_all("sm_90").expect("NVRTC builds sm_90 cubins");
    assert!(cubin
        .iter()
        .all(|m| m.is_cubin && m.image.starts_with(b"\x7fELF")));
    // A second call is served from the per-process cache.
    assert!(std::sync::Arc::ptr_eq(
        &cubin,
        &compile::compile_all("sm_90").unwrap()
    ));
}

#[test]
fn missing_gpu_is_an_error_not_a_panic() {
    match Cuda::new(0) {
        Ok(_) => {
            let e = Cuda::new(1 << 20).expect_err("no GPU has this ordinal");
            assert_eq!(e.code(), "cuda_no_device");
        }
        Err(e) => println!("no GPU here, Cuda::new says: {e}"),
    }
}

#[test]
fn embedding_rms_norm_add_gather_match_cpu() {
    let Some(g) = gpu() else { return };
    let cpu = Cpu::new();
    let mut r = rng(1);
    let (vocab, dim, rows) = (50, 96, 7);
    for dt in DTYPES {
        let table = random(&mut r, vocab * dim, 1.0);
        let ids: Vec<u32> = (0..rows).map(|i| (i * 7 % vocab) as u32).collect();
        let (ct, gt) = (
            cpu.weight(weight_data(&table, dt), vocab, dim),
            g.weight(weight_data(&table, dt), vocab, dim),
        );
        let (mut co, mut go) = (cpu.tensor(0, dim), g.tensor(0, dim));
        cpu.embedding(&ct, &ids, &mut co);
        g.embedding(&gt, &ids, &mut go);
        let what = format!("embedding {dt:?}");
        assert_close(&g.download(&go), &f64s(&cpu.download(&co)), 0.0, &what);

        let w = random(&mut r, dim, 2.0);
        let (cw, gw) = (
            cpu.weight(weight_data(&w, dt), 1, dim),
            g.weight(weight_data(&w, dt), 1, dim),
        );
        let (mut cn, mut gn) = (cpu.tensor(0, dim), g.tensor(0, dim));
        cpu.rms_norm(&co, &cw, 1e-5, &mut cn);
        g.rms_norm(&go, &gw, 1e-5, &mut gn);
        let want = f64s(&cpu.download(&cn));
        assert_close(&g.download(&gn), &want, 1e-5, &format!("rms_norm {dt:?}"));

        cpu.add_assign(&mut cn, &co);
        g.add_assign(&mut gn, &go);
        let want = f64s(&cpu.download(&cn));
        assert_close(&g.download(&gn), &want, 1e-5, "add_assign");

        let pick = [6u32, 0, 3, 3];
        let (mut cg, mut gg) = (cpu.tensor(0, dim), g.tensor(0, dim));
        cpu.gather_rows(&cn, &pick, &mut cg);
        g.gather_rows(&gn, &pick, &mut gg);
        assert_eq!(g.shape(&gg), (4, dim));
        let want = f64s(&cpu.download(&cg));
        assert_close(&g.download(&gg), &want, 1e-5, "gather_rows");
    }
}

#[test]
fn rope_and_silu_match_cpu() {
    let Some(g) = gpu() else { return };
    let cpu = Cpu::new();
    let mut r = rng(2);
    for head_dim in [64, 128] {
        let config = kvgate_kernels::RopeConfig {
            theta: 10000.0,
            head_dim,
            max_positions: 4096,
            llama3_scaling: None,
        };
        let (crope, grope) = (cpu.rope(&config), g.rope(&config));
        let (rows, heads) = (9, 3);
        let x = random(&mut r, rows * heads * head_dim, 1.0);
        let positions: Vec<u32> = (0..rows as u32).map(|i| i * 401 % 4096).collect();
        let mut cx = cpu.upload(&x, rows, heads * head_dim);
        let mut gx = g.upload(&x, rows, heads * head_dim);
        cpu.apply_rope(&crope, &mut cx, &positions);
        g.apply_rope(&grope, &mut gx, &positions);
        let want = f64s(&cpu.download(&cx));
        assert_close(&g.download(&gx), &want, 1e-5, &format!("rope hd{head_dim}"));
    }
    let (rows, ffn) = (5, 300);
    let gu = random(&mut r, rows * 2 * ffn, 4.0);
    let (cgu, ggu) = (cpu.upload(&gu, rows, 2 * ffn), g.upload(&gu, rows, 2 * ffn));
    let (mut co, mut go) = (cpu.tensor(0, ffn), g.tensor(0, ffn));
    cpu.silu_mul(&cgu, &mut co);
    g.silu_mul(&ggu, &mut go);
    assert_eq!(g.shape(&go), (rows, ffn));
    let want = f64s(&cpu.download(&co));
    assert_close(&g.download(&go), &want, 1e-5, "silu_mul");
}

#[test]
fn matmul_matches_cpu_for_every_weight_type() {
    let Some(g) = gpu() else { return };
    let cpu = Cpu::new();
    let mut r = rng(3);
    for (dt, tol) in [(DType::F32, 1e-5), (DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        for (m, k, n) in [(1, 256, 80), (7, 96, 33), (64, 576, 192)] {
            let x = random(&mut r, m * k, 1.0);
            let w = random(&mut r, n * k, 1.0);
            let b = random(&mut r, n, 1.0);
            let (cx, gx) = (cpu.upload(&x, m, k), g.upload(&x, m, k));
            let (cw, gw) = (
                cpu.weight(weight_data(&w, dt), n, k),
                g.weight(weight_data(&w, dt), n, k),
            );
            let (cb, gb) = (
                cpu.weight(weight_data(&b, DType::F32), 1, n),
                g.weight(weight_data(&b, DType::F32), 1, n),
            );
            let (mut co, mut go) = (cpu.tensor(0, n), g.tensor(0, n));
            cpu.matmul(&cx, &cw, Some(&cb), &mut co);
            g.matmul(&gx, &gw, Some(&gb), &mut go);
            let what = format!("matmul {dt:?} {m}x{k}x{n}");
            assert_close(&g.download(&go), &f64s(&cpu.download(&co)), tol, &what);
        }
    }
}

/// K and V pools of `blocks` blocks on both backends, every slot written by `reshape_and_cache`
/// from the same random rows.
struct Pools<B: Backend> {
    k: B::Cache,
    v: B::Cache,
}

fn filled<B: Backend>(b: &B, shape: AttnShape, dt: DType, blocks: usize, seed: u64) -> Pools<B> {
    let mut r = rng(seed);
    let slots = blocks * shape.block_size;
    let width = shape.num_kv_heads * shape.head_dim;
    let k = random(&mut r, slots * width, 1.0);
    let v = random(&mut r, slots * width, 1.0);
    // Slots in a shuffled order: the scatter must not depend on row order.
    let mut order: Vec<u32> = (0..slots as u32).collect();
    order.shuffle(&mut r);
    let mut p = Pools {
        k: b.cache(blocks, shape, dt),
        v: b.cache(blocks, shape, dt),
    };
    let (kt, vt) = (b.upload(&k, slots, width), b.upload(&v, slots, width));
    b.reshape_and_cache(&kt, &vt, &mut p.k, &mut p.v, &order);
    p
}

fn cpu_pool(c: &kvgate_kernels::cpu::CpuCache) -> Vec<f32> {
    let mut out = vec![0.0; c.num_blocks() * c.block_len()];
    for (slot, row) in out.chunks_exact_mut(c.slot_len()).enumerate() {
        c.read_slot(slot, row);
    }
    out
}

#[test]
fn reshape_and_cache_and_block_copies_match_cpu() {
    let Some(g) = gpu() else { return };
    let cpu = Cpu::new();
    for dt in DTYPES {
        let shape = AttnShape {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 64,
            block_size: 16,
        };
        let mut c = filled(&cpu, shape, dt, 12, 4);
        let mut gp = filled(g, shape, dt, 12, 4);
        let what = format!("reshape_and_cache {dt:?}");
        assert_close(&g.read_cache(&gp.k), &f64s(&cpu_pool(&c.k)), 0.0, &what);
        assert_close(&g.read_cache(&gp.v), &f64s(&cpu_pool(&c.v)), 0.0, &what);

        // Copy-on-write pairs of one step, in both pools with one call.
        let pairs = [(0, 5), (3, 7), (9, 9), (11, 1)];
        cpu.copy_blocks_many(&mut [&mut c.k, &mut c.v], &pairs);
        g.copy_blocks_many(&mut [&mut gp.k, &mut gp.v], &pairs);
        cpu.copy_blocks(&mut c.k, &[(2, 4)]);
        g.copy_blocks(&mut gp.k, &[(2, 4)]);
        let what = format!("copy_blocks {dt:?}");
        assert_close(&g.read_cache(&gp.k), &f64s(&cpu_pool(&c.k)), 0.0, &what);
        assert_close(&g.read_cache(&gp.v), &f64s(&cpu_pool(&c.v)), 0.0, &what);

        // Swap out to pinned host blocks and back into other device blocks.
        let mut host = g.host_cache(6, shape, dt);
        let mut chost = cpu.host_cache(6, shape, dt);
        let out = [(0, 2), (1, 3), (2, 4), (8, 0)];
        let back = [(2, 10), (3, 11), (0, 6), (4, 2)];
        g.transfer_blocks(&gp.k, &mut host, &out);
        cpu.transfer_blocks(&c.k, &mut chost, &out);
        g.transfer_blocks(&host, &mut gp.k, &back);
        cpu.transfer_blocks(&chost, &mut c.k, &back);
        let what = format!("transfer_blocks {dt:?}");
        assert_close(&g.read_cache(&host), &f64s(&cpu_pool(&chost)), 0.0, &what);
        assert_close(&g.read_cache(&gp.k), &f64s(&cpu_pool(&c.k)), 0.0, &what);
    }
}

/// A batch: decodes and prefill chunks over shuffled (non-contiguous) block tables, two
/// sequences sharing their prefix blocks, partial last blocks. `long` adds decodes past one
/// v2 partition (512 tokens).
fn batch(
    block_size: usize,
    blocks: usize,
    long: bool,
    seed: u64,
) -> (Vec<Vec<u32>>, Vec<(usize, usize)>) {
    let mut r = rng(seed);
    // (query_len, context_len)
    let mut lens = vec![
        (1, 1),
        (1, 17),
        (1, 300),
        (20, 70),
        (33, 33),
        (1, 2 * block_size),
    ];
    if long {
        lens.extend([(1, 513), (1, 1500), (5, 900)]);
    }
    let mut free: Vec<u32> = (0..blocks as u32).collect();
    free.shuffle(&mut r);
    let mut tables: Vec<Vec<u32>> = Vec::new();
    for (i, &(_, ctx)) in lens.iter().enumerate() {
        let need = ctx.div_ceil(block_size);
        let mut t = Vec::with_capacity(need);
        if i == 3 {
            // Shares the prefix blocks of sequence 2 (a cached prompt prefix).
            let shared = (need - 1).min(tables[2].len());
            t.extend_from_slice(&tables[2][..shared]);
        }
        while t.len() < need {
            t.push(free.pop().expect("enough blocks"));
        }
        tables.push(t);
    }
    (tables, lens)
}

fn run_attention<B: Backend>(
    b: &B,
    pools: &Pools<B>,
    shape: AttnShape,
    tables: &[Vec<u32>],
    lens: &[(usize, usize)],
    q: &[f32],
) -> Vec<f32> {
    let mut start = 0;
    let seqs: Vec<AttnSeq<'_>> = tables
        .iter()
        .zip(lens)
        .map(|(t, &(ql, ctx))| {
            let s = AttnSeq {
                query_start: start,
                query_len: ql,
                context_len: ctx,
                block_table: t,
            };
            start += ql;
            s
        })
        .collect();
    let width = shape.num_heads * shape.head_dim;
    let qt = b.upload(q, start, width);
    let mut out = b.tensor(0, width);
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    b.paged_attention(&qt, &pools.k, &pools.v, &seqs, scale, &mut out);
    b.download(&out)
}

#[test]
fn paged_attention_matches_cpu_for_every_variant() {
    let Some(g) = gpu() else { return };
    let cpu = Cpu::new();
    let mut seed = 100;
    for dt in DTYPES {
        for head_dim in [64, 128] {
            for block_size in [16, 32] {
                for (heads, kv_heads) in [(8, 2), (4, 4)] {
                    let shape = AttnShape {
                        num_heads: heads,
                        num_kv_heads: kv_heads,
                        head_dim,
                        block_size,
                    };
                    for long in [false, true] {
                        seed += 1;
                        let blocks = if long {
                            4096 / block_size + 16
                        } else {
                            1024 / block_size
                        };
                        let (tables, lens) = batch(block_size, blocks, long, seed);
                        let rows: usize = lens.iter().map(|l| l.0).sum();
                        let q = random(&mut rng(seed), rows * heads * head_dim, 1.0);
                        let cp = filled(&cpu, shape, dt, blocks, seed);
                        let gp = filled(g, shape, dt, blocks, seed);
                        let want = run_attention(&cpu, &cp, shape, &tables, &lens, &q);
                        let got = run_attention(g, &gp, shape, &tables, &lens, &q);
                        let what = format!(
                            "attention {dt:?} hd{head_dim} bs{block_size} {heads}/{kv_heads} \
                             heads long={long}"
                        );
                        assert_close(&got, &f64s(&want), 2e-4, &what);
                    }
                }
            }
        }
    }
}

#[test]
fn decode_only_batches_take_v1_and_v2_and_agree() {
    let Some(g) = gpu() else { return };
    let cpu = Cpu::new();
    let shape = AttnShape {
        num_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
    };
    for (ctx, seed) in [(512, 7), (2048, 8)] {
        let batch = 6;
        let blocks = batch * ctx / 16;
        let mut order: Vec<u32> = (0..blocks as u32).collect();
        order.shuffle(&mut rng(seed));
        let tables: Vec<Vec<u32>> = order.chunks(ctx / 16).map(|c| c.to_vec()).collect();
        let lens = vec![(1, ctx); batch];
        let q = random(&mut rng(seed), batch * 32 * 128, 1.0);
        let cp = filled(&cpu, shape, DType::BF16, blocks, seed);
        let gp = filled(g, shape, DType::BF16, blocks, seed);
        let want = run_attention(&cpu, &cp, shape, &tables, &lens, &q);
        let got = run_attention(g, &gp, shape, &tables, &lens, &q);
        assert_close(&got, &f64s(&want), 2e-4, &format!("decode ctx {ctx}"));
    }
}

/// Threads sharing one backend each get their own results: an operation's metadata upload and
/// its launch are never split by another thread's (they share the metadata buffers).
#[test]
fn threads_sharing_the_backend_get_their_own_attention() {
    let Some(g) = gpu() else { return };
    let cpu = Cpu::new();
    let shape = AttnShape {
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
    };
    let blocks = 64;
    let (cp, gp) = (
        filled(&cpu, shape, DType::F32, blocks, 5),
        filled(g, shape, DType::F32, blocks, 5),
    );
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (cpu, cp, gp) = (&cpu, &cp, &gp);
            s.spawn(move || {
                // Each thread its own block tables and context lengths.
                let mut order: Vec<u32> = (0..blocks as u32).collect();
                order.shuffle(&mut rng(t));
                let ctx = 40 + 30 * t as usize;
                let tables = vec![order[..ctx.div_ceil(16)].to_vec()];
                let lens = [(1, ctx)];
                let q = random(&mut rng(t + 10), shape.num_heads * shape.head_dim, 1.0);
                let want = run_attention(cpu, cp, shape, &tables, &lens, &q);
                for i in 0..25 {
                    let got = run_attention(g, gp, shape, &tables, &lens, &q);
                    assert_close(&got, &f64s(&want), 2e-4, &format!("thread {t}, round {i}"));
                }
            });
        }
    });
}
