//! JSON-aware mutations: parse the input, change one node of the tree, and write it back, with
//! the writer itself able to produce what a tree cannot hold (duplicate keys, escaped keys,
//! numbers past every range, odd whitespace).
//!
//! Node changes: drop, duplicate or rename a field; add a protocol field; retype a value;
//! boundary and extreme numbers; empty, huge and unusual Unicode strings; deep nesting; grow an
//! array past a limit; graft a subtree from another input. O(input) per mutation.

use crate::rng::Rng;
use serde_json::{Map, Value};

/// Numbers written as they are (many have no `serde_json::Value`): the limits kvgate checks and
/// the edges of i64, u64, f32 and f64.
pub const RAW_NUMBERS: &[&str] = &[
    "0",
    "-0",
    "1",
    "-1",
    "2",
    "-2",
    "0.5",
    "1.0",
    "16",
    "17",
    "20",
    "21",
    "255",
    "256",
    "257",
    "300",
    "301",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "-9223372036854775809",
    "18446744073709551615",
    "18446744073709551616",
    "123456789012345678901234567890",
    "1e308",
    "-1e308",
    "1.7976931348623157e308",
    "1e309",
    "1e400",
    "-1e400",
    "5e-324",
    "1e-320",
    "1e-400",
    "1e-5",
    "9.99999e-6",
    "1.00001e-5",
    "1e-46",
    "1e-50",
    "-1e-50",
    "3.4028235e38",
    "3.4028236e38",
    "1e39",
    "100",
    "100.0000001",
    "-100.0000001",
    "2.0000001",
    "-2.0000001",
    "1E2",
    "1e+2",
    "0e0",
    "0.0000001",
];

/// Strings worth trying in any field: roles and part types, numbers as text, Unicode that
/// changes length or direction, control characters, SSE framing.
const STRINGS: &[&str] = &[
    "",
    "a",
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
    "User",
    "text",
    "image_url",
    "input_audio",
    "none",
    "auto",
    "required",
    "json_object",
    "json_schema",
    "[DONE]",
    "\n\n",
    "data: {}\n\n",
    " 12 ",
    "+5",
    "-1",
    "0x10",
    "\u{ff11}\u{ff12}",
    "\u{663}",
    "4294967296",
    "\u{1f980}",
    "e\u{301}",
    "\u{202e}abc",
    "\u{0}",
    "\u{feff}",
    "\u{10ffff}",
    "kvgate",
    "cache_salt",
];

/// Field names of the protocol (requests, usage, chunks, errors).
pub const FIELDS: &[&str] = &[
    "model",
    "messages",
    "role",
    "content",
    "name",
    "type",
    "text",
    "image_url",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "best_of",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "min_tokens",
    "ignore_eos",
    "echo",
    "suffix",
    "stream",
    "stream_options",
    "include_usage",
    "user",
    "tools",
    "tool_choice",
    "response_format",
    "cache_salt",
    "cache_scope",
    "usage",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "prompt_tokens_details",
    "cached_tokens",
    "choices",
    "delta",
    "index",
    "finish_reason",
    "error",
    "message",
    "code",
    "param",
    "id",
    "object",
    "created",
];

/// Marks a string the writer emits raw (a number token no `Value` can hold).
const RAW: &str = "\u{1}raw:";

/// Lengths that sit on a limit (`n`, `stop`, `stop_token_ids`, `logit_bias`, top logprobs).
const LENGTHS: &[usize] = &[
    0, 1, 2, 15, 16, 17, 20, 21, 255, 256, 257, 299, 300, 301, 1000,
];

/// Nesting depths around serde_json's recursion limit (128).
const DEPTHS: &[usize] = &[1, 2, 8, 126, 127, 128, 129, 200, 1000];

/// Parses `data` as JSON, applies one tree mutation (`other` provides grafts) and writes it back;
/// `None` when `data` is not JSON.
pub fn mutate_json(data: &[u8], other: &[u8], rng: &mut Rng) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(data).ok()?;
    let donor: Option<Value> = serde_json::from_slice(other).ok();
    on_random_node(&mut v, rng, &mut |node, rng| {
        mutate_node(node, donor.as_ref(), rng)
    });
    let mut out = Vec::with_capacity(data.len() + 64);
    let style = Style::random(rng);
    write(&v, &style, rng, &mut out);
    Some(out)
}

