//! kvgate's fuzzer: a mutation-based, invariant-checking harness that runs on stable Rust (and
//! so in `cargo test`), for the code that reads what clients and engines send.
//!
//! Inputs start from a corpus of real request bodies, usage documents and engine SSE streams
//! ([`corpus`]); each case mutates one, as bytes ([`mutate`]) or as a JSON tree ([`json`]), and
//! runs a target ([`targets`]) that checks invariants beyond "does not panic". The loop
//! ([`driver`]) keeps mutants with new outcomes, catches panics per case ([`panics`]), and
//! minimizes ([`minimize`]) and saves the input of any failure.

pub mod corpus;
pub mod driver;
pub mod json;
pub mod minimize;
pub mod mutate;
pub mod panics;
pub mod rng;
pub mod targets;

pub use driver::{replay, run, Config, Failure, Report, KNOWN, TARGETS};
