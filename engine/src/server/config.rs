//! `engine.toml`: what one engine instance serves and how, parsed once into typed structs.
//! Errors name the field. `KVGATE_ENGINE_TOKEN`, `KVGATE_OPERATOR_TOKEN` and `KVGATE_HASH_SEED` in
//! the environment override the file.
//!
//! ```toml
//! listen = "127.0.0.1:8081"
//! model = "/models/smollm2-135m-instruct"   # omit: the default model, fetched on first use
//! model_id = "smollm2-135m-instruct"        # the name clients send; default: the directory's
//! device = "cpu"                            # or "cuda" / "cuda:N" (builds with --features cuda)
//! dtype = "f32"                             # weights in memory: f32, f16, bf16
//! [kv]
//! blocks = 4096                             # or: bytes = 1073741824
//! gpu_memory_fraction = 0.9                 # cuda, neither blocks nor bytes set: the KV pool
//!                                           # takes this share of free GPU memory left after
//!                                           # weights and activations
//! block_size = 16
//! host_blocks = 1024                        # swap space
//! hash_seed = "<64 hex digits>"             # deployment secret, the same on every engine
//! [scheduler]
//! max_batched_tokens = 2048
//! max_seqs = 64
//! preemption = "recompute"                  # or "swap"
//! [auth]
//! engine_token = "..."                      # required from the gateway on /v1/* and /kv/events
//! operator_token = "..."                    # required on /admin/*
//! ```

use serde::Deserialize;
use std::path::PathBuf;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    #[serde(default = "default_listen")]
    pub listen: String,
    #[serde(default)]
    pub model: Option<PathBuf>,
    #[serde(default)]
    pub model_id: Option<String>,
    #[serde(default = "default_device")]
    pub device: String,
    #[serde(default = "default_dtype")]
    pub dtype: String,
    #[serde(default)]
    pub kv: KvSection,
    #[serde(default)]
    pub scheduler: SchedulerSection,
    #[serde(default)]
    pub auth: AuthSection,
    /// Largest request body, in bytes.
    #[serde(default = "default_body_limit")]
    pub max_body_bytes: usize,
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
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerSection {
    #[serde(default = "default_batched_tokens")]
    pub max_batched_tokens: usize,
    #[serde(default = "default_max_seqs")]
    pub max_seqs: usize,
    #[serde(default = "default_preemption")]
    pub preemption: String,
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
fn default_device() -> String {
    "cpu".into()
}
fn default_dtype() -> String {
    "f32".into()
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
fn default_preemption() -> String {
    "recompute".into()
}
fn default_body_limit() -> usize {
    4 << 20
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
        }
    }
}

impl Default for SchedulerSection {
    fn default() -> Self {
        SchedulerSection {
            max_batched_tokens: default_batched_tokens(),
            max_seqs: default_max_seqs(),
            preemption: default_preemption(),
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
        if self.device != "cpu" && cuda_ordinal(&self.device).is_none() {
            let built = if cfg!(feature = "cuda") {
                "cpu, cuda, cuda:N"
            } else {
                "cpu; cuda needs --features cuda"
            };
            return Err(format!(
                "device: {:?} is not available in this build ({built})",
                self.device
            ));
        }
        if !(self.kv.gpu_memory_fraction > 0.0 && self.kv.gpu_memory_fraction <= 1.0) {
            return Err("kv.gpu_memory_fraction: must be in (0, 1]".into());
        }
        if !["f32", "f16", "bf16"].contains(&self.dtype.as_str()) {
            return Err(format!(
                "dtype: {:?} (expected f32, f16 or bf16)",
                self.dtype
            ));
        }
        if !(1..=256).contains(&self.kv.block_size) {
            return Err("kv.block_size: must be 1 to 256".into());
        }
        if self.kv.blocks == Some(0) || self.kv.bytes == Some(0) {
            return Err("kv.blocks / kv.bytes: must be positive".into());
        }
        if self.scheduler.max_batched_tokens == 0 || self.scheduler.max_seqs == 0 {
            return Err("scheduler.max_batched_tokens and max_seqs: must be positive".into());
        }
        if !["recompute", "swap"].contains(&self.scheduler.preemption.as_str()) {
            return Err(format!(
                "scheduler.preemption: {:?} (expected recompute or swap)",
                self.scheduler.preemption
            ));
        }
        if let Some(seed) = &self.kv.hash_seed {
            parse_seed(seed)?;
        }
        self.listen
            .parse::<std::net::SocketAddr>()
            .map_err(|e| format!("listen: {e}"))?;
        Ok(())
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

/// The GPU ordinal of a `cuda` / `cuda:N` device, in a build with the `cuda` feature.
pub fn cuda_ordinal(device: &str) -> Option<usize> {
    if !cfg!(feature = "cuda") {
        return None;
    }
    match device.strip_prefix("cuda")? {
        "" => Some(0),
        n => n.strip_prefix(':')?.parse().ok(),
    }
}

fn parse_seed(s: &str) -> Result<[u8; 32], String> {
    let err = || "kv.hash_seed: expected 64 hex digits".to_owned();
    if s.len() != 64 {
        return Err(err());
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| err())?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_errors_name_the_field() {
        let c = EngineConfig::parse("").unwrap();
        assert_eq!(c.kv.block_size, 16);
        assert_eq!(c.scheduler.preemption, "recompute");
        for (text, field) in [
            ("device = \"tpu\"", "device"),
            ("[kv]\nblock_size = 0", "kv.block_size"),
            ("[scheduler]\npreemption = \"drop\"", "scheduler.preemption"),
            ("[kv]\nhash_seed = \"abc\"", "kv.hash_seed"),
            ("listen = \"nowhere\"", "listen"),
            ("bogus = 1", "bogus"),
        ] {
            let e = EngineConfig::parse(text).unwrap_err();
            assert!(e.contains(field), "{e} should name {field}");
        }
    }
}
