//! The worker's side of the prefix cache's tiers: it carries out the copies the block manager
//! plans ([`TierOp`]), holds a request whose cached prefix continues on disk until the disk
//! thread has read it into the host tier, persists the cache to disk (a drain, a stop), and takes
//! in and gives out the blocks of peer transfers.

use super::disk::{self, DiskIo, Done, Frame};
use super::{ExportJob, Submit, Worker};
use crate::kv::TierOp;
use crate::model::Blocks;
use crate::scheduler::{GroupId, Scheduler};
use kvgate_kernels::Backend;
use kvgate_protocol::BlockHash;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Reads from disk in flight at once; a request past it is admitted at once (it recomputes).
/// Requests whose run starts with the same block wait on one read.
const MAX_LOADS: usize = 8;
/// A request waits at most this long for its load; then it goes on and computes the rest.
const LOAD_DEADLINE: Duration = Duration::from_secs(5);
/// How long stopping waits for the disk thread to write what was persisted.
const PERSIST_WAIT: Duration = Duration::from_secs(60);

/// A request waiting for its prefix to be read from disk.
struct Waiter {
    id: GroupId,
    submit: Box<Submit>,
    started: Instant,
}

/// One read on the disk thread and the requests waiting for it.
struct Load {
    first: kvgate_protocol::BlockHash,
    waiting: Vec<Waiter>,
    /// Set when nobody waits any more: the disk thread stops reading it.
    cancel: Arc<AtomicBool>,
}

/// The disk tier of a worker.
pub(super) struct DiskTier {
    pub(super) io: DiskIo,
    loads: HashMap<u64, Load>,
    /// The cache still to be persisted a little at a time (after a drain).
    persisting: bool,
}

impl DiskTier {
    pub(super) fn new(io: DiskIo) -> Self {
        DiskTier {
            io,
            loads: HashMap::new(),
            persisting: false,
        }
    }
}

impl<B: Backend> Worker<B> {
    /// Host block id of host-tier slot `slot` (the swap space comes first).
    fn host_slot(&self, slot: u32) -> u32 {
        self.swap_blocks + slot
    }

    /// Carries out every tier copy planned so far, in order; runs again for what failing writes
    /// plan (deleting their blocks).
    pub(super) fn run_tier_ops(&mut self) {
        let started = Instant::now();
        let mut copied = false;
        loop {
            let ops = self.sched.kv.take_tier_ops();
            if ops.is_empty() {
                break;
            }
            let mut i = 0;
            while i < ops.len() {
                match ops[i] {
                    TierOp::Demote { .. } => {
                        let mut pairs = Vec::new();
                        while let Some(TierOp::Demote { device, host }) = ops.get(i) {
                            pairs.push((device.0, self.host_slot(*host)));
                            i += 1;
                        }
                        self.model.swap_out(&pairs);
                        copied = true;
                        continue;
                    }
                    TierOp::Promote { .. } => {
                        let mut pairs = Vec::new();
                        while let Some(TierOp::Promote { host, device }) = ops.get(i) {
                            pairs.push((self.host_slot(*host), device.0));
                            i += 1;
                        }
                        self.model.swap_in(&pairs);
                        copied = true;
                        continue;
                    }
                    TierOp::Spill { host, hash, scope } => {
                        let bytes = self.model.read_block(true, self.host_slot(host));
                        self.write_to_disk(hash, scope, bytes);
                    }
                    TierOp::Save {
                        device,
                        hash,
                        scope,
                    } => {
                        let bytes = self.model.read_block(false, device.0);
                        self.write_to_disk(hash, scope, bytes);
                    }
                    TierOp::Delete { hash } => {
                        if let Some(d) = &self.disk {
                            d.io.delete(hash);
                        }
                    }
                    TierOp::DeleteAll => {
                        if let Some(d) = &self.disk {
                            d.io.delete_all();
                        }
                    }
                }
                i += 1;
            }
        }
        if copied {
            let secs = started.elapsed().as_secs_f64();
            self.metrics.update(|m| m.tiers.copy_seconds += secs);
        }
    }

