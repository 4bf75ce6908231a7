//! Collecting a step's answer and updating from it: prompt logprobs are recorded, sampled tokens
//! go to the scheduler and, as token ids, to the output stage of each request; finished
//! sequences retire.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use ferrolm_sampling::TokenLogprobs;

use super::core::{tracing_error, Engine, Sequence};
use super::handle::EngineError;
use super::launch::Launched;
use super::layout::StepLayout;
use super::state::RequestOutput;
use crate::request::{FinishReason, RequestId, RequestStatus};
use crate::scheduler::{ScheduledRequest, SchedulerOutput};

/// A step's answer: one result per logits row of its layout.
pub(super) struct Answer {
    out: SchedulerOutput,
    layout: StepLayout,
    results: Vec<Option<TokenLogprobs>>,
}

/// A token sampled this step, waiting to be sent.
struct Sampled {
    id: RequestId,
    logprobs: TokenLogprobs,
}

impl Engine {
    /// Waits for `launched`'s answer and times the step. `None` when the runner failed: the
    /// step's requests are aborted.
    pub(super) fn collect(&mut self, launched: Launched) -> Option<Answer> {
        let Launched { out, layout, .. } = launched;
        let collected = self.runner.collect();
        let now = Instant::now();
        if self.ahead.is_none() {
            self.idle_since = Some(now);
        }
        if let Some(previous) = self.last_collect.replace(now) {
            let micros = u64::try_from((now - previous).as_micros()).unwrap_or(u64::MAX);
            self.stats.step_times.record(out.scheduled.len(), num_prompt_tokens(&out) > 0, micros);
        }
        let num_rows = layout.num_rows;
        let collected = collected.map_err(|e| e.to_string()).and_then(|results| {
            if results.len() == num_rows {
                Ok(results)
            } else {
                Err(format!("the runner answered {} of {num_rows} logits rows", results.len()))
            }
        });
        match collected {
            Ok(results) => Some(Answer { out, layout, results }),
            Err(err) => {
                self.abort_step(&out, &err);
                // Nothing of the step is left in flight; a step launched ahead takes its place.
                if let Err(err) = self.scheduler.update_from_output(&[]) {
                    tracing_error(&EngineError::from(err));
                }
                None
            }
        }
    }

    /// Applies a step's answer: prompt logprobs are recorded, sampled tokens go to the scheduler
    /// and the output stage, finished sequences retire.
    pub(super) fn update(&mut self, answer: Answer) {
        let Answer { out, layout, mut results } = answer;
        let mut sampled = Vec::new();
        let mut failed = Vec::new();
        for (s, rows) in out.scheduled.iter().zip(&layout.requests) {
            let Some(seq) = self.sequences.get_mut(&rows.request_id) else { continue };
            record_prompt_logprobs(seq, s, &mut results[rows.prompt.clone()]);
            if let Some(row) = rows.sampled {
                match results[row].take() {
                    Some(logprobs) => {
                        seq.sampler.record(logprobs.token);
                        sampled.push(Sampled { id: rows.request_id, logprobs });
                    }
                    None => failed.push(rows.request_id),
                }
            }
        }
        self.stats.prompt_tokens.fetch_add(num_prompt_tokens(&out), Ordering::Relaxed);
        self.stats.generation_tokens.fetch_add(sampled.len() as u64, Ordering::Relaxed);
        for id in failed {
            // Every logit NaN or -inf: the model's fault, not the request's (a request's own
            // `min_tokens` mask covers at most 256 stop token ids and the EOS ids, fewer than
            // any model's vocabulary).
            tracing::error!(request = %id, "engine fault: no token could be sampled from the logits");
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
            self.send(s, reason);
        }
        self.stats.num_steps.fetch_add(1, Ordering::Relaxed);
        self.publish_stats();
    }

    /// Sends one step's token of a sequence to its output stage.
    fn send(&mut self, sampled: Sampled, finish: Option<FinishReason>) {
        let id = sampled.id;
        let Some(seq) = self.sequences.get_mut(&id) else { return };
        let token = sampled.logprobs.token;
        // NOTE: a complete grammar takes no more tokens: an EOS id sampled under `ignore_eos`
        // stays out of it, and its mask keeps allowing only EOS ids.
        let grammar_fault = match (&mut seq.constraint, finish) {
            (Some(c), None) if !c.is_stopped() => c.advance(token).err(),
            _ => None,
        };
        let output = RequestOutput {
            index: seq.index,
            token_ids: vec![sampled.logprobs.token],
            text: String::new(),
            logprobs: if seq.wants_logprobs { vec![sampled.logprobs] } else { Vec::new() },
            prompt_logprobs: seq.prompt_logprobs.take().map(|p| p.values),
            finish_reason: finish,
            num_prompt_tokens: seq.num_prompt_tokens,
            num_cached_tokens: seq.num_cached_tokens,
        };
        let client_gone = seq.tx.send(output).is_err();
        if let Some(err) = grammar_fault {
            // The token came from the grammar's own mask: the grammar engine is at fault.
            tracing::error!(request = %id, %err, "engine fault: the sampled token does not advance the grammar");
            self.scheduler.finish_request(id, FinishReason::Abort);
            self.send_final(id, FinishReason::Abort);
        } else if finish.is_some() {
            self.retire(id);
        } else if client_gone {
            let client = seq.client_id;
            self.finish_client(client, None);
        }
    }

    pub(super) fn send_final(&mut self, id: RequestId, reason: FinishReason) {
        if let Some(seq) = self.sequences.get(&id) {
            let _ = seq.tx.send(RequestOutput { index: seq.index, finish_reason: Some(reason), ..Default::default() });
        }
        self.retire(id);
    }
}

/// Tokens of prompt chunks in a step (every scheduled token of a request that does not sample,
/// or samples after more than one).
fn num_prompt_tokens(out: &SchedulerOutput) -> u64 {
    out.scheduled
        .iter()
        .filter(|s| !s.samples_next_token || s.num_scheduled_tokens > 1)
        .map(|s| s.num_scheduled_tokens as u64)
        .sum()
}

/// Stores the logprob of each prompt token that the rows of this chunk predict (`results`: the
/// chunk's prompt rows from its first, each predicting the token after it).
fn record_prompt_logprobs(seq: &mut Sequence, s: &ScheduledRequest, results: &mut [Option<TokenLogprobs>]) {
    let Some(p) = seq.prompt_logprobs.as_mut() else { return };
    for (i, result) in results.iter_mut().enumerate() {
        let next = s.num_computed_tokens + i + 1;
        if next < p.prompt.len() {
            p.values[next] = result.take();
        }
    }
}
