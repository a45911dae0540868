//! `tokenizer.json` and `tokenizer_config.json` rebuilt from GGUF `tokenizer.*` metadata.
//!
//! Only byte-level BPE (`tokenizer.ggml.model = gpt2`) is rebuilt: the vocabulary is
//! `tokenizer.ggml.tokens` in id order, the merges `tokenizer.ggml.merges` ("left right"), and
//! tokens typed control (3) or user-defined (4) in `tokenizer.ggml.token_type` become added
//! tokens, special and not special respectively. The pre-tokenizer is chosen by
//! `tokenizer.ggml.pre` and reproduces the Hugging Face `tokenizer.json` of that family:
//! - `smollm` / `starcoder`: `Sequence[Digits(individual), ByteLevel(regex)]`, as in
//!   SmolLM2's own `tokenizer.json` (ByteLevel post-processor and decoder);
//! - `gpt-2`: plain `ByteLevel`, whose built-in regex is GPT-2's.
//!
//! Other families need split regexes this module does not carry yet, so they are refused
//! rather than tokenized subtly wrong. Building is O(vocab + merges).

use super::{GgufError, GgufFile};
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{json, Value};
use std::collections::HashMap;

const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The JSON of `tokenizer.json` for `file`.
pub fn tokenizer_json(file: &GgufFile) -> Result<Vec<u8>, GgufError> {
    let model = file.meta_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(unsupported(
            file,
            format!("tokenizer model `{model}` (only gpt2)"),
        ));
    }
    let pre = file.meta_str_opt("tokenizer.ggml.pre")?;
    let (pre_tokenizer, post_processor) = pre_tokenizer(file, pre)?;
    let tokens = file.meta_str_array("tokenizer.ggml.tokens")?;
    let ids = vocab_ids(file, &tokens)?;
    let merges = merges(file, &ids)?;
    let added_tokens = added_tokens(file, &tokens)?;
    let json = TokenizerJson {
        version: "1.0",
        truncation: None,
        padding: None,
        added_tokens,
        normalizer: None,
        pre_tokenizer,
        post_processor,
        decoder: byte_level(true, true),
        model: BpeModel {
            kind: "BPE",
            dropout: None,
            unk_token: None,
            continuing_subword_prefix: None,
            end_of_word_suffix: None,
            fuse_unk: false,
            byte_fallback: false,
            ignore_merges: false,
            vocab: OrderedVocab(&tokens),
            merges,
        },
    };
    serde_json::to_vec(&json).map_err(|source| GgufError::Json {
        file: file.path().to_path_buf(),
        source,
    })
}

/// `tokenizer_config.json`: special token strings, BOS/EOS policy and the chat template.
/// `add_bos_token` is false unless the file says otherwise: byte-level BPE models (SmolLM2,
/// GPT-2) do not prepend a BOS token.
pub fn tokenizer_config_json(file: &GgufFile, model_max_length: u64) -> Result<Value, GgufError> {
    let tokens = file.meta_str_array("tokenizer.ggml.tokens")?;
    let token_of = |key: &str| -> Result<Option<&str>, GgufError> {
        let Some(id) = file.meta_u64_opt(key)? else {
            return Ok(None);
        };
        let token = usize::try_from(id).ok().and_then(|i| tokens.get(i));
        token.map(|t| Some(*t)).ok_or_else(|| GgufError::Invalid {
            file: file.path().to_path_buf(),
            what: format!("metadata `{key}`"),
            reason: format!(
                "token id {id} is outside the {}-token vocabulary",
                tokens.len()
            ),
        })
    };
    let mut config = json!({
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": file.meta_bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(false),
        "add_eos_token": file.meta_bool_opt("tokenizer.ggml.add_eos_token")?.unwrap_or(false),
        "bos_token": token_of("tokenizer.ggml.bos_token_id")?,
        "eos_token": token_of("tokenizer.ggml.eos_token_id")?,
        "unk_token": token_of("tokenizer.ggml.unknown_token_id")?,
        "clean_up_tokenization_spaces": false,
        "model_max_length": model_max_length,
    });
    if let Some(pad) = token_of("tokenizer.ggml.padding_token_id")? {
        config["pad_token"] = json!(pad);
    }
    if let Some(template) = file.meta_str_opt("tokenizer.chat_template")? {
        config["chat_template"] = json!(template);
    }
    Ok(config)
}

/// `(pre_tokenizer, post_processor)` for a `tokenizer.ggml.pre` value.
fn pre_tokenizer(file: &GgufFile, pre: Option<&str>) -> Result<(Value, Value), GgufError> {
    match pre {
        Some("smollm" | "starcoder") => Ok((
            json!({
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits", "individual_digits": true},
                    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                     "use_regex": true},
                ],
            }),
            // Affects offsets only; kept because the upstream tokenizer.json has it.
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
                   "use_regex": true}),
        )),
        Some("gpt-2") => Ok((byte_level(false, true), Value::Null)),
        other => Err(unsupported(
            file,
            format!(
                "pre-tokenizer `{}` (supported: smollm, starcoder, gpt-2)",
                other.unwrap_or("(absent)")
            ),
        )),
    }
}

