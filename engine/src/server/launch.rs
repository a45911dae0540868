//! Starting an engine: load the model, size the KV pool, spawn the engine thread, bind the
//! listener. Used by `kvgate engine`, `kvgate serve` and the tests (which bind `127.0.0.1:0`).

use super::config::EngineConfig;
use super::ServerState;
use crate::kv::{KvCacheManager, KvConfig, TierConfig};
use crate::model::{Llama, LoadOptions, ModelConfig, ModelError};
use crate::sampling::GrammarCompiler;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::stats::Stats;
use crate::worker::disk;
use crate::worker::{EngineThread, Worker, DEFAULT_STALL_AFTER};
use kvgate_kernels::{Backend, Cpu, DType};
use kvgate_protocol::openai::{Limits, SamplingDefaults};
use kvgate_protocol::prompt::PromptRenderer;
use kvgate_protocol::{BlockHasher, HashParams};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;
use tokio::sync::broadcast;

/// Why an engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{0}")]
    Prompt(#[from] kvgate_protocol::prompt::PromptError),
    #[error("config: {0}")]
    Config(String),
    #[error("cannot start the engine thread: {0}")]
    Thread(std::io::Error),
    #[error("device: {0}")]
    Device(String),
}

/// Loads the model in `dir` and starts the engine thread; returns the shared server state (the
/// caller binds a listener and calls [`super::run`]).
pub fn start(config: &EngineConfig, dir: &Path) -> Result<Arc<ServerState>, LaunchError> {
    config.validate().map_err(LaunchError::Config)?;
    if config.auth.engine_token.is_none() {
        // validate() allows this on loopback only; even there, any local process may call.
        tracing::warn!(
            listen = %config.listen,
            "no engine token (auth.engine_token / KVGATE_ENGINE_TOKEN): any local process may \
             call this engine, and tenant, scope, priority and quota headers are ignored"
        );
    }
    #[cfg(feature = "cuda")]
    if let super::config::Device::Cuda(ordinal) = config.device {
        return cuda::start(config, dir, ordinal);
    }
    start_on(Cpu::new(), "cpu".into(), config, dir, DType::F32, |_, _| {
        Ok(2048)
    })
}

/// Host-tier blocks that stage disk reads and peer transfers when no host tier is configured (a
/// load takes at most half: 2,048 tokens at 16 per block).
const DISK_STAGING_BLOCKS: u32 = 256;

