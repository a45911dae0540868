//! The emulated execution harness's own tests: each primitive gives what a GPU gives, and each
//! class of mistake a GPU would refuse (or silently corrupt) fails the launch with a message that
//! names it. The kernels are in `csrc/selftest.cu`, compiled like `kernels/cuda/*.cu`.

use kvgate_cuda_emu::{Arg, Harness, Schedule, Shape};
use rand::{Rng, SeedableRng};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// One harness for the whole binary; tests that change the schedule hold its lock.
fn harness() -> MutexGuard<'static, Harness> {
    static H: OnceLock<Mutex<Harness>> = OnceLock::new();
    let h = H
        .get_or_init(|| Mutex::new(Harness::load().expect("the emulator library loads")))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    h.set_schedule(Schedule::Rotate);
    h
}

fn expect_failure(
    h: &Harness,
    kernel: &str,
    shape: Shape,
    args: &[Arg],
    code: i32,
    words: &[&str],
) {
    let e = h
        .run(kernel, shape, args)
        .expect_err(&format!("emulated {kernel}: the launch must fail"));
    assert_eq!(e.code, code, "emulated {kernel}: {e}");
    for w in words {
        assert!(
            e.message.contains(w),
            "emulated {kernel}: {w:?} not in: {}",
            e.message
        );
    }
    assert!(
        e.message.contains(kernel) || words.is_empty(),
        "the message names the kernel: {}",
        e.message
    );
    println!("emulated {kernel}: {}", e.message);
}

const ILLEGAL_ADDRESS: i32 = 700;
const LAUNCH_FAILED: i32 = 719;
const INVALID_VALUE: i32 = 1;
const MISALIGNED_ADDRESS: i32 = 716;
const OUT_OF_RESOURCES: i32 = 701;

#[test]
fn emulated_block_sum_is_exact_under_every_schedule_and_size() {
    let h = harness();
    for threads in [32u32, 96, 128, 256, 1024] {
        let blocks = 3u32;
        let x: Vec<f32> = (0..threads * blocks).map(|i| (i % 7) as f32).collect();
        let want: Vec<f32> = x.chunks(threads as usize).map(|c| c.iter().sum()).collect();
        let (xp, op) = (h.upload(&x), h.alloc(4 * blocks as usize).unwrap());
        for s in [
            Schedule::Forward,
            Schedule::Reverse,
            Schedule::Shuffle(7),
            Schedule::Rotate,
        ] {
            h.set_schedule(s);
            h.run(
                "selftest_block_sum",
                Shape::linear(blocks, threads),
                &[Arg::Ptr(xp), Arg::Ptr(op)],
            )
            .unwrap();
            assert_eq!(
                h.download::<f32>(op, blocks as usize),
                want,
                "{threads} threads, {s:?}"
            );
        }
        h.free(xp);
        h.free(op);
    }
}

#[test]
fn emulated_warp_intrinsics_match_their_definitions() {
    let h = harness();
    let (blocks, threads) = (2u32, 64u32);
    let n = (blocks * threads) as usize;
    let x: Vec<i32> = (0..n as i32).map(|i| (i * 37 + 11) % 50).collect();
    let (xp, op) = (h.upload(&x), h.alloc(4 * 6 * n).unwrap());
    h.run(
        "selftest_warp_ops",
        Shape::linear(blocks, threads),
        &[Arg::Ptr(xp), Arg::Ptr(op)],
    )
    .unwrap();
    let out = h.download::<i32>(op, 6 * n);
    for i in 0..n {
        let (warp, lane) = (i / 32, i % 32);
        let at = |l: usize| x[warp * 32 + l];
        let o = &out[i * 6..i * 6 + 6];
        assert_eq!(o[0], at((lane + 5) % 32), "shfl, thread {i}");
        assert_eq!(
            o[1],
            if lane >= 3 { at(lane - 3) } else { at(lane) },
            "shfl_up, thread {i}"
        );
        assert_eq!(
            o[2],
            if lane + 3 < 32 {
                at(lane + 3)
            } else {
                at(lane)
            },
            "shfl_down, thread {i}"
        );
        assert_eq!(o[3], at(lane ^ 9), "shfl_xor, thread {i}");
        let ballot = (0..32)
            .filter(|&l| at(l) % 3 == 0)
            .fold(0u32, |b, l| b | 1 << l);
        assert_eq!(o[4] as u32, ballot, "ballot, thread {i}");
        let any7 = (0..32).any(|l| at(l) == 7) as i32;
        assert_eq!(o[5], any7 * 2 + 1, "any/all, thread {i}");
    }
}

