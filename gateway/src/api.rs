//! The tenants' endpoints behind the tower stack: `/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`, `/health`. A generation request is validated (the engine's own rules, so bad
//! input fails here with the same error), rewritten (the client's cache scope removed, the
//! tenant's default system prompt added), admitted by the tenant's rate limits, hashed, routed
//! and proxied, with a retry on another engine while nothing has reached the client.

use crate::auth::Principal;
use crate::routing::prefix::PromptHashes;
use crate::server::Gateway;
use crate::service::{BodyLimit, RequestId};
use crate::store::Admission;
use crate::upstream::proxy::{self, Forward, Outcome, StreamEnd};
use crate::upstream::{now_ms, Engine};
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use kvgate_http::{error_response, json_response, ok_json, RespBody};
use kvgate_protocol::openai::{
    strip_client_scope, ApiError, ChatCompletionRequest, CompletionRequest, Limits, ModelCard,
    ModelList, PromptInput,
};
use serde::Deserialize;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    stream: bool,
    wants_usage: bool,
}

async fn generate(gw: Arc<Gateway>, req: Request<Incoming>, kind: Kind) -> Response<RespBody> {
    let start = Instant::now();
    let Some(p) = principal(&req) else {
        return error_response(&ApiError::unauthorized("Missing API key."));
    };
    let tenant_id = p.tenant.id.clone();
    let request_id = req
        .extensions()
        .get::<RequestId>()
        .map_or_else(|| Arc::from("req"), |r| r.0.clone());
    let limit = req
        .extensions()
        .get::<BodyLimit>()
        .map_or(gw.config.max_body_bytes, |l| l.0);
    let result = async {
        let body = kvgate_http::read_body(req, limit).await?;
        let prepared = prepare(&gw, &p, kind, &body)?;
        admit(&gw, &p, &request_id).await?;
        Ok::<_, ApiError>(prepared)
    }
    .await;
    let prepared = match result {
        Ok(x) => x,
        Err(e) => {
            gw.metrics.request(&tenant_id, e.status);
            return error_response(&e);
        }
    };
    let resp = forward(&gw, &p, &request_id, kind, prepared, start).await;
    resp.unwrap_or_else(|e| {
        gw.metrics.request(&tenant_id, e.status);
        error_response(&e)
    })
}

/// Validates with the engine's rules and rewrites the body for the engine.
fn prepare(gw: &Gateway, p: &Principal, kind: Kind, body: &[u8]) -> Result<Prepared, ApiError> {
    let tenant = &p.tenant;
    let mut json: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| ApiError::from_json_error(&e))?;
    if !json.is_object() {
        return Err(ApiError::invalid_value(
            "body",
            "The request body must be a JSON object.",
        ));
    }
    strip_client_scope(&mut json);
    let limits = Limits::default();
    let scope = tenant.scope();
    let (model, stream, wants_usage, hashes) = match kind {
        Kind::Chat => {
            if let Some(system) = &tenant.system_prompt {
                inject_system_prompt(&mut json, system);
            }
            // Straight from the tree (no deep copy of the body): the same errors as an owned
            // `from_value`.
            let typed = ChatCompletionRequest::deserialize(&json)
                .map_err(|e| ApiError::from_json_error(&e))?;
            let input = typed.validate(&limits)?;
            let hashes = gw
                .hasher
                .chat(&scope, &input.messages)
                .map_err(|e| ApiError::invalid_value("messages", e.to_string()))?;
            (typed.model, input.stream, input.include_usage, hashes)
        }
        Kind::Completion => {
            let typed = CompletionRequest::parse(body)?;
            let input = typed.validate(&limits)?;
            let hashes = match &input.prompt {
                PromptInput::Text(t) => gw
                    .hasher
                    .text(&scope, t)
                    .map_err(|e| ApiError::invalid_value("prompt", e.to_string()))?,
                PromptInput::Tokens(t) => gw.hasher.tokens(&scope, t),
            };
            (typed.model, input.stream, input.include_usage, hashes)
        }
    };
    if model != gw.config.model_id {
        return Err(ApiError::model_not_found(&model));
    }
    if !tenant.allows_model(&model) {
        return Err(ApiError::forbidden(format!(
            "This key may not use the model '{model}'."
        )));
    }
    if stream {
        // Always ask the engine for the final usage: tokens/min is charged from it.
        json["stream_options"] = serde_json::json!({"include_usage": true});
    }
    let body = serde_json::to_vec(&json).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(Prepared {
        body: Bytes::from(body),
        hashes,
        stream,
        wants_usage,
    })
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

/// The tenant's rate limits. When the store cannot be reached, requests of already
/// authenticated tenants go through (limits fail open) and the failure is counted.
async fn admit(gw: &Gateway, p: &Principal, request_id: &str) -> Result<(), ApiError> {
    let limits = p.tenant.rate_limits();
    if limits == Default::default() {
        return Ok(());
    }
    let adm = Admission {
        tenant: &p.tenant.id,
        limits,
        request_id,
        lease_ms: gw.config.request_timeout_secs * 1000,
    };
    match gw.store.admit(adm).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(refusal)) => {
            gw.metrics.ratelimited(&p.tenant.id);
            let secs = refusal.retry_after_ms().div_ceil(1000).max(1);
            Err(ApiError::rate_limited(
                format!(
                    "Rate limit reached for {}: try again in {secs} s.",
                    refusal.what()
                ),
                secs,
            ))
        }
        Err(e) => {
            gw.metrics.store_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "rate limiter unavailable; admitting");
            Ok(())
        }
    }
}

