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
#[path = "../tests/common/tiny.rs"]
mod tiny;

use kvgate_engine::kv::{test_manager, SeqId};
use kvgate_engine::model::{Batch, Llama, LoadOptions};
use kvgate_kernels::{AttnSeq, Backend, Cuda, DType};
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
    let blocks = (batch * per_seq) as u32;
    let mut model = Llama::load(
        backend,
        dir,
        LoadOptions {
            dtype,
            kv_dtype: dtype,
            num_blocks: blocks as usize,
            num_host_blocks: 0,
            block_size: BS as usize,
        },
    )
    .expect("model loads");
    let mut kv = test_manager(blocks, 0, BS);
    let scope = kv.scope("bench");
    // Prompts differ per sequence (no shared prefix), prefilled one sequence at a time.
    for s in 0..batch {
        let prompt: Vec<u32> = (0..PROMPT as u32)
            .map(|i| (i * 131 + s as u32 * 7919) % 49152)
            .collect();
        let hashed = kv.hash_prompt(scope, &prompt);
        kv.start_sequence(SeqId(s as u64), &hashed).expect("start");
        kv.append_slots(SeqId(s as u64), &prompt).expect("slots");
        let table: Vec<u32> = kv
            .block_table(SeqId(s as u64))
            .unwrap()
            .blocks()
            .iter()
            .map(|b| b.0)
            .collect();
        let positions: Vec<u32> = (0..PROMPT as u32).collect();
        let slots: Vec<u32> = positions
            .iter()
            .map(|&p| table[p as usize / BS as usize] * BS + p % BS)
            .collect();
        model.forward(&Batch {
            tokens: &prompt,
            positions: &positions,
            slots: &slots,
            seqs: &[AttnSeq {
                query_start: 0,
                query_len: PROMPT,
                context_len: PROMPT,
                block_table: &table,
            }],
            logits_rows: &[PROMPT as u32 - 1],
        });
    }
    let start = Instant::now();
    for step in 0..steps {
        let pos = PROMPT + step;
        let tokens: Vec<u32> = (0..batch as u32)
            .map(|s| (s * 17 + step as u32 * 3) % 49152)
            .collect();
        let mut tables = Vec::with_capacity(batch);
        let mut slots = Vec::with_capacity(batch);
        for (s, &t) in tokens.iter().enumerate() {
            kv.append_slots(SeqId(s as u64), &[t]).expect("slot");
            let table: Vec<u32> = kv
                .block_table(SeqId(s as u64))
                .unwrap()
                .blocks()
                .iter()
                .map(|b| b.0)
                .collect();
            slots.push(table[pos / BS as usize] * BS + (pos as u32) % BS);
            tables.push(table);
        }
        let seqs: Vec<AttnSeq<'_>> = tables
            .iter()
            .enumerate()
            .map(|(i, t)| AttnSeq {
                query_start: i,
                query_len: 1,
                context_len: pos + 1,
                block_table: t,
            })
            .collect();
        let positions = vec![pos as u32; batch];
        let rows: Vec<u32> = (0..batch as u32).collect();
        let logits = model.forward(&Batch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            seqs: &seqs,
            logits_rows: &rows,
        });
        assert_eq!(logits.len(), batch * 49152);
    }
    (batch * steps) as f64 / start.elapsed().as_secs_f64()
}
