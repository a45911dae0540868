//! Whether the engine thread is alive and making progress, for `/health`.
//!
//! Every request and every step runs on the engine thread, so an HTTP server that answers while
//! that thread is gone serves nothing. The thread is spawned only through
//! [`EngineThread::spawn`], which hands it a [`Heartbeat`]: a guard dropped as the thread ends,
//! by return or by panic, marks it stopped (and the join handle's `is_finished` confirms it), and
//! the engine loop beats once per iteration, saying whether it has work. A thread that has work
//! and has not come round its loop for [`DEFAULT_STALL_AFTER`] is stalled: a step that never
//! returns (a hung device, a deadlock) looks like that. An idle thread waiting for requests is
//! never stalled. Reading the state is a few atomic loads.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the engine thread may stay inside one iteration while it has work before `/health`
/// reports it stalled. Generous: one step of a large model on a CPU can take tens of seconds.
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(300);

/// What the engine thread reports about itself.
#[derive(Debug)]
pub struct Heartbeat {
    epoch: Instant,
    alive: AtomicBool,
    busy: AtomicBool,
    /// Milliseconds from `epoch` to the last beat.
    last_beat_ms: AtomicU64,
}

impl Heartbeat {
    fn new() -> Self {
        Heartbeat {
            epoch: Instant::now(),
            alive: AtomicBool::new(true),
            busy: AtomicBool::new(false),
            last_beat_ms: AtomicU64::new(0),
        }
    }

    /// Records one turn of the engine loop; `busy` when it has work to do before it next waits.
    pub fn beat(&self, busy: bool) {
        self.last_beat_ms.store(self.now_ms(), Ordering::Release);
        self.busy.store(busy, Ordering::Release);
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// Marks the thread stopped however it ends: unwinding from a panic drops it too.
struct AliveGuard(Arc<Heartbeat>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.alive.store(false, Ordering::Release);
    }
}

/// The engine thread as `/health` sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerState {
    Running,
    /// It has work and has not come round its loop for this long.
    Stalled {
        seconds: u64,
    },
    /// It returned or panicked: nothing will be served until the process restarts.
    Stopped,
}

/// The engine thread and its heartbeat.
#[derive(Debug)]
pub struct EngineThread {
    handle: JoinHandle<()>,
    beat: Arc<Heartbeat>,
    stall_after: Duration,
}

impl EngineThread {
    /// Spawns `body` on the thread `kvgate-engine`; it gets the heartbeat to beat.
    pub fn spawn(
        stall_after: Duration,
        body: impl FnOnce(&Heartbeat) + Send + 'static,
    ) -> std::io::Result<Self> {
        let beat = Arc::new(Heartbeat::new());
        let guard = AliveGuard(beat.clone());
        let handle = std::thread::Builder::new()
            .name("kvgate-engine".into())
            .spawn(move || {
                let guard = guard;
                body(&guard.0);
            })?;
        Ok(EngineThread {
            handle,
            beat,
            stall_after,
        })
    }

    pub fn state(&self) -> WorkerState {
        if !self.beat.alive.load(Ordering::Acquire) || self.handle.is_finished() {
            return WorkerState::Stopped;
        }
        if !self.beat.busy.load(Ordering::Acquire) {
            return WorkerState::Running;
        }
        let since = self
            .beat
            .now_ms()
            .saturating_sub(self.beat.last_beat_ms.load(Ordering::Acquire));
        let since = Duration::from_millis(since);
        if since >= self.stall_after {
            WorkerState::Stalled {
                seconds: since.as_secs(),
            }
        } else {
            WorkerState::Running
        }
    }
}

#[cfg(test)]
impl EngineThread {
    /// Waits until the thread has stopped (polling; no assertion on how long it takes).
    pub(crate) fn wait_stopped(&self) {
        for _ in 0..10_000 {
            if self.state() == WorkerState::Stopped {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("the engine thread did not stop");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_that_panics_or_returns_is_stopped() {
        let t =
            EngineThread::spawn(DEFAULT_STALL_AFTER, |_| panic!("engine thread fault")).unwrap();
        t.wait_stopped();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = EngineThread::spawn(DEFAULT_STALL_AFTER, move |beat| {
            beat.beat(false);
            let _ = rx.recv();
        })
        .unwrap();
        assert_eq!(t.state(), WorkerState::Running, "idle is not stalled");
        drop(tx);
        t.wait_stopped();
    }

    #[test]
    fn a_busy_thread_that_stops_beating_is_stalled() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        let t = EngineThread::spawn(Duration::ZERO, move |beat| {
            beat.beat(true);
            let _ = ready_tx.send(());
            let _ = rx.recv();
        })
        .unwrap();
        ready_rx.recv().unwrap();
        assert!(matches!(t.state(), WorkerState::Stalled { .. }));
        drop(tx);
        t.wait_stopped();
    }
}
