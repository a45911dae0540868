//! The tenants' endpoints behind the tower stack: `/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`, `/health`. A generation request is validated (the engine's own rules, so bad
//! input fails here with the same error), rewritten (the client's cache scope removed, the
//! tenant's default system prompt added), admitted by the tenant's rate limits, hashed, routed
//! and proxied, with a retry on another engine while nothing has reached the client.
//!
//! Deadlines have one owner each: the request's (`request_timeout_secs`, until the answer
//! starts, retries included) is kept here; an attempt's (`first_byte_timeout_secs`, within what
//! is left of the request's) by the proxy, so a hung engine is given up and the next one tried
//! before the request's own deadline. What a request holds (lease, engine load, its metrics
//! line) lives in drop guards ([`guard`]), released however the request ends.

mod guard;

use self::guard::{Admitting, Billed, EngineLoad, Lease, Outcome};
use crate::auth::Principal;
use crate::extensions::{BodyLimit, RequestId};
use crate::routing::prefix::PromptHashes;
use crate::state::Gateway;
use crate::store::Admission;
use crate::upstream::proxy::{self, Forward, StreamEnd};
use crate::upstream::{now_ms, Engine, RouteRequest};
use crate::usage::{self, Prices};
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use kvgate_http::trace::{Attr, Kind as SpanKind, Span, Trace, TRACEPARENT};
use kvgate_http::{error_response, json_response, ok_json, RespBody};
use kvgate_protocol::openai::{
    body_not_an_object, strip_client_scope, ApiError, ChatCompletionRequest, CompletionRequest,
    ErrorCode, Limits, ModelCard, ModelList, PromptInput, SamplingParams,
};
use serde::Deserialize;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// Engines tried per request (the first choice plus retries).
const MAX_ATTEMPTS: usize = 3;

pub async fn handle(gw: Arc<Gateway>, req: Request<Incoming>) -> Response<RespBody> {
    let path = req.uri().path().to_owned();
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => health(&gw),
        (Method::GET, "/v1/models") => models(&gw, &req),
        (Method::POST, "/v1/chat/completions") => generate(gw, req, Kind::Chat).await,
        (Method::POST, "/v1/completions") => generate(gw, req, Kind::Completion).await,
        (m, "/v1/models" | "/v1/chat/completions" | "/v1/completions" | "/health") => {
            error_response(&ApiError::method_not_allowed(m.as_str(), &path))
        }
        (m, p) => error_response(&ApiError::not_found(m.as_str(), p)),
    }
}

fn health(gw: &Gateway) -> Response<RespBody> {
    if gw.stopping.load(std::sync::atomic::Ordering::Relaxed) {
        return json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "{\"status\":\"stopping\"}".to_owned(),
        );
    }
    let now = now_ms();
    let routable = gw.registry.all().iter().filter(|e| e.routable(now)).count();
    let status = if routable > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(
        status,
        format!(
            "{{\"status\":\"{}\",\"engines_routable\":{routable}}}",
            if routable > 0 { "ready" } else { "no_engine" }
        ),
    )
}

fn principal<B>(req: &Request<B>) -> Option<Arc<Principal>> {
    req.extensions().get::<Arc<Principal>>().cloned()
}

