//! The engine loop: one step = schedule, build the flattened batch, run the model, sample,
//! update the scheduler, emit outputs, free what finished.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use ferrolm_model::{ModelInput, ModelRunner};
use ferrolm_sampling::{RequestSampler, RowRequest, SamplePlan, StopChecker, TokenLogprobs};
use ferrolm_tokenizer::{IncrementalDetokenizer, Tokenizer};
use tokio::sync::mpsc as tokio_mpsc;

use super::handle::{Command, EngineConfig, EngineError, GenerateRequest};
use super::state::{EngineStats, PromptLogprob, RequestOutput};
use crate::request::{FinishReason, Request, RequestId, RequestStatus};
use crate::scheduler::{ScheduledRequest, Scheduler, SchedulerOutput, UNKNOWN_TOKEN};

/// Sequence ids are the client id shifted left by this, plus the sequence index (`n <= 256`).
const SEQ_BITS: u32 = 8;

/// Per-sequence state that lives as long as the sequence, across preemptions.
struct Sequence {
    client_id: u64,
    index: u32,
    tx: tokio_mpsc::UnboundedSender<RequestOutput>,
    sampler: RequestSampler,
    /// `None` when the engine runs without a tokenizer.
    detokenizer: Option<IncrementalDetokenizer>,
    stop: StopChecker,
    num_prompt_tokens: usize,
    wants_logprobs: bool,
    /// `Some` while prompt logprobs are wanted and not yet sent.
    prompt_logprobs: Option<PromptLogprobs>,
    num_cached_tokens: usize,
}

pub(crate) struct Engine {
    scheduler: Scheduler,
    runner: Box<dyn ModelRunner>,
    block_size: usize,
    tokenizer: Option<Arc<Tokenizer>>,
    eos_token_ids: Vec<u32>,
    sequences: HashMap<RequestId, Sequence>,
    /// Client id -> its live sequence ids.
    clients: HashMap<u64, Vec<RequestId>>,
    rx: mpsc::Receiver<Command>,
    stats: Arc<EngineStats>,
    pending: Arc<AtomicUsize>,
    /// Launch each step that can be scheduled ahead while the one before runs.
    overlap_steps: bool,
    /// The step launched ahead of the one being applied, collected by the next `step()`.
    ahead: Option<Launched>,
    /// When the last step was collected with none launched ahead: the device idles from then
    /// until the next launch (`EngineStats::host_gap_us`).
    idle_since: Option<Instant>,
    /// When the last step was collected, while steps run back to back (`EngineStats::step_times`).
    last_collect: Option<Instant>,
}

/// Prompt logprobs being gathered, filled as prompt chunks run (again after a preemption, with
/// the same values).
struct PromptLogprobs {
    num_top: usize,
    prompt: Vec<u32>,
    /// One entry per prompt token; the first stays `None`.
    values: Vec<PromptLogprob>,
}

/// A step launched on the runner whose answer is not collected yet.
struct Launched {
    out: SchedulerOutput,
    /// Per scheduled request: whether all its rows' logits are in the answer (prompt logprobs).
    all_rows: Vec<bool>,
    num_rows: usize,
}

/// A token sampled this step, waiting to be emitted.
struct Sampled {
    id: RequestId,
    logprobs: TokenLogprobs,
}

