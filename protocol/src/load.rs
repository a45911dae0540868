//! What an engine reports about its queue and its speed (`load` in `/admin/status`), and the
//! wait a new request can expect there, in seconds. The gateway's routing score is a time: the
//! prefill a cached prefix saves (tokens x the engine's measured seconds per token) against the
//! wait its queue adds. Engine, gateway and routing simulator share this one estimate.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most tenants [`LoadReport::waiting_by_tenant`] lists; the others' tokens are counted as if
/// they were ahead of everyone (in `running_prefill_tokens`).
pub const MAX_REPORTED_TENANTS: usize = 256;

/// Reported step costs above this many seconds are taken as nonsense.
const MAX_STEP_SECS: f64 = 60.0;

/// An engine's queue and measured step costs, as of its last step.
///
/// Every field defaults, so a report from an older engine (or none at all) reads as an idle
/// engine of unknown speed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadReport {
    /// Prompt tokens not yet computed: `running_prefill_tokens` plus every tenant's waiting.
    pub pending_prefill_tokens: u64,
    /// Of those, the rest of the prefills in progress, which go before any new admission.
    pub running_prefill_tokens: u64,
    /// The uncached prompt tokens of waiting requests, per tenant (net of the prefix the cache
    /// holds for them now). The engine admits waiting requests by fair queuing across tenants,
    /// so a tenant's wait depends on its own queue and on the others' only up to its own size.
    pub waiting_by_tenant: BTreeMap<String, u64>,
    /// Sequences in the running batch.
    pub running: u32,
    /// The batch's limit (`scheduler.max_seqs`).
    pub max_seqs: u32,
    /// Tokens one step computes at most (`scheduler.max_batched_tokens`).
    pub max_batched_tokens: u32,
    /// Prompt tokens a step that also decodes computes at most
    /// (`scheduler.decode_step_prefill_tokens`; 0: no such limit).
    pub decode_step_prefill_tokens: u32,
    /// KV blocks a new request may take without waiting: free plus cached (evictable).
    pub available_blocks: u64,
    /// KV blocks that are free and hold nothing: a new request's blocks beyond these evict
    /// cached prefixes.
    pub free_blocks: u64,
    /// Measured marginal seconds per token of a step (0 until measured).
    pub secs_per_token: f64,
    /// Measured fixed seconds per step, whatever its size.
    pub step_secs: f64,
    /// Seconds until the running sequence nearest its end (its `max_tokens`) finishes and frees
    /// its slot and blocks; 0 with nothing running.
    pub next_finish_secs: f64,
    /// How old these figures were when the engine sent them (it answers with the last step's
    /// while a long step runs).
    pub age_secs: f64,
    /// Measured seconds to bring one block back from the host tier, and from the disk tier
    /// (0 until measured).
    pub host_load_secs_per_block: f64,
    pub disk_load_secs_per_block: f64,
    /// Measured seconds a fetch from a peer takes here, per block and one block's more for the
    /// ask (as [`peer_fetch_secs`] counts them): the median of the recent fetches that brought
    /// blocks, from the request's ask to its last block. It counts what such a request waits
    /// for: a transfer slot, and a peer still computing what it sends. 0 until measured.
    pub peer_load_secs_per_block: f64,
    /// Identifies what the engine computes on (a hash of its machine and its CPU set or
    /// device): engines reporting the same value share their compute, so work moved from one
    /// to the other gains no capacity. Empty: unknown (taken as its own).
    pub compute: String,
}

/// Longest [`LoadReport::compute`] kept from a report (longer ones are cut).
pub const MAX_COMPUTE_LEN: usize = 64;

/// Seconds to bring one block back from the host tier, until an engine has measured it (a copy
/// of under a megabyte).
pub const PRIOR_HOST_LOAD_SECS_PER_BLOCK: f64 = 0.0002;
/// Seconds to read one block from the disk tier, until an engine has measured it.
pub const PRIOR_DISK_LOAD_SECS_PER_BLOCK: f64 = 0.002;
/// Seconds to fetch one block from a peer engine (framed, MACed, over the network) and stage it.
pub const PRIOR_PEER_LOAD_SECS_PER_BLOCK: f64 = 0.002;

