//! ferrolm's OpenAI-compatible HTTP server.
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
//! `GET /metrics` (Prometheus text), `POST /tokenize`, `POST /detokenize`.
//!
//! - [`routes`]: one module per route family; the router, API-key check and fallbacks.
//! - [`protocol`]: request and response types as they travel on the wire.
//! - [`params`]: from a request's optional knobs to the engine's `SamplingParams`.
//! - `generation`: one API request on the engine (its prompts, merged output streams, choices).
//! - `sse`: streamed responses; `logprobs`: the two logprob shapes; [`chat_prompt`]: templates.
//! - [`tool_calls`]: tool-call formats parsed out of replies, `tools` and `tool_choice`;
//!   [`reasoning`]: `<think>` blocks split off; [`chat_output`]: both applied to a chat choice.
//! - [`limits`]: what one request may ask for (sequences, prompt tokens, logprob rows);
//!   `work_pool`: the threads that tokenize, off the async ones.
//! - [`error`]: the one mapping from every error to a status and an OpenAI-shaped body.
//! - [`metrics`]: Prometheus metrics with vLLM's names.
//! - `conn`: the accept loop and each connection under the router: timeouts, the connection
//!   cap, half-close, OpenAI-shaped transport errors, the drain at shutdown.
//! - [`signals`]: the first SIGINT/SIGTERM drains, the second exits at once.
//!
//! The server never touches engine state: it submits requests through an [`EngineHandle`] and
//! reads their output streams. Dropping a stream aborts its request, so a client that goes
//! away (its handler future or response body dropped) frees its KV blocks.

pub mod chat_output;
pub mod chat_prompt;
mod conn;
pub mod error;
mod generation;
mod json;
pub mod limits;
mod logprobs;
mod memory;
pub mod metrics;
pub mod params;
pub mod protocol;
pub mod reasoning;
pub mod routes;
pub mod signals;
mod sse;
mod state;
pub mod structured;
pub mod tool_calls;
mod work_pool;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ferrolm_engine::EngineHandle;
use ferrolm_sampling::GenerationDefaults;
use ferrolm_tokenizer::Tokenizer;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use conn::fd_limit::{raise_open_files_limit, OpenFilesLimit};
pub use conn::ConnectionLimits;
pub use error::ApiError;
use limits::RequestLimits;
use reasoning::ReasoningParser;
pub use signals::{shutdown_signal, StopSignal};
use state::AppState;
use structured::Grammars;
use tool_calls::ToolCallParser;
use work_pool::WorkPool;

/// How the server listens and whom it serves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    /// 0 picks a free port; [`Server::local_addr`] tells which.
    pub port: u16,
    /// When set, every `/v1/*`, `/tokenize` and `/detokenize` request needs
    /// `Authorization: Bearer <key>`; `/health` and `/metrics` stay open.
    pub api_key: Option<String>,
    /// The `model` name clients must use (and `/v1/models` lists).
    pub served_model_name: String,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// After a shutdown signal, how long in-flight requests may run before they are aborted.
    pub shutdown_grace_period: Duration,
    /// Timeouts and caps on client connections.
    pub connections: ConnectionLimits,
    /// What one request may ask for.
    pub limits: RequestLimits,
    /// Threads that tokenize prompts and render chat templates.
    pub tokenizer_threads: usize,
    /// The format tool calls are parsed from (`tool_choice: "auto"`); `None` reads it from the
    /// chat template, and without one a reply is text.
    pub tool_call_parser: Option<ToolCallParser>,
    /// Splits `<think>` blocks into `reasoning_content`.
    pub reasoning_parser: Option<ReasoningParser>,
}

