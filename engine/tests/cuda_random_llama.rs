//! CUDA against the CPU backend on a random-weight Llama with SmolLM2's vocabulary (49,152 tokens)
//! and, where its files are at hand, SmolLM2's tokenizer: the whole model path (embedding, every
//! layer's kernels and GEMMs, the LM head, the paged pool with shared and copied blocks) checked
//! without the 515 MB model, so that a GPU machine checks it from a bundle of a few megabytes.
//!
//! - f32 weights and KV: every logit within 1e-4 of the largest (relative), through a chunked
//!   prefill, decodes, a shared prefix and a copy-on-write fork;
//! - bf16 weights and f16 KV (tensor-core GEMMs on the GPU narrow activations to bf16): within
//!   3e-2, and the same greedy token at nearly every position;
//! - with the tokenizer: the same greedy continuation of a chat prompt on both.
//!
//! Built with `--features cuda`; runs on a GPU or on the emulated one (kernels/emu). Without
//! either it prints `skipped: <reason>` and passes, unless `KVGATE_REQUIRE_CUDA=1`.
//! `KVGATE_TOKENIZER_DIR` names a folder with SmolLM2's tokenizer.json (scripts/gpu-check).

#![cfg(feature = "cuda")]

mod common;

use common::runner::Runner;
use common::tiny::{write_tiny_llama, TinySpec};
use kvgate_engine::kv::SeqId;
use kvgate_engine::model::{GenerateOptions, Generator, Llama, LoadOptions};
use kvgate_kernels::cuda::test_device;
use kvgate_kernels::{Backend, Cpu, DType};
use kvgate_protocol::prompt::{ChatMessage, PromptRenderer};
use std::path::{Path, PathBuf};

/// SmolLM2's vocabulary with a small body (head_dim 64, GQA 2:1), tied embeddings.
const SPEC: TinySpec = TinySpec {
    hidden: 256,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    ffn: 512,
    vocab: 49152,
    tie: true,
};
const BS: u32 = 16;

/// A folder holding SmolLM2's tokenizer files, if any is at hand.
fn tokenizer_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("KVGATE_TOKENIZER_DIR") {
        return Some(d.into());
    }
    let assets =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/kvgate-test-assets/smollm2-f32");
    assets.join("tokenizer.json").exists().then_some(assets)
}

/// The random model, with SmolLM2's tokenizer files copied in when they are at hand.
fn model_dir() -> (tempfile::TempDir, bool) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_llama(dir.path(), &SPEC, 12);
    let mut with_tokenizer = false;
    if let Some(src) = tokenizer_dir() {
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
        ] {
            if src.join(f).exists() {
                std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
            }
        }
        with_tokenizer = dir.path().join("tokenizer.json").exists();
    }
    (dir, with_tokenizer)
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7919 + salt * 104_729 + 13) % SPEC.vocab as u32)
        .collect()
}

/// Largest |a - b| over the largest |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |best, (i, &x)| if x > v[best] { i } else { best })
}

/// Every logit row of one scenario: a 40-token prompt prefilled in two chunks, 7 decodes, a
/// second sequence sharing the first 32 tokens (two blocks) and decoding on, and a fork of the
/// first whose next write copies its shared partial block.
fn scenario<B: Backend>(r: &mut Runner<B>) -> Vec<Vec<f32>> {
    let prompt = tokens(40, 1);
    let mut rows = Vec::new();
    let (_, logits) = r.prefill(SeqId(0), &prompt, 2);
    rows.extend(logits);
    let mut pos = prompt.len();
    for t in tokens(7, 2) {
        rows.push(r.decode(SeqId(0), t, pos));
        pos += 1;
    }
    let mut other = prompt[..32].to_vec();
    other.extend(tokens(5, 3));
    let (cached, logits) = r.prefill(SeqId(1), &other, 1);
    assert_eq!(cached, 32, "two full blocks shared");
    rows.extend(logits);
    for (i, t) in tokens(4, 4).into_iter().enumerate() {
        rows.push(r.decode(SeqId(1), t, other.len() + i));
    }
    r.kv.fork(SeqId(0), SeqId(2)).unwrap();
    for (i, t) in tokens(3, 5).into_iter().enumerate() {
        rows.push(r.decode(SeqId(2), t, pos + i));
        rows.push(r.decode(SeqId(0), t ^ 1, pos + i));
    }
    assert!(r.kv.counters().cow_copies >= 1, "the fork copied a block");
    rows
}

