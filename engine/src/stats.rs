//! What the engine thread publishes about itself: KV blocks by state, prefix-cache lookups and
//! hits, evictions, copy-on-write copies, preemptions, swaps, queue lengths, tokens and latency
//! histograms. The worker updates it once per step and as tokens go out; the server renders it
//! as Prometheus metrics (`server::metrics`). Labels are bounded: states and modes are fixed
//! enums, tenants are the ids the gateway sends (configured tenants).

use kvgate_http::metrics::Histogram;
use kvgate_protocol::LoadReport;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const DURATION_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
];

/// The engine's statistics.
#[derive(Debug)]
pub struct EngineStats {
    pub blocks_used: u64,
    pub blocks_cached: u64,
    pub blocks_free: u64,
    pub blocks_capacity: u64,
    pub filled_slots: u64,
    pub block_size: u64,
    pub queried_tokens: BTreeMap<String, u64>,
    pub hit_tokens: BTreeMap<String, u64>,
    pub evicted_blocks: u64,
    pub cow_copies: u64,
    pub preemptions_recompute: u64,
    pub preemptions_swap: u64,
    pub swapped_out_blocks: u64,
    pub swapped_in_blocks: u64,
    pub running: u64,
    pub waiting: u64,
    pub swapped: u64,
    pub tenant_blocks: BTreeMap<String, u64>,
    /// KV block quota per tenant (tenants with a quota only).
    pub tenant_quota: BTreeMap<String, u64>,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Streams cancelled because their client stopped reading.
    pub stalled_clients: u64,
    /// Grammar masks computed (one per constrained sample per step), and their total time.
    pub grammar_masks: u64,
    pub grammar_mask_seconds: f64,
    /// Decodes of constrained groups held back a step because their tenant's masks had spent
    /// its share of the step's mask time.
    pub grammar_deferred_decodes: u64,
    /// Grammars compiled (not found in the cache), their total time, and cache hits.
    pub grammar_compiles: u64,
    pub grammar_compile_seconds: f64,
    pub grammar_cache_hits: u64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub request_duration: Histogram,
    pub batch_tokens: Histogram,
    /// Each step's wall time, from its forward pass to its last sample (peer asks answered
    /// between layers and grammar masks included): their sum over a while is how busy the
    /// engine was.
    pub step_seconds: Histogram,
    pub model: String,
    pub device: String,
    /// The load report as of the last step (for `/admin/status` while a step runs), and when
    /// it was made.
    pub load: LoadReport,
    pub load_at: Option<std::time::Instant>,
    /// The prefix cache's slower tiers.
    pub tiers: TierStats,
}

/// The host-memory and disk tiers of the prefix cache (all zero when they are off).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct TierStats {
    /// Bytes of one block's KV, every layer.
    pub block_bytes: u64,
    pub host_blocks: u64,
    pub host_capacity: u64,
    pub disk_blocks: u64,
    pub disk_capacity: u64,
    /// Whether the disk tier was configured, and whether it is on (a full disk turns it off).
    pub disk_configured: bool,
    pub disk_up: bool,
    pub host_hit_tokens: u64,
    pub disk_hit_tokens: u64,
    pub promoted_blocks: u64,
    pub loaded_blocks: u64,
    pub demoted_blocks: u64,
    pub spilled_blocks: u64,
    pub dropped_blocks: u64,
    /// Disk blocks found corrupt, cut short or unreadable (deleted, never served).
    pub corrupt_blocks: u64,
    /// Disk writes that failed or were refused because the disk queue was full.
    pub failed_writes: u64,
    /// Loads from disk, and their total time.
    pub loads: u64,
    pub load_seconds: f64,
    /// Time spent copying between the device pool and the host tier.
    pub copy_seconds: f64,
    /// Bytes of disk writes waiting.
    pub queued_write_bytes: u64,
    pub peer_hit_tokens: u64,
    pub imported_blocks: u64,
    pub saved_blocks: u64,
    /// Peer fetches by how they ended.
    pub peer_fetches: PeerFetches,
    /// Blocks that peer fetches brought, and their total time.
    pub peer_blocks: u64,
    pub peer_seconds: f64,
    /// Seconds per block of a peer fetch, as the load report gives it
    /// ([`LoadReport::peer_load_secs_per_block`]): the median of `peer_rates`.
    pub peer_secs_per_block: f64,
    /// The recent fetches that brought blocks, each one's seconds per block.
    #[serde(skip)]
    pub peer_rates: Recent,
    /// Transfers served to peers, the blocks they carried, and those refused (busy).
    pub exports: u64,
    pub exported_blocks: u64,
    pub exports_refused: u64,
    /// Asks of those transfers that waited for a step here to compute the blocks asked for.
    pub export_waits: u64,
}

/// The last [`Recent::KEEP`] measurements of a time, of the last [`Recent::MAX_AGE`], for their
/// median: a few odd ones (a fetch that waited for a long step) do not move it, and a price set
/// by a burst long past does not stay (it would keep the requests that would measure it again
/// away).
#[derive(Debug, Clone, Default)]
pub struct Recent(std::collections::VecDeque<(Instant, f64)>);

impl Recent {
    pub const KEEP: usize = 32;
    pub const MAX_AGE: Duration = Duration::from_secs(60);

    /// Adds a measurement taken at `at` (one that is negative or not finite is dropped),
    /// forgetting the oldest past [`Recent::KEEP`].
    pub fn push(&mut self, at: Instant, secs: f64) {
        if !(secs.is_finite() && secs >= 0.0) {
            return;
        }
        if self.0.len() == Self::KEEP {
            self.0.pop_front();
        }
        self.0.push_back((at, secs));
    }

