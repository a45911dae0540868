//! A tokenizer's added tokens (`added_tokens` of `tokenizer.json`), found in a text as
//! `tokenizers` finds its non-normalized ones: the leftmost match, and of those the longest
//! (its Aho-Corasick automaton's `LeftmostLongest`).
//!
//! A scan looks closer only at the bytes that may start a token ([`Stops`]); where those are at
//! most four distinct bytes (one or two in most tokenizers: `<`, `[`), it passes over 32 bytes at
//! a time with compares the compiler vectorizes, since every message and every prompt is scanned
//! on the request path. Where a token may start, the tokens sharing that first byte are compared,
//! longest first.

/// An added token found at the start of a text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddedMatch {
    /// Length of its spelling, in bytes.
    pub len: usize,
    pub id: u32,
    /// A control token (`"special": true`), as opposed to a word added to the vocabulary.
    pub special: bool,
}

/// Added tokens by first byte.
#[derive(Clone)]
pub struct AddedTokens {
    /// For each first byte, its tokens, longest first.
    by_first: Vec<Vec<Entry>>,
    /// Whether a byte starts some token.
    first: [bool; 256],
}

#[derive(Clone)]
struct Entry {
    spelling: Box<[u8]>,
    id: u32,
    special: bool,
}

/// Where a scan must look closer: the first bytes of the tokens, and maybe more.
#[derive(Debug, Clone, Copy)]
pub struct Stops {
    table: [bool; 256],
    few: Few,
}

#[derive(Debug, Clone, Copy)]
enum Few {
    /// The stops, when they are at most four: the first `count` of `bytes`.
    Bytes {
        bytes: [u8; 4],
        count: usize,
    },
    Many,
}

/// Bytes a [`Stops::skip`] passes over at a time.
const RUN: usize = 32;

impl Stops {
    /// No stops at all.
    pub fn none() -> Stops {
        Stops {
            table: [false; 256],
            few: Few::Bytes {
                bytes: [0; 4],
                count: 0,
            },
        }
    }

    /// These stops and `b`.
    pub fn with(mut self, b: u8) -> Stops {
        if self.table[b as usize] {
            return self;
        }
        self.table[b as usize] = true;
        self.few = match self.few {
            Few::Bytes { mut bytes, count } if count < 4 => {
                bytes[count] = b;
                Few::Bytes {
                    bytes,
                    count: count + 1,
                }
            }
            _ => Few::Many,
        };
        self
    }

    #[inline]
    pub fn is_stop(&self, b: u8) -> bool {
        self.table[b as usize]
    }

    /// The first position from `i` on that may be a stop: the start of the first run of
    /// [`RUN`] bytes holding one, or of the tail shorter than that. The bytes passed over hold
    /// no stop.
    #[inline]
    fn skip(&self, bytes: &[u8], i: usize) -> usize {
        match self.few {
            Few::Bytes { count: 0, .. } => bytes.len().max(i),
            Few::Bytes { bytes: n, count: 1 } => skip_runs(bytes, i, [n[0]]),
            Few::Bytes { bytes: n, count: 2 } => skip_runs(bytes, i, [n[0], n[1]]),
            Few::Bytes { bytes: n, count: 3 } => skip_runs(bytes, i, [n[0], n[1], n[2]]),
            Few::Bytes { bytes: n, .. } => skip_runs(bytes, i, n),
            Few::Many => i,
        }
    }

    /// The next stop at or after `i`, or `bytes.len()`.
    #[inline]
    pub fn next(&self, bytes: &[u8], mut i: usize) -> usize {
        loop {
            i = self.skip(bytes, i).min(bytes.len());
            let end = (i + RUN).min(bytes.len());
            match bytes[i..end].iter().position(|&b| self.is_stop(b)) {
                Some(k) => return i + k,
                None if end == bytes.len() => return end,
                None => i = end,
            }
        }
    }
}

impl std::fmt::Debug for AddedTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddedTokens")
            .field("len", &self.by_first.iter().map(Vec::len).sum::<usize>())
            .finish()
    }
}

