//! Peer fetch: an engine streams a prefix's KV blocks from a peer engine that holds them, instead
//! of computing them.
//!
//! - **The hint.** When the gateway routes a request away from the engine that holds its prefix
//!   (that engine is busy or draining), it names that engine in [`PEER_HEADER`]. Like the tenancy
//!   headers, the hint counts only from a caller with the engine token.
//! - **The fetch.** The engine asks its own thread which blocks of the prompt's cached run no tier
//!   here holds. It asks the peer for those (`POST /kv/blocks`, engine token) and checks each frame:
//!   - this deployment's fingerprint;
//!   - exactly the hash asked for (a hash it computed itself, from the prompt, in the request's
//!     own scope);
//!   - its BLAKE3.
//!
//!   Each good block enters the host tier. Then the request is admitted and promoted like any
//!   host-tier hit. The transfer has a time limit. A peer that is slow, down, or sends one bad
//!   frame costs only that: the rest is computed.
//! - **Serving a fetch.** Frames come from the device pool and the host tier, in order, and stop at
//!   the first block neither holds. They go out in chunks, so a transfer holds a few megabytes, and
//!   at most [`MAX_EXPORTS`] run at once.

use super::http::{self, error_response, RespBody};
use super::ServerState;
use crate::worker::disk::{self, Frame};
use crate::worker::Command;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use kvgate_protocol::openai::ApiError;
use kvgate_protocol::BlockHash;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// The gateway's hint: the base URL of a peer engine that holds more of the request's prefix.
pub const PEER_HEADER: &str = "x-kvgate-prefix-peer";
/// Most hashes one fetch asks for.
pub const MAX_FETCH_BLOCKS: usize = 1024;
/// Transfers served at once; more are refused (503), and their requester computes instead.
pub const MAX_EXPORTS: usize = 2;
/// Blocks per chunk a transfer reads from the engine thread.
const EXPORT_CHUNK: usize = 8;
/// A fetch's time limit: this, plus [`FETCH_SECS_PER_BLOCK`] per block asked for.
const FETCH_BASE: Duration = Duration::from_secs(2);
const FETCH_SECS_PER_BLOCK: f64 = 0.02;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportBody {
    hashes: Vec<BlockHash>,
}

async fn ask<T>(
    state: &ServerState,
    make: impl FnOnce(oneshot::Sender<T>) -> Command,
) -> Option<T> {
    let (tx, rx) = oneshot::channel();
    state.commands.send(make(tx)).ok()?;
    rx.await.ok()
}

/// `POST /kv/blocks`: the frames of `hashes`, in order, as far as this engine holds them.
pub async fn export(state: Arc<ServerState>, req: Request<Incoming>) -> Response<RespBody> {
    let Some(token) = &state.engine_token else {
        return error_response(&ApiError::forbidden(
            "Peer transfer is off: no engine token is configured.",
        ));
    };
    if !http::has_bearer(&req, token) {
        return error_response(&ApiError::unauthorized("Missing or wrong engine token."));
    }
    let body = match http::read_body(req, 64 + MAX_FETCH_BLOCKS * 40).await {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let parsed: ExportBody = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => return error_response(&ApiError::from_json_error(&e)),
    };
    if parsed.hashes.len() > MAX_FETCH_BLOCKS {
        return error_response(&ApiError::invalid_value(
            "hashes",
            format!("at most {MAX_FETCH_BLOCKS} per transfer"),
        ));
    }
    let Ok(permit) = state.exports.clone().try_acquire_owned() else {
        return error_response(&ApiError::unavailable(
            "This engine is serving as many peer transfers as it allows.",
        ));
    };
    let (tx, body) = http::stream_channel(2);
    tokio::spawn(async move {
        let _permit = permit;
        for chunk in parsed.hashes.chunks(EXPORT_CHUNK) {
            let Some(frames) = ask(&state, |r| Command::Export(chunk.to_vec(), r)).await else {
                return;
            };
            let complete = frames.len() == chunk.len();
            for f in frames {
                if tx.send(Bytes::from(f)).await.is_err() {
                    return;
                }
            }
            if !complete {
                return;
            }
        }
    });
    let mut resp = Response::new(body);
    *resp.status_mut() = StatusCode::OK;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/octet-stream"),
    );
    resp
}

