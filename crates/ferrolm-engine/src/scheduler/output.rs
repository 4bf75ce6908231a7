//! What the scheduler hands the engine for one step: per request, which tokens to run, from
//! which position, into which blocks.
//!
//! Invariants of a [`SchedulerOutput`]:
//! - Running requests come first, in running order, then requests admitted this step, in the
//!   order they were admitted. A request appears at most once; preempted ones not at all.
//! - `total_num_scheduled_tokens` is the sum of `num_scheduled_tokens`, at most
//!   `max_num_batched_tokens`, and each request has at least one token.
//! - Each of `block_tables` (one per KV cache group) covers
//!   `num_computed_tokens + num_scheduled_tokens` positions, and none maps a scheduled position
//!   to a sliding group's null block.

use crate::kv::BlockId;
use crate::request::RequestId;

/// A scheduled token not known yet: the one the step in flight samples for the request (a step
/// scheduled ahead, see `Scheduler::schedule_ahead`).
pub const UNKNOWN_TOKEN: u32 = u32::MAX;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledRequest {
    pub request_id: RequestId,
    /// Tokens already in the KV cache before this step: the position of the first scheduled
    /// token.
    pub num_computed_tokens: usize,
    pub num_scheduled_tokens: usize,
    /// `[num_scheduled_tokens]`: the tokens at positions
    /// `num_computed_tokens..num_computed_tokens + num_scheduled_tokens`; [`UNKNOWN_TOKEN`] in a
    /// step scheduled ahead.
    pub token_ids: Vec<u32>,
    /// `[num_kv_cache_groups]`: the request's whole block table in each group after this step's
    /// allocation.
    pub block_tables: Vec<Vec<BlockId>>,
    /// Admitted from the waiting queue this step, fresh or resumed after preemption: the
    /// engine holds no per-step state for it yet.
    pub is_new: bool,
    /// The step catches the request up with its tokens, so the last scheduled row's logits
    /// are sampled. False for a prefill chunk that leaves part of the prompt for later.
    pub samples_next_token: bool,
}

impl ScheduledRequest {
    /// Context length after this step (vLLM's `seq_lens`).
    pub fn seq_len(&self) -> usize {
        self.num_computed_tokens + self.num_scheduled_tokens
    }

    /// `[num_scheduled_tokens]`: where each scheduled token's K and V are written in group
    /// `group`, `block_id * block_size + offset`.
    pub fn slot_mapping(&self, group: usize, block_size: usize) -> Vec<usize> {
        let table = &self.block_tables[group];
        (self.num_computed_tokens..self.seq_len())
            .map(|pos| table[pos / block_size].index() * block_size + pos % block_size)
            .collect()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    pub scheduled: Vec<ScheduledRequest>,
    /// Requests that lost their blocks this step; they are back in the waiting queue.
    pub preempted: Vec<RequestId>,
    pub total_num_scheduled_tokens: usize,
}

impl SchedulerOutput {
    /// Nothing to run this step.
    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }

    pub fn num_reqs(&self) -> usize {
        self.scheduled.len()
    }

    pub fn get(&self, request_id: RequestId) -> Option<&ScheduledRequest> {
        self.scheduled.iter().find(|s| s.request_id == request_id)
    }
}
