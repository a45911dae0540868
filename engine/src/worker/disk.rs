//! The disk tier's files and the thread that reads and writes them.
//!
//! One file per block, named by its hash: `<32 hex digits>.kvb` under the tier's directory.
//!
//! ```text
//! magic "KVGBLK01" | fingerprint (16) | hash (16, LE) | scope length (u32 LE) | scope
//! | payload length (u64 LE) | payload (every layer's K then V block, storage type, LE)
//! | keyed BLAKE3 of everything before (32)
//! ```
//!
//! - Writes go to a temporary name and are renamed into place, so a reader never sees half a
//!   file; a file cut short by a crash fails its length or MAC check and is never served.
//! - The MAC's key is derived from the deployment's hash root (`BlockHasher::secret_key`): a file
//!   written by anyone without the seed, or for another block, is refused. The directory is the
//!   owner's only (0700, files 0600).
//! - The fingerprint is the deployment's (model and a digest of its weights, KV type, block size,
//!   hash seed; see `BlockHasher::fingerprint`). The directory's `kvgate-kv.json` names it, and
//!   start-up refuses a directory of another deployment's blocks, a non-empty directory that is
//!   not a disk tier, and a directory another engine holds (a lock).
//! - Only files named like the tier's own (`<32 hex>.kvb`, `<32 hex>.<pid>.tmp`) are ever deleted.
//! - Peers send blocks to each other in the same frames ([`frame_parts`], [`decode_frame`]).
//! - One I/O thread does every job in the order sent, so a read after a write or a delete of the
//!   same block sees it. Writes queued past a byte bound are refused (the block is not kept on
//!   disk), so a slow disk never holds the engine thread up nor grows memory without bound.

use kvgate_protocol::BlockHash;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime};

const MAGIC: &[u8; 8] = b"KVGBLK01";
const MANIFEST: &str = "kvgate-kv.json";
const LOCK: &str = "kvgate-kv.lock";
const SUFFIX: &str = "kvb";
/// Longest scope name a file may carry.
const MAX_SCOPE: usize = 1024;
/// Bytes of writes waiting for the I/O thread before more are refused.
pub const MAX_QUEUED_WRITE_BYTES: usize = 256 << 20;
/// How long start-up waits for another engine (a restart's predecessor) to let go of the
/// directory.
const LOCK_WAIT: Duration = Duration::from_secs(15);
const HEAD: usize = 8 + 16 + 16 + 4;

/// The fingerprint and key purposes of disk-tier files (the weights' digest is appended to the
/// fingerprint's).
pub const FINGERPRINT_PURPOSE: &str = "disk-tier/v1";
pub const MAC_PURPOSE: &str = "disk-tier/mac/v1";

/// One block in transit: its hash, its scope, its bytes.
#[derive(Debug)]
pub struct Frame {
    pub hash: BlockHash,
    pub scope: String,
    pub payload: Vec<u8>,
}

/// What peers need to send each other frames: the deployment's fingerprint (weights included)
/// and MAC key, and a block's size.
#[derive(Clone)]
pub struct PeerCodec {
    pub fingerprint: [u8; 16],
    pub key: [u8; 32],
    pub block_bytes: usize,
}

impl std::fmt::Debug for PeerCodec {
    // The key is as secret as the hash seed: never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerCodec")
            .field("block_bytes", &self.block_bytes)
            .finish_non_exhaustive()
    }
}

/// The fingerprint and key purposes of peer frames (the weights' digest is appended to both).
pub const PEER_PURPOSE: &str = "peer/v1";

/// Bytes of one block's frame (or file).
pub fn frame_bytes(block_bytes: usize, scope_len: usize) -> usize {
    HEAD + scope_len + 8 + block_bytes + 32
}

/// A block's frame (file or peer transfer) but for its payload: the head (magic to payload
/// length) and the MAC of head and payload. The three are written or sent as they are, without
/// copying the payload into a frame of its own.
pub fn frame_parts(
    fingerprint: [u8; 16],
    key: &[u8; 32],
    hash: BlockHash,
    scope: &str,
    payload: &[u8],
) -> (Vec<u8>, [u8; 32]) {
    let mut head = Vec::with_capacity(HEAD + scope.len() + 8);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&fingerprint);
    head.extend_from_slice(&hash.0.to_le_bytes());
    head.extend_from_slice(&(scope.len() as u32).to_le_bytes());
    head.extend_from_slice(scope.as_bytes());
    head.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    let mut mac = blake3::Hasher::new_keyed(key);
    mac.update(&head);
    mac.update(payload);
    (head, *mac.finalize().as_bytes())
}