    fn write_to_disk(&mut self, hash: BlockHash, scope: crate::kv::ScopeId, bytes: Vec<u8>) {
        let name = self.sched.kv.scope_name(scope).to_owned();
        let queued = self
            .disk
            .as_ref()
            .is_some_and(|d| d.io.write(hash, name, bytes));
        if !queued {
            // The disk is behind (or gone): the block is not kept there.
            self.sched.kv.disk_lost(hash);
            self.metrics.update(|m| m.tiers.failed_writes += 1);
        }
    }

    /// Holds `s` while its cached prefix is read from disk, when it continues there. Gives the
    /// request back when it should be admitted now.
    pub(super) fn start_load(&mut self, id: GroupId, s: Submit) -> Option<Submit> {
        if self.disk.is_none() {
            return Some(s);
        }
        let scope = self.sched.kv.scope(&s.scope);
        let hashed = self.sched.kv.hash_prompt(scope, &s.prompt);
        let run = self.sched.kv.disk_run(&hashed);
        let Some(disk) = &mut self.disk else {
            return Some(s);
        };
        let Some(&first) = run.first() else {
            return Some(s);
        };
        let waiter = Waiter {
            id,
            submit: Box::new(s),
            started: Instant::now(),
        };
        // A read of the same run is on its way: wait for that one.
        if let Some(load) = disk
            .loads
            .values_mut()
            .find(|l| l.first == first && !l.cancel.load(Ordering::Relaxed))
        {
            load.waiting.push(waiter);
            return None;
        }
        if disk.loads.len() >= MAX_LOADS {
            return Some(*waiter.submit);
        }
        self.sched.kv.touch_disk(&run);
        let cancel = Arc::new(AtomicBool::new(false));
        let Some(load) = disk.io.read(run, cancel.clone()) else {
            return Some(*waiter.submit);
        };
        disk.loads.insert(
            load,
            Load {
                first,
                waiting: vec![waiter],
                cancel,
            },
        );
        None
    }

    /// Whether the disk tier has work for the engine thread: requests waiting for reads, or a
    /// drain's persisting still going.
    pub(super) fn has_loads(&self) -> bool {
        self.disk
            .as_ref()
            .is_some_and(|d| d.persisting || d.loads.values().any(|l| !l.waiting.is_empty()))
    }

    /// Takes what the disk thread reported: read blocks enter the host tier, finished loads admit
    /// their requests, failed writes drop their blocks (a full disk turns the tier off). Goes on
    /// persisting the cache after a drain, as the disk takes it.
    pub(super) fn poll_disk(&mut self, wait: Duration) {
        let mut wait = wait;
        while let Some(done) = self.disk.as_ref().and_then(|d| d.io.next(wait)) {
            wait = Duration::ZERO;
            match done {
                Done::Block { hash, payload, .. } => {
                    if let Some(slot) = self.sched.kv.load_from_disk(hash) {
                        self.fill_host_slot(slot, hash, &payload);
                    }
                }
                Done::Bad { hash, reason, .. } => {
                    tracing::warn!(block = %hash, %reason, "a disk-tier block is unusable; it is deleted and recomputed");
                    self.sched.kv.disk_lost(hash);
                    self.metrics.update(|m| m.tiers.corrupt_blocks += 1);
                }
                Done::LoadEnd { load, secs } => {
                    self.metrics.update(|m| {
                        m.tiers.loads += 1;
                        m.tiers.load_seconds += secs;
                    });
                    let waiting = self
                        .disk
                        .as_mut()
                        .and_then(|d| d.loads.remove(&load))
                        .map(|l| l.waiting)
                        .unwrap_or_default();
                    for w in waiting {
                        if !w.submit.events.is_closed() {
                            self.admit(w.id, *w.submit);
                        }
                    }
                }
                Done::WriteFailed { hash, full, reason } => {
                    self.metrics.update(|m| m.tiers.failed_writes += 1);
                    if full {
                        tracing::error!(%reason, "the disk tier is full: it is off until the engine restarts");
                        self.sched.kv.disable_disk_tier();
                        self.metrics.update(|m| m.tiers.disk_up = false);
                    } else {
                        tracing::warn!(%reason, "a disk-tier write failed");
                        self.sched.kv.disk_lost(hash);
                    }
                }
            }
        }
        self.run_tier_ops();
        self.expire_loads();
        if self.disk.as_ref().is_some_and(|d| d.persisting) && self.persist_some() == 0 {
            // Nothing planned: done, unless the queue had no room.
            let room = self.disk_room();
            if let Some(d) = &mut self.disk {
                d.persisting = room == 0;
            }
        }
    }

