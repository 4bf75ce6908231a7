//! One API request on the engine: its prompts are submitted together, their output streams are
//! merged, and each choice (`index = prompt_index * n + sample_index`) accumulates its text,
//! token ids and logprobs.
//!
//! Invariant: the engine streams live exactly as long as the [`Generation`]. Dropping it (a
//! client gone, a handler future dropped, a shutdown) drops them, which aborts the engine
//! requests and frees their KV blocks. Timing, metrics and the one log line per request are
//! recorded here too, including for requests that never finish.

use std::pin::Pin;
use std::time::{Duration, Instant};

use ferrolm_engine::{FinishReason, GenerateRequest, PromptLogprob, RequestOutput, RequestStream};
use ferrolm_sampling::TokenLogprobs;
use futures_util::stream::{self, SelectAll, Stream, StreamExt};

use crate::error::ApiError;
use crate::metrics::FinishedReason;
use crate::params::ResolvedSampling;
use crate::protocol::{PromptTokensDetails, Usage};
use crate::state::{aborted, SharedState};

type TaggedOutputs = Pin<Box<dyn Stream<Item = (usize, RequestOutput)> + Send>>;

/// What one choice has produced so far.
#[derive(Debug, Default)]
pub struct ChoiceState {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
    pub finish: Option<FinishReason>,
    /// When its latest token arrived (for inter-token latency).
    last_token_at: Option<Instant>,
}

pub struct Generation {
    pub request_id: String,
    /// Token ids of each prompt.
    pub prompts: Vec<Vec<u32>>,
    /// Sequences per prompt.
    pub n: usize,
    pub choices: Vec<ChoiceState>,
    /// Per prompt, once the engine sent them (with the first output of its sequence 0).
    pub prompt_logprobs: Vec<Option<Vec<PromptLogprob>>>,
    cached_tokens: Vec<usize>,
    outputs: SelectAll<TaggedOutputs>,
    state: SharedState,
    started_at: Instant,
    first_token_at: Option<Instant>,
}

/// The `finish_reason` a client sees: `stop`, `length`, or `abort` (as vLLM says it) for a
/// stream the server ended.
pub fn client_finish_reason(reason: Option<FinishReason>) -> Option<&'static str> {
    reason.map(FinishReason::as_str)
}

impl Generation {
    /// Validates and submits every prompt as one client request (the engine admits client
    /// requests in turn); any refusal refuses the whole request, and nothing is queued.
    pub fn start(
        state: &SharedState,
        request_id: String,
        prompts: Vec<Vec<u32>>,
        sampling: &ResolvedSampling,
    ) -> Result<Generation, ApiError> {
        let engine = &state.engine;
        let max_model_len = engine.max_model_len();
        let requests = prompts
            .iter()
            .map(|prompt| GenerateRequest {
                prompt_token_ids: prompt.clone(),
                params: sampling.for_prompt(prompt.len(), max_model_len),
                grammar: sampling.grammar.clone(),
            })
            .collect();
        let mut outputs = SelectAll::new();
        for (prompt_index, stream) in engine.submit_all(requests)?.into_iter().enumerate() {
            outputs.push(tagged(prompt_index, stream));
        }
        let n = sampling.params.n as usize;
        let num_choices = prompts.len() * n;
        Ok(Generation {
            request_id,
            n,
            choices: (0..num_choices).map(|_| ChoiceState::default()).collect(),
            prompt_logprobs: vec![None; prompts.len()],
            cached_tokens: vec![0; prompts.len()],
            prompts,
            outputs,
            state: SharedState::clone(state),
            started_at: Instant::now(),
            first_token_at: None,
        })
    }

    /// The prompt a choice belongs to.
    pub fn prompt_of(&self, choice: usize) -> usize {
        choice / self.n
    }

