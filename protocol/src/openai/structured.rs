//! Structured outputs and tool calling: `response_format`, `tools`, `tool_choice` and
//! `parallel_tool_calls`, checked here (the same rules in the gateway and the engine) and turned
//! into a [`Grammar`] that the engine compiles into per-token masks, so that the output always
//! parses and always matches.
//!
//! - `response_format`: `{"type":"text"}` (no constraint), `{"type":"json_object"}` (any JSON
//!   object), `{"type":"json_schema","json_schema":{"name","schema","strict"}}` (JSON matching the
//!   schema), and two kvgate extensions: `{"type":"regex","regex":"..."}` (the whole output
//!   matches the regular expression) and `{"type":"lark","lark":"..."}` (a context-free grammar
//!   in llguidance's Lark dialect, with `%json {schema}` allowed as a rule).
//! - `tools`: function tools, rendered into the system turn in the format documented in
//!   `docs/structured-outputs.md` ([`TOOLS_PREAMBLE`]), so a tenant's repeated tool definitions
//!   are a cached prefix like any system prompt. The model answers with
//!   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, which the engine parses
//!   into OpenAI's `tool_calls` ([`parse_tool_calls`]).
//! - `tool_choice`: `"none"` (tools are not rendered), `"auto"` (rendered, output free),
//!   `"required"` or `{"type":"function","function":{"name":...}}` (output constrained to calls of
//!   the allowed tools with arguments matching their schemas).
//!
//! Every shape error is a 400 naming the field. Schemas are bounded in size and depth
//! ([`MAX_SCHEMA_BYTES`], [`MAX_SCHEMA_DEPTH`]); what a schema asks that the compiler cannot do is
//! the engine's 400 when it compiles it.

use super::error::ApiError;
use crate::prompt::ChatMessage;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// Largest schema (or grammar, or regex), serialized, in bytes.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// Deepest nesting of arrays and objects in a schema.
pub const MAX_SCHEMA_DEPTH: usize = 32;
/// Most calls in one constrained answer with `parallel_tool_calls`: a small model that may write
/// another call after each one would otherwise repeat calls until `max_tokens`.
pub const MAX_PARALLEL_CALLS: usize = 4;
/// Most tools a request may define.
pub const MAX_TOOLS: usize = 128;
/// Longest tool or schema name (OpenAI's limit).
pub const MAX_NAME_LEN: usize = 64;

/// A constraint on the whole output, compiled by the engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Grammar {
    /// One JSON value matching the schema.
    JsonSchema(Value),
    /// Text matching the regular expression, whole.
    Regex(String),
    /// A Lark grammar (llguidance's dialect).
    Lark(String),
    /// The Lark grammar of required tool calls ([`tool_call_grammar`]).
    ToolCalls(String),
}

impl Grammar {
    /// A stable key for caching the compiled grammar.
    pub fn cache_key(&self) -> String {
        match self {
            Grammar::JsonSchema(s) => format!("json:{s}"),
            Grammar::Regex(r) => format!("regex:{r}"),
            Grammar::Lark(l) => format!("lark:{l}"),
            Grammar::ToolCalls(l) => format!("tools:{l}"),
        }
    }

    /// The request field the grammar came from, for errors.
    pub fn param(&self) -> &'static str {
        match self {
            Grammar::ToolCalls(_) => "tools",
            _ => "response_format",
        }
    }
}

/// How JSON is laid out in constrained output: `json.dumps` style, one space after `,` and `:`,
/// no other whitespace (a small model given free whitespace at temperature 1 may never stop).
const JSON_LAYOUT: &str =
    r#"{"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}"#;

fn json_layout() -> Value {
    serde_json::from_str(JSON_LAYOUT).expect("valid layout")
}

/// A schema with kvgate's JSON layout; a client's own `x-guidance` options are dropped (the
/// layout is the server's to set).
fn with_layout(schema: &Value) -> Value {
    match schema {
        Value::Object(o) => {
            let mut o = o.clone();
            o.insert("x-guidance".into(), json_layout());
            Value::Object(o)
        }
        // `true` and `false` are schemas too: any value, no value.
        Value::Bool(true) => json!({"x-guidance": json_layout()}),
        other => other.clone(),
    }
}

/// One function tool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON schema of the arguments object; `None` takes any object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
}

