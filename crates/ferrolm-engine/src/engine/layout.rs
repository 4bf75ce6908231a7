//! Which logits rows of a step belong to which scheduled request, derived once when the batch is
//! built and handed on to whatever reads the step's answers.
//!
//! Invariants (the order `ModelInput::push_request` asks for logits in):
//! - Requests' rows come back to back, in the order the scheduler listed the requests.
//! - A request that asks for prompt logprobs has one row per scheduled token: first its prompt
//!   rows, each predicting the prompt token after it, then, when it samples, its sampled row.
//! - Any other request has one row when it samples (its last scheduled token) and none otherwise.

use std::ops::Range;

use crate::request::RequestId;
use crate::scheduler::ScheduledRequest;

/// The rows of one scheduled request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RequestRows {
    pub(crate) request_id: RequestId,
    /// Rows predicting prompt tokens (empty unless prompt logprobs were asked for).
    pub(crate) prompt: Range<usize>,
    /// The row that samples the request's next token, when it samples this step.
    pub(crate) sampled: Option<usize>,
}

impl RequestRows {
    /// Whether this request's rows cover all of its scheduled tokens (prompt logprobs).
    pub(crate) fn all_rows(&self) -> bool {
        !self.prompt.is_empty()
    }
}

/// The logits rows of a step, per scheduled request in the scheduler's order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct StepLayout {
    pub(crate) requests: Vec<RequestRows>,
    pub(crate) num_rows: usize,
}

impl StepLayout {
    /// `wants_prompt_rows`: whether a scheduled request's prompt rows are wanted (it asked for
    /// prompt logprobs and this chunk holds prompt tokens whose logprobs are still missing).
    pub(crate) fn new(
        scheduled: &[ScheduledRequest],
        mut wants_prompt_rows: impl FnMut(&ScheduledRequest) -> bool,
    ) -> StepLayout {
        let mut requests = Vec::with_capacity(scheduled.len());
        let mut row = 0;
        for s in scheduled {
            let num_prompt_rows =
                if wants_prompt_rows(s) { s.num_scheduled_tokens - usize::from(s.samples_next_token) } else { 0 };
            let prompt = row..row + num_prompt_rows;
            row = prompt.end;
            let sampled = s.samples_next_token.then(|| {
                row += 1;
                row - 1
            });
            requests.push(RequestRows { request_id: s.request_id, prompt, sampled });
        }
        StepLayout { requests, num_rows: row }
    }

    /// Whether any request wants prompt rows this step.
    pub(crate) fn has_prompt_rows(&self) -> bool {
        self.requests.iter().any(RequestRows::all_rows)
    }

    /// The sampled row of each request that samples.
    pub(crate) fn sampled_rows(&self) -> impl Iterator<Item = (RequestId, usize)> + '_ {
        self.requests.iter().filter_map(|r| Some((r.request_id, r.sampled?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheduled(id: u64, num_computed_tokens: usize, num_scheduled_tokens: usize, samples: bool) -> ScheduledRequest {
        ScheduledRequest {
            request_id: RequestId(id),
            num_computed_tokens,
            num_scheduled_tokens,
            token_ids: vec![0; num_scheduled_tokens],
            block_tables: Vec::new(),
            is_new: false,
            samples_next_token: samples,
        }
    }

    #[test]
    fn rows_follow_the_scheduled_order() {
        let steps = [
            // A decode, a prompt chunk that does not sample yet, the last chunk of a prompt
            // whose logprobs were asked for, and a prompt chunk with logprobs that does not sample.
            scheduled(1, 9, 1, true),
            scheduled(2, 0, 8, false),
            scheduled(3, 4, 3, true),
            scheduled(4, 0, 2, false),
        ];
        let layout = StepLayout::new(&steps, |s| s.request_id.0 >= 3);
        let rows: Vec<_> = layout.requests.iter().map(|r| (r.request_id.0, r.prompt.clone(), r.sampled)).collect();
        assert_eq!(rows, vec![(1, 0..0, Some(0)), (2, 1..1, None), (3, 1..3, Some(3)), (4, 4..6, None)]);
        assert_eq!(layout.num_rows, 6);
        assert!(layout.has_prompt_rows());
        assert_eq!(layout.sampled_rows().collect::<Vec<_>>(), vec![(RequestId(1), 0), (RequestId(3), 3)]);
    }

    #[test]
    fn without_prompt_rows_each_sampling_request_has_one_row() {
        let steps = [scheduled(7, 3, 1, true), scheduled(8, 0, 5, false), scheduled(9, 5, 1, true)];
        let layout = StepLayout::new(&steps, |_| false);
        assert!(!layout.has_prompt_rows());
        assert_eq!(layout.num_rows, 2);
        assert_eq!(layout.sampled_rows().collect::<Vec<_>>(), vec![(RequestId(7), 0), (RequestId(9), 1)]);
    }
}
