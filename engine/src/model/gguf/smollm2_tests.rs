//! The real default model: SmolLM2-135M-Instruct's Q4_1 GGUF (see docs/golden-outputs.md), imported
//! and checked against its known config and tokenizer ids. Skipped, with a message, when the
//! file has not been extracted to `target/kvgate-test-assets/`.

use super::{import_gguf_with, GgmlType, GgufFile, ImportOptions, StorageDtype};
use serde_json::Value;
use std::path::PathBuf;

const CHATML_PROMPT: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, \
trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
<|im_start|>assistant\n";

/// The extracted GGUF, if present.
fn smollm2_gguf() -> Option<PathBuf> {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/kvgate-test-assets/SmolLM2-135M-Instruct.Q4_1.gguf"
    ));
    path.is_file().then_some(path)
}

#[test]
fn smollm2_gguf_imports_with_known_config_and_tokenizer() {
    let Some(gguf) = smollm2_gguf() else {
        eprintln!("skipping: SmolLM2 GGUF not found under target/kvgate-test-assets/");
        return;
    };
    let file = GgufFile::open(&gguf).unwrap();
    assert_eq!(file.tensors().len(), 272);
    let count = |ty| {
        file.tensors()
            .iter()
            .filter(|t| t.ggml_type() == ty)
            .count()
    };
    assert_eq!(
        (
            count(GgmlType::Q4_1),
            count(GgmlType::F32),
            count(GgmlType::Q8_0)
        ),
        (210, 61, 1)
    );
    drop(file);

    let dir = tempfile::tempdir().unwrap();
    // f16 halves the bytes written; the f32 path is covered by the synthetic model.
    let options = ImportOptions {
        dtype: StorageDtype::F16,
    };
    let mut last = (0, 1);
    let summary = import_gguf_with(&gguf, dir.path(), &options, &mut |d, t| last = (d, t)).unwrap();
    assert_eq!(last.0, last.1);
    assert_eq!(summary.tensors, 272);

    let config: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("config.json")).unwrap()).unwrap();
    for (key, want) in [
        ("num_hidden_layers", 30),
        ("hidden_size", 576),
        ("intermediate_size", 1536),
        ("num_attention_heads", 9),
        ("num_key_value_heads", 3),
        ("vocab_size", 49152),
        ("max_position_embeddings", 8192),
        ("bos_token_id", 1),
        ("eos_token_id", 2),
    ] {
        assert_eq!(config[key], want, "{key}");
    }
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["rope_theta"], 100_000.0);
    assert_eq!(config["rms_norm_eps"], 1e-5);

    let tok_config: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(tok_config["bos_token"], "<|im_start|>");
    assert_eq!(tok_config["eos_token"], "<|im_end|>");
    assert_eq!(tok_config["add_bos_token"], false);
    let template = tok_config["chat_template"].as_str().unwrap();
    assert!(
        template.contains("<|im_start|>")
            && template.contains("You are a helpful AI assistant named SmolLM")
    );

    let tokenizer = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    let ids = tokenizer
        .encode(CHATML_PROMPT, true)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(ids.len(), 37, "{ids:?}");
    assert_eq!(ids[..6], [1, 9690, 198, 2683, 359, 253]);
    assert_eq!(ids[31..], [2, 198, 1, 520, 9531, 198]);
    let ids = tokenizer.encode("The quick brown fox", true).unwrap();
    assert_eq!(ids.get_ids(), [504, 2365, 6354, 16438]);
    assert_eq!(
        tokenizer
            .decode(&[504, 3575, 282, 4649, 314, 7042, 30], true)
            .unwrap(),
        "The capital of France is Paris."
    );
    let digits = tokenizer.encode("2024", false).unwrap();
    assert_eq!(digits.get_ids().len(), 4, "digits are split one by one");
}
