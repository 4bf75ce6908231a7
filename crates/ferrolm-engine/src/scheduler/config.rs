//! What the scheduler is configured with: its budgets, the KV cache groups and their pools, the
//! one admission rule, and how the groups' pools are sized from a block count or a byte budget.
//!
//! Sizing a sliding-window group (window `w`, blocks of `bs` tokens). A request that has
//! computed `c` tokens with `m` more in flight holds the blocks touching positions
//! `c - w + 1 ..= c + m - 1` (its next query reads back to `c - w + 1`; see `kv::group`): at most
//! `ceil((w + m - 2) / bs) + 1`. Over `R` requests with `M` tokens in flight in all, each ceiling
//! being at most its argument plus `(bs - 1) / bs`, that is at most `(R (w + 2 bs - 3) + M) / bs`
//! blocks. With `R = max_num_seqs` and `M` two steps' budgets (a step in flight and one scheduled
//! ahead of it) this is what the group is given when it is not the model's only group
//! ([`SchedulerConfig::sliding_group_blocks`]): every step `schedule()` can make finds its blocks
//! there, and so does a step scheduled ahead while no seat changes hands.
//! NOTE: the rounder `max_num_seqs * (ceil(w / bs) + 1) + ceil(M / bs)` falls short when many
//! requests run short prompt chunks: a chunk of 3 tokens may cross a block boundary that a
//! decode would not. A step scheduled ahead may also seat new requests in the seats of requests
//! ending with the step in flight, whose blocks are released only by its update; if the group is
//! short then, that step is simply not scheduled ahead.

use super::SchedulerError;
use crate::kv::KvCacheGroupConfig;
use crate::request::RequestId;

/// Tokens per KV block unless measured otherwise; the binary sizes its KV cache with it.
pub const BLOCK_SIZE: usize = 16;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most requests running at once.
    pub max_num_seqs: usize,
    /// Token budget of one step, summed over all scheduled requests.
    pub max_num_batched_tokens: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// The KV cache groups in the model's order (ferrolm-model's `ModelConfig::kv_cache_groups`:
    /// full attention first), each with the blocks of its pool. One group of full attention for
    /// a model whose layers do not slide.
    pub kv_cache_groups: Vec<KvCacheGroupConfig>,
    /// Longest sequence (prompt + outputs) a request may reach.
    pub max_model_len: usize,
    /// Most tokens one request gets in a step, so that one long prompt cannot take the whole
    /// budget from the prompts queued behind it.
    pub long_prefill_token_threshold: Option<usize>,
    /// Most prompt rows a step computes logits of for requests that ask for prompt logprobs
    /// (their prompts run in chunks of at most this many tokens in all).
    pub max_prompt_logprob_rows: usize,
    pub enable_prefix_caching: bool,
}

impl SchedulerConfig {
    /// Defaults for everything but the pool size and the model's length: one group of full
    /// attention with `num_blocks` blocks, 256 sequences, 2048 tokens a step, blocks of 16
    /// tokens, no per-request chunk cap, 256 prompt-logprob rows a step, prefix caching on.
    pub fn new(num_blocks: usize, max_model_len: usize) -> Self {
        SchedulerConfig {
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            block_size: BLOCK_SIZE,
            kv_cache_groups: vec![KvCacheGroupConfig::full(num_blocks)],
            max_model_len,
            long_prefill_token_threshold: None,
            max_prompt_logprob_rows: 256,
            enable_prefix_caching: true,
        }
    }

    /// This config with the KV cache groups of a model whose groups attend through `windows`,
    /// sized by [`Self::kv_cache_groups_for`].
    pub fn with_kv_cache_groups(mut self, windows: &[Option<usize>], num_blocks: usize) -> Self {
        self.kv_cache_groups = self.kv_cache_groups_for(windows, num_blocks);
        self
    }

    /// Most prompt tokens of requests that ask for prompt logprobs that one step runs (each
    /// needs its row's logits): `max_prompt_logprob_rows`, at most the token budget.
    pub fn prompt_logprob_rows(&self) -> usize {
        self.max_prompt_logprob_rows.min(self.max_num_batched_tokens)
    }

    /// Most logits rows one step has: one for each request that samples, and the prompt rows of
    /// requests that ask for prompt logprobs.
    pub fn max_logits_rows(&self) -> usize {
        (self.max_num_seqs + self.prompt_logprob_rows()).min(self.max_num_batched_tokens)
    }

    /// Most tokens one request runs in a step.
    pub fn max_chunk_tokens(&self) -> usize {
        self.long_prefill_token_threshold.map_or(self.max_num_batched_tokens, |t| t.min(self.max_num_batched_tokens))
    }

