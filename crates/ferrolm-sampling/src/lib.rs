//! Sampling for ferrolm: per-request parameters and their validation, logits processing
//! (penalties, `min_tokens`, temperature, top-k, top-p, min-p), seeded sampling, logprobs,
//! and stop strings over streamed text.
//!
//! Everything here is per sequence and plain CPU code: each step's work on a logits row is a
//! [`SamplePlan`], applied on the host here or by a device where the logits are, and what comes
//! back never depends on the rest of the batch.
//!
//! - [`params`]: `SamplingParams`, `GenerationDefaults`, validation.
//! - [`sampler`]: `RequestSampler`, one per sequence, owning its random stream.
//! - [`plan`]: `SamplePlan` and its host application; `RowRequest`, what a runner computes
//!   from a row.
//! - `penalties`, `filters`: the processing steps, in vLLM's order.
//! - [`mask`]: `TokenMasks`, the tokens a grammar allows each constrained row of a step.
//! - [`logprobs`]: `log_softmax`, `top_n`, per-token logprobs.
//! - [`stop`]: `StopStrings` (one automaton per request), `StopChecker` and `FinishReason`.

mod error;
mod filters;
pub mod logprobs;
pub mod mask;
pub mod params;
mod penalties;
pub mod plan;
pub mod sampler;
pub mod stop;

pub use error::SamplingError;
pub use logprobs::{log_softmax, logsumexp, token_logprobs, top_n, TokenLogprobs};
pub use mask::TokenMasks;
pub use params::{
    GenerationDefaults, SamplingParams, GREEDY_TEMPERATURE_EPS, MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS,
    MAX_STOP_STRING_BYTES, MAX_STOP_TOKEN_IDS,
};
pub use plan::{OwnedRowRequest, RowRequest, SamplePlan, TokenAdjust};
pub use sampler::{RequestSampler, SampleOutput};
pub use stop::{FinishReason, StopChecker, StopResult, StopStrings};
