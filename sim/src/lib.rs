//! kvgate's simulators, kept out of the production crates. Each drives the real code it
//! studies, not a model of it:
//! - [`memory`]: `kvgate sim`, a workload replayed against paged (the engine's block manager)
//!   and contiguous KV allocation on the same memory budget;
//! - [`routing`]: `kvgate bench --routing-sim`, routing policies (the gateway's router and
//!   prefix index) against an oracle on a multi-tenant trace.

pub mod memory;
pub mod routing;
