//! What the protocol tests share: the SmolLM2 tokenizer directory.

use std::path::{Path, PathBuf};

/// `target/kvgate-test-assets/smollm2-f32` (scripts/test creates it). Under CI its absence fails
/// the test; elsewhere the test is skipped with a message.
pub fn smollm2_dir() -> Option<PathBuf> {
    let dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/kvgate-test-assets/smollm2-f32");
    if dir.join("tokenizer.json").is_file() {
        return Some(dir);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{} is missing: scripts/test creates it (the SmolLM2 GGUF imported as an f32 model \
         directory), and these tests compare against its tokenizer.json",
        dir.join("tokenizer.json").display()
    );
    eprintln!(
        "skipped: {} is missing (run scripts/test once)",
        dir.join("tokenizer.json").display()
    );
    None
}
