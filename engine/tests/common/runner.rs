//! Drives one model's forward pass position by position on any backend, with the engine's own KV
//! manager: prefill (whole or chunked, from the cached prefix on), decode with copy-on-write. The
//! logits of every computed row come back, for comparisons against a reference.

use kvgate_engine::kv::{test_manager, KvCacheManager, SeqId};
use kvgate_engine::model::{Batch, Llama, LoadOptions};
use kvgate_kernels::{AttnSeq, Backend, DType};
use std::path::Path;

pub struct Runner<B: Backend> {
    pub model: Llama<B>,
    pub kv: KvCacheManager,
    block_size: u32,
    vocab: usize,
}

impl<B: Backend> Runner<B> {
    /// The model in `dir` on `backend`, weights in `dtype`, a pool of `num_blocks` of `kv_dtype`.
    pub fn new(
        backend: B,
        dir: &Path,
        dtype: DType,
        kv_dtype: DType,
        num_blocks: u32,
        block_size: u32,
    ) -> Self {
        let model = Llama::load(
            backend,
            dir,
            LoadOptions {
                dtype,
                quant: None,
                kv_dtype,
                num_blocks: num_blocks as usize,
                num_host_blocks: 0,
                block_size: block_size as usize,
            },
        )
        .unwrap();
        let vocab = model.config().vocab_size;
        Runner {
            model,
            kv: test_manager(num_blocks, 0, block_size),
            block_size,
            vocab,
        }
    }

    /// Runs `chunk` (positions `start..`) of `seq`, whose slots are allocated; logits of every row.
    pub fn run(&mut self, seq: SeqId, chunk: &[u32], start: usize) -> Vec<Vec<f32>> {
        let rows: Vec<u32> = (0..chunk.len() as u32).collect();
        self.run_rows(seq, chunk, start, &rows)
    }

    /// As [`Runner::run`], with the logits of `rows` (of the chunk) only.
    pub fn run_rows(
        &mut self,
        seq: SeqId,
        chunk: &[u32],
        start: usize,
        rows: &[u32],
    ) -> Vec<Vec<f32>> {
        let bs = self.block_size as usize;
        let table = self.kv.block_table(seq).unwrap();
        let blocks: Vec<u32> = table.blocks().iter().map(|b| b.0).collect();
        let positions: Vec<u32> = (start..start + chunk.len()).map(|p| p as u32).collect();
        let slots: Vec<u32> = positions
            .iter()
            .map(|&p| table.slot(p as usize, bs) as u32)
            .collect();
        let seqs = [AttnSeq {
            query_start: 0,
            query_len: chunk.len(),
            context_len: start + chunk.len(),
            block_table: &blocks,
        }];
        let flat = self.model.forward(&Batch {
            tokens: chunk,
            positions: &positions,
            slots: &slots,
            seqs: &seqs,
            logits_rows: rows,
        });
        flat.chunks(self.vocab).map(<[f32]>::to_vec).collect()
    }

    /// Starts `seq` with `prompt`, computing all of it but the cached prefix in `chunks` pieces.
    pub fn prefill(&mut self, seq: SeqId, prompt: &[u32], chunks: usize) -> (usize, Vec<Vec<f32>>) {
        let scope = self.kv.scope("t");
        let hashed = self.kv.hash_prompt(scope, prompt);
        let cached = self.kv.start_sequence(seq, &hashed).unwrap();
        let rest = &prompt[cached..];
        let size = rest.len().div_ceil(chunks).max(1);
        let mut out = Vec::new();
        let mut pos = cached;
        for chunk in rest.chunks(size) {
            self.kv.append_slots(seq, chunk).unwrap();
            out.extend(self.run(seq, chunk, pos));
            pos += chunk.len();
        }
        (cached, out)
    }

    /// Appends `token` at `pos` (copying a shared block first) and returns its logits.
    pub fn decode(&mut self, seq: SeqId, token: u32, pos: usize) -> Vec<f32> {
        self.decode_batch(&[(seq, token, pos)]).remove(0)
    }

    /// One decode step of several sequences in one batch, `(seq, token, position)` each (copying
    /// shared blocks first); their logits, in order.
    pub fn decode_batch(&mut self, steps: &[(SeqId, u32, usize)]) -> Vec<Vec<f32>> {
        let bs = self.block_size as usize;
        let mut tables = Vec::with_capacity(steps.len());
        let mut slots = Vec::with_capacity(steps.len());
        for &(seq, token, pos) in steps {
            let out = self.kv.append_slots(seq, &[token]).unwrap();
            if let Some((src, dst)) = out.cow {
                self.model.copy_blocks(&[(src.0, dst.0)]);
            }
            let table = self.kv.block_table(seq).unwrap();
            slots.push(table.slot(pos, bs) as u32);
            tables.push(table.blocks().iter().map(|b| b.0).collect::<Vec<u32>>());
        }
        let seqs: Vec<AttnSeq<'_>> = tables
            .iter()
            .zip(steps)
            .enumerate()
            .map(|(i, (t, &(_, _, pos)))| AttnSeq {
                query_start: i,
                query_len: 1,
                context_len: pos + 1,
                block_table: t,
            })
            .collect();
        let tokens: Vec<u32> = steps.iter().map(|s| s.1).collect();
        let positions: Vec<u32> = steps.iter().map(|s| s.2 as u32).collect();
        let rows: Vec<u32> = (0..steps.len() as u32).collect();
        let flat = self.model.forward(&Batch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            seqs: &seqs,
            logits_rows: &rows,
        });
        flat.chunks(self.vocab).map(<[f32]>::to_vec).collect()
    }
}
