//! The engine on `device = "cuda"` end to end over HTTP: the golden chat answer, prefix reuse, and
//! swap preemption through pinned host memory with outputs identical to an unpreempted run.
//!
//! Built with `--features cuda`. CI runs it on the emulated H200 (the stand-in driver of
//! kernels/emu first on `LD_LIBRARY_PATH`, with `KVGATE_REQUIRE_CUDA=1`); scripts/gpu-check runs
//! it on a real GPU. Without either it prints `skipped: <reason>` and passes.

use kvgate_tests::{greedy_completions, Engine};

const PARIS: &str = "The capital of France is Paris.";

/// The device's memory is shared: one test at a time (the pools are sized from what is free).
static DEVICE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The device lock when a CUDA device (real or emulated) is here.
fn cuda_device() -> Option<std::sync::MutexGuard<'static, ()>> {
    let guard = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    kvgate_kernels::cuda::test_device().map(|_| guard)
}

#[test]
fn cuda_engine_answers_golden_and_reuses_prefixes() {
    let Some(_device) = cuda_device() else {
        return;
    };
    // The pool sized from the device's free memory (the emulated device has 4 GiB), which an
    // engine of the previous test may still be releasing: the request asks for few tokens, so
    // that it fits whatever share of the device is free.
    let e = Engine::start("device = \"cuda\"\n[kv]\ngpu_memory_fraction = 0.4");
    let ask = || {
        let r = e.chat("What is the capital of France?", r#","max_tokens":16"#);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let first = ask();
    assert_eq!(first["choices"][0]["message"]["content"], PARIS);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let again = ask();
    assert_eq!(again["choices"][0]["message"]["content"], PARIS);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    let status = e.admin("GET", "/admin/status", "").json();
    assert_eq!(status["blocks"]["used"], 0, "blocks leaked: {status}");
}

#[test]
fn cuda_engine_swap_preemption_keeps_outputs_identical() {
    let Some(_device) = cuda_device() else {
        return;
    };
    const PROMPTS: [&str; 4] = [
        "List five animals:",
        "Write a haiku about rain.",
        "What is 12 times 12?",
        "Name three colors of the rainbow.",
    ];
    let outputs =
        |e: &Engine, concurrent: bool| greedy_completions(e.addr, &PROMPTS, 20, concurrent);
    let roomy = Engine::start("device = \"cuda\"\n[kv]\nblocks = 64");
    let want = outputs(&roomy, false);
    drop(roomy);
    // Each request ends near 28 tokens (2 blocks of 16); four at once need 8 of the 6 blocks.
    let tight = Engine::start(
        "device = \"cuda\"\n[kv]\nblocks = 6\nhost_blocks = 32\n[scheduler]\npreemption = \"swap\"",
    );
    let got = outputs(&tight, true);
    assert_eq!(got, want, "outputs differ from the unpreempted run");
    assert!(
        tight.metric("kvgate_preemptions_total{mode=\"swap\"}") > 0.0,
        "nothing was preempted"
    );
    assert!(tight.metric("kvgate_swapped_blocks_total{direction=\"out\"}") > 0.0);
    assert!(tight.metric("kvgate_swapped_blocks_total{direction=\"in\"}") > 0.0);
    let status = tight.admin("GET", "/admin/status", "").json();
    assert_eq!(status["blocks"]["used"], 0, "blocks leaked: {status}");
}
