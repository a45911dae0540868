//! The simulation loop: continuous batching at iteration granularity over one allocator.
//!
//! Each step, every running request first gets the slot for its next token, oldest first; when
//! the allocator refuses, the latest-arrived running request is preempted by recompute (it frees
//! everything and rejoins the head of the queue, keeping the tokens it generated). Then waiting
//! requests are admitted in arrival order while their prompt (plus tokens generated before a
//! preemption) fits; a prefill yields the first token in the same step. Requests finish when they
//! have all their output tokens.
//!
//! Statistics are time-weighted over the saturated window: the steps at whose end a request is
//! still waiting, so memory, not arrivals, is what limits the batch.

use super::allocator::Allocator;
use super::workload::Request;
use std::collections::VecDeque;

/// What one policy achieved on one workload.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PolicyStats {
    pub name: String,
    /// Real tokens over slots reserved or allocated.
    pub useful_fraction: f64,
    /// Real tokens over the whole budget.
    pub pool_fraction: f64,
    pub mean_concurrent: f64,
    pub peak_concurrent: usize,
    pub preemptions_per_request: f64,
    /// Mean blocks that prefix sharing saved (logical minus physical blocks).
    pub blocks_saved_by_sharing: f64,
    pub saturated_steps: u64,
    pub total_steps: u64,
    pub completed: usize,
    /// Requests that could never fit, even alone.
    pub rejected: usize,
}

#[derive(Debug, Clone, Copy, Default)]
struct Live {
    generated: usize,
}

#[derive(Debug, Default)]
struct Sums {
    real: f64,
    reserved: f64,
    running: f64,
    saved: f64,
    steps: u64,
}

/// Replays `reqs` (sorted by arrival) against `alloc` with `budget` slots.
pub fn simulate(
    name: &str,
    alloc: &mut dyn Allocator,
    reqs: &[Request],
    budget: usize,
) -> PolicyStats {
    let mut live = vec![Live::default(); reqs.len()];
    let mut waiting: VecDeque<usize> = VecDeque::new();
    let mut running: Vec<usize> = Vec::new();
    let (mut next, mut step, mut done, mut rejected, mut preemptions) = (0, 0u64, 0, 0, 0u64);
    let mut sums = Sums::default();
    let mut peak = 0;
    let slots = |r: &Request, l: &Live| r.prompt_len + l.generated.saturating_sub(1);
    while done + rejected < reqs.len() {
        while next < reqs.len() && reqs[next].arrival <= step {
            waiting.push_back(next);
            next += 1;
        }
        // Decode: one new slot per running request, oldest first; preempt the newest on refusal.
        let mut i = 0;
        while i < running.len() {
            let id = running[i];
            let want = slots(&reqs[id], &live[id]) + 1;
            if alloc.grow(id, &reqs[id], want) {
                live[id].generated += 1;
                i += 1;
                continue;
            }
            let victim = running.pop().unwrap_or(id);
            alloc.release(victim);
            waiting.push_front(victim);
            preemptions += 1;
        }
        // Admission in arrival order (preempted requests are older than everyone waiting).
        while let Some(&id) = waiting.front() {
            let now = reqs[id].prompt_len + live[id].generated;
            if !alloc.admit(id, &reqs[id], now) {
                if running.is_empty() {
                    waiting.pop_front();
                    rejected += 1;
                    continue;
                }
                break;
            }
            waiting.pop_front();
            live[id].generated += 1;
            let at = running.partition_point(|&r| r < id);
            running.insert(at, id);
        }
        peak = peak.max(running.len());
        if !waiting.is_empty() {
            let real = alloc
                .filled_slots()
                .unwrap_or_else(|| running.iter().map(|&r| slots(&reqs[r], &live[r])).sum());
            sums.real += real as f64;
            sums.reserved += alloc.reserved_slots() as f64;
            sums.running += running.len() as f64;
            sums.saved += alloc.blocks_saved() as f64;
            sums.steps += 1;
        }
        running.retain(|&id| {
            let finished = live[id].generated >= reqs[id].output_len;
            if finished {
                alloc.release(id);
                done += 1;
            }
            !finished
        });
        step += 1;
    }
    let steps = sums.steps.max(1) as f64;
    PolicyStats {
        name: name.to_owned(),
        useful_fraction: sums.real / sums.reserved.max(1.0),
        pool_fraction: sums.real / (budget as f64 * steps),
        mean_concurrent: sums.running / steps,
        peak_concurrent: peak,
        preemptions_per_request: preemptions as f64 / reqs.len().max(1) as f64,
        blocks_saved_by_sharing: sums.saved / steps,
        saturated_steps: sums.steps,
        total_steps: step,
        completed: done,
        rejected,
    }
}
