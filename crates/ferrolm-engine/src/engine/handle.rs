//! The caller's side of the engine: validation, submission and per-request output streams.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferrolm_model::ModelRunner;
use ferrolm_sampling::{SamplingError, SamplingParams};
use ferrolm_tokenizer::{Tokenizer, TokenizerError};
use tokio::sync::mpsc as tokio_mpsc;

use super::core::Engine;
use super::output::{OutputProcessor, Processed};
use super::state::{EngineStats, EngineStatsSnapshot, RequestOutput};
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

/// The one rule for a request's length: the client's `max_tokens` as given; else `default` (the
/// model's or the route's) where it fits in the context; else all the room left in the context,
/// as vLLM does. A prompt that fills the context leaves no room (0; the engine refuses it).
pub fn resolve_max_tokens(
    requested: Option<u32>,
    default: Option<u32>,
    num_prompt_tokens: usize,
    max_model_len: usize,
) -> u32 {
    let room = u32::try_from(max_model_len.saturating_sub(num_prompt_tokens)).unwrap_or(u32::MAX);
    requested.unwrap_or_else(|| default.map_or(room, |d| d.min(room)))
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
    /// A prompt id inside the model's vocabulary that the tokenizer cannot decode (checkpoints
    /// pad their embedding past the tokenizer).
    #[error("token id {token_id} is out of vocabulary: the tokenizer has {num_tokens} tokens")]
    UnknownToken { token_id: u32, num_tokens: usize },
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
    /// The prompt cannot be read back as text (an id the tokenizer does not know).
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("the server is overloaded: {pending} requests pending; retry later")]
    Overloaded { pending: usize },
    #[error("the engine has stopped")]
    Stopped,
    #[error("device failure: {0}")]
    Device(String),
}

pub(crate) enum Command {
    /// `max_tokens`: the request's length as [`resolve_max_tokens`] settled it.
    Add {
        client_id: u64,
        request: GenerateRequest,
        max_tokens: usize,
        tx: tokio_mpsc::UnboundedSender<RequestOutput>,
    },
    Abort {
        client_id: u64,
    },
    /// A stop string ended sequence `index` in the output stage, which has sent its last output.
    StopSequence {
        client_id: u64,
        index: u32,
    },
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
    /// Rows of the model's embedding: ids a prompt may hold.
    vocab_size: usize,
    /// Ids the runner computes logits for: the model's, limited to the tokenizer's.
    output_vocab_size: usize,
    /// For the output stage of each stream; `None`: outputs carry token ids only.
    tokenizer: Option<Arc<Tokenizer>>,
    /// The engine thread ends by itself once every sender (handles and streams) is gone.
    thread: JoinHandle<()>,
}

impl EngineHandle {
    /// Starts the engine thread, which owns `model` and a KV cache of
    /// `config.scheduler.num_blocks` blocks.
    ///
    /// Without a tokenizer (random-weight benchmarks) outputs carry token ids only: their `text`
    /// stays empty and stop strings never match. With one, the runner computes logits only for
    /// the ids the tokenizer can decode, so that ids padding the model's vocabulary are never
    /// sampled, and prompts holding such ids are refused.
    pub fn start(
        runner: impl Into<Box<dyn ModelRunner>>,
        tokenizer: impl Into<Option<Arc<Tokenizer>>>,
        config: EngineConfig,
    ) -> Result<EngineHandle, EngineError> {
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(EngineStats::default());
        let pending = Arc::new(AtomicUsize::new(0));
        let mut runner = runner.into();
        let tokenizer: Option<Arc<Tokenizer>> = tokenizer.into();
        if let Some(tokenizer) = &tokenizer {
            runner.limit_output_vocab(tokenizer.vocab_size());
        }
        let (vocab_size, output_vocab_size) = (runner.config().vocab_size, runner.config().output_vocab_size);
        let engine = Engine::new(runner, &config, rx, Arc::clone(&stats), Arc::clone(&pending))?;
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
            inner: Arc::new(HandleInner {
                tx,
                stats,
                pending,
                next_id: AtomicU64::new(1),
                config,
                vocab_size,
                output_vocab_size,
                tokenizer,
                thread,
            }),
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
        self.admit(request).map(|_| ())
    }

    /// [`EngineHandle::validate`], answering the request's length.
    fn admit(&self, request: &mut GenerateRequest) -> Result<usize, EngineError> {
        let max_model_len = self.max_model_len();
        let num_prompt_tokens = request.prompt_token_ids.len();
        if num_prompt_tokens == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        self.check_token_ids(request)?;
        if let Some(&token_id) = request.prompt_token_ids.iter().find(|&&t| t as usize >= self.inner.vocab_size) {
            return Err(EngineError::TokenOutOfVocab { token_id, vocab_size: self.inner.vocab_size });
        }
        if num_prompt_tokens >= max_model_len {
            return Err(EngineError::PromptTooLong { num_prompt_tokens, max_model_len });
        }
        let max_tokens = resolve_max_tokens(request.params.max_tokens, None, num_prompt_tokens, max_model_len) as usize;
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
        // The request has no id yet; the scheduler names it when it says the same.
        self.inner.config.scheduler.check_fits_kv_cache(crate::RequestId(0), num_prompt_tokens, max_tokens)?;
        Ok(max_tokens)
    }

