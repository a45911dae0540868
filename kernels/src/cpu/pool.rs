//! The CPU kernels' thread pool: the calling thread and `threads - 1` workers share the tasks of
//! one parallel call, claimed one at a time from an atomic counter.
//!
//! A decode step runs some two hundred small matmuls, each a few tens of microseconds of memory
//! traffic. A pool whose idle threads sleep in the kernel pays a futex wake-up (tens of
//! microseconds on a virtual machine) at every one of them, which at batch 1 cost about as much
//! as the matmuls themselves. Here an idle worker spins (with the CPU's pause hint, yielding now
//! and then) for [`SPIN`] after its last task before it sleeps, so the calls of one step find
//! it awake; an engine with nothing to do sleeps after that and costs nothing.
//!
//! One call at a time uses the workers. A call that finds them busy (another model in the same
//! process, or a task that itself calls in) runs its tasks on its own thread instead of waiting.
//!
//! Protocol: `state` packs an epoch, a `closed` bit and the count of workers inside the current
//! call. The caller publishes a call by writing the job and storing a new epoch (open, no one
//! inside); a worker joins by incrementing the count with a compare-exchange on that same epoch
//! while it is open, so a worker that arrives late (the call closed, or the next one begun)
//! never reads a job it did not join. When every task is claimed the caller closes the call and
//! waits for the count to reach zero; only then does its closure go out of scope.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle worker spins for the next call before it sleeps.
const SPIN: Duration = Duration::from_micros(500);
/// Pause hints between yields of the CPU while spinning (a machine with more runnable threads
/// than cores gets the core back quickly).
const SPINS_PER_YIELD: u32 = 64;

const ACTIVE_MASK: u64 = 0xffff;
const CLOSED: u64 = 1 << 16;
const EPOCH_SHIFT: u32 = 17;

/// The job of the current call: a borrowed closure, valid while the call is open or any worker
/// is inside it.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    tasks: usize,
}

struct Shared {
    state: AtomicU64,
    job: UnsafeCell<Job>,
    next: AtomicUsize,
    /// A task of this call panicked in a worker.
    panicked: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the caller that holds `busy` while no worker is inside a call
// (the previous one closed with zero inside) and read only by workers that joined the open
// call; the state's Release store / AcqRel join order the write before the reads.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw closure pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// A pool of `threads()` threads (the caller included).
pub(crate) struct Pool {
    shared: &'static Shared,
    workers: usize,
    /// Held by the call that uses the workers.
    busy: Mutex<()>,
}

/// The process's pool: `RAYON_NUM_THREADS` threads when set (the name other Rust programs use
/// for their compute threads), else one per available CPU.
pub(crate) fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        Pool::new(threads.min(ACTIVE_MASK as usize))
    })
}

impl Pool {
    fn new(threads: usize) -> Pool {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            state: AtomicU64::new(CLOSED),
            job: UnsafeCell::new(Job {
                f: &|_| {},
                tasks: 0,
            }),
            next: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        }));
        let mut workers = 0;
        for i in 1..threads.max(1) {
            let spawned = std::thread::Builder::new()
                .name(format!("kvgate-cpu-{i}"))
                .spawn(move || worker(shared));
            if spawned.is_ok() {
                workers += 1;
            }
        }
        Pool {
            shared,
            workers,
            busy: Mutex::new(()),
        }
    }

    /// Threads a call can use, the caller's included.
    pub(crate) fn threads(&self) -> usize {
        self.workers + 1
    }

    /// Runs `f(i, part)` once for each of `parts` (the `i`-th), as [`Pool::run`] runs its tasks:
    /// each task takes its own part, such as disjoint `&mut` slices of one buffer, so callers
    /// split their work without raw pointers. A single part runs on this thread, with nothing
    /// allocated.
    pub(crate) fn run_parts<T: Send>(
        &self,
        parts: impl IntoIterator<Item = T>,
        f: impl Fn(usize, T) + Sync,
    ) {
        let mut parts = parts.into_iter();
        let Some(first) = parts.next() else {
            return;
        };
        let Some(second) = parts.next() else {
            return f(0, first);
        };
        let slots: Vec<Mutex<Option<T>>> = [first, second]
            .into_iter()
            .chain(parts)
            .map(|p| Mutex::new(Some(p)))
            .collect();
        self.run(slots.len(), &|i| {
            // Each slot is taken by its one task; the lock is never contended.
            let part = slots[i]
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if let Some(part) = part {
                f(i, part);
            }
        });
    }

    /// Runs `f(0) .. f(tasks - 1)`, each once, on this thread and the workers; returns when all
    /// are done. A panic in a task is raised here once every task has finished.
    pub(crate) fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        let guard = match self.busy.try_lock() {
            Ok(g) if self.workers > 0 && tasks > 1 => g,
            _ => {
                (0..tasks).for_each(f);
                return;
            }
        };
        let s = self.shared;
        // SAFETY: the previous call closed with no worker inside (it waited for that before
        // returning), and `busy` keeps other callers out, so no one reads `job` now. The
        // lifetime is erased: workers use `f` only while this call is open or they are inside
        // it, and this function does not return before both have ended.
        unsafe {
            let f: *const (dyn Fn(usize) + Sync + '_) = f;
            *s.job.get() = Job {
                f: std::mem::transmute::<
                    *const (dyn Fn(usize) + Sync + '_),
                    *const (dyn Fn(usize) + Sync + 'static),
                >(f),
                tasks,
            };
        }
        s.next.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        let epoch = (s.state.load(Ordering::Relaxed) >> EPOCH_SHIFT).wrapping_add(1);
        s.state.store(epoch << EPOCH_SHIFT, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s
                .lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| claim(s, f, tasks)));
        s.state.fetch_or(CLOSED, Ordering::AcqRel);
        let mut spins = 0u32;
        while s.state.load(Ordering::Acquire) & ACTIVE_MASK != 0 {
            pause(&mut spins);
        }
        drop(guard);
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if s.panicked.load(Ordering::Relaxed) {
            panic!("a CPU kernel task panicked on a worker thread");
        }
    }
}

