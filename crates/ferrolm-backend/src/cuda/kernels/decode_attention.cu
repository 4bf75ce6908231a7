// Decode attention on tensor cores: batches of decodes (one query row per request) over bf16 or
// f16 caches, for the head sizes of flash_attention.cu but 256. Computes what the decode kernel
// of attention.cu computes, with the same work split, workspace and partition merge: one block
// per (token, up to DM_ROWS query heads of one KV head, context partition).
//
// The decode kernel of attention.cu spends about 130 instructions on every 2 keys of a warp
// (conversions, FMAs, shuffle reductions), which at large batch makes it bound by issue, not by
// the memory system (1.6 TB/s on the H200). Here the block's query heads are the 16 rows of one
// mma.m16n8k16 tile (rows past the group are zeros, never stored): a warp takes 16 keys of each
// tile and computes S = Q K^T (D / 16 * 2 mma) and O += P V (D / 8 * 2 mma, P as a T part and a
// T residual as in flash_attention.cu) from ldmatrix fragments, with the online softmax in f32
// registers in base 2; the instructions per key drop about tenfold.
//
// K/V tiles of DM_TILE_KEYS keys are copied with 16-byte cp.async into a ring of DM_STAGES
// tiles, rows padded to D + 8 elements so that ldmatrix reads hit distinct banks; each warp
// keeps its own softmax state, and the warps' states are merged at the end through shared memory
// (`decode_store`), which also writes the output or the partition's partial result.

#define DM_WARPS 4
#define DM_THREADS (DM_WARPS * 32)
// Query heads per block: the rows of one mma tile.
#define DM_ROWS 16
// Keys of a warp in each tile, and of the whole tile.
#define DM_KEYS 16
#define DM_TILE_KEYS (DM_WARPS * DM_KEYS)

// Tiles in the ring: 4 for head_dim 64 (72 KiB, three blocks per SM), 3 above (up to 102 KiB
// at 128: two blocks per SM, four tiles of each in flight).
template <int D> struct DecodeMmaStages { static constexpr int value = D <= 64 ? 4 : 3; };

__device__ __forceinline__ u32 load_pair(const void* p) { return *reinterpret_cast<const u32*>(p); }

