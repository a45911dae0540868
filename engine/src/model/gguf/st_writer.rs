//! A streaming `.safetensors` writer: the header first, from the tensor list, then each tensor's
//! bytes in the same order, so the whole model never has to sit in memory at once.
//!
//! Format: u64 little-endian header length, a JSON header (padded with spaces to a multiple of
//! 8 bytes) mapping each name to `{dtype, shape, data_offsets}`, then the data back to back.
//! The file is written under a `.partial` name and renamed when complete, so an interrupted
//! import never leaves a file that looks whole; a writer dropped unfinished deletes it.

use super::GgufError;
use half::f16;
use serde_json::{json, Map, Value};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Element types the importer stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StDtype {
    F32,
    F16,
    /// Raw bytes (quantized blocks).
    U8,
}

impl StDtype {
    /// The safetensors dtype string.
    pub fn name(self) -> &'static str {
        match self {
            StDtype::F32 => "F32",
            StDtype::F16 => "F16",
            StDtype::U8 => "U8",
        }
    }

    pub fn size(self) -> u64 {
        match self {
            StDtype::F32 => 4,
            StDtype::F16 => 2,
            StDtype::U8 => 1,
        }
    }

    /// `values` as little-endian bytes of this type (f16 rounds to nearest even; never called
    /// for U8, whose bytes are written as they are).
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            StDtype::F32 | StDtype::U8 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            StDtype::F16 => values
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
        }
    }
}

/// One tensor the header announces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: StDtype,
    /// Outermost first.
    pub shape: Vec<u64>,
}

impl TensorSpec {
    fn byte_len(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(self.dtype.size(), |acc, &d| acc.checked_mul(d))
    }
}

/// Writes the tensors announced to [`SafetensorsWriter::create`], in that order.
#[derive(Debug)]
pub struct SafetensorsWriter {
    path: PathBuf,
    partial: PathBuf,
    /// `None` once finished.
    out: Option<BufWriter<File>>,
    specs: Vec<TensorSpec>,
    next: usize,
}

impl SafetensorsWriter {
    /// Creates `path.partial` and writes the header for `specs`.
    pub fn create(path: &Path, specs: Vec<TensorSpec>) -> Result<Self, GgufError> {
        Self::create_with(path, specs, &[])
    }

    /// [`SafetensorsWriter::create`] with extra `__metadata__` entries.
    pub fn create_with(
        path: &Path,
        specs: Vec<TensorSpec>,
        metadata: &[(String, String)],
    ) -> Result<Self, GgufError> {
        let mut header = Map::new();
        let mut meta = Map::new();
        meta.insert("format".into(), "pt".into());
        for (k, v) in metadata {
            meta.insert(k.clone(), v.clone().into());
        }
        header.insert("__metadata__".into(), Value::Object(meta));
        let mut offset = 0u64;
        for spec in &specs {
            let end = spec
                .byte_len()
                .and_then(|len| offset.checked_add(len))
                .ok_or_else(|| writer_error(path, format!("`{}` is too large", spec.name)))?;
            let entry = json!({
                "dtype": spec.dtype.name(),
                "shape": spec.shape,
                "data_offsets": [offset, end],
            });
            if header.insert(spec.name.clone(), entry).is_some() {
                return Err(writer_error(path, format!("`{}` appears twice", spec.name)));
            }
            offset = end;
        }
        let mut json =
            serde_json::to_vec(&Value::Object(header)).map_err(|source| GgufError::Json {
                file: path.to_path_buf(),
                source,
            })?;
        json.resize(json.len().next_multiple_of(8), b' ');

        let mut name = path.as_os_str().to_owned();
        name.push(".partial");
        let partial = PathBuf::from(name);
        let file = File::create(&partial).map_err(|e| io(&partial, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&(json.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(&json))
            .map_err(|e| io(&partial, e))?;
        Ok(Self {
            path: path.to_path_buf(),
            partial,
            out: Some(out),
            specs,
            next: 0,
        })
    }

    /// Writes the next announced tensor; `name` and the length must match the announcement.
    pub fn write_next(&mut self, name: &str, bytes: &[u8]) -> Result<(), GgufError> {
        let spec = self
            .specs
            .get(self.next)
            .ok_or_else(|| writer_error(&self.path, format!("`{name}` was not announced")))?;
        if spec.name != name || spec.byte_len() != Some(bytes.len() as u64) {
            return Err(writer_error(
                &self.path,
                format!(
                    "got `{name}` ({} bytes), expected `{}` ({:?} bytes)",
                    bytes.len(),
                    spec.name,
                    spec.byte_len()
                ),
            ));
        }
        let out = self
            .out
            .as_mut()
            .ok_or_else(|| writer_error(&self.path, "finished".into()))?;
        out.write_all(bytes).map_err(|e| io(&self.partial, e))?;
        self.next += 1;
        Ok(())
    }

    /// Checks every tensor was written, flushes and renames the file into place.
    pub fn finish(mut self) -> Result<PathBuf, GgufError> {
        if self.next != self.specs.len() {
            return Err(writer_error(
                &self.path,
                format!("{} of {} tensors written", self.next, self.specs.len()),
            ));
        }
        let out = self
            .out
            .take()
            .ok_or_else(|| writer_error(&self.path, "finished".into()))?;
        let file = out
            .into_inner()
            .map_err(|e| io(&self.partial, e.into_error()))?;
        file.sync_all().map_err(|e| io(&self.partial, e))?;
        std::fs::rename(&self.partial, &self.path).map_err(|e| io(&self.path, e))?;
        Ok(self.path.clone())
    }
}

impl Drop for SafetensorsWriter {
    fn drop(&mut self) {
        if let Some(out) = self.out.take() {
            drop(out);
            // Best effort: the import is already failing with the error that matters.
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}

fn io(path: &Path, source: std::io::Error) -> GgufError {
    GgufError::Io {
        file: path.to_path_buf(),
        source,
    }
}

fn writer_error(path: &Path, reason: String) -> GgufError {
    GgufError::Invalid {
        file: path.to_path_buf(),
        what: "safetensors output".into(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs() -> Vec<TensorSpec> {
        vec![
            TensorSpec {
                name: "b".into(),
                dtype: StDtype::F32,
                shape: vec![2, 1],
            },
            TensorSpec {
                name: "a".into(),
                dtype: StDtype::F16,
                shape: vec![3],
            },
        ]
    }

    #[test]
    fn writes_a_file_the_reference_reader_accepts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let mut w = SafetensorsWriter::create(&path, specs()).unwrap();
        w.write_next("b", &StDtype::F32.encode(&[1.0, -2.0]))
            .unwrap();
        w.write_next("a", &StDtype::F16.encode(&[0.5, 1.0, 65504.0]))
            .unwrap();
        assert_eq!(w.finish().unwrap(), path);
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("b").unwrap().shape(), [2, 1]);
        assert_eq!(
            st.tensor("a").unwrap().data(),
            [0x00, 0x38, 0x00, 0x3C, 0xFF, 0x7B]
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn refuses_out_of_order_tensors_and_cleans_up_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let mut w = SafetensorsWriter::create(&path, specs()).unwrap();
        assert!(w.write_next("a", &[0; 6]).is_err());
        assert!(w.write_next("b", &[0; 7]).is_err());
        w.write_next("b", &[0; 8]).unwrap();
        drop(w);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let mut w = SafetensorsWriter::create(&path, specs()).unwrap();
        w.write_next("b", &[0; 8]).unwrap();
        assert!(w.finish().is_err());
        assert!(!path.exists());
    }
}
