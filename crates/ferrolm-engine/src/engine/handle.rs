//! The caller's side of the engine: validation, submission and per-request output streams.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferrolm_model::ModelRunner;
use ferrolm_sampling::{SamplingError, SamplingParams};
use ferrolm_tokenizer::Tokenizer;
use tokio::sync::mpsc as tokio_mpsc;

use super::state::{EngineStats, EngineStatsSnapshot, RequestOutput};
use super::step::Engine;
use crate::scheduler::{SchedulerConfig, SchedulerError};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// Client requests accepted but not finished, beyond which `submit` answers
    /// [`EngineError::Overloaded`] (backpressure rather than an unbounded queue).
    pub max_pending_requests: usize,
    /// EOS ids of the model (`generation_config.json`, else `config.json`, else the tokenizer).
    pub eos_token_ids: Vec<u32>,
    /// Launch the next step while the runner still runs this one, where the scheduler can tell
    /// it already (every request decoding one more token; see `Scheduler::schedule_ahead`), so
    /// that a device never waits for the host between steps. The outputs are the same either way.
    pub overlap_steps: bool,
}

/// A request as a caller submits it.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt_token_ids: Vec<u32>,
    pub params: SamplingParams,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {token_id} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfVocab { token_id: u32, vocab_size: usize },
    #[error(
        "this model's maximum context length is {max_model_len} tokens; the prompt has \
         {num_prompt_tokens} tokens and max_tokens is {max_tokens}, {total} in all"
    )]
    TooLong { num_prompt_tokens: usize, max_tokens: usize, total: usize, max_model_len: usize },
    #[error(
        "this model's maximum context length is {max_model_len} tokens; the prompt alone has \
         {num_prompt_tokens} tokens"
    )]
    PromptTooLong { num_prompt_tokens: usize, max_model_len: usize },
    #[error(transparent)]
    InvalidParams(#[from] SamplingError),
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    #[error("the server is overloaded: {pending} requests pending; retry later")]
    Overloaded { pending: usize },
    #[error("the engine has stopped")]
    Stopped,
    #[error("device failure: {0}")]
    Device(String),
}

pub(crate) enum Command {
    Add { client_id: u64, request: GenerateRequest, tx: tokio_mpsc::UnboundedSender<RequestOutput> },
    Abort { client_id: u64 },
}

/// Cheap to clone; the engine thread stops once every handle and stream is gone.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<HandleInner>,
}

struct HandleInner {
    tx: mpsc::Sender<Command>,
    stats: Arc<EngineStats>,
    pending: Arc<AtomicUsize>,
    next_id: AtomicU64,
    config: EngineConfig,
    vocab_size: usize,
    /// The engine thread ends by itself once every sender (handles and streams) is gone.
    thread: JoinHandle<()>,
}

impl EngineHandle {
    /// Starts the engine thread, which owns `model` and a KV cache of
    /// `config.scheduler.num_blocks` blocks.
    ///
    /// Without a tokenizer (random-weight benchmarks) outputs carry token ids only: their `text`
    /// stays empty and stop strings never match.
    pub fn start(
        runner: impl Into<Box<dyn ModelRunner>>,
        tokenizer: impl Into<Option<Arc<Tokenizer>>>,
        config: EngineConfig,
    ) -> Result<EngineHandle, EngineError> {
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(EngineStats::default());
        let pending = Arc::new(AtomicUsize::new(0));
        let runner = runner.into();
        let vocab_size = runner.config().vocab_size;
        let engine = Engine::new(runner, tokenizer.into(), &config, rx, Arc::clone(&stats), Arc::clone(&pending))?;
        let thread = std::thread::Builder::new()
            .name("ferrolm-engine".into())
            // NOTE: the step loop runs on a worker of its own rayon pool, so the ops' parallel
            // loops start without a cross-thread hand-off (12-15 us per op call otherwise).
            .spawn(move || match rayon::ThreadPoolBuilder::new().thread_name(|i| format!("ferrolm-cpu-{i}")).build() {
                Ok(pool) => pool.install(move || engine.run()),
                Err(_) => engine.run(),
            })
            .map_err(|_| EngineError::Stopped)?;
        Ok(EngineHandle {
            inner: Arc::new(HandleInner { tx, stats, pending, next_id: AtomicU64::new(1), config, vocab_size, thread }),
        })
    }