/// Starts the engine on `backend` with a KV pool of `kv_dtype`; `default_blocks(bytes per block,
/// model)` sizes the pool when the config gives neither `kv.blocks` nor `kv.bytes`.
fn start_on<B: Backend + 'static>(
    backend: B,
    device: String,
    config: &EngineConfig,
    dir: &Path,
    kv_dtype: DType,
    default_blocks: impl FnOnce(usize, &ModelConfig) -> Result<usize, LaunchError>,
) -> Result<Arc<ServerState>, LaunchError> {
    let model_config = ModelConfig::load(dir)?;
    let renderer = Arc::new(PromptRenderer::from_dir(dir)?);
    let wdtype = DType::from(config.dtype);
    let block_size = config.kv.block_size as usize;
    let per_block = 2
        * model_config.num_layers
        * model_config.num_kv_heads
        * model_config.head_dim
        * block_size
        * kv_dtype.size_bytes();
    let num_blocks = match (config.kv.blocks, config.kv.bytes) {
        (Some(b), _) => b as usize,
        (None, Some(bytes)) => (bytes as usize / per_block).max(1),
        (None, None) => default_blocks(per_block, &model_config)?,
    };
    // The host tier's slots follow the swap space in the host pools. With a disk tier and no
    // host tier asked for, a small one stages the disk's reads.
    let host_tier = match (config.kv.host_cache_blocks, config.kv.host_cache_bytes) {
        (Some(b), _) => b,
        (None, Some(bytes)) => u32::try_from((bytes / per_block as u64).max(1))
            .map_err(|_| LaunchError::Config("kv.host_cache_bytes: too large".into()))?,
        // The disk tier's reads and peer transfers (on with the engine token) are staged there.
        (None, None) if config.kv.disk_dir.is_some() || config.auth.engine_token.is_some() => {
            DISK_STAGING_BLOCKS
        }
        (None, None) => 0,
    };
    if config.kv.disk_dir.is_some() && host_tier == 0 {
        return Err(LaunchError::Config(
            "kv.disk_dir: the disk tier needs a host tier to stage its reads \
             (kv.host_cache_blocks > 0, or leave it unset)"
                .into(),
        ));
    }
    let host_pool = config
        .kv
        .host_blocks
        .checked_add(host_tier)
        .ok_or_else(|| {
            LaunchError::Config("kv.host_blocks + the host tier: too many blocks".into())
        })?;
    let model = Llama::load(
        backend,
        dir,
        LoadOptions {
            dtype: wdtype,
            quant: config.dtype.quant(),
            kv_dtype,
            num_blocks,
            num_host_blocks: host_pool as usize,
            block_size,
        },
    )?;
    let model_id = config.model_id.clone().unwrap_or_else(|| {
        dir.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("model")
            .to_owned()
    });
    let hasher = BlockHasher::new(&HashParams {
        model_id: model_id.clone(),
        weight_version: "1".into(),
        kv_dtype: kv_dtype.name().into(),
        block_size: config.kv.block_size,
        seed: config.seed(),
    });
    // The weights are part of what a block means: other weights under the same name are
    // another deployment, for the disk tier and for peers.
    let digest =
        model_digest(dir).map_err(|e| LaunchError::Config(format!("{}: {e}", dir.display())))?;
    let peer = config.auth.engine_token.as_ref().map(|_| disk::PeerCodec {
        fingerprint: hasher.fingerprint(&format!("{}/{digest}", disk::PEER_PURPOSE)),
        key: hasher.secret_key(&format!("{}/{digest}", disk::PEER_PURPOSE)),
        block_bytes: per_block,
    });
    let disk = match &config.kv.disk_dir {
        Some(path) => {
            let fingerprint =
                hasher.fingerprint(&format!("{}/{digest}", disk::FINGERPRINT_PURPOSE));
            let key = hasher.secret_key(disk::MAC_PURPOSE);
            let (files, scan) = disk::DiskFiles::open(path, fingerprint, key, &model_id, per_block)
                .map_err(LaunchError::Config)?;
            let slots = u32::try_from((config.kv.disk_bytes / files.file_bytes(64) as u64).max(1))
                .unwrap_or(u32::MAX);
            tracing::info!(
                dir = %path.display(),
                blocks = scan.blocks.len(),
                removed = scan.removed,
                capacity = slots,
                "disk tier"
            );
            Some((files, scan, slots))
        }
        None => None,
    };
    let mut kv = KvCacheManager::new(KvConfig {
        num_blocks: num_blocks as u32,
        num_host_blocks: config.kv.host_blocks,
        hasher,
        tiers: TierConfig {
            host_blocks: host_tier,
            disk_blocks: disk.as_ref().map_or(0, |d| d.2),
        },
    });
    let disk_io = match disk {
        Some((files, scan, _)) => {
            kv.restore_disk_tier(scan.blocks);
            Some(disk::DiskIo::start(files).map_err(LaunchError::Thread)?)
        }
        None => None,
    };
    let sched = Scheduler::new(
        SchedulerConfig {
            max_batched_tokens: config.scheduler.max_batched_tokens,
            decode_step_prefill_tokens: config.scheduler.decode_step_prefill_tokens(config.device),
            max_seqs: config.scheduler.max_seqs,
            preempt_mode: config.scheduler.preemption,
        },
        kv,
    );
    let metrics = Arc::new(Stats::new(
        &model_id,
        &config.device.to_string(),
        block_size,
        num_blocks,
    ));
    let (kv_tx, _) = broadcast::channel(4096);
    let mut eos = model_config.eos_token_ids.clone();
    eos.extend(renderer.eos_token_id());
    eos.sort_unstable();
    eos.dedup();
    let grammars = match GrammarCompiler::from_dir(
        dir,
        renderer.clone(),
        model_config.vocab_size,
        &eos,
    ) {
        Ok(g) => Some(Arc::new(g)),
        Err(reason) => {
            tracing::warn!(%reason, "structured outputs are off: the tokenizer could not be read for grammars");
            None
        }
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let (export_tx, export_rx) = std::sync::mpsc::channel();
    let (want_tx, want_rx) = std::sync::mpsc::channel();
    let imports_pending = Arc::new(AtomicUsize::new(0));
    let worker = Worker::new(
        sched,
        model,
        renderer.clone(),
        eos,
        metrics.clone(),
        kv_tx.clone(),
    )
    .with_stall_timeout(config.stalled_client_timeout())
    .with_tiers(config.kv.host_blocks, disk_io, peer.clone())
    .with_peer_queues(export_rx, want_rx, imports_pending.clone());
    let engine = EngineThread::spawn(DEFAULT_STALL_AFTER, move |beat| worker.run(rx, beat))
        .map_err(LaunchError::Thread)?;
    let tracer = kvgate_http::trace::Tracer::start(&config.tracing, "kvgate-engine")
        .map_err(LaunchError::Config)?;
    Ok(Arc::new(ServerState {
        tracer,
        device,
        model_id,
        context_len: model_config.max_position_embeddings,
        vocab_size: model_config.vocab_size,
        block_size: config.kv.block_size as usize,
        renderer,
        grammars,
        grammar_gate: Default::default(),
        commands: tx,
        export_asks: export_tx,
        want_asks: want_tx,
        imports_pending,
        engine,
        metrics,
        kv_events: kv_tx,
        limits: Limits {
            defaults: sampling_defaults(config, dir)?,
            ..Limits::default()
        },
        max_body_bytes: config.max_body_bytes,
        engine_token: config.auth.engine_token.clone(),
        operator_token: config.auth.operator_token.clone(),
        draining: AtomicBool::new(false),
        peer,
        exports: Arc::new(tokio::sync::Semaphore::new(super::peer::MAX_EXPORTS)),
        fetches: tokio::sync::Semaphore::new(super::peer::MAX_FETCHES),
        fetching: Default::default(),
        peer_backoff: Default::default(),
        inflight: AtomicUsize::new(0),
        next_id: AtomicU64::new(1),
        closing: tokio::sync::watch::channel(false).0,
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    }))
}

/// A digest of a model directory's weights and configuration, for the disk tier's fingerprint:
/// `config.json` whole, and of each weight file its name, its length and 64 KiB samples at 33
/// evenly spaced offsets. Cheap on any model size; weights that were retrained or fine-tuned
/// differ in the samples.
pub fn model_digest(dir: &Path) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    const SAMPLE: u64 = 64 << 10;
    let mut h = blake3::Hasher::new();
    h.update(&std::fs::read(dir.join("config.json"))?);
    let mut files: Vec<_> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let mut buf = vec![0u8; SAMPLE as usize];
    for path in files {
        let mut f = std::fs::File::open(&path)?;
        let len = f.metadata()?.len();
        h.update(path.file_name().map_or(&[][..], |n| n.as_encoded_bytes()));
        h.update(&len.to_le_bytes());
        for i in 0..=32u64 {
            let at = (len.saturating_sub(SAMPLE)) * i / 32;
            f.seek(SeekFrom::Start(at))?;
            let n = f.read(&mut buf)?;
            h.update(&buf[..n]);
        }
    }
    Ok(h.finalize().to_hex()[..32].to_owned())
}