impl Tool {
    /// The schema a call of this tool must match: `{"name": <name>, "arguments": <parameters>}`.
    fn call_schema(&self) -> Value {
        let arguments = self
            .parameters
            .clone()
            .unwrap_or_else(|| json!({"type": "object"}));
        json!({
            "type": "object",
            "properties": {"name": {"const": self.name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        })
    }

    /// The tool as rendered in the prompt: compact JSON with sorted keys, so the same tools give
    /// the same text (and the same cached prefix) whatever order a client wrote them in.
    fn rendered(&self) -> String {
        let mut out = String::new();
        write_sorted(&self.definition(), &mut out);
        out
    }

    fn definition(&self) -> Value {
        let mut f = Map::new();
        f.insert("name".into(), Value::String(self.name.clone()));
        if let Some(d) = &self.description {
            f.insert("description".into(), Value::String(d.clone()));
        }
        if let Some(p) = &self.parameters {
            f.insert("parameters".into(), p.clone());
        }
        json!({"type": "function", "function": f})
    }
}

/// Which tools the model may, or must, call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Function(String),
}

/// The validated structured-output part of a chat request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Structured {
    /// The output constraint, if any.
    pub grammar: Option<Grammar>,
    /// Tools the output may call: tool calls are parsed out of the output when non-empty.
    pub tools: Vec<Tool>,
}

impl Structured {
    /// Whether tool calls are parsed from the output.
    pub fn parses_tool_calls(&self) -> bool {
        !self.tools.is_empty()
    }
}

/// The opening and closing of a tool call in the output.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";
const TOOL_CALL_OPEN_LARK: &str = "\"<tool_call>\\n\"";

/// The text before the tool definitions in the system turn.
pub const TOOLS_PREAMBLE: &str = "# Tools\n\nYou may call one or more functions to assist with \
the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n\
<tools>\n";

/// The text after them.
pub const TOOLS_POSTAMBLE: &str = "</tools>\n\nFor each function call, return a json object \
with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_value(param, message)
}

/// Checks a name: 1 to 64 of `a-z A-Z 0-9 _ -`.
fn check_name(param: &str, name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(bad(
            param,
            format!(
                "Invalid '{param}': {name:?} must be 1 to {MAX_NAME_LEN} characters of a-z, A-Z, \
                 0-9, underscores and dashes."
            ),
        ))
    }
}

/// Checks a schema's size and depth, and that it is an object or a boolean.
fn check_schema(param: &str, schema: &Value) -> Result<(), ApiError> {
    if !matches!(schema, Value::Object(_) | Value::Bool(_)) {
        return Err(bad(
            param,
            format!("Invalid '{param}': a JSON schema is an object (or true / false)."),
        ));
    }
    let size = serde_json::to_string(schema).map_or(usize::MAX, |s| s.len());
    if size > MAX_SCHEMA_BYTES {
        return Err(bad(
            param,
            format!(
                "Invalid '{param}': the schema is {size} bytes; the limit is {MAX_SCHEMA_BYTES}."
            ),
        ));
    }
    if depth(schema) > MAX_SCHEMA_DEPTH {
        return Err(bad(
            param,
            format!("Invalid '{param}': the schema nests deeper than {MAX_SCHEMA_DEPTH} levels."),
        ));
    }
    Ok(())
}

/// Nesting depth of arrays and objects, without recursion (a hostile body can nest as deep as
/// the JSON parser allows).
fn depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, d)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match v {
            Value::Array(a) => Box::new(a.iter()),
            Value::Object(o) => Box::new(o.values()),
            _ => continue,
        };
        deepest = deepest.max(d);
        stack.extend(children.map(|c| (c, d + 1)));
    }
    deepest
}

fn check_text(param: &str, text: &str) -> Result<(), ApiError> {
    if text.is_empty() {
        return Err(bad(param, format!("Invalid '{param}': it is empty.")));
    }
    if text.len() > MAX_SCHEMA_BYTES {
        return Err(bad(
            param,
            format!(
                "Invalid '{param}': it is {} bytes; the limit is {MAX_SCHEMA_BYTES}.",
                text.len()
            ),
        ));
    }
    Ok(())
}

fn str_field<'a>(o: &'a Map<String, Value>, key: &str, param: &str) -> Result<&'a str, ApiError> {
    match o.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(bad(param, format!("Invalid '{param}': expected a string."))),
        None => Err(bad(
            param,
            format!("Missing required parameter: '{param}'."),
        )),
    }
}