/// Claims and runs tasks until none is left.
fn claim(s: &Shared, f: &(dyn Fn(usize) + Sync), tasks: usize) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= tasks {
            return;
        }
        f(i);
    }
}

fn pause(spins: &mut u32) {
    *spins += 1;
    if (*spins).is_multiple_of(SPINS_PER_YIELD) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

fn worker(s: &'static Shared) {
    let mut seen = s.state.load(Ordering::Acquire) >> EPOCH_SHIFT;
    loop {
        let mut state = wait_for_call(s, seen);
        // Join the open call of the epoch seen: retried while other workers join first, given
        // up once it closes (a later epoch is joined instead, if one opened meanwhile).
        loop {
            seen = state >> EPOCH_SHIFT;
            if state & CLOSED != 0 {
                break;
            }
            match s.state.compare_exchange_weak(
                state,
                state + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    work(s);
                    break;
                }
                Err(now) => state = now,
            }
        }
    }
}

/// Runs tasks of the call this worker joined, then leaves it.
fn work(s: &Shared) {
    // SAFETY: joined the open call, whose job was written before its epoch was published
    // (SeqCst store, AcqRel join); the caller waits for this worker to leave before the closure
    // ends.
    let job = unsafe { *s.job.get() };
    // SAFETY: as above: the closure outlives this worker's time inside the call.
    let f = unsafe { &*job.f };
    if catch_unwind(AssertUnwindSafe(|| claim(s, f, job.tasks))).is_err() {
        s.panicked.store(true, Ordering::Relaxed);
    }
    s.state.fetch_sub(1, Ordering::Release);
}

/// Spins until the state's epoch differs from `seen`, then sleeps until it does; returns it.
fn wait_for_call(s: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let state = s.state.load(Ordering::Acquire);
        if state >> EPOCH_SHIFT != seen {
            return state;
        }
        if spins.is_multiple_of(SPINS_PER_YIELD) && start.elapsed() >= SPIN {
            break;
        }
        pause(&mut spins);
    }
    let mut l = s
        .lock
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    s.sleepers.fetch_add(1, Ordering::SeqCst);
    loop {
        // Checked after counting as a sleeper: a caller that publishes after this load sees
        // the count and wakes us (under the lock, so not before we wait).
        let state = s.state.load(Ordering::SeqCst);
        if state >> EPOCH_SHIFT != seen {
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            return state;
        }
        l = s
            .wake
            .wait(l)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_once_across_many_calls() {
        let pool = Pool::new(3);
        assert_eq!(pool.threads(), 3);
        for tasks in [1, 2, 3, 7, 64, 1000] {
            let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
            for _ in 0..50 {
                pool.run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
            }
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 50));
        }
    }

    #[test]
    fn each_part_goes_to_its_own_task_once() {
        let pool = Pool::new(3);
        for parts in [0, 1, 2, 5, 64] {
            let mut data = vec![0u32; parts * 4];
            for _ in 0..10 {
                pool.run_parts(data.chunks_mut(4), |i, chunk| {
                    chunk.iter_mut().for_each(|v| *v += i as u32 + 1);
                });
            }
            for (i, chunk) in data.chunks(4).enumerate() {
                assert!(
                    chunk.iter().all(|&v| v == 10 * (i as u32 + 1)),
                    "part {i} of {parts}"
                );
            }
        }
    }

    #[test]
    fn sleeping_workers_wake_for_the_next_call() {
        let pool = Pool::new(2);
        let seen = Mutex::new(std::collections::HashSet::new());
        for _ in 0..3 {
            std::thread::sleep(SPIN * 4);
            // Tasks long enough that the woken worker joins before they are all claimed.
            pool.run(8, &|_| {
                seen.lock().unwrap().insert(std::thread::current().id());
                std::thread::sleep(Duration::from_millis(5));
            });
        }
        assert_eq!(seen.lock().unwrap().len(), 2, "the worker never joined");
    }

    #[test]
    fn concurrent_and_nested_callers_run_inline() {
        let pool = Pool::new(2);
        let total = AtomicU32::new(0);
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| {
                    for _ in 0..100 {
                        pool.run(4, &|_| {
                            pool.run(3, &|_| {
                                total.fetch_add(1, Ordering::Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 100 * 4 * 3);
    }

    #[test]
    fn a_panicking_task_panics_the_caller_after_the_rest() {
        let pool = Pool::new(2);
        let done = AtomicU32::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(16, &|i| {
                if i == 5 {
                    panic!("task 5");
                }
                done.fetch_add(1, Ordering::Relaxed);
            })
        }));
        assert!(r.is_err());
        // The pool still works.
        let after = AtomicU32::new(0);
        pool.run(16, &|_| {
            after.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(after.load(Ordering::Relaxed), 16);
    }
}