/// Calls `f` on a node reached by a random walk from the root (stopping early favours shallow
/// nodes, where most request fields are).
fn on_random_node(v: &mut Value, rng: &mut Rng, f: &mut dyn FnMut(&mut Value, &mut Rng)) {
    let mut cur = v;
    loop {
        let n = match &*cur {
            Value::Array(a) => a.len(),
            Value::Object(o) => o.len(),
            _ => 0,
        };
        if n == 0 || rng.one_in(3) {
            return f(cur, rng);
        }
        let i = rng.below(n);
        cur = match cur {
            Value::Array(a) => &mut a[i],
            Value::Object(o) => match o.values_mut().nth(i) {
                Some(x) => x,
                None => return,
            },
            other => return f(other, rng),
        };
    }
}

fn mutate_node(node: &mut Value, donor: Option<&Value>, rng: &mut Rng) {
    match rng.below(10) {
        0 => *node = scalar(rng),
        1 => *node = retype(node, rng),
        2 => *node = nest(node.take(), rng),
        3 => {
            if let Some(d) = donor {
                let mut graft = d.clone();
                on_random_node(&mut graft, rng, &mut |n, _| *node = n.take());
            }
        }
        _ => match node {
            Value::Object(o) => mutate_object(o, donor, rng),
            Value::Array(a) => mutate_array(a, rng),
            Value::String(s) => *s = string(rng),
            Value::Number(_) => *node = number(rng),
            Value::Bool(b) => *b = !*b,
            Value::Null => *node = scalar(rng),
        },
    }
}

fn mutate_object(o: &mut Map<String, Value>, donor: Option<&Value>, rng: &mut Rng) {
    let keys: Vec<String> = o.keys().cloned().collect();
    match rng.below(6) {
        0 if !keys.is_empty() => {
            o.remove(&keys[rng.below(keys.len())]);
        }
        1 if !keys.is_empty() => {
            // Rename a field: to another field's name, or to a near miss of its own.
            let k = &keys[rng.below(keys.len())];
            let v = o.remove(k).unwrap_or(Value::Null);
            let name = match rng.below(3) {
                0 => k.to_uppercase(),
                1 => format!("{k} "),
                _ => (*rng.pick(FIELDS).unwrap_or(&"x")).to_owned(),
            };
            o.insert(name, v);
        }
        2 => {
            // A field the donor has, with the donor's value (valid values move across inputs).
            if let Some(Value::Object(d)) = donor {
                if let Some((k, v)) = d.iter().nth(rng.below(d.len())) {
                    o.insert(k.clone(), v.clone());
                }
            }
        }
        _ => {
            let k = (*rng.pick(FIELDS).unwrap_or(&"x")).to_owned();
            let v = match rng.below(4) {
                0 => Value::Array((0..rng.range(1, 3)).map(|_| scalar(rng)).collect()),
                1 => Value::Object(Map::from_iter([(
                    (*rng.pick(FIELDS).unwrap_or(&"x")).to_owned(),
                    scalar(rng),
                )])),
                _ => scalar(rng),
            };
            o.insert(k, v);
        }
    }
}

fn mutate_array(a: &mut Vec<Value>, rng: &mut Rng) {
    let len = a.len();
    match rng.below(6) {
        0 if len > 0 => {
            a.remove(rng.below(len));
        }
        1 if len > 0 => {
            let i = rng.below(len);
            a.insert(i, a[i].clone());
        }
        2 if len > 0 => {
            // Grow to a length on a limit, varying numbers so that ids stay distinct.
            let target = *rng.pick(LENGTHS).unwrap_or(&17);
            let mut i = 0usize;
            while a.len() < target {
                let mut v = a[i % len].clone();
                if v.is_number() {
                    v = Value::from(a.len() as u64);
                }
                a.push(v);
                i += 1;
            }
            a.truncate(target.max(1));
        }
        3 => a.clear(),
        4 => a.reverse(),
        _ => a.push(scalar(rng)),
    }
}

/// A random scalar: an interesting number or string, a bool or null.
fn scalar(rng: &mut Rng) -> Value {
    match rng.below(8) {
        0 => Value::Null,
        1 => Value::Bool(rng.coin()),
        2..=4 => number(rng),
        _ => Value::String(string(rng)),
    }
}

/// An interesting number, usually written raw (so it may lie outside every Rust type).
fn number(rng: &mut Rng) -> Value {
    if rng.one_in(4) {
        return Value::from(rng.next_u64() as i64 >> rng.below(64));
    }
    let raw = rng.pick(RAW_NUMBERS).copied().unwrap_or("0");
    Value::String(format!("{RAW}{raw}"))
}

