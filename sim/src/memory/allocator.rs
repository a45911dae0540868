//! The allocation policies the simulator compares, behind one trait.
//!
//! - [`Paged`]: kvgate's own [`KvCacheManager`] (blocks on demand, prefix sharing).
//! - [`Contiguous`]: one contiguous reservation per request, sized by policy: the model's maximum
//!   length, the next power of two of the final length, or exactly the final length (an oracle),
//!   placed first-fit, by a binary buddy allocator, or with no fragmentation at all (a bound).

use super::buddy::Buddy;
use super::first_fit::FirstFit;
use super::workload::Request;
use kvgate_engine::kv::{test_manager, HashedPrompt, KvCacheManager, ScopeId, SeqId};
use std::collections::HashMap;

/// A memory policy. Slots are token positions of KV memory.
pub trait Allocator {
    /// Admits request `id` (`req`), whose first `slots` tokens need KV now.
    fn admit(&mut self, id: usize, req: &Request, slots: usize) -> bool;
    /// Gives running request `id` one more slot (its `slots`-th).
    fn grow(&mut self, id: usize, req: &Request, slots: usize) -> bool;
    /// Frees everything `id` holds.
    fn release(&mut self, id: usize);
    /// Slots reserved or allocated now.
    fn reserved_slots(&self) -> usize;
    /// Physical slots holding real tokens, when the policy shares memory (else the runner counts
    /// each request's tokens).
    fn filled_slots(&self) -> Option<usize>;
    /// Blocks that sharing saves right now (logical minus physical).
    fn blocks_saved(&self) -> usize;
}

/// How a contiguous policy sizes its reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserve {
    /// The model's maximum length.
    MaxLen(usize),
    /// The next power of two of prompt + output.
    Pow2,
    /// Exactly prompt + output (an oracle that knows the output length).
    Exact,
}

/// Where contiguous reservations are placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Anywhere there are enough free slots in total (no external fragmentation: a bound).
    Ideal,
    /// The lowest free extent that fits.
    FirstFit,
    /// A binary buddy allocator (sizes round up to a power of two).
    Buddy,
}

#[derive(Debug)]
enum Placer {
    Ideal,
    FirstFit(FirstFit),
    Buddy(Buddy),
}

/// One contiguous reservation per request.
#[derive(Debug)]
pub struct Contiguous {
    reserve: Reserve,
    placer: Placer,
    free: usize,
    reserved: usize,
    held: HashMap<usize, (usize, usize)>,
}

impl Contiguous {
    pub fn new(reserve: Reserve, budget: usize, placement: Placement) -> Self {
        Contiguous {
            reserve,
            placer: match placement {
                Placement::Ideal => Placer::Ideal,
                Placement::FirstFit => Placer::FirstFit(FirstFit::new(budget)),
                Placement::Buddy => Placer::Buddy(Buddy::new(budget)),
            },
            free: budget,
            reserved: 0,
            held: HashMap::new(),
        }
    }

    fn size(&self, req: &Request) -> usize {
        let len = req.prompt_len + req.output_len;
        match self.reserve {
            Reserve::MaxLen(max) => max.max(len),
            Reserve::Pow2 => len.next_power_of_two(),
            Reserve::Exact => len,
        }
    }
}

impl Allocator for Contiguous {
    fn admit(&mut self, id: usize, req: &Request, _slots: usize) -> bool {
        let size = self.size(req);
        let placed = match &mut self.placer {
            Placer::Buddy(b) => b.alloc(size).map(|off| (off, Buddy::rounded(size))),
            Placer::FirstFit(f) => f.alloc(size).map(|off| (off, size)),
            Placer::Ideal => (size <= self.free).then_some((0, size)),
        };
        let Some((offset, taken)) = placed else {
            return false;
        };
        self.free -= taken;
        self.reserved += taken;
        self.held.insert(id, (offset, size));
        true
    }

    fn grow(&mut self, _id: usize, _req: &Request, _slots: usize) -> bool {
        true // the reservation already covers the final length
    }

