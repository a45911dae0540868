//! The Llama-family forward pass (Llama 2/3, Qwen2, Mistral, SmolLM) over a [`Backend`], reading
//! and writing the paged KV cache through the block manager's slots and block tables.
//!
//! Per layer: RMSNorm -> Q, K, V projections (+ bias for Qwen2) -> RoPE -> write K/V of the new
//! tokens into their slots -> paged attention over each sequence's blocks -> output projection ->
//! residual -> RMSNorm -> gate|up projection -> SiLU-and-multiply -> down projection -> residual.
//! Every sequence's new K/V rows are written before any attention of that layer runs, so a
//! sequence may attend to blocks another sequence of the same batch fills in this very step.
//!
//! Cost per step: one pass over every weight (matmuls of `tokens x hidden`), plus attention over
//! each sequence's context.

use super::config::ModelConfig;
use super::weights::Safetensors;
use super::ModelError;
use kvgate_kernels::{
    AttnSeq, AttnShape, Backend, DType, Llama3RopeScaling, Quant, RopeConfig, WeightData,
};
use std::path::Path;

struct Layer<B: Backend> {
    input_norm: B::Weight,
    q: B::Weight,
    k: B::Weight,
    v: B::Weight,
    qkv_bias: Option<[B::Weight; 3]>,
    o: B::Weight,
    post_norm: B::Weight,
    /// Gate and up projections stacked: `[2 * ffn, hidden]`.
    gate_up: B::Weight,
    down: B::Weight,
}

/// Activation buffers, reused across steps.
struct Scratch<B: Backend> {
    x: B::Tensor,
    h: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    attn: B::Tensor,
    proj: B::Tensor,
    gate_up: B::Tensor,
    act: B::Tensor,
    last: B::Tensor,
    logits: B::Tensor,
}

/// One forward step's inputs: the new tokens of every scheduled sequence, concatenated.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    pub tokens: &'a [u32],
    /// Position of each token in its sequence.
    pub positions: &'a [u32],
    /// KV slot of each token (from the block table).
    pub slots: &'a [u32],
    pub seqs: &'a [AttnSeq<'a>],
    /// Rows of `tokens` whose logits are wanted (usually each sequence's last).
    pub logits_rows: &'a [u32],
}

/// A loaded model with its paged KV cache.
pub struct Llama<B: Backend> {
    backend: B,
    config: ModelConfig,
    dtype: DType,
    embed: B::Weight,
    lm_head: Option<B::Weight>,
    norm: B::Weight,
    layers: Vec<Layer<B>>,
    rope: B::Rope,
    k_cache: Vec<B::Cache>,
    v_cache: Vec<B::Cache>,
    /// Host (swap) pools, one K and one V per layer.
    k_host: Vec<B::Cache>,
    v_host: Vec<B::Cache>,
    shape: AttnShape,
    kv_dtype: DType,
    scratch: Scratch<B>,
}

impl<B: Backend> std::fmt::Debug for Llama<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("backend", &self.backend)
            .field("config", &self.config)
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

/// Read access to a model's KV pools, device and host, every layer.
pub struct Blocks<'a, B: Backend> {
    backend: &'a B,
    device: (&'a [B::Cache], &'a [B::Cache]),
    host: (&'a [B::Cache], &'a [B::Cache]),
    block_bytes: usize,
}

impl<B: Backend> std::fmt::Debug for Blocks<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blocks")
            .field("block_bytes", &self.block_bytes)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Blocks<'_, B> {
    /// Every layer's K then V of one block, as bytes: of host block `id` when `host`, else of
    /// device block `id`.
    pub fn read(&self, host: bool, id: u32) -> Vec<u8> {
        let (k, v) = if host { self.host } else { self.device };
        let mut out = Vec::with_capacity(self.block_bytes);
        for cache in k.iter().chain(v.iter()) {
            self.backend.read_block(cache, id, &mut out);
        }
        out
    }
}

/// How to load a model.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Storage type of the weights in memory.
    pub dtype: DType,
    /// Block-quantized matrices instead: the projections in this format, the embedding table
    /// (and an untied output head) in Q8_0, as llama.cpp's files ship them. Tensors stored
    /// quantized in that format are kept as they are; others are quantized at load.
    pub quant: Option<Quant>,
    /// Storage type of the KV cache.
    pub kv_dtype: DType,
    /// Device KV blocks.
    pub num_blocks: usize,
    /// Host blocks: for swapped-out sequences, then for the host tier of the prefix cache.
    pub num_host_blocks: usize,
    pub block_size: usize,
}

