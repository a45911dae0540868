//! OpenAI wire types: requests as real clients send them (the official `openai` Python client
//! among them), every validation error with its status, code and param, and the exact JSON shape
//! of responses, stream chunks and errors.

use kvgate_protocol::openai::*;
use kvgate_protocol::prompt::ChatMessage;
use serde_json::{json, Value};

fn limits() -> Limits {
    Limits::default()
}

fn chat(body: Value) -> Result<ChatInput, ApiError> {
    ChatCompletionRequest::parse(body.to_string().as_bytes())?.validate(&limits())
}

fn completion(body: Value) -> Result<CompletionInput, ApiError> {
    CompletionRequest::parse(body.to_string().as_bytes())?.validate(&limits())
}

/// Adds `extra`'s fields to a minimal valid chat request.
fn chat_with(extra: Value) -> Result<ChatInput, ApiError> {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    chat(body)
}

fn completion_with(extra: Value) -> Result<CompletionInput, ApiError> {
    let mut body = json!({"model": "m", "prompt": "hi"});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    completion(body)
}

#[track_caller]
fn assert_err(r: Result<impl std::fmt::Debug, ApiError>, code: ErrorCode, param: Option<&str>) {
    let e = r.expect_err("expected an error");
    assert_eq!((e.code, e.param.as_deref()), (code, param), "{e}");
    assert_eq!(e.status, code.status());
}

#[test]
fn python_client_chat_request() {
    // What `client.chat.completions.create(..., stream=True,
    // stream_options={"include_usage": True})` sends, plus fields we accept and ignore.
    let body = br#"{"messages":[{"role":"system","content":"You are terse."},
        {"role":"user","content":"Say hi"}],"model":"smollm2-135m-instruct",
        "max_completion_tokens":32,"seed":7,"stream":true,"stream_options":{"include_usage":true},
        "temperature":0.7,"top_p":0.9,"stop":"\n\n","user":"u-1","metadata":{"k":"v"},
        "store":false,"parallel_tool_calls":null,"service_tier":"auto","cache_salt":"mine"}"#;
    let req = ChatCompletionRequest::parse(body).unwrap();
    assert_eq!(req.model, "smollm2-135m-instruct");
    let input = req.validate(&limits()).unwrap();
    assert_eq!(
        input.messages,
        vec![
            ChatMessage {
                role: "system".into(),
                content: "You are terse.".into()
            },
            ChatMessage {
                role: "user".into(),
                content: "Say hi".into()
            },
        ]
    );
    assert!(input.stream && input.include_usage);
    let p = &input.params;
    assert_eq!(
        (p.temperature, p.top_p, p.seed, p.max_tokens),
        (0.7, 0.9, Some(7), Some(32))
    );
    assert_eq!(p.stop, vec!["\n\n".to_string()]);
    assert_eq!((p.n, p.logprobs, p.top_k, p.min_p), (1, None, None, 0.0));
}

#[test]
fn python_client_minimal_requests() {
    let input = chat(json!({"messages":[{"role":"user","content":"Hello"}],"model":"m"})).unwrap();
    assert_eq!(input.params, SamplingParams::default());
    assert!(!input.stream && !input.include_usage);
    let input =
        completion(json!({"model":"m","prompt":"Once upon a time","max_tokens":5})).unwrap();
    assert_eq!(input.prompt, PromptInput::Text("Once upon a time".into()));
    assert_eq!(input.params.max_tokens, Some(5));
}

#[test]
fn include_usage_needs_stream() {
    let input = chat_with(json!({"stream_options": {"include_usage": true}})).unwrap();
    assert!(!input.include_usage);
    let input = completion_with(json!({"stream": true, "stream_options": {"include_usage": null}}));
    assert!(!input.unwrap().include_usage);
}

