//! Reader and dequantization tests against GGUF images written by [`super::test_writer`], with
//! expected values computed here from the ggml formulas and hand-written f16/bf16 bit patterns.

use super::test_writer::*;
use super::{GgmlType, GgufError, GgufFile, MetaValue};

/// `(f16 bits, value)` pairs, from the IEEE binary16 definition.
const F16_CASES: [(u16, f32); 8] = [
    (0x3C00, 1.0),
    (0xC000, -2.0),
    (0x3800, 0.5),
    (0x3555, 0.333_251_95),
    (0x7BFF, 65504.0),
    (0x0001, 5.960_464_5e-8),
    (0x8000, -0.0),
    (0x4248, 3.140_625),
];

fn f16_bits(bits: &[u16]) -> Vec<u8> {
    bits.iter().flat_map(|b| b.to_le_bytes()).collect()
}

/// One Q8_0 block: f16 scale then 32 signed bytes.
fn q8_0_block(d_bits: u16, q: &[i8; 32]) -> Vec<u8> {
    let mut b = d_bits.to_le_bytes().to_vec();
    b.extend(q.iter().map(|&v| v as u8));
    b
}

/// Packs 32 nibbles: byte j holds nibble j (low) and nibble j + 16 (high).
fn pack_nibbles(q: &[u8; 32]) -> Vec<u8> {
    (0..16).map(|j| q[j] | (q[j + 16] << 4)).collect()
}

pub(super) struct Fixture {
    pub(super) image: Vec<u8>,
    expected: Vec<(&'static str, Vec<f32>)>,
}

/// One tensor of every supported type plus two the dequantizer must refuse.
pub(super) fn fixture(alignment: Option<u32>) -> Fixture {
    let mut expected = Vec::new();
    let mut b = GgufBuilder::new();
    if let Some(a) = alignment {
        b = b.alignment(a);
    }

    let f32_vals = [1.5f32, -2.25, 0.0, 1e-7, 3.0e8, -0.125];
    b = b.tensor("f32", &[3, 2], 0, f32_bytes(&f32_vals));
    expected.push(("f32", f32_vals.to_vec()));

    let (bits, vals): (Vec<u16>, Vec<f32>) = F16_CASES.iter().copied().unzip();
    b = b.tensor("f16", &[8], 1, f16_bits(&bits));
    expected.push(("f16", vals));

    // bf16 is the top half of an f32, so exactly representable values round-trip by shifting.
    let bf_bits = [0x3F80u16, 0xC060, 0x3C00, 0x7149, 0xC780, 0x0000];
    let bf_vals = [1.0f32, -3.5, 0.007_812_5, 9.953_038e29, -65536.0, 0.0];
    assert!(bf_bits
        .iter()
        .zip(bf_vals)
        .all(|(&b, v)| f32::from_bits(u32::from(b) << 16) == v));
    b = b.tensor("bf16", &[6], 30, f16_bits(&bf_bits));
    expected.push(("bf16", bf_vals.to_vec()));

    // Q8_0, two rows of one block: d = 0.5 and d = -2.0.
    let mut data = Vec::new();
    let mut vals = Vec::new();
    for (d_bits, d) in [(0x3800u16, 0.5f32), (0xC000, -2.0)] {
        let q: [i8; 32] = std::array::from_fn(|i| (i as i8 - 16) * 4 - i8::from(i == 0) * 60);
        data.extend(q8_0_block(d_bits, &q));
        vals.extend(q.iter().map(|&v| d * f32::from(v)));
    }
    b = b.tensor("q8_0", &[32, 2], 8, data);
    expected.push(("q8_0", vals));

    // Q4_0, one row of two blocks: w = d * (q - 8).
    let mut data = Vec::new();
    let mut vals = Vec::new();
    for (d_bits, d) in [(0x3400u16, 0.25f32), (0x4200, 3.0)] {
        let q: [u8; 32] = std::array::from_fn(|i| ((i * 7 + 3) % 16) as u8);
        data.extend(d_bits.to_le_bytes());
        data.extend(pack_nibbles(&q));
        vals.extend(q.iter().map(|&v| d * (f32::from(v) - 8.0)));
    }
    b = b.tensor("q4_0", &[64], 2, data);
    expected.push(("q4_0", vals));

    // Q4_1, two rows of one block: w = d * q + m.
    let mut data = Vec::new();
    let mut vals = Vec::new();
    for (d_bits, d, m_bits, m) in [
        (0x3800u16, 0.5f32, 0xBC00u16, -1.0f32),
        (0x2E66, 0.099_975_586, 0x4500, 5.0),
    ] {
        let q: [u8; 32] = std::array::from_fn(|i| (15 - (i * 5) % 16) as u8);
        data.extend(d_bits.to_le_bytes());
        data.extend(m_bits.to_le_bytes());
        data.extend(pack_nibbles(&q));
        vals.extend(q.iter().map(|&v| d * f32::from(v) + m));
    }
    b = b.tensor("q4_1", &[32, 2], 3, data);
    expected.push(("q4_1", vals));

    // The unknown type goes first: its size is unknowable, and a file cut inside the last
    // tensor must still be caught by that tensor's known size.
    b = b.tensor("mystery", &[4], 99, vec![0; 4]);
    b = b.tensor("q4_k", &[256], 12, vec![0; 144]);
    Fixture {
        image: b.build(),
        expected,
    }
}

#[test]
fn dequantizes_every_supported_type() {
    for alignment in [None, Some(64), Some(8)] {
        let fx = fixture(alignment);
        let file = GgufFile::from_bytes("fixture.gguf", fx.image).unwrap();
        assert_eq!(file.version(), 3);
        let align = u64::from(alignment.unwrap_or(32));
        assert_eq!(file.alignment(), align);
        assert_eq!(file.data_offset() % align, 0);
        for (name, want) in &fx.expected {
            let got = file.dequantize(file.tensor(name).unwrap()).unwrap();
            assert_eq!(got.len(), want.len(), "{name}");
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits() || (g - w).abs() <= 1e-6 * w.abs(),
                    "{name}[{i}]: {g} != {w}"
                );
            }
        }
    }
}

