//! `kvgate-fuzz`: runs the fuzzer from the command line, or replays one saved case.
//!
//! ```text
//! cargo run -p kvgate-fuzz --release -- --cases 10000000 --seed 1 --jobs 2
//! cargo run -p kvgate-fuzz --release -- --target sse --replay fuzz/out/sse-....min
//! ```

use clap::Parser;
use kvgate_fuzz::{corpus, driver, Config};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "kvgate-fuzz",
    about = "Fuzzes kvgate's request parsing, usage reading and SSE relay"
)]
struct Args {
    /// Cases to run in all (over every target and worker).
    #[arg(long, default_value_t = 1_000_000)]
    cases: u64,
    /// Seed of the run (a run is reproducible for a seed and a number of jobs).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Target to run (protocol, usage, sse); repeat for several; all when absent.
    #[arg(long = "target")]
    targets: Vec<String>,
    /// Parallel workers.
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// Seed corpus folder.
    #[arg(long, default_value_os_t = corpus::default_dir())]
    corpus: PathBuf,
    /// Where failing inputs are written.
    #[arg(long, default_value_os_t = driver::default_out())]
    out: PathBuf,
    /// Known violations fail the run too.
    #[arg(long)]
    strict: bool,
    /// Save the first input of each known violation as it is, not minimized.
    #[arg(long)]
    no_minimize_known: bool,
    /// Seconds between progress lines (0: none).
    #[arg(long, default_value_t = 10)]
    progress: u64,
    /// Replay one saved case (of the one `--target`) instead of fuzzing.
    #[arg(long)]
    replay: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(path) = &args.replay {
        let [target] = args.targets.as_slice() else {
            eprintln!("--replay needs exactly one --target");
            return ExitCode::FAILURE;
        };
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("cannot read {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        };
        return match kvgate_fuzz::replay(target, &bytes) {
            Ok(()) => {
                println!("{}: passes", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!("{}: fails: {e}", path.display());
                ExitCode::FAILURE
            }
        };
    }
    let config = Config {
        cases: args.cases,
        seed: args.seed,
        targets: args.targets,
        jobs: args.jobs,
        corpus: args.corpus,
        out: args.out,
        strict: args.strict,
        minimize_known: !args.no_minimize_known,
        progress: (args.progress > 0).then(|| Duration::from_secs(args.progress)),
    };
    let report = match kvgate_fuzz::run(&config) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "{} cases in {:.1} s: {:.0} cases/s (seed {}, {} jobs)",
        report.cases,
        report.elapsed.as_secs_f64(),
        report.cases_per_second(),
        config.seed,
        config.jobs.max(1)
    );
    for (name, t) in &report.targets {
        println!(
            "  {name}: {} cases, {} outcome signatures, {} inputs pooled",
            t.cases, t.signatures, t.pool
        );
    }
    for (invariant, n) in &report.known {
        println!(
            "  known violation {invariant}: {n} cases (first one saved in {})",
            config.out.display()
        );
    }
    match &report.failure {
        None => ExitCode::SUCCESS,
        Some(f) => {
            println!(
                "FAILED: target {}, invariant {}\n{}\ninput: {}\nminimized: {}",
                f.target,
                f.invariant,
                f.detail,
                f.input.display(),
                f.minimized.display()
            );
            ExitCode::FAILURE
        }
    }
}
