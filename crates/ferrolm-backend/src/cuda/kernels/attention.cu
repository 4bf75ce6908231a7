// The paged KV cache: writing new tokens' K/V, and causal attention over it for a flattened
// batch of prefill chunks and decodes (the same semantics as the CPU backend's).
//
// Cache layout, per layer and for K and V alike: [num_slots, num_kv_heads * head_dim] with
// `slot = block_id * block_size + offset`.
//
// A cache holds the activations' dtype T, or (an FP8 cache, `*_fp8kv` kernels) e4m3 codes of
// each value divided by the layer's K or V scale: the kernels take the cache's element type C and
// read an element as `cache_value` / `load8_cached` give it, f32 of the code times the scale
// (crate::cpu::kv_cache's FP8 store holds the same codes and reads the same values).

// Element `at` of a cache as f32.
template <typename T> __device__ __forceinline__ float cache_value(const T* cache, u64 at, float) {
    return to_float(cache[at]);
}
__device__ __forceinline__ float cache_value(const unsigned char* cache, u64 at, float scale) {
    return e4m3x2_to_float2(cache[at]).x * scale;
}

// 8 consecutive elements of a cache row (16-byte aligned for T, 8-byte for codes) as f32.
template <typename T> __device__ __forceinline__ void load8_cached(const T* p, float, float (&x)[8]) {
    Raw8<T> raw;
    load_raw(p, raw);
    unpack8(raw, x);
}
__device__ __forceinline__ void load8_cached(const unsigned char* p, float scale, float (&x)[8]) {
    e4m3x8_to_float(*reinterpret_cast<const uint2*>(p), x);
#pragma unroll
    for (int i = 0; i < 8; i++) x[i] *= scale;
}

// k, v: [T, kv_width]; slot_mapping: [T]. A negative slot is padding and is skipped; a slot past
// the cache is skipped too (callers check slots; this only keeps the write in bounds).
template <typename T>
__device__ __forceinline__ void reshape_and_cache_impl(const T* k, const T* v, const i64* slot_mapping, T* k_cache,
                                                       T* v_cache, u32 kv_width, i64 num_slots) {
    const u64 t = blockIdx.x;
    const i64 slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) return;
    for (u32 i = threadIdx.x; i < kv_width; i += blockDim.x) {
        k_cache[(u64)slot * kv_width + i] = k[t * kv_width + i];
        v_cache[(u64)slot * kv_width + i] = v[t * kv_width + i];
    }
}

// reshape_and_cache_fp8: the same into an FP8 cache, e4m3(x / scale) rounded to nearest even and
// saturating (as crate::cpu::kv_cache writes it).
#define RESHAPE_AND_CACHE(T, S) \
    extern "C" __global__ void reshape_and_cache_##S(const T* k, const T* v, const i64* slot_mapping, T* k_cache, \
                                                     T* v_cache, u32 kv_width, i64 num_slots) { \
        pdl_enter(); \
        reshape_and_cache_impl<T>(k, v, slot_mapping, k_cache, v_cache, kv_width, num_slots); \
    } \
    extern "C" __global__ void reshape_and_cache_fp8_##S(const T* k, const T* v, const i64* slot_mapping, \
                                                         unsigned char* k_cache, unsigned char* v_cache, \
                                                         u32 kv_width, i64 num_slots, float k_scale, float v_scale) { \
        pdl_enter(); \
        const u64 t = blockIdx.x; \
        const i64 slot = slot_mapping[t]; \
        if (slot < 0 || slot >= num_slots) return; \
        for (u32 i = threadIdx.x; i < kv_width; i += blockDim.x) { \
            k_cache[(u64)slot * kv_width + i] = f32_to_e4m3(to_float(k[t * kv_width + i]) / k_scale); \
            v_cache[(u64)slot * kv_width + i] = f32_to_e4m3(to_float(v[t * kv_width + i]) / v_scale); \
        } \
    }
FOR_EACH_DTYPE(RESHAPE_AND_CACHE)

// Keys per tile: one per lane in the softmax step.
#define ATTN_TILE 32
// Accumulator elements per thread: a block covers at most `blockDim.x * ATTN_ACC` elements of
// `[rows, head_dim]` (the host picks the tile shape to fit).
#define ATTN_ACC 16

