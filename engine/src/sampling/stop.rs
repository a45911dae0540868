//! When a sequence stops: EOS (unless `ignore_eos`), a stop token id, a stop string in the
//! decoded text, or `max_tokens`. None of the first three count before `min_tokens`.
//!
//! Stop strings are matched on the incrementally decoded output text: after each token only the
//! new text plus the `longest stop - 1` bytes before it are searched, so a string split across
//! tokens is found and a step costs O(new text + longest stop) per stop string. The output is cut
//! before the match (and before the text of a stop token or EOS), as OpenAI and vLLM do.
//! [`StopChecker::streamable_len`] tells a streaming server how much text is safe to send: all
//! but a tail that may still grow into a stop string.

use kvgate_protocol::openai::{FinishReason, SamplingParams};

/// What ended a sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopMatch {
    /// An end-of-sequence token.
    Eos(u32),
    /// One of the request's `stop_token_ids`.
    StopToken(u32),
    /// The request's stop string at this index.
    StopString(usize),
    /// `max_tokens` tokens were generated.
    Length,
}

/// A sequence's end: the reason to report, what matched, and how much of the output text to keep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finish {
    pub reason: FinishReason,
    pub matched: StopMatch,
    /// Keep `text[..text_len]`; the rest is the stop string or the stop token's text.
    pub text_len: usize,
}

/// Stop conditions of one sequence.
#[derive(Debug, Clone)]
pub struct StopChecker {
    stop: Vec<String>,
    stop_token_ids: Vec<u32>,
    eos: Vec<u32>,
    max_tokens: u32,
    min_tokens: u32,
    longest_stop: usize,
    generated: u32,
}

impl StopChecker {
    /// Stop conditions of `params`, with the model's EOS ids (ignored under `ignore_eos`) and
    /// `max_tokens` as resolved for this prompt ([`SamplingParams::max_tokens_for`]).
    pub fn new(params: &SamplingParams, eos_token_ids: &[u32], max_tokens: u32) -> Self {
        let stop: Vec<String> = params
            .stop
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect();
        StopChecker {
            longest_stop: stop.iter().map(String::len).max().unwrap_or(0),
            stop,
            stop_token_ids: params.stop_token_ids.clone(),
            eos: if params.ignore_eos {
                Vec::new()
            } else {
                eos_token_ids.to_vec()
            },
            max_tokens,
            min_tokens: params.min_tokens,
            generated: 0,
        }
    }

    /// Tokens checked so far.
    pub fn generated(&self) -> u32 {
        self.generated
    }

    /// Checks the token just generated. `text` is the whole output text so far, of which
    /// `text[new_from..]` is what `token` added. Returns how the sequence ends, if it does.
    pub fn check(&mut self, token: u32, text: &str, new_from: usize) -> Option<Finish> {
        self.generated = self.generated.saturating_add(1);
        let new_from = floor_char_boundary(text, new_from);
        if self.generated > self.min_tokens {
            let stop = |matched| {
                Some(Finish {
                    reason: FinishReason::Stop,
                    matched,
                    text_len: new_from,
                })
            };
            if self.eos.contains(&token) {
                return stop(StopMatch::Eos(token));
            }
            if self.stop_token_ids.contains(&token) {
                return stop(StopMatch::StopToken(token));
            }
            if let Some((index, at)) = self.find_stop(text, new_from) {
                return Some(Finish {
                    reason: FinishReason::Stop,
                    matched: StopMatch::StopString(index),
                    text_len: at,
                });
            }
        }
        (self.generated >= self.max_tokens).then_some(Finish {
            reason: FinishReason::Length,
            matched: StopMatch::Length,
            text_len: text.len(),
        })
    }

    /// The earliest stop string that ends in `text[new_from..]`: its index and start.
    fn find_stop(&self, text: &str, new_from: usize) -> Option<(usize, usize)> {
        if self.stop.is_empty() {
            return None;
        }
        let start = floor_char_boundary(
            text,
            new_from.saturating_sub(self.longest_stop.saturating_sub(1)),
        );
        let window = &text[start..];
        self.stop
            .iter()
            .enumerate()
            .filter_map(|(i, s)| window.find(s.as_str()).map(|at| (start + at, i)))
            .min()
            .map(|(at, i)| (i, at))
    }

    /// How many leading bytes of `text` can be streamed now: all but the longest tail that is
    /// the beginning of a stop string (it may become one with the next token).
    pub fn streamable_len(&self, text: &str) -> usize {
        let held = self
            .stop
            .iter()
            .filter_map(|s| {
                (1..s.len().min(text.len() + 1))
                    .rev()
                    .find(|&n| s.is_char_boundary(n) && text.ends_with(&s[..n]))
            })
            .max()
            .unwrap_or(0);
        text.len() - held
    }
}

