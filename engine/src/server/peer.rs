//! Peer fetch: an engine streams a prefix's KV blocks from a peer engine that holds them, instead
//! of computing them.
//!
//! - **The hint.** When the gateway routes a request away from the engine that holds its prefix
//!   (that engine is busy or draining), it names that engine in [`PEER_HEADER`], and how many of
//!   the prompt's leading blocks to fetch from it in [`PEER_BLOCKS_HEADER`]. Like the tenancy
//!   headers, the hint counts only from a caller with the engine token.
//! - **The fetch.** The engine asks its own thread which blocks of the prompt's cached run no tier
//!   here holds, as far as the gateway's count. It asks the peer for those (`POST /kv/blocks`,
//!   engine token), sending the prompt's tokens and scope: the peer hashes them itself, so a
//!   transfer needs the prompt, not only its hashes. It checks each frame:
//!   - this deployment's fingerprint;
//!   - exactly the hash asked for (a hash it computed itself, from the prompt, in the request's
//!     own scope);
//!   - its BLAKE3.
//!
//!   Each good block enters the host tier. Then the request is admitted and promoted like any
//!   host-tier hit. The transfer has a time limit. A peer that is slow, down, busy, or sends one
//!   bad frame costs only that: the rest is computed, and the peer is not asked again for a
//!   while. At most [`MAX_FETCHES`] run at once; a request that finds them all running waits for
//!   one (a transfer takes far less than the prefill it spares), within its time limit and only
//!   while the transfer would still end before computing the blocks here would.
//! - **Serving a fetch.** Blocks come from the device pool and the host tier, in order, and stop
//!   at the first block neither holds. The engine thread reads them between its steps, or
//!   between the layers of a step in progress (every block but those the step writes was
//!   computed before it), as many at a time as fit in [`EXPORT_CHUNK_BYTES`] (a prompt's whole
//!   prefix, for small models): a transfer waits a layer's time, not a step's. A blocking thread
//!   MACs them, and each frame goes out as its head, the payload as read, and the MAC, never
//!   copied into a frame of its own; the requester reads each frame into one buffer of its exact
//!   size and checks it there. (A fresh thread's first megabytes of new memory cost it tens of
//!   milliseconds of page zeroing on a busy engine, more than the rest of a transfer.) At most
//!   [`MAX_EXPORTS`] transfers run at once, each for at most 30 s.
//! - **A holder still computing the prefix.** A read that reaches a block this engine is
//!   computing (the step in progress writes it, or a prompt in prefill here reaches it in a
//!   later step, or a prompt waiting in its queue will) waits for the step that computes it,
//!   and the transfer goes on from there. So a request sent away from a busy engine that is
//!   computing its tenant's prompt, or is about to, copies the prompt when that prefill ends
//!   instead of computing it a second time. The wait is bounded by the fetch's time limit: past
//!   it, the requester computes what has not come.
//! - **One transfer for several requests.** A request that wants the same blocks from the same
//!   peer as a transfer already running here (a tenant's requests sent away together) waits for
//!   that transfer, then asks for whatever is still missing, instead of asking for the blocks a
//!   second time or, with every transfer slot taken, computing them.
//! - **The measured rate.** Each fetch that brought blocks from a holder (not one the gateway
//!   said is still computing them, [`PEER_COMPUTING_HEADER`]) is timed from the request's ask to
//!   its last block, slot waits included: what such a request waits. The median of the recent
//!   ones, per block and one block's more for the ask, goes in the load report
//!   (`peer_load_secs_per_block`), and the gateway prices this engine's fetches with it.

