//! The admin API, on its own listener. Everything under `/admin/` needs an operator token;
//! `/metrics` and `/health` are open (the admin listener is not exposed to tenants).
//!
//! - `GET|POST /admin/tenants`, `GET|PATCH|DELETE /admin/tenants/{id}`
//! - `GET|POST /admin/tenants/{id}/keys`, `PATCH|DELETE /admin/tenants/{id}/keys/{key_id}`
//!   (update, revoke), `POST /admin/tenants/{id}/keys/{key_id}/rotate` (a successor; the old
//!   key works for `grace_secs` more)
//! - `GET|POST /admin/engines`, `DELETE /admin/engines/{name}`,
//!   `POST /admin/engines/{name}/drain[?wait=SECS]`, `POST /admin/engines/{name}/undrain`
//! - `POST /admin/cache/flush` with `{"engine": name?, "tenant": id?}`
//! - `GET /admin/usage?tenant=&since=&until=&group_by=day|key|model` (the aggregates) and
//!   `GET /admin/usage/records?tenant=&since_ms=&until_ms=&limit=` (the ledger's records)
//! - `GET /admin/audit?since_ms=&until_ms=&limit=`
//! - `GET|POST /admin/tokens`, `DELETE /admin/tokens/{name}`: named operator tokens
//!
//! Operator tokens: the bootstrap token (`operator_token` in the config, or
//! `KVGATE_OPERATOR_TOKEN`) is an `admin`; named tokens (`kvo_...`, stored hashed like API keys)
//! have a role: `admin` (everything), `operator` (reads, drain, undrain, cache flush) or `viewer`
//! (reads). Without a bootstrap token the admin API is off. Every write, and every refusal of
//! a known token, goes to the audit log ([`crate::audit`]).

use crate::audit::{self, AuditEntry, AuditQuery, AUDIT_READ_MAX};
use crate::auth::{Caller, OPERATOR_TOKENS_CHANGED};
use crate::state::Gateway;
use crate::store::{RecordQuery, StoreError, RECORDS_READ_MAX};
use crate::tenant::{
    generate_operator_token, unix_now, valid_id, KeyRecord, KeySpec, OperatorToken, Role, Tenant,
};
use crate::upstream::{now_ms, Engine};
use crate::usage;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{header, Method, Request, Response, StatusCode};
use kvgate_http::{bearer_token, error_response, json_response, ok_json, read_body, RespBody};
use kvgate_protocol::openai::{ApiError, ErrorCode};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// The longest grace a rotated key may keep working.
const MAX_GRACE_SECS: u64 = 90 * 86_400;
/// The longest span one usage query may cover.
const MAX_USAGE_DAYS: i64 = 400;

/// Whether `role` may call `method` on `/admin/{parts}`.
pub fn permits(role: Role, method: &Method, parts: &[&str]) -> bool {
    match role {
        Role::Admin => true,
        Role::Viewer => method == Method::GET,
        Role::Operator => {
            method == Method::GET
                || (method == Method::POST
                    && matches!(
                        parts,
                        ["engines", _, "drain" | "undrain"] | ["cache", "flush"]
                    ))
        }
    }
}

/// What an admin write did, for its audit entry: handlers name the target they created.
#[derive(Debug, Default)]
struct Note {
    target: Option<String>,
}