#[test]
fn completion_prompt_shapes() {
    let text = |p: Value| completion(json!({"model": "m", "prompt": p})).map(|i| i.prompt);
    assert_eq!(text(json!("a")).unwrap(), PromptInput::Text("a".into()));
    assert_eq!(text(json!(["a"])).unwrap(), PromptInput::Text("a".into()));
    assert_eq!(
        text(json!([1, 2, 3])).unwrap(),
        PromptInput::Tokens(vec![1, 2, 3])
    );
    assert_eq!(
        text(json!([[4, 5]])).unwrap(),
        PromptInput::Tokens(vec![4, 5])
    );
    assert_err(
        text(json!(["a", "b"])),
        ErrorCode::UnsupportedParameter,
        Some("prompt"),
    );
    assert_err(
        text(json!([[1], [2]])),
        ErrorCode::UnsupportedParameter,
        Some("prompt"),
    );
    assert_err(text(json!([])), ErrorCode::InvalidValue, Some("prompt"));
    assert_err(text(json!([[]])), ErrorCode::InvalidValue, Some("prompt"));
    assert_err(text(json!([1, "a"])), ErrorCode::InvalidType, None);
    assert_err(text(json!([-1])), ErrorCode::InvalidType, None);
    assert_err(text(json!(5)), ErrorCode::InvalidType, None);
    assert_err(text(json!(null)), ErrorCode::InvalidType, None);
    // Round trip: a client serializes each shape back as it came.
    for p in [json!("a"), json!([1, 2]), json!(["a"]), json!([[1, 2]])] {
        let req: CompletionRequest =
            serde_json::from_value(json!({"model": "m", "prompt": p})).unwrap();
        assert_eq!(
            serde_json::to_value(&req).unwrap(),
            json!({"model": "m", "prompt": p})
        );
    }
}

#[test]
fn prompt_token_ids_checked_against_vocab() {
    let input = completion(json!({"model": "m", "prompt": [0, 9]})).unwrap();
    assert!(input.prompt.check_token_ids(10).is_ok());
    assert_err(
        input.prompt.check_token_ids(9),
        ErrorCode::InvalidValue,
        Some("prompt"),
    );
    assert!(PromptInput::Text("x".into()).check_token_ids(0).is_ok());
}

#[test]
fn chat_content_parts_and_roles() {
    let input = chat(json!({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "q", "name": "bob"},
        {"role": "assistant", "content": null},
        {"role": "user", "content": "r"},
    ]}))
    .unwrap();
    let got: Vec<(&str, &str)> = input
        .messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            ("developer", "a\nb"),
            ("user", "q"),
            ("assistant", ""),
            ("user", "r")
        ]
    );
    let one = |m: Value| chat(json!({"model": "m", "messages": [m]}));
    assert_err(
        one(json!({"role": "wizard", "content": "x"})),
        ErrorCode::InvalidValue,
        Some("messages[0].role"),
    );
    assert_err(
        one(json!({"role": "user"})),
        ErrorCode::InvalidValue,
        Some("messages[0].content"),
    );
    assert_err(
        one(json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})),
        ErrorCode::UnsupportedParameter,
        Some("messages[0].content[0].type"),
    );
    assert_err(
        one(json!({"role": "user", "content": [{"type": "text"}]})),
        ErrorCode::InvalidValue,
        Some("messages[0].content[0].text"),
    );
    assert_err(
        one(json!({"role": "user", "content": 5})),
        ErrorCode::InvalidType,
        None,
    );
    assert_err(
        chat(json!({"model": "m", "messages": []})),
        ErrorCode::InvalidValue,
        Some("messages"),
    );
}

/// serde's derived structs read an array as the fields in order; a request is an object only.
#[test]
fn only_an_object_is_a_request() {
    for body in [
        &br#"["kvgate-test","hi"]"#[..],
        br#" [false,false,"kvgate-test","hi"]"#,
        br#""hi""#,
        b"null",
        b"17",
    ] {
        assert_err(
            CompletionRequest::parse(body),
            ErrorCode::InvalidValue,
            Some("body"),
        );
        assert_err(
            ChatCompletionRequest::parse(body),
            ErrorCode::InvalidValue,
            Some("body"),
        );
    }
    // Not JSON at all: the parser's own message, whatever the first byte.
    assert_err(
        CompletionRequest::parse(b"[1,"),
        ErrorCode::InvalidJson,
        None,
    );
}