use super::http::{self, error_response, RespBody};
use super::ServerState;
use crate::worker::disk::{self, Frame, PeerCodec};
use crate::worker::{Command, ExportAsk};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use kvgate_protocol::openai::ApiError;
use kvgate_protocol::BlockHash;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// The gateway's hint: the base URL of a peer engine that holds more of the request's prefix.
pub const PEER_HEADER: &str = "x-kvgate-prefix-peer";
/// With the hint: how many of the prompt's leading blocks to fetch, those the gateway knows the
/// peer to hold and those it expects the peer to have computed within the fetch's time limit.
/// No block past them is asked for.
pub const PEER_BLOCKS_HEADER: &str = "x-kvgate-prefix-peer-blocks";
/// With the hint, `1`: the peer is still computing some of those blocks (for a request routed
/// there), so the fetch waits for its steps. Such a fetch's time is not counted in the rate this engine
/// reports ([`kvgate_protocol::LoadReport::peer_load_secs_per_block`]), which prices transfers
/// from engines that hold the blocks.
pub const PEER_COMPUTING_HEADER: &str = "x-kvgate-prefix-peer-computing";
/// Most blocks one transfer carries.
pub const MAX_FETCH_BLOCKS: usize = 1024;
/// Transfers served at once; more are refused (503), and their requester computes instead.
pub const MAX_EXPORTS: usize = 2;
/// Transfers this engine runs at once as the requester; a request past it waits for one to end
/// (within its fetch's time limit, and only while its transfer would still end before computing
/// the blocks would), and computes them if none does.
pub const MAX_FETCHES: usize = 2;
/// The most block bytes a transfer reads from the engine thread at once (and holds in memory).
const EXPORT_CHUNK_BYTES: usize = 32 << 20;
/// How long a transfer may take to be served, whatever its reader does.
const EXPORT_DEADLINE: Duration = Duration::from_secs(30);
/// A peer that failed, timed out or was busy is not asked again for this long.
const PEER_BACKOFF: Duration = Duration::from_secs(10);
/// Peers remembered in the back-off table (the gateway names engines it knows).
const MAX_BACKOFF_PEERS: usize = 256;

/// Peers not to ask until a time, after they failed.
#[derive(Debug, Default)]
pub struct Backoff(Mutex<HashMap<String, Instant>>);

impl Backoff {
    fn blocked(&self, peer: &str) -> bool {
        let now = Instant::now();
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, until| *until > now);
        map.contains_key(peer)
    }

    fn hold_off(&self, peer: &str) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() < MAX_BACKOFF_PEERS {
            map.insert(peer.to_owned(), Instant::now() + PEER_BACKOFF);
        }
    }
}

/// The transfers this engine runs as the requester, by peer and first block asked for: one entry
/// a transfer, from just before it takes (or waits for) a transfer slot until it ends.
#[derive(Debug, Default)]
pub struct Fetching(Mutex<HashMap<(String, BlockHash), Done>>);

/// Changes (with an error) when the transfer ends.
type Done = tokio::sync::watch::Receiver<()>;

/// A running transfer's entry in [`Fetching`]: removed when the transfer ends, however it ends,
/// and the requests waiting for it wake (its sender is dropped).
struct Running<'a> {
    table: &'a Fetching,
    key: (String, BlockHash),
    _done: tokio::sync::watch::Sender<()>,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.table.lock().remove(&self.key);
    }
}

impl Fetching {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, BlockHash), Done>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The transfer from `peer` that starts at block `first` when one is running (`Err`, to wait
    /// for), else a new entry for it, registered.
    fn join_or_start(&self, peer: &str, first: BlockHash) -> Result<Running<'_>, Done> {
        let key = (peer.to_owned(), first);
        let mut map = self.lock();
        if let Some(done) = map.get(&key) {
            return Err(done.clone());
        }
        let (done, rx) = tokio::sync::watch::channel(());
        map.insert(key.clone(), rx);
        Ok(Running {
            table: self,
            key,
            _done: done,
        })
    }
}

/// What a peer asks for: the prompt's tokens in a scope, from block `from` on, `blocks` of them
/// at most (all it holds when absent). The exporter hashes them itself, so a transfer needs the
/// prompt, not only its hashes.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportBody {
    scope: String,
    tokens: Vec<u32>,
    from: usize,
    #[serde(default)]
    blocks: Option<usize>,
}

/// Of `prompt` in `scope`, the cached run that no tier here holds, from the engine thread
/// (answered between steps or between the layers of a step).
async fn missing_run(
    state: &ServerState,
    scope: &str,
    prompt: &[u32],
) -> Option<(usize, Vec<BlockHash>)> {
    let (tx, rx) = oneshot::channel();
    state
        .want_asks
        .send((scope.to_owned(), prompt.to_vec(), tx))
        .ok()?;
    state.commands.send(Command::PeerAsks).ok()?;
    rx.await.ok()
}

