//! Memory bandwidth of this machine, the physical limit of decode: sums a 512 MiB f32 array
//! (far larger than the last-level cache) on all threads. Compare the GEMV figures to it.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rayon::prelude::*;

fn sum(c: &mut Criterion) {
    let n = 512 << 20 >> 2;
    let data: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let mut g = c.benchmark_group("membw");
    g.throughput(Throughput::Bytes((n * 4) as u64));
    g.bench_function(
        format!("sum_512MiB_{}threads", rayon::current_num_threads()),
        |b| {
            b.iter(|| {
                data.par_chunks(1 << 16)
                    .map(|c| {
                        let mut acc = [0.0f32; 16];
                        for ch in c.chunks_exact(16) {
                            for l in 0..16 {
                                acc[l] += ch[l];
                            }
                        }
                        acc.iter().sum::<f32>()
                    })
                    .sum::<f32>()
            })
        },
    );
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = sum
}
criterion_main!(benches);
