//! A real OTLP/HTTP collector for the tracing tests: `tests/otlp/receiver.py`, which decodes each
//! export with the official `opentelemetry-proto` definitions (installed by `scripts/test` into
//! `target/venv`) and writes every span as a line of JSON.

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running receiver; killed when dropped.
#[derive(Debug)]
pub struct OtlpReceiver {
    child: Child,
    pub port: u16,
    spans: PathBuf,
    _dir: tempfile::TempDir,
}

impl OtlpReceiver {
    /// Starts the receiver; `None` (the test skips) where the venv lacks `opentelemetry-proto`,
    /// which CI never allows.
    pub fn start() -> Option<OtlpReceiver> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let python = crate::venv_python(
            "opentelemetry.proto.collector.trace.v1",
            "opentelemetry-proto",
        )?;
        let dir = tempfile::tempdir().expect("tempdir");
        let spans = dir.path().join("spans.jsonl");
        let mut child = Command::new(&python)
            .arg(root.join("otlp/receiver.py"))
            .arg(&spans)
            .stdout(Stdio::piped())
            .spawn()
            .expect("the receiver starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the receiver's port");
        let port = line.trim().parse().expect("a port");
        Some(OtlpReceiver {
            child,
            port,
            spans,
            _dir: dir,
        })
    }

    /// The endpoint to configure (`/v1/traces` is added by kvgate).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.spans)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The spans of one trace, once it has at least `names` (each at least once), waiting up
    /// to 30 s; a short settle after, so late spans of the same trace are in.
    pub fn wait_trace(&self, trace_id: &str, names: &[&str]) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let spans: Vec<Value> = self
                .spans()
                .into_iter()
                .filter(|s| s["trace_id"] == trace_id)
                .collect();
            if names.iter().all(|n| spans.iter().any(|s| s["name"] == *n)) {
                std::thread::sleep(Duration::from_millis(700));
                return self
                    .spans()
                    .into_iter()
                    .filter(|s| s["trace_id"] == trace_id)
                    .collect();
            }
            assert!(
                Instant::now() < deadline,
                "trace {trace_id}: wanted {names:?}, have {:?}",
                spans.iter().map(|s| &s["name"]).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