/// `POST /kv/blocks`: the frames of a prompt's blocks from `from` on, in order, as far as this
/// engine holds them.
pub async fn export(state: Arc<ServerState>, req: Request<Incoming>) -> Response<RespBody> {
    let Some(token) = &state.engine_token else {
        return error_response(&ApiError::forbidden(
            "Peer transfer is off: no engine token is configured.",
        ));
    };
    if !http::has_bearer(&req, token) {
        return error_response(&ApiError::unauthorized("Missing or wrong engine token."));
    }
    let Some(codec) = state.peer.clone() else {
        return error_response(&ApiError::forbidden("Peer transfer is off."));
    };
    let body = match http::read_body(req, state.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let parsed: ExportBody = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => return error_response(&ApiError::from_json_error(&e)),
    };
    let Ok(permit) = state.exports.clone().try_acquire_owned() else {
        state.metrics.update(|m| m.tiers.exports_refused += 1);
        return error_response(&ApiError::unavailable(
            "This engine is serving as many peer transfers as it allows.",
        ));
    };
    // Two frames ahead, each sent as three parts.
    let (tx, body) = http::stream_channel(2 * 3);
    let ExportBody {
        scope,
        tokens,
        from,
        blocks,
    } = parsed;
    let tokens = Arc::new(tokens);
    let wanted = blocks.unwrap_or(MAX_FETCH_BLOCKS).min(MAX_FETCH_BLOCKS);
    let chunk = (EXPORT_CHUNK_BYTES / codec.block_bytes.max(1)).clamp(1, MAX_FETCH_BLOCKS);
    tokio::spawn(async move {
        let _permit = permit;
        let serve = async {
            let mut sent = 0;
            // Where a transfer's time goes, for the debug log: waiting for the engine thread's
            // answer, framing, and sending.
            let (mut answering, mut framing, mut sending) = (0.0, 0.0, 0.0);
            while sent < wanted {
                let count = chunk.min(wanted - sent);
                let ask_for = ExportAsk {
                    scope: scope.clone(),
                    tokens: tokens.clone(),
                    from: from + sent,
                    count,
                };
                let (reply, frames) = oneshot::channel();
                let ask = Instant::now();
                if state.export_asks.send((ask_for, reply)).is_err()
                    || state.commands.send(Command::PeerAsks).is_err()
                {
                    return sent;
                }
                // A requester that leaves (its time limit) ends the transfer at once, and with
                // it an ask waiting for a block: the permit goes back now, not at the deadline.
                let got = tokio::select! {
                    got = frames => got,
                    () = tx.closed() => return sent,
                };
                let Ok(got) = got else {
                    return sent;
                };
                answering += ask.elapsed().as_secs_f64();
                let (frames, pending) = (got.frames, got.pending);
                let n = frames.len();
                // The MAC is work for a blocking thread, not the engine's nor the async
                // runtime's. Each frame goes out as its head, the payload as the engine thread
                // read it, and the MAC: no frame-sized buffer is allocated or copied into.
                let codec = codec.clone();
                let frame_start = Instant::now();
                let Ok(parts) = tokio::task::spawn_blocking(move || {
                    frames
                        .into_iter()
                        .map(|f| {
                            let (head, mac) = disk::frame_parts(
                                codec.fingerprint,
                                &codec.key,
                                f.hash,
                                &f.scope,
                                &f.payload,
                            );
                            [
                                Bytes::from(head),
                                Bytes::from(f.payload),
                                Bytes::copy_from_slice(&mac),
                            ]
                        })
                        .collect::<Vec<_>>()
                })
                .await
                else {
                    return sent;
                };
                framing += frame_start.elapsed().as_secs_f64();
                let send_start = Instant::now();
                // A frame's three parts go into the channel together: a transfer cut short (its
                // deadline) ends between two frames, never inside one.
                for frame in parts {
                    let Ok(slots) = tx.reserve_many(frame.len()).await else {
                        return sent;
                    };
                    for (slot, part) in slots.zip(frame) {
                        slot.send(part);
                    }
                }
                sending += send_start.elapsed().as_secs_f64();
                sent += n;
                // Short of its count, the read reached the end of what this engine holds,
                // unless it stopped at a block being computed: the next ask waits for it.
                if n < count && !pending {
                    break;
                }
            }
            tracing::debug!(sent, answering, framing, sending, "peer export timed");
            sent
        };
        let sent = tokio::time::timeout(EXPORT_DEADLINE, serve)
            .await
            .unwrap_or(0);
        state.metrics.update(|m| {
            m.tiers.exports += 1;
            m.tiers.exported_blocks += sent as u64;
        });
    });
    let mut resp = Response::new(body);
    *resp.status_mut() = StatusCode::OK;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/octet-stream"),
    );
    resp
}

