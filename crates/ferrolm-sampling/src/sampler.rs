//! `RequestSampler`: one per sequence, turning each logits row into the next token.
//!
//! Per step, in vLLM's order: penalties, then (while fewer than `min_tokens` were
//! generated) masking of EOS and stop token ids, then greedy argmax, or temperature,
//! top-k, top-p, min-p and one draw. Top-k runs on the logits just before temperature is
//! applied, which picks the same tokens because `exp((l - max) / T)` is monotone.
//!
//! Invariants that continuous batching relies on:
//! - The sampler owns its random stream (ChaCha8, seeded from the request's `seed` or the
//!   engine's fallback, one stream per sequence index) and takes exactly one uniform from
//!   it per non-greedy step, and none per greedy step. Same seed and same logits rows give
//!   the same tokens whatever else shares the batch, and however the batch is split.
//! - `sample` records the token it returns (for penalties and `min_tokens`), so the
//!   caller never has to.
//! - Reported logprobs are those of the raw logits row, not of the processed one.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::SamplingError;
use crate::filters;
use crate::logprobs::{token_logprobs, TokenLogprobs};
use crate::params::SamplingParams;
use crate::penalties::Penalties;
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
    stop_token_ids: Vec<u32>,
    num_top_logprobs: usize,
    penalties: Penalties,
    num_output_tokens: u32,
    rng: ChaCha8Rng,
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
            stop_token_ids: params.stop_token_ids.clone(),
            num_top_logprobs: params.logprobs.unwrap_or(0) as usize,
            penalties: Penalties::new(
                params.repetition_penalty,
                params.presence_penalty,
                params.frequency_penalty,
                prompt_ids,
            ),
            num_output_tokens: 0,
            rng,
        })
    }

    /// Tokens sampled so far.
    pub fn num_output_tokens(&self) -> u32 {
        self.num_output_tokens
    }

    /// Picks the next token from `logits` (the model's raw output for this sequence) and
    /// records it. `eos_token_ids` are the model's EOS ids; with the request's stop token
    /// ids they are masked until `min_tokens` tokens exist (EOS not, with `ignore_eos`).
    /// Ids outside the row are ignored.
    // logits: [vocab]
    pub fn sample(&mut self, logits: &[f32], eos_token_ids: &[u32]) -> Result<SampleOutput, SamplingError> {
        if logits.is_empty() {
            return Err(SamplingError::EmptyLogits);
        }
        let mut scores = logits.to_vec(); // [vocab]
        self.penalties.apply(&mut scores);
        if self.num_output_tokens < self.min_tokens {
            let eos = if self.ignore_eos { &[][..] } else { eos_token_ids };
            for &t in eos.iter().chain(&self.stop_token_ids) {
                if let Some(s) = scores.get_mut(t as usize) {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
        // NOTE: NaN can never win and +inf would turn into NaN after `l - max`.
        for s in &mut scores {
            if s.is_nan() {
                *s = f32::NEG_INFINITY;
            } else if *s == f32::INFINITY {
                *s = f32::MAX;
            }
        }

        let token = if self.greedy { filters::argmax(&scores) } else { self.sample_random(&scores) }
            .ok_or(SamplingError::NoCandidates)?;

        self.penalties.record(token);
        self.num_output_tokens += 1;
        Ok(token_logprobs(logits, token, self.num_top_logprobs))
    }

    /// Whether the next token is exactly the argmax of the raw logits with only its own logprob
    /// wanted: greedy, no penalties, no top logprobs, and past `min_tokens` (so nothing is
    /// masked). A backend may then pick the token where the logits are (see [`Self::accept`]).
    pub fn is_plain_argmax(&self) -> bool {
        self.greedy
            && self.penalties.is_off()
            && self.num_top_logprobs == 0
            && self.num_output_tokens >= self.min_tokens
    }

    /// Records `token`, chosen outside [`Self::sample`] by the argmax of the raw logits (only
    /// valid while [`Self::is_plain_argmax`]), with `logprob` its log-softmax value.
    pub fn accept(&mut self, token: u32, logprob: f32) -> SampleOutput {
        debug_assert!(self.is_plain_argmax(), "accept: the sampler needs the full logits");
        self.penalties.record(token);
        self.num_output_tokens += 1;
        TokenLogprobs { token, logprob, top_logprobs: Vec::new() }
    }

    // scores: [vocab], penalized and masked, no NaN, no +inf
    fn sample_random(&mut self, scores: &[f32]) -> Option<u32> {
        let mut cands = Vec::new(); // [num_candidates] of (token id, logit, then weight)
        filters::collect_candidates(scores, &mut cands);
        if cands.is_empty() {
            return None;
        }
        let mut reordered = filters::top_k(&mut cands, self.top_k);
        filters::apply_temperature(&mut cands, self.temperature);
        reordered |= filters::top_p(&mut cands, self.top_p);
        filters::min_p(&mut cands, self.min_p);
        if reordered {
            cands.sort_unstable_by_key(|c| c.0);
        }
        let u: f64 = self.rng.random();
        filters::draw(&cands, u)
    }

    /// Why the sequence ends after `token` (the one `sample` just returned), if it does:
    /// EOS (unless `ignore_eos`) or a stop token id is `Stop`, reaching `max_tokens` is
    /// `Length`. Nothing stops it before `min_tokens`. Stop strings, the context length
    /// and aborts are the caller's to check.
    pub fn finish_reason(&self, token: u32, eos_token_ids: &[u32]) -> Option<FinishReason> {
        if self.num_output_tokens < self.min_tokens {
            return None;
        }
        if (!self.ignore_eos && eos_token_ids.contains(&token)) || self.stop_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        if self.max_tokens.is_some_and(|m| self.num_output_tokens >= m) {
            return Some(FinishReason::Length);
        }
        None
    }
}
