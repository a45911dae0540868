//! End-to-end model speed on this machine, through the engine's real path (block manager, paged
//! attention, the CPU backend): single-stream decode, 512-token prefill and batched decode of 32
//! sequences, with f32, f16, Q8_0 and Q4_1 weights, next to the machine's memory bandwidth
//! measured in the same run, and the memory each load took. Prints one JSON object per figure.
//! `scripts/bench-model` runs llama.cpp beside it.
//!
//! cargo bench -p kvgate-engine --bench model
//!
//! Model: $KVGATE_BENCH_MODEL or the test copy (f32); the quantized formats load
//! $KVGATE_BENCH_QUANT_MODEL (an import with `--keep-quant`: the GGUF's own blocks) when set,
//! and quantize the f32 model at load otherwise. $KVGATE_BENCH_WEIGHTS (`f32,q4_1`, ...) picks
//! formats; $KVGATE_CPU_ISA (`avx2`, `portable`) a lower instruction set than the CPU's best;
//! $KVGATE_BENCH_FIGURES (`decode`, `prefill`, `batched`) some of the figures.

use kvgate_engine::kv::{test_manager, KvCacheManager, SeqId};
use kvgate_engine::model::{Batch, Llama, LoadOptions};
use kvgate_engine::sampling::{Sampler, Workspace};
use kvgate_kernels::{AttnSeq, Cpu, DType, Quant};
use kvgate_protocol::openai::SamplingParams;
use std::path::PathBuf;
use std::time::Instant;

const BS: u32 = 16;

struct Runner {
    model: Llama<Cpu>,
    kv: KvCacheManager,
    vocab: usize,
    /// A greedy request's sampler, as the engine runs it for every sequence.
    greedy: Sampler,
    ws: Workspace,
}

