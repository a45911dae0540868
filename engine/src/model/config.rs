//! `config.json` of a Llama-family model (Llama 2/3, Qwen2, Mistral, SmolLM), parsed once into a
//! typed, validated [`ModelConfig`].

use super::ModelError;
use serde::Deserialize;
use std::path::Path;

/// Llama-3 frequency scaling of RoPE.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// What the forward pass needs to know about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `llama`, `qwen2`, `mistral`.
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_llama3: Option<Llama3Scaling>,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    /// Biases on the Q, K and V projections (Qwen2).
    pub attention_bias: bool,
    pub bos_token_id: Option<u32>,
    /// Token ids that end generation.
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct Raw {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    rope_theta: f64,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    vocab_size: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    attention_bias: Option<bool>,
    #[serde(default)]
    hidden_act: Option<String>,
    bos_token_id: Option<u32>,
    #[serde(default)]
    eos_token_id: Option<serde_json::Value>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_max_pos() -> usize {
    2048
}

const SUPPORTED: [&str; 4] = ["llama", "qwen2", "mistral", "smollm"];

impl ModelConfig {
    /// Reads and validates `dir/config.json`.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        Self::parse(&text).map_err(|reason| ModelError::Config {
            file: path.display().to_string(),
            reason,
        })
    }

    /// Parses `config.json` text; the error names the offending field.
    pub fn parse(text: &str) -> Result<Self, String> {
        let raw: Raw = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let model_type = raw
            .model_type
            .clone()
            .or_else(|| {
                raw.architectures
                    .first()
                    .map(|a| a.trim_end_matches("ForCausalLM").to_lowercase())
            })
            .ok_or("model_type: missing (and no architectures)")?;
        if !SUPPORTED.contains(&model_type.as_str()) {
            return Err(format!(
                "model_type: unsupported architecture {model_type:?} (supported: {})",
                SUPPORTED.join(", ")
            ));
        }
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return Err(format!("hidden_act: {act:?} is not supported (only silu)"));
            }
        }
        let heads = raw.num_attention_heads;
        let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
        let positive = [
            ("hidden_size", raw.hidden_size),
            ("intermediate_size", raw.intermediate_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("vocab_size", raw.vocab_size),
            ("max_position_embeddings", raw.max_position_embeddings),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(format!("{field}: must be positive"));
            }
        }
        if !heads.is_multiple_of(kv_heads) {
            return Err(format!(
                "num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}"
            ));
        }
        let head_dim = raw.head_dim.unwrap_or(raw.hidden_size / heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(format!("head_dim: {head_dim} must be positive and even"));
        }
        if raw.head_dim.is_none() && !raw.hidden_size.is_multiple_of(heads) {
            return Err("hidden_size: not a multiple of num_attention_heads".into());
        }
        Ok(ModelConfig {
            attention_bias: raw.attention_bias.unwrap_or(model_type == "qwen2"),
            model_type,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps as f32,
            rope_theta: raw.rope_theta as f32,
            rope_llama3: parse_rope_scaling(raw.rope_scaling.as_ref())?,
            max_position_embeddings: raw.max_position_embeddings,
            vocab_size: raw.vocab_size,
            tie_word_embeddings: raw.tie_word_embeddings,
            bos_token_id: raw.bos_token_id,
            eos_token_ids: parse_eos(raw.eos_token_id.as_ref())?,
        })
    }
}

fn parse_eos(v: Option<&serde_json::Value>) -> Result<Vec<u32>, String> {
    let as_id = |v: &serde_json::Value| {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| format!("eos_token_id: {v} is not a token id"))
    };
    match v {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(items)) => items.iter().map(as_id).collect(),
        Some(one) => Ok(vec![as_id(one)?]),
    }
}

fn parse_rope_scaling(v: Option<&serde_json::Value>) -> Result<Option<Llama3Scaling>, String> {
    let Some(obj) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("");
    if kind != "llama3" {
        return Err(format!(
            "rope_scaling: type {kind:?} is not supported (only llama3)"
        ));
    }
    let num = |k: &str| {
        obj.get(k)
            .and_then(|x| x.as_f64())
            .ok_or_else(|| format!("rope_scaling.{k}: missing or not a number"))
    };
    Ok(Some(Llama3Scaling {
        factor: num("factor")? as f32,
        low_freq_factor: num("low_freq_factor")? as f32,
        high_freq_factor: num("high_freq_factor")? as f32,
        original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
        "hidden_size":576,"intermediate_size":1536,"num_hidden_layers":30,"num_attention_heads":9,
        "num_key_value_heads":3,"rms_norm_eps":1e-5,"rope_theta":100000.0,
        "max_position_embeddings":8192,"vocab_size":49152,"tie_word_embeddings":true,
        "bos_token_id":1,"eos_token_id":2,"hidden_act":"silu"}"#;

    #[test]
    fn parses_smollm2() {
        let c = ModelConfig::parse(SMOLLM2).unwrap();
        assert_eq!(
            (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim),
            (30, 9, 3, 64)
        );
        assert!(c.tie_word_embeddings && !c.attention_bias);
        assert_eq!(c.eos_token_ids, vec![2]);
    }

    #[test]
    fn qwen2_has_qkv_bias_and_llama3_scaling_parses() {
        let q = SMOLLM2.replace("\"llama\"", "\"qwen2\"");
        assert!(ModelConfig::parse(&q).unwrap().attention_bias);
        let l3 = SMOLLM2.replace(
            "\"hidden_act\"",
            r#""rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
               "high_freq_factor":4.0,"original_max_position_embeddings":8192},"hidden_act""#,
        );
        assert_eq!(
            ModelConfig::parse(&l3).unwrap().rope_llama3.unwrap().factor,
            8.0
        );
    }

    #[test]
    fn errors_name_the_field() {
        let bad = [
            (SMOLLM2.replace("\"llama\"", "\"gpt2\""), "model_type"),
            (
                SMOLLM2.replace("\"num_key_value_heads\":3", "\"num_key_value_heads\":4"),
                "num_key_value_heads",
            ),
            (
                SMOLLM2.replace("\"vocab_size\":49152", "\"vocab_size\":0"),
                "vocab_size",
            ),
            (
                SMOLLM2.replace("\"hidden_act\":\"silu\"", "\"hidden_act\":\"gelu\""),
                "hidden_act",
            ),
            ("{".to_owned(), "EOF"),
            (SMOLLM2.replace("\"hidden_size\":576,", ""), "hidden_size"),
        ];
        for (text, field) in bad {
            let err = ModelConfig::parse(&text).unwrap_err();
            assert!(err.contains(field), "{err:?} should name {field}");
        }
    }
}