/// How a fetch ended.
enum Ended {
    Complete,
    Partial,
    Busy,
    Failed(String),
}

/// Fetches from the hinted peer the blocks of `prompt` (in `scope`) that no tier here holds, as
/// far as the hint says to, into the host tier. Returns the blocks that arrived; never fails the
/// request.
pub async fn fetch(state: &ServerState, hint: &Hint, scope: &str, prompt: &[u32]) -> usize {
    let peer = hint.peer.as_str();
    // No block past the gateway's count is asked for: the peer does not have it, or will not
    // have computed it within the fetch's time limit (a request that waited for a transfer of
    // its tenant's prefix would otherwise ask again for its own question's block, which the
    // peer never had, and wait for nothing).
    let reach = hint.blocks.unwrap_or(usize::MAX);
    let (Some(token), Some(codec)) = (state.engine_token.clone(), state.peer.clone()) else {
        return 0;
    };
    let Ok(uri) = format!("{}/kv/blocks", peer.trim_end_matches('/')).parse::<hyper::Uri>() else {
        tracing::warn!(peer, "a peer hint that is not a URL");
        return 0;
    };
    if uri.scheme_str() != Some("http") {
        tracing::warn!(peer, "peer transfer speaks http only");
        return 0;
    }
    let started = Instant::now();
    let mut limit = None;
    let mut joined = false;
    // A transfer slot waited for, and this transfer's entry (kept while it waited, so that
    // requests for the same blocks join it rather than queue for a slot of their own).
    let mut slot = None;
    // At most three rounds: wait for a transfer of the same blocks, or for a transfer slot, then
    // fetch what is missing.
    let (from, want, _permit, _running) = loop {
        let Some((from, want)) = missing_run(state, scope, prompt).await else {
            return 0;
        };
        let asked = reach.saturating_sub(from).min(MAX_FETCH_BLOCKS);
        let want: Vec<BlockHash> = want.into_iter().take(asked).collect();
        let limit = *limit.get_or_insert_with(|| {
            Duration::from_secs_f64(kvgate_protocol::load::peer_fetch_limit_secs(want.len()))
        });
        let left = limit.saturating_sub(started.elapsed());
        // Nothing missing that the peer is to send (a joined transfer brought it), or no time
        // left.
        let (Some(&first), false) = (want.first(), left.is_zero()) else {
            if joined {
                record_fetch(state, (hint, scope, joined), "joined", 0, started);
            }
            return 0;
        };
        // Checked each round: the transfer waited for may have found the peer down.
        if state.peer_backoff.blocked(peer) {
            record_fetch(state, (hint, scope, joined), "held_off", 0, started);
            return 0;
        }
        if let Some((permit, running)) = slot.take() {
            break (from, want, permit, running);
        }
        let running = match state.fetching.join_or_start(peer, first) {
            Ok(running) => running,
            Err(mut done) if !joined => {
                joined = true;
                // Changes (with an error) when that transfer ends: then ask again.
                let _ = tokio::time::timeout(left, done.changed()).await;
                continue;
            }
            // The blocks a joined transfer left are being fetched by yet another request.
            Err(_) => {
                record_fetch(state, (hint, scope, joined), "joined", 0, started);
                return 0;
            }
        };
        if let Ok(permit) = state.fetches.try_acquire() {
            break (from, want, permit, running);
        }
        // Every transfer slot is taken. A transfer takes far less than computing the blocks, so
        // the request waits for one, and then looks again at what is missing (its own engine
        // may have computed some of it meanwhile); but only while the transfer would still end
        // before computing them here would, and within its time limit.
        let missing = (want.len() * state.block_size).min(prompt.len());
        // The transfer alone, once it has its slot: the prior, not the measured rate, which
        // counts the waits for slots too.
        let transfer = kvgate_protocol::load::peer_fetch_secs(want.len(), 0.0);
        let transfer = Duration::from_secs_f64(transfer);
        let wait = left
            .min(prefill_time(state, missing))
            .saturating_sub(transfer);
        match tokio::time::timeout(wait, state.fetches.acquire()).await {
            Ok(Ok(permit)) => slot = Some((permit, running)),
            _ => {
                record_fetch(state, (hint, scope, joined), "refused", 0, started);
                return 0;
            }
        }
    };
    let limit = limit.unwrap_or_default().saturating_sub(started.elapsed());
    // What waiting for a slot left of the time limit: a transfer cut short in less than the
    // least limit says nothing of the peer.
    let cut_short = limit.as_secs_f64() < kvgate_protocol::load::peer_fetch_limit_secs(0);
    let ask_body = ExportBody {
        scope: scope.to_owned(),
        tokens: prompt.to_vec(),
        from,
        blocks: Some(want.len()),
    };
    let waited = started.elapsed().as_secs_f64();
    tracing::debug!(
        peer,
        scope,
        from,
        blocks = want.len(),
        waited,
        "peer fetch asks"
    );
    let got = Arc::new(Progress::default());
    let ended = tokio::time::timeout(
        limit,
        transfer(state, uri, &token, &ask_body, &want, &codec, got.clone()),
    )
    .await;
    let blocks = got.blocks.load(Ordering::SeqCst);
    let ended = match ended {
        Ok(e) => e,
        Err(_) => Ended::Failed("timed out".into()),
    };
    let result = match &ended {
        Ended::Complete => "complete",
        Ended::Partial => "partial",
        Ended::Busy => "busy",
        Ended::Failed(why) if why == "timed out" => "timed_out",
        Ended::Failed(_) => "failed",
    };
    match &ended {
        Ended::Busy => state.peer_backoff.hold_off(peer),
        // Cut short while the peer was sending, or computing what it sends (it answered, and
        // holds the blocks it will compute back until a step has computed them): it works.
        Ended::Failed(why)
            if why == "timed out" && (cut_short || got.answered.load(Ordering::SeqCst)) => {}
        Ended::Failed(why) => {
            tracing::warn!(peer, %why, "a peer transfer failed; the rest is computed");
            state.peer_backoff.hold_off(peer);
        }
        _ => {}
    }
    record_fetch(state, (hint, scope, joined), result, blocks, started);
    blocks
}

