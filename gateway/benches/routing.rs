//! The gateway's routing decision for one chat request, as the gateway makes it: the prompt
//! hashed with SmolLM2's tokenizer and chat template (the system prompt's tokens cached, the
//! rest tokenized), the prefix index looked up across 8 engines each holding 4,096 blocks, the
//! candidates built from each engine's load report, and the `prefix` policy's choice.
//!
//! `cargo bench -p kvgate-gateway --bench routing` (needs target/kvgate-test-assets/smollm2-f32,
//! which scripts/test creates).

use criterion::{criterion_group, criterion_main, Criterion};
use kvgate_gateway::routing::prefix::PromptHasher;
use kvgate_gateway::routing::{Policy, Router, RouterConfig};
use kvgate_gateway::upstream::{Registry, RouteRequest};
use kvgate_protocol::prompt::{ChatMessage, PromptRenderer};
use kvgate_protocol::{BlockHash, BlockHasher, HashParams, LoadReport};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

const ENGINES: usize = 8;
const BLOCKS_PER_ENGINE: usize = 4096;

fn system_prompt() -> String {
    let words: Vec<&str> =
        "refund order policy customer shipping warranty within days product question clearly summarize"
            .split(' ')
            .collect();
    let mut s = String::from("You are the support assistant of Example Corp.");
    for i in 0..260 {
        s.push(' ');
        s.push_str(words[(i * 7 + i / 5) % words.len()]);
        if i % 12 == 11 {
            s.push('.');
        }
    }
    s
}

fn decision(c: &mut Criterion) {
    let dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/kvgate-test-assets/smollm2-f32");
    if !dir.join("tokenizer.json").is_file() {
        eprintln!(
            "skipped: {} is missing (run scripts/test once)",
            dir.display()
        );
        return;
    }
    let renderer = Arc::new(PromptRenderer::from_dir(&dir).expect("SmolLM2's tokenizer"));
    let hasher = PromptHasher::new(
        renderer,
        BlockHasher::new(&HashParams {
            model_id: "smollm2-135m-instruct".into(),
            weight_version: "1".into(),
            kv_dtype: "f32".into(),
            block_size: 16,
            seed: [7; 32],
        }),
    );
    let system = system_prompt();
    let messages: Vec<Vec<ChatMessage>> = (0..64)
        .map(|i| {
            vec![
                ChatMessage {
                    role: "system".into(),
                    content: system.clone(),
                },
                ChatMessage {
                    role: "user".into(),
                    content: format!(
                        "Question {i}: my order {} arrived late and the box was open, what now?",
                        1000 + i * 37
                    ),
                },
            ]
        })
        .collect();
    let config = RouterConfig {
        policy: Policy::Prefix,
        load_factor: 1.25,
        block_size: 16,
        prior_secs_per_token: 0.001,
    };
    let router = Router::new(config);
    let registry = Registry::new();
    let first = hasher.chat("tenant-0", &messages[0]).expect("hashes");
    for s in 0..ENGINES {
        let e = registry
            .add(
                &format!("engine-{s}"),
                &format!("http://127.0.0.1:{}", 9000 + s),
            )
            .expect("a slot");
        e.up.store(true, Ordering::SeqCst);
        e.inflight.store(s as u64, Ordering::Relaxed);
        e.set_report(Some(LoadReport {
            pending_prefill_tokens: 100 * s as u64,
            running_prefill_tokens: 50 * s as u64,
            waiting_by_tenant: (0..12)
                .map(|t| (format!("tenant-{t}"), 50 * s as u64 / 12))
                .collect(),
            running: s as u32,
            max_seqs: 64,
            max_batched_tokens: 4096,
            available_blocks: 1000,
            free_blocks: 100,
            secs_per_token: 0.0005,
            step_secs: 0.01,
            next_finish_secs: 0.5,
            age_secs: 0.0,
        }));
        let mut index = registry.index.write().expect("index");
        if s == 3 {
            for h in &first.hashes {
                index.insert(s, *h);
            }
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u128 * (s as u128 + 1);
        while index.len(s) < BLOCKS_PER_ENGINE {
            x = x.wrapping_mul(0x2545_f491_4f6c_dd1d).wrapping_add(1);
            index.insert(s, BlockHash(x));
        }
    }
    let mut i = 0;
    c.bench_function("routing decision (hash + index + score), 8 engines", |b| {
        b.iter(|| {
            i = (i + 1) % messages.len();
            let ph = hasher.chat("tenant-0", &messages[i]).expect("hashes");
            let req = RouteRequest::new(&ph.hashes, ph.prompt_tokens, "tenant-0", &config);
            let (candidates, _) = registry.candidates(&req, 0, 0);
            std::hint::black_box(router.choose(ph.affinity, ph.prompt_tokens, &candidates))
        })
    });
}

criterion_group!(benches, decision);
criterion_main!(benches);
