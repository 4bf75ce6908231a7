//! The engine: a thread that owns the scheduler, the KV cache, the model and every sequence's
//! sampling state and runs the step loop `schedule -> launch -> collect -> update`, and the
//! output stage, a thread of its own that turns its token ids into text, matches stop strings
//! and forwards each request's outputs to its stream.
//!
//! Callers reach them only through channels: [`EngineHandle::submit`] validates a request and
//! returns a [`RequestStream`] of [`RequestOutput`]s ([`EngineHandle::submit_all`]: several, as
//! one client request that the scheduler admits in turn with the others, and that weighs its
//! sequences and prompt tokens against the backpressure limits); dropping the stream (a client
//! gone) aborts the request, and its blocks are freed in the next step. A stop string ends its
//! sequence whether or not the stream is read. Nothing here is shared behind a lock except
//! read-only counters ([`EngineStats`]).

mod admission;
mod core;
mod handle;
mod launch;
mod layout;
mod masks;
mod output;
mod output_stage;
mod state;
mod update;

pub use admission::Load;
pub use handle::{resolve_max_tokens, EngineConfig, EngineError, EngineHandle, GenerateRequest, RequestStream};
pub use state::{EngineStats, EngineStatsSnapshot, PromptLogprob, RequestOutput, StepTimesSnapshot, STEP_BUCKET_SEQS};
