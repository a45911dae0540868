//! `POST /v1/completions`, `POST /v1/chat/completions` and `GET /v1/models`.
//!
//! A request is checked (draining, engine token, body size, JSON, fields, model, context) before
//! it reaches the engine thread; every failure is an OpenAI-style error. An [`Inflight`] guard
//! counts the request for drain and, if the response is dropped before the request finished (the
//! client went away), tells the engine to abort it so its blocks are freed at once.
//!
//! Tenant, scope, priority and quota come from the gateway's `x-kvgate-*` headers, and only when
//! the request carried the engine token: an engine without one serves every caller as the
//! default tenant, so no caller can read another tenant's cached prefixes.
//!
//! A stream that fails after it started ends like any other: an SSE error event, then
//! `data: [DONE]`.

use super::http::{self, error_response, ok_json, sse_response, stream_channel, RespBody};
use super::ServerState;
use crate::sampling::grammar::COMPILE_STACK_BYTES;
use crate::sampling::{Constraint, TokenLogprobs};
use crate::scheduler::GroupId;
use crate::worker::{Command, Event, Progress, Submit, EVENT_BUFFER};
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response};
use kvgate_http::trace::{Attr, Kind as SpanKind, Parent, Trace, TRACEPARENT};
use kvgate_protocol::openai::structured::{self, StreamPiece, ToolCallStream};
use kvgate_protocol::openai::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// Which API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

pub fn models<B>(state: &ServerState, req: &Request<B>) -> Response<RespBody> {
    if let Err(e) = check_engine_token(state, req) {
        return error_response(&e);
    }
    let card = ModelCard::new(
        &state.model_id,
        state.started,
        "kvgate",
        Some(state.context_len as u32),
    );
    ok_json(&ModelList::new(vec![card]))
}

pub async fn completions(state: Arc<ServerState>, req: Request<Incoming>) -> Response<RespBody> {
    respond(state, req, Kind::Completion).await
}

pub async fn chat(state: Arc<ServerState>, req: Request<Incoming>) -> Response<RespBody> {
    respond(state, req, Kind::Chat).await
}

async fn respond(
    state: Arc<ServerState>,
    req: Request<Incoming>,
    kind: Kind,
) -> Response<RespBody> {
    let trace = request_trace(&state, &req);
    let resp = generate(state, req, kind, trace.clone())
        .await
        .unwrap_or_else(|e| {
            if let Some(t) = &trace {
                t.fail(failure(&e));
            }
            error_response(&e)
        });
    if let Some(t) = trace {
        t.set(Attr::new(
            "http.response.status_code",
            i64::from(resp.status().as_u16()),
        ));
    }
    resp
}

/// What a failed span says: the error's status and code, never its message (which can quote
/// what the tenant sent: a schema, a regex).
fn failure(e: &ApiError) -> String {
    format!("{} {}", e.status, e.code.as_str())
}

/// The request's trace, under the caller's span. The gateway (a caller with the engine token)
/// has sampled already, so its flag decides; where the engine has no token, a request is
/// sampled here. A request without the token the engine requires is not traced.
fn request_trace<B>(state: &ServerState, req: &Request<B>) -> Option<Arc<Trace>> {
    if !state.tracer.enabled() {
        return None;
    }
    let trusted = match &state.engine_token {
        Some(t) if !http::has_bearer(req, t) => return None,
        Some(_) => true,
        None => false,
    };
    let parent = http::header_str(req, TRACEPARENT).and_then(Parent::parse);
    let trace = state
        .tracer
        .trace("engine.request", SpanKind::Server, parent, trusted)?;
    if let Some(id) = http::header_str(req, "x-request-id").filter(|id| id.len() <= 64) {
        trace.set(Attr::new("kvgate.request_id", id.to_owned()));
    }
    Some(trace)
}

/// A traced request's milestones, made into its queue, prefill and decode spans when it ends.
struct Timeline {
    trace: Arc<Trace>,
    submitted: std::time::Instant,
    progress: Arc<Progress>,
    /// Prompt, cached and completion tokens, once the engine reported them.
    tokens: Option<(usize, usize, usize)>,
}