/// The engine's `[sampling]` over the model's `generation_config.json` (when it has one).
fn sampling_defaults(config: &EngineConfig, dir: &Path) -> Result<SamplingDefaults, LaunchError> {
    let path = dir.join("generation_config.json");
    let model = match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .map(|json| SamplingDefaults::from_generation_config(&json))
            .map_err(|e| LaunchError::Config(format!("{}: {e}", path.display())))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => SamplingDefaults::default(),
        Err(e) => return Err(LaunchError::Config(format!("{}: {e}", path.display()))),
    };
    let defaults = config.sampling.or(model);
    defaults
        .check()
        .map_err(|e| LaunchError::Config(format!("{}: {}", path.display(), e.message)))?;
    Ok(defaults)
}

/// The CUDA engine: KV in the weights' storage type, the pool sized from free GPU memory.
#[cfg(feature = "cuda")]
mod cuda {
    use super::{start_on, EngineConfig, LaunchError, ModelConfig, ServerState};
    use kvgate_kernels::{Cuda, DType};
    use std::path::Path;
    use std::sync::Arc;

    pub(super) fn start(
        config: &EngineConfig,
        dir: &Path,
        ordinal: usize,
    ) -> Result<Arc<ServerState>, LaunchError> {
        let cuda = Cuda::new(ordinal).map_err(|e| LaunchError::Device(e.to_string()))?;
        let (free, _) = cuda
            .mem_info()
            .map_err(|e| LaunchError::Device(e.to_string()))?;
        let wdtype = DType::from(config.dtype);
        let fraction = config.kv.gpu_memory_fraction;
        let block_size = config.kv.block_size as usize;
        let tokens = config.scheduler.max_batched_tokens;
        let seqs = config.scheduler.max_seqs;
        tracing::info!(
            gpu = cuda.device_name(),
            arch = cuda.arch(),
            free_bytes = free,
            "cuda"
        );
        let device = format!("{} ({})", cuda.device_name(), cuda.arch());
        start_on(cuda, device, config, dir, wdtype, move |per_block, m| {
            if !matches!(m.head_dim, 64 | 128) || !matches!(block_size, 16 | 32) {
                return Err(LaunchError::Config(format!(
                    "device cuda: head_dim {} / kv.block_size {block_size} (the CUDA kernels \
                     support head_dim 64 or 128 and block_size 16 or 32)",
                    m.head_dim
                )));
            }
            let reserved = weight_bytes(m, wdtype) + activation_bytes(m, tokens, seqs);
            let budget = (free as f64 * fraction) as usize;
            let blocks = budget.saturating_sub(reserved) / per_block;
            if blocks == 0 {
                return Err(LaunchError::Device(format!(
                    "no GPU memory left for the KV pool: {free} bytes free, {fraction} of it \
                     allowed, {reserved} needed for weights and activations"
                )));
            }
            Ok(blocks)
        })
    }