/// Seconds a transfer of `blocks` blocks from a peer takes at `secs_per_block` (an engine's
/// measured [`LoadReport::peer_load_secs_per_block`]; 0: not measured, the
/// [`PRIOR_PEER_LOAD_SECS_PER_BLOCK`]): each block's, and one block's more for the ask and its
/// answer.
pub fn peer_fetch_secs(blocks: usize, secs_per_block: f64) -> f64 {
    if blocks == 0 {
        return 0.0;
    }
    let rate = if secs_per_block > 0.0 && secs_per_block.is_finite() {
        secs_per_block
    } else {
        PRIOR_PEER_LOAD_SECS_PER_BLOCK
    };
    blocks.saturating_add(1) as f64 * rate
}

/// How long an engine waits for a peer fetch of `blocks` blocks before it computes what has not
/// come: a second, plus about a block's prefill on a slow CPU per block (a peer still computing
/// the prompt sends each block when a step has computed it, and one step of a CPU's prefill may
/// take a second), at most ten seconds.
pub fn peer_fetch_limit_secs(blocks: usize) -> f64 {
    (1.0 + 0.025 * blocks as f64).min(10.0)
}

/// The median of `values` (of an even count, the higher of the middle two: the slower of two
/// rates); `None` with none.
pub fn upper_median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied()
}

/// A number of seconds from a report, made safe to compute with: finite, in `[0, max]`.
fn sane(secs: f64, max: f64) -> f64 {
    if secs.is_finite() {
        secs.clamp(0.0, max)
    } else {
        0.0
    }
}

impl LoadReport {
    /// The same report with every measured time made finite and bounded (a report is read from
    /// the network).
    pub fn sanitized(mut self) -> Self {
        self.secs_per_token = sane(self.secs_per_token, 1.0);
        self.step_secs = sane(self.step_secs, MAX_STEP_SECS);
        self.next_finish_secs = sane(self.next_finish_secs, 24.0 * 3600.0);
        self.age_secs = sane(self.age_secs, 24.0 * 3600.0);
        self.host_load_secs_per_block = sane(self.host_load_secs_per_block, 1.0);
        self.disk_load_secs_per_block = sane(self.disk_load_secs_per_block, 1.0);
        self.peer_load_secs_per_block = sane(self.peer_load_secs_per_block, 1.0);
        if self.compute.len() > MAX_COMPUTE_LEN {
            let mut end = MAX_COMPUTE_LEN;
            while !self.compute.is_char_boundary(end) {
                end -= 1;
            }
            self.compute.truncate(end);
        }
        self
    }

    /// Seconds to bring `host` blocks from the host tier and `disk` from the disk tier into
    /// the device pool: measured rates, else the priors.
    pub fn tier_load_secs(&self, host: u32, disk: u32) -> f64 {
        let rate = |r: f64, prior: f64| if r > 0.0 { r } else { prior };
        let h = rate(
            self.host_load_secs_per_block,
            PRIOR_HOST_LOAD_SECS_PER_BLOCK,
        );
        // A disk block is read, then copied up from the host tier.
        let d = rate(
            self.disk_load_secs_per_block,
            PRIOR_DISK_LOAD_SECS_PER_BLOCK,
        ) + h;
        f64::from(host) * h + f64::from(disk) * d
    }

    /// Seconds per prefill token: measured, else `prior`.
    pub fn secs_per_token(&self, prior: f64) -> f64 {
        if self.secs_per_token > 0.0 && self.secs_per_token.is_finite() {
            self.secs_per_token
        } else {
            prior
        }
    }

    /// Seconds to prefill `tokens` in chunks beside the running batch's decodes.
    pub fn prefill_secs(&self, tokens: u64, prior: f64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let per_token = self.secs_per_token(prior);
        let running = u64::from(self.running);
        let mut chunk = u64::from(self.max_batched_tokens).saturating_sub(running);
        if running > 0 && self.decode_step_prefill_tokens > 0 {
            chunk = chunk.min(u64::from(self.decode_step_prefill_tokens));
        }
        let chunk = chunk.max(1);
        let steps = tokens.div_ceil(chunk);
        tokens as f64 * per_token + steps as f64 * (self.step_secs + running as f64 * per_token)
    }

