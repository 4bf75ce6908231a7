//! `RequestSampler`: one per sequence, turning each logits row into the next token.
//!
//! Per step, in vLLM's order: penalties, then (while fewer than `min_tokens` were
//! generated) masking of EOS and stop token ids, then greedy argmax, or temperature,
//! top-k, top-p, min-p and one draw. Top-k runs on the logits just before temperature is
//! applied, which picks the same tokens because `exp((l - max) / T)` is monotone.
//!
//! A step is [`RequestSampler::plan`] (what the step does, as data: see [`SamplePlan`]),
//! the plan applied to the row wherever the row is (on the host, [`SamplePlan::apply`]; on a
//! GPU, the CUDA backend's sampler), then [`RequestSampler::record`] of the token.
//! [`RequestSampler::sample`] is the three on the host.
//!
//! Invariants that continuous batching relies on:
//! - The sampler owns its random stream (ChaCha8, seeded from the request's `seed` or the
//!   engine's fallback, one stream per sequence index) and takes exactly one uniform from
//!   it per non-greedy plan, and none per greedy one. Same seed and same logits rows give
//!   the same tokens whatever else shares the batch, and however the batch is split.
//! - Every plan is followed by the `record` of its token before the next plan (penalties
//!   and `min_tokens` depend on it); a step that picks no token ends the sequence.
//! - Reported logprobs are those of the raw logits row, not of the processed one.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::SamplingError;
use crate::logprobs::TokenLogprobs;
use crate::params::SamplingParams;
use crate::penalties::Penalties;
use crate::plan::{SamplePlan, TokenAdjust};
use crate::stop::FinishReason;

/// What [`RequestSampler::sample`] returns: the chosen token, its logprob under the raw
/// `log_softmax`, and the `logprobs` highest raw logprobs (empty when not asked for).
pub type SampleOutput = TokenLogprobs;

/// Sampling state of one sequence: its parameters, what it generated, its random stream.
#[derive(Debug, Clone)]
pub struct RequestSampler {
    greedy: bool,
    temperature: f32,
    /// 0 is off.
    top_k: usize,
    top_p: f32,
    min_p: f32,
    min_tokens: u32,
    max_tokens: Option<u32>,
    ignore_eos: bool,
    /// Sorted, without duplicates: membership is a binary search.
    stop_token_ids: Vec<u32>,
    num_top_logprobs: usize,
    penalties: Penalties,
    num_output_tokens: u32,
    rng: ChaCha8Rng,
    /// A grammar constrains the sequence: every plan is `masked`.
    masked: bool,
}

impl RequestSampler {
    /// Sampler for a request's first (or only) sequence. `seed_fallback` seeds the stream
    /// when `params.seed` is `None`; the engine should make it unique per request.
    pub fn new(params: &SamplingParams, prompt_ids: &[u32], seed_fallback: u64) -> Result<Self, SamplingError> {
        Self::for_sequence(params, prompt_ids, seed_fallback, 0)
    }

    /// Sampler for sequence `seq_index` of a request with `n > 1`: same seed, its own
    /// ChaCha stream, so the `n` sequences differ even when the client fixed the seed.
    pub fn for_sequence(
        params: &SamplingParams,
        prompt_ids: &[u32],
        seed_fallback: u64,
        seq_index: u64,
    ) -> Result<Self, SamplingError> {
        params.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(params.seed.unwrap_or(seed_fallback));
        rng.set_stream(seq_index);
        Ok(Self {
            greedy: params.is_greedy(),
            temperature: params.temperature,
            top_k: usize::try_from(params.top_k).unwrap_or(0),
            top_p: params.top_p,
            min_p: params.min_p,
            min_tokens: params.min_tokens,
            max_tokens: params.max_tokens,
            ignore_eos: params.ignore_eos,
            stop_token_ids: sorted_unique(&params.stop_token_ids),
            num_top_logprobs: params.logprobs.unwrap_or(0) as usize,
            penalties: Penalties::new(
                params.repetition_penalty,
                params.presence_penalty,
                params.frequency_penalty,
                prompt_ids,
            ),
            num_output_tokens: 0,
            rng,
            masked: false,
        })
    }

    /// From now on every plan is `masked`: a grammar gives each step's allowed tokens
    /// ([`TokenMasks`](crate::TokenMasks)), and `min_tokens` no longer masks EOS and stop ids
    /// (the grammar decides where the output may end).
    pub fn constrain(&mut self) {
        self.masked = true;
    }

    /// Tokens sampled so far.
    pub fn num_output_tokens(&self) -> u32 {
        self.num_output_tokens
    }

