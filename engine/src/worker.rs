//! The engine thread: it owns the scheduler, the model and every sequence's sampler, and runs
//! steps back to back while there is work. HTTP handlers talk to it over channels: requests and
//! admin commands come in on one channel; each request's tokens go out on its own channel; KV
//! events go out on a broadcast channel for `/kv/events`.
//!
//! A request whose output channel is closed (the client disconnected) is aborted at the next step
//! and every block it held is freed. Output channels are bounded and never waited on
//! ([`outbox`]): a client that leaves its stream unread past the stall timeout has its request
//! cancelled the same way.

mod detok;
pub mod disk;
mod liveness;
mod outbox;
mod tiers;

pub use liveness::{EngineThread, Heartbeat, WorkerState, DEFAULT_STALL_AFTER};

use crate::kv::manager::SnapshotBlock;
use crate::kv::{KvCacheManager, ScopeId};
use crate::model::Llama;
use crate::sampling::{Constraint, Sampler, StopChecker, StopMatch, TokenLogprobs, Workspace};
use crate::scheduler::{
    FinishReason as SchedFinish, GroupId, NewGroup, Scheduler, StepItem, StepPlan, TenantId,
};
use crate::stats::Stats;
use detok::Detokenizer;
use kvgate_kernels::{AttnSeq, Backend};
use kvgate_protocol::load::MAX_REPORTED_TENANTS;
use kvgate_protocol::openai::{ApiError, ErrorCode, FinishReason, SamplingParams};
use kvgate_protocol::prompt::PromptRenderer;
use kvgate_protocol::{KvEventRecord, LoadReport, StepCost};
use outbox::{Outbox, Refused};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, oneshot};

/// Pieces a request's output channel holds before the engine holds output back; the HTTP side
/// adds one slot per sample and one for the end ([`Submit::events`]).
pub const EVENT_BUFFER: usize = 128;

/// A request handed to the engine thread.
#[derive(Debug)]
pub struct Submit {
    pub tenant: String,
    pub scope: String,
    pub priority: f64,
    pub kv_quota: Option<u32>,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: u32,
    /// The compiled grammar of a constrained output (each sample follows its own copy).
    pub constraint: Option<Constraint>,
    /// Bounded: [`EVENT_BUFFER`] plus `n + 1` slots, which the engine reserves for each sample's
    /// last piece and the request's end.
    pub events: mpsc::Sender<Event>,
    /// Fired when the request is cancelled because its client stopped reading.
    pub on_stall: oneshot::Sender<()>,
    /// When a traced request reaches its milestones (for its queue, prefill and decode spans).
    pub progress: Option<Arc<Progress>>,
}

/// When a traced request was first scheduled and when its first token came, set once each by
/// the engine thread.
#[derive(Debug, Default)]
pub struct Progress {
    pub scheduled: std::sync::OnceLock<Instant>,
    pub first_token: std::sync::OnceLock<Instant>,
}

/// What a request's channel carries, per sample `index`.
#[derive(Debug, Clone)]
pub enum Event {
    /// The text tokens added to sample `index`: usually one token's (may be empty while a
    /// character or a possible stop string is incomplete), several when the client reads slower
    /// than the engine writes. `logprobs` has each output token with its logprobs, when the
    /// request asked for them (never an EOS or stop token). `finish` is set on the sample's
    /// last piece.
    Piece {
        index: u32,
        text: String,
        logprobs: Vec<(u32, TokenLogprobs)>,
        finish: Option<FinishReason>,
    },
    /// Every sample ended.
    Done {
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    Failed(ApiError),
}

/// The engine's state for `/admin/status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Status {
    pub blocks_used: usize,
    pub blocks_cached: usize,
    pub blocks_free: usize,
    pub running: usize,
    pub waiting: usize,
    pub swapped: usize,
    pub running_by_tenant: HashMap<String, usize>,
    /// The queue and the measured step costs, for the gateways' routing.
    pub load: LoadReport,
}

/// Commands to the engine thread.
#[derive(Debug)]
pub enum Command {
    Submit(GroupId, Box<Submit>),
    Abort(GroupId),
    /// Drop cached prefixes (all, or one scope); replies with the number dropped.
    Flush(Option<String>, oneshot::Sender<usize>),
    Status(oneshot::Sender<Status>),
    /// Every cached hash with its scope and tier, and the last event number it reflects.
    Snapshot(oneshot::Sender<(u64, Vec<SnapshotBlock>)>),
    /// Write every cached block not on disk yet to the disk tier (a drain, a stop); with `true`,
    /// answer once the disk has them. Replies with the number of blocks written.
    Persist(bool, oneshot::Sender<usize>),
    /// A block a peer sent, checked, for the host tier.
    Import(disk::Frame),
    /// Answer what waits in the peer queues ([`Worker::with_peer_queues`]). The engine thread
    /// also answers it between the layers of a step.
    PeerAsks,
}

/// A fetch about to start here: of a prompt (its scope and tokens), the cached run that no tier
/// here holds, which a peer could send, as the index of its first block and the hashes
/// ([`crate::kv::KvCacheManager::missing_run`]).
pub type WantJob = (
    String,
    Vec<u32>,
    oneshot::Sender<(usize, Vec<kvgate_protocol::BlockHash>)>,
);