// Attention of a tile of query rows over their request's paged K/V, online softmax over tiles of
// ATTN_TILE keys staged in shared memory as f32.
//
// q, out: [T, num_heads, head_dim]; query_start_loc: [num_reqs + 1]; seq_lens: [num_reqs];
// block_tables: [num_reqs, max_blocks_per_seq]. `window` 0 means no sliding window; `softcap` 0
// means no soft-cap of the scaled scores (`soft_cap`).
//
// Grid: (ceil(T / q_tile), num_kv_heads, ceil(group / heads_per_block)). A block takes `q_tile`
// consecutive tokens and `heads_per_block` query heads of one KV head (GQA: query head `h` reads
// KV head `h / group`); its rows are (token, head) pairs, so the tokens of one request share
// every K/V tile. Tokens of different requests in one tile are handled one request (segment)
// after another.
//
// Shared memory (f32): q_s [rows, D], k_s [ATTN_TILE, D + 1] (padded: the score loop reads
// columns), v_s [ATTN_TILE, D], s_s [rows, ATTN_TILE], m_s/l_s/a_s [rows], where rows =
// q_tile * heads_per_block.
template <typename T, typename C>
__device__ __forceinline__ void paged_attention_impl(const T* q, const C* k_cache, const C* v_cache, T* out,
                                                     const u32* query_start_loc, const u32* seq_lens,
                                                     const u32* block_tables, u32 num_reqs, u32 num_tokens,
                                                     u32 num_heads, u32 num_kv_heads, u32 head_dim,
                                                     u32 max_blocks_per_seq, u32 block_size, u32 num_blocks,
                                                     u32 window, float scale, float softcap, u32 q_tile,
                                                     u32 heads_per_block, float k_scale, float v_scale) {
    extern __shared__ float smem[];
    const u32 D = head_dim;
    const u32 group = num_heads / num_kv_heads;
    const u32 kv_head = blockIdx.y;
    const u32 head0 = kv_head * group + blockIdx.z * heads_per_block;
    const u32 nh = min(heads_per_block, group - blockIdx.z * heads_per_block);
    const u32 max_rows = q_tile * heads_per_block;
    const u32 kv_width = num_kv_heads * D;
    const u32 tid = threadIdx.x, num_threads = blockDim.x;
    const u32 lane = tid & 31, warp = tid >> 5, num_warps = num_threads >> 5;

    float* q_s = smem;
    float* k_s = q_s + max_rows * D;
    float* v_s = k_s + ATTN_TILE * (D + 1);
    float* s_s = v_s + ATTN_TILE * D;
    float* m_s = s_s + max_rows * ATTN_TILE;
    float* l_s = m_s + max_rows;
    float* a_s = l_s + max_rows;

    const u32 tile_start = blockIdx.x * q_tile;
    const u32 tile_end = min(tile_start + q_tile, num_tokens);
    // The request of the tile's first token: the last r with query_start_loc[r] <= tile_start
    // (skipping requests with no query rows).
    u32 lo = 0, hi = num_reqs;
    while (lo + 1 < hi) {
        const u32 mid = (lo + hi) / 2;
        if (query_start_loc[mid] <= tile_start) lo = mid; else hi = mid;
    }
    u32 r = lo;

    for (u32 seg_start = tile_start; seg_start < tile_end;) {
        while (query_start_loc[r + 1] <= seg_start) r++;
        const u32 q_begin = query_start_loc[r], q_end = query_start_loc[r + 1];
        const u32 seg_end = min(tile_end, q_end);
        const u32 rows = (seg_end - seg_start) * nh;
        // Query rows of r sit at the last q_len positions of its context.
        const u32 pos0 = seq_lens[r] - (q_end - q_begin) + (seg_start - q_begin);
        const u32 pos_last = pos0 + (seg_end - seg_start) - 1;
        const u32 key_begin = (window != 0 && pos0 + 1 > window) ? pos0 + 1 - window : 0;
        const u32* table = block_tables + (u64)r * max_blocks_per_seq;

        // Row `row` is token `seg_start + row / nh`, query head `head0 + row % nh`.
        for (u32 e = tid; e < rows * D; e += num_threads) {
            const u32 row = e / D, d = e % D;
            const u64 token = seg_start + row / nh;
            q_s[e] = to_float(q[(token * num_heads + head0 + row % nh) * D + d]);
        }
        for (u32 row = tid; row < rows; row += num_threads) {
            m_s[row] = NEG_INF;
            l_s[row] = 0.f;
        }
        float acc[ATTN_ACC];
#pragma unroll
        for (int i = 0; i < ATTN_ACC; i++) acc[i] = 0.f;
        __syncthreads();

        for (u32 key0 = key_begin; key0 <= pos_last; key0 += ATTN_TILE) {
            for (u32 e = tid; e < ATTN_TILE * D; e += num_threads) {
                const u32 j = e / D, d = e % D, key = key0 + j;
                float kx = 0.f, vx = 0.f;
                if (key <= pos_last) {
                    const u32 block = table[key / block_size];
                    if (block < num_blocks) {
                        const u64 slot = (u64)block * block_size + key % block_size;
                        const u64 at = slot * kv_width + (u64)kv_head * D + d;
                        kx = cache_value(k_cache, at, k_scale);
                        vx = cache_value(v_cache, at, v_scale);
                    }
                }
                k_s[j * (D + 1) + d] = kx;
                v_s[j * D + d] = vx;
            }
            __syncthreads();

            // A warp computes 32 keys of one row: q_s reads broadcast, k_s reads hit 32 banks.
            for (u32 e = tid; e < rows * ATTN_TILE; e += num_threads) {
                const u32 row = e / ATTN_TILE, j = e % ATTN_TILE;
                const u32 pos = pos0 + row / nh, key = key0 + j;
                float score = NEG_INF;
                if (key <= pos && (window == 0 || (u64)key + window > pos)) {
                    const float* qr = q_s + row * D;
                    const float* kr = k_s + j * (D + 1);
                    float dot = 0.f;
                    for (u32 d = 0; d < D; d++) dot += qr[d] * kr[d];
                    score = soft_cap(dot * scale, softcap);
                }
                s_s[e] = score;
            }
            __syncthreads();

            // Online softmax, one warp per row: s_s becomes exp(score - new max).
            for (u32 row = warp; row < rows; row += num_warps) {
                const float score = s_s[row * ATTN_TILE + lane];
                const float m_old = m_s[row];
                const float m_new = fmaxf(m_old, warp_max(score));
                const float p = m_new == NEG_INF ? 0.f : expf(score - m_new);
                const float sum = warp_sum(p);
                s_s[row * ATTN_TILE + lane] = p;
                if (lane == 0) {
                    const float alpha = m_new == NEG_INF ? 1.f : expf(m_old - m_new);
                    a_s[row] = alpha;
                    l_s[row] = l_s[row] * alpha + sum;
                    m_s[row] = m_new;
                }
            }
            __syncthreads();

#pragma unroll
            for (int i = 0; i < ATTN_ACC; i++) {
                const u32 e = tid + i * num_threads;
                if (e < rows * D) {
                    const u32 row = e / D, d = e % D;
                    const float* p = s_s + row * ATTN_TILE;
                    float a = acc[i] * a_s[row];
#pragma unroll 8
                    for (u32 j = 0; j < ATTN_TILE; j++) a += p[j] * v_s[j * D + d];
                    acc[i] = a;
                }
            }
            __syncthreads();
        }

#pragma unroll
        for (int i = 0; i < ATTN_ACC; i++) {
            const u32 e = tid + i * num_threads;
            if (e < rows * D) {
                const u32 row = e / D, d = e % D;
                const u64 token = seg_start + row / nh;
                out[(token * num_heads + head0 + row % nh) * D + d] = from_float<T>(acc[i] / l_s[row]);
            }
        }
        __syncthreads();
        seg_start = seg_end;
    }
}