impl Timeline {
    fn record(&self, finished: bool) {
        let now = std::time::Instant::now();
        let scheduled = self.progress.scheduled.get().copied();
        let first = self.progress.first_token.get().copied();
        let t = &self.trace;
        t.record(
            "engine.queue",
            SpanKind::Internal,
            self.submitted,
            scheduled.unwrap_or(now),
            Vec::new(),
        );
        let count = |n: usize| n.min(i64::MAX as usize) as i64;
        if let Some(start) = scheduled {
            let mut attrs = Vec::new();
            if let Some((prompt, cached, _)) = self.tokens {
                attrs.push(Attr::new("kvgate.prefill.cached_tokens", count(cached)));
                attrs.push(Attr::new(
                    "kvgate.prefill.computed_tokens",
                    count(prompt.saturating_sub(cached)),
                ));
            }
            t.record(
                "engine.prefill",
                SpanKind::Internal,
                start,
                first.unwrap_or(now),
                attrs,
            );
        }
        if let Some(start) = first {
            let attrs = self.tokens.map_or_else(Vec::new, |(_, _, completion)| {
                vec![Attr::new("kvgate.completion_tokens", count(completion))]
            });
            t.record("engine.decode", SpanKind::Internal, start, now, attrs);
        }
        if let Some((prompt, cached, completion)) = self.tokens {
            t.set(Attr::new("kvgate.prompt_tokens", count(prompt)));
            t.set(Attr::new("kvgate.cached_tokens", count(cached)));
            t.set(Attr::new("kvgate.completion_tokens", count(completion)));
        }
        if !finished {
            t.fail("cancelled before it finished");
        }
    }
}

fn check_engine_token<B>(state: &ServerState, req: &Request<B>) -> Result<(), ApiError> {
    match &state.engine_token {
        Some(t) if !http::has_bearer(req, t) => {
            Err(ApiError::unauthorized("Missing or wrong engine token."))
        }
        _ => Ok(()),
    }
}

/// Who a request is for: set by the gateway in headers, defaulted when called directly.
#[derive(Debug, PartialEq)]
struct Tenancy {
    tenant: String,
    scope: String,
    priority: f64,
    kv_quota: Option<u32>,
}

impl Default for Tenancy {
    fn default() -> Self {
        Tenancy {
            tenant: "default".into(),
            scope: "default".into(),
            priority: 1.0,
            kv_quota: None,
        }
    }
}

/// The request's tenancy. The headers carry authority (whose cache a request may hit, how much
/// of the engine it gets), so they count only from a caller that proved it is the gateway with
/// the engine token ([`check_engine_token`] has run); without a token everyone is the default
/// tenant.
fn tenancy<B>(state: &ServerState, req: &Request<B>) -> Result<Tenancy, ApiError> {
    if state.engine_token.is_none() {
        return Ok(Tenancy::default());
    }
    let tenant = http::header_str(req, "x-kvgate-tenant")
        .unwrap_or("default")
        .to_owned();
    let scope =
        http::header_str(req, "x-kvgate-scope").map_or_else(|| tenant.clone(), str::to_owned);
    let priority = match http::header_str(req, "x-kvgate-priority") {
        None => 1.0,
        Some(p) => p
            .parse::<f64>()
            .ok()
            .filter(|p| p.is_finite() && *p > 0.0)
            .ok_or_else(|| {
                ApiError::invalid_value("x-kvgate-priority", "must be a positive number")
            })?,
    };
    let kv_quota =
        match http::header_str(req, "x-kvgate-kv-quota") {
            None => None,
            Some(q) => Some(q.parse::<u32>().map_err(|_| {
                ApiError::invalid_value("x-kvgate-kv-quota", "must be a block count")
            })?),
        };
    Ok(Tenancy {
        tenant,
        scope,
        priority,
        kv_quota,
    })
}

struct Prepared {
    prompt: Vec<u32>,
    params: SamplingParams,
    stream: bool,
    include_usage: bool,
    /// Tools whose calls are parsed out of the output.
    tools: Vec<Tool>,
}

