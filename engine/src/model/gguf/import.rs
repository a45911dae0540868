//! [`import_gguf`]: a llama GGUF file to a Hugging Face-style model directory.
//!
//! Steps: parse the file and its hyperparameters; map every tensor to its HF name and check its
//! shape against the hyperparameters (so nothing is written for a file that cannot be imported
//! whole); build the tokenizer files; then stream the tensors in file order — dequantize,
//! un-permute `attn_q`/`attn_k`, encode as f32 or f16 — into `model.safetensors`. `config.json`
//! is written last, so a directory that has one holds a complete import.
//! Time O(parameters); memory one dequantized tensor at a time.

use super::hf_config::LlamaHparams;
use super::permute::unpermute_qk;
use super::st_writer::{SafetensorsWriter, StDtype, TensorSpec};
use super::{tokenizer, GgmlType, GgufError, GgufFile, TensorInfo};
use crate::model::weights::QUANT_KEY_PREFIX;
use kvgate_kernels::Quant;
use std::path::{Path, PathBuf};

/// How the imported weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StorageDtype {
    #[default]
    F32,
    F16,
    /// Q8_0 and Q4_1 tensors kept as their blocks (the engine runs them as such with
    /// `dtype = "q8_0"` / `"q4_1"`); every other tensor in f32.
    Quantized,
}

impl StorageDtype {
    fn st(self) -> StDtype {
        match self {
            StorageDtype::F32 | StorageDtype::Quantized => StDtype::F32,
            StorageDtype::F16 => StDtype::F16,
        }
    }

    /// The `torch_dtype` of `config.json` (the dense tensors' type).
    pub fn torch_name(self) -> &'static str {
        match self {
            StorageDtype::F32 | StorageDtype::Quantized => "float32",
            StorageDtype::F16 => "float16",
        }
    }

    /// The block format `tensor` is kept in, if this storage keeps it quantized.
    fn keeps(self, tensor: &TensorInfo) -> Option<Quant> {
        let q = match tensor.ggml_type() {
            GgmlType::Q8_0 => Quant::Q8_0,
            GgmlType::Q4_1 => Quant::Q4_1,
            _ => return None,
        };
        let shape = tensor.shape();
        (self == StorageDtype::Quantized && shape.len() == 2).then_some(q)
    }
}

/// Options of [`import_gguf_with`].
#[derive(Debug, Clone, Default)]
pub struct ImportOptions {
    pub dtype: StorageDtype,
}

/// What an import wrote.
#[derive(Debug, Clone)]
pub struct ImportSummary {
    pub hparams: LlamaHparams,
    pub tensors: usize,
    pub parameters: u64,
    pub dtype: StorageDtype,
    /// Every file written, `config.json` last.
    pub files: Vec<PathBuf>,
}

