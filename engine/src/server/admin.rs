//! Operator endpoints (`/admin/*`, operator token), `/health` (readiness) and `/health/live`
//! (liveness), and `/kv/events` for the gateway.
//!
//! Both health endpoints answer 503 when the engine thread has stopped (it returned or panicked)
//! or stalled (see [`crate::worker::EngineThread`]): the HTTP server alone serves nothing.
//! `/health` also answers 503 while draining, so a draining engine leaves the ready set;
//! `/health/live` does not, so a liveness probe never restarts an engine mid-drain.
//!
//! `/kv/events` opens with a snapshot of every cached block (`event: snapshot`), then streams each
//! KV event as `data: {"seq":..,"type":..}`. Events numbered at or below the snapshot's are
//! skipped; a consumer that falls behind is told to re-sync (`event: resync`) and the stream
//! ends, so it reconnects and starts from a fresh snapshot.

use super::http::{self, error_response, ok_json, sse_response, stream_channel, RespBody};
use super::ServerState;
use crate::worker::{Command, WorkerState};
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use kvgate_protocol::openai::ApiError;
use serde::Deserialize;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::{broadcast, oneshot};

/// Readiness: 200 `ready` only while the engine thread runs and the engine is not draining; 503
/// otherwise, with the reason in `status`.
pub fn health(state: &ServerState) -> Response<RespBody> {
    readiness(
        state.engine.state(),
        state.is_draining(),
        state.inflight.load(Ordering::SeqCst),
    )
}

/// Liveness (`/health/live`): 503 only when the engine thread has stopped or stalled, which a
/// restart fixes; a draining engine is alive, so the probe never restarts it mid-drain.
pub fn liveness(state: &ServerState) -> Response<RespBody> {
    alive(state.engine.state())
}

fn alive(worker: WorkerState) -> Response<RespBody> {
    worker_down(worker)
        .unwrap_or_else(|| http::json_response(StatusCode::OK, "{\"status\":\"alive\"}".into()))
}

fn readiness(worker: WorkerState, draining: bool, inflight: usize) -> Response<RespBody> {
    if let Some(down) = worker_down(worker) {
        return down;
    }
    if draining {
        http::json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{{\"status\":\"draining\",\"inflight\":{inflight}}}"),
        )
    } else {
        http::json_response(StatusCode::OK, "{\"status\":\"ready\"}".into())
    }
}

/// The 503 for an engine thread that serves nothing, if it does not.
fn worker_down(worker: WorkerState) -> Option<Response<RespBody>> {
    let body = match worker {
        WorkerState::Running => return None,
        WorkerState::Stopped => serde_json::json!({
            "status": "engine_stopped",
            "message": "The engine thread has stopped; the process must be restarted.",
        }),
        WorkerState::Stalled { seconds } => serde_json::json!({
            "status": "engine_stalled",
            "message": "The engine thread has had work and made no progress.",
            "stalled_seconds": seconds,
        }),
    };
    Some(http::json_response(
        StatusCode::SERVICE_UNAVAILABLE,
        body.to_string(),
    ))
}

async fn ask<T>(
    state: &ServerState,
    make: impl FnOnce(oneshot::Sender<T>) -> Command,
) -> Result<T, ApiError> {
    let (tx, rx) = oneshot::channel();
    state
        .commands
        .send(make(tx))
        .map_err(|_| ApiError::unavailable("The engine is not running."))?;
    rx.await
        .map_err(|_| ApiError::unavailable("The engine is not running."))
}

#[derive(Deserialize, Default)]
struct FlushBody {
    #[serde(default)]
    scope: Option<String>,
}

pub async fn route(state: Arc<ServerState>, req: Request<Incoming>) -> Response<RespBody> {
    match &state.operator_token {
        Some(t) if http::has_bearer(&req, t) => {}
        Some(_) => {
            return error_response(&ApiError::unauthorized("Missing or wrong operator token."))
        }
        None => {
            return error_response(&ApiError::forbidden(
                "Admin endpoints are disabled: no operator token is configured.",
            ))
        }
    }
    let path = req.uri().path().to_owned();
    let result = match (req.method().clone(), path.as_str()) {
        (Method::POST, "/admin/drain") => {
            state.draining.store(true, Ordering::SeqCst);
            // The cache survives a restart: what is cached now goes to the disk tier.
            let _ = state
                .commands
                .send(Command::Persist(false, oneshot::channel().0));
            status(&state).await
        }
        (Method::POST, "/admin/undrain") => {
            state.draining.store(false, Ordering::SeqCst);
            status(&state).await
        }
        (Method::GET, "/admin/status") => status(&state).await,
        (Method::POST, "/admin/cache/flush") => flush(&state, req).await,
        (m, p) => Err(ApiError::not_found(m.as_str(), p)),
    };
    result.unwrap_or_else(|e| error_response(&e))
}

/// How long `/admin/status` waits for the engine thread's exact figures before it answers with
/// those published after its last step: a long prefill step must not make a busy engine look
/// dead to the gateways' health checks.
const STATUS_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