fn models(gw: &Gateway, req: &Request<Incoming>) -> Response<RespBody> {
    let Some(p) = principal(req) else {
        return error_response(&ApiError::unauthorized("Missing API key."));
    };
    let cards = if p.tenant.allows_model(&gw.config.model_id) {
        vec![ModelCard::new(&gw.config.model_id, 0, "kvgate", None)]
    } else {
        Vec::new()
    };
    gw.metrics.request(&p.tenant.id, 200);
    ok_json(&ModelList::new(cards))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// A validated, rewritten request ready to route.
struct Prepared {
    body: Bytes,
    hashes: PromptHashes,
    /// Most tokens the answer may have (`max_tokens`, else the context's room).
    max_tokens: u32,
    /// Answers asked for (`n`).
    samples: u32,
    stream: bool,
    wants_usage: bool,
}

/// Bodies up to this size are validated and hashed inline; larger ones on the blocking pool, a
/// few at a time, so that one tenant's huge prompts never hold the threads that serve everyone.
const INLINE_PREPARE_BYTES: usize = 64 << 10;

/// Large requests being prepared at once (the rest wait their turn, asynchronously).
fn heavy_permits() -> Arc<Semaphore> {
    static PERMITS: std::sync::OnceLock<Arc<Semaphore>> = std::sync::OnceLock::new();
    PERMITS
        .get_or_init(|| {
            let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
            Arc::new(Semaphore::new((cpus / 2).max(1)))
        })
        .clone()
}

async fn generate(gw: Arc<Gateway>, req: Request<Incoming>, kind: Kind) -> Response<RespBody> {
    let start = Instant::now();
    let deadline =
        tokio::time::Instant::now() + Duration::from_secs(gw.config.request_timeout_secs);
    let Some(p) = principal(&req) else {
        return error_response(&ApiError::unauthorized("Missing API key."));
    };
    let mut outcome = Outcome::new(&gw, &p.tenant.id, start);
    let trace = req.extensions().get::<Arc<Trace>>().cloned();
    outcome.trace = trace.clone();
    let request_id = req
        .extensions()
        .get::<RequestId>()
        .map_or_else(|| Arc::from("req"), |r| r.0.clone());
    let limit = req
        .extensions()
        .get::<BodyLimit>()
        .map_or(gw.config.max_body_bytes, |l| l.0);
    let admitted = tokio::time::timeout_at(deadline, async {
        let body = kvgate_http::read_body(req, limit).await?;
        let prepared = prepare_bounded(&gw, &p, kind, body).await?;
        let mut span = trace
            .as_ref()
            .map(|t| t.span("gateway.rate_limit", SpanKind::Internal));
        let lease = admit(&gw, &p, prepared.hashes.prompt_tokens as u64).await;
        if let Some(span) = span.as_mut() {
            match &lease {
                Ok(l) => span.set(Attr::new("kvgate.rate_limited", l.is_some())),
                Err(e) => span.fail(e.message.clone()),
            }
        }
        Ok::<_, ApiError>((prepared, lease?))
    })
    .await;
    let (prepared, lease) = match admitted {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => return fail(&mut outcome, &e),
        Err(_) => return fail(&mut outcome, &ApiError::timeout()),
    };
    // Admitted: from here on, however it ends, the request is in the ledger.
    outcome.billed = gw.config.usage_ledger.then(|| Billed {
        request_id: request_id.to_string(),
        key_id: p.key_id.clone(),
        key_lineage: p.key.lineage.clone(),
        model: gw.config.model_id.clone(),
        prices: prices(&gw, &p),
        engine: None,
        // Counted once an engine answers: a request no engine took costs nothing.
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
        finish_reason: None,
        first_token: None,
        broken: false,
    });
    let to = Upstream {
        gw: &gw,
        p: &p,
        request_id: &request_id,
        kind,
        deadline,
        trace: trace.as_ref(),
    };
    match forward(to, prepared, lease, &mut outcome).await {
        Ok(resp) => resp,
        Err(e) => fail(&mut outcome, &e),
    }
}

/// The error's response, recorded as the request's outcome.
fn fail(outcome: &mut Outcome, e: &ApiError) -> Response<RespBody> {
    outcome.status = Some(e.status);
    error_response(e)
}

/// [`prepare`], off the async threads for large bodies.
async fn prepare_bounded(
    gw: &Arc<Gateway>,
    p: &Arc<Principal>,
    kind: Kind,
    body: Bytes,
) -> Result<Prepared, ApiError> {
    if body.len() <= INLINE_PREPARE_BYTES {
        return prepare(gw, p, kind, &body);
    }
    // Owned by the blocking job, which runs to its end even when the request is dropped (its
    // client gone, its deadline passed): a client that sends large bodies and leaves holds the
    // permit until the work it started is done.
    let permit = heavy_permits()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::unavailable("The gateway is shutting down."))?;
    let (gw, p) = (gw.clone(), p.clone());
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        prepare(&gw, &p, kind, &body)
    })
    .await
    .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))?
}

