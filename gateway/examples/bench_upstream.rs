//! BENCHMARK FIXTURE, not an engine: a minimal HTTP server that speaks just enough of the kvgate
//! engine API for the gateway to route to it, so `scripts/bench-proxy` can measure the gateway's
//! own overhead (a real engine on 2 CPU cores cannot answer thousands of requests a second).
//!
//! - `POST /v1/chat/completions` (and `/v1/completions`): reads the body, and answers a fixed,
//!   valid OpenAI chat completion with a `usage` block; with `"stream": true` a fixed SSE stream
//!   (role chunk, two content chunks, finish chunk, usage chunk, `[DONE]`).
//! - `GET /admin/status` (operator token): `{"draining":false,"inflight":N,"blocks":{..}}`.
//! - `GET /kv/events` (engine token): the `snapshot` event with no blocks, then stays idle.
//! - `GET /health`: `{"status":"ok"}`.
//!
//! ```text
//! cargo run --release -p kvgate-gateway --example bench_upstream -- \
//!     --listen 127.0.0.1:18201 [--engine-token T] [--operator-token T] [--threads 1]
//! ```
//! Tokens, when given, are checked like the engine checks them (401 otherwise).

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use kvgate_http::{error_response, json_response, RespBody};
use kvgate_protocol::openai::ApiError;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const COMPLETION: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"smollm2-135m-instruct","choices":[{"index":0,"message":{"role":"assistant","content":"Hello! This is a fixed answer from the benchmark upstream."},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":24,"completion_tokens":12,"total_tokens":36}}"#;

const STREAM: &str = concat!(
    r#"data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"smollm2-135m-instruct","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"smollm2-135m-instruct","choices":[{"index":0,"delta":{"content":"Hello!"},"logprobs":null,"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"smollm2-135m-instruct","choices":[{"index":0,"delta":{"content":" A fixed answer."},"logprobs":null,"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"smollm2-135m-instruct","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"smollm2-135m-instruct","choices":[],"usage":{"prompt_tokens":24,"completion_tokens":3,"total_tokens":27}}"#,
    "\n\n",
    "data: [DONE]\n\n",
);

#[derive(Debug)]
struct State {
    engine_token: Option<String>,
    operator_token: Option<String>,
    inflight: AtomicU64,
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<RespBody> {
    let path = req.uri().path().to_owned();
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => json_response(StatusCode::OK, r#"{"status":"ok"}"#.into()),
        (Method::GET, "/admin/status") => {
            if let Some(t) = &state.operator_token {
                if !kvgate_http::has_bearer(&req, t) {
                    return error_response(&ApiError::unauthorized("Wrong operator token."));
                }
            }
            let n = state.inflight.load(Ordering::Relaxed);
            json_response(
                StatusCode::OK,
                format!(
                    r#"{{"draining":false,"inflight":{n},"blocks":{{"used":0,"cached":0,"free":4096}}}}"#
                ),
            )
        }
        (Method::GET, "/kv/events") => {
            if let Some(t) = &state.engine_token {
                if !kvgate_http::has_bearer(&req, t) {
                    return error_response(&ApiError::unauthorized("Wrong engine token."));
                }
            }
            let (tx, body) = kvgate_http::stream_channel(4);
            tokio::spawn(async move {
                let snapshot =
                    Bytes::from_static(b"event: snapshot\ndata: {\"seq\":0,\"blocks\":[]}\n\n");
                if tx.send(snapshot).await.is_ok() {
                    // Idle until the gateway hangs up.
                    tx.closed().await;
                }
            });
            kvgate_http::sse_response(body)
        }
        (Method::POST, "/v1/chat/completions" | "/v1/completions") => {
            if let Some(t) = &state.engine_token {
                if !kvgate_http::has_bearer(&req, t) {
                    return error_response(&ApiError::unauthorized("Wrong engine token."));
                }
            }
            state.inflight.fetch_add(1, Ordering::Relaxed);
            let resp = generate(req).await;
            state.inflight.fetch_sub(1, Ordering::Relaxed);
            resp
        }
        (m, p) => error_response(&ApiError::not_found(m.as_str(), p)),
    }
}

/// Parses the body like an engine would (it must be JSON), then answers the fixed completion.
async fn generate(req: Request<Incoming>) -> Response<RespBody> {
    let body = match kvgate_http::read_body(req, 4 << 20).await {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let json: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error_response(&ApiError::from_json_error(&e)),
    };
    if json.get("stream").and_then(|s| s.as_bool()) == Some(true) {
        kvgate_http::sse_response(kvgate_http::full(Bytes::from_static(STREAM.as_bytes())))
    } else {
        json_response(StatusCode::OK, COMPLETION.to_owned())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut listen = "127.0.0.1:18201".to_owned();
    let mut threads = 1usize;
    let mut engine_token = None;
    let mut operator_token = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--listen" => listen = value()?,
            "--threads" => threads = value()?.parse()?,
            "--engine-token" => engine_token = Some(value()?),
            "--operator-token" => operator_token = Some(value()?),
            _ => return Err(format!("unknown argument {a}").into()),
        }
    }
    let state = Arc::new(State {
        engine_token,
        operator_token,
        inflight: AtomicU64::new(0),
    });
    let rt = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()?
    };
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&listen).await?;
        eprintln!(
            "bench_upstream (benchmark fixture) listening on {}",
            listener.local_addr()?
        );
        kvgate_http::serve(
            listener,
            move || {
                let state = state.clone();
                hyper::service::service_fn(move |req| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(handle(state, req).await) }
                })
            },
            async {
                let _ = tokio::signal::ctrl_c().await;
            },
        )
        .await?;
        Ok(())
    })
}