    /// Writes a block's bytes into its new host slot, after the slot's old block went out.
    fn fill_host_slot(&mut self, slot: u32, hash: BlockHash, payload: &[u8]) {
        self.run_tier_ops();
        let id = self.host_slot(slot);
        if !self.model.write_host_block(id, payload) {
            self.sched.kv.unload_host(hash);
            self.sched.kv.disk_lost(hash);
            self.metrics.update(|m| m.tiers.corrupt_blocks += 1);
        }
    }

    /// Waiting requests whose client left are dropped, and those past the deadline go on without
    /// the rest of their load; a load nobody waits for is cancelled.
    fn expire_loads(&mut self) {
        let Some(disk) = &mut self.disk else {
            return;
        };
        let now = Instant::now();
        let mut admit = Vec::new();
        for load in disk.loads.values_mut() {
            let mut i = 0;
            while i < load.waiting.len() {
                let w = &load.waiting[i];
                if w.submit.events.is_closed() {
                    load.waiting.swap_remove(i);
                } else if now.duration_since(w.started) > LOAD_DEADLINE {
                    admit.push(load.waiting.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            if load.waiting.is_empty() {
                load.cancel.store(true, Ordering::Relaxed);
            }
        }
        for w in admit {
            self.admit(w.id, *w.submit);
        }
    }

    /// Drops a waiting request (cancelled); true if it was waiting on a load.
    pub(super) fn abort_load(&mut self, id: GroupId) -> bool {
        let Some(disk) = &mut self.disk else {
            return false;
        };
        let mut found = false;
        for load in disk.loads.values_mut() {
            let before = load.waiting.len();
            load.waiting.retain(|w| w.id != id);
            found |= before != load.waiting.len();
            if load.waiting.is_empty() {
                load.cancel.store(true, Ordering::Relaxed);
            }
        }
        found
    }

    /// Blocks the disk's write queue has room for now.
    fn disk_room(&self) -> usize {
        let Some(d) = &self.disk else {
            return 0;
        };
        let per = self.model.kv_block_bytes().max(1);
        disk::MAX_QUEUED_WRITE_BYTES.saturating_sub(d.io.queued_write_bytes()) / per
    }

    /// Plans and queues as many persisting writes as the disk queue takes now.
    fn persist_some(&mut self) -> usize {
        let room = self.disk_room();
        if room == 0 {
            return 0;
        }
        let n = self.sched.kv.persist_to_disk(room);
        self.run_tier_ops();
        n
    }

    /// Writes every cached block not on disk yet to the disk tier, hottest first. With `wait`
    /// (the engine stops), until the disk has them all or the deadline passes; without (a
    /// drain), as the disk takes them, between steps. Returns the blocks queued now.
    pub(super) fn persist(&mut self, wait: bool) -> usize {
        if self.disk.is_none() {
            return 0;
        }
        if !wait {
            let n = self.persist_some();
            if let Some(d) = &mut self.disk {
                d.persisting = true;
            }
            return n;
        }
        let deadline = Instant::now() + PERSIST_WAIT;
        let mut total = 0;
        loop {
            let n = self.persist_some();
            total += n;
            if n == 0 && self.disk_room() > 0 {
                break;
            }
            if Instant::now() > deadline {
                tracing::warn!("the disk tier did not take every cached block in time");
                break;
            }
            // The queue is full: let the disk catch up.
            self.poll_disk(Duration::from_millis(20));
        }
        if let Some(d) = &self.disk {
            let left = deadline.saturating_duration_since(Instant::now());
            if !d.io.wait_idle(left) {
                tracing::warn!("the disk tier did not finish writing in time");
            }
        }
        total
    }

    /// A block a peer sent enters the host tier, in the scope its requester hashed it in.
    pub(super) fn import(&mut self, frame: Frame) {
        let scope = self.sched.kv.scope(&frame.scope);
        if let Some(slot) = self.sched.kv.import_to_host(frame.hash, scope) {
            self.fill_host_slot(slot, frame.hash, &frame.payload);
        }
    }

    /// Between two steps: answers the asks that waited for a step (those still waiting for a
    /// later one stay), then every new one in the queue.
    pub(super) fn serve_exports(&mut self) {
        let Some(asks) = &self.export_asks else {
            return;
        };
        let earlier = std::mem::take(&mut self.waiting_exports);
        let new = std::iter::from_fn(|| asks.try_recv().ok().map(fresh));
        let waited = serve_exports(
            &self.sched,
            &self.model.blocks(),
            self.swap_blocks,
            earlier.into_iter().chain(new),
            &|_| false,
            false,
            &mut self.waiting_exports,
        );
        self.count_export_waits(waited);
    }

    /// [`Self::serve_exports`], when some ask waits.
    pub(super) fn serve_waiting_exports(&mut self) {
        if !self.waiting_exports.is_empty() {
            self.serve_exports();
        }
    }

    /// Counts asks that began to wait for a step ([`serve_exports`]).
    pub(super) fn count_export_waits(&self, asks: usize) {
        if asks > 0 {
            self.metrics.update(|m| m.tiers.export_waits += asks as u64);
        }
    }
}

/// Answers every ask in `wants` ([`super::WantJob`]): between steps, or between the layers of a
/// step, given `imports_pending` there. What an answer reads, the index and the tiers, a step
/// does not change (its own blocks entered the index when it was scheduled, and count as held).
/// But blocks a transfer has brought wait in the command queue until the step ends: while any
/// do, an answer would list them as missing again and start a second transfer of them, so the
/// asks wait for the step's end, when those go in first.
pub(super) fn serve_wants(
    sched: &Scheduler,
    wants: Option<&Receiver<super::WantJob>>,
    imports_pending: Option<&AtomicUsize>,
) {
    let Some(wants) = wants else {
        return;
    };
    if imports_pending.is_some_and(|n| n.load(Ordering::SeqCst) > 0) {
        return;
    }
    while let Ok((scope, tokens, reply)) = wants.try_recv() {
        let _ = reply.send(sched.kv.missing_run(&scope, &tokens));
    }
}

/// An ask kept for a later step, and whether it has been counted as waiting for a block this
/// engine computes (`kvgate_kv_peer_export_waits_total`).
pub(super) type WaitingAsk = (ExportJob, bool);

/// A new ask, not counted yet.
pub(super) fn fresh(job: ExportJob) -> WaitingAsk {
    (job, false)
}

/// Answers `jobs`, stopping each read at a device block for which `writing` is true (one a step
/// in progress writes). An ask whose read stops, before its first block, at a block this engine
/// will compute ([`Scheduler::will_compute`]: in a prefill under way or a prompt in the queue)
/// goes to `waiting` instead, to be answered after a step; so does one that finds nothing at
/// all, when `defer_empty` (asked between the layers of a step: the request it is after may be
/// in the commands the engine thread takes between steps). The others are answered, marked
/// `pending` where they stop at a block this engine will compute. Returns how many asks began
/// to wait for a block this engine will compute (each is counted once, however many steps it
/// waits). The caller frames the blocks off this thread.
pub(super) fn serve_exports<B: Backend>(
    sched: &Scheduler,
    blocks: &Blocks<'_, B>,
    swap_blocks: u32,
    jobs: impl IntoIterator<Item = WaitingAsk>,
    writing: &impl Fn(u32) -> bool,
    defer_empty: bool,
    waiting: &mut Vec<WaitingAsk>,
) -> usize {
    let mut kept = 0;
    for ((ask, reply), counted) in jobs {
        // An asker that gave up (its time limit) is not waited for.
        if reply.is_closed() {
            continue;
        }
        let got = export(sched, blocks, swap_blocks, &ask, writing);
        if got.frames.is_empty() && (got.pending || defer_empty) {
            let count = got.pending && !counted;
            kept += usize::from(count);
            waiting.push(((ask, reply), counted || count));
        } else {
            let _ = reply.send(got);
        }
    }
    kept
}

/// For one ask: the blocks of its prompt (hashed in its scope) from its `from` on, in order, as
/// far as the device pool and the host tier hold them, and whether the read stopped at a block
/// this engine is computing.
fn export<B: Backend>(
    sched: &Scheduler,
    blocks: &Blocks<'_, B>,
    swap_blocks: u32,
    ask: &super::ExportAsk,
    writing: &impl Fn(u32) -> bool,
) -> super::Exported {
    let kv = &sched.kv;
    // A scope this engine never used holds nothing here.
    let Some(scope) = kv.known_scope(&ask.scope) else {
        return super::Exported::default();
    };
    // Only the tokens up to the last block asked for are hashed.
    let reach = ask
        .from
        .saturating_add(ask.count)
        .saturating_mul(kv.block_size())
        .min(ask.tokens.len());
    let hashed = kv.hash_prompt(scope, &ask.tokens[..reach]);
    let hashes = hashed.hashes();
    let from = ask.from.min(hashes.len());
    let to = from.saturating_add(ask.count).min(hashes.len());
    let mut out = super::Exported::default();
    for &hash in &hashes[from..to] {
        let (bytes, scope) = if let Some(id) = kv.index().get(hash) {
            if writing(id.0) {
                out.pending = true;
                break;
            }
            (blocks.read(false, id.0), kv.pool().meta(id).scope)
        } else if let Some(slot) = kv.host_tier().get(hash) {
            let Some(b) = kv.host_tier().block(slot) else {
                break;
            };
            (blocks.read(true, swap_blocks + slot), b.scope)
        } else {
            out.pending = sched.will_compute(hash);
            break;
        };
        out.frames.push(Frame {
            hash,
            scope: kv.scope_name(scope).to_owned(),
            payload: bytes,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::{PreemptMode, SchedulerConfig};

    #[test]
    fn asks_for_what_to_fetch_wait_mid_step_while_fetched_blocks_wait_to_go_in() {
        let sched = Scheduler::new(
            SchedulerConfig {
                max_batched_tokens: 64,
                decode_step_prefill_tokens: 64,
                max_seqs: 8,
                preempt_mode: PreemptMode::Recompute,
            },
            crate::kv::test_manager_tiered(
                16,
                0,
                4,
                crate::kv::TierConfig {
                    host_blocks: 16,
                    disk_blocks: 0,
                },
            ),
        );
        let (asks, wants) = std::sync::mpsc::channel();
        let (reply, mut answer) = tokio::sync::oneshot::channel();
        asks.send(("t".to_owned(), (0..13).collect(), reply))
            .unwrap();
        // Between two layers, with a fetched block still in the command queue: the answer would
        // list it as missing, so it waits.
        let pending = AtomicUsize::new(1);
        serve_wants(&sched, Some(&wants), Some(&pending));
        assert!(answer.try_recv().is_err());
        // Between steps (the queued blocks went in first) it is answered whatever the count.
        serve_wants(&sched, Some(&wants), None);
        assert_eq!(answer.try_recv().unwrap().1.len(), 3);
        // And between layers once nothing waits to go in.
        let (reply, mut answer) = tokio::sync::oneshot::channel();
        asks.send(("t".to_owned(), (0..9).collect(), reply))
            .unwrap();
        pending.store(0, Ordering::SeqCst);
        serve_wants(&sched, Some(&wants), Some(&pending));
        let (from, run) = answer.try_recv().unwrap();
        assert_eq!((from, run.len()), (0, 2));
    }
}
