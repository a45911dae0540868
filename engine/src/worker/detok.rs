//! Incremental detokenization: the text a new token adds, without re-decoding the whole output.
//!
//! Byte-level BPE can split one character over several tokens, so a token's text is the
//! difference between decoding a short window with and without it; while the window ends in an
//! incomplete character (U+FFFD), nothing is emitted yet. O(window) per token, and the window
//! is bounded: tokens that add no text (a special token, skipped when decoding) or that never
//! complete a character (bytes that are not UTF-8) are let through after [`MAX_PENDING`], the
//! latter as U+FFFD. Without the bound, a request biased toward such tokens made every step
//! decode its whole output, twice.

use kvgate_protocol::prompt::PromptRenderer;

/// Most tokens held back that have added no whole character: a UTF-8 character is at most 4
/// bytes, so tokens past this many that complete nothing never will.
const MAX_PENDING: usize = 8;
/// Most tokens held back at all: text whose every token ends inside a character (which valid
/// text can do for a while, a character spanning each pair of tokens) is let through past this,
/// its last character as U+FFFD.
const MAX_WINDOW: usize = 64;

/// Output text of one sequence, built token by token.
#[derive(Debug, Clone, Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix: usize,
    /// Tokens whose text is already in `text`.
    read: usize,
    pub text: String,
}

impl Detokenizer {
    /// Adds `token`; returns the byte offset in `text` where its text starts.
    pub fn push(&mut self, renderer: &PromptRenderer, token: u32) -> usize {
        self.ids.push(token);
        let start = self.text.len();
        let before = renderer
            .decode(&self.ids[self.prefix..self.read])
            .unwrap_or_default();
        let after = renderer
            .decode(&self.ids[self.prefix..])
            .unwrap_or_default();
        let complete = after.len() > before.len() && !after.ends_with('\u{FFFD}');
        let held = self.ids.len() - self.read;
        let nothing_whole = after.trim_end_matches('\u{FFFD}').len() <= before.len();
        let stuck = held >= MAX_WINDOW || held >= MAX_PENDING && nothing_whole;
        if (complete || stuck) && after.starts_with(&before) {
            self.text.push_str(&after[before.len()..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        } else if stuck {
            // The window's context decodes differently with the new tokens (it never does for
            // byte-level BPE): start over from them.
            let text = renderer.decode(&self.ids[self.read..]).unwrap_or_default();
            self.text.push_str(&text);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        start
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::{tokenizer::tokenizer_json, GgufFile};

    /// SmolLM2's tokenizer, from the GGUF `scripts/test` fetches (`None`, with a message, when
    /// it is not there).
    fn renderer() -> Option<PromptRenderer> {
        let gguf = std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/kvgate-test-assets/SmolLM2-135M-Instruct.Q4_1.gguf"
        ));
        if !gguf.is_file() {
            eprintln!("skipping: SmolLM2 GGUF not found under target/kvgate-test-assets/");
            return None;
        }
        let file = GgufFile::open(gguf).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer.json"),
            tokenizer_json(&file).unwrap(),
        )
        .unwrap();
        Some(PromptRenderer::from_dir(dir.path()).unwrap())
    }

    /// The window decoded per token stays within two of the bounds' worth of tokens.
    fn assert_small_window(d: &Detokenizer) {
        let window = d.ids.len() - d.prefix;
        assert!(window <= 2 * MAX_PENDING, "window {window}");
    }

    fn detokenize(r: &PromptRenderer, ids: &[u32]) -> Detokenizer {
        let mut d = Detokenizer::default();
        for &id in ids {
            d.push(r, id);
        }
        d
    }

    #[test]
    fn gives_the_whole_decode_for_text_with_multibyte_characters() {
        let Some(r) = renderer() else { return };
        let text = "Grüße, 世界! Ça va? 🙂🙂 naïve café — done.";
        let ids = r.encode(text).unwrap();
        assert!(ids.len() > 10);
        assert_eq!(detokenize(&r, &ids).text, r.decode(&ids).unwrap());
    }

    #[test]
    fn tokens_without_text_keep_the_window_small() {
        let Some(r) = renderer() else { return };
        let special = r.token_id("<|im_start|>").expect("a special token");
        assert_eq!(r.decode(&[special]).unwrap(), "", "skipped when decoding");
        let mut d = detokenize(&r, &vec![special; 1000]);
        assert_small_window(&d);
        // Text after them still comes out whole.
        let ids = r.encode("Paris is the capital.").unwrap();
        for &id in &ids {
            d.push(&r, id);
        }
        assert_eq!(d.text, "Paris is the capital.");
    }

    #[test]
    fn bytes_that_never_complete_a_character_come_out_as_replacements() {
        let Some(r) = renderer() else { return };
        // A token that is one byte of a character and nothing else (byte-level BPE has one for
        // every byte): repeated, it never makes a character.
        let byte = (0..r.vocab_size() as u32)
            .find(|&id| r.decode(&[id]).unwrap() == "\u{FFFD}")
            .expect("a byte token");
        let mut d = detokenize(&r, &vec![byte; 1000]);
        assert_small_window(&d);
        assert!(d.text.chars().all(|c| c == '\u{FFFD}') && d.text.len() > 100);
        let ids = r.encode(" ok").unwrap();
        for &id in &ids {
            d.push(&r, id);
        }
        assert!(
            d.text.ends_with(" ok"),
            "{:?}",
            &d.text[d.text.len() - 12..]
        );
    }
}
