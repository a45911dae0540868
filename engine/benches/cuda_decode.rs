//! End-to-end decode throughput on the CUDA backend at batch 1 and 64: SmolLM2-135M's exact shape
//! (30 layers, hidden 576, 9 heads / 3 KV heads of 64, FFN 1536, vocabulary 49,152) with random
//! weights, so that it needs no model file. Each sequence starts from a 128-token prompt; the
//! figure is generated tokens per second over 32 decode steps of the whole batch (the logits
//! downloaded every step, as the engine does), f32 and bf16 weights, KV in the weights' type.
//!
//! `cargo bench -p kvgate-engine --features cuda --bench cuda_decode`; on the emulated device
//! (kernels/emu) set `KVGATE_BENCH_QUICK=1` for a 2-layer, 4-step smoke run (its numbers mean
//! nothing). Prints `skipped: <reason>` without a device.

#[allow(dead_code)]
#[path = "../tests/common/runner.rs"]
mod runner;
#[allow(dead_code)]
#[path = "../tests/common/tiny.rs"]
mod tiny;

use kvgate_engine::kv::SeqId;
use kvgate_kernels::{Backend, Cuda, DType};
use runner::Runner;
use std::time::Instant;
use tiny::{write_tiny_llama, TinySpec};

const BS: u32 = 16;
const PROMPT: usize = 128;

fn main() {
    let quick = std::env::var_os("KVGATE_BENCH_QUICK").is_some();
    let cuda = match Cuda::new(0) {
        Ok(c) => c,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    println!("decode on {} ({})", cuda.device_name(), cuda.arch());
    drop(cuda);
    let spec = TinySpec {
        hidden: 576,
        layers: if quick { 2 } else { 30 },
        heads: 9,
        kv_heads: 3,
        ffn: 1536,
        vocab: 49152,
        tie: true,
    };
    let steps = if quick { 4 } else { 32 };
    let dir = tempfile::tempdir().expect("temp dir");
    write_tiny_llama(dir.path(), &spec, 3);
    for dtype in [DType::F32, DType::BF16] {
        for batch in [1usize, 64] {
            let tps = decode_rate(
                Cuda::new(0).expect("device"),
                dir.path(),
                dtype,
                batch,
                steps,
            );
            println!(
                "decode {} batch {batch:>2}: {tps:>9.1} tokens/s ({:.2} ms per step)",
                dtype.name(),
                1000.0 * batch as f64 / tps
            );
        }
    }
}

/// Generated tokens per second of `batch` sequences decoding together for `steps` steps.
fn decode_rate<B: Backend>(
    backend: B,
    dir: &std::path::Path,
    dtype: DType,
    batch: usize,
    steps: usize,
) -> f64 {
    let per_seq = (PROMPT + steps).div_ceil(BS as usize) + 1;
    let mut r = Runner::new(backend, dir, dtype, dtype, (batch * per_seq) as u32, BS);
    // Prompts differ per sequence (no shared prefix), prefilled one sequence at a time, logits of
    // the last row only.
    for s in 0..batch {
        let prompt: Vec<u32> = (0..PROMPT as u32)
            .map(|i| (i * 131 + s as u32 * 7919) % 49152)
            .collect();
        let scope = r.kv.scope("bench");
        let hashed = r.kv.hash_prompt(scope, &prompt);
        r.kv.start_sequence(SeqId(s as u64), &hashed)
            .expect("start");
        r.kv.append_slots(SeqId(s as u64), &prompt).expect("slots");
        r.run_rows(SeqId(s as u64), &prompt, 0, &[PROMPT as u32 - 1]);
    }
    let start = Instant::now();
    for step in 0..steps {
        let batch_step: Vec<(SeqId, u32, usize)> = (0..batch)
            .map(|s| {
                let token = (s as u32 * 17 + step as u32 * 3) % 49152;
                (SeqId(s as u64), token, PROMPT + step)
            })
            .collect();
        let logits = r.decode_batch(&batch_step);
        assert_eq!(logits.len(), batch);
    }
    (batch * steps) as f64 / start.elapsed().as_secs_f64()
}
