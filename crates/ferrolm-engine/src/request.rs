//! A request as the scheduler sees it: its tokens, how many of them already have their K and V
//! in the cache, and where it stands in its life.
//!
//! Invariants:
//! - `all_token_ids` is the prompt followed by the outputs sampled so far; the prompt is not
//!   empty.
//! - `num_computed_tokens <= num_tokens()`. A request is "caught up" when they are equal; the
//!   step that catches it up samples its next token. There is no prefill or decode phase: a
//!   prompt is simply many tokens to catch up with, a decode is one.
//! - `Waiting` and `Preempted` requests hold no KV blocks and have `num_computed_tokens == 0`
//!   (preemption is by recompute); `Running` ones hold blocks covering their computed tokens.

use std::fmt;

/// Identifier the engine gives a request; unique among live requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Why a request finished: the sampling crate's, so the engine, the stop-string matcher and the
/// server speak of one type.
pub use ferrolm_sampling::FinishReason;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    /// Queued, never run yet.
    Waiting,
    /// Holds KV blocks and is scheduled every step it fits in the budget.
    Running,
    /// Lost its blocks to an older request; back in the queue to be recomputed.
    Preempted,
    Finished(FinishReason),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    request_id: RequestId,
    /// `[num_prompt_tokens + num_output_tokens]`
    all_token_ids: Vec<u32>,
    num_prompt_tokens: usize,
    max_tokens: usize,
    min_tokens: usize,
    /// Sampling any of these finishes the request with `Stop` (EOS belongs here unless
    /// the client asked to ignore it). Sorted, without duplicates: checked by binary search on
    /// every sampled token.
    stop_token_ids: Vec<u32>,
    /// Prompt logprobs need logits for every prompt row, so no prompt token may come from
    /// the prefix cache.
    needs_prompt_logprobs: bool,
    pub(crate) num_computed_tokens: usize,
    pub(crate) status: RequestStatus,
    /// Position in arrival order, set by the scheduler.
    pub(crate) arrival_index: u64,
    /// Prompt tokens found in the prefix cache when first admitted.
    pub(crate) num_cached_tokens: Option<usize>,
    pub(crate) num_preemptions: u32,
    /// The client request it belongs to (its prompts times `n`), which the waiting queue takes
    /// turns by; a request of its own by default.
    group: u64,
}

impl Request {
    /// A new waiting request that may generate up to `max_tokens` tokens.
    pub fn new(request_id: RequestId, prompt_token_ids: Vec<u32>, max_tokens: usize) -> Self {
        Request {
            request_id,
            num_prompt_tokens: prompt_token_ids.len(),
            all_token_ids: prompt_token_ids,
            max_tokens,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            needs_prompt_logprobs: false,
            num_computed_tokens: 0,
            status: RequestStatus::Waiting,
            arrival_index: 0,
            num_cached_tokens: None,
            num_preemptions: 0,
            group: request_id.0,
        }
    }

    /// Makes the request one of a group (one client request), which the scheduler admits in
    /// turn with other groups.
    pub fn with_group(mut self, group: u64) -> Self {
        self.group = group;
        self
    }

    pub fn group(&self) -> u64 {
        self.group
    }

    /// Tokens that finish the request with [`FinishReason::Stop`] once sampled.
    pub fn with_stop_token_ids(mut self, mut stop_token_ids: Vec<u32>) -> Self {
        stop_token_ids.sort_unstable();
        stop_token_ids.dedup();
        self.stop_token_ids = stop_token_ids;
        self
    }

    /// Stop tokens are ignored until this many tokens have been generated.
    pub fn with_min_tokens(mut self, min_tokens: usize) -> Self {
        self.min_tokens = min_tokens;
        self
    }

    pub fn with_prompt_logprobs(mut self, needs_prompt_logprobs: bool) -> Self {
        self.needs_prompt_logprobs = needs_prompt_logprobs;
        self
    }

