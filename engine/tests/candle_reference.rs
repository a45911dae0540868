//! The CPU forward pass against candle-transformers' Llama (an independent implementation) on the
//! same tiny random weights: logits within 1e-4 relative in f32, for every way the engine can
//! reach a position: full prefill, token-by-token decode, a prefill chunked in three, a prefix
//! shared with another sequence and scattered through the pool, and a fork after copy-on-write.
//!
//! candle runs token by token with its own contiguous KV cache, giving the reference logits at
//! every position.

mod common;

use candle_core::{DType as CDType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama as cl;
use common::runner::Runner;
use common::tiny::{write_tiny_llama, TINY};
use kvgate_engine::kv::SeqId;
use kvgate_engine::model::{Llama, LoadOptions};
use kvgate_kernels::{Cpu, DType};
use std::path::Path;

const BS: u32 = 4;

/// candle's logits after each token of `tokens` (one row per position).
fn candle_logits(dir: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let dev = Device::Cpu;
    let cfg: cl::LlamaConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let cfg = cfg.into_config(false);
    // SAFETY (test): the file is not modified while mapped.
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], CDType::F32, &dev)
            .unwrap()
    };
    let model = cl::Llama::load(vb, &cfg).unwrap();
    let mut cache = cl::Cache::new(true, CDType::F32, &cfg, &dev).unwrap();
    tokens
        .iter()
        .enumerate()
        .map(|(pos, &t)| {
            let input = Tensor::new(&[[t]], &dev).unwrap();
            let logits = model.forward(&input, pos, &mut cache).unwrap();
            logits.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        })
        .collect()
}

/// The engine's CPU forward pass on the tiny model, blocks of `BS` tokens.
fn ours(dir: &Path, num_blocks: u32) -> Runner<Cpu> {
    Runner::new(Cpu::new(), dir, DType::F32, DType::F32, num_blocks, BS)
}

fn assert_close(ours: &[f32], reference: &[f32], what: &str) {
    assert_eq!(ours.len(), reference.len(), "{what}");
    let scale = reference.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
        let err = (a - b).abs() / scale;
        assert!(
            err <= 1e-4,
            "{what}: logit {i}: ours {a}, candle {b} (rel {err:e})"
        );
    }
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 11 + 3) % TINY.vocab as u32)
        .collect()
}

fn setup() -> (tempfile::TempDir, Vec<u32>, Vec<Vec<f32>>) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_llama(dir.path(), &TINY, 7);
    let seq = tokens(23, 1);
    let reference = candle_logits(dir.path(), &seq);
    (dir, seq, reference)
}

#[test]
fn full_prefill_matches_candle() {
    let (dir, seq, reference) = setup();
    let mut ours = ours(dir.path(), 32);
    let (_, logits) = ours.prefill(SeqId(0), &seq, 1);
    for (pos, (a, b)) in logits.iter().zip(&reference).enumerate() {
        assert_close(a, b, &format!("prefill position {pos}"));
    }
}

#[test]
fn token_by_token_decode_matches_candle() {
    let (dir, seq, reference) = setup();
    let mut ours = ours(dir.path(), 32);
    let (_, first) = ours.prefill(SeqId(0), &seq[..1], 1);
    assert_close(&first[0], &reference[0], "position 0");
    for pos in 1..seq.len() {
        let logits = ours.decode(SeqId(0), seq[pos], pos);
        assert_close(&logits, &reference[pos], &format!("decode position {pos}"));
    }
}

#[test]
fn chunked_prefill_matches_candle() {
    let (dir, seq, reference) = setup();
    let mut ours = ours(dir.path(), 32);
    let (_, logits) = ours.prefill(SeqId(0), &seq, 3);
    assert_eq!(logits.len(), seq.len());
    for (pos, (a, b)) in logits.iter().zip(&reference).enumerate() {
        assert_close(a, b, &format!("chunked position {pos}"));
    }
}

#[test]
fn shared_scattered_prefix_matches_candle() {
    let (dir, seq, reference) = setup();
    let mut ours = ours(dir.path(), 64);
    // Fragment the pool: unrelated sequences take blocks, some are freed, so the shared prefix
    // and the new blocks land out of order.
    for i in 0..6 {
        ours.prefill(SeqId(100 + i), &tokens(9, 50 + i as u32), 1);
    }
    for i in [1, 3, 4] {
        ours.kv.free(SeqId(100 + i)).unwrap();
    }
    let (_, _) = ours.prefill(SeqId(1), &seq[..14], 1);
    let (cached, logits) = ours.prefill(SeqId(2), &seq, 1);
    assert_eq!(
        cached, 12,
        "three full blocks of the first 14 tokens are shared"
    );
    let table = ours.kv.block_table(SeqId(2)).unwrap().blocks().to_vec();
    assert!(
        table.windows(2).any(|w| w[1].0 != w[0].0 + 1),
        "blocks are scattered: {table:?}"
    );
    for (k, (a, b)) in logits.iter().zip(&reference[cached..]).enumerate() {
        assert_close(a, b, &format!("shared-prefix position {}", cached + k));
    }
}

#[test]
fn fork_after_copy_on_write_matches_candle() {
    let (dir, seq, reference) = setup();
    // The child continues with other tokens: its own reference.
    let mut child_seq = seq[..10].to_vec();
    child_seq.extend(tokens(6, 9));
    let child_ref = candle_logits(dir.path(), &child_seq);
    let mut ours = ours(dir.path(), 32);
    ours.prefill(SeqId(0), &seq[..10], 1);
    ours.kv.fork(SeqId(0), SeqId(1)).unwrap();
    for pos in 10..16 {
        let a = ours.decode(SeqId(0), seq[pos], pos);
        assert_close(&a, &reference[pos], &format!("parent position {pos}"));
        let b = ours.decode(SeqId(1), child_seq[pos], pos);
        assert_close(&b, &child_ref[pos], &format!("child position {pos}"));
    }
    // The first write into the shared partial block (the parent's) copied it.
    assert_eq!(ours.kv.counters().cow_copies, 1);
}

#[test]
fn sharded_safetensors_load_like_one_file() {
    use safetensors::SafeTensors;
    let (dir, seq, reference) = setup();
    // Split model.safetensors into two shards with an index, as large checkpoints ship.
    let sharded = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_owned).collect();
    names.sort();
    let mut map = serde_json::Map::new();
    for (i, part) in names.chunks(names.len() / 2 + 1).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        let views: Vec<_> = part
            .iter()
            .map(|n| (n.clone(), st.tensor(n).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &sharded.path().join(&file)).unwrap();
        for n in part {
            map.insert(n.clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        sharded.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    std::fs::copy(
        dir.path().join("config.json"),
        sharded.path().join("config.json"),
    )
    .unwrap();
    let mut ours = ours(sharded.path(), 32);
    let (_, logits) = ours.prefill(SeqId(0), &seq, 1);
    for (pos, (a, b)) in logits.iter().zip(&reference).enumerate() {
        assert_close(a, b, &format!("sharded position {pos}"));
    }
    // A corrupt shard is an error naming the file.
    std::fs::write(
        sharded.path().join("model-00002-of-00002.safetensors"),
        b"not safetensors",
    )
    .unwrap();
    let err = Llama::load(
        Cpu::new(),
        sharded.path(),
        LoadOptions {
            dtype: DType::F32,
            quant: None,
            kv_dtype: DType::F32,
            num_blocks: 4,
            num_host_blocks: 0,
            block_size: 4,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
}