fn prepare(state: &ServerState, kind: Kind, body: &[u8]) -> Result<Prepared, ApiError> {
    let tokenize =
        |e: kvgate_protocol::prompt::PromptError| ApiError::invalid_value("prompt", e.to_string());
    match kind {
        Kind::Completion => {
            let req = CompletionRequest::parse(body)?;
            if req.model != state.model_id {
                return Err(ApiError::model_not_found(&req.model));
            }
            let input = req.validate(&state.limits)?;
            input.prompt.check_token_ids(state.vocab_size)?;
            let prompt = match input.prompt {
                PromptInput::Text(t) => state.renderer.encode(&t).map_err(tokenize)?,
                PromptInput::Tokens(t) => t,
            };
            Ok(Prepared {
                prompt,
                params: input.params,
                stream: input.stream,
                include_usage: input.include_usage,
                tools: Vec::new(),
            })
        }
        Kind::Chat => {
            let req = ChatCompletionRequest::parse(body)?;
            if req.model != state.model_id {
                return Err(ApiError::model_not_found(&req.model));
            }
            let input = req.validate(&state.limits)?;
            let prompt = state
                .renderer
                .encode_chat(&input.messages)
                .map_err(|e| ApiError::invalid_value("messages", e.to_string()))?;
            Ok(Prepared {
                prompt,
                params: input.params,
                stream: input.stream,
                include_usage: input.include_usage,
                tools: input.structured.tools,
            })
        }
    }
}

/// A request's grammar: its tenant's compiled copy, or compiled now on a thread of its own
/// (never the engine thread), once the tenant's and one of the engine's compile places are free.
/// Its errors are the request's 400.
async fn compile(
    state: &ServerState,
    tenant: &str,
    grammar: &Grammar,
) -> Result<Constraint, ApiError> {
    let Some(compiler) = state.grammars.clone() else {
        return Err(ApiError::unsupported(
            grammar.param(),
            "Structured outputs are not available: this model's tokenizer could not be read \
             for grammars.",
        ));
    };
    if let Some(c) = compiler.cached_for(tenant, grammar) {
        state.metrics.update(|m| m.grammar_cache_hits += 1);
        return Ok(c);
    }
    let permit = state
        .grammar_gate
        .enter(tenant)
        .await
        .ok_or_else(|| ApiError::unavailable("The grammar compiler is shutting down."))?;
    let (tx, rx) = oneshot::channel();
    let (tenant, grammar) = (tenant.to_owned(), grammar.clone());
    std::thread::Builder::new()
        .name("kvgate-compile".into())
        .stack_size(COMPILE_STACK_BYTES)
        .spawn(move || {
            let _permit = permit;
            let _ = tx.send(compiler.compile(&tenant, &grammar));
        })
        .map_err(|_| ApiError::unavailable("The grammar compiler cannot start a thread."))?;
    let (constraint, compiled) = rx
        .await
        .map_err(|_| ApiError::internal("The grammar compiler failed."))??;
    state.metrics.update(|m| match compiled {
        Some(secs) => {
            m.grammar_compiles += 1;
            m.grammar_compile_seconds += secs;
        }
        None => m.grammar_cache_hits += 1,
    });
    Ok(constraint)
}

/// Counts a request in flight; aborts it in the engine if dropped before it finished. A traced
/// request's spans are recorded when it is dropped.
struct Inflight {
    state: Arc<ServerState>,
    id: GroupId,
    finished: bool,
    timeline: Option<Timeline>,
}

impl Inflight {
    /// The engine ended the request, having served these tokens.
    fn done(&mut self, prompt: usize, cached: usize, completion: usize) {
        self.finished = true;
        if let Some(t) = self.timeline.as_mut() {
            t.tokens = Some((prompt, cached, completion));
        }
    }

    /// The engine ended the request with an error.
    fn failed(&mut self, e: &ApiError) {
        self.finished = true;
        if let Some(t) = &self.timeline {
            t.trace.fail(failure(e));
        }
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        if let Some(t) = &self.timeline {
            t.record(self.finished);
        }
        self.state.inflight.fetch_sub(1, Ordering::SeqCst);
        if !self.finished {
            let _ = self.state.commands.send(Command::Abort(self.id));
        }
    }
}