async fn status(state: &ServerState) -> Result<Response<RespBody>, ApiError> {
    if state.engine.state() != WorkerState::Running {
        return Err(ApiError::unavailable("The engine thread is not running."));
    }
    let exact = tokio::time::timeout(STATUS_WAIT, ask(state, Command::Status)).await;
    let inflight = state.inflight.load(Ordering::SeqCst);
    let mut body = serde_json::json!({
        "draining": state.is_draining(),
        "drained": state.is_draining() && inflight == 0,
        "inflight": inflight,
    });
    match exact {
        Ok(s) => {
            let s = s?;
            body["blocks"] = serde_json::json!({"used": s.blocks_used, "cached": s.blocks_cached, "free": s.blocks_free});
            body["queues"] = serde_json::json!({"running": s.running, "waiting": s.waiting, "swapped": s.swapped});
            body["running_by_tenant"] = serde_json::json!(s.running_by_tenant);
            body["load"] = serde_json::json!(s.load);
        }
        Err(_) => {
            let m = state.metrics.update(|m| {
                let mut load = m.load.clone();
                load.age_secs = m.load_at.map_or(0.0, |t| t.elapsed().as_secs_f64());
                serde_json::json!({
                    "blocks": {"used": m.blocks_used, "cached": m.blocks_cached, "free": m.blocks_free},
                    "queues": {"running": m.running, "waiting": m.waiting, "swapped": m.swapped},
                    "load": load,
                })
            });
            body["blocks"] = m["blocks"].clone();
            body["queues"] = m["queues"].clone();
            body["load"] = m["load"].clone();
            // As of the engine thread's last step, which is still running.
            body["stale"] = serde_json::Value::Bool(true);
        }
    }
    // The prefix cache's slower tiers, as of the last step.
    body["tiers"] = serde_json::json!(state.metrics.update(|m| m.tiers.clone()));
    Ok(ok_json(&body))
}

async fn flush(
    state: &ServerState,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, ApiError> {
    let body = http::read_body(req, 64 << 10).await?;
    let parsed: FlushBody = if body.iter().all(u8::is_ascii_whitespace) {
        FlushBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::from_json_error(&e))?
    };
    let scope = parsed.scope.clone();
    let dropped = ask(state, |tx| Command::Flush(scope, tx)).await?;
    Ok(ok_json(
        &serde_json::json!({"flushed_blocks": dropped, "scope": parsed.scope}),
    ))
}

pub async fn kv_events(state: Arc<ServerState>, req: Request<Incoming>) -> Response<RespBody> {
    if let Some(t) = &state.engine_token {
        if !http::has_bearer(&req, t) {
            return error_response(&ApiError::unauthorized("Missing or wrong engine token."));
        }
    }
    // Subscribe first, then snapshot: nothing falls between the two.
    let mut events = state.kv_events.subscribe();
    let (seq, blocks) = match ask(&state, Command::Snapshot).await {
        Ok(s) => s,
        Err(e) => return error_response(&e),
    };
    let (tx, body) = stream_channel(256);
    let mut closing = state.closing.subscribe();
    tokio::spawn(async move {
        let snapshot = serde_json::json!({"seq": seq, "blocks": blocks});
        if tx
            .send(Bytes::from(format!(
                "event: snapshot\ndata: {snapshot}\n\n"
            )))
            .await
            .is_err()
        {
            return;
        }
        loop {
            let next = tokio::select! {
                e = events.recv() => e,
                _ = closing.wait_for(|c| *c) => return,
            };
            let frame = match next {
                Ok(e) if e.seq <= seq => continue,
                Ok(e) => match serde_json::to_string(&e) {
                    Ok(json) => format!("data: {json}\n\n"),
                    Err(_) => continue,
                },
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let _ = tx.send(Bytes::from("event: resync\ndata: {}\n\n")).await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            };
            if tx.send(Bytes::from(frame)).await.is_err() {
                return;
            }
        }
    });
    sse_response(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::{EngineThread, DEFAULT_STALL_AFTER};
    use http_body_util::BodyExt;

    fn body(r: Response<RespBody>) -> serde_json::Value {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let bytes = rt.block_on(r.into_body().collect()).unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    /// `/health` and `/health/live` as their handlers answer them for `engine`.
    fn probes(engine: &EngineThread, draining: bool) -> (Response<RespBody>, Response<RespBody>) {
        let worker = engine.state();
        (readiness(worker, draining, 0), alive(worker))
    }

    #[test]
    fn health_is_503_once_the_engine_thread_dies() {
        // The engine thread panics, through the same spawn the engine uses.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let engine = EngineThread::spawn(DEFAULT_STALL_AFTER, move |beat| {
            beat.beat(false);
            let _ = rx.recv();
            panic!("engine thread fault");
        })
        .unwrap();
        let (ready, live) = probes(&engine, false);
        assert_eq!(
            (ready.status(), live.status()),
            (StatusCode::OK, StatusCode::OK)
        );
        tx.send(()).unwrap();
        engine.wait_stopped();
        let (ready, live) = probes(&engine, false);
        assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(live.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body(ready)["status"], "engine_stopped");
        assert_eq!(body(live)["status"], "engine_stopped");
    }

    #[test]
    fn draining_fails_readiness_but_not_liveness() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let engine = EngineThread::spawn(DEFAULT_STALL_AFTER, move |beat| {
            beat.beat(false);
            let _ = rx.recv();
        })
        .unwrap();
        let (ready, live) = probes(&engine, true);
        assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body(ready)["status"], "draining");
        assert_eq!(live.status(), StatusCode::OK);
        // An engine thread that returns (its command channel closed) is as gone as one that
        // panicked.
        drop(tx);
        engine.wait_stopped();
        let (ready, live) = probes(&engine, true);
        assert_eq!(body(ready)["status"], "engine_stopped");
        assert_eq!(live.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
}
