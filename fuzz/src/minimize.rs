//! Minimization of a failing case: delta debugging that keeps a change while the case still
//! fails the same way (the same invariant; for a panic, the same place). First whole JSON
//! elements and object members go (which keeps the rest well-formed), then ever smaller runs of
//! bytes, then the target's own simplifications. Bounded in runs and time, since one run of a
//! large case can take milliseconds.

use crate::panics::run_case;
use crate::targets::{Target, Violation};
use std::time::{Duration, Instant};

/// Whether `case` fails the same way as `v` (the same invariant; for a panic, the same place).
fn same_failure<T: Target>(case: &T::Case, v: &Violation) -> bool {
    match run_case::<T>(case) {
        Ok(_) => false,
        Err(w) if w.invariant != v.invariant => false,
        Err(w) => w.invariant != "panic" || panic_place(&w.detail) == panic_place(&v.detail),
    }
}

fn panic_place(detail: &str) -> &str {
    detail.rsplit(" at ").next().unwrap_or(detail)
}

/// Most runs, and most time, spent minimizing one failure.
const MINIMIZE_RUNS: usize = 4000;
const MINIMIZE_TIME: Duration = Duration::from_secs(10);

/// Delta debugging over the payload: drop whole JSON elements and members while the failure
/// stays the same, then ever smaller pieces of bytes, then the target's own simplifications.
pub fn minimize<T: Target>(case: &T::Case, v: &Violation) -> T::Case {
    let mut best = case.clone();
    let mut runs = 0;
    let start = Instant::now();
    let fails = |c: &T::Case, v: &Violation, runs: &mut usize| {
        if start.elapsed() > MINIMIZE_TIME {
            *runs = MINIMIZE_RUNS;
        }
        same_failure::<T>(c, v)
    };
    'elements: while runs < MINIMIZE_RUNS {
        let mut spans = element_spans(T::payload(&best));
        spans.sort_by_key(|r| std::cmp::Reverse(r.len()));
        for r in spans {
            if runs >= MINIMIZE_RUNS {
                break 'elements;
            }
            let p = T::payload(&best);
            let mut smaller = p[..r.start].to_vec();
            smaller.extend_from_slice(&p[r.end..]);
            let candidate = T::with_payload(&best, smaller);
            runs += 1;
            if fails(&candidate, v, &mut runs) {
                best = candidate;
                continue 'elements;
            }
        }
        break;
    }
    let mut chunk = T::payload(&best).len().div_ceil(2).max(1);
    loop {
        let mut at = 0;
        while at < T::payload(&best).len() && runs < MINIMIZE_RUNS {
            let p = T::payload(&best);
            let mut smaller = p[..at].to_vec();
            smaller.extend_from_slice(&p[(at + chunk).min(p.len())..]);
            let candidate = T::with_payload(&best, smaller);
            runs += 1;
            if fails(&candidate, v, &mut runs) {
                best = candidate;
            } else {
                at += chunk;
            }
        }
        if chunk == 1 || runs >= MINIMIZE_RUNS {
            break;
        }
        chunk = chunk.div_ceil(2);
    }
    let mut again = true;
    while again && runs < MINIMIZE_RUNS {
        again = false;
        for c in T::simpler(&best) {
            runs += 1;
            if c != best && fails(&c, v, &mut runs) {
                best = c;
                again = true;
                break;
            }
        }
    }
    best
}

/// The byte ranges of every element of every JSON array and object in `data` (a member, for
/// objects), each with one comma, so that removing one leaves the rest well-formed. Works on
/// text that is JSON only in parts (an SSE stream); brackets inside strings are skipped.
fn element_spans(data: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut starts: Vec<usize> = Vec::new();
    let (mut in_str, mut escaped) = (false, false);
    for (i, &c) in data.iter().enumerate() {
        if in_str {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            b'"' => in_str = true,
            b'{' | b'[' => starts.push(i + 1),
            b',' => {
                if let Some(s) = starts.last_mut() {
                    out.push(*s..i + 1);
                    *s = i + 1;
                }
            }
            b'}' | b']' => {
                if let Some(s) = starts.pop() {
                    if s < i {
                        let from = if data[s - 1] == b',' { s - 1 } else { s };
                        out.push(from..i);
                    }
                }
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::corpus::Corpus;
    use crate::panics::{quiet_panics, run_case};
    use crate::rng::Rng;

    /// Panics on any input holding `boom`.
    struct Boom;

    impl Target for Boom {
        const NAME: &'static str = "boom";
        type Case = Vec<u8>;
        fn seeds(_: &Corpus) -> Vec<Vec<u8>> {
            Vec::new()
        }
        fn mutate(case: &Vec<u8>, _: &Vec<u8>, _: &mut Rng) -> Vec<u8> {
            case.clone()
        }
        fn check(case: &Vec<u8>) -> Result<u64, Violation> {
            if case.windows(4).any(|w| w == b"boom") {
                panic!("found it");
            }
            Ok(0)
        }
        crate::targets::bytes_case!();
    }

    #[test]
    fn a_panic_is_caught_and_minimized() {
        let hook = quiet_panics();
        let case =
            br#"{"model":"m","messages":[{"role":"user","content":"a boom b"},1,2]}"#.to_vec();
        let v = run_case::<Boom>(&case).unwrap_err();
        let min = minimize::<Boom>(&case, &v);
        let clean = run_case::<Boom>(&b"{}".to_vec());
        std::panic::set_hook(hook);
        assert_eq!(v.invariant, "panic");
        assert!(v.detail.starts_with("found it at "), "{}", v.detail);
        assert!(v.detail.contains("minimize.rs"), "{}", v.detail);
        assert_eq!(min, b"boom");
        assert_eq!(clean, Ok(0));
    }

    #[test]
    fn element_spans_leave_json_well_formed() {
        let doc = br#"{"a":[1,"x,]",{"b":2}],"c":3}"#;
        let spans = element_spans(doc);
        assert!(!spans.is_empty());
        for r in spans {
            let mut out = doc[..r.start].to_vec();
            out.extend_from_slice(&doc[r.end..]);
            assert!(
                serde_json::from_slice::<serde_json::Value>(&out).is_ok(),
                "{}",
                String::from_utf8_lossy(&out)
            );
        }
    }
}