#define PAGED_ATTENTION(T, S) \
    extern "C" __global__ void __launch_bounds__(256) paged_attention_##S( \
        const T* q, const T* k_cache, const T* v_cache, T* out, const u32* query_start_loc, const u32* seq_lens, \
        const u32* block_tables, u32 num_reqs, u32 num_tokens, u32 num_heads, u32 num_kv_heads, u32 head_dim, \
        u32 max_blocks_per_seq, u32 block_size, u32 num_blocks, u32 window, float scale, float softcap, u32 q_tile, \
        u32 heads_per_block) { \
        pdl_enter(); \
        paged_attention_impl<T, T>(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, num_reqs, \
                                   num_tokens, num_heads, num_kv_heads, head_dim, max_blocks_per_seq, block_size, \
                                   num_blocks, window, scale, softcap, q_tile, heads_per_block, 1.f, 1.f); \
    } \
    extern "C" __global__ void __launch_bounds__(256) paged_attention_fp8kv_##S( \
        const T* q, const unsigned char* k_cache, const unsigned char* v_cache, T* out, const u32* query_start_loc, \
        const u32* seq_lens, const u32* block_tables, u32 num_reqs, u32 num_tokens, u32 num_heads, u32 num_kv_heads, \
        u32 head_dim, u32 max_blocks_per_seq, u32 block_size, u32 num_blocks, u32 window, float scale, float softcap, \
        u32 q_tile, u32 heads_per_block, float k_scale, float v_scale) { \
        pdl_enter(); \
        paged_attention_impl<T, unsigned char>(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, \
                                               num_reqs, num_tokens, num_heads, num_kv_heads, head_dim, \
                                               max_blocks_per_seq, block_size, num_blocks, window, scale, softcap, \
                                               q_tile, heads_per_block, k_scale, v_scale); \
    }
FOR_EACH_DTYPE(PAGED_ATTENTION)

// ---------------------------------------------------------------------------------------------
// Decode: one query row per block, split over the context (flash-decoding).
//
// Each block takes one token, up to G query heads of one KV head, and one partition of the
// token's visible keys. The K and V of each key are read from device memory once and serve all
// G heads.
//
// The partition's keys go through shared memory in tiles of DECODE_TILE_ELEMS elements each of K
// and V (DECODE_TILE_ELEMS / head_dim keys), copied with 16-byte cp.async into a ring of
// DECODE_STAGES tiles: while the block works on one tile, the copies of the next
// DECODE_STAGES - 1 are in flight, so that the loads of a block never wait on its arithmetic
// and each SM keeps well over 100 KB of reads outstanding (what the memory system needs to run
// near its bandwidth). The block table entry of each copied row is read by the thread that
// issues the copy.
//
// In a tile, a key's head_dim is spread over L = head_dim / 8 lanes (8 elements each), so a warp
// works on 32 / L keys at once (one key per "sub-group" of L lanes); scores are reduced over
// those L lanes with shuffles. Each sub-group keeps its own online-softmax state (max, sum,
// output accumulators) over the keys it visits; the states are merged at the end, with shuffles
// inside a warp and through shared memory across warps. With one partition the block writes the
// normalized output; with several it writes its unnormalized output and (max, sum) to the
// workspace, and the last block of the token's partitions merges them (`decode_finish`).

