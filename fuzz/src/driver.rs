//! The fuzzing loop: per target, a pool of inputs (the corpus, then every mutant with an
//! outcome signature not seen before), from which each case picks one, mutates it and runs the
//! target under `catch_unwind`. A panic or a broken invariant stops the run; its input is
//! minimized (delta debugging over its bytes) and written out, original and minimized.
//!
//! Workers run in parallel, each with its own generator (derived from the seed and the worker's
//! number) and its own pool, so a run is reproducible for a given seed and worker count.
//! O(cases x input size).

use crate::corpus::Corpus;
use crate::minimize::minimize;
use crate::panics::{quiet_panics, run_case};
use crate::rng::{mix, Rng};
use crate::targets::protocol::Protocol;
use crate::targets::sse::Sse;
use crate::targets::usage::UsageReader;
use crate::targets::{Target, Violation};
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Invariants known to be broken by kvgate as it stands (see the README's findings): counted and
/// saved, but they do not fail a run unless `strict`. Delete an entry once its bug is fixed.
pub const KNOWN: &[&str] = &[
    "usage.lenient_on_skipped_members",
    "protocol.engine_skips_unknown_fields_unread",
    "sse.buffer_bound_after_done",
];

/// The targets, by name.
pub const TARGETS: &[&str] = &[Protocol::NAME, UsageReader::NAME, Sse::NAME];

/// What a run does.
#[derive(Debug, Clone)]
pub struct Config {
    /// Cases in all, over every target and worker.
    pub cases: u64,
    pub seed: u64,
    /// The targets to run (round-robin); all of them when empty.
    pub targets: Vec<String>,
    /// Parallel workers.
    pub jobs: usize,
    pub corpus: PathBuf,
    /// Where failing inputs are written.
    pub out: PathBuf,
    /// Known violations fail the run too.
    pub strict: bool,
    /// Minimize the first input of each known violation too (seconds each; not worth it in CI).
    pub minimize_known: bool,
    /// Progress lines on stderr this often (never when `None`).
    pub progress: Option<Duration>,
}

/// What a run found.
#[derive(Debug, Default)]
pub struct Report {
    pub cases: u64,
    pub elapsed: Duration,
    /// Per target: cases run, inputs in the pools, distinct outcome signatures.
    pub targets: BTreeMap<&'static str, TargetStats>,
    /// Known violations seen, by invariant.
    pub known: BTreeMap<&'static str, u64>,
    /// The failure that stopped the run.
    pub failure: Option<Failure>,
}

impl Report {
    pub fn cases_per_second(&self) -> f64 {
        self.cases as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Counts for one target (summed over workers).
#[derive(Debug, Default, Clone, Copy)]
pub struct TargetStats {
    pub cases: u64,
    pub pool: usize,
    pub signatures: usize,
}

/// A panic or a broken invariant, and where its input went.
#[derive(Debug, Clone)]
pub struct Failure {
    pub target: &'static str,
    pub invariant: &'static str,
    pub detail: String,
    pub input: PathBuf,
    pub minimized: PathBuf,
}

/// Runs the fuzzer.
pub fn run(config: &Config) -> Result<Report, String> {
    let corpus = Corpus::load(&config.corpus)
        .map_err(|e| format!("cannot read the corpus {}: {e}", config.corpus.display()))?;
    let targets: Vec<&'static str> = if config.targets.is_empty() {
        TARGETS.to_vec()
    } else {
        config
            .targets
            .iter()
            .map(|t| {
                TARGETS
                    .iter()
                    .copied()
                    .find(|n| n == t)
                    .ok_or_else(|| format!("unknown target {t:?}; targets: {TARGETS:?}"))
            })
            .collect::<Result<_, _>>()?
    };
    let jobs = config.jobs.max(1);
    let shared = Shared {
        config,
        corpus: &corpus,
        targets: &targets,
        stop: AtomicBool::new(false),
        done: AtomicU64::new(0),
        report: Mutex::new(Report::default()),
    };
    let start = Instant::now();
    let hook = quiet_panics();
    std::thread::scope(|s| {
        let shared = &shared;
        for w in 0..jobs {
            let share =
                config.cases / jobs as u64 + u64::from((w as u64) < config.cases % jobs as u64);
            s.spawn(move || worker(shared, w as u64, share));
        }
        if let Some(every) = config.progress {
            s.spawn(move || progress(shared, every, start));
        }
    });
    std::panic::set_hook(hook);
    let mut report = shared
        .report
        .into_inner()
        .map_err(|_| "a worker died".to_owned())?;
    report.elapsed = start.elapsed();
    Ok(report)
}

/// Replays one saved case of `target`: `Ok` when it passes.
pub fn replay(target: &str, bytes: &[u8]) -> Result<(), String> {
    fn one<T: Target>(bytes: &[u8]) -> Result<(), String> {
        let case = T::from_file(bytes).ok_or("not a case of this target")?;
        let hook = quiet_panics();
        let r = run_case::<T>(&case);
        std::panic::set_hook(hook);
        r.map(|_| ())
            .map_err(|v| format!("{}: {}", v.invariant, v.detail))
    }
    match target {
        Protocol::NAME => one::<Protocol>(bytes),
        UsageReader::NAME => one::<UsageReader>(bytes),
        Sse::NAME => one::<Sse>(bytes),
        _ => Err(format!("unknown target {target:?}; targets: {TARGETS:?}")),
    }
}

struct Shared<'a> {
    config: &'a Config,
    corpus: &'a Corpus,
    targets: &'a [&'static str],
    stop: AtomicBool,
    done: AtomicU64,
    report: Mutex<Report>,
}

