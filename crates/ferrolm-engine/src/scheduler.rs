//! Token-budget scheduling with continuous batching over the paged KV cache.
//!
//! There is no prefill or decode phase. Each request has `num_computed_tokens`, and each step
//! it is given `min(budget left, num_tokens - num_computed_tokens)` tokens (also capped by
//! `long_prefill_token_threshold`), where `num_tokens` counts the prompt and the outputs so far.
//! A long prompt thus runs in chunks beside other requests' decodes, and a prefix-cache hit
//! simply starts a request with tokens already computed.
//!
//! Order: running requests first, in the order they were admitted; then waiting ones while the
//! budget, `max_num_seqs` and the free blocks allow: preempted ones first, then the others taking
//! turns by client request (a group: its prompts times `n`), each group in arrival order (see
//! `waiting.rs`), so one huge client request cannot starve the ones that come after it. A
//! waiting request that does not fit stops admission: nobody behind it jumps the queue.
//!
//! Logits rows: a request that asks for prompt logprobs needs every prompt row's logits, so its
//! prompt chunks share a budget of [`SchedulerConfig::prompt_logprob_rows`] rows a step, and a
//! step's logits rows stay within [`SchedulerConfig::max_logits_rows`] (the runner's logits
//! buffer is sized for that, not for a whole token budget of rows).
//!
//! Preemption by recompute: when a running request cannot get blocks, the newest running
//! request loses all of its blocks and goes back to the front of the waiting queue with
//! `num_computed_tokens = 0` (its outputs kept), and the allocation is retried; the newest may
//! be the request itself. No waiting request is admitted in a step that preempted.
//!
//! Invariants, between steps and after `schedule()`:
//! - Every live request is in exactly one of `waiting` (status Waiting or Preempted, no blocks,
//!   nothing computed) and `running` (status Running, holding blocks);
//!   `running.len() <= max_num_seqs`, but for requests that end with the step in flight while a
//!   step is scheduled ahead.
//! - The oldest running request progresses in every step: everyone newer can be preempted for
//!   it, and `add_request` accepts only requests that fit the pool on their own. Hence every
//!   request finishes.
//!
//! Step protocol: `schedule()`, run the batch, then `update_from_output()` with the sampled
//! tokens. Only then do computed tokens advance and full blocks enter the prefix cache, so no
//! request can hit a block whose K and V are not written yet, and only then do sliding-window
//! groups release the blocks their windows have passed (`kv::group`), so no step in flight
//! loses a block it reads. Calling `schedule()` again without an update drops the previous step:
//! its tokens are scheduled anew.
//!
//! Scheduling ahead: while a step runs, `schedule_ahead()` may schedule the next one before the
//! step's tokens are known, taking them as computed (see there). Its decodes' tokens are
//! [`UNKNOWN_TOKEN`]: the runner takes them from the step before. The next `update_from_output()` applies the step in flight and makes
//! the one scheduled ahead the step in flight; `schedule()` is not called in between.

mod config;
mod output;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
mod waiting;

use std::collections::HashMap;

pub use config::{SchedulerConfig, BLOCK_SIZE};
pub use output::{ScheduledRequest, SchedulerOutput, UNKNOWN_TOKEN};

use crate::kv::{BlockId, ComputedBlocks, KvCacheManager, PrefixCacheStats};
use crate::request::{FinishReason, Request, RequestId, RequestStatus};
use waiting::WaitingQueue;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    #[error("invalid scheduler config: {0}")]
    InvalidConfig(String),
    #[error("request {0} is already queued or running")]
    DuplicateRequest(RequestId),
    #[error("request {0} has an empty prompt")]
    EmptyPrompt(RequestId),
    #[error("request {0}: max_tokens must be at least 1")]
    ZeroMaxTokens(RequestId),
    #[error(
        "request {request_id}: prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) \
         exceeds the model's maximum length of {max_model_len} tokens"
    )]
    TooLong { request_id: RequestId, num_prompt_tokens: usize, max_tokens: usize, max_model_len: usize },
    #[error(
        "request {request_id} may need {num_blocks_needed} KV cache blocks but the pool has only \
         {num_blocks}; lower max_tokens or the prompt length"
    )]
    ExceedsKvCache { request_id: RequestId, num_blocks_needed: usize, num_blocks: usize },
    #[error("no sampled token for request {0}, which caught up with its tokens this step")]
    MissingSampledTokens(RequestId),
}