/// Validates with the engine's rules and, where needed, rewrites the body for the engine.
///
/// Most requests need no rewrite: no client cache-scope field to remove, no tenant system prompt
/// to add, not streamed (whose `stream_options` the gateway sets). Those are parsed once, into
/// the typed request, and forwarded as the bytes the client sent. The others go through a JSON
/// tree that is edited and written out again.
fn prepare(gw: &Gateway, p: &Principal, kind: Kind, body: &Bytes) -> Result<Prepared, ApiError> {
    // A body the typed parse refuses takes the tree's path, for its errors.
    if body.len() <= gw.max_prompt_bytes {
        let checked = match kind {
            Kind::Chat => match ChatCompletionRequest::parse(body) {
                Ok(typed) if unchanged(p, &typed) => check_chat(gw, p, &typed)?,
                _ => return prepare_rewritten(gw, p, kind, body),
            },
            Kind::Completion => match CompletionRequest::parse(body) {
                Ok(typed) if !typed.has_client_scope() && typed.stream != Some(true) => {
                    check_completion(gw, p, &typed)?
                }
                _ => return prepare_rewritten(gw, p, kind, body),
            },
        };
        return Ok(checked.prepared(body.clone()));
    }
    prepare_rewritten(gw, p, kind, body)
}

/// Whether a chat request goes to the engine as sent: no client cache-scope field, not
/// streamed (the gateway sets `stream_options`), and no tenant system prompt to add.
fn unchanged(p: &Principal, typed: &ChatCompletionRequest) -> bool {
    let adds_system = p.tenant.system_prompt.is_some()
        && !typed
            .messages
            .iter()
            .any(|m| matches!(m.role.as_str(), "system" | "developer"));
    !adds_system && !typed.has_client_scope() && typed.stream != Some(true)
}

/// What a request was found to be: its stream flags, prompt hashes and answer's limit.
struct Checked {
    stream: bool,
    wants_usage: bool,
    hashes: PromptHashes,
    max_tokens: u32,
    samples: u32,
}

impl Checked {
    fn prepared(self, body: Bytes) -> Prepared {
        Prepared {
            body,
            hashes: self.hashes,
            max_tokens: self.max_tokens,
            samples: self.samples,
            stream: self.stream,
            wants_usage: self.wants_usage,
        }
    }
}

/// A chat request validated with the engine's rules, its model checked, its prompt hashed.
fn check_chat(
    gw: &Gateway,
    p: &Principal,
    typed: &ChatCompletionRequest,
) -> Result<Checked, ApiError> {
    let input = typed.validate(&Limits::default())?;
    let hashes = gw
        .hasher
        .chat(&p.tenant.scope(), &input.messages)
        .map_err(|e| ApiError::invalid_value("messages", e.to_string()))?;
    let (stream, usage) = (input.stream, input.include_usage);
    checked(gw, p, &typed.model, &input.params, hashes, stream, usage)
}

/// A completion request validated, its model checked, its prompt hashed.
fn check_completion(
    gw: &Gateway,
    p: &Principal,
    typed: &CompletionRequest,
) -> Result<Checked, ApiError> {
    let input = typed.validate(&Limits::default())?;
    let scope = p.tenant.scope();
    let hashes = match &input.prompt {
        PromptInput::Text(t) => gw
            .hasher
            .text(&scope, t)
            .map_err(|e| ApiError::invalid_value("prompt", e.to_string()))?,
        PromptInput::Tokens(t) => gw.hasher.tokens(&scope, t),
    };
    let (stream, usage) = (input.stream, input.include_usage);
    checked(gw, p, &typed.model, &input.params, hashes, stream, usage)
}

/// The checks both kinds share once the prompt is hashed: the engine's own length rule (before
/// the request is charged or forwarded) and the model.
fn checked(
    gw: &Gateway,
    p: &Principal,
    model: &str,
    params: &SamplingParams,
    hashes: PromptHashes,
    stream: bool,
    wants_usage: bool,
) -> Result<Checked, ApiError> {
    let max_tokens = params.max_tokens_for(hashes.prompt_tokens, gw.config.context_tokens())?;
    check_model(gw, p, model)?;
    Ok(Checked {
        stream,
        wants_usage,
        hashes,
        max_tokens,
        samples: params.n.max(1),
    })
}

fn check_model(gw: &Gateway, p: &Principal, model: &str) -> Result<(), ApiError> {
    if model != gw.config.model_id {
        return Err(ApiError::model_not_found(model));
    }
    if !p.tenant.allows_model(model) {
        return Err(ApiError::forbidden(format!(
            "This key may not use the model '{model}'."
        )));
    }
    Ok(())
}