impl<B: Backend> Llama<B> {
    /// Loads `dir` (config.json + safetensors) onto `backend`.
    pub fn load(backend: B, dir: &Path, opts: LoadOptions) -> Result<Self, ModelError> {
        let config = ModelConfig::load(dir)?;
        let st = Safetensors::open(dir)?;
        let c = &config;
        let (hd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        // The projections' and the embedding table's format.
        let (proj, table) = match opts.quant {
            Some(q) => (Format::Quant(q), Format::Quant(Quant::Q8_0)),
            None => (Format::Dense(opts.dtype), Format::Dense(opts.dtype)),
        };
        let load_as = |name: &str, format: Format| match format {
            Format::Dense(dtype) => st.load(name, dtype),
            Format::Quant(q) => st.load_quantized(name, q),
        };
        let load = |name: &str, shape: &[usize], format: Format| -> Result<B::Weight, ModelError> {
            let (data, got) = load_as(name, format)?;
            if got != shape {
                return Err(ModelError::Shape {
                    name: name.to_owned(),
                    got,
                    want: shape.to_vec(),
                });
            }
            let (rows, cols) = match *shape {
                [n] => (1, n),
                [r, c] => (r, c),
                _ => unreachable!("weights are vectors or matrices"),
            };
            Ok(backend.weight(data, rows, cols))
        };
        let h = c.hidden_size;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let qkv_bias = if c.attention_bias {
                Some([
                    load(&format!("{p}.self_attn.q_proj.bias"), &[hd], F32)?,
                    load(&format!("{p}.self_attn.k_proj.bias"), &[kvd], F32)?,
                    load(&format!("{p}.self_attn.v_proj.bias"), &[kvd], F32)?,
                ])
            } else {
                None
            };
            let gate_up = stack_rows(
                load_as(&format!("{p}.mlp.gate_proj.weight"), proj)?,
                load_as(&format!("{p}.mlp.up_proj.weight"), proj)?,
                &[c.intermediate_size, h],
                &p,
            )?;
            layers.push(Layer {
                input_norm: load(&format!("{p}.input_layernorm.weight"), &[h], F32)?,
                q: load(&format!("{p}.self_attn.q_proj.weight"), &[hd, h], proj)?,
                k: load(&format!("{p}.self_attn.k_proj.weight"), &[kvd, h], proj)?,
                v: load(&format!("{p}.self_attn.v_proj.weight"), &[kvd, h], proj)?,
                qkv_bias,
                o: load(&format!("{p}.self_attn.o_proj.weight"), &[h, hd], proj)?,
                post_norm: load(&format!("{p}.post_attention_layernorm.weight"), &[h], F32)?,
                gate_up: backend.weight(gate_up, 2 * c.intermediate_size, h),
                down: load(
                    &format!("{p}.mlp.down_proj.weight"),
                    &[h, c.intermediate_size],
                    proj,
                )?,
            });
        }
        let embed = load("model.embed_tokens.weight", &[c.vocab_size, h], table)?;
        let lm_head = if c.tie_word_embeddings || !st.contains("lm_head.weight") {
            None
        } else {
            Some(load("lm_head.weight", &[c.vocab_size, h], table)?)
        };
        let norm = load("model.norm.weight", &[h], F32)?;
        let rope = backend.rope(&RopeConfig {
            theta: c.rope_theta,
            head_dim: c.head_dim,
            max_positions: c.max_position_embeddings,
            llama3_scaling: c.rope_llama3.map(|s| Llama3RopeScaling {
                factor: s.factor,
                low_freq_factor: s.low_freq_factor,
                high_freq_factor: s.high_freq_factor,
                original_max_position_embeddings: s.original_max_position_embeddings,
            }),
        });
        let shape = AttnShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: opts.block_size,
        };
        let k_cache = (0..c.num_layers)
            .map(|_| backend.cache(opts.num_blocks, shape, opts.kv_dtype))
            .collect();
        let v_cache = (0..c.num_layers)
            .map(|_| backend.cache(opts.num_blocks, shape, opts.kv_dtype))
            .collect();
        let host = |_| backend.host_cache(opts.num_host_blocks, shape, opts.kv_dtype);
        let k_host = (0..c.num_layers).map(host).collect();
        let v_host = (0..c.num_layers).map(host).collect();
        let scratch = Scratch {
            x: backend.tensor(0, h),
            h: backend.tensor(0, h),
            q: backend.tensor(0, hd),
            k: backend.tensor(0, kvd),
            v: backend.tensor(0, kvd),
            attn: backend.tensor(0, hd),
            proj: backend.tensor(0, h),
            gate_up: backend.tensor(0, 2 * c.intermediate_size),
            act: backend.tensor(0, c.intermediate_size),
            last: backend.tensor(0, h),
            logits: backend.tensor(0, c.vocab_size),
        };
        Ok(Llama {
            backend,
            dtype: opts.dtype,
            embed,
            lm_head,
            norm,
            layers,
            rope,
            k_cache,
            v_cache,
            k_host,
            v_host,
            shape,
            kv_dtype: opts.kv_dtype,
            scratch,
            config,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Runs one step and returns the logits of `batch.logits_rows`, row-major (`rows x vocab`).
    pub fn forward(&mut self, batch: &Batch<'_>) -> Vec<f32> {
        self.forward_with(batch, &mut |_| {})
    }

    /// [`Self::forward`], calling `between_layers` after each layer with read access to the KV
    /// pools: blocks this step does not write (`batch.slots`) may be read there, while the
    /// step is in progress.
    pub fn forward_with(
        &mut self,
        batch: &Batch<'_>,
        between_layers: &mut dyn FnMut(&Blocks<'_, B>),
    ) -> Vec<f32> {
        let n = batch.tokens.len();
        let block_bytes = self.kv_block_bytes();
        let b = &self.backend;
        let s = &mut self.scratch;
        for t in [
            &mut s.x,
            &mut s.h,
            &mut s.q,
            &mut s.k,
            &mut s.v,
            &mut s.attn,
            &mut s.proj,
        ] {
            b.resize_rows(t, n);
        }
        b.resize_rows(&mut s.gate_up, n);
        b.resize_rows(&mut s.act, n);
        let scale = 1.0 / (self.shape.head_dim as f32).sqrt();
        let eps = self.config.rms_norm_eps;
        b.embedding(&self.embed, batch.tokens, &mut s.x);
        for (i, layer) in self.layers.iter().enumerate() {
            b.rms_norm(&s.x, &layer.input_norm, eps, &mut s.h);
            let bias = layer.qkv_bias.as_ref();
            b.matmul(&s.h, &layer.q, bias.map(|x| &x[0]), &mut s.q);
            b.matmul(&s.h, &layer.k, bias.map(|x| &x[1]), &mut s.k);
            b.matmul(&s.h, &layer.v, bias.map(|x| &x[2]), &mut s.v);
            b.apply_rope(&self.rope, &mut s.q, batch.positions);
            b.apply_rope(&self.rope, &mut s.k, batch.positions);
            b.reshape_and_cache(
                &s.k,
                &s.v,
                &mut self.k_cache[i],
                &mut self.v_cache[i],
                batch.slots,
            );
            b.paged_attention(
                &s.q,
                &self.k_cache[i],
                &self.v_cache[i],
                batch.seqs,
                scale,
                &mut s.attn,
            );
            b.matmul(&s.attn, &layer.o, None, &mut s.proj);
            b.add_assign(&mut s.x, &s.proj);
            b.rms_norm(&s.x, &layer.post_norm, eps, &mut s.h);
            b.matmul(&s.h, &layer.gate_up, None, &mut s.gate_up);
            b.silu_mul(&s.gate_up, &mut s.act);
            b.matmul(&s.act, &layer.down, None, &mut s.proj);
            b.add_assign(&mut s.x, &s.proj);
            between_layers(&Blocks {
                backend: b,
                device: (&self.k_cache, &self.v_cache),
                host: (&self.k_host, &self.v_host),
                block_bytes,
            });
        }
        let rows = batch.logits_rows.len();
        b.resize_rows(&mut s.last, rows);
        b.resize_rows(&mut s.logits, rows);
        b.gather_rows(&s.x, batch.logits_rows, &mut s.h);
        b.rms_norm(&s.h, &self.norm, eps, &mut s.last);
        b.matmul(
            &s.last,
            self.lm_head.as_ref().unwrap_or(&self.embed),
            None,
            &mut s.logits,
        );
        b.download(&s.logits)
    }

    /// Copy-on-write copies of one step, in every layer.
    pub fn copy_blocks(&mut self, pairs: &[(u32, u32)]) {
        if pairs.is_empty() {
            return;
        }
        // Every layer's K and V at once (one launch on a GPU).
        let mut caches: Vec<&mut B::Cache> = self
            .k_cache
            .iter_mut()
            .chain(self.v_cache.iter_mut())
            .collect();
        self.backend.copy_blocks_many(&mut caches, pairs);
    }
}

impl<B: Backend> Llama<B> {
    /// Copies device blocks to host blocks (`(device, host)` pairs), every layer.
    pub fn swap_out(&mut self, pairs: &[(u32, u32)]) {
        if pairs.is_empty() {
            return;
        }
        for (dev, host) in self.k_cache.iter().zip(self.k_host.iter_mut()) {
            self.backend.transfer_blocks(dev, host, pairs);
        }
        for (dev, host) in self.v_cache.iter().zip(self.v_host.iter_mut()) {
            self.backend.transfer_blocks(dev, host, pairs);
        }
    }

    /// Bytes of one block across every layer's K and V.
    pub fn kv_block_bytes(&self) -> usize {
        let c = self.config();
        2 * c.num_layers
            * c.num_kv_heads
            * c.head_dim
            * self.shape.block_size
            * self.kv_dtype.size_bytes()
    }

    /// Read access to the KV pools.
    pub fn blocks(&self) -> Blocks<'_, B> {
        Blocks {
            backend: &self.backend,
            device: (&self.k_cache, &self.v_cache),
            host: (&self.k_host, &self.v_host),
            block_bytes: self.kv_block_bytes(),
        }
    }

    /// Every layer's K then V of one block, as bytes: of host block `id` when `host`, else of
    /// device block `id`.
    pub fn read_block(&self, host: bool, id: u32) -> Vec<u8> {
        self.blocks().read(host, id)
    }

    /// Overwrites host block `id` with bytes from [`Self::read_block`]. False (nothing written)
    /// when they are not one block's worth.
    pub fn write_host_block(&mut self, id: u32, bytes: &[u8]) -> bool {
        let n = self.k_host.len() + self.v_host.len();
        if n == 0 || bytes.len() != self.kv_block_bytes() {
            return false;
        }
        let per = bytes.len() / n;
        for (cache, chunk) in self
            .k_host
            .iter_mut()
            .chain(self.v_host.iter_mut())
            .zip(bytes.chunks_exact(per))
        {
            self.backend.write_block(cache, id, chunk);
        }
        true
    }

    /// Copies host blocks back to device blocks (`(host, device)` pairs), every layer.
    pub fn swap_in(&mut self, pairs: &[(u32, u32)]) {
        if pairs.is_empty() {
            return;
        }
        for (host, dev) in self.k_host.iter().zip(self.k_cache.iter_mut()) {
            self.backend.transfer_blocks(host, dev, pairs);
        }
        for (host, dev) in self.v_host.iter().zip(self.v_cache.iter_mut()) {
            self.backend.transfer_blocks(host, dev, pairs);
        }
    }
}

/// How one tensor is held in memory.
#[derive(Debug, Clone, Copy)]
enum Format {
    Dense(DType),
    Quant(Quant),
}

/// Norms and biases: always f32.
const F32: Format = Format::Dense(DType::F32);

/// `[a; b]` for two weights of `shape` each (gate and up stacked into one matmul).
fn stack_rows(
    a: (WeightData, Vec<usize>),
    b: (WeightData, Vec<usize>),
    shape: &[usize],
    layer: &str,
) -> Result<WeightData, ModelError> {
    for (which, got) in [("gate_proj", &a.1), ("up_proj", &b.1)] {
        if got != shape {
            return Err(ModelError::Shape {
                name: format!("{layer}.mlp.{which}.weight"),
                got: got.clone(),
                want: shape.to_vec(),
            });
        }
    }
    Ok(match (a.0, b.0) {
        (WeightData::F32(mut x), WeightData::F32(y)) => {
            x.extend(y);
            WeightData::F32(x)
        }
        (WeightData::F16(mut x), WeightData::F16(y)) => {
            x.extend(y);
            WeightData::F16(x)
        }
        (WeightData::BF16(mut x), WeightData::BF16(y)) => {
            x.extend(y);
            WeightData::BF16(x)
        }
        (WeightData::Q8_0(mut x), WeightData::Q8_0(y)) => {
            x.extend(y);
            WeightData::Q8_0(x)
        }
        (WeightData::Q4_1(mut x), WeightData::Q4_1(y)) => {
            x.extend(y);
            WeightData::Q4_1(x)
        }
        _ => unreachable!("both loaded in the same dtype"),
    })
}