/// Snapshot of the scheduler's gauges and counters, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    /// Fraction of KV blocks held by requests, in the KV cache group where it is highest.
    pub kv_cache_usage: f64,
    pub prefix_cache: PrefixCacheStats,
    /// Preemptions since start.
    pub num_preemptions: u64,
}

#[derive(Clone, Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    requests: HashMap<RequestId, Request>,
    waiting: WaitingQueue,
    /// In admission order: the last one is the newest, the first to be preempted.
    running: Vec<RequestId>,
    /// `(request, num_scheduled_tokens)` of the step in flight, applied by
    /// `update_from_output`.
    in_flight: Vec<(RequestId, usize)>,
    /// `(request, num_scheduled_tokens)` of the step scheduled ahead of the one in flight, which
    /// becomes the step in flight at the next `update_from_output`.
    ahead: Vec<(RequestId, usize)>,
    next_arrival_index: u64,
    num_preemptions: u64,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Self, SchedulerError> {
        config.validate()?;
        let kv = KvCacheManager::new(&config.kv_cache_groups, config.block_size, config.enable_prefix_caching);
        Ok(Scheduler {
            config,
            kv,
            requests: HashMap::new(),
            waiting: WaitingQueue::default(),
            running: Vec::new(),
            in_flight: Vec::new(),
            ahead: Vec::new(),
            next_arrival_index: 0,
            num_preemptions: 0,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn kv_cache_manager(&self) -> &KvCacheManager {
        &self.kv
    }

    /// Queues a request, or rejects one that could never run: longer than `max_model_len`,
    /// or needing more blocks than a group's whole pool.
    pub fn add_request(&mut self, mut request: Request) -> Result<(), SchedulerError> {
        let request_id = request.request_id();
        if self.requests.contains_key(&request_id) {
            return Err(SchedulerError::DuplicateRequest(request_id));
        }
        if request.num_prompt_tokens() == 0 {
            return Err(SchedulerError::EmptyPrompt(request_id));
        }
        if request.max_tokens() == 0 {
            return Err(SchedulerError::ZeroMaxTokens(request_id));
        }
        let max_len = request.num_prompt_tokens() + request.max_tokens();
        if max_len > self.config.max_model_len {
            return Err(SchedulerError::TooLong {
                request_id,
                num_prompt_tokens: request.num_prompt_tokens(),
                max_tokens: request.max_tokens(),
                max_model_len: self.config.max_model_len,
            });
        }
        self.config.check_fits_kv_cache(request_id, request.num_prompt_tokens(), request.max_tokens())?;
        request.status = RequestStatus::Waiting;
        request.num_computed_tokens = 0;
        request.arrival_index = self.next_arrival_index;
        self.next_arrival_index += 1;
        self.waiting.push_back(request_id, request.group());
        self.requests.insert(request_id, request);
        Ok(())
    }

    /// Picks this step's requests and tokens and allocates their blocks.
    pub fn schedule(&mut self) -> SchedulerOutput {
        debug_assert!(self.ahead.is_empty(), "schedule() with a step scheduled ahead still to update");
        let mut budget = StepBudget::of(&self.config);
        let mut out = SchedulerOutput::default();

        let mut i = 0;
        while i < self.running.len() && budget.tokens > 0 {
            let id = self.running[i];
            let start = self.requests[&id].num_computed_tokens();
            let n = budget.tokens_for(&self.requests[&id], start, &self.config);
            if n == 0 {
                i += 1;
                continue;
            }
            let scheduled = loop {
                let none = ComputedBlocks::default();
                if let Some(tables) = self.kv.allocate_slots(&self.requests[&id], n, &none) {
                    break Some(tables.to_vec());
                }
                // `i < running.len()`, so there is always a newest one to take blocks from.
                let Some(victim) = self.running.pop() else {
                    break None;
                };
                self.preempt(victim);
                out.preempted.push(victim);
                if victim == id {
                    break None;
                }
            };
            let Some(tables) = scheduled else {
                // It preempted itself: it was the newest, nothing left behind it.
                break;
            };
            let req = &self.requests[&id];
            out.scheduled.push(scheduled_request(req, start, n, tables, false));
            budget.take(req, start, n);
            i += 1;
        }

        // NOTE: a step that had to preempt is short of blocks; admitting anyone now would only
        // set up the next preemption.
        if out.preempted.is_empty() {
            self.admit_waiting(&mut budget, &mut out, 0);
        }

        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget.tokens;
        self.in_flight = out.scheduled.iter().map(|s| (s.request_id, s.num_scheduled_tokens)).collect();
        out
    }

    /// Schedules the step after the one in flight before that step's tokens are known: what the
    /// next `schedule()` would give if nobody preempted, taking the tokens in flight as computed.
    /// Each running request goes on from after its tokens in flight: a request the step in
    /// flight catches up decodes the token it samples there (unknown yet), one in the middle of
    /// its prompt runs its next chunk; then waiting requests are admitted as `schedule()` admits
    /// them, into the seats of requests that surely end with the step in flight. Those (they
    /// reach `max_tokens` or `max_model_len`) are left out; one that ends on a stop token is
    /// dropped when that token arrives, and the runner's answer for it is ignored. `None`, with
    /// nothing changed, when the running requests' next tokens need more blocks than are free
    /// (the next `schedule()` preempts) or nothing would run.
    ///
    /// A decode scheduled ahead is one [`UNKNOWN_TOKEN`] at position `num_computed_tokens`: the
    /// token the step in flight samples for that request.
    pub fn schedule_ahead(&mut self) -> Option<SchedulerOutput> {
        if self.in_flight.is_empty() || !self.ahead.is_empty() {
            return None;
        }
        let in_flight: HashMap<RequestId, usize> = self.in_flight.iter().copied().collect();
        let mut budget = StepBudget::of(&self.config);
        // (request, first position, tokens, whether its one token is the unknown one)
        let mut plan = Vec::with_capacity(self.running.len());
        let mut num_new_blocks = 0;
        let mut leaving = 0;
        for &id in &self.running {
            if budget.tokens == 0 {
                break;
            }
            let req = &self.requests[&id];
            let start = req.num_computed_tokens() + in_flight.get(&id).copied().unwrap_or(0);
            let (n, unknown) = if start == req.num_tokens() {
                // Caught up by the step in flight: it decodes the token sampled there, if it goes on.
                if req.num_output_tokens() + 1 >= req.max_tokens() || start + 1 >= self.config.max_model_len {
                    leaving += 1;
                    continue;
                }
                (1, true)
            } else {
                (budget.tokens_for(req, start, &self.config), false)
            };
            if n == 0 {
                // Out of prompt-logprob rows this step.
                continue;
            }
            num_new_blocks += self.kv.num_blocks_to_cover(id, start + n);
            plan.push((id, start, n, unknown));
            budget.take(req, start, n);
        }
        // Every group's tables lack the same entries.
        if num_new_blocks > self.kv.num_free_blocks() {
            return None;
        }
        let mut out = SchedulerOutput::default();
        for (id, start, n, unknown) in plan {
            let tables = self.kv.allocate_ahead(id, start + n).expect("the free blocks were counted").to_vec();
            let token_ids = if unknown {
                vec![UNKNOWN_TOKEN]
            } else {
                self.requests[&id].all_token_ids()[start..start + n].to_vec()
            };
            let samples_next_token = unknown || start + n == self.requests[&id].num_tokens();
            out.scheduled.push(ScheduledRequest {
                request_id: id,
                num_computed_tokens: start,
                num_scheduled_tokens: n,
                token_ids,
                block_tables: tables,
                is_new: false,
                samples_next_token,
            });
        }
        self.admit_waiting(&mut budget, &mut out, leaving);
        if out.scheduled.is_empty() {
            return None;
        }
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget.tokens;
        self.ahead = out.scheduled.iter().map(|s| (s.request_id, s.num_scheduled_tokens)).collect();
        Some(out)
    }

    /// Admits waiting requests in order while the budget, the seats and the blocks allow; `leaving`
    /// running requests end with the step in flight (a step scheduled ahead), so their seats count
    /// as free.
    fn admit_waiting(&mut self, budget: &mut StepBudget, out: &mut SchedulerOutput, leaving: usize) {
        while budget.tokens > 0 && self.running.len() < self.config.max_num_seqs + leaving {
            let Some(id) = self.waiting.front() else {
                break;
            };
            let req = &self.requests[&id];
            let hit = self.kv.get_computed_blocks(req);
            let start = hit.num_computed_tokens();
            let n = budget.tokens_for(req, start, &self.config);
            if n == 0 {
                // Out of prompt-logprob rows: it waits for the next step, and nobody jumps it.
                break;
            }
            let Some(tables) = self.kv.allocate_slots(req, n, &hit) else {
                break;
            };
            let tables = tables.to_vec();
            self.waiting.pop_front();
            self.running.push(id);
            let Some(req) = self.requests.get_mut(&id) else {
                break;
            };
            req.status = RequestStatus::Running;
            req.num_computed_tokens = start;
            req.num_cached_tokens.get_or_insert(start);
            out.scheduled.push(scheduled_request(req, start, n, tables, true));
            budget.take(req, start, n);
        }
    }

    fn preempt(&mut self, request_id: RequestId) {
        self.kv.free(request_id);
        if let Some(req) = self.requests.get_mut(&request_id) {
            req.status = RequestStatus::Preempted;
            req.num_computed_tokens = 0;
            req.num_preemptions += 1;
        }
        self.waiting.push_front(request_id);
        self.num_preemptions += 1;
    }

    /// Applies the step in flight: computed tokens advance by what was scheduled, full blocks
    /// enter the prefix cache, and requests that caught up with their tokens get their sampled
    /// tokens (those of a partial prefill chunk are ignored). Finished requests (max_tokens,
    /// max_model_len, stop token) release their blocks at once and are returned. A step
    /// scheduled ahead becomes the step in flight.
    ///
    /// `sampled` must hold at least one token for every request whose `samples_next_token` was
    /// set; otherwise nothing changes and the error names the first one missing. Requests
    /// finished or aborted since `schedule()` are skipped.
    pub fn update_from_output(&mut self, sampled: &[(RequestId, Vec<u32>)]) -> Result<Vec<Request>, SchedulerError> {
        let sampled: HashMap<RequestId, &[u32]> = sampled.iter().map(|(id, t)| (*id, t.as_slice())).collect();
        for &(id, n) in &self.in_flight {
            let Some(req) = self.requests.get(&id) else {
                continue;
            };
            let catches_up = req.num_computed_tokens() + n >= req.num_tokens();
            if catches_up && sampled.get(&id).is_none_or(|t| t.is_empty()) {
                return Err(SchedulerError::MissingSampledTokens(id));
            }
        }

        let mut finished = Vec::new();
        let applied = std::mem::replace(&mut self.in_flight, std::mem::take(&mut self.ahead));
        for (id, n) in applied {
            let Some(req) = self.requests.get_mut(&id) else {
                continue;
            };
            req.num_computed_tokens += n;
            self.kv.cache_blocks(req, req.num_computed_tokens);
            // NOTE: the step scheduled ahead, now in flight, starts at the new computed tokens,
            // so it reads none of the blocks its windows have passed.
            self.kv.remove_skipped_blocks(id, req.num_computed_tokens);
            if req.num_computed_tokens < req.num_tokens() {
                continue;
            }
            for &token in sampled.get(&id).copied().unwrap_or_default() {
                req.append_output_token(token);
                if let Some(reason) = req.check_stop(self.config.max_model_len) {
                    finished.push((id, reason));
                    break;
                }
            }
        }
        Ok(finished.into_iter().filter_map(|(id, reason)| self.finish_request(id, reason)).collect())
    }

    /// Finishes a waiting or running request now (the engine matched a stop string, say),
    /// releasing its blocks. `None` if the request is unknown or already finished.
    pub fn finish_request(&mut self, request_id: RequestId, reason: FinishReason) -> Option<Request> {
        let mut req = self.requests.remove(&request_id)?;
        if req.status == RequestStatus::Running {
            self.running.retain(|&r| r != request_id);
        } else {
            self.waiting.remove(request_id);
        }
        self.kv.free(request_id);
        self.in_flight.retain(|&(r, _)| r != request_id);
        self.ahead.retain(|&(r, _)| r != request_id);
        req.status = RequestStatus::Finished(reason);
        Some(req)
    }

    /// Drops a request wherever it is and frees its blocks at once.
    pub fn abort(&mut self, request_id: RequestId) -> Option<Request> {
        self.finish_request(request_id, FinishReason::Abort)
    }

    pub fn request(&self, request_id: RequestId) -> Option<&Request> {
        self.requests.get(&request_id)
    }

    /// Running requests, oldest first.
    pub fn running(&self) -> &[RequestId] {
        &self.running
    }

    /// Waiting requests in the order they will be admitted.
    pub fn waiting(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.waiting.iter()
    }

    pub fn has_unfinished_requests(&self) -> bool {
        !self.requests.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn kv_cache_usage(&self) -> f64 {
        self.kv.usage()
    }

    pub fn prefix_cache_hit_rate(&self) -> f64 {
        self.kv.prefix_cache_stats().hit_rate()
    }

    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_running: self.num_running(),
            num_waiting: self.num_waiting(),
            kv_cache_usage: self.kv_cache_usage(),
            prefix_cache: self.kv.prefix_cache_stats(),
            num_preemptions: self.num_preemptions,
        }
    }
}

/// What is left of a step's budgets while it is scheduled.
struct StepBudget {
    /// Tokens (`max_num_batched_tokens`).
    tokens: usize,
    /// Prompt rows of requests that ask for prompt logprobs
    /// ([`SchedulerConfig::prompt_logprob_rows`]).
    prompt_logprob_rows: usize,
}

impl StepBudget {
    fn of(config: &SchedulerConfig) -> StepBudget {
        StepBudget { tokens: config.max_num_batched_tokens, prompt_logprob_rows: config.prompt_logprob_rows() }
    }

    /// Whether `request`'s tokens from `start` on are prompt rows whose logits it needs.
    fn needs_rows(request: &Request, start: usize) -> bool {
        request.needs_prompt_logprobs() && start < request.num_prompt_tokens()
    }

    /// Tokens `request` gets this step from `start` on: what it has left, capped by
    /// `long_prefill_token_threshold` and what is left of the budgets (0 when a budget it needs
    /// is spent).
    fn tokens_for(&self, request: &Request, start: usize, config: &SchedulerConfig) -> usize {
        let remaining = request.num_tokens() - start;
        let capped = config.long_prefill_token_threshold.map_or(remaining, |t| remaining.min(t)).min(self.tokens);
        if Self::needs_rows(request, start) {
            capped.min(self.prompt_logprob_rows)
        } else {
            capped
        }
    }

    /// Spends what `n` tokens of `request` from `start` on take.
    fn take(&mut self, request: &Request, start: usize, n: usize) {
        self.tokens -= n;
        if Self::needs_rows(request, start) {
            self.prompt_logprob_rows -= n;
        }
    }
}

fn scheduled_request(
    req: &Request,
    start: usize,
    n: usize,
    block_tables: Vec<Vec<BlockId>>,
    is_new: bool,
) -> ScheduledRequest {
    ScheduledRequest {
        request_id: req.request_id(),
        num_computed_tokens: start,
        num_scheduled_tokens: n,
        token_ids: req.all_token_ids()[start..start + n].to_vec(),
        block_tables,
        is_new,
        samples_next_token: start + n == req.num_tokens(),
    }
}
