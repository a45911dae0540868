//! One kvgate engine instance.
//!
//! - [`kv`]: the paged KV cache: block pool, prefix index, block tables, copy-on-write, swap.

pub mod kv;
pub mod model;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod stats;
pub mod worker;