/// [`prepare`] through a JSON tree: client scope fields removed, the tenant's system prompt
/// added, `stream_options` set, the text bounded before it is tokenized.
fn prepare_rewritten(
    gw: &Gateway,
    p: &Principal,
    kind: Kind,
    body: &[u8],
) -> Result<Prepared, ApiError> {
    let tenant = &p.tenant;
    let mut json: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| ApiError::from_json_error(&e))?;
    if !json.is_object() {
        return Err(body_not_an_object());
    }
    strip_client_scope(&mut json);
    let text = text_bytes(&json);
    if text > gw.max_prompt_bytes {
        return Err(ApiError::new(
            ErrorCode::ContextLengthExceeded,
            format!(
                "The request carries {text} bytes of text; the model's context of {} tokens \
                 holds at most {} bytes.",
                gw.config.context_tokens(),
                gw.max_prompt_bytes
            ),
        ));
    }
    let checked = match kind {
        Kind::Chat => {
            if let Some(system) = &tenant.system_prompt {
                inject_system_prompt(&mut json, system);
            }
            // Straight from the tree (no deep copy of the body): the same errors as an owned
            // `from_value`.
            let typed = ChatCompletionRequest::deserialize(&json)
                .map_err(|e| ApiError::from_json_error(&e))?;
            check_chat(gw, p, &typed)?
        }
        Kind::Completion => {
            let typed =
                CompletionRequest::deserialize(&json).map_err(|e| ApiError::from_json_error(&e))?;
            check_completion(gw, p, &typed)?
        }
    };
    if checked.stream {
        // Always ask the engine for the final usage: tokens/min is charged from it.
        json["stream_options"] = serde_json::json!({"include_usage": true});
    }
    let body = serde_json::to_vec(&json).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(checked.prepared(Bytes::from(body)))
}

/// Bytes of every string in a JSON document: an upper bound on its prompt text, without
/// tokenizing.
fn text_bytes(v: &serde_json::Value) -> usize {
    match v {
        serde_json::Value::String(s) => s.len(),
        serde_json::Value::Array(a) => a.iter().map(text_bytes).sum(),
        serde_json::Value::Object(o) => o.iter().map(|(k, v)| k.len() + text_bytes(v)).sum(),
        _ => 0,
    }
}

/// Puts the tenant's default system prompt first when the conversation has none.
fn inject_system_prompt(json: &mut serde_json::Value, system: &str) {
    let Some(messages) = json.get_mut("messages").and_then(|m| m.as_array_mut()) else {
        return;
    };
    let has_system = messages.iter().any(|m| {
        matches!(
            m.get("role").and_then(|r| r.as_str()),
            Some("system" | "developer")
        )
    });
    if !has_system {
        messages.insert(0, serde_json::json!({"role": "system", "content": system}));
    }
}

/// The prices a tenant pays for the model: its own, else the model's, else nothing.
fn prices(gw: &Gateway, p: &Principal) -> Prices {
    p.tenant
        .prices
        .or_else(|| gw.config.prices.get(&gw.config.model_id).copied())
        .unwrap_or(Prices {
            prompt: 0.0,
            cached_prompt: None,
            completion: 0.0,
        })
}

/// The monthly budgets of the tenant and of its key: a request that would start past either is
/// refused (429 `insufficient_quota`). Crossing 80% and 100% is logged and counted once per
/// process. When the store cannot say, requests go through (budgets fail open, as the rate
/// limits do) and the failure is counted.
async fn check_budgets(gw: &Gateway, p: &Principal) -> Result<(), ApiError> {
    let budgets = [("tenant", p.tenant.budget), ("key", p.key.budget)];
    if !gw.config.usage_ledger || budgets.iter().all(|(_, b)| b.is_none()) {
        return Ok(());
    }
    let now = crate::tenant::unix_now();
    let month = usage::month_of(now);
    let spent = gw.store.spent(&p.tenant.id, &month, p.key.lineage()).await;
    let (tenant_spent, key_spent) = match spent {
        Ok(s) => s,
        Err(e) => {
            gw.metrics.store_errors.fetch_add(1, Ordering::Relaxed);
            gw.metrics
                .budget_check_failures
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "budget check unavailable; admitting");
            return Ok(());
        }
    };
    for (level, budget) in budgets {
        let Some(budget) = budget else { continue };
        let (spent, label, whose) = if level == "tenant" {
            (
                tenant_spent,
                "tenant".to_owned(),
                format!("tenant '{}'", p.tenant.id),
            )
        } else {
            (
                key_spent,
                format!("key:{}", p.key_id),
                format!("key '{}'", p.key_id),
            )
        };
        if let Some(ratio) = budget.used(spent) {
            gw.budget_used(&p.tenant.id, &label, &month, ratio);
        }
        if let Some(what) = budget.exhausted(spent) {
            gw.metrics.budget_refused(&p.tenant.id);
            return Err(ApiError::budget_exceeded(format!(
                "The monthly budget of {whose} is used up ({what} this month); it renews on {}.",
                usage::next_month_start(now)
            )));
        }
    }
    Ok(())
}

