//! Request bodies through both paths a request takes: the gateway's (`prepare` in
//! `gateway/src/api.rs`: a JSON tree, the client's cache scope stripped, the typed request read
//! from the tree, validated, `stream_options` forced on, the tree re-serialized and forwarded)
//! and the engine's (the typed request parsed from bytes and validated). Every body is tried as
//! a chat and as a completion request.
//!
//! Invariants: nothing panics; every error is a 4xx [`ApiError`] whose body round-trips; a
//! validated request obeys every documented range of [`SamplingParams`]; what the gateway
//! accepts and forwards, the engine accepts with the same meaning; what the engine accepts
//! directly, the gateway accepts with the same meaning.

use super::{ensure, param_shape, signature, Target, Violation};
use crate::corpus::Corpus;
use crate::rng::Rng;
use kvgate_protocol::openai::{
    body_not_an_object, strip_client_scope, ApiError, ChatCompletionRequest, ChatInput,
    CompletionInput, CompletionRequest, ErrorBody, ErrorCode, Limits, PromptInput, SamplingParams,
    CLIENT_SCOPE_FIELDS,
};
use serde::Deserialize;
use serde_json::Value;

/// Request bodies.
#[derive(Debug)]
pub struct Protocol;

/// Largest body a mutant grows to.
const MAX_BODY: usize = 256 << 10;

/// Which endpoint a body is sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Chat,
    Completion,
}

/// A validated request of either kind.
#[derive(Debug, Clone, PartialEq)]
enum Input {
    Chat(ChatInput),
    Completion(CompletionInput),
}

impl Input {
    fn params(&self) -> &SamplingParams {
        match self {
            Input::Chat(c) => &c.params,
            Input::Completion(c) => &c.params,
        }
    }

    fn stream(&self) -> bool {
        match self {
            Input::Chat(c) => c.stream,
            Input::Completion(c) => c.stream,
        }
    }

    fn include_usage(&self) -> bool {
        match self {
            Input::Chat(c) => c.include_usage,
            Input::Completion(c) => c.include_usage,
        }
    }

    /// The same request as the engine sees it after the gateway forced `include_usage` on.
    fn with_usage_forced(&self) -> Input {
        let mut i = self.clone();
        match &mut i {
            Input::Chat(c) => c.include_usage = c.stream,
            Input::Completion(c) => c.include_usage = c.stream,
        }
        i
    }
}

impl Target for Protocol {
    const NAME: &'static str = "protocol";
    type Case = Vec<u8>;

    fn seeds(corpus: &Corpus) -> Vec<Vec<u8>> {
        corpus
            .chat
            .iter()
            .chain(&corpus.completion)
            .map(|e| e.data.clone())
            .collect()
    }

    fn mutate(case: &Vec<u8>, other: &Vec<u8>, rng: &mut Rng) -> Vec<u8> {
        super::mutate_input(case, other, rng, MAX_BODY)
    }

    fn check(body: &Vec<u8>) -> Result<u64, Violation> {
        let limits = Limits::default();
        let mut outcomes = Vec::with_capacity(4);
        for kind in [Kind::Chat, Kind::Completion] {
            let direct = engine(kind, body, &limits)?;
            let gateway = gateway(kind, body, &limits)?;
            if let Ok(d) = &direct {
                // The gateway must not refuse, or change, what the engine itself accepts. The
                // one known exception: the engine skips unknown fields without reading them as
                // JSON values (a number out of range, invalid UTF-8 there pass), while the
                // gateway reads the whole body as a tree first.
                let lax_skip = gateway
                    .as_ref()
                    .is_err_and(|e| e.code == ErrorCode::InvalidJson);
                ensure(
                    gateway.as_ref().is_ok_and(|(g, _)| g == d),
                    if lax_skip {
                        "protocol.engine_skips_unknown_fields_unread"
                    } else {
                        "protocol.gateway_accepts_what_engine_accepts"
                    },
                    || format!("{kind:?}: engine {d:?}, gateway {gateway:?}"),
                )?;
            }
            if let Ok((g, forwarded)) = &gateway {
                let at_engine = engine(kind, forwarded, &limits)?;
                let want = g.with_usage_forced();
                ensure(
                    at_engine.as_ref().is_ok_and(|e| *e == want),
                    "protocol.engine_accepts_what_gateway_forwards",
                    || {
                        format!(
                            "{kind:?}: gateway {g:?}, engine {at_engine:?}, forwarded {}",
                            String::from_utf8_lossy(forwarded)
                        )
                    },
                )?;
            }
            outcomes.push((kind, shape(&direct)));
            outcomes.push((kind, shape(&gateway.map(|(g, _)| g))));
        }
        Ok(signature(outcomes))
    }

    crate::targets::bytes_case!();
}

