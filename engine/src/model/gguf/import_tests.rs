//! Import tests on a tiny synthetic llama GGUF (2 layers, GQA, hidden 32): tensor names and
//! shapes, un-permuted Q/K against the index formula, config and tokenizer files, and refusals.

use super::test_writer::*;
use super::{import_gguf, import_gguf_with, GgufError, ImportOptions, StorageDtype};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::path::Path;

const HIDDEN: u64 = 32;
const HEADS: u64 = 4;
const KV_HEADS: u64 = 2;
const HEAD_DIM: u64 = HIDDEN / HEADS;
const FFN: u64 = 64;
const LAYERS: u64 = 2;
const TOKENS: [&str; 12] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "a",
    "b",
    "ab",
    "Ġ",
    "Ġab",
    "1",
    "2",
    "Ċ",
    "<tool>",
];
const TOKEN_TYPES: [i32; 12] = [3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 4];
const VOCAB: u64 = TOKENS.len() as u64;

/// Deterministic pseudo-random f32 values in [-1, 1), distinct per `seed`.
fn values(seed: u64, n: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// What to vary in the tiny model.
struct Tiny {
    arch: &'static str,
    tokenizer_model: &'static str,
    pre: &'static str,
    with_output: bool,
    skip: Option<&'static str>,
    extra: Option<&'static str>,
    /// A tensor written with its dims swapped.
    transposed: Option<&'static str>,
}

impl Default for Tiny {
    fn default() -> Self {
        Self {
            arch: "llama",
            tokenizer_model: "gpt2",
            pre: "smollm",
            with_output: false,
            skip: None,
            extra: None,
            transposed: None,
        }
    }
}

/// `(gguf name, dims innermost first)` of every tensor, in file order.
fn tensor_list(tiny: &Tiny) -> Vec<(String, Vec<u64>)> {
    let mut list = vec![("token_embd.weight".to_string(), vec![HIDDEN, VOCAB])];
    for l in 0..LAYERS {
        let layer = [
            ("attn_norm", vec![HIDDEN]),
            ("attn_q", vec![HIDDEN, HEADS * HEAD_DIM]),
            ("attn_k", vec![HIDDEN, KV_HEADS * HEAD_DIM]),
            ("attn_v", vec![HIDDEN, KV_HEADS * HEAD_DIM]),
            ("attn_output", vec![HEADS * HEAD_DIM, HIDDEN]),
            ("ffn_norm", vec![HIDDEN]),
            ("ffn_gate", vec![HIDDEN, FFN]),
            ("ffn_up", vec![HIDDEN, FFN]),
            ("ffn_down", vec![FFN, HIDDEN]),
        ];
        list.extend(
            layer
                .into_iter()
                .map(|(t, d)| (format!("blk.{l}.{t}.weight"), d)),
        );
    }
    list.push(("output_norm.weight".into(), vec![HIDDEN]));
    if tiny.with_output {
        list.push(("output.weight".into(), vec![HIDDEN, VOCAB]));
    }
    if let Some(extra) = tiny.extra {
        list.push((extra.into(), vec![4]));
    }
    list.retain(|(n, _)| Some(n.as_str()) != tiny.skip);
    for (n, d) in &mut list {
        if Some(n.as_str()) == tiny.transposed {
            d.reverse();
        }
    }
    list
}

fn tiny_gguf(tiny: &Tiny) -> Vec<u8> {
    let a = |k: &str| format!("{}.{k}", tiny.arch);
    let mut b = GgufBuilder::new()
        .str("general.architecture", tiny.arch)
        .u32(&a("block_count"), LAYERS as u32)
        .u32(&a("embedding_length"), HIDDEN as u32)
        .u32(&a("feed_forward_length"), FFN as u32)
        .u32(&a("attention.head_count"), HEADS as u32)
        .u32(&a("attention.head_count_kv"), KV_HEADS as u32)
        .f32(&a("attention.layer_norm_rms_epsilon"), 1e-5)
        .f32(&a("rope.freq_base"), 100_000.0)
        .u32(&a("rope.dimension_count"), HEAD_DIM as u32)
        .u32(&a("context_length"), 256)
        .str("tokenizer.ggml.model", tiny.tokenizer_model)
        .str("tokenizer.ggml.pre", tiny.pre)
        .str_array("tokenizer.ggml.tokens", &TOKENS)
        .i32_array("tokenizer.ggml.token_type", &TOKEN_TYPES)
        .str_array("tokenizer.ggml.merges", &["a b", "Ġ ab"])
        .u32("tokenizer.ggml.bos_token_id", 1)
        .u32("tokenizer.ggml.eos_token_id", 2)
        .str("tokenizer.chat_template", "{{ messages }}");
    for (i, (name, dims)) in tensor_list(tiny).into_iter().enumerate() {
        let n = dims.iter().product();
        let vals = values(i as u64, n);
        b = if name == "token_embd.weight" {
            // Q8_0 with d = 1/64 (0x2400) and q = round(v * 64): an exact round trip.
            let data = vals
                .chunks(32)
                .flat_map(|c| {
                    let mut block = 0x2400u16.to_le_bytes().to_vec();
                    block.extend(c.iter().map(|v| (v * 64.0).round() as i8 as u8));
                    block
                })
                .collect();
            b.tensor(&name, &dims, 8, data)
        } else {
            b.tensor(&name, &dims, 0, f32_bytes(&vals))
        };
    }
    b.build()
}

/// The expected f32 contents of a GGUF tensor, in GGUF row order.
fn gguf_values(tiny: &Tiny, name: &str) -> Vec<f32> {
    let list = tensor_list(tiny);
    let i = list.iter().position(|(n, _)| n == name).unwrap();
    let vals = values(i as u64, list[i].1.iter().product());
    if name == "token_embd.weight" {
        return vals.iter().map(|v| (v * 64.0).round() / 64.0).collect();
    }
    vals
}

fn write_gguf(dir: &Path, tiny: &Tiny) -> std::path::PathBuf {
    let path = dir.join("tiny.gguf");
    std::fs::write(&path, tiny_gguf(tiny)).unwrap();
    path
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn as_f32(view: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    match view.dtype() {
        Dtype::F32 => view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        Dtype::F16 => view
            .data()
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => panic!("unexpected dtype {other:?}"),
    }
}

#[test]
fn imports_a_tiny_llama() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = Tiny::default();
    let gguf = write_gguf(dir.path(), &tiny);
    let out = dir.path().join("out");
    let mut calls = Vec::new();
    let summary = import_gguf(&gguf, &out, &mut |done, total| calls.push((done, total))).unwrap();
    assert_eq!(summary.tensors, 1 + 9 * LAYERS as usize + 1);
    assert_eq!(summary.files.last().unwrap(), &out.join("config.json"));
    let total = calls[0].1;
    assert_eq!(calls.first(), Some(&(0, total)));
    assert_eq!(calls.last(), Some(&(total, total)));
    assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0));

    let config = read_json(&out.join("config.json"));
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    for (key, want) in [
        ("hidden_size", HIDDEN),
        ("intermediate_size", FFN),
        ("num_hidden_layers", LAYERS),
        ("num_attention_heads", HEADS),
        ("num_key_value_heads", KV_HEADS),
        ("max_position_embeddings", 256),
        ("vocab_size", VOCAB),
        ("bos_token_id", 1),
        ("eos_token_id", 2),
    ] {
        assert_eq!(config[key], want, "{key}");
    }
    assert_eq!(config["rope_theta"], 100_000.0);
    assert!((config["rms_norm_eps"].as_f64().unwrap() - 1e-5).abs() < 1e-12);
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["torch_dtype"], "float32");

    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names = st.names();
    names.sort();
    assert_eq!(names.len(), summary.tensors);
    assert!(!names.iter().any(|n| n.starts_with("lm_head")));
    let embed = st.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!(embed.shape(), [VOCAB as usize, HIDDEN as usize]);
    assert_eq!(as_f32(&embed), gguf_values(&tiny, "token_embd.weight"));
    let v = st.tensor("model.layers.1.self_attn.v_proj.weight").unwrap();
    assert_eq!(v.dtype(), Dtype::F32);
    assert_eq!(as_f32(&v), gguf_values(&tiny, "blk.1.attn_v.weight"));
    let down = st.tensor("model.layers.0.mlp.down_proj.weight").unwrap();
    assert_eq!(down.shape(), [HIDDEN as usize, FFN as usize]);
    assert_eq!(
        as_f32(&st.tensor("model.norm.weight").unwrap()),
        gguf_values(&tiny, "output_norm.weight")
    );

    // HF row h*hd + s*hd/2 + i is GGUF row h*hd + 2i + s.
    for (gguf_name, hf_name, heads) in [
        (
            "blk.1.attn_q.weight",
            "model.layers.1.self_attn.q_proj.weight",
            HEADS,
        ),
        (
            "blk.0.attn_k.weight",
            "model.layers.0.self_attn.k_proj.weight",
            KV_HEADS,
        ),
    ] {
        let (src, got) = (
            gguf_values(&tiny, gguf_name),
            as_f32(&st.tensor(hf_name).unwrap()),
        );
        let (hd, cols) = (HEAD_DIM as usize, HIDDEN as usize);
        for h in 0..heads as usize {
            for s in 0..2 {
                for i in 0..hd / 2 {
                    let hf_row = h * hd + s * hd / 2 + i;
                    let gguf_row = h * hd + 2 * i + s;
                    assert_eq!(got[hf_row * cols..][..cols], src[gguf_row * cols..][..cols]);
                }
            }
        }
    }

    let tok_config = read_json(&out.join("tokenizer_config.json"));
    assert_eq!(tok_config["bos_token"], "<|im_start|>");
    assert_eq!(tok_config["eos_token"], "<|im_end|>");
    assert_eq!(tok_config["add_bos_token"], false);
    assert_eq!(tok_config["chat_template"], "{{ messages }}");

    let tokenizer = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let enc = tokenizer
        .encode("<|im_start|>ab ab12\n<tool>", false)
        .unwrap();
    assert_eq!(enc.get_ids(), [1, 5, 7, 8, 9, 10, 11]);
    assert_eq!(tokenizer.decode(&[5, 7, 8], true).unwrap(), "ab ab1");
    let tj = read_json(&out.join("tokenizer.json"));
    let added = tj["added_tokens"].as_array().unwrap();
    assert_eq!(added.len(), 4);
    assert_eq!(added[3]["content"], "<tool>");
    assert_eq!(added[3]["special"], false);
    assert_eq!(added[0]["special"], true);
}