impl Engine {
    pub(crate) fn new(
        mut runner: Box<dyn ModelRunner>,
        tokenizer: Option<Arc<Tokenizer>>,
        config: &EngineConfig,
        rx: mpsc::Receiver<Command>,
        stats: Arc<EngineStats>,
        pending: Arc<AtomicUsize>,
    ) -> Result<Engine, EngineError> {
        let scheduler = Scheduler::new(config.scheduler.clone())?;
        runner
            .allocate_kv_cache(config.scheduler.num_blocks, config.scheduler.block_size)
            .map_err(|e| EngineError::Device(e.to_string()))?;
        stats.num_blocks.store(config.scheduler.num_blocks as u64, Ordering::Relaxed);
        Ok(Engine {
            scheduler,
            runner,
            block_size: config.scheduler.block_size,
            tokenizer,
            eos_token_ids: config.eos_token_ids.clone(),
            sequences: HashMap::new(),
            clients: HashMap::new(),
            rx,
            stats,
            pending,
            overlap_steps: config.overlap_steps,
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
            self.step();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Add { client_id, request, tx } => self.add(client_id, request, tx),
            Command::Abort { client_id } => self.finish_client(client_id, None),
        }
    }

    fn add(&mut self, client_id: u64, request: GenerateRequest, tx: tokio_mpsc::UnboundedSender<RequestOutput>) {
        let GenerateRequest { prompt_token_ids, params } = request;
        let mut stop_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_ids.extend(&self.eos_token_ids);
        }
        let max_tokens = params.max_tokens.unwrap_or(1) as usize;
        let mut ids = Vec::new();
        for index in 0..params.n {
            let id = RequestId((client_id << SEQ_BITS) | index as u64);
            let seq = RequestSampler::for_sequence(&params, &prompt_token_ids, client_id, index as u64)
                .map_err(EngineError::from)
                .and_then(|sampler| {
                    let detokenizer = match &self.tokenizer {
                        Some(tokenizer) => Some(
                            IncrementalDetokenizer::new(
                                Arc::clone(tokenizer),
                                &prompt_token_ids,
                                params.skip_special_tokens,
                            )
                            .map_err(|_| EngineError::Stopped)?,
                        ),
                        None => None,
                    };
                    Ok(Sequence {
                        client_id,
                        index,
                        tx: tx.clone(),
                        sampler,
                        detokenizer,
                        stop: StopChecker::new(&params.stop),
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
                    })
                });
            let req = Request::new(id, prompt_token_ids.clone(), max_tokens)
                .with_stop_token_ids(stop_ids.clone())
                .with_min_tokens(params.min_tokens as usize)
                .with_prompt_logprobs(params.prompt_logprobs.is_some() && index == 0);
            match seq.and_then(|seq| self.scheduler.add_request(req).map(|()| seq).map_err(EngineError::from)) {
                Ok(seq) => {
                    self.sequences.insert(id, seq);
                    ids.push(id);
                }
                Err(err) => {
                    // Validated by the handle; reaching this is an engine fault. End the stream.
                    tracing_error(&err);
                    self.clients.insert(client_id, ids);
                    self.finish_client(client_id, Some(FinishReason::Abort));
                    let _ = tx.send(RequestOutput { finish_reason: Some(FinishReason::Abort), ..Default::default() });
                    return;
                }
            }
        }
        self.clients.insert(client_id, ids);
    }

