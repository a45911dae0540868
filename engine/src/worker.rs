//! The engine thread: it owns the scheduler, the model and every sequence's sampler, and runs
//! steps back to back while there is work. HTTP handlers talk to it over channels: requests and
//! admin commands come in on one channel; each request's tokens go out on its own channel; KV
//! events go out on a broadcast channel for `/kv/events`.
//!
//! A request whose output channel is closed (the client disconnected) is aborted at the next step
//! and every block it held is freed.

mod detok;

use crate::kv::{KvCacheManager, ScopeId};
use crate::model::Llama;
use crate::sampling::{Sampler, StopChecker, StopMatch, TokenLogprobs, Workspace};
use crate::scheduler::{
    FinishReason as SchedFinish, GroupId, NewGroup, Scheduler, StepItem, StepPlan, TenantId,
};
use crate::server::metrics::Metrics;
use detok::Detokenizer;
use kvgate_kernels::{AttnSeq, Backend};
use kvgate_protocol::openai::{ApiError, ErrorCode, FinishReason, SamplingParams};
use kvgate_protocol::prompt::PromptRenderer;
use kvgate_protocol::{BlockHash, KvEventRecord};
use std::collections::HashMap;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{broadcast, mpsc, oneshot};

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
    pub events: mpsc::UnboundedSender<Event>,
}

/// What a request's channel carries, per sample `index`.
#[derive(Debug, Clone)]
pub enum Event {
    /// The text a token added to sample `index` (may be empty while a character or a possible
    /// stop string is incomplete). `token` and `logprobs` are absent when the token is not part
    /// of the output (an EOS or stop token). `finish` is set on the sample's last piece.
    Piece {
        index: u32,
        text: String,
        token: Option<u32>,
        logprobs: Option<TokenLogprobs>,
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
}

/// Commands to the engine thread.
#[derive(Debug)]
pub enum Command {
    Submit(GroupId, Box<Submit>),
    Abort(GroupId),
    /// Drop cached prefixes (all, or one scope); replies with the number dropped.
    Flush(Option<String>, oneshot::Sender<usize>),
    Status(oneshot::Sender<Status>),
    /// Every cached hash with its scope, and the last event number it reflects.
    Snapshot(oneshot::Sender<(u64, Vec<(String, BlockHash)>)>),
}

struct Sample {
    sampler: Sampler,
    stop: StopChecker,
    detok: Detokenizer,
    /// Bytes of `detok.text` already sent.
    sent: usize,
    last_token_at: Option<Instant>,
    done: bool,
}

struct Request {
    tenant: String,
    events: mpsc::UnboundedSender<Event>,
    arrival: Instant,
    prompt: Vec<u32>,
    samples: Vec<Sample>,
    /// Sequence id -> sample index.
    index: HashMap<crate::kv::SeqId, usize>,
    first_token: bool,
    completion_tokens: usize,
}

/// The engine thread's state.
pub struct Worker<B: Backend> {
    sched: Scheduler,
    model: Llama<B>,
    renderer: Arc<PromptRenderer>,
    eos: Vec<u32>,
    requests: HashMap<GroupId, Request>,
    tenants: HashMap<String, TenantId>,
    /// The scope each tenant's requests use (the gateway gives a tenant one scope).
    tenant_scopes: HashMap<String, ScopeId>,
    metrics: Arc<Metrics>,
    kv_events: broadcast::Sender<KvEventRecord>,
    ws: Workspace,
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
        metrics: Arc<Metrics>,
        kv_events: broadcast::Sender<KvEventRecord>,
    ) -> Self {
        Worker {
            sched,
            model,
            renderer,
            eos,
            requests: HashMap::new(),
            tenants: HashMap::new(),
            tenant_scopes: HashMap::new(),
            metrics,
            kv_events,
            ws: Workspace::new(),
        }
    }

