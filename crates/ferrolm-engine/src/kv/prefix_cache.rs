//! Content hashes of full KV blocks, and the prefix cache's hit counters.
//!
//! A full block's hash covers its own token ids and its parent's hash, so equal hashes mean equal
//! whole prefixes, not just equal blocks: a hit on block `i` implies hits on blocks `0..i`.
//! The hash is deterministic (fixed seed, no per-process randomness), so it is stable across
//! runs and processes. Only full blocks are hashed; the partial tail of a sequence never is.
//!
//! The map from hash to block lives in [`BlockPool`](super::BlockPool), next to the free list,
//! because handing out a free block must drop its hash in the same move; each KV cache group has
//! its own pool, so a prefix is cached per group. What a group must hold of a prefix depends on
//! what its layers read ([`longest_cache_hit`]): a full-attention group every block before the
//! prefix's end, a sliding-window group only the blocks of the window before it. A hit on
//! `k` blocks is thus not always a hit on fewer in a sliding group, and the manager looks for the
//! longest prefix on which every group agrees.

use std::fmt;

use super::block_pool::{BlockId, BlockPool};

/// Hash of a full block's tokens chained to the hash of the block before it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:#018x})", self.0)
    }
}

// Constants of wyhash; any odd 64-bit constants with well-spread bits would do.
const P0: u64 = 0xa076_1d64_78bd_642f;
const P1: u64 = 0xe703_7ed1_a0b4_28db;
const P2: u64 = 0x8ebc_6af0_9c88_c6e3;
const P3: u64 = 0x5899_65cc_7537_4cc3;
/// Stands in for the parent of a sequence's first block.
const ROOT: u64 = 0x1d8e_4e27_c47d_124f;

/// Multiplies to 128 bits and folds the halves: the mixing step of wyhash.
#[inline]
fn mum(a: u64, b: u64) -> u64 {
    let r = u128::from(a) * u128::from(b);
    (r as u64) ^ ((r >> 64) as u64)
}

/// Hash of one full block: its `token_ids` chained to `parent` (`None` for a sequence's first
/// block).
pub fn hash_block_tokens(parent: Option<BlockHash>, token_ids: &[u32]) -> BlockHash {
    let seed = parent.map_or(ROOT, |p| p.0);
    let mut h = mum(seed ^ P0, token_ids.len() as u64 ^ P1);
    // Two tokens per multiply: each round takes a fresh 64-bit word.
    for pair in token_ids.chunks(2) {
        let lo = u64::from(pair[0]);
        let hi = pair.get(1).map_or(0, |&t| u64::from(t));
        h = mum(h ^ P2, (lo | (hi << 32)) ^ P3);
    }
    BlockHash(mum(h ^ P0, P1 ^ seed.rotate_left(17)))
}

/// The chained hashes of a sequence's full blocks, computed as far as lookups ask.
pub(super) struct PrefixHashes<'a> {
    tokens: &'a [u32],
    block_size: usize,
    hashes: Vec<BlockHash>,
}

impl<'a> PrefixHashes<'a> {
    pub(super) fn new(tokens: &'a [u32], block_size: usize) -> Self {
        PrefixHashes { tokens, block_size, hashes: Vec::new() }
    }

    /// The hash of block `i`, which must be full.
    pub(super) fn get(&mut self, i: usize) -> BlockHash {
        while self.hashes.len() <= i {
            let j = self.hashes.len();
            let chunk = &self.tokens[j * self.block_size..(j + 1) * self.block_size];
            self.hashes.push(hash_block_tokens(self.hashes.last().copied(), chunk));
        }
        self.hashes[i]
    }

    /// The hashes of the first `n` blocks.
    pub(super) fn first(mut self, n: usize) -> Vec<BlockHash> {
        if n > 0 {
            self.get(n - 1);
        }
        self.hashes.truncate(n);
        self.hashes
    }
}

