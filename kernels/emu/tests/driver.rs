//! The stand-in CUDA driver and cuBLAS, called as cudarc calls them (by symbol, through the
//! library): streams run in order and only when waited for, so a missing synchronization reads
//! stale data; a launch an H200 would refuse is refused at once; a faulting kernel makes the
//! context's error sticky, with the emulator's explanation in cuGetErrorString; cuBLAS checks its
//! arguments and every matrix's extent. One test, in order: the sticky error ends the context.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use kvgate_cuda_emu::lib_path;

type R = c_int;
const SUCCESS: R = 0;
const INVALID_VALUE: R = 1;
const ILLEGAL_ADDRESS: R = 700;
const LAUNCH_OUT_OF_RESOURCES: R = 701;

struct Driver {
    lib: libloading::Library,
}

macro_rules! sym {
    ($d:expr, $name:literal, $ty:ty) => {{
        // SAFETY: the stand-in exports $name with this C signature.
        let f: $ty = unsafe {
            *$d.lib
                .get::<$ty>(concat!($name, "\0").as_bytes())
                .expect($name)
        };
        f
    }};
}

impl Driver {
    fn alloc(&self, bytes: usize) -> u64 {
        let f = sym!(
            self,
            "cuMemAlloc_v2",
            unsafe extern "C" fn(*mut u64, usize) -> R
        );
        let mut p = 0;
        // SAFETY: out-pointer to a local.
        assert_eq!(unsafe { f(&mut p, bytes) }, SUCCESS);
        p
    }
    fn pinned(&self, bytes: usize) -> *mut u8 {
        let f = sym!(
            self,
            "cuMemHostAlloc",
            unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> R
        );
        let mut p = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        assert_eq!(unsafe { f(&mut p, bytes, 0) }, SUCCESS);
        p as *mut u8
    }
    fn htod_async(&self, dst: u64, src: &[f32], stream: *mut c_void) -> R {
        let f = sym!(
            self,
            "cuMemcpyHtoDAsync_v2",
            unsafe extern "C" fn(u64, *const c_void, usize, *mut c_void) -> R
        );
        // SAFETY: src is a live slice; the stand-in stages pageable sources at once.
        unsafe {
            f(
                dst,
                src.as_ptr() as *const c_void,
                std::mem::size_of_val(src),
                stream,
            )
        }
    }
    fn dtoh_async(&self, dst: *mut u8, src: u64, bytes: usize, stream: *mut c_void) -> R {
        let f = sym!(
            self,
            "cuMemcpyDtoHAsync_v2",
            unsafe extern "C" fn(*mut c_void, u64, usize, *mut c_void) -> R
        );
        // SAFETY: dst has room for `bytes`.
        unsafe { f(dst as *mut c_void, src, bytes, stream) }
    }
    fn stream(&self) -> *mut c_void {
        let f = sym!(
            self,
            "cuStreamCreate",
            unsafe extern "C" fn(*mut *mut c_void, c_uint) -> R
        );
        let mut s = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        assert_eq!(unsafe { f(&mut s, 0) }, SUCCESS);
        s
    }
    fn sync(&self, s: *mut c_void) -> R {
        let f = sym!(
            self,
            "cuStreamSynchronize",
            unsafe extern "C" fn(*mut c_void) -> R
        );
        // SAFETY: a stream from cuStreamCreate.
        unsafe { f(s) }
    }
    fn function(&self, name: &str) -> *mut c_void {
        // A PTX image naming the kernels is enough for the stand-in (it runs its own build).
        let ptx =
            format!(".version 8.0\n.target sm_90\n.visible .entry {name}(\n)\n{{ ret; }}\n\0");
        let load = sym!(
            self,
            "cuModuleLoadData",
            unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> R
        );
        let get = sym!(
            self,
            "cuModuleGetFunction",
            unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> R
        );
        let (mut m, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
        let cname = std::ffi::CString::new(name).unwrap();
        // SAFETY: NUL-terminated image and name; out-pointers to locals.
        unsafe {
            assert_eq!(load(&mut m, ptx.as_ptr() as *const c_void), SUCCESS);
            assert_eq!(get(&mut f, m, cname.as_ptr()), SUCCESS);
        }
        f
    }
    fn launch(
        &self,
        f: *mut c_void,
        grid: u32,
        block: u32,
        stream: *mut c_void,
        args: &mut [u64],
    ) -> R {
        let launch = sym!(
            self,
            "cuLaunchKernel",
            unsafe extern "C" fn(
                *mut c_void,
                c_uint,
                c_uint,
                c_uint,
                c_uint,
                c_uint,
                c_uint,
                c_uint,
                *mut c_void,
                *mut *mut c_void,
                *mut *mut c_void,
            ) -> R
        );
        let mut params: Vec<*mut c_void> = args
            .iter_mut()
            .map(|a| a as *mut u64 as *mut c_void)
            .collect();
        // SAFETY: params point at 8-byte argument values that outlive the call (they are copied).
        unsafe {
            launch(
                f,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    }
    fn error_string(&self, code: R) -> String {
        let f = sym!(
            self,
            "cuGetErrorString",
            unsafe extern "C" fn(R, *mut *const c_char) -> R
        );
        let mut s = std::ptr::null();
        // SAFETY: the stand-in returns a NUL-terminated string that stays valid.
        unsafe {
            f(code, &mut s);
            CStr::from_ptr(s).to_string_lossy().into_owned()
        }
    }
}

fn floats(p: *const u8, n: usize) -> Vec<f32> {
    // SAFETY: p points at n initialized f32 values (pinned memory of the test).
    unsafe { std::slice::from_raw_parts(p as *const f32, n).to_vec() }
}

#[test]
fn emulated_driver_orders_streams_refuses_bad_launches_and_sticks_on_faults() {
    // SAFETY: the stand-in's initializers only register kernels.
    let lib = unsafe { libloading::Library::new(lib_path()) }.expect("the stand-in loads");
    let d = Driver { lib };
    let init = sym!(d, "cuInit", unsafe extern "C" fn(c_uint) -> R);
    // SAFETY: plain call.
    assert_eq!(unsafe { init(0) }, SUCCESS);
    let s = d.stream();
    let n = 256usize;
    let (x, out) = (d.alloc(4 * n), d.alloc(4));
    let host = d.pinned(4);
    // SAFETY: host has 4 bytes.
    unsafe { std::ptr::write(host as *mut f32, -1.0) };

    // Upload, reduce, download into pinned memory: nothing happens until the stream is waited for.
    let ones = vec![1.0f32; n];
    assert_eq!(d.htod_async(x, &ones, s), SUCCESS);
    let sum = d.function("selftest_block_sum");
    assert_eq!(d.launch(sum, 1, n as u32, s, &mut [x, out]), SUCCESS);
    assert_eq!(d.dtoh_async(host, out, 4, s), SUCCESS);
    assert_eq!(
        floats(host, 1),
        [-1.0],
        "emulated: read before the stream ran: still the old value"
    );
    assert_eq!(d.sync(s), SUCCESS);
    assert_eq!(
        floats(host, 1),
        [n as f32],
        "emulated: after cuStreamSynchronize"
    );

    // A copy into pageable memory waits for the stream itself (as the real driver does).
    let twos = vec![2.0f32; n];
    assert_eq!(d.htod_async(x, &twos, s), SUCCESS);
    assert_eq!(d.launch(sum, 1, n as u32, s, &mut [x, out]), SUCCESS);
    let mut pageable = [0.0f32];
    assert_eq!(
        d.dtoh_async(pageable.as_mut_ptr() as *mut u8, out, 4, s),
        SUCCESS
    );
    assert_eq!(pageable, [2.0 * n as f32]);

    // Two streams: an event orders the second after the first.
    let s2 = d.stream();
    let ev_create = sym!(
        d,
        "cuEventCreate",
        unsafe extern "C" fn(*mut *mut c_void, c_uint) -> R
    );
    let ev_record = sym!(
        d,
        "cuEventRecord",
        unsafe extern "C" fn(*mut c_void, *mut c_void) -> R
    );
    let wait = sym!(
        d,
        "cuStreamWaitEvent",
        unsafe extern "C" fn(*mut c_void, *mut c_void, c_uint) -> R
    );
    let mut ev = std::ptr::null_mut();
    let threes = vec![3.0f32; n];
    // SAFETY: out-pointer to a local; handles from the stand-in.
    unsafe {
        assert_eq!(ev_create(&mut ev, 0), SUCCESS);
        assert_eq!(d.htod_async(x, &threes, s), SUCCESS);
        assert_eq!(ev_record(ev, s), SUCCESS);
        assert_eq!(wait(s2, ev, 0), SUCCESS);
    }
    assert_eq!(d.launch(sum, 1, n as u32, s2, &mut [x, out]), SUCCESS);
    assert_eq!(d.dtoh_async(host, out, 4, s2), SUCCESS);
    assert_eq!(d.sync(s2), SUCCESS);
    assert_eq!(
        floats(host, 1),
        [3.0 * n as f32],
        "emulated: s2 waited for s's upload"
    );

    // Launches an H200 refuses fail at once, and the context goes on.
    assert_eq!(d.launch(sum, 1, 1025, s, &mut [x, out]), INVALID_VALUE);
    let bounded = d.function("selftest_bounded");
    assert_eq!(
        d.launch(bounded, 1, 512, s, &mut [out]),
        LAUNCH_OUT_OF_RESOURCES
    );
    let host_ptr = ones.as_ptr() as u64;
    assert_eq!(
        d.launch(sum, 1, 32, s, &mut [host_ptr, out]),
        ILLEGAL_ADDRESS
    );
    assert!(d.error_string(ILLEGAL_ADDRESS).contains("a host address"));
    assert_eq!(d.sync(s), SUCCESS);

    // A copy past an allocation's end is refused when it is queued, and so is a host-to-device
    // copy whose destination is host memory (swapped arguments).
    assert_eq!(d.htod_async(out, &ones, s), INVALID_VALUE);
    assert_eq!(d.htod_async(host as u64, &ones[..1], s), INVALID_VALUE);
    assert!(d.error_string(INVALID_VALUE).contains("swapped arguments"));

    // cuBLAS: argument checks at the call, extents when it runs.
    let create = sym!(
        d,
        "cublasCreate_v2",
        unsafe extern "C" fn(*mut *mut c_void) -> c_int
    );
    let set_stream = sym!(
        d,
        "cublasSetStream_v2",
        unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int
    );
    type Sgemm = unsafe extern "C" fn(
        *mut c_void,
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
        *const f32,
        u64,
        c_int,
        u64,
        c_int,
        *const f32,
        u64,
        c_int,
    ) -> c_int;
    let sgemm = sym!(d, "cublasSgemm_v2", Sgemm);
    let mut h = std::ptr::null_mut();
    let (one, zero) = (1.0f32, 0.0f32);
    let (a, b, c) = (d.alloc(4 * 6), d.alloc(4 * 3), d.alloc(4 * 2));
    // C (2x1) = A (2x3, column-major, lda 2) * B (3x1).
    assert_eq!(d.htod_async(a, &[1., 2., 3., 4., 5., 6.], s), SUCCESS);
    assert_eq!(d.htod_async(b, &[1., 1., 1.], s), SUCCESS);
    // SAFETY: out-pointer to a local; device pointers from the stand-in; scalars on the host.
    unsafe {
        assert_eq!(create(&mut h), 0);
        assert_eq!(set_stream(h, s), 0);
        assert_eq!(sgemm(h, 0, 0, 2, 1, 3, &one, a, 2, b, 3, &zero, c, 2), 0);
        assert_eq!(
            sgemm(h, 0, 0, 2, 1, 3, &one, a, 1, b, 3, &zero, c, 2),
            7,
            "lda < m"
        );
    }
    let mut got = [0.0f32; 2];
    assert_eq!(d.dtoh_async(got.as_mut_ptr() as *mut u8, c, 8, s), SUCCESS);
    assert_eq!(got, [9.0, 12.0]);

    // A GEMM whose A is read transposed with too large a leading dimension runs past A: the
    // fault surfaces at the next wait and sticks.
    // SAFETY: as above.
    unsafe { assert_eq!(sgemm(h, 1, 0, 2, 1, 3, &one, a, 4, b, 3, &zero, c, 2), 0) };
    let code = d.sync(s);
    assert_eq!(code, ILLEGAL_ADDRESS);
    let why = d.error_string(code);
    println!("emulated sticky error: {why}");
    assert!(
        why.contains("cublasSgemm: matrix A") && why.contains("emulated"),
        "{why}"
    );
    assert_eq!(
        d.launch(sum, 1, 32, s, &mut [x, out]),
        ILLEGAL_ADDRESS,
        "the error sticks"
    );
}
