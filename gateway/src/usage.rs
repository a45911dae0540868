//! The usage ledger, prices and budgets.
//!
//! Every admitted request appends one [`UsageRecord`] when it ends, however it ends (completed,
//! failed, or cancelled by its client, mid-stream included). Records go to the store through the
//! [`Ledger`]: a bounded in-memory queue drained by one background task, so a request never
//! waits on the store for its record, and a store outage buffers records (up to
//! [`LEDGER_BUFFER`]) instead of blocking or losing them; past the bound they are dropped and
//! counted (`kvgate_gateway_usage_records_dropped_total`).
//!
//! The store keeps, for each record, in one atomic step (idempotent on the record's id):
//! - the record itself, in a stream with bounded retention (what `kvgate usage-sink` and
//!   `GET /admin/usage/records` read);
//! - the tenant's daily aggregate ([`day_fields`]): requests, prompt, cached and completion
//!   tokens and cost, in total, per key (`k:{key}:{field}`) and per model (`m:{model}:{field}`);
//! - the tenant's monthly aggregate ([`month_fields`]): tokens and cost, in total and per key,
//!   which budgets are checked against.
//!
//! Days and months are UTC. Costs are integers in micro-dollars (USD 1e-6): a price in USD per
//! million tokens times a token count is already in micro-dollars.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Records held in memory while the store cannot take them; past this they are dropped.
pub const LEDGER_BUFFER: usize = 50_000;
/// Records sent to the store in one call.
const LEDGER_BATCH: usize = 256;
/// How often the writer sends what has queued up: a record reaches the store within about this
/// long after its request ends (budgets see it then).
pub const LEDGER_FLUSH: std::time::Duration = std::time::Duration::from_millis(20);
/// Records the store's stream keeps (approximately: trimmed in whole nodes).
pub const STREAM_RETENTION: u64 = 1_000_000;
/// The highest price accepted, USD per million tokens.
pub const MAX_PRICE: f64 = 1e6;
/// Any one count a record adds to an aggregate is capped here (below 2^53, so Redis' integer
/// increments and Lua's doubles stay exact and can never overflow).
pub const MAX_COUNT: u64 = 1 << 50;

/// USD per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    /// Prompt tokens computed by the engine.
    pub prompt: f64,
    /// Prompt tokens served from the prefix cache; `None`: the prompt price.
    #[serde(default)]
    pub cached_prompt: Option<f64>,
    pub completion: f64,
}

impl Prices {
    /// The cost of one request, in micro-dollars, rounded up (a request that costs anything
    /// costs at least one micro-dollar, so small requests still move a cost budget).
    pub fn cost_micros(&self, prompt: u64, cached: u64, completion: u64) -> u64 {
        let cached = cached.min(prompt);
        let micros = (prompt - cached) as f64 * self.prompt
            + cached as f64 * self.cached_prompt.unwrap_or(self.prompt)
            + completion as f64 * self.completion;
        if micros.is_finite() && micros > 0.0 {
            (micros.ceil() as u64).min(MAX_COUNT)
        } else {
            0
        }
    }

    /// The first field that is not a price (negative, NaN, infinite, or above USD 1,000,000
    /// per million tokens), for a 400 naming it.
    pub fn invalid_field(&self) -> Option<&'static str> {
        let bad = |v: f64| !v.is_finite() || !(0.0..=MAX_PRICE).contains(&v);
        if bad(self.prompt) {
            Some("prompt")
        } else if self.cached_prompt.is_some_and(bad) {
            Some("cached_prompt")
        } else if bad(self.completion) {
            Some("completion")
        } else {
            None
        }
    }
}

/// A monthly budget (UTC calendar month), in tokens (prompt + completion), in cost, or both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    #[serde(default)]
    pub monthly_tokens: Option<u64>,
    #[serde(default)]
    pub monthly_cost_usd: Option<f64>,
}

