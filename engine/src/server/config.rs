//! `engine.toml`: what one engine instance serves and how, parsed once into typed structs.
//! Errors name the field. `KVGATE_ENGINE_TOKEN`, `KVGATE_OPERATOR_TOKEN` and `KVGATE_HASH_SEED` in
//! the environment override the file.
//!
//! The engine token is what makes the gateway's tenant, scope, priority and quota headers
//! trustworthy: without one the engine ignores them, and it refuses to listen beyond loopback.
//!
//! ```toml
//! listen = "127.0.0.1:8081"                 # beyond loopback, auth.engine_token is required
//! model = "/models/smollm2-135m-instruct"   # omit: the default model, fetched on first use
//! model_id = "smollm2-135m-instruct"        # the name clients send; default: the directory's
//! device = "cpu"                            # or "cuda" / "cuda:N" (builds with --features cuda)
//! dtype = "f32"                             # weights in memory: f32, f16, bf16, q8_0, q4_1
//! [kv]
//! blocks = 4096                             # or: bytes = 1073741824
//! gpu_memory_fraction = 0.9                 # cuda, neither blocks nor bytes set: the KV pool
//!                                           # takes this share of free GPU memory left after
//!                                           # weights and activations
//! block_size = 16
//! host_blocks = 1024                        # swap space
//! host_cache_bytes = 4294967296             # host tier: evicted cached blocks live on here
//!                                           # (or host_cache_blocks = N)
//! disk_dir = "/var/cache/kvgate/kv"         # disk tier, off unless set: blocks evicted from
//! disk_bytes = 68719476736                  # the host tier, kept across restarts
//! hash_seed = "<64 hex digits>"             # deployment secret, the same on every engine
//! [scheduler]
//! max_batched_tokens = 2048
//! decode_step_prefill_tokens = 256           # prompt tokens in a step that also decodes
//!                                           # (default: 256 on cpu, max_batched_tokens on cuda)
//! max_seqs = 64
//! preemption = "recompute"                  # or "swap"
//! [sampling]                                # defaults for what a request leaves out; each
//! temperature = 0.2                         # overrides the model's generation_config.json
//! top_p = 0.9                               # (also top_k, min_p, repetition_penalty)
//! [auth]
//! engine_token = "..."                      # required from the gateway on /v1/* and /kv/events
//! operator_token = "..."                    # required on /admin/*
//! [tracing]                                 # off unless an endpoint is set
//! otlp_endpoint = "http://otel-collector:4318"
//! ```
//!
//! Top level, beside `listen`: `max_body_bytes = 4194304` (largest request body) and
//! `stalled_client_timeout_ms = 30000` (a stream whose client has not read for this long is
//! cancelled and its KV blocks freed).

pub use crate::scheduler::PreemptMode;
use kvgate_kernels::{DType, Quant};
use serde::Deserialize;
use std::path::PathBuf;

/// The weights' type in memory (`dtype`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDType {
    #[default]
    F32,
    F16,
    Bf16,
    /// Matrices in Q8_0 blocks, executed as such on the CPU.
    Q8_0,
    /// Projections in Q4_1 blocks and the embedding table in Q8_0, as llama.cpp's Q4_1 files
    /// ship them; executed as such on the CPU.
    Q4_1,
}

impl WeightDType {
    /// The block format of the matrices, for the quantized types.
    pub fn quant(self) -> Option<Quant> {
        match self {
            WeightDType::Q8_0 => Some(Quant::Q8_0),
            WeightDType::Q4_1 => Some(Quant::Q4_1),
            _ => None,
        }
    }
}