fn byte_level(add_prefix_space: bool, trim_offsets: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space,
           "trim_offsets": trim_offsets, "use_regex": true})
}

/// Token -> id; a repeated token would make the vocabulary map ambiguous.
fn vocab_ids<'a>(
    file: &GgufFile,
    tokens: &[&'a str],
) -> Result<HashMap<&'a str, usize>, GgufError> {
    let mut ids = HashMap::with_capacity(tokens.len());
    for (id, &token) in tokens.iter().enumerate() {
        if let Some(first) = ids.insert(token, id) {
            return Err(invalid(
                file,
                "tokenizer.ggml.tokens",
                format!("token {token:?} appears at ids {first} and {id}"),
            ));
        }
    }
    Ok(ids)
}

fn merges<'a>(
    file: &'a GgufFile,
    ids: &HashMap<&str, usize>,
) -> Result<Vec<(&'a str, &'a str)>, GgufError> {
    let key = "tokenizer.ggml.merges";
    let merges = file.meta_str_array(key)?;
    merges
        .iter()
        .enumerate()
        .map(|(rank, merge)| {
            // Split at the first space after the first character, as llama.cpp does.
            let split = merge.char_indices().skip(1).find(|&(_, c)| c == ' ');
            let Some((at, _)) = split else {
                return Err(invalid(
                    file,
                    key,
                    format!("merge {rank} {merge:?} has no space"),
                ));
            };
            let (left, right) = (&merge[..at], &merge[at + 1..]);
            for part in [left, right] {
                if !ids.contains_key(part) {
                    let reason =
                        format!("merge {rank} {merge:?}: {part:?} is not in the vocabulary");
                    return Err(invalid(file, key, reason));
                }
            }
            Ok((left, right))
        })
        .collect()
}

fn added_tokens<'a>(file: &GgufFile, tokens: &[&'a str]) -> Result<Vec<AddedToken<'a>>, GgufError> {
    let key = "tokenizer.ggml.token_type";
    let Some(types) = file.meta_i64_array_opt(key)? else {
        return Ok(Vec::new());
    };
    if types.len() != tokens.len() {
        let reason = format!("{} types for {} tokens", types.len(), tokens.len());
        return Err(invalid(file, key, reason));
    }
    let added = tokens.iter().zip(&types).enumerate();
    Ok(added
        .filter(|(_, (_, &ty))| ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED)
        .map(|(id, (&content, &ty))| AddedToken {
            id,
            content,
            single_word: false,
            lstrip: false,
            rstrip: false,
            normalized: false,
            special: ty == TOKEN_TYPE_CONTROL,
        })
        .collect())
}

fn invalid(file: &GgufFile, key: &str, reason: String) -> GgufError {
    GgufError::Invalid {
        file: file.path().to_path_buf(),
        what: format!("metadata `{key}`"),
        reason,
    }
}

fn unsupported(file: &GgufFile, what: String) -> GgufError {
    GgufError::Unsupported {
        file: file.path().to_path_buf(),
        what,
    }
}

#[derive(serde::Serialize)]
struct TokenizerJson<'a> {
    version: &'static str,
    truncation: Option<Value>,
    padding: Option<Value>,
    added_tokens: Vec<AddedToken<'a>>,
    normalizer: Option<Value>,
    pre_tokenizer: Value,
    post_processor: Value,
    decoder: Value,
    model: BpeModel<'a>,
}

#[derive(serde::Serialize)]
struct AddedToken<'a> {
    id: usize,
    content: &'a str,
    single_word: bool,
    lstrip: bool,
    rstrip: bool,
    normalized: bool,
    special: bool,
}

#[derive(serde::Serialize)]
struct BpeModel<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    dropout: Option<f32>,
    unk_token: Option<&'a str>,
    continuing_subword_prefix: Option<&'a str>,
    end_of_word_suffix: Option<&'a str>,
    fuse_unk: bool,
    byte_fallback: bool,
    ignore_merges: bool,
    vocab: OrderedVocab<'a>,
    merges: Vec<(&'a str, &'a str)>,
}

/// The vocabulary as a JSON object in id order (serde_json's `Map` would sort it by token).
struct OrderedVocab<'a>(&'a [&'a str]);

impl Serialize for OrderedVocab<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (id, token) in self.0.iter().enumerate() {
            map.serialize_entry(token, &id)?;
        }
        map.end()
    }
}
