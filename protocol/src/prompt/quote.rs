//! The quoted form of prompt text: how a rendered prompt tells the chat template's own control
//! tokens from a message that merely spells one.
//!
//! [`QUOTE`] before a special token's spelling makes that spelling plain text; doubled, it
//! stands for one [`QUOTE`] of text; anywhere else it is an ordinary char. Quoting a message
//! ([`Quoting::quote`]) puts [`QUOTE`] before each special token's spelling and doubles each
//! [`QUOTE`], so the message reads back as exactly its own text, however the template surrounds
//! it. Both directions are one scan, which passes over runs of bytes that start no token 32 at a
//! time ([`Stops`]); a text with nothing to quote is borrowed, not copied.

use crate::bpe::{AddedTokens, Stops};
use std::borrow::Cow;
use std::ops::Range;

/// A noncharacter (U+FDD0): Unicode sets these aside for a program's internal use, so no text a
/// model was trained on holds one, and a message that does is quoted like any other.
pub const QUOTE: char = '\u{FDD0}';
const Q: &[u8] = "\u{FDD0}".as_bytes();

/// A tokenizer's added tokens, and where a scan for them or for [`QUOTE`] must look closer.
#[derive(Debug, Clone)]
pub struct Quoting {
    added: AddedTokens,
    stops: Stops,
}

impl Quoting {
    pub fn new(added: AddedTokens) -> Self {
        Quoting {
            stops: added.stops().with(Q[0]),
            added,
        }
    }

    /// `text` in the quoted form: each special token's spelling (found as the tokenizer finds
    /// added tokens, leftmost-longest) and each [`QUOTE`] preceded by a [`QUOTE`].
    pub fn quote<'a>(&self, text: &'a str) -> Cow<'a, str> {
        let bytes = text.as_bytes();
        let mut out: Option<String> = None;
        let mut start = 0;
        let mut i = self.stops.next(bytes, 0);
        while i < bytes.len() {
            if bytes[i..].starts_with(Q) {
                let o = out.get_or_insert_with(|| String::with_capacity(text.len() + 16));
                o.push_str(&text[start..i]);
                o.push(QUOTE);
                start = i;
                i += Q.len();
            } else if let Some(m) = self.added.at(&bytes[i..]) {
                if m.special {
                    let o = out.get_or_insert_with(|| String::with_capacity(text.len() + 16));
                    o.push_str(&text[start..i]);
                    o.push(QUOTE);
                    start = i;
                }
                // A word added to the vocabulary stays one: it is text, and matching it here
                // keeps this scan in step with the encoder's.
                i += m.len;
            } else {
                i += 1;
            }
            i = self.stops.next(bytes, i);
        }
        match out {
            None => Cow::Borrowed(text),
            Some(mut o) => {
                o.push_str(&text[start..]);
                Cow::Owned(o)
            }
        }
    }

    /// The text a quoted form stands for, and the byte ranges in it of the special tokens'
    /// spellings that were quoted: the reading of
    /// [`BpeEncoder::encode_quoted_into`](crate::bpe::BpeEncoder::encode_quoted_into).
    pub fn unquote<'a>(&self, text: &'a str) -> (Cow<'a, str>, Vec<Range<usize>>) {
        let bytes = text.as_bytes();
        let mut out: Option<String> = None;
        let mut spans = Vec::new();
        let mut start = 0;
        let mut i = self.stops.next(bytes, 0);
        while i < bytes.len() {
            if bytes[i..].starts_with(Q) {
                let at = i + Q.len();
                let (len, special) = if bytes[at..].starts_with(Q) {
                    (Q.len(), false)
                } else {
                    match self.added.at(&bytes[at..]) {
                        Some(m) if m.special => (m.len, true),
                        _ => (0, false),
                    }
                };
                if len > 0 {
                    let o = out.get_or_insert_with(|| String::with_capacity(text.len()));
                    o.push_str(&text[start..i]);
                    if special {
                        spans.push(o.len()..o.len() + len);
                    }
                    o.push_str(&text[at..at + len]);
                    start = at + len;
                }
                i = at + len;
            } else if let Some(m) = self.added.at(&bytes[i..]) {
                i += m.len;
            } else {
                i += 1;
            }
            i = self.stops.next(bytes, i);
        }
        match out {
            None => (Cow::Borrowed(text), spans),
            Some(mut o) => {
                o.push_str(&text[start..]);
                (Cow::Owned(o), spans)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quoting() -> Quoting {
        Quoting::new(AddedTokens::new([
            ("<s>", 0, true),
            ("<s>x", 1, false),
            ("<w>", 2, false),
        ]))
    }

    #[test]
    fn quoting_reads_back_as_the_text() {
        let q = quoting();
        let cases = [
            ("plain", "plain", vec![]),
            ("<s>", "\u{fdd0}<s>", vec![(0, 3)]),
            ("a<s><s>b", "a\u{fdd0}<s>\u{fdd0}<s>b", vec![(1, 4), (4, 7)]),
            ("<s>x <w>", "<s>x <w>", vec![]),
            ("\u{fdd0}", "\u{fdd0}\u{fdd0}", vec![]),
            ("\u{fdd0}<s>", "\u{fdd0}\u{fdd0}\u{fdd0}<s>", vec![(3, 6)]),
            ("<\u{fdd0}s>", "<\u{fdd0}\u{fdd0}s>", vec![]),
        ];
        for (text, quoted, spans) in cases {
            assert_eq!(q.quote(text), quoted, "{text:?}");
            let (back, got) = q.unquote(quoted);
            assert_eq!(back, text, "{text:?}");
            let got: Vec<_> = got.iter().map(|r| (r.start, r.end)).collect();
            assert_eq!(got, spans, "{text:?}");
        }
        assert!(matches!(q.quote("plain <w>"), Cow::Borrowed(_)));
        // A lone quote is a char of text.
        assert_eq!(q.unquote("\u{fdd0}a").0, "\u{fdd0}a");
        assert_eq!(q.unquote("a\u{fdd0}").0, "a\u{fdd0}");
    }
}
