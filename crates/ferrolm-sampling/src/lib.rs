//! Sampling for ferrolm: per-request parameters and their validation, logits processing
//! (penalties, `min_tokens`, temperature, top-k, top-p, min-p), seeded sampling, logprobs,
//! and stop strings over streamed text.
//!
//! Everything here is per sequence and plain CPU code: the engine hands each sequence its
//! own logits row, and what comes back never depends on the rest of the batch.
//!
//! - [`params`]: `SamplingParams`, `GenerationDefaults`, validation.
//! - [`sampler`]: `RequestSampler`, one per sequence, owning its random stream.
//! - `penalties`, `filters`: the processing steps, in vLLM's order.
//! - [`logprobs`]: `log_softmax`, `top_n`, per-token logprobs.
//! - [`stop`]: `StopChecker` and `FinishReason`.

mod error;
mod filters;
pub mod logprobs;
pub mod params;
mod penalties;
pub mod sampler;
pub mod stop;

pub use error::SamplingError;
pub use logprobs::{log_softmax, logsumexp, token_logprobs, top_n, TokenLogprobs};
pub use params::{GenerationDefaults, SamplingParams, GREEDY_TEMPERATURE_EPS, MAX_LOGPROBS, MAX_N};
pub use sampler::{RequestSampler, SampleOutput};
pub use stop::{FinishReason, StopChecker, StopResult};
