//! Causal attention over a paged KV cache for a flattened batch of prefill chunks and decodes.
//!
//! Invariants: the cache already holds every token of each request up to `seq_lens[r]`
//! (written by `reshape_and_cache`); the `q_len` query rows of request `r` are its last `q_len`
//! positions, so a row at position `p` sees keys `0..=p`, or `p - window < j <= p` with a sliding
//! window. A layer with a soft-cap (Gemma 2) caps each scaled score before the mask. Work is
//! split over (query row, KV head) so that the query heads sharing a KV head (GQA) read each key
//! and value once.

use rayon::prelude::*;

use super::KvView;

/// Describes the flattened batch for [`paged_attention`].
#[derive(Clone, Copy, Debug)]
pub struct AttentionMetadata<'a> {
    /// `[num_reqs + 1]`: request `r` owns query rows `query_start_loc[r]..query_start_loc[r + 1]`.
    pub query_start_loc: &'a [u32],
    /// `[num_reqs]`: context length of request `r` after this step (cached + new tokens).
    /// The query rows of `r` sit at positions `seq_lens[r] - q_len + i`.
    pub seq_lens: &'a [u32],
    /// `[num_reqs, max_blocks_per_seq]`, padded: the KV block ids of each request.
    pub block_tables: &'a [u32],
    pub max_blocks_per_seq: usize,
    pub block_size: usize,
    /// A query at position `p` sees keys at positions `j` with `p - window < j <= p` (HF semantics).
    pub sliding_window: Option<usize>,
    /// Softmax scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Attention-logit soft-cap (Gemma 2): each scaled score `s` becomes `cap * tanh(s / cap)`
    /// before the mask and the softmax.
    pub softcap: Option<f32>,
}

/// Causal attention of every query row over its request's paged K/V (which must already hold the
/// new tokens: call [`reshape_and_cache`](super::reshape_and_cache) first). GQA: query head `h`
/// reads KV head `h / (num_heads / num_kv_heads)`. `q`, `out`: `[T, num_heads, head_dim]`; caches
/// as in [`reshape_and_cache`](super::reshape_and_cache).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    k_cache: KvView<'_>,
    v_cache: KvView<'_>,
    meta: &AttentionMetadata<'_>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    let shape = AttentionShape::new(num_heads, num_kv_heads, head_dim);
    // [T]: the request each query row belongs to.
    let row_request = check_batch(q, k_cache, v_cache, meta, &shape, out);
    let group_width = shape.group * head_dim;
    out.par_chunks_mut(group_width).enumerate().for_each_init(Vec::new, |scratch, (task, out_group)| {
        let (row, kv_head) = (task / num_kv_heads, task % num_kv_heads);
        let r = row_request[row];
        let q_start = meta.query_start_loc[r] as usize;
        let q_len = meta.query_start_loc[r + 1] as usize - q_start;
        let pos = meta.seq_lens[r] as usize - q_len + (row - q_start);
        let first_key = meta.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let task = GroupTask {
            q: &q[row * num_heads * head_dim + kv_head * group_width..][..group_width],
            k_cache,
            v_cache,
            block_table: &meta.block_tables[r * meta.max_blocks_per_seq..][..meta.max_blocks_per_seq],
            block_size: meta.block_size,
            keys: first_key..pos + 1,
            kv_offset: kv_head * head_dim,
            shape: &shape,
            scale: meta.scale,
            softcap: meta.softcap,
        };
        task.run(scratch, out_group);
    });
}

struct AttentionShape {
    head_dim: usize,
    /// Query heads per KV head.
    group: usize,
    /// `num_kv_heads * head_dim`: one cache slot.
    kv_width: usize,
}

