//! Launching a step: its flattened batch ([`ModelInput`]), its logits rows ([`StepLayout`]) and
//! what each row is for, handed to the runner; and the step after it launched ahead, where the
//! scheduler can already tell what it is.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use ferrolm_model::ModelInput;
use ferrolm_sampling::{RowRequest, SamplePlan};

use super::core::{tracing_error, Engine};
use super::handle::EngineError;
use super::layout::StepLayout;
use crate::request::{FinishReason, RequestId};
use crate::scheduler::{SchedulerOutput, UNKNOWN_TOKEN};

/// A step launched on the runner whose answer is not collected yet.
pub(super) struct Launched {
    pub(super) out: SchedulerOutput,
    pub(super) layout: StepLayout,
    /// The requests of its grammar-constrained rows, in row order: their token masks go to the
    /// runner before the step can be collected.
    pub(super) masked: Vec<RequestId>,
    /// Whether those masks were set.
    pub(super) masks_set: bool,
    /// Setting them failed: the step is aborted, nothing is launched after it.
    pub(super) masks_failed: bool,
}

/// A row nothing is wanted from (its request has no sequence any more); its result is dropped.
const UNUSED_ROW: RowRequest<'static> = RowRequest::Logprobs { token: u32::MAX, num_top: 0 };

impl Engine {
    /// Schedules a step and launches it; `None` when there is nothing to run or the launch failed.
    pub(super) fn schedule_and_launch(&mut self) -> Option<Launched> {
        let out = self.scheduler.schedule();
        if out.is_empty() {
            self.last_collect = None;
            self.publish_stats();
            return None;
        }
        self.launch(out, None)
    }

    /// Launches the step after `current` before its tokens are known, when every request that
    /// samples in it plans its next token without them (no penalties), none wants prompt logprobs,
    /// and the scheduler can schedule ahead (see `Scheduler::schedule_ahead`).
    pub(super) fn launch_ahead(&mut self, current: &Launched) -> Option<Launched> {
        if current.layout.has_prompt_rows() {
            return None;
        }
        let plans_ahead = current
            .layout
            .sampled_rows()
            .all(|(id, _)| self.sequences.get(&id).is_none_or(|q| q.sampler.plans_ahead()));
        if !plans_ahead {
            return None;
        }
        let rows: HashMap<RequestId, u32> = current.layout.sampled_rows().map(|(id, row)| (id, row as u32)).collect();
        let next = self.scheduler.schedule_ahead()?;
        let launched = self.launch(next, Some(&rows))?;
        self.stats.num_steps_ahead.fetch_add(1, Ordering::Relaxed);
        Some(launched)
    }

