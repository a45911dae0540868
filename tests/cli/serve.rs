//! `kvgate serve`, the quick start, as a new user runs it: the commands it prints are run as
//! printed. The first answer is SmolLM2's golden one, and the printed metrics URL shows the
//! in-process engine's KV cache next to the gateway's metrics.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs a printed command line in a shell; its stdout.
fn sh(line: &str, env: &[(&str, &str)]) -> String {
    let out = Command::new("sh")
        .args(["-c", line])
        .envs(env.iter().copied())
        .output()
        .expect("sh runs");
    assert!(
        out.status.success(),
        "{line}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The printed command that starts with `prefix`, with its continuation lines joined.
fn command(banner: &[String], prefix: &str) -> String {
    let start = banner
        .iter()
        .position(|l| l.trim_start().starts_with(prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` line in:\n{}", banner.join("\n")));
    let mut cmd = String::new();
    for line in &banner[start..] {
        let line = line.trim();
        match line.strip_suffix('\\') {
            Some(head) => cmd.push_str(head),
            None => {
                cmd.push_str(line);
                break;
            }
        }
    }
    cmd
}

#[test]
fn the_quick_start_answers_golden_and_shows_the_kv_cache() {
    let home = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/kvgate-test-assets");
    if !home.join("downloads").exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "scripts/test fetches the model first"
        );
        eprintln!("skipped: run scripts/test once to fetch the model");
        return;
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .env("KVGATE_HOME", &home)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--kv-blocks",
            "256",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvgate serve starts");
    let stdout = child.stdout.take().unwrap();
    let _serve = Serve(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut banner = Vec::new();
    while !banner
        .last()
        .is_some_and(|l: &String| l.contains("prometheus --config.file"))
    {
        let line = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("serve printed no banner; so far:\n{}", banner.join("\n")));
        banner.push(line);
    }

    // The printed curl, as printed: the golden answer.
    let answer: serde_json::Value =
        serde_json::from_str(&sh(&format!("{} -s", command(&banner, "curl http")), &[]))
            .expect("a JSON answer");
    assert_eq!(
        answer["choices"][0]["message"]["content"], "The capital of France is Paris.",
        "{answer}"
    );

    // The printed metrics URL: the engine's KV cache beside the gateway's own metrics.
    let metrics = sh(
        &command(&banner, "curl -s http").replace("| grep kvgate_kv_", ""),
        &[],
    );
    for name in [
        "kvgate_kv_blocks{",
        "kvgate_kv_usage_ratio",
        "kvgate_prefix_cache_queried_tokens_total",
        "kvgate_preemptions_total",
        "kvgate_kv_peer_transfers{role=\"fetching\"} 0",
        "kvgate_gateway_requests_total{",
        // The disk tier is on under $KVGATE_HOME.
        "kvgate_kv_tier_capacity_blocks{tier=\"disk\"}",
        "kvgate_kv_tier_disk_up 1",
    ] {
        assert!(metrics.contains(name), "{name} missing from:\n{metrics}");
    }
    let value = |prefix: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    // The answer took steps, and their time is counted.
    let (steps, busy) = (
        value("kvgate_step_seconds_count"),
        value("kvgate_step_seconds_sum"),
    );
    assert!(
        steps.is_some_and(|n| n >= 1.0) && busy.is_some_and(|s| s > 0.0),
        "no step timed: {steps:?} steps, {busy:?} s"
    );
    let disk_slots = value("kvgate_kv_tier_capacity_blocks{tier=\"disk\"}");
    assert!(
        disk_slots.is_some_and(|n| n > 0.0),
        "no disk tier: {disk_slots:?}"
    );

    // The printed admin commands: a second tenant with its own key, which works.
    let export = command(&banner, "export ");
    let env: Vec<(String, String)> = export
        .trim_start_matches("export ")
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    sh(
        &command(
            &banner,
            &format!("{} admin tenants", env!("CARGO_BIN_EXE_kvgate")),
        ),
        &env,
    );
    let issued: serde_json::Value = serde_json::from_str(&sh(
        &command(
            &banner,
            &format!("{} admin keys", env!("CARGO_BIN_EXE_kvgate")),
        ),
        &env,
    ))
    .expect("the issued key as JSON");
    let key = issued["key"].as_str().expect("a key");
    let curl = command(&banner, "curl http");
    let default_key = curl
        .split_whitespace()
        .find(|w| w.starts_with("kvg_"))
        .map(|w| w.trim_end_matches('\''))
        .expect("the default tenant's key in the curl");
    let answer: serde_json::Value =
        serde_json::from_str(&sh(&format!("{} -s", curl.replace(default_key, key)), &[]))
            .expect("a JSON answer");
    assert_eq!(
        answer["choices"][0]["message"]["content"], "The capital of France is Paris.",
        "{answer}"
    );
}