#define DECODE_WARPS 4
// Keys of a tile, in DECODE_PASSES passes of DECODE_WARPS * (256 / head_dim) keys (one per
// sub-group of every warp): DECODE_TILE_ELEMS / head_dim keys, whatever head_dim is.
#define DECODE_PASSES 4
#define DECODE_TILE_ELEMS (DECODE_PASSES * DECODE_WARPS * 256)
// Tiles in the ring (DECODE_STAGES - 1 in flight while one is used).
#define DECODE_STAGES 4
// Fewest keys per partition: below this a block's fixed cost outweighs its loads.
#define DECODE_MIN_PART 32

// The slot of key `key` in the cache, or -1 for a block id past the cache (whose rows read as
// zeros, as in the general kernel).
// Block sizes are powers of two in practice (16 by default): then a shift and a mask.
__device__ __forceinline__ long long decode_slot(const u32* table, u32 key, u32 block_size, u32 num_blocks) {
    const bool pow2 = (block_size & (block_size - 1)) == 0;
    const u32 index = pow2 ? key >> (__ffs(block_size) - 1) : key / block_size;
    const u32 offset = pow2 ? key & (block_size - 1) : key % block_size;
    const u32 block = table[index];
    if (block >= num_blocks) return -1;
    return (long long)block * block_size + offset;
}

// The request that owns row `t`: the last r with query_start_loc[r] <= t, past requests with
// no rows.
__device__ __forceinline__ u32 request_of_row(const u32* query_start_loc, u32 num_reqs, u32 t) {
    u32 lo = 0, hi = num_reqs;
    while (lo + 1 < hi) {
        const u32 mid = (lo + hi) / 2;
        if (query_start_loc[mid] <= t) lo = mid; else hi = mid;
    }
    while (query_start_loc[lo + 1] <= t) lo++;
    return lo;
}

// The work of one decode block, in the grid both decode kernels use ((T * num_kv_heads *
// head_chunks, num_parts), head blocks fastest, `heads` query heads per block): token t of
// request r, query heads head0..head0 + nh of KV head kv_head, and keys [start, end) of
// partition `part` of the token's visible range (the last partition takes what is left).
struct DecodeWork {
    u32 t, r, kv_head, head0, nh, part, num_parts, start, end;
};

// The work of head block `block` (blocks of one token's heads consecutive), partition `part` of
// `num_parts`. The host sizes partitions for the longest context the block tables can hold
// (`part_len`, a multiple of 16): it reads no sequence length, so that a graph replays for any.
// Each row then cuts its own visible range into `num_parts` equal partitions, a multiple of 16
// and at least `min_part` keys each (at most `part_len`): a short context is spread over
// several blocks instead of falling whole into the first of many partitions sized for the
// table's width. Partitions past the range are empty.
__device__ __forceinline__ DecodeWork decode_work_of(u32 block, u32 part, u32 num_parts, u32 heads,
                                                     const u32* query_start_loc, const u32* seq_lens, u32 num_reqs,
                                                     u32 num_heads, u32 num_kv_heads, u32 window, u32 part_len,
                                                     u32 min_part) {
    DecodeWork w;
    const u32 group = num_heads / num_kv_heads;
    const u32 head_chunks = (group + heads - 1) / heads;
    // Blocks of one token's heads are consecutive, so that blocks resident together read whole
    // cache rows (all KV heads of the same keys) rather than one head's slice of many rows.
    const u32 heads_total = num_kv_heads * head_chunks;
    w.t = block / heads_total;
    const u32 head_block = block % heads_total;
    w.kv_head = head_block / head_chunks;
    w.head0 = w.kv_head * group + (head_block % head_chunks) * heads;
    w.nh = min(heads, w.kv_head * group + group - w.head0);
    w.part = part;
    w.num_parts = num_parts;
    // A step's decodes come first (the scheduler orders them so), each one row: where row t is
    // all of request t, these three independent loads are the whole lookup. The binary search
    // is a chain of dependent loads (about ten round trips to the L2 at batch 384) that every
    // block would wait through before its first K/V copy could start.
    u32 q_begin = 0, q_end = 0, seq_len = 0;
    if (w.t < num_reqs) {
        q_begin = query_start_loc[w.t];
        q_end = query_start_loc[w.t + 1];
        seq_len = seq_lens[w.t];
    }
    if (w.t < num_reqs && q_begin == w.t && q_end == w.t + 1) {
        w.r = w.t;
    } else {
        w.r = request_of_row(query_start_loc, num_reqs, w.t);
        q_begin = query_start_loc[w.r];
        q_end = query_start_loc[w.r + 1];
        seq_len = seq_lens[w.r];
    }
    const u32 pos = seq_len - (q_end - q_begin) + (w.t - q_begin);
    const u32 key_begin = (window != 0 && pos + 1 > window) ? pos + 1 - window : 0;
    const u32 visible = pos + 1 - key_begin;
    const u32 even = ((visible + num_parts - 1) / num_parts + 15) / 16 * 16;
    const u32 len = min(max(even, min_part), part_len);
    w.start = key_begin + min(w.part * len, visible);
    w.end = w.part + 1 == w.num_parts ? pos + 1 : min(w.start + len, pos + 1);
    return w;
}

