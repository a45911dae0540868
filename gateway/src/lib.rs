//! The kvgate gateway: tenants and API keys, rate limits, prefix-aware routing and the streaming
//! proxy to engines. It depends on `kvgate-protocol` only, never on the engine or the kernels.
//!
//! Filled by the gateway issue; the crate exists so the workspace layout is final.