async fn generate(
    state: Arc<ServerState>,
    req: Request<Incoming>,
    kind: Kind,
    trace: Option<Arc<Trace>>,
) -> Result<Response<RespBody>, ApiError> {
    if state.is_draining() {
        return Err(ApiError::draining());
    }
    check_engine_token(&state, &req)?;
    let who = tenancy(&state, &req)?;
    let peer = super::peer::hint(&state, &req);
    let body = http::read_body(req, state.max_body_bytes).await?;
    let p = prepare(&state, kind, &body)?;
    let max_tokens = p.params.max_tokens_for(p.prompt.len(), state.context_len)?;
    let constraint = match &p.params.grammar {
        Some(g) => Some(compile(&state, &who.tenant, g).await?),
        None => None,
    };
    let id = GroupId(state.next_id.fetch_add(1, Ordering::SeqCst));
    let n = p.params.n;
    // Bounded: the engine holds output back rather than queue it here for a slow reader. One
    // slot per sample for its last piece, one for the end.
    let (tx, rx) = mpsc::channel(EVENT_BUFFER + n as usize + 1);
    let (on_stall, stalled) = oneshot::channel();
    let prompt_len = p.prompt.len();
    let logprobs = p.params.logprobs.is_some();
    if let Some(t) = &trace {
        t.set(Attr::new("kvgate.tenant", who.tenant.clone()));
    }
    let timeline = trace.map(|trace| Timeline {
        trace,
        submitted: std::time::Instant::now(),
        progress: Arc::default(),
        tokens: None,
    });
    let progress = timeline.as_ref().map(|t| t.progress.clone());
    state.inflight.fetch_add(1, Ordering::SeqCst);
    let mut guard = Inflight {
        state: state.clone(),
        id,
        finished: false,
        timeline,
    };
    // A peer holds more of the prefix than this engine: its blocks come over first.
    if let Some(hint) = &peer {
        super::peer::fetch(&state, hint, &who.scope, &p.prompt).await;
    }
    if let Some(t) = guard.timeline.as_mut() {
        let now = std::time::Instant::now();
        if peer.is_some() {
            let start = t.submitted;
            t.trace.record(
                "engine.peer_fetch",
                SpanKind::Client,
                start,
                now,
                Vec::new(),
            );
        }
        t.submitted = now;
    }
    state
        .commands
        .send(Command::Submit(
            id,
            Box::new(Submit {
                tenant: who.tenant,
                scope: who.scope,
                priority: who.priority,
                kv_quota: who.kv_quota,
                prompt: p.prompt,
                params: p.params,
                max_tokens,
                constraint,
                events: tx,
                on_stall,
                progress,
            }),
        ))
        .map_err(|_| ApiError::unavailable("The engine is not running."))?;
    let out = Output {
        state: state.clone(),
        kind,
        id: format!("{}-{}", prefix(kind), id.0),
        created: now(),
        n,
        logprobs,
        tools: p.tools,
    };
    if p.stream {
        let (body_tx, body) = stream_channel(64);
        tokio::spawn(out.stream(rx, body_tx, guard, p.include_usage, stalled));
        Ok(sse_response(body))
    } else {
        out.collect(rx, guard, prompt_len).await
    }
}

fn prefix(kind: Kind) -> &'static str {
    match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Renders a request's events as a response.
struct Output {
    state: Arc<ServerState>,
    kind: Kind,
    id: String,
    created: u64,
    n: u32,
    logprobs: bool,
    /// Tools whose calls are parsed out of the output (chat only).
    tools: Vec<Tool>,
}

#[derive(Default)]
struct Choice {
    text: String,
    finish: Option<FinishReason>,
    tokens: Vec<(u32, usize, TokenLogprobs)>,
}

impl Output {
    fn token_text(&self, id: u32) -> String {
        self.state.renderer.decode(&[id]).unwrap_or_default()
    }