/// For a peer: `tokens` hashed in `scope`, the blocks from `from` on, at most `count`, in order,
/// as far as the device pool and host tier hold them.
pub type ExportJob = (ExportAsk, oneshot::Sender<Exported>);

/// The answer to one [`ExportAsk`].
#[derive(Debug, Default)]
pub struct Exported {
    pub frames: Vec<disk::Frame>,
    /// The read stopped at a block this engine is computing (a step in progress writes it, or
    /// a prompt in prefill here reaches it in a later step): asked again from there, the answer
    /// waits for it.
    pub pending: bool,
}

/// What a peer asks to be sent: it must know the prompt (tokens and scope), not only hashes.
#[derive(Debug)]
pub struct ExportAsk {
    pub scope: String,
    pub tokens: Arc<Vec<u32>>,
    pub from: usize,
    pub count: usize,
}

struct Sample {
    sampler: Sampler,
    /// The output's grammar, if constrained.
    constraint: Option<Constraint>,
    stop: StopChecker,
    detok: Detokenizer,
    /// Bytes of `detok.text` already sent.
    sent: usize,
    /// Logprobs of output tokens not sent yet (the channel was full).
    held: Vec<(u32, TokenLogprobs)>,
    last_token_at: Option<Instant>,
    done: bool,
}

struct Request {
    tenant: String,
    out: Outbox,
    arrival: Instant,
    prompt: Vec<u32>,
    samples: Vec<Sample>,
    /// Sequence id -> sample index.
    index: HashMap<crate::kv::SeqId, usize>,
    first_token: bool,
    completion_tokens: usize,
    progress: Option<Traced>,
}

