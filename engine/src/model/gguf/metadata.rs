//! GGUF metadata values: the bounds-checked byte [`Cursor`] that decodes them, [`MetaValue`],
//! and typed accessors on [`GgufFile`] whose errors name the key.
//!
//! Value types (u32 ids): 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string,
//! 9 array (element type u32, count u64, elements), 10 u64, 11 i64, 12 f64. Arrays may nest;
//! nesting deeper than [`MAX_DEPTH`] is refused so a hostile file cannot exhaust the stack.

use super::reader::{invalid, GgufFile};
use super::GgufError;
use std::collections::BTreeMap;
use std::path::Path;

/// Deepest array nesting accepted (GGUF files in the wild use one level).
const MAX_DEPTH: u8 = 4;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// A short name of the type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F32(_) => "f32",
            MetaValue::F64(_) => "f64",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }

    /// Any integer that is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            _ => self.as_i64().and_then(|v| u64::try_from(v).ok()),
        }
    }

    /// Any integer that fits an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any number, widened.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            // Through the shortest decimal that round-trips: an f32 `1e-5` widens to
            // 9.99999974e-6, but the writer meant 1e-5 (and it reads back as the same f32).
            MetaValue::F32(v) => v.to_string().parse().ok(),
            MetaValue::F64(v) => Some(v),
            // Integral hyperparameters written as ints (e.g. a rope base of 10000) are fine.
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Typed metadata accessors: a missing key is [`GgufError::MissingMetadata`], a value of the
/// wrong type [`GgufError::MetadataType`]; the `_opt` forms return `None` for a missing key.
impl GgufFile {
    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        convert: impl FnOnce(&'a MetaValue) -> Option<T>,
    ) -> Result<Option<T>, GgufError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        convert(value)
            .map(Some)
            .ok_or_else(|| GgufError::MetadataType {
                file: self.path().to_path_buf(),
                key: key.to_string(),
                expected,
                found: value.type_name(),
            })
    }

    fn required<T>(&self, key: &str, value: Option<T>) -> Result<T, GgufError> {
        value.ok_or_else(|| GgufError::MissingMetadata {
            file: self.path().to_path_buf(),
            key: key.to_string(),
        })
    }

    pub fn meta_u64_opt(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.typed(key, "an unsigned integer", MetaValue::as_u64)
    }
    pub fn meta_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.required(key, self.meta_u64_opt(key)?)
    }
    pub fn meta_f64_opt(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.typed(key, "a number", MetaValue::as_f64)
    }
    pub fn meta_f64(&self, key: &str) -> Result<f64, GgufError> {
        self.required(key, self.meta_f64_opt(key)?)
    }
    pub fn meta_bool_opt(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.typed(key, "a bool", MetaValue::as_bool)
    }
    pub fn meta_str_opt(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.typed(key, "a string", MetaValue::as_str)
    }
    pub fn meta_str(&self, key: &str) -> Result<&str, GgufError> {
        self.required(key, self.meta_str_opt(key)?)
    }
    pub fn meta_str_array_opt(&self, key: &str) -> Result<Option<Vec<&str>>, GgufError> {
        self.typed(key, "an array of strings", |v| {
            v.as_array()?.iter().map(MetaValue::as_str).collect()
        })
    }
    pub fn meta_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.required(key, self.meta_str_array_opt(key)?)
    }
    pub fn meta_i64_array_opt(&self, key: &str) -> Result<Option<Vec<i64>>, GgufError> {
        self.typed(key, "an array of integers", |v| {
            v.as_array()?.iter().map(MetaValue::as_i64).collect()
        })
    }
}

/// A read position in the file image; every read checks the length first.
pub(super) struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(path: &'a Path, bytes: &'a [u8]) -> Self {
        Self {
            path,
            bytes,
            pos: 0,
        }
    }

    pub(super) fn position(&self) -> u64 {
        self.pos as u64
    }

    pub(super) fn invalid(&self, what: impl Into<String>, reason: impl Into<String>) -> GgufError {
        invalid(self.path, what, reason)
    }

    /// The next `n` bytes, or [`GgufError::Truncated`] naming `what`.
    pub(super) fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let remaining = (self.bytes.len() - self.pos) as u64;
        if n > remaining {
            return Err(GgufError::Truncated {
                file: self.path.to_path_buf(),
                what: what.to_string(),
                offset: self.pos as u64,
                end: (self.pos as u64).saturating_add(n),
                len: self.bytes.len() as u64,
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    pub(super) fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    pub(super) fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| self.invalid(what.to_string(), format!("string is not UTF-8: {e}")))
    }

    /// `n` key/value pairs; a repeated key is an error.
    pub(super) fn metadata(&mut self, n: u64) -> Result<BTreeMap<String, MetaValue>, GgufError> {
        let mut map = BTreeMap::new();
        for i in 0..n {
            let key = self.string(&format!("metadata key {i}"))?;
            let what = format!("metadata `{key}`");
            let ty = self.u32(&what)?;
            let value = self.value(ty, &what, 0)?;
            if map.insert(key, value).is_some() {
                return Err(self.invalid(what, "key appears twice"));
            }
        }
        Ok(map)
    }

    fn value(&mut self, ty: u32, what: &str, depth: u8) -> Result<MetaValue, GgufError> {
        Ok(match ty {
            0 => MetaValue::U8(u8::from_le_bytes(self.array(what)?)),
            1 => MetaValue::I8(i8::from_le_bytes(self.array(what)?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(self.invalid(what, format!("bool byte {b}"))),
            },
            8 => MetaValue::String(self.string(what)?),
            9 => self.array_value(what, depth)?,
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => return Err(self.invalid(what, format!("unknown value type {other}"))),
        })
    }

    fn array_value(&mut self, what: &str, depth: u8) -> Result<MetaValue, GgufError> {
        if depth >= MAX_DEPTH {
            return Err(self.invalid(what, "arrays nested too deeply"));
        }
        let elem_ty = self.u32(what)?;
        let n = self.u64(what)?;
        // Every element takes at least one byte, so the remaining length bounds a sane count;
        // capping the reservation keeps a lying count from allocating before it fails.
        let cap = n.min((self.bytes.len() - self.pos) as u64).min(1 << 20);
        let mut items = Vec::with_capacity(cap as usize);
        for _ in 0..n {
            items.push(self.value(elem_ty, what, depth + 1)?);
        }
        Ok(MetaValue::Array(items))
    }
}