/// The longest prefix of at most `max_blocks` full blocks that `pool` can supply to layers
/// attending through `window` (`None`: every earlier position): its length in blocks.
/// - Full attention: the blocks before it are all cached; a hit on `k` blocks is one on fewer.
/// - A sliding window: the blocks of its last `window - 1` positions are cached, which with the
///   first position after it make the first query's window. Found from the right: the first run of
///   that many cached blocks ends the longest prefix; a run reaching block 0 is a prefix too.
pub(super) fn longest_cache_hit(
    pool: &BlockPool,
    window: Option<usize>,
    hashes: &mut PrefixHashes<'_>,
    max_blocks: usize,
) -> usize {
    let cached = |hashes: &mut PrefixHashes<'_>, i| pool.lookup(hashes.get(i)).is_some();
    let Some(window) = window else {
        return (0..max_blocks).find(|&i| !cached(hashes, i)).unwrap_or(max_blocks);
    };
    let needed = (window - 1).div_ceil(pool.block_size());
    if needed == 0 {
        return max_blocks;
    }
    let mut run = 0;
    for i in (0..max_blocks).rev() {
        if cached(hashes, i) {
            run += 1;
            if run == needed {
                return i + needed;
            }
        } else {
            run = 0;
        }
    }
    run
}

/// The blocks of a hit of `num_blocks` blocks ([`longest_cache_hit`]) as a block table: a full
/// group's cached blocks, a sliding group's null block where its window does not reach.
/// `None` if a block it needs is not cached.
pub(super) fn hit_blocks(
    pool: &BlockPool,
    window: Option<usize>,
    hashes: &[BlockHash],
    num_blocks: usize,
) -> Option<Vec<BlockId>> {
    let first_read = match (window, pool.null_block()) {
        (Some(w), Some(_)) => (num_blocks * pool.block_size() + 1).saturating_sub(w) / pool.block_size(),
        _ => 0,
    };
    let null = pool.null_block();
    (0..num_blocks).map(|i| if i < first_read { null } else { pool.lookup(hashes[i]) }).collect()
}

/// Prefix-cache lookups, in tokens: `queries` prompt tokens were looked up when requests were
/// admitted, `hits` of them were found cached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    pub queries: u64,
    pub hits: u64,
}

impl PrefixCacheStats {
    /// Fraction of looked-up tokens that were cached; 0 before any lookup.
    pub fn hit_rate(&self) -> f64 {
        if self.queries == 0 {
            0.0
        } else {
            self.hits as f64 / self.queries as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_deterministic_across_runs() {
        // A fixed value: a change here silently invalidates any persisted or shared cache keys.
        let h = hash_block_tokens(None, &[1, 2, 3, 4]);
        assert_eq!(h, hash_block_tokens(None, &[1, 2, 3, 4]));
        assert_eq!(h, BlockHash(0x82dd_41cb_4a61_3c48));
    }

    #[test]
    fn hash_depends_on_parent_tokens_order_and_length() {
        let a = hash_block_tokens(None, &[1, 2, 3, 4]);
        let b = hash_block_tokens(None, &[2, 1, 3, 4]);
        let c = hash_block_tokens(Some(a), &[1, 2, 3, 4]);
        let d = hash_block_tokens(Some(b), &[1, 2, 3, 4]);
        let e = hash_block_tokens(None, &[1, 2, 3, 4, 0]);
        let f = hash_block_tokens(None, &[1, 2, 3]);
        let g = hash_block_tokens(None, &[1, 2, 3, 0]);
        let all = [a, b, c, d, e, f, g];
        for i in 0..all.len() {
            for j in i + 1..all.len() {
                assert_ne!(all[i], all[j], "hashes {i} and {j} collide");
            }
        }
    }

    #[test]
    fn hit_rate_is_hits_over_queries() {
        assert_eq!(PrefixCacheStats::default().hit_rate(), 0.0);
        let s = PrefixCacheStats { queries: 64, hits: 48 };
        assert_eq!(s.hit_rate(), 0.75);
    }
}