impl Runner {
    /// One step over `seqs` (id, new tokens, start position); returns the logits of each last row.
    fn step(&mut self, seqs: &[(SeqId, Vec<u32>, usize)]) -> Vec<f32> {
        let (mut tokens, mut positions, mut slots, mut rows, mut tables) =
            (vec![], vec![], vec![], vec![], vec![]);
        for (id, new, start) in seqs {
            let t = self.kv.block_table(*id).unwrap();
            for (k, tok) in new.iter().enumerate() {
                tokens.push(*tok);
                positions.push((start + k) as u32);
                slots.push(t.slot(start + k, BS as usize) as u32);
            }
            rows.push(tokens.len() as u32 - 1);
            tables.push(t.blocks().iter().map(|b| b.0).collect::<Vec<u32>>());
        }
        let mut q = 0;
        let attn: Vec<AttnSeq<'_>> = seqs
            .iter()
            .zip(&tables)
            .map(|((_, new, start), table)| {
                let a = AttnSeq {
                    query_start: q,
                    query_len: new.len(),
                    context_len: start + new.len(),
                    block_table: table,
                };
                q += new.len();
                a
            })
            .collect();
        self.model.forward(&Batch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            seqs: &attn,
            logits_rows: &rows,
        })
    }

    fn start(&mut self, id: u64, prompt: &[u32]) -> (SeqId, Vec<u32>, usize) {
        let scope = self.kv.scope("bench");
        let p = self.kv.hash_prompt(scope, prompt);
        let cached = self
            .kv
            .allocate_prompt(SeqId(id), &p, prompt)
            .unwrap()
            .cached_tokens;
        (SeqId(id), prompt[cached..].to_vec(), cached)
    }

    /// The next token of row `row`, picked as the engine picks a greedy request's.
    fn argmax(&mut self, logits: &mut [f32], row: usize) -> u32 {
        let r = &mut logits[row * self.vocab..(row + 1) * self.vocab];
        self.greedy.sample(r, &mut self.ws).unwrap().token
    }

    fn reset(&mut self) {
        let blocks = self.kv.num_blocks() as u32;
        self.kv = test_manager(blocks, 0, BS);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn decode_tok_s(r: &mut Runner, n: usize) -> f64 {
    r.reset();
    let prompt = [504, 2365, 6354, 16438];
    let first = r.start(0, &prompt);
    let mut logits = r.step(&[first]);
    let mut tok = r.argmax(&mut logits, 0);
    let t0 = Instant::now();
    for i in 0..n {
        r.kv.append_slots(SeqId(0), &[tok]).unwrap();
        let mut logits = r.step(&[(SeqId(0), vec![tok], prompt.len() + i)]);
        tok = r.argmax(&mut logits, 0);
    }
    n as f64 / t0.elapsed().as_secs_f64()
}

fn prefill_tok_s(r: &mut Runner, len: usize) -> f64 {
    r.reset();
    let prompt: Vec<u32> = (0..len as u32)
        .map(|i| (i * 37 + 11) % 30000 + 100)
        .collect();
    let t0 = Instant::now();
    let s = r.start(0, &prompt);
    r.step(&[s]);
    len as f64 / t0.elapsed().as_secs_f64()
}

fn batched_tok_s(r: &mut Runner, batch: usize, steps: usize) -> f64 {
    r.reset();
    let starts: Vec<_> = (0..batch)
        .map(|b| {
            let prompt: Vec<u32> = (0..16u32)
                .map(|i| (i * 131 + b as u32 * 977) % 30000 + 100)
                .collect();
            r.start(b as u64, &prompt)
        })
        .collect();
    let mut logits = r.step(&starts);
    let mut toks: Vec<u32> = (0..batch).map(|b| r.argmax(&mut logits, b)).collect();
    let t0 = Instant::now();
    for s in 0..steps {
        let items: Vec<_> = (0..batch)
            .map(|b| {
                r.kv.append_slots(SeqId(b as u64), &[toks[b]]).unwrap();
                (SeqId(b as u64), vec![toks[b]], 16 + s)
            })
            .collect();
        let mut logits = r.step(&items);
        toks = (0..batch).map(|b| r.argmax(&mut logits, b)).collect();
    }
    (batch * steps) as f64 / t0.elapsed().as_secs_f64()
}

/// Read bandwidth of this machine: two threads summing a 1 GiB buffer with 16 independent
/// accumulators (so the sum vectorizes and memory, not the adder chain, is the limit), the best
/// of a plain loop and one that prefetches 1 KiB ahead. On some machines (virtual
/// ones especially) the hardware prefetcher alone leaves latency exposed, and a plain loop reads
/// slower than the decode it is the limit of.
fn bandwidth_gb_s() -> f64 {
    let data = vec![1.0f32; 1 << 28];
    let sum = |c: &[f32], prefetch: bool| {
        let mut acc = [0f32; 16];
        for (i, chunk) in c.chunks_exact(16).enumerate() {
            if prefetch {
                prefetch_ahead(c, i * 16 + 256);
            }
            for (a, x) in acc.iter_mut().zip(chunk) {
                *a += x;
            }
        }
        acc.iter().sum::<f32>()
    };
    let run = |prefetch: bool| {
        let t0 = Instant::now();
        let total: f32 = std::thread::scope(|s| {
            let hs: Vec<_> = data
                .chunks(data.len() / 2)
                .map(|c| s.spawn(move || sum(c, prefetch)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        std::hint::black_box(total);
        (data.len() * 4) as f64 / t0.elapsed().as_secs_f64() / 1e9
    };
    run(false);
    let plain = median((0..3).map(|_| run(false)).collect());
    let prefetched = median((0..3).map(|_| run(true)).collect());
    plain.max(prefetched)
}

/// Hints the cache line holding `c[at]` into L1, where the CPU has a prefetch instruction.
#[inline(always)]
fn prefetch_ahead(c: &[f32], at: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(v) = c.get(at) {
        // SAFETY: prefetching is a hint; the address is inside `c`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                (v as *const f32).cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (c, at);
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let dir = std::env::var_os("KVGATE_BENCH_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/kvgate-test-assets/smollm2-f32")
        });
    if !dir.join("config.json").exists() {
        eprintln!(
            "no model at {} (run scripts/test once, or set KVGATE_BENCH_MODEL)",
            dir.display()
        );
        return;
    }
    let quant_dir = std::env::var_os("KVGATE_BENCH_QUANT_MODEL").map(PathBuf::from);
    let wanted = std::env::var("KVGATE_BENCH_WEIGHTS").unwrap_or_default();
    let bw = bandwidth_gb_s();
    println!("{{\"figure\":\"memory_bandwidth_gb_s\",\"value\":{bw:.2}}}");
    println!(
        "{{\"figure\":\"isa\",\"value\":\"{}\"}}",
        kvgate_kernels::Backend::name(&Cpu::new())
    );
    let formats = [
        ("f32", DType::F32, None),
        ("f16", DType::F16, None),
        ("q8_0", DType::F32, Some(Quant::Q8_0)),
        ("q4_1", DType::F32, Some(Quant::Q4_1)),
    ];
    for (name, dtype, quant) in formats {
        if !wanted.is_empty() && !wanted.split(',').any(|w| w.trim() == name) {
            continue;
        }
        let from = match (&quant, &quant_dir) {
            (Some(_), Some(q)) => q.clone(),
            _ => dir.clone(),
        };
        let rss_before = rss_bytes();
        let model = Llama::load(
            Cpu::new(),
            &from,
            LoadOptions {
                dtype,
                quant,
                kv_dtype: DType::F32,
                num_blocks: 2048,
                num_host_blocks: 0,
                block_size: BS as usize,
            },
        )
        .expect("load the model");
        let vocab = model.config().vocab_size;
        let c = model.config().clone();
        let rss_load = rss_bytes().saturating_sub(rss_before);
        let table = (c.vocab_size * c.hidden_size) as f64;
        let layers = (c.num_layers
            * (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                + c.num_heads * c.head_dim * c.hidden_size
                + 3 * c.hidden_size * c.intermediate_size)) as f64;
        // Bytes one decode step streams: every projection and the (tied) table once.
        let weight_bytes = match quant {
            None => (table + layers) * dtype.size_bytes() as f64,
            Some(Quant::Q8_0) => (table + layers) * 34.0 / 32.0,
            Some(Quant::Q4_1) => table * 34.0 / 32.0 + layers * 20.0 / 32.0,
        };
        let mut r = Runner {
            model,
            kv: test_manager(2048, 0, BS),
            vocab,
            greedy: Sampler::new(&SamplingParams::greedy(), &[], &[], 0),
            ws: Workspace::new(),
        };
        // $KVGATE_BENCH_FIGURES (`batched`, `decode,prefill`) measures some figures only (the
        // others print as 0), for a profile or a quick comparison of one kernel.
        let figures = std::env::var("KVGATE_BENCH_FIGURES").unwrap_or_default();
        let want = |f: &str| figures.is_empty() || figures.split(',').any(|w| w.trim() == f);
        // The median of `runs` runs of a wanted figure, after one untimed warm-up run of
        // `warm_up` (a figure that needs none passes a no-op).
        let mut figure = |f: &str,
                          runs: usize,
                          warm_up: &mut dyn FnMut(&mut Runner),
                          run: &mut dyn FnMut(&mut Runner) -> f64| {
            if !want(f) {
                return 0.0;
            }
            warm_up(&mut r);
            median((0..runs).map(|_| run(&mut r)).collect())
        };
        // Three runs, as llama.cpp's figures beside them. The batched figure has no peer, and
        // one run is only 32 steps (about a second), so it takes five.
        let decode = figure(
            "decode",
            3,
            &mut |r| {
                decode_tok_s(r, 16);
            },
            &mut |r| decode_tok_s(r, 128),
        );
        let prefill = figure("prefill", 3, &mut |_| {}, &mut |r| prefill_tok_s(r, 512));
        let batched = figure("batched", 5, &mut |_| {}, &mut |r| batched_tok_s(r, 32, 32));
        // 0 rather than a division by a figure not measured (JSON has no infinity).
        let batched_over_single = if decode > 0.0 { batched / decode } else { 0.0 };
        let weight_gb_s = decode * weight_bytes / 1e9;
        println!("{{\"engine\":\"kvgate\",\"weights\":\"{name}\",\"decode_tok_s\":{decode:.2},\"prefill_512_tok_s\":{prefill:.1},\"batched32_tok_s\":{batched:.1},\"batched_over_single\":{:.2},\"decode_weight_gb_s\":{weight_gb_s:.2},\"decode_share_of_bandwidth\":{:.3},\"weight_mb\":{:.1},\"load_rss_mb\":{:.1}}}", batched_over_single, weight_gb_s / bw, weight_bytes / 1e6, rss_load as f64 / 1e6);
    }
}

/// The process's resident memory (Linux; 0 elsewhere).
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}
