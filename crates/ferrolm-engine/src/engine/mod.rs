//! The engine: a thread that owns the scheduler, the KV cache, the model and every sequence's
//! sampling state and runs the step loop `schedule -> launch -> collect -> update`, and the
//! output stage that turns its token ids into text on the callers' side.
//!
//! Callers reach it only through channels: [`EngineHandle::submit`] validates a request and
//! returns a [`RequestStream`] of [`RequestOutput`]s; dropping the stream (a client gone) aborts
//! the request, and its blocks are freed in the next step. Nothing here is shared behind a lock
//! except the read-only [`EngineStats`] counters.

mod core;
mod handle;
mod launch;
mod layout;
mod output;
mod state;
mod update;

pub use handle::{resolve_max_tokens, EngineConfig, EngineError, EngineHandle, GenerateRequest, RequestStream};
pub use state::{EngineStats, EngineStatsSnapshot, PromptLogprob, RequestOutput, StepTimesSnapshot, STEP_BUCKET_SEQS};
