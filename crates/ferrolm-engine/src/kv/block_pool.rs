//! The fixed pool of KV cache blocks: ref counts, the free list, and the blocks whose content
//! is cached under a prefix hash.
//!
//! Invariants (verified after every step by the property tests):
//! - A block is in the free list iff its ref count is 0; free + referenced = `num_blocks`.
//! - The free list is a doubly linked list threaded through `blocks` by index (no allocation,
//!   O(1) removal from the middle); each free block appears in it exactly once.
//! - The free list doubles as the LRU of cached content. [`BlockPool::allocate`] takes blocks
//!   from the front and drops whatever hash they held (eviction); [`BlockPool::free`] appends
//!   blocks at the back in the order given, keeping their hash, so a prefix hit
//!   ([`BlockPool::touch`]) can take them back out of the middle until they are evicted.
//! - `cached[h] == b` iff `blocks[b].hash == Some(h)`: one block per hash, one hash per block.
//!
//! A pool made by [`BlockPool::new`] reserves no block: block 0 is an ordinary block and the first
//! one handed out. A sliding-window group's pool ([`BlockPool::with_null_block`]) reserves block 0
//! as its null block: the entry of a block table whose block the window has passed, so that table
//! positions stay aligned. It is never handed out, never referenced, never written, and never in
//! the free list; free + referenced + 1 = `num_ids`.

use std::collections::HashMap;
use std::fmt;

use super::prefix_cache::BlockHash;

/// Index of a block in the pool; its slots are `id * block_size .. (id + 1) * block_size`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// The id as the backend's block tables hold it.
impl From<BlockId> for u32 {
    fn from(block: BlockId) -> u32 {
        block.0
    }
}

impl fmt::Debug for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "B{}", self.0)
    }
}

/// Link value meaning "no block".
const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct BlockMeta {
    ref_cnt: u32,
    /// Set once the block is full and registered in the prefix cache.
    hash: Option<BlockHash>,
    /// Free-list neighbours; meaningful only while `ref_cnt == 0`.
    prev: u32,
    next: u32,
}