#[test]
fn stores_f16_and_keeps_an_untied_head() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = Tiny {
        with_output: true,
        ..Tiny::default()
    };
    let gguf = write_gguf(dir.path(), &tiny);
    let out = dir.path().join("out");
    let options = ImportOptions {
        dtype: StorageDtype::F16,
    };
    import_gguf_with(&gguf, &out, &options, &mut |_, _| {}).unwrap();
    let config = read_json(&out.join("config.json"));
    assert_eq!(config["tie_word_embeddings"], false);
    assert_eq!(config["torch_dtype"], "float16");
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let head = st.tensor("lm_head.weight").unwrap();
    assert_eq!(head.dtype(), Dtype::F16);
    let want = gguf_values(&tiny, "output.weight");
    for (g, w) in as_f32(&head).iter().zip(&want) {
        assert!((g - w).abs() <= 1e-3 * w.abs().max(1e-2), "{g} vs {w}");
    }
}

#[test]
fn refuses_what_it_cannot_import() {
    let cases: Vec<(Tiny, &str, &str)> = vec![
        (
            Tiny {
                arch: "qwen2",
                ..Tiny::default()
            },
            "gguf_unsupported",
            "qwen2",
        ),
        (
            Tiny {
                tokenizer_model: "llama",
                ..Tiny::default()
            },
            "gguf_unsupported",
            "tokenizer model",
        ),
        (
            Tiny {
                pre: "qwen2",
                ..Tiny::default()
            },
            "gguf_unsupported",
            "pre-tokenizer",
        ),
        (
            Tiny {
                skip: Some("blk.1.ffn_up.weight"),
                ..Tiny::default()
            },
            "gguf_missing_tensor",
            "blk.1.ffn_up",
        ),
        (
            Tiny {
                extra: Some("rope_freqs.weight"),
                ..Tiny::default()
            },
            "gguf_unsupported",
            "rope_freqs",
        ),
        (
            Tiny {
                extra: Some("blk.7.attn_q.weight"),
                ..Tiny::default()
            },
            "gguf_unsupported",
            "blk.7",
        ),
        (
            Tiny {
                transposed: Some("blk.0.ffn_down.weight"),
                ..Tiny::default()
            },
            "gguf_tensor_shape",
            "ffn_down",
        ),
    ];
    for (tiny, code, mention) in cases {
        let dir = tempfile::tempdir().unwrap();
        let gguf = write_gguf(dir.path(), &tiny);
        let out = dir.path().join("out");
        let err: GgufError = import_gguf(&gguf, &out, &mut |_, _| {}).unwrap_err();
        assert_eq!(err.code(), code, "{err}");
        let msg = err.to_string();
        assert!(msg.contains(mention) && msg.contains("tiny.gguf"), "{msg}");
        assert!(!out.join("config.json").exists());
    }
}
