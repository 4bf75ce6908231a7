//! KV cache groups: the layers that share one set of block tables.
//!
//! A model's layers fall into groups by what they attend to (ferrolm-model's
//! `ModelConfig::kv_cache_groups`): the layers without a window form one group, the layers of each
//! window another. Each group has its own pool of blocks, and each request one block table per
//! group; every table covers the same positions, so a position's slot is found the same way in
//! each. A sliding-window group releases a block as soon as no query the request will still run
//! reads it, and puts its pool's null block in the table entry instead.
//!
//! Invariant: in a sliding group of window `w`, a request that has computed `c` tokens holds the
//! null block exactly in the entries before [`KvCacheGroup::first_read_block`]`(c)` (whose
//! positions are all below `c - w + 1`, the first key its next query reads), and real blocks from
//! there on.

use super::block_pool::{BlockId, BlockPool};

/// One KV cache group as the scheduler is configured with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheGroupConfig {
    /// A query at position `p` of the group's layers reads the keys at `p - window < j <= p`;
    /// `None`: every key up to `p`.
    pub sliding_window: Option<usize>,
    /// Blocks the group's pool hands out.
    pub num_blocks: usize,
}

impl KvCacheGroupConfig {
    /// A group of full attention with `num_blocks` blocks.
    pub fn full(num_blocks: usize) -> Self {
        KvCacheGroupConfig { sliding_window: None, num_blocks }
    }

    /// A group of sliding-window attention with `num_blocks` blocks besides its null block.
    pub fn sliding(window: usize, num_blocks: usize) -> Self {
        KvCacheGroupConfig { sliding_window: Some(window), num_blocks }
    }

    /// Blocks of the group's cache on the device: those its pool hands out, and a sliding
    /// group's null block (block 0).
    pub fn num_cache_blocks(&self) -> usize {
        self.num_blocks + usize::from(self.sliding_window.is_some())
    }
}

/// A group's pool, with the window its layers read through.
#[derive(Clone, Debug)]
pub(super) struct KvCacheGroup {
    pub(super) window: Option<usize>,
    pub(super) pool: BlockPool,
}

impl KvCacheGroup {
    pub(super) fn new(config: &KvCacheGroupConfig, block_size: usize) -> KvCacheGroup {
        let pool = match config.sliding_window {
            Some(_) => BlockPool::with_null_block(config.num_blocks, block_size),
            None => BlockPool::new(config.num_blocks, block_size),
        };
        KvCacheGroup { window: config.sliding_window, pool }
    }

    /// The first block table entry that a query at `first_query` or later reads: 0 for full
    /// attention.
    pub(super) fn first_read_block(&self, first_query: usize) -> usize {
        self.window.map_or(0, |w| (first_query + 1).saturating_sub(w) / self.pool.block_size())
    }

    /// Whether `block` is a real block (not the null block).
    pub(super) fn holds(&self, block: BlockId) -> bool {
        Some(block) != self.pool.null_block()
    }

    /// Releases the blocks of `table` that no query from `first_query` on reads, the later ones
    /// first, and puts the null block in their entries. A no-op for full attention.
    pub(super) fn remove_skipped_blocks(&mut self, table: &mut [BlockId], first_query: usize) {
        let Some(null) = self.pool.null_block() else { return };
        let end = self.first_read_block(first_query).min(table.len());
        // NOTE: the entries before `end` are the null block up to some point, then real blocks:
        // walking back from `end`, the first null one ends what is left to release.
        for entry in table[..end].iter_mut().rev() {
            if *entry == null {
                break;
            }
            self.pool.free([*entry]);
            *entry = null;
        }
    }

    /// Releases every real block of `table`, its last block first.
    pub(super) fn free_table(&mut self, table: &[BlockId]) {
        let null = self.pool.null_block();
        self.pool.free(table.iter().rev().copied().filter(|&b| Some(b) != null));
    }
}
