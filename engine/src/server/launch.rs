//! Starting an engine: load the model, size the KV pool, spawn the engine thread, bind the
//! listener. Used by `kvgate engine`, `kvgate serve` and the tests (which bind `127.0.0.1:0`).

use super::config::EngineConfig;
use super::metrics::Metrics;
use super::ServerState;
use crate::kv::{KvCacheManager, KvConfig};
use crate::model::{Llama, LoadOptions, ModelConfig, ModelError};
use crate::scheduler::{PreemptMode, Scheduler, SchedulerConfig};
use crate::worker::Worker;
use kvgate_kernels::{Cpu, DType};
use kvgate_protocol::openai::Limits;
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
}

fn dtype(name: &str) -> DType {
    match name {
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        _ => DType::F32,
    }
}

/// Loads the model in `dir` and starts the engine thread; returns the shared server state (the
/// caller binds a listener and calls [`super::run`]).
pub fn start(config: &EngineConfig, dir: &Path) -> Result<Arc<ServerState>, LaunchError> {
    config.validate().map_err(LaunchError::Config)?;
    let model_config = ModelConfig::load(dir)?;
    let renderer = Arc::new(PromptRenderer::from_dir(dir)?);
    let wdtype = dtype(&config.dtype);
    let kv_dtype = DType::F32;
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
        (None, None) => 2048,
    };
    let model = Llama::load(
        Cpu::new(),
        dir,
        LoadOptions {
            dtype: wdtype,
            kv_dtype,
            num_blocks,
            num_host_blocks: config.kv.host_blocks as usize,
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
    let kv = KvCacheManager::new(KvConfig {
        num_blocks: num_blocks as u32,
        num_host_blocks: config.kv.host_blocks,
        hasher,
    });
    let sched = Scheduler::new(
        SchedulerConfig {
            max_batched_tokens: config.scheduler.max_batched_tokens,
            max_seqs: config.scheduler.max_seqs,
            preempt_mode: if config.scheduler.preemption == "swap" {
                PreemptMode::Swap
            } else {
                PreemptMode::Recompute
            },
        },
        kv,
    );
    let metrics = Arc::new(Metrics::new(
        &model_id,
        &config.device,
        block_size,
        num_blocks,
    ));
    let (kv_tx, _) = broadcast::channel(4096);
    let mut eos = model_config.eos_token_ids.clone();
    eos.extend(renderer.eos_token_id());
    eos.sort_unstable();
    eos.dedup();
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = Worker::new(
        sched,
        model,
        renderer.clone(),
        eos,
        metrics.clone(),
        kv_tx.clone(),
    );
    std::thread::Builder::new()
        .name("kvgate-engine".into())
        .spawn(move || worker.run(rx))
        .map_err(LaunchError::Thread)?;
    Ok(Arc::new(ServerState {
        model_id,
        context_len: model_config.max_position_embeddings,
        vocab_size: model_config.vocab_size,
        renderer,
        commands: tx,
        metrics,
        kv_events: kv_tx,
        limits: Limits::default(),
        max_body_bytes: config.max_body_bytes,
        engine_token: config.auth.engine_token.clone(),
        operator_token: config.auth.operator_token.clone(),
        draining: AtomicBool::new(false),
        inflight: AtomicUsize::new(0),
        next_id: AtomicU64::new(1),
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    }))
}