    /// Prefill tokens the engine computes before those of a new request of `tenant` with
    /// `own_tokens` to compute: the prefills in progress, the tenant's own waiting requests,
    /// and of every other tenant's waiting tokens at most as many as the tenant's (fair
    /// queuing serves them side by side). Without a tenant, everything pending.
    pub fn queued_ahead(&self, tenant: Option<&str>, own_tokens: u64) -> u64 {
        let Some(tenant) = tenant else {
            return self.pending_prefill_tokens;
        };
        let mine = self.waiting_by_tenant.get(tenant).copied().unwrap_or(0);
        let share = mine.saturating_add(own_tokens);
        let others = self
            .waiting_by_tenant
            .iter()
            .filter(|(t, _)| t.as_str() != tenant)
            .fold(0u64, |sum, (_, &w)| sum.saturating_add(w.min(share)));
        self.running_prefill_tokens
            .saturating_add(mine)
            .saturating_add(others)
    }

    /// Expected seconds, as of this report, before the prefill of a new request of `tenant`
    /// (with `own_tokens` to compute in `blocks_needed` new blocks) starts on this engine: the
    /// prefill queued ahead of it, plus, when the batch is full or the cache cannot hold its
    /// blocks, the time until a running sequence ends.
    pub fn wait_secs(
        &self,
        tenant: Option<&str>,
        own_tokens: u64,
        blocks_needed: u64,
        prior: f64,
    ) -> f64 {
        let mut wait = self.prefill_secs(self.queued_ahead(tenant, own_tokens), prior);
        let batch_full = self.max_seqs > 0 && self.running >= self.max_seqs;
        if batch_full || blocks_needed > self.available_blocks {
            wait += self.next_finish_secs.max(0.0);
        }
        if wait.is_finite() {
            wait
        } else {
            f64::MAX
        }
    }
}

/// What a router knows of one request to an engine, for [`LoadReport::wait_now`].
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// The tenant, as the engine names it.
    pub tenant: Option<&'a str>,
    /// Prompt tokens the engine would compute (those it does not cache).
    pub own_tokens: u64,
    /// New KV blocks they take.
    pub blocks_needed: u64,
    /// Prefill tokens this router sent the engine that have not started.
    pub queued_tokens: u64,
}

impl LoadReport {
    /// The wait a router expects for `ask` from this report, received `age_secs` ago: the
    /// report's wait less what the engine has worked off since the figures were taken, and at
    /// least the prefill of the tokens the router itself queued there (which a report taken
    /// before they arrived does not show).
    pub fn wait_now(&self, age_secs: f64, ask: Ask<'_>, prior: f64) -> f64 {
        let reported = self.wait_secs(ask.tenant, ask.own_tokens, ask.blocks_needed, prior);
        let reported = (reported - age_secs.max(0.0) - self.age_secs.max(0.0)).max(0.0);
        reported.max(self.prefill_secs(ask.queued_tokens, prior))
    }
}

/// An online least-squares fit of a step's time against its size, `secs = step + per_token x
/// tokens`, with exponential forgetting so that it follows a machine whose speed changes (other
/// work on its cores, a warmer cache).
#[derive(Debug, Clone, Copy)]
pub struct StepCost {
    /// Weight of the newest step (1 - forgetting factor).
    rate: f64,
    n: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    /// The quickest recent step, of any size: the fixed cost of a step is no more than that.
    /// It drops to a quicker step at once and rises toward slower ones at `rate`.
    quickest: f64,
    /// The last fit made while step sizes were spread out, kept through stretches of same-size
    /// steps (decode alone), which cannot tell the fixed cost from the per-token one.
    last: Option<(f64, f64)>,
}

impl Default for StepCost {
    fn default() -> Self {
        StepCost::new(0.05)
    }
}

impl StepCost {
    /// `rate`: the weight of each new step, in (0, 1].
    pub fn new(rate: f64) -> Self {
        StepCost {
            rate: rate.clamp(1e-6, 1.0),
            n: 0.0,
            sx: 0.0,
            sy: 0.0,
            sxx: 0.0,
            sxy: 0.0,
            quickest: f64::INFINITY,
            last: None,
        }
    }

