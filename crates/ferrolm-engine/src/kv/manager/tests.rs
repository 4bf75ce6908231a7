//! Exact block ids of the block manager: one full-attention group (every model without a
//! window), a sliding-window group alone (every layer slides), and both (hybrid models).

use super::*;

fn ids(v: &[u32]) -> Vec<BlockId> {
    v.iter().map(|&i| BlockId(i)).collect()
}

fn full(num_blocks: usize) -> [KvCacheGroupConfig; 1] {
    [KvCacheGroupConfig::full(num_blocks)]
}

fn request(id: u64, prompt: Vec<u32>) -> Request {
    Request::new(RequestId(id), prompt, 16)
}

/// One scheduler step of `request` and the update after it: its prefix hit when it holds no
/// blocks yet, `n` more tokens (all it has left when `None`), then its computed tokens advance,
/// its full blocks are cached and the blocks out of every window released. Its tables after.
fn step(kv: &mut KvCacheManager, request: &mut Request, n: Option<usize>) -> Result<Vec<Vec<BlockId>>, String> {
    let id = request.request_id();
    let hit = if kv.block_tables(id).is_empty() { kv.get_computed_blocks(request) } else { ComputedBlocks::default() };
    let start = request.num_computed_tokens + hit.num_computed_tokens();
    let n = n.unwrap_or(request.num_tokens() - start);
    kv.allocate_slots(request, n, &hit).ok_or("allocation failed")?;
    request.num_computed_tokens = start + n;
    kv.cache_blocks(request, request.num_computed_tokens);
    kv.remove_skipped_blocks(id, request.num_computed_tokens);
    Ok(kv.block_tables(id).to_vec())
}

/// [`step`] in a manager of one group: that group's table.
fn run_prefill(kv: &mut KvCacheManager, request: &mut Request, n: Option<usize>) -> Result<Vec<BlockId>, String> {
    Ok(step(kv, request, n)?.swap_remove(0))
}

fn seq(start: u32, len: usize) -> Vec<u32> {
    (start..start + len as u32).collect()
}

fn check(kv: &KvCacheManager) -> Result<(), String> {
    (0..kv.num_groups()).try_for_each(|g| kv.block_pool(g).check_invariants())
}

fn ref_counts(kv: &KvCacheManager, group: usize, blocks: &[u32]) -> Vec<u32> {
    blocks.iter().map(|&b| kv.block_pool(group).ref_count(BlockId(b))).collect()
}

fn free_list(kv: &KvCacheManager, group: usize) -> Vec<BlockId> {
    kv.block_pool(group).free_blocks().collect()
}

#[test]
fn block_ids_for_a_sequence_of_allocations() -> Result<(), String> {
    let mut kv = KvCacheManager::new(&full(10), 16, true);
    let mut a = request(1, seq(0, 20));
    assert_eq!(run_prefill(&mut kv, &mut a, None)?, ids(&[0, 1]));
    let mut b = request(2, seq(100, 40));
    assert_eq!(run_prefill(&mut kv, &mut b, None)?, ids(&[2, 3, 4]));
    // Decodes of `a`: tokens 20..32 fit in block 1, token 32 opens a new block.
    for t in 20..33 {
        a.append_output_token(t);
        let tables = kv.allocate_slots(&a, 1, &ComputedBlocks::default()).ok_or("full")?;
        let expected = if t < 32 { ids(&[0, 1]) } else { ids(&[0, 1, 5]) };
        assert_eq!(tables, &[expected][..], "token {t}");
        a.num_computed_tokens += 1;
        kv.cache_blocks(&a, a.num_computed_tokens);
    }
    assert_eq!(kv.block_pool(0).num_free_blocks(), 4);
    assert_eq!(kv.usage(), 0.6);
    // Asking again for tokens already allocated takes nothing more.
    let tables = kv.allocate_slots(&b, 0, &ComputedBlocks::default()).ok_or("full")?;
    assert_eq!(tables, &[ids(&[2, 3, 4])][..]);
    kv.block_pool(0).check_invariants()
}