/// A traced request's milestones, counted in [`Worker::traced`] while the request lives.
struct Traced {
    progress: Arc<Progress>,
    live: Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for Traced {
    fn drop(&mut self) {
        self.live.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The engine thread's state.
pub struct Worker<B: Backend> {
    sched: Scheduler,
    model: Llama<B>,
    renderer: Arc<PromptRenderer>,
    eos: Vec<u32>,
    requests: HashMap<GroupId, Request>,
    /// Requests in `requests` that are traced (their milestones are marked only when some are).
    traced: Arc<std::sync::atomic::AtomicUsize>,
    tenants: HashMap<String, TenantId>,
    metrics: Arc<Stats>,
    kv_events: broadcast::Sender<KvEventRecord>,
    ws: Workspace,
    stall_timeout: Duration,
    /// Step time against step size, measured on every forward pass.
    cost: StepCost,
    /// The recent time of a forward pass that only decodes (a running mean): the grammar masks'
    /// budget per step.
    forward_secs: f64,
    /// The load report last published, and when.
    published_load: Option<(Instant, LoadReport)>,
    /// The disk tier's I/O and the requests waiting on it, when the tier is on.
    disk: Option<tiers::DiskTier>,
    /// Host blocks of the swap space, before the host tier's slots.
    swap_blocks: u32,
    /// Measured seconds per block of host-tier copies and of disk reads (0 until measured).
    tier_rates: (f64, f64),
    /// How peer frames are made and checked, when peer transfer is on.
    peer: Option<disk::PeerCodec>,
    /// What it computes on ([`LoadReport::compute`]).
    compute: String,
    /// Peers' asks for blocks, answered between steps and between a step's layers.
    export_asks: Option<Receiver<ExportJob>>,
    /// This engine's own fetches' asks for what they should fetch, answered between steps and
    /// between a step's layers.
    want_asks: Option<Receiver<WantJob>>,
    /// Blocks a transfer brought that wait in the command queue for the host tier
    /// ([`Command::Import`]): while any do, the asks in `want_asks` wait for the step's end.
    imports_pending: Arc<AtomicUsize>,
    /// Asks that wait for blocks this engine is computing, answered after the step that does
    /// (at most one per transfer served at once).
    waiting_exports: Vec<tiers::WaitingAsk>,
}

/// Stack of the thread that computes grammar masks beside the forward pass.
const MASK_STACK_BYTES: usize = 64 << 20;

/// Weight of the newest forward pass in [`Worker::forward_secs`].
const FORWARD_SECS_RATE: f64 = 0.2;

/// How long an idle engine waits on the disk per turn while requests wait for their loads.
const LOAD_POLL: Duration = Duration::from_millis(2);

/// How often the published load report is brought up to date.
const LOAD_REFRESH: Duration = Duration::from_millis(100);

/// [`LoadReport::compute`]: a hash of the machine (its hostname) and the backend's compute unit,
/// so that the report names no host and two engines agree exactly when they share compute.
fn compute_id(unit: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let mut h = blake3::Hasher::new();
    h.update(host.trim().as_bytes());
    h.update(&[0]);
    h.update(unit.as_bytes());
    h.finalize().to_hex()[..16].to_owned()
}

impl<B: Backend> std::fmt::Debug for Worker<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("requests", &self.requests.len())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Worker<B> {
    pub fn new(
        sched: Scheduler,
        model: Llama<B>,
        renderer: Arc<PromptRenderer>,
        eos: Vec<u32>,
        metrics: Arc<Stats>,
        kv_events: broadcast::Sender<KvEventRecord>,
    ) -> Self {
        Worker {
            sched,
            renderer,
            eos,
            requests: HashMap::new(),
            traced: Arc::default(),
            tenants: HashMap::new(),
            metrics,
            kv_events,
            ws: Workspace::new(),
            stall_timeout: Duration::from_secs(30),
            cost: StepCost::default(),
            forward_secs: 0.0,
            published_load: None,
            disk: None,
            swap_blocks: 0,
            tier_rates: (0.0, 0.0),
            peer: None,
            compute: compute_id(&model.backend().compute_unit()),
            export_asks: None,
            want_asks: None,
            imports_pending: Arc::default(),
            waiting_exports: Vec::new(),
            model,
        }
    }

    /// The host tier's slots follow `swap_blocks` swap blocks in the model's host pools; `disk`
    /// is the disk tier's I/O, when it is on.
    /// `peer` makes and checks the frames of peer transfers.
    pub fn with_tiers(
        mut self,
        swap_blocks: u32,
        disk: Option<disk::DiskIo>,
        peer: Option<disk::PeerCodec>,
    ) -> Self {
        self.swap_blocks = swap_blocks;
        self.peer = peer;
        let on = disk.is_some();
        self.disk = disk.map(tiers::DiskTier::new);
        let block_bytes = self.model.kv_block_bytes() as u64;
        self.metrics.update(|m| {
            m.tiers.disk_configured = on;
            m.tiers.disk_up = on;
            m.tiers.block_bytes = block_bytes;
        });
        self
    }

    /// Answers peers' asks for blocks from `exports`, and this engine's fetches' asks for what to
    /// fetch from `wants` (each followed by [`Command::PeerAsks`]): between steps, and between
    /// the layers of a step, so that neither end of a transfer waits for a long step to end.
    /// `imports_pending` counts the [`Command::Import`]s sent and not yet taken: the sender adds
    /// one before each, the engine thread takes it off.
    pub fn with_peer_queues(
        mut self,
        exports: Receiver<ExportJob>,
        wants: Receiver<WantJob>,
        imports_pending: Arc<AtomicUsize>,
    ) -> Self {
        self.export_asks = Some(exports);
        self.want_asks = Some(wants);
        self.imports_pending = imports_pending;
        self
    }

    /// How long a request's output may sit in a full buffer before it is cancelled as stalled.
    pub fn with_stall_timeout(mut self, timeout: Duration) -> Self {
        self.stall_timeout = timeout;
        self
    }

    /// Runs until every sender of `rx` is gone and no work is left, beating `beat` once per
    /// turn so `/health` can tell a stuck or dead engine thread from a busy one.
    /// Before it returns, the cached blocks are persisted to the disk tier, when there is one.
    pub fn run(mut self, rx: Receiver<Command>, beat: &Heartbeat) {
        loop {
            beat.beat(self.sched.has_work() || self.has_loads());
            self.poll_disk(Duration::ZERO);
            if self.sched.has_work() {
                loop {
                    match rx.try_recv() {
                        Ok(cmd) => self.handle(cmd),
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => break,
                    }
                }
                // The last step computed blocks that waiting asks may want, and the commands
                // just taken may have queued the prompts that others wait for.
                self.serve_waiting_exports();
                self.step();
            } else if self.has_loads() {
                // Nothing here will compute what the waiting asks want.
                self.serve_waiting_exports();
                // Nothing to compute until a read lands (or the disk takes more of a drain's
                // writes): wait on the disk, a little at a time.
                self.poll_disk(LOAD_POLL);
                while let Ok(cmd) = rx.try_recv() {
                    self.handle(cmd);
                }
            } else {
                // Nothing left to compute: asks that waited for a block are answered with
                // what is here (a prompt they waited for was cancelled, or found its blocks
                // cached) rather than kept to their asker's time limit.
                self.serve_waiting_exports();
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => break,
                }
            }
            self.publish();
        }
        self.persist(true);
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(id, s) => self.submit(id, *s),
            Command::Abort(id) => {
                if self.sched.abort(id) {
                    self.requests.remove(&id);
                }
                self.abort_load(id);
            }
            Command::Flush(scope, reply) => {
                let scope = scope.map(|s| self.sched.kv.scope(&s));
                let n = self.sched.kv.flush(scope);
                self.run_tier_ops();
                // Answered once the disk tier's files are gone, not just queued to go.
                match &self.disk {
                    Some(d) => {
                        d.io.then(move || {
                            let _ = reply.send(n);
                        });
                    }
                    None => {
                        let _ = reply.send(n);
                    }
                }
            }
            Command::Persist(wait, reply) => {
                let _ = reply.send(self.persist(wait));
            }
            Command::Import(frame) => {
                self.import(frame);
                let _ =
                    self.imports_pending
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            }
            Command::PeerAsks => {
                self.serve_exports();
                tiers::serve_wants(&self.sched, self.want_asks.as_ref(), None);
            }
            Command::Status(reply) => {
                let _ = reply.send(self.status());
            }
            Command::Snapshot(reply) => {
                self.publish();
                let _ = reply.send(self.sched.kv.snapshot());
            }
        }
    }

    fn tenant(&mut self, name: &str) -> TenantId {
        let next = TenantId(self.tenants.len() as u32);
        *self.tenants.entry(name.to_owned()).or_insert(next)
    }

    fn submit(&mut self, id: GroupId, s: Submit) {
        // A prefix cached on disk is read into host memory first, off this thread.
        if let Some(s) = self.start_load(id, s) {
            self.admit(id, s);
        }
    }

    fn admit(&mut self, id: GroupId, s: Submit) {
        let tenant = self.tenant(&s.tenant);
        let scope: ScopeId = self.sched.kv.scope(&s.scope);
        // Each request carries its tenant's current settings: a missing quota clears one.
        self.sched.update_tenant(tenant, s.priority, s.kv_quota);
        let n = s.params.n.max(1);
        let Some(out) = Outbox::new(s.events.clone(), n as usize, s.on_stall) else {
            // The client left already (or sized the channel too small to reserve the ends).
            let _ = s.events.try_send(Event::Failed(ApiError::internal(
                "The request's output channel has no room for its end.",
            )));
            return;
        };
        // Each sample its own grammar state: copies for all but the last, which takes the one
        // compiled for the request.
        let mut constraint = s.constraint;
        let samples = (0..n)
            .map(|i| Sample {
                sampler: Sampler::new(&s.params, &s.prompt, &self.eos, i),
                constraint: if i + 1 == n {
                    constraint.take()
                } else {
                    constraint.clone()
                },
                stop: StopChecker::new(&s.params, &self.eos, s.max_tokens),
                detok: Detokenizer::default(),
                sent: 0,
                held: Vec::new(),
                last_token_at: None,
                done: false,
            })
            .collect();
        let added = self.sched.add(NewGroup {
            id,
            tenant,
            priority: s.priority,
            scope,
            prompt: s.prompt.clone(),
            n: n as usize,
            max_tokens: s.max_tokens as usize,
        });
        if let Err(reason) = added {
            out.end(Event::Failed(ApiError::new(
                ErrorCode::InvalidValue,
                reason,
            )));
            return;
        }
        self.requests.insert(
            id,
            Request {
                tenant: s.tenant,
                out,
                arrival: Instant::now(),
                prompt: s.prompt,
                samples,
                index: HashMap::new(),
                first_token: false,
                completion_tokens: 0,
                progress: s.progress.map(|progress| {
                    self.traced
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Traced {
                        progress,
                        live: self.traced.clone(),
                    }
                }),
            },
        );
    }

    fn step(&mut self) {
        // Requests whose client went away are dropped before they cost a step.
        let gone: Vec<GroupId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.out.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.sched.abort(id);
            self.requests.remove(&id);
        }
        self.cancel_stalled();
        let plan = self.sched.schedule();
        for (id, reason) in &plan.rejected {
            if let Some(r) = self.requests.remove(id) {
                r.out.end(Event::Failed(ApiError::new(
                    ErrorCode::InvalidValue,
                    reason.clone(),
                )));
            }
        }
        let pairs = |v: &[(crate::kv::BlockId, crate::kv::HostBlockId)]| -> Vec<(u32, u32)> {
            v.iter().map(|(d, h)| (d.0, h.0)).collect()
        };
        self.model.swap_out(&pairs(&plan.swap_out));
        // After the swap-outs have read their blocks, before anything writes a reused block:
        // demotions read the blocks being reused, promotions write blocks the forward pass reads.
        self.run_tier_ops();
        let swap_in: Vec<(u32, u32)> = plan.swap_in.iter().map(|(h, d)| (h.0, d.0)).collect();
        self.model.swap_in(&swap_in);
        let cow: Vec<(u32, u32)> = plan.cow.iter().map(|(s, d)| (s.0, d.0)).collect();
        self.model.copy_blocks(&cow);
        if plan.is_empty() {
            return;
        }
        let started = Instant::now();
        if self.traced.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            for item in &plan.items {
                if let Some(t) = self
                    .requests
                    .get(&item.group)
                    .and_then(|r| r.progress.as_ref())
                {
                    t.progress.scheduled.get_or_init(|| started);
                }
            }
        }
        let masks = self.take_constraints(&plan);
        let mut measured = Vec::new();
        let (logits, sampled) = if masks.is_empty() {
            self.timed_forward(&plan)
        } else {
            // The grammar masks of this step's constrained samples are computed beside the
            // forward pass, not after it (if the thread cannot start, as each row is sampled).
            let slot = std::sync::Mutex::new((masks, Vec::new()));
            let out = std::thread::scope(|scope| {
                let work = || {
                    let mut g = slot.lock().unwrap_or_else(|p| p.into_inner());
                    g.1 = g.0.iter_mut().map(|(_, _, c)| c.prepare()).collect();
                };
                let masker = std::thread::Builder::new()
                    .name("kvgate-masks".into())
                    .stack_size(MASK_STACK_BYTES)
                    .spawn_scoped(scope, work);
                let out = self.timed_forward(&plan);
                // A mask that panicked is left unset and computed again as its row is sampled.
                if masker.is_ok_and(|h| h.join().is_err()) {
                    tracing::error!("the mask thread panicked");
                }
                out
            });
            let (back, secs) = slot.into_inner().unwrap_or_else(|p| p.into_inner());
            measured = back.iter().map(|(g, i, _)| (*g, *i)).zip(secs).collect();
            self.restore_constraints(back);
            out
        };
        self.cost
            .observe(plan.num_tokens(), started.elapsed().as_secs_f64());
        let vocab = self.model.config().vocab_size;
        // Each mask's tenant, known before sampling may end its request.
        let tenants: Vec<Option<TenantId>> = measured
            .iter()
            .map(|((g, _), _)| {
                let r = self.requests.get(g)?;
                self.tenants.get(&r.tenant).copied()
            })
            .collect();
        for (k, item) in sampled.iter().enumerate() {
            let row = &logits[k * vocab..(k + 1) * vocab];
            self.on_logits(item.group, item.seq, row);
        }
        if !measured.is_empty() {
            self.observe_masks(&measured, &tenants);
        }
        let secs = started.elapsed().as_secs_f64();
        self.metrics.update(|m| {
            m.batch_tokens.observe(plan.num_tokens() as f64);
            m.step_seconds.observe(secs);
        });
    }

    /// Cancels requests whose client has not read its full buffer for the stall timeout: their
    /// blocks go back to the pool, and their output stops growing.
    fn cancel_stalled(&mut self) {
        let (now, timeout) = (Instant::now(), self.stall_timeout);
        let stalled: Vec<GroupId> = self
            .requests
            .iter_mut()
            .filter_map(|(id, r)| r.out.is_stalled(now, timeout).then_some(*id))
            .collect();
        for id in stalled {
            self.sched.abort(id);
            if let Some(r) = self.requests.remove(&id) {
                tracing::info!(
                    request = id.0,
                    tenant = %r.tenant,
                    timeout_ms = timeout.as_millis() as u64,
                    "client stopped reading its stream; request cancelled"
                );
                r.out.stall();
            }
            self.metrics.update(|m| m.stalled_clients += 1);
        }
    }

    /// Takes out the grammar state of every constrained sample the plan samples, to compute
    /// its mask beside the forward pass: the item's own sample, or every sample of a request
    /// whose prompt ends this step (its samples fork from that row).
    fn take_constraints(&mut self, plan: &StepPlan) -> Vec<(GroupId, usize, Constraint)> {
        let mut out = Vec::new();
        for item in plan.items.iter().filter(|i| i.sample) {
            let Some(req) = self.requests.get_mut(&item.group) else {
                continue;
            };
            let indices = match req.index.get(&item.seq) {
                Some(&i) => i..i + 1,
                None => 0..req.samples.len(),
            };
            for i in indices {
                let sample = &mut req.samples[i];
                if sample.done {
                    continue;
                }
                if let Some(c) = sample.constraint.take() {
                    out.push((item.group, i, c));
                }
            }
        }
        out
    }

    /// Runs the step's forward pass; the time of one that only decodes is the next steps' mask
    /// budget (a running mean: steps with prefill chunks, which a tenant can lengthen at will,
    /// do not raise it).
    fn timed_forward(&mut self, plan: &StepPlan) -> (Vec<f32>, Vec<StepItem>) {
        let started = Instant::now();
        let out = self.forward(plan);
        if plan.items.iter().all(|i| i.len == 1) {
            let secs = started.elapsed().as_secs_f64();
            self.forward_secs = if self.forward_secs > 0.0 {
                self.forward_secs + FORWARD_SECS_RATE * (secs - self.forward_secs)
            } else {
                secs
            };
            self.sched.set_mask_budget(self.forward_secs);
        }
        out
    }

    /// Counts the step's masks and gives each one's time to the scheduler, which charges it to
    /// the request's tenant and keeps each sample's expected time (after [`Worker::on_logits`],
    /// so that samples forked this step are known).
    fn observe_masks(&mut self, masks: &[((GroupId, usize), f64)], tenants: &[Option<TenantId>]) {
        for (&((gid, i), secs), tenant) in masks.iter().zip(tenants) {
            let seq = self.requests.get(&gid).and_then(|r| {
                r.index
                    .iter()
                    .find_map(|(seq, &at)| (at == i).then_some(*seq))
            });
            if let Some(tenant) = *tenant {
                self.sched.observe_mask(tenant, seq, secs);
            }
        }
        let count = masks.len() as u64;
        let total: f64 = masks.iter().map(|(_, s)| s).sum();
        self.metrics.update(|m| {
            m.grammar_masks += count;
            m.grammar_mask_seconds += total;
        });
    }

    fn restore_constraints(&mut self, masks: Vec<(GroupId, usize, Constraint)>) {
        for (gid, i, c) in masks {
            if let Some(sample) = self
                .requests
                .get_mut(&gid)
                .and_then(|r| r.samples.get_mut(i))
            {
                sample.constraint = Some(c);
            }
        }
    }

    /// Ends request `gid` with `error`, freeing its blocks.
    fn fail(&mut self, gid: GroupId, error: ApiError) {
        self.sched.abort(gid);
        if let Some(req) = self.requests.remove(&gid) {
            req.out.end(Event::Failed(error));
        }
    }

    /// Runs the plan's items through the model; returns the logits of the sampled items, in
    /// order, and those items. (The scheduler just planned every item, so each is found; an item
    /// that is not would be skipped rather than take the engine down.)
    fn forward(&mut self, plan: &StepPlan) -> (Vec<f32>, Vec<StepItem>) {
        let bs = self.sched.kv.block_size();
        let (mut tokens, mut positions, mut slots, mut rows) = (vec![], vec![], vec![], vec![]);
        let mut tables: Vec<Vec<u32>> = Vec::with_capacity(plan.items.len());
        let mut items: Vec<StepItem> = Vec::with_capacity(plan.items.len());
        for item in &plan.items {
            let seq = self
                .sched
                .group(item.group)
                .and_then(|g| g.seqs.iter().find(|s| s.id == item.seq));
            let (Some(seq), Some(table)) = (seq, self.sched.kv.block_table(item.seq)) else {
                tracing::error!(?item, "scheduled item without a sequence; skipped");
                continue;
            };
            items.push(*item);
            for p in item.start..item.start + item.len {
                tokens.push(seq.tokens[p]);
                positions.push(p as u32);
                slots.push(table.slot(p, bs) as u32);
            }
            if item.sample {
                rows.push(tokens.len() as u32 - 1);
            }
            tables.push(table.blocks().iter().map(|b| b.0).collect());
        }
        let mut start = 0;
        let seqs: Vec<AttnSeq<'_>> = items
            .iter()
            .zip(&tables)
            .map(|(item, table)| {
                let s = AttnSeq {
                    query_start: start,
                    query_len: item.len,
                    context_len: item.start + item.len,
                    block_table: table,
                };
                start += item.len;
                s
            })
            .collect();
        if tokens.is_empty() {
            return (Vec::new(), Vec::new());
        }
        let batch = crate::model::Batch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            seqs: &seqs,
            logits_rows: &rows,
        };
        let logits = match &self.export_asks {
            // Between layers, peers' asks are answered from the blocks this step does not
            // write: every other block in the index was computed by an earlier step.
            // The step's blocks are listed on the first ask, not every step.
            Some(asks) => {
                let writing = std::cell::OnceCell::new();
                let written = |id: u32| {
                    let ids: &Vec<u32> = writing.get_or_init(|| {
                        let mut ids: Vec<u32> = slots.iter().map(|&s| s / bs as u32).collect();
                        ids.sort_unstable();
                        ids.dedup();
                        ids
                    });
                    ids.binary_search(&id).is_ok()
                };
                // Only new asks: those waiting for a block wait for the step's end (between
                // steps), when what this step writes becomes readable. So do those that find
                // nothing: the prompt they are after may be in the commands taken between steps.
                let (sched, swap_blocks) = (&self.sched, self.swap_blocks);
                let waiting = &mut self.waiting_exports;
                let wants = self.want_asks.as_ref();
                let imports = &*self.imports_pending;
                let mut waited = 0;
                let logits = self.model.forward_with(&batch, &mut |blocks| {
                    // A fetch starting here learns what to fetch now, not after the step: its
                    // blocks can then arrive with its request, by the step's end.
                    tiers::serve_wants(sched, wants, Some(imports));
                    let new = std::iter::from_fn(|| asks.try_recv().ok().map(tiers::fresh));
                    waited += tiers::serve_exports(
                        sched,
                        blocks,
                        swap_blocks,
                        new,
                        &written,
                        true,
                        waiting,
                    )
                });
                self.count_export_waits(waited);
                logits
            }
            None => self.model.forward(&batch),
        };
        (logits, items.into_iter().filter(|i| i.sample).collect())
    }

    /// Samples the next token of `seq` (or of every sample, right after the prompt of an `n > 1`
    /// request) from one row of logits.
    fn on_logits(&mut self, gid: GroupId, seq: crate::kv::SeqId, row: &[f32]) {
        let Some(group) = self.sched.group(gid) else {
            return;
        };
        let targets: Vec<(usize, crate::kv::SeqId)> = if group.n > 1 && group.seqs.len() == 1 {
            let ids = self.sched.fork_samples(gid);
            let Some(req) = self.requests.get_mut(&gid) else {
                return;
            };
            for (i, id) in ids.iter().enumerate() {
                req.index.insert(*id, i);
            }
            ids.into_iter().enumerate().collect()
        } else {
            let Some(req) = self.requests.get_mut(&gid) else {
                return;
            };
            let i = *req.index.entry(seq).or_insert(0);
            vec![(i, seq)]
        };
        let mut buf = row.to_vec();
        for (index, seq) in targets {
            buf.copy_from_slice(row);
            self.sample_one(gid, index, seq, &mut buf);
        }
    }

    fn sample_one(
        &mut self,
        gid: GroupId,
        index: usize,
        seq: crate::kv::SeqId,
        logits: &mut [f32],
    ) {
        let now = Instant::now();
        let Some(req) = self.requests.get_mut(&gid) else {
            return;
        };
        let sample = &mut req.samples[index];
        // A row with no finite logit is the model's fault, whatever the grammar: the sampler
        // reports it as the engine's.
        let finite = logits.iter().any(|&l| l > f32::NEG_INFINITY);
        if let Some(c) = sample.constraint.as_mut().filter(|_| finite) {
            let masked = c.apply(logits).and_then(|()| {
                if logits.iter().any(|&l| l > f32::NEG_INFINITY) {
                    Ok(())
                } else {
                    Err(c.failed("no token can continue the output".into(), false))
                }
            });
            if let Err(e) = masked {
                self.fail(gid, e.api_error());
                return;
            }
        }
        let sampled = match sample.sampler.sample(logits, &mut self.ws) {
            Ok(s) => s,
            Err(e) => {
                if !e.is_request_fault() {
                    tracing::error!(request = gid.0, code = e.code(), "sampling failed");
                }
                self.fail(gid, e.api_error());
                return;
            }
        };
        let new_from = sample.detok.push(&self.renderer, sampled.token);
        let finish = sample
            .stop
            .check(sampled.token, &sample.detok.text, new_from);
        req.completion_tokens += 1;
        let since = sample.last_token_at.replace(now);
        let first = !std::mem::replace(&mut req.first_token, true);
        if let Some(t) = req.progress.as_ref().filter(|_| first) {
            t.progress.first_token.get_or_init(|| now);
        }
        let arrival = req.arrival;
        self.metrics.update(|m| {
            m.generation_tokens += 1;
            if first {
                m.ttft.observe(now.duration_since(arrival).as_secs_f64());
            }
            if let Some(t) = since {
                m.itl.observe(now.duration_since(t).as_secs_f64());
            }
        });
        let (keep, output) = match &finish {
            Some(f) => {
                sample.done = true;
                let output = !matches!(f.matched, StopMatch::Eos(_) | StopMatch::StopToken(_));
                (f.text_len, output)
            }
            None => (sample.stop.streamable_len(&sample.detok.text), true),
        };
        let keep = keep.max(sample.sent).min(sample.detok.text.len());
        if let Some(lp) = sampled.logprobs.filter(|_| output) {
            sample.held.push((sampled.token, lp));
        }
        let reason = finish.as_ref().map(|f| f.reason);
        let delivered = deliver(&mut req.out, sample, index, keep, reason, now);
        if !delivered {
            self.sched.abort(gid);
            self.requests.remove(&gid);
            return;
        }
        if finish.is_none() {
            let committed = sample
                .constraint
                .as_mut()
                .map_or(Ok(()), |c| c.commit(sampled.token));
            if let Err(e) = committed {
                self.fail(gid, e.api_error());
                return;
            }
            self.sched.push_token(gid, seq, sampled.token);
            return;
        }
        let cached = self.sched.group(gid).map_or(0, |g| g.cached_tokens);
        let reason = match finish.map(|f| f.reason) {
            Some(FinishReason::Length) => SchedFinish::Length,
            _ => SchedFinish::Stop,
        };
        if self.sched.finish_seq(gid, seq, reason) {
            if let Some(req) = self.requests.remove(&gid) {
                self.finish_request(req, cached);
            }
        }
    }

    fn finish_request(&mut self, req: Request, cached: usize) {
        let duration = req.arrival.elapsed().as_secs_f64();
        let (prompt_tokens, completion_tokens) = (req.prompt.len(), req.completion_tokens);
        req.out.end(Event::Done {
            prompt_tokens,
            completion_tokens,
            cached_tokens: cached,
        });
        self.metrics.update(|m| {
            m.prompt_tokens += req.prompt.len() as u64;
            *m.queried_tokens.entry(req.tenant.clone()).or_default() += req.prompt.len() as u64;
            *m.hit_tokens.entry(req.tenant.clone()).or_default() += cached as u64;
            m.request_duration.observe(duration);
        });
    }

    /// KV events out, metrics in.
    fn publish(&mut self) {
        for e in self.sched.kv.drain_events() {
            let _ = self.kv_events.send(e);
        }
        let usage = self.sched.kv.usage();
        let c = self.sched.kv.counters();
        let tier = self.sched.kv.tier_counters();
        let queued = self.disk.as_ref().map_or(0, |d| d.io.queued_write_bytes());
        let mut rates = self.tier_rates;
        let s = self.sched.stats();
        let deferred = self.sched.mask_deferrals();
        let kv = &self.sched.kv;
        let tenant_blocks: BTreeMap<String, u64> = self
            .tenants
            .iter()
            .map(|(name, t)| (name.clone(), u64::from(kv.tenant_usage(*t))))
            .collect();
        let tenant_quota: BTreeMap<String, u64> = self
            .tenants
            .iter()
            .filter_map(|(name, t)| Some((name.clone(), u64::from(kv.quota(*t)?))))
            .collect();
        let (running, waiting, swapped) = (
            self.sched.num_running(),
            self.sched.num_waiting(),
            self.sched.num_swapped(),
        );
        // The backlog looks up the cached prefix of every waiting request: at most ten times a
        // second, not every step.
        let (load_at, load) = match &self.published_load {
            Some((at, load)) if at.elapsed() < LOAD_REFRESH => (*at, load.clone()),
            _ => {
                let load = self.load();
                let at = Instant::now();
                self.published_load = Some((at, load.clone()));
                (at, load)
            }
        };
        self.metrics.update(|m| {
            m.blocks_used = usage.used as u64;
            m.blocks_cached = usage.cached as u64;
            m.blocks_free = usage.free as u64;
            m.filled_slots = usage.filled_slots as u64;
            m.evicted_blocks = c.evicted_blocks;
            m.cow_copies = c.cow_copies;
            m.swapped_out_blocks = c.swapped_out_blocks;
            m.swapped_in_blocks = c.swapped_in_blocks;
            m.preemptions_recompute = s.preempted_recompute;
            m.preemptions_swap = s.preempted_swap;
            m.grammar_deferred_decodes = deferred;
            m.running = running as u64;
            m.waiting = waiting as u64;
            m.swapped = swapped as u64;
            // Replaced, not merged: a quota that was removed leaves the metric.
            m.tenant_blocks = tenant_blocks;
            m.tenant_quota = tenant_quota;
            m.load = load;
            m.load_at = Some(load_at);
            let (t, tc) = (&mut m.tiers, tier);
            t.host_blocks = usage.host_cached as u64;
            t.host_capacity = usage.host_cache_capacity as u64;
            t.disk_blocks = usage.disk_cached as u64;
            t.disk_capacity = usage.disk_capacity as u64;
            t.host_hit_tokens = tc.host_hit_tokens;
            t.disk_hit_tokens = tc.disk_hit_tokens;
            t.promoted_blocks = tc.promoted_blocks;
            t.loaded_blocks = tc.loaded_blocks;
            t.demoted_blocks = tc.demoted_blocks;
            t.spilled_blocks = tc.spilled_blocks;
            t.dropped_blocks = tc.dropped_blocks;
            t.peer_hit_tokens = tc.peer_hit_tokens;
            t.imported_blocks = tc.imported_blocks;
            t.saved_blocks = tc.saved_blocks;
            t.queued_write_bytes = queued as u64;
            let moved = t.promoted_blocks + t.demoted_blocks;
            rates = (
                if moved > 0 {
                    t.copy_seconds / moved as f64
                } else {
                    0.0
                },
                if t.loaded_blocks > 0 {
                    t.load_seconds / t.loaded_blocks as f64
                } else {
                    0.0
                },
            );
        });
        self.tier_rates = rates;
    }

    /// The load report: the scheduler's backlog (waiting tokens by tenant name, the largest
    /// [`MAX_REPORTED_TENANTS`] apart), its limits and the measured step costs.
    fn load(&self) -> LoadReport {
        let backlog = self.sched.backlog();
        let config = self.sched.config();
        let u = self.sched.kv.usage();
        let (step_secs, secs_per_token) = self.cost.fit();
        let running = self.sched.num_running();
        let names: HashMap<TenantId, &String> = self.tenants.iter().map(|(k, v)| (*v, k)).collect();
        let mut waiting: Vec<(u64, &String)> = backlog
            .waiting
            .iter()
            .filter(|(_, &n)| n > 0)
            .filter_map(|(t, &n)| Some((n, *names.get(t)?)))
            .collect();
        let pending = backlog.running_prefill + backlog.waiting.values().sum::<u64>();
        let mut running_prefill_tokens = backlog.running_prefill;
        if waiting.len() > MAX_REPORTED_TENANTS {
            waiting.sort_unstable_by_key(|w| std::cmp::Reverse(w.0));
            // The rest are counted as if they went first: never an underestimate.
            running_prefill_tokens += waiting[MAX_REPORTED_TENANTS..]
                .iter()
                .map(|(n, _)| n)
                .sum::<u64>();
            waiting.truncate(MAX_REPORTED_TENANTS);
        }
        // A decode step for the batch as it is, times the steps until the nearest end.
        let step = step_secs + running as f64 * secs_per_token;
        LoadReport {
            pending_prefill_tokens: pending,
            running_prefill_tokens,
            waiting_by_tenant: waiting.into_iter().map(|(n, t)| (t.clone(), n)).collect(),
            running: running as u32,
            max_seqs: config.max_seqs as u32,
            max_batched_tokens: config.max_batched_tokens as u32,
            decode_step_prefill_tokens: config.decode_step_prefill_tokens as u32,
            available_blocks: (u.free + u.cached) as u64,
            free_blocks: u.free as u64,
            secs_per_token,
            step_secs,
            next_finish_secs: backlog.next_end.map_or(0.0, |n| n as f64 * step),
            age_secs: 0.0,
            host_load_secs_per_block: self.tier_rates.0,
            disk_load_secs_per_block: self.tier_rates.1,
            // Measured by the server's fetches, which record them in the statistics.
            peer_load_secs_per_block: self.metrics.update(|m| m.tiers.peer_rate()),
            compute: self.compute.clone(),
        }
    }

    fn status(&self) -> Status {
        let u = self.sched.kv.usage();
        let names: HashMap<TenantId, &String> = self.tenants.iter().map(|(k, v)| (*v, k)).collect();
        Status {
            blocks_used: u.used,
            blocks_cached: u.cached,
            blocks_free: u.free,
            running: self.sched.num_running(),
            waiting: self.sched.num_waiting(),
            swapped: self.sched.num_swapped(),
            running_by_tenant: self
                .sched
                .running_by_tenant()
                .into_iter()
                .filter_map(|(t, n)| names.get(&t).map(|name| ((*name).clone(), n)))
                .collect(),
            load: self.load(),
        }
    }

    pub fn kv(&self) -> &KvCacheManager {
        &self.sched.kv
    }
}

/// Sends sample `index`'s output up to byte `keep` of its text, with the logprobs it holds, and
/// `finish` on its last piece. When the channel is full (the client reads slower than the engine
/// writes) the output stays in the sample, nothing copied, and goes with the next piece that finds
/// room. False when the client is gone.
fn deliver(
    out: &mut Outbox,
    sample: &mut Sample,
    index: usize,
    keep: usize,
    finish: Option<FinishReason>,
    now: Instant,
) -> bool {
    if finish.is_none() && !out.has_room() {
        out.full(now);
        return true;
    }
    let event = Event::Piece {
        index: index as u32,
        text: sample.detok.text[sample.sent..keep].to_owned(),
        logprobs: std::mem::take(&mut sample.held),
        finish,
    };
    let from = std::mem::replace(&mut sample.sent, keep);
    if finish.is_some() {
        return out.last_piece(index, event);
    }
    match out.piece(event, now) {
        Ok(()) => true,
        Err(Refused::Full(event)) => {
            if let Event::Piece { logprobs, .. } = event {
                (sample.sent, sample.held) = (from, logprobs);
            }
            true
        }
        Err(Refused::Closed) => false,
    }
}
