//! The seed corpus: real request bodies, usage documents and engine SSE streams, read from
//! `fuzz/corpus/` (one input per file, one folder per kind). Mutants found during a run stay in
//! memory; nothing is written back here.

use std::path::{Path, PathBuf};

/// The corpus shipped with the crate.
pub fn default_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus")
}

/// One seed input.
#[derive(Debug, Clone)]
pub struct Entry {
    /// `folder/file`, for reports.
    pub name: String,
    pub data: Vec<u8>,
}

/// The seed inputs by kind.
#[derive(Debug, Clone, Default)]
pub struct Corpus {
    /// `chat/`: bodies of `POST /v1/chat/completions`.
    pub chat: Vec<Entry>,
    /// `completion/`: bodies of `POST /v1/completions`.
    pub completion: Vec<Entry>,
    /// `usage/`: whole answers and chunks carrying (or not) `usage`.
    pub usage: Vec<Entry>,
    /// `sse/`: engine streams, byte for byte as engines send them.
    pub sse: Vec<Entry>,
}

impl Corpus {
    /// Reads every folder of `dir` (files in name order, so a run is reproducible).
    pub fn load(dir: &Path) -> std::io::Result<Corpus> {
        Ok(Corpus {
            chat: read_dir(&dir.join("chat"))?,
            completion: read_dir(&dir.join("completion"))?,
            usage: read_dir(&dir.join("usage"))?,
            sse: read_dir(&dir.join("sse"))?,
        })
    }
}

fn read_dir(dir: &Path) -> std::io::Result<Vec<Entry>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    paths.retain(|p| p.is_file());
    paths.sort();
    let folder = dir
        .file_name()
        .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
    paths
        .into_iter()
        .map(|p| {
            Ok(Entry {
                name: format!(
                    "{folder}/{}",
                    p.file_name()
                        .map_or_else(String::new, |f| f.to_string_lossy().into_owned())
                ),
                data: std::fs::read(&p)?,
            })
        })
        .collect()
}
