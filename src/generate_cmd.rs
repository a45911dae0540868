//! `kvgate generate`: one prompt through the engine a server runs (the same scheduler, worker,
//! block manager, paged attention and sampler), so the command line and the server give the same
//! answer to the same request and seed.

use crate::model_cmd;
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use kvgate_engine::scheduler::GroupId;
use kvgate_engine::server::config::{Device, EngineConfig, KvSection, WeightDType};
use kvgate_engine::server::launch;
use kvgate_engine::worker::{Command, Event, Submit, EVENT_BUFFER};
use kvgate_protocol::openai::SamplingParams;
use kvgate_protocol::prompt::ChatMessage;
use std::io::Write;
use std::path::PathBuf;

/// `--dtype`: the weights' type in memory.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DTypeArg {
    F32,
    F16,
    Bf16,
    /// Matrices in Q8_0 blocks.
    #[value(name = "q8_0")]
    Q8_0,
    /// Projections in Q4_1 blocks, the embedding table in Q8_0 (a Q4_1 GGUF as shipped).
    #[value(name = "q4_1")]
    Q4_1,
}

impl From<DTypeArg> for WeightDType {
    fn from(d: DTypeArg) -> WeightDType {
        match d {
            DTypeArg::F32 => WeightDType::F32,
            DTypeArg::F16 => WeightDType::F16,
            DTypeArg::Bf16 => WeightDType::Bf16,
            DTypeArg::Q8_0 => WeightDType::Q8_0,
            DTypeArg::Q4_1 => WeightDType::Q4_1,
        }
    }
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model directory or .gguf file (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Storage type of the weights in memory.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// KV cache blocks (16 tokens each).
    #[arg(long, default_value_t = 512)]
    kv_blocks: u32,
    /// `cpu`, or `cuda` / `cuda:N` in a build with `--features cuda`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Also print the prompt and generated token ids.
    #[arg(long)]
    ids: bool,
}

/// `--device`, checked before the model is fetched or loaded.
fn check_device(device: &str) -> Result<Device> {
    let parsed: Device = device
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--{e}"))?;
    if matches!(parsed, Device::Cuda(_)) && !cfg!(feature = "cuda") {
        anyhow::bail!(
            "--device {device}: this kvgate was built without CUDA (cargo build --features cuda)"
        );
    }
    Ok(parsed)
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let device = check_device(&args.device)?;
    let dtype = WeightDType::from(args.dtype);
    let dir = model_cmd::resolve(args.model.as_deref(), dtype.quant().is_some())?;
    let config = EngineConfig {
        model: Some(dir.clone()),
        device,
        dtype,
        kv: KvSection {
            blocks: Some(args.kv_blocks),
            ..KvSection::default()
        },
        ..EngineConfig::default()
    };
    let engine = launch::start(&config, &dir)
        .with_context(|| format!("loading {} on {}", dir.display(), args.device))?;
    if device != Device::Cpu {
        eprintln!("device: {}", engine.device);
    }
    let prompt = if args.chat {
        engine.renderer.encode_chat(&[ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
        }])?
    } else {
        engine.renderer.encode(&args.prompt)?
    };
    let params = SamplingParams {
        temperature: args.temperature,
        seed: Some(args.seed),
        max_tokens: Some(args.max_tokens),
        // Each output token's id comes back with its logprob (for --ids).
        logprobs: Some(0),
        ..SamplingParams::default()
    };
    let max_tokens = params.max_tokens_for(prompt.len(), engine.context_len)?;
    let (events, mut rx) = tokio::sync::mpsc::channel(EVENT_BUFFER + 2);
    let (on_stall, _stalled) = tokio::sync::oneshot::channel();
    engine
        .commands
        .send(Command::Submit(
            GroupId(1),
            Box::new(Submit {
                tenant: "cli".into(),
                scope: String::new(),
                priority: 0.0,
                kv_quota: None,
                prompt: prompt.clone(),
                params,
                max_tokens,
                constraint: None,
                events,
                on_stall,
                progress: None,
            }),
        ))
        .map_err(|_| anyhow::anyhow!("the engine thread is not running"))?;
    let mut stdout = std::io::stdout();
    let mut ids = Vec::new();
    while let Some(event) = rx.blocking_recv() {
        match event {
            Event::Piece { text, logprobs, .. } => {
                ids.extend(logprobs.iter().map(|(id, _)| *id));
                let _ = write!(stdout, "{text}");
                let _ = stdout.flush();
            }
            Event::Done { .. } => break,
            Event::Failed(e) => anyhow::bail!("{}", e.message),
        }
    }
    println!();
    if args.ids {
        println!("prompt_ids: {prompt:?}");
        println!("output_ids: {ids:?}");
    }
    Ok(())
}