#[test]
fn emulated_atomics_from_concurrent_blocks_lose_nothing() {
    let h = harness();
    let (blocks, threads) = (64u32, 256u32);
    let (c, m, s) = (h.upload(&[0u32]), h.upload(&[-1i32]), h.upload(&[0f32]));
    h.run(
        "selftest_atomics",
        Shape::linear(blocks, threads),
        &[Arg::Ptr(c), Arg::Ptr(m), Arg::Ptr(s)],
    )
    .unwrap();
    let n = blocks * threads;
    assert_eq!(h.download::<u32>(c, 1)[0], n);
    assert_eq!(h.download::<i32>(m, 1)[0], n as i32 - 1);
    assert_eq!(h.download::<f32>(s, 1)[0], n as f32 * 0.5);
}

#[test]
fn emulated_half_and_bfloat16_conversions_round_as_cuda() {
    let h = harness();
    let mut r = rand::rngs::StdRng::seed_from_u64(5);
    let mut x: Vec<f32> = (0..20000)
        .map(|_| f32::from_bits(r.gen::<u32>()))
        .filter(|v| !v.is_nan())
        .collect();
    x.extend([
        0.0,
        -0.0,
        1.0,
        65504.0,
        65519.0,
        65520.0,
        1e-8,
        2.98e-8,
        5.96e-8,
        6.1e-5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        3.389_531_4e38,
        f32::MAX,
        f32::MIN_POSITIVE,
    ]);
    for i in 0..2000 {
        x.push(i as f32 * 0.0137 - 13.0);
        x.push(f32::from_bits(0x3300_0000 + i)); // around half the smallest f16 subnormal
    }
    let n = x.len();
    let (xp, hp, bp) = (
        h.upload(&x),
        h.alloc(2 * n).unwrap(),
        h.alloc(2 * n).unwrap(),
    );
    h.run(
        "selftest_convert",
        Shape::linear(8, 256),
        &[Arg::Ptr(xp), Arg::Ptr(hp), Arg::Ptr(bp), Arg::I64(n as i64)],
    )
    .unwrap();
    let (hs, bs) = (h.download::<u16>(hp, n), h.download::<u16>(bp, n));
    for (i, &v) in x.iter().enumerate() {
        assert_eq!(
            hs[i],
            half::f16::from_f32(v).to_bits(),
            "f16 of {v:e} ({:#x})",
            v.to_bits()
        );
        assert_eq!(
            bs[i],
            half::bf16::from_f32(v).to_bits(),
            "bf16 of {v:e} ({:#x})",
            v.to_bits()
        );
    }
}

#[test]
fn emulated_dynamic_shared_memory_is_per_block_and_sized_by_the_launch() {
    let h = harness();
    let x: Vec<f32> = (0..512).map(|i| i as f32).collect();
    let (xp, op) = (h.upload(&x), h.alloc(4 * 512).unwrap());
    let mut shape = Shape::linear(1, 512);
    shape.dyn_smem = 512 * 4;
    h.run("selftest_dyn_reverse", shape, &[Arg::Ptr(xp), Arg::Ptr(op)])
        .unwrap();
    let want: Vec<f32> = x.iter().rev().copied().collect();
    assert_eq!(h.download::<f32>(op, 512), want);

    // 100 KiB needs the opt-in attribute; 228 KiB is more than an H200 has.
    shape.dyn_smem = 100 * 1024;
    expect_failure(
        &h,
        "selftest_dyn_reverse",
        shape,
        &[Arg::Ptr(xp), Arg::Ptr(op)],
        INVALID_VALUE,
        &["dynamic shared memory"],
    );
    shape.max_dyn_smem = 227 * 1024;
    h.run("selftest_dyn_reverse", shape, &[Arg::Ptr(xp), Arg::Ptr(op)])
        .unwrap();
    shape.dyn_smem = 228 * 1024;
    expect_failure(
        &h,
        "selftest_dyn_reverse",
        shape,
        &[Arg::Ptr(xp), Arg::Ptr(op)],
        INVALID_VALUE,
        &["dynamic shared memory"],
    );

    let mut shape = Shape::linear(1, 64);
    shape.dyn_smem = 64 * 4;
    expect_failure(
        &h,
        "selftest_dyn_overflow",
        shape,
        &[Arg::Ptr(op)],
        LAUNCH_FAILED,
        &["past the 256 bytes of dynamic shared memory"],
    );
}