pub async fn route(gw: Arc<Gateway>, req: Request<Incoming>) -> Response<RespBody> {
    let path = req.uri().path().to_owned();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/metrics") => {
            refresh_engine_gauges(&gw);
            let mut text = gw.metrics.render();
            gw.tracer.render_metrics("kvgate_gateway", &mut text);
            return kvgate_http::text_response("text/plain; version=0.0.4; charset=utf-8", text);
        }
        (&Method::GET, "/health") => {
            return json_response(StatusCode::OK, "{\"status\":\"ok\"}".into())
        }
        _ => {}
    }
    let caller = match gw.operators.authenticate(bearer_token(&req)).await {
        Ok(c) => c,
        Err(e) => return error_response(&e),
    };
    let method = req.method().clone();
    // A key or a token pasted where an id belongs never reaches a handler, a log or the
    // audit log.
    if path.split('/').any(audit::looks_secret) {
        return error_response(&ApiError::invalid_value(
            "path",
            "Paths name tenants, keys and tokens by id or name, never by the key or token itself.",
        ));
    }
    let parts: Vec<String> = path
        .trim_end_matches('/')
        .split('/')
        .skip(2)
        .take(8)
        .map(audit::bounded)
        .collect();
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    let (action, target) = audit::describe(method.as_str(), &parts);
    if !permits(caller.role, &method, &parts) {
        let e = ApiError::forbidden(format!(
            "The operator token '{}' ({}) may not {action}.",
            caller.name,
            caller.role.as_str()
        ));
        // Refusals are audited up to a rate per token, so a token that may not write cannot
        // push the history out of the log's bounded stream by being refused.
        if gw.operators.audit_refusal(&caller.name) {
            record_audit(
                &gw,
                &caller,
                action,
                target,
                e.status,
                Some(e.message.clone()),
            )
            .await;
        }
        return error_response(&e);
    }
    // The action and its audit entry run to the end even when the caller hangs up midway (and
    // a graceful stop waits for them).
    let running = crate::state::InFlight::start(&gw.admin_actions);
    let task = tokio::spawn(async move {
        let _running = running;
        let mut note = Note::default();
        let result = admin(gw.clone(), req, &path, &mut note).await;
        if method != Method::GET {
            let (status, error) = match &result {
                Ok(r) => (r.status().as_u16(), None),
                Err(e) => (e.status, Some(e.message.clone())),
            };
            let target = note.target.unwrap_or(target);
            record_audit(&gw, &caller, action, target, status, error).await;
        }
        result.unwrap_or_else(|e| error_response(&e))
    });
    task.await.unwrap_or_else(|e| {
        error_response(&ApiError::internal(format!("the admin action failed: {e}")))
    })
}

/// Appends to the audit log; a store that cannot take it is logged and counted (the action has
/// already happened, or failed on its own).
async fn record_audit(
    gw: &Gateway,
    caller: &Caller,
    action: String,
    target: String,
    status: u16,
    error: Option<String>,
) {
    let entry = AuditEntry {
        at_ms: now_ms(),
        actor: caller.name.clone(),
        role: caller.role,
        action,
        target,
        status,
        error,
    };
    if let Err(e) = gw.store.append_audit(&entry).await {
        gw.metrics.store_errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %e, action = %entry.action, "audit entry not written");
    }
}

fn refresh_engine_gauges(gw: &Gateway) {
    let m = &gw.metrics;
    m.ledger_pending
        .store(gw.ledger.pending() as u64, Ordering::Relaxed);
    m.ledger_written
        .store(gw.ledger.written.load(Ordering::Relaxed), Ordering::Relaxed);
    m.ledger_dropped
        .store(gw.ledger.dropped.load(Ordering::Relaxed), Ordering::Relaxed);
    for e in gw.registry.all() {
        gw.metrics.engine(
            &e.name,
            e.up.load(Ordering::SeqCst),
            e.inflight.load(Ordering::SeqCst),
            e.is_draining(),
        );
    }
}

fn store_err(e: StoreError) -> ApiError {
    ApiError::unavailable(format!("store: {e}"))
}

async fn body_json(req: Request<Incoming>) -> Result<Value, ApiError> {
    let body = read_body(req, 1 << 20).await?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    serde_json::from_slice(&body).map_err(|e| ApiError::from_json_error(&e))
}

fn created<T: serde::Serialize>(v: &T) -> Response<RespBody> {
    let mut r = ok_json(v);
    *r.status_mut() = StatusCode::CREATED;
    r
}