/// What distinguishes one outcome from another, for the signature.
fn shape(r: &Result<Input, ApiError>) -> String {
    match r {
        Err(e) => format!(
            "{} {}",
            e.code,
            param_shape(e.param.as_deref().unwrap_or(""))
        ),
        Ok(i) => {
            let p = i.params();
            format!(
                "ok s{} u{} g{} k{} st{} ids{} b{} lp{:?} seed{} prompt{}",
                i.stream(),
                i.include_usage(),
                p.is_greedy(),
                p.top_k.is_some(),
                p.stop.len().min(2),
                p.stop_token_ids.len().min(2),
                p.logit_bias.len().min(2),
                p.logprobs.map(|l| l.min(2)),
                p.seed.is_some(),
                match i {
                    Input::Chat(c) => c.messages.len().min(3),
                    Input::Completion(c) => usize::from(matches!(c.prompt, PromptInput::Text(_))),
                }
            )
        }
    }
}

/// The engine's path: the typed request straight from the bytes, validated.
fn engine(kind: Kind, body: &[u8], limits: &Limits) -> Result<Result<Input, ApiError>, Violation> {
    let r = match kind {
        Kind::Chat => {
            ChatCompletionRequest::parse(body).and_then(|r| r.validate(limits).map(Input::Chat))
        }
        Kind::Completion => {
            CompletionRequest::parse(body).and_then(|r| r.validate(limits).map(Input::Completion))
        }
    };
    settle(r, limits, body)
}

/// The gateway's path (`prepare`): the validated request and the body forwarded to the engine.
fn gateway(
    kind: Kind,
    body: &[u8],
    limits: &Limits,
) -> Result<Result<(Input, Vec<u8>), ApiError>, Violation> {
    let mut json: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return refused(ApiError::from_json_error(&e)),
    };
    if !json.is_object() {
        return refused(body_not_an_object());
    }
    let had_scope = CLIENT_SCOPE_FIELDS.iter().any(|f| json.get(f).is_some());
    let removed = strip_client_scope(&mut json);
    ensure(
        removed == had_scope && CLIENT_SCOPE_FIELDS.iter().all(|f| json.get(f).is_none()),
        "protocol.strip_client_scope",
        || format!("removed {removed}, had {had_scope}, left {json}"),
    )?;
    let input = match kind {
        Kind::Chat => ChatCompletionRequest::deserialize(&json)
            .map_err(|e| ApiError::from_json_error(&e))
            .and_then(|r| r.validate(limits).map(Input::Chat)),
        Kind::Completion => {
            CompletionRequest::parse(body).and_then(|r| r.validate(limits).map(Input::Completion))
        }
    };
    let input = match settle(input, limits, body)? {
        Ok(i) => i,
        Err(e) => return Ok(Err(e)),
    };
    if input.stream() {
        json["stream_options"] = serde_json::json!({"include_usage": true});
    }
    let forwarded = serde_json::to_vec(&json)
        .map_err(|e| Violation::new("protocol.forward_serializes", e.to_string()))?;
    Ok(Ok((input, forwarded)))
}

/// Checks an outcome: an error must be a well-formed 4xx, a validated request must be in range.
fn settle(
    r: Result<Input, ApiError>,
    limits: &Limits,
    body: &[u8],
) -> Result<Result<Input, ApiError>, Violation> {
    match &r {
        Err(e) => check_error(e)?,
        Ok(i) => check_input(i, limits, body)?,
    }
    Ok(r)
}

/// A refusal before any typed parsing, checked like every other error.
fn refused<T>(e: ApiError) -> Result<Result<T, ApiError>, Violation> {
    check_error(&e)?;
    Ok(Err(e))
}

/// Every error is a client error with a consistent status, type and code, and a body that
/// reads back as itself.
fn check_error(e: &ApiError) -> Result<(), Violation> {
    ensure(
        (400..500).contains(&e.status),
        "protocol.error_is_4xx",
        || format!("{e:?}"),
    )?;
    ensure(
        e.code.status() == e.status
            && e.type_ == kvgate_protocol::openai::error::error_type(e.status)
            && !e.message.is_empty()
            && e.param.as_deref() != Some("")
            && e.retry_after.is_none(),
        "protocol.error_consistent",
        || format!("{e:?}"),
    )?;
    let json = e.to_json();
    let back: Result<ErrorBody, _> = serde_json::from_str(&json);
    ensure(
        back.as_ref().is_ok_and(|b| *b == e.body()),
        "protocol.error_body_round_trips",
        || format!("{json} -> {back:?}"),
    )?;
    let sse = e.to_sse();
    ensure(
        sse.starts_with("data: ") && sse.ends_with("\n\n") && sse.matches("\n\n").count() == 1,
        "protocol.error_is_one_sse_event",
        || sse.clone(),
    )
}

