//! Per-request block tables on top of the [`BlockPool`], with prefix caching.
//!
//! Invariants:
//! - A request's block table covers exactly the tokens allocated for it:
//!   `len == ceil((num_computed_tokens + tokens scheduled in the steps in flight) / block_size)`
//!   (two steps when one was scheduled ahead of the other).
//! - Each block's ref count equals the number of block tables holding it; a table holds a block
//!   at most once.
//! - `block_hashes[i]` is the chained hash of the request's block `i`, for its first
//!   `block_hashes.len()` blocks: exactly the full blocks whose tokens are all computed. Those
//!   blocks were offered to the prefix cache ([`KvCacheManager::cache_blocks`]); a block only
//!   becomes visible to other requests once its K and V were written.
//! - A prefix hit never covers a whole sequence: at least its last token is recomputed, so that
//!   the step that catches it up has logits to sample from.

use std::collections::HashMap;

use super::block_pool::{BlockId, BlockPool};
use super::prefix_cache::{hash_block_tokens, BlockHash, PrefixCacheStats};
use crate::request::{Request, RequestId};

/// The cached prefix of a request found by [`KvCacheManager::get_computed_blocks`], to be
/// passed to [`KvCacheManager::allocate_slots`] in the same step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ComputedBlocks {
    blocks: Vec<BlockId>,
    /// `[blocks.len()]`: their chained hashes, kept so they are not recomputed.
    block_hashes: Vec<BlockHash>,
    num_computed_tokens: usize,
}

impl ComputedBlocks {
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    pub fn num_computed_tokens(&self) -> usize {
        self.num_computed_tokens
    }
}

#[derive(Clone, Debug, Default)]
struct RequestBlocks {
    block_table: Vec<BlockId>,
    /// Chained hashes of the computed full blocks, `block_table[..block_hashes.len()]`.
    block_hashes: Vec<BlockHash>,
}

#[derive(Clone, Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    enable_prefix_caching: bool,
    requests: HashMap<RequestId, RequestBlocks>,
    stats: PrefixCacheStats,
}

