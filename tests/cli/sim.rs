//! `kvgate sim` end to end: the real binary on the real ShareGPT file (fetched on first use), the
//! targets on its JSON report, and bad input as one-line errors.
//!
//! The simulator is deterministic (seeded, no timing), so its figures are asserted here.

use serde_json::Value;
use std::process::{Command, Output};

fn kvgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(args)
        .output()
        .expect("kvgate runs")
}

fn report(args: &[&str]) -> Value {
    let out = kvgate(&[&["sim", "--json"], args].concat());
    assert!(
        out.status.success(),
        "kvgate sim failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn policy<'a>(r: &'a Value, name: &str) -> &'a Value {
    r["policies"]
        .as_array()
        .expect("policies")
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no policy {name} in {r}"))
}

fn f(p: &Value, key: &str) -> f64 {
    p[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {p}"))
}

#[test]
fn sharegpt_meets_the_paged_attention_targets() {
    let r = report(&["--workload", "sharegpt"]);
    assert_eq!(r["workload"], "sharegpt");
    assert_eq!(r["budget_tokens"], 65536);
    assert!(r["requests"].as_u64().unwrap() > 9000, "{r}");
    let paged = policy(&r, "paged");
    let conc = |name| f(policy(&r, name), "mean_concurrent");
    assert!(f(paged, "useful_fraction") >= 0.97, "{paged}");
    assert!(f(paged, "pool_fraction") >= 0.96, "{paged}");
    assert!(f(policy(&r, "max_len"), "useful_fraction") <= 0.25);
    let pow2 = f(policy(&r, "pow2"), "pool_fraction");
    assert!((0.20..=0.40).contains(&pow2), "pow2 pool fraction {pow2}");
    assert!(conc("paged") >= 2.2 * conc("oracle"), "{r}");
    assert!(conc("paged") >= 1.6 * conc("oracle_ideal"), "{r}");
    assert!(conc("paged") >= 5.0 * conc("max_len"), "{r}");
    for p in r["policies"].as_array().unwrap() {
        assert_eq!(p["rejected"], 0, "{p}");
        assert_eq!(p["completed"], r["requests"], "{p}");
        for key in [
            "useful_fraction",
            "pool_fraction",
            "mean_concurrent",
            "peak_concurrent",
            "preemptions_per_request",
            "blocks_saved_by_sharing",
        ] {
            assert!(p[key].is_number(), "{key} in {p}");
        }
    }
}

#[test]
fn shared_prefix_shows_blocks_saved_by_sharing() {
    let r = report(&[
        "--workload",
        "shared-prefix",
        "--requests",
        "2000",
        "--tenants",
        "4",
    ]);
    let saved = f(policy(&r, "paged"), "blocks_saved_by_sharing");
    assert!(saved > 100.0, "paged saved only {saved} blocks: {r}");
    assert_eq!(f(policy(&r, "oracle"), "blocks_saved_by_sharing"), 0.0);
    // Sharing lets paging run far more requests at once than even the ideal contiguous oracle.
    let conc = |name| f(policy(&r, name), "mean_concurrent");
    assert!(conc("paged") > 2.0 * conc("oracle_ideal"), "{r}");
}

#[test]
fn short_requests_waste_more_of_their_last_block() {
    let args = [
        "--workload",
        "alpaca-like",
        "--requests",
        "3000",
        "--policies",
        "paged",
    ];
    let useful = |bs: &str| {
        let r = report(&[&args[..], &["--block-size", bs]].concat());
        f(policy(&r, "paged"), "useful_fraction")
    };
    let (b8, b16, b32) = (useful("8"), useful("16"), useful("32"));
    assert!(b8 > b16 && b16 > b32, "{b8} {b16} {b32}");
    assert!(b16 < 0.97, "alpaca-like at block size 16: {b16}");
}

#[test]
fn routing_sim_bad_input_is_a_one_line_error() {
    let sim = ["bench", "--routing-sim", "--timing-iterations", "0"];
    let cases: [&[&str]; 5] = [
        // Pools too small for two of the longest requests.
        &["--tenants", "1", "--sim-requests", "100"],
        &["--capacity-blocks", "1"],
        &["--sim-context-us=-1"],
        &["--sim-request-ms", "inf"],
        &["--zipf-s", "nan"],
    ];
    for args in cases {
        let out = kvgate(&[&sim[..], args].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
    }
}

#[test]
fn routing_sim_counts_the_context_each_token_attends_to() {
    let engine_ms = |context_us: &str| {
        let out = kvgate(&[
            "bench",
            "--routing-sim",
            "--timing-iterations",
            "0",
            "--sim-requests",
            "400",
            "--policies",
            "prefix",
            "--sim-step-ms",
            "1:18,16:24,160:200",
            "--sim-context-us",
            context_us,
            "--json",
            "-",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        f(&r["results"][0], "work_ms_per_request")
    };
    let (plain, with) = (engine_ms("0"), engine_ms("5"));
    // The default trace: prompts of 200-2,200 tokens, mostly cached, and answers of 50-300,
    // each of whose tokens attends to a thousand tokens or more: about a second a request at
    // 5 us, against 3-4 s of steps.
    assert!(with > plain * 1.2, "{plain} ms, then {with} ms a request");
}

#[test]
fn bad_input_is_a_one_line_error() {
    let cases: [&[&str]; 6] = [
        &["sim", "--workload", "nonsense"],
        &[
            "sim",
            "--workload",
            "sharegpt",
            "--sharegpt",
            "/nonexistent/sharegpt.json",
        ],
        &["sim", "--workload", "alpaca-like", "--budget", "0"],
        &["sim", "--workload", "alpaca-like", "--block-size", "0"],
        &[
            "sim",
            "--workload",
            "alpaca-like",
            "--policies",
            "paged,bogus",
        ],
        &["sim", "--workload", "alpaca-like", "--rate=-1"],
    ];
    for args in cases {
        let out = kvgate(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
