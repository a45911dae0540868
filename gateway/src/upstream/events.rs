//! Follows one engine's `/kv/events` stream into the prefix index. The stream opens with a
//! snapshot of every cached block; each later event carries the next sequence number. On a gap,
//! a `resync` notice, or a broken connection the engine's entries are dropped and the consumer
//! reconnects for a fresh snapshot, so the index never routes on blocks the engine no longer has
//! for longer than one reconnect.

use super::{Engine, HttpClient, Registry};
use bytes::{Buf, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::{header, Request};
use kvgate_protocol::{BlockHash, KvEvent, KvEventRecord, Tier};
use serde::Deserialize;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

#[derive(Deserialize)]
struct Snapshot {
    seq: u64,
    blocks: Vec<SnapshotBlock>,
}

#[derive(Deserialize)]
struct SnapshotBlock {
    hash: BlockHash,
    #[serde(default)]
    tier: Tier,
}

/// Why a stream ended.
#[derive(Debug)]
enum End {
    Stopped,
    Broken(String),
}

/// Runs until the engine leaves the registry.
pub async fn follow(
    engine: Arc<Engine>,
    registry: Arc<Registry>,
    client: HttpClient,
    token: Option<String>,
) {
    let mut stop = engine.stopped();
    let mut backoff = Duration::from_millis(100);
    loop {
        let end = tokio::select! {
            end = stream_once(&engine, &registry, &client, token.as_deref()) => end,
            _ = stop.changed() => End::Stopped,
        };
        let was_live = engine.events_live.swap(false, Ordering::SeqCst);
        registry
            .index
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear(engine.slot);
        match end {
            End::Stopped => return,
            End::Broken(why) => {
                tracing::debug!(engine = %engine.name, %why, "kv event stream ended; re-syncing")
            }
        }
        if *stop.borrow() {
            return;
        }
        backoff = if was_live {
            Duration::from_millis(100)
        } else {
            (backoff * 2).min(Duration::from_secs(2))
        };
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
    }
}

async fn stream_once(
    engine: &Engine,
    registry: &Registry,
    client: &HttpClient,
    token: Option<&str>,
) -> End {
    let mut req = Request::get(format!("{}/kv/events", engine.url));
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let Ok(req) = req.body(Full::default()) else {
        return End::Broken("bad url".into());
    };
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => return End::Broken(e.to_string()),
    };
    if !resp.status().is_success() {
        return End::Broken(format!("status {}", resp.status()));
    }
    let mut body = resp.into_body();
    let mut buf = BytesMut::new();
    let mut last_seq: Option<u64> = None;
    loop {
        let frame = match body.frame().await {
            Some(Ok(f)) => f,
            Some(Err(e)) => return End::Broken(e.to_string()),
            None => return End::Broken("closed".into()),
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        while let Some(pos) = find_event_end(&buf) {
            let event = buf.split_to(pos);
            buf.advance(2);
            if let Err(why) = apply(engine, registry, &event, &mut last_seq) {
                return End::Broken(why);
            }
        }
    }
}

fn find_event_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\n\n")
}

/// Applies one SSE event (`event:` and `data:` lines).
fn apply(
    engine: &Engine,
    registry: &Registry,
    event: &[u8],
    last_seq: &mut Option<u64>,
) -> Result<(), String> {
    let text = std::str::from_utf8(event).map_err(|e| e.to_string())?;
    let mut kind = "message";
    let mut data = "";
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("event:") {
            kind = v.trim();
        } else if let Some(v) = line.strip_prefix("data:") {
            data = v.trim();
        }
    }
    let mut index = registry.index.write().unwrap_or_else(|p| p.into_inner());
    match kind {
        "snapshot" => {
            let snap: Snapshot = serde_json::from_str(data).map_err(|e| e.to_string())?;
            index.clear(engine.slot);
            for b in snap.blocks {
                index.insert_at(engine.slot, b.hash, b.tier);
            }
            *last_seq = Some(snap.seq);
            engine.events_live.store(true, Ordering::SeqCst);
            Ok(())
        }
        "resync" => Err("engine asked for a re-sync".into()),
        _ => {
            let rec: KvEventRecord = serde_json::from_str(data).map_err(|e| e.to_string())?;
            match *last_seq {
                Some(s) if rec.seq == s + 1 => {}
                Some(s) => return Err(format!("sequence gap: {s} then {}", rec.seq)),
                None => return Err("event before the snapshot".into()),
            }
            *last_seq = Some(rec.seq);
            match rec.event {
                KvEvent::BlockStored { hashes, .. } => {
                    for h in hashes {
                        index.insert(engine.slot, h);
                    }
                }
                KvEvent::BlockTier { hashes, tier } => {
                    for h in hashes {
                        index.insert_at(engine.slot, h, tier);
                    }
                }
                KvEvent::BlockRemoved { hashes } => {
                    for h in hashes {
                        index.remove(engine.slot, h);
                    }
                }
                KvEvent::AllCleared => index.clear(engine.slot),
            }
            Ok(())
        }
    }
}