    /// Ends every sequence of a client (an abort when `reason` is `None`: nothing is sent).
    fn finish_client(&mut self, client_id: u64, reason: Option<FinishReason>) {
        let Some(ids) = self.clients.remove(&client_id) else { return };
        for id in ids {
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
        self.pending.fetch_sub(1, Ordering::AcqRel);
    }

    /// A sequence finished: forget it, and the client once all of its sequences did.
    fn retire(&mut self, id: RequestId) {
        let Some(seq) = self.sequences.remove(&id) else { return };
        if let Some(ids) = self.clients.get_mut(&seq.client_id) {
            ids.retain(|&s| s != id);
            if ids.is_empty() {
                self.clients.remove(&seq.client_id);
                self.pending.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// One step: launch it (or take the one launched ahead), launch the next one ahead where
    /// the scheduler can already tell what it is, then collect this one's answer and apply it.
    /// With a step ahead in flight, the device runs it while the host applies this one.
    fn step(&mut self) {
        let launched = match self.ahead.take() {
            Some(launched) => launched,
            None => {
                let out = self.scheduler.schedule();
                if out.is_empty() {
                    self.last_collect = None;
                    self.publish_stats();
                    return;
                }
                match self.launch(out, None) {
                    Some(launched) => launched,
                    None => return,
                }
            }
        };
        if self.overlap_steps {
            self.ahead = self.launch_ahead(&launched);
        }
        self.finish(launched);
    }

    /// Launches the step after `current` before its tokens are known, when every request that
    /// samples in it plans its next token without them (no penalties), none wants prompt logprobs,
    /// and the scheduler can schedule ahead (see `Scheduler::schedule_ahead`).
    fn launch_ahead(&mut self, current: &Launched) -> Option<Launched> {
        if current.all_rows.iter().any(|&all| all) {
            return None;
        }
        let plans_ahead = current.out.scheduled.iter().all(|s| {
            self.sequences.get(&s.request_id).is_none_or(|q| !s.samples_next_token || q.sampler.plans_ahead())
        });
        if !plans_ahead {
            return None;
        }
        // Without prompt-logprob rows, each request's sampled row is its one row.
        let mut rows = HashMap::with_capacity(current.out.scheduled.len());
        let mut row = 0u32;
        for s in &current.out.scheduled {
            if s.samples_next_token {
                rows.insert(s.request_id, row);
                row += 1;
            }
        }
        let next = self.scheduler.schedule_ahead()?;
        let launched = self.launch(next, Some(&rows))?;
        self.stats.num_steps_ahead.fetch_add(1, Ordering::Relaxed);
        Some(launched)
    }

    /// Builds `out`'s batch and row requests and launches it. `previous_rows`: for a step
    /// scheduled ahead, the logits row of the step before that samples each request's token.
    /// `None` when the launch failed: the step's requests are aborted.
    fn launch(&mut self, out: SchedulerOutput, previous_rows: Option<&HashMap<RequestId, u32>>) -> Option<Launched> {
        let block_size = self.block_size;
        let mut input = ModelInput::default();
        // Per scheduled request: whether all its rows' logits are in the output (prompt logprobs).
        let mut all_rows = Vec::with_capacity(out.scheduled.len());
        for s in &out.scheduled {
            let wants_prompt = self
                .sequences
                .get(&s.request_id)
                .is_some_and(|q| q.prompt_logprobs.is_some() && s.num_computed_tokens + 1 < q.num_prompt_tokens);
            if s.is_new {
                if let (Some(seq), Some(req)) =
                    (self.sequences.get_mut(&s.request_id), self.scheduler.request(s.request_id))
                {
                    seq.num_cached_tokens = req.num_cached_tokens().unwrap_or(0);
                }
            }
            let table = s.block_ids();
            input.push_request(
                &s.token_ids,
                s.num_computed_tokens,
                &table,
                block_size,
                s.samples_next_token,
                wants_prompt,
            );
            if let Some(&row) = previous_rows.and_then(|rows| rows.get(&s.request_id)) {
                // The step's one token, scheduled ahead: the one the step before samples.
                input.previous_tokens.push((input.num_tokens() as u32 - 1, row));
            }
            all_rows.push(wants_prompt);
        }
        debug_assert!(
            input.token_ids.iter().filter(|&&t| t == UNKNOWN_TOKEN).count() <= input.previous_tokens.len(),
            "a token scheduled ahead without the row that samples it"
        );
        // What each logits row is for: the next prompt token's logprobs for prompt logprob rows,
        // and one plan per request that samples (its uniform drawn now).
        let eos_token_ids = &self.eos_token_ids;
        // A request with a token in flight plans the step after it.
        let in_flight = |id| previous_rows.is_some_and(|rows| rows.contains_key(id));
        let plans: Vec<Option<SamplePlan>> = out
            .scheduled
            .iter()
            .map(|s| match self.sequences.get_mut(&s.request_id) {
                Some(seq) if s.samples_next_token && in_flight(&s.request_id) => {
                    Some(seq.sampler.plan_ahead(eos_token_ids))
                }
                Some(seq) if s.samples_next_token => Some(seq.sampler.plan(eos_token_ids)),
                _ => None,
            })
            .collect();
        let mut rows = Vec::with_capacity(input.logits_indices.len());
        for ((s, &all), plan) in out.scheduled.iter().zip(&all_rows).zip(&plans) {
            if all {
                let prompt = self.sequences.get(&s.request_id).and_then(|q| q.prompt_logprobs.as_ref());
                for i in 0..s.num_scheduled_tokens - usize::from(s.samples_next_token) {
                    let next = prompt.and_then(|p| Some((*p.prompt.get(s.num_computed_tokens + i + 1)?, p.num_top)));
                    rows.push(next.map_or(UNUSED_ROW, |(token, num_top)| RowRequest::Logprobs { token, num_top }));
                }
            }
            if s.samples_next_token {
                rows.push(plan.as_ref().map_or(UNUSED_ROW, RowRequest::Sample));
            }
        }
        let launched = self.runner.launch(&input, &rows);
        // A step launched with nothing in flight found the device idle since the last collect.
        if let (None, Some(idle_since)) = (previous_rows, self.idle_since.take()) {
            let gap = u64::try_from(idle_since.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.stats.host_gap_us.fetch_add(gap, Ordering::Relaxed);
        }
        match launched {
            Ok(()) => Some(Launched { out, all_rows, num_rows: rows.len() }),
            Err(err) => {
                self.abort_step(&out, &err.to_string());
                None
            }
        }
    }

    /// The step's KV writes may be incomplete: every request in it is aborted.
    fn abort_step(&mut self, out: &SchedulerOutput, err: &str) {
        tracing_error(&EngineError::Device(err.to_string()));
        for s in &out.scheduled {
            self.scheduler.finish_request(s.request_id, FinishReason::Abort);
            self.send_final(s.request_id, FinishReason::Abort);
        }
        self.publish_stats();
    }

    /// Collects `launched`'s answer and applies it: sampled tokens go to the scheduler and the
    /// clients, prompt logprobs are recorded, finished requests retire.
    fn finish(&mut self, launched: Launched) {
        let Launched { out, all_rows, num_rows } = launched;
        let collected = self.runner.collect();
        let now = Instant::now();
        // Tokens of prompt chunks (every scheduled token of a request that does not sample, or
        // samples after more than one).
        let prompt_tokens: u64 = out
            .scheduled
            .iter()
            .filter(|s| !s.samples_next_token || s.num_scheduled_tokens > 1)
            .map(|s| s.num_scheduled_tokens as u64)
            .sum();
        if self.ahead.is_none() {
            self.idle_since = Some(now);
        }
        if let Some(previous) = self.last_collect.replace(now) {
            let micros = u64::try_from((now - previous).as_micros()).unwrap_or(u64::MAX);
            self.stats.step_times.record(out.scheduled.len(), prompt_tokens > 0, micros);
        }
        let collected = collected.map_err(|e| e.to_string()).and_then(|results| {
            if results.len() == num_rows {
                Ok(results)
            } else {
                Err(format!("the runner answered {} of {num_rows} logits rows", results.len()))
            }
        });
        let mut results = match collected {
            Ok(results) => results,
            Err(err) => {
                self.abort_step(&out, &err);
                // Nothing of the step is left in flight; a step launched ahead takes its place.
                if let Err(err) = self.scheduler.update_from_output(&[]) {
                    tracing_error(&EngineError::from(err));
                }
                return;
            }
        };

        let mut sampled = Vec::new();
        let mut failed = Vec::new();
        let mut row = 0;
        for (s, &all) in out.scheduled.iter().zip(&all_rows) {
            let count = if all { s.num_scheduled_tokens } else { usize::from(s.samples_next_token) };
            let Some(seq) = self.sequences.get_mut(&s.request_id) else {
                row += count;
                continue;
            };
            if all {
                let prompt_rows = count - usize::from(s.samples_next_token);
                record_prompt_logprobs(seq, s, &mut results[row..row + prompt_rows]);
            }
            if s.samples_next_token {
                match results[row + count - 1].take() {
                    Some(logprobs) => {
                        seq.sampler.record(logprobs.token);
                        sampled.push(Sampled { id: s.request_id, logprobs });
                    }
                    None => failed.push(s.request_id),
                }
            }
            row += count;
        }
        self.stats.prompt_tokens.fetch_add(prompt_tokens, Ordering::Relaxed);
        self.stats.generation_tokens.fetch_add(sampled.len() as u64, Ordering::Relaxed);
        for id in failed {
            self.scheduler.finish_request(id, FinishReason::Abort);
            self.send_final(id, FinishReason::Abort);
        }

        let tokens: Vec<(RequestId, Vec<u32>)> = sampled.iter().map(|s| (s.id, vec![s.logprobs.token])).collect();
        let finished: HashMap<RequestId, FinishReason> = match self.scheduler.update_from_output(&tokens) {
            Ok(reqs) => reqs
                .iter()
                .filter_map(|r| match r.status() {
                    RequestStatus::Finished(f) => Some((r.request_id(), f)),
                    _ => None,
                })
                .collect(),
            Err(err) => {
                tracing_error(&EngineError::from(err));
                HashMap::new()
            }
        };
        for s in sampled {
            let reason = finished.get(&s.id).copied();
            self.emit(s, reason);
        }
        self.stats.num_steps.fetch_add(1, Ordering::Relaxed);
        self.publish_stats();
    }

    /// Detokenizes, applies stop strings and sends one step's output of a sequence.
    fn emit(&mut self, sampled: Sampled, mut finish: Option<FinishReason>) {
        let id = sampled.id;
        let Some(seq) = self.sequences.get_mut(&id) else { return };
        let token = sampled.logprobs.token;
        let mut delta = String::new();
        if let Some(detokenizer) = seq.detokenizer.as_mut() {
            delta = detokenizer.push(token).unwrap_or_default();
            if finish.is_some() {
                delta.push_str(&detokenizer.finish().unwrap_or_default());
            }
        }
        let result = seq.stop.push(&delta);
        let mut text = result.emit;
        if result.stopped {
            if finish.is_none() {
                self.scheduler.finish_request(id, FinishReason::Stop);
            }
            finish = Some(FinishReason::Stop);
        } else if finish.is_some() {
            text.push_str(&seq.stop.flush());
        }
        let prompt_logprobs = seq.prompt_logprobs.take().map(|p| p.values);
        let output = RequestOutput {
            index: seq.index,
            token_ids: vec![token],
            text,
            logprobs: if seq.wants_logprobs { vec![sampled.logprobs] } else { Vec::new() },
            prompt_logprobs,
            finish_reason: finish,
            num_prompt_tokens: seq.num_prompt_tokens,
            num_cached_tokens: seq.num_cached_tokens,
        };
        let client_gone = seq.tx.send(output).is_err();
        if finish.is_some() {
            self.retire(id);
        } else if client_gone {
            let client = seq.client_id;
            self.finish_client(client, None);
        }
    }

    fn send_final(&mut self, id: RequestId, reason: FinishReason) {
        if let Some(seq) = self.sequences.get(&id) {
            let _ = seq.tx.send(RequestOutput { index: seq.index, finish_reason: Some(reason), ..Default::default() });
        }
        self.retire(id);
    }

    fn publish_stats(&self) {
        let s = self.scheduler.stats();
        self.stats.num_running.store(s.num_running as u64, Ordering::Relaxed);
        self.stats.num_waiting.store(s.num_waiting as u64, Ordering::Relaxed);
        self.stats.set_kv_usage(s.kv_cache_usage);
        self.stats.prefix_cache_queries.store(s.prefix_cache.queries, Ordering::Relaxed);
        self.stats.prefix_cache_hits.store(s.prefix_cache.hits, Ordering::Relaxed);
        self.stats.num_preemptions.store(s.num_preemptions, Ordering::Relaxed);
    }
}

/// A row nothing is wanted from (its request has no sequence any more); its result is dropped.
const UNUSED_ROW: RowRequest<'static> = RowRequest::Logprobs { token: u32::MAX, num_top: 0 };

/// Stores the logprob of each prompt token that the rows of this chunk predict (`results`: the
/// chunk's rows from its first, each predicting the token after it).
fn record_prompt_logprobs(seq: &mut Sequence, s: &ScheduledRequest, results: &mut [Option<TokenLogprobs>]) {
    let Some(p) = seq.prompt_logprobs.as_mut() else { return };
    for (i, result) in results.iter_mut().enumerate() {
        let next = s.num_computed_tokens + i + 1;
        if next < p.prompt.len() {
            p.values[next] = result.take();
        }
    }
}

fn tracing_error(err: &EngineError) {
    tracing::error!(%err, "engine fault");
}
