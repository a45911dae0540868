//! The kvgate gateway: tenants and API keys, rate limits shared across replicas, prefix-aware
//! routing and the streaming proxy to engines, and the admin API. It depends on
//! `kvgate-protocol` (and the shared HTTP plumbing) only, never on the engine or the kernels.
//!
//! - `gateway.toml` is [`config`].
//! - The tower stack is [`service`], the tenants' endpoints [`api`], the operators' [`admin`].
//! - Keys, tenants, Redis / in-memory state and rate limits: [`auth`], [`tenant`], [`store`].
//! - The policy, the prefix index and request hashing: [`routing`].
//! - Engines, health, KV events and the proxy: [`upstream`].
//! - Shared state and start-up: [`state`]; the request extensions the stack hands the
//!   handlers: [`extensions`]; the listeners: [`server`]; Prometheus: [`metrics`].
//!
//! Dependencies inside the crate point one way: `server` -> `service` -> `api` -> `state`, and
//! `server` -> `admin` -> `state`; `state` uses the building blocks (`auth`, `routing`, `store`,
//! `upstream`, ...), which use none of these.

pub mod admin;
pub mod api;
pub mod audit;
pub mod auth;
pub mod config;
pub mod extensions;
pub mod metrics;
pub mod routing;
pub mod server;
pub mod service;
pub mod state;
pub mod store;
pub mod tenant;
pub mod upstream;
pub mod usage;

pub use config::GatewayConfig;
pub use state::{Gateway, StartError};
