//! ferrolm's continuous-batching core: the paged KV block pool with its prefix cache, the
//! per-request block tables, and the token-budget scheduler.
//!
//! The engine thread drives one step at a time: `schedule()` → launch the flattened batch built
//! from the [`SchedulerOutput`] → collect the sampled tokens → `update_from_output()`, sending
//! token ids to the output stage, a thread of its own, which detokenizes, matches stop strings
//! (telling the engine when one ends a sequence) and forwards the outputs to each request's
//! stream.

pub mod engine;
pub mod kv;
pub mod request;
pub mod scheduler;

pub use engine::{
    resolve_max_tokens, EngineConfig, EngineError, EngineHandle, EngineStats, EngineStatsSnapshot, GenerateRequest,
    Load, PromptLogprob, RequestOutput, RequestStream, StepTimesSnapshot, STEP_BUCKET_SEQS,
};
pub use kv::{BlockHash, BlockId, BlockPool, ComputedBlocks, KvCacheGroupConfig, KvCacheManager, PrefixCacheStats};
pub use request::{FinishReason, Request, RequestId, RequestStatus};
pub use scheduler::{
    ScheduledRequest, Scheduler, SchedulerConfig, SchedulerError, SchedulerOutput, SchedulerStats, BLOCK_SIZE,
    UNKNOWN_TOKEN,
};
