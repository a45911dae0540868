//! SIMD building blocks shared by the kernels: which instruction set to use ([`Isa`], detected
//! once at run time), the storage element types ([`Elem`]: f32, f16, bf16, each widened to f32),
//! and AVX-512 and AVX2 helpers (vectorized `exp`, transposing 16- and 8-way horizontal sums).
//!
//! Everything SIMD here is `#[inline(always)]` and only called from functions compiled with
//! `#[target_feature(enable = "...")]`, so it inlines into those and never runs on a CPU
//! without the feature (the callers check [`Isa`] first).

use half::{bf16, f16};

/// The instruction set the kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust loops (auto-vectorized for the build target).
    Portable,
    /// AVX2 with FMA and F16C (Haswell and later, Zen 1 to Zen 3).
    Avx2,
    /// AVX-512F with FMA and F16C (Skylake-SP and later, Zen 4 and later).
    Avx512,
    /// AVX-512 with the AMX-INT8 tile unit (Sapphire Rapids and later), which multiplies
    /// quantized weights by a batch of rows; everything else runs the AVX-512 kernels.
    Amx,
}

impl Isa {
    /// The best instruction set this CPU supports, unless `KVGATE_CPU_ISA` (`portable`, `avx2`,
    /// `avx512`, `amx`) names a lower one: benchmarks compare the paths on one machine that way. A
    /// name the CPU cannot run, or an unknown one, is ignored.
    pub fn detect() -> Self {
        let best = Self::available().last().copied().unwrap_or(Isa::Portable);
        match std::env::var("KVGATE_CPU_ISA")
            .ok()
            .and_then(|v| Self::parse(&v))
        {
            Some(asked) if Self::available().contains(&asked) => asked,
            _ => best,
        }
    }

    /// Every instruction set this CPU supports, slowest first (always starts with
    /// [`Isa::Portable`]).
    pub fn available() -> Vec<Isa> {
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut isas = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                isas.push(Isa::Avx2);
                if has!("avx512f") {
                    isas.push(Isa::Avx512);
                    if has!("avx512bw") && amx_int8_usable() {
                        isas.push(Isa::Amx);
                    }
                }
            }
        }
        isas
    }

    /// Whether the AVX-512 kernels run ([`Isa::Avx512`] and [`Isa::Amx`]).
    pub fn avx512(self) -> bool {
        matches!(self, Isa::Avx512 | Isa::Amx)
    }

    /// Whether the integer dot products take AVX-512 VNNI's `vpdpbusd`: an AVX-512 ISA on a CPU
    /// with VNNI and VL (Ice Lake, Sapphire Rapids, Zen 4).
    pub fn vnni(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            self.avx512() && has!("avx512vnni") && has!("avx512vl")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// The instruction set a name (`portable`, `avx2`, `avx512`, `amx`) stands for.
    pub fn parse(name: &str) -> Option<Isa> {
        match name.trim().to_ascii_lowercase().as_str() {
            "portable" => Some(Isa::Portable),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            "amx" => Some(Isa::Amx),
            _ => None,
        }
    }
}

/// Whether this CPU has the AMX-INT8 tile unit and the kernel lets this process use it. Linux
/// enables the tiles' register state per process, on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
/// the request is made once, and a refusal (an older kernel, a hypervisor that hides the state)
/// leaves AMX unused.
#[cfg(target_arch = "x86_64")]
fn amx_int8_usable() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(|| {
        // CPUID leaf 7, sub-leaf 0: EDX bit 24 is AMX-TILE, bit 25 AMX-INT8 (zeros where the
        // leaf is not supported).
        let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
        let cpu = leaf7.edx & (1 << 24) != 0 && leaf7.edx & (1 << 25) != 0;
        #[cfg(target_os = "linux")]
        {
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a plain system call with integer arguments; it changes only whether this
            // process may use the tile state.
            cpu && unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                )
            } == 0
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = cpu;
            false
        }
    })
}

