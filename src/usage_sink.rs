//! `kvgate usage-sink`: the usage ledger's durable copy in PostgreSQL.
//!
//! The gateways append every finished request to the Redis stream `kvgate:usage:records`
//! (docs/tenancy.md), which keeps only the newest million. The sink reads it as a member of a
//! consumer group and writes each record into the table `usage_records`
//! (`migrations/postgres/`), and acknowledges a batch only after its transaction commits:
//!
//! - a sink that dies between its commit and its acknowledgement reads the batch again when it
//!   comes back (its pending entries, or, under another consumer name, by claiming entries idle
//!   for a minute), and the record id, the table's primary key, makes the second write a no-op:
//!   nothing is lost and nothing is counted twice;
//! - while PostgreSQL is down the sink retries with backoff (100 ms doubling to 5 s) and the
//!   records wait in the stream; while Redis is down it waits the same way.
//!
//! Several sinks may run under one group (each its own `--consumer`): each entry goes to one.

use crate::backoff::Backoff;
use anyhow::{bail, Context, Result};
use clap::Args;
use redis::aio::MultiplexedConnection;
use redis::Value;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The stream the gateways append to (the gateway's store: `USAGE_STREAM`).
const STREAM: &str = kvgate_gateway::store::USAGE_STREAM;
/// The numbered PostgreSQL migrations, in order.
const MIGRATIONS: &[(i32, &str)] = &[(
    1,
    include_str!("../migrations/postgres/0001_usage_records.sql"),
)];
/// How often the sink looks for entries to claim.
const CLAIM_EVERY: Duration = Duration::from_secs(30);
/// How long one read waits for new entries.
const BLOCK_MS: u64 = 1000;
/// Any one Redis or PostgreSQL call's deadline.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Columns of `usage_records` the sink writes, in order.
const COLUMNS: usize = 17;

#[derive(Args, Debug)]
pub struct UsageSinkArgs {
    /// The gateways' Redis.
    #[arg(long, env = "KVGATE_REDIS", hide_env_values = true)]
    redis: String,
    /// PostgreSQL, `postgres://USER[:PASSWORD]@HOST[:PORT]/DB`.
    #[arg(long, env = "KVGATE_POSTGRES", hide_env_values = true)]
    postgres: String,
    /// The consumer group (every sink of one deployment uses the same).
    #[arg(long, default_value = "kvgate-usage-sink")]
    group: String,
    /// This sink's name in the group (default: the host name); keep it across restarts.
    #[arg(long)]
    consumer: Option<String>,
    /// Records per transaction.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=3000))]
    batch: u32,
    /// Exit once every record in the stream is written (instead of following it).
    #[arg(long)]
    once: bool,
    /// Claim another consumer's entries once they are pending this long (a sink that died).
    #[arg(long, default_value_t = 60)]
    claim_idle_secs: u64,
}

pub fn run(args: UsageSinkArgs) -> Result<()> {
    crate::engine_cmd::init_tracing();
    let consumer = match &args.consumer {
        Some(c) => c.clone(),
        None => std::fs::read_to_string("/etc/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "kvgate-usage-sink".into()),
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(Sink::new(args, consumer)?.run())
}

/// One entry of the stream: its id, and its record's JSON (`None` when the entry was trimmed
/// from the stream while it was pending).
type Entry = (String, Option<String>);

struct Sink {
    args: UsageSinkArgs,
    consumer: String,
    redis: redis::Client,
    conn: Option<MultiplexedConnection>,
    pg: Option<tokio_postgres::Client>,
    written: u64,
}

async fn timed<T>(what: &str, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(CALL_TIMEOUT, f)
        .await
        .with_context(|| format!("{what}: no answer in {} s", CALL_TIMEOUT.as_secs()))?
}

impl Sink {
    fn new(args: UsageSinkArgs, consumer: String) -> Result<Sink> {
        let redis = redis::Client::open(args.redis.as_str()).context("--redis")?;
        args.postgres
            .parse::<tokio_postgres::Config>()
            .context("--postgres")?;
        Ok(Sink {
            args,
            consumer,
            redis,
            conn: None,
            pg: None,
            written: 0,
        })
    }

    async fn run(mut self) -> Result<()> {
        tracing::info!(group = %self.args.group, consumer = %self.consumer, "usage sink starting");
        let mut backoff = Backoff::new();
        // Until the group exists and the schema is current, nothing can be read or written.
        loop {
            match self.prepare().await {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "usage sink not ready; retrying");
                    self.conn = None;
                    self.pg = None;
                    backoff.wait().await;
                }
            }
        }
        // First what this consumer had read and not acknowledged (a restart), then what other
        // consumers left pending, then new entries.
        let mut pending_from = Some("0-0".to_owned());
        let mut last_claim = tokio::time::Instant::now() - CLAIM_EVERY;
        let mut backoff = Backoff::new();
        loop {
            let mut read_new = false;
            let read = if let Some(from) = &pending_from {
                self.read_group(from, false).await
            } else if last_claim.elapsed() >= CLAIM_EVERY {
                last_claim = tokio::time::Instant::now();
                self.claim().await
            } else {
                read_new = true;
                self.read_group(">", true).await
            };
            let batch = match read {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "reading the ledger stream failed; retrying");
                    self.conn = None;
                    backoff.wait().await;
                    continue;
                }
            };
            if batch.is_empty() {
                pending_from = None;
                if read_new && self.args.once {
                    match self.claimable().await {
                        Ok(false) => {
                            tracing::info!(written = self.written, "usage sink caught up");
                            return Ok(());
                        }
                        // Another consumer's entries are pending: claim them once they are
                        // idle long enough.
                        Ok(true) => {
                            last_claim = tokio::time::Instant::now() - CLAIM_EVERY;
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        Err(e) => {
                            tracing::warn!(error = %format!("{e:#}"), "XPENDING failed; retrying");
                            self.conn = None;
                            backoff.wait().await;
                        }
                    }
                }
                continue;
            }
            if let Some(from) = pending_from.as_mut() {
                from.clone_from(&batch[batch.len() - 1].0);
            }
            self.write_until_done(&batch).await;
            self.ack_until_done(&batch).await;
            backoff = Backoff::new();
        }
    }

    async fn redis(&mut self) -> Result<MultiplexedConnection> {
        if let Some(c) = &self.conn {
            return Ok(c.clone());
        }
        let c = timed("redis", async {
            Ok(self.redis.get_multiplexed_async_connection().await?)
        })
        .await?;
        self.conn = Some(c.clone());
        Ok(c)
    }

    async fn postgres(&mut self) -> Result<&tokio_postgres::Client> {
        if self.pg.as_ref().is_some_and(|c| c.is_closed()) {
            self.pg = None;
        }
        if self.pg.is_none() {
            let url = self.args.postgres.clone();
            let (client, connection) = timed("postgres", async {
                Ok(tokio_postgres::connect(&url, tokio_postgres::NoTls).await?)
            })
            .await?;
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::warn!(error = %e, "postgres connection closed");
                }
            });
            self.pg = Some(client);
        }
        self.pg.as_ref().context("postgres: not connected")
    }

    /// The consumer group (created at the stream's start when missing) and the schema.
    async fn prepare(&mut self) -> Result<()> {
        let mut c = self.redis().await?;
        let created: redis::RedisResult<Value> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(STREAM)
            .arg(&self.args.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut c)
            .await;
        match created {
            Ok(_) => tracing::info!(group = %self.args.group, "created the consumer group"),
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            Err(e) => return Err(e).context("XGROUP CREATE"),
        }
        self.migrate().await
    }

    /// Applies the PostgreSQL migrations newer than `kvgate_schema.version`, each in its own
    /// transaction under an advisory lock (so two sinks starting at once apply each once).
    async fn migrate(&mut self) -> Result<()> {
        let pg = self.postgres().await?;
        pg.batch_execute("CREATE TABLE IF NOT EXISTS kvgate_schema (version integer NOT NULL)")
            .await
            .context("kvgate_schema")?;
        for &(n, sql) in MIGRATIONS {
            pg.batch_execute("BEGIN; SELECT pg_advisory_xact_lock(4672837465)")
                .await?;
            let row = pg
                .query_one("SELECT coalesce(max(version), 0) FROM kvgate_schema", &[])
                .await?;
            let current: i32 = row.get(0);
            let newest = MIGRATIONS.last().map_or(0, |m| m.0);
            if current > newest {
                pg.batch_execute("ROLLBACK").await?;
                bail!("the PostgreSQL schema is at version {current}, newer than this build's {newest}: upgrade kvgate");
            }
            if current >= n {
                pg.batch_execute("COMMIT").await?;
                continue;
            }
            if let Err(e) = pg.batch_execute(sql).await {
                let _ = pg.batch_execute("ROLLBACK").await;
                return Err(e).with_context(|| format!("postgres migration {n:04}"));
            }
            pg.execute("INSERT INTO kvgate_schema (version) VALUES ($1)", &[&n])
                .await?;
            pg.batch_execute("COMMIT").await?;
            tracing::info!(migration = n, "applied a PostgreSQL migration");
        }
        Ok(())
    }

    /// `XREADGROUP` from `from` (`>`: new entries, waiting up to [`BLOCK_MS`]; an id: this
    /// consumer's pending entries after it).
    async fn read_group(&mut self, from: &str, block: bool) -> Result<Vec<Entry>> {
        let mut c = self.redis().await?;
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.args.group)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(self.args.batch);
        if block {
            cmd.arg("BLOCK").arg(BLOCK_MS);
        }
        cmd.arg("STREAMS").arg(STREAM).arg(from);
        let reply: Value =
            timed("XREADGROUP", async { Ok(cmd.query_async(&mut c).await?) }).await?;
        // [[stream, [entry, ...]]], or nil when nothing came.
        let streams = array(reply);
        let entries = streams
            .into_iter()
            .next()
            .map(|s| array(s).into_iter().nth(1).map(array).unwrap_or_default())
            .unwrap_or_default();
        Ok(entries.into_iter().filter_map(entry).collect())
    }

    /// Claims entries other consumers read and left unacknowledged for `--claim-idle-secs` (a
    /// sink that died for good, or was renamed).
    async fn claim(&mut self) -> Result<Vec<Entry>> {
        let mut c = self.redis().await?;
        let reply: Value = timed("XAUTOCLAIM", async {
            Ok(redis::cmd("XAUTOCLAIM")
                .arg(STREAM)
                .arg(&self.args.group)
                .arg(&self.consumer)
                .arg(self.args.claim_idle_secs.saturating_mul(1000))
                .arg("0-0")
                .arg("COUNT")
                .arg(self.args.batch)
                .query_async(&mut c)
                .await?)
        })
        .await?;
        // [next start, [entry, ...], [deleted ids]]: a claimed entry trimmed from the stream
        // is among the deleted (and no longer pending).
        let mut parts = array(reply).into_iter();
        let _next = parts.next();
        let claimed: Vec<Entry> = parts
            .next()
            .map(array)
            .unwrap_or_default()
            .into_iter()
            .filter_map(entry)
            .collect();
        let deleted = parts.next().map(array).unwrap_or_default().len();
        if deleted > 0 {
            tracing::error!(
                records = deleted,
                "ledger records were trimmed from the stream before any sink wrote them"
            );
        }
        if !claimed.is_empty() {
            tracing::info!(
                records = claimed.len(),
                "claimed records left pending by another sink"
            );
        }
        Ok(claimed)
    }

    /// Whether some other consumer has entries pending (for `--once`: not caught up yet).
    async fn claimable(&mut self) -> Result<bool> {
        let mut c = self.redis().await?;
        let reply: Value = timed("XPENDING", async {
            Ok(redis::cmd("XPENDING")
                .arg(STREAM)
                .arg(&self.args.group)
                .query_async(&mut c)
                .await?)
        })
        .await?;
        let count = array(reply).into_iter().next().and_then(|v| match v {
            Value::Int(n) => Some(n),
            _ => None,
        });
        Ok(count.unwrap_or(0) > 0)
    }

    /// Writes a batch in one transaction, retrying (with backoff, reconnecting) until it
    /// commits. Entries that are not records (trimmed, or not a record's JSON) are logged and
    /// skipped: they would never commit.
    async fn write_until_done(&mut self, batch: &[Entry]) {
        let rows: Vec<Row> = batch
            .iter()
            .filter_map(|(id, json)| {
                let Some(json) = json else {
                    tracing::error!(entry = %id, "a ledger record was trimmed from the stream before it was written");
                    return None;
                };
                match serde_json::from_str::<kvgate_gateway::usage::UsageRecord>(json) {
                    Ok(r) => Some(Row::of(id, r)),
                    Err(e) => {
                        tracing::error!(entry = %id, error = %e, "not a ledger record; skipped");
                        None
                    }
                }
            })
            .collect();
        if rows.is_empty() {
            return;
        }
        let mut backoff = Backoff::new();
        loop {
            match self.write(&rows).await {
                Ok(inserted) => {
                    self.written += rows.len() as u64;
                    tracing::info!(
                        records = rows.len(),
                        new = inserted,
                        total = self.written,
                        "usage records committed"
                    );
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), records = rows.len(), "writing to PostgreSQL failed; retrying");
                    self.pg = None;
                    backoff.wait().await;
                }
            }
        }
    }

    /// One multi-row `INSERT ... ON CONFLICT (id) DO NOTHING` in a transaction; the rows that
    /// were new.
    async fn write(&mut self, rows: &[Row]) -> Result<u64> {
        let pg = self.postgres().await?;
        let mut sql = String::from(
            "INSERT INTO usage_records (id, request_id, tenant, key_id, model, engine, \
             prompt_tokens, cached_tokens, completion_tokens, cost_micros, status, ending, \
             finish_reason, ttft_ms, duration_ms, ended_at, stream_id) VALUES ",
        );
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
            Vec::with_capacity(rows.len() * COLUMNS);
        for (i, r) in rows.iter().enumerate() {
            if i > 0 {
                sql.push(',');
            }
            sql.push('(');
            for c in 0..COLUMNS {
                if c > 0 {
                    sql.push(',');
                }
                sql.push_str(&format!("${}", i * COLUMNS + c + 1));
            }
            sql.push(')');
            params.extend(r.params());
        }
        sql.push_str(" ON CONFLICT (id) DO NOTHING");
        timed("postgres insert", async {
            pg.batch_execute("BEGIN").await?;
            let inserted = match pg.execute(sql.as_str(), &params).await {
                Ok(n) => n,
                Err(e) => {
                    let _ = pg.batch_execute("ROLLBACK").await;
                    return Err(e.into());
                }
            };
            pg.batch_execute("COMMIT").await?;
            Ok(inserted)
        })
        .await
    }

    /// Acknowledges a committed batch, retrying until Redis takes it (an entry acknowledged
    /// late is at worst written once more, as a no-op).
    async fn ack_until_done(&mut self, batch: &[Entry]) {
        let mut backoff = Backoff::new();
        loop {
            let acked: Result<i64> = async {
                let mut c = self.redis().await?;
                let mut cmd = redis::cmd("XACK");
                cmd.arg(STREAM).arg(&self.args.group);
                for (id, _) in batch {
                    cmd.arg(id);
                }
                timed("XACK", async { Ok(cmd.query_async(&mut c).await?) }).await
            }
            .await;
            match acked {
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "acknowledging records failed; retrying");
                    self.conn = None;
                    backoff.wait().await;
                }
            }
        }
    }
}

