//! Incremental detokenization: the text a new token adds, without re-decoding the whole output.
//!
//! Byte-level BPE can split one character over several tokens, so a token's text is the
//! difference between decoding a short window with and without it; while the window ends in an
//! incomplete character (U+FFFD), nothing is emitted yet. O(window) per token.

use kvgate_protocol::prompt::PromptRenderer;

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
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') && after.starts_with(&before)
        {
            self.text.push_str(&after[before.len()..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        start
    }
}
