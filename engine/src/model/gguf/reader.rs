//! [`GgufFile`]: a memory-mapped GGUF v3 file, its metadata and its tensor table.
//!
//! Layout (little-endian): magic `GGUF`, version u32, tensor count u64, metadata count u64; the
//! metadata as (key string, value type u32, value); the tensor infos as (name, n_dims u32,
//! dims u64 x n_dims innermost first, ggml type u32, offset u64); then, at the next multiple of
//! `general.alignment` (default 32), the tensor data, each tensor at its offset from there.
//! Strings are a u64 byte length and UTF-8 bytes; arrays are an element type u32, a u64 count
//! and the elements.
//!
//! Parsing is one pass over the header, O(header bytes); every read is bounds-checked against
//! the file length and every tensor's data range is checked at open, so a truncated or corrupt
//! file is an error, never a panic. Tensor data stays in the mapping until asked for.

use super::dequant::{self, DequantError, GgmlType};
use super::{metadata, GgufError};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

pub use super::metadata::MetaValue;

const MAGIC: [u8; 4] = *b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;

/// One entry of the tensor table. `dims` are in GGUF order, innermost first: dims `[cols, rows]`
/// describe a row-major `(rows, cols)` matrix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    offset: u64,
    elements: u64,
}

impl TensorInfo {
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Dimensions, innermost first.
    pub fn dims(&self) -> &[u64] {
        &self.dims
    }
    pub fn ggml_type(&self) -> GgmlType {
        self.ggml_type
    }
    /// Offset of the data from the start of the data section.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    pub fn n_elements(&self) -> u64 {
        self.elements
    }
    /// Size of the data, or `None` for a type this reader does not know.
    pub fn byte_len(&self) -> Option<u64> {
        dequant::byte_size(self.ggml_type, self.elements)
    }
    /// The shape outermost first, as PyTorch and safetensors write it.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

enum Storage {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file. Tensor data is read from the mapping on demand.
pub struct GgufFile {
    path: PathBuf,
    storage: Storage,
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io {
            file: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        if file.metadata().map_err(io)?.len() == 0 {
            // Zero-length mappings are not portable; an empty file is simply truncated.
            return Self::parse(path.to_path_buf(), Storage::Owned(Vec::new()));
        }
        // SAFETY: the mapping is read-only and every access is bounds-checked against its length;
        // a file truncated by another process while mapped is outside what any reader can guard
        // against (the same contract as llama.cpp and safetensors).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path.to_path_buf(), Storage::Mmap(mmap))
    }

    /// Parses an in-memory GGUF image; `path` only names it in errors.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(path.into(), Storage::Owned(bytes))
    }