impl KvCacheManager {
    /// # Panics
    /// As [`BlockPool::new`].
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Self {
        KvCacheManager {
            pool: BlockPool::new(num_blocks, block_size),
            enable_prefix_caching,
            requests: HashMap::new(),
            stats: PrefixCacheStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    pub fn block_pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Fraction of blocks referenced by some request.
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// The request's block table; empty for a request holding no blocks.
    pub fn block_table(&self, request_id: RequestId) -> &[BlockId] {
        self.requests.get(&request_id).map_or(&[][..], |r| &r.block_table[..])
    }

    /// Ids of the requests holding blocks.
    pub fn request_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.requests.keys().copied()
    }

    /// Longest run of cached full blocks at the start of the request's tokens, capped so that
    /// at least one token is left to compute. Changes nothing; the blocks are only claimed by
    /// [`Self::allocate_slots`].
    pub fn get_computed_blocks(&self, request: &Request) -> ComputedBlocks {
        let mut out = ComputedBlocks::default();
        if !self.enable_prefix_caching || request.needs_prompt_logprobs() {
            return out;
        }
        let bs = self.block_size();
        // NOTE: a hit on the whole sequence would leave nothing to run and so no logits to
        // sample from; the last token is always recomputed, and with it its block.
        let max_blocks = request.num_tokens().saturating_sub(1) / bs;
        let tokens = request.all_token_ids();
        let mut parent = None;
        for chunk in tokens.chunks_exact(bs).take(max_blocks) {
            let hash = hash_block_tokens(parent, chunk);
            let Some(block) = self.pool.lookup(hash) else {
                break;
            };
            out.blocks.push(block);
            out.block_hashes.push(hash);
            parent = Some(hash);
        }
        out.num_computed_tokens = out.blocks.len() * bs;
        out
    }

    /// Makes the request's block table cover `num_new_tokens` more tokens beyond those already
    /// computed plus the cached prefix `new_computed` (non-empty only at admission). Returns the
    /// whole block table, or `None` with nothing changed if the pool cannot supply the blocks.
    ///
    /// The caller moves `num_computed_tokens` forward only once the step has run; until then
    /// calling this again for the same tokens allocates nothing more.
    pub fn allocate_slots(
        &mut self,
        request: &Request,
        num_new_tokens: usize,
        new_computed: &ComputedBlocks,
    ) -> Option<&[BlockId]> {
        let bs = self.block_size();
        let id = request.request_id();
        let num_held = self.requests.get(&id).map_or(0, |r| r.block_table.len());
        debug_assert!(new_computed.blocks.is_empty() || num_held == 0, "cached blocks are claimed at admission only");
        let num_computed = request.num_computed_tokens() + new_computed.num_computed_tokens;
        debug_assert!(num_computed + num_new_tokens <= request.num_tokens());
        let num_required = (num_computed + num_new_tokens).div_ceil(bs);
        let num_new_blocks = num_required.saturating_sub(num_held + new_computed.blocks.len());
        // Cached blocks sitting in the free list leave it when claimed, so they count against
        // the free blocks too.
        let num_evictable_hits = new_computed.blocks.iter().filter(|&&b| self.pool.ref_count(b) == 0).count();
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks() {
            return None;
        }

        let first_allocation = !self.requests.contains_key(&id);
        if first_allocation && self.enable_prefix_caching && !request.needs_prompt_logprobs() {
            self.stats.queries += request.num_tokens() as u64;
            self.stats.hits += new_computed.num_computed_tokens as u64;
        }
        // Claim the hits before allocating, so that allocation cannot evict them.
        self.pool.touch(&new_computed.blocks);
        let new_blocks = self.pool.allocate(num_new_blocks)?;
        let entry = self.requests.entry(id).or_default();
        entry.block_table.extend_from_slice(&new_computed.blocks);
        entry.block_hashes.extend_from_slice(&new_computed.block_hashes);
        entry.block_table.extend(new_blocks);
        Some(&entry.block_table)
    }

    /// Offers to the prefix cache the request's full blocks among its first
    /// `num_computed_tokens` tokens, which must now hold their K and V.
    pub fn cache_blocks(&mut self, request: &Request, num_computed_tokens: usize) {
        if !self.enable_prefix_caching || request.needs_prompt_logprobs() {
            return;
        }
        let Some(entry) = self.requests.get_mut(&request.request_id()) else {
            return;
        };
        let bs = self.pool.block_size();
        let num_full = num_computed_tokens.min(request.num_tokens()) / bs;
        debug_assert!(num_full <= entry.block_table.len());
        let tokens = request.all_token_ids();
        for i in entry.block_hashes.len()..num_full {
            let parent = entry.block_hashes.last().copied();
            let hash = hash_block_tokens(parent, &tokens[i * bs..(i + 1) * bs]);
            // NOTE: a false return means another request computed the same content first; that
            // copy stays the cached one and this block stays private.
            self.pool.cache_block(entry.block_table[i], hash);
            entry.block_hashes.push(hash);
        }
    }

    /// Blocks the request's table lacks to cover its first `num_positions` positions.
    pub fn num_blocks_to_cover(&self, request_id: RequestId, num_positions: usize) -> usize {
        num_positions.div_ceil(self.block_size()).saturating_sub(self.block_table(request_id).len())
    }

    /// Makes the table of a request that holds blocks cover its first `num_positions`
    /// positions, which may run past its known tokens: the slot of a step scheduled ahead of the
    /// one in flight (`Scheduler::schedule_ahead`). `None` with nothing changed when the request
    /// holds no blocks or the pool is short.
    pub fn allocate_ahead(&mut self, request_id: RequestId, num_positions: usize) -> Option<&[BlockId]> {
        let missing = self.num_blocks_to_cover(request_id, num_positions);
        let entry = self.requests.get_mut(&request_id)?;
        if missing > 0 {
            entry.block_table.extend(self.pool.allocate(missing)?);
        }
        Some(&entry.block_table)
    }

    /// Releases all of the request's blocks, its last block first, so that when cached blocks
    /// are evicted later, a sequence loses its tail before its head (which is more likely to
    /// be shared).
    pub fn free(&mut self, request_id: RequestId) {
        if let Some(entry) = self.requests.remove(&request_id) {
            self.pool.free(entry.block_table.into_iter().rev());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&i| BlockId(i)).collect()
    }

    fn request(id: u64, prompt: Vec<u32>) -> Request {
        Request::new(RequestId(id), prompt, 16)
    }

    /// Admits `request`, computes `n` tokens of it (the whole prompt when `n` is None) and
    /// caches the full blocks, as a scheduler step would.
    fn run_prefill(kv: &mut KvCacheManager, request: &mut Request, n: Option<usize>) -> Result<Vec<BlockId>, String> {
        let hit = kv.get_computed_blocks(request);
        let n = n.unwrap_or(request.num_tokens() - hit.num_computed_tokens());
        let table = kv.allocate_slots(request, n, &hit).ok_or("allocation failed")?.to_vec();
        request.num_computed_tokens = hit.num_computed_tokens() + n;
        kv.cache_blocks(request, request.num_computed_tokens);
        Ok(table)
    }

    fn seq(start: u32, len: usize) -> Vec<u32> {
        (start..start + len as u32).collect()
    }

    #[test]
    fn block_ids_for_a_sequence_of_allocations() -> Result<(), String> {
        let mut kv = KvCacheManager::new(10, 16, true);
        let mut a = request(1, seq(0, 20));
        assert_eq!(run_prefill(&mut kv, &mut a, None)?, ids(&[0, 1]));
        let mut b = request(2, seq(100, 40));
        assert_eq!(run_prefill(&mut kv, &mut b, None)?, ids(&[2, 3, 4]));
        // Decodes of `a`: tokens 20..32 fit in block 1, token 32 opens a new block.
        for t in 20..33 {
            a.append_output_token(t);
            let table = kv.allocate_slots(&a, 1, &ComputedBlocks::default()).ok_or("full")?;
            let expected = if t < 32 { ids(&[0, 1]) } else { ids(&[0, 1, 5]) };
            assert_eq!(table, &expected[..], "token {t}");
            a.num_computed_tokens += 1;
            kv.cache_blocks(&a, a.num_computed_tokens);
        }
        assert_eq!(kv.block_pool().num_free_blocks(), 4);
        assert_eq!(kv.usage(), 0.6);
        // Asking again for tokens already allocated takes nothing more.
        let table = kv.allocate_slots(&b, 0, &ComputedBlocks::default()).ok_or("full")?;
        assert_eq!(table, &ids(&[2, 3, 4])[..]);
        kv.block_pool().check_invariants()
    }

    #[test]
    fn failed_allocation_changes_nothing() -> Result<(), String> {
        let mut kv = KvCacheManager::new(3, 16, true);
        let mut a = request(1, seq(0, 40));
        run_prefill(&mut kv, &mut a, None)?;
        let b = request(2, seq(100, 17));
        assert_eq!(kv.allocate_slots(&b, 17, &ComputedBlocks::default()), None);
        assert_eq!(kv.block_table(RequestId(2)), &[]);
        assert_eq!(kv.block_pool().num_free_blocks(), 0);
        assert_eq!(kv.prefix_cache_stats().queries, 40, "a failed admission is no lookup");
        kv.block_pool().check_invariants()
    }

    #[test]
    fn two_requests_share_a_two_block_prefix() -> Result<(), String> {
        let mut kv = KvCacheManager::new(10, 16, true);
        let mut a = request(1, seq(0, 40));
        assert_eq!(run_prefill(&mut kv, &mut a, None)?, ids(&[0, 1, 2]));
        let mut prompt = seq(0, 32);
        prompt.extend(seq(500, 8));
        let mut b = request(2, prompt);
        let hit = kv.get_computed_blocks(&b);
        assert_eq!(hit.blocks(), &ids(&[0, 1])[..]);
        assert_eq!(hit.num_computed_tokens(), 32);
        assert_eq!(run_prefill(&mut kv, &mut b, None)?, ids(&[0, 1, 3]));
        assert_eq!(b.num_computed_tokens, 40);
        let refs: Vec<u32> = (0..4).map(|i| kv.block_pool().ref_count(BlockId(i))).collect();
        assert_eq!(refs, vec![2, 2, 1, 1]);
        let stats = kv.prefix_cache_stats();
        assert_eq!((stats.queries, stats.hits), (80, 32));
        assert_eq!(stats.hit_rate(), 0.4);
        kv.free(RequestId(1));
        let refs: Vec<u32> = (0..4).map(|i| kv.block_pool().ref_count(BlockId(i))).collect();
        assert_eq!(refs, vec![1, 1, 0, 1]);
        kv.block_pool().check_invariants()
    }

    #[test]
    fn full_prompt_hit_recomputes_the_last_token() -> Result<(), String> {
        let mut kv = KvCacheManager::new(6, 16, true);
        let mut a = request(1, seq(0, 32));
        assert_eq!(run_prefill(&mut kv, &mut a, None)?, ids(&[0, 1]));
        kv.free(RequestId(1));
        let free: Vec<BlockId> = kv.block_pool().free_blocks().collect();
        assert_eq!(free, ids(&[2, 3, 4, 5, 1, 0]));

        // Same 32 tokens: only the first block is a hit; block 1 is recomputed into a fresh
        // block, since the hit must leave a token to compute.
        let mut b = request(2, seq(0, 32));
        let hit = kv.get_computed_blocks(&b);
        assert_eq!((hit.blocks(), hit.num_computed_tokens()), (&ids(&[0])[..], 16));
        assert_eq!(run_prefill(&mut kv, &mut b, None)?, ids(&[0, 2]));
        // Block 2 now holds the same content as cached block 1, which stays the cached copy.
        assert_eq!(kv.block_pool().block_hash(BlockId(2)), None);
        kv.free(RequestId(2));

        // One token more and both blocks hit.
        let mut c = request(3, seq(0, 33));
        let hit = kv.get_computed_blocks(&c);
        assert_eq!((hit.blocks(), hit.num_computed_tokens()), (&ids(&[0, 1])[..], 32));
        assert_eq!(run_prefill(&mut kv, &mut c, None)?, ids(&[0, 1, 3]));
        kv.block_pool().check_invariants()
    }

    #[test]
    fn cached_free_blocks_are_evicted_lru_tail_first() -> Result<(), String> {
        let mut kv = KvCacheManager::new(6, 4, true);
        let mut a = request(1, seq(0, 12));
        assert_eq!(run_prefill(&mut kv, &mut a, None)?, ids(&[0, 1, 2]));
        kv.free(RequestId(1));
        let mut b = request(2, seq(100, 12));
        assert_eq!(run_prefill(&mut kv, &mut b, None)?, ids(&[3, 4, 5]));
        kv.free(RequestId(2));
        let free: Vec<BlockId> = kv.block_pool().free_blocks().collect();
        assert_eq!(free, ids(&[2, 1, 0, 5, 4, 3]));
        assert_eq!(kv.block_pool().num_cached_blocks(), 6);

        // New content evicts a's tail first, then its middle.
        let mut c = request(3, seq(200, 8));
        assert_eq!(run_prefill(&mut kv, &mut c, None)?, ids(&[2, 1]));
        let free: Vec<BlockId> = kv.block_pool().free_blocks().collect();
        assert_eq!(free, ids(&[0, 5, 4, 3]));

        // a's head survived; b is whole (up to the recomputed last token).
        let a_again = request(4, seq(0, 12));
        assert_eq!(kv.get_computed_blocks(&a_again).blocks(), &ids(&[0])[..]);
        let b_again = request(5, seq(100, 13));
        assert_eq!(kv.get_computed_blocks(&b_again).blocks(), &ids(&[3, 4, 5])[..]);
        kv.block_pool().check_invariants()
    }

    #[test]
    fn hits_in_the_free_list_count_against_free_blocks() -> Result<(), String> {
        let mut kv = KvCacheManager::new(3, 4, true);
        let mut a = request(1, seq(0, 8));
        run_prefill(&mut kv, &mut a, None)?;
        kv.free(RequestId(1));
        // Blocks 0 and 1 are cached and free; block 2 is free. b hits 0 and 1 and needs two
        // more blocks: only one is left once the hits leave the free list.
        let b = request(2, seq(0, 16));
        let hit = kv.get_computed_blocks(&b);
        assert_eq!(hit.blocks(), &ids(&[0, 1])[..]);
        assert_eq!(kv.allocate_slots(&b, 8, &hit), None);
        assert_eq!(kv.block_pool().num_free_blocks(), 3);
        assert_eq!(kv.allocate_slots(&b, 4, &hit), Some(&ids(&[0, 1, 2])[..]));
        kv.block_pool().check_invariants()
    }

    #[test]
    fn chunked_prefill_caches_blocks_as_they_fill() -> Result<(), String> {
        let mut kv = KvCacheManager::new(8, 4, true);
        let mut a = request(1, seq(0, 10));
        assert_eq!(run_prefill(&mut kv, &mut a, Some(6))?, ids(&[0, 1]));
        assert_eq!(kv.block_pool().num_cached_blocks(), 1);
        assert!(kv.block_pool().block_hash(BlockId(1)).is_none(), "half-full block");
        let table = kv.allocate_slots(&a, 4, &ComputedBlocks::default()).ok_or("full")?;
        assert_eq!(table, &ids(&[0, 1, 2])[..]);
        // Allocated but not computed yet: not visible to others.
        assert_eq!(kv.block_pool().num_cached_blocks(), 1);
        a.num_computed_tokens = 10;
        kv.cache_blocks(&a, 10);
        assert_eq!(kv.block_pool().num_cached_blocks(), 2);
        kv.block_pool().check_invariants()
    }

    #[test]
    fn free_releases_blocks_in_reverse_order() -> Result<(), String> {
        let mut kv = KvCacheManager::new(4, 4, false);
        let mut a = request(1, seq(0, 9));
        assert_eq!(run_prefill(&mut kv, &mut a, None)?, ids(&[0, 1, 2]));
        kv.free(RequestId(1));
        let free: Vec<BlockId> = kv.block_pool().free_blocks().collect();
        assert_eq!(free, ids(&[3, 2, 1, 0]));
        assert_eq!(kv.block_table(RequestId(1)), &[]);
        assert_eq!(kv.usage(), 0.0);
        // Freeing an unknown request is a no-op.
        kv.free(RequestId(1));
        kv.block_pool().check_invariants()
    }

    #[test]
    fn prefix_caching_off_or_prompt_logprobs_never_hit() -> Result<(), String> {
        let mut kv = KvCacheManager::new(8, 4, false);
        let mut a = request(1, seq(0, 9));
        run_prefill(&mut kv, &mut a, None)?;
        assert_eq!(kv.block_pool().num_cached_blocks(), 0);
        assert_eq!(kv.get_computed_blocks(&request(2, seq(0, 9))).num_computed_tokens(), 0);

        let mut kv = KvCacheManager::new(8, 4, true);
        let mut a = request(1, seq(0, 9));
        run_prefill(&mut kv, &mut a, None)?;
        let b = request(2, seq(0, 9)).with_prompt_logprobs(true);
        assert_eq!(kv.get_computed_blocks(&b).num_computed_tokens(), 0);
        assert_eq!(kv.get_computed_blocks(&request(3, seq(0, 9))).num_computed_tokens(), 8);
        Ok(())
    }
}
