//! One kvgate engine instance.
//!
//! - [`kv`]: the paged KV cache: block pool, prefix index, block tables, copy-on-write, swap.
//! - [`sim`]: a memory simulator that replays a workload against paged and contiguous allocation.

pub mod kv;
pub mod model;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod sim;
pub mod worker;