/// Imports `gguf` into `out_dir` with f32 weights. `progress(done, total)` counts GGUF tensor
/// data bytes converted so far; it is called once at the start and after every tensor.
pub fn import_gguf(
    gguf: &Path,
    out_dir: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ImportSummary, GgufError> {
    import_gguf_with(gguf, out_dir, &ImportOptions::default(), progress)
}

/// [`import_gguf`] with a choice of storage type.
pub fn import_gguf_with(
    gguf: &Path,
    out_dir: &Path,
    options: &ImportOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ImportSummary, GgufError> {
    let file = GgufFile::open(gguf)?;
    let hparams = LlamaHparams::from_gguf(&file)?;
    let plan = plan_tensors(&file, &hparams)?;
    let tokenizer_json = tokenizer::tokenizer_json(&file)?;
    let tokenizer_config = tokenizer::tokenizer_config_json(&file, hparams.context_length)?;

    std::fs::create_dir_all(out_dir).map_err(|e| io(out_dir, e))?;
    let weights = write_weights(
        &file,
        &plan,
        options.dtype,
        &out_dir.join("model.safetensors"),
        progress,
    )?;
    let mut files = vec![weights];
    files.push(write_file(out_dir, "tokenizer.json", &tokenizer_json)?);
    files.push(write_json(
        out_dir,
        "tokenizer_config.json",
        &tokenizer_config,
    )?);
    let config = hparams.to_config_json(options.dtype.torch_name());
    files.push(write_json(out_dir, "config.json", &config)?);
    Ok(ImportSummary {
        tensors: plan.len(),
        parameters: plan.iter().map(|p| p.source.n_elements()).sum(),
        hparams,
        dtype: options.dtype,
        files,
    })
}

/// One GGUF tensor and where it goes.
#[derive(Debug)]
struct Planned<'a> {
    source: &'a TensorInfo,
    hf_name: String,
    /// Heads to un-permute the rows for (query and key projections only).
    unpermute_heads: Option<usize>,
}

/// Which tensor a GGUF name is and the shape (outermost first) it must have.
struct Target {
    hf_name: String,
    shape: Vec<usize>,
    unpermute_heads: Option<usize>,
}

fn plan_tensors<'a>(file: &'a GgufFile, hp: &LlamaHparams) -> Result<Vec<Planned<'a>>, GgufError> {
    let mut plan = Vec::with_capacity(file.tensors().len());
    for tensor in file.tensors() {
        let target = target(tensor.name(), hp).ok_or_else(|| GgufError::Unsupported {
            file: file.path().to_path_buf(),
            what: format!(
                "tensor `{}` has no Hugging Face Llama counterpart",
                tensor.name()
            ),
        })?;
        let expected: Vec<u64> = target.shape.iter().map(|&d| d as u64).collect();
        if tensor.shape() != expected {
            return Err(GgufError::TensorShape {
                file: file.path().to_path_buf(),
                tensor: tensor.name().to_string(),
                reason: format!("shape {:?}, expected {expected:?}", tensor.shape()),
            });
        }
        plan.push(Planned {
            source: tensor,
            hf_name: target.hf_name,
            unpermute_heads: target.unpermute_heads,
        });
    }
    for required in required_tensors(hp.n_layers) {
        if file.tensor(&required).is_none() {
            return Err(GgufError::MissingTensor {
                file: file.path().to_path_buf(),
                tensor: required,
            });
        }
    }
    Ok(plan)
}

/// Every GGUF tensor a llama model must have (`output.weight` is optional: tied embeddings).
fn required_tensors(n_layers: usize) -> Vec<String> {
    const PER_LAYER: [&str; 9] = [
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ];
    let mut names = vec![
        "token_embd.weight".to_string(),
        "output_norm.weight".to_string(),
    ];
    for layer in 0..n_layers {
        names.extend(PER_LAYER.iter().map(|t| format!("blk.{layer}.{t}.weight")));
    }
    names
}

