//! Llama hyperparameters from GGUF metadata, and the Hugging Face `config.json` they become.
//!
//! Keys are `{arch}.*` with `arch = general.architecture`; only `llama` (which also covers
//! Mistral and SmolLM GGUFs) is accepted. Absent optional keys take llama.cpp's defaults:
//! `head_count_kv = head_count`, `rope.freq_base = 10000`.

use super::{GgufError, GgufFile};
use serde_json::{json, Value};

/// What the importer and `config.json` need to know about a Llama-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaHparams {
    pub n_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// `{"type": "linear", "factor": f}` when the file asks for linear RoPE scaling.
    pub rope_scaling: Option<Value>,
    pub context_length: u64,
    /// Taken from the embedding matrix, which is what the weights actually hold.
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
}

impl LlamaHparams {
    /// Reads the hyperparameters of `file`; `vocab_size` and tying come from the tensor table.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, GgufError> {
        let arch = file.meta_str("general.architecture")?;
        if arch != "llama" {
            return Err(unsupported(
                file,
                format!("architecture `{arch}` (only llama)"),
            ));
        }
        let key = |k: &str| format!("llama.{k}");
        let usize_of = |k: &str| -> Result<usize, GgufError> {
            let v = file.meta_u64(&key(k))?;
            usize::try_from(v)
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| invalid_value(file, &key(k), v))
        };
        let n_layers = usize_of("block_count")?;
        let hidden_size = usize_of("embedding_length")?;
        let intermediate_size = usize_of("feed_forward_length")?;
        let n_heads = usize_of("attention.head_count")?;
        let n_kv_heads = match file.get(&key("attention.head_count_kv")) {
            Some(_) => usize_of("attention.head_count_kv")?,
            None => n_heads,
        };
        if hidden_size % n_heads != 0 || n_heads % n_kv_heads != 0 {
            return Err(invalid_value(
                file,
                &key("attention.head_count"),
                n_heads as u64,
            ));
        }
        let head_dim = match file.meta_u64_opt(&key("attention.key_length"))? {
            Some(k) => usize::try_from(k)
                .ok()
                .filter(|&k| k > 0)
                .ok_or_else(|| invalid_value(file, &key("attention.key_length"), k))?,
            None => hidden_size / n_heads,
        };
        if let Some(rot) = file.meta_u64_opt(&key("rope.dimension_count"))? {
            if rot != head_dim as u64 {
                return Err(unsupported(
                    file,
                    format!("partial rotary embedding ({rot} of {head_dim} dims)"),
                ));
            }
        }
        let vocab_size = embedding_rows(file, hidden_size)?;
        Ok(Self {
            n_layers,
            hidden_size,
            intermediate_size,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_norm_eps: file.meta_f64(&key("attention.layer_norm_rms_epsilon"))?,
            rope_theta: file
                .meta_f64_opt(&key("rope.freq_base"))?
                .unwrap_or(10_000.0),
            rope_scaling: rope_scaling(file)?,
            context_length: file.meta_u64(&key("context_length"))?,
            vocab_size,
            tie_word_embeddings: file.tensor("output.weight").is_none(),
            bos_token_id: file.meta_u64_opt("tokenizer.ggml.bos_token_id")?,
            eos_token_id: file.meta_u64_opt("tokenizer.ggml.eos_token_id")?,
        })
    }

    /// The `config.json` of a `LlamaForCausalLM`; `torch_dtype` names the stored weights.
    pub fn to_config_json(&self, torch_dtype: &str) -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.context_length,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": false,
            "mlp_bias": false,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": torch_dtype,
        })
    }
}

/// Rows of `token_embd.weight`, checking that its rows are `hidden_size` long.
fn embedding_rows(file: &GgufFile, hidden_size: usize) -> Result<usize, GgufError> {
    let name = "token_embd.weight";
    let t = file.tensor(name).ok_or_else(|| GgufError::MissingTensor {
        file: file.path().to_path_buf(),
        tensor: name.into(),
    })?;
    match *t.dims() {
        [cols, rows] if cols == hidden_size as u64 && rows > 0 => {
            usize::try_from(rows).map_err(|_| invalid_value(file, name, rows))
        }
        _ => Err(GgufError::TensorShape {
            file: file.path().to_path_buf(),
            tensor: name.into(),
            reason: format!(
                "dims {:?}, expected [{hidden_size}, vocab] (innermost first)",
                t.dims()
            ),
        }),
    }
}

fn rope_scaling(file: &GgufFile) -> Result<Option<Value>, GgufError> {
    match file.meta_str_opt("llama.rope.scaling.type")? {
        None | Some("none") => Ok(None),
        Some("linear") => {
            let factor = file.meta_f64("llama.rope.scaling.factor")?;
            Ok(Some(json!({"type": "linear", "factor": factor})))
        }
        Some(other) => Err(unsupported(file, format!("rope scaling `{other}`"))),
    }
}

fn unsupported(file: &GgufFile, what: String) -> GgufError {
    GgufError::Unsupported {
        file: file.path().to_path_buf(),
        what,
    }
}

fn invalid_value(file: &GgufFile, key: &str, value: u64) -> GgufError {
    GgufError::Invalid {
        file: file.path().to_path_buf(),
        what: format!("metadata `{key}`"),
        reason: format!("value {value} is out of range or inconsistent"),
    }
}
