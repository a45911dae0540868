//! The gateway's usage reader, [`kvgate_gateway::upstream::proxy::usage`], which skips every
//! member but `usage` without building a tree, against a full `serde_json::Value` parse (the
//! reference its unit test uses).
//!
//! Invariants: nothing panics; both read the same prompt, cached and completion counts, or both read
//! none; [`Served::completion`] never counts less than what was relayed.

use super::{ensure, signature, Target, Violation};
use crate::corpus::Corpus;
use crate::rng::Rng;
use kvgate_gateway::upstream::proxy::{usage, Served, Usage};

/// JSON documents that may carry `usage`.
#[derive(Debug)]
pub struct UsageReader;

const MAX_DOC: usize = 64 << 10;

/// The reference: the whole document as a tree, then its `usage`.
pub fn reference(json: &[u8]) -> Option<Usage> {
    let v: serde_json::Value = serde_json::from_slice(json).ok()?;
    let u = v.get("usage").filter(|u| !u.is_null())?;
    let count = |name: &str| u.get(name).and_then(|x| x.as_u64()).unwrap_or(0);
    let cached = u
        .get("prompt_tokens_details")
        .and_then(|d| d.get("cached_tokens"))
        .and_then(|x| x.as_u64())
        .unwrap_or(0);
    Some(Usage {
        prompt: count("prompt_tokens"),
        completion: count("completion_tokens"),
        cached,
    })
}

impl Target for UsageReader {
    const NAME: &'static str = "usage";
    type Case = Vec<u8>;

    fn seeds(corpus: &Corpus) -> Vec<Vec<u8>> {
        let mut seeds: Vec<Vec<u8>> = corpus.usage.iter().map(|e| e.data.clone()).collect();
        // Every event payload of the engine streams is a document the relay reads usage from.
        for e in &corpus.sse {
            for event in e.data.split(|&b| b == b'\n') {
                if let Some(p) = event.strip_prefix(b"data: ") {
                    if p != b"[DONE]" {
                        seeds.push(p.to_vec());
                    }
                }
            }
        }
        seeds.sort();
        seeds.dedup();
        seeds
    }

    fn mutate(case: &Vec<u8>, other: &Vec<u8>, rng: &mut Rng) -> Vec<u8> {
        super::mutate_input(case, other, rng, MAX_DOC)
    }

    fn check(json: &Vec<u8>) -> Result<u64, Violation> {
        let fast = usage(json);
        let full = reference(json);
        if fast != full {
            // The reader skips every other member without building it: when skipping accepts
            // the document where a full parse refuses it (invalid UTF-8 or escapes in a skipped
            // string, a number out of range), it reads a usage the reference does not.
            let lenient = fast.is_some()
                && full.is_none()
                && serde_json::from_slice::<serde::de::IgnoredAny>(json).is_ok();
            let why = serde_json::from_slice::<serde_json::Value>(json)
                .err()
                .map(|e| e.to_string());
            let invariant = if lenient {
                "usage.lenient_on_skipped_members"
            } else {
                "usage.matches_full_parse"
            };
            return Err(Violation::new(
                invariant,
                format!("usage() {fast:?}, full parse {full:?} ({why:?})"),
            ));
        }
        let chunks = json.len() as u64;
        let served = Served {
            usage: fast,
            chunks,
            ..Served::default()
        };
        ensure(
            served.completion() >= chunks,
            "usage.served_never_below_relayed",
            || format!("{served:?}"),
        )?;
        let parse_error = serde_json::from_slice::<serde::de::IgnoredAny>(json)
            .err()
            .map(|e| format!("{:?}", e.classify()));
        Ok(signature((
            fast.map(|u| {
                (
                    u.prompt.min(2),
                    u.completion.min(2),
                    u.prompt > u64::from(u32::MAX),
                )
            }),
            parse_error,
            json.first().copied(),
        )))
    }

    crate::targets::bytes_case!();
}
