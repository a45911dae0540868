//! `kvgate generate`: one prompt through the real engine path (block manager, paged attention).

use crate::model_cmd;
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use kvgate_engine::kv::{KvCacheManager, KvConfig};
use kvgate_engine::model::{GenerateOptions, Generator, Llama, LoadOptions, ModelConfig};
use kvgate_kernels::{Backend, Cpu, DType};
use kvgate_protocol::prompt::{ChatMessage, PromptRenderer};
use kvgate_protocol::{BlockHasher, HashParams};
use std::io::Write;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DTypeArg {
    F32,
    F16,
    Bf16,
}

impl From<DTypeArg> for DType {
    fn from(d: DTypeArg) -> DType {
        match d {
            DTypeArg::F32 => DType::F32,
            DTypeArg::F16 => DType::F16,
            DTypeArg::Bf16 => DType::BF16,
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
    max_tokens: usize,
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

/// Where `--device` runs the model, checked before the model is fetched or loaded.
enum Device {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(usize),
}

fn parse_device(device: &str) -> Result<Device> {
    if device == "cpu" {
        return Ok(Device::Cpu);
    }
    #[cfg(feature = "cuda")]
    if let Some(ordinal) = kvgate_engine::server::config::cuda_ordinal(device) {
        return Ok(Device::Cuda(ordinal));
    }
    if device.starts_with("cuda") && !cfg!(feature = "cuda") {
        anyhow::bail!(
            "--device {device}: this kvgate was built without CUDA (cargo build --features cuda)"
        );
    }
    anyhow::bail!("--device {device}: expected cpu, cuda or cuda:N")
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let device = parse_device(&args.device)?;
    let dir = model_cmd::resolve(args.model.as_deref())?;
    let config = ModelConfig::load(&dir)?;
    let renderer = PromptRenderer::from_dir(&dir)?;
    let prompt = if args.chat {
        renderer.encode_chat(&[ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
        }])?
    } else {
        renderer.encode(&args.prompt)?
    };
    match device {
        Device::Cpu => generate_on(Cpu::new(), &args, &dir, &config, &renderer, &prompt),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => {
            let cuda = kvgate_kernels::Cuda::new(ordinal)
                .with_context(|| format!("opening {}", args.device))?;
            eprintln!("device: {} ({})", cuda.device_name(), cuda.arch());
            generate_on(cuda, &args, &dir, &config, &renderer, &prompt)
        }
    }
}

/// Generates from `prompt` on `backend`, printing the text as it grows.
fn generate_on<B: Backend>(
    backend: B,
    args: &GenerateArgs,
    dir: &std::path::Path,
    config: &ModelConfig,
    renderer: &PromptRenderer,
    prompt: &[u32],
) -> Result<()> {
    let block_size = 16;
    let model = Llama::load(
        backend,
        dir,
        LoadOptions {
            dtype: args.dtype.into(),
            kv_dtype: DType::F32,
            num_blocks: args.kv_blocks as usize,
            num_host_blocks: 0,
            block_size,
        },
    )
    .with_context(|| format!("loading {}", dir.display()))?;
    let hasher = BlockHasher::new(&HashParams {
        model_id: dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("model")
            .to_owned(),
        weight_version: "local".into(),
        kv_dtype: "f32".into(),
        block_size: block_size as u32,
        seed: [0; 32],
    });
    let kv = KvCacheManager::new(KvConfig {
        num_blocks: args.kv_blocks,
        num_host_blocks: 0,
        hasher,
    });
    let mut eos = config.eos_token_ids.clone();
    eos.extend(renderer.eos_token_id());
    let mut generator = Generator::new(model, kv);
    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        seed: args.seed,
    };
    let mut stdout = std::io::stdout();
    let mut shown = String::new();
    let mut ids = Vec::new();
    let out = generator.generate(prompt, &eos, opts, |t| {
        ids.push(t);
        // Print the text as it grows (decoding the whole tail keeps multi-byte characters whole).
        if let Ok(text) = renderer.decode(&ids) {
            if let Some(new) = text.strip_prefix(shown.as_str()) {
                let _ = write!(stdout, "{new}");
                let _ = stdout.flush();
            }
            shown = text;
        }
    })?;
    println!();
    if args.ids {
        println!("prompt_ids: {prompt:?}");
        println!("output_ids: {:?}", out.tokens);
    }
    Ok(())
}
