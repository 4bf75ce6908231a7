//! The engine thread: owns the scheduler, the runner and every sequence's sampling state, and
//! runs the step loop. A step reads as what it does: schedule (or take the step launched
//! ahead), launch, collect, update. Building the batch lives in `launch.rs`, applying the
//! answer in `update.rs`, the token masks of grammar-constrained sequences in `masks.rs`; text and stop strings are the output stage's (`output_stage.rs`, a
//! thread of its own), which every output goes to and which tells the engine of stop strings on
//! a channel of its own.
//!
//! The thread ends once the command channel is closed (every handle and stream gone) and no
//! request is unfinished; the output stage's channel keeps nothing alive.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use ferrolm_model::ModelRunner;
use ferrolm_sampling::{RequestSampler, TokenMasks};
use ferrolm_structured::Constraint;

use super::admission::{Load, PendingLoad};
use super::handle::{Command, EngineConfig, EngineError, GenerateRequest};
use super::launch::Launched;
use super::output_stage::{OutputEvent, OutputSender};
use super::state::{EngineStats, PromptLogprob, RequestOutput};
use crate::kv::KvCacheGroupConfig;
use crate::request::{FinishReason, Request, RequestId};
use crate::scheduler::{Scheduler, SchedulerError};

/// Sequence ids are the client id shifted left by this, plus the sequence index (`n <= 256`).
const SEQ_BITS: u32 = 8;

fn sequence_id(client_id: u64, index: u32) -> RequestId {
    RequestId((client_id << SEQ_BITS) | u64::from(index))
}

/// Per-sequence state that lives as long as the sequence, across preemptions.
pub(super) struct Sequence {
    pub(super) client_id: u64,
    pub(super) index: u32,
    /// To the output stage.
    pub(super) tx: OutputSender,
    pub(super) sampler: RequestSampler,
    /// Where the output is in its grammar, for a constrained request: every sampled token is
    /// advanced into it before the next mask is computed.
    pub(super) constraint: Option<Constraint>,
    pub(super) num_prompt_tokens: usize,
    pub(super) wants_logprobs: bool,
    /// `Some` while prompt logprobs are wanted and not yet sent.
    pub(super) prompt_logprobs: Option<PromptLogprobs>,
    pub(super) num_cached_tokens: usize,
}

/// Prompt logprobs being gathered, filled as prompt chunks run (again after a preemption, with
/// the same values).
pub(super) struct PromptLogprobs {
    pub(super) num_top: usize,
    pub(super) prompt: Vec<u32>,
    /// One entry per prompt token; the first stays `None`.
    pub(super) values: Vec<PromptLogprob>,
}

/// What `Command::Add` says of a client request besides the request itself.
struct NewClient {
    client_id: u64,
    group: u64,
    max_tokens: usize,
}

/// One client request's sequences still live, and the load it reserved until they end.
struct Client {
    ids: Vec<RequestId>,
    load: Load,
}

pub(crate) struct Engine {
    pub(super) scheduler: Scheduler,
    pub(super) runner: Box<dyn ModelRunner>,
    pub(super) block_size: usize,
    pub(super) eos_token_ids: Vec<u32>,
    pub(super) sequences: HashMap<RequestId, Sequence>,
    /// Client id -> its live sequences.
    clients: HashMap<u64, Client>,
    rx: mpsc::Receiver<Command>,
    /// `Command::StopSequence` from the output stage.
    stops: mpsc::Receiver<Command>,
    /// To the output stage, for every request's outputs.
    outputs: mpsc::Sender<OutputEvent>,
    pub(super) stats: Arc<EngineStats>,
    pending: Arc<PendingLoad>,
    /// Launch each step that can be scheduled ahead while the one before runs.
    overlap_steps: bool,
    /// The token masks of the last masked step, kept for the next one's rows.
    pub(super) masks: TokenMasks,
    /// The step launched ahead of the one being applied, collected by the next `step()`.
    pub(super) ahead: Option<Launched>,
    /// When the last step was collected with none launched ahead: the device idles from then
    /// until the next launch (`EngineStats::host_gap_us`).
    pub(super) idle_since: Option<Instant>,
    /// When the last step was collected, while steps run back to back (`EngineStats::step_times`).
    pub(super) last_collect: Option<Instant>,
}