/// The budgets, then the rate limits of the tenant and of its key: admits the request and
/// charges its prompt tokens, or refuses it. When the store cannot be reached, requests of
/// already authenticated tenants go through (limits fail open) and the failure is counted.
///
/// The key's limits are checked first; a request they admit and the tenant's then refuse
/// still counts against the key's (never against another tenant's).
async fn admit(
    gw: &Arc<Gateway>,
    p: &Principal,
    prompt_tokens: u64,
) -> Result<Option<Lease>, ApiError> {
    check_budgets(gw, p).await?;
    let unlimited = crate::tenant::RateLimits::default();
    let buckets: Vec<(String, crate::tenant::RateLimits)> = [
        (p.key.bucket(), p.key.rate_limits()),
        (p.tenant.id.clone(), p.tenant.rate_limits()),
    ]
    .into_iter()
    .filter(|(_, l)| *l != unlimited)
    .collect();
    if buckets.is_empty() {
        return Ok(None);
    }
    // Dropped unfinished (the client left, the deadline passed), it releases what was asked.
    let mut lease = Admitting::new(gw);
    for (bucket, limits) in buckets {
        let adm = Admission {
            tenant: &bucket,
            limits,
            lease: lease.ask(&bucket, limits),
            lease_ms: guard::LEASE.as_millis() as u64,
            tokens: prompt_tokens,
        };
        match gw.store.admit(adm).await {
            Ok(Ok(())) => {}
            Ok(Err(refusal)) => {
                // The buckets that admitted it get their slots back.
                lease.refused();
                drop(lease);
                gw.metrics.ratelimited(&p.tenant.id);
                let secs = refusal.retry_after_ms().div_ceil(1000).max(1);
                let whose = if bucket == p.tenant.id {
                    String::new()
                } else {
                    format!(" of key '{}'", p.key_id)
                };
                return Err(ApiError::rate_limited(
                    format!(
                        "Rate limit reached for {}{whose}: try again in {secs} s.",
                        refusal.what()
                    ),
                    secs,
                ));
            }
            Err(e) => {
                gw.metrics.store_errors.fetch_add(1, Ordering::Relaxed);
                // The store may have taken the lease before it failed: it stays asked, and
                // is released all the same.
                tracing::warn!(error = %e, "rate limiter unavailable; admitting");
            }
        }
    }
    Ok(Some(lease.admitted()))
}

/// Names the engine that answered (`x-kvgate-engine`), for operators and tests.
fn with_engine(mut r: Response<RespBody>, engine: &Engine) -> Response<RespBody> {
    if let Ok(v) = HeaderValue::from_str(&engine.name) {
        r.headers_mut().insert("x-kvgate-engine", v);
    }
    r
}

/// Where and how a prepared request goes.
struct Upstream<'a> {
    gw: &'a Arc<Gateway>,
    p: &'a Principal,
    request_id: &'a Arc<str>,
    kind: Kind,
    /// The request's deadline for its answer to start.
    deadline: tokio::time::Instant,
    trace: Option<&'a Arc<Trace>>,
}

impl Upstream<'_> {
    /// What the engine is sent: the rewritten body and the tenant's identity headers.
    fn forward_spec(&self, prepared: &Prepared) -> Forward {
        let tenant = &self.p.tenant;
        let header = |name: &'static str, v: String| {
            HeaderValue::from_str(&v)
                .ok()
                .map(|v| (HeaderName::from_static(name), v))
        };
        let headers = [
            header("x-kvgate-tenant", tenant.id.clone()),
            header("x-kvgate-scope", tenant.scope()),
            header("x-kvgate-priority", tenant.priority.max(1).to_string()),
            tenant
                .kv_block_quota
                .and_then(|q| header("x-kvgate-kv-quota", q.to_string())),
            header("x-request-id", self.request_id.to_string()),
        ]
        .into_iter()
        .flatten()
        .collect();
        Forward {
            path: match self.kind {
                Kind::Chat => "/v1/chat/completions",
                Kind::Completion => "/v1/completions",
            },
            body: prepared.body.clone(),
            headers,
            engine_token: self.gw.engine_token.clone(),
            stream: prepared.stream,
            client_wants_usage: prepared.wants_usage,
            stream_idle: Duration::from_secs(self.gw.config.first_byte_timeout_secs),
        }
    }
}

