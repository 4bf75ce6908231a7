//! The paged KV cache's bookkeeping (no tensors live here): which blocks exist, who holds
//! them, and which hold reusable prefix content.
//!
//! - [`block_pool`]: fixed block set, ref counts, LRU free list, hash → block table.
//! - [`prefix_cache`]: chained block hashes and hit counters.
//! - [`manager`]: per-request block tables, prefix lookups, allocation for a step.

pub mod block_pool;
pub mod manager;
pub mod prefix_cache;

pub use block_pool::{BlockId, BlockPool};
pub use manager::{ComputedBlocks, KvCacheManager};
pub use prefix_cache::{hash_block_tokens, BlockHash, PrefixCacheStats};