/// The engine thread's channels.
pub(crate) struct Channels {
    /// From the handles and streams; closed when they are all gone.
    pub(crate) commands: mpsc::Receiver<Command>,
    /// From the output stage: stop strings that matched.
    pub(crate) stops: mpsc::Receiver<Command>,
    pub(crate) outputs: mpsc::Sender<OutputEvent>,
}

impl Engine {
    pub(crate) fn new(
        mut runner: Box<dyn ModelRunner>,
        config: &EngineConfig,
        channels: Channels,
        stats: Arc<EngineStats>,
        pending: Arc<PendingLoad>,
    ) -> Result<Engine, EngineError> {
        let groups = &config.scheduler.kv_cache_groups;
        let windows: Vec<Option<usize>> = groups.iter().map(|g| g.sliding_window).collect();
        let model_windows = runner.config().kv_cache_windows();
        if windows != model_windows {
            let message = format!("KV cache groups of windows {windows:?}, the model's are {model_windows:?}");
            return Err(SchedulerError::InvalidConfig(message).into());
        }
        let scheduler = Scheduler::new(config.scheduler.clone())?;
        let num_cache_blocks: Vec<usize> = groups.iter().map(KvCacheGroupConfig::num_cache_blocks).collect();
        runner
            .allocate_kv_cache(&num_cache_blocks, config.scheduler.block_size)
            .map_err(|e| EngineError::Device(e.to_string()))?;
        stats.num_blocks.store(groups[0].num_blocks as u64, Ordering::Relaxed);
        Ok(Engine {
            scheduler,
            runner,
            block_size: config.scheduler.block_size,
            eos_token_ids: config.eos_token_ids.clone(),
            sequences: HashMap::new(),
            clients: HashMap::new(),
            rx: channels.commands,
            stops: channels.stops,
            outputs: channels.outputs,
            stats,
            pending,
            overlap_steps: config.overlap_steps,
            masks: TokenMasks::default(),
            ahead: None,
            idle_since: None,
            last_collect: None,
        })
    }

