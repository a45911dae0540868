//! Active health checks: every engine's `/admin/status` (with the operator token) once a second,
//! for liveness, its drain state, its in-flight count and its KV usage (the load signal). Without
//! an operator token, `/health` gives liveness and drain state only.
//!
//! An engine that refuses connections, or answers that it is not serving, is down at once. One
//! that is merely slow to answer (a health check timing out on a busy host) is down only after
//! [`SLOW_CHECKS_DOWN`] checks in a row, so a burst of load does not empty the fleet; a hung
//! engine's requests are bounded by the proxy's first-byte deadline meanwhile.

use super::{Engine, HttpClient};
use http_body_util::{BodyExt, Full};
use hyper::{header, Request, StatusCode};
use kvgate_protocol::LoadReport;
use serde::Deserialize;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

pub const INTERVAL: Duration = Duration::from_secs(1);
const TIMEOUT: Duration = Duration::from_secs(2);
/// Timed-out checks in a row that take a healthy engine out of routing.
pub const SLOW_CHECKS_DOWN: u32 = 3;

#[derive(Deserialize)]
struct Status {
    #[serde(default)]
    draining: bool,
    #[serde(default)]
    inflight: u64,
    blocks: Blocks,
    /// Read apart, so that a report this gateway cannot read (absent from an older engine, or
    /// malformed) counts as no report and never fails the health check.
    #[serde(default)]
    load: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Blocks {
    used: u64,
    cached: u64,
    free: u64,
}

/// Runs until the engine leaves the registry.
pub async fn watch(engine: Arc<Engine>, client: HttpClient, operator_token: Option<String>) {
    let mut stop = engine.stopped();
    loop {
        check(&engine, &client, operator_token.as_deref()).await;
        tokio::select! {
            () = tokio::time::sleep(INTERVAL) => {}
            _ = stop.changed() => return,
        }
    }
}

/// One check; updates the engine's state.
pub async fn check(engine: &Engine, client: &HttpClient, operator_token: Option<&str>) {
    let was_up = engine.up.load(Ordering::SeqCst);
    let up = match tokio::time::timeout(TIMEOUT, probe(engine, client, operator_token)).await {
        Ok(Ok(())) => {
            engine.slow_checks.store(0, Ordering::Relaxed);
            true
        }
        Ok(Err(why)) => {
            if was_up {
                tracing::warn!(engine = %engine.name, %why, "engine unhealthy");
            }
            false
        }
        Err(_) => {
            let slow = engine.slow_checks.fetch_add(1, Ordering::Relaxed) + 1;
            let down = !was_up || slow >= SLOW_CHECKS_DOWN;
            if was_up && down {
                tracing::warn!(engine = %engine.name, checks = slow, "engine health checks timed out");
            }
            !down
        }
    };
    if up && !was_up {
        tracing::info!(engine = %engine.name, "engine healthy");
        engine.record_success();
    }
    engine.up.store(up, Ordering::SeqCst);
}

async fn probe(
    engine: &Engine,
    client: &HttpClient,
    operator_token: Option<&str>,
) -> Result<(), String> {
    let path = if operator_token.is_some() {
        "/admin/status"
    } else {
        "/health"
    };
    let mut req = Request::get(format!("{}{path}", engine.url));
    if let Some(t) = operator_token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let req = req.body(Full::default()).map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if operator_token.is_none() {
        return match status {
            StatusCode::OK => {
                engine.engine_draining.store(false, Ordering::SeqCst);
                Ok(())
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                engine.engine_draining.store(true, Ordering::SeqCst);
                Ok(())
            }
            s => Err(format!("status {s}")),
        };
    }
    if status != StatusCode::OK {
        return Err(format!("status {status}"));
    }
    let s: Status = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    engine.engine_draining.store(s.draining, Ordering::SeqCst);
    engine.set_engine_inflight(s.inflight);
    engine.set_report(
        s.load
            .and_then(|v| serde_json::from_value::<LoadReport>(v).ok()),
    );
    let total = s
        .blocks
        .used
        .saturating_add(s.blocks.cached)
        .saturating_add(s.blocks.free);
    if total > 0 {
        engine.set_kv_usage(s.blocks.used as f64 / total as f64);
    }
    Ok(())
}
