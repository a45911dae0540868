use half::f16;
use kvgate_kernels::cpu::{CpuTensor, CpuWeight};
use kvgate_kernels::{Backend, Cpu, DType, WeightData};
use std::time::Instant;
fn cpu_ns() -> u64 {
    let mut t = 0;
    for e in std::fs::read_dir("/proc/self/task").unwrap() {
        let p = e.unwrap().path().join("schedstat");
        if let Ok(s) = std::fs::read_to_string(p) {
            t += s.split_whitespace().next().unwrap().parse::<u64>().unwrap();
        }
    }
    t
}
const LAYER: [(usize, usize); 7] = [
    (576, 576),
    (192, 576),
    (192, 576),
    (576, 576),
    (1536, 576),
    (1536, 576),
    (576, 1536),
];
fn main() {
    let cpu = Cpu::new();
    let dtype = if std::env::var("F16").is_ok() {
        DType::F16
    } else {
        DType::F32
    };
    let mut ws: Vec<CpuWeight> = Vec::new();
    for l in 0..30 {
        for &(n, k) in &LAYER {
            let v: Vec<f32> = (0..n * k)
                .map(|i| ((i * 7 + l) % 100) as f32 * 0.01)
                .collect();
            let d = match dtype {
                DType::F32 => WeightData::F32(v),
                _ => WeightData::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
            };
            ws.push(cpu.weight(d, n, k));
        }
    }
    let v: Vec<f32> = (0..49152 * 576).map(|i| (i % 100) as f32 * 0.01).collect();
    let d = match dtype {
        DType::F32 => WeightData::F32(v),
        _ => WeightData::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
    };
    ws.push(cpu.weight(d, 49152, 576));
    let x576 = CpuTensor::from_vec(vec![0.1; 576], 1, 576);
    let x1536 = CpuTensor::from_vec(vec![0.1; 1536], 1, 1536);
    let mut out = cpu.tensor(1, 49152);
    let mut best_cpu = u64::MAX;
    let mut best_wall = f64::MAX;
    for _ in 0..40 {
        let (c0, t0) = (cpu_ns(), Instant::now());
        for w in &ws {
            let x = if w.cols() == 576 { &x576 } else { &x1536 };
            cpu.matmul(x, w, None, &mut out);
        }
        best_cpu = best_cpu.min(cpu_ns() - c0);
        best_wall = best_wall.min(t0.elapsed().as_secs_f64());
    }
    println!(
        "{:?} threads={} cpu {:.2} ms wall {:.2} ms",
        dtype,
        rayon::current_num_threads(),
        best_cpu as f64 / 1e6,
        best_wall * 1e3
    );
}