#[test]
fn emulated_missing_barrier_is_a_wrong_answer() {
    let h = harness();
    let x = vec![1.0f32; 256];
    let (xp, op) = (h.upload(&x), h.alloc(4).unwrap());
    let mut wrong = 0;
    for s in [
        Schedule::Forward,
        Schedule::Shuffle(1),
        Schedule::Shuffle(2),
    ] {
        h.set_schedule(s);
        h.run(
            "selftest_block_sum",
            Shape::linear(1, 256),
            &[Arg::Ptr(xp), Arg::Ptr(op)],
        )
        .unwrap();
        assert_eq!(
            h.download::<f32>(op, 1)[0],
            256.0,
            "the correct kernel, {s:?}"
        );
        h.run(
            "selftest_missing_barrier",
            Shape::linear(1, 256),
            &[Arg::Ptr(xp), Arg::Ptr(op)],
        )
        .unwrap();
        let got = h.download::<f32>(op, 1)[0];
        println!("emulated selftest_missing_barrier, {s:?}: {got} (256 with the barrier)");
        wrong += (got != 256.0) as usize;
    }
    assert_eq!(wrong, 3, "every schedule but reverse exposes the race");
}

#[test]
fn emulated_out_of_bounds_accesses_fail_the_launch() {
    let h = harness();
    let x = vec![1.0f32; 128];
    let (xp, op) = (h.upload(&x), h.alloc(4 * 128).unwrap());
    // An allocation that does not fill its last 16 bytes: the slack is checked after the launch.
    let odd = h.upload(&[1.0f32; 127]);
    let gone = h.upload(&x);
    h.free(gone);
    let host = x.as_ptr() as u64;
    // (kernel, threads, source, destination, what the message says)
    let cases: [(&str, u32, u64, u64, &[&str]); 7] = [
        (
            "selftest_oob_read",
            128,
            xp,
            op,
            &[
                "illegal read",
                "offset 512 of allocation",
                "which has 512 bytes",
                "past the end",
                "thread (127,0,0)",
            ],
        ),
        (
            "selftest_oob_write",
            128,
            xp,
            op,
            &[
                "illegal write",
                "offset 512 of allocation",
                "past the end",
                "thread (127,0,0)",
            ],
        ),
        (
            "selftest_underflow",
            128,
            xp,
            op,
            &["before the start of allocation"],
        ),
        (
            "selftest_oob_write",
            127,
            xp,
            odd,
            &["past the end of allocation"],
        ),
        ("selftest_oob_read", 64, gone, op, &["freed"]),
        ("selftest_oob_read", 64, host, op, &["host address"]),
        ("selftest_oob_read", 32, 0, op, &["not device memory"]),
    ];
    for (kernel, threads, src, dst, words) in cases {
        let args = [Arg::Ptr(src), Arg::Ptr(dst)];
        expect_failure(
            &h,
            kernel,
            Shape::linear(1, threads),
            &args,
            ILLEGAL_ADDRESS,
            words,
        );
    }
    // The harness keeps working after a fault.
    let args = [Arg::Ptr(xp), Arg::Ptr(op)];
    h.run("selftest_block_sum", Shape::linear(1, 128), &args)
        .unwrap();
    assert_eq!(h.download::<f32>(op, 1)[0], 128.0);
}