#[test]
fn failed_allocation_changes_nothing() -> Result<(), String> {
    let mut kv = KvCacheManager::new(&full(3), 16, true);
    let mut a = request(1, seq(0, 40));
    run_prefill(&mut kv, &mut a, None)?;
    let b = request(2, seq(100, 17));
    assert_eq!(kv.allocate_slots(&b, 17, &ComputedBlocks::default()), None);
    assert!(kv.block_tables(RequestId(2)).is_empty());
    assert_eq!(kv.block_pool(0).num_free_blocks(), 0);
    assert_eq!(kv.prefix_cache_stats().queries, 40, "a failed admission is no lookup");
    kv.block_pool(0).check_invariants()
}

#[test]
fn two_requests_share_a_two_block_prefix() -> Result<(), String> {
    let mut kv = KvCacheManager::new(&full(10), 16, true);
    let mut a = request(1, seq(0, 40));
    assert_eq!(run_prefill(&mut kv, &mut a, None)?, ids(&[0, 1, 2]));
    let mut prompt = seq(0, 32);
    prompt.extend(seq(500, 8));
    let mut b = request(2, prompt);
    let hit = kv.get_computed_blocks(&b);
    assert_eq!(hit.blocks(0), &ids(&[0, 1])[..]);
    assert_eq!(hit.num_computed_tokens(), 32);
    assert_eq!(run_prefill(&mut kv, &mut b, None)?, ids(&[0, 1, 3]));
    assert_eq!(b.num_computed_tokens, 40);
    let refs: Vec<u32> = (0..4).map(|i| kv.block_pool(0).ref_count(BlockId(i))).collect();
    assert_eq!(refs, vec![2, 2, 1, 1]);
    let stats = kv.prefix_cache_stats();
    assert_eq!((stats.queries, stats.hits), (80, 32));
    assert_eq!(stats.hit_rate(), 0.4);
    kv.free(RequestId(1));
    let refs: Vec<u32> = (0..4).map(|i| kv.block_pool(0).ref_count(BlockId(i))).collect();
    assert_eq!(refs, vec![1, 1, 0, 1]);
    kv.block_pool(0).check_invariants()
}

#[test]
fn full_prompt_hit_recomputes_the_last_token() -> Result<(), String> {
    let mut kv = KvCacheManager::new(&full(6), 16, true);
    let mut a = request(1, seq(0, 32));
    assert_eq!(run_prefill(&mut kv, &mut a, None)?, ids(&[0, 1]));
    kv.free(RequestId(1));
    let free: Vec<BlockId> = kv.block_pool(0).free_blocks().collect();
    assert_eq!(free, ids(&[2, 3, 4, 5, 1, 0]));

    // Same 32 tokens: only the first block is a hit; block 1 is recomputed into a fresh
    // block, since the hit must leave a token to compute.
    let mut b = request(2, seq(0, 32));
    let hit = kv.get_computed_blocks(&b);
    assert_eq!((hit.blocks(0), hit.num_computed_tokens()), (&ids(&[0])[..], 16));
    assert_eq!(run_prefill(&mut kv, &mut b, None)?, ids(&[0, 2]));
    // Block 2 now holds the same content as cached block 1, which stays the cached copy.
    assert_eq!(kv.block_pool(0).block_hash(BlockId(2)), None);
    kv.free(RequestId(2));

    // One token more and both blocks hit.
    let mut c = request(3, seq(0, 33));
    let hit = kv.get_computed_blocks(&c);
    assert_eq!((hit.blocks(0), hit.num_computed_tokens()), (&ids(&[0, 1])[..], 32));
    assert_eq!(run_prefill(&mut kv, &mut c, None)?, ids(&[0, 1, 3]));
    kv.block_pool(0).check_invariants()
}

#[test]
fn cached_free_blocks_are_evicted_lru_tail_first() -> Result<(), String> {
    let mut kv = KvCacheManager::new(&full(6), 4, true);
    let mut a = request(1, seq(0, 12));
    assert_eq!(run_prefill(&mut kv, &mut a, None)?, ids(&[0, 1, 2]));
    kv.free(RequestId(1));
    let mut b = request(2, seq(100, 12));
    assert_eq!(run_prefill(&mut kv, &mut b, None)?, ids(&[3, 4, 5]));
    kv.free(RequestId(2));
    let free: Vec<BlockId> = kv.block_pool(0).free_blocks().collect();
    assert_eq!(free, ids(&[2, 1, 0, 5, 4, 3]));
    assert_eq!(kv.block_pool(0).num_cached_blocks(), 6);

    // New content evicts a's tail first, then its middle.
    let mut c = request(3, seq(200, 8));
    assert_eq!(run_prefill(&mut kv, &mut c, None)?, ids(&[2, 1]));
    let free: Vec<BlockId> = kv.block_pool(0).free_blocks().collect();
    assert_eq!(free, ids(&[0, 5, 4, 3]));

    // a's head survived; b is whole (up to the recomputed last token).
    let a_again = request(4, seq(0, 12));
    assert_eq!(kv.get_computed_blocks(&a_again).blocks(0), &ids(&[0])[..]);
    let b_again = request(5, seq(100, 13));
    assert_eq!(kv.get_computed_blocks(&b_again).blocks(0), &ids(&[3, 4, 5])[..]);
    kv.block_pool(0).check_invariants()
}

