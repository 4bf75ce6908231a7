//! What every handler shares: the engine handle, the tokenizer, the model's sampling defaults,
//! the configuration, the metrics and the tokenizer threads. Read-only after start, so no locks.

use std::sync::Arc;

use ferrolm_engine::EngineHandle;
use ferrolm_sampling::GenerationDefaults;
use ferrolm_tokenizer::Tokenizer;
use tokio::sync::watch;

use crate::metrics::ServerMetrics;
use crate::structured::Grammars;
use crate::tool_calls::ToolCallParser;
use crate::work_pool::WorkPool;
use crate::ServerConfig;

pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub defaults: GenerationDefaults,
    pub config: ServerConfig,
    pub metrics: ServerMetrics,
    /// Unix time the server started (the `created` of its model card).
    pub created: u64,
    /// Turns true when the shutdown grace period is over: requests in flight end at once.
    pub abort: watch::Receiver<bool>,
    /// Where tokenizing and chat templates run.
    pub work: WorkPool,
    /// The format tool calls are parsed from: configured, or read from the chat template.
    pub tool_call_parser: Option<ToolCallParser>,
    /// The compiler of structured-output constraints, built on first use.
    pub grammars: Grammars,
}

pub type SharedState = Arc<AppState>;

/// Resolves once the server aborts requests in flight; never when that cannot happen any more.
pub async fn aborted(mut abort: watch::Receiver<bool>) {
    if abort.wait_for(|&a| a).await.is_err() {
        std::future::pending::<()>().await;
    }
}