/// `response_format` as a grammar (`None` for text).
pub fn response_format(format: Option<&Value>) -> Result<Option<Grammar>, ApiError> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let Value::Object(o) = format else {
        return Err(bad(
            "response_format",
            "Invalid 'response_format': expected an object with a 'type'.",
        ));
    };
    let kind = str_field(o, "type", "response_format.type")?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Grammar::JsonSchema(with_layout(
            &json!({"type": "object"}),
        )))),
        "json_schema" => {
            let Some(Value::Object(js)) = o.get("json_schema") else {
                return Err(bad(
                    "response_format.json_schema",
                    "Missing required parameter: 'response_format.json_schema' (an object with \
                     'name' and 'schema').",
                ));
            };
            check_name(
                "response_format.json_schema.name",
                str_field(js, "name", "response_format.json_schema.name")?,
            )?;
            if let Some(s) = js.get("strict").filter(|s| !s.is_null() && !s.is_boolean()) {
                return Err(bad(
                    "response_format.json_schema.strict",
                    format!("Invalid 'response_format.json_schema.strict': expected a boolean, got {s}."),
                ));
            }
            // The schema is always enforced, strict or not.
            let schema = js.get("schema").cloned().unwrap_or(Value::Bool(true));
            check_schema("response_format.json_schema.schema", &schema)?;
            Ok(Some(Grammar::JsonSchema(with_layout(&schema))))
        }
        "regex" => {
            let r = str_field(o, "regex", "response_format.regex")?;
            check_text("response_format.regex", r)?;
            Ok(Some(Grammar::Regex(r.to_owned())))
        }
        "lark" => {
            let l = str_field(o, "lark", "response_format.lark")?;
            check_text("response_format.lark", l)?;
            Ok(Some(Grammar::Lark(l.to_owned())))
        }
        other => Err(ApiError::unsupported(
            "response_format.type",
            format!(
                "Invalid 'response_format.type': {other:?} is not one of text, json_object, \
                 json_schema, regex, lark."
            ),
        )),
    }
}

/// A constrained output ends where its grammar does: `ignore_eos` would run it past the end.
pub fn check_ends(params: &super::params::SamplingParams) -> Result<(), ApiError> {
    if params.grammar.is_some() && params.ignore_eos {
        return Err(bad(
            "ignore_eos",
            "Invalid 'ignore_eos': a constrained output (response_format or required tool calls) \
             ends where its grammar does.",
        ));
    }
    Ok(())
}

/// `tools` as function tools.
pub fn tools(tools: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let list = match tools {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(bad("tools", "Invalid 'tools': expected an array of tools.")),
    };
    if list.len() > MAX_TOOLS {
        return Err(bad(
            "tools",
            format!(
                "Invalid 'tools': {} tools; the limit is {MAX_TOOLS}.",
                list.len()
            ),
        ));
    }
    let mut out: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        let Value::Object(t) = t else {
            return Err(bad(&p, format!("Invalid '{p}': expected an object.")));
        };
        let kind = str_field(t, "type", &format!("{p}.type"))?;
        if kind != "function" {
            return Err(ApiError::unsupported(
                format!("{p}.type"),
                format!("Invalid '{p}.type': only \"function\" tools are supported, got {kind:?}."),
            ));
        }
        let Some(Value::Object(f)) = t.get("function") else {
            return Err(bad(
                &format!("{p}.function"),
                format!("Missing required parameter: '{p}.function' (an object)."),
            ));
        };
        let name = str_field(f, "name", &format!("{p}.function.name"))?;
        check_name(&format!("{p}.function.name"), name)?;
        if out.iter().any(|o| o.name == name) {
            return Err(bad(
                &format!("{p}.function.name"),
                format!("Invalid '{p}.function.name': the tool {name:?} is defined twice."),
            ));
        }
        let description = match f.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(_) => {
                return Err(bad(
                    &format!("{p}.function.description"),
                    format!("Invalid '{p}.function.description': expected a string."),
                ))
            }
        };
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => None,
            Some(s) => {
                check_schema(&format!("{p}.function.parameters"), s)?;
                Some(s.clone())
            }
        };
        out.push(Tool {
            name: name.to_owned(),
            description,
            parameters,
        });
    }
    Ok(out)
}