    /// Picks the next token from `logits` (the model's raw output for this sequence) and
    /// records it: [`Self::plan`], [`SamplePlan::apply`], [`Self::record`].
    // logits: [vocab]
    pub fn sample(&mut self, logits: &[f32], eos_token_ids: &[u32]) -> Result<SampleOutput, SamplingError> {
        if logits.is_empty() {
            return Err(SamplingError::EmptyLogits);
        }
        let out = self.plan(eos_token_ids).apply(logits).ok_or(SamplingError::NoCandidates)?;
        self.record(out.token);
        Ok(out)
    }

    /// What the next step does to its logits row: the filters, the uniform it draws with (taken
    /// from the stream here, one per non-greedy plan), and the penalties and masks as a list of
    /// tokens. `eos_token_ids` are the model's EOS ids; with the request's stop token ids they
    /// are masked until `min_tokens` tokens exist (EOS not, with `ignore_eos`).
    pub fn plan(&mut self, eos_token_ids: &[u32]) -> SamplePlan {
        self.plan_after(0, eos_token_ids)
    }

    /// Whether [`Self::plan_ahead`] can plan a step before the token of the step in flight is
    /// known: no penalty looks at the tokens generated so far.
    pub fn plans_ahead(&self) -> bool {
        self.penalties.is_off()
    }

    /// The plan of the step after the one in flight, whose token is not recorded yet: what
    /// [`Self::plan`] would give once it is (the same uniform, drawn now, in stream order).
    ///
    /// # Panics
    /// When a penalty is on ([`Self::plans_ahead`] is false): the plan would depend on the
    /// token in flight.
    pub fn plan_ahead(&mut self, eos_token_ids: &[u32]) -> SamplePlan {
        assert!(self.plans_ahead(), "plan_ahead: penalties depend on the token in flight");
        self.plan_after(1, eos_token_ids)
    }

    /// [`Self::plan`] with `pending` sampled tokens not recorded yet.
    fn plan_after(&mut self, pending: u32, eos_token_ids: &[u32]) -> SamplePlan {
        let mut adjusts = self.penalties.adjusts().to_vec();
        // NOTE: under a grammar the mask decides where the output may end: once it is complete
        // only EOS ids are allowed, which a `min_tokens` mask would leave nothing to sample from.
        // Such a sequence samples EOS until `min_tokens` (its text is unchanged).
        if self.num_output_tokens + pending < self.min_tokens && !self.masked {
            let eos = if self.ignore_eos { &[][..] } else { eos_token_ids };
            // One entry per token: a device applies the entries in parallel. The stop ids are
            // unique already; the model's few EOS ids are checked against each other and them.
            let unique_eos = eos.iter().enumerate().filter(|&(i, t)| !eos[..i].contains(t)).map(|(_, &t)| t);
            let stops = self.stop_token_ids.iter().copied().filter(|t| !eos.contains(t));
            for token in unique_eos.chain(stops) {
                match self.penalties.position(token) {
                    Some(i) => adjusts[i].mask = true,
                    None => adjusts.push(TokenAdjust { token, mask: true, ..TokenAdjust::default() }),
                }
            }
        }
        SamplePlan {
            greedy: self.greedy,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            u: if self.greedy { 0.0 } else { self.rng.random() },
            num_top_logprobs: self.num_top_logprobs,
            repetition_penalty: self.penalties.repetition,
            frequency_penalty: self.penalties.frequency,
            presence_penalty: self.penalties.presence,
            adjusts,
            masked: self.masked,
        }
    }

    /// Records `token`, the one the last [`Self::plan`] picked, for penalties and `min_tokens`.
    pub fn record(&mut self, token: u32) {
        self.penalties.record(token);
        self.num_output_tokens += 1;
    }

    /// Why the sequence ends after `token` (the one `sample` just returned), if it does:
    /// EOS (unless `ignore_eos`) or a stop token id is `Stop`, reaching `max_tokens` is
    /// `Length`. Nothing stops it before `min_tokens`. Stop strings, the context length
    /// and aborts are the caller's to check.
    pub fn finish_reason(&self, token: u32, eos_token_ids: &[u32]) -> Option<FinishReason> {
        if self.num_output_tokens < self.min_tokens {
            return None;
        }
        if (!self.ignore_eos && eos_token_ids.contains(&token)) || self.stop_token_ids.binary_search(&token).is_ok() {
            return Some(FinishReason::Stop);
        }
        if self.max_tokens.is_some_and(|m| self.num_output_tokens >= m) {
            return Some(FinishReason::Length);
        }
        None
    }
}

/// `ids` sorted, each once.
fn sorted_unique(ids: &[u32]) -> Vec<u32> {
    let mut ids = ids.to_vec();
    ids.sort_unstable();
    ids.dedup();
    ids
}

#[cfg(test)]
mod tests;