    /// Bytes of the model's weights in `dtype` (norms and biases are f32).
    fn weight_bytes(m: &ModelConfig, dtype: DType) -> usize {
        let (h, q, kv, ffn) = (
            m.hidden_size,
            m.num_heads * m.head_dim,
            m.num_kv_heads * m.head_dim,
            m.intermediate_size,
        );
        let per_layer = h * (q + 2 * kv) + q * h + 3 * ffn * h;
        let tables = if m.tie_word_embeddings { 1 } else { 2 } * m.vocab_size * h;
        (m.num_layers * per_layer + tables) * dtype.size_bytes()
            + (m.num_layers * (2 * h + q + 2 * kv) + h) * 4
    }

    /// Activation buffers of a step of `tokens` tokens and `seqs` sequences, the split-KV
    /// scratch, the rotary tables, plus 512 MiB for the CUDA context and cuBLAS workspaces.
    fn activation_bytes(m: &ModelConfig, tokens: usize, seqs: usize) -> usize {
        let (h, q, kv, ffn) = (
            m.hidden_size,
            m.num_heads * m.head_dim,
            m.num_kv_heads * m.head_dim,
            m.intermediate_size,
        );
        let per_token = 3 * h + 2 * q + 2 * kv + 3 * ffn;
        let partitions = m.max_position_embeddings.div_ceil(512);
        let split_kv = seqs * m.num_heads * partitions * (m.head_dim + 2);
        let rope = m.max_position_embeddings * m.head_dim;
        (tokens * per_token + seqs * m.vocab_size + split_kv + rope) * 4
            + tokens * h.max(ffn) * 2
            + (512 << 20)
    }
}