async fn admin(
    gw: Arc<Gateway>,
    req: Request<Incoming>,
    path: &str,
    note: &mut Note,
) -> Result<Response<RespBody>, ApiError> {
    let method = req.method().clone();
    let query = req.uri().query().unwrap_or("").to_owned();
    let parts: Vec<&str> = path.trim_end_matches('/').split('/').skip(2).collect();
    match (method.clone(), parts.as_slice()) {
        (Method::GET, ["tenants"]) => {
            let tenants = gw.store.list_tenants().await.map_err(store_err)?;
            Ok(ok_json(&json!({ "tenants": tenants })))
        }
        (Method::POST, ["tenants"]) => create_tenant(&gw, body_json(req).await?, note).await,
        (Method::GET, ["tenants", id]) => Ok(ok_json(&get_tenant(&gw, id).await?)),
        (Method::PATCH | Method::PUT, ["tenants", id]) => {
            update_tenant(&gw, id, body_json(req).await?).await
        }
        (Method::DELETE, ["tenants", id]) => {
            let existed = gw.store.delete_tenant(id).await.map_err(store_err)?;
            tenant_changed(&gw, id).await;
            if !existed {
                return Err(no_such("tenant", id));
            }
            Ok(ok_json(&json!({ "deleted": id })))
        }
        (Method::POST, ["tenants", id, "keys"]) => {
            issue_key(&gw, id, body_json(req).await?, note).await
        }
        (Method::PATCH, ["tenants", id, "keys", key_id]) => {
            update_key(&gw, id, key_id, body_json(req).await?).await
        }
        (Method::POST, ["tenants", id, "keys", key_id, "rotate"]) => {
            rotate_key(&gw, id, key_id, body_json(req).await?).await
        }
        (Method::GET, ["tenants", id, "keys"]) => {
            get_tenant(&gw, id).await?;
            let keys = gw.store.list_keys(id).await.map_err(store_err)?;
            let keys: Vec<Value> = keys.iter().map(key_view).collect();
            Ok(ok_json(&json!({ "keys": keys })))
        }
        (Method::DELETE, ["tenants", id, "keys", key_id]) => {
            let revoked = gw.store.revoke_key(id, key_id).await.map_err(store_err)?;
            tenant_changed(&gw, id).await;
            if !revoked {
                return Err(no_such("key", key_id));
            }
            Ok(ok_json(&json!({ "revoked": key_id })))
        }
        (Method::GET, ["engines"]) => {
            let engines: Vec<Value> = gw
                .registry
                .all()
                .iter()
                .map(|e| engine_view(&gw, e))
                .collect();
            Ok(ok_json(&json!({ "engines": engines })))
        }
        (Method::POST, ["engines"]) => {
            #[derive(Deserialize)]
            struct Add {
                name: String,
                url: String,
            }
            let add: Add = serde_json::from_value(body_json(req).await?)
                .map_err(|e| ApiError::from_json_error(&e))?;
            note.target = Some(format!("engine:{}", audit::bounded(&add.name)));
            let e = gw
                .add_engine(&add.name, &add.url)
                .await
                .map_err(|e| ApiError::invalid_value("engine", e))?;
            Ok(created(&engine_view(&gw, &e)))
        }
        (Method::DELETE, ["engines", name]) => {
            if !gw.remove_engine(name).await.map_err(store_err)? {
                return Err(no_such("engine", name));
            }
            Ok(ok_json(&json!({ "removed": name })))
        }
        (Method::POST, ["engines", name, "drain"]) => {
            let engine = gw
                .registry
                .get(name)
                .ok_or_else(|| no_such("engine", name))?;
            drain(&gw, &engine, wait_secs(&query)).await
        }
        (Method::POST, ["engines", name, "undrain"]) => {
            let engine = gw
                .registry
                .get(name)
                .ok_or_else(|| no_such("engine", name))?;
            engine.draining.store(false, Ordering::SeqCst);
            let upstream = engine_admin(&gw, &engine, "/admin/undrain", None).await;
            if upstream.is_ok() {
                engine.engine_draining.store(false, Ordering::SeqCst);
            }
            Ok(ok_json(&engine_view(&gw, &engine)))
        }
        (Method::POST, ["cache", "flush"]) => flush(&gw, body_json(req).await?, note).await,
        (Method::GET, ["usage"]) => usage_report(&gw, &query).await,
        (Method::GET, ["usage", "records"]) => usage_records(&gw, &query).await,
        (Method::GET, ["audit"]) => {
            let q = AuditQuery {
                since_ms: query_u64(&query, "since_ms")?.unwrap_or(0),
                until_ms: query_u64(&query, "until_ms")?.unwrap_or(u64::MAX),
                limit: query_u64(&query, "limit")?.map_or(1000, |n| n as usize),
            };
            if q.limit > AUDIT_READ_MAX {
                return Err(ApiError::invalid_value(
                    "limit",
                    format!("At most {AUDIT_READ_MAX} entries per read."),
                ));
            }
            let entries = gw.store.audit(q).await.map_err(store_err)?;
            Ok(ok_json(&json!({ "entries": entries })))
        }
        (Method::GET, ["tokens"]) => {
            let tokens = gw.store.list_operator_tokens().await.map_err(store_err)?;
            let tokens: Vec<Value> = tokens.iter().map(token_view).collect();
            Ok(ok_json(&json!({ "tokens": tokens })))
        }
        (Method::POST, ["tokens"]) => issue_token(&gw, body_json(req).await?, note).await,
        (Method::DELETE, ["tokens", name]) => {
            let revoked = gw
                .store
                .revoke_operator_token(name)
                .await
                .map_err(store_err)?;
            operator_tokens_changed(&gw).await;
            if !revoked {
                return Err(no_such("operator token", name));
            }
            Ok(ok_json(&json!({ "revoked": name })))
        }
        _ => Err(ApiError::not_found(method.as_str(), path)),
    }
}