/// Fetches from `peer` the blocks of `prompt` (in `scope`) that no tier here holds, into the
/// host tier. Returns the blocks that arrived; never fails the request.
pub async fn fetch(state: &ServerState, peer: &str, scope: &str, prompt: &[u32]) -> usize {
    let Some(token) = state.engine_token.clone() else {
        return 0;
    };
    let Ok(uri) = format!("{}/kv/blocks", peer.trim_end_matches('/')).parse::<hyper::Uri>() else {
        return 0;
    };
    if uri.scheme_str() != Some("http") {
        return 0;
    }
    let Some(codec) = state.peer.clone() else {
        return 0;
    };
    let (scope, prompt) = (scope.to_owned(), prompt.to_vec());
    let Some(want) = ask(state, |r| Command::PeerWant(scope.clone(), prompt, r)).await else {
        return 0;
    };
    if want.is_empty() {
        return 0;
    }
    let want: Vec<BlockHash> = want.into_iter().take(MAX_FETCH_BLOCKS).collect();
    let started = Instant::now();
    let limit = FETCH_BASE + Duration::from_secs_f64(FETCH_SECS_PER_BLOCK * want.len() as f64);
    let got =
        tokio::time::timeout(limit, transfer(state, uri, &token, &scope, &want, &codec)).await;
    let (blocks, result) = match got {
        Ok(Ok(n)) => (
            n,
            if n == want.len() {
                "complete"
            } else {
                "partial"
            },
        ),
        Ok(Err((n, why))) => {
            tracing::warn!(peer, %why, "a peer transfer failed; the rest is computed");
            (n, "failed")
        }
        Err(_) => (0, "timed_out"),
    };
    let secs = started.elapsed().as_secs_f64();
    state.metrics.update(|m| {
        m.tiers.peer_fetches.push_result(result);
        m.tiers.peer_blocks += blocks as u64;
        m.tiers.peer_seconds += secs;
    });
    blocks
}

/// The transfer itself: frames are checked and handed to the engine thread as they arrive.
async fn transfer(
    state: &ServerState,
    uri: hyper::Uri,
    token: &str,
    scope: &str,
    want: &[BlockHash],
    codec: &disk::PeerCodec,
) -> Result<usize, (usize, String)> {
    let body = serde_json::json!({ "hashes": want }).to_string();
    let req = Request::post(uri)
        .header(hyper::header::AUTHORIZATION, format!("Bearer {token}"))
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| (0, e.to_string()))?;
    let resp = client()
        .request(req)
        .await
        .map_err(|e| (0, e.to_string()))?;
    if resp.status() != StatusCode::OK {
        return Err((0, format!("HTTP {}", resp.status())));
    }
    let frame_len = disk::frame_bytes(codec.block_bytes, scope.len());
    let mut body = resp.into_body();
    let mut buf: Vec<u8> = Vec::with_capacity(frame_len);
    let mut done = 0;
    while done < want.len() {
        let Some(next) = body.frame().await else {
            break;
        };
        let data = next.map_err(|e| (done, e.to_string()))?;
        let Ok(data) = data.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        while buf.len() >= frame_len && done < want.len() {
            let rest = buf.split_off(frame_len);
            let frame = std::mem::replace(&mut buf, rest);
            let payload = disk::decode_frame(
                &frame,
                codec.fingerprint,
                &codec.key,
                want[done],
                codec.block_bytes,
            )
            .map_err(|why| (done, format!("block {}: {why}", want[done])))?;
            let sent = state.commands.send(Command::Import(Frame {
                hash: want[done],
                scope: scope.to_owned(),
                payload,
            }));
            if sent.is_err() {
                return Err((done, "the engine stopped".into()));
            }
            done += 1;
        }
        if buf.len() > frame_len {
            return Err((done, "a frame longer than a block".into()));
        }
    }
    Ok(done)
}

fn client() -> hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
> {
    static CLIENT: std::sync::OnceLock<
        hyper_util::client::legacy::Client<
            hyper_util::client::legacy::connect::HttpConnector,
            Full<Bytes>,
        >,
    > = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| {
            let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
            connector.set_nodelay(true);
            connector.set_connect_timeout(Some(Duration::from_secs(1)));
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(connector)
        })
        .clone()
}

/// Whether the request carries a peer hint that counts (the caller has the engine token).
pub fn hint<B>(state: &ServerState, req: &Request<B>) -> Option<String> {
    state.engine_token.as_ref()?;
    http::header_str(req, PEER_HEADER).map(str::to_owned)
}