__device__ __forceinline__ DecodeWork decode_work(u32 heads, const u32* query_start_loc, const u32* seq_lens,
                                                  u32 num_reqs, u32 num_heads, u32 num_kv_heads, u32 window,
                                                  u32 part_len, u32 min_part) {
    return decode_work_of(blockIdx.x, blockIdx.y, gridDim.y, heads, query_start_loc, seq_lens, num_reqs, num_heads,
                          num_kv_heads, window, part_len, min_part);
}

// Scores are kept in base 2 (the query is pre-scaled by log2(e)), so that each exponential is
// one exp2. The factor that moves online-softmax state kept against max `m` to max `m_new >= m`
// (0 for state that has seen no key yet).
__device__ __forceinline__ float merge_scale(float m, float m_new) { return m == NEG_INF ? 0.f : exp2f(m - m_new); }

// With several partitions, the block that finishes last among those of its (token, head block)
// merges their partial results into `out`: out = sum_p 2^(m_p - M) o_p / sum_p 2^(m_p - M) l_p
// with M the largest m_p, skipping partitions with a max of -inf (they saw no keys and wrote no
// o_p). `counters[blockIdx.x]` counts the finished partitions and is left at 0 for the next
// launch. Every thread of the block calls this after its partial results are written; `w_s`
// (shared, nh * num_parts floats) may overlap whatever the block kept in shared memory before.
template <typename T>
__device__ __forceinline__ void decode_finish(const float* part_out, const float* part_ml, T* out, u32* counters,
                                              float* w_s, u32 t, u32 head0, u32 nh, u32 num_heads, u32 D,
                                              u32 num_parts) {
    __shared__ u32 is_last;
    // This block's partial results are visible to every block before it counts itself, and
    // every thread is done with the block's shared memory.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 done = atomicAdd(&counters[blockIdx.x], 1u) + 1;
        is_last = done == num_parts;
        if (done == num_parts) counters[blockIdx.x] = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // One warp per head: each partition's normalized weight 2^(m_p - M) / sum_q 2^(m_q - M) l_q,
    // 0 for partitions that saw no keys.
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    for (u32 g = warp; g < nh; g += num_warps) {
        const float* ml = part_ml + ((u64)t * num_heads + head0 + g) * num_parts * 2;
        float m = NEG_INF;
        for (u32 p = lane; p < num_parts; p += 32) m = fmaxf(m, __ldcg(ml + p * 2));
        m = warp_max(m);
        float l = 0.f;
        for (u32 p = lane; p < num_parts; p += 32) {
            const float mp = __ldcg(ml + p * 2);
            const float w = mp == NEG_INF ? 0.f : exp2f(mp - m);
            w_s[g * num_parts + p] = w;
            l += w * __ldcg(ml + p * 2 + 1);
        }
        l = warp_sum(l);
        __syncwarp();
        for (u32 p = lane; p < num_parts; p += 32) w_s[g * num_parts + p] /= l;
    }
    __syncthreads();
    for (u32 e = threadIdx.x; e < nh * D; e += blockDim.x) {
        const u32 g = e / D, d = e % D;
        const u64 row = (u64)t * num_heads + head0 + g;
        const float* w = w_s + g * num_parts;
        const float* o_p = part_out + row * num_parts * D + d;
        float o = 0.f;
#pragma unroll 4
        for (u32 p = 0; p < num_parts; p++) {
            const float wp = w[p];
            o += wp == 0.f ? 0.f : wp * __ldcg(o_p + (u64)p * D);
        }
        out[row * D + d] = from_float<T>(o);
    }
}

// A block whose partition holds no key records a max of -inf for its heads (the merge skips
// it) and takes its part in the merge (`smem` as decode_finish's `w_s`). Every thread calls it.
template <typename T>
__device__ __forceinline__ void decode_empty_partition(const DecodeWork& w, float* part_out, float* part_ml, T* out,
                                                       u32* counters, float* smem, u32 num_heads, u32 D) {
    if (threadIdx.x < w.nh) {
        const u64 at = ((u64)w.t * num_heads + w.head0 + threadIdx.x) * w.num_parts + w.part;
        part_ml[at * 2] = NEG_INF;
        part_ml[at * 2 + 1] = 0.f;
    }
    decode_finish(part_out, part_ml, out, counters, smem, w.t, w.head0, w.nh, num_heads, D, w.num_parts);
}

