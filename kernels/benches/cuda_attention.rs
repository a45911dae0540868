//! Decode attention on the GPU: effective bandwidth of the paged decode kernel next to the
//! device-to-device copy bandwidth measured in the same run (the target: at least 70%).
//!
//! Shapes: batch 64, context 2,048 and 16,384, 32 query heads / 8 KV heads, head dim 128, bf16
//! KV, block size 16, block tables shuffled over the pool (paging, not contiguous). Effective
//! bandwidth counts the K and V bytes of every context once (a GQA group re-reads its KV head
//! through L2; that is not counted). The copy bandwidth counts bytes read plus bytes written.
//! Times are CUDA events around `iters` back-to-back calls of the Backend method, so they
//! include the launch path (metadata packing, the v2 reduce) as the engine sees it.
//!
//! Run: `cargo bench -p kvgate-kernels --features cuda --bench cuda_attention`. Without a GPU it
//! prints `skipped: <reason>`. `KVGATE_BENCH_ITERS` overrides the iteration count (default 20).

use cudarc::driver::sys::CUevent_flags;
use kvgate_kernels::{AttnSeq, AttnShape, Backend, Cuda, DType};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const BATCH: usize = 64;
const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const BLOCK: usize = 16;

fn main() {
    let cuda = match Cuda::new(0) {
        Ok(c) => c,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let iters: usize = std::env::var("KVGATE_BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    println!(
        "device: {} ({}), iters {iters}",
        cuda.device_name(),
        cuda.arch()
    );
    let copy = copy_bandwidth(&cuda, iters);
    println!(
        "memcpy d2d: {:.0} GB/s (read + write, 1 GiB buffers)",
        copy / 1e9
    );
    for ctx in [2048, 16384] {
        let (secs, bytes) = decode_attention(&cuda, ctx, iters);
        let bw = bytes as f64 / secs;
        println!(
            "decode attention bf16 batch {BATCH} ctx {ctx} heads {HEADS}/{KV_HEADS} hd {HEAD_DIM} \
             bs {BLOCK}: {:.1} us, {:.0} GB/s effective = {:.0}% of memcpy",
            secs * 1e6,
            bw / 1e9,
            100.0 * bw / copy
        );
    }
}

/// Seconds per call and K/V bytes per call.
fn decode_attention(cuda: &Cuda, ctx: usize, iters: usize) -> (f64, usize) {
    let shape = AttnShape {
        num_heads: HEADS,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        block_size: BLOCK,
    };
    let per_seq = ctx / BLOCK;
    let blocks = BATCH * per_seq;
    let mut k = cuda.cache(blocks, shape, DType::BF16);
    let mut v = cuda.cache(blocks, shape, DType::BF16);
    // Random K/V: one random chunk of rows, written over the whole pool.
    let mut rng = StdRng::seed_from_u64(7);
    let width = KV_HEADS * HEAD_DIM;
    let chunk = 4096;
    let rows: Vec<f32> = (0..chunk * width)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let rows = cuda.upload(&rows, chunk, width);
    for start in (0..blocks * BLOCK).step_by(chunk) {
        let slots: Vec<u32> = (start as u32..(start + chunk) as u32).collect();
        cuda.reshape_and_cache(&rows, &rows, &mut k, &mut v, &slots);
    }
    let mut order: Vec<u32> = (0..blocks as u32).collect();
    order.shuffle(&mut rng);
    let tables: Vec<&[u32]> = order.chunks(per_seq).collect();
    let seqs: Vec<AttnSeq<'_>> = tables
        .iter()
        .enumerate()
        .map(|(i, t)| AttnSeq {
            query_start: i,
            query_len: 1,
            context_len: ctx,
            block_table: t,
        })
        .collect();
    let q: Vec<f32> = (0..BATCH * HEADS * HEAD_DIM)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let q = cuda.upload(&q, BATCH, HEADS * HEAD_DIM);
    let mut out = cuda.tensor(BATCH, HEADS * HEAD_DIM);
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let secs = timed(cuda, iters, || {
        cuda.paged_attention(&q, &k, &v, &seqs, scale, &mut out)
    });
    let bytes = 2 * BATCH * ctx * width * 2;
    (secs, bytes)
}

/// Device-to-device copy bandwidth, bytes read plus written per second.
fn copy_bandwidth(cuda: &Cuda, iters: usize) -> f64 {
    let n = 1usize << 30;
    let stream = cuda.stream();
    let src = stream.alloc_zeros::<u8>(n).expect("alloc");
    let mut dst = stream.alloc_zeros::<u8>(n).expect("alloc");
    let secs = timed(cuda, iters, || {
        stream.memcpy_dtod(&src, &mut dst).expect("memcpy");
    });
    2.0 * n as f64 / secs
}

/// Seconds per call of `f` (2 warm-up calls, then `iters` between two CUDA events).
fn timed(cuda: &Cuda, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..2 {
        f();
    }
    cuda.synchronize();
    let ctx = cuda.context();
    let start = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    let end = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    start.record(cuda.stream()).expect("record");
    for _ in 0..iters {
        f();
    }
    end.record(cuda.stream()).expect("record");
    let ms = start.elapsed_ms(&end).expect("elapsed");
    ms as f64 / 1e3 / iters as f64
}