/// [`Stops::skip`] for `K` stop bytes: as many compares per byte as there are stops.
#[inline]
fn skip_runs<const K: usize>(bytes: &[u8], mut i: usize, stops: [u8; K]) -> usize {
    while let Some(run) = bytes.get(i..).and_then(|b| b.first_chunk::<RUN>()) {
        // No early exit inside the run: a branch-free fold becomes vector compares.
        let hit = run.iter().fold(false, |hit, &b| {
            hit | stops.iter().fold(false, |h, &s| h | (b == s))
        });
        if hit {
            return i;
        }
        i += RUN;
    }
    i
}

impl AddedTokens {
    /// Tokens as (spelling, id, special), in registration order. A spelling registered twice
    /// keeps its last id, as in `tokenizers`; an empty spelling never matches and is left out.
    pub fn new<'a>(tokens: impl IntoIterator<Item = (&'a str, u32, bool)>) -> Self {
        let mut by_first: Vec<Vec<Entry>> = vec![Vec::new(); 256];
        let mut first = [false; 256];
        for (spelling, id, special) in tokens {
            let Some(&b) = spelling.as_bytes().first() else {
                continue;
            };
            first[b as usize] = true;
            let list = &mut by_first[b as usize];
            match list
                .iter_mut()
                .find(|t| &*t.spelling == spelling.as_bytes())
            {
                Some(t) => (t.id, t.special) = (id, special),
                None => list.push(Entry {
                    spelling: spelling.as_bytes().into(),
                    id,
                    special,
                }),
            }
        }
        for list in &mut by_first {
            list.sort_by_key(|t| std::cmp::Reverse(t.spelling.len()));
        }
        AddedTokens { by_first, first }
    }

    /// The bytes that start some token: a scan needs to look closer only at those.
    pub fn stops(&self) -> Stops {
        (0..=255u8)
            .filter(|&b| self.first[b as usize])
            .fold(Stops::none(), Stops::with)
    }

    /// The longest token at the start of `bytes`.
    #[inline]
    pub fn at(&self, bytes: &[u8]) -> Option<AddedMatch> {
        let &b = bytes.first()?;
        self.by_first[b as usize]
            .iter()
            .find(|t| bytes.starts_with(&t.spelling))
            .map(|t| AddedMatch {
                len: t.spelling.len(),
                id: t.id,
                special: t.special,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_wins_and_the_last_registration_counts() {
        let t = AddedTokens::new([
            ("<a>", 1, true),
            ("<a>b", 2, false),
            ("", 3, true),
            ("<a>", 4, true),
        ]);
        let m = |len, id, special| Some(AddedMatch { len, id, special });
        assert_eq!(t.at(b"<a>bc"), m(4, 2, false));
        assert_eq!(t.at(b"<a>c"), m(3, 4, true));
        assert_eq!(t.at(b"x<a>"), None);
        assert_eq!(t.at(b""), None);
    }

    #[test]
    fn stops_are_found_past_long_runs() {
        let few = AddedTokens::new([("<a>", 1, true), ("[b]", 2, true)]);
        let many = AddedTokens::new("abcde".split("").map(|s| (s, 1, true)));
        let none = AddedTokens::new([]);
        for extra in [None, Some(0xEF)] {
            for t in [&few, &many, &none] {
                let stops = extra.map_or(t.stops(), |b| t.stops().with(b));
                for len in [0, 1, 31, 32, 33, 64, 100, 200] {
                    for at in [0, 1, 30, 31, 32, 33, 63, 64, 65, 99, 150] {
                        let mut text = vec![b'x'; len];
                        for (k, &b) in [b'<', b'[', b'c', 0xEF].iter().enumerate() {
                            if at + 7 * k < len {
                                text[at + 7 * k] = b;
                            }
                        }
                        for from in [0, 1, 5, 33].into_iter().filter(|&f| f <= len) {
                            let want = (from..len).find(|&i| stops.is_stop(text[i])).unwrap_or(len);
                            assert_eq!(stops.next(&text, from), want, "{len} {at} {from}");
                            assert!(stops.skip(&text, from) <= want);
                        }
                    }
                }
            }
        }
        assert!(few.stops().is_stop(b'['));
        assert!(!few.stops().is_stop(0xEF));
        assert!(few.stops().with(0xEF).is_stop(0xEF));
    }
}