/// Fixed set of KV blocks with ref counts, an LRU free list and the prefix-cache table.
#[derive(Clone, Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<BlockMeta>,
    /// Next block [`BlockPool::allocate`] hands out (the least recently freed).
    free_head: u32,
    free_tail: u32,
    num_free: usize,
    cached: HashMap<BlockHash, BlockId>,
    /// Block 0 when the pool reserves it (see the module header).
    null_block: Option<BlockId>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` tokens, free list in id order.
    ///
    /// # Panics
    /// If `block_size` is 0 or `num_blocks` does not fit below `u32::MAX`; the scheduler
    /// validates its config before building a pool.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self::with_reserved(num_blocks, block_size, false)
    }

    /// A pool whose block 0 is the null block (see the module header), then `num_blocks` free
    /// blocks `1..=num_blocks` of `block_size` tokens, free list in id order.
    ///
    /// # Panics
    /// As [`BlockPool::new`], for `num_blocks + 1` blocks.
    pub fn with_null_block(num_blocks: usize, block_size: usize) -> Self {
        Self::with_reserved(num_blocks, block_size, true)
    }

    fn with_reserved(num_blocks: usize, block_size: usize, null_block: bool) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        let first = u32::from(null_block);
        let num_ids = num_blocks + first as usize;
        assert!(num_ids < NIL as usize, "num_blocks must be below u32::MAX");
        let n = num_ids as u32;
        let blocks = (0..n)
            .map(|i| BlockMeta {
                ref_cnt: 0,
                hash: None,
                prev: if i <= first { NIL } else { i - 1 },
                next: if i < first || i + 1 == n { NIL } else { i + 1 },
            })
            .collect();
        BlockPool {
            block_size,
            blocks,
            free_head: if num_blocks == 0 { NIL } else { first },
            free_tail: if num_blocks == 0 { NIL } else { n - 1 },
            num_free: num_blocks,
            cached: HashMap::new(),
            null_block: null_block.then_some(BlockId(0)),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks it hands out (the null block is not one of them).
    pub fn num_blocks(&self) -> usize {
        self.blocks.len() - usize::from(self.null_block.is_some())
    }

    /// Ids of its blocks, `0..num_ids()`, the null block's included: the group's KV cache holds
    /// this many blocks.
    pub fn num_ids(&self) -> usize {
        self.blocks.len()
    }

    /// The block that stands for blocks a sliding window has passed, if the pool has one.
    pub fn null_block(&self) -> Option<BlockId> {
        self.null_block
    }

    pub fn num_free_blocks(&self) -> usize {
        self.num_free
    }

    /// Number of blocks registered in the prefix cache, free or in use.
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Fraction of the blocks it hands out that some request references. Cached free blocks
    /// count as free.
    pub fn usage(&self) -> f64 {
        match self.num_blocks() {
            0 => 0.0,
            n => 1.0 - self.num_free as f64 / n as f64,
        }
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks[block.index()].ref_cnt
    }

    pub fn block_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.blocks[block.index()].hash
    }

    /// The block caching `hash`, if any (in use, or free and not yet evicted).
    pub fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Free blocks from the front (next handed out) to the back (most recently freed).
    pub fn free_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut cur = self.free_head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let id = BlockId(cur);
            cur = self.blocks[cur as usize].next;
            Some(id)
        })
    }

    /// Takes `n` blocks from the front of the free list with ref count 1, evicting the cached
    /// content they held. `None`, with nothing changed, if fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let i = self.free_head;
            self.unlink(i);
            let meta = &mut self.blocks[i as usize];
            meta.ref_cnt = 1;
            if let Some(hash) = meta.hash.take() {
                self.cached.remove(&hash);
            }
            out.push(BlockId(i));
        }
        Some(out)
    }

    /// Takes a reference on each block (a prefix hit), pulling free ones out of the free list
    /// so that they can no longer be evicted.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            assert!(Some(b) != self.null_block, "the null block is never referenced");
            if self.blocks[b.index()].ref_cnt == 0 {
                self.unlink(b.0);
            }
            self.blocks[b.index()].ref_cnt += 1;
        }
    }

    /// Drops one reference on each block; blocks that reach 0 are appended to the back of the
    /// free list in the order given, keeping their cached content.
    ///
    /// # Panics
    /// If a block is already free (or is the null block): a double free means a block table is
    /// corrupt.
    pub fn free(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            assert!(Some(b) != self.null_block, "free of the null block {b:?}");
            let meta = &mut self.blocks[b.index()];
            assert!(meta.ref_cnt > 0, "double free of {b:?}");
            meta.ref_cnt -= 1;
            if meta.ref_cnt == 0 {
                self.push_back(b.0);
            }
        }
    }

    /// Registers a full, computed `block` under `hash`. Returns false (and changes nothing) if
    /// the hash already names another block: the same content was computed twice concurrently,
    /// and the first copy stays the cached one.
    pub fn cache_block(&mut self, block: BlockId, hash: BlockHash) -> bool {
        debug_assert!(self.blocks[block.index()].ref_cnt > 0, "caching a free block");
        if self.cached.contains_key(&hash) {
            return false;
        }
        debug_assert!(self.blocks[block.index()].hash.is_none(), "{block:?} already cached");
        self.blocks[block.index()].hash = Some(hash);
        self.cached.insert(hash, block);
        true
    }

    fn unlink(&mut self, i: u32) {
        let BlockMeta { prev, next, .. } = self.blocks[i as usize];
        if prev == NIL {
            self.free_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.free_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let meta = &mut self.blocks[i as usize];
        meta.prev = NIL;
        meta.next = NIL;
        self.num_free -= 1;
    }

    fn push_back(&mut self, i: u32) {
        let tail = self.free_tail;
        let meta = &mut self.blocks[i as usize];
        meta.prev = tail;
        meta.next = NIL;
        if tail == NIL {
            self.free_head = i;
        } else {
            self.blocks[tail as usize].next = i;
        }
        self.free_tail = i;
        self.num_free += 1;
    }

    /// Checks every invariant of the module header.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let n = self.blocks.len();
        let mut in_list = vec![false; n];
        let mut count = 0;
        let mut prev = NIL;
        let mut cur = self.free_head;
        while cur != NIL {
            let i = cur as usize;
            if i >= n {
                return Err(format!("free list points past the pool: {cur}"));
            }
            if in_list[i] {
                return Err(format!("B{cur} appears twice in the free list"));
            }
            in_list[i] = true;
            count += 1;
            if self.blocks[i].prev != prev {
                return Err(format!("B{cur}: prev link {} != {prev}", self.blocks[i].prev));
            }
            if self.blocks[i].ref_cnt != 0 {
                return Err(format!("B{cur} is free with ref count {}", self.blocks[i].ref_cnt));
            }
            prev = cur;
            cur = self.blocks[i].next;
        }
        if prev != self.free_tail {
            return Err(format!("free tail {} but the list ends at {prev}", self.free_tail));
        }
        if count != self.num_free {
            return Err(format!("free list holds {count} blocks, counter says {}", self.num_free));
        }
        let reserved = self.null_block.map(BlockId::index);
        if let Some(i) = reserved {
            let meta = &self.blocks[i];
            if in_list[i] || meta.ref_cnt != 0 || meta.hash.is_some() {
                return Err(format!("the null block B{i} is in use: {meta:?}, in the free list: {}", in_list[i]));
            }
        }
        if let Some(i) = (0..n).find(|&i| !in_list[i] && self.blocks[i].ref_cnt == 0 && Some(i) != reserved) {
            return Err(format!("B{i} has ref count 0 but is not in the free list"));
        }
        for (&hash, &b) in &self.cached {
            if self.blocks[b.index()].hash != Some(hash) {
                return Err(format!("cache maps {hash:?} to {b:?}, which holds another hash"));
            }
        }
        let hashed = self.blocks.iter().filter(|m| m.hash.is_some()).count();
        if hashed != self.cached.len() {
            return Err(format!("{hashed} blocks carry a hash, {} are in the cache", self.cached.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::prefix_cache::hash_block_tokens;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&i| BlockId(i)).collect()
    }

    fn free_list(pool: &BlockPool) -> Vec<BlockId> {
        pool.free_blocks().collect()
    }

    #[test]
    fn allocates_from_the_front_in_id_order() -> Result<(), String> {
        let mut pool = BlockPool::new(8, 16);
        assert_eq!(pool.allocate(3), Some(ids(&[0, 1, 2])));
        assert_eq!(pool.allocate(2), Some(ids(&[3, 4])));
        assert_eq!(pool.num_free_blocks(), 3);
        assert_eq!(pool.usage(), 5.0 / 8.0);
        pool.free(ids(&[2, 1, 0]));
        assert_eq!(free_list(&pool), ids(&[5, 6, 7, 2, 1, 0]));
        assert_eq!(pool.allocate(4), Some(ids(&[5, 6, 7, 2])));
        pool.check_invariants()
    }

    #[test]
    fn allocation_beyond_free_count_changes_nothing() -> Result<(), String> {
        let mut pool = BlockPool::new(4, 16);
        assert_eq!(pool.allocate(3), Some(ids(&[0, 1, 2])));
        assert_eq!(pool.allocate(2), None);
        assert_eq!(pool.num_free_blocks(), 1);
        assert_eq!(free_list(&pool), ids(&[3]));
        assert_eq!(pool.allocate(1), Some(ids(&[3])));
        assert_eq!(pool.allocate(1), None);
        assert_eq!(pool.allocate(0), Some(vec![]));
        pool.check_invariants()
    }

    #[test]
    fn touch_pulls_a_cached_block_out_of_the_middle() -> Result<(), String> {
        let mut pool = BlockPool::new(5, 4);
        let blocks = pool.allocate(3).ok_or("pool too small")?;
        let h = hash_block_tokens(None, &[1, 2, 3, 4]);
        assert!(pool.cache_block(blocks[1], h));
        pool.free(blocks.iter().rev().copied());
        assert_eq!(free_list(&pool), ids(&[3, 4, 2, 1, 0]));
        assert_eq!(pool.lookup(h), Some(BlockId(1)));
        pool.touch(&[BlockId(1)]);
        assert_eq!(free_list(&pool), ids(&[3, 4, 2, 0]));
        assert_eq!(pool.ref_count(BlockId(1)), 1);
        // A second reference on a block in use leaves the free list alone.
        pool.touch(&[BlockId(1)]);
        assert_eq!(pool.ref_count(BlockId(1)), 2);
        assert_eq!(pool.num_free_blocks(), 4);
        pool.free([BlockId(1)]);
        assert_eq!(free_list(&pool), ids(&[3, 4, 2, 0]));
        pool.free([BlockId(1)]);
        assert_eq!(free_list(&pool), ids(&[3, 4, 2, 0, 1]));
        pool.check_invariants()
    }

    #[test]
    fn allocation_evicts_cached_content() -> Result<(), String> {
        let mut pool = BlockPool::new(2, 4);
        let a = pool.allocate(2).ok_or("pool too small")?;
        let h0 = hash_block_tokens(None, &[1, 2, 3, 4]);
        let h1 = hash_block_tokens(Some(h0), &[5, 6, 7, 8]);
        assert!(pool.cache_block(a[0], h0));
        assert!(pool.cache_block(a[1], h1));
        pool.free(a.iter().rev().copied());
        assert_eq!(free_list(&pool), ids(&[1, 0]));
        assert_eq!(pool.num_cached_blocks(), 2);
        // The tail block of the freed sequence goes first.
        assert_eq!(pool.allocate(1), Some(ids(&[1])));
        assert_eq!(pool.lookup(h1), None);
        assert_eq!(pool.block_hash(BlockId(1)), None);
        assert_eq!(pool.lookup(h0), Some(BlockId(0)));
        pool.check_invariants()
    }

    #[test]
    fn one_block_per_hash() -> Result<(), String> {
        let mut pool = BlockPool::new(2, 4);
        let a = pool.allocate(2).ok_or("pool too small")?;
        let h = hash_block_tokens(None, &[9, 9, 9, 9]);
        assert!(pool.cache_block(a[0], h));
        assert!(!pool.cache_block(a[1], h));
        assert_eq!(pool.lookup(h), Some(a[0]));
        assert_eq!(pool.block_hash(a[1]), None);
        pool.check_invariants()
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut pool = BlockPool::new(1, 4);
        pool.free([BlockId(0)]);
    }

    #[test]
    fn the_null_block_is_never_handed_out() -> Result<(), String> {
        let mut pool = BlockPool::with_null_block(3, 4);
        assert_eq!((pool.num_blocks(), pool.num_ids(), pool.null_block()), (3, 4, Some(BlockId(0))));
        assert_eq!(free_list(&pool), ids(&[1, 2, 3]));
        assert_eq!(pool.allocate(3), Some(ids(&[1, 2, 3])));
        assert_eq!(pool.allocate(1), None);
        assert_eq!(pool.usage(), 1.0);
        pool.free(ids(&[3, 1]));
        assert_eq!(free_list(&pool), ids(&[3, 1]));
        assert_eq!(pool.ref_count(BlockId(0)), 0);
        pool.check_invariants()?;
        let mut empty = BlockPool::with_null_block(0, 4);
        assert_eq!(empty.allocate(1), None);
        assert_eq!(empty.usage(), 0.0);
        empty.check_invariants()
    }

    #[test]
    #[should_panic(expected = "null block")]
    fn freeing_the_null_block_panics() {
        let mut pool = BlockPool::with_null_block(2, 4);
        pool.free([BlockId(0)]);
    }

    #[test]
    fn empty_pool() -> Result<(), String> {
        let mut pool = BlockPool::new(0, 16);
        assert_eq!(pool.allocate(1), None);
        assert_eq!(pool.usage(), 0.0);
        assert_eq!(free_list(&pool), vec![]);
        pool.check_invariants()
    }
}