    /// Records one step of `tokens` tokens that took `secs`.
    pub fn observe(&mut self, tokens: usize, secs: f64) {
        if tokens == 0 || !secs.is_finite() || secs < 0.0 {
            return;
        }
        let keep = 1.0 - self.rate;
        let x = tokens as f64;
        self.n = self.n * keep + 1.0;
        self.sx = self.sx * keep + x;
        self.sy = self.sy * keep + secs;
        self.sxx = self.sxx * keep + x * x;
        self.sxy = self.sxy * keep + x * secs;
        self.quickest = if secs < self.quickest {
            secs
        } else {
            self.quickest + self.rate * (secs - self.quickest)
        };
        if let Some(fit) = self.line() {
            self.last = Some(fit);
        }
    }

    /// The least-squares line, when step sizes are spread enough to fit one.
    fn line(&self) -> Option<(f64, f64)> {
        let (mx, my) = (self.sx / self.n, self.sy / self.n);
        let var = self.sxx / self.n - mx * mx;
        // Sizes spread by less than ~2 tokens: no slope to fit.
        if var.is_nan() || var < 4.0 {
            return None;
        }
        let slope = (self.sxy / self.n - mx * my) / var;
        let intercept = my - slope * mx;
        // A step never gets cheaper with more tokens: a slope at or below zero is noise (steps
        // slowed by other work on the cores, a cold first pass), and read as a line it would
        // price a whole prefill at nothing and put everything on a fixed step cost. So is a
        // negative fixed cost. Either way, the line through the origin that fits best: all of
        // the time on the tokens.
        if slope <= 0.0 || intercept < 0.0 || !slope.is_finite() {
            return Some((0.0, (self.sxy / self.sxx).max(0.0)));
        }
        // A fixed cost above the quickest recent step is the line bent by steps that other
        // work slowed (large and small steps rarely meet the same contention): the fixed cost
        // is held to that step, and the per-token cost fitted again under it.
        if intercept > self.quickest {
            let step = self.quickest;
            return Some((step, ((self.sxy - step * self.sx) / self.sxx).max(0.0)));
        }
        Some((intercept, slope))
    }