// Arguments as paged_decode_impl's (attention.cu); head_dim is D. Grid: (T * num_kv_heads *
// head_chunks, num_parts) with head_chunks = ceil(group / DM_ROWS), head blocks fastest.
// Shared memory: the ring, DM_STAGES * 2 * DM_TILE_KEYS * (D + 8) elements of T; after the
// loop the same bytes hold red_s [DM_WARPS, DM_ROWS, D] and ml_s [DM_WARPS, DM_ROWS, 2] (f32).
template <typename T, int D>
__device__ __forceinline__ void paged_decode_mma_impl(const T* __restrict__ q, const T* __restrict__ k_cache,
                                                      const T* __restrict__ v_cache, T* __restrict__ out,
                                                      float* part_out, float* part_ml, u32* counters,
                                                      const u32* __restrict__ query_start_loc,
                                                      const u32* __restrict__ seq_lens,
                                                      const u32* __restrict__ block_tables, u32 num_reqs,
                                                      u32 num_heads, u32 num_kv_heads, u32 max_blocks_per_seq,
                                                      u32 block_size, u32 num_blocks, u32 window, float scale,
                                                      u32 part_len) {
    constexpr int STRIDE = D + 8;              // elements per shared-memory row
    constexpr int CH = D / 8;                  // 16-byte chunks per row
    constexpr int TILE = DM_TILE_KEYS * STRIDE;
    constexpr int STAGES = DecodeMmaStages<D>::value;
    constexpr int KSTEPS = D / 16;             // k steps of Q K^T
    constexpr int DT = D / 8;                  // 8-wide column tiles of O
    constexpr int LOADS = DM_TILE_KEYS * CH / DM_THREADS;
    static_assert(D % 16 == 0 && (DM_TILE_KEYS * CH) % DM_THREADS == 0, "mma tiles and even loads");
    extern __shared__ uint4 dm_smem[];
    T* ring = reinterpret_cast<T*>(dm_smem);
    float* red_s = reinterpret_cast<float*>(dm_smem);
    float* ml_s = red_s + DM_WARPS * DM_ROWS * D;

    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const DecodeWork work =
        decode_work(DM_ROWS, query_start_loc, seq_lens, num_reqs, num_heads, num_kv_heads, window, part_len);
    const u32 t = work.t, kv_head = work.kv_head, head0 = work.head0, nh = work.nh;
    const u32 part = work.part, num_parts = work.num_parts, start = work.start, end = work.end;
    const u32 kv_width = num_kv_heads * D;
    const u32* table = block_tables + (u64)work.r * max_blocks_per_seq;

    // The K/V rows of the first tiles go into the L2 while the kernels before this one finish
    // (see pdl_wait): the block tables and the context lengths were copied in before the step.
    constexpr u32 LINE = 128 / sizeof(T), LINES = D / LINE > 0 ? D / LINE : 1;
    const u32 first_end = min(end, start + (STAGES - 1) * DM_TILE_KEYS);
    for (u32 e = tid; start + e / LINES < first_end; e += DM_THREADS) {
        const long long at_slot = decode_slot(table, start + e / LINES, block_size, num_blocks);
        if (at_slot >= 0) {
            const u64 at = (u64)at_slot * kv_width + kv_head * D + (e % LINES) * LINE;
            prefetch_l2(k_cache + at);
            prefetch_l2(v_cache + at);
        }
    }
    pdl_enter();
    if (start >= end) {
        decode_empty_partition(work, part_out, part_ml, out, counters, red_s, num_heads, D);
        return;
    }

    // Copies keys of tile `tile` into ring slot `slot`; keys at or past `end` and rows of block
    // ids past the cache are zero-filled.
    auto load_tile = [&](u32 tile, u32 slot) {
        const u32 k0 = start + tile * DM_TILE_KEYS;
        T* k_s = ring + slot * 2 * TILE;
        T* v_s = k_s + TILE;
#pragma unroll
        for (int i = 0; i < LOADS; i++) {
            const u32 e = tid + i * DM_THREADS, j = e / CH, c = e % CH, key = k0 + j;
            const long long at_slot = key < end ? decode_slot(table, key, block_size, num_blocks) : -1;
            const u64 at = at_slot < 0 ? 0 : (u64)at_slot * kv_width + kv_head * D + c * 8;
            cp_async16(smem_addr(k_s + j * STRIDE + c * 8), k_cache + at, at_slot >= 0);
            cp_async16(smem_addr(v_s + j * STRIDE + c * 8), v_cache + at, at_slot >= 0);
        }
    };
    const u32 num_tiles = (end - start + DM_TILE_KEYS - 1) / DM_TILE_KEYS;
    // One commit group per tile (empty past the last), so that "all but STAGES - 2 groups done"
    // always means "tile i is in".
#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) {
        if ((u32)st < num_tiles) load_tile(st, st);
        cp_async_commit();
    }

    // This thread's rows of S and O: head gid (lo) and gid + 8 (hi) of the block; Q's A
    // fragments per k step, zeros for rows past nh.
    const u32 gid = lane >> 2, tig = lane & 3;
    const bool has_lo = gid < nh, has_hi = gid + 8 < nh;
    const T* q_lo = q + ((u64)t * num_heads + head0 + gid) * D + tig * 2;
    const T* q_hi = q_lo + 8 * D;
    u32 qf[KSTEPS][4];
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ks++) {
        qf[ks][0] = has_lo ? load_pair(q_lo + ks * 16) : 0u;
        qf[ks][1] = has_hi ? load_pair(q_hi + ks * 16) : 0u;
        qf[ks][2] = has_lo ? load_pair(q_lo + ks * 16 + 8) : 0u;
        qf[ks][3] = has_hi ? load_pair(q_hi + ks * 16 + 8) : 0u;
    }
    const float scale_log2 = scale * 1.4426950408889634f;

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
#pragma unroll
        for (int i = 0; i < 4; i++) o[dt][i] = 0.f;
    }
    float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;
    // Lane byte offsets of the K (row-major fragments) and V (transposed) ldmatrix, within the
    // warp's 16 keys of a tile (see flash_attention.cu).
    const u32 warp_rows = warp * DM_KEYS * STRIDE * sizeof(T);
    const u32 k_lane = warp_rows + (((lane & 7) + ((lane >> 4) << 3)) * STRIDE + ((lane >> 3) & 1) * 8) * sizeof(T);
    const u32 v_lane = warp_rows + (((lane & 7) + (((lane >> 3) & 1) << 3)) * STRIDE + (lane >> 4) * 8) * sizeof(T);

    for (u32 tile = 0; tile < num_tiles; tile++) {
        cp_async_wait<STAGES - 2>();
        // Tile `tile` is in for every thread's copies, and every warp is done with the slot the
        // next copy overwrites (the one used in the previous iteration).
        __syncthreads();
        const u32 next = tile + STAGES - 1;
        if (next < num_tiles) load_tile(next, next % STAGES);
        cp_async_commit();

        const u32 key0 = start + tile * DM_TILE_KEYS + warp * DM_KEYS;
        if (key0 >= end) continue;  // warp-uniform: none of this warp's keys in the partition
        const u32 kb = smem_addr(ring + (tile % STAGES) * 2 * TILE) + k_lane;
        const u32 vb = smem_addr(ring + (tile % STAGES) * 2 * TILE + TILE) + v_lane;

        float s[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int i = 0; i < 4; i++) s[nt][i] = 0.f;
        }
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) {
            // Keys 0..15 of the warp, dims 16 ks..16 ks + 15: b0, b1 of key tiles 0 and 1.
            u32 b[4];
            ldmatrix_x4(b, kb + ks * 16 * sizeof(T));
            mma16816(s[0], qf[ks], b[0], b[1], T());
            mma16816(s[1], qf[ks], b[2], b[3], T());
        }
        float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u32 key = key0 + nt * 8 + tig * 2 + (i & 1);
                s[nt][i] = key < end ? s[nt][i] * scale_log2 : NEG_INF;
            }
            mx_lo = fmaxf(mx_lo, fmaxf(s[nt][0], s[nt][1]));
            mx_hi = fmaxf(mx_hi, fmaxf(s[nt][2], s[nt][3]));
        }
        float alpha_lo, alpha_hi;
        softmax_step(s, mx_lo, mx_hi, m_lo, m_hi, l_lo, l_hi, alpha_lo, alpha_hi);
        // Once the maxima settle most tiles leave them as they are: skip the rescale then.
        if (__any_sync(0xffffffffu, alpha_lo != 1.f || alpha_hi != 1.f)) {
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                o[dt][0] *= alpha_lo;
                o[dt][1] *= alpha_lo;
                o[dt][2] *= alpha_hi;
                o[dt][3] *= alpha_hi;
            }
        }
        // S's accumulators of key tiles 0 and 1 are the A fragment of the warp's 16 keys.
        u32 p[4], p_rest[4];
        p[0] = split2(s[0][0], s[0][1], p_rest[0], T());
        p[1] = split2(s[0][2], s[0][3], p_rest[1], T());
        p[2] = split2(s[1][0], s[1][1], p_rest[2], T());
        p[3] = split2(s[1][2], s[1][3], p_rest[3], T());