impl Budget {
    pub fn invalid_field(&self) -> Option<&'static str> {
        self.monthly_cost_usd
            .filter(|v| !v.is_finite() || *v < 0.0)
            .map(|_| "monthly_cost_usd")
    }

    /// The budget's cost limit in micro-dollars.
    fn cost_micros(&self) -> Option<u64> {
        self.monthly_cost_usd
            .map(|usd| (usd * 1e6).round().min(u64::MAX as f64) as u64)
    }

    /// How much of the budget `spent` uses, as the larger of its two ratios (tokens, cost);
    /// `None` when the budget sets neither.
    pub fn used(&self, spent: Spent) -> Option<f64> {
        let ratio = |used: u64, limit: u64| {
            if limit == 0 {
                f64::INFINITY
            } else {
                used as f64 / limit as f64
            }
        };
        let tokens = self.monthly_tokens.map(|l| ratio(spent.tokens, l));
        let cost = self.cost_micros().map(|l| ratio(spent.cost_micros, l));
        match (tokens, cost) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    /// What is used up, for the refusal's message; `None` while the budget has room.
    pub fn exhausted(&self, spent: Spent) -> Option<String> {
        if let Some(l) = self.monthly_tokens.filter(|l| spent.tokens >= *l) {
            return Some(format!("{} of {l} tokens", spent.tokens));
        }
        if let Some(l) = self.cost_micros().filter(|l| spent.cost_micros >= *l) {
            return Some(format!(
                "USD {:.2} of {:.2}",
                spent.cost_micros as f64 / 1e6,
                l as f64 / 1e6
            ));
        }
        None
    }
}

/// What a tenant or key has spent this month.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Spent {
    pub tokens: u64,
    pub cost_micros: u64,
}

/// How a recorded request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ending {
    /// The engine answered (a 2xx, the stream finished).
    Completed,
    /// The client left before the answer was over.
    Cancelled,
    /// No answer, an error answer, or a stream the engine broke.
    Failed,
}

/// One finished request, as billed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageRecord {
    /// Made by the gateway, unique: the ledger's primary key.
    pub id: String,
    /// The request's `x-request-id` (the client's, when it sent one: informational only).
    pub request_id: String,
    pub tenant: String,
    pub key_id: String,
    /// The first key of the key's rotation chain, when it is not the key itself (budgets
    /// count a chain as one key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_lineage: Option<String>,
    pub model: String,
    /// The engine that answered; `None` when none did.
    pub engine: Option<String>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// Micro-dollars at the prices in force when it was admitted.
    pub cost_micros: u64,
    pub status: u16,
    pub ending: Ending,
    pub finish_reason: Option<String>,
    /// Time to the first token (a whole answer: to the answer).
    pub ttft_ms: Option<u64>,
    pub duration_ms: u64,
    /// When it ended, unix milliseconds.
    pub at_ms: u64,
}