/// How long this engine would take to compute `tokens` prompt tokens, beside its running
/// batch, at its measured step costs (zero before it has measured any).
fn prefill_time(state: &ServerState, tokens: usize) -> Duration {
    let secs = state
        .metrics
        .update(|m| m.load.prefill_secs(tokens as u64, 0.0));
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::ZERO)
}

/// Counts a fetch that ended with `result`, having brought `blocks`, and adds it to the
/// measured rate: one that brought blocks from a holder, not having `joined` another request's
/// transfer first (it would spread that wait over the few blocks it then fetched itself). A
/// fetch from a peer still computing the blocks waits for its steps, and is left out too.
fn record_fetch(
    state: &ServerState,
    (hint, scope, joined): (&Hint, &str, bool),
    result: &str,
    blocks: usize,
    started: Instant,
) {
    let peer = hint.peer.as_str();
    let secs = started.elapsed().as_secs_f64();
    tracing::debug!(peer, scope, result, blocks, secs, "peer fetch ended");
    let timed = blocks > 0 && !joined && !hint.computing;
    state.metrics.update(|m| {
        let t = &mut m.tiers;
        t.peer_fetches.push_result(result);
        t.peer_blocks += blocks as u64;
        t.peer_seconds += secs;
        if timed {
            t.peer_rates
                .push(Instant::now(), secs / (blocks + 1) as f64);
        }
    });
}

/// How far a transfer got, readable after its time limit cut it short.
#[derive(Debug, Default)]
struct Progress {
    /// The peer answered 200: it serves the transfer.
    answered: AtomicBool,
    /// Blocks checked and handed to the engine thread.
    blocks: AtomicUsize,
}