/// `tool_choice`; its default is `auto` with tools and `none` without, as OpenAI's.
pub fn tool_choice(choice: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let choice = match choice {
        None | Some(Value::Null) if tools.is_empty() => ToolChoice::None,
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(
                    "tool_choice",
                    format!(
                        "Invalid 'tool_choice': {other:?} is not one of none, auto, required, or \
                         an object naming a function."
                    ),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = match o.get("function") {
                Some(Value::Object(f)) => str_field(f, "name", "tool_choice.function.name")?,
                _ => {
                    return Err(bad(
                        "tool_choice.function",
                        "Missing required parameter: 'tool_choice.function' (an object with \
                         'name').",
                    ))
                }
            };
            ToolChoice::Function(name.to_owned())
        }
        Some(_) => {
            return Err(bad(
                "tool_choice",
                "Invalid 'tool_choice': expected a string or an object.",
            ))
        }
    };
    match &choice {
        // `auto` with nothing to call is no tools at all.
        ToolChoice::Auto if tools.is_empty() => Ok(ToolChoice::None),
        ToolChoice::Required if tools.is_empty() => Err(bad(
            "tool_choice",
            "Invalid 'tool_choice': it asks for tool calls, but 'tools' is empty.",
        )),
        ToolChoice::Function(name) if !tools.iter().any(|t| &t.name == name) => Err(bad(
            "tool_choice.function.name",
            format!("Invalid 'tool_choice': the function {name:?} is not among 'tools'."),
        )),
        _ => Ok(choice),
    }
}

/// The grammar of the output when the model calls tools: one or more `<tool_call>` blocks (just
/// one unless `parallel`), each a call of one of `tools`; or, when `answer` is set (a JSON
/// schema, with `tool_choice` `auto`), either that JSON or the calls.
pub fn tool_call_grammar(tools: &[&Tool], parallel: bool, answer: Option<&Value>) -> Grammar {
    let any_of: Vec<Value> = tools.iter().map(|t| t.call_schema()).collect();
    let schema = with_layout(&json!({"anyOf": any_of}));
    // `call ("\n" call (...)?)?`: at most MAX_PARALLEL_CALLS calls.
    let mut calls = "call".to_owned();
    if parallel {
        for _ in 1..MAX_PARALLEL_CALLS {
            calls = format!("call (\"\\n\" {calls})?");
        }
    }
    let mut lark = match answer {
        Some(a) => format!("start: answer | calls\nanswer: %json {a}\n"),
        None => "start: calls\n".to_owned(),
    };
    lark.push_str(&format!(
        "calls: {calls}\ncall: {TOOL_CALL_OPEN_LARK} body \"\\n</tool_call>\"\nbody: %json {schema}\n"
    ));
    Grammar::ToolCalls(lark)
}

/// The system turn's text for `tools`.
pub fn render_tools(tools: &[Tool]) -> String {
    let mut out = String::from(TOOLS_PREAMBLE);
    for t in tools {
        out.push_str(&t.rendered());
        out.push('\n');
    }
    out.push_str(TOOLS_POSTAMBLE);
    out
}

/// The conversation with the tools in its system turn: appended to a leading system (or
/// developer) message, or as a new system message first.
pub fn add_tools_to_system(messages: &mut Vec<ChatMessage>, tools: &[Tool]) {
    let text = render_tools(tools);
    match messages.first_mut() {
        Some(m) if m.role == "system" || m.role == "developer" => {
            if !m.content.is_empty() {
                m.content.push_str("\n\n");
            }
            m.content.push_str(&text);
        }
        _ => messages.insert(
            0,
            ChatMessage {
                role: "system".into(),
                content: text,
            },
        ),
    }
}

/// One tool call in an assistant message of the conversation, as sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    pub function: RequestFunctionCall,
}

/// The function of a [`RequestToolCall`]: `arguments` is a JSON string, as OpenAI sends it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestFunctionCall {
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