    /// Runs until every sender of `rx` is gone and no work is left.
    pub fn run(mut self, rx: Receiver<Command>) {
        loop {
            if self.sched.has_work() {
                loop {
                    match rx.try_recv() {
                        Ok(cmd) => self.handle(cmd),
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => break,
                    }
                }
                self.step();
            } else {
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return,
                }
            }
            self.publish();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(id, s) => self.submit(id, *s),
            Command::Abort(id) => {
                if self.sched.abort(id) {
                    self.requests.remove(&id);
                }
            }
            Command::Flush(scope, reply) => {
                let scope = scope.map(|s| self.sched.kv.scope(&s));
                let _ = reply.send(self.sched.kv.flush(scope));
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

    fn tenant(&mut self, name: &str, priority: f64) -> TenantId {
        let next = TenantId(self.tenants.len() as u32);
        let id = *self.tenants.entry(name.to_owned()).or_insert(next);
        self.sched.set_tenant_weight(id, priority);
        id
    }

    fn submit(&mut self, id: GroupId, s: Submit) {
        let tenant = self.tenant(&s.tenant, s.priority);
        let scope: ScopeId = self.sched.kv.scope(&s.scope);
        self.tenant_scopes.insert(s.tenant.clone(), scope);
        if s.kv_quota.is_some() {
            self.sched.kv.set_quota(scope, s.kv_quota);
        }
        let n = s.params.n.max(1);
        let samples = (0..n)
            .map(|i| Sample {
                sampler: Sampler::new(&s.params, &s.prompt, &self.eos, i),
                stop: StopChecker::new(&s.params, &self.eos, s.max_tokens),
                detok: Detokenizer::default(),
                sent: 0,
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
            let _ = s.events.send(Event::Failed(ApiError::new(
                ErrorCode::InvalidValue,
                reason,
            )));
            return;
        }
        self.requests.insert(
            id,
            Request {
                tenant: s.tenant,
                events: s.events,
                arrival: Instant::now(),
                prompt: s.prompt,
                samples,
                index: HashMap::new(),
                first_token: false,
                completion_tokens: 0,
            },
        );
    }

    fn step(&mut self) {
        // Requests whose client went away are dropped before they cost a step.
        let gone: Vec<GroupId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.sched.abort(id);
            self.requests.remove(&id);
        }
        let plan = self.sched.schedule();
        for (id, reason) in &plan.rejected {
            if let Some(r) = self.requests.remove(id) {
                let _ = r.events.send(Event::Failed(ApiError::new(
                    ErrorCode::InvalidValue,
                    reason.clone(),
                )));
            }
        }
        let pairs = |v: &[(crate::kv::BlockId, crate::kv::HostBlockId)]| -> Vec<(u32, u32)> {
            v.iter().map(|(d, h)| (d.0, h.0)).collect()
        };
        self.model.swap_out(&pairs(&plan.swap_out));
        let swap_in: Vec<(u32, u32)> = plan.swap_in.iter().map(|(h, d)| (h.0, d.0)).collect();
        self.model.swap_in(&swap_in);
        let cow: Vec<(u32, u32)> = plan.cow.iter().map(|(s, d)| (s.0, d.0)).collect();
        self.model.copy_blocks(&cow);
        if plan.is_empty() {
            return;
        }
        let (logits, sampled) = self.forward(&plan);
        let vocab = self.model.config().vocab_size;
        for (k, item) in sampled.iter().enumerate() {
            let row = &logits[k * vocab..(k + 1) * vocab];
            self.on_logits(item.group, item.seq, row);
        }
        self.metrics
            .update(|m| m.batch_tokens.observe(plan.num_tokens() as f64));
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
        let logits = self.model.forward(&crate::model::Batch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            seqs: &seqs,
            logits_rows: &rows,
        });
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
        let sampled = match sample.sampler.sample(logits, &mut self.ws) {
            Ok(s) => s,
            Err(e) => {
                let _ = req
                    .events
                    .send(Event::Failed(ApiError::internal(e.to_string())));
                self.sched.abort(gid);
                self.requests.remove(&gid);
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
        let text = sample.detok.text[sample.sent..keep].to_owned();
        sample.sent = keep;
        let event = Event::Piece {
            index: index as u32,
            text,
            token: output.then_some(sampled.token),
            logprobs: sampled.logprobs.filter(|_| output),
            finish: finish.as_ref().map(|f| f.reason),
        };
        let delivered = req.events.send(event).is_ok();
        if !delivered {
            self.sched.abort(gid);
            self.requests.remove(&gid);
            return;
        }
        if finish.is_none() {
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
        let _ = req.events.send(Event::Done {
            prompt_tokens: req.prompt.len(),
            completion_tokens: req.completion_tokens,
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
        let s = self.sched.stats();
        let tenant_blocks: Vec<(String, u64)> = self
            .tenant_scopes
            .iter()
            .map(|(t, s)| (t.clone(), u64::from(self.sched.kv.scope_usage(*s))))
            .collect();
        let tenant_quota: Vec<(String, u64)> = self
            .tenant_scopes
            .iter()
            .filter_map(|(t, s)| Some((t.clone(), u64::from(self.sched.kv.quota(*s)?))))
            .collect();
        let (running, waiting, swapped) = (
            self.sched.num_running(),
            self.sched.num_waiting(),
            self.sched.num_swapped(),
        );
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
            m.running = running as u64;
            m.waiting = waiting as u64;
            m.swapped = swapped as u64;
            m.tenant_blocks.extend(tenant_blocks);
            m.tenant_quota.extend(tenant_quota);
        });
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
        }
    }

    pub fn kv(&self) -> &KvCacheManager {
        &self.sched.kv
    }
}
