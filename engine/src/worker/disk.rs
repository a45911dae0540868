//! The disk tier's files and the thread that reads and writes them.
//!
//! One file per block, named by its hash: `<32 hex digits>.kvb` under the tier's directory.
//!
//! ```text
//! magic "KVGBLK01" | fingerprint (16) | hash (16, LE) | scope length (u32 LE) | scope
//! | payload length (u64 LE) | payload (every layer's K then V block, storage type, LE)
//! | BLAKE3 of everything before (32)
//! ```
//!
//! - Writes go to a temporary name and are renamed into place, so a reader never sees half a
//!   file; a file cut short by a crash fails its length or checksum check and is never served.
//! - The fingerprint is the deployment's (model, KV type, block size, hash seed; see
//!   `BlockHasher::fingerprint`); the directory's `kvgate-kv.json` names it, and start-up refuses a
//!   directory of another deployment's blocks.
//! - One I/O thread does every job in the order sent, so a read after a write or a delete of the
//!   same block sees it. Writes queued past a byte bound are refused (the block is not kept on
//!   disk), so a slow disk never holds the engine thread up nor grows memory without bound.

use kvgate_protocol::BlockHash;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime};

const MAGIC: &[u8; 8] = b"KVGBLK01";
const MANIFEST: &str = "kvgate-kv.json";
const SUFFIX: &str = "kvb";
/// Longest scope name a file may carry.
const MAX_SCOPE: usize = 1024;
/// Bytes of writes waiting for the I/O thread before more are refused.
const MAX_QUEUED_WRITE_BYTES: usize = 256 << 20;

/// The fingerprint purpose of disk-tier files.
pub const FINGERPRINT_PURPOSE: &str = "disk-tier/v1";

/// A block file's location and layout.
#[derive(Debug, Clone)]
pub struct DiskFiles {
    dir: PathBuf,
    fingerprint: [u8; 16],
    block_bytes: usize,
}

/// What start-up found in the directory.
#[derive(Debug, Default)]
pub struct Scan {
    /// Usable blocks with their scope, least recently written first.
    pub blocks: Vec<(BlockHash, String)>,
    /// Files deleted because they were cut short, malformed, or left over from a write.
    pub removed: usize,
}

