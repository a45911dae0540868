//! The gateway's routing decision for one chat request ([`DecisionPath`]): SmolLM2's tokenizer
//! and chat template on a ~2,000-token system prompt (its tokens cached) and a user message, the
//! prefix index over 8 engines of 1,700 blocks each, the candidates from their load reports, and
//! the `prefix` policy's choice.
//!
//! `cargo bench -p kvgate-sim --bench decision` (needs target/kvgate-test-assets/smollm2-f32,
//! which scripts/test creates).

use criterion::{criterion_group, criterion_main, Criterion};
use kvgate_protocol::prompt::PromptRenderer;
use kvgate_sim::routing::{DecisionPath, SimConfig};
use std::path::Path;
use std::sync::Arc;

fn decision(c: &mut Criterion) {
    let dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/kvgate-test-assets/smollm2-f32");
    let renderer = match PromptRenderer::from_dir(&dir) {
        Ok(r) => Arc::new(r),
        Err(e) => {
            eprintln!(
                "skipped: {} does not load ({e}); run scripts/test once",
                dir.display()
            );
            return;
        }
    };
    let path = match DecisionPath::new(renderer, &SimConfig::default(), 2000, 1700) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("skipped: the decision path does not set up ({e})");
            return;
        }
    };
    let mut i = 0;
    c.bench_function(
        "routing decision, 2,000-token system prompt, 8 engines",
        |b| {
            b.iter(|| {
                i += 1;
                path.decide(i)
            })
        },
    );
}

criterion_group!(benches, decision);
criterion_main!(benches);
