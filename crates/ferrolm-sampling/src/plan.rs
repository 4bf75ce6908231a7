//! `SamplePlan`: everything one sampling step needs besides the logits row, so that the host
//! ([`SamplePlan::apply`]) and a device (the CUDA backend's sampler) apply one definition.
//!
//! [`RequestSampler::plan`](crate::RequestSampler::plan) draws the plan (taking the step's one
//! uniform from the sequence's stream), a runner applies it to the raw row where the row is, and
//! the chosen token goes back to [`RequestSampler::record`](crate::RequestSampler::record).
//!
//! Applying a plan, each step a pure function of the row and the plan (vLLM's order):
//! 0. A `masked` plan's token mask (see [`TokenMasks`](crate::TokenMasks)): a token it does not
//!    allow scores `-inf`.
//! 1. `adjusts`, one entry per token and at most one per token (ids outside the row skipped): the
//!    repetition penalty, then `frequency * count` and `presence`, then the `min_tokens` mask.
//! 2. NaN becomes `-inf` (never a candidate) and `+inf` becomes `f32::MAX`.
//! 3. Greedy: the argmax, lowest id on ties. Otherwise top-k, temperature, top-p, min-p and one
//!    inverse-CDF draw with `u`, in token-id order (see `filters`).
//! 4. Logprobs of the raw row (not the processed one): the chosen token's and the top ones.

use crate::filters;
use crate::logprobs::{token_logprobs, TokenLogprobs};
use crate::mask::allows;
use crate::penalties::penalize;

/// What one step does to one token's logit before filtering.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TokenAdjust {
    pub token: u32,
    /// Seen in the prompt or the output while the repetition penalty is on.
    pub repetition: bool,
    /// Times generated; the frequency and presence penalties apply when it is above 0.
    pub output_count: u32,
    /// An EOS or stop token id while fewer than `min_tokens` were generated: `-inf`.
    pub mask: bool,
}

/// One sampling step of one sequence, as [`RequestSampler::plan`](crate::RequestSampler::plan)
/// builds it. Fields are public so that devices can read them; other values than the sampler's
/// are for tests.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplePlan {
    /// Argmax; `temperature`, the filters and `u` are then unused.
    pub greedy: bool,
    pub temperature: f32,
    /// 0 is off.
    pub top_k: usize,
    /// 1 is off.
    pub top_p: f32,
    /// 0 is off.
    pub min_p: f32,
    /// The step's uniform in [0, 1); 0 for greedy steps, which draw none.
    pub u: f64,
    pub num_top_logprobs: usize,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// At most one entry per token.
    pub adjusts: Vec<TokenAdjust>,
    /// The row's allowed tokens come in the step's [`TokenMasks`](crate::TokenMasks) (a grammar
    /// constrains the sequence): apply it with [`Self::apply_masked`].
    pub masked: bool,
}

impl SamplePlan {
    /// Argmax with the `num_top_logprobs` highest logprobs, nothing adjusted.
    pub fn greedy(num_top_logprobs: usize) -> SamplePlan {
        SamplePlan {
            greedy: true,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            u: 0.0,
            num_top_logprobs,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            adjusts: Vec::new(),
            masked: false,
        }
    }

    /// The token this step picks from `logits` (the model's raw row), with its raw logprob and
    /// the top logprobs; `None` when no token is left to pick (every score `-inf` or NaN).
    ///
    /// # Panics
    /// On a `masked` plan: its mask is needed ([`Self::apply_masked`]).
    // logits: [vocab]
    pub fn apply(&self, logits: &[f32]) -> Option<TokenLogprobs> {
        assert!(!self.masked, "SamplePlan::apply: a masked plan needs its token mask");
        self.apply_masked(logits, None)
    }

    /// [`Self::apply`] with the row's token mask (`[words]` packed bits) applied first; `None`
    /// allows every token.
    // logits: [vocab]
    pub fn apply_masked(&self, logits: &[f32], mask: Option<&[u32]>) -> Option<TokenLogprobs> {
        let mut scores = logits.to_vec(); // [vocab]
        if let Some(mask) = mask {
            for (t, s) in scores.iter_mut().enumerate() {
                if !allows(mask, t as u32) {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
        for a in &self.adjusts {
            if let Some(s) = scores.get_mut(a.token as usize) {
                *s = self.adjusted(*s, a);
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
        let token = if self.greedy { filters::argmax(&scores) } else { self.draw(&scores) }?;
        Some(token_logprobs(logits, token, self.num_top_logprobs))
    }

    /// `logit` of `a.token` after the penalties and the mask of `a`.
    fn adjusted(&self, logit: f32, a: &TokenAdjust) -> f32 {
        if a.mask {
            return f32::NEG_INFINITY;
        }
        penalize(logit, a, self.repetition_penalty, self.frequency_penalty, self.presence_penalty)
    }

    // scores: [vocab], penalized and masked, no NaN, no +inf
    fn draw(&self, scores: &[f32]) -> Option<u32> {
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
        filters::draw(&cands, self.u)
    }
}

/// What a runner computes from one logits row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowRequest<'a> {
    /// The next token by this plan (`None` back when no token can be picked).
    Sample(&'a SamplePlan),
    /// The raw logprob of `token` (the next prompt token, for prompt logprobs) and the `num_top`
    /// highest; always `Some` back, with `-inf` for a token outside the row.
    Logprobs { token: u32, num_top: usize },
}

impl RowRequest<'_> {
    /// The host's answer for the raw row `logits`; a device must give the same.
    // logits: [vocab]
    pub fn apply(&self, logits: &[f32]) -> Option<TokenLogprobs> {
        self.apply_masked(logits, None)
    }

    /// [`Self::apply`] for a row whose plan may be `masked`, with its mask (`[words]`).
    // logits: [vocab]
    pub fn apply_masked(&self, logits: &[f32], mask: Option<&[u32]>) -> Option<TokenLogprobs> {
        match *self {
            RowRequest::Sample(plan) if plan.masked => plan.apply_masked(logits, mask),
            RowRequest::Sample(plan) => plan.apply(logits),
            RowRequest::Logprobs { token, num_top } => Some(token_logprobs(logits, token, num_top)),
        }
    }

    /// Whether the row waits for a token mask.
    pub fn is_masked(&self) -> bool {
        matches!(self, RowRequest::Sample(plan) if plan.masked)
    }
}

/// A [`RowRequest`] that owns its plan: what a runner keeps of a launched step whose sampling
/// waits for its token masks.
#[derive(Clone, Debug, PartialEq)]
pub enum OwnedRowRequest {
    Sample(SamplePlan),
    Logprobs { token: u32, num_top: usize },
}

impl OwnedRowRequest {
    pub fn of(row: &RowRequest<'_>) -> OwnedRowRequest {
        match *row {
            RowRequest::Sample(plan) => OwnedRowRequest::Sample(plan.clone()),
            RowRequest::Logprobs { token, num_top } => OwnedRowRequest::Logprobs { token, num_top },
        }
    }

    pub fn borrow(&self) -> RowRequest<'_> {
        match *self {
            OwnedRowRequest::Sample(ref plan) => RowRequest::Sample(plan),
            OwnedRowRequest::Logprobs { token, num_top } => RowRequest::Logprobs { token, num_top },
        }
    }
}
