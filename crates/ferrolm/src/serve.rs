//! `ferrolm serve`: the OpenAI-compatible HTTP server over the engine, until SIGINT or SIGTERM.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use ferrolm_server::limits::RequestLimits;
use ferrolm_server::reasoning::ReasoningParser;
use ferrolm_server::tool_calls::ToolCallParser;
use ferrolm_server::{ConnectionLimits, ServerConfig};

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
    /// Seconds that requests in flight get to finish after SIGINT/SIGTERM before they are aborted
    /// (a second SIGINT/SIGTERM exits at once).
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_timeout: f64,
    /// Seconds in which a request head (request line and headers) must arrive, from the
    /// connection's start or from the first byte of a later head; a partial head then gets 408.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub http_header_timeout: f64,
    /// Seconds in which a request body must arrive after its head; else 408 and the connection
    /// is closed.
    #[arg(long, default_value_t = 60.0, value_name = "SECONDS")]
    pub http_body_timeout: f64,
    /// Seconds a kept-alive connection may wait for its next request before it is closed.
    #[arg(long, default_value_t = 60.0, value_name = "SECONDS")]
    pub http_idle_timeout: f64,
    /// Open client connections at most; beyond them new connections get 503 and are closed.
    #[arg(long, default_value_t = 2048)]
    pub max_connections: usize,
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
    /// The format tool calls are parsed from in replies to requests with `tools`
    /// (`tool_choice: "auto"`): llama3_json, hermes or mistral. Default: the one the chat
    /// template teaches (`<tool_call>` hermes, `[TOOL_CALLS]` mistral, Llama 3.1's JSON
    /// llama3_json); with none, such replies are text.
    #[arg(long, value_name = "NAME", value_parser = ToolCallParser::from_name)]
    pub tool_call_parser: Option<ToolCallParser>,
    /// Accepted for vLLM's command lines: tool calls are parsed whenever a format is known.
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
    /// Split `<think>` blocks out of chat replies into `reasoning_content`: deepseek_r1 (the
    /// reply starts inside the block) or qwen3 (only where a block is opened).
    #[arg(long, value_name = "NAME", value_parser = ReasoningParser::from_name)]
    pub reasoning_parser: Option<ReasoningParser>,
}

/// The name of a model directory (`/models/Qwen3-0.6B/` -> `Qwen3-0.6B`).
fn dir_name(dir: &Path) -> Option<String> {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    dir.file_name().map(|n| n.to_string_lossy().into_owned())
}

/// `value` seconds as a duration in (0 s, a day], or an error naming `flag`.
fn positive_seconds(flag: &str, value: f64) -> Result<Duration> {
    const DAY: f64 = 86_400.0;
    match Duration::try_from_secs_f64(value) {
        Ok(d) if !d.is_zero() && value <= DAY => Ok(d),
        _ => anyhow::bail!("{flag} must be a number of seconds in (0, {DAY}], got {value}"),
    }
}

/// The API key, refused when empty: a server that answers 401 to every request is a mistake.
fn api_key(given: Option<&str>) -> Result<Option<String>> {
    match given {
        Some(key) if key.trim().is_empty() => {
            anyhow::bail!("--api-key (or FERROLM_API_KEY) is empty: give a key, or leave it unset to serve without one")
        }
        other => Ok(other.map(str::to_string)),
    }
}

fn connection_limits(args: &ServeArgs) -> Result<ConnectionLimits> {
    if args.max_connections == 0 {
        anyhow::bail!("--max-connections must be at least 1, got 0");
    }
    let limits = ConnectionLimits {
        header_timeout: positive_seconds("--http-header-timeout", args.http_header_timeout)?,
        body_timeout: positive_seconds("--http-body-timeout", args.http_body_timeout)?,
        idle_timeout: positive_seconds("--http-idle-timeout", args.http_idle_timeout)?,
        max_connections: args.max_connections,
        ..ConnectionLimits::default()
    };
    limits.validate().map_err(anyhow::Error::msg)?;
    Ok(limits)
}

/// Raises the open-files limit (each connection is a file descriptor) and warns when it still
/// cannot hold `max_connections`.
fn raise_open_files_limit(max_connections: usize) {
    match ferrolm_server::raise_open_files_limit() {
        Ok((before, after)) => {
            if after.soft > before.soft {
                tracing::info!(from = before.soft, to = after.soft, "raised the open-files limit");
            }
            // Besides connections: the listener, model files, the runtime's own descriptors.
            let needed = max_connections as u64 + 64;
            if after.soft < needed {
                tracing::warn!(
                    open_files = after.soft,
                    max_connections,
                    "the open-files limit is below --max-connections: accepting will fail (and be retried) before the cap"
                );
            }
        }
        Err(err) => tracing::warn!(error = %err, "cannot raise the open-files limit"),
    }
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
    let api_key = api_key(args.api_key.as_deref())?;
    let connections = connection_limits(&args)?;
    raise_open_files_limit(connections.max_connections);
    let loaded = loader::load(&args.engine)?;
    let served_model_name =
        args.served_model_name.clone().or_else(|| dir_name(&loaded.dir)).unwrap_or_else(|| "ferrolm".to_string());
    let config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        api_key,
        shutdown_grace_period: grace,
        connections,
        limits: RequestLimits {
            max_sequences: args.max_request_sequences,
            max_prompt_tokens: args.max_request_prompt_tokens,
            max_prompt_logprob_rows: args.max_request_prompt_logprob_rows,
        },
        tool_call_parser: args.tool_call_parser,
        reasoning_parser: args.reasoning_parser,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_api_key_is_refused() {
        for empty in ["", "   ", "\t\n"] {
            let err = api_key(Some(empty)).expect_err("an empty key");
            assert!(err.to_string().contains("--api-key"), "{err}");
        }
        assert_eq!(api_key(Some("sk-1")).expect("a key"), Some("sk-1".to_string()));
        assert_eq!(api_key(None).expect("no key"), None);
    }

    #[test]
    fn timeouts_must_be_positive() {
        assert_eq!(positive_seconds("--x", 2.5).expect("valid"), Duration::from_millis(2500));
        for bad in [0.0, -1.0, 1e9, f64::NAN, f64::INFINITY] {
            let err = positive_seconds("--http-idle-timeout", bad).expect_err("invalid");
            assert!(err.to_string().starts_with("--http-idle-timeout must be"), "{err}");
        }
    }
}
