// TEMPORARY microbenchmark (deleted before handing back).
use kvgate_protocol::prompt::{ChatMessage, PromptRenderer};
use std::time::Instant;
fn main() {
    let r = PromptRenderer::from_dir(std::path::Path::new("/work/main/target/kvgate-test-assets/smollm2-f32")).unwrap();
    let msgs = vec![
        ChatMessage { role: "system".into(), content: "You are a helpful assistant. Answer briefly.".into() },
        ChatMessage { role: "user".into(), content: "Say hello to the benchmark.".into() },
    ];
    let full = r.render_chat(&msgs, true).unwrap();
    let pre = r.render_chat(&msgs[..1], false).unwrap();
    let rest = &full[pre.len()..];
    println!("rest={rest:?} toks={}", r.encode_continuation(rest).unwrap().len());
    let n = 20000;
    let t = Instant::now(); for _ in 0..n { std::hint::black_box(r.render_chat(&msgs, true).unwrap()); } println!("render full {:?}", t.elapsed() / n);
    let t = Instant::now(); for _ in 0..n { std::hint::black_box(r.render_chat(&msgs[..1], false).unwrap()); } println!("render prefix {:?}", t.elapsed() / n);
    let t = Instant::now(); for _ in 0..n { std::hint::black_box(r.encode_continuation(rest).unwrap()); } println!("encode rest {:?}", t.elapsed() / n);
    let body = br#"{"model":"smollm2-135m-instruct","messages":[{"role":"system","content":"You are a helpful assistant. Answer briefly."},{"role":"user","content":"Say hello to the benchmark."}],"max_tokens":16}"#;
    let t = Instant::now(); for _ in 0..n { let v: serde_json::Value = serde_json::from_slice(body).unwrap(); std::hint::black_box(serde_json::to_vec(&v).unwrap()); } println!("json value+to_vec {:?}", t.elapsed() / n);
}