#[test]
fn malformed_bodies() {
    assert_err(
        ChatCompletionRequest::parse(b"{\"model\": "),
        ErrorCode::InvalidJson,
        None,
    );
    assert_err(
        ChatCompletionRequest::parse(b"not json"),
        ErrorCode::InvalidJson,
        None,
    );
    assert_err(
        ChatCompletionRequest::parse(b""),
        ErrorCode::InvalidJson,
        None,
    );
    let bad_utf8 = b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}";
    assert_err(
        ChatCompletionRequest::parse(bad_utf8),
        ErrorCode::InvalidJson,
        None,
    );
    assert_err(
        CompletionRequest::parse(br#"{"prompt":"x"}"#),
        ErrorCode::MissingRequiredParameter,
        None,
    );
    assert_err(
        ChatCompletionRequest::parse(br#"{"model":"m"}"#),
        ErrorCode::MissingRequiredParameter,
        None,
    );
    assert_err(
        ChatCompletionRequest::parse(br#"{"model":"m","messages":[],"temperature":"hot"}"#),
        ErrorCode::InvalidType,
        None,
    );
    assert_err(
        ChatCompletionRequest::parse(b"[1,2]"),
        ErrorCode::InvalidValue,
        Some("body"),
    );
    assert_err(
        CompletionRequest::parse(br#"{"model":"m","prompt":"x","n":1.5}"#),
        ErrorCode::InvalidType,
        None,
    );
}

#[test]
fn every_sampling_error() {
    let cases = [
        (json!({"temperature": -0.1}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"top_p": 1.01}), "top_p"),
        (json!({"top_k": -2}), "top_k"),
        (json!({"min_p": -0.1}), "min_p"),
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"presence_penalty": 2.5}), "presence_penalty"),
        (json!({"frequency_penalty": -3}), "frequency_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"n": 0}), "n"),
        (json!({"n": 17}), "n"),
        (json!({"n": -1}), "n"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_tokens": -5}), "max_tokens"),
        (json!({"max_tokens": 1u64 << 40}), "max_tokens"),
        (json!({"max_tokens": 5, "min_tokens": 6}), "min_tokens"),
        (json!({"min_tokens": -1}), "min_tokens"),
        (json!({"seed": 1.5}), "seed"),
        (json!({"seed": 18446744073709551616.0}), "seed"),
        (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias"),
        (json!({"stop": vec!["a"; 17]}), "stop"),
        (json!({"stop": "x".repeat(257)}), "stop"),
    ];
    for (extra, param) in cases {
        assert_err(
            chat_with(extra.clone()),
            ErrorCode::InvalidValue,
            Some(param),
        );
        assert_err(completion_with(extra), ErrorCode::InvalidValue, Some(param));
    }
    assert_err(
        chat_with(json!({"max_completion_tokens": 0})),
        ErrorCode::InvalidValue,
        Some("max_completion_tokens"),
    );
    assert_err(
        chat_with(json!({"logprobs": true, "top_logprobs": 21})),
        ErrorCode::InvalidValue,
        Some("top_logprobs"),
    );
    assert_err(
        chat_with(json!({"top_logprobs": 2})),
        ErrorCode::InvalidValue,
        Some("top_logprobs"),
    );
    assert_err(
        completion_with(json!({"logprobs": 21})),
        ErrorCode::InvalidValue,
        Some("logprobs"),
    );
    assert_err(
        completion_with(json!({"logprobs": -1})),
        ErrorCode::InvalidValue,
        Some("logprobs"),
    );
    assert_err(
        completion_with(json!({"n": 2, "best_of": 1})),
        ErrorCode::InvalidValue,
        Some("best_of"),
    );
}

#[test]
fn unsupported_features_are_rejected() {
    assert_err(
        completion_with(json!({"echo": true})),
        ErrorCode::UnsupportedParameter,
        Some("echo"),
    );
    assert_err(
        completion_with(json!({"suffix": "end"})),
        ErrorCode::UnsupportedParameter,
        Some("suffix"),
    );
    assert_err(
        completion_with(json!({"best_of": 3})),
        ErrorCode::UnsupportedParameter,
        Some("best_of"),
    );
    // Tools are served: rendered into the system turn unless `tool_choice` is none, and a
    // grammar only when calls are required.
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    let auto = chat_with(json!({"tools": tool})).unwrap();
    assert!(auto.params.grammar.is_none());
    assert_eq!(auto.messages[0].role, "system");
    assert!(auto.messages[0].content.contains("<tools>"));
    let none = chat_with(json!({"tools": tool, "tool_choice": "none"})).unwrap();
    assert!(none.structured.tools.is_empty() && none.messages.len() == 1);
    let required = chat_with(json!({"tools": tool, "tool_choice": "required"})).unwrap();
    assert!(matches!(
        required.params.grammar,
        Some(kvgate_protocol::openai::Grammar::ToolCalls(_))
    ));
    assert!(chat_with(json!({"tools": [], "tool_choice": "auto"})).is_ok());
    assert_err(
        chat_with(json!({"tools": [], "tool_choice": "required"})),
        ErrorCode::InvalidValue,
        Some("tool_choice"),
    );
    let json_object = chat_with(json!({"response_format": {"type": "json_object"}})).unwrap();
    assert!(json_object.params.grammar.is_some());
    assert_err(
        chat_with(json!({"response_format": {"type": "xml"}})),
        ErrorCode::UnsupportedParameter,
        Some("response_format.type"),
    );
    assert!(chat_with(json!({"response_format": {"type": "text"}}))
        .unwrap()
        .params
        .grammar
        .is_none());
    assert!(completion_with(json!({"echo": false, "suffix": "", "best_of": 1})).is_ok());
}

#[test]
fn liberal_values_are_normalized() {
    let p = chat_with(json!({"temperature": 0, "top_p": 0.5, "top_k": 5, "min_p": 0.2}))
        .unwrap()
        .params;
    assert!(p.is_greedy());
    assert_eq!((p.top_p, p.top_k, p.min_p), (1.0, None, 0.0));
    let p = chat_with(json!({"temperature": 0.000001})).unwrap().params;
    assert!(p.is_greedy());
    let p = chat_with(json!({"temperature": 7.5, "top_k": -1}))
        .unwrap()
        .params;
    assert_eq!((p.temperature, p.top_k), (7.5, None));
    let p = chat_with(json!({"temperature": 1e300})).unwrap().params;
    assert_eq!(p.temperature, f32::MAX);
    // Past f32's range at either end, a value keeps its meaning: nonzero stays nonzero, huge
    // stays finite.
    let p = chat_with(json!({"top_p": 1e-50, "repetition_penalty": 1e39}))
        .unwrap()
        .params;
    assert!(p.top_p > 0.0 && p.repetition_penalty == f32::MAX);
    let p = chat_with(json!({"repetition_penalty": 1e-320}))
        .unwrap()
        .params;
    assert!(p.repetition_penalty > 0.0);
    // `min_tokens` is checked against the completions default of 16 tokens.
    let e = completion_with(json!({"min_tokens": 17})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("min_tokens"), "{e:?}");
    assert_eq!(chat_with(json!({"top_k": 0})).unwrap().params.top_k, None);
    assert_eq!(
        chat_with(json!({"top_k": 40})).unwrap().params.top_k,
        Some(40)
    );
    assert_eq!(
        chat_with(json!({"seed": -1})).unwrap().params.seed,
        Some(u64::MAX)
    );
    assert_eq!(
        chat_with(json!({"seed": u64::MAX})).unwrap().params.seed,
        Some(u64::MAX)
    );
    let p = chat_with(json!({"stop": ["", "a", "b"], "stop_token_ids": [2, 3]}))
        .unwrap()
        .params;
    assert_eq!(
        (p.stop, p.stop_token_ids),
        (vec!["a".to_string(), "b".to_string()], vec![2, 3])
    );
    let p = chat_with(json!({"stop": null, "temperature": null, "n": null, "max_tokens": null}))
        .unwrap()
        .params;
    assert_eq!(p, SamplingParams::default());
    let p = chat_with(json!({"logit_bias": {"7": -100, "3": 2.5}}))
        .unwrap()
        .params;
    assert_eq!(p.logit_bias, vec![(3, 2.5), (7, -100.0)]);
    let p = chat_with(json!({"max_tokens": 10, "max_completion_tokens": 20}))
        .unwrap()
        .params;
    assert_eq!(p.max_tokens, Some(20));
    let p = chat_with(json!({"logprobs": true})).unwrap().params;
    assert_eq!(p.logprobs, Some(0));
    let p = chat_with(json!({"logprobs": true, "top_logprobs": 20, "n": 16}))
        .unwrap()
        .params;
    assert_eq!((p.logprobs, p.n), (Some(20), 16));
    assert_eq!(
        chat_with(json!({"logprobs": false}))
            .unwrap()
            .params
            .logprobs,
        None
    );
    let p = completion_with(json!({"logprobs": 0, "ignore_eos": true, "min_tokens": 3}))
        .unwrap()
        .params;
    assert_eq!(
        (p.logprobs, p.ignore_eos, p.min_tokens, p.max_tokens),
        (Some(0), true, 3, Some(16))
    );
    let p = completion_with(
        json!({"repetition_penalty": 1.3, "presence_penalty": -2, "frequency_penalty": 2}),
    );
    let p = p.unwrap().params;
    assert_eq!(
        (
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty
        ),
        (1.3, -2.0, 2.0)
    );
}

#[test]
fn max_n_is_a_server_limit() {
    let req: ChatCompletionRequest = serde_json::from_value(
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3}),
    )
    .unwrap();
    let tight = Limits {
        max_n: 2,
        ..Limits::default()
    };
    assert_err(req.validate(&tight), ErrorCode::InvalidValue, Some("n"));
    assert_eq!(req.validate(&limits()).unwrap().params.n, 3);
}

