//! A minimal GGUF v3 writer for tests, written from the format description independently of
//! the reader, so the reader is tested against bytes it did not produce.

/// Metadata value type ids.
pub const T_U8: u32 = 0;
pub const T_I8: u32 = 1;
pub const T_U16: u32 = 2;
pub const T_I16: u32 = 3;
pub const T_U32: u32 = 4;
pub const T_I32: u32 = 5;
pub const T_F32: u32 = 6;
pub const T_BOOL: u32 = 7;
pub const T_STRING: u32 = 8;
pub const T_ARRAY: u32 = 9;
pub const T_U64: u32 = 10;
pub const T_I64: u32 = 11;
pub const T_F64: u32 = 12;

/// Builds a GGUF image: metadata, then tensors laid out at aligned offsets.
#[derive(Debug)]
pub struct GgufBuilder {
    kv: Vec<u8>,
    n_kv: u64,
    alignment: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

pub fn string_bytes(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

impl GgufBuilder {
    pub fn new() -> Self {
        Self {
            kv: Vec::new(),
            n_kv: 0,
            alignment: 32,
            tensors: Vec::new(),
        }
    }

    /// A key with a raw, already-encoded value of type `ty`.
    pub fn raw(mut self, key: &str, ty: u32, value: &[u8]) -> Self {
        self.kv.extend(string_bytes(key));
        self.kv.extend_from_slice(&ty.to_le_bytes());
        self.kv.extend_from_slice(value);
        self.n_kv += 1;
        self
    }

    pub fn u32(self, key: &str, v: u32) -> Self {
        self.raw(key, T_U32, &v.to_le_bytes())
    }

    pub fn f32(self, key: &str, v: f32) -> Self {
        self.raw(key, T_F32, &v.to_le_bytes())
    }

    pub fn bool(self, key: &str, v: bool) -> Self {
        self.raw(key, T_BOOL, &[u8::from(v)])
    }

    pub fn str(self, key: &str, v: &str) -> Self {
        self.raw(key, T_STRING, &string_bytes(v))
    }

    pub fn str_array(self, key: &str, items: &[&str]) -> Self {
        let mut v = T_STRING.to_le_bytes().to_vec();
        v.extend_from_slice(&(items.len() as u64).to_le_bytes());
        items.iter().for_each(|s| v.extend(string_bytes(s)));
        self.raw(key, T_ARRAY, &v)
    }

    pub fn i32_array(self, key: &str, items: &[i32]) -> Self {
        let mut v = T_I32.to_le_bytes().to_vec();
        v.extend_from_slice(&(items.len() as u64).to_le_bytes());
        items
            .iter()
            .for_each(|x| v.extend_from_slice(&x.to_le_bytes()));
        self.raw(key, T_ARRAY, &v)
    }

    /// Sets `general.alignment` and lays tensors out on it.
    pub fn alignment(mut self, alignment: u32) -> Self {
        self.alignment = u64::from(alignment);
        self.u32("general.alignment", alignment)
    }

    /// A tensor with GGUF dims (innermost first), ggml type id and raw data.
    pub fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    pub fn build(self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.n_kv.to_le_bytes());
        out.extend_from_slice(&self.kv);
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            out.extend(string_bytes(name));
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            dims.iter()
                .for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).div_ceil(self.alignment) * self.alignment;
        }
        let data_start = (out.len() as u64).div_ceil(self.alignment) * self.alignment;
        out.resize(data_start as usize, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend_from_slice(data);
        }
        out
    }
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}