#[test]
fn hits_in_the_free_list_count_against_free_blocks() -> Result<(), String> {
    let mut kv = KvCacheManager::new(&full(3), 4, true);
    let mut a = request(1, seq(0, 8));
    run_prefill(&mut kv, &mut a, None)?;
    kv.free(RequestId(1));
    // Blocks 0 and 1 are cached and free; block 2 is free. b hits 0 and 1 and needs two
    // more blocks: only one is left once the hits leave the free list.
    let b = request(2, seq(0, 16));
    let hit = kv.get_computed_blocks(&b);
    assert_eq!(hit.blocks(0), &ids(&[0, 1])[..]);
    assert_eq!(kv.allocate_slots(&b, 8, &hit), None);
    assert_eq!(kv.block_pool(0).num_free_blocks(), 3);
    assert_eq!(kv.allocate_slots(&b, 4, &hit), Some(&[ids(&[0, 1, 2])][..]));
    kv.block_pool(0).check_invariants()
}

#[test]
fn chunked_prefill_caches_blocks_as_they_fill() -> Result<(), String> {
    let mut kv = KvCacheManager::new(&full(8), 4, true);
    let mut a = request(1, seq(0, 10));
    assert_eq!(run_prefill(&mut kv, &mut a, Some(6))?, ids(&[0, 1]));
    assert_eq!(kv.block_pool(0).num_cached_blocks(), 1);
    assert!(kv.block_pool(0).block_hash(BlockId(1)).is_none(), "half-full block");
    let tables = kv.allocate_slots(&a, 4, &ComputedBlocks::default()).ok_or("full")?;
    assert_eq!(tables, &[ids(&[0, 1, 2])][..]);
    // Allocated but not computed yet: not visible to others.
    assert_eq!(kv.block_pool(0).num_cached_blocks(), 1);
    a.num_computed_tokens = 10;
    kv.cache_blocks(&a, 10);
    assert_eq!(kv.block_pool(0).num_cached_blocks(), 2);
    kv.block_pool(0).check_invariants()
}

#[test]
fn free_releases_blocks_in_reverse_order() -> Result<(), String> {
    let mut kv = KvCacheManager::new(&full(4), 4, false);
    let mut a = request(1, seq(0, 9));
    assert_eq!(run_prefill(&mut kv, &mut a, None)?, ids(&[0, 1, 2]));
    kv.free(RequestId(1));
    let free: Vec<BlockId> = kv.block_pool(0).free_blocks().collect();
    assert_eq!(free, ids(&[3, 2, 1, 0]));
    assert!(kv.block_tables(RequestId(1)).is_empty());
    assert_eq!(kv.usage(), 0.0);
    // Freeing an unknown request is a no-op.
    kv.free(RequestId(1));
    kv.block_pool(0).check_invariants()
}

#[test]
fn prefix_caching_off_or_prompt_logprobs_never_hit() -> Result<(), String> {
    let mut kv = KvCacheManager::new(&full(8), 4, false);
    let mut a = request(1, seq(0, 9));
    run_prefill(&mut kv, &mut a, None)?;
    assert_eq!(kv.block_pool(0).num_cached_blocks(), 0);
    assert_eq!(kv.get_computed_blocks(&request(2, seq(0, 9))).num_computed_tokens(), 0);

    let mut kv = KvCacheManager::new(&full(8), 4, true);
    let mut a = request(1, seq(0, 9));
    run_prefill(&mut kv, &mut a, None)?;
    let b = request(2, seq(0, 9)).with_prompt_logprobs(true);
    assert_eq!(kv.get_computed_blocks(&b).num_computed_tokens(), 0);
    assert_eq!(kv.get_computed_blocks(&request(3, seq(0, 9))).num_computed_tokens(), 8);
    Ok(())
}