fn no_such(what: &str, id: &str) -> ApiError {
    ApiError::new(ErrorCode::NotFound, format!("No {what} named '{id}'."))
}

async fn get_tenant(gw: &Gateway, id: &str) -> Result<Tenant, ApiError> {
    gw.store
        .get_tenant(id)
        .await
        .map_err(store_err)?
        .ok_or_else(|| no_such("tenant", id))
}

fn check_tenant(t: &Tenant) -> Result<(), ApiError> {
    if !valid_id(&t.id) {
        return Err(ApiError::invalid_value(
            "id",
            "A tenant id is 1-64 characters of a-z, 0-9, '-' and '_'.",
        ));
    }
    if t.priority == 0 {
        return Err(ApiError::invalid_value(
            "priority",
            "priority must be at least 1.",
        ));
    }
    if let Some(s) = &t.cache_scope {
        if !valid_id(s) {
            return Err(ApiError::invalid_value(
                "cache_scope",
                "A scope name is 1-64 characters of a-z, 0-9, '-' and '_'.",
            ));
        }
    }
    if let Some(f) = t.prices.as_ref().and_then(usage::Prices::invalid_field) {
        return Err(ApiError::invalid_value(
            format!("prices.{f}"),
            "A price is a finite number >= 0, in USD per million tokens.",
        ));
    }
    if let Some(f) = t.budget.as_ref().and_then(usage::Budget::invalid_field) {
        return Err(ApiError::invalid_value(
            format!("budget.{f}"),
            "A budget is a finite, non-negative amount.",
        ));
    }
    Ok(())
}

async fn create_tenant(
    gw: &Gateway,
    body: Value,
    note: &mut Note,
) -> Result<Response<RespBody>, ApiError> {
    let mut t: Tenant = serde_json::from_value(body).map_err(|e| ApiError::from_json_error(&e))?;
    note.target = Some(format!("tenant:{}", audit::bounded(&t.id)));
    if t.name.is_empty() {
        t.name = t.id.clone();
    }
    t.created_at = unix_now();
    check_tenant(&t)?;
    if gw
        .store
        .get_tenant(&t.id)
        .await
        .map_err(store_err)?
        .is_some()
    {
        return Err(ApiError::new(
            ErrorCode::InvalidValue,
            format!("A tenant named '{}' already exists.", t.id),
        )
        .with_param("id"));
    }
    gw.store.put_tenant(&t).await.map_err(store_err)?;
    Ok(created(&t))
}

async fn update_tenant(
    gw: &Gateway,
    id: &str,
    patch: Value,
) -> Result<Response<RespBody>, ApiError> {
    let current = get_tenant(gw, id).await?;
    let Value::Object(patch) = patch else {
        return Err(ApiError::invalid_value("body", "Expected a JSON object."));
    };
    let mut merged =
        serde_json::to_value(&current).map_err(|e| ApiError::internal(e.to_string()))?;
    for (k, v) in patch {
        if k == "id" && v.as_str() != Some(id) {
            return Err(ApiError::invalid_value(
                "id",
                "A tenant's id cannot change.",
            ));
        }
        merged[k] = v;
    }
    let t: Tenant = serde_json::from_value(merged).map_err(|e| ApiError::from_json_error(&e))?;
    check_tenant(&t)?;
    gw.store.put_tenant(&t).await.map_err(store_err)?;
    tenant_changed(gw, id).await;
    Ok(ok_json(&t))
}