#[test]
fn context_check() {
    let p = SamplingParams {
        max_tokens: Some(10),
        ..SamplingParams::default()
    };
    assert_eq!(p.max_tokens_for(90, 100), Ok(10));
    let e = p.max_tokens_for(91, 100).unwrap_err();
    assert_eq!((e.status, e.code), (400, ErrorCode::ContextLengthExceeded));
    assert_eq!(
        e.message,
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens \
         (91 in the messages, 10 in the completion). Please reduce the length of the messages or \
         completion."
    );
    let open = SamplingParams::default();
    assert_eq!(open.max_tokens_for(60, 100), Ok(40));
    assert_eq!(
        open.max_tokens_for(100, 100).unwrap_err().code,
        ErrorCode::ContextLengthExceeded
    );
    assert_err(
        open.max_tokens_for(0, 100),
        ErrorCode::InvalidValue,
        Some("prompt"),
    );
}

#[test]
fn error_body_is_openai_shaped() {
    let e = ApiError::invalid_value("temperature", "Invalid 'temperature'.");
    assert_eq!(
        serde_json::from_str::<Value>(&e.to_json()).unwrap(),
        json!({"error": {"message": "Invalid 'temperature'.", "type": "invalid_request_error",
                         "code": "invalid_value", "param": "temperature"}})
    );
    let e = ApiError::unauthorized("Incorrect API key provided.");
    assert_eq!(
        serde_json::from_str::<Value>(&e.to_json()).unwrap(),
        json!({"error": {"message": "Incorrect API key provided.", "type": "authentication_error",
                         "code": "invalid_api_key", "param": null}})
    );
    let sse = ApiError::internal("engine failed").to_sse();
    assert!(
        sse.starts_with("data: {\"error\":{") && sse.ends_with("}\n\n"),
        "{sse}"
    );
    let back: ErrorBody = serde_json::from_str(&e.to_json()).unwrap();
    assert_eq!(back.error.code.as_deref(), Some("invalid_api_key"));
}