    /// The median, as of `now`, of the measurements under [`Recent::MAX_AGE`] old (of an even
    /// count, the higher of the middle two); 0 with none. Older ones are forgotten.
    pub fn median(&mut self, now: Instant) -> f64 {
        while let Some(&(at, _)) = self.0.front() {
            if now.saturating_duration_since(at) < Self::MAX_AGE {
                break;
            }
            self.0.pop_front();
        }
        let recent = self.0.iter().map(|&(_, secs)| secs).collect();
        kvgate_protocol::load::upper_median(recent).unwrap_or(0.0)
    }
}

impl TierStats {
    /// The measured seconds per block of a peer fetch as of now ([`Recent::median`] of
    /// `peer_rates`), kept in `peer_secs_per_block` for the status and the metrics.
    pub fn peer_rate(&mut self) -> f64 {
        self.peer_secs_per_block = self.peer_rates.median(Instant::now());
        self.peer_secs_per_block
    }
}

/// Peer fetches by how they ended.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct PeerFetches {
    pub complete: u64,
    pub partial: u64,
    pub busy: u64,
    pub failed: u64,
    pub timed_out: u64,
    /// Waited for a transfer of the same blocks that another request here ran, which left
    /// nothing more to fetch (or no time).
    pub joined: u64,
    /// Every transfer slot stayed taken as long as the request could wait: computed instead.
    pub refused: u64,
    /// The peer failed, was busy, or did not answer in time moments before: not asked,
    /// computed instead.
    pub held_off: u64,
}

impl PeerFetches {
    pub fn push_result(&mut self, result: &str) {
        match result {
            "complete" => self.complete += 1,
            "partial" => self.partial += 1,
            "busy" => self.busy += 1,
            "timed_out" => self.timed_out += 1,
            "joined" => self.joined += 1,
            "refused" => self.refused += 1,
            "held_off" => self.held_off += 1,
            _ => self.failed += 1,
        }
    }
}

/// Shared between the engine thread (writer) and the HTTP handlers (readers).
#[derive(Debug)]
pub struct Stats {
    state: Mutex<EngineStats>,
}

impl Stats {
    pub fn new(model: &str, device: &str, block_size: usize, capacity: usize) -> Self {
        Stats {
            state: Mutex::new(EngineStats {
                blocks_used: 0,
                blocks_cached: 0,
                blocks_free: capacity as u64,
                blocks_capacity: capacity as u64,
                filled_slots: 0,
                block_size: block_size as u64,
                queried_tokens: BTreeMap::new(),
                hit_tokens: BTreeMap::new(),
                evicted_blocks: 0,
                cow_copies: 0,
                preemptions_recompute: 0,
                preemptions_swap: 0,
                swapped_out_blocks: 0,
                swapped_in_blocks: 0,
                running: 0,
                waiting: 0,
                swapped: 0,
                tenant_blocks: BTreeMap::new(),
                tenant_quota: BTreeMap::new(),
                prompt_tokens: 0,
                generation_tokens: 0,
                stalled_clients: 0,
                grammar_masks: 0,
                grammar_mask_seconds: 0.0,
                grammar_deferred_decodes: 0,
                grammar_compiles: 0,
                grammar_compile_seconds: 0.0,
                grammar_cache_hits: 0,
                ttft: Histogram::new(LATENCY_BUCKETS),
                itl: Histogram::new(LATENCY_BUCKETS),
                request_duration: Histogram::new(DURATION_BUCKETS),
                batch_tokens: Histogram::new(TOKEN_BUCKETS),
                step_seconds: Histogram::new(LATENCY_BUCKETS),
                model: model.to_owned(),
                device: device.to_owned(),
                load: LoadReport::default(),
                load_at: None,
                tiers: TierStats::default(),
            }),
        }
    }

    /// Runs `f` on the state under the lock (a poisoned lock still yields the data: metrics
    /// must never take the engine down).
    pub fn update<R>(&self, f: impl FnOnce(&mut EngineStats) -> R) -> R {
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }
}

#[cfg(test)]
mod tests {
    use super::Recent;
    use std::time::{Duration, Instant};

    #[test]
    fn a_recent_median_forgets_the_oldest_and_drops_nonsense() {
        let t0 = Instant::now();
        let mut r = Recent::default();
        assert_eq!(r.median(t0), 0.0);
        for secs in [0.02, 5.0, 0.01, f64::NAN, -1.0, f64::INFINITY] {
            r.push(t0, secs);
        }
        // One fetch that waited long does not move it.
        assert_eq!(r.median(t0), 0.02);
        for _ in 0..Recent::KEEP {
            r.push(t0, 0.03);
        }
        assert_eq!(r.median(t0), 0.03);
        // Half the window and one more, faster: the old ones are forgotten.
        let t1 = t0 + Duration::from_secs(1);
        for _ in 0..Recent::KEEP / 2 + 1 {
            r.push(t1, 0.001);
        }
        assert_eq!(r.median(t1), 0.001);
        // A minute on, those of t0 are too old; a while later, all are: unmeasured again.
        assert_eq!(r.median(t0 + Recent::MAX_AGE), 0.001);
        assert_eq!(r.0.len(), Recent::KEEP / 2 + 1);
        assert_eq!(r.median(t1 + Recent::MAX_AGE), 0.0);
        assert!(r.0.is_empty());
    }
}