    /// KV blocks a request of this length may hold at once in `group`. The last sampled token is
    /// never run, so at most `num_prompt_tokens + max_tokens - 1` tokens hold K and V; in a
    /// sliding-window group, at most those of its window before a step and the step's chunk
    /// (see the module header).
    pub fn max_blocks_of(&self, group: &KvCacheGroupConfig, num_prompt_tokens: usize, max_tokens: usize) -> usize {
        let whole = (num_prompt_tokens + max_tokens).saturating_sub(1).div_ceil(self.block_size);
        match group.sliding_window {
            Some(w) => whole.min((w + self.max_chunk_tokens()).saturating_sub(2).div_ceil(self.block_size) + 1),
            None => whole,
        }
    }

    /// Refuses a request that could never run alone in the whole pool of some group. Checking
    /// the worst case keeps the guarantee that a lone request always finishes, rather than
    /// preempting itself forever. The one admission rule: the engine's handle and the scheduler
    /// both ask it.
    pub fn check_fits_kv_cache(
        &self,
        request_id: RequestId,
        num_prompt_tokens: usize,
        max_tokens: usize,
    ) -> Result<(), SchedulerError> {
        for group in &self.kv_cache_groups {
            let num_blocks_needed = self.max_blocks_of(group, num_prompt_tokens, max_tokens);
            if num_blocks_needed > group.num_blocks {
                return Err(SchedulerError::ExceedsKvCache {
                    request_id,
                    num_blocks_needed,
                    num_blocks: group.num_blocks,
                });
            }
        }
        Ok(())
    }

    /// Blocks a sliding-window group of `window` needs for `max_num_seqs` requests with two
    /// steps in flight (see the module header).
    pub fn sliding_group_blocks(&self, window: usize) -> usize {
        let bs = self.block_size;
        (self.max_num_seqs * (window + 2 * bs - 3) + 2 * self.max_num_batched_tokens) / bs
    }

    /// The KV cache groups of a model whose groups attend through `windows`: the first (full
    /// attention, or the one group of a model whose layers all slide) with `num_blocks` blocks,
    /// a sliding group after it with what it needs ([`Self::sliding_group_blocks`]), at most
    /// `num_blocks`: its tables hold real blocks only at positions where the first group's do,
    /// so more would sit idle.
    pub fn kv_cache_groups_for(&self, windows: &[Option<usize>], num_blocks: usize) -> Vec<KvCacheGroupConfig> {
        let sized = |(i, window): (usize, &Option<usize>)| match window {
            Some(w) if i > 0 => KvCacheGroupConfig::sliding(*w, self.sliding_group_blocks(*w).min(num_blocks)),
            _ => KvCacheGroupConfig { sliding_window: *window, num_blocks },
        };
        windows.iter().enumerate().map(sized).collect()
    }

    /// The most blocks the first group may have such that the caches of all the groups
    /// ([`Self::kv_cache_groups_for`], null blocks included) fit in `budget` bytes, a block of
    /// group `g` taking `bytes_per_block[g]`.
    pub fn num_blocks_within(&self, windows: &[Option<usize>], bytes_per_block: &[usize], budget: usize) -> usize {
        let bytes = |num_blocks: usize| {
            let groups = self.kv_cache_groups_for(windows, num_blocks);
            groups.iter().zip(bytes_per_block).map(|(g, &b)| g.num_cache_blocks().saturating_mul(b)).sum::<usize>()
        };
        // `bytes` grows with the block count: the largest count within the budget, by bisection.
        let first = bytes_per_block.first().copied().unwrap_or(0).max(1);
        let (mut fits, mut over) = (0, budget / first + 1);
        while fits + 1 < over {
            let mid = fits + (over - fits) / 2;
            if bytes(mid) <= budget {
                fits = mid;
            } else {
                over = mid;
            }
        }
        fits
    }

    pub fn validate(&self) -> Result<(), SchedulerError> {
        let positive = [
            (self.max_num_seqs, "max_num_seqs"),
            (self.max_num_batched_tokens, "max_num_batched_tokens"),
            (self.block_size, "block_size"),
            (self.max_model_len, "max_model_len"),
            (self.long_prefill_token_threshold.unwrap_or(1), "long_prefill_token_threshold"),
            (self.max_prompt_logprob_rows, "max_prompt_logprob_rows"),
        ];
        let groups = self.kv_cache_groups.iter();
        let in_groups =
            groups.flat_map(|g| [(g.num_blocks, "num_blocks"), (g.sliding_window.unwrap_or(1), "a sliding window")]);
        if let Some((_, name)) = positive.into_iter().chain(in_groups).find(|(v, _)| *v == 0) {
            return Err(SchedulerError::InvalidConfig(format!("{name} must be at least 1")));
        }
        if self.kv_cache_groups.is_empty() {
            return Err(SchedulerError::InvalidConfig("the KV cache needs at least one group".into()));
        }
        // Block ids are u32 with u32::MAX reserved as the free list's end marker.
        if let Some(g) = self.kv_cache_groups.iter().find(|g| g.num_cache_blocks() >= u32::MAX as usize) {
            return Err(SchedulerError::InvalidConfig(format!(
                "num_blocks must be below {}, got {}",
                u32::MAX as usize - usize::from(g.sliding_window.is_some()),
                g.num_blocks
            )));
        }
        Ok(())
    }
}
