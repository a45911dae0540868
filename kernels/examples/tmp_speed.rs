use kvgate_kernels::cpu::CpuTensor;
use kvgate_kernels::{Backend, Cpu, WeightData};
use std::time::Instant;
fn main() {
    let cpu = Cpu::new();
    let (n, k) = (1536, 576);
    let w = cpu.weight(WeightData::F32(vec![0.5; n * k]), n, k);
    for m in [1usize, 512] {
        let x = CpuTensor::from_vec(vec![0.1; m * k], m, k);
        let mut out = cpu.tensor(m, n);
        cpu.matmul(&x, &w, None, &mut out);
        let t = Instant::now();
        let it = if m == 1 { 2000 } else { 20 };
        for _ in 0..it {
            cpu.matmul(&x, &w, None, &mut out);
        }
        let dt = t.elapsed().as_secs_f64() / it as f64;
        println!(
            "m={m}: {:.1} us, {:.1} GFLOP/s",
            dt * 1e6,
            2.0 * (m * n * k) as f64 / dt / 1e9
        );
    }
}