/// Routes and proxies, trying up to [`MAX_ATTEMPTS`] engines while nothing has reached the
/// client and the deadline allows.
async fn forward(
    to: Upstream<'_>,
    prepared: Prepared,
    mut lease: Option<Lease>,
    outcome: &mut Outcome,
) -> Result<Response<RespBody>, ApiError> {
    let gw = to.gw;
    let fwd = to.forward_spec(&prepared);
    let per_attempt = Duration::from_secs(gw.config.first_byte_timeout_secs);
    let block = gw.config.block_size as usize;
    let mut exclude = 0u64;
    let mut last_error = None;
    for attempt in 1..=MAX_ATTEMPTS {
        let left = to
            .deadline
            .saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            break;
        }
        let now = now_ms();
        let routing = Instant::now();
        let req = RouteRequest::new(
            &prepared.hashes.hashes,
            prepared.hashes.prompt_tokens,
            &to.p.tenant.id,
            &gw.router.config(),
        );
        let (candidates, engines) = gw.registry.candidates(&req, exclude, now);
        let Some(choice) = gw.router.choose(
            prepared.hashes.affinity,
            prepared.hashes.prompt_tokens,
            prepared.max_tokens,
            &candidates,
        ) else {
            break;
        };
        let Some(engine) = engines.into_iter().find(|e| e.slot == choice.slot) else {
            break;
        };
        if let Some(t) = to.trace {
            t.record(
                "gateway.route",
                SpanKind::Internal,
                routing,
                Instant::now(),
                vec![
                    Attr::new("kvgate.route.decision", choice.reason.as_str()),
                    Attr::new(
                        "kvgate.route.matched_blocks",
                        i64::from(choice.matched_blocks),
                    ),
                    Attr::new("kvgate.route.candidates", candidates.len() as i64),
                    Attr::new("kvgate.engine", engine.name.clone()),
                    Attr::new("kvgate.attempt", attempt as i64),
                ],
            );
        }
        gw.metrics.route_decision(choice.reason.as_str());
        gw.metrics
            .routed_prefix_blocks
            .observe(f64::from(choice.matched_blocks));
        tracing::Span::current().record("engine", engine.name.as_str());
        let prefill = prepared
            .hashes
            .prompt_tokens
            .saturating_sub(choice.matched_blocks as usize * block) as u64;
        // Another engine holds more of the prefix (the chosen one is less busy, or that one is
        // draining) and sending it costs less than computing it, or one is computing it and
        // will be done within the chosen engine's fetch limit: the chosen engine is told where
        // to fetch it from.
        let chosen = candidates.iter().find(|c| c.slot == choice.slot);
        let peer = chosen
            .and_then(|c| {
                let block = gw.config.block_size;
                let hashes = &prepared.hashes.hashes;
                (gw.registry).peer_for(hashes, &candidates, c, exclude, block, now)
            })
            .and_then(|(engine, p)| Some((HeaderValue::from_str(&engine.url).ok()?, engine, p)));
        // The prompt counts as being computed there until the request ends, unless the engine
        // is to fetch it (until its fetch ends, it computes none of it).
        let ready_ms = chosen.map_or(u64::MAX, |c| c.ready_ms(prefill, now));
        let routed = peer.is_none().then(|| {
            gw.registry
                .route(engine.slot, &prepared.hashes.hashes, ready_ms)
        });
        let mut load = EngineLoad::enter(&engine, prefill, routed);
        // A stream's first event is due within the first-byte time. A whole answer's first
        // byte is its end: it may take the request's whole time, and is given up as a hang
        // only when the engine itself stops stepping ([`stalled`]), so a long answer is
        // neither counted against the engine nor retried elsewhere.
        let budget = if prepared.stream {
            per_attempt.min(left)
        } else {
            left
        };
        // Every decision and what it was made from (no prompt text), for tracing a route.
        {
            let peer = (peer.as_ref()).map(|(_, e, p)| (e.name.as_str(), p.blocks, p.computing));
            let reason = choice.reason;
            tracing::debug!(tenant = req.tenant, ?reason, engine = %engine.name, ?peer, ?candidates, "routed");
        }
        let mut extra = Vec::new();
        if let Some((url, peer, p)) = peer {
            gw.metrics.peer_hint(&peer.name);
            extra.extend(p.headers(url));
        }
        let mut span = to.trace.map(|t| upstream_span(t, &engine, attempt));
        if let Some(v) = span
            .as_ref()
            .and_then(|s| HeaderValue::from_str(&s.traceparent()).ok())
        {
            extra.push((HeaderName::from_static(TRACEPARENT), v));
        }
        let with_extra;
        let fwd_here = if extra.is_empty() {
            &fwd
        } else {
            let mut f = fwd.clone();
            f.headers.extend(extra);
            with_extra = f;
            &with_extra
        };
        let client = crate::upstream::local_client();
        let attempt = proxy::attempt(&client, &engine, fwd_here, budget);
        let mut hung = false;
        let result = if prepared.stream {
            attempt.await
        } else {
            tokio::select! {
                r = attempt => r,
                () = stalled(&engine, per_attempt) => {
                    hung = true;
                    proxy::Outcome::TimedOut
                }
            }
        };
        load.started();
        match result {
            proxy::Outcome::Whole {
                status,
                headers,
                body,
                usage,
            } => {
                engine.record_success();
                if let (Some(l), Some(u)) = (lease.as_mut(), usage) {
                    l.charge(
                        u.completion
                            + u.prompt
                                .saturating_sub(prepared.hashes.prompt_tokens as u64),
                    );
                }
                if let Some(b) = outcome.billed.as_mut() {
                    b.engine = Some(engine.name.clone());
                    b.first_token = Some(Instant::now());
                    if let Some(u) = usage {
                        b.prompt_tokens = u.prompt;
                        b.cached_tokens = u.cached;
                        b.completion_tokens = u.completion;
                    }
                    b.finish_reason = proxy::finish_reason(&body).map(str::to_owned);
                }
                outcome.status = Some(status.as_u16());
                if let Some(s) = span.as_mut() {
                    s.set(Attr::new(
                        "http.response.status_code",
                        i64::from(status.as_u16()),
                    ));
                }
                drop(span);
                // Back before the answer goes out: the tenant's next request finds its slot.
                if let Some(l) = lease.take() {
                    l.release().await;
                }
                return Ok(with_engine(
                    proxy::whole_response(status, headers, body),
                    &engine,
                ));
            }
            proxy::Outcome::Stream {
                status,
                headers,
                mut relay,
            } => {
                engine.record_success();
                outcome.status = Some(status.as_u16());
                if let Some(b) = outcome.billed.as_mut() {
                    b.engine = Some(engine.name.clone());
                }
                if let Some(s) = span.as_mut() {
                    s.set(Attr::new(
                        "http.response.status_code",
                        i64::from(status.as_u16()),
                    ));
                }
                let held = Held {
                    load,
                    lease: lease.take(),
                    outcome: outcome.take(),
                    prompt_charged: prepared.hashes.prompt_tokens as u64,
                    span,
                };
                relay.on_end(Box::new(move |served, end| held.settle(served, end)));
                return Ok(with_engine(
                    proxy::stream_response(status, headers, relay),
                    &engine,
                ));
            }
            proxy::Outcome::Retry { why, failure } => {
                if failure {
                    engine.record_failure(now_ms());
                }
                tracing::warn!(engine = %engine.name, %why, "engine attempt failed; retrying elsewhere");
                if let Some(s) = span.as_mut() {
                    s.fail(why.to_string());
                }
                last_error = Some(why);
            }
            proxy::Outcome::TooLarge => {
                engine.record_success();
                // Charged and billed as if every answer ran to its end: it ran far enough to
                // pass the cap.
                let generated = u64::from(prepared.max_tokens) * u64::from(prepared.samples);
                if let Some(l) = lease.as_mut() {
                    l.charge(generated);
                }
                if let Some(b) = outcome.billed.as_mut() {
                    b.engine = Some(engine.name.clone());
                    b.completion_tokens = generated;
                }
                if let Some(l) = lease.take() {
                    l.release().await;
                }
                return Err(ApiError::invalid_value(
                    "stream",
                    format!(
                        "the answer is larger than the {} MiB relayed whole: stream it (\"stream\": true) or ask for fewer tokens",
                        proxy::MAX_WHOLE >> 20
                    ),
                ));
            }
            proxy::Outcome::TimedOut => {
                // A hang counts against the engine only when it had its whole time (a whole
                // answer's time ran out with the request's: no fault of the engine's).
                if hung || prepared.stream && budget == per_attempt {
                    engine.record_failure(now_ms());
                }
                tracing::warn!(engine = %engine.name, secs = budget.as_secs_f64(), "no first byte in time; retrying elsewhere");
                if let Some(s) = span.as_mut() {
                    s.fail("timed out before the first byte");
                }
                last_error = Some("timed out before the first byte".into());
            }
        }
        exclude |= 1 << engine.slot;
    }
    if let Some(why) = last_error {
        tracing::warn!(%why, "no engine could serve the request");
    }
    if let Some(l) = lease.take() {
        l.release().await;
    }
    if tokio::time::Instant::now() >= to.deadline {
        return Err(ApiError::timeout());
    }
    Err(ApiError::no_healthy_engine())
}