impl AttentionShape {
    fn new(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> AttentionShape {
        assert!(
            num_heads > 0 && num_kv_heads > 0 && head_dim > 0,
            "paged_attention: num_heads, num_kv_heads and head_dim must be positive"
        );
        assert_eq!(
            num_heads % num_kv_heads,
            0,
            "paged_attention: {num_heads} query heads do not share {num_kv_heads} KV heads evenly"
        );
        AttentionShape { head_dim, group: num_heads / num_kv_heads, kv_width: num_kv_heads * head_dim }
    }
}

/// Checks every shape and index the kernel will rely on; returns the request of each query row.
fn check_batch(
    q: &[f32],
    k_cache: KvView<'_>,
    v_cache: KvView<'_>,
    meta: &AttentionMetadata<'_>,
    shape: &AttentionShape,
    out: &[f32],
) -> Vec<usize> {
    let num_reqs = meta.seq_lens.len();
    let qsl = meta.query_start_loc;
    assert_eq!(qsl.len(), num_reqs + 1, "paged_attention: query_start_loc must have num_reqs + 1 entries");
    assert_eq!(qsl[0], 0, "paged_attention: query_start_loc must start at 0");
    let num_tokens = qsl[num_reqs] as usize;
    let token_width = shape.group * shape.kv_width;
    assert_eq!(q.len(), num_tokens * token_width, "paged_attention: q is not [{num_tokens}, num_heads, head_dim]");
    assert_eq!(out.len(), q.len(), "paged_attention: out and q differ in size");
    assert!(meta.block_size > 0, "paged_attention: block_size is 0");
    assert_eq!(
        meta.block_tables.len(),
        num_reqs * meta.max_blocks_per_seq,
        "paged_attention: block_tables is not [num_reqs, max_blocks_per_seq]"
    );
    assert_eq!(k_cache.len(), v_cache.len(), "paged_attention: k_cache and v_cache differ in size");
    assert_eq!(k_cache.len() % shape.kv_width, 0, "paged_attention: cache is not whole slots");
    let num_blocks = k_cache.len() / shape.kv_width / meta.block_size;
    assert!(meta.sliding_window != Some(0), "paged_attention: sliding window of 0 sees nothing");
    assert!(meta.softcap.is_none_or(|c| c > 0.0), "paged_attention: a soft-cap must be positive");

    let mut row_request = Vec::with_capacity(num_tokens);
    for r in 0..num_reqs {
        assert!(qsl[r] <= qsl[r + 1], "paged_attention: query_start_loc decreases at request {r}");
        let q_len = (qsl[r + 1] - qsl[r]) as usize;
        let seq_len = meta.seq_lens[r] as usize;
        assert!(q_len <= seq_len, "paged_attention: request {r} has {q_len} queries but a context of {seq_len}");
        let blocks_used = seq_len.div_ceil(meta.block_size);
        assert!(
            blocks_used <= meta.max_blocks_per_seq,
            "paged_attention: request {r} needs {blocks_used} blocks, tables hold {}",
            meta.max_blocks_per_seq
        );
        let table = &meta.block_tables[r * meta.max_blocks_per_seq..][..blocks_used];
        if let Some(&bad) = table.iter().find(|&&b| b as usize >= num_blocks) {
            panic!("paged_attention: request {r} uses block {bad}, the cache has {num_blocks}");
        }
        row_request.extend(std::iter::repeat_n(r, q_len));
    }
    row_request
}

/// The query heads of one KV head, for one query row.
struct GroupTask<'a> {
    /// `[group, head_dim]`
    q: &'a [f32],
    k_cache: KvView<'a>,
    v_cache: KvView<'a>,
    /// `[max_blocks_per_seq]`
    block_table: &'a [u32],
    block_size: usize,
    /// Positions of the keys this row attends to.
    keys: std::ops::Range<usize>,
    /// Where this KV head starts inside a cache slot.
    kv_offset: usize,
    shape: &'a AttentionShape,
    scale: f32,
    softcap: Option<f32>,
}

impl GroupTask<'_> {
    fn run(&self, scratch: &mut Vec<f32>, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU was just checked for the features the function is compiled with.
            return unsafe { self.run_avx2(scratch, out) };
        }
        self.run_portable(scratch, out);
    }

    /// The same loops, vectorised 8 wide; the results are bitwise those of `run_portable`,
    /// since the partial sums are explicit and nothing gets fused.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, scratch: &mut Vec<f32>, out: &mut [f32]) {
        self.run_portable(scratch, out);
    }

    /// Two-pass softmax: scores of every key, then the max-subtracted weights applied to V.
    #[inline(always)]
    fn run_portable(&self, scratch: &mut Vec<f32>, out: &mut [f32]) {
        let (dim, group, n) = (self.shape.head_dim, self.shape.group, self.keys.len());
        scratch.clear();
        scratch.resize(group * n + group + dim, 0.0);
        // [group, n], [group], [head_dim] (a K or V row decoded from an FP8 cache)
        let (weights, rest) = scratch.split_at_mut(group * n);
        let (inv_sums, row) = rest.split_at_mut(group);
        for (i, key) in self.keys.clone().enumerate() {
            let k = self.cache_row(self.k_cache, key, row);
            for (g, q) in self.q.chunks_exact(dim).enumerate() {
                weights[g * n + i] = dot(q, k) * self.scale;
            }
        }
        if let Some(cap) = self.softcap {
            // In HF's order: divide, tanh, multiply.
            weights.iter_mut().for_each(|s| *s = (*s / cap).tanh() * cap);
        }
        for (w, inv_sum) in weights.chunks_exact_mut(n).zip(inv_sums.iter_mut()) {
            let max = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for v in w.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            *inv_sum = 1.0 / sum;
        }
        out.fill(0.0);
        for (i, key) in self.keys.clone().enumerate() {
            let v = self.cache_row(self.v_cache, key, row);
            for (g, o) in out.chunks_exact_mut(dim).enumerate() {
                axpy(weights[g * n + i], v, o);
            }
        }
        for (o, &inv_sum) in out.chunks_exact_mut(dim).zip(inv_sums.iter()) {
            o.iter_mut().for_each(|x| *x *= inv_sum);
        }
    }

    /// `[head_dim]`: this KV head's K or V of the token at position `key` (`buf`: `[head_dim]`,
    /// where an FP8 cache's row is decoded).
    #[inline(always)]
    fn cache_row<'c>(&self, cache: KvView<'c>, key: usize, buf: &'c mut [f32]) -> &'c [f32] {
        let block = self.block_table[key / self.block_size] as usize;
        let slot = block * self.block_size + key % self.block_size;
        cache.row(slot * self.shape.kv_width + self.kv_offset, buf)
    }
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut a_chunks = a.chunks_exact(8);
    let mut b_chunks = b.chunks_exact(8);
    for (ac, bc) in (&mut a_chunks).zip(&mut b_chunks) {
        for l in 0..8 {
            acc[l] += ac[l] * bc[l];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for (&x, &y) in a_chunks.remainder().iter().zip(b_chunks.remainder()) {
        sum += x * y;
    }
    sum
}

/// `y += a * x`
#[inline(always)]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

#[cfg(test)]
mod tests;
