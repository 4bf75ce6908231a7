//! The engine thread: owns the scheduler, the KV cache, the model and every request's sampling
//! and detokenizing state, and runs the step loop
//! `schedule -> ModelInput -> forward -> sample -> update -> emit / free`.
//!
//! Callers reach it only through channels: [`EngineHandle::submit`] validates a request and
//! returns a [`RequestStream`] of [`RequestOutput`]s; dropping the stream (a client gone) aborts
//! the request, and its blocks are freed in the next step. Nothing here is shared behind a lock
//! except the read-only [`EngineStats`] counters.

mod handle;
mod state;
mod step;

pub use handle::{EngineConfig, EngineError, EngineHandle, GenerateRequest, RequestStream};
pub use state::{EngineStats, EngineStatsSnapshot, PromptLogprob, RequestOutput, StepTimesSnapshot, STEP_BUCKET_SEQS};