impl UsageRecord {
    pub fn tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// A fresh record id: `u_` + 16 random hex digits + a process counter.
pub fn record_id() -> String {
    static PREFIX: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let p = PREFIX.get_or_init(rand::random::<u64>);
    format!("u_{p:016x}{:x}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// The counts a day's aggregate keeps, in total, per key and per model.
const DAY_FIELDS: [&str; 5] = ["requests", "prompt", "cached", "completion", "cost"];

/// What a batch adds to one aggregate: the tenant, the period (`YYYY-MM-DD` or `YYYY-MM`) and
/// field -> count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Increment {
    pub tenant: String,
    pub period: String,
    pub fields: Vec<(String, u64)>,
}

impl Increment {
    /// Whether the period is a day (else a month).
    pub fn is_day(&self) -> bool {
        self.period.len() == 10
    }
}

/// A batch's additions to its tenants' aggregates, merged: one [`Increment`] per tenant and day
/// and per tenant and month, each field once.
///
/// - a day: `requests`, `prompt`, `cached`, `completion`, `cost`, and the same per key
///   (`k:{key}:{field}`) and per model (`m:{model}:{field}`);
/// - a month (what budgets read): `tokens`, `cost`, and the same per key lineage
///   (`k:{lineage}:tokens`, `k:{lineage}:cost`: a rotated key's successor continues its
///   budget).
///
/// Records are merged by borrowed keys, so a batch costs a few hash lookups per record and its
/// field names are made once per group. Every count is capped at [`MAX_COUNT`].
pub fn increments(records: &[UsageRecord]) -> Vec<Increment> {
    type Counts = [u64; 5];
    #[derive(Default)]
    struct Day<'a> {
        total: Counts,
        keys: HashMap<&'a str, Counts>,
        models: HashMap<&'a str, Counts>,
    }
    #[derive(Default)]
    struct Month<'a> {
        total: [u64; 2],
        keys: HashMap<&'a str, [u64; 2]>,
    }
    let add = |into: &mut [u64], from: &[u64]| {
        for (a, b) in into.iter_mut().zip(from) {
            *a = a.saturating_add(*b).min(MAX_COUNT);
        }
    };
    let mut days: HashMap<(&str, i64), Day> = HashMap::new();
    let mut months: HashMap<(&str, i64, u32), Month> = HashMap::new();
    for r in records {
        let day = (r.at_ms / 1000 / 86_400) as i64;
        let (y, m, _) = civil(day);
        let counts = [
            1,
            r.prompt_tokens,
            r.cached_tokens,
            r.completion_tokens,
            r.cost_micros,
        ]
        .map(|v| v.min(MAX_COUNT));
        let d = days.entry((r.tenant.as_str(), day)).or_default();
        add(&mut d.total, &counts);
        add(d.keys.entry(r.key_id.as_str()).or_default(), &counts);
        add(d.models.entry(r.model.as_str()).or_default(), &counts);
        let spend = [r.tokens().min(MAX_COUNT), counts[4]];
        let mo = months.entry((r.tenant.as_str(), y, m)).or_default();
        add(&mut mo.total, &spend);
        let lineage = r.key_lineage.as_deref().unwrap_or(&r.key_id);
        add(mo.keys.entry(lineage).or_default(), &spend);
    }
    let mut out = Vec::with_capacity(days.len() + months.len());
    for ((tenant, day), d) in days {
        let mut fields = Vec::with_capacity(5 * (1 + d.keys.len() + d.models.len()));
        for (i, name) in DAY_FIELDS.iter().enumerate() {
            fields.push(((*name).to_owned(), d.total[i]));
            for (k, c) in &d.keys {
                fields.push((format!("k:{k}:{name}"), c[i]));
            }
            for (model, c) in &d.models {
                fields.push((format!("m:{model}:{name}"), c[i]));
            }
        }
        out.push(Increment {
            tenant: tenant.to_owned(),
            period: day_name(day),
            fields,
        });
    }
    for ((tenant, y, m), mo) in months {
        let mut fields = vec![
            ("tokens".to_owned(), mo.total[0]),
            ("cost".to_owned(), mo.total[1]),
        ];
        for (k, c) in &mo.keys {
            fields.push((format!("k:{k}:tokens"), c[0]));
            fields.push((format!("k:{k}:cost"), c[1]));
        }
        out.push(Increment {
            tenant: tenant.to_owned(),
            period: format!("{y:04}-{m:02}"),
            fields,
        });
    }
    out
}

/// How a usage report groups a tenant's days.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupBy {
    Tenant,
    Day,
    Key,
    Model,
}

impl GroupBy {
    pub fn parse(s: &str) -> Option<GroupBy> {
        match s {
            "tenant" => Some(GroupBy::Tenant),
            "day" => Some(GroupBy::Day),
            "key" => Some(GroupBy::Key),
            "model" => Some(GroupBy::Model),
            _ => None,
        }
    }
}

/// Daily aggregates summed into rows: (tenant, group) -> field -> count, where the group is the
/// day, the key, the model, or nothing (one row per tenant); and the totals over everything.
#[derive(Debug)]
pub struct Report {
    group: GroupBy,
    pub rows: BTreeMap<(String, String), BTreeMap<String, u64>>,
    pub totals: BTreeMap<String, u64>,
}

impl Report {
    pub fn new(group: GroupBy) -> Report {
        Report {
            group,
            rows: BTreeMap::new(),
            totals: BTreeMap::new(),
        }
    }

