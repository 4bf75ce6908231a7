//! `ferrolm serve`: the OpenAI-compatible HTTP server over the engine, until SIGINT or SIGTERM.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use ferrolm_server::ServerConfig;

use crate::loader::{self, EngineArgs};

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the address is printed at start).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on the API routes (/health and /metrics stay open).
    #[arg(long, env = "FERROLM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model name clients pass as `model`; defaults to the model directory's name.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Seconds that requests in flight get to finish after SIGINT/SIGTERM before they are aborted.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_timeout: f64,
}

/// The name of a model directory (`/models/Qwen3-0.6B/` -> `Qwen3-0.6B`).
fn dir_name(dir: &Path) -> Option<String> {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    dir.file_name().map(|n| n.to_string_lossy().into_owned())
}

pub fn run(args: ServeArgs) -> Result<()> {
    let grace = Duration::try_from_secs_f64(args.shutdown_timeout).with_context(|| {
        format!("--shutdown-timeout must be a number of seconds >= 0, got {}", args.shutdown_timeout)
    })?;
    let loaded = loader::load(&args.engine)?;
    let served_model_name =
        args.served_model_name.clone().or_else(|| dir_name(&loaded.dir)).unwrap_or_else(|| "ferrolm".to_string());
    let config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        api_key: args.api_key.clone(),
        shutdown_grace_period: grace,
        ..ServerConfig::new(served_model_name)
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("ferrolm-http")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let shutdown = ferrolm_server::shutdown_signal().context("cannot install the signal handlers")?;
        ferrolm_server::serve(loaded.engine, loaded.tokenizer, loaded.defaults, config, shutdown).await?;
        Ok(())
    })
}