#[test]
fn error_constructors_status_type_code() {
    let cases = [
        (
            ApiError::invalid_value("x", "m"),
            400,
            "invalid_request_error",
            "invalid_value",
        ),
        (
            ApiError::unsupported("x", "m"),
            400,
            "invalid_request_error",
            "unsupported_parameter",
        ),
        (
            ApiError::context_length_exceeded(8, 9, 1),
            400,
            "invalid_request_error",
            "context_length_exceeded",
        ),
        (
            ApiError::unauthorized("m"),
            401,
            "authentication_error",
            "invalid_api_key",
        ),
        (
            ApiError::forbidden("m"),
            403,
            "permission_error",
            "permission_denied",
        ),
        (
            ApiError::model_not_found("gpt-9"),
            404,
            "invalid_request_error",
            "model_not_found",
        ),
        (
            ApiError::not_found("GET", "/v2"),
            404,
            "invalid_request_error",
            "unknown_url",
        ),
        (
            ApiError::method_not_allowed("PUT", "/v1/models"),
            405,
            "invalid_request_error",
            "method_not_allowed",
        ),
        (
            ApiError::payload_too_large(1 << 20),
            413,
            "invalid_request_error",
            "request_too_large",
        ),
        (
            ApiError::rate_limited("slow down", 3),
            429,
            "rate_limit_error",
            "rate_limit_exceeded",
        ),
        (
            ApiError::internal("m"),
            500,
            "server_error",
            "internal_error",
        ),
        (ApiError::draining(), 503, "server_error", "draining"),
        (
            ApiError::no_healthy_engine(),
            503,
            "server_error",
            "no_healthy_engine",
        ),
        (
            ApiError::unavailable("m"),
            503,
            "server_error",
            "service_unavailable",
        ),
        (ApiError::timeout(), 504, "server_error", "timeout"),
    ];
    for (e, status, type_, code) in cases {
        assert_eq!(
            (e.status, e.type_, e.code.as_str()),
            (status, type_, code),
            "{e}"
        );
        let body: Value = serde_json::from_str(&e.to_json()).unwrap();
        assert_eq!(body["error"]["code"], code);
        assert_eq!(body["error"]["type"], type_);
    }
    assert_eq!(ApiError::rate_limited("m", 3).retry_after, Some(3));
    assert_eq!(ApiError::draining().retry_after, Some(1));
    assert_eq!(
        ApiError::model_not_found("gpt-9").param.as_deref(),
        Some("model")
    );
}