/// Drops what this replica cached of a tenant and tells the others to do the same (their key
/// caches' TTL is the fallback when that message cannot be sent).
async fn tenant_changed(gw: &Gateway, id: &str) {
    gw.auth.invalidate_tenant(id);
    if let Err(e) = gw.store.publish_tenant_change(id).await {
        tracing::warn!(error = %e, tenant = id, "could not announce the change to other gateways");
    }
}

fn key_view(k: &KeyRecord) -> Value {
    json!({
        "id": k.id,
        "tenant": k.tenant,
        "name": k.name,
        "labels": k.labels,
        "prefix": k.prefix,
        "created_at": k.created_at,
        "expires_at": k.expires_at,
        "expired": k.expired(unix_now()),
        "revoked": k.revoked,
        "requests_per_min": k.requests_per_min,
        "tokens_per_min": k.tokens_per_min,
        "budget": k.budget,
        "rotated_to": k.rotated_to,
        "last_used_at": k.last_used_at,
    })
}

/// A key spec from a request body (`{}` or empty: an unnamed key with no limits of its own).
fn key_spec(body: Value) -> Result<KeySpec, ApiError> {
    let spec: KeySpec = serde_json::from_value(body).map_err(|e| ApiError::from_json_error(&e))?;
    if let Some((field, why)) = spec.invalid() {
        return Err(ApiError::invalid_value(field, why));
    }
    if spec.expires_at.is_some_and(|at| at <= unix_now()) {
        return Err(ApiError::invalid_value(
            "expires_at",
            "expires_at is in the past (unix seconds).",
        ));
    }
    Ok(spec)
}

async fn issue_key(
    gw: &Gateway,
    tenant: &str,
    body: Value,
    note: &mut Note,
) -> Result<Response<RespBody>, ApiError> {
    let spec = key_spec(body)?;
    get_tenant(gw, tenant).await?;
    let (key, rec) = gw.issue_key(tenant, &spec).await.map_err(store_err)?;
    note.target = Some(format!("key:{tenant}/{}", rec.id));
    let mut view = key_view(&rec);
    // The only time the key is ever shown.
    view["key"] = Value::String(key);
    Ok(created(&view))
}

async fn find_key(gw: &Gateway, tenant: &str, key_id: &str) -> Result<KeyRecord, ApiError> {
    get_tenant(gw, tenant).await?;
    let keys = gw.store.list_keys(tenant).await.map_err(store_err)?;
    keys.into_iter()
        .find(|k| k.id == key_id)
        .ok_or_else(|| no_such("key", key_id))
}

async fn update_key(
    gw: &Gateway,
    tenant: &str,
    key_id: &str,
    body: Value,
) -> Result<Response<RespBody>, ApiError> {
    let spec = key_spec(body)?;
    let mut rec = find_key(gw, tenant, key_id).await?;
    spec.apply(&mut rec);
    rec.last_used_at = None;
    gw.store.put_key(&rec).await.map_err(store_err)?;
    tenant_changed(gw, tenant).await;
    Ok(ok_json(&key_view(&rec)))
}