    /// Lets the engine thread end and waits up to `timeout` for it: when this returns true, the
    /// model and the KV cache (device memory included) are freed. The thread ends once no handle
    /// or stream is left and no request is unfinished, so this returns false at once while
    /// another handle is alive (the engine keeps running for it), and after `timeout` while a
    /// stream is.
    pub fn shutdown(self, timeout: Duration) -> bool {
        let Ok(inner) = Arc::try_unwrap(self.inner) else { return false };
        let HandleInner { tx, thread, .. } = inner;
        drop(tx);
        let deadline = Instant::now() + timeout;
        while !thread.is_finished() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        thread.join().is_ok()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    pub fn max_model_len(&self) -> usize {
        self.inner.config.scheduler.max_model_len
    }

    pub fn stats(&self) -> EngineStatsSnapshot {
        self.inner.stats.snapshot()
    }

    /// Client requests accepted and not yet finished.
    pub fn num_pending(&self) -> usize {
        self.inner.pending.load(Ordering::Relaxed)
    }

    /// Checks a request against the model and the engine's limits, and fills in `max_tokens`
    /// when unset (all the room left in the context, as vLLM does).
    pub fn validate(&self, request: &mut GenerateRequest) -> Result<(), EngineError> {
        let max_model_len = self.max_model_len();
        let num_prompt_tokens = request.prompt_token_ids.len();
        if num_prompt_tokens == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        if let Some(&token_id) = request.prompt_token_ids.iter().find(|&&t| t as usize >= self.inner.vocab_size) {
            return Err(EngineError::TokenOutOfVocab { token_id, vocab_size: self.inner.vocab_size });
        }
        if num_prompt_tokens >= max_model_len {
            return Err(EngineError::PromptTooLong { num_prompt_tokens, max_model_len });
        }
        let max_tokens = match request.params.max_tokens {
            Some(m) => m as usize,
            None => max_model_len - num_prompt_tokens,
        };
        if num_prompt_tokens + max_tokens > max_model_len {
            return Err(EngineError::TooLong {
                num_prompt_tokens,
                max_tokens,
                total: num_prompt_tokens + max_tokens,
                max_model_len,
            });
        }
        request.params.max_tokens = Some(max_tokens as u32);
        request.params.validate()?;
        let sched = &self.inner.config.scheduler;
        let num_blocks_needed = (num_prompt_tokens + max_tokens).div_ceil(sched.block_size);
        if num_blocks_needed > sched.num_blocks {
            return Err(SchedulerError::ExceedsKvCache {
                request_id: crate::RequestId(0),
                num_blocks_needed,
                num_blocks: sched.num_blocks,
            }
            .into());
        }
        Ok(())
    }

    /// Validates and queues a request; its outputs arrive on the returned stream.
    pub fn submit(&self, mut request: GenerateRequest) -> Result<RequestStream, EngineError> {
        self.validate(&mut request)?;
        let pending = self.inner.pending.fetch_add(1, Ordering::AcqRel);
        if pending >= self.inner.config.max_pending_requests {
            self.inner.pending.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::Overloaded { pending });
        }
        let client_id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let n = request.params.n;
        let (tx, rx) = tokio_mpsc::unbounded_channel();
        if self.inner.tx.send(Command::Add { client_id, request, tx }).is_err() {
            self.inner.pending.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::Stopped);
        }
        Ok(RequestStream { client_id, rx, remaining: n, abort_tx: self.inner.tx.clone() })
    }
}

/// The outputs of one submitted request. Dropping it before every sequence finished aborts the
/// request and frees its KV blocks.
pub struct RequestStream {
    client_id: u64,
    rx: tokio_mpsc::UnboundedReceiver<RequestOutput>,
    /// Sequences not finished yet.
    remaining: u32,
    abort_tx: mpsc::Sender<Command>,
}

impl RequestStream {
    pub fn id(&self) -> u64 {
        self.client_id
    }

    fn note(&mut self, out: Option<RequestOutput>) -> Option<RequestOutput> {
        match &out {
            Some(o) if o.finish_reason.is_some() => self.remaining = self.remaining.saturating_sub(1),
            None => self.remaining = 0,
            _ => {}
        }
        out
    }

    /// Next output, or `None` once every sequence finished.
    pub async fn recv(&mut self) -> Option<RequestOutput> {
        if self.remaining == 0 {
            return None;
        }
        let out = self.rx.recv().await;
        self.note(out)
    }

    /// As [`RequestStream::recv`], blocking the calling (non-async) thread.
    pub fn blocking_recv(&mut self) -> Option<RequestOutput> {
        if self.remaining == 0 {
            return None;
        }
        let out = self.rx.blocking_recv();
        self.note(out)
    }

    /// Aborts the request now.
    pub fn abort(&mut self) {
        if self.remaining > 0 {
            let _ = self.abort_tx.send(Command::Abort { client_id: self.client_id });
            self.remaining = 0;
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.abort();
    }
}