/// The transfer itself: frames are checked (off the async threads) and handed to the engine
/// thread as they arrive; `got` counts them, so a transfer cut short by the time limit still
/// reports what it brought.
async fn transfer(
    state: &ServerState,
    uri: hyper::Uri,
    token: &str,
    ask_body: &ExportBody,
    want: &[BlockHash],
    codec: &PeerCodec,
    got: Arc<Progress>,
) -> Ended {
    let body = match serde_json::to_string(ask_body) {
        Ok(b) => b,
        Err(e) => return Ended::Failed(e.to_string()),
    };
    let req = match Request::post(uri)
        .header(hyper::header::AUTHORIZATION, format!("Bearer {token}"))
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
    {
        Ok(r) => r,
        Err(e) => return Ended::Failed(e.to_string()),
    };
    let asked = Instant::now();
    let resp = match client().request(req).await {
        Ok(r) => r,
        Err(e) => return Ended::Failed(e.to_string()),
    };
    let head = asked.elapsed().as_secs_f64();
    match resp.status() {
        StatusCode::OK => got.answered.store(true, Ordering::SeqCst),
        StatusCode::SERVICE_UNAVAILABLE => return Ended::Busy,
        s => return Ended::Failed(format!("HTTP {s}")),
    }
    let frame_len = disk::frame_bytes(codec.block_bytes, ask_body.scope.len());
    let mut body = resp.into_body();
    // The frame being read: allocated once, at its exact size, when its first byte comes, then
    // checked and cut down to its payload in place.
    let mut frame: Vec<u8> = Vec::new();
    let mut done = 0;
    let (mut first, mut checking) = (None, 0.0);
    while done < want.len() {
        let Some(next) = body.frame().await else {
            break;
        };
        let data = match next {
            Ok(d) => d,
            Err(e) => return Ended::Failed(e.to_string()),
        };
        let Ok(mut data) = data.into_data() else {
            continue;
        };
        while !data.is_empty() && done < want.len() {
            if frame.capacity() == 0 {
                frame.reserve_exact(frame_len);
            }
            let take = (frame_len - frame.len()).min(data.len());
            frame.extend_from_slice(&data.split_to(take));
            if frame.len() < frame_len {
                break;
            }
            let whole = std::mem::take(&mut frame);
            let (hash, c) = (want[done], codec.clone());
            first.get_or_insert_with(|| asked.elapsed().as_secs_f64());
            let check = Instant::now();
            let checked = tokio::task::spawn_blocking(move || {
                disk::decode_frame(whole, c.fingerprint, &c.key, hash, c.block_bytes)
            })
            .await;
            checking += check.elapsed().as_secs_f64();
            let payload = match checked {
                Ok(Ok(p)) => p,
                Ok(Err(why)) => return Ended::Failed(format!("block {hash}: {why}")),
                Err(e) => return Ended::Failed(e.to_string()),
            };
            let block = Frame {
                hash,
                scope: ask_body.scope.clone(),
                payload,
            };
            if !state.send_import(block) {
                return Ended::Failed("the engine stopped".into());
            }
            done += 1;
            got.blocks.store(done, Ordering::SeqCst);
        }
    }
    let last = asked.elapsed().as_secs_f64();
    tracing::debug!(
        blocks = done,
        head,
        first,
        last,
        checking,
        "peer transfer timed"
    );
    if done == want.len() {
        Ended::Complete
    } else if frame.is_empty() {
        Ended::Partial
    } else {
        // A peer ends a short transfer after a whole frame: these bytes are not one.
        Ended::Failed("the transfer ended inside a frame".into())
    }
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

/// A peer hint: the peer's base URL, and how many of the prompt's leading blocks to fetch from
/// it, where the gateway said ([`PEER_BLOCKS_HEADER`]).
#[derive(Debug, Clone)]
pub struct Hint {
    pub peer: String,
    pub blocks: Option<usize>,
    /// The peer is computing the blocks ([`PEER_COMPUTING_HEADER`]).
    pub computing: bool,
}

/// The request's peer hint, where it carries one that counts (the caller has the engine token).
/// A block count that is not a number is ignored: the fetch then asks for all it misses.
pub fn hint<B>(state: &ServerState, req: &Request<B>) -> Option<Hint> {
    state.engine_token.as_ref()?;
    let peer = http::header_str(req, PEER_HEADER)?.to_owned();
    let blocks = http::header_str(req, PEER_BLOCKS_HEADER).and_then(|v| v.trim().parse().ok());
    let computing = http::header_str(req, PEER_COMPUTING_HEADER).is_some_and(|v| v.trim() == "1");
    Some(Hint {
        peer,
        blocks,
        computing,
    })
}
