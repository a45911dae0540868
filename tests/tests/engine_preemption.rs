//! Preemption end to end: a KV pool too small for the batch, in both modes. Every request
//! completes with exactly the output it has on an engine with room to spare, the preemptions are
//! visible in the metrics, and no block is left behind.

use kvgate_tests::{greedy_completions, Engine, MODEL};

const PROMPTS: [&str; 5] = [
    "List five animals:",
    "Write a haiku about rain.",
    "What is 12 times 12?",
    "Name three colors of the rainbow.",
    "Describe a cat in one sentence.",
];

fn outputs(e: &Engine, concurrent: bool) -> Vec<String> {
    greedy_completions(e.addr, &PROMPTS, 48, concurrent)
}

fn check(mode: &str) {
    let roomy = Engine::start("");
    let want = outputs(&roomy, false);
    drop(roomy);
    // 14 blocks of 16 tokens: each request needs 4 at the end (about 8 prompt + 48 tokens), five
    // at once need 20.
    let tight = Engine::start(&format!(
        "[kv]\nblocks = 14\nhost_blocks = 64\n[scheduler]\npreemption = \"{mode}\""
    ));
    let got = outputs(&tight, true);
    assert_eq!(got, want, "{mode}: outputs differ from the unpreempted run");
    let preempted = tight.metric(&format!("kvgate_preemptions_total{{mode=\"{mode}\"}}"));
    assert!(
        preempted > 0.0,
        "{mode}: the pool was too small, yet nothing was preempted"
    );
    // Asked of the engine thread itself (between steps), not the gauge it publishes after each
    // step, which may trail the last response by a moment.
    let status = tight.admin("GET", "/admin/status", "").json();
    assert_eq!(
        status["blocks"]["used"], 0,
        "{mode}: blocks leaked: {status}"
    );
    if mode == "swap" {
        assert!(tight.metric("kvgate_swapped_blocks_total{direction=\"out\"}") > 0.0);
        assert!(tight.metric("kvgate_swapped_blocks_total{direction=\"in\"}") > 0.0);
    }
}

#[test]
fn recompute_preemption_keeps_outputs_identical() {
    check("recompute");
}

#[test]
fn swap_preemption_keeps_outputs_identical() {
    check("swap");
}

#[test]
fn a_request_that_can_never_fit_is_rejected_not_preempted_forever() {
    let e = Engine::start("[kv]\nblocks = 4");
    let body =
        format!(r#"{{"model":"{MODEL}","prompt":"Hello","max_tokens":200,"temperature":0}}"#);
    let r = e.post("/v1/completions", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KV blocks"),
        "{}",
        r.body
    );
    let ok = format!(r#"{{"model":"{MODEL}","prompt":"Hello","max_tokens":8,"temperature":0}}"#);
    assert_eq!(e.post("/v1/completions", &ok).status, 200);
}
