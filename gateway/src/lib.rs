//! The kvgate gateway: tenants and API keys, rate limits shared across replicas, prefix-aware
//! routing and the streaming proxy to engines, and the admin API. It depends on
//! `kvgate-protocol` (and the shared HTTP plumbing) only, never on the engine or the kernels.
//!
//! - `gateway.toml` is [`config`].
//! - The tower stack is [`service`], the tenants' endpoints [`api`], the operators' [`admin`].
//! - Keys, tenants, Redis / in-memory state and rate limits: [`auth`], [`tenant`], [`store`].
//! - The policy, the prefix index and request hashing: [`routing`].
//! - Engines, health, KV events and the proxy: [`upstream`].
//! - Start-up and listeners: [`server`]; Prometheus: [`metrics`].

pub mod admin;
pub mod api;
pub mod auth;
pub mod config;
pub mod metrics;
pub mod routing;
pub mod server;
pub mod service;
pub mod store;
pub mod tenant;
pub mod upstream;

pub use config::GatewayConfig;
pub use server::{Gateway, StartError};