/// Window 8, blocks of 4: a query at position `p` reads `p - 7..=p`. A block is released once
/// the next query's window has passed all of it, its entry taking the null block (0); the
/// request never holds more than `ceil(8 / 4) + 1` blocks while it decodes.
#[test]
fn a_sliding_group_releases_the_blocks_its_window_has_passed() -> Result<(), String> {
    let mut kv = KvCacheManager::new(&[KvCacheGroupConfig::sliding(8, 6)], 4, true);
    assert_eq!(free_list(&kv, 0), ids(&[1, 2, 3, 4, 5, 6]), "block 0 is the null block");
    let mut a = request(1, seq(0, 14));
    // 14 prompt tokens in blocks 1-4; the next query (position 14) reads 7..=14: block 1 goes.
    assert_eq!(step(&mut kv, &mut a, None)?, [ids(&[0, 2, 3, 4])]);
    assert_eq!(free_list(&kv, 0), ids(&[5, 6, 1]));
    assert_eq!(kv.block_pool(0).num_cached_blocks(), 3, "released blocks stay cached until evicted");
    let expected = [
        // After position 14: the next query (15) reads 8..=15.
        ids(&[0, 0, 3, 4]),
        ids(&[0, 0, 3, 4]),
        // Position 16 opens block 5, the front of the free list.
        ids(&[0, 0, 3, 4, 5]),
        ids(&[0, 0, 3, 4, 5]),
        // The query at 19 reads 12..=19: block 3 (positions 8-11) goes.
        ids(&[0, 0, 0, 4, 5]),
    ];
    let free_counts = [4, 4, 3, 3, 4];
    for (i, (want, free)) in expected.iter().zip(free_counts).enumerate() {
        a.append_output_token(500 + i as u32);
        assert_eq!(step(&mut kv, &mut a, Some(1))?, std::slice::from_ref(want), "decode {i}");
        assert_eq!(kv.block_pool(0).num_free_blocks(), free, "decode {i}");
        let held: Vec<BlockId> = want.iter().copied().filter(|&b| b != BlockId(0)).collect();
        assert!(held.len() <= 3);
        assert!(held.iter().all(|&b| kv.block_pool(0).ref_count(b) == 1));
    }
    assert_eq!(free_list(&kv, 0), ids(&[6, 1, 2, 3]));
    kv.free(RequestId(1));
    assert_eq!(free_list(&kv, 0), ids(&[6, 1, 2, 3, 5, 4]), "null entries are not freed");
    assert_eq!(kv.usage(), 0.0);
    check(&kv)
}

/// A hybrid model: the full-attention group keeps every block, the sliding group only its
/// window's; the tables stay the same length, so a position's entry is at one index in both.
#[test]
fn a_hybrid_model_has_a_table_per_group() -> Result<(), String> {
    let groups = [KvCacheGroupConfig::full(10), KvCacheGroupConfig::sliding(8, 6)];
    let mut kv = KvCacheManager::new(&groups, 4, true);
    let mut a = request(1, seq(0, 14));
    assert_eq!(step(&mut kv, &mut a, None)?, [ids(&[0, 1, 2, 3]), ids(&[0, 2, 3, 4])]);
    assert_eq!((kv.block_pool(0).num_free_blocks(), kv.block_pool(1).num_free_blocks()), (6, 3));
    // The sliding group is the fuller one: 3 of its 6 blocks.
    assert_eq!(kv.usage(), 0.5);
    assert_eq!(kv.num_blocks_to_cover(RequestId(1), 17), 1);
    let tables = kv.allocate_ahead(RequestId(1), 17).ok_or("pools are short")?;
    assert_eq!(tables, [ids(&[0, 1, 2, 3, 4]), ids(&[0, 2, 3, 4, 5])]);
    kv.free(RequestId(1));
    assert_eq!(free_list(&kv, 0), ids(&[5, 6, 7, 8, 9, 4, 3, 2, 1, 0]));
    assert_eq!(free_list(&kv, 1), ids(&[6, 1, 5, 4, 3, 2]));
    check(&kv)
}

