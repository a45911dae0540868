//! Structured outputs (criterion): compiling a grammar (a small JSON schema, and the required
//! tool-call grammar of 20 tools) and computing one token's mask, per token, along a valid JSON
//! document. The engine computes masks beside the forward pass; these are the costs it hides.
//!
//! cargo bench -p kvgate-engine --bench grammar   (tokenizer: $KVGATE_BENCH_MODEL or the test copy)

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvgate_engine::sampling::GrammarCompiler;
use kvgate_protocol::openai::{structured, Grammar};
use kvgate_protocol::prompt::PromptRenderer;
use serde_json::json;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;

fn setup() -> (GrammarCompiler, Arc<PromptRenderer>) {
    let dir = std::env::var_os("KVGATE_BENCH_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/kvgate-test-assets/smollm2-f32")
        });
    let renderer = Arc::new(PromptRenderer::from_dir(&dir).expect("tokenizer"));
    let eos = vec![renderer.eos_token_id().unwrap_or(0)];
    let compiler =
        GrammarCompiler::from_dir(&dir, renderer.clone(), 49152, &eos).expect("compiler");
    (compiler, renderer)
}

fn person() -> Grammar {
    let f = json!({"type": "json_schema", "json_schema": {"name": "person", "schema": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 32},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "address": {"type": "object", "properties": {
                "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": false}
        },
        "required": ["name", "age", "email", "tags", "address"],
        "additionalProperties": false}}});
    structured::response_format(Some(&f)).unwrap().unwrap()
}

fn tools20() -> Grammar {
    let tools: Vec<_> = (0..20)
        .map(|i| {
            json!({"type": "function", "function": {"name": format!("tool_{i}"),
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string"}, "limit": {"type": "integer"},
                "mode": {"enum": ["fast", "exact"]}}, "required": ["query"]}}})
        })
        .collect();
    let tools = structured::tools(Some(&json!(tools))).unwrap();
    structured::tool_call_grammar(&tools.iter().collect::<Vec<_>>(), true, None)
}

fn bench(c: &mut Criterion) {
    let (compiler, renderer) = setup();
    let mut g = c.benchmark_group("grammar_compile");
    g.sample_size(20);
    for (name, grammar) in [("person_schema", person()), ("tools_20", tools20())] {
        g.bench_function(name, |b| {
            b.iter(|| black_box(compiler.compile_uncached(&grammar).unwrap()))
        });
    }
    // A cache hit: the compiled matcher copied for the request.
    let schema = person();
    compiler.compile("bench", &schema).unwrap();
    g.bench_function("person_schema_cached", |b| {
        b.iter(|| black_box(compiler.compile("bench", &schema).unwrap()))
    });
    g.finish();
    let doc = r#"{"name": "Ada Lovelace", "age": 36, "email": "ada@math.com", "tags": ["math", "poetry"], "address": {"city": "London", "zip": "12345"}}"#;
    let tokens = renderer.encode_continuation(doc).unwrap();
    let start = compiler.compile_uncached(&person()).unwrap();
    let mut g = c.benchmark_group("grammar_mask");
    g.throughput(Throughput::Elements(tokens.len() as u64));
    g.bench_function("person_per_document", |b| {
        b.iter(|| {
            let mut c = start.clone();
            for &t in &tokens {
                c.prepare();
                c.commit(t).unwrap();
            }
            black_box(c.is_finished())
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