/// Names the engine that answered (`x-kvgate-engine`), for operators and tests.
fn with_engine(mut r: Response<RespBody>, engine: &Engine) -> Response<RespBody> {
    if let Ok(v) = HeaderValue::from_str(&engine.name) {
        r.headers_mut().insert("x-kvgate-engine", v);
    }
    r
}

/// Settles a request once: engine counters, rate-limit release, metrics.
struct Settle {
    gw: Arc<Gateway>,
    engine: Arc<Engine>,
    tenant: Arc<crate::tenant::Tenant>,
    request_id: Arc<str>,
    start: Instant,
    status: u16,
}

impl Settle {
    fn finish(self, tokens: u64) {
        self.engine.inflight.fetch_sub(1, Ordering::SeqCst);
        let m = &self.gw.metrics;
        m.request(&self.tenant.id, self.status);
        m.request_duration
            .observe(self.start.elapsed().as_secs_f64());
        let limits = self.tenant.rate_limits();
        if limits != Default::default() {
            let gw = self.gw.clone();
            let tenant = self.tenant.id.clone();
            let id = self.request_id.clone();
            tokio::spawn(async move {
                if let Err(e) = gw.store.release(&tenant, limits, &id, tokens).await {
                    gw.metrics.store_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, "rate-limit release failed");
                }
            });
        }
    }
}

async fn forward(
    gw: &Arc<Gateway>,
    p: &Principal,
    request_id: &Arc<str>,
    kind: Kind,
    prepared: Prepared,
    start: Instant,
) -> Result<Response<RespBody>, ApiError> {
    let tenant = &p.tenant;
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
        header("x-request-id", request_id.to_string()),
    ]
    .into_iter()
    .flatten()
    .collect();
    let fwd = Forward {
        path: match kind {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completion => "/v1/completions",
        },
        body: prepared.body,
        headers,
        engine_token: gw.engine_token.clone(),
        stream: prepared.stream,
        client_wants_usage: prepared.wants_usage,
    };
    let timeout = Duration::from_secs(gw.config.request_timeout_secs);
    let block = gw.config.block_size as usize;
    let mut exclude = 0u64;
    let mut last_error = None;
    for _ in 0..MAX_ATTEMPTS {
        let now = now_ms();
        let (candidates, engines) = gw.registry.candidates(
            &prepared.hashes.hashes,
            exclude,
            gw.config.routing.kv_weight,
            now,
        );
        let Some(choice) = gw.router.choose(prepared.hashes.affinity, &candidates) else {
            break;
        };
        let Some(engine) = engines.into_iter().find(|e| e.slot == choice.slot) else {
            break;
        };
        gw.metrics.route_decision(choice.reason.as_str());
        gw.metrics
            .routed_prefix_blocks
            .observe(f64::from(choice.matched_blocks));
        tracing::Span::current().record("engine", engine.name.as_str());
        let prefill = prepared
            .hashes
            .prompt_tokens
            .saturating_sub(choice.matched_blocks as usize * block) as u64;
        engine.inflight.fetch_add(1, Ordering::SeqCst);
        engine.queued_prefill.fetch_add(prefill, Ordering::Relaxed);
        let outcome = proxy::attempt(&gw.client, &engine, &fwd, timeout).await;
        engine.queued_prefill.fetch_sub(prefill, Ordering::Relaxed);
        let settle = |status: StatusCode| Settle {
            gw: gw.clone(),
            engine: engine.clone(),
            tenant: tenant.clone(),
            request_id: request_id.clone(),
            start,
            status: status.as_u16(),
        };
        match outcome {
            Outcome::Whole {
                status,
                headers,
                body,
                tokens,
            } => {
                engine.record_success();
                settle(status).finish(tokens);
                return Ok(with_engine(
                    proxy::whole_response(status, headers, body),
                    &engine,
                ));
            }
            Outcome::Stream {
                status,
                headers,
                mut relay,
            } => {
                engine.record_success();
                let settle = settle(status);
                relay.on_end(Box::new(move |tokens, end| {
                    if end == StreamEnd::Broken {
                        settle.engine.record_failure(now_ms());
                    }
                    settle.finish(tokens);
                }));
                return Ok(with_engine(
                    proxy::stream_response(status, headers, relay),
                    &engine,
                ));
            }
            Outcome::Retry { why, failure } => {
                engine.inflight.fetch_sub(1, Ordering::SeqCst);
                if failure {
                    engine.record_failure(now_ms());
                }
                tracing::warn!(engine = %engine.name, %why, "engine attempt failed; retrying elsewhere");
                exclude |= 1 << engine.slot;
                last_error = Some(why);
            }
        }
    }
    if let Some(why) = last_error {
        tracing::warn!(%why, "no engine could serve the request");
    }
    // Nothing was charged for tokens; free the concurrency slot.
    let limits = tenant.rate_limits();
    if limits != Default::default() {
        if let Err(e) = gw.store.release(&tenant.id, limits, request_id, 0).await {
            tracing::warn!(error = %e, "rate-limit release failed");
        }
    }
    Err(ApiError::no_healthy_engine())
}
