//! The official `openai` Python client (installed by scripts/test into target/venv) completes a
//! streaming and a non-streaming chat completion against a real engine, and through the gateway
//! with an issued API key.

use kvgate_tests::gateway::{config, gated_engine, StoreKind, TestGateway};
use kvgate_tests::{Engine, MODEL};
use std::path::Path;
use std::process::Command;

const SCRIPT: &str = r#"
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key=sys.argv[3])
model = sys.argv[2]
messages = [{"role": "user", "content": "What is the capital of France?"}]
full = client.chat.completions.create(model=model, messages=messages, temperature=0)
print("FULL", full.choices[0].message.content)
print("CACHED", full.usage.prompt_tokens_details.cached_tokens)
parts = []
usage = None
stream = client.chat.completions.create(model=model, messages=messages, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage
print("STREAM", "".join(parts))
print("STREAM_USAGE", usage.completion_tokens)
models = client.models.list()
print("MODELS", [m.id for m in models.data])
try:
    client.chat.completions.create(model="nope", messages=messages)
except Exception as e:
    print("ERROR", type(e).__name__)
"#;

fn python_with_openai() -> Option<std::path::PathBuf> {
    kvgate_tests::venv_python("openai", "openai")
}

/// Runs `python` with `args`; its stdout, once it exited successfully.
fn run_python(python: &Path, args: &[&str]) -> String {
    let out = Command::new(python)
        .args(args)
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A gated engine behind a gateway, and a key of a new tenant `tenant`.
fn gateway_with_key(tenant: &str) -> (kvgate_tests::Engine, TestGateway, String) {
    let e = gated_engine("blocks = 1024");
    let gw = TestGateway::start(config(&[("e0", e.addr)]), StoreKind::Memory);
    gw.wait_ready(1);
    let key = gw.tenant(tenant, serde_json::json!({}));
    (e, gw, key)
}

/// Runs the client script against `base_url` and checks the golden answers.
fn check_client(python: &Path, base_url: &str, key: &str) {
    let stdout = run_python(python, &["-c", SCRIPT, base_url, MODEL, key]);
    assert!(
        stdout.contains("FULL The capital of France is Paris."),
        "{stdout}"
    );
    assert!(
        stdout.contains("STREAM The capital of France is Paris."),
        "{stdout}"
    );
    assert!(stdout.contains("STREAM_USAGE 8"), "{stdout}");
    assert!(stdout.contains(&format!("MODELS ['{MODEL}']")), "{stdout}");
    assert!(stdout.contains("ERROR NotFoundError"), "{stdout}");
}

#[test]
fn the_official_openai_client_works() {
    let Some(python) = python_with_openai() else {
        return;
    };
    let e = Engine::start("");
    check_client(&python, &format!("http://{}/v1", e.addr), "unused");
}

#[test]
fn the_official_openai_client_works_through_the_gateway() {
    let Some(python) = python_with_openai() else {
        return;
    };
    let (_e, gw, key) = gateway_with_key("py");
    check_client(&python, &format!("http://{}/v1", gw.addr), &key);
}

/// Structured outputs and tools through the gateway with the official client: pydantic
/// `parse` (full and streamed), a tool round trip, 100 required calls at temperature 1 all valid,
/// and 200 random schemas whose every finished sample validates (`tests/python/structured_outputs.py`,
/// checked with the `jsonschema` package).
#[test]
fn structured_outputs_and_tools_work_with_the_official_client() {
    let Some(python) = python_with_openai() else {
        return;
    };
    let (_e, gw, key) = gateway_with_key("py-structured");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/structured_outputs.py");
    let script = script.to_str().expect("a UTF-8 path");
    let base = format!("http://{}/v1", gw.addr);
    let stdout = run_python(&python, &[script, &base, MODEL, &key, "200", "100"]);
    println!("{stdout}");
    for part in [
        "OK parse",
        "OK round-trip",
        "OK required 100 of 100",
        "OK schemas",
    ] {
        assert!(stdout.contains(part), "{part} missing in\n{stdout}");
    }
}
