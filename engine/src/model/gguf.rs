//! GGUF v3 reading, dequantization and import into a Hugging Face-style model directory.