    fn completion_logprobs(&self, tokens: &[(u32, usize, TokenLogprobs)]) -> CompletionLogprobs {
        CompletionLogprobs {
            tokens: tokens.iter().map(|(t, _, _)| self.token_text(*t)).collect(),
            token_logprobs: tokens.iter().map(|(_, _, l)| l.logprob).collect(),
            top_logprobs: tokens
                .iter()
                .map(|(_, _, l)| {
                    TopLogprobMap::new(l.top.iter().map(|(id, lp)| (self.token_text(*id), *lp)))
                })
                .collect(),
            text_offset: tokens.iter().map(|(_, off, _)| *off as u32).collect(),
        }
    }

    fn chat_logprobs(&self, tokens: &[(u32, usize, TokenLogprobs)]) -> ChatLogprobs {
        let entry = |id: u32, lp: f32| {
            let token = self.token_text(id);
            (token.as_bytes().to_vec(), token, lp)
        };
        ChatLogprobs {
            content: tokens
                .iter()
                .map(|(t, _, l)| {
                    let (bytes, token, logprob) = entry(*t, l.logprob);
                    ChatTokenLogprob {
                        token,
                        logprob,
                        bytes: Some(bytes),
                        top_logprobs: l
                            .top
                            .iter()
                            .map(|(id, lp)| {
                                let (bytes, token, logprob) = entry(*id, *lp);
                                TopLogprob {
                                    token,
                                    logprob,
                                    bytes: Some(bytes),
                                }
                            })
                            .collect(),
                    }
                })
                .collect(),
        }
    }