#[test]
fn tensor_infos_keep_gguf_dims_and_types() {
    let file = GgufFile::from_bytes("fixture.gguf", fixture(None).image).unwrap();
    let names: Vec<_> = file.tensors().iter().map(|t| t.name()).collect();
    assert_eq!(
        names,
        ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "mystery", "q4_k"]
    );
    let t = file.tensor("q4_1").unwrap();
    assert_eq!(t.dims(), [32, 2]);
    assert_eq!(t.shape(), [2, 32]);
    assert_eq!(t.ggml_type(), GgmlType::Q4_1);
    assert_eq!(t.byte_len(), Some(40));
    assert_eq!(file.tensor_bytes(t).unwrap().len(), 40);
}

#[test]
fn unsupported_types_name_the_tensor_and_type() {
    let file = GgufFile::from_bytes("fixture.gguf", fixture(None).image).unwrap();
    let err = file.dequantize(file.tensor("q4_k").unwrap()).unwrap_err();
    assert!(matches!(
        &err,
        GgufError::UnsupportedTensorType { tensor, ggml_type, .. }
            if tensor == "q4_k" && *ggml_type == GgmlType::Q4_K
    ));
    let msg = err.to_string();
    assert!(
        msg.contains("fixture.gguf") && msg.contains("q4_k") && msg.contains("Q4_K"),
        "{msg}"
    );
    let err = file
        .dequantize(file.tensor("mystery").unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("unknown ggml type 99"), "{err}");
    assert_eq!(err.code(), "gguf_unsupported_tensor_type");
}

#[test]
fn reads_every_metadata_type() {
    let nested = {
        let mut v = T_ARRAY.to_le_bytes().to_vec();
        v.extend(2u64.to_le_bytes());
        for inner in [[1u8, 2].as_slice(), &[3]] {
            v.extend(T_U8.to_le_bytes());
            v.extend((inner.len() as u64).to_le_bytes());
            v.extend(inner);
        }
        v
    };
    let image = GgufBuilder::new()
        .raw("u8", T_U8, &[200])
        .raw("i8", T_I8, &[0xFE])
        .raw("u16", T_U16, &60000u16.to_le_bytes())
        .raw("i16", T_I16, &(-300i16).to_le_bytes())
        .u32("u32", 4_000_000_000)
        .raw("i32", T_I32, &(-5i32).to_le_bytes())
        .f32("f32", 1e-5)
        .bool("bool", true)
        .str("str", "héllo")
        .raw("u64", T_U64, &u64::MAX.to_le_bytes())
        .raw("i64", T_I64, &i64::MIN.to_le_bytes())
        .raw("f64", T_F64, &0.1f64.to_le_bytes())
        .str_array("strs", &["a", "", "<|im_start|>"])
        .i32_array("ints", &[1, -2, 3])
        .raw("nested", T_ARRAY, &nested)
        .build();
    let file = GgufFile::from_bytes("meta.gguf", image).unwrap();
    assert_eq!(file.get("u8"), Some(&MetaValue::U8(200)));
    assert_eq!(file.get("i8"), Some(&MetaValue::I8(-2)));
    assert_eq!(file.meta_u64("u16").unwrap(), 60000);
    assert_eq!(file.get("i16").unwrap().as_i64(), Some(-300));
    assert_eq!(file.meta_u64("u32").unwrap(), 4_000_000_000);
    assert!(file.meta_u64("i32").is_err());
    assert_eq!(file.meta_f64("f32").unwrap(), 1e-5);
    assert_eq!(file.meta_bool_opt("bool").unwrap(), Some(true));
    assert_eq!(file.meta_str("str").unwrap(), "héllo");
    assert_eq!(file.meta_u64("u64").unwrap(), u64::MAX);
    assert_eq!(file.get("i64"), Some(&MetaValue::I64(i64::MIN)));
    assert_eq!(file.meta_f64("f64").unwrap(), 0.1);
    assert_eq!(
        file.meta_str_array("strs").unwrap(),
        ["a", "", "<|im_start|>"]
    );
    assert_eq!(
        file.meta_i64_array_opt("ints").unwrap(),
        Some(vec![1, -2, 3])
    );
    let nested = file.get("nested").unwrap().as_array().unwrap();
    assert_eq!(
        nested[0],
        MetaValue::Array(vec![MetaValue::U8(1), MetaValue::U8(2)])
    );
    assert_eq!(file.meta_u64_opt("absent").unwrap(), None);
    let err = file.meta_str("absent").unwrap_err();
    assert!(matches!(err, GgufError::MissingMetadata { ref key, .. } if key == "absent"));
    let err = file.meta_str("u8").unwrap_err();
    assert!(
        err.to_string().contains("`u8` is u8, expected a string"),
        "{err}"
    );
    assert!(file.meta_str_array("ints").is_err());
    assert_eq!(file.tensors().len(), 0);
}