/// A storage element type: f32, f16 or bf16.
pub trait Elem: Copy + Send + Sync + 'static {
    /// Widens one value.
    fn to_f32(self) -> f32;

    /// Loads 16 consecutive values widened to f32.
    ///
    /// # Safety
    /// `p..p + 16` must be readable, and the CPU must support AVX-512F and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;

    /// Loads 8 consecutive values widened to f32.
    ///
    /// # Safety
    /// `p..p + 8` must be readable, and the CPU must support AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller guarantees 16 readable values and AVX-512F.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller guarantees 8 readable values and AVX.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 32 readable bytes and AVX-512F (vcvtph2ps zmm).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 16 readable bytes and F16C (vcvtph2ps ymm).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 32 readable bytes and AVX-512F. bf16 is the top half of
        // an f32, so zero-extending to 32 bits and shifting left by 16 widens it exactly.
        unsafe {
            let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 16 readable bytes and AVX2; widened as in load16.
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub use x86::*;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Loads `n < 16` values widened to f32, zero-filling the other lanes.
    ///
    /// # Safety
    /// `p..p + n` must be readable and the CPU must support AVX-512F and F16C.
    #[inline(always)]
    pub unsafe fn load_partial<E: super::Elem>(p: *const E, n: usize) -> __m512 {
        debug_assert!(n <= 16);
        let mut buf = [0.0f32; 16];
        for (i, b) in buf.iter_mut().enumerate().take(n) {
            // SAFETY: i < n, and the caller guarantees n readable values.
            *b = unsafe { *p.add(i) }.to_f32();
        }
        // SAFETY: buf holds 16 values; AVX-512F per the caller.
        unsafe { _mm512_loadu_ps(buf.as_ptr()) }
    }

    /// `exp`'s input range: below `EXP_LO` the result flushes to 0, above `EXP_HI` it clamps.
    const EXP_LO: f32 = -87.336_55;
    const EXP_HI: f32 = 88.376_26;
    /// ln 2 in two parts (high bits exact), for `r = x - n ln 2` without cancellation.
    const EXP_LN2: [f32; 2] = [0.693_359_4, -2.121_944_4e-4];
    /// Cephes' polynomial for `(e^r - 1 - r) / r^2`, highest degree first.
    const EXP_POLY: [f32; 6] = [
        1.987_569_1e-4,
        1.398_2e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];

    /// Loads `n < 8` values widened to f32, zero-filling the other lanes.
    ///
    /// # Safety
    /// `p..p + n` must be readable and the CPU must support AVX.
    #[inline(always)]
    pub unsafe fn load_partial8<E: super::Elem>(p: *const E, n: usize) -> __m256 {
        debug_assert!(n <= 8);
        let mut buf = [0.0f32; 8];
        for (i, b) in buf.iter_mut().enumerate().take(n) {
            // SAFETY: i < n, and the caller guarantees n readable values.
            *b = unsafe { *p.add(i) }.to_f32();
        }
        // SAFETY: buf holds 8 values; AVX per the caller.
        unsafe { _mm256_loadu_ps(buf.as_ptr()) }
    }

    /// `e^x` per lane with AVX2 and FMA: the same polynomial and range as [`exp512`], with the
    /// power of two built in the exponent bits (no `scalef` before AVX-512).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[inline(always)]
    pub unsafe fn exp256(x: __m256) -> __m256 {
        // SAFETY: register-only AVX2/FMA arithmetic; the caller guarantees the features.
        unsafe {
            let lo = _mm256_set1_ps(EXP_LO);
            let hi = _mm256_set1_ps(EXP_HI);
            let underflow = _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo);
            let x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            );
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2[0]), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2[1]), r);
            let mut p = _mm256_set1_ps(EXP_POLY[0]);
            for &c in &EXP_POLY[1..] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
            }
            let r2 = _mm256_mul_ps(r, r);
            let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
            // 2^n for n in [-126, 128]: n = 128 (x near the top of the range) is split in two
            // factors so that the exponent field never overflows.
            let n1 = _mm256_min_ps(n, _mm256_set1_ps(127.0));
            let n2 = _mm256_sub_ps(n, n1);
            let y = _mm256_mul_ps(_mm256_mul_ps(y, pow2_256(n1)), pow2_256(n2));
            _mm256_andnot_ps(underflow, y)
        }
    }

    /// `2^e` for integral lanes `e` in [-126, 127], built in the exponent field.
    #[inline(always)]
    unsafe fn pow2_256(e: __m256) -> __m256 {
        // SAFETY: register-only AVX2 arithmetic; the caller guarantees the feature.
        unsafe {
            let biased = _mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased))
        }
    }

    /// Horizontal sums of 8 vectors at once: lane `i` of the result is the sum of `v[i]`'s
    /// lanes (three levels of `hadd` and one cross-lane add).
    ///
    /// # Safety
    /// The CPU must support AVX.
    #[inline(always)]
    pub unsafe fn reduce8(v: &[__m256; 8]) -> __m256 {
        // SAFETY: register-only AVX shuffles and adds; the caller guarantees the feature.
        unsafe {
            // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | the same for lanes 4..8].
            let t0 = _mm256_hadd_ps(v[0], v[1]);
            let t1 = _mm256_hadd_ps(v[2], v[3]);
            let t2 = _mm256_hadd_ps(v[4], v[5]);
            let t3 = _mm256_hadd_ps(v[6], v[7]);
            // [v0, v1, v2, v3 partials over lanes 0..4 | the same over lanes 4..8].
            let u0 = _mm256_hadd_ps(t0, t1);
            let u1 = _mm256_hadd_ps(t2, t3);
            let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
            let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
            _mm256_add_ps(lo, hi)
        }
    }

    /// The sum of one vector's lanes.
    ///
    /// # Safety
    /// The CPU must support AVX.
    #[inline(always)]
    pub unsafe fn hsum256(v: __m256) -> f32 {
        // SAFETY: register-only AVX/SSE shuffles and adds; the caller guarantees the feature.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
            _mm_cvtss_f32(s)
        }
    }

    /// `e^x` per lane, Cephes' single-precision polynomial (max relative error about 2e-7).
    /// Lanes below -87.3 flush to 0; lanes of -inf give 0.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[inline(always)]
    pub unsafe fn exp512(x: __m512) -> __m512 {
        // SAFETY: register-only AVX-512F arithmetic; the caller guarantees the feature.
        unsafe {
            let lo = _mm512_set1_ps(EXP_LO);
            let hi = _mm512_set1_ps(EXP_HI);
            let underflow = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo);
            let x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
            // n = round(x / ln 2); r = x - n ln 2 (in two parts for precision).
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
            );
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2[0]), x);
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2[1]), r);
            let mut p = _mm512_set1_ps(EXP_POLY[0]);
            for &c in &EXP_POLY[1..] {
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
            }
            let r2 = _mm512_mul_ps(r, r);
            let y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
            let y = _mm512_scalef_ps(y, n);
            _mm512_mask_mov_ps(y, underflow, _mm512_setzero_ps())
        }
    }

    /// Horizontal sums of 16 vectors at once: lane `i` of the result is the sum of `v[i]`'s
    /// lanes. About 45 shuffles and adds, against about 130 for 16 separate reductions.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[inline(always)]
    pub unsafe fn reduce16(v: &[__m512; 16]) -> __m512 {
        // SAFETY: register-only AVX-512F shuffles and adds; the caller guarantees the feature.
        unsafe {
            // Each level halves the vector count: pair a (even sources) with b (odd sources) so
            // that half of every output holds a's partial sums and half holds b's.
            // Level 1: 256-bit halves. w[i] = [v[2i] partial (8 lanes) | v[2i+1] partial].
            let mut w = [_mm512_setzero_ps(); 8];
            for i in 0..8 {
                let (a, b) = (v[2 * i], v[2 * i + 1]);
                let lo = _mm512_shuffle_f32x4::<0b0100_0100>(a, b); // a0 a1 b0 b1
                let hi = _mm512_shuffle_f32x4::<0b1110_1110>(a, b); // a2 a3 b2 b3
                w[i] = _mm512_add_ps(lo, hi);
            }
            // Level 2: 128-bit lanes. x[i] = [w[2i].a, w[2i+1].a, w[2i].b, w[2i+1].b] partials.
            let mut x = [_mm512_setzero_ps(); 4];
            for i in 0..4 {
                let (a, b) = (w[2 * i], w[2 * i + 1]);
                let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b); // a0 a2 b0 b2
                let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b); // a1 a3 b1 b3
                x[i] = _mm512_add_ps(lo, hi);
            }
            // Level 3: pairs of floats inside each 128-bit lane.
            let mut y = [_mm512_setzero_ps(); 2];
            for i in 0..2 {
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                let lo = _mm512_shuffle_ps::<0b01_00_01_00>(a, b); // a0 a1 b0 b1
                let hi = _mm512_shuffle_ps::<0b11_10_11_10>(a, b); // a2 a3 b2 b3
                y[i] = _mm512_add_ps(lo, hi);
            }
            // Level 4: single floats.
            let lo = _mm512_shuffle_ps::<0b10_00_10_00>(y[0], y[1]); // a0 a2 b0 b2
            let hi = _mm512_shuffle_ps::<0b11_01_11_01>(y[0], y[1]); // a1 a3 b1 b3
            let z = _mm512_add_ps(lo, hi);
            // The levels leave source i in lane PERM[i]; gather them back in order.
            let idx = _mm512_loadu_si512(REDUCE16_ORDER.as_ptr().cast());
            _mm512_permutexvar_ps(idx, z)
        }
    }

    /// Lane of `reduce16`'s shuffled result that holds source `i`: the levels leave source
    /// `4f + u` in lane `4u + f` (a 4x4 transpose); checked by the unit test below.
    static REDUCE16_ORDER: [i32; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn reduce16_sums_each_vector_in_order() {
            if !super::super::Isa::detect().avx512() {
                return;
            }
            let vals: Vec<[f32; 16]> = (0..16)
                .map(|i| std::array::from_fn(|l| (i * 100 + l) as f32 * 0.5))
                .collect();
            // SAFETY: AVX-512F was detected above; each array holds 16 values.
            let got: [f32; 16] = unsafe {
                let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(vals[i].as_ptr()));
                std::mem::transmute(reduce16(&v))
            };
            for (i, row) in vals.iter().enumerate() {
                let want: f32 = row.iter().sum();
                assert_eq!(got[i], want, "lane {i}");
            }
        }

        #[test]
        fn reduce8_and_hsum256_sum_each_vector() {
            if !super::super::Isa::available().contains(&super::super::Isa::Avx2) {
                return;
            }
            let vals: Vec<[f32; 8]> = (0..8)
                .map(|i| std::array::from_fn(|l| (i * 100 + l) as f32 * 0.5))
                .collect();
            // SAFETY: AVX2 was detected above; each array holds 8 values.
            let (got, each): ([f32; 8], Vec<f32>) = unsafe {
                let v: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(vals[i].as_ptr()));
                let each = v.iter().map(|&x| hsum256(x)).collect();
                (std::mem::transmute::<__m256, [f32; 8]>(reduce8(&v)), each)
            };
            for (i, row) in vals.iter().enumerate() {
                let want: f32 = row.iter().sum();
                assert_eq!(got[i], want, "lane {i}");
                assert_eq!(each[i], want, "vector {i}");
            }
        }

        #[test]
        fn exp256_matches_std() {
            if !super::super::Isa::available().contains(&super::super::Isa::Avx2) {
                return;
            }
            let mut xs: Vec<f32> = (0..4096).map(|i| -100.0 + i as f32 * 0.0458).collect();
            xs.extend([88.3, 88.376, -87.3, 0.0, -0.0, 1e-30]);
            while !xs.len().is_multiple_of(8) {
                xs.push(1.0);
            }
            for chunk in xs.chunks_exact(8) {
                // SAFETY: AVX2 and FMA detected; chunk has 8 values.
                let got: [f32; 8] =
                    unsafe { std::mem::transmute(exp256(_mm256_loadu_ps(chunk.as_ptr()))) };
                for (x, g) in chunk.iter().zip(got) {
                    let want = x.exp();
                    let tol = 4e-7 * want + f32::MIN_POSITIVE * 4.0;
                    assert!(
                        (g - want).abs() <= tol.max(1e-37),
                        "exp({x}) = {g}, want {want}"
                    );
                }
            }
            // SAFETY: AVX2 detected.
            let z: [f32; 8] =
                unsafe { std::mem::transmute(exp256(_mm256_set1_ps(f32::NEG_INFINITY))) };
            assert!(z.iter().all(|&v| v == 0.0));
        }

        #[test]
        fn exp512_matches_std() {
            if !super::super::Isa::detect().avx512() {
                return;
            }
            let xs: Vec<f32> = (0..4096).map(|i| -100.0 + i as f32 * 0.0458).collect();
            for chunk in xs.chunks_exact(16) {
                // SAFETY: AVX-512F detected; chunk has 16 values.
                let got: [f32; 16] =
                    unsafe { std::mem::transmute(exp512(_mm512_loadu_ps(chunk.as_ptr()))) };
                for (x, g) in chunk.iter().zip(got) {
                    let want = x.exp();
                    let tol = 4e-7 * want + f32::MIN_POSITIVE * 4.0;
                    assert!(
                        (g - want).abs() <= tol.max(1e-37),
                        "exp({x}) = {g}, want {want}"
                    );
                }
            }
            // SAFETY: AVX-512F detected.
            let z: [f32; 16] =
                unsafe { std::mem::transmute(exp512(_mm512_set1_ps(f32::NEG_INFINITY))) };
            assert!(z.iter().all(|&v| v == 0.0));
        }
    }
}
