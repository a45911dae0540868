//! What is fuzzed. Each target turns one case into a run of the code under test plus checks of
//! its invariants, and reports an outcome signature: the driver keeps mutants whose signature
//! it has not seen (a cheap stand-in for coverage).
//!
//! - [`protocol`]: request bodies through the gateway's and the engine's parsing and validation.
//! - [`usage`]: the gateway's `usage` reader against a full JSON parse.
//! - [`sse`]: the SSE relay's event parser under arbitrary chunkings.

pub mod protocol;
pub mod sse;
pub mod usage;

use crate::corpus::Corpus;
use crate::rng::Rng;
use std::hash::{Hash, Hasher};

/// A broken invariant: which one (a stable name) and what was seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub invariant: &'static str,
    pub detail: String,
}

impl Violation {
    /// A violation; a long detail is cut (reports keep the whole input anyway).
    pub fn new(invariant: &'static str, detail: impl Into<String>) -> Self {
        let mut detail = detail.into();
        if detail.len() > MAX_DETAIL {
            let mut cut = MAX_DETAIL;
            while !detail.is_char_boundary(cut) {
                cut -= 1;
            }
            detail.truncate(cut);
            detail.push_str(" [...]");
        }
        Violation { invariant, detail }
    }
}

/// Longest detail kept in a violation.
const MAX_DETAIL: usize = 4000;

/// Fails with `invariant` unless `ok`.
pub fn ensure(
    ok: bool,
    invariant: &'static str,
    detail: impl FnOnce() -> String,
) -> Result<(), Violation> {
    if ok {
        Ok(())
    } else {
        Err(Violation::new(invariant, detail()))
    }
}

/// The file and payload methods of a target whose case is its bytes as they are.
macro_rules! bytes_case {
    () => {
        fn to_file(case: &Vec<u8>) -> Vec<u8> {
            case.clone()
        }

        fn from_file(bytes: &[u8]) -> Option<Vec<u8>> {
            Some(bytes.to_vec())
        }

        fn payload(case: &Vec<u8>) -> &[u8] {
            case
        }

        fn with_payload(_case: &Vec<u8>, payload: Vec<u8>) -> Vec<u8> {
            payload
        }
    };
}
pub(crate) use bytes_case;

/// One fuzz target.
pub trait Target {
    /// The name on the command line and in reports.
    const NAME: &'static str;
    /// One input.
    type Case: Clone + Send + PartialEq;

    /// The starting inputs, from the corpus.
    fn seeds(corpus: &Corpus) -> Vec<Self::Case>;

    /// A mutant of `case`; `other` is another input of the pool, for splices and grafts.
    fn mutate(case: &Self::Case, other: &Self::Case, rng: &mut Rng) -> Self::Case;

    /// Runs the code under test on `case` and checks its invariants: the outcome's signature,
    /// or the first invariant broken. A panic is caught by the driver.
    fn check(case: &Self::Case) -> Result<u64, Violation>;

    /// The case as a file (what a report saves and `--replay` reads).
    fn to_file(case: &Self::Case) -> Vec<u8>;

    /// A case from [`Target::to_file`]'s bytes.
    fn from_file(bytes: &[u8]) -> Option<Self::Case>;

    /// The bytes minimization removes from.
    fn payload(case: &Self::Case) -> &[u8];

    /// `case` with its payload replaced.
    fn with_payload(case: &Self::Case, payload: Vec<u8>) -> Self::Case;

    /// Whether a case that found a new outcome joins the pool (a huge one is tried, not kept:
    /// mutating it over and over would slow every later case).
    fn poolable(case: &Self::Case) -> bool {
        Self::payload(case).len() <= 64 << 10
    }

    /// Simpler variants of `case` beyond its payload (fewer chunks, say), for minimization.
    fn simpler(_case: &Self::Case) -> Vec<Self::Case> {
        Vec::new()
    }
}

/// An outcome signature: a hash of whatever distinguishes outcomes.
pub fn signature(parts: impl Hash) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parts.hash(&mut h);
    h.finish()
}

/// `param` with its indices blanked (`messages[3].role` -> `messages[#].role`), so that one
/// kind of error is one signature.
pub fn param_shape(param: &str) -> String {
    param
        .chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .collect()
}

/// Mutates `data` as bytes or, when it is JSON, as a tree (stacking up to a few changes).
pub fn mutate_input(data: &[u8], other: &[u8], rng: &mut Rng, max_len: usize) -> Vec<u8> {
    let mut out = data.to_vec();
    for _ in 0..rng.range(1, 3) {
        let tree = !rng.one_in(4);
        match tree
            .then(|| crate::json::mutate_json(&out, other, rng))
            .flatten()
        {
            Some(m) => out = m,
            None => crate::mutate::mutate_bytes(&mut out, other, rng, max_len),
        }
        out.truncate(max_len);
    }
    out
}
