//! The paged KV cache's bookkeeping (no tensors live here): which blocks exist, who holds
//! them, and which hold reusable prefix content.
//!
//! - [`block_pool`]: fixed block set, ref counts, LRU free list, hash → block table; a sliding
//!   group's pool reserves a null block.
//! - [`group`]: KV cache groups (the layers that share block tables) and what a sliding window
//!   lets a group release.
//! - [`prefix_cache`]: chained block hashes, the longest prefix a group can supply, hit counters.
//! - [`manager`]: per-request block tables (one per group), prefix lookups, allocation for a step.

pub mod block_pool;
pub mod group;
pub mod manager;
pub mod prefix_cache;

pub use block_pool::{BlockId, BlockPool};
pub use group::KvCacheGroupConfig;
pub use manager::{ComputedBlocks, KvCacheManager};
pub use prefix_cache::{hash_block_tokens, BlockHash, PrefixCacheStats};