// The end of a decode block: merges the online-softmax states its WARPS warps left in shared
// memory, red_s [WARPS, ROWS, D] (unnormalized outputs) and ml_s [WARPS, ROWS, 2] (base-2 max,
// sum), for its nh heads, then writes the normalized output (one partition) or the partition's
// partial result, and with several partitions lets the last block merge them (`decode_finish`,
// which reuses red_s). Every thread calls this after red_s and ml_s are written and synced.
// SKEW 1: red_s's rows are D + D / 32 floats and element d of a row lies at d + d / 32
// (`decode_red_at`), for writers whose lanes would otherwise hit one bank.
template <typename T, int WARPS, int ROWS, int SKEW = 0>
__device__ __forceinline__ void decode_store(float* red_s, const float* ml_s, T* out, float* part_out,
                                             float* part_ml, u32* counters, u32 t, u32 head0, u32 nh,
                                             u32 num_heads, u32 D, u32 part, u32 num_parts) {
    const u32 red_row = D + SKEW * (D / 32);
    for (u32 e = threadIdx.x; e < nh * D; e += blockDim.x) {
        const u32 g = e / D, d = e % D;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, ml_s[(w * ROWS + g) * 2]);
        float o = 0.f, sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            const float a = merge_scale(ml_s[(w * ROWS + g) * 2], mx);
            o += a * red_s[(w * ROWS + g) * red_row + d + SKEW * (d / 32)];
            sum += a * ml_s[(w * ROWS + g) * 2 + 1];
        }
        const u64 row = (u64)t * num_heads + head0 + g;
        if (num_parts == 1) {
            out[row * D + d] = from_float<T>(o / sum);
        } else {
            part_out[(row * num_parts + part) * D + d] = o;
            if (d == 0) {
                part_ml[(row * num_parts + part) * 2] = mx;
                part_ml[(row * num_parts + part) * 2 + 1] = sum;
            }
        }
    }
    if (num_parts > 1) {
        decode_finish(part_out, part_ml, out, counters, red_s, t, head0, nh, num_heads, D, num_parts);
    }
}

// Copies keys [k0, k0 + nk) of the partition (those below `end`) into one ring slot: K and V,
// each [nk, head_dim]; keys at or past `end` and rows of blocks past the cache are zero-filled.
// A row is D / (16 / sizeof(T)) 16-byte chunks, a power of two that divides the block size, so
// each thread copies the same chunk of every (blockDim.x / chunks)-th row.
template <typename T>
__device__ __forceinline__ void decode_copy_tile(T* k_s, T* v_s, const T* k_cache, const T* v_cache,
                                                 const u32* table, u32 k0, u32 nk, u32 end, u32 D, u32 kv_width,
                                                 u32 col0, u32 block_size, u32 num_blocks) {
    const u32 per_chunk = 16 / sizeof(T);  // elements per 16-byte copy
    const u32 chunks_per_row = D / per_chunk;
    const u32 row_step = blockDim.x / chunks_per_row;
    const u32 e = (threadIdx.x % chunks_per_row) * per_chunk;
    for (u32 j = threadIdx.x / chunks_per_row; j < nk; j += row_step) {
        const u32 key = k0 + j;
        const long long slot = key < end ? decode_slot(table, key, block_size, num_blocks) : -1;
        const u64 at = slot < 0 ? 0 : (u64)slot * kv_width + col0 + e;
        cp_async16(smem_addr(k_s + j * D + e), k_cache + at, slot >= 0);
        cp_async16(smem_addr(v_s + j * D + e), v_cache + at, slot >= 0);
    }
}

