//! Structured outputs and tool calling on the real model: `response_format` (JSON schema, JSON
//! object, regex) and `tools` with `tool_choice`, sampled at temperature 1 so that only the
//! grammar keeps the output valid; tool calls parsed into OpenAI's `tool_calls`, streamed as
//! deltas; a tool round trip; bad grammars and tools refused with 400s while the engine keeps
//! serving; constrained outputs identical through preemption; the same through the gateway,
//! where repeated tool definitions are a cached prefix.

use kvgate_tests::gateway::{config, gated_engine, StoreKind, TestGateway};
use kvgate_tests::{request, Engine, MODEL};
use serde_json::{json, Value};
use std::net::SocketAddr;

fn body(messages: Value, extra: Value) -> String {
    let mut b = json!({"model": MODEL, "messages": messages, "temperature": 1.0, "seed": 7});
    for (k, v) in extra.as_object().expect("object") {
        b[k] = v.clone();
    }
    b.to_string()
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

fn post(addr: SocketAddr, auth: Option<&str>, body: &str) -> kvgate_tests::Response {
    let bearer = auth.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = bearer
        .as_deref()
        .map(|b| vec![("authorization", b)])
        .unwrap_or_default();
    request(addr, "POST", "/v1/chat/completions", &headers, body)
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pet": {"enum": ["cat", "dog", "none"]}
        },
        "required": ["name", "age", "pet"],
        "additionalProperties": false
    })
}

/// Checks `v` against [`person_schema`] by hand.
fn is_person(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    o.len() == 3
        && o["name"].as_str().is_some_and(|s| s.chars().count() <= 16)
        && o["age"].as_i64().is_some_and(|a| (0..=120).contains(&a))
        && ["cat", "dog", "none"].contains(&o["pet"].as_str().unwrap_or("?"))
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city", "unit"],
            "additionalProperties": false
        }
    }})
}

fn check_weather_call(call: &Value) {
    assert_eq!(call["type"], "function", "{call}");
    assert!(
        call["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_")),
        "{call}"
    );
    assert_eq!(call["function"]["name"], "get_weather", "{call}");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().expect("string"))
        .expect("arguments are JSON");
    assert!(
        args["city"]
            .as_str()
            .is_some_and(|c| c.chars().count() <= 24),
        "{args}"
    );
    assert!(
        ["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap_or("?")),
        "{args}"
    );
}

