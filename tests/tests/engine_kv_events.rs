//! `/kv/events`: a snapshot first, then the block events of new requests, numbered without gaps;
//! a late subscriber's snapshot already holds what it missed. Replaying the stream rebuilds the
//! engine's cached hashes, which is what the gateway's prefix index does.

use kvgate_tests::{Engine, MODEL};
use serde_json::Value;
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

struct Subscription {
    reader: BufReader<TcpStream>,
}

impl Subscription {
    fn open(e: &Engine) -> Subscription {
        let mut s = TcpStream::connect(e.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(s, "GET /kv/events HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
        let mut reader = BufReader::new(s);
        let mut line = String::new();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            if line.trim().is_empty() {
                break;
            }
        }
        Subscription { reader }
    }

    /// The next SSE event: (event name, data).
    fn next(&mut self) -> (String, Value) {
        let (mut name, mut line) = ("message".to_owned(), String::new());
        loop {
            line.clear();
            assert!(
                self.reader.read_line(&mut line).unwrap() > 0,
                "stream ended"
            );
            let l = line.trim_end();
            if let Some(n) = l.strip_prefix("event: ") {
                name = n.to_owned();
            } else if let Some(d) = l.strip_prefix("data: ") {
                return (name, serde_json::from_str(d).unwrap());
            }
        }
    }
}

#[test]
fn snapshot_then_numbered_events_rebuild_the_cache_index() {
    let e = Engine::start("");
    let mut sub = Subscription::open(&e);
    let (name, snap) = sub.next();
    assert_eq!(name, "snapshot");
    assert_eq!(snap["blocks"].as_array().unwrap().len(), 0);
    let mut index: HashSet<String> = HashSet::new();
    let mut last = snap["seq"].as_u64().unwrap();
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"{}","max_tokens":20,"temperature":0}}"#,
        "one two three four five six seven eight nine ten ".repeat(4)
    );
    assert_eq!(e.post("/v1/completions", &body).status, 200);
    // The prompt's and the output's full blocks arrive as BlockStored events.
    while index.len() < 3 {
        let (_, ev) = sub.next();
        assert_eq!(ev["seq"].as_u64().unwrap(), last + 1, "no gaps: {ev}");
        last += 1;
        match ev["type"].as_str().unwrap() {
            "BlockStored" => {
                assert_eq!(ev["scope"], "default");
                index.extend(
                    ev["hashes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|h| h.as_str().unwrap().to_owned()),
                );
            }
            "BlockRemoved" => ev["hashes"].as_array().unwrap().iter().for_each(|h| {
                index.remove(h.as_str().unwrap());
            }),
            "AllCleared" => index.clear(),
            other => panic!("unknown event {other}"),
        }
    }
    // A late subscriber gets the same set from its snapshot.
    let mut late = Subscription::open(&e);
    let (name, snap) = late.next();
    assert_eq!(name, "snapshot");
    let snapped: HashSet<String> = snap["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["hash"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(snapped, index);
    // A flush reaches both as AllCleared.
    e.admin("POST", "/admin/cache/flush", "");
    let (_, ev) = late.next();
    assert_eq!(ev["type"], "AllCleared");
    let (_, ev) = sub.next();
    assert_eq!(ev["type"], "AllCleared");
    assert_eq!(ev["seq"].as_u64().unwrap(), last + 1);
}

/// A graceful shutdown ends the endless event stream, so it finishes (it waits for every
/// connection) instead of hanging on a gateway that is still subscribed.
#[test]
fn shutdown_ends_the_event_stream() {
    let e = Engine::start("");
    let mut sub = Subscription::open(&e);
    let (event, _) = sub.next();
    assert_eq!(event, "snapshot");
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(e);
        let _ = done_tx.send(());
    });
    done_rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("the engine shut down with a subscriber attached");
}