/// Resolves once `limit` has passed and the engine has not stepped for `limit`: the figures of
/// its last report are older than that (the engine's thread has not finished a step since), or
/// no report has come for that long beyond two health-check intervals, or it has none. That is
/// a hang; a whole answer that is merely long finds its engine stepping.
async fn stalled(engine: &Engine, limit: Duration) {
    tokio::time::sleep(limit).await;
    let checks = 2.0 * crate::upstream::health::INTERVAL.as_secs_f64();
    loop {
        let (report, seen) = engine.report();
        let quiet = seen.map_or(f64::INFINITY, |s| (s - checks).max(0.0) + report.age_secs);
        if quiet > limit.as_secs_f64() {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// What a streamed answer holds until it ends.
struct Held {
    load: EngineLoad,
    lease: Option<Lease>,
    outcome: Outcome,
    prompt_charged: u64,
    /// The attempt's span, which ends with the stream.
    span: Option<Span>,
}

/// One attempt at an engine, a client span whose id the engine is given as its parent.
fn upstream_span(trace: &Arc<Trace>, engine: &Engine, attempt: usize) -> Span {
    let mut span = trace.span("gateway.upstream", SpanKind::Client);
    span.set(Attr::new("kvgate.engine", engine.name.clone()));
    span.set(Attr::new("kvgate.attempt", attempt as i64));
    span
}

impl Held {
    /// The stream is over: charge what it served, tell the breaker about a broken stream, and
    /// release everything (by dropping it).
    fn settle(mut self, served: proxy::Served, end: StreamEnd) {
        if end == StreamEnd::Broken {
            self.load.engine().record_failure(now_ms());
        }
        if end == StreamEnd::ClientGone {
            self.outcome.status = Some(guard::CLIENT_CLOSED);
        }
        if let Some(s) = self.span.as_mut() {
            let how = match end {
                StreamEnd::Clean => "clean",
                StreamEnd::Broken => "broken",
                StreamEnd::ClientGone => "client_gone",
                StreamEnd::Oversized => "oversized",
            };
            s.set(Attr::new("kvgate.stream_end", how));
            if end == StreamEnd::Broken {
                s.fail("the engine broke off the stream");
            }
        }
        if let Some(b) = self.outcome.billed.as_mut() {
            // What was served: the engine's final usage when it got that far, else the prompt
            // as counted here and the tokens relayed.
            match served.usage {
                Some(u) => {
                    b.prompt_tokens = u.prompt;
                    b.cached_tokens = u.cached;
                }
                None => b.prompt_tokens = self.prompt_charged,
            }
            // Billed as the engine counted when it reported (the relayed chunks include the
            // last one, which carries only the finish reason), else the chunks relayed.
            b.completion_tokens = served.usage.map_or(served.chunks, |u| u.completion);
            b.finish_reason = served.finish_reason.map(str::to_owned);
            b.first_token = served.first_chunk;
            b.broken = end == StreamEnd::Broken;
        }
        if let Some(l) = self.lease.as_mut() {
            let prompt_extra = served
                .usage
                .map_or(0, |u| u.prompt.saturating_sub(self.prompt_charged));
            l.charge(served.completion() + prompt_extra);
        }
    }
}