/// A Redis array's elements (nothing for nil or anything else).
fn array(v: Value) -> Vec<Value> {
    match v {
        Value::Array(items) => items,
        Value::Map(pairs) => pairs.into_iter().flat_map(|(k, v)| [k, v]).collect(),
        _ => Vec::new(),
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// `[id, [field, value, ...]]` (or `[id, nil]` for a trimmed entry) to its id and its `r`.
fn entry(v: Value) -> Option<Entry> {
    let mut parts = array(v).into_iter();
    let id = text(&parts.next()?)?;
    let fields = parts.next().map(array).unwrap_or_default();
    let record = fields
        .chunks(2)
        .find(|f| text(&f[0]).as_deref() == Some("r"))
        .and_then(|f| f.get(1))
        .and_then(text);
    Some((id, record))
}

/// A record as the table's columns.
struct Row {
    id: String,
    request_id: String,
    tenant: String,
    key_id: String,
    model: String,
    engine: Option<String>,
    prompt_tokens: i64,
    cached_tokens: i64,
    completion_tokens: i64,
    cost_micros: i64,
    status: i32,
    ending: String,
    finish_reason: Option<String>,
    ttft_ms: Option<i64>,
    duration_ms: i64,
    ended_at: SystemTime,
    stream_id: String,
}

impl Row {
    fn of(stream_id: &str, r: kvgate_gateway::usage::UsageRecord) -> Row {
        let big = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let ending = serde_json::to_value(r.ending)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        Row {
            id: r.id,
            request_id: r.request_id,
            tenant: r.tenant,
            key_id: r.key_id,
            model: r.model,
            engine: r.engine,
            prompt_tokens: big(r.prompt_tokens),
            cached_tokens: big(r.cached_tokens),
            completion_tokens: big(r.completion_tokens),
            cost_micros: big(r.cost_micros),
            status: i32::from(r.status),
            ending,
            finish_reason: r.finish_reason,
            ttft_ms: r.ttft_ms.map(big),
            duration_ms: big(r.duration_ms),
            ended_at: UNIX_EPOCH + Duration::from_millis(r.at_ms),
            stream_id: stream_id.to_owned(),
        }
    }

    fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); COLUMNS] {
        [
            &self.id,
            &self.request_id,
            &self.tenant,
            &self.key_id,
            &self.model,
            &self.engine,
            &self.prompt_tokens,
            &self.cached_tokens,
            &self.completion_tokens,
            &self.cost_micros,
            &self.status,
            &self.ending,
            &self.finish_reason,
            &self.ttft_ms,
            &self.duration_ms,
            &self.ended_at,
            &self.stream_id,
        ]
    }
}
