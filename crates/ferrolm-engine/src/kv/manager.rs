//! Per-request block tables on top of the KV cache groups' [`BlockPool`]s, with prefix caching.
//!
//! Invariants:
//! - A request holds one block table per KV cache group, all of one length, covering exactly the
//!   tokens allocated for it: `len == ceil((num_computed_tokens + tokens scheduled in the steps in
//!   flight) / block_size)` (two steps when one was scheduled ahead of the other).
//! - In a sliding-window group, the entries whose blocks no query of the request will run reads
//!   hold the group's null block (see [`super::group`]); they are released when its computed
//!   tokens advance ([`KvCacheManager::remove_skipped_blocks`]). Every other entry is a real block.
//! - Each real block's ref count equals the number of block tables holding it; a table holds a
//!   block at most once.
//! - `block_hashes[i]` is the chained hash of the request's block `i`, for its first
//!   `block_hashes.len()` blocks: exactly the full blocks whose tokens are all computed. Those
//!   blocks were offered to each group's prefix cache ([`KvCacheManager::cache_blocks`]) before
//!   any was released; a block only becomes visible to other requests once its K and V were
//!   written.
//! - A prefix hit never covers a whole sequence: at least its last token is recomputed, so that
//!   the step that catches it up has logits to sample from.

use std::collections::HashMap;

use super::block_pool::{BlockId, BlockPool};
use super::group::{KvCacheGroup, KvCacheGroupConfig};
use super::prefix_cache::{
    hash_block_tokens, hit_blocks, longest_cache_hit, BlockHash, PrefixCacheStats, PrefixHashes,
};
use crate::request::{Request, RequestId};

/// The cached prefix of a request found by [`KvCacheManager::get_computed_blocks`], to be
/// passed to [`KvCacheManager::allocate_slots`] in the same step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ComputedBlocks {
    /// `[num_groups][num_computed_tokens / block_size]` when there is a hit (empty otherwise):
    /// each group's table entries for the prefix, its null block where a window does not reach.
    blocks: Vec<Vec<BlockId>>,
    /// `[num_computed_tokens / block_size]`: their chained hashes, kept so they are not
    /// recomputed.
    block_hashes: Vec<BlockHash>,
    num_computed_tokens: usize,
}

impl ComputedBlocks {
    /// Group `group`'s table entries for the prefix (empty without a hit).
    pub fn blocks(&self, group: usize) -> &[BlockId] {
        self.blocks.get(group).map_or(&[], |b| &b[..])
    }

    pub fn num_computed_tokens(&self) -> usize {
        self.num_computed_tokens
    }
}

#[derive(Clone, Debug, Default)]
struct RequestBlocks {
    /// `[num_groups]`: each group's block table, all of one length.
    block_tables: Vec<Vec<BlockId>>,
    /// Chained hashes of the computed full blocks, the first `block_hashes.len()` entries.
    block_hashes: Vec<BlockHash>,
}

impl RequestBlocks {
    /// Entries of each of its tables.
    fn num_blocks(&self) -> usize {
        self.block_tables.first().map_or(0, Vec::len)
    }
}

#[derive(Clone, Debug)]
pub struct KvCacheManager {
    block_size: usize,
    groups: Vec<KvCacheGroup>,
    /// Whether a group has a window (else no block is ever released before its request ends).
    has_sliding_groups: bool,
    enable_prefix_caching: bool,
    requests: HashMap<RequestId, RequestBlocks>,
    stats: PrefixCacheStats,
}