impl ServerConfig {
    pub fn new(served_model_name: impl Into<String>) -> ServerConfig {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8000,
            api_key: None,
            served_model_name: served_model_name.into(),
            max_body_bytes: 32 << 20,
            shutdown_grace_period: Duration::from_secs(30),
            connections: ConnectionLimits::default(),
            limits: RequestLimits::default(),
            tokenizer_threads: WorkPool::default_threads(),
            tool_call_parser: None,
            reasoning_parser: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("server I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("invalid connection limits: {0}")]
    Limits(String),
    #[error("cannot start the tokenizer threads: {0}")]
    Threads(#[from] rayon::ThreadPoolBuildError),
}

/// A server bound to its address and not yet serving.
pub struct Server {
    listener: TcpListener,
    state: Arc<AppState>,
    abort_tx: watch::Sender<bool>,
}

impl Server {
    pub async fn bind(
        engine: EngineHandle,
        tokenizer: Arc<Tokenizer>,
        defaults: GenerationDefaults,
        config: ServerConfig,
    ) -> Result<Server, ServerError> {
        config.connections.validate().map_err(ServerError::Limits)?;
        let addr = format!("{}:{}", config.host, config.port);
        let listener = TcpListener::bind((config.host.as_str(), config.port))
            .await
            .map_err(|source| ServerError::Bind { addr, source })?;
        let (abort_tx, abort_rx) = watch::channel(false);
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let metrics = metrics::ServerMetrics::new(&config.served_model_name);
        let work = WorkPool::new(config.tokenizer_threads)?;
        let tool_call_parser = tool_call_parser(config.tool_call_parser, &tokenizer);
        let state = Arc::new(AppState {
            engine,
            tokenizer,
            defaults,
            config,
            metrics,
            created,
            abort: abort_rx,
            work,
            tool_call_parser,
            grammars: Grammars::default(),
        });
        Ok(Server { listener, state, abort_tx })
    }

    pub fn local_addr(&self) -> Result<SocketAddr, ServerError> {
        Ok(self.listener.local_addr()?)
    }

    /// Serves until `shutdown` resolves; then stops accepting connections, closes those awaiting
    /// a request, lets in-flight requests finish for the grace period, aborts those still
    /// running, and returns.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), ServerError> {
        let Server { listener, state, abort_tx } = self;
        let grace = state.config.shutdown_grace_period;
        let upkeep = tokio::spawn({
            let state = Arc::clone(&state);
            async move {
                let mut every = tokio::time::interval(Duration::from_secs(5));
                loop {
                    every.tick().await;
                    state.metrics.run_upkeep();
                    memory::release_free_memory();
                }
            }
        });
        let connections =
            conn::accept::Connections::new(routes::router(Arc::clone(&state)), state.config.connections.clone());
        connections.accept_until(listener, shutdown).await;
        tracing::info!("shutting down: no new connections; waiting for requests in flight");
        connections.drain();
        if tokio::time::timeout(grace, connections.closed()).await.is_err() {
            tracing::warn!(grace_s = grace.as_secs_f64(), "grace period over: aborting requests in flight");
            let _ = abort_tx.send(true);
            // Aborted handlers end their responses at once; do not wait on a stuck client.
            let _ = tokio::time::timeout(Duration::from_secs(5), connections.closed()).await;
        }
        connections.close_all();
        upkeep.abort();
        Ok(())
    }
}

/// The tool-call format: the configured one, else the one the chat template teaches.
fn tool_call_parser(configured: Option<ToolCallParser>, tokenizer: &Tokenizer) -> Option<ToolCallParser> {
    let parser = configured.or_else(|| tokenizer.chat_template().and_then(|t| ToolCallParser::detect(t.source())));
    match (configured, parser) {
        (Some(p), _) => tracing::info!(parser = p.name(), "tool calls parsed with the configured format"),
        (None, Some(p)) => tracing::info!(parser = p.name(), "tool call format read from the chat template"),
        (None, None) => tracing::info!("no tool call format: replies to requests with tools are text"),
    }
    parser
}

/// Binds `config.host:config.port` and serves until `shutdown` resolves (see [`Server::run`]).
pub async fn serve(
    engine: EngineHandle,
    tokenizer: Arc<Tokenizer>,
    defaults: GenerationDefaults,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let server = Server::bind(engine, tokenizer, defaults, config).await?;
    let addr = server.local_addr()?;
    println!("ferrolm: serving on http://{addr}");
    tracing::info!(%addr, "listening");
    server.run(shutdown).await
}