/// Issues a successor with the old key's name, labels, limits and budget, and lets the old key
/// work for `grace_secs` more (default a day; 0 ends it now).
async fn rotate_key(
    gw: &Gateway,
    tenant: &str,
    key_id: &str,
    body: Value,
) -> Result<Response<RespBody>, ApiError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Rotate {
        #[serde(default)]
        grace_secs: Option<u64>,
    }
    let r: Rotate = serde_json::from_value(body).map_err(|e| ApiError::from_json_error(&e))?;
    let grace = r.grace_secs.unwrap_or(86_400);
    if grace > MAX_GRACE_SECS {
        return Err(ApiError::invalid_value(
            "grace_secs",
            format!("A grace time is at most {MAX_GRACE_SECS} s (90 days)."),
        ));
    }
    let mut old = find_key(gw, tenant, key_id).await?;
    if old.revoked {
        return Err(ApiError::invalid_value(
            "key_id",
            format!("The key '{key_id}' is revoked; issue a new key instead."),
        ));
    }
    if old.rotated_to.is_some() {
        return Err(ApiError::invalid_value(
            "key_id",
            format!("The key '{key_id}' was already rotated; rotate its successor."),
        ));
    }
    let (key, mut successor) = gw
        .issue_key(tenant, &KeySpec::of(&old))
        .await
        .map_err(store_err)?;
    // The chain keeps one budget: the successor's spend counts where the old key's did.
    successor.lineage = Some(old.lineage().to_owned());
    gw.store.put_key(&successor).await.map_err(store_err)?;
    let ends = unix_now().saturating_add(grace);
    old.expires_at = Some(old.expires_at.map_or(ends, |at| at.min(ends)));
    old.rotated_to = Some(successor.id.clone());
    old.last_used_at = None;
    gw.store.put_key(&old).await.map_err(store_err)?;
    tenant_changed(gw, tenant).await;
    let mut view = key_view(&successor);
    view["key"] = Value::String(key);
    view["replaces"] = json!(old.id);
    view["replaced_key_expires_at"] = json!(old.expires_at);
    Ok(created(&view))
}

fn token_view(t: &OperatorToken) -> Value {
    json!({
        "name": t.name,
        "role": t.role,
        "prefix": t.prefix,
        "created_at": t.created_at,
        "revoked": t.revoked,
    })
}

async fn issue_token(
    gw: &Gateway,
    body: Value,
    note: &mut Note,
) -> Result<Response<RespBody>, ApiError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Issue {
        name: String,
        role: String,
    }
    let req: Issue = serde_json::from_value(body).map_err(|e| ApiError::from_json_error(&e))?;
    note.target = Some(format!("token:{}", audit::bounded(&req.name)));
    if !valid_id(&req.name) || req.name == "bootstrap" {
        return Err(ApiError::invalid_value(
            "name",
            "A token name is 1-64 characters of a-z, 0-9, '-' and '_' (and not 'bootstrap').",
        ));
    }
    let role = Role::parse(&req.role).ok_or_else(|| {
        ApiError::invalid_value("role", "A role is 'admin', 'operator' or 'viewer'.")
    })?;
    let token = generate_operator_token();
    let rec = OperatorToken {
        name: req.name,
        role,
        hash: gw.operators.hash(&token),
        prefix: token[..8].to_owned(),
        created_at: unix_now(),
        revoked: false,
    };
    if !gw
        .store
        .create_operator_token(&rec)
        .await
        .map_err(store_err)?
    {
        return Err(ApiError::invalid_value(
            "name",
            format!(
                "An operator token named '{}' exists or existed (names are never reused).",
                rec.name
            ),
        ));
    }
    let mut view = token_view(&rec);
    // The only time the token is ever shown.
    view["token"] = Value::String(token);
    Ok(created(&view))
}

/// Drops this replica's cached operator tokens and tells the others to do the same.
async fn operator_tokens_changed(gw: &Gateway) {
    gw.operators.invalidate();
    if let Err(e) = gw
        .store
        .publish_tenant_change(OPERATOR_TOKENS_CHANGED)
        .await
    {
        tracing::warn!(error = %e, "could not announce a token change to other gateways");
    }
}

/// A query parameter's raw value.
fn query_param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == name).then_some(v)
    })
}

/// A query parameter that must be a whole number when present.
fn query_u64(query: &str, name: &str) -> Result<Option<u64>, ApiError> {
    query_param(query, name)
        .map(|v| {
            v.parse().map_err(|_| {
                ApiError::invalid_value(name, format!("{name} must be a whole number."))
            })
        })
        .transpose()
}

/// A query parameter that must be a `YYYY-MM-DD` date when present (days since 1970).
fn query_day(query: &str, name: &str) -> Result<Option<i64>, ApiError> {
    query_param(query, name)
        .map(|v| {
            usage::parse_day(v).ok_or_else(|| {
                ApiError::invalid_value(name, format!("{name} must be a date, YYYY-MM-DD."))
            })
        })
        .transpose()
}