    /// Adds one tenant's daily aggregate ([`increments`] names its fields).
    pub fn add(&mut self, tenant: &str, day: &str, aggregate: HashMap<String, u64>) {
        let prefix = match self.group {
            GroupBy::Key => Some("k:"),
            GroupBy::Model => Some("m:"),
            GroupBy::Tenant | GroupBy::Day => None,
        };
        for (field, v) in aggregate {
            let total = !field.contains(':');
            if total {
                *self.totals.entry(field.clone()).or_insert(0) += v;
            }
            let (group, name) = match prefix {
                None if !total => continue,
                None if self.group == GroupBy::Day => (day.to_owned(), field),
                None => (String::new(), field),
                Some(p) => {
                    // Model ids may hold ':'; the field name is after the last one.
                    let Some((group, name)) =
                        field.strip_prefix(p).and_then(|rest| rest.rsplit_once(':'))
                    else {
                        continue;
                    };
                    (group.to_owned(), name.to_owned())
                }
            };
            *self
                .rows
                .entry((tenant.to_owned(), group))
                .or_default()
                .entry(name)
                .or_insert(0) += v;
        }
    }
}

/// This month's spend of a tenant (`key: None`) or one of its keys, from a monthly aggregate.
pub fn spent(month: &HashMap<String, u64>, key: Option<&str>) -> Spent {
    let get = |f: &str| month.get(f).copied().unwrap_or(0);
    match key {
        None => Spent {
            tokens: get("tokens"),
            cost_micros: get("cost"),
        },
        Some(k) => Spent {
            tokens: get(&format!("k:{k}:tokens")),
            cost_micros: get(&format!("k:{k}:cost")),
        },
    }
}