/// The payload of a frame of block `hash`, after checking every field and the MAC. The payload
/// is the frame's own buffer, moved to its front and cut to size: no new memory is taken.
pub fn decode_frame(
    mut frame: Vec<u8>,
    fingerprint: [u8; 16],
    key: &[u8; 32],
    hash: BlockHash,
    block_bytes: usize,
) -> Result<Vec<u8>, String> {
    if frame.len() < HEAD + 8 + 32 {
        return Err("truncated".into());
    }
    let (body, mac) = frame.split_at(frame.len() - 32);
    if blake3::keyed_hash(key, body).as_bytes() != mac {
        return Err("MAC mismatch (damaged, or not written by this deployment)".into());
    }
    if &body[..8] != MAGIC || body[8..24] != fingerprint {
        return Err("not this deployment's block".into());
    }
    if body[24..40] != hash.0.to_le_bytes() {
        return Err("holds another block".into());
    }
    let scope_len = u32::from_le_bytes(body[40..44].try_into().unwrap_or_default()) as usize;
    if scope_len > MAX_SCOPE || frame.len() != frame_bytes(block_bytes, scope_len) {
        return Err("wrong length".into());
    }
    frame.truncate(frame.len() - 32);
    frame.drain(..HEAD + scope_len + 8);
    Ok(frame)
}

/// A block file's location and layout, and the lock that keeps the directory this engine's.
#[derive(Clone)]
pub struct DiskFiles {
    dir: PathBuf,
    fingerprint: [u8; 16],
    key: [u8; 32],
    block_bytes: usize,
    _lock: Arc<fs::File>,
}

impl std::fmt::Debug for DiskFiles {
    // The key is as secret as the hash seed: never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskFiles")
            .field("dir", &self.dir)
            .field("block_bytes", &self.block_bytes)
            .finish_non_exhaustive()
    }
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

/// The hash a tier file's name stands for: `<32 hex>.kvb`.
fn block_name(name: &str) -> Option<BlockHash> {
    let stem = name.strip_suffix(".kvb")?;
    (stem.len() == 32 && stem.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| u128::from_str_radix(stem, 16).ok().map(BlockHash))
        .flatten()
}

/// Whether `name` is a tier write's temporary file: `<32 hex>.kvb.<pid>.tmp`.
fn is_temp_name(name: &str) -> bool {
    let Some(rest) = name.strip_suffix(".tmp") else {
        return false;
    };
    let Some((file, pid)) = rest.rsplit_once('.') else {
        return false;
    };
    !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()) && block_name(file).is_some()
}

fn private_dir(dir: &Path) -> io::Result<()> {
    let mut b = fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(dir)
}

