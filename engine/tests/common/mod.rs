//! Shared helpers of the engine's integration tests: the real SmolLM2 model (imported once) and
//! a tiny random Llama.

#![allow(dead_code)]

pub mod runner;
pub mod tiny;

use kvgate_engine::model::gguf::import_gguf;
use std::path::{Path, PathBuf};

fn assets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/kvgate-test-assets")
}

/// The SmolLM2 GGUF that `scripts/test` fetches. Under CI its absence fails the test; elsewhere
/// the test is skipped with a message.
pub fn smollm2_gguf() -> Option<PathBuf> {
    let path = assets().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{} is missing: scripts/test fetches it",
        path.display()
    );
    eprintln!(
        "skipped: {} is missing (run scripts/test once)",
        path.display()
    );
    None
}

/// SmolLM2 imported as an f32 Hugging Face directory, shared by the tests (imported once; the
/// rename makes concurrent test binaries safe).
pub fn smollm2_dir() -> Option<PathBuf> {
    let gguf = smollm2_gguf()?;
    let dir = assets().join("smollm2-f32");
    if dir.join("config.json").exists() {
        return Some(dir);
    }
    let tmp = assets().join(format!("smollm2-f32.tmp{}", std::process::id()));
    import_gguf(&gguf, &tmp, &mut |_, _| {}).expect("import SmolLM2");
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another test binary won the race.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Some(dir)
}

/// The golden ChatML prompt of docs/golden-outputs.md.
pub const GOLDEN_CHAT_PROMPT_HEAD: [u32; 6] = [1, 9690, 198, 2683, 359, 253];
pub const GOLDEN_CHAT_PROMPT_TAIL: [u32; 6] = [2, 198, 1, 520, 9531, 198];
pub const GOLDEN_CHAT_ANSWER: [u32; 7] = [504, 3575, 282, 4649, 314, 7042, 30];
pub const GOLDEN_FOX_PROMPT: [u32; 4] = [504, 2365, 6354, 16438];
pub const GOLDEN_FOX_ANSWER: [u32; 12] = [
    351, 253, 2365, 6354, 7012, 30, 198, 198, 504, 2798, 6330, 314,
];