#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
struct Manifest {
    format: u32,
    fingerprint: String,
    block_bytes: usize,
    model: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl DiskFiles {
    /// Opens (creating it if needed) the tier directory for blocks of `block_bytes` bytes, and
    /// lists the blocks it holds. Refuses a directory that holds another deployment's blocks.
    pub fn open(
        dir: &Path,
        fingerprint: [u8; 16],
        model: &str,
        block_bytes: usize,
    ) -> Result<(DiskFiles, Scan), String> {
        let shown = dir.display();
        fs::create_dir_all(dir).map_err(|e| format!("kv.disk_dir {shown}: {e}"))?;
        let manifest = Manifest {
            format: 1,
            fingerprint: hex(&fingerprint),
            block_bytes,
            model: model.to_owned(),
        };
        let path = dir.join(MANIFEST);
        match fs::read_to_string(&path) {
            Ok(text) => {
                let found: Manifest = serde_json::from_str(&text)
                    .map_err(|e| format!("{}: not a kvgate disk tier: {e}", path.display()))?;
                if found.fingerprint != manifest.fingerprint || found.block_bytes != block_bytes {
                    return Err(format!(
                        "kv.disk_dir {shown} holds KV blocks of another deployment (model \
                         '{}', fingerprint {}); this engine serves '{model}' with fingerprint {} \
                         (model, KV type, block size and hash seed). Point kv.disk_dir at another \
                         directory, or empty this one.",
                        found.model, found.fingerprint, manifest.fingerprint
                    ));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let json = serde_json::to_string_pretty(&manifest).map_err(|e| e.to_string())?;
                write_atomic(&path, json.as_bytes())
                    .map_err(|e| format!("{}: {e}", path.display()))?;
            }
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
        let files = DiskFiles {
            dir: dir.to_owned(),
            fingerprint,
            block_bytes,
        };
        let scan = files
            .scan()
            .map_err(|e| format!("kv.disk_dir {shown}: {e}"))?;
        Ok((files, scan))
    }

    /// Bytes of one block's file.
    pub fn file_bytes(&self, scope_len: usize) -> usize {
        MAGIC.len() + 16 + 16 + 4 + scope_len + 8 + self.block_bytes + 32
    }

    fn path(&self, hash: BlockHash) -> PathBuf {
        self.dir.join(format!("{:032x}.{SUFFIX}", hash.0))
    }

    fn scan(&self) -> io::Result<Scan> {
        let mut found: Vec<(SystemTime, BlockHash, String)> = Vec::new();
        let mut removed = 0;
        for entry in fs::read_dir(&self.dir)? {
            let entry = entry?;
            let path = entry.path();
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.ends_with(".tmp") {
                let _ = fs::remove_file(&path);
                removed += 1;
                continue;
            }
            let Some(stem) = name.strip_suffix(&format!(".{SUFFIX}")) else {
                continue;
            };
            let hash = u128::from_str_radix(stem, 16)
                .ok()
                .filter(|_| stem.len() == 32)
                .map(BlockHash);
            let header = hash.and_then(|h| Some((h, self.read_header(&path, h).ok()??)));
            match header {
                Some((hash, (scope, mtime))) => found.push((mtime, hash, scope)),
                None => {
                    let _ = fs::remove_file(&path);
                    removed += 1;
                }
            }
        }
        found.sort_by_key(|(t, _, _)| *t);
        Ok(Scan {
            blocks: found.into_iter().map(|(_, h, s)| (h, s)).collect(),
            removed,
        })
    }

    /// A file's scope and time, if its header is this deployment's and its length is right.
    fn read_header(
        &self,
        path: &Path,
        hash: BlockHash,
    ) -> io::Result<Option<(String, SystemTime)>> {
        let mut f = fs::File::open(path)?;
        let meta = f.metadata()?;
        let mut head = [0u8; 8 + 16 + 16 + 4];
        f.read_exact(&mut head)?;
        let (magic, rest) = head.split_at(8);
        let (fp, rest) = rest.split_at(16);
        let (h, len) = rest.split_at(16);
        let scope_len = u32::from_le_bytes(len.try_into().unwrap_or_default()) as usize;
        if magic != MAGIC
            || fp != self.fingerprint
            || h != hash.0.to_le_bytes()
            || scope_len > MAX_SCOPE
            || meta.len() != self.file_bytes(scope_len) as u64
        {
            return Ok(None);
        }
        let mut scope = vec![0u8; scope_len];
        f.read_exact(&mut scope)?;
        let Ok(scope) = String::from_utf8(scope) else {
            return Ok(None);
        };
        Ok(Some((
            scope,
            meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        )))
    }

    /// Writes block `hash` atomically.
    pub fn write(&self, hash: BlockHash, scope: &str, payload: &[u8]) -> io::Result<()> {
        if payload.len() != self.block_bytes || scope.len() > MAX_SCOPE {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad block"));
        }
        let mut buf = Vec::with_capacity(self.file_bytes(scope.len()));
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&self.fingerprint);
        buf.extend_from_slice(&hash.0.to_le_bytes());
        buf.extend_from_slice(&(scope.len() as u32).to_le_bytes());
        buf.extend_from_slice(scope.as_bytes());
        buf.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        buf.extend_from_slice(payload);
        let sum = blake3::hash(&buf);
        buf.extend_from_slice(sum.as_bytes());
        write_atomic(&self.path(hash), &buf)
    }

    /// Reads block `hash`'s payload, checking every field and the checksum.
    pub fn read(&self, hash: BlockHash) -> Result<Vec<u8>, String> {
        let buf = fs::read(self.path(hash)).map_err(|e| e.to_string())?;
        if buf.len() < 32 {
            return Err("truncated".into());
        }
        let (body, sum) = buf.split_at(buf.len() - 32);
        if blake3::hash(body).as_bytes() != sum {
            return Err("checksum mismatch".into());
        }
        let head = 8 + 16 + 16 + 4;
        if body.len() < head || &body[..8] != MAGIC || body[8..24] != self.fingerprint {
            return Err("not this deployment's block".into());
        }
        if body[24..40] != hash.0.to_le_bytes() {
            return Err("holds another block".into());
        }
        let scope_len = u32::from_le_bytes(body[40..44].try_into().unwrap_or_default()) as usize;
        if body.len() != self.file_bytes(scope_len) - 32 {
            return Err("wrong length".into());
        }
        let start = head + scope_len + 8;
        Ok(body[start..].to_vec())
    }

    pub fn delete(&self, hash: BlockHash) {
        let _ = fs::remove_file(self.path(hash));
    }

    pub fn delete_all(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == SUFFIX || e == "tmp") {
                let _ = fs::remove_file(path);
            }
        }
    }
}

fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
    let result = fs::File::create(&tmp).and_then(|mut f| f.write_all(data));
    match result {
        Ok(()) => fs::rename(&tmp, path),
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Whether an I/O error means the disk is full.
fn is_full(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::StorageFull || e.raw_os_error() == Some(28)
}

enum Job {
    Write {
        hash: BlockHash,
        scope: String,
        payload: Vec<u8>,
    },
    Read {
        load: u64,
        hashes: Vec<BlockHash>,
    },
    Delete(BlockHash),
    DeleteAll,
    /// Answered once every job before it is done.
    Barrier(mpsc::Sender<()>),
}

/// What the I/O thread reports back.
#[derive(Debug)]
pub enum Done {
    /// A write failed; `full` when the disk is out of space.
    WriteFailed {
        hash: BlockHash,
        full: bool,
        reason: String,
    },
    /// One block of load `load`, read and checked.
    Block {
        load: u64,
        hash: BlockHash,
        payload: Vec<u8>,
    },
    /// A block of load `load` is unusable (corrupt, cut short, unreadable); the load stops.
    Bad {
        load: u64,
        hash: BlockHash,
        reason: String,
    },
    /// Load `load` is over, after `secs` of reading.
    LoadEnd { load: u64, secs: f64 },
}

/// The disk tier's I/O thread and its queues. Dropping it lets the thread finish every job
/// queued, then joins it.
#[derive(Debug)]
pub struct DiskIo {
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<Done>,
    queued_bytes: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
    next_load: u64,
}

impl DiskIo {
    pub fn start(files: DiskFiles) -> io::Result<DiskIo> {
        let (jobs, rx) = mpsc::channel::<Job>();
        let (tx, done) = mpsc::channel();
        let queued_bytes = Arc::new(AtomicUsize::new(0));
        let queued = queued_bytes.clone();
        let thread = std::thread::Builder::new()
            .name("kvgate-disk-tier".into())
            .spawn(move || io_thread(files, rx, tx, queued))?;
        Ok(DiskIo {
            jobs: Some(jobs),
            done,
            queued_bytes,
            thread: Some(thread),
            next_load: 0,
        })
    }

    fn send(&self, job: Job) -> bool {
        self.jobs.as_ref().is_some_and(|j| j.send(job).is_ok())
    }

    /// Queues a write; false (nothing queued) when too many bytes wait already.
    pub fn write(&self, hash: BlockHash, scope: String, payload: Vec<u8>) -> bool {
        let n = payload.len();
        if self.queued_bytes.fetch_add(n, Ordering::SeqCst) + n > MAX_QUEUED_WRITE_BYTES {
            self.queued_bytes.fetch_sub(n, Ordering::SeqCst);
            return false;
        }
        self.send(Job::Write {
            hash,
            scope,
            payload,
        })
    }

    /// Queues reading `hashes` in order; returns the load's id.
    pub fn read(&mut self, hashes: Vec<BlockHash>) -> Option<u64> {
        self.next_load += 1;
        let load = self.next_load;
        self.send(Job::Read { load, hashes }).then_some(load)
    }

    pub fn delete(&self, hash: BlockHash) {
        self.send(Job::Delete(hash));
    }

    pub fn delete_all(&self) {
        self.send(Job::DeleteAll);
    }

    /// Waits up to `timeout` for every job queued so far to be done; false if it timed out.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let (tx, rx) = mpsc::channel();
        self.send(Job::Barrier(tx)) && rx.recv_timeout(timeout).is_ok()
    }

    /// Bytes of writes waiting for the disk.
    pub fn queued_write_bytes(&self) -> usize {
        self.queued_bytes.load(Ordering::SeqCst)
    }

    /// Waits up to `timeout` for the next report.
    pub fn next(&self, timeout: Duration) -> Option<Done> {
        if timeout.is_zero() {
            return self.done.try_recv().ok();
        }
        self.done.recv_timeout(timeout).ok()
    }
}