fn worker(shared: &Shared<'_>, w: u64, cases: u64) {
    let seed = mix(shared.config.seed, w);
    let mut protocol = Fuzzer::<Protocol>::new(shared.corpus, mix(seed, 1));
    let mut usage = Fuzzer::<UsageReader>::new(shared.corpus, mix(seed, 2));
    let mut sse = Fuzzer::<Sse>::new(shared.corpus, mix(seed, 3));
    let mut known = BTreeMap::new();
    let mut failure = None;
    let mut i = 0;
    while i < cases && failure.is_none() {
        let batch = (cases - i).min(256);
        for j in i..i + batch {
            let step = match shared.targets[(j % shared.targets.len() as u64) as usize] {
                Protocol::NAME => protocol.step(shared, &mut known),
                UsageReader::NAME => usage.step(shared, &mut known),
                _ => sse.step(shared, &mut known),
            };
            if let Err(f) = step {
                failure = Some(f);
                shared.stop.store(true, Ordering::Relaxed);
                break;
            }
        }
        i += batch;
        shared.done.fetch_add(batch, Ordering::Relaxed);
        if shared.stop.load(Ordering::Relaxed) {
            break;
        }
    }
    let mut report = shared.report.lock().unwrap_or_else(|e| e.into_inner());
    report.cases += protocol.cases + usage.cases + sse.cases;
    for (name, stats) in [protocol.stats(), usage.stats(), sse.stats()] {
        if stats.cases > 0 {
            let t = report.targets.entry(name).or_default();
            t.cases += stats.cases;
            t.pool += stats.pool;
            t.signatures += stats.signatures;
        }
    }
    for (k, n) in known {
        *report.known.entry(k).or_insert(0) += n;
    }
    if report.failure.is_none() {
        report.failure = failure;
    }
}

fn progress(shared: &Shared<'_>, every: Duration, start: Instant) {
    let mut last = Instant::now();
    while shared.done.load(Ordering::Relaxed) < shared.config.cases
        && !shared.stop.load(Ordering::Relaxed)
    {
        std::thread::sleep(Duration::from_millis(100));
        if last.elapsed() >= every {
            last = Instant::now();
            let done = shared.done.load(Ordering::Relaxed);
            let secs = start.elapsed().as_secs_f64();
            eprintln!(
                "{done} / {} cases, {:.0} s, {:.0} cases/s",
                shared.config.cases,
                secs,
                done as f64 / secs.max(1e-9)
            );
        }
    }
}