fn string(rng: &mut Rng) -> String {
    match rng.below(10) {
        0 => {
            let n = *rng
                .pick(&[255usize, 256, 257, 4096, 70_000])
                .unwrap_or(&257);
            "x".repeat(n)
        }
        // Two bytes a character: a byte limit met in characters, or not.
        1 => "\u{e9}".repeat(rng.range(120, 140)),
        2 => {
            let base = rng.pick(STRINGS).copied().unwrap_or("");
            base.repeat(rng.range(1, 4))
        }
        _ => rng.pick(STRINGS).copied().unwrap_or("").to_owned(),
    }
}

/// The same content as another JSON type (a number as a string, a value in a list, ...).
fn retype(v: &Value, rng: &mut Rng) -> Value {
    match (v, rng.below(4)) {
        (Value::String(s), 0) => match s.trim().parse::<f64>() {
            Ok(x) => Value::from(x),
            Err(_) => Value::from(s.len() as u64),
        },
        (Value::Number(n), 0) => Value::String(n.to_string()),
        (Value::Bool(b), 0) => Value::from(u64::from(*b)),
        (Value::Array(a), 0) => a.first().cloned().unwrap_or(Value::Null),
        (Value::Object(o), 0) => Value::Array(o.values().cloned().collect()),
        (_, 1) => Value::Array(vec![v.clone()]),
        (_, 2) => Value::Object(Map::from_iter([(
            (*rng.pick(FIELDS).unwrap_or(&"type")).to_owned(),
            v.clone(),
        )])),
        _ => Value::String(v.to_string()),
    }
}

/// `v` inside arrays and objects, to a depth around the parser's limit.
fn nest(v: Value, rng: &mut Rng) -> Value {
    let depth = *rng.pick(DEPTHS).unwrap_or(&2);
    let mut out = v;
    for _ in 0..depth {
        out = if rng.coin() {
            Value::Array(vec![out])
        } else {
            Value::Object(Map::from_iter([("a".to_owned(), out)]))
        };
    }
    out
}

/// How the writer lays out one document.
#[derive(Debug)]
struct Style {
    /// One in this many object entries is written twice, the second time with another value.
    dup_key: usize,
    /// One in this many keys has its characters escaped (`\u0061`).
    escape_key: usize,
    /// Whitespace between tokens.
    space: &'static str,
}

impl Style {
    fn random(rng: &mut Rng) -> Style {
        Style {
            dup_key: if rng.one_in(8) { rng.range(1, 4) } else { 0 },
            escape_key: if rng.one_in(16) { rng.range(1, 3) } else { 0 },
            space: rng
                .pick(&["", "", "", "", " ", "\n", "\t", "\r\n "])
                .copied()
                .unwrap_or(""),
        }
    }
}

fn write(v: &Value, style: &Style, rng: &mut Rng, out: &mut Vec<u8>) {
    match v {
        Value::String(s) if s.starts_with(RAW) => out.extend_from_slice(&s.as_bytes()[RAW.len()..]),
        Value::Array(a) => {
            out.push(b'[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                    out.extend_from_slice(style.space.as_bytes());
                }
                write(x, style, rng, out);
            }
            out.push(b']');
        }
        Value::Object(o) => {
            out.push(b'{');
            out.extend_from_slice(style.space.as_bytes());
            let mut first = true;
            for (k, x) in o {
                let twice = style.dup_key > 0 && rng.one_in(style.dup_key);
                for round in 0..1 + usize::from(twice) {
                    if !first {
                        out.push(b',');
                        out.extend_from_slice(style.space.as_bytes());
                    }
                    first = false;
                    write_key(k, style, rng, out);
                    out.push(b':');
                    out.extend_from_slice(style.space.as_bytes());
                    if round == 0 {
                        write(x, style, rng, out);
                    } else {
                        write(&scalar(rng), style, rng, out);
                    }
                }
            }
            out.extend_from_slice(style.space.as_bytes());
            out.push(b'}');
        }
        // Serializing a plain value into a Vec cannot fail.
        other => serde_json::to_writer(&mut *out, other).unwrap_or_default(),
    }
}

fn write_key(k: &str, style: &Style, rng: &mut Rng, out: &mut Vec<u8>) {
    if style.escape_key > 0 && rng.one_in(style.escape_key) {
        out.push(b'"');
        for c in k.chars() {
            let mut buf = [0u16; 2];
            for unit in c.encode_utf16(&mut buf) {
                out.extend_from_slice(format!("\\u{unit:04x}").as_bytes());
            }
        }
        out.push(b'"');
    } else {
        serde_json::to_writer(&mut *out, k).unwrap_or_default();
    }
}
