//! The worker's side of the prefix cache's tiers: it carries out the copies the block manager
//! plans ([`TierOp`]), holds a request whose cached prefix continues on disk until the disk
//! thread has read it into the host tier, and persists the cache to disk before it stops.

use super::disk::{DiskIo, Done};
use super::{Submit, Worker};
use crate::kv::TierOp;
use crate::scheduler::GroupId;
use kvgate_kernels::Backend;
use std::time::{Duration, Instant};

/// Loads from disk in flight at once; a request past it is admitted at once (it recomputes).
const MAX_LOADS: usize = 8;
/// A request waits at most this long for its load; then it goes on and computes the rest.
const LOAD_DEADLINE: Duration = Duration::from_secs(5);
/// How long stopping waits for the disk thread to write what was persisted.
const PERSIST_WAIT: Duration = Duration::from_secs(60);

/// A request waiting for its prefix to be read from disk.
pub(super) struct Loading {
    id: GroupId,
    submit: Box<Submit>,
    started: Instant,
}

/// The disk tier of a worker.
pub(super) struct DiskTier {
    pub(super) io: DiskIo,
    pub(super) loading: std::collections::HashMap<u64, Loading>,
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

    fn write_to_disk(
        &mut self,
        hash: kvgate_protocol::BlockHash,
        scope: crate::kv::ScopeId,
        bytes: Vec<u8>,
    ) {
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
        let Some(disk) = &mut self.disk else {
            return Some(s);
        };
        if disk.loading.len() >= MAX_LOADS {
            return Some(s);
        }
        let scope = self.sched.kv.scope(&s.scope);
        let hashed = self.sched.kv.hash_prompt(scope, &s.prompt);
        let run = self.sched.kv.disk_run(&hashed);
        if run.is_empty() {
            return Some(s);
        }
        self.sched.kv.touch_disk(&run);
        let Some(load) = disk.io.read(run) else {
            return Some(s);
        };
        disk.loading.insert(
            load,
            Loading {
                id,
                submit: Box::new(s),
                started: Instant::now(),
            },
        );
        None
    }

    /// Whether requests wait for disk reads.
    pub(super) fn has_loads(&self) -> bool {
        self.disk.as_ref().is_some_and(|d| !d.loading.is_empty())
    }

    /// Takes what the disk thread reported: read blocks enter the host tier, finished loads admit
    /// their requests, failed writes drop their blocks (a full disk turns the tier off).
    pub(super) fn poll_disk(&mut self, wait: Duration) {
        let mut wait = wait;
        while let Some(done) = self.disk.as_ref().and_then(|d| d.io.next(wait)) {
            wait = Duration::ZERO;
            match done {
                Done::Block { hash, payload, .. } => {
                    if let Some(slot) = self.sched.kv.load_from_disk(hash) {
                        // The slot's old block goes out first.
                        self.run_tier_ops();
                        let id = self.host_slot(slot);
                        if !self.model.write_host_block(id, &payload) {
                            self.sched.kv.unload_host(hash);
                            self.sched.kv.disk_lost(hash);
                            self.metrics.update(|m| m.tiers.corrupt_blocks += 1);
                        }
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
                    if let Some(l) = self.disk.as_mut().and_then(|d| d.loading.remove(&load)) {
                        self.admit(l.id, *l.submit);
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
    }

    /// Requests whose client left while they waited are dropped; those past the deadline go on
    /// without the rest of their load.
    fn expire_loads(&mut self) {
        let Some(disk) = &mut self.disk else {
            return;
        };
        let now = Instant::now();
        let done: Vec<u64> = disk
            .loading
            .iter()
            .filter(|(_, l)| {
                l.submit.events.is_closed() || now.duration_since(l.started) > LOAD_DEADLINE
            })
            .map(|(k, _)| *k)
            .collect();
        let expired: Vec<Loading> = done
            .into_iter()
            .filter_map(|k| disk.loading.remove(&k))
            .collect();
        for l in expired {
            if !l.submit.events.is_closed() {
                self.admit(l.id, *l.submit);
            }
        }
    }

    /// Drops a waiting request (cancelled); true if it was waiting on a load.
    pub(super) fn abort_load(&mut self, id: GroupId) -> bool {
        let Some(disk) = &mut self.disk else {
            return false;
        };
        let before = disk.loading.len();
        disk.loading.retain(|_, l| l.id != id);
        before != disk.loading.len()
    }

    /// Writes every cached block not on disk yet to the disk tier; with `wait`, until the disk
    /// has them. Returns how many were queued.
    pub(super) fn persist(&mut self, wait: bool) -> usize {
        if self.disk.is_none() {
            return 0;
        }
        let n = self.sched.kv.persist_to_disk();
        self.run_tier_ops();
        if wait {
            if let Some(d) = &self.disk {
                if !d.io.wait_idle(PERSIST_WAIT) {
                    tracing::warn!("the disk tier did not finish writing in time");
                }
            }
        }
        n
    }
}
