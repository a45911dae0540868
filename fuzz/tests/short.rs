//! A short, fixed-seed fuzzing run of every target, for CI: a few hundred thousand cases.
//! A failure names the invariant and the files holding the (minimized) input.

use kvgate_fuzz::{corpus, driver, run, Config};

#[test]
fn short_fuzz_run_finds_nothing() {
    let config = Config {
        cases: 300_000,
        seed: 20_240_601,
        targets: Vec::new(),
        jobs: 1,
        corpus: corpus::default_dir(),
        out: driver::default_out(),
        strict: false,
        minimize_known: false,
        progress: None,
    };
    let report = run(&config).expect("the corpus is readable");
    if let Some(f) = &report.failure {
        panic!(
            "target {}, invariant {}: {}\ninput: {}\nminimized: {}",
            f.target,
            f.invariant,
            f.detail,
            f.input.display(),
            f.minimized.display()
        );
    }
    assert_eq!(report.cases, config.cases);
    eprintln!(
        "{} cases in {:.1} s ({:.0}/s); known violations: {:?}",
        report.cases,
        report.elapsed.as_secs_f64(),
        report.cases_per_second(),
        report.known
    );
}

#[test]
fn every_seed_passes_as_it_is() {
    let corpus = corpus::Corpus::load(&corpus::default_dir()).expect("the corpus is readable");
    for (target, entries) in [
        (
            "protocol",
            corpus
                .chat
                .iter()
                .chain(&corpus.completion)
                .collect::<Vec<_>>(),
        ),
        ("usage", corpus.usage.iter().collect()),
    ] {
        for e in entries {
            kvgate_fuzz::replay(target, &e.data).unwrap_or_else(|err| panic!("{}: {err}", e.name));
        }
    }
    for e in &corpus.sse {
        let mut file = b"kvgate-fuzz sse wants_usage=0 cuts=\n".to_vec();
        file.extend_from_slice(&e.data);
        kvgate_fuzz::replay("sse", &file).unwrap_or_else(|err| panic!("{}: {err}", e.name));
    }
}

/// Each file of `corpus/findings/` (`<target>--<invariant>.<ext>`) reproduces a known violation.
/// When this fails because a file now passes, its bug was fixed: delete the file and the
/// invariant's entry in `KNOWN`.
#[test]
fn known_findings_still_reproduce() {
    let dir = corpus::default_dir().join("findings");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("corpus/findings exists") {
        let path = entry.expect("readable").path();
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_owned();
        let Some((target, invariant)) = name.split_once("--") else {
            continue;
        };
        assert!(
            kvgate_fuzz::KNOWN.contains(&invariant),
            "{name}: not in KNOWN"
        );
        let bytes = std::fs::read(&path).expect("readable");
        let err = kvgate_fuzz::replay(target, &bytes).expect_err(&name);
        assert!(err.starts_with(&format!("{invariant}:")), "{name}: {err}");
        seen += 1;
    }
    assert!(seen > 0);
}
