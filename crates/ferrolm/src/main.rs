//! `ferrolm`: an LLM inference server. Subcommands: `generate`.

mod generate;
mod loader;

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
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
    };
    if let Err(err) = result {
        // One line, the whole cause chain.
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