    pub fn request_id(&self) -> RequestId {
        self.request_id
    }

    pub fn prompt_token_ids(&self) -> &[u32] {
        &self.all_token_ids[..self.num_prompt_tokens]
    }

    pub fn output_token_ids(&self) -> &[u32] {
        &self.all_token_ids[self.num_prompt_tokens..]
    }

    /// Prompt followed by outputs.
    pub fn all_token_ids(&self) -> &[u32] {
        &self.all_token_ids
    }

    pub fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    pub fn num_output_tokens(&self) -> usize {
        self.all_token_ids.len() - self.num_prompt_tokens
    }

    pub fn num_tokens(&self) -> usize {
        self.all_token_ids.len()
    }

    /// Tokens whose K and V are in the cache (before the step in flight, if any).
    pub fn num_computed_tokens(&self) -> usize {
        self.num_computed_tokens
    }

    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    pub fn min_tokens(&self) -> usize {
        self.min_tokens
    }

    /// Sorted, each id once.
    pub fn stop_token_ids(&self) -> &[u32] {
        &self.stop_token_ids
    }

    pub fn needs_prompt_logprobs(&self) -> bool {
        self.needs_prompt_logprobs
    }

    pub fn status(&self) -> RequestStatus {
        self.status
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }

    /// Position in arrival order (0 for the first request the scheduler accepted).
    pub fn arrival_index(&self) -> u64 {
        self.arrival_index
    }

    /// Prompt tokens served from the prefix cache at first admission (OpenAI's
    /// `cached_tokens`); `None` until admitted.
    pub fn num_cached_tokens(&self) -> Option<usize> {
        self.num_cached_tokens
    }

    pub fn num_preemptions(&self) -> u32 {
        self.num_preemptions
    }

    pub(crate) fn append_output_token(&mut self, token: u32) {
        self.all_token_ids.push(token);
    }

    /// Whether the last sampled token ends the request. A stop token wins over the length
    /// limit when both hold, since the model did end the text.
    pub(crate) fn check_stop(&self, max_model_len: usize) -> Option<FinishReason> {
        let num_outputs = self.num_output_tokens();
        if num_outputs >= self.min_tokens.max(1) {
            let last = self.all_token_ids[self.all_token_ids.len() - 1];
            if self.stop_token_ids.binary_search(&last).is_ok() {
                return Some(FinishReason::Stop);
            }
        }
        if num_outputs >= self.max_tokens || self.num_tokens() >= max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_prompt_then_outputs() {
        let mut r = Request::new(RequestId(7), vec![1, 2, 3], 4);
        r.append_output_token(9);
        assert_eq!(r.prompt_token_ids(), &[1, 2, 3]);
        assert_eq!(r.output_token_ids(), &[9]);
        assert_eq!(r.all_token_ids(), &[1, 2, 3, 9]);
        assert_eq!((r.num_tokens(), r.num_output_tokens()), (4, 1));
        assert_eq!(r.status(), RequestStatus::Waiting);
    }

    #[test]
    fn stop_conditions() {
        let mut r = Request::new(RequestId(1), vec![1], 3).with_stop_token_ids(vec![9, 0, 4, 0]).with_min_tokens(2);
        assert_eq!(r.stop_token_ids(), &[0, 4, 9]);
        r.append_output_token(0);
        assert_eq!(r.check_stop(100), None, "stop token before min_tokens");
        r.append_output_token(5);
        assert_eq!(r.check_stop(100), None);
        r.append_output_token(0);
        assert_eq!(r.check_stop(100), Some(FinishReason::Stop), "stop wins over length");
        let mut r = Request::new(RequestId(2), vec![1, 2], 10);
        r.append_output_token(5);
        assert_eq!(r.check_stop(4), None);
        r.append_output_token(5);
        assert_eq!(r.check_stop(4), Some(FinishReason::Length), "max_model_len reached");
    }
}
