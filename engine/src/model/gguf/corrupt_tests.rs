//! Bad input: every truncation, hand-made corrupt headers and random byte damage are errors
//! with stable codes, never panics.

use super::test_writer::*;
use super::tests::fixture;
use super::{GgufError, GgufFile};

#[test]
fn every_truncation_is_an_error() {
    let image = fixture(None).image;
    for len in 0..image.len() {
        let result = GgufFile::from_bytes("cut.gguf", image[..len].to_vec());
        assert!(
            result.is_err(),
            "a file cut at {len} of {} bytes opened",
            image.len()
        );
    }
    let err = GgufFile::from_bytes("cut.gguf", image[..image.len() - 1].to_vec()).unwrap_err();
    assert!(
        matches!(&err, GgufError::Truncated { what, .. } if what.contains("q4_k")),
        "{err}"
    );
}

/// Header bytes for hand-made corrupt files.
fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut v = b"GGUF".to_vec();
    v.extend(3u32.to_le_bytes());
    v.extend(n_tensors.to_le_bytes());
    v.extend(n_kv.to_le_bytes());
    v
}

fn tensor_info(name: &str, dims: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    let mut v = string_bytes(name);
    v.extend((dims.len() as u32).to_le_bytes());
    dims.iter().for_each(|d| v.extend(d.to_le_bytes()));
    v.extend(ty.to_le_bytes());
    v.extend(offset.to_le_bytes());
    v
}

#[test]
fn corrupt_headers_are_errors_with_codes() {
    let with = |mut head: Vec<u8>, body: &[&[u8]]| {
        body.iter().for_each(|b| head.extend_from_slice(b));
        GgufFile::from_bytes("bad.gguf", head).unwrap_err()
    };
    let kv = |key: &str, ty: u32, value: &[u8]| {
        let mut v = string_bytes(key);
        v.extend(ty.to_le_bytes());
        v.extend_from_slice(value);
        v
    };
    let cases: Vec<(GgufError, &str)> = vec![
        (with(b"GGML\x03\0\0\0".to_vec(), &[]), "gguf_bad_magic"),
        (
            with(b"GGUF\x01\0\0\0".to_vec(), &[]),
            "gguf_unsupported_version",
        ),
        (with(header(0, 1), &[&kv("k", 13, &[])]), "gguf_invalid"),
        (
            with(header(0, 1), &[&kv("k", T_BOOL, &[2])]),
            "gguf_invalid",
        ),
        (
            with(header(0, 1), &[&kv("k", T_STRING, &u64::MAX.to_le_bytes())]),
            "gguf_truncated",
        ),
        (
            with(
                header(0, 1),
                &[&kv("k", T_STRING, &[1, 0, 0, 0, 0, 0, 0, 0, 0xFF])],
            ),
            "gguf_invalid",
        ),
        (
            with(
                header(0, 1),
                &[&kv(
                    "k",
                    T_ARRAY,
                    &[&T_U64.to_le_bytes()[..], &u64::MAX.to_le_bytes()].concat(),
                )],
            ),
            "gguf_truncated",
        ),
        (
            with(header(0, 2), &[&kv("k", T_U8, &[1]), &kv("k", T_U8, &[2])]),
            "gguf_invalid",
        ),
        (
            with(
                header(0, 1),
                &[&kv("general.alignment", T_U32, &3u32.to_le_bytes())],
            ),
            "gguf_invalid",
        ),
        (
            with(
                header(0, 1),
                &[&kv("general.alignment", T_STRING, &string_bytes("x"))],
            ),
            "gguf_metadata_type",
        ),
        (with(header(u64::MAX, 0), &[]), "gguf_truncated"),
        (
            with(header(1, 0), &[&tensor_info("t", &[1, 1, 1, 1, 1], 0, 0)]),
            "gguf_invalid",
        ),
        (
            with(
                header(1, 0),
                &[&tensor_info("t", &[1 << 40, 1 << 40], 0, 0)],
            ),
            "gguf_invalid",
        ),
        (
            with(header(1, 0), &[&tensor_info("t", &[4], 0, 4)]),
            "gguf_invalid",
        ),
        (
            with(header(1, 0), &[&tensor_info("t", &[4], 0, 0)]),
            "gguf_truncated",
        ),
        (
            with(header(1, 0), &[&tensor_info("t", &[16], 2, 0)]),
            "gguf_tensor_shape",
        ),
        (
            with(header(1, 0), &[&tensor_info("t", &[u64::MAX / 8], 0, 0)]),
            "gguf_truncated",
        ),
        (
            with(
                header(2, 0),
                &[
                    &tensor_info("t", &[1], 0, 0),
                    &tensor_info("t", &[1], 0, 32),
                    &[0; 64],
                ],
            ),
            "gguf_invalid",
        ),
    ];
    for (i, (err, code)) in cases.iter().enumerate() {
        assert_eq!(err.code(), *code, "case {i}: {err}");
        assert_eq!(err.file(), std::path::Path::new("bad.gguf"));
    }
}

#[test]
fn random_corruption_never_panics() {
    let image = fixture(None).image;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..2000 {
        let mut bad = image.clone();
        for _ in 0..1 + next() % 4 {
            let at = (next() % bad.len() as u64) as usize;
            bad[at] = next() as u8;
        }
        if let Ok(file) = GgufFile::from_bytes("fuzz.gguf", bad) {
            for t in file.tensors() {
                let _ = file.dequantize(t);
            }
        }
    }
}

#[test]
fn opens_from_disk_and_reports_missing_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.gguf");
    std::fs::write(&path, fixture(None).image).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(
        file.dequantize(file.tensor("f16").unwrap()).unwrap()[0],
        1.0
    );
    let err = GgufFile::open(&dir.path().join("absent.gguf")).unwrap_err();
    assert_eq!(err.code(), "gguf_io");
    assert!(err.to_string().contains("absent.gguf"));
    std::fs::write(&path, b"").unwrap();
    assert_eq!(GgufFile::open(&path).unwrap_err().code(), "gguf_truncated");
}