// q, out: [T, num_heads, head_dim]; part_out: [T, num_heads, num_parts, head_dim] f32;
// part_ml: [T, num_heads, num_parts, 2] f32 (base-2 max and sum of exp2); counters: [T * num_kv_heads *
// head_chunks] u32, all 0 (and left so); the three unused with one partition.
// Grid: (T * num_kv_heads * head_chunks, num_parts), head blocks fastest; DECODE_WARPS warps.
// head_dim / 8 must be a power of two of at most 32. `softcap` 0 means no soft-cap of the scaled
// scores (`soft_cap`, applied in base 2). Partition p covers keys [begin + p * len, begin + (p +
// 1) * len) of the visible range, and the last partition everything past that, with len the
// row's own partition length (`decode_work_of`).
// Shared memory: the ring, DECODE_STAGES * 2 * DECODE_TILE_ELEMS elements of T; after the loop
// the same bytes hold red_s [DECODE_WARPS, G, head_dim] and ml_s [DECODE_WARPS, G, 2] (f32).
template <typename T, int G, typename C>
__device__ __forceinline__ void paged_decode_impl(const T* q, const C* k_cache, const C* v_cache, T* out,
                                                  float* part_out, float* part_ml, u32* counters,
                                                  const u32* query_start_loc,
                                                  const u32* seq_lens, const u32* block_tables, u32 num_reqs,
                                                  u32 num_heads, u32 num_kv_heads, u32 head_dim,
                                                  u32 max_blocks_per_seq, u32 block_size, u32 num_blocks, u32 window,
                                                  float scale, float softcap, u32 part_len, float k_scale,
                                                  float v_scale) {
    extern __shared__ __align__(16) unsigned char decode_smem[];
    const u32 D = head_dim;
    const u32 L = D / 8;           // lanes per key
    const u32 kpw = 32 / L;        // keys per warp step (sub-groups per warp)
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 sub = lane / L, li = lane % L;
    const DecodeWork work =
        decode_work(G, query_start_loc, seq_lens, num_reqs, num_heads, num_kv_heads, window, part_len, DECODE_MIN_PART);
    const u32 t = work.t, kv_head = work.kv_head, head0 = work.head0, nh = work.nh;
    const u32 part = work.part, num_parts = work.num_parts, start = work.start, end = work.end;
    const u32 kv_width = num_kv_heads * D;
    const u32 tile_keys = DECODE_TILE_ELEMS / D;
    const u32 pass_keys = DECODE_WARPS * kpw;

    C* ring = reinterpret_cast<C*>(decode_smem);
    float* red_s = reinterpret_cast<float*>(decode_smem);
    float* ml_s = red_s + DECODE_WARPS * G * D;

    const u32* table = block_tables + (u64)work.r * max_blocks_per_seq;

    if (start >= end) {
        decode_empty_partition(work, part_out, part_ml, out, counters, red_s, num_heads, D);
        return;
    }
    const u32 num_tiles = (end - start + tile_keys - 1) / tile_keys;
#define DECODE_RING_K(slot) (ring + (slot) * 2 * DECODE_TILE_ELEMS)
#define DECODE_RING_V(slot) (ring + (slot) * 2 * DECODE_TILE_ELEMS + DECODE_TILE_ELEMS)
    // Start the first DECODE_STAGES - 1 tiles' copies; one commit group per tile (empty past
    // the last), so that "all but DECODE_STAGES - 2 groups done" always means "tile i is in".
#pragma unroll
    for (int st = 0; st < DECODE_STAGES - 1; st++) {
        if ((u32)st < num_tiles) {
            decode_copy_tile(DECODE_RING_K(st), DECODE_RING_V(st), k_cache, v_cache, table, start + st * tile_keys,
                             tile_keys, end, D, kv_width, kv_head * D, block_size, num_blocks);
        }
        cp_async_commit();
    }

    // This lane's 8 elements of each head's query, pre-scaled (by log2(e) too: base-2 scores);
    // heads past nh stay zero.
    const float q_scale = scale * 1.4426950408889634f, cap_log2 = softcap * 1.4426950408889634f;
    float qr[G][8];
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            qr[g][i] = (u32)g < nh ? to_float(q[((u64)t * num_heads + head0 + g) * D + li * 8 + i]) * q_scale : 0.f;
        }
    }
    float acc[G][8], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[g][i] = 0.f;
    }

    for (u32 tile = 0; tile < num_tiles; tile++) {
        cp_async_wait<DECODE_STAGES - 2>();
        // Tile `tile` is in for every thread's copies, and every warp is done with the slot the
        // next copy overwrites (the one used in the previous iteration).
        __syncthreads();
        const u32 next = tile + DECODE_STAGES - 1;
        if (next < num_tiles) {
            const u32 slot = next % DECODE_STAGES;
            decode_copy_tile(DECODE_RING_K(slot), DECODE_RING_V(slot), k_cache, v_cache, table,
                             start + next * tile_keys, tile_keys, end, D, kv_width, kv_head * D, block_size,
                             num_blocks);
        }
        cp_async_commit();

        const C* k_s = DECODE_RING_K(tile % DECODE_STAGES);
        const C* v_s = DECODE_RING_V(tile % DECODE_STAGES);
        const u32 k0 = start + tile * tile_keys;
        float s[DECODE_PASSES][G];
#pragma unroll
        for (int u = 0; u < DECODE_PASSES; u++) {
            const u32 j = u * pass_keys + warp * kpw + sub;
            float kx[8];
            load8_cached(k_s + j * D + li * 8, k_scale, kx);
#pragma unroll
            for (int g = 0; g < G; g++) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) dot = fmaf(qr[g][i], kx[i], dot);
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    if ((u32)o < L) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                }
                s[u][g] = k0 + j < end ? soft_cap(dot, cap_log2) : NEG_INF;
            }
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
            float m_new = m[g];
#pragma unroll
            for (int u = 0; u < DECODE_PASSES; u++) m_new = fmaxf(m_new, s[u][g]);
            if (m_new == NEG_INF) continue;  // no key of this sub-group yet
            const float alpha = merge_scale(m[g], m_new);
            l[g] *= alpha;