/// Days since 1970-01-01 to a (year, month, day) civil date (Howard Hinnant's algorithm).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// A (year, month, day) civil date to days since 1970-01-01.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from(if m > 2 { m - 3 } else { m + 9 });
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `YYYY-MM-DD` (UTC) of a unix time in seconds.
pub fn day_of(unix_secs: u64) -> String {
    let (y, m, d) = civil((unix_secs / 86_400) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

/// `YYYY-MM` (UTC) of a unix time in seconds.
pub fn month_of(unix_secs: u64) -> String {
    let (y, m, _) = civil((unix_secs / 86_400) as i64);
    format!("{y:04}-{m:02}")
}

/// The first day of the month after `unix_secs`'s, `YYYY-MM-DD`: when a budget renews.
pub fn next_month_start(unix_secs: u64) -> String {
    let (y, m, _) = civil((unix_secs / 86_400) as i64);
    let (y, m) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    format!("{y:04}-{m:02}-01")
}

/// Days since 1970-01-01 of a `YYYY-MM-DD` date; `None` when it is not one.
pub fn parse_day(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let y: i64 = s[..4].parse().ok()?;
    let m: u32 = s[5..7].parse().ok()?;
    let d: u32 = s[8..].parse().ok()?;
    if !(1..=12).contains(&m) || d == 0 {
        return None;
    }
    let days = days_from_civil(y, m, d);
    // A day past the month's end (02-30) comes back as another date.
    (civil(days) == (y, m, d)).then_some(days)
}

/// `YYYY-MM-DD` of days since 1970-01-01.
pub fn day_name(days: i64) -> String {
    let (y, m, d) = civil(days);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The gateway's side of the ledger: records waiting for the store.
#[derive(Debug, Default)]
pub struct Ledger {
    queue: Mutex<VecDeque<UsageRecord>>,
    pub(crate) wake: tokio::sync::Notify,
    /// Records sent to the store: a batch taken from the queue until the store has it.
    in_flight: Arc<AtomicU64>,
    /// Records dropped (the buffer was full) and written, for the metrics.
    pub dropped: AtomicU64,
    pub written: AtomicU64,
}

impl Ledger {
    /// Queues a record for the store, never waiting; past [`LEDGER_BUFFER`] it is dropped and
    /// counted.
    pub fn push(&self, record: UsageRecord) {
        {
            let mut q = self.lock();
            if q.len() >= LEDGER_BUFFER {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    tenant = %record.tenant,
                    "usage ledger buffer full; record dropped"
                );
                return;
            }
            q.push_back(record);
            // The writer wakes on its own every [`LEDGER_FLUSH`]; a full batch wakes it early.
            // (Waking it for every record would cost each request a cross-thread wake-up.)
            if q.len() < LEDGER_BATCH {
                return;
            }
        }
        self.wake.notify_one();
    }

    /// Records not yet in the store.
    pub fn pending(&self) -> usize {
        self.lock().len() + self.in_flight.load(Ordering::SeqCst) as usize
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<UsageRecord>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the next batch to write, under a fresh batch id; its records count as pending
    /// until the batch is dropped (stored, or its writer gone).
    pub(crate) fn take_batch(&self) -> Batch {
        let mut q = self.lock();
        let n = q.len().min(LEDGER_BATCH);
        self.in_flight.fetch_add(n as u64, Ordering::SeqCst);
        Batch {
            id: record_id(),
            records: q.drain(..n).collect(),
            in_flight: self.in_flight.clone(),
        }
    }
}

/// Records on their way to the store, counted in the ledger's pending records until dropped.
#[derive(Debug)]
pub(crate) struct Batch {
    /// The store recognises a batch sent again under the same id.
    pub id: String,
    pub records: Vec<UsageRecord>,
    in_flight: Arc<AtomicU64>,
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.in_flight
            .fetch_sub(self.records.len() as u64, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(prompt: u64, cached: u64, completion: u64) -> UsageRecord {
        UsageRecord {
            id: record_id(),
            request_id: "r".into(),
            tenant: "acme".into(),
            key_id: "key_1".into(),
            key_lineage: None,
            model: "m:v1".into(),
            engine: Some("e0".into()),
            prompt_tokens: prompt,
            cached_tokens: cached,
            completion_tokens: completion,
            cost_micros: 0,
            status: 200,
            ending: Ending::Completed,
            finish_reason: Some("stop".into()),
            ttft_ms: Some(5),
            duration_ms: 9,
            at_ms: 1_764_633_600_000, // 2025-12-02T00:00:00Z
        }
    }

    #[test]
    fn cached_tokens_are_priced_apart() {
        let p = Prices {
            prompt: 1.0,
            cached_prompt: Some(0.1),
            completion: 2.0,
        };
        // 60 computed at 1.0, 40 cached at 0.1, 10 completion at 2.0: 60 + 4 + 20.
        assert_eq!(p.cost_micros(100, 40, 10), 84);
        // Rounded up: a fraction of a micro-dollar still counts.
        let cheap = Prices {
            prompt: 0.001,
            cached_prompt: None,
            completion: 0.0,
        };
        assert_eq!(cheap.cost_micros(10, 0, 0), 1);
        assert_eq!(Prices { prompt: 2e6, ..p }.invalid_field(), Some("prompt"));
        let no_cached_price = Prices {
            cached_prompt: None,
            ..p
        };
        assert_eq!(no_cached_price.cost_micros(100, 40, 10), 120);
        // More cached than prompt (an engine's mistake) never makes a negative count.
        assert_eq!(p.cost_micros(10, 40, 0), 1);
        assert_eq!(Prices { prompt: -1.0, ..p }.invalid_field(), Some("prompt"));
        assert_eq!(
            Prices {
                completion: f64::NAN,
                ..p
            }
            .invalid_field(),
            Some("completion")
        );
    }

    #[test]
    fn budgets_use_the_larger_ratio_and_name_what_ran_out() {
        let b = Budget {
            monthly_tokens: Some(1000),
            monthly_cost_usd: Some(0.5),
        };
        let spent = Spent {
            tokens: 800,
            cost_micros: 100_000,
        };
        assert_eq!(b.used(spent), Some(0.8));
        assert_eq!(b.exhausted(spent), None);
        let over = Spent {
            tokens: 10,
            cost_micros: 500_000,
        };
        assert_eq!(b.exhausted(over).as_deref(), Some("USD 0.50 of 0.50"));
        let zero = Budget {
            monthly_tokens: Some(0),
            monthly_cost_usd: None,
        };
        assert_eq!(
            zero.exhausted(Spent::default()).as_deref(),
            Some("0 of 0 tokens")
        );
        assert_eq!(Budget::default().used(spent), None);
    }

    #[test]
    fn aggregates_split_by_key_and_model_and_merge_a_batch() {
        let a = rec(100, 40, 10);
        let mut b = rec(50, 0, 5);
        b.key_id = "key_2".into();
        b.key_lineage = Some("key_1".into());
        let inc = increments(&[a, b]);
        assert_eq!(inc.len(), 2);
        let day: HashMap<String, u64> = inc
            .iter()
            .find(|i| i.is_day())
            .unwrap()
            .fields
            .iter()
            .cloned()
            .collect();
        assert_eq!(day["requests"], 2);
        assert_eq!(day["k:key_1:prompt"], 100);
        assert_eq!(day["k:key_2:prompt"], 50);
        assert_eq!(day["m:m:v1:cached"], 40);
        assert_eq!(day["m:m:v1:requests"], 2);
        let month_inc = inc.iter().find(|i| !i.is_day()).unwrap();
        assert_eq!(month_inc.period, "2025-12");
        let month: HashMap<String, u64> = month_inc.fields.iter().cloned().collect();
        assert_eq!(spent(&month, None).tokens, 165);
        // key_2 continues key_1's budget.
        assert_eq!(spent(&month, Some("key_1")).tokens, 165);
        assert_eq!(spent(&month, Some("key_2")), Spent::default());
    }

    #[test]
    fn a_report_groups_by_key_and_by_a_model_with_colons() {
        let mut b = rec(50, 0, 5);
        b.key_id = "key_2".into();
        let inc = increments(&[rec(100, 40, 10), b]);
        let day = inc.into_iter().find(Increment::is_day).unwrap();
        let agg: HashMap<String, u64> = day.fields.into_iter().collect();
        let mut by_model = Report::new(GroupBy::Model);
        by_model.add("acme", "2025-12-02", agg.clone());
        let row = &by_model.rows[&("acme".to_owned(), "m:v1".to_owned())];
        assert_eq!((row["requests"], row["prompt"]), (2, 150));
        assert_eq!(by_model.totals["completion"], 15);
        let mut by_key = Report::new(GroupBy::Key);
        by_key.add("acme", "2025-12-02", agg);
        assert_eq!(by_key.rows.len(), 2);
        assert_eq!(
            by_key.rows[&("acme".to_owned(), "key_2".to_owned())]["prompt"],
            50
        );
    }

    #[test]
    fn calendar_days_and_months() {
        assert_eq!(day_of(0), "1970-01-01");
        assert_eq!(day_of(1_764_633_600), "2025-12-02");
        assert_eq!(month_of(1_764_633_600), "2025-12");
        assert_eq!(next_month_start(1_764_633_600), "2026-01-01");
        assert_eq!(day_of(951_782_400), "2000-02-29");
        let d = parse_day("2000-02-29").unwrap();
        assert_eq!(day_name(d), "2000-02-29");
        assert_eq!(parse_day("2001-02-29"), None);
        assert_eq!(parse_day("2001-13-01"), None);
        assert_eq!(parse_day("yesterday"), None);
        for days in [-1, 0, 59, 365, 10_957, 20_424, 100_000] {
            assert_eq!(parse_day(&day_name(days)), Some(days), "{days}");
        }
    }

    #[test]
    fn a_full_ledger_drops_and_counts() {
        let l = Ledger::default();
        for _ in 0..LEDGER_BUFFER + 3 {
            l.push(rec(1, 0, 1));
        }
        assert_eq!(l.pending(), LEDGER_BUFFER);
        assert_eq!(l.dropped.load(Ordering::Relaxed), 3);
        // A batch being written still counts as pending, until it is dropped.
        let batch = l.take_batch();
        assert_eq!(batch.records.len(), LEDGER_BATCH);
        assert_eq!(l.pending(), LEDGER_BUFFER);
        drop(batch);
        assert_eq!(l.pending(), LEDGER_BUFFER - LEDGER_BATCH);
    }
}