impl KvCacheManager {
    /// A pool per group of `groups`, in that order.
    ///
    /// # Panics
    /// As [`BlockPool::new`], or without a group.
    pub fn new(groups: &[KvCacheGroupConfig], block_size: usize, enable_prefix_caching: bool) -> Self {
        assert!(!groups.is_empty(), "a KV cache has at least one group");
        KvCacheManager {
            block_size,
            groups: groups.iter().map(|g| KvCacheGroup::new(g, block_size)).collect(),
            has_sliding_groups: groups.iter().any(|g| g.sliding_window.is_some()),
            enable_prefix_caching,
            requests: HashMap::new(),
            stats: PrefixCacheStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// The attention window of group `group` (`None`: full attention).
    pub fn sliding_window(&self, group: usize) -> Option<usize> {
        self.groups[group].window
    }

    pub fn block_pool(&self, group: usize) -> &BlockPool {
        &self.groups[group].pool
    }

    /// Fraction of blocks referenced by some request, in the group where that is highest: the
    /// one that runs out first (and so decides when requests are preempted).
    pub fn usage(&self) -> f64 {
        self.groups.iter().map(|g| g.pool.usage()).fold(0.0, f64::max)
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// The request's block table in group `group`; empty for a request holding no blocks.
    pub fn block_table(&self, request_id: RequestId, group: usize) -> &[BlockId] {
        self.requests.get(&request_id).map_or(&[][..], |r| &r.block_tables[group][..])
    }

    /// The request's block tables, one per group; empty for a request holding no blocks.
    pub fn block_tables(&self, request_id: RequestId) -> &[Vec<BlockId>] {
        self.requests.get(&request_id).map_or(&[][..], |r| &r.block_tables[..])
    }

    /// Ids of the requests holding blocks.
    pub fn request_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.requests.keys().copied()
    }

    /// Longest run of cached full blocks at the start of the request's tokens that every group
    /// can supply (see [`longest_cache_hit`]), capped so that at least one token is left to
    /// compute. Changes nothing; the blocks are only claimed by [`Self::allocate_slots`].
    pub fn get_computed_blocks(&self, request: &Request) -> ComputedBlocks {
        if !self.enable_prefix_caching || request.needs_prompt_logprobs() {
            return ComputedBlocks::default();
        }
        let bs = self.block_size;
        // NOTE: a hit on the whole sequence would leave nothing to run and so no logits to
        // sample from; the last token is always recomputed, and with it its block.
        let mut num_blocks = request.num_tokens().saturating_sub(1) / bs;
        let mut hashes = PrefixHashes::new(request.all_token_ids(), bs);
        // Each group's longest hit within the prefix, until all agree. A full-attention group's
        // hit holds for every shorter prefix; a sliding group's is looked for again whenever
        // another group shortens the prefix.
        let mut found: Vec<Option<usize>> = vec![None; self.groups.len()];
        loop {
            let mut agreed = true;
            for (group, found) in self.groups.iter().zip(&mut found) {
                let holds = found.is_some_and(|f| f == num_blocks || (group.window.is_none() && f > num_blocks));
                if holds {
                    continue;
                }
                let hit = longest_cache_hit(&group.pool, group.window, &mut hashes, num_blocks);
                *found = Some(hit);
                if hit < num_blocks {
                    num_blocks = hit;
                    agreed = false;
                }
            }
            if agreed {
                break;
            }
        }
        if num_blocks == 0 {
            return ComputedBlocks::default();
        }
        let block_hashes = hashes.first(num_blocks);
        let blocks: Option<Vec<Vec<BlockId>>> =
            self.groups.iter().map(|g| hit_blocks(&g.pool, g.window, &block_hashes, num_blocks)).collect();
        match blocks {
            Some(blocks) => ComputedBlocks { blocks, block_hashes, num_computed_tokens: num_blocks * bs },
            None => ComputedBlocks::default(),
        }
    }

    /// Makes the request's block tables cover `num_new_tokens` more tokens beyond those already
    /// computed plus the cached prefix `new_computed` (non-empty only at admission). Returns the
    /// block tables, one per group, or `None` with nothing changed if a group's pool cannot
    /// supply the blocks.
    ///
    /// The caller moves `num_computed_tokens` forward only once the step has run; until then
    /// calling this again for the same tokens allocates nothing more.
    pub fn allocate_slots(
        &mut self,
        request: &Request,
        num_new_tokens: usize,
        new_computed: &ComputedBlocks,
    ) -> Option<&[Vec<BlockId>]> {
        let bs = self.block_size;
        let id = request.request_id();
        let num_held = self.requests.get(&id).map_or(0, RequestBlocks::num_blocks);
        let num_hit = new_computed.num_computed_tokens / bs;
        debug_assert!(num_hit == 0 || num_held == 0, "cached blocks are claimed at admission only");
        let num_computed = request.num_computed_tokens() + new_computed.num_computed_tokens;
        debug_assert!(num_computed + num_new_tokens <= request.num_tokens());
        let num_required = (num_computed + num_new_tokens).div_ceil(bs);
        let num_new_blocks = num_required.saturating_sub(num_held + num_hit);
        for (g, group) in self.groups.iter().enumerate() {
            // Cached blocks sitting in the free list leave it when claimed, so they count against
            // the free blocks too.
            let hits = new_computed.blocks(g);
            let num_evictable_hits = hits.iter().filter(|&&b| group.holds(b) && group.pool.ref_count(b) == 0).count();
            if num_new_blocks + num_evictable_hits > group.pool.num_free_blocks() {
                return None;
            }
        }

        let first_allocation = !self.requests.contains_key(&id);
        if first_allocation && self.enable_prefix_caching && !request.needs_prompt_logprobs() {
            self.stats.queries += request.num_tokens() as u64;
            self.stats.hits += new_computed.num_computed_tokens as u64;
        }
        let num_groups = self.groups.len();
        let entry = self
            .requests
            .entry(id)
            .or_insert_with(|| RequestBlocks { block_tables: vec![Vec::new(); num_groups], block_hashes: Vec::new() });
        for (g, (group, table)) in self.groups.iter_mut().zip(&mut entry.block_tables).enumerate() {
            let hits = new_computed.blocks(g);
            // Claim the hits before allocating, so that allocation cannot evict them.
            let null = group.pool.null_block();
            for &b in hits.iter().filter(|&&b| Some(b) != null) {
                group.pool.touch(&[b]);
            }
            let new_blocks = group.pool.allocate(num_new_blocks)?;
            table.extend_from_slice(hits);
            table.extend(new_blocks);
        }
        entry.block_hashes.extend_from_slice(&new_computed.block_hashes);
        Some(&entry.block_tables)
    }

    /// Offers to each group's prefix cache the request's full blocks among its first
    /// `num_computed_tokens` tokens, which must now hold their K and V.
    pub fn cache_blocks(&mut self, request: &Request, num_computed_tokens: usize) {
        if !self.enable_prefix_caching || request.needs_prompt_logprobs() {
            return;
        }
        let Some(entry) = self.requests.get_mut(&request.request_id()) else {
            return;
        };
        let bs = self.block_size;
        let num_full = num_computed_tokens.min(request.num_tokens()) / bs;
        debug_assert!(num_full <= entry.num_blocks());
        let tokens = request.all_token_ids();
        for i in entry.block_hashes.len()..num_full {
            let parent = entry.block_hashes.last().copied();
            let hash = hash_block_tokens(parent, &tokens[i * bs..(i + 1) * bs]);
            for (group, table) in self.groups.iter_mut().zip(&entry.block_tables) {
                // A block is offered when it fills, before its window can pass it.
                debug_assert!(group.holds(table[i]), "block {i} was released before it was cached");
                if group.holds(table[i]) {
                    // NOTE: a false return means another request computed the same content
                    // first; that copy stays the cached one and this block stays private.
                    group.pool.cache_block(table[i], hash);
                }
            }
            entry.block_hashes.push(hash);
        }
    }

    /// Releases, in every sliding-window group, the request's blocks that no query from its
    /// `num_computed_tokens`-th token on reads; its tables keep their length, with the groups'
    /// null blocks in those entries. Released blocks that were cached stay in the prefix cache
    /// until evicted. Call it once the computed tokens advance (after [`Self::cache_blocks`]):
    /// a step in flight, or scheduled ahead of it, starts at `num_computed_tokens` at the
    /// earliest, so it reads none of them.
    pub fn remove_skipped_blocks(&mut self, request_id: RequestId, num_computed_tokens: usize) {
        if !self.has_sliding_groups {
            return;
        }
        let Some(entry) = self.requests.get_mut(&request_id) else {
            return;
        };
        for (group, table) in self.groups.iter_mut().zip(&mut entry.block_tables) {
            group.remove_skipped_blocks(table, num_computed_tokens);
        }
    }

    /// Blocks the request's tables (each of them) lack to cover its first `num_positions`
    /// positions.
    pub fn num_blocks_to_cover(&self, request_id: RequestId, num_positions: usize) -> usize {
        let num_held = self.requests.get(&request_id).map_or(0, RequestBlocks::num_blocks);
        num_positions.div_ceil(self.block_size).saturating_sub(num_held)
    }

    /// Free blocks of the group that has the fewest.
    pub fn num_free_blocks(&self) -> usize {
        self.groups.iter().map(|g| g.pool.num_free_blocks()).min().unwrap_or(0)
    }

    /// Makes the tables of a request that holds blocks cover its first `num_positions`
    /// positions, which may run past its known tokens: the slot of a step scheduled ahead of the
    /// one in flight (`Scheduler::schedule_ahead`). `None` with nothing changed when the request
    /// holds no blocks or a pool is short.
    pub fn allocate_ahead(&mut self, request_id: RequestId, num_positions: usize) -> Option<&[Vec<BlockId>]> {
        let missing = self.num_blocks_to_cover(request_id, num_positions);
        let entry = self.requests.get_mut(&request_id)?;
        if missing > self.groups.iter().map(|g| g.pool.num_free_blocks()).min().unwrap_or(0) {
            return None;
        }
        for (group, table) in self.groups.iter_mut().zip(&mut entry.block_tables) {
            table.extend(group.pool.allocate(missing)?);
        }
        Some(&entry.block_tables)
    }

    /// Releases all of the request's blocks, its last block first, so that when cached blocks
    /// are evicted later, a sequence loses its tail before its head (which is more likely to
    /// be shared).
    pub fn free(&mut self, request_id: RequestId) {
        if let Some(entry) = self.requests.remove(&request_id) {
            for (group, table) in self.groups.iter_mut().zip(&entry.block_tables) {
                group.free_table(table);
            }
        }
    }
}

#[cfg(test)]
mod tests;