#pragma unroll
            for (int i = 0; i < 8; i++) acc[g][i] *= alpha;
            m[g] = m_new;
        }
#pragma unroll
        for (int u = 0; u < DECODE_PASSES; u++) {
            const u32 j = u * pass_keys + warp * kpw + sub;
            float vx[8];
            load8_cached(v_s + j * D + li * 8, v_scale, vx);
#pragma unroll
            for (int g = 0; g < G; g++) {
                const float p = s[u][g] == NEG_INF ? 0.f : exp2f(s[u][g] - m[g]);
                l[g] += p;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[g][i] = fmaf(p, vx[i], acc[g][i]);
            }
        }
    }
#undef DECODE_RING_K
#undef DECODE_RING_V
    // Every copy has landed and every warp is done with the ring before red_s reuses it.
    cp_async_wait<0>();
    __syncthreads();

    // Merge the sub-groups of the warp (lanes li, li + L, li + 2L, ...), then the warps.
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            if ((u32)o < L) continue;
            const float m2 = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float l2 = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float m_new = fmaxf(m[g], m2);
            const float a1 = merge_scale(m[g], m_new), a2 = merge_scale(m2, m_new);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float acc2 = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
                acc[g][i] = acc[g][i] * a1 + acc2 * a2;
            }
            l[g] = l[g] * a1 + l2 * a2;
            m[g] = m_new;
        }
    }
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < G; g++) {
#pragma unroll
            for (int i = 0; i < 8; i++) red_s[(warp * G + g) * D + li * 8 + i] = acc[g][i];
            if (li == 0) {
                ml_s[(warp * G + g) * 2] = m[g];
                ml_s[(warp * G + g) * 2 + 1] = l[g];
            }
        }
    }
    __syncthreads();
    decode_store<T, DECODE_WARPS, G>(red_s, ml_s, out, part_out, part_ml, counters, t, head0, nh, num_heads, D, part,
                                     num_parts);
}

// MINB: blocks per SM the register budget is set for (3, as the bf16 ring of 64 KiB allows, leaves
// G <= 4 about 168 registers, with no spills; G = 8 holds twice the state and gets 2).
#define PAGED_DECODE(T, S, G, MINB) \
    extern "C" __global__ void __launch_bounds__(DECODE_WARPS * 32, MINB) paged_attention_decode_g##G##_##S( \
        const T* q, const T* k_cache, const T* v_cache, T* out, float* part_out, float* part_ml, u32* counters, \
        const u32* query_start_loc, const u32* seq_lens, const u32* block_tables, u32 num_reqs, u32 num_heads, \
        u32 num_kv_heads, u32 head_dim, u32 max_blocks_per_seq, u32 block_size, u32 num_blocks, u32 window, \
        float scale, float softcap, u32 part_len) { \
        pdl_enter(); \
        paged_decode_impl<T, G, T>(q, k_cache, v_cache, out, part_out, part_ml, counters, query_start_loc, seq_lens, \
                                   block_tables, num_reqs, num_heads, num_kv_heads, head_dim, max_blocks_per_seq, \
                                   block_size, num_blocks, window, scale, softcap, part_len, 1.f, 1.f); \
    } \
    extern "C" __global__ void __launch_bounds__(DECODE_WARPS * 32, MINB) paged_attention_decode_fp8kv_g##G##_##S( \
        const T* q, const unsigned char* k_cache, const unsigned char* v_cache, T* out, float* part_out, \
        float* part_ml, u32* counters, const u32* query_start_loc, const u32* seq_lens, const u32* block_tables, \
        u32 num_reqs, u32 num_heads, u32 num_kv_heads, u32 head_dim, u32 max_blocks_per_seq, u32 block_size, \
        u32 num_blocks, u32 window, float scale, float softcap, u32 part_len, float k_scale, float v_scale) { \
        pdl_enter(); \
        paged_decode_impl<T, G, unsigned char>(q, k_cache, v_cache, out, part_out, part_ml, counters, \
                                               query_start_loc, seq_lens, block_tables, num_reqs, num_heads, \
                                               num_kv_heads, head_dim, max_blocks_per_seq, block_size, num_blocks, \
                                               window, scale, softcap, part_len, k_scale, v_scale); \
    }
#define PAGED_DECODE_G1(T, S) PAGED_DECODE(T, S, 1, 3)
#define PAGED_DECODE_G2(T, S) PAGED_DECODE(T, S, 2, 3)
#define PAGED_DECODE_G4(T, S) PAGED_DECODE(T, S, 4, 3)
#define PAGED_DECODE_G8(T, S) PAGED_DECODE(T, S, 8, 2)
FOR_EACH_DTYPE(PAGED_DECODE_G1)
FOR_EACH_DTYPE(PAGED_DECODE_G2)
FOR_EACH_DTYPE(PAGED_DECODE_G4)
FOR_EACH_DTYPE(PAGED_DECODE_G8)