impl Drop for DiskIo {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn io_thread(
    files: DiskFiles,
    jobs: mpsc::Receiver<Job>,
    done: mpsc::Sender<Done>,
    queued: Arc<AtomicUsize>,
) {
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Write {
                hash,
                scope,
                payload,
            } => {
                let r = files.write(hash, &scope, &payload);
                queued.fetch_sub(payload.len(), Ordering::SeqCst);
                if let Err(e) = r {
                    let _ = done.send(Done::WriteFailed {
                        hash,
                        full: is_full(&e),
                        reason: e.to_string(),
                    });
                }
            }
            Job::Read { load, hashes } => {
                let started = Instant::now();
                for hash in hashes {
                    match files.read(hash) {
                        Ok(payload) => {
                            let _ = done.send(Done::Block {
                                load,
                                hash,
                                payload,
                            });
                        }
                        Err(reason) => {
                            let _ = done.send(Done::Bad { load, hash, reason });
                            break;
                        }
                    }
                }
                let secs = started.elapsed().as_secs_f64();
                let _ = done.send(Done::LoadEnd { load, secs });
            }
            Job::Delete(hash) => files.delete(hash),
            Job::DeleteAll => files.delete_all(),
            Job::Barrier(reply) => {
                let _ = reply.send(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip_and_damage_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let fp = [7u8; 16];
        let (files, scan) = DiskFiles::open(dir.path(), fp, "m", 64).unwrap();
        assert!(scan.blocks.is_empty());
        let payload: Vec<u8> = (0..64).collect();
        files.write(BlockHash(5), "tenant-a", &payload).unwrap();
        files.write(BlockHash(6), "tenant-b", &payload).unwrap();
        assert_eq!(files.read(BlockHash(5)).unwrap(), payload);
        // One flipped payload byte fails the checksum.
        let path = files.path(BlockHash(6));
        let mut raw = fs::read(&path).unwrap();
        raw[70] ^= 1;
        fs::write(&path, &raw).unwrap();
        assert_eq!(files.read(BlockHash(6)).unwrap_err(), "checksum mismatch");
        // A file cut short is dropped at start-up, as is a leftover temporary file.
        fs::write(&path, &raw[..raw.len() - 10]).unwrap();
        fs::write(dir.path().join("x.kvb.1.tmp"), b"partial").unwrap();
        let (_, scan) = DiskFiles::open(dir.path(), fp, "m", 64).unwrap();
        assert_eq!(scan.blocks, vec![(BlockHash(5), "tenant-a".to_owned())]);
        assert_eq!(scan.removed, 2);
        // Another deployment's directory is refused, by name.
        let err = DiskFiles::open(dir.path(), [8u8; 16], "other", 64).unwrap_err();
        assert!(err.contains("another deployment"), "{err}");
        // A file renamed to another block's name is refused.
        fs::copy(files.path(BlockHash(5)), files.path(BlockHash(9))).unwrap();
        assert_eq!(files.read(BlockHash(9)).unwrap_err(), "holds another block");
    }
}