    fn parse(path: PathBuf, storage: Storage) -> Result<Self, GgufError> {
        let header = Header::parse(&path, storage.bytes())?;
        Ok(Self {
            path,
            storage,
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            alignment: header.alignment,
            data_offset: header.data_offset,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn version(&self) -> u32 {
        self.version
    }
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
    /// Absolute file offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }
    /// Tensors in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }
    /// The tensor called `name` (a linear scan: tables hold a few hundred entries).
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of `tensor`.
    pub fn tensor_bytes(&self, tensor: &TensorInfo) -> Result<&[u8], GgufError> {
        let len = tensor
            .byte_len()
            .ok_or_else(|| self.unsupported_type(tensor))?;
        let bytes = self.storage.bytes();
        let range = tensor_range(self.data_offset, tensor.offset, len, bytes.len() as u64)
            .map_err(|(offset, end)| GgufError::Truncated {
                file: self.path.clone(),
                what: format!("data of tensor `{}`", tensor.name),
                offset,
                end,
                len: bytes.len() as u64,
            })?;
        Ok(&bytes[range])
    }

    /// `tensor` decoded to `f32`, in row-major order (innermost dimension fastest).
    pub fn dequantize(&self, tensor: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        if !tensor.ggml_type.is_supported() {
            return Err(self.unsupported_type(tensor));
        }
        let bytes = self.tensor_bytes(tensor)?;
        dequant::dequantize(tensor.ggml_type, bytes, tensor.elements).map_err(|e| match e {
            DequantError::Unsupported(_) => self.unsupported_type(tensor),
            DequantError::Length { .. } => GgufError::TensorShape {
                file: self.path.clone(),
                tensor: tensor.name.clone(),
                reason: e.to_string(),
            },
        })
    }

    fn unsupported_type(&self, tensor: &TensorInfo) -> GgufError {
        GgufError::UnsupportedTensorType {
            file: self.path.clone(),
            tensor: tensor.name.clone(),
            ggml_type: tensor.ggml_type,
        }
    }
}

/// The byte range `data_offset + offset .. + len` if it lies within `file_len`; else the
/// requested `(start, end)` (saturated) for the error.
fn tensor_range(
    data_offset: u64,
    offset: u64,
    len: u64,
    file_len: u64,
) -> Result<std::ops::Range<usize>, (u64, u64)> {
    let start = data_offset.saturating_add(offset);
    let end = start.saturating_add(len);
    if end > file_len || end == u64::MAX {
        return Err((start, end));
    }
    // Both are at most the file length, which is a `usize`.
    Ok(start as usize..end as usize)
}

/// Everything before the tensor data.
struct Header {
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

impl Header {
    fn parse(path: &Path, bytes: &[u8]) -> Result<Self, GgufError> {
        let mut cur = metadata::Cursor::new(path, bytes);
        let magic = cur.take(4, "magic")?;
        if magic != MAGIC {
            let mut found = [0u8; 4];
            found.copy_from_slice(magic);
            return Err(GgufError::BadMagic {
                file: path.to_path_buf(),
                found,
            });
        }
        let version = cur.u32("version")?;
        // v2 has the same layout as v3 (v3 only added big-endian files, which read as a bogus
        // version here); v1 used 32-bit counts.
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion {
                file: path.to_path_buf(),
                version,
            });
        }
        let n_tensors = cur.u64("tensor count")?;
        let n_kv = cur.u64("metadata count")?;
        let metadata = cur.metadata(n_kv)?;
        let alignment = alignment(path, &metadata)?;
        let mut tensors = Vec::with_capacity(n_tensors.min(4096) as usize);
        for i in 0..n_tensors {
            tensors.push(read_tensor_info(&mut cur, i, alignment)?);
        }
        let data_offset = cur
            .position()
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| invalid(path, "data offset", "overflows"))?;
        let header = Self {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
        };
        header.check_tensors(path, bytes.len() as u64)?;
        Ok(header)
    }

    /// Names are unique and every tensor of a known type lies inside the file.
    fn check_tensors(&self, path: &Path, file_len: u64) -> Result<(), GgufError> {
        let mut names = std::collections::HashSet::with_capacity(self.tensors.len());
        for t in &self.tensors {
            if !names.insert(t.name.as_str()) {
                return Err(invalid(
                    path,
                    "tensor table",
                    format!("duplicate `{}`", t.name),
                ));
            }
            if let Some((block, _)) = t.ggml_type.block_layout() {
                if t.dims.first().copied().unwrap_or(1) % block != 0 {
                    return Err(GgufError::TensorShape {
                        file: path.to_path_buf(),
                        tensor: t.name.clone(),
                        reason: format!(
                            "row length {:?} is not a multiple of the {} block size {block}",
                            t.dims.first(),
                            t.ggml_type
                        ),
                    });
                }
            }
            if let Some(len) = t.byte_len() {
                tensor_range(self.data_offset, t.offset, len, file_len).map_err(
                    |(offset, end)| GgufError::Truncated {
                        file: path.to_path_buf(),
                        what: format!("data of tensor `{}`", t.name),
                        offset,
                        end,
                        len: file_len,
                    },
                )?;
            }
        }
        Ok(())
    }
}

fn alignment(path: &Path, metadata: &BTreeMap<String, MetaValue>) -> Result<u64, GgufError> {
    let Some(value) = metadata.get("general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let align = value.as_u64().ok_or_else(|| GgufError::MetadataType {
        file: path.to_path_buf(),
        key: "general.alignment".into(),
        expected: "an unsigned integer",
        found: value.type_name(),
    })?;
    if align == 0 || !align.is_power_of_two() {
        return Err(invalid(
            path,
            "general.alignment",
            format!("{align} is not a power of two"),
        ));
    }
    Ok(align)
}

fn read_tensor_info(
    cur: &mut metadata::Cursor<'_>,
    index: u64,
    alignment: u64,
) -> Result<TensorInfo, GgufError> {
    let what = |field: &str| format!("tensor info {index} {field}");
    let name = cur.string(&what("name"))?;
    let n_dims = cur.u32(&what("n_dims"))?;
    if n_dims > MAX_DIMS {
        return Err(cur.invalid(format!("tensor `{name}`"), format!("{n_dims} dimensions")));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(cur.u64(&what("dims"))?);
    }
    let elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| {
            acc.checked_mul(d).filter(|&n| n < i64::MAX as u64)
        })
        .ok_or_else(|| {
            cur.invalid(
                format!("tensor `{name}`"),
                format!("dims {dims:?} overflow"),
            )
        })?;
    let ggml_type = GgmlType(cur.u32(&what("type"))?);
    let offset = cur.u64(&what("offset"))?;
    if offset % alignment != 0 {
        return Err(cur.invalid(
            format!("tensor `{name}`"),
            format!("offset {offset} is not a multiple of the alignment {alignment}"),
        ));
    }
    Ok(TensorInfo {
        name,
        dims,
        ggml_type,
        offset,
        elements,
    })
}

pub(super) fn invalid(
    path: &Path,
    what: impl Into<String>,
    reason: impl Into<String>,
) -> GgufError {
    GgufError::Invalid {
        file: path.to_path_buf(),
        what: what.into(),
        reason: reason.into(),
    }
}
