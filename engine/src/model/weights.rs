//! Weights from `*.safetensors`: memory-mapped, a single file or shards listed in
//! `model.safetensors.index.json`, stored as f32, f16 or bf16 and converted to the dtype the model
//! runs in, or stored as block-quantized bytes.
//!
//! A quantized tensor (as `kvgate model import` keeps a GGUF's Q8_0/Q4_1 tensors) is a `U8`
//! tensor of shape `[rows, blocks per row * block bytes]` holding the blocks in GGUF layout, and
//! the file's `__metadata__` names its format: `"kvgate.quant.<tensor name>": "q4_1"`.

use super::ModelError;
use half::{bf16, f16};
use kvgate_kernels::quant::{self, BlockQ4_1, BlockQ8_0};
use kvgate_kernels::{DType, Quant, WeightData};
use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The safetensors files of one model directory.
#[derive(Debug)]
pub struct Safetensors {
    files: Vec<(PathBuf, Mmap)>,
    /// Tensor name -> index into `files`.
    owner: HashMap<String, usize>,
    /// Tensors stored as quantized blocks, and their format.
    quantized: HashMap<String, Quant>,
}

/// The metadata key that marks tensor `name` as quantized.
pub const QUANT_KEY_PREFIX: &str = "kvgate.quant.";

impl Safetensors {
    /// Opens `dir/model.safetensors`, or the shards named by `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        let names: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::weights(&index, e))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::weights(&index, "weight_map: missing"))?;
            let mut files: Vec<PathBuf> = map
                .values()
                .filter_map(|v| v.as_str())
                .map(|f| dir.join(f))
                .collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut files = Vec::new();
        let mut owner = HashMap::new();
        let mut quantized = HashMap::new();
        for path in names {
            let file = std::fs::File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: the file is opened read-only and the map is never written; a concurrent
            // truncation by another process would be a caller error, as with every mmap loader.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| ModelError::weights(&path, e))?;
            for name in st.names() {
                owner.insert(name.to_string(), files.len());
            }
            let (_, meta) =
                SafeTensors::read_metadata(&map).map_err(|e| ModelError::weights(&path, e))?;
            for (key, value) in meta.metadata().iter().flatten() {
                let Some(name) = key.strip_prefix(QUANT_KEY_PREFIX) else {
                    continue;
                };
                let q = Quant::parse(value).ok_or_else(|| {
                    ModelError::weights(&path, format!("{name}: unknown quantization `{value}`"))
                })?;
                quantized.insert(name.to_owned(), q);
            }
            files.push((path, map));
        }
        Ok(Safetensors {
            files,
            owner,
            quantized,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.owner.contains_key(name)
    }

    /// Tensor `name` as `dtype`, with its shape. The error names the file and the tensor.
    pub fn load(&self, name: &str, dtype: DType) -> Result<(WeightData, Vec<usize>), ModelError> {
        if self.quantized.contains_key(name) {
            let (data, shape) = self.load_blocks(name)?;
            return Ok((data.dequantize(dtype), shape));
        }
        let (path, map) = self.file_of(name)?;
        let st = SafeTensors::deserialize(map).map_err(|e| ModelError::weights(path, e))?;
        let view = st.tensor(name).map_err(|e| ModelError::weights(path, e))?;
        let bytes = view.data();
        let data = match view.dtype() {
            StDtype::F32 => convert(
                bytes,
                4,
                |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                dtype,
            ),
            StDtype::F16 => convert(
                bytes,
                2,
                |b| f16::from_le_bytes([b[0], b[1]]).to_f32(),
                dtype,
            ),
            StDtype::BF16 => convert(
                bytes,
                2,
                |b| bf16::from_le_bytes([b[0], b[1]]).to_f32(),
                dtype,
            ),
            other => {
                return Err(ModelError::weights(
                    path,
                    format!("{name}: unsupported tensor dtype {other:?} (f32, f16, bf16)"),
                ))
            }
        };
        Ok((data, view.shape().to_vec()))
    }

    /// Matrix `name` in `quant` blocks, with its shape: kept as stored when it is stored in
    /// that format, quantized from its values otherwise (rows must be whole blocks).
    pub fn load_quantized(
        &self,
        name: &str,
        q: Quant,
    ) -> Result<(WeightData, Vec<usize>), ModelError> {
        if self.quantized.get(name) == Some(&q) {
            return self.load_blocks(name);
        }
        let (data, shape) = self.load(name, DType::F32)?;
        let WeightData::F32(values) = data else {
            unreachable!("loaded as f32")
        };
        let cols = shape.last().copied().unwrap_or(0);
        if !cols.is_multiple_of(quant::QK) {
            let (path, _) = self.file_of(name)?;
            return Err(ModelError::weights(
                path,
                format!(
                    "{name}: rows of {cols} values cannot be quantized to {} (blocks of {})",
                    q.name(),
                    quant::QK
                ),
            ));
        }
        Ok((WeightData::quantized(&values, q), shape))
    }

    /// A tensor stored as blocks, with its logical shape `[rows, cols]`.
    fn load_blocks(&self, name: &str) -> Result<(WeightData, Vec<usize>), ModelError> {
        let (path, map) = self.file_of(name)?;
        let q = self.quantized[name];
        let st = SafeTensors::deserialize(map).map_err(|e| ModelError::weights(path, e))?;
        let view = st.tensor(name).map_err(|e| ModelError::weights(path, e))?;
        let bad = |why: String| ModelError::weights(path, format!("{name} ({}): {why}", q.name()));
        if view.dtype() != StDtype::U8 {
            return Err(bad(format!("stored as {:?}, not U8", view.dtype())));
        }
        let &[rows, row_bytes] = view.shape() else {
            return Err(bad(format!(
                "shape {:?} is not [rows, bytes]",
                view.shape()
            )));
        };
        if !row_bytes.is_multiple_of(q.block_bytes()) {
            return Err(bad(format!(
                "{row_bytes} bytes per row is not whole blocks"
            )));
        }
        let cols = row_bytes / q.block_bytes() * quant::QK;
        let data = match q {
            Quant::Q8_0 => quant::parse_blocks::<BlockQ8_0>(view.data()).map(WeightData::Q8_0),
            Quant::Q4_1 => quant::parse_blocks::<BlockQ4_1>(view.data()).map(WeightData::Q4_1),
        }
        .ok_or_else(|| bad("data is not whole blocks".into()))?;
        debug_assert_eq!(data.len(), rows * cols);
        Ok((data, vec![rows, cols]))
    }

    fn file_of(&self, name: &str) -> Result<&(PathBuf, Mmap), ModelError> {
        self.owner
            .get(name)
            .map(|&i| &self.files[i])
            .ok_or_else(|| ModelError::MissingTensor(name.to_owned()))
    }
}

fn convert(bytes: &[u8], width: usize, read: impl Fn(&[u8]) -> f32, dtype: DType) -> WeightData {
    let values = bytes.chunks_exact(width).map(read);
    match dtype {
        DType::F32 => WeightData::F32(values.collect()),
        DType::F16 => WeightData::F16(values.map(f16::from_f32).collect()),
        DType::BF16 => WeightData::BF16(values.map(bf16::from_f32).collect()),
    }
}