    async fn collect(
        self,
        mut rx: mpsc::Receiver<Event>,
        mut guard: Inflight,
        _prompt_len: usize,
    ) -> Result<Response<RespBody>, ApiError> {
        let mut choices: Vec<Choice> = (0..self.n).map(|_| Choice::default()).collect();
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Piece {
                    index,
                    text,
                    logprobs,
                    finish,
                } => {
                    let Some(c) = choices.get_mut(index as usize) else {
                        continue;
                    };
                    if self.logprobs {
                        let at = c.text.len();
                        c.tokens
                            .extend(logprobs.into_iter().map(|(t, l)| (t, at, l)));
                    }
                    c.text.push_str(&text);
                    c.finish = finish.or(c.finish);
                }
                Event::Done {
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                } => {
                    guard.done(prompt_tokens, cached_tokens, completion_tokens);
                    let usage = Usage::new(
                        prompt_tokens as u32,
                        completion_tokens as u32,
                        cached_tokens as u32,
                    );
                    return Ok(self.full_response(choices, usage));
                }
                Event::Failed(e) => {
                    guard.failed(&e);
                    return Err(e);
                }
            }
        }
        Err(engine_stopped())
    }

    fn full_response(&self, choices: Vec<Choice>, usage: Usage) -> Response<RespBody> {
        let model = &self.state.model_id;
        match self.kind {
            Kind::Completion => {
                let choices = choices
                    .into_iter()
                    .enumerate()
                    .map(|(i, c)| CompletionChoice {
                        logprobs: self.logprobs.then(|| self.completion_logprobs(&c.tokens)),
                        text: c.text,
                        index: i as u32,
                        finish_reason: c.finish,
                    })
                    .collect();
                ok_json(&CompletionResponse::new(
                    &self.id,
                    self.created,
                    model,
                    choices,
                    usage,
                ))
            }
            Kind::Chat => {
                let choices = choices
                    .into_iter()
                    .enumerate()
                    .map(|(i, c)| {
                        let lp = self.logprobs.then(|| self.chat_logprobs(&c.tokens));
                        let finish = c.finish.unwrap_or(FinishReason::Stop);
                        match structured::parse_tool_calls(&c.text, &self.tools) {
                            Some((content, calls)) => {
                                let mut choice = ChatChoice::tool_calls(
                                    i as u32,
                                    (!content.is_empty()).then_some(content),
                                    calls
                                        .iter()
                                        .map(|c| ToolCall::function(&c.name, &c.arguments))
                                        .collect(),
                                    lp,
                                );
                                // Calls cut short by max_tokens still say so, as a stream does.
                                if finish == FinishReason::Length {
                                    choice.finish_reason = FinishReason::Length;
                                }
                                choice
                            }
                            None => ChatChoice::new(i as u32, c.text, lp, finish),
                        }
                    })
                    .collect();
                ok_json(&ChatCompletionResponse::new(
                    &self.id,
                    self.created,
                    model,
                    choices,
                    usage,
                ))
            }
        }
    }

    fn chunk(
        &self,
        index: u32,
        text: String,
        finish: Option<FinishReason>,
        lps: Vec<(u32, usize, TokenLogprobs)>,
        first: bool,
    ) -> String {
        let model = &self.state.model_id;
        match self.kind {
            Kind::Completion => sse_event(&CompletionChunk::new(
                &self.id,
                self.created,
                model,
                vec![CompletionChoice {
                    text,
                    index,
                    logprobs: (!lps.is_empty()).then(|| self.completion_logprobs(&lps)),
                    finish_reason: finish,
                }],
            )),
            Kind::Chat => {
                let mut out = String::new();
                if first {
                    out.push_str(&sse_event(&ChatCompletionChunk::new(
                        &self.id,
                        self.created,
                        model,
                        vec![ChatChunkChoice::role(index)],
                    )));
                }
                let choice = match finish {
                    Some(r) => {
                        let mut c = ChatChunkChoice::finish(index, text, r);
                        c.logprobs = (!lps.is_empty()).then(|| self.chat_logprobs(&lps));
                        c
                    }
                    None => ChatChunkChoice::content(
                        index,
                        text,
                        (!lps.is_empty()).then(|| self.chat_logprobs(&lps)),
                    ),
                };
                out.push_str(&sse_event(&ChatCompletionChunk::new(
                    &self.id,
                    self.created,
                    model,
                    vec![choice],
                )));
                out
            }
        }
    }

    /// The chunks of a chat stream whose tool calls are parsed out: text as content (held while
    /// it may open a call), each whole call as one tool-call delta with its id, name and
    /// arguments, and `finish_reason` `tool_calls` when the output was calls.
    fn tool_chunks(
        &self,
        index: u32,
        text: &str,
        finish: Option<FinishReason>,
        lps: Vec<(u32, usize, TokenLogprobs)>,
        first: bool,
        calls: &mut ToolCallStream,
    ) -> String {
        let mut pieces = calls.push(text, &self.tools);
        if finish.is_some() {
            pieces.extend(calls.finish());
        }
        let mut choices = Vec::new();
        if first {
            choices.push(ChatChunkChoice::role(index));
        }
        let mut lps = (!lps.is_empty()).then(|| self.chat_logprobs(&lps));
        for piece in pieces {
            choices.push(match piece {
                StreamPiece::Content(c) => ChatChunkChoice::content(index, c, lps.take()),
                StreamPiece::Call { index: k, call: c } => {
                    let call = ToolCall::function(&c.name, &c.arguments);
                    ChatChunkChoice::tool_calls(
                        index,
                        vec![ToolCallDelta {
                            index: k as u32,
                            id: Some(call.id),
                            type_: Some(call.type_),
                            function: FunctionDelta {
                                name: Some(call.function.name),
                                arguments: Some(call.function.arguments),
                            },
                        }],
                    )
                }
            });
        }
        if let Some(reason) = finish {
            let reason = match reason {
                FinishReason::Stop if calls.calls() > 0 => FinishReason::ToolCalls,
                r => r,
            };
            let mut c = ChatChunkChoice::finish(index, String::new(), reason);
            c.logprobs = lps.take();
            choices.push(c);
        }
        let model = &self.state.model_id;
        choices
            .into_iter()
            .map(|c| {
                sse_event(&ChatCompletionChunk::new(
                    &self.id,
                    self.created,
                    model,
                    vec![c],
                ))
            })
            .collect()
    }

    async fn stream(
        self,
        mut rx: mpsc::Receiver<Event>,
        body: mpsc::Sender<Bytes>,
        mut guard: Inflight,
        include_usage: bool,
        stalled: oneshot::Receiver<()>,
    ) {
        let mut stalled = Some(stalled);
        let mut tool_streams = vec![ToolCallStream::default(); self.n as usize];
        let mut started = vec![false; self.n as usize];
        let mut offsets = vec![0usize; self.n as usize];
        loop {
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                () = cancelled_as_stalled(&mut stalled) => {
                    let _ = body.try_send(Bytes::from(error_frames(&stalled_client())));
                    return;
                }
            };
            let frame = match ev {
                Some(Event::Piece {
                    index,
                    text,
                    logprobs,
                    finish,
                }) => {
                    let i = index as usize;
                    let (Some(offset), Some(was_started)) =
                        (offsets.get_mut(i), started.get_mut(i))
                    else {
                        continue;
                    };
                    let lps: Vec<_> = if self.logprobs {
                        logprobs.into_iter().map(|(t, l)| (t, *offset, l)).collect()
                    } else {
                        Vec::new()
                    };
                    if text.is_empty() && lps.is_empty() && finish.is_none() && *was_started {
                        continue;
                    }
                    *offset += text.len();
                    let first = !std::mem::replace(was_started, true);
                    match tool_streams.get_mut(i).filter(|_| !self.tools.is_empty()) {
                        Some(calls) => self.tool_chunks(index, &text, finish, lps, first, calls),
                        None => self.chunk(index, text, finish, lps, first),
                    }
                }
                Some(Event::Done {
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                }) => {
                    guard.done(prompt_tokens, cached_tokens, completion_tokens);
                    let mut out = String::new();
                    if include_usage {
                        let usage = Usage::new(
                            prompt_tokens as u32,
                            completion_tokens as u32,
                            cached_tokens as u32,
                        );
                        out.push_str(&self.usage_chunk(usage));
                    }
                    out.push_str(SSE_DONE);
                    send(&body, out, &mut stalled).await;
                    return;
                }
                Some(Event::Failed(e)) => {
                    guard.failed(&e);
                    send(&body, error_frames(&e), &mut stalled).await;
                    return;
                }
                None => {
                    // The engine dropped the request without ending it.
                    send(&body, error_frames(&engine_stopped()), &mut stalled).await;
                    return;
                }
            };
            if !send(&body, frame, &mut stalled).await {
                return; // the client went away or stalled: the guard aborts the request
            }
        }
    }

    fn usage_chunk(&self, usage: Usage) -> String {
        let model = &self.state.model_id;
        match self.kind {
            Kind::Completion => sse_event(&CompletionChunk::usage(
                &self.id,
                self.created,
                model,
                usage,
            )),
            Kind::Chat => sse_event(&ChatCompletionChunk::usage(
                &self.id,
                self.created,
                model,
                usage,
            )),
        }
    }
}

