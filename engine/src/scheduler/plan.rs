//! What one step runs: the scheduler's output, the model runner's input.

use super::sequence::GroupId;
use crate::kv::{BlockId, HostBlockId, SeqId};

/// How a group was preempted (and `scheduler.preemption` in `engine.toml`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PreemptMode {
    #[default]
    Recompute,
    Swap,
}

impl PreemptMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PreemptMode::Recompute => "recompute",
            PreemptMode::Swap => "swap",
        }
    }
}

/// New tokens of one sequence in this step: `tokens[start..start + len]` of the sequence, whose
/// slots are allocated. `sample` when the chunk ends at the sequence's last token, so its logits
/// yield the next token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepItem {
    pub group: GroupId,
    pub seq: SeqId,
    pub start: usize,
    pub len: usize,
    pub sample: bool,
}

/// One step.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    pub items: Vec<StepItem>,
    /// Copy-on-write copies to do before the forward pass.
    pub cow: Vec<(BlockId, BlockId)>,
    pub swap_out: Vec<(BlockId, HostBlockId)>,
    pub swap_in: Vec<(HostBlockId, BlockId)>,
    pub preempted: Vec<(GroupId, PreemptMode)>,
    /// Groups refused because they can never fit.
    pub rejected: Vec<(GroupId, String)>,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.items.iter().map(|i| i.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}