    /// Builds `out`'s batch and row requests and launches it. `previous_rows`: for a step
    /// scheduled ahead, the logits row of the step before that samples each request's token.
    /// `None` when the launch failed: the step's requests are aborted.
    fn launch(&mut self, out: SchedulerOutput, previous_rows: Option<&HashMap<RequestId, u32>>) -> Option<Launched> {
        // Prompt rows are wanted while prompt logprobs are, and this chunk predicts prompt tokens.
        let layout = StepLayout::new(&out.scheduled, |s| {
            self.sequences
                .get(&s.request_id)
                .is_some_and(|q| q.prompt_logprobs.is_some() && s.num_computed_tokens + 1 < q.num_prompt_tokens)
        });
        for s in out.scheduled.iter().filter(|s| s.is_new) {
            if let (Some(seq), Some(req)) =
                (self.sequences.get_mut(&s.request_id), self.scheduler.request(s.request_id))
            {
                seq.num_cached_tokens = req.num_cached_tokens().unwrap_or(0);
            }
        }
        let input = self.model_input(&out, &layout, previous_rows);
        let plans = self.plans(&layout, previous_rows);
        let rows = self.row_requests(&out, &layout, &plans);
        let masked = layout
            .requests
            .iter()
            .zip(&plans)
            .filter(|(_, plan)| plan.as_ref().is_some_and(|p| p.masked))
            .map(|(r, _)| r.request_id)
            .collect();
        debug_assert_eq!(input.logits_indices.len(), layout.num_rows, "the batch asks for the layout's rows");
        let launched = self.runner.launch(&input, &rows);
        // A step launched with nothing in flight found the device idle since the last collect.
        if let (None, Some(idle_since)) = (previous_rows, self.idle_since.take()) {
            let gap = u64::try_from(idle_since.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.stats.host_gap_us.fetch_add(gap, Ordering::Relaxed);
        }
        match launched {
            Ok(()) => Some(Launched { out, layout, masked, masks_set: false, masks_failed: false }),
            Err(err) => {
                self.abort_step(&out, &err.to_string());
                None
            }
        }
    }

    /// The flattened batch, asking for the logits rows of `layout`.
    fn model_input(
        &self,
        out: &SchedulerOutput,
        layout: &StepLayout,
        previous_rows: Option<&HashMap<RequestId, u32>>,
    ) -> ModelInput {
        let mut input = ModelInput::default();
        for (s, rows) in out.scheduled.iter().zip(&layout.requests) {
            input.push_request_tables(
                &s.token_ids,
                s.num_computed_tokens,
                &s.block_tables,
                self.block_size,
                s.samples_next_token,
                rows.all_rows(),
            );
            if let Some(&row) = previous_rows.and_then(|rows| rows.get(&s.request_id)) {
                // The step's one token, scheduled ahead: the one the step before samples.
                input.previous_tokens.push((input.num_tokens() as u32 - 1, row));
            }
        }
        debug_assert!(
            input.token_ids.iter().filter(|&&t| t == UNKNOWN_TOKEN).count() <= input.previous_tokens.len(),
            "a token scheduled ahead without the row that samples it"
        );
        input
    }

    /// One plan per request that samples (its uniform drawn now); a request with a token in
    /// flight plans the step after it.
    fn plans(
        &mut self,
        layout: &StepLayout,
        previous_rows: Option<&HashMap<RequestId, u32>>,
    ) -> Vec<Option<SamplePlan>> {
        let eos_token_ids = &self.eos_token_ids;
        let in_flight = |id| previous_rows.is_some_and(|rows| rows.contains_key(id));
        layout
            .requests
            .iter()
            .map(|r| {
                r.sampled?;
                let seq = self.sequences.get_mut(&r.request_id)?;
                Some(if in_flight(&r.request_id) {
                    seq.sampler.plan_ahead(eos_token_ids)
                } else {
                    seq.sampler.plan(eos_token_ids)
                })
            })
            .collect()
    }

    /// What each logits row is for, in row order: the next prompt token's logprobs for a
    /// prompt row, the request's plan for a sampled row.
    fn row_requests<'a>(
        &self,
        out: &SchedulerOutput,
        layout: &StepLayout,
        plans: &'a [Option<SamplePlan>],
    ) -> Vec<RowRequest<'a>> {
        let mut rows = Vec::with_capacity(layout.num_rows);
        for ((s, r), plan) in out.scheduled.iter().zip(&layout.requests).zip(plans) {
            let prompt = self.sequences.get(&r.request_id).and_then(|q| q.prompt_logprobs.as_ref());
            for i in 0..r.prompt.len() {
                let next = prompt.and_then(|p| Some((*p.prompt.get(s.num_computed_tokens + i + 1)?, p.num_top)));
                rows.push(next.map_or(UNUSED_ROW, |(token, num_top)| RowRequest::Logprobs { token, num_top }));
            }
            if r.sampled.is_some() {
                rows.push(plan.as_ref().map_or(UNUSED_ROW, RowRequest::Sample));
            }
        }
        rows
    }

    /// The step's KV writes may be incomplete: every request in it is aborted.
    pub(super) fn abort_step(&mut self, out: &SchedulerOutput, err: &str) {
        tracing_error(&EngineError::Device(err.to_string()));
        for s in &out.scheduled {
            self.scheduler.finish_request(s.request_id, FinishReason::Abort);
            self.send_final(s.request_id, FinishReason::Abort);
        }
        self.publish_stats();
    }
}