/// The dense type of the weights: quantized ones are widened to f16 where a backend has no
/// quantized kernels (CUDA), and their unquantized vectors stay f32 on the CPU.
impl From<WeightDType> for DType {
    fn from(d: WeightDType) -> DType {
        match d {
            WeightDType::F32 => DType::F32,
            WeightDType::F16 | WeightDType::Q8_0 | WeightDType::Q4_1 => DType::F16,
            WeightDType::Bf16 => DType::BF16,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    #[serde(default = "default_listen")]
    pub listen: String,
    #[serde(default)]
    pub model: Option<PathBuf>,
    #[serde(default)]
    pub model_id: Option<String>,
    #[serde(default)]
    pub device: Device,
    #[serde(default)]
    pub dtype: WeightDType,
    #[serde(default)]
    pub kv: KvSection,
    #[serde(default)]
    pub scheduler: SchedulerSection,
    #[serde(default)]
    pub auth: AuthSection,
    /// Sampling defaults for the fields a request leaves out, over the model's own
    /// (`generation_config.json`).
    #[serde(default)]
    pub sampling: kvgate_protocol::openai::SamplingDefaults,
    /// Largest request body, in bytes.
    #[serde(default = "default_body_limit")]
    pub max_body_bytes: usize,
    /// How long a stream's output may wait, its buffer full, for a client that does not read,
    /// before the request is cancelled and its blocks freed.
    #[serde(default = "default_stalled_client_timeout_ms")]
    pub stalled_client_timeout_ms: u64,
    /// Each request's queue, prefill and decode spans, exported over OTLP when an endpoint is
    /// set, under the gateway's span that sent it.
    #[serde(default)]
    pub tracing: kvgate_http::trace::TracingConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvSection {
    pub blocks: Option<u32>,
    pub bytes: Option<u64>,
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    #[serde(default)]
    pub host_blocks: u32,
    #[serde(default)]
    pub hash_seed: Option<String>,
    /// CUDA only, when neither `blocks` nor `bytes` is set: the share of the free GPU memory
    /// (after weights and activations) the KV pool takes.
    #[serde(default = "default_gpu_memory_fraction")]
    pub gpu_memory_fraction: f64,
    /// The host tier's size, in blocks or bytes (pinned host memory on a GPU; on a CPU engine a
    /// budget apart from the working pool). Neither: no host tier, unless the disk tier is on.
    #[serde(default)]
    pub host_cache_blocks: Option<u32>,
    #[serde(default)]
    pub host_cache_bytes: Option<u64>,
    /// The disk tier's directory (off when unset) and its size in bytes.
    #[serde(default)]
    pub disk_dir: Option<PathBuf>,
    #[serde(default = "default_disk_bytes")]
    pub disk_bytes: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerSection {
    #[serde(default = "default_batched_tokens")]
    pub max_batched_tokens: usize,
    /// The most prompt tokens of a step that also decodes: inter-token latency against TTFT.
    /// Default: 256 on the CPU, where a step's time grows with its tokens, and the whole
    /// `max_batched_tokens` on a GPU, where a chunk beside the decodes costs them little.
    #[serde(default)]
    pub decode_step_prefill_tokens: Option<usize>,
    #[serde(default = "default_max_seqs")]
    pub max_seqs: usize,
    #[serde(default)]
    pub preemption: PreemptMode,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthSection {
    pub engine_token: Option<String>,
    pub operator_token: Option<String>,
}

fn default_listen() -> String {
    "127.0.0.1:8081".into()
}
fn default_disk_bytes() -> u64 {
    16 << 30
}
fn default_gpu_memory_fraction() -> f64 {
    0.9
}
fn default_block_size() -> u32 {
    16
}
fn default_batched_tokens() -> usize {
    2048
}
fn default_max_seqs() -> usize {
    64
}
fn default_body_limit() -> usize {
    4 << 20
}
fn default_stalled_client_timeout_ms() -> u64 {
    30_000
}

impl Default for KvSection {
    fn default() -> Self {
        KvSection {
            blocks: None,
            bytes: None,
            block_size: default_block_size(),
            host_blocks: 0,
            hash_seed: None,
            gpu_memory_fraction: default_gpu_memory_fraction(),
            host_cache_blocks: None,
            host_cache_bytes: None,
            disk_dir: None,
            disk_bytes: default_disk_bytes(),
        }
    }
}

impl SchedulerSection {
    /// [`Self::decode_step_prefill_tokens`], or its default for `device`.
    pub fn decode_step_prefill_tokens(&self, device: Device) -> usize {
        self.decode_step_prefill_tokens.unwrap_or(match device {
            Device::Cpu => CPU_DECODE_STEP_PREFILL_TOKENS.min(self.max_batched_tokens),
            Device::Cuda(_) => self.max_batched_tokens,
        })
    }
}

/// On the CPU a step's time grows with its tokens. With 256 prompt tokens beside the decodes, a
/// ShareGPT replay's inter-token p99 was 321 ms against 998 ms with 2,048, at a higher throughput
/// (docs/PERFORMANCE.md).
const CPU_DECODE_STEP_PREFILL_TOKENS: usize = 256;

impl Default for SchedulerSection {
    fn default() -> Self {
        SchedulerSection {
            max_batched_tokens: default_batched_tokens(),
            decode_step_prefill_tokens: None,
            max_seqs: default_max_seqs(),
            preemption: PreemptMode::default(),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        toml::from_str("").expect("every field has a default")
    }
}

impl EngineConfig {
    /// Parses and validates TOML text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut c: EngineConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        c.apply_env(|k| std::env::var(k).ok());
        c.validate()?;
        Ok(c)
    }

    /// Secrets from the environment, which win over the file: `KVGATE_ENGINE_TOKEN`,
    /// `KVGATE_OPERATOR_TOKEN`, `KVGATE_HASH_SEED` (the same names the gateway reads).
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) {
        let pairs: [(&str, &mut Option<String>); 3] = [
            ("KVGATE_ENGINE_TOKEN", &mut self.auth.engine_token),
            ("KVGATE_OPERATOR_TOKEN", &mut self.auth.operator_token),
            ("KVGATE_HASH_SEED", &mut self.kv.hash_seed),
        ];
        for (key, field) in pairs {
            if let Some(v) = get(key).filter(|v| !v.is_empty()) {
                *field = Some(v);
            }
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        self.tracing.validate()?;
        if matches!(self.device, Device::Cuda(_)) && !cfg!(feature = "cuda") {
            return Err(format!(
                "device: {} is not available in this build (cpu; cuda needs --features cuda)",
                self.device
            ));
        }
        if let Err(e) = self.sampling.check() {
            return Err(format!("sampling: {}", e.message));
        }
        if !(self.kv.gpu_memory_fraction > 0.0 && self.kv.gpu_memory_fraction <= 1.0) {
            return Err("kv.gpu_memory_fraction: must be in (0, 1]".into());
        }
        if !(1..=256).contains(&self.kv.block_size) {
            return Err("kv.block_size: must be 1 to 256".into());
        }
        if self.kv.blocks == Some(0) || self.kv.bytes == Some(0) {
            return Err("kv.blocks / kv.bytes: must be positive".into());
        }
        if self.kv.host_cache_blocks.is_some() && self.kv.host_cache_bytes.is_some() {
            return Err("kv.host_cache_blocks / kv.host_cache_bytes: set one, not both".into());
        }
        if self.kv.disk_dir.is_some() && self.kv.disk_bytes == 0 {
            return Err("kv.disk_bytes: must be positive with kv.disk_dir".into());
        }
        if self.scheduler.max_batched_tokens == 0
            || self.scheduler.max_seqs == 0
            || self.scheduler.decode_step_prefill_tokens == Some(0)
        {
            return Err(
                "scheduler.max_batched_tokens, decode_step_prefill_tokens and max_seqs: must be \
                 positive"
                    .into(),
            );
        }
        if let Some(seed) = &self.kv.hash_seed {
            parse_seed(seed)?;
        }
        if self.stalled_client_timeout_ms == 0 {
            return Err("stalled_client_timeout_ms: must be positive".into());
        }
        if self.auth.engine_token.as_deref() == Some("") {
            return Err("auth.engine_token (KVGATE_ENGINE_TOKEN): must not be empty".into());
        }
        let listen = self
            .listen
            .parse::<std::net::SocketAddr>()
            .map_err(|e| format!("listen: {e}"))?;
        // Without the token anyone who reaches the engine could pass as the gateway; only this
        // machine may, so that is the one place it may run open.
        if !listen.ip().is_loopback() && self.auth.engine_token.is_none() {
            return Err(format!(
                "auth.engine_token: required when listen ({listen}) is not a loopback address; \
                 set it in the file or in KVGATE_ENGINE_TOKEN, the same token the gateway sends"
            ));
        }
        Ok(())
    }

    /// See [`EngineConfig::stalled_client_timeout_ms`].
    pub fn stalled_client_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.stalled_client_timeout_ms)
    }

    /// The deployment seed (zeros when unset: fine for one machine, not for a fleet).
    pub fn seed(&self) -> [u8; 32] {
        self.kv
            .hash_seed
            .as_deref()
            .and_then(|s| parse_seed(s).ok())
            .unwrap_or([0; 32])
    }
}

/// Where the model runs (`device`): `cpu`, `cuda` (GPU 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Device, String> {
        let err = || format!("device {s:?}: expected cpu, cuda or cuda:N");
        match s.strip_prefix("cuda") {
            _ if s == "cpu" => Ok(Device::Cpu),
            Some("") => Ok(Device::Cuda(0)),
            Some(n) => n
                .strip_prefix(':')
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(err),
            None => Err(err()),
        }
    }
}

impl TryFrom<String> for Device {
    type Error = String;