impl DiskFiles {
    /// Opens (creating it if needed) the tier directory for blocks of `block_bytes` bytes, and
    /// lists the blocks it holds. Refuses a directory that holds another deployment's blocks, a
    /// non-empty directory that is not a disk tier, and one that another engine holds.
    pub fn open(
        dir: &Path,
        fingerprint: [u8; 16],
        key: [u8; 32],
        model: &str,
        block_bytes: usize,
    ) -> Result<(DiskFiles, Scan), String> {
        let shown = dir.display();
        private_dir(dir).map_err(|e| format!("kv.disk_dir {shown}: {e}"))?;
        let manifest = Manifest {
            format: 1,
            fingerprint: hex(&fingerprint),
            block_bytes,
            model: model.to_owned(),
        };
        let path = dir.join(MANIFEST);
        let lock = lock(&dir.join(LOCK)).map_err(|e| format!("kv.disk_dir {shown}: {e}"))?;
        match fs::read_to_string(&path) {
            Ok(text) => {
                let found: Manifest = serde_json::from_str(&text)
                    .map_err(|e| format!("{}: not a kvgate disk tier: {e}", path.display()))?;
                if found.fingerprint != manifest.fingerprint || found.block_bytes != block_bytes {
                    return Err(format!(
                        "kv.disk_dir {shown} holds KV blocks of another deployment (model \
                         '{}', fingerprint {}); this engine serves '{model}' with fingerprint {} \
                         (model and weights, KV type, block size and hash seed). Point \
                         kv.disk_dir at another directory, or empty this one.",
                        found.model, found.fingerprint, manifest.fingerprint
                    ));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let others = fs::read_dir(dir)
                    .map_err(|e| format!("kv.disk_dir {shown}: {e}"))?
                    .flatten()
                    .any(|e| e.file_name() != LOCK);
                if others {
                    return Err(format!(
                        "kv.disk_dir {shown} is not empty and is not a kvgate disk tier (no \
                         {MANIFEST}); give the disk tier a directory of its own"
                    ));
                }
                let json = serde_json::to_string_pretty(&manifest).map_err(|e| e.to_string())?;
                write_atomic(&path, &[json.as_bytes()])
                    .map_err(|e| format!("{}: {e}", path.display()))?;
            }
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
        let files = DiskFiles {
            dir: dir.to_owned(),
            fingerprint,
            key,
            block_bytes,
            _lock: Arc::new(lock),
        };
        let scan = files
            .scan()
            .map_err(|e| format!("kv.disk_dir {shown}: {e}"))?;
        Ok((files, scan))
    }

    /// Bytes of one block's file.
    pub fn file_bytes(&self, scope_len: usize) -> usize {
        frame_bytes(self.block_bytes, scope_len)
    }

    fn path(&self, hash: BlockHash) -> PathBuf {
        self.dir.join(format!("{:032x}.{SUFFIX}", hash.0))
    }

    fn scan(&self) -> io::Result<Scan> {
        let mut found: Vec<(SystemTime, BlockHash, String)> = Vec::new();
        let mut removed = 0;
        for entry in fs::read_dir(&self.dir)?.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if !entry.file_type().is_ok_and(|t| t.is_file()) {
                continue;
            }
            if is_temp_name(name) {
                let _ = fs::remove_file(&path);
                removed += 1;
                continue;
            }
            let Some(hash) = block_name(name) else {
                continue;
            };
            match self.read_header(&path, hash).ok().flatten() {
                Some((scope, mtime)) => found.push((mtime, hash, scope)),
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
        let mut head = [0u8; HEAD];
        f.read_exact(&mut head)?;
        let scope_len = u32::from_le_bytes(head[40..44].try_into().unwrap_or_default()) as usize;
        if &head[..8] != MAGIC
            || head[8..24] != self.fingerprint
            || head[24..40] != hash.0.to_le_bytes()
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
        let (head, mac) = frame_parts(self.fingerprint, &self.key, hash, scope, payload);
        write_atomic(&self.path(hash), &[&head, payload, &mac])
    }

    /// Reads block `hash`'s payload, checking every field and the MAC.
    pub fn read(&self, hash: BlockHash) -> Result<Vec<u8>, String> {
        let path = self.path(hash);
        let meta = fs::symlink_metadata(&path).map_err(|e| e.to_string())?;
        // Never more than a block's file: a file swapped in by someone else is not read whole.
        if !meta.is_file() || meta.len() > self.file_bytes(MAX_SCOPE) as u64 {
            return Err("not a block file".into());
        }
        let buf = fs::read(&path).map_err(|e| e.to_string())?;
        decode_frame(buf, self.fingerprint, &self.key, hash, self.block_bytes)
    }

    pub fn delete(&self, hash: BlockHash) {
        let _ = fs::remove_file(self.path(hash));
    }

    /// Deletes every block file and temporary file of the tier (and nothing else).
    pub fn delete_all(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if block_name(name).is_some() || is_temp_name(name) {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}

/// Takes the directory's lock file, waiting a while for an engine that is stopping.
fn lock(path: &Path) -> io::Result<fs::File> {
    let mut options = fs::OpenOptions::new();
    options.read(true).write(true).create(true).truncate(false);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let file = options.open(path)?;
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(fs::TryLockError::WouldBlock) => {
                return Err(io::Error::other(
                    "another engine is using this directory as its disk tier",
                ))
            }
            Err(fs::TryLockError::Error(e)) => return Err(e),
        }
    }
}

/// Writes `parts`, one after the other, as the file at `path`: under a temporary name, renamed
/// into place once whole.
fn write_atomic(path: &Path, parts: &[&[u8]]) -> io::Result<()> {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(name);
    let mut options = fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let result = options
        .open(&tmp)
        .and_then(|mut f| parts.iter().try_for_each(|p| f.write_all(p)));
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
        /// Set when nobody waits for the load any more: the rest is not read.
        cancel: Arc<AtomicBool>,
    },
    Delete(BlockHash),
    DeleteAll,
    /// Runs once every job before it is done.
    Then(Box<dyn FnOnce() + Send>),
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

    /// Queues reading `hashes` in order; returns the load's id. Setting `cancel` stops it.
    pub fn read(&mut self, hashes: Vec<BlockHash>, cancel: Arc<AtomicBool>) -> Option<u64> {
        self.next_load += 1;
        let load = self.next_load;
        self.send(Job::Read {
            load,
            hashes,
            cancel,
        })
        .then_some(load)
    }

    /// Runs `f` on the disk thread once every job queued so far is done.
    pub fn then(&self, f: impl FnOnce() + Send + 'static) -> bool {
        self.send(Job::Then(Box::new(f)))
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
        self.then(move || {
            let _ = tx.send(());
        }) && rx.recv_timeout(timeout).is_ok()
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
            Job::Read {
                load,
                hashes,
                cancel,
            } => {
                let started = Instant::now();
                for hash in hashes {
                    if cancel.load(Ordering::Relaxed) {
                        break;
                    }
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
            Job::Then(f) => f(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip_and_damage_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let (fp, key) = ([7u8; 16], [3u8; 32]);
        let (files, scan) = DiskFiles::open(dir.path(), fp, key, "m", 64).unwrap();
        assert!(scan.blocks.is_empty());
        let payload: Vec<u8> = (0..64).collect();
        files.write(BlockHash(5), "tenant-a", &payload).unwrap();
        files.write(BlockHash(6), "tenant-b", &payload).unwrap();
        assert_eq!(files.read(BlockHash(5)).unwrap(), payload);
        // One flipped payload byte fails the MAC.
        let path = files.path(BlockHash(6));
        let mut raw = fs::read(&path).unwrap();
        raw[70] ^= 1;
        fs::write(&path, &raw).unwrap();
        assert!(files.read(BlockHash(6)).unwrap_err().contains("MAC"));
        // A file written with another key (no seed) is refused, whatever it says.
        let (head, mac) = frame_parts(fp, &[9u8; 32], BlockHash(6), "tenant-b", &payload);
        fs::write(&path, [head, payload.clone(), mac.to_vec()].concat()).unwrap();
        assert!(files.read(BlockHash(6)).unwrap_err().contains("MAC"));
        // A file cut short is dropped at start-up, as is a leftover temporary file; a file of
        // another name is left alone.
        fs::write(&path, &raw[..raw.len() - 10]).unwrap();
        let tmp = format!("{:032x}.kvb.17.tmp", 9);
        fs::write(dir.path().join(&tmp), b"partial").unwrap();
        fs::write(dir.path().join("notes.txt"), b"mine").unwrap();
        drop(files);
        let (files, scan) = DiskFiles::open(dir.path(), fp, key, "m", 64).unwrap();
        assert_eq!(scan.blocks, vec![(BlockHash(5), "tenant-a".to_owned())]);
        assert_eq!(scan.removed, 2);
        files.delete_all();
        assert!(
            dir.path().join("notes.txt").exists(),
            "only the tier's own files go"
        );
        // A file renamed to another block's name is refused.
        files.write(BlockHash(5), "tenant-a", &payload).unwrap();
        fs::copy(files.path(BlockHash(5)), files.path(BlockHash(9))).unwrap();
        assert_eq!(files.read(BlockHash(9)).unwrap_err(), "holds another block");
        drop(files);
        // Another deployment's directory is refused, by name.
        let err = DiskFiles::open(dir.path(), [8u8; 16], key, "other", 64).unwrap_err();
        assert!(err.contains("another deployment"), "{err}");
        // A directory with other files and no manifest is not taken over.
        let other = tempfile::tempdir().unwrap();
        fs::write(other.path().join("data.bin"), b"x").unwrap();
        let err = DiskFiles::open(other.path(), fp, key, "m", 64).unwrap_err();
        assert!(err.contains("not empty"), "{err}");
    }

    #[test]
    fn a_directory_belongs_to_one_engine_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let (fp, key) = ([7u8; 16], [3u8; 32]);
        let (held, _) = DiskFiles::open(dir.path(), fp, key, "m", 64).unwrap();
        let (tx, rx) = mpsc::channel();
        let path = dir.path().to_owned();
        std::thread::spawn(move || {
            let _ = tx.send(DiskFiles::open(&path, fp, key, "m", 64).map(|_| ()));
        });
        // The second waits while the first holds it, then gets it once let go.
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        drop(held);
        assert!(rx.recv_timeout(Duration::from_secs(5)).unwrap().is_ok());
    }
}