    fn release(&mut self, id: usize) {
        let Some((offset, size)) = self.held.remove(&id) else {
            return;
        };
        let taken = match &mut self.placer {
            Placer::Buddy(b) => {
                b.free(offset, size);
                Buddy::rounded(size)
            }
            Placer::FirstFit(f) => {
                f.free(offset, size);
                size
            }
            Placer::Ideal => size,
        };
        self.free += taken;
        self.reserved -= taken;
    }

    fn reserved_slots(&self) -> usize {
        self.reserved
    }

    fn filled_slots(&self) -> Option<usize> {
        None
    }

    fn blocks_saved(&self) -> usize {
        0
    }
}

/// kvgate's block manager. Token ids are synthetic but deterministic: a request's tokens are its
/// tenant's system prompt (shared) followed by tokens unique to the request.
#[derive(Debug)]
pub struct Paged {
    kv: KvCacheManager,
    scopes: Vec<ScopeId>,
    logical_blocks: usize,
    held: HashMap<usize, usize>,
}

fn mix(a: u64, b: u64) -> u32 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_add(0x632B_E59B_D9B4_E019);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (x ^ (x >> 29)) as u32
}

/// Token `pos` of request `id`.
fn token(id: usize, req: &Request, pos: usize) -> u32 {
    match req.prefix {
        Some((tenant, len)) if pos < len => mix(tenant as u64 | 1 << 40, pos as u64),
        _ => mix(id as u64, pos as u64),
    }
}

impl Paged {
    pub fn new(budget_tokens: usize, block_size: u32, tenants: usize) -> Self {
        let num_blocks = (budget_tokens / block_size as usize) as u32;
        let mut kv = test_manager(num_blocks, 0, block_size);
        let scopes = (0..tenants.max(1))
            .map(|t| kv.scope(&format!("tenant-{t}")))
            .collect();
        Paged {
            kv,
            scopes,
            logical_blocks: 0,
            held: HashMap::new(),
        }
    }

    fn blocks_of(&self, slots: usize) -> usize {
        slots.div_ceil(self.kv.block_size())
    }

    fn prompt(&self, id: usize, req: &Request, slots: usize) -> (HashedPrompt, Vec<u32>) {
        let tokens: Vec<u32> = (0..slots).map(|p| token(id, req, p)).collect();
        // Each tenant has its own cache scope; requests without a system prompt share scope 0.
        let scope = self.scopes[req.prefix.map_or(0, |(t, _)| t) % self.scopes.len()];
        (self.kv.hash_prompt(scope, &tokens), tokens)
    }
}

impl Allocator for Paged {
    fn admit(&mut self, id: usize, req: &Request, slots: usize) -> bool {
        let (prompt, tokens) = self.prompt(id, req, slots);
        // Only running out of blocks can refuse a prompt here; the runner frees every request.
        if self
            .kv
            .allocate_prompt(SeqId(id as u64), &prompt, &tokens)
            .is_err()
        {
            return false;
        }
        self.logical_blocks += self.blocks_of(slots);
        self.held.insert(id, slots);
        true
    }

    fn grow(&mut self, id: usize, req: &Request, slots: usize) -> bool {
        let t = token(id, req, slots - 1);
        if self.kv.append_slots(SeqId(id as u64), &[t]).is_err() {
            return false;
        }
        self.logical_blocks += self.blocks_of(slots) - self.blocks_of(slots - 1);
        self.held.insert(id, slots);
        true
    }

    fn release(&mut self, id: usize) {
        if let Some(slots) = self.held.remove(&id) {
            self.logical_blocks -= self.blocks_of(slots);
            let _ = self.kv.free(SeqId(id as u64));
        }
    }

    fn reserved_slots(&self) -> usize {
        self.kv.usage().used * self.kv.block_size()
    }

    fn filled_slots(&self) -> Option<usize> {
        Some(self.kv.usage().filled_slots)
    }

    fn blocks_saved(&self) -> usize {
        self.logical_blocks - self.kv.usage().used
    }
}
