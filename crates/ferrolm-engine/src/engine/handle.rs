//! The caller's side of the engine: validation, submission and per-request output streams.
//!
//! [`EngineHandle::start`] starts two threads: the engine thread (`ferrolm-engine`) and the
//! output stage (`ferrolm-output`, see `output_stage.rs`). A submitted request is registered
//! with the output stage before the engine hears of it; its [`RequestStream`] only reads what
//! the output stage forwards, so detokenizing and stop strings run whether or not it is read.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferrolm_model::ModelRunner;
use ferrolm_sampling::{SamplingError, SamplingParams, StopStrings};
use ferrolm_structured::Grammar;
use ferrolm_tokenizer::{Tokenizer, TokenizerError};
use tokio::sync::mpsc as tokio_mpsc;

use super::admission::{Load, PendingLoad};
use super::core::Engine;
use super::output::{stop_strings, OutputProcessor};
use super::output_stage::{EngineStoppedGuard, OutputEvent, OutputStage};
use super::state::{EngineStats, EngineStatsSnapshot, RequestOutput};
use crate::scheduler::{SchedulerConfig, SchedulerError};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// What the requests accepted and not finished may weigh (sequences, prompt tokens); a
    /// submission past either answers [`EngineError::Overloaded`] (backpressure rather than an
    /// unbounded queue).
    pub max_pending: Load,
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
    /// The grammar every sequence's output must follow (structured output, tool calls).
    pub grammar: Option<Grammar>,
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
    #[error(
        "the server is overloaded: {} sequences and {} prompt tokens pending; retry later",
        pending.sequences,
        pending.prompt_tokens
    )]
    Overloaded { pending: Load },
    #[error("the engine has stopped")]
    Stopped,
    #[error("device failure: {0}")]
    Device(String),
}

pub(crate) enum Command {
    /// `max_tokens`: the request's length as [`resolve_max_tokens`] settled it.
    Add {
        client_id: u64,
        /// The client request (a `submit_all` call) it belongs to: the scheduler admits groups
        /// in turn.
        group: u64,
        request: GenerateRequest,
        max_tokens: usize,
    },
    Abort {
        client_id: u64,
    },
    /// A stop string ended sequence `index` in the output stage, which has sent its last output.
    /// Sent by the output stage on a channel of its own.
    StopSequence {
        client_id: u64,
        index: u32,
    },
}

/// Cheap to clone; the engine thread and the output stage stop once every handle and stream is
/// gone.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<HandleInner>,
}

struct HandleInner {
    tx: mpsc::Sender<Command>,
    /// To the output stage: registrations.
    outputs: mpsc::Sender<OutputEvent>,
    /// Requests the output stage holds.
    num_output_requests: Arc<AtomicUsize>,
    stats: Arc<EngineStats>,
    pending: Arc<PendingLoad>,
    next_id: AtomicU64,
    config: EngineConfig,
    /// Rows of the model's embedding: ids a prompt may hold.
    vocab_size: usize,
    /// For the output stage of each request; `None`: outputs carry token ids only.
    tokenizer: Option<Arc<Tokenizer>>,
    /// The engine thread ends by itself once every sender (handles and streams) is gone.
    thread: JoinHandle<()>,
    /// The output stage ends by itself once the engine thread and every handle and stream are.
    output_thread: JoinHandle<()>,
}