    fn try_from(s: String) -> Result<Device, String> {
        s.parse()
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

fn parse_seed(s: &str) -> Result<[u8; 32], String> {
    kvgate_protocol::parse_hash_seed(s)
        .ok_or_else(|| "kv.hash_seed (KVGATE_HASH_SEED): expected 64 hex digits".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_errors_name_the_field() {
        let c = EngineConfig::parse("").unwrap();
        assert_eq!(c.kv.block_size, 16);
        assert_eq!(c.scheduler.preemption, PreemptMode::Recompute);
        assert_eq!(c.dtype, WeightDType::F32);
        for (name, want, quant) in [
            ("q8_0", WeightDType::Q8_0, Some(Quant::Q8_0)),
            ("q4_1", WeightDType::Q4_1, Some(Quant::Q4_1)),
            ("f16", WeightDType::F16, None),
        ] {
            let c = EngineConfig::parse(&format!("dtype = \"{name}\"")).unwrap();
            assert_eq!((c.dtype, c.dtype.quant()), (want, quant), "{name}");
        }
        // A decode step's prefill: a quarter-ish step on the CPU, the whole budget on a GPU.
        assert_eq!(c.scheduler.decode_step_prefill_tokens(Device::Cpu), 256);
        assert_eq!(
            c.scheduler.decode_step_prefill_tokens(Device::Cuda(0)),
            2048
        );
        let small = EngineConfig::parse("[scheduler]\nmax_batched_tokens = 100").unwrap();
        assert_eq!(small.scheduler.decode_step_prefill_tokens(Device::Cpu), 100);
        let set = EngineConfig::parse("[scheduler]\ndecode_step_prefill_tokens = 64").unwrap();
        assert_eq!(
            set.scheduler.decode_step_prefill_tokens(Device::Cuda(0)),
            64
        );
        for (text, field) in [
            (
                "[scheduler]\ndecode_step_prefill_tokens = 0",
                "decode_step_prefill_tokens",
            ),
            ("device = \"tpu\"", "expected cpu, cuda or cuda:N"),
            ("device = \"cuda:x\"", "expected cpu, cuda or cuda:N"),
            ("[kv]\nblock_size = 0", "kv.block_size"),
            (
                "[scheduler]\npreemption = \"drop\"",
                "expected `recompute` or `swap`",
            ),
            (
                "dtype = \"f8\"",
                "expected one of `f32`, `f16`, `bf16`, `q8_0`, `q4_1`",
            ),
            ("[kv]\nhash_seed = \"abc\"", "kv.hash_seed"),
            ("listen = \"nowhere\"", "listen"),
            ("bogus = 1", "bogus"),
            ("[sampling]\ntemperature = -1", "temperature"),
            ("[sampling]\ntop_p = 0", "top_p"),
            ("[sampling]\nseed = 3", "seed"),
        ] {
            let e = EngineConfig::parse(text).unwrap_err();
            assert!(e.contains(field), "{e} should name {field}");
        }
    }

    fn with_seed(seed: &str) -> Result<EngineConfig, String> {
        let mut c = EngineConfig::default();
        c.apply_env(|k| (k == "KVGATE_HASH_SEED").then(|| seed.to_owned()));
        c.validate().map(|()| c)
    }

    #[test]
    fn a_malformed_hash_seed_is_a_config_error() {
        let good = "0123456789abcdefABCDEF".repeat(3)[..64].to_owned();
        let c = with_seed(&good).unwrap();
        assert_eq!(c.seed()[..3], [0x01, 0x23, 0x45]);
        // 64 bytes, but a two-byte character straddles every digit pair after the first.
        let straddling = format!("a{}a", "é".repeat(31));
        assert_eq!(straddling.len(), 64);
        for bad in [
            straddling.as_str(),
            &"é".repeat(32),
            &"+f".repeat(32),
            &"0x".repeat(32),
            &"g".repeat(64),
            &"a".repeat(63),
        ] {
            let e = with_seed(bad).unwrap_err();
            assert!(e.contains("KVGATE_HASH_SEED"), "{e}");
        }
    }

    #[test]
    fn no_engine_token_only_on_loopback() {
        let open = |listen: &str| {
            let c = EngineConfig {
                listen: listen.into(),
                ..EngineConfig::default()
            };
            c.validate()
        };
        assert!(open("127.0.0.1:8081").is_ok());
        assert!(open("[::1]:8081").is_ok());
        for listen in ["0.0.0.0:8081", "[::]:8081", "10.0.0.5:8081"] {
            let e = open(listen).unwrap_err();
            assert!(
                e.contains("auth.engine_token") && e.contains("KVGATE_ENGINE_TOKEN"),
                "{e}"
            );
        }
        let mut c = EngineConfig {
            listen: "0.0.0.0:8081".into(),
            ..EngineConfig::default()
        };
        c.apply_env(|k| (k == "KVGATE_ENGINE_TOKEN").then(|| "secret".to_owned()));
        assert!(c.validate().is_ok());
        c.auth.engine_token = Some(String::new());
        assert!(c.validate().unwrap_err().contains("auth.engine_token"));
    }
}