/// Most pool inputs per target and worker; past it a new input replaces a random mutant.
const POOL_MAX: usize = 4096;

/// The state of one target in one worker.
struct Fuzzer<T: Target> {
    pool: Vec<T::Case>,
    seeds: usize,
    /// Seeds not yet run as they are.
    next_seed: usize,
    seen: HashSet<u64>,
    rng: Rng,
    cases: u64,
}

impl<T: Target> Fuzzer<T> {
    fn new(corpus: &Corpus, seed: u64) -> Self {
        let pool = T::seeds(corpus);
        Fuzzer {
            seeds: pool.len(),
            pool,
            next_seed: 0,
            seen: HashSet::new(),
            rng: Rng::new(seed),
            cases: 0,
        }
    }

    fn stats(&self) -> (&'static str, TargetStats) {
        (
            T::NAME,
            TargetStats {
                cases: self.cases,
                pool: self.pool.len(),
                signatures: self.seen.len(),
            },
        )
    }

    /// One case: a seed as it is (the first time round), else a mutant of a pool input. A
    /// known violation is counted (and saved the first time); any other failure is saved and
    /// returned.
    fn step(
        &mut self,
        shared: &Shared<'_>,
        known: &mut BTreeMap<&'static str, u64>,
    ) -> Result<(), Failure> {
        self.cases += 1;
        let case = if self.next_seed < self.seeds {
            self.next_seed += 1;
            self.pool[self.next_seed - 1].clone()
        } else if self.pool.is_empty() {
            return Ok(());
        } else {
            let a = self.rng.below(self.pool.len());
            let b = self.rng.below(self.pool.len());
            T::mutate(&self.pool[a], &self.pool[b], &mut self.rng)
        };
        let v = match run_case::<T>(&case) {
            Ok(sig) => {
                if T::poolable(&case) && self.seen.insert(sig) {
                    if self.pool.len() < POOL_MAX {
                        self.pool.push(case);
                    } else if self.pool.len() > self.seeds {
                        let i = self.seeds + self.rng.below(self.pool.len() - self.seeds);
                        self.pool[i] = case;
                    }
                }
                return Ok(());
            }
            Err(v) => v,
        };
        let is_known = KNOWN.contains(&v.invariant) && !shared.config.strict;
        if is_known {
            let n = known.entry(v.invariant).or_insert(0);
            *n += 1;
            if *n > 1 {
                return Ok(());
            }
        }
        let min = if is_known && !shared.config.minimize_known {
            case.clone()
        } else {
            minimize::<T>(&case, &v)
        };
        let f = save(
            shared,
            T::NAME,
            &v,
            &T::to_file(&case),
            &T::to_file(&min),
            is_known,
        );
        if is_known {
            Ok(())
        } else {
            Err(f)
        }
    }
}

/// Writes a failing case and its minimized form under the output folder.
fn save(
    shared: &Shared<'_>,
    target: &'static str,
    v: &Violation,
    input: &[u8],
    min: &[u8],
    known: bool,
) -> Failure {
    let dir = &shared.config.out;
    let stem = format!(
        "{}{target}-{}-{:016x}",
        if known { "known-" } else { "" },
        v.invariant,
        crate::targets::signature(input)
    );
    let input_path = dir.join(format!("{stem}.input"));
    let min_path = dir.join(format!("{stem}.min"));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&input_path, input))
        .and_then(|()| std::fs::write(&min_path, min))
        .and_then(|()| {
            std::fs::write(
                dir.join(format!("{stem}.txt")),
                format!(
                    "target: {target}\ninvariant: {}\nreplay: cargo run -p kvgate-fuzz --release -- --target {target} --replay {}\n\n{}\n",
                    v.invariant,
                    min_path.display(),
                    v.detail
                ),
            )
        });
    if let Err(e) = written {
        eprintln!("cannot write {}: {e}", dir.display());
    }
    Failure {
        target,
        invariant: v.invariant,
        detail: v.detail.clone(),
        input: input_path,
        minimized: min_path,
    }
}

/// The default output folder: `fuzz/out/`.
pub fn default_out() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("out")
}