/// The usage aggregates over a span of days, summed per tenant and per day, key or model.
async fn usage_report(gw: &Gateway, query: &str) -> Result<Response<RespBody>, ApiError> {
    let today = (unix_now() / 86_400) as i64;
    let until = query_day(query, "until")?.unwrap_or(today);
    let since = match query_day(query, "since")? {
        Some(d) => d,
        // The first of this month.
        None => usage::parse_day(&format!("{}-01", usage::month_of(unix_now()))).unwrap_or(today),
    };
    if since > until || until - since >= MAX_USAGE_DAYS {
        return Err(ApiError::invalid_value(
            "since",
            format!("since must be on or before until, at most {MAX_USAGE_DAYS} days before."),
        ));
    }
    let group_by = query_param(query, "group_by").unwrap_or("tenant");
    let group = usage::GroupBy::parse(group_by).ok_or_else(|| {
        ApiError::invalid_value("group_by", "group_by is one of tenant, day, key and model.")
    })?;
    let tenants = match query_param(query, "tenant") {
        Some(t) if valid_id(t) => vec![t.to_owned()],
        Some(_) => return Err(ApiError::invalid_value("tenant", "Not a tenant id.")),
        None => (gw.store.list_tenants().await.map_err(store_err)?)
            .into_iter()
            .map(|t| t.id)
            .collect(),
    };
    let days: Vec<String> = (since..=until).map(usage::day_name).collect();
    let mut report = usage::Report::new(group);
    for tenant in &tenants {
        let aggregates = gw
            .store
            .usage_aggregates(tenant, &days)
            .await
            .map_err(store_err)?;
        for (day, agg) in days.iter().zip(aggregates) {
            report.add(tenant, day, agg);
        }
    }
    let rows: Vec<Value> = report
        .rows
        .iter()
        .map(|((tenant, key), fields)| {
            let mut row = usage_row(fields);
            row["tenant"] = json!(tenant);
            if group != usage::GroupBy::Tenant {
                row[group_by] = json!(key);
            }
            row
        })
        .collect();
    Ok(ok_json(&json!({
        "since": usage::day_name(since),
        "until": usage::day_name(until),
        "group_by": group_by,
        "rows": rows,
        "totals": usage_row(&report.totals),
    })))
}

fn usage_row(fields: &BTreeMap<String, u64>) -> Value {
    let get = |f: &str| fields.get(f).copied().unwrap_or(0);
    json!({
        "requests": get("requests"),
        "prompt_tokens": get("prompt"),
        "cached_tokens": get("cached"),
        "completion_tokens": get("completion"),
        "cost_usd": get("cost") as f64 / 1e6,
    })
}

async fn usage_records(gw: &Gateway, query: &str) -> Result<Response<RespBody>, ApiError> {
    let tenant = match query_param(query, "tenant") {
        Some(t) if valid_id(t) => Some(t.to_owned()),
        Some(_) => return Err(ApiError::invalid_value("tenant", "Not a tenant id.")),
        None => None,
    };
    let q = RecordQuery {
        tenant,
        since_ms: query_u64(query, "since_ms")?.unwrap_or(0),
        until_ms: query_u64(query, "until_ms")?.unwrap_or(u64::MAX / 2),
        limit: query_u64(query, "limit")?.map_or(1000, |n| n as usize),
    };
    if q.limit > RECORDS_READ_MAX {
        return Err(ApiError::invalid_value(
            "limit",
            format!("At most {RECORDS_READ_MAX} records per read."),
        ));
    }
    let records = gw.store.usage_records(&q).await.map_err(store_err)?;
    Ok(ok_json(&json!({ "records": records })))
}

fn engine_view(gw: &Gateway, e: &Engine) -> Value {
    let blocks = gw
        .registry
        .index
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .len(e.slot);
    json!({
        "name": e.name,
        "url": e.url,
        "up": e.up.load(Ordering::SeqCst),
        "routable": e.routable(now_ms()),
        "circuit_open": e.circuit_open(now_ms()),
        "draining": e.is_draining(),
        "inflight": e.inflight.load(Ordering::SeqCst),
        "engine_inflight": e.engine_inflight.load(Ordering::Relaxed),
        "kv_usage": e.kv_usage(),
        "cached_blocks_indexed": blocks,
        "events_live": e.events_live.load(Ordering::SeqCst),
    })
}