#[test]
fn a_json_schema_holds_at_temperature_one() {
    let e = Engine::start("");
    let format = json!({"type": "json_schema", "json_schema": {
        "name": "person", "strict": true, "schema": person_schema()}});
    let r = e.post(
        "/v1/chat/completions",
        &body(
            user("Describe a person as JSON."),
            json!({"response_format": format, "n": 6, "max_tokens": 60}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let choices = r.json()["choices"].as_array().expect("choices").clone();
    assert_eq!(choices.len(), 6);
    for c in &choices {
        assert_eq!(c["finish_reason"], "stop", "{c}");
        let text = c["message"]["content"].as_str().expect("content");
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(is_person(&v), "does not match the schema: {text}");
    }
    // Compiled once, for this tenant.
    assert_eq!(e.state.grammars.as_ref().expect("grammars").cached(), 1);
    assert!(e.metric("kvgate_grammar_masks_total") > 0.0);
}

#[test]
fn json_object_and_regex_formats_hold() {
    let e = Engine::start("");
    let r = e.post(
        "/v1/chat/completions",
        &body(
            user("Give me a product code."),
            json!({"response_format": {"type": "regex", "regex": "[A-Z]{3}-[0-9]{4}"}, "n": 4}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    for c in r.json()["choices"].as_array().expect("choices") {
        let text = c["message"]["content"].as_str().expect("content");
        let b = text.as_bytes();
        let ok = b.len() == 8
            && b[..3].iter().all(u8::is_ascii_uppercase)
            && b[3] == b'-'
            && b[4..].iter().all(u8::is_ascii_digit);
        assert!(ok, "{text:?} does not match the regex");
        assert_eq!(c["finish_reason"], "stop");
    }
    // An object is all json_object promises; greedy, it finishes.
    let r = e.post(
        "/v1/chat/completions",
        &body(
            user("Reply with a JSON object with a key 'ok'."),
            json!({"response_format": {"type": "json_object"}, "temperature": 0, "max_tokens": 40}),
        ),
    );
    let c = &r.json()["choices"][0];
    let text = c["message"]["content"].as_str().expect("content");
    if c["finish_reason"] == "stop" {
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v.is_object(), "{text}");
    } else {
        assert!(text.starts_with('{'), "{text}");
    }
}

#[test]
fn a_schema_that_cannot_finish_in_max_tokens_ends_with_length() {
    let e = Engine::start("");
    let r = e.post(
        "/v1/chat/completions",
        &body(
            user("A person."),
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": person_schema()}}, "max_tokens": 3}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let c = &r.json()["choices"][0];
    assert_eq!(c["finish_reason"], "length", "{c}");
    assert!(c["message"]["content"]
        .as_str()
        .expect("content")
        .starts_with('{'));
}

#[test]
fn required_tool_calls_are_valid_calls_streamed_or_not() {
    let e = Engine::start("");
    let extra =
        json!({"tools": [weather_tool()], "tool_choice": "required", "parallel_tool_calls": false});
    for seed in 0..4 {
        let mut x = extra.clone();
        x["seed"] = json!(seed);
        let r = e.post(
            "/v1/chat/completions",
            &body(user("What is the weather like in Paris?"), x),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let c = &r.json()["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        let calls = c["message"]["tool_calls"].as_array().expect("tool_calls");
        assert_eq!(calls.len(), 1, "{c}");
        check_weather_call(&calls[0]);
        assert!(c["message"]["content"].is_null(), "{c}");
    }
    // Streamed: a role chunk, one tool-call delta with id, name and arguments, the finish.
    let mut x = extra.clone();
    x["stream"] = json!(true);
    let r = e.post(
        "/v1/chat/completions",
        &body(user("What is the weather like in Rome?"), x),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let chunks: Vec<Value> = r
        .sse_data()
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("chunk"))
        .collect();
    let deltas: Vec<&Value> = chunks
        .iter()
        .flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(deltas.len(), 1, "{chunks:?}");
    assert_eq!(deltas[0]["index"], 0);
    check_weather_call(deltas[0]);
    let last = chunks.last().expect("chunks");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{last}");
    assert!(
        chunks.iter().all(|c| c["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap_or("")
            .is_empty()),
        "no text outside the call: {chunks:?}"
    );
}

#[test]
fn a_named_function_is_the_one_called() {
    let e = Engine::start("");
    let time_tool = json!({"type": "function", "function": {"name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}});
    let r = e.post(
        "/v1/chat/completions",
        &body(
            user("What is the weather like in Paris?"),
            json!({"tools": [weather_tool(), time_tool],
                   "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let c = &r.json()["choices"][0];
    let calls = c["message"]["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{c}");
    assert_eq!(calls[0]["function"]["name"], "get_time");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().expect("args"))
            .expect("JSON");
    assert!(["UTC", "CET"].contains(&args["zone"].as_str().unwrap_or("?")));
}

#[test]
fn a_tool_round_trip_reads_the_result() {
    let e = Engine::start("");
    let messages = json!([
        {"role": "user", "content": "What is the weather like in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21, \"sky\": \"sunny\"}"}
    ]);
    let r = e.post(
        "/v1/chat/completions",
        &body(
            messages.clone(),
            json!({"tools": [weather_tool()], "temperature": 0, "max_tokens": 30}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let c = &r.json()["choices"][0];
    let answer = c["message"]["content"].as_str().expect("an answer");
    assert!(!answer.is_empty(), "{c}");
    // The call and its result are in the prompt: far longer than the three messages' text.
    let with = r.json()["usage"]["prompt_tokens"].as_u64().expect("usage");
    let r = e.post(
        "/v1/chat/completions",
        &body(
            user("What is the weather like in Paris?"),
            json!({"max_tokens": 1}),
        ),
    );
    let without = r.json()["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert!(with > without + 100, "{with} vs {without}");
}

#[test]
fn bad_grammars_and_tools_are_400s_and_the_engine_keeps_serving() {
    let e = Engine::start("");
    let schema = |s: Value| json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}});
    let mut deep = json!({"type": "string"});
    for _ in 0..40 {
        deep = json!({"type": "array", "items": deep});
    }
    let cases = [
        (schema(json!({"type": "strng"})), "response_format"),
        (
            schema(json!({"type": "string", "pattern": "(?<=a)b"})),
            "response_format",
        ),
        (
            schema(json!({"allOf": [{"type": "string"}, {"type": "integer"}]})),
            "response_format",
        ),
        (
            schema(json!({"$ref": "http://169.254.169.254/latest"})),
            "response_format",
        ),
        (schema(deep), "response_format.json_schema.schema"),
        (
            schema(json!({"description": "x".repeat(70_000)})),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "regex", "regex": "["}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "lark", "lark": "start: missing"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "regex", "regex": "[a&&b]"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [weather_tool()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice.function.name",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": [weather_tool()], "tool_choice": "required", "response_format": {"type": "regex", "regex": "a"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_object"}, "ignore_eos": true}),
            "ignore_eos",
        ),
    ];
    for (extra, param) in cases {
        let r = e.post("/v1/chat/completions", &body(user("hi"), extra.clone()));
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        let err = &r.json()["error"];
        assert_eq!(err["param"], param, "{extra}: {err}");
        assert!(!err["message"].as_str().unwrap_or("").is_empty());
    }
    // A grammar whose rules chain 5,000 deep (within the size limit): compiled on a thread with
    // room for llguidance's recursion, answered either way, and the engine still serves.
    let mut chain = String::from("start: r0\n");
    for i in 0..5000 {
        chain.push_str(&format!("r{i}: r{}\n", i + 1));
    }
    chain.push_str("r5000: \"ok\"\n");
    let r = e.post(
        "/v1/chat/completions",
        &body(
            user("hi"),
            json!({"response_format": {"type": "lark", "lark": chain}}),
        ),
    );
    assert!(r.status == 200 || r.status == 400, "{}", r.body);
    println!(
        "a 5,000-rule chain: {} {}",
        r.status,
        &r.body[..r.body.len().min(200)]
    );
    let r = e.chat("What is the capital of France?", r#","max_tokens":8"#);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        "The capital of France is Paris."
    );
}

#[test]
fn constrained_outputs_are_identical_through_preemption() {
    let prompts = [
        "Describe a person.",
        "Describe a pirate.",
        "Describe a doctor.",
        "Describe a child.",
        "Describe a king.",
    ];
    let run = |e: &Engine| -> Vec<String> {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let (addr, b) = (
                    e.addr,
                    body(
                        user(p),
                        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": person_schema()}}, "max_tokens": 40}),
                    ),
                );
                std::thread::spawn(move || {
                    let r = request(addr, "POST", "/v1/chat/completions", &[], &b);
                    assert_eq!(r.status, 200, "{}", r.body);
                    r.json()["choices"][0]["message"]["content"]
                        .as_str()
                        .expect("content")
                        .to_owned()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("request"))
            .collect()
    };
    let roomy = Engine::start("");
    let want = run(&roomy);
    drop(roomy);
    // About 2 blocks of prompt and 2 of output each: five at once do not fit in 8.
    let tight = Engine::start("[kv]\nblocks = 8\n[scheduler]\npreemption = \"recompute\"");
    let got = run(&tight);
    assert_eq!(got, want, "preemption changed a constrained output");
    assert!(tight.metric("kvgate_preemptions_total{mode=\"recompute\"}") > 0.0);
    let status = tight.admin("GET", "/admin/status", "").json();
    assert_eq!(status["blocks"]["used"], 0, "blocks leaked: {status}");
}

#[test]
fn through_the_gateway_repeated_tools_are_a_cached_prefix() {
    let e = gated_engine("blocks = 1024");
    let gw = TestGateway::start(config(&[("e0", e.addr)]), StoreKind::Memory);
    gw.wait_ready(1);
    let key = gw.tenant("agents", json!({}));
    let req = |q: &str| {
        body(
            user(q),
            json!({"tools": [weather_tool()], "tool_choice": "required", "parallel_tool_calls": false}),
        )
    };
    let first = post(gw.addr, Some(&key), &req("Weather in Oslo?"));
    assert_eq!(first.status, 200, "{}", first.body);
    check_weather_call(&first.json()["choices"][0]["message"]["tool_calls"][0]);
    let second = post(gw.addr, Some(&key), &req("Weather in Lima?"));
    assert_eq!(second.status, 200, "{}", second.body);
    let usage = &second.json()["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached");
    // The system turn with the tool definitions (well over 100 tokens) came from the cache.
    assert!(cached >= 128, "{usage}");
    // A bad schema is the request's 400 through the gateway too, and does not count against the
    // engine.
    let bad = body(
        user("hi"),
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}}),
    );
    for _ in 0..8 {
        let r = post(gw.addr, Some(&key), &bad);
        assert_eq!(r.status, 400, "{}", r.body);
    }
    let ok = post(gw.addr, Some(&key), &req("Weather in Cairo?"));
    assert_eq!(ok.status, 200, "{}", ok.body);
}

#[test]
fn the_next_turn_after_a_call_reads_the_call_from_the_cache() {
    let e = Engine::start("");
    let extra =
        json!({"tools": [weather_tool()], "tool_choice": "required", "parallel_tool_calls": false});
    let mut messages =
        vec![json!({"role": "user", "content": "What is the weather like in Oslo?"})];
    let r = e.post(
        "/v1/chat/completions",
        &body(Value::Array(messages.clone()), extra),
    );
    let first = r.json();
    let prompt = first["usage"]["prompt_tokens"].as_u64().expect("usage");
    let completion = first["usage"]["completion_tokens"].as_u64().expect("usage");
    let call = first["choices"][0]["message"]["tool_calls"][0].clone();
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call.clone()]}));
    messages.push(
        json!({"role": "tool", "tool_call_id": call["id"], "content": "{\"temperature\": 3}"}),
    );
    let r = e.post(
        "/v1/chat/completions",
        &body(
            Value::Array(messages),
            json!({"tools": [weather_tool()], "max_tokens": 4}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached");
    // The call rendered back as the model wrote it continues the same tokens: every full block
    // of the first prompt and of the call (its last token, EOS, is the template's end of turn).
    println!("prompt {prompt}, call {completion} tokens, cached next turn {cached}");
    let want = (prompt + completion - 1) / 16 * 16;
    assert!(cached >= want, "{cached} cached, {want} expected");
}
