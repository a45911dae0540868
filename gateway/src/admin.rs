//! The admin API, on its own listener. Everything under `/admin/` needs the operator token;
//! `/metrics` and `/health` are open (the admin listener is not exposed to tenants).
//!
//! - `GET|POST /admin/tenants`, `GET|PATCH|DELETE /admin/tenants/{id}`
//! - `GET|POST /admin/tenants/{id}/keys`, `DELETE /admin/tenants/{id}/keys/{key_id}` (revoke)
//! - `GET|POST /admin/engines`, `DELETE /admin/engines/{name}`,
//!   `POST /admin/engines/{name}/drain[?wait=SECS]`, `POST /admin/engines/{name}/undrain`
//! - `POST /admin/cache/flush` with `{"engine": name?, "tenant": id?}`

use crate::state::Gateway;
use crate::tenant::{unix_now, valid_id, KeyRecord, Tenant};
use crate::upstream::{now_ms, Engine};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{header, Method, Request, Response, StatusCode};
use kvgate_http::{error_response, has_bearer, json_response, ok_json, read_body, RespBody};
use kvgate_protocol::openai::{ApiError, ErrorCode};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

pub async fn route(gw: Arc<Gateway>, req: Request<Incoming>) -> Response<RespBody> {
    let path = req.uri().path().to_owned();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/metrics") => {
            refresh_engine_gauges(&gw);
            return kvgate_http::text_response(
                "text/plain; version=0.0.4; charset=utf-8",
                gw.metrics.render(),
            );
        }
        (&Method::GET, "/health") => {
            return json_response(StatusCode::OK, "{\"status\":\"ok\"}".into())
        }
        _ => {}
    }
    match &gw.config.operator_token {
        Some(t) if has_bearer(&req, t) => {}
        Some(_) => {
            return error_response(&ApiError::unauthorized("Missing or wrong operator token."))
        }
        None => {
            return error_response(&ApiError::forbidden(
                "The admin API is disabled: no operator token is configured.",
            ))
        }
    }
    admin(gw, req, &path)
        .await
        .unwrap_or_else(|e| error_response(&e))
}

fn refresh_engine_gauges(gw: &Gateway) {
    for e in gw.registry.all() {
        gw.metrics.engine(
            &e.name,
            e.up.load(Ordering::SeqCst),
            e.inflight.load(Ordering::SeqCst),
            e.is_draining(),
        );
    }
}

fn store_err(e: crate::store::StoreError) -> ApiError {
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
) -> Result<Response<RespBody>, ApiError> {
    let method = req.method().clone();
    let query = req.uri().query().unwrap_or("").to_owned();
    let parts: Vec<&str> = path.trim_end_matches('/').split('/').skip(2).collect();
    match (method.clone(), parts.as_slice()) {
        (Method::GET, ["tenants"]) => {
            let tenants = gw.store.list_tenants().await.map_err(store_err)?;
            Ok(ok_json(&json!({ "tenants": tenants })))
        }
        (Method::POST, ["tenants"]) => create_tenant(&gw, body_json(req).await?).await,
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
        (Method::POST, ["tenants", id, "keys"]) => issue_key(&gw, id).await,
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
        (Method::POST, ["cache", "flush"]) => flush(&gw, body_json(req).await?).await,
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
    Ok(())
}

async fn create_tenant(gw: &Gateway, body: Value) -> Result<Response<RespBody>, ApiError> {
    let mut t: Tenant = serde_json::from_value(body).map_err(|e| ApiError::from_json_error(&e))?;
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
        "prefix": k.prefix,
        "created_at": k.created_at,
        "revoked": k.revoked,
    })
}

async fn issue_key(gw: &Gateway, tenant: &str) -> Result<Response<RespBody>, ApiError> {
    get_tenant(gw, tenant).await?;
    let (key, rec) = gw.issue_key(tenant).await.map_err(store_err)?;
    let mut view = key_view(&rec);
    // The only time the key is ever shown.
    view["key"] = Value::String(key);
    Ok(created(&view))
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
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix("wait="))
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
async fn flush(gw: &Gateway, body: Value) -> Result<Response<RespBody>, ApiError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Flush {
        #[serde(default)]
        engine: Option<String>,
        #[serde(default)]
        tenant: Option<String>,
    }
    let f: Flush = serde_json::from_value(body).map_err(|e| ApiError::from_json_error(&e))?;
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
