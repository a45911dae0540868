//! A tiny random Llama written as a Hugging Face directory (config.json + model.safetensors), for
//! comparing the forward pass with candle's.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::BTreeMap;
use std::path::Path;

pub struct TinySpec {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub tie: bool,
}

pub const TINY: TinySpec = TinySpec {
    hidden: 64,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    ffn: 160,
    vocab: 101,
    tie: false,
};

/// Writes the model into `dir`.
pub fn write_tiny_llama(dir: &Path, spec: &TinySpec, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let hd = spec.hidden / spec.heads;
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n: usize = shape.iter().product();
        let data: Vec<u8> = (0..n)
            .flat_map(|_| (offset + scale * rng.gen_range(-1.0f32..1.0)).to_le_bytes())
            .collect();
        tensors.insert(name, (shape, data));
    };
    let (h, f) = (spec.hidden, spec.ffn);
    add(
        "model.embed_tokens.weight".into(),
        vec![spec.vocab, h],
        0.5,
        0.0,
    );
    for i in 0..spec.layers {
        let p = format!("model.layers.{i}");
        add(format!("{p}.input_layernorm.weight"), vec![h], 0.2, 1.0);
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            0.2,
            1.0,
        );
        add(
            format!("{p}.self_attn.q_proj.weight"),
            vec![spec.heads * hd, h],
            0.15,
            0.0,
        );
        add(
            format!("{p}.self_attn.k_proj.weight"),
            vec![spec.kv_heads * hd, h],
            0.15,
            0.0,
        );
        add(
            format!("{p}.self_attn.v_proj.weight"),
            vec![spec.kv_heads * hd, h],
            0.15,
            0.0,
        );
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, spec.heads * hd],
            0.15,
            0.0,
        );
        add(format!("{p}.mlp.gate_proj.weight"), vec![f, h], 0.15, 0.0);
        add(format!("{p}.mlp.up_proj.weight"), vec![f, h], 0.15, 0.0);
        add(format!("{p}.mlp.down_proj.weight"), vec![h, f], 0.15, 0.0);
    }
    add("model.norm.weight".into(), vec![h], 0.2, 1.0);
    if !spec.tie {
        add("lm_head.weight".into(), vec![spec.vocab, h], 0.3, 0.0);
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (shape, data))| {
            (
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), data).expect("view"),
            )
        })
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": f,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": spec.vocab,
        "tie_word_embeddings": spec.tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}