fn wait_secs(query: &str) -> u64 {
    query_param(query, "wait")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
        .min(3600)
}

/// Stops routing to the engine (here, and on the engine itself so every gateway replica sees
/// it), then reports progress; with `wait`, waits up to that many seconds for in-flight
/// requests to reach zero.
async fn drain(
    gw: &Gateway,
    engine: &Arc<Engine>,
    wait: u64,
) -> Result<Response<RespBody>, ApiError> {
    engine.draining.store(true, Ordering::SeqCst);
    let upstream = engine_admin(gw, engine, "/admin/drain", None).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(wait);
    loop {
        let here = engine.inflight.load(Ordering::SeqCst);
        let there = engine_inflight(gw, engine).await;
        let drained = here == 0 && there.unwrap_or(0) == 0;
        if drained || tokio::time::Instant::now() >= deadline {
            let mut view = engine_view(gw, engine);
            view["drained"] = json!(drained);
            view["engine_inflight"] = json!(there);
            if let Err(e) = &upstream {
                view["engine_drain_error"] = json!(e);
            }
            return Ok(ok_json(&view));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn engine_inflight(gw: &Gateway, engine: &Engine) -> Option<u64> {
    let req = Request::get(format!("{}/admin/status", engine.url));
    let v = engine_call(gw, req, None).await.ok()?;
    v.get("inflight").and_then(Value::as_u64)
}

/// POSTs to one of the engine's admin endpoints.
async fn engine_admin(
    gw: &Gateway,
    engine: &Engine,
    path: &str,
    body: Option<Value>,
) -> Result<Value, String> {
    engine_call(gw, Request::post(format!("{}{path}", engine.url)), body).await
}

async fn engine_call(
    gw: &Gateway,
    mut req: hyper::http::request::Builder,
    body: Option<Value>,
) -> Result<Value, String> {
    if let Some(t) = &gw.config.operator_token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    let req = req
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(10), gw.client.request(req))
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if !status.is_success() {
        return Err(format!("engine answered {status}: {v}"));
    }
    Ok(v)
}

/// Flushes engine caches (all engines or one; everything or one tenant's scope) and the
/// gateway's index of them, and reports per engine.
async fn flush(gw: &Gateway, body: Value, note: &mut Note) -> Result<Response<RespBody>, ApiError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Flush {
        #[serde(default)]
        engine: Option<String>,
        #[serde(default)]
        tenant: Option<String>,
    }
    let f: Flush = serde_json::from_value(body).map_err(|e| ApiError::from_json_error(&e))?;
    note.target = Some(format!(
        "cache:{}/{}",
        f.engine.as_deref().map_or("*".into(), audit::bounded),
        f.tenant.as_deref().map_or("*".into(), audit::bounded)
    ));
    let scope = match &f.tenant {
        Some(id) => Some(get_tenant(gw, id).await?.scope()),
        None => None,
    };
    let engines = match &f.engine {
        Some(name) => vec![gw
            .registry
            .get(name)
            .ok_or_else(|| no_such("engine", name))?],
        None => gw.registry.all(),
    };
    let mut results = Vec::new();
    for e in &engines {
        let r = engine_admin(gw, e, "/admin/cache/flush", Some(json!({ "scope": scope }))).await;
        if scope.is_none() {
            // The engine's event stream reports the removals too; clearing here means no
            // request routes on the flushed cache in between.
            gw.registry
                .index
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .clear(e.slot);
        }
        results.push(match r {
            Ok(v) => {
                json!({ "engine": e.name, "ok": true, "flushed_blocks": v.get("flushed_blocks") })
            }
            Err(err) => json!({ "engine": e.name, "ok": false, "error": err }),
        });
    }
    if scope.is_none() {
        gw.router.forget_homes();
    }
    Ok(ok_json(&json!({ "scope": scope, "engines": results })))
}