/// The largest char boundary of `text` at or below `i`.
fn floor_char_boundary(text: &str, i: usize) -> usize {
    let mut i = i.min(text.len());
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checker(stop: &[&str], stop_ids: &[u32], max_tokens: u32) -> StopChecker {
        let params = SamplingParams {
            stop: stop.iter().map(|s| s.to_string()).collect(),
            stop_token_ids: stop_ids.to_vec(),
            ..SamplingParams::default()
        };
        StopChecker::new(&params, &[0], max_tokens)
    }

    /// Feeds token texts (token id = position + 10); returns the finish and the kept text.
    fn run(c: &mut StopChecker, pieces: &[&str]) -> Option<(Finish, String)> {
        let mut text = String::new();
        for (i, piece) in pieces.iter().enumerate() {
            let from = text.len();
            text.push_str(piece);
            if let Some(f) = c.check(i as u32 + 10, &text, from) {
                text.truncate(f.text_len);
                return Some((f, text));
            }
        }
        None
    }

    #[test]
    fn stop_string_spanning_tokens() {
        let mut c = checker(&["world"], &[], 100);
        let (f, text) = run(&mut c, &["Hello", " wo", "r", "ld", "!"]).unwrap();
        assert_eq!(
            (f.reason, f.matched, text.as_str()),
            (FinishReason::Stop, StopMatch::StopString(0), "Hello ")
        );
        assert_eq!(c.generated(), 4);
    }

    #[test]
    fn earliest_stop_string_wins() {
        let mut c = checker(&["cd", "b"], &[], 100);
        let (f, text) = run(&mut c, &["a", "bcde"]).unwrap();
        assert_eq!((f.matched, text.as_str()), (StopMatch::StopString(1), "a"));
    }

    #[test]
    fn stop_inside_one_token_and_multibyte_text() {
        let mut c = checker(&["é!"], &[], 100);
        let (f, text) = run(&mut c, &["ça", "va é! oui"]).unwrap();
        assert_eq!(
            (f.matched, text.as_str()),
            (StopMatch::StopString(0), "çava ")
        );
        // A bogus offset inside a character does not panic.
        let mut c = checker(&["x"], &[], 100);
        assert_eq!(c.check(5, "éé", 1), None);
    }

    #[test]
    fn eos_and_stop_tokens_drop_their_text() {
        let mut c = checker(&[], &[7], 100);
        assert_eq!(c.check(3, "ab", 0), None);
        let f = c.check(7, "ab</s>", 2).unwrap();
        assert_eq!(
            (f.reason, f.matched, f.text_len),
            (FinishReason::Stop, StopMatch::StopToken(7), 2)
        );
        let mut c = checker(&[], &[], 100);
        let f = c.check(0, "x", 1).unwrap();
        assert_eq!(f.matched, StopMatch::Eos(0));
    }

    #[test]
    fn ignore_eos() {
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::default()
        };
        let mut c = StopChecker::new(&params, &[0], 2);
        assert_eq!(c.check(0, "", 0), None);
        assert_eq!(c.check(0, "", 0).unwrap().matched, StopMatch::Length);
    }

    #[test]
    fn max_tokens_is_length_unless_a_stop_matches() {
        let mut c = checker(&["z"], &[], 2);
        assert_eq!(c.check(1, "a", 0), None);
        let f = c.check(2, "ab", 1).unwrap();
        assert_eq!((f.reason, f.text_len), (FinishReason::Length, 2));
        let mut c = checker(&["b"], &[], 2);
        assert_eq!(c.check(1, "a", 0), None);
        assert_eq!(c.check(2, "ab", 1).unwrap().reason, FinishReason::Stop);
    }

    #[test]
    fn min_tokens_defers_stops() {
        let params = SamplingParams {
            min_tokens: 2,
            stop: vec!["a".into()],
            ..SamplingParams::default()
        };
        let mut c = StopChecker::new(&params, &[0], 10);
        assert_eq!(c.check(0, "", 0), None);
        assert_eq!(c.check(1, "a", 0), None);
        assert_eq!(c.check(0, "a", 1).unwrap().matched, StopMatch::Eos(0));
    }

    #[test]
    fn streamable_len_holds_back_a_possible_stop() {
        let c = checker(&["</end>", "\n\n"], &[], 100);
        assert_eq!(c.streamable_len("hello"), 5);
        assert_eq!(c.streamable_len("hello </e"), 6);
        assert_eq!(c.streamable_len("hello\n"), 5);
        assert_eq!(c.streamable_len("<"), 0);
        assert_eq!(c.streamable_len(""), 0);
        let c = checker(&["éa"], &[], 100);
        assert_eq!(c.streamable_len("xé"), 1);
        assert_eq!(checker(&[], &[], 1).streamable_len("abc"), 3);
    }
}