#[test]
fn cache_salt_is_stripped_and_ignored() {
    let mut body =
        json!({"model": "m", "prompt": "x", "cache_salt": "evil", "cache_scope": "other"});
    assert!(strip_client_scope(&mut body));
    assert_eq!(body, json!({"model": "m", "prompt": "x"}));
    assert!(!strip_client_scope(&mut body));
    assert!(!strip_client_scope(&mut json!([1])));
    let req =
        CompletionRequest::parse(br#"{"model":"m","prompt":"x","cache_salt":"evil"}"#).unwrap();
    assert!(!serde_json::to_string(&req).unwrap().contains("evil"));
}

#[test]
fn completion_response_shape() {
    let logprobs = CompletionLogprobs {
        tokens: vec![" a".into(), "b".into()],
        token_logprobs: vec![-0.5, -1.0],
        top_logprobs: vec![
            TopLogprobMap::new([
                (" a".to_string(), -0.5),
                (" c".to_string(), -1.5),
                (" a".to_string(), -9.0),
            ]),
            TopLogprobMap::new([("b".to_string(), -1.0)]),
        ],
        text_offset: vec![0, 2],
    };
    let choices = vec![
        CompletionChoice {
            text: " ab".into(),
            index: 0,
            logprobs: Some(logprobs),
            finish_reason: Some(FinishReason::Length),
        },
        CompletionChoice {
            text: "x".into(),
            index: 1,
            logprobs: None,
            finish_reason: Some(FinishReason::Stop),
        },
    ];
    let resp = CompletionResponse::new("cmpl-1", 1700000000, "m", choices, Usage::new(5, 3, 4));
    let value = serde_json::to_value(&resp).unwrap();
    assert_eq!(
        value,
        json!({
            "id": "cmpl-1", "object": "text_completion", "created": 1700000000u64, "model": "m",
            "choices": [
                {"text": " ab", "index": 0, "finish_reason": "length", "logprobs": {
                    "tokens": [" a", "b"], "token_logprobs": [-0.5, -1.0],
                    "top_logprobs": [{" a": -0.5, " c": -1.5}, {"b": -1.0}], "text_offset": [0, 2]}},
                {"text": "x", "index": 1, "logprobs": null, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                      "prompt_tokens_details": {"cached_tokens": 4}}
        })
    );
    // Top logprobs keep their order (most likely first) through a round trip.
    let text = serde_json::to_string(&resp).unwrap();
    assert!(text.contains(r#"{" a":-0.5," c":-1.5}"#), "{text}");
    assert_eq!(
        serde_json::from_str::<CompletionResponse>(&text).unwrap(),
        resp
    );
}

#[test]
fn chat_response_shape() {
    let lp = ChatLogprobs {
        content: vec![ChatTokenLogprob {
            token: "Hi".into(),
            logprob: -0.25,
            bytes: Some(vec![72, 105]),
            top_logprobs: vec![TopLogprob {
                token: "Hi".into(),
                logprob: -0.25,
                bytes: Some(vec![72, 105]),
            }],
        }],
    };
    let choices = vec![ChatChoice::new(
        0,
        "Hi".into(),
        Some(lp),
        FinishReason::Stop,
    )];
    let resp = ChatCompletionResponse::new("chatcmpl-9", 1, "m", choices, Usage::new(10, 1, 0));
    assert_eq!(
        serde_json::to_value(&resp).unwrap(),
        json!({
            "id": "chatcmpl-9", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                "finish_reason": "stop",
                "logprobs": {"content": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105],
                    "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105]}]}]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                      "prompt_tokens_details": {"cached_tokens": 0}}
        })
    );
    // A client also reads usage from servers that omit the details.
    let u: Usage = serde_json::from_value(
        json!({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}),
    )
    .unwrap();
    assert_eq!(u, Usage::new(1, 2, 0));
}

#[test]
fn model_list_shape() {
    let list = ModelList::new(vec![
        ModelCard::new("smollm2", 5, "kvgate", Some(8192)),
        ModelCard::new("x", 6, "kvgate", None),
    ]);
    assert_eq!(
        serde_json::to_value(&list).unwrap(),
        json!({"object": "list", "data": [
            {"id": "smollm2", "object": "model", "created": 5, "owned_by": "kvgate", "max_model_len": 8192},
            {"id": "x", "object": "model", "created": 6, "owned_by": "kvgate"}]})
    );
}

#[test]
fn chat_stream_chunk_shapes() {
    let event = |c: &ChatCompletionChunk| {
        let s = sse_event(c);
        assert!(
            s.starts_with("data: ") && s.ends_with("\n\n") && !s[6..s.len() - 2].contains('\n')
        );
        serde_json::from_str::<Value>(&s[6..]).unwrap()
    };
    let head = |choices| json!({"id": "c", "object": "chat.completion.chunk", "created": 2, "model": "m", "choices": choices});
    let first = ChatCompletionChunk::new("c", 2, "m", vec![ChatChunkChoice::role(0)]);
    assert_eq!(
        event(&first),
        head(
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}])
        )
    );
    let text = ChatCompletionChunk::new(
        "c",
        2,
        "m",
        vec![ChatChunkChoice::content(1, "Hel".into(), None)],
    );
    assert_eq!(
        event(&text),
        head(
            json!([{"index": 1, "delta": {"content": "Hel"}, "logprobs": null, "finish_reason": null}])
        )
    );
    let last = ChatCompletionChunk::new(
        "c",
        2,
        "m",
        vec![ChatChunkChoice::finish(
            0,
            String::new(),
            FinishReason::Length,
        )],
    );
    assert_eq!(
        event(&last),
        head(json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "length"}]))
    );
    let usage = ChatCompletionChunk::usage("c", 2, "m", Usage::new(3, 4, 0));
    let mut want = head(json!([]));
    want["usage"] = json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                           "prompt_tokens_details": {"cached_tokens": 0}});
    assert_eq!(event(&usage), want);
    assert_eq!(SSE_DONE, "data: [DONE]\n\n");
}

