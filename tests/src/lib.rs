//! End-to-end tests for kvgate: real servers on loopback, the real SmolLM2 model. The tests live
//! in `tests/tests/`; this library is their harness: start an engine in-process on
//! `127.0.0.1:0`, and a small blocking HTTP/1.1 client (JSON and SSE) to talk to it like any
//! client would.

pub mod gateway;
pub mod otlp;
pub mod postgres;
pub mod redis;

use kvgate_engine::model::gguf::import_gguf;
use kvgate_engine::server::{self, config::EngineConfig, launch, ServerState};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The test venv's python (`target/venv`, made by `scripts/test`) when it can import `module`;
/// `None` (the test skips, saying so) where it cannot, which CI never allows.
pub fn venv_python(module: &str, package: &str) -> Option<PathBuf> {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/venv/bin/python");
    let found = python.exists()
        && std::process::Command::new(&python)
            .args(["-c", &format!("import {module}")])
            .status()
            .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "scripts/test installs {package} into target/venv"
        );
        eprintln!("skipped: target/venv has no {package} (run scripts/test)");
        return None;
    }
    Some(python)
}

fn assets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/kvgate-test-assets")
}

/// SmolLM2 imported as an f32 model directory (`scripts/test` fetched its GGUF). Imported once
/// per process; the rename makes concurrent test binaries safe.
pub fn smollm2_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let gguf = assets().join("SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(
            gguf.exists(),
            "{} is missing: run scripts/test",
            gguf.display()
        );
        let dir = assets().join("smollm2-f32");
        if !dir.join("config.json").exists() {
            let tmp = assets().join(format!("smollm2-f32.tmp{}", std::process::id()));
            import_gguf(&gguf, &tmp, &mut |_, _| {}).expect("import SmolLM2");
            if std::fs::rename(&tmp, &dir).is_err() {
                let _ = std::fs::remove_dir_all(&tmp);
            }
        }
        dir
    })
    .clone()
}

/// A running engine on loopback; stops when dropped.
#[derive(Debug)]
pub struct Engine {
    pub addr: SocketAddr,
    pub state: Arc<ServerState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

pub const OPERATOR: &str = "operator-secret";
pub const MODEL: &str = "smollm2-135m-instruct";

impl Engine {
    /// Starts SmolLM2 with `config` (TOML, merged over test defaults: operator token set).
    pub fn start(config_toml: &str) -> Engine {
        let mut config = EngineConfig::parse(config_toml).expect("engine config");
        config.model_id = Some(MODEL.into());
        config
            .auth
            .operator_token
            .get_or_insert_with(|| OPERATOR.into());
        let state = launch::start(&config, &smollm2_dir()).expect("engine starts");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let s = state.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                addr_tx
                    .send(listener.local_addr().expect("addr"))
                    .expect("report addr");
                let _ = server::run(listener, s, async {
                    let _ = stop_rx.await;
                })
                .await;
            });
        });
        let addr = addr_rx.recv().expect("engine address");
        Engine {
            addr,
            state,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    pub fn post(&self, path: &str, body: &str) -> Response {
        request(self.addr, "POST", path, &[], body)
    }

    pub fn get(&self, path: &str) -> Response {
        request(self.addr, "GET", path, &[], "")
    }

    pub fn admin(&self, method: &str, path: &str, body: &str) -> Response {
        let auth = format!("Bearer {OPERATOR}");
        request(self.addr, method, path, &[("authorization", &auth)], body)
    }

    /// A greedy chat completion of one user message.
    pub fn chat(&self, content: &str, extra: &str) -> Response {
        let body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":{}}}],"temperature":0{extra}}}"#,
            Value::String(content.into())
        );
        self.post("/v1/chat/completions", &body)
    }

    /// Value of one metric line (first match of `name` with the given label text).
    pub fn metric(&self, line_prefix: &str) -> f64 {
        let text = self.get("/metrics").body;
        text.lines()
            .find(|l| l.starts_with(line_prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no metric {line_prefix} in\n{text}"))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An HTTP response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of an SSE body, `[DONE]` included.
    pub fn sse_data(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    }
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`); reads the whole response.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Response {
    request_bytes(addr, method, path, headers, body.as_bytes())
}

pub fn request_bytes(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(300)))
        .expect("timeout");
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n", body.len());
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).expect("write head");
    // A peer that rejects the body early may close first; the response is still readable.
    let _ = s.write_all(body);
    read_response(s)
}

fn read_response(s: TcpStream) -> Response {
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).expect("header");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_lowercase(), v.trim().to_owned()));
        }
    }
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                break;
            }
            let size = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
            if size == 0 {
                break;
            }
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk).expect("chunk");
            body.extend_from_slice(&chunk[..size]);
        }
    } else {
        let _ = r.read_to_end(&mut body);
    }
    Response {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// Opens a streaming request and returns the open connection after reading the first `n` bytes
/// of the body, to disconnect mid-stream.
pub fn start_stream(addr: SocketAddr, path: &str, body: &str, n: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    let head = format!("POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
    s.write_all(head.as_bytes()).expect("write");
    let mut buf = vec![0u8; n];
    let mut got = 0;
    while got < n {
        match s.read(&mut buf[got..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => got += k,
        }
    }
    s
}

/// Greedy completions of `prompts` (`max_tokens` each, EOS ignored), one request per prompt,
/// concurrent or one after another; the texts in prompt order.
pub fn greedy_completions(
    addr: SocketAddr,
    prompts: &[&'static str],
    max_tokens: usize,
    concurrent: bool,
) -> Vec<String> {
    let run = move |p: &'static str| {
        let body = format!(
            r#"{{"model":"{MODEL}","prompt":"{p}","max_tokens":{max_tokens},"temperature":0,"ignore_eos":true}}"#
        );
        let r = request(addr, "POST", "/v1/completions", &[], &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["text"].as_str().unwrap().to_owned()
    };
    if concurrent {
        let handles: Vec<_> = prompts
            .iter()
            .map(|&p| std::thread::spawn(move || run(p)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    } else {
        prompts.iter().map(|&p| run(p)).collect()
    }
}
