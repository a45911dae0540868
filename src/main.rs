//! `kvgate`: the one binary. Each subcommand wires the library crates together.

mod admin_cmd;
mod assets;
mod backoff;
mod bench;
mod engine_cmd;
mod gateway_cmd;
mod generate_cmd;
mod model_cmd;
mod serve_cmd;
mod sim_cmd;
mod usage_sink;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// mimalloc: the gateway allocates a few dozen small buffers per request (headers, JSON, the
/// rewritten body, token ids), and mimalloc's per-thread free lists serve them at a fraction of
/// glibc malloc's cost (docs/PERFORMANCE.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(
    name = "kvgate",
    version,
    about = "Multi-tenant prefix-caching LLM service"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Operator CLI over the gateway's admin API: tenants, keys, engines, drain, cache flush.
    Admin(admin_cmd::AdminArgs),
    /// Load generator for an OpenAI-compatible server (engine or gateway).
    Bench(Box<bench::BenchArgs>),
    /// Run one engine instance (OpenAI API, metrics, admin, KV events).
    Engine(engine_cmd::EngineArgs),
    /// Run the gateway (tenants, keys, rate limits, prefix-aware routing, admin API).
    Gateway(gateway_cmd::GatewayArgs),
    /// Apply the Redis keyspace migrations.
    Migrate(gateway_cmd::MigrateArgs),
    /// Run kvgate on this machine with the default model, zero configuration.
    #[command(after_help = serve_cmd::AFTER_HELP)]
    Serve(serve_cmd::ServeArgs),
    /// Generate text for one prompt through the engine path (block manager, paged attention).
    Generate(generate_cmd::GenerateArgs),
    /// Fetch the default model or import a GGUF file.
    #[command(subcommand)]
    Model(model_cmd::ModelCommand),
    /// KV memory simulator: paged against contiguous allocation on one workload.
    Sim(sim_cmd::SimArgs),
    /// Copy the usage ledger from Redis into PostgreSQL (idempotent, acknowledged on commit).
    UsageSink(usage_sink::UsageSinkArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Admin(args) => admin_cmd::run(args),
        Command::Bench(args) => bench::run(*args),
        Command::Gateway(args) => gateway_cmd::gateway(args),
        Command::Migrate(args) => gateway_cmd::migrate(args),
        Command::Engine(args) => engine_cmd::engine(args),
        Command::Serve(args) => serve_cmd::serve(args),
        Command::Generate(args) => generate_cmd::run(args),
        Command::Model(cmd) => model_cmd::run(cmd),
        Command::Sim(args) => sim_cmd::run(args),
        Command::UsageSink(args) => usage_sink::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
