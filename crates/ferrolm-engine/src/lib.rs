//! ferrolm's continuous-batching core: the paged KV block pool with its prefix cache, the
//! per-request block tables, and the token-budget scheduler.
//!
//! The engine thread drives one step at a time:
//! `schedule()` → build the flattened batch from the [`SchedulerOutput`] → forward → sample →
//! `update_from_output()` → emit tokens, hand back finished requests.

pub mod engine;
pub mod kv;
pub mod request;
pub mod scheduler;

pub use engine::{
    EngineConfig, EngineError, EngineHandle, EngineStats, EngineStatsSnapshot, GenerateRequest, PromptLogprob,
    RequestOutput, RequestStream, StepTimesSnapshot, STEP_BUCKET_SEQS,
};
pub use kv::{BlockHash, BlockId, BlockPool, ComputedBlocks, KvCacheManager, PrefixCacheStats};
pub use request::{FinishReason, Request, RequestId, RequestStatus};
pub use scheduler::{
    ScheduledRequest, Scheduler, SchedulerConfig, SchedulerError, SchedulerOutput, SchedulerStats, UNKNOWN_TOKEN,
};