    /// What the model's vocabulary alone does not settle: every prompt id is one the tokenizer
    /// can decode (an id in the model's padding would have no text, and its embedding row no
    /// meaning), and a `min_tokens` mask leaves some token to sample.
    fn check_token_ids(&self, request: &GenerateRequest) -> Result<(), EngineError> {
        if let Some(tokenizer) = &self.inner.tokenizer {
            let num_tokens = tokenizer.vocab_size();
            if let Some(&token_id) = request.prompt_token_ids.iter().find(|&&t| t as usize >= num_tokens) {
                return Err(EngineError::UnknownToken { token_id, num_tokens });
            }
        }
        let params = &request.params;
        let eos = if params.ignore_eos { &[][..] } else { &self.inner.config.eos_token_ids[..] };
        let vocab = self.inner.output_vocab_size;
        // NOTE: until `min_tokens` tokens exist, EOS and the stop token ids are masked; masking
        // every id would leave the engine no token to sample. Counted only when that is possible.
        if params.min_tokens > 0 && params.stop_token_ids.len() + eos.len() >= vocab {
            let masked: std::collections::HashSet<u32> =
                params.stop_token_ids.iter().chain(eos).copied().filter(|&t| (t as usize) < vocab).collect();
            if masked.len() >= vocab {
                return Err(EngineError::InvalidParams(SamplingError::InvalidParam {
                    param: "stop_token_ids",
                    reason: format!(
                        "must leave some token unmasked while min_tokens is set: with EOS they cover \
                         all {vocab} tokens the model can sample"
                    ),
                }));
            }
        }
        Ok(())
    }

    /// Validates and queues a request; its outputs arrive on the returned stream.
    pub fn submit(&self, mut request: GenerateRequest) -> Result<RequestStream, EngineError> {
        let max_tokens = self.admit(&mut request)?;
        let outputs = OutputProcessor::new(self.inner.tokenizer.as_ref(), &request.prompt_token_ids, &request.params)?;
        let pending = self.inner.pending.fetch_add(1, Ordering::AcqRel);
        if pending >= self.inner.config.max_pending_requests {
            self.inner.pending.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::Overloaded { pending });
        }
        let client_id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let n = request.params.n;
        let (tx, rx) = tokio_mpsc::unbounded_channel();
        if self.inner.tx.send(Command::Add { client_id, request, max_tokens, tx }).is_err() {
            self.inner.pending.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::Stopped);
        }
        Ok(RequestStream { client_id, rx, remaining: n, abort_tx: self.inner.tx.clone(), outputs })
    }
}

/// The outputs of one submitted request, through its output stage (text, stop strings) on the
/// reading side. Dropping it before every sequence finished aborts the request and frees its KV
/// blocks.
pub struct RequestStream {
    client_id: u64,
    rx: tokio_mpsc::UnboundedReceiver<RequestOutput>,
    /// Sequences not finished yet.
    remaining: u32,
    abort_tx: mpsc::Sender<Command>,
    outputs: OutputProcessor,
}

impl RequestStream {
    pub fn id(&self) -> u64 {
        self.client_id
    }

    /// Passes what the engine thread sent through the output stage: `Break` with the output to
    /// return (`None` once the engine is gone), `Continue` when it was dropped.
    fn process(&mut self, sent: Option<RequestOutput>) -> ControlFlow<Option<RequestOutput>> {
        let Some(sent) = sent else {
            self.remaining = 0;
            return ControlFlow::Break(None);
        };
        let Some(Processed { output, stopped_here }) = self.outputs.process(sent) else {
            return ControlFlow::Continue(());
        };
        if stopped_here {
            let _ = self.abort_tx.send(Command::StopSequence { client_id: self.client_id, index: output.index });
        }
        if output.finish_reason.is_some() {
            self.remaining = self.remaining.saturating_sub(1);
        }
        ControlFlow::Break(Some(output))
    }

    /// Next output, or `None` once every sequence finished.
    pub async fn recv(&mut self) -> Option<RequestOutput> {
        while self.remaining > 0 {
            let sent = self.rx.recv().await;
            if let ControlFlow::Break(output) = self.process(sent) {
                return output;
            }
        }
        None
    }

    /// As [`RequestStream::recv`], blocking the calling (non-async) thread.
    pub fn blocking_recv(&mut self) -> Option<RequestOutput> {
        while self.remaining > 0 {
            let sent = self.rx.blocking_recv();
            if let ControlFlow::Break(output) = self.process(sent) {
                return output;
            }
        }
        None
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
