//! `ferrolm`: an LLM inference server. Subcommands: `generate`, `bench`, `serve`.

mod bench;
mod generate;
mod loader;
mod serve;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "ferrolm", version, about = "An LLM inference server with continuous batching over a paged KV cache")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text for one or more prompts, batched continuously.
    Generate(generate::GenerateArgs),
    /// Benchmark offline throughput, single-request latency, or a running server.
    Bench(bench::BenchArgs),
    /// Serve the OpenAI-compatible HTTP API until SIGINT or SIGTERM.
    Serve(serve::ServeArgs),
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // A server logs one line per request by default.
                .unwrap_or_else(|_| {
                    let level = if matches!(cli.command, Command::Serve(_)) { "info" } else { "warn" };
                    tracing_subscriber::EnvFilter::new(level)
                }),
        )
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal; log files and pipes get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Serve(args) => serve::run(args),
    };
    if let Err(err) = result {
        // One line, the whole cause chain.
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