impl EngineHandle {
    /// Starts the engine thread, which owns `model` and a KV cache of the blocks of
    /// `config.scheduler.kv_cache_groups`, whose windows must be the model's
    /// (`ModelConfig::kv_cache_groups`).
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
        let (outputs, outputs_rx) = mpsc::channel();
        let (stops, stops_rx) = mpsc::channel();
        let stats = Arc::new(EngineStats::default());
        let pending = Arc::new(PendingLoad::default());
        let num_output_requests = Arc::new(AtomicUsize::new(0));
        let mut runner = runner.into();
        let tokenizer: Option<Arc<Tokenizer>> = tokenizer.into();
        if let Some(tokenizer) = &tokenizer {
            runner.limit_output_vocab(tokenizer.vocab_size());
        }
        let vocab_size = runner.config().vocab_size;
        let channels = super::core::Channels { commands: rx, stops: stops_rx, outputs: outputs.clone() };
        let engine = Engine::new(runner, &config, channels, Arc::clone(&stats), Arc::clone(&pending))?;
        let stage = OutputStage::new(outputs_rx, stops, Arc::clone(&num_output_requests));
        let output_thread = std::thread::Builder::new()
            .name("ferrolm-output".into())
            .spawn(move || stage.run())
            .map_err(|_| EngineError::Stopped)?;
        let stopped = EngineStoppedGuard(outputs.clone());
        let thread = std::thread::Builder::new()
            .name("ferrolm-engine".into())
            // NOTE: the step loop runs on a worker of its own rayon pool, so the ops' parallel
            // loops start without a cross-thread hand-off (12-15 us per op call otherwise).
            .spawn(move || {
                let _stopped = stopped;
                match rayon::ThreadPoolBuilder::new().thread_name(|i| format!("ferrolm-cpu-{i}")).build() {
                    Ok(pool) => pool.install(move || engine.run()),
                    Err(_) => engine.run(),
                }
            })
            .map_err(|_| EngineError::Stopped)?;
        Ok(EngineHandle {
            inner: Arc::new(HandleInner {
                tx,
                outputs,
                num_output_requests,
                stats,
                pending,
                next_id: AtomicU64::new(1),
                config,
                vocab_size,
                tokenizer,
                thread,
                output_thread,
            }),
        })
    }

    /// Lets the engine thread and the output stage end and waits up to `timeout` for them: when
    /// this returns true, the model and the KV cache (device memory included) are freed, and so
    /// is every request's output state. The threads end once no handle or stream is left and no
    /// request is unfinished, so this returns false at once while another handle is alive (the
    /// engine keeps running for it), and after `timeout` while a stream is.
    pub fn shutdown(self, timeout: Duration) -> bool {
        let Ok(inner) = Arc::try_unwrap(self.inner) else { return false };
        let HandleInner { tx, outputs, thread, output_thread, .. } = inner;
        drop((tx, outputs));
        let deadline = Instant::now() + timeout;
        while !(thread.is_finished() && output_thread.is_finished()) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        thread.join().is_ok() && output_thread.join().is_ok()
    }

    /// Whether the engine thread and the output stage still run: false once either has died
    /// (a panic) and nothing submitted will ever be answered.
    pub fn is_running(&self) -> bool {
        !self.inner.thread.is_finished() && !self.inner.output_thread.is_finished()
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

    /// What the requests accepted and not yet finished weigh.
    pub fn pending(&self) -> Load {
        self.inner.pending.get()
    }

    /// Requests whose output state the output stage holds: registered, and not yet finished
    /// there nor dropped. 0 once every request has ended and its stream was read or dropped.
    pub fn num_output_requests(&self) -> usize {
        self.inner.num_output_requests.load(Ordering::Relaxed)
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
    /// meaning).
    fn check_token_ids(&self, request: &GenerateRequest) -> Result<(), EngineError> {
        if let Some(tokenizer) = &self.inner.tokenizer {
            let num_tokens = tokenizer.vocab_size();
            if let Some(&token_id) = request.prompt_token_ids.iter().find(|&&t| t as usize >= num_tokens) {
                return Err(EngineError::UnknownToken { token_id, num_tokens });
            }
        }
        Ok(())
    }

    /// Validates and queues a request; its outputs arrive on the returned stream.
    pub fn submit(&self, request: GenerateRequest) -> Result<RequestStream, EngineError> {
        let mut streams = self.submit_all(vec![request])?;
        streams.pop().ok_or(EngineError::Stopped)
    }

    /// Validates every request, then queues them all as one client request (the scheduler
    /// admits client requests in turn, so a big one cannot starve those after it): all are
    /// accepted or none, and a refusal costs no work on the engine thread. Their outputs arrive
    /// on the returned streams, in order.
    pub fn submit_all(&self, mut requests: Vec<GenerateRequest>) -> Result<Vec<RequestStream>, EngineError> {
        let mut admitted = Vec::with_capacity(requests.len());
        let mut load = Load::default();
        let tokenizer = self.inner.tokenizer.as_ref();
        // The prompts of one client request share their stop strings: compiled once.
        let mut compiled: Option<(Vec<String>, StopStrings)> = None;
        for request in &mut requests {
            let max_tokens = self.admit(request)?;
            let stops = match &compiled {
                Some((strings, stops)) if *strings == request.params.stop => stops.clone(),
                _ => {
                    let stops = stop_strings(tokenizer, &request.params)?;
                    compiled = Some((request.params.stop.clone(), stops.clone()));
                    stops
                }
            };
            let processor = OutputProcessor::new(tokenizer, &request.prompt_token_ids, &request.params, stops)?;
            load = load.plus(Load::of_prompt(request.prompt_token_ids.len(), request.params.n));
            admitted.push((max_tokens, processor));
        }
        let pending = &self.inner.pending;
        pending
            .try_reserve(load, self.inner.config.max_pending)
            .map_err(|pending| EngineError::Overloaded { pending })?;
        let group = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let mut unsent = load;
        let mut streams = Vec::with_capacity(requests.len());
        for (request, (max_tokens, processor)) in requests.into_iter().zip(admitted) {
            let client_load = Load::of_prompt(request.prompt_token_ids.len(), request.params.n);
            let client_id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
            let n = request.params.n;
            // Registered before the engine hears of it, so that its outputs find their entry.
            let (tx, rx) = tokio_mpsc::unbounded_channel();
            if self.inner.outputs.send(OutputEvent::Register { client_id, processor, tx }).is_err() {
                pending.release(unsent);
                return Err(EngineError::Stopped);
            }
            let stream = RequestStream {
                client_id,
                rx,
                remaining: n,
                abort_tx: self.inner.tx.clone(),
                outputs_tx: self.inner.outputs.clone(),
            };
            if self.inner.tx.send(Command::Add { client_id, group, request, max_tokens }).is_err() {
                // This one and those after it never reached the engine (dropping its stream
                // forgets the registration); those before are aborted, and released, as their
                // streams drop.
                pending.release(unsent);
                return Err(EngineError::Stopped);
            }
            unsent = unsent.minus(client_load);
            streams.push(stream);
        }
        Ok(streams)
    }
}

/// The outputs of one submitted request, as the output stage forwards them (text filled in, cut
/// at stop strings). Dropping it before every sequence finished aborts the request and frees
/// its KV blocks.
pub struct RequestStream {
    client_id: u64,
    rx: tokio_mpsc::UnboundedReceiver<RequestOutput>,
    /// Sequences not finished yet.
    remaining: u32,
    abort_tx: mpsc::Sender<Command>,
    /// To the output stage, to forget the request when the stream is dropped early.
    outputs_tx: mpsc::Sender<OutputEvent>,
}

impl RequestStream {
    pub fn id(&self) -> u64 {
        self.client_id
    }

    /// Counts what was received: `None` (the output stage dropped the request: the engine is
    /// gone) ends the stream.
    fn received(&mut self, output: Option<RequestOutput>) -> Option<RequestOutput> {
        match &output {
            Some(out) if out.finish_reason.is_some() => self.remaining = self.remaining.saturating_sub(1),
            Some(_) => {}
            None => self.remaining = 0,
        }
        output
    }

    /// Next output, or `None` once every sequence finished.
    pub async fn recv(&mut self) -> Option<RequestOutput> {
        if self.remaining == 0 {
            return None;
        }
        let output = self.rx.recv().await;
        self.received(output)
    }

    /// As [`RequestStream::recv`], blocking the calling (non-async) thread.
    pub fn blocking_recv(&mut self) -> Option<RequestOutput> {
        if self.remaining == 0 {
            return None;
        }
        let output = self.rx.blocking_recv();
        self.received(output)
    }

    /// Aborts the request now.
    pub fn abort(&mut self) {
        if self.remaining > 0 {
            let _ = self.abort_tx.send(Command::Abort { client_id: self.client_id });
            let _ = self.outputs_tx.send(OutputEvent::Forget { client_id: self.client_id });
            self.remaining = 0;
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.abort();
    }
}