    /// The next output of any choice, already folded into `choices`, as (choice index, output).
    /// `None` once every sequence ended. Fails when the server aborts requests on shutdown.
    pub async fn next(&mut self) -> Option<Result<(usize, RequestOutput), ApiError>> {
        let abort = self.state.abort.clone();
        let item = tokio::select! {
            biased;
            _ = aborted(abort) => return Some(Err(ApiError::ShuttingDown)),
            item = self.outputs.next() => item,
        };
        let (prompt_index, out) = item?;
        let choice = prompt_index * self.n + out.index as usize;
        if choice >= self.choices.len() {
            return Some(Err(ApiError::Internal(format!("engine output for unknown sequence {}", out.index))));
        }
        self.apply(prompt_index, choice, &out);
        Some(Ok((choice, out)))
    }

    fn apply(&mut self, prompt_index: usize, choice: usize, out: &RequestOutput) {
        let now = Instant::now();
        if let Some(p) = &out.prompt_logprobs {
            self.prompt_logprobs[prompt_index] = Some(p.clone());
        }
        if out.index == 0 && out.num_prompt_tokens > 0 {
            self.cached_tokens[prompt_index] = out.num_cached_tokens;
        }
        let metrics = &self.state.metrics;
        let c = &mut self.choices[choice];
        if !out.token_ids.is_empty() {
            if self.first_token_at.is_none() {
                self.first_token_at = Some(now);
                metrics.record_ttft(now - self.started_at);
            }
            if let Some(last) = c.last_token_at {
                metrics.record_itl(now - last);
            }
            c.last_token_at = Some(now);
        }
        c.text.push_str(&out.text);
        c.token_ids.extend_from_slice(&out.token_ids);
        c.logprobs.extend(out.logprobs.iter().cloned());
        if out.finish_reason.is_some() {
            c.finish = out.finish_reason;
        }
    }

    /// Runs every choice to its end (non-streaming responses).
    pub async fn run_to_end(&mut self) -> Result<(), ApiError> {
        while let Some(item) = self.next().await {
            item?;
        }
        self.check_finished()
    }

    /// After the streams ended: every choice must have finished by stop or length; an abort
    /// here came from inside the engine, and a missing finish means the engine stopped.
    pub fn check_finished(&self) -> Result<(), ApiError> {
        for c in &self.choices {
            match c.finish {
                Some(FinishReason::Stop | FinishReason::Length) => {}
                Some(FinishReason::Abort) => {
                    return Err(ApiError::Internal("the engine aborted the request".into()));
                }
                None => return Err(ApiError::Engine(ferrolm_engine::EngineError::Stopped)),
            }
        }
        Ok(())
    }

    pub fn usage(&self) -> Usage {
        let prompt_tokens: usize = self.prompts.iter().map(Vec::len).sum();
        let completion_tokens: usize = self.choices.iter().map(|c| c.token_ids.len()).sum();
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens: self.cached_tokens.iter().sum() }),
        }
    }
}

/// One engine stream as a `Stream` of outputs tagged with its prompt's index.
fn tagged(prompt_index: usize, stream: RequestStream) -> TaggedOutputs {
    Box::pin(stream::unfold(stream, move |mut s| async move { s.recv().await.map(|out| ((prompt_index, out), s)) }))
}

impl Drop for Generation {
    /// Metrics and the log line of the request, however it ended; choices without a finish
    /// were aborted (the client went away or the server shut down).
    fn drop(&mut self) {
        let e2e = self.started_at.elapsed();
        let usage = self.usage();
        let mut reasons: Vec<&'static str> = Vec::new();
        for c in &self.choices {
            let reason = match c.finish {
                Some(FinishReason::Stop) => FinishedReason::Stop,
                Some(FinishReason::Length) => FinishedReason::Length,
                Some(FinishReason::Abort) | None => FinishedReason::Abort,
            };
            if !reasons.contains(&reason.as_str()) {
                reasons.push(reason.as_str());
            }
            self.state.metrics.record_sequence_finished(reason);
        }
        self.state.metrics.record_request(e2e, usage.prompt_tokens, usage.completion_tokens);
        let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
        tracing::info!(
            request_id = %self.request_id,
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            cached_tokens = self.cached_tokens.iter().sum::<usize>(),
            ttft_ms = self.first_token_at.map(|t| ms(t - self.started_at)),
            e2e_ms = ms(e2e),
            finish_reason = reasons.join(","),
            "request finished"
        );
    }
}