fn engine_stopped() -> ApiError {
    ApiError::internal("The engine stopped before the request finished.")
}

fn stalled_client() -> ApiError {
    ApiError::new(
        ErrorCode::Timeout,
        "The client read nothing for too long; the request was cancelled.",
    )
}

/// How every stream that fails after it started ends, whatever the error: the error as an SSE
/// event, then `[DONE]`, so a client (or the gateway) always sees where the stream stops.
fn error_frames(e: &ApiError) -> String {
    let mut out = e.to_sse();
    out.push_str(SSE_DONE);
    out
}

/// Sends `frame` to the client; false when it left, or when the engine cancelled the request
/// because the client stopped reading (then the client gets the error only if it has room,
/// since waiting for it is what the cancel ended).
async fn send(
    body: &mpsc::Sender<Bytes>,
    frame: String,
    stalled: &mut Option<oneshot::Receiver<()>>,
) -> bool {
    tokio::select! {
        sent = body.send(Bytes::from(frame)) => sent.is_ok(),
        () = cancelled_as_stalled(stalled) => {
            let _ = body.try_send(Bytes::from(error_frames(&stalled_client())));
            false
        }
    }
}

/// Completes when the engine cancels the request as stalled; never, once the engine is done with
/// the request without doing so (the sender is gone).
async fn cancelled_as_stalled(rx: &mut Option<oneshot::Receiver<()>>) {
    if let Some(r) = rx.as_mut() {
        let fired = r.await.is_ok();
        // A finished oneshot must not be polled again.
        *rx = None;
        if fired {
            return;
        }
    }
    std::future::pending::<()>().await;
}