/// A validated request obeys the documented ranges of its parameters.
fn check_input(input: &Input, limits: &Limits, body: &[u8]) -> Result<(), Violation> {
    match input {
        Input::Chat(c) => {
            ensure(!c.messages.is_empty(), "protocol.chat_has_messages", || {
                format!("{c:?}")
            })?;
            ensure(
                c.messages
                    .iter()
                    .all(|m| kvgate_protocol::openai::chat::ROLES.contains(&m.role.as_str())),
                "protocol.chat_roles",
                || format!("{:?}", c.messages),
            )?;
        }
        Input::Completion(c) => {
            ensure(
                c.params.max_tokens.is_some()
                    && !matches!(&c.prompt, PromptInput::Tokens(t) if t.is_empty()),
                "protocol.completion_shape",
                || format!("{c:?}"),
            )?;
            // `min_tokens` is checked against `max_tokens` as sent, before the completions
            // default (16) fills it in.
            ensure(
                c.params.max_tokens.is_none_or(|m| c.params.min_tokens <= m),
                "completion.min_tokens_past_default_max_tokens",
                || format!("{:?}", c.params),
            )?;
        }
    }
    ensure(
        !input.include_usage() || input.stream(),
        "protocol.usage_only_when_streaming",
        || format!("{input:?}"),
    )?;
    check_params(input.params(), limits)?;
    check_context(input.params(), body)
}

fn check_params(p: &SamplingParams, limits: &Limits) -> Result<(), Violation> {
    let bad = |what: &'static str| move || format!("{what}: {p:?}");
    ensure(
        p.temperature.is_finite() && p.temperature >= 0.0,
        "sampling.temperature_range",
        bad("temperature"),
    )?;
    ensure(
        p.temperature != 0.0 || (p.top_p == 1.0 && p.top_k.is_none() && p.min_p == 0.0),
        "sampling.greedy_turns_filters_off",
        bad("greedy"),
    )?;
    ensure(
        p.top_p > 0.0 && p.top_p <= 1.0,
        "sampling.top_p_range",
        bad("top_p"),
    )?;
    ensure(
        (0.0..=1.0).contains(&p.min_p),
        "sampling.min_p_range",
        bad("min_p"),
    )?;
    ensure(
        (-2.0..=2.0).contains(&p.presence_penalty) && (-2.0..=2.0).contains(&p.frequency_penalty),
        "sampling.penalty_range",
        bad("penalties"),
    )?;
    ensure(
        p.repetition_penalty > 0.0 && p.repetition_penalty.is_finite(),
        "sampling.repetition_penalty_range",
        bad("repetition_penalty"),
    )?;
    ensure(
        p.top_k != Some(0),
        "sampling.top_k_never_zero",
        bad("top_k"),
    )?;
    ensure(
        (1..=limits.max_n).contains(&p.n),
        "sampling.n_range",
        bad("n"),
    )?;
    ensure(
        p.max_tokens != Some(0) && p.min_tokens <= p.max_tokens.unwrap_or(u32::MAX),
        "sampling.max_min_tokens",
        bad("max_tokens/min_tokens"),
    )?;
    ensure(
        p.logprobs.is_none_or(|k| k <= limits.max_logprobs),
        "sampling.logprobs_range",
        bad("logprobs"),
    )?;
    ensure(
        p.stop.len() <= limits.max_stop
            && p.stop
                .iter()
                .all(|s| !s.is_empty() && s.len() <= limits.max_stop_len),
        "sampling.stop_bounded",
        bad("stop"),
    )?;
    ensure(
        p.stop_token_ids.len() <= limits.max_stop_token_ids
            && p.stop_token_ids.windows(2).all(|w| w[0] < w[1]),
        "sampling.stop_token_ids_sorted_bounded",
        bad("stop_token_ids"),
    )?;
    ensure(
        p.logit_bias.len() <= limits.max_logit_bias
            && p.logit_bias.windows(2).all(|w| w[0].0 < w[1].0)
            && p.logit_bias
                .iter()
                .all(|&(_, b)| (-100.0..=100.0).contains(&b)),
        "sampling.logit_bias_sorted_bounded",
        bad("logit_bias"),
    )?;
    let json = serde_json::to_string(p)
        .map_err(|e| Violation::new("sampling.serializes", e.to_string()))?;
    let back: Result<SamplingParams, _> = serde_json::from_str(&json);
    ensure(
        back.as_ref().is_ok_and(|b| b == p),
        "sampling.round_trips",
        || format!("{json} -> {back:?}"),
    )
}

/// `max_tokens_for` on a prompt length and context drawn from the body: an answer fits.
fn check_context(p: &SamplingParams, body: &[u8]) -> Result<(), Violation> {
    let h = signature(body);
    let context = [1usize, 2048, 4096, 131_072][(h & 3) as usize];
    let prompt = ((h >> 8) as usize) % (context + 2);
    match p.max_tokens_for(prompt, context) {
        Ok(m) => ensure(
            prompt > 0 && m >= 1 && prompt + m as usize <= context,
            "sampling.max_tokens_for_fits",
            || format!("prompt {prompt}, context {context}, got {m}, {p:?}"),
        ),
        Err(e) => check_error(&e),
    }
}
