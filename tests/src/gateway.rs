//! A gateway on loopback for the end-to-end tests: started in-process on its own runtime thread
//! (tenant API and admin API on `127.0.0.1:0`), in front of real engines, with a real Redis or
//! the in-memory store. Also a TCP relay that can be cut, standing in for an engine that dies.

use crate::{request, smollm2_dir, Engine, Response, MODEL, OPERATOR};
use kvgate_gateway::config::EngineEntry;
use kvgate_gateway::store::{MemoryStore, RedisStore, Store};
use kvgate_gateway::{Gateway, GatewayConfig};
use kvgate_protocol::prompt::PromptRenderer;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The engine token the test engines require and the gateways send.
pub const ENGINE_TOKEN: &str = "engine-secret";
/// The deployment hash seed shared by test engines and gateways.
pub const SEED: &str = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed";

/// Opens a streamed request (`body`, with these extra header lines) and leaves after the first
/// token's chunk: the connection closes with the answer half sent.
pub fn stream_and_leave(addr: SocketAddr, key: &str, headers: &str, body: &str) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {key}\r\n\
         {headers}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"delta\"") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => panic!("stream ended before its first token"),
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
}

/// Engine config text for engines behind a test gateway (merged into `Engine::start`).
pub fn engine_toml(extra_kv: &str) -> String {
    format!(
        "[kv]\nhash_seed = \"{SEED}\"\n{extra_kv}\n[auth]\nengine_token = \"{ENGINE_TOKEN}\"\noperator_token = \"{OPERATOR}\"\n"
    )
}

/// Starts an engine that accepts this harness's gateways.
pub fn gated_engine(extra_kv: &str) -> Engine {
    Engine::start(&engine_toml(extra_kv))
}

/// Where a test gateway keeps its state.
#[derive(Debug, Clone)]
pub enum StoreKind {
    Memory,
    Redis(String),
}

