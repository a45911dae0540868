//! Weights from `*.safetensors`: memory-mapped, a single file or shards listed in
//! `model.safetensors.index.json`, stored as f32, f16 or bf16 and converted to the dtype the model
//! runs in.

use super::ModelError;
use half::{bf16, f16};
use kvgate_kernels::{DType, WeightData};
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
}

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
        for path in names {
            let file = std::fs::File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: the file is opened read-only and the map is never written; a concurrent
            // truncation by another process would be a caller error, as with every mmap loader.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| ModelError::weights(&path, e))?;
            for name in st.names() {
                owner.insert(name.to_string(), files.len());
            }
            files.push((path, map));
        }
        Ok(Safetensors { files, owner })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.owner.contains_key(name)
    }

    /// Tensor `name` as `dtype`, with its shape. The error names the file and the tensor.
    pub fn load(&self, name: &str, dtype: DType) -> Result<(WeightData, Vec<usize>), ModelError> {
        let (path, map) = self
            .owner
            .get(name)
            .map(|&i| &self.files[i])
            .ok_or_else(|| ModelError::MissingTensor(name.to_owned()))?;
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
}

fn convert(bytes: &[u8], width: usize, read: impl Fn(&[u8]) -> f32, dtype: DType) -> WeightData {
    let values = bytes.chunks_exact(width).map(read);
    match dtype {
        DType::F32 => WeightData::F32(values.collect()),
        DType::F16 => WeightData::F16(values.map(f16::from_f32).collect()),
        DType::BF16 => WeightData::BF16(values.map(bf16::from_f32).collect()),
    }
}