/// An assistant turn's tool calls as the model writes them.
pub fn render_tool_calls(content: &str, calls: &[RequestToolCall]) -> String {
    let mut out = content.to_owned();
    for c in calls {
        // As the model writes a call (the constrained layout), keys in the order sent, so that
        // a conversation's next turn repeats the tokens of the call it made.
        let args = match serde_json::from_str::<Value>(&c.function.arguments) {
            Ok(_) => relayout(&c.function.arguments, ", ", ": "),
            Err(_) => Value::String(c.function.arguments.clone()).to_string(),
        };
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(TOOL_CALL_OPEN);
        out.push('\n');
        out.push_str(&format!(
            "{{\"name\": {}, \"arguments\": {args}}}",
            Value::String(c.function.name.clone())
        ));
        out.push('\n');
        out.push_str(TOOL_CALL_CLOSE);
    }
    out
}

/// A tool result as the model reads it.
pub fn render_tool_result(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// A tool call parsed from the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedToolCall {
    pub name: String,
    /// The arguments object, serialized.
    pub arguments: String,
}

/// The tool calls in `text` and its other text, by the same rule as a stream
/// ([`ToolCallStream`]): each well-formed `<tool_call>` block naming one of `tools` is a call,
/// everything else is content (trimmed; whitespace between calls dropped). `None` when there is
/// no call: the output is plain content. A call that repeats an earlier one exactly (same tool,
/// same arguments) is dropped: parallel calls that are the same call do nothing more.
pub fn parse_tool_calls(text: &str, tools: &[Tool]) -> Option<(String, Vec<ParsedToolCall>)> {
    let mut stream = ToolCallStream::default();
    let mut pieces = stream.push(text, tools);
    pieces.extend(stream.finish());
    let (content, calls) = join_pieces(pieces);
    if calls.is_empty() {
        return None;
    }
    Some((content.trim().to_owned(), calls))
}

/// A stream's pieces as one text and its calls, in order.
fn join_pieces(pieces: Vec<StreamPiece>) -> (String, Vec<ParsedToolCall>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    for piece in pieces {
        match piece {
            StreamPiece::Content(c) => content.push_str(&c),
            StreamPiece::Call { index, call } => {
                debug_assert_eq!(index, calls.len());
                calls.push(call);
            }
        }
    }
    (content, calls)
}

/// What follows a `<tool_call>`.
#[derive(Debug, PartialEq)]
enum Scan {
    /// A call of a known tool, and the length of its text up to and with `</tool_call>`.
    Call(ParsedToolCall, usize),
    /// Not all of it yet.
    Incomplete,
    /// Not a call.
    Invalid,
}

/// Reads a call's JSON (a string in it may hold `</tool_call>`), then its closing tag.
fn scan_call(body: &str, tools: &[Tool]) -> Scan {
    let mut values = serde_json::Deserializer::from_str(body).into_iter::<serde::de::IgnoredAny>();
    match values.next() {
        Some(Ok(_)) => {}
        Some(Err(e)) if e.is_eof() => return Scan::Incomplete,
        None => return Scan::Incomplete,
        Some(Err(_)) => return Scan::Invalid,
    }
    let value = &body[..values.byte_offset()];
    let after = &body[values.byte_offset()..];
    let trimmed = after.trim_start();
    let ws = after.len() - trimmed.len();
    if !trimmed.starts_with(TOOL_CALL_CLOSE) {
        return if TOOL_CALL_CLOSE.starts_with(trimmed) {
            Scan::Incomplete
        } else {
            Scan::Invalid
        };
    }
    match call_of(value, tools) {
        Some(call) => Scan::Call(call, values.byte_offset() + ws + TOOL_CALL_CLOSE.len()),
        None => Scan::Invalid,
    }
}

/// A call as written: its arguments kept as text, in the model's key order.
#[derive(Deserialize)]
struct WrittenCall<'a> {
    name: String,
    #[serde(borrow)]
    arguments: &'a serde_json::value::RawValue,
}

/// The call in `text` (one JSON value), when it names one of `tools` and its arguments are an
/// object (or a JSON string holding one, as the API sends them). The arguments come back
/// compact, keys in the order written.
fn call_of(text: &str, tools: &[Tool]) -> Option<ParsedToolCall> {
    let call: WrittenCall<'_> = serde_json::from_str(text).ok()?;
    if !tools.iter().any(|t| t.name == call.name) {
        return None;
    }
    let raw = call.arguments.get();
    let args = match serde_json::from_str::<Value>(raw).ok()? {
        Value::String(s) => s,
        Value::Object(_) => raw.to_owned(),
        _ => return None,
    };
    if !serde_json::from_str::<Value>(&args).ok()?.is_object() {
        return None;
    }
    Some(ParsedToolCall {
        name: call.name,
        arguments: relayout(&args, ",", ":"),
    })
}