    /// `(step_secs, secs_per_token)`, both >= 0; `(0, 0)` before any step. Through a stretch
    /// of same-size steps the last line fitted holds; before any, the whole time is put on the
    /// tokens.
    pub fn fit(&self) -> (f64, f64) {
        if self.n <= 0.0 {
            return (0.0, 0.0);
        }
        if let Some(fit) = self.line().or(self.last) {
            return fit;
        }
        let (mx, my) = (self.sx / self.n, self.sy / self.n);
        (0.0, (my / mx.max(1.0)).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_finds_fixed_and_per_token_costs() {
        let mut c = StepCost::new(0.05);
        assert_eq!(c.fit(), (0.0, 0.0));
        for i in 0..400 {
            let tokens = [1, 3, 8, 64, 256, 512][i % 6];
            c.observe(tokens, 0.015 + 0.0014 * tokens as f64);
        }
        let (step, per_token) = c.fit();
        assert!((step - 0.015).abs() < 1e-6, "{step}");
        assert!((per_token - 0.0014).abs() < 1e-8, "{per_token}");
        // One size only: all of it per token.
        let mut one = StepCost::new(0.05);
        for _ in 0..10 {
            one.observe(4, 0.02);
        }
        let (step, per_token) = one.fit();
        assert!(
            step == 0.0 && (per_token - 0.005).abs() < 1e-12,
            "{step} {per_token}"
        );
        // Nonsense is ignored.
        one.observe(0, 1.0);
        one.observe(4, f64::NAN);
        one.observe(4, -1.0);
        assert_eq!(one.fit(), (step, per_token));
    }

    #[test]
    fn steps_that_do_not_grow_with_their_size_are_not_a_free_prefill() {
        // A cold first prefill of 300 tokens, then small steps slowed by work beside them: the
        // least-squares slope is negative. Read as (0.8 s a step, nothing a token) it would
        // make a queued step look long and a full prefill free.
        let mut c = StepCost::new(0.05);
        c.observe(300, 0.8);
        for _ in 0..3 {
            c.observe(20, 0.85);
        }
        let (step, per_token) = c.fit();
        assert_eq!(step, 0.0);
        let want = (0.8 * 300.0 + 3.0 * 0.85 * 20.0) / (300.0f64.powi(2) + 3.0 * 400.0);
        assert!((per_token - want).abs() / want < 0.05, "{per_token} {want}");
    }

    #[test]
    fn the_fixed_cost_is_no_more_than_the_quickest_step() {
        // Mid-size steps slowed by work beside them, and a few quick decode steps: the line
        // through them all starts above the quick steps' own time.
        let mut c = StepCost::new(0.05);
        for i in 0..40 {
            match i % 4 {
                0 => c.observe(300, 0.45),
                3 => c.observe(2, 0.04),
                _ => c.observe(22, 0.25),
            }
        }
        let (step, per_token) = c.fit();
        assert!(step <= 0.04 + 1e-9, "{step}");
        assert!(per_token > 0.001, "{per_token}");
    }

    #[test]
    fn the_fit_follows_a_change_of_speed() {
        let mut c = StepCost::new(0.05);
        for i in 0..200 {
            c.observe(1 + i % 200, 0.001 * (1 + i % 200) as f64);
        }
        for i in 0..200 {
            c.observe(1 + i % 200, 0.003 * (1 + i % 200) as f64);
        }
        let (_, per_token) = c.fit();
        assert!((per_token - 0.003).abs() < 2e-4, "{per_token}");
    }

    #[test]
    fn same_size_steps_keep_the_last_line() {
        let mut c = StepCost::new(0.05);
        for i in 0..100 {
            let tokens = [1, 200][i % 2];
            c.observe(tokens, 0.015 + 0.0014 * tokens as f64);
        }
        // A long stretch of single-token decode steps: the line stays.
        for _ in 0..1000 {
            c.observe(1, 0.0164);
        }
        let (step, per_token) = c.fit();
        assert!(
            (step - 0.015).abs() < 1e-3 && (per_token - 0.0014).abs() < 1e-4,
            "{step} {per_token}"
        );
    }

    fn ask(
        tenant: Option<&str>,
        own_tokens: u64,
        blocks_needed: u64,
        queued_tokens: u64,
    ) -> Ask<'_> {
        Ask {
            tenant,
            own_tokens,
            blocks_needed,
            queued_tokens,
        }
    }

    #[test]
    fn the_wait_counts_the_queue_a_full_batch_and_a_full_cache() {
        let idle = LoadReport {
            max_seqs: 8,
            max_batched_tokens: 512,
            available_blocks: 100,
            secs_per_token: 0.001,
            ..LoadReport::default()
        };
        assert_eq!(idle.wait_secs(None, 10, 10, 0.5), 0.0);
        // What the router queued counts until the report shows it.
        assert!((idle.wait_now(0.0, ask(None, 10, 10, 300), 0.5) - 0.3).abs() < 1e-9);
        let busy = LoadReport {
            pending_prefill_tokens: 1000,
            running_prefill_tokens: 1000,
            running: 8,
            step_secs: 0.01,
            next_finish_secs: 2.0,
            ..idle.clone()
        };
        // 1000 tokens in chunks of 504 beside 8 decodes: 2 steps of 10 ms + 8 tokens each.
        let queue = 1.0 + 2.0 * (0.01 + 0.008);
        assert!((busy.wait_secs(None, 10, 10, 0.5) - (queue + 2.0)).abs() < 1e-9);
        // An engine that computes at most 256 prompt tokens in a step that decodes: 4 steps.
        let capped = LoadReport {
            decode_step_prefill_tokens: 256,
            ..busy.clone()
        };
        let steps = 1.0 + 4.0 * (0.01 + 0.008);
        assert!((capped.prefill_secs(1000, 0.5) - steps).abs() < 1e-9);
        // A report ages: the engine has worked for that long since.
        assert!((busy.wait_now(1.0, ask(None, 10, 10, 0), 0.5) - (queue + 1.0)).abs() < 1e-9);
        assert_eq!(busy.wait_now(60.0, ask(None, 10, 10, 0), 0.5), 0.0);
        let floor = busy.wait_now(60.0, ask(None, 10, 10, 100), 0.5);
        assert!((floor - busy.prefill_secs(100, 0.5)).abs() < 1e-12);
        // Room in the batch, none in the cache: still the wait for an end.
        let no_room = LoadReport {
            running: 2,
            available_blocks: 3,
            ..busy.clone()
        };
        assert!(no_room.wait_secs(None, 10, 10, 0.5) > 2.0);
        assert!(no_room.wait_secs(None, 10, 3, 0.5) < 2.0);
        // Unmeasured: the prior.
        assert_eq!(LoadReport::default().secs_per_token(0.25), 0.25);
    }

    #[test]
    fn fair_queuing_puts_only_a_tenants_share_of_the_others_ahead_of_it() {
        let mut waiting = BTreeMap::new();
        waiting.insert("flood".to_owned(), 32_000);
        waiting.insert("mine".to_owned(), 100);
        waiting.insert("small".to_owned(), 30);
        let r = LoadReport {
            pending_prefill_tokens: 32_330,
            running_prefill_tokens: 200,
            waiting_by_tenant: waiting,
            ..LoadReport::default()
        };
        // Unknown tenant: everything pending.
        assert_eq!(r.queued_ahead(None, 50), 32_330);
        // "mine" with 50 more: the running 200, its own 100, and up to 150 of each other.
        assert_eq!(r.queued_ahead(Some("mine"), 50), 200 + 100 + 150 + 30);
        // A tenant with nothing waiting: the running prefills and 20 of each other.
        assert_eq!(r.queued_ahead(Some("new"), 20), 200 + 20 + 20 + 20);
        // The flooding tenant itself waits for all of its own.
        assert_eq!(r.queued_ahead(Some("flood"), 0), 200 + 32_000 + 100 + 30);
    }

    #[test]
    fn the_median_of_an_even_count_is_the_higher_of_the_middle_two() {
        assert_eq!(upper_median(vec![]), None);
        assert_eq!(upper_median(vec![0.03, 0.01]), Some(0.03));
        assert_eq!(upper_median(vec![5.0, 0.02, 0.01]), Some(0.02));
    }

    #[test]
    fn reports_from_the_network_are_made_safe() {
        let r = LoadReport {
            secs_per_token: f64::INFINITY,
            step_secs: 1e300,
            next_finish_secs: f64::NAN,
            peer_load_secs_per_block: f64::NEG_INFINITY,
            ..LoadReport::default()
        }
        .sanitized();
        assert_eq!(
            (r.secs_per_token, r.step_secs, r.next_finish_secs),
            (0.0, 60.0, 0.0)
        );
        // A peer rate that is nonsense reads as unmeasured: the prior.
        assert_eq!(r.peer_load_secs_per_block, 0.0);
        assert_eq!(
            peer_fetch_secs(4, r.peer_load_secs_per_block),
            5.0 * PRIOR_PEER_LOAD_SECS_PER_BLOCK
        );
        assert_eq!(peer_fetch_secs(4, 0.02), 5.0 * 0.02);
        assert_eq!(peer_fetch_secs(0, 0.02), 0.0);
        // A compute id is cut to its bound, on a character boundary.
        let long = LoadReport {
            compute: "é".repeat(100),
            ..LoadReport::default()
        }
        .sanitized();
        assert_eq!(long.compute, "é".repeat(MAX_COMPUTE_LEN / 2));
        let huge = LoadReport {
            pending_prefill_tokens: u64::MAX,
            running_prefill_tokens: u64::MAX,
            waiting_by_tenant: [("a".to_owned(), u64::MAX), ("b".to_owned(), u64::MAX)].into(),
            secs_per_token: 1.0,
            max_batched_tokens: 1,
            ..LoadReport::default()
        };
        assert_eq!(huge.queued_ahead(Some("a"), u64::MAX), u64::MAX);
        assert!(huge.wait_secs(Some("a"), 1, 1, 0.001).is_finite());
    }
}