/// Logit rows of the scenario, one per computed position.
type Rows = Vec<Vec<f32>>;

/// The scenario's logit rows on the GPU and on the CPU (weights in `dtype`, KV in `kv_dtype`),
/// and the worst relative error between them; None without a device.
fn compare(dtype: DType, kv_dtype: DType) -> Option<(Rows, Rows, f32)> {
    let gpu = test_device()?;
    let (dir, _) = model_dir();
    let mut g = Runner::new(gpu, dir.path(), dtype, kv_dtype, 64, BS);
    let mut c = Runner::new(Cpu::new(), dir.path(), dtype, kv_dtype, 64, BS);
    let (gr, cr) = (scenario(&mut g), scenario(&mut c));
    assert_eq!(gr.len(), cr.len());
    let worst = gr
        .iter()
        .zip(&cr)
        .map(|(a, b)| rel_err(a, b))
        .fold(0f32, f32::max);
    Some((gr, cr, worst))
}

#[test]
fn random_llama_logits_match_cpu_in_f32() {
    let Some((gr, cr, worst)) = compare(DType::F32, DType::F32) else {
        return;
    };
    println!(
        "f32: {} rows of {} logits, worst relative error {worst:.2e}",
        gr.len(),
        SPEC.vocab
    );
    for (i, (a, b)) in gr.iter().zip(&cr).enumerate() {
        assert!(
            rel_err(a, b) <= 1e-4,
            "row {i}: relative error {:e}",
            rel_err(a, b)
        );
    }
}

#[test]
fn random_llama_logits_match_cpu_in_bf16_with_f16_kv() {
    let Some((gr, cr, worst)) = compare(DType::BF16, DType::F16) else {
        return;
    };
    let same = gr
        .iter()
        .zip(&cr)
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    println!(
        "bf16/f16: worst relative error {worst:.2e}, same greedy token at {same} of {} rows",
        gr.len()
    );
    assert!(worst <= 3e-2, "worst relative error {worst:e}");
    assert!(
        same * 10 >= gr.len() * 9,
        "greedy tokens agree at {same} of {} rows",
        gr.len()
    );
}

#[test]
fn random_llama_with_smollm2_tokenizer_generates_the_same_tokens() {
    let Some(gpu) = test_device() else { return };
    let (dir, with_tokenizer) = model_dir();
    if !with_tokenizer {
        assert!(
            std::env::var_os("CI").is_none(),
            "SmolLM2's tokenizer is missing"
        );
        println!("skipped: no SmolLM2 tokenizer at hand (KVGATE_TOKENIZER_DIR)");
        return;
    }
    let r = PromptRenderer::from_dir(dir.path()).expect("the random model's folder is complete");
    let prompt = r
        .encode_chat(&[ChatMessage {
            role: "user".into(),
            content: "What is the capital of France?".into(),
        }])
        .unwrap();
    let cpu_ids = greedy(Cpu::new(), dir.path(), &prompt);
    let gpu_ids = greedy(gpu, dir.path(), &prompt);
    println!(
        "greedy ids: {gpu_ids:?} ({:?})",
        r.decode(&gpu_ids).unwrap_or_default()
    );
    assert_eq!(gpu_ids, cpu_ids);
}

fn greedy<B: Backend>(backend: B, dir: &Path, prompt: &[u32]) -> Vec<u32> {
    let opts = LoadOptions {
        dtype: DType::F32,
        quant: None,
        kv_dtype: DType::F32,
        num_blocks: 64,
        num_host_blocks: 0,
        block_size: BS as usize,
    };
    let model = Llama::load(backend, dir, opts).unwrap();
    let mut g = Generator::new(model, kvgate_engine::kv::test_manager(64, 0, BS));
    let opts = GenerateOptions {
        max_tokens: 12,
        temperature: 0.0,
        seed: 0,
    };
    g.generate(prompt, &[], opts, |_| {}).unwrap().tokens
}