/// A running gateway; stops (finishing streams) when dropped.
#[derive(Debug)]
pub struct TestGateway {
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub gw: Arc<Gateway>,
    stop: Option<tokio::sync::watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A gateway config for tests: the test secrets and these engines.
pub fn config(engines: &[(&str, SocketAddr)]) -> GatewayConfig {
    GatewayConfig {
        listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        model_id: MODEL.into(),
        operator_token: Some(OPERATOR.into()),
        engine_token: Some(ENGINE_TOKEN.into()),
        pepper: Some("pepper-for-the-tests-0123456789".into()),
        hash_seed: Some(SEED.into()),
        engines: engines
            .iter()
            .map(|(name, addr)| EngineEntry {
                name: (*name).to_owned(),
                url: format!("http://{addr}"),
            })
            .collect(),
        ..GatewayConfig::default()
    }
}

fn renderer() -> Arc<PromptRenderer> {
    static R: std::sync::OnceLock<Arc<PromptRenderer>> = std::sync::OnceLock::new();
    R.get_or_init(|| Arc::new(PromptRenderer::from_dir(&smollm2_dir()).expect("tokenizer")))
        .clone()
}

impl TestGateway {
    pub fn start(config: GatewayConfig, store: StoreKind) -> TestGateway {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let store: Arc<dyn Store> = match store {
                    StoreKind::Memory => Arc::new(MemoryStore::new()),
                    StoreKind::Redis(url) => {
                        let s = RedisStore::connect(&url).await.expect("redis");
                        s.migrate().await.expect("migrate");
                        Arc::new(s)
                    }
                };
                let gw = Gateway::start(config, store, renderer())
                    .await
                    .expect("gateway starts");
                let api = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                let admin = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                tx.send((
                    api.local_addr().expect("addr"),
                    admin.local_addr().expect("addr"),
                    gw.clone(),
                ))
                .expect("report");
                let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
                    let _ = rx.wait_for(|s| *s).await;
                };
                let a = tokio::spawn(gw.clone().run_admin(admin, wait(stop_rx.clone())));
                let _ = gw.run(api, wait(stop_rx)).await;
                let _ = a.await;
            });
        });
        let (addr, admin_addr, gw) = rx.recv().expect("gateway address");
        TestGateway {
            addr,
            admin_addr,
            gw,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    /// An admin API call with the operator token.
    pub fn admin(&self, method: &str, path: &str, body: &str) -> Response {
        let auth = format!("Bearer {OPERATOR}");
        request(
            self.admin_addr,
            method,
            path,
            &[("authorization", &auth)],
            body,
        )
    }

    /// Creates a tenant (JSON fields beyond the id) and returns its first API key.
    pub fn tenant(&self, id: &str, fields: Value) -> String {
        let mut body = fields;
        body["id"] = Value::String(id.into());
        let r = self.admin("POST", "/admin/tenants", &body.to_string());
        assert_eq!(r.status, 201, "create tenant: {}", r.body);
        self.issue_key(id)
    }

    pub fn issue_key(&self, tenant: &str) -> String {
        let r = self.admin("POST", &format!("/admin/tenants/{tenant}/keys"), "");
        assert_eq!(r.status, 201, "issue key: {}", r.body);
        r.json()["key"].as_str().expect("key").to_owned()
    }

    /// A request to the tenant API with an API key.
    pub fn post(&self, key: &str, path: &str, body: &str) -> Response {
        let auth = format!("Bearer {key}");
        request(self.addr, "POST", path, &[("authorization", &auth)], body)
    }

    /// A greedy chat completion: a system prompt (or none) and one user message.
    pub fn chat(&self, key: &str, system: Option<&str>, user: &str, extra: &str) -> Response {
        self.post(key, "/v1/chat/completions", &chat_body(system, user, extra))
    }

    /// Waits until every configured engine is routable and following its KV events.
    pub fn wait_ready(&self, engines: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let views = self.engine_views();
            let ready = views
                .iter()
                .filter(|e| e["routable"] == true && e["events_live"] == true)
                .count();
            if ready >= engines {
                return;
            }
            assert!(Instant::now() < deadline, "engines not ready: {views:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The engines as `/admin/engines` lists them.
    fn engine_views(&self) -> Vec<Value> {
        let r = self.admin("GET", "/admin/engines", "");
        r.json()["engines"].as_array().cloned().unwrap_or_default()
    }

    /// Waits until the gateway's prefix index holds at least `blocks` blocks, over all its
    /// engines. The gateway learns of cached blocks from the engines' KV events, a moment after
    /// the answers that stored them: a test that routes on a prefix it just stored waits here.
    pub fn wait_indexed(&self, blocks: u64) {
        let indexed = || {
            self.engine_views()
                .iter()
                .map(|e| e["cached_blocks_indexed"].as_u64().unwrap_or(0))
                .sum::<u64>()
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while indexed() < blocks {
            assert!(
                Instant::now() < deadline,
                "{} of {blocks} blocks indexed",
                indexed()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The gateway's `/metrics` text.
    pub fn metrics(&self) -> String {
        request(self.admin_addr, "GET", "/metrics", &[], "").body
    }
}

/// A chat request body.
pub fn chat_body(system: Option<&str>, user: &str, extra: &str) -> String {
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    messages.push(serde_json::json!({"role": "user", "content": user}));
    format!(
        r#"{{"model":"{MODEL}","messages":{},"temperature":0{extra}}}"#,
        Value::Array(messages)
    )
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(true);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A TCP relay in front of a server; [`Relay::kill`] cuts every connection and refuses new
/// ones, which is what a gateway sees when an engine process dies.
#[derive(Debug)]
pub struct Relay {
    pub addr: SocketAddr,
    dead: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    listener: Option<TcpListener>,
}

impl Relay {
    pub fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind relay");
        let addr = listener.local_addr().expect("addr");
        let dead = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let l = listener.try_clone().expect("clone listener");
        let (d, c) = (dead.clone(), conns.clone());
        std::thread::spawn(move || {
            for client in l.incoming() {
                let Ok(client) = client else { break };
                if d.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(upstream) = TcpStream::connect(target) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = upstream.set_nodelay(true);
                {
                    let mut c = c.lock().unwrap();
                    c.push(client.try_clone().expect("clone"));
                    c.push(upstream.try_clone().expect("clone"));
                }
                pipe(
                    client.try_clone().expect("clone"),
                    upstream.try_clone().expect("clone"),
                );
                pipe(upstream, client);
            }
        });
        Relay {
            addr,
            dead,
            conns,
            listener: Some(listener),
        }
    }

    /// Cuts every open connection and stops accepting.
    pub fn kill(&mut self) {
        self.dead.store(true, Ordering::SeqCst);
        for s in self.conns.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // Wake the accept loop so it sees `dead`, then close the socket.
        let _ = TcpStream::connect(self.addr);
        self.listener.take();
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 << 10];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}

/// A stand-in for an engine that hangs: it passes health checks (`/admin/status`, `/health`)
/// and holds `/kv/events` open, but never answers a generation request. What a gateway sees of
/// an engine whose model thread is stuck.
#[derive(Debug)]
pub struct HungEngine {
    pub addr: SocketAddr,
    /// Generation requests received.
    pub requests: Arc<std::sync::atomic::AtomicUsize>,
}

impl HungEngine {
    pub fn start() -> HungEngine {
        HungEngine::serve(Answer::Never)
    }

    /// One that starts a streamed answer (headers and a first event) and then goes silent
    /// without closing: what a gateway sees of an engine whose host vanished mid-stream.
    pub fn mid_stream() -> HungEngine {
        HungEngine::serve(Answer::FirstEvent)
    }

    /// One that starts a streamed answer, then sends an event that never ends (2 MiB without
    /// its blank line) and goes silent.
    pub fn huge_event() -> HungEngine {
        HungEngine::serve(Answer::HugeEvent)
    }

    /// One that answers every generation request at once with a whole answer of 65 MiB.
    pub fn oversized() -> HungEngine {
        HungEngine::serve(Answer::Oversized)
    }

    fn serve(answer: Answer) -> HungEngine {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind hung engine");
        let addr = listener.local_addr().expect("addr");
        let requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = requests.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                let count = count.clone();
                std::thread::spawn(move || hung_conn(conn, &count, answer));
            }
        });
        HungEngine { addr, requests }
    }
}

/// What a [`HungEngine`] does with a generation request.
#[derive(Debug, Clone, Copy)]
enum Answer {
    Never,
    FirstEvent,
    HugeEvent,
    Oversized,
}

fn hung_conn(conn: TcpStream, count: &std::sync::atomic::AtomicUsize, generation: Answer) {
    use std::io::BufRead;
    let mut w = conn.try_clone().expect("clone");
    let mut r = std::io::BufReader::new(conn);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h.trim_end().is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        let answer = |w: &mut TcpStream, ctype: &str, body: &str| {
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            w.write_all(head.as_bytes())
        };
        let ok = match path.as_str() {
            "/admin/status" => answer(
                &mut w,
                "application/json",
                r#"{"draining":false,"inflight":0,"blocks":{"used":0,"cached":0,"free":100}}"#,
            ),
            "/health" => answer(&mut w, "application/json", r#"{"status":"ready"}"#),
            _ => {
                let generation = if path.starts_with("/v1/") {
                    count.fetch_add(1, Ordering::SeqCst);
                    generation
                } else {
                    Answer::Never
                };
                if matches!(generation, Answer::Oversized) {
                    let size = 65 << 20;
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {size}\r\n\r\n"
                    );
                    let chunk = vec![b' '; 1 << 20];
                    let _ = w.write_all(head.as_bytes());
                    for _ in 0..65 {
                        if w.write_all(&chunk).is_err() {
                            return;
                        }
                    }
                    continue;
                }
                if matches!(generation, Answer::FirstEvent | Answer::HugeEvent) {
                    let event = r#"data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}"#;
                    let event = format!("{event}\n\n");
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{event}\r\n",
                        event.len()
                    );
                    if w.write_all(head.as_bytes()).is_err() {
                        return;
                    }
                }
                if matches!(generation, Answer::HugeEvent) {
                    let part = format!("data: {}", "x".repeat(2 << 20));
                    let chunk = format!("{:x}\r\n{part}\r\n", part.len());
                    if w.write_all(chunk.as_bytes()).is_err() {
                        return;
                    }
                }
                // Never answers (or never goes on): hold the connection until the peer leaves.
                let mut sink = [0u8; 1024];
                while r.read(&mut sink).unwrap_or(0) > 0 {}
                return;
            }
        };
        if ok.is_err() {
            return;
        }
    }
}