/// An allocation that one group cannot supply changes no group.
#[test]
fn a_short_group_fails_the_allocation_in_every_group() -> Result<(), String> {
    let groups = [KvCacheGroupConfig::full(8), KvCacheGroupConfig::sliding(8, 2)];
    let mut kv = KvCacheManager::new(&groups, 4, true);
    let a = request(1, seq(0, 12));
    assert_eq!(kv.allocate_slots(&a, 12, &ComputedBlocks::default()), None);
    assert_eq!((kv.block_pool(0).num_free_blocks(), kv.block_pool(1).num_free_blocks()), (8, 2));
    assert!(kv.block_tables(RequestId(1)).is_empty());
    assert_eq!(kv.prefix_cache_stats().queries, 0);
    check(&kv)
}

/// Full group and a sliding group of window 6, blocks of 4: a prefix of `k` blocks is a hit
/// when the full group holds all `k` and the sliding group the blocks of the 5 positions before
/// it. The sliding group's hit claims those only; an evicted window block shortens the hit to
/// the longest prefix both groups can still supply; requests share the blocks of a hit.
#[test]
fn a_prefix_hit_needs_only_the_window_before_it_in_a_sliding_group() -> Result<(), String> {
    let groups = [KvCacheGroupConfig::full(16), KvCacheGroupConfig::sliding(6, 6)];
    let mut kv = KvCacheManager::new(&groups, 4, true);
    let mut a = request(1, seq(0, 17));
    assert_eq!(step(&mut kv, &mut a, None)?, [ids(&[0, 1, 2, 3, 4]), ids(&[0, 0, 0, 4, 5])]);
    kv.free(RequestId(1));
    assert_eq!(free_list(&kv, 1), ids(&[6, 3, 2, 1, 5, 4]));

    // b shares a's first 16 tokens. Both groups can supply 4 blocks: the full group blocks 0-3,
    // the sliding group the blocks of positions 11-15 (3 and 4).
    let mut prompt = seq(0, 16);
    prompt.extend(seq(100, 4));
    let mut b = request(2, prompt.clone());
    let hit = kv.get_computed_blocks(&b);
    assert_eq!(hit.num_computed_tokens(), 16);
    assert_eq!((hit.blocks(0), hit.blocks(1)), (&ids(&[0, 1, 2, 3])[..], &ids(&[0, 0, 3, 4])[..]));

    // Were c to take sliding block 3 (a's positions 8-11) first, the sliding group could supply
    // a prefix of 2 blocks only (positions 3-7, in blocks 1 and 2): those of 3 and 4 need
    // position 11. The hit shrinks to 2 blocks in both groups.
    let mut evicted = kv.clone();
    let mut c = request(3, seq(900, 8));
    assert_eq!(step(&mut evicted, &mut c, None)?, [ids(&[5, 6]), ids(&[6, 3])]);
    let short = evicted.get_computed_blocks(&b);
    assert_eq!(short.num_computed_tokens(), 8);
    assert_eq!((short.blocks(0), short.blocks(1)), (&ids(&[0, 1])[..], &ids(&[1, 2])[..]));

    // b claims its hit (out of the free lists) and one new block in each group.
    assert_eq!(step(&mut kv, &mut b, None)?, [ids(&[0, 1, 2, 3, 5]), ids(&[0, 0, 0, 4, 6])]);
    let stats = kv.prefix_cache_stats();
    assert_eq!((stats.queries, stats.hits), (37, 16));
    assert_eq!(free_list(&kv, 1), ids(&[2, 1, 5, 3]), "block 3 went back once b's window passed it");

    // d, the same prompt, hits b's blocks while b runs: shared ones count both tables.
    let mut d = request(4, prompt);
    assert_eq!(step(&mut kv, &mut d, None)?, [ids(&[0, 1, 2, 3, 6]), ids(&[0, 0, 0, 4, 2])]);
    assert_eq!(ref_counts(&kv, 0, &[0, 1, 2, 3, 5, 6]), vec![2, 2, 2, 2, 1, 1]);
    assert_eq!(ref_counts(&kv, 1, &[3, 4, 6, 2]), vec![0, 2, 1, 1]);
    kv.free(RequestId(2));
    assert_eq!(ref_counts(&kv, 1, &[3, 4, 6, 2]), vec![0, 1, 0, 1]);
    check(&kv)
}