/// The HF name and expected shape of a GGUF llama tensor, or `None` for an unknown name.
fn target(name: &str, hp: &LlamaHparams) -> Option<Target> {
    let (hidden, inter, vocab) = (hp.hidden_size, hp.intermediate_size, hp.vocab_size);
    let (q_rows, kv_rows) = (hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim);
    let plain = |hf_name: String, shape| Target {
        hf_name,
        shape,
        unpermute_heads: None,
    };
    match name {
        "token_embd.weight" => {
            return Some(plain(
                "model.embed_tokens.weight".into(),
                vec![vocab, hidden],
            ))
        }
        "output_norm.weight" => return Some(plain("model.norm.weight".into(), vec![hidden])),
        "output.weight" => return Some(plain("lm_head.weight".into(), vec![vocab, hidden])),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, tensor) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok().filter(|&l| l < hp.n_layers)?;
    let prefix = format!("model.layers.{layer}");
    let (suffix, shape, heads) = match tensor {
        "attn_norm.weight" => ("input_layernorm.weight", vec![hidden], None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", vec![hidden], None),
        "attn_q.weight" => (
            "self_attn.q_proj.weight",
            vec![q_rows, hidden],
            Some(hp.n_heads),
        ),
        "attn_k.weight" => (
            "self_attn.k_proj.weight",
            vec![kv_rows, hidden],
            Some(hp.n_kv_heads),
        ),
        "attn_v.weight" => ("self_attn.v_proj.weight", vec![kv_rows, hidden], None),
        "attn_output.weight" => ("self_attn.o_proj.weight", vec![hidden, q_rows], None),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", vec![inter, hidden], None),
        "ffn_up.weight" => ("mlp.up_proj.weight", vec![inter, hidden], None),
        "ffn_down.weight" => ("mlp.down_proj.weight", vec![hidden, inter], None),
        _ => return None,
    };
    Some(Target {
        hf_name: format!("{prefix}.{suffix}"),
        shape,
        unpermute_heads: heads,
    })
}

fn write_weights(
    file: &GgufFile,
    plan: &[Planned<'_>],
    storage: StorageDtype,
    path: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<PathBuf, GgufError> {
    let dtype = storage.st();
    let mut metadata = Vec::new();
    let specs = plan
        .iter()
        .map(|p| match storage.keeps(p.source) {
            Some(q) => {
                metadata.push((
                    format!("{QUANT_KEY_PREFIX}{}", p.hf_name),
                    q.name().to_owned(),
                ));
                let shape = p.source.shape();
                let row_bytes =
                    shape[1] / kvgate_kernels::quant::QK as u64 * q.block_bytes() as u64;
                TensorSpec {
                    name: p.hf_name.clone(),
                    dtype: StDtype::U8,
                    shape: vec![shape[0], row_bytes],
                }
            }
            None => TensorSpec {
                name: p.hf_name.clone(),
                dtype,
                shape: p.source.shape(),
            },
        })
        .collect();
    // Sizes were checked when the file was opened, so every planned tensor has one.
    let byte_len = |p: &Planned<'_>| p.source.byte_len().unwrap_or(0);
    let total: u64 = plan.iter().map(byte_len).sum();
    let mut done = 0;
    progress(done, total);
    let mut writer = SafetensorsWriter::create_with(path, specs, &metadata)?;
    for p in plan {
        if storage.keeps(p.source).is_some() {
            let bytes = kept_blocks(file, p)?;
            writer.write_next(&p.hf_name, &bytes)?;
            done += byte_len(p);
            progress(done, total);
            continue;
        }
        let mut values = file.dequantize(p.source)?;
        if let Some(n_head) = p.unpermute_heads {
            let shape = p.source.shape();
            let (rows, cols) = (shape[0] as usize, shape[1] as usize);
            values =
                unpermute_qk(&values, rows, cols, n_head).map_err(|e| GgufError::TensorShape {
                    file: file.path().to_path_buf(),
                    tensor: p.source.name().to_string(),
                    reason: e.to_string(),
                })?;
        }
        writer.write_next(&p.hf_name, &dtype.encode(&values))?;
        done += byte_len(p);
        progress(done, total);
    }
    writer.finish()
}

/// A quantized tensor's blocks as the file stores them, its rows un-permuted like the values
/// of a dequantized one (each row is a whole number of blocks, so rows move as byte ranges).
fn kept_blocks(file: &GgufFile, p: &Planned<'_>) -> Result<Vec<u8>, GgufError> {
    let bytes = file.tensor_bytes(p.source)?;
    let Some(n_head) = p.unpermute_heads else {
        return Ok(bytes.to_vec());
    };
    let rows = p.source.shape()[0] as usize;
    let row_bytes = bytes.len() / rows.max(1);
    // The permutation of row indices: un-permute a column holding each row's own index.
    let index: Vec<f32> = (0..rows).map(|r| r as f32).collect();
    let order = unpermute_qk(&index, rows, 1, n_head).map_err(|e| GgufError::TensorShape {
        file: file.path().to_path_buf(),
        tensor: p.source.name().to_string(),
        reason: e.to_string(),
    })?;
    let mut out = Vec::with_capacity(bytes.len());
    for src in order {
        let src = src as usize;
        out.extend_from_slice(&bytes[src * row_bytes..(src + 1) * row_bytes]);
    }
    Ok(out)
}

fn write_json(dir: &Path, name: &str, value: &serde_json::Value) -> Result<PathBuf, GgufError> {
    let bytes = serde_json::to_vec_pretty(value).map_err(|source| GgufError::Json {
        file: dir.join(name),
        source,
    })?;
    write_file(dir, name, &bytes)
}

fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf, GgufError> {
    let path = dir.join(name);
    std::fs::write(&path, bytes).map_err(|e| io(&path, e))?;
    Ok(path)
}

fn io(path: &Path, source: std::io::Error) -> GgufError {
    GgufError::Io {
        file: path.to_path_buf(),
        source,
    }
}