#[test]
fn emulated_bad_launch_sizes_are_refused() {
    let h = harness();
    let op = h.alloc(4 * 2048).unwrap();
    let shape = |grid: [u32; 3], block: [u32; 3]| Shape {
        grid,
        block,
        ..Shape::linear(1, 1)
    };
    let cases: [(Shape, i32, &str); 5] = [
        (
            shape([1, 1, 1], [1025, 1, 1]),
            INVALID_VALUE,
            "at most 1024",
        ),
        (shape([1, 1, 1], [32, 32, 2]), INVALID_VALUE, "2048 threads"),
        (
            shape([1, 1, 1], [512, 1, 1]),
            OUT_OF_RESOURCES,
            "__launch_bounds__(256)",
        ),
        (shape([0, 1, 1], [32, 1, 1]), INVALID_VALUE, "empty grid"),
        (shape([1, 70000, 1], [32, 1, 1]), INVALID_VALUE, "65535"),
    ];
    for (s, code, words) in cases {
        expect_failure(&h, "selftest_bounded", s, &[Arg::Ptr(op)], code, &[words]);
    }
    h.run("selftest_bounded", Shape::linear(2, 256), &[Arg::Ptr(op)])
        .unwrap();
}

#[test]
fn emulated_barriers_reached_by_some_threads_fail() {
    let h = harness();
    let op = h.alloc(4 * 256).unwrap();
    for s in [Schedule::Forward, Schedule::Reverse, Schedule::Shuffle(3)] {
        h.set_schedule(s);
        let e = h
            .run(
                "selftest_divergent_barrier",
                Shape::linear(1, 128),
                &[Arg::Ptr(op)],
            )
            .unwrap_err();
        assert_eq!(e.code, LAUNCH_FAILED);
        assert!(
            e.message.contains("only some of the block's threads"),
            "{s:?}: {}",
            e.message
        );
        println!("emulated selftest_divergent_barrier, {s:?}: {}", e.message);
        expect_failure(
            &h,
            "selftest_split_barrier",
            Shape::linear(1, 128),
            &[Arg::Ptr(op)],
            LAUNCH_FAILED,
            &["divergent barriers"],
        );
    }
}

#[test]
fn emulated_shuffle_masks_must_name_every_participant() {
    let h = harness();
    let op = h.alloc(4 * 64).unwrap();
    let cases = [
        (
            "selftest_shfl_mask_excludes_caller",
            "which leaves out lane",
        ),
        (
            "selftest_shfl_reads_outside_mask",
            "which mask 0x0000ffff leaves out",
        ),
        ("selftest_shfl_exited_lane", "has returned"),
    ];
    for (kernel, words) in cases {
        let args = [Arg::Ptr(op)];
        expect_failure(
            &h,
            kernel,
            Shape::linear(1, 64),
            &args,
            LAUNCH_FAILED,
            &[words],
        );
    }
}

#[test]
fn emulated_misaligned_vector_access_fails() {
    let h = harness();
    let (xp, op) = (h.upload(&[1.0f32; 64]), h.alloc(4 * 64).unwrap());
    expect_failure(
        &h,
        "selftest_misaligned",
        Shape::linear(1, 32),
        &[Arg::Ptr(xp), Arg::Ptr(op)],
        MISALIGNED_ADDRESS,
        &["misaligned address"],
    );
}

#[test]
fn emulated_half_warps_exchange_independently() {
    let h = harness();
    let op = h.alloc(4 * 64).unwrap();
    h.run("selftest_half_warps", Shape::linear(1, 64), &[Arg::Ptr(op)])
        .unwrap();
    let want: Vec<f32> = (0..64).map(|i| (i ^ 1) as f32).collect();
    assert_eq!(h.download::<f32>(op, 64), want);
}

#[test]
fn emulated_division_by_zero_fails_the_launch() {
    let h = harness();
    let (zeros, op) = (h.upload(&[0i32; 32]), h.alloc(4 * 32).unwrap());
    let args = [Arg::Ptr(zeros), Arg::Ptr(op)];
    expect_failure(
        &h,
        "selftest_div_zero",
        Shape::linear(1, 32),
        &args,
        LAUNCH_FAILED,
        &["division by zero"],
    );
}
