//! Byte-level mutations, as libFuzzer does them: bit flips, interesting bytes, inserts and
//! deletes, copies within the input, splices with another input, dictionary tokens, truncation,
//! and the byte sequences that break UTF-8 and SSE framing. Each call is O(input).

use crate::rng::Rng;

/// Tokens worth inserting whole: the protocol's field names, SSE framing and JSON punctuation.
pub const DICTIONARY: &[&[u8]] = &[
    b"\n\n",
    b"\n",
    b"\r\n",
    b"data: ",
    b"data:",
    b"data: [DONE]\n\n",
    b"[DONE]",
    b": keep-alive\n\n",
    b"event: error\n",
    b"{\"error\"",
    b"\"usage\"",
    b"\"usage\":null",
    b"\"usage\":{\"prompt_tokens\":18446744073709551615,\"completion_tokens\":1}",
    b"\"choices\":[]",
    b"\"choices\":[{",
    b"\"prompt_tokens\"",
    b"\"completion_tokens\"",
    b"\"messages\"",
    b"\"role\"",
    b"\"content\"",
    b"\"prompt\"",
    b"\"stream\":true",
    b"\"stream_options\":{\"include_usage\":true}",
    b"\"logprobs\"",
    b"\"top_logprobs\"",
    b"\"logit_bias\"",
    b"\"stop\"",
    b"\"stop_token_ids\"",
    b"\"seed\"",
    b"\"n\"",
    b"\"cache_salt\"",
    b"\"tools\"",
    b"\"response_format\"",
    b"\\u0000",
    b"\\ud800",
    b"\\udc00",
    b"\\\"",
    b"\\u0061",
    b"null",
    b"true",
    b"-0",
    b"1e400",
    b"-1e400",
    b"1e-400",
    b"18446744073709551616",
    b"9223372036854775808",
    b"-9223372036854775809",
    b"4294967296",
    b"[[[[[[[[",
    b"]]]]]]]]",
    b"{}",
    b"[]",
    b",",
    b":",
    b"\"",
];

/// Bytes that make text invalid UTF-8 (or nearly so): lone continuation and lead bytes, an
/// overlong slash, an encoded surrogate, a code point past U+10FFFF, and NUL.
pub const BAD_UTF8: &[&[u8]] = &[
    b"\xff",
    b"\x80",
    b"\xc3",
    b"\xc0\xaf",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xe2\x82",
    b"\x00",
];

const INTERESTING: &[u8] = &[
    0, 1, 0x7f, 0x80, 0xff, b'\n', b'\r', b'"', b'\\', b'{', b'}', b'[', b']', b':', b',', b'0',
    b'9', b'-', b'.', b'e', b' ',
];

/// Applies one random byte-level mutation to `data`, with `other` for splices; keeps the result
/// at most `max_len` bytes.
pub fn mutate_bytes(data: &mut Vec<u8>, other: &[u8], rng: &mut Rng, max_len: usize) {
    let len = data.len();
    match rng.below(13) {
        0 if len > 0 => {
            let i = rng.below(len);
            data[i] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let i = rng.below(len);
            data[i] = *rng.pick(INTERESTING).unwrap_or(&0);
        }
        2 if len > 0 => {
            let i = rng.below(len);
            data[i] = rng.next_u64() as u8;
        }
        3 if len > 0 => {
            // Delete a range.
            let at = rng.below(len);
            let n = rng.small_len(len - at).max(1);
            data.drain(at..at + n);
        }
        4 if len > 0 => {
            // Copy a range elsewhere (duplicating it).
            let from = rng.below(len);
            let n = rng.small_len(len - from).max(1);
            let chunk = data[from..from + n].to_vec();
            let at = rng.below(len + 1);
            data.splice(at..at, chunk);
        }
        5 => {
            let token = rng.pick(DICTIONARY).copied().unwrap_or(b"\n\n");
            let at = rng.below(len + 1);
            data.splice(at..at, token.iter().copied());
        }
        6 => {
            let bad = rng.pick(BAD_UTF8).copied().unwrap_or(b"\xff");
            let at = rng.below(len + 1);
            data.splice(at..at, bad.iter().copied());
        }
        7 if len > 0 => data.truncate(rng.below(len)),
        8 if !other.is_empty() => {
            // Splice: a prefix of one input, a suffix of the other.
            let keep = rng.below(len + 1);
            let from = rng.below(other.len());
            data.truncate(keep);
            data.extend_from_slice(&other[from..]);
        }
        9 if !other.is_empty() => {
            // Insert a piece of the other input.
            let from = rng.below(other.len());
            let n = rng.small_len(other.len() - from).max(1);
            let at = rng.below(len + 1);
            data.splice(at..at, other[from..from + n].iter().copied());
        }
        10 => {
            let n = rng.small_len(16).max(1);
            let at = rng.below(len + 1);
            let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            data.splice(at..at, bytes);
        }
        11 if len > 1 => {
            // Swap two bytes.
            let (i, j) = (rng.below(len), rng.below(len));
            data.swap(i, j);
        }
        12 if len > 0 => {
            // Replace a digit run with another number (numbers hide in every field).
            let at = rng.below(len);
            if let Some(start) = data[at..].iter().position(u8::is_ascii_digit) {
                let start = at + start;
                let end = data[start..]
                    .iter()
                    .position(|b| !b.is_ascii_digit())
                    .map_or(len, |e| start + e);
                let with = rng
                    .pick(crate::json::RAW_NUMBERS)
                    .copied()
                    .unwrap_or("0")
                    .as_bytes();
                data.splice(start..end, with.iter().copied());
            }
        }
        _ => {
            let at = rng.below(len + 1);
            data.insert(at, *rng.pick(INTERESTING).unwrap_or(&b'\n'));
        }
    }
    data.truncate(max_len);
}