/// `json` (valid JSON) with no whitespace but `item` after each `,` and `key` after each `:`,
/// outside strings; keys and values as written.
fn relayout(json: &str, item: &str, key: &str) -> String {
    let mut out = String::with_capacity(json.len());
    let (mut in_string, mut escaped) = (false, false);
    for c in json.chars() {
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            ',' => out.push_str(item),
            ':' => out.push_str(key),
            c if c.is_whitespace() => {}
            c => out.push(c),
        }
    }
    out
}

/// Compact JSON with every object's keys sorted, whatever order the map keeps.
fn write_sorted(v: &Value, out: &mut String) {
    match v {
        Value::Object(o) => {
            let mut keys: Vec<&String> = o.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_sorted(&o[k], out);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_sorted(x, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// What a streamed output becomes once tool calls are parsed out of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamPiece {
    Content(String),
    /// Call `index` (0, 1, ... in the order written) of the answer.
    Call {
        index: usize,
        call: ParsedToolCall,
    },
}

/// Most text held back while a call is incomplete; past it, the text goes out as content.
pub const MAX_HELD_CALL_BYTES: usize = 64 * 1024;

/// Parses tool calls out of an output as it streams: text passes through as content except
/// what may be the start of a `<tool_call>`, which is held until it is known; a whole call is
/// one [`StreamPiece::Call`]. A `<tool_call>` not followed by a call's JSON goes out as content
/// at once, and scanning goes on after it; so does one whose JSON outgrows
/// [`MAX_HELD_CALL_BYTES`]. A stream and the full response ([`parse_tool_calls`]) read the same
/// output the same way.
#[derive(Debug, Clone, Default)]
pub struct ToolCallStream {
    held: String,
    in_call: bool,
    calls: Vec<ParsedToolCall>,
}

impl ToolCallStream {
    /// Calls parsed so far.
    pub fn calls(&self) -> usize {
        self.calls.len()
    }

    /// Feeds more output text.
    pub fn push(&mut self, text: &str, tools: &[Tool]) -> Vec<StreamPiece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let body = &self.held[TOOL_CALL_OPEN.len()..];
                let scan = match scan_call(body, tools) {
                    Scan::Incomplete if self.held.len() > MAX_HELD_CALL_BYTES => Scan::Invalid,
                    scan => scan,
                };
                let end = match scan {
                    Scan::Incomplete => break,
                    Scan::Call(call, end) => {
                        if !self.calls.contains(&call) {
                            self.calls.push(call.clone());
                            let index = self.calls.len() - 1;
                            out.push(StreamPiece::Call { index, call });
                        }
                        TOOL_CALL_OPEN.len() + end
                    }
                    Scan::Invalid => {
                        // Not a call: the tag is text, and what follows it is read afresh.
                        out.push(StreamPiece::Content(TOOL_CALL_OPEN.to_owned()));
                        TOOL_CALL_OPEN.len()
                    }
                };
                self.held.drain(..end);
                self.in_call = false;
                continue;
            }
            match self.held.find(TOOL_CALL_OPEN) {
                Some(start) => {
                    let before: String = self.held.drain(..start).collect();
                    self.content(before, &mut out);
                    self.in_call = true;
                }
                None => {
                    // Keep back a tail that could begin `<tool_call>`.
                    let keep = (1..TOOL_CALL_OPEN.len())
                        .rev()
                        .find(|&k| {
                            self.held.len() >= k
                                && self.held.is_char_boundary(self.held.len() - k)
                                && TOOL_CALL_OPEN.starts_with(&self.held[self.held.len() - k..])
                        })
                        .unwrap_or(0);
                    let ready: String = self.held.drain(..self.held.len() - keep).collect();
                    self.content(ready, &mut out);
                    break;
                }
            }
        }
        out
    }

    /// The end of the output: whatever is held goes out as content.
    pub fn finish(&mut self) -> Vec<StreamPiece> {
        let rest = std::mem::take(&mut self.held);
        self.in_call = false;
        let mut out = Vec::new();
        self.content(rest, &mut out);
        out
    }

    /// Content, except whitespace between and after calls.
    fn content(&self, text: String, out: &mut Vec<StreamPiece>) {
        let skip = text.is_empty() || (!self.calls.is_empty() && text.trim().is_empty());
        if !skip {
            out.push(StreamPiece::Content(text));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Tool {
        Tool {
            name: "get_weather".into(),
            description: Some("Weather in a city".into()),
            parameters: Some(
                json!({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}),
            ),
        }
    }

    #[test]
    fn tool_calls_parse_out_of_the_output() {
        let tools = [weather()];
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Rome\\\"}\"}</tool_call>\n";
        let (content, calls) = parse_tool_calls(text, &tools).unwrap();
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(calls[1].arguments, r#"{"city":"Rome"}"#);
        // A string may hold the closing tag.
        let tricky = "<tool_call>{\"name\":\"get_weather\",\"arguments\":{\"city\":\"}}</tool_call>x\"}}</tool_call>";
        let (_, calls) = parse_tool_calls(tricky, &tools).unwrap();
        assert_eq!(calls[0].arguments, r#"{"city":"}}</tool_call>x"}"#);
        let mut s = ToolCallStream::default();
        let mut pieces = Vec::new();
        for ch in tricky.chars() {
            pieces.extend(s.push(&ch.to_string(), &tools));
        }
        pieces.extend(s.finish());
        assert_eq!(
            pieces,
            vec![StreamPiece::Call {
                index: 0,
                call: calls[0].clone()
            }]
        );
        // An unknown tool, broken JSON, an unclosed call: plain content.
        for bad in [
            "<tool_call>{\"name\":\"nope\",\"arguments\":{}}</tool_call>",
            "<tool_call>{\"name\":\"get_weather\",\"arguments\":{</tool_call>",
            "<tool_call>{\"name\":\"get_weather\",\"arguments\":{}}",
            "I will use <tool_call> tags. <tool_call>not json",
            "no calls",
        ] {
            assert_eq!(parse_tool_calls(bad, &tools), None, "{bad}");
        }
        // Text after a call is content, as the stream sends it.
        let (content, calls) = parse_tool_calls(
            "<tool_call>{\"name\":\"get_weather\",\"arguments\":{}}</tool_call> and more",
            &tools,
        )
        .unwrap();
        assert_eq!((content.as_str(), calls.len()), ("and more", 1));
        // A tag in prose is released at once, not held to the end.
        let mut s = ToolCallStream::default();
        let out = s.push("Use <tool_call> tags like this: ", &tools);
        let text: String = out
            .iter()
            .map(|p| match p {
                StreamPiece::Content(c) => c.as_str(),
                StreamPiece::Call { .. } => "",
            })
            .collect();
        assert_eq!(text, "Use <tool_call> tags like this: ");
    }

    #[test]
    fn streamed_tool_calls_come_out_whole_and_text_passes() {
        let tools = [weather()];
        let text = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"nope\",\"arguments\":{}}</tool_call>";
        // Byte by byte (at char boundaries) and whole give the same pieces, once merged.
        for step in [1, 3, 7, text.len()] {
            let mut s = ToolCallStream::default();
            let mut pieces = Vec::new();
            let mut at = 0;
            while at < text.len() {
                let mut end = (at + step).min(text.len());
                while !text.is_char_boundary(end) {
                    end += 1;
                }
                pieces.extend(s.push(&text[at..end], &tools));
                at = end;
            }
            pieces.extend(s.finish());
            let indexes: Vec<usize> = pieces
                .iter()
                .filter_map(|p| match p {
                    StreamPiece::Call { index, .. } => Some(*index),
                    StreamPiece::Content(_) => None,
                })
                .collect();
            assert_eq!(indexes, (0..indexes.len()).collect::<Vec<_>>());
            let (content, calls) = join_pieces(pieces);
            assert_eq!(calls.len(), 1, "step {step}");
            assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
            assert!(content.starts_with("Sure.\n"), "{content:?}");
            assert!(
                content.contains("nope"),
                "an unknown tool stays text: {content:?}"
            );
        }
        let mut s = ToolCallStream::default();
        assert_eq!(
            s.push("a <tool", &tools),
            vec![StreamPiece::Content("a ".into())]
        );
        assert_eq!(
            s.push("box>", &tools),
            vec![StreamPiece::Content("<toolbox>".into())]
        );
    }

    #[test]
    fn bad_tools_and_choices_are_400s_naming_the_field() {
        let cases = [
            (
                json!([{"type":"function","function":{"name":"bad name"}}]),
                "tools[0].function.name",
            ),
            (json!([{"type":"retrieval"}]), "tools[0].type"),
            (json!([{"type":"function"}]), "tools[0].function"),
            (
                json!([{"type":"function","function":{"name":"a","parameters":[1]}}]),
                "tools[0].function.parameters",
            ),
            (
                json!([{"type":"function","function":{"name":"a"}},{"type":"function","function":{"name":"a"}}]),
                "tools[1].function.name",
            ),
            (json!({"a":1}), "tools"),
        ];
        for (t, param) in cases {
            let e = tools(Some(&t)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{t}");
            assert_eq!(e.status, 400);
        }
        let ts = tools(Some(&json!([{"type":"function","function":{"name":"a"}}]))).unwrap();
        let e = tool_choice(
            Some(&json!({"type":"function","function":{"name":"b"}})),
            &ts,
        )
        .unwrap_err();
        assert!(e.message.contains("\"b\""), "{}", e.message);
        assert!(tool_choice(Some(&json!("required")), &[]).is_err());
        assert!(tool_choice(Some(&json!("sometimes")), &ts).is_err());
        assert_eq!(tool_choice(None, &ts).unwrap(), ToolChoice::Auto);
        assert_eq!(tool_choice(None, &[]).unwrap(), ToolChoice::None);
    }

    #[test]
    fn schemas_are_bounded() {
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"type": "array", "items": deep});
        }
        let f = json!({"type":"json_schema","json_schema":{"name":"x","schema":deep}});
        let e = response_format(Some(&f)).unwrap_err();
        assert!(e.message.contains("deeper"), "{}", e.message);
        let big = json!({"type":"json_schema","json_schema":{"name":"x","schema":{"description":"x".repeat(MAX_SCHEMA_BYTES)}}});
        assert!(response_format(Some(&big))
            .unwrap_err()
            .message
            .contains("bytes"));
        for f in [
            json!("json"),
            json!({"type":"yaml"}),
            json!({"type":"json_schema"}),
            json!({"type":"json_schema","json_schema":{"name":"a b","schema":{}}}),
            json!({"type":"json_schema","json_schema":{"name":"a","schema":"{}"}}),
            json!({"type":"regex","regex":""}),
        ] {
            assert_eq!(response_format(Some(&f)).unwrap_err().status, 400, "{f}");
        }
        assert_eq!(
            response_format(Some(&json!({"type":"text"}))).unwrap(),
            None
        );
    }

    #[test]
    fn calls_render_back_as_the_model_wrote_them() {
        let tools = [weather()];
        let written = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"unit\": \"c\", \"city\": \"Paris, France\"}}\n</tool_call>";
        let (_, calls) = parse_tool_calls(written, &tools).unwrap();
        // Compact, in the order written (not sorted).
        assert_eq!(calls[0].arguments, r#"{"unit":"c","city":"Paris, France"}"#);
        let sent = RequestToolCall {
            id: Some("call_1".into()),
            type_: Some("function".into()),
            function: RequestFunctionCall {
                name: calls[0].name.clone(),
                arguments: calls[0].arguments.clone(),
            },
        };
        assert_eq!(render_tool_calls("", &[sent]), written);
        // Tool definitions render with sorted keys whatever order they were sent in.
        let a = tools_from(
            json!([{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"b":{"type":"string"},"a":{"type":"integer"}}}}}]),
        );
        let b = tools_from(
            json!([{"function":{"parameters":{"properties":{"a":{"type":"integer"},"b":{"type":"string"}},"type":"object"},"name":"f"},"type":"function"}]),
        );
        assert_eq!(render_tools(&a), render_tools(&b));
        assert!(render_tools(&a)
            .contains(r#"{"function":{"name":"f","parameters":{"properties":{"a":"#));
    }

    fn tools_from(v: Value) -> Vec<Tool> {
        tools(Some(&v)).unwrap()
    }

    #[test]
    fn a_client_cannot_set_the_layout() {
        let f = json!({"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object","x-guidance":{"lenient":true}}}});
        let Some(Grammar::JsonSchema(s)) = response_format(Some(&f)).unwrap() else {
            panic!("a schema");
        };
        assert_eq!(s["x-guidance"], json_layout());
    }
}