    pub(crate) fn run(mut self) {
        loop {
            // Block when idle (nothing left to run or to collect); otherwise take whatever
            // arrived since the last step.
            if !self.scheduler.has_unfinished_requests() && self.ahead.is_none() {
                // Waiting for work is not the host's time between steps, nor part of a step.
                self.idle_since = None;
                self.last_collect = None;
                match self.rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return,
                }
            }
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) if self.scheduler.has_unfinished_requests() => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            // NOTE: only while requests run: when idle, every sequence a stop could name is over.
            while let Ok(cmd) = self.stops.try_recv() {
                self.handle(cmd);
            }
            self.step();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Add { client_id, group, request, max_tokens } => {
                self.add(NewClient { client_id, group, max_tokens }, request)
            }
            Command::Abort { client_id } => self.finish_client(client_id, None),
            Command::StopSequence { client_id, index } => self.stop_sequence(sequence_id(client_id, index)),
        }
    }

    fn add(&mut self, new: NewClient, request: GenerateRequest) {
        let NewClient { client_id, group, max_tokens } = new;
        let GenerateRequest { prompt_token_ids, params, grammar } = request;
        let load = Load::of_prompt(prompt_token_ids.len(), params.n);
        let tx = OutputSender::new(client_id, self.outputs.clone());
        let mut stop_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_ids.extend(&self.eos_token_ids);
        }
        let mut ids = Vec::new();
        for index in 0..params.n {
            let id = sequence_id(client_id, index);
            let seq = RequestSampler::for_sequence(&params, &prompt_token_ids, client_id, index as u64)
                .map_err(EngineError::from)
                .map(|mut sampler| {
                    if grammar.is_some() {
                        sampler.constrain();
                    }
                    sampler
                })
                .map(|sampler| Sequence {
                    client_id,
                    index,
                    tx: tx.clone(),
                    sampler,
                    constraint: grammar.as_ref().map(|g| g.start()),
                    num_prompt_tokens: prompt_token_ids.len(),
                    wants_logprobs: params.logprobs.is_some(),
                    prompt_logprobs: match params.prompt_logprobs {
                        Some(n) if index == 0 => Some(PromptLogprobs {
                            num_top: n as usize,
                            prompt: prompt_token_ids.clone(),
                            values: vec![None; prompt_token_ids.len()],
                        }),
                        _ => None,
                    },
                    num_cached_tokens: 0,
                });
            let req = Request::new(id, prompt_token_ids.clone(), max_tokens)
                .with_stop_token_ids(stop_ids.clone())
                .with_min_tokens(params.min_tokens as usize)
                .with_prompt_logprobs(params.prompt_logprobs.is_some() && index == 0)
                .with_group(group);
            match seq.and_then(|seq| self.scheduler.add_request(req).map(|()| seq).map_err(EngineError::from)) {
                Ok(seq) => {
                    self.sequences.insert(id, seq);
                    ids.push(id);
                }
                Err(err) => {
                    // Validated by the handle; reaching this is an engine fault. End the stream:
                    // every sequence gets its end, the ones added (by `finish_client`) and the
                    // ones not, so that none looks like an engine that stopped.
                    tracing_error(&err);
                    self.clients.insert(client_id, Client { ids, load });
                    self.finish_client(client_id, Some(FinishReason::Abort));
                    for index in index..params.n {
                        let _ = tx.send(RequestOutput {
                            index,
                            finish_reason: Some(FinishReason::Abort),
                            ..Default::default()
                        });
                    }
                    return;
                }
            }
        }
        self.clients.insert(client_id, Client { ids, load });
    }

    /// Ends every sequence of a client (an abort when `reason` is `None`: nothing is sent).
    pub(super) fn finish_client(&mut self, client_id: u64, reason: Option<FinishReason>) {
        let Some(client) = self.clients.remove(&client_id) else { return };
        for id in client.ids {
            self.scheduler.abort(id);
            if let Some(seq) = self.sequences.remove(&id) {
                if let Some(reason) = reason {
                    let _ = seq.tx.send(RequestOutput {
                        index: seq.index,
                        finish_reason: Some(reason),
                        ..Default::default()
                    });
                }
            }
        }
        self.pending.release(client.load);
    }

    /// A stop string ended a sequence in the output stage, which has sent its last output: end
    /// it here too, sending nothing (tokens sampled for it since are dropped there).
    fn stop_sequence(&mut self, id: RequestId) {
        self.scheduler.finish_request(id, FinishReason::Stop);
        self.retire(id);
    }

    /// A sequence finished: forget it, and the client once all of its sequences did.
    pub(super) fn retire(&mut self, id: RequestId) {
        let Some(seq) = self.sequences.remove(&id) else { return };
        if let Some(client) = self.clients.get_mut(&seq.client_id) {
            client.ids.retain(|&s| s != id);
            if client.ids.is_empty() {
                self.pending.release(client.load);
                self.clients.remove(&seq.client_id);
            }
        }
    }

    /// One step: schedule it (or take the one launched ahead), launch the next one ahead where
    /// the scheduler can already tell what it is, collect this one's answer and update from it.
    /// With a step ahead in flight, the device runs it while the host updates from this one.
    ///
    /// Token masks: a step's masks are set once the tokens before it are advanced into their
    /// grammars, while its forward pass runs: after the update for a step launched ahead, at
    /// once for one launched now. Either way before the next launch, which may read its tokens.
    fn step(&mut self) {
        let Some(mut launched) = self.ahead.take().or_else(|| self.schedule_and_launch()) else { return };
        self.set_token_masks(&mut launched);
        if self.overlap_steps && !launched.masks_failed {
            self.ahead = self.launch_ahead(&launched);
        }
        if let Some(answer) = self.collect(launched) {
            self.update(answer);
        }
        if let Some(mut ahead) = self.ahead.take() {
            self.set_token_masks(&mut ahead);
            self.ahead = Some(ahead);
        }
    }

    pub(super) fn publish_stats(&self) {
        let s = self.scheduler.stats();
        self.stats.num_running.store(s.num_running as u64, Ordering::Relaxed);
        self.stats.num_waiting.store(s.num_waiting as u64, Ordering::Relaxed);
        self.stats.set_kv_usage(s.kv_cache_usage);
        self.stats.prefix_cache_queries.store(s.prefix_cache.queries, Ordering::Relaxed);
        self.stats.prefix_cache_hits.store(s.prefix_cache.hits, Ordering::Relaxed);
        self.stats.num_preemptions.store(s.num_preemptions, Ordering::Relaxed);
    }
}

pub(super) fn tracing_error(err: &EngineError) {
    tracing::error!(%err, "engine fault");
}