#pragma unroll
        for (int np = 0; np < DT / 2; np++) {
            // Keys 0..15, dims 16 np..16 np + 15, transposed: b0, b1 of dim tiles 2 np, 2 np + 1.
            u32 b[4];
            ldmatrix_x4_trans(b, vb + np * 16 * sizeof(T));
            mma16816(o[2 * np], p, b[0], b[1], T());
            mma16816(o[2 * np + 1], p, b[2], b[3], T());
            mma16816(o[2 * np], p_rest, b[0], b[1], T());
            mma16816(o[2 * np + 1], p_rest, b[2], b[3], T());
        }
    }
    // Every copy has landed and every warp is done with the ring before red_s reuses it.
    cp_async_wait<0>();
    __syncthreads();

    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    float* red_w = red_s + warp * DM_ROWS * D;
    float* ml_w = ml_s + warp * DM_ROWS * 2;
    if (has_lo) {
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            red_w[gid * D + dt * 8 + tig * 2] = o[dt][0];
            red_w[gid * D + dt * 8 + tig * 2 + 1] = o[dt][1];
        }
        if (tig == 0) {
            ml_w[gid * 2] = m_lo;
            ml_w[gid * 2 + 1] = l_lo;
        }
    }
    if (has_hi) {
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            red_w[(gid + 8) * D + dt * 8 + tig * 2] = o[dt][2];
            red_w[(gid + 8) * D + dt * 8 + tig * 2 + 1] = o[dt][3];
        }
        if (tig == 0) {
            ml_w[(gid + 8) * 2] = m_hi;
            ml_w[(gid + 8) * 2 + 1] = l_hi;
        }
    }
    __syncthreads();
    decode_store<T, DM_WARPS, DM_ROWS>(red_s, ml_s, out, part_out, part_ml, counters, t, head0, nh, num_heads, D,
                                       part, num_parts);
}

// One kernel per (head_dim, dtype): paged_decode_mma_d{D}_{bf16,f16}, with the decode kernel's
// parameters (head_dim unused: it is D).
#define PAGED_DECODE_MMA(T, S, D) \
    extern "C" __global__ void __launch_bounds__(DM_THREADS, 2) paged_decode_mma_d##D##_##S( \
        const T* q, const T* k_cache, const T* v_cache, T* out, float* part_out, float* part_ml, u32* counters, \
        const u32* query_start_loc, const u32* seq_lens, const u32* block_tables, u32 num_reqs, u32 num_heads, \
        u32 num_kv_heads, u32 head_dim, u32 max_blocks_per_seq, u32 block_size, u32 num_blocks, u32 window, \
        float scale, u32 part_len) { \
        paged_decode_mma_impl<T, D>(q, k_cache, v_cache, out, part_out, part_ml, counters, query_start_loc, \
                                    seq_lens, block_tables, num_reqs, num_heads, num_kv_heads, max_blocks_per_seq, \
                                    block_size, num_blocks, window, scale, part_len); \
    }
#define PAGED_DECODE_MMA_HEAD_DIMS(T, S) \
    PAGED_DECODE_MMA(T, S, 64) \
    PAGED_DECODE_MMA(T, S, 80) \
    PAGED_DECODE_MMA(T, S, 96) \
    PAGED_DECODE_MMA(T, S, 128)
PAGED_DECODE_MMA_HEAD_DIMS(__nv_bfloat16, bf16)
PAGED_DECODE_MMA_HEAD_DIMS(__half, f16)
