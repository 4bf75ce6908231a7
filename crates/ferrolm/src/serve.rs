//! `ferrolm serve`: the OpenAI-compatible HTTP server over the engine, until SIGINT or SIGTERM.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use ferrolm_server::limits::RequestLimits;
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
    /// Most sequences (prompts times `n`) one request may ask for.
    #[arg(long, default_value_t = RequestLimits::default().max_sequences)]
    pub max_request_sequences: usize,
    /// Most prompt tokens one request may carry, summed over its prompts.
    #[arg(long, default_value_t = RequestLimits::default().max_prompt_tokens)]
    pub max_request_prompt_tokens: usize,
    /// Most prompt logprob rows one response may carry (each choice of an `echo` with
    /// `logprobs` repeats its prompt's).
    #[arg(long, default_value_t = RequestLimits::default().max_prompt_logprob_rows)]
    pub max_request_prompt_logprob_rows: usize,
    /// Threads that tokenize prompts and render chat templates, off the threads that answer
    /// requests (default: half the cores, 1 to 8).
    #[arg(long)]
    pub tokenizer_threads: Option<usize>,
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
    if args.max_request_sequences > args.engine.max_pending_sequences {
        anyhow::bail!(
            "--max-request-sequences ({}) is above --max-pending-sequences ({}): such a request could never be queued",
            args.max_request_sequences,
            args.engine.max_pending_sequences
        );
    }
    if args.max_request_prompt_tokens > args.engine.max_pending_tokens {
        anyhow::bail!(
            "--max-request-prompt-tokens ({}) is above --max-pending-tokens ({}): such a request could never be queued",
            args.max_request_prompt_tokens,
            args.engine.max_pending_tokens
        );
    }
    let loaded = loader::load(&args.engine)?;
    let served_model_name =
        args.served_model_name.clone().or_else(|| dir_name(&loaded.dir)).unwrap_or_else(|| "ferrolm".to_string());
    let config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        api_key: args.api_key.clone(),
        shutdown_grace_period: grace,
        limits: RequestLimits {
            max_sequences: args.max_request_sequences,
            max_prompt_tokens: args.max_request_prompt_tokens,
            max_prompt_logprob_rows: args.max_request_prompt_logprob_rows,
        },
        ..ServerConfig::new(served_model_name)
    };
    let config =
        ServerConfig { tokenizer_threads: args.tokenizer_threads.unwrap_or(config.tokenizer_threads), ..config };
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