#[test]
fn completion_stream_chunk_shapes() {
    let choice = CompletionChoice {
        text: "lo".into(),
        index: 0,
        logprobs: None,
        finish_reason: None,
    };
    let chunk = CompletionChunk::new("cmpl-2", 3, "m", vec![choice]);
    assert_eq!(
        serde_json::to_value(&chunk).unwrap(),
        json!({"id": "cmpl-2", "object": "text_completion", "created": 3, "model": "m",
               "choices": [{"text": "lo", "index": 0, "logprobs": null, "finish_reason": null}]})
    );
    let usage = CompletionChunk::usage("cmpl-2", 3, "m", Usage::new(1, 1, 1));
    let v = serde_json::to_value(&usage).unwrap();
    assert_eq!(v["choices"], json!([]));
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
}

#[test]
fn requests_serialize_for_clients() {
    let req = ChatCompletionRequest {
        model: "m".into(),
        messages: vec![RequestMessage::new("user", "hi")],
        max_completion_tokens: Some(8),
        stream: Some(true),
        ..ChatCompletionRequest::default()
    };
    assert_eq!(
        serde_json::to_value(&req).unwrap(),
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
               "max_completion_tokens": 8, "stream": true})
    );
}

/// The model's sampling defaults fill what a request leaves out; a field the request sets wins,
/// and a greedy default turns the filters off like a greedy request does.
#[test]
fn sampling_defaults_fill_only_what_the_request_leaves_out() {
    let limits = Limits {
        defaults: SamplingDefaults {
            temperature: Some(0.3),
            top_p: Some(0.9),
            top_k: Some(40),
            ..SamplingDefaults::default()
        },
        ..Limits::default()
    };
    let parse = |extra: Value| {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        ChatCompletionRequest::parse(body.to_string().as_bytes())
            .unwrap()
            .validate(&limits)
            .unwrap()
            .params
    };
    let p = parse(json!({}));
    assert_eq!((p.temperature, p.top_p, p.top_k), (0.3, 0.9, Some(40)));
    let p = parse(json!({"temperature": 1.0, "top_k": -1}));
    assert_eq!((p.temperature, p.top_p, p.top_k), (1.0, 0.9, None));
    let greedy = Limits {
        defaults: SamplingDefaults {
            temperature: Some(0.0),
            top_p: Some(0.5),
            ..SamplingDefaults::default()
        },
        ..Limits::default()
    };
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let p = ChatCompletionRequest::parse(body.to_string().as_bytes())
        .unwrap()
        .validate(&greedy)
        .unwrap()
        .params;
    assert!(p.is_greedy());
    assert_eq!(p.top_p, 1.0);

    let gen = json!({"bos_token_id": 1, "do_sample": true, "temperature": 0.6, "top_p": 0.95,
                     "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 256});
    let d = SamplingDefaults::from_generation_config(&gen);
    assert_eq!(
        d,
        SamplingDefaults {
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            min_p: None,
            repetition_penalty: Some(1.1),
        }
    );
    let engine = SamplingDefaults {
        temperature: Some(0.0),
        ..SamplingDefaults::default()
    };
    assert_eq!(engine.or(d).temperature, Some(0.0));
    assert_eq!(engine.or(d).top_p, Some(0.95));
    let bad = SamplingDefaults {
        top_p: Some(2.0),
        ..SamplingDefaults::default()
    };
    assert_eq!(bad.check().unwrap_err().param.as_deref(), Some("top_p"));
}

/// A client's cache-scope fields are recorded whatever their spelling in JSON (escaped keys
/// included), so a proxy that forwards a body unchanged knows when it must rewrite it instead.
#[test]
fn client_scope_fields_are_seen_even_with_escaped_keys() {
    for (body, seen) in [
        (
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            false,
        ),
        (
            r#"{"model":"m","messages":[{"role":"user","content":"cache_salt"}]}"#,
            false,
        ),
        (r#"{"model":"m","messages":[],"cache_salt":"x"}"#, true),
        (
            r#"{"model":"m","messages":[],"cache\u005fsalt":{"a":[1]}}"#,
            true,
        ),
        (
            r#"{"model":"m","messages":[],"\u0063ache_scope":null}"#,
            true,
        ),
    ] {
        let chat = ChatCompletionRequest::parse(body.as_bytes()).unwrap();
        assert_eq!(chat.has_client_scope(), seen, "{body}");
        let completion = body.replace(
            r#""messages":[{"role":"user","content":"hi"}]"#,
            r#""prompt":"hi""#,
        );
        if let Ok(c) = CompletionRequest::parse(completion.as_bytes()) {
            assert_eq!(c.has_client_scope(), seen, "{completion}");
        }
    }
    // Never sent on: the typed request serializes without them.
    let chat = ChatCompletionRequest::parse(
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"cache_salt":"x"}"#,
    )
    .unwrap();
    assert!(!serde_json::to_string(&chat).unwrap().contains("cache_salt"));
}
