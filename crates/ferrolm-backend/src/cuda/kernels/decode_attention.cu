// Decode attention on tensor cores: batches of decodes (one query row per request) over bf16 or
// f16 caches (or FP8 ones: see below), for the head sizes of flash_attention.cu but 256. Computes what the decode kernel
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
//
// Over an FP8 cache (`paged_decode_mma_fp8kv_d{D}`, the block kernel only) the ring holds the
// tiles' codes (rows of D bytes padded to D + 16) and each warp builds its mma fragments from
// them in registers (`decode_mma_codes`): no pass through shared memory converts them, and the
// block meets at one barrier a tile, as over dense caches. Those mma run in f16 whatever T is:
// every code is an exact half, Q's rows are scaled by a power of two into the half's range, and
// the cache's scales are applied in f32 (K's with the softmax scale, V's to the sums); P is a
// half and its residual, as over dense caches.

#define DM_WARPS 4
#define DM_THREADS (DM_WARPS * 32)
// Query heads per block: the rows of one mma tile.
#define DM_ROWS 16
// Keys of a warp in each tile, and of the whole tile.
#define DM_KEYS 16
#define DM_TILE_KEYS (DM_WARPS * DM_KEYS)

// Tiles in the ring: 4 for head_dim 64 (72 KiB, three blocks per SM), 3 above (up to 102 KiB
// at 128: two blocks per SM, four tiles of each in flight); over FP8 caches 40 KiB at 64 and 55
// KiB at 128 (three blocks per SM).
template <int D> struct DecodeMmaStages { static constexpr int value = D <= 64 ? 4 : 3; };

// The per-warp kernel's K/V rows come in by bulk copies on sm_90 and later (DM_BULK=0, through
// FERROLM_KERNEL_DEFINES, keeps them on cp.async there too, to compare).
#ifndef DM_BULK
#define DM_BULK 1
#endif

__device__ __forceinline__ u32 load_pair(const void* p) { return *reinterpret_cast<const u32*>(p); }

// Where a decode kernel's threads read one KV head's rows: the cache, its block table and sizes.
template <typename T> struct DecodeKv {
    const T* k_cache;
    const T* v_cache;
    const u32* table;
    u32 kv_width, col0, block_size, num_blocks;
};

// Prefetches into the L2 the K/V rows of keys [start, end) that `threads` threads, this one
// `thread`, cover 128 bytes at a time (before pdl_wait: no kernel writes the cache rows read).
template <typename T, int D>
__device__ __forceinline__ void decode_prefetch(const DecodeKv<T>& kv, u32 start, u32 end, u32 thread, u32 threads) {
    constexpr u32 LINE = 128 / sizeof(T), LINES = D / LINE > 0 ? D / LINE : 1;
    for (u32 e = thread; start + e / LINES < end; e += threads) {
        const long long at_slot = decode_slot(kv.table, start + e / LINES, kv.block_size, kv.num_blocks);
        if (at_slot >= 0) {
            const u64 at = (u64)at_slot * kv.kv_width + kv.col0 + (e % LINES) * LINE;
            prefetch_l2(kv.k_cache + at);
            prefetch_l2(kv.v_cache + at);
        }
    }
}

// Copies KEYS keys from k0 into a ring slot (K rows, then V rows at k_s + KEYS * (D + 8)) with
// THREADS threads, this one `thread`; keys at or past `end` and rows of block ids past the cache
// are zero-filled.
template <typename T, int D, int KEYS, int THREADS>
__device__ __forceinline__ void decode_load_keys(T* k_s, const DecodeKv<T>& kv, u32 k0, u32 end, u32 thread) {
    constexpr int STRIDE = D + 8, CH = D / 8, LOADS = KEYS * CH / THREADS;
    static_assert((KEYS * CH) % THREADS == 0, "even loads");
    T* v_s = k_s + KEYS * STRIDE;
#pragma unroll
    for (int i = 0; i < LOADS; i++) {
        const u32 e = thread + i * THREADS, j = e / CH, c = e % CH, key = k0 + j;
        const long long at_slot = key < end ? decode_slot(kv.table, key, kv.block_size, kv.num_blocks) : -1;
        const u64 at = at_slot < 0 ? 0 : (u64)at_slot * kv.kv_width + kv.col0 + c * 8;
        cp_async16(smem_addr(k_s + j * STRIDE + c * 8), kv.k_cache + at, at_slot >= 0);
        cp_async16(smem_addr(v_s + j * STRIDE + c * 8), kv.v_cache + at, at_slot >= 0);
    }
}

// Bytes per row of a ring slot of FP8 codes: D codes and 16 bytes of padding, so that the lanes
// of a fragment load (decode_mma_codes) hit distinct banks at head size 128 (two lanes share one
// in some loads of the other sizes).
template <int D> struct CodeRow { static constexpr int BYTES = D + 16; };

// Copies KEYS keys' FP8 codes from k0 into a ring slot (K rows, then V rows at codes_s + KEYS *
// CodeRow<D>::BYTES) with THREADS threads, this one `thread`; zero-filled as decode_load_keys.
template <int D, int KEYS, int THREADS>
__device__ __forceinline__ void decode_load_codes(unsigned char* codes_s, const DecodeKv<unsigned char>& kv, u32 k0,
                                                  u32 end, u32 thread) {
    constexpr u32 CH = D / 16, SB = CodeRow<D>::BYTES;  // 16-code chunks per row
    unsigned char* v_s = codes_s + KEYS * SB;
    for (u32 e = thread; e < KEYS * CH; e += THREADS) {
        const u32 j = e / CH, c = e % CH, key = k0 + j;
        const long long at_slot = key < end ? decode_slot(kv.table, key, kv.block_size, kv.num_blocks) : -1;
        const u64 at = at_slot < 0 ? 0 : (u64)at_slot * kv.kv_width + kv.col0 + c * 16;
        cp_async16(smem_addr(codes_s + j * SB + c * 16), kv.k_cache + at, at_slot >= 0);
        cp_async16(smem_addr(v_s + j * SB + c * 16), kv.v_cache + at, at_slot >= 0);
    }
}

// Q's A fragments per k step for this lane's rows of the 16-row tile: head gid (lo) and gid + 8
// (hi) of the block's heads at `q_row` (head0's row of the token); zeros for rows past nh.
template <typename T, int D>
__device__ __forceinline__ void load_q_fragments(const T* q_row, u32 gid, u32 tig, bool has_lo, bool has_hi,
                                                 u32 (&qf)[D / 16][4]) {
    const T* q_lo = q_row + gid * D + tig * 2;
    const T* q_hi = q_lo + 8 * D;
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        qf[ks][0] = has_lo ? load_pair(q_lo + ks * 16) : 0u;
        qf[ks][1] = has_hi ? load_pair(q_hi + ks * 16) : 0u;
        qf[ks][2] = has_lo ? load_pair(q_lo + ks * 16 + 8) : 0u;
        qf[ks][3] = has_hi ? load_pair(q_hi + ks * 16 + 8) : 0u;
    }
}

// The shared address of a lane's ldmatrix row for k step `ks` (16 columns) of a 16-key tile,
// from `row` (the tile's address plus the lane's row and, unswizzled, column offset) and `x`.
// Unswizzled rows are padded and contiguous: the step moves 32 bytes. Swizzled tiles (tensor
// copies with 128-byte swizzling) hold 64-column halves 2 KiB apart, each of 16 rows of 128
// bytes whose 16-byte chunk c lies at chunk c ^ (row % 8); `x` is the lane's chunk (0 or 1 of a
// step's two) XOR its row % 8, times 16.
template <typename T, bool SWIZZLED> __device__ __forceinline__ u32 tile_step(u32 row, u32 x, int ks) {
    if (SWIZZLED) return row + (ks / 4) * 2048 + ((((2 * ks) & 7) * 16) ^ x);
    return row + ks * 16 * sizeof(T);
}

// The online-softmax step of a warp's 16 keys from key0: S's accumulators `s` (keys at or past
// `end` masked) times scale_lo (the lane's row gid) or scale_hi (gid + 8), in base 2, soft-capped;
// O rescaled where a row's maximum moved; P as the A fragment of the 16 keys in T, each weight
// rounded once (`p`) plus its residual (`p_rest`): one rounding alone leaves a sum of values that
// cancel far from the exact one.
template <typename T, int D>
__device__ __forceinline__ void decode_softmax_keys(float (&s)[2][4], u32 key0, u32 end, u32 tig, float scale_lo,
                                                    float scale_hi, float cap_log2, float (&o)[D / 8][4], float& m_lo,
                                                    float& m_hi, float& l_lo, float& l_hi, u32 (&p)[4],
                                                    u32 (&p_rest)[4]) {
    float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 key = key0 + nt * 8 + tig * 2 + (i & 1);
            s[nt][i] = key < end ? soft_cap(s[nt][i] * (i < 2 ? scale_lo : scale_hi), cap_log2) : NEG_INF;
        }
        mx_lo = fmaxf(mx_lo, fmaxf(s[nt][0], s[nt][1]));
        mx_hi = fmaxf(mx_hi, fmaxf(s[nt][2], s[nt][3]));
    }
    float alpha_lo, alpha_hi;
    softmax_step(s, mx_lo, mx_hi, m_lo, m_hi, l_lo, l_hi, alpha_lo, alpha_hi);
    // Once the maxima settle most tiles leave them as they are: skip the rescale then.
    if (__any_sync(0xffffffffu, alpha_lo != 1.f || alpha_hi != 1.f)) {
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++) {
            o[dt][0] *= alpha_lo;
            o[dt][1] *= alpha_lo;
            o[dt][2] *= alpha_hi;
            o[dt][3] *= alpha_hi;
        }
    }
    // S's accumulators of key tiles 0 and 1 are the A fragment of the warp's 16 keys.
    p[0] = split2(s[0][0], s[0][1], p_rest[0], T());
    p[1] = split2(s[0][2], s[0][3], p_rest[1], T());
    p[2] = split2(s[1][0], s[1][1], p_rest[2], T());
    p[3] = split2(s[1][2], s[1][3], p_rest[3], T());
}

// A warp's 16 keys from key0 (those at or past `end` masked): S = Q K^T from the K rows at
// shared address kb, the online-softmax step on the lane's state, then O += P V from the V rows
// at vb (kb and vb with the lane's ldmatrix offsets applied, kx and vx their swizzle: see
// tile_step and flash_attention.cu).
template <typename T, int D, bool SWIZZLED = false>
__device__ __forceinline__ void decode_mma_keys(u32 kb, u32 vb, u32 kx, u32 vx, u32 key0, u32 end, u32 tig,
                                                float scale_log2, float cap_log2, const u32 (&qf)[D / 16][4],
                                                float (&o)[D / 8][4],
                                                float& m_lo, float& m_hi, float& l_lo, float& l_hi) {
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int i = 0; i < 4; i++) s[nt][i] = 0.f;
    }
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        // Keys 0..15, dims 16 ks..16 ks + 15: b0, b1 of key tiles 0 and 1.
        u32 b[4];
        ldmatrix_x4(b, tile_step<T, SWIZZLED>(kb, kx, ks));
        mma16816(s[0], qf[ks], b[0], b[1], T());
        mma16816(s[1], qf[ks], b[2], b[3], T());
    }
    u32 p[4], p_rest[4];
    decode_softmax_keys<T, D>(s, key0, end, tig, scale_log2, scale_log2, cap_log2, o, m_lo, m_hi, l_lo, l_hi, p, p_rest);
#pragma unroll
    for (int np = 0; np < D / 16; np++) {
        // Keys 0..15, dims 16 np..16 np + 15, transposed: b0, b1 of dim tiles 2 np, 2 np + 1.
        u32 b[4];
        ldmatrix_x4_trans(b, tile_step<T, SWIZZLED>(vb, vx, np));
        mma16816(o[2 * np], p, b[0], b[1], T());
        mma16816(o[2 * np + 1], p, b[2], b[3], T());
        mma16816(o[2 * np], p_rest, b[0], b[1], T());
        mma16816(o[2 * np + 1], p_rest, b[2], b[3], T());
    }
}

// Over FP8 caches (see the top): the mma take the codes as halves in an order of K's dims and V's
// columns that lets each lane load whole words of its rows.
//
// S = Q K^T: the sums run over dims, so any order of them does as long as Q's fragments follow it.
// Lane (gid, tig) loads R = D / 4 codes of its key's row, dims tig R .. tig R + R - 1; in k step s
// its slots 2 tig, 2 tig + 1 take dims tig R + 4 s, + 1 and slots 2 tig + 8, + 9 dims tig R + 4 s + 2,
// + 3 (the low and high halves of its word s).
//
// O += P V: the sums run over keys, which stay in order (P is S's accumulators); the columns are
// dims, and column n of column tile j stands for dim W (n + 8 (j / W)) + j % W, W being the
// widest power of two up to 16 dividing D / 8: lane (gid, tig) loads W codes of rows 2 tig,
// 2 tig + 1, 2 tig + 8 and 2 tig + 9 from dim W (gid + 8 jj) for each jj, and a byte permute pairs
// rows 2 tig and 2 tig + 1 (2 tig + 8 and 2 tig + 9) of one dim, the B fragment's two halves.
template <int D> struct CodeFragments {
    static constexpr int R = D / 4;  // K codes a lane loads per key
    static constexpr int DT = D / 8;
    static constexpr int W = DT % 16 == 0 ? 16 : DT % 8 == 0 ? 8 : DT % 4 == 0 ? 4 : 2;
    // The dim of O's column n of column tile j.
    static __device__ __forceinline__ u32 dim(u32 j, u32 n) { return W * (n + 8 * (j / W)) + j % W; }
};

// N codes (N a multiple of 4) from a shared address aligned to the widest access N allows, as
// words (the first code in the lowest byte).
template <int N> __device__ __forceinline__ void load_code_words(const unsigned char* p, u32 (&w)[N / 4]) {
    static_assert(N % 4 == 0, "whole words");
    if constexpr (N % 16 == 0) {
#pragma unroll
        for (int i = 0; i < N / 16; i++) {
            const uint4 v = reinterpret_cast<const uint4*>(p)[i];
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    } else if constexpr (N % 8 == 0) {
#pragma unroll
        for (int i = 0; i < N / 8; i++) {
            const uint2 v = reinterpret_cast<const uint2*>(p)[i];
            w[2 * i] = v.x, w[2 * i + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N / 4; i++) w[i] = reinterpret_cast<const u32*>(p)[i];
    }
}

// W codes of a row for the V fragments: W / 4 words, or one word holding 2 codes in its low half.
template <int W> __device__ __forceinline__ void load_code_group(const unsigned char* p, u32 (&w)[W >= 4 ? W / 4 : 1]) {
    if constexpr (W >= 4) {
        load_code_words<W>(p, w);
    } else {
        w[0] = *reinterpret_cast<const unsigned short*>(p);
    }
}

// The power of two that takes a row whose largest magnitude is `mx` into [2^14, 2^15) (within a
// normal f32), so that its values are halves as exact as T's; 1 for a zero row (or one not finite,
// which stays what it is).
__device__ __forceinline__ float half_range_factor(float mx) {
    if (!(mx > 0.f) || !isfinite(mx)) return 1.f;
    const int e = (int)((__float_as_uint(mx) >> 23) & 0xffu) - 127;
    const int k = min(max(14 - e, -126), 127);
    return __uint_as_float((u32)(k + 127) << 23);
}

// Q's A fragments in halves for decode_mma_codes: the lane's rows (heads gid and gid + 8 of the
// block's, at `q_row`; zeros past nh) each times its half_range_factor, in the dim order of the K
// words. Returns the rows' factors.
template <typename T, int D>
__device__ __forceinline__ float2 load_q_fragments_f16(const T* q_row, u32 gid, u32 tig, bool has_lo, bool has_hi,
                                                       u32 (&qf)[D / 16][4]) {
    constexpr int R = CodeFragments<D>::R;
    const T* q_lo = q_row + gid * D + tig * R;
    const T* q_hi = q_lo + 8 * D;
    float lo[R], hi[R], mx_lo = 0.f, mx_hi = 0.f;
#pragma unroll
    for (int i = 0; i < R; i += 2) {
        const u32 a = has_lo ? load_pair(q_lo + i) : 0u, b = has_hi ? load_pair(q_hi + i) : 0u;
        const float2 fa = pair_to_float2(*reinterpret_cast<const typename Pair2<T>::type*>(&a));
        const float2 fb = pair_to_float2(*reinterpret_cast<const typename Pair2<T>::type*>(&b));
        lo[i] = fa.x, lo[i + 1] = fa.y, hi[i] = fb.x, hi[i + 1] = fb.y;
        mx_lo = fmaxf(mx_lo, fmaxf(fabsf(fa.x), fabsf(fa.y)));
        mx_hi = fmaxf(mx_hi, fmaxf(fabsf(fb.x), fabsf(fb.y)));
    }
    // The quad's four lanes hold the row between them.
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    const float f_lo = half_range_factor(mx_lo), f_hi = half_range_factor(mx_hi);
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        qf[ks][0] = pack2(lo[4 * ks] * f_lo, lo[4 * ks + 1] * f_lo, __half());
        qf[ks][1] = pack2(hi[4 * ks] * f_hi, hi[4 * ks + 1] * f_hi, __half());
        qf[ks][2] = pack2(lo[4 * ks + 2] * f_lo, lo[4 * ks + 3] * f_lo, __half());
        qf[ks][3] = pack2(hi[4 * ks + 2] * f_hi, hi[4 * ks + 3] * f_hi, __half());
    }
    return make_float2(f_lo, f_hi);
}

// decode_mma_keys over FP8 codes: a warp's 16 keys from key0 at k_rows and v_rows (ring rows of
// CodeRow<D>::BYTES), Q's fragments from load_q_fragments_f16, scores times scale_lo or
// scale_hi (the softmax scale in base 2, K's cache scale and 1 / the row's factor). O's columns
// are in CodeFragments' order and its sums in code units (times V's scale later).
template <int D>
__device__ __forceinline__ void decode_mma_codes(const unsigned char* k_rows, const unsigned char* v_rows, u32 key0,
                                                 u32 end, u32 gid, u32 tig, float scale_lo, float scale_hi,
                                                 float cap_log2, const u32 (&qf)[D / 16][4], float (&o)[D / 8][4],
                                                 float& m_lo, float& m_hi, float& l_lo, float& l_hi) {
    using F = CodeFragments<D>;
    constexpr int SB = CodeRow<D>::BYTES, R = F::R, W = F::W, WORDS = W >= 4 ? W / 4 : 1;
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int i = 0; i < 4; i++) s[nt][i] = 0.f;
        // Key 8 nt + gid, dims tig R ..: word ks is k step ks's b0 (low half) and b1 (high half).
        u32 kw[R / 4];
        load_code_words<R>(k_rows + (nt * 8 + gid) * SB + tig * R, kw);
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            mma16816(s[nt], qf[ks], e4m3x2_to_half2(kw[ks]), e4m3x2_to_half2(kw[ks] >> 16), __half());
        }
    }
    // P in halves and their residuals, as over dense caches.
    u32 p[4], p_rest[4];
    decode_softmax_keys<__half, D>(s, key0, end, tig, scale_lo, scale_hi, cap_log2, o, m_lo, m_hi, l_lo, l_hi, p,
                                   p_rest);
#pragma unroll
    for (int jj = 0; jj < D / 8 / W; jj++) {
        const unsigned char* at = v_rows + W * (gid + 8 * jj) + 2 * tig * SB;
        u32 r0[WORDS], r1[WORDS], r8[WORDS], r9[WORDS];
        load_code_group<W>(at, r0);
        load_code_group<W>(at + SB, r1);
        load_code_group<W>(at + 8 * SB, r8);
        load_code_group<W>(at + 9 * SB, r9);
#pragma unroll
        for (int i = 0; i < WORDS; i++) {
            // Dims 4 i, 4 i + 1 of the group (bytes 0, 1 of each word), then 4 i + 2, 4 i + 3.
#pragma unroll
            for (int h = 0; h < (W >= 4 ? 2 : 1); h++) {
                const u32 sel = h == 0 ? 0x5140u : 0x7362u;
                const u32 lo = __byte_perm(r0[i], r1[i], sel), hi = __byte_perm(r8[i], r9[i], sel);
                const int j = jj * W + 4 * i + 2 * h;
                const u32 b0 = e4m3x2_to_half2(lo), b1 = e4m3x2_to_half2(hi);
                const u32 c0 = e4m3x2_to_half2(lo >> 16), c1 = e4m3x2_to_half2(hi >> 16);
                mma16816(o[j], p, b0, b1, __half());
                mma16816(o[j + 1], p, c0, c1, __half());
                mma16816(o[j], p_rest, b0, b1, __half());
                mma16816(o[j + 1], p_rest, c0, c1, __half());
            }
        }
    }
}

// Arguments as paged_decode_impl's (attention.cu); head_dim is D. Grid: (T * num_kv_heads *
// head_chunks, num_parts) with head_chunks = ceil(group / DM_ROWS), head blocks fastest.
// Shared memory: the ring, DM_STAGES * 2 * DM_TILE_KEYS * (D + 8) elements of T (over FP8 caches
// DM_STAGES * 2 * DM_TILE_KEYS * (D + 16) codes); after the loop the same bytes hold red_s
// [DM_WARPS, DM_ROWS, D] (over FP8 caches rows of D + D / 32, skewed) and ml_s [DM_WARPS,
// DM_ROWS, 2] (f32).
template <typename T, typename C, int D>
__device__ __forceinline__ void paged_decode_mma_impl(const T* __restrict__ q, const C* __restrict__ k_cache,
                                                      const C* __restrict__ v_cache, T* __restrict__ out,
                                                      float* part_out, float* part_ml, u32* counters,
                                                      const u32* __restrict__ query_start_loc,
                                                      const u32* __restrict__ seq_lens,
                                                      const u32* __restrict__ block_tables, u32 num_reqs,
                                                      u32 num_heads, u32 num_kv_heads, u32 max_blocks_per_seq,
                                                      u32 block_size, u32 num_blocks, u32 window, float scale,
                                                      float softcap, u32 part_len, float k_scale, float v_scale) {
    constexpr bool FP8 = sizeof(C) == 1;
    constexpr int STRIDE = D + 8;              // elements per shared-memory row
    constexpr int TILE = DM_TILE_KEYS * STRIDE;
    constexpr int STAGES = DecodeMmaStages<D>::value;
    constexpr int KSTEPS = D / 16;             // k steps of Q K^T
    constexpr int DT = D / 8;                  // 8-wide column tiles of O
    static_assert(D % 16 == 0, "mma tiles");
    // FP8: a slot holds the tile's K then V codes, rows of CodeRow<D>::BYTES.
    constexpr int CODE_SLOT = 2 * DM_TILE_KEYS * CodeRow<D>::BYTES;
    extern __shared__ uint4 dm_smem[];
    T* ring = reinterpret_cast<T*>(dm_smem);
    unsigned char* code_ring = reinterpret_cast<unsigned char*>(dm_smem);
    // The merge's rows of O: over FP8 caches skewed by a float every 32 (see the stores below).
    constexpr int SKEW = FP8 ? 1 : 0, RED_ROW = D + SKEW * (D / 32);
    float* red_s = reinterpret_cast<float*>(dm_smem);
    float* ml_s = red_s + DM_WARPS * DM_ROWS * RED_ROW;

    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const DecodeWork work =
        decode_work(DM_ROWS, query_start_loc, seq_lens, num_reqs, num_heads, num_kv_heads, window, part_len, DM_TILE_KEYS);
    const u32 t = work.t, kv_head = work.kv_head, head0 = work.head0, nh = work.nh;
    const u32 part = work.part, num_parts = work.num_parts, start = work.start, end = work.end;
    const u32 kv_width = num_kv_heads * D;
    const u32* table = block_tables + (u64)work.r * max_blocks_per_seq;

    // The K/V rows of the first tiles go into the L2 while the kernels before this one finish
    // (see pdl_wait): the block tables and the context lengths were copied in before the step.
    const DecodeKv<C> kv{k_cache, v_cache, table, kv_width, kv_head * D, block_size, num_blocks};
    decode_prefetch<C, D>(kv, start, min(end, start + (STAGES - 1) * DM_TILE_KEYS), tid, DM_THREADS);
    pdl_enter();
    if (start >= end) {
        decode_empty_partition(work, part_out, part_ml, out, counters, red_s, num_heads, D);
        return;
    }

    auto load_tile = [&](u32 tile, u32 slot) {
        if constexpr (FP8) {
            decode_load_codes<D, DM_TILE_KEYS, DM_THREADS>(code_ring + slot * CODE_SLOT, kv, start + tile * DM_TILE_KEYS,
                                                           end, tid);
        } else {
            decode_load_keys<T, D, DM_TILE_KEYS, DM_THREADS>(ring + slot * 2 * TILE, kv, start + tile * DM_TILE_KEYS,
                                                             end, tid);
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
    u32 qf[KSTEPS][4];
    const T* q_row = q + ((u64)t * num_heads + head0) * D;
    const float scale_log2 = scale * 1.4426950408889634f, cap_log2 = softcap * 1.4426950408889634f;
    // FP8: Q in halves, each row times its factor f; its scores times k_scale / f.
    float scale_lo = scale_log2, scale_hi = scale_log2;
    if constexpr (FP8) {
        const float2 f = load_q_fragments_f16<T, D>(q_row, gid, tig, has_lo, has_hi, qf);
        scale_lo = scale_log2 * k_scale / f.x;
        scale_hi = scale_log2 * k_scale / f.y;
    } else {
        load_q_fragments<T, D>(q_row, gid, tig, has_lo, has_hi, qf);
    }

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
        if constexpr (FP8) {
            const unsigned char* k_rows = code_ring + (tile % STAGES) * CODE_SLOT + warp * DM_KEYS * CodeRow<D>::BYTES;
            decode_mma_codes<D>(k_rows, k_rows + DM_TILE_KEYS * CodeRow<D>::BYTES, key0, end, gid, tig, scale_lo,
                                scale_hi, cap_log2, qf, o, m_lo, m_hi, l_lo, l_hi);
        } else {
            const T* kv_tile = ring + (tile % STAGES) * 2 * TILE;
            const u32 kb = smem_addr(kv_tile) + k_lane;
            const u32 vb = smem_addr(kv_tile + TILE) + v_lane;
            decode_mma_keys<T, D>(kb, vb, 0, 0, key0, end, tig, scale_log2, cap_log2, qf, o, m_lo, m_hi, l_lo, l_hi);
        }
    }
    // Every copy has landed and every warp is done with the ring before red_s reuses it.
    cp_async_wait<0>();
    __syncthreads();

    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    float* red_w = red_s + warp * DM_ROWS * RED_ROW;
    float* ml_w = ml_s + warp * DM_ROWS * 2;
    // Where o[dt][c] goes in its row: column 2 tig + c of tile dt, in order over dense caches;
    // over FP8 ones in CodeFragments' order (its sums in code units), where one (dt, c) is 32
    // floats apart from lane to lane, so each 32 floats of a row move by one (SKEW): a store's
    // lanes then hit distinct banks at head size 128 instead of one.
    const float o_scale = FP8 ? v_scale : 1.f;
    auto at = [&](int dt, u32 c) {
        const u32 d = FP8 ? CodeFragments<D>::dim(dt, tig * 2 + c) : dt * 8 + tig * 2 + c;
        return d + SKEW * (d / 32);
    };
    if (has_lo) {
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            red_w[gid * RED_ROW + at(dt, 0)] = o[dt][0] * o_scale;
            red_w[gid * RED_ROW + at(dt, 1)] = o[dt][1] * o_scale;
        }
        if (tig == 0) {
            ml_w[gid * 2] = m_lo;
            ml_w[gid * 2 + 1] = l_lo;
        }
    }
    if (has_hi) {
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            red_w[(gid + 8) * RED_ROW + at(dt, 0)] = o[dt][2] * o_scale;
            red_w[(gid + 8) * RED_ROW + at(dt, 1)] = o[dt][3] * o_scale;
        }
        if (tig == 0) {
            ml_w[(gid + 8) * 2] = m_hi;
            ml_w[(gid + 8) * 2 + 1] = l_hi;
        }
    }
    __syncthreads();
    decode_store<T, DM_WARPS, DM_ROWS, SKEW>(red_s, ml_s, out, part_out, part_ml, counters, t, head0, nh, num_heads, D,
                                       part, num_parts);
}

// The same attention with each warp on a head block of its own, over the whole context (one
// partition: batches large enough not to split). A block's four warps take four consecutive head
// blocks (KV heads of one token) and share nothing: each streams its own 16-key tiles through its
// own ring (a quarter of the block's shared memory, the same bytes as above), keeps its own
// softmax state and writes its own rows, so there is no cross-warp merge and no block barrier. A
// warp starting its work (the lookup, the first copies, waiting for them) idles one warp of the
// SM's eight, where a block starting idles four. The block kernel pays that start per block:
// `attention_bench` (H200) gives it 3.8 TB/s at batch 384, context 1500, where this kernel
// streams 4.0. But this kernel's blocks are 4 whole contexts: with too few of them for full waves
// (batch 192 at 3000: 1.45 waves) the block kernel wins, and the host picks it
// (`warp_items_fill_as_well` in attention.rs).
//
// How the tiles come in (LOAD):
// - DM_LOAD_CP_ASYNC: 16-byte cp.async copies, 16 per lane and tile, into rows padded to D + 8.
// - DM_LOAD_BULK (sm_90): a lane brings a tile's K or V row of its head (D * 2 bytes) with one
//   bulk copy that completes on the slot's mbarrier: `attention_bench` (H200), batch 512 at
//   1500, 779 -> 765 us (4.04 -> 4.11 TB/s).
// - DM_LOAD_TENSOR (sm_90, the `paged_decode_mma_tensor_d{D}` entries): one lane copies a
//   tile's K and V as boxes of the caches' tensor maps (64 columns of one KV head by 16 keys,
//   128-byte swizzled, so rows need no padding: D / 32 copies a tile instead of 32). A tile is
//   one cache block, so the host takes it for block size 16 without a window only (every tile
//   then starts on a block); block ids past the cache land as zeros (past the tensor), and the
//   V rows past the context in the last tile are zeroed once landed (K's are masked).
// Grid: ceil(T * num_kv_heads * head_chunks / DM_WARPS) blocks of DM_THREADS; num_parts 1.
#define DM_LOAD_CP_ASYNC 0
#define DM_LOAD_BULK 1
#define DM_LOAD_TENSOR 2

template <typename T, int D, int LOAD>
__device__ __forceinline__ void paged_decode_mma_warp_impl(const T* __restrict__ q, const T* __restrict__ k_cache,
                                                           const T* __restrict__ v_cache, T* __restrict__ out,
                                                           const u32* __restrict__ query_start_loc,
                                                           const u32* __restrict__ seq_lens,
                                                           const u32* __restrict__ block_tables, u32 num_reqs,
                                                           u32 num_heads, u32 num_kv_heads, u32 max_blocks_per_seq,
                                                           u32 block_size, u32 num_blocks, u32 window, float scale,
                                                           float softcap, const TensorMap* k_map,
                                                           const TensorMap* v_map) {
    constexpr bool SWIZZLED = LOAD == DM_LOAD_TENSOR;
    constexpr int STRIDE = SWIZZLED ? D : D + 8;  // elements per shared-memory row
    constexpr int TILE = DM_KEYS * STRIDE;        // one warp's 16 keys
    constexpr int STAGES = DecodeMmaStages<D>::value;
    constexpr int KSTEPS = D / 16;
    constexpr int DT = D / 8;
    static_assert(D % 16 == 0, "mma tiles");
    static_assert(!SWIZZLED || D % 64 == 0, "tensor copies take 64-column halves");
    extern __shared__ uint4 dm_smem[];

    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // 128-byte swizzling lays out 1 KiB patterns: the ring starts on a 1 KiB boundary (the host
    // gives the tensor entries 1 KiB more shared memory).
    const u32 pad = SWIZZLED ? (1024u - (smem_addr(dm_smem) & 1023u)) & 1023u : 0u;
    T* ring = reinterpret_cast<T*>(reinterpret_cast<char*>(dm_smem) + pad) + warp * STAGES * 2 * TILE;
    const u32 group = num_heads / num_kv_heads;
    const u32 heads_total = num_kv_heads * ((group + DM_ROWS - 1) / DM_ROWS);
    const u32 item = blockIdx.x * DM_WARPS + warp;
    // Warp-uniform: the last block's warps past the step's head blocks have nothing to do.
    if (item >= query_start_loc[num_reqs] * heads_total) return;
    const DecodeWork work = decode_work_of(item, 0, 1, DM_ROWS, query_start_loc, seq_lens, num_reqs, num_heads,
                                           num_kv_heads, window, 0, 0);
    const u32 t = work.t, kv_head = work.kv_head, head0 = work.head0, nh = work.nh;
    const u32 start = work.start, end = work.end;
    const u32 kv_width = num_kv_heads * D;
    const u32* table = block_tables + (u64)work.r * max_blocks_per_seq;

    // The first tiles' K/V rows go into the L2 while the kernels before this one finish.
    const DecodeKv<T> kv{k_cache, v_cache, table, kv_width, kv_head * D, block_size, num_blocks};
    decode_prefetch<T, D>(kv, start, min(end, start + (STAGES - 1) * DM_KEYS), lane, 32);
    if constexpr (SWIZZLED) {
        if (lane == 0) {
            prefetch_tensor_map(k_map);
            prefetch_tensor_map(v_map);
        }
    }
    pdl_enter();

#if __CUDA_ARCH__ >= 900
    __shared__ __align__(8) u64 dm_bars[DM_WARPS][DecodeMmaStages<D>::value];
    const u32 bar0 = smem_addr(&dm_bars[warp][0]);
    if (LOAD != DM_LOAD_CP_ASYNC) {
        if (lane == 0) {
#pragma unroll
            for (int st = 0; st < STAGES; st++) mbar_init(bar0 + st * 8, 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncwarp();
    }
#else
    const u32 bar0 = 0;
#endif
    auto load_tile = [&](u32 tile, u32 slot) {
        T* k_s = ring + slot * 2 * TILE;
        if constexpr (LOAD == DM_LOAD_TENSOR) {
            // Lane 0 copies the tile's cache block, K then V, in 64-column halves; a block id
            // past the cache reads rows past the tensor, which arrive as zeros.
            if (lane == 0) {
                const u32 bar = bar0 + slot * 8;
                const int row = (int)(min(kv.table[start / DM_KEYS + tile], kv.num_blocks) * DM_KEYS);
                fence_proxy_async();
                mbar_expect_tx(bar, 2 * DM_KEYS * D * (u32)sizeof(T));
#pragma unroll
                for (int h = 0; h < D / 64; h++) {
                    tensor_copy_3d(smem_addr(k_s) + h * 2048, k_map, h * 64, (int)kv_head, row, bar);
                    tensor_copy_3d(smem_addr(k_s + TILE) + h * 2048, v_map, h * 64, (int)kv_head, row, bar);
                }
            }
        } else if constexpr (LOAD == DM_LOAD_BULK) {
            // Lane l copies row l % 16 of the tile's K (l < 16) or V rows: keys past `end` repeat
            // the last key's row (finite; their weights are 0), rows of block ids past the cache
            // are zeros.
            const u32 j = lane & 15, key = min(start + tile * DM_KEYS + j, end - 1);
            const long long at_slot = decode_slot(kv.table, key, kv.block_size, kv.num_blocks);
            const bool valid = at_slot >= 0;
            const u32 bytes = __popc(__ballot_sync(0xffffffffu, valid)) * (u32)(D * sizeof(T));
            const u32 bar = bar0 + slot * 8;
            T* row = k_s + (lane >> 4) * TILE + j * STRIDE;
            if (lane == 0) mbar_expect_tx(bar, bytes);
            __syncwarp();
            if (valid) {
                const T* src = (lane < 16 ? kv.k_cache : kv.v_cache) + (u64)at_slot * kv.kv_width + kv.col0;
                fence_proxy_async();
                bulk_copy(smem_addr(row), src, D * sizeof(T), bar);
            } else {
#pragma unroll
                for (int c = 0; c < D / 8; c++) reinterpret_cast<uint4*>(row)[c] = make_uint4(0, 0, 0, 0);
            }
            // Zero rows a lane stored are in before any lane reads the slot.
            __syncwarp();
        } else {
            decode_load_keys<T, D, DM_KEYS, 32>(k_s, kv, start + tile * DM_KEYS, end, lane);
        }
    };
    // cp.async: one commit group per tile (empty past the last), so that "all but STAGES - 2
    // groups done" always means "tile i is in". The bulk copies complete on the slot's barrier,
    // whose phase flips once per use of the slot.
    auto commit = [] {
        if constexpr (LOAD == DM_LOAD_CP_ASYNC) cp_async_commit();
    };
    auto wait_tile = [&](u32 tile) {
        if constexpr (LOAD == DM_LOAD_CP_ASYNC) {
            cp_async_wait<STAGES - 2>();
        } else {
            mbar_wait(bar0 + (tile % STAGES) * 8, (tile / STAGES) & 1);
        }
    };
    // Tensor copies bring whole cache blocks: the last tile's V rows past the context hold
    // whatever the cache holds there (weight 0 is not enough against a NaN), so they are zeroed.
    auto settle_tile = [&](u32 tile) {
        if constexpr (LOAD == DM_LOAD_TENSOR) {
            const u32 valid = end - (start + tile * DM_KEYS);
            if (valid < DM_KEYS) {
                uint4* v_s = reinterpret_cast<uint4*>(ring + (tile % STAGES) * 2 * TILE + TILE);
                // 16-byte chunk c of the V tile lies in row (c % 128) / 8 of its half.
                for (u32 c = lane; c < DM_KEYS * D / 8; c += 32) {
                    if ((c % 128) / 8 >= valid) v_s[c] = make_uint4(0, 0, 0, 0);
                }
            }
        }
    };
    // One visible key at least (the token's own): start < end.
    const u32 num_tiles = (end - start + DM_KEYS - 1) / DM_KEYS;
#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) {
        if ((u32)st < num_tiles) load_tile(st, st);
        commit();
    }

    const u32 gid = lane >> 2, tig = lane & 3;
    const bool has_lo = gid < nh, has_hi = gid + 8 < nh;
    u32 qf[KSTEPS][4];
    load_q_fragments<T, D>(q + ((u64)t * num_heads + head0) * D, gid, tig, has_lo, has_hi, qf);
    const float scale_log2 = scale * 1.4426950408889634f, cap_log2 = softcap * 1.4426950408889634f;

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
#pragma unroll
        for (int i = 0; i < 4; i++) o[dt][i] = 0.f;
    }
    float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;
    // The lane's ldmatrix rows: K row-major (key, chunk of the step) = (lane % 8 + 8 (lane / 16),
    // lane / 8 % 2), V transposed (lane % 8 + 8 (lane / 8 % 2), lane / 16); see tile_step.
    const u32 k_key = (lane & 7) + ((lane >> 4) << 3), k_chunk = (lane >> 3) & 1;
    const u32 v_key = (lane & 7) + (((lane >> 3) & 1) << 3), v_chunk = lane >> 4;
    const u32 k_lane = SWIZZLED ? k_key * 128 : (k_key * STRIDE + k_chunk * 8) * sizeof(T);
    const u32 v_lane = SWIZZLED ? v_key * 128 : (v_key * STRIDE + v_chunk * 8) * sizeof(T);
    const u32 kx = SWIZZLED ? (k_chunk ^ (k_key & 7)) * 16 : 0;
    const u32 vx = SWIZZLED ? (v_chunk ^ (v_key & 7)) * 16 : 0;

    for (u32 tile = 0; tile < num_tiles; tile++) {
        wait_tile(tile);
        settle_tile(tile);
        // Tile `tile` is in for every lane's copies, and every lane is done with the slot the
        // next copy overwrites (the one used in the previous iteration).
        __syncwarp();
        const u32 next = tile + STAGES - 1;
        if (next < num_tiles) load_tile(next, next % STAGES);
        commit();

        const u32 key0 = start + tile * DM_KEYS;
        const u32 kb = smem_addr(ring + (tile % STAGES) * 2 * TILE) + k_lane;
        const u32 vb = smem_addr(ring + (tile % STAGES) * 2 * TILE + TILE) + v_lane;
        decode_mma_keys<T, D, SWIZZLED>(kb, vb, kx, vx, key0, end, tig, scale_log2, cap_log2, qf, o, m_lo, m_hi, l_lo,
                                        l_hi);
    }
    // No copy is left in flight when the warp exits (the last groups are empty).
    if (LOAD == DM_LOAD_CP_ASYNC) cp_async_wait<0>();

    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    T* out_lo = out + ((u64)t * num_heads + head0 + gid) * D + tig * 2;
    T* out_hi = out_lo + 8 * D;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        if (has_lo) {
            out_lo[dt * 8] = from_float<T>(o[dt][0] / l_lo);
            out_lo[dt * 8 + 1] = from_float<T>(o[dt][1] / l_lo);
        }
        if (has_hi) {
            out_hi[dt * 8] = from_float<T>(o[dt][2] / l_hi);
            out_hi[dt * 8 + 1] = from_float<T>(o[dt][3] / l_hi);
        }
    }
}

// The per-warp kernel's loads on this architecture: bulk copies from sm_90 (unless DM_BULK=0,
// through FERROLM_KERNEL_DEFINES, to compare), cp.async before. The tensor-copy entries exist on
// every architecture (so that every one has the same entry points) but trap before sm_90: the
// host never launches them there.
#if __CUDA_ARCH__ >= 900
#define DM_LOAD_WARP (DM_BULK ? DM_LOAD_BULK : DM_LOAD_CP_ASYNC)
#define DM_TENSOR_BODY(T, D) \
    paged_decode_mma_warp_impl<T, D, DM_LOAD_TENSOR>(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, \
                                                     num_reqs, num_heads, num_kv_heads, max_blocks_per_seq, block_size, \
                                                     num_blocks, window, scale, softcap, &k_map, &v_map);
#else
#define DM_LOAD_WARP DM_LOAD_CP_ASYNC
#define DM_TENSOR_BODY(T, D) __trap();
#endif

// One kernel per (head_dim, dtype): paged_decode_mma_d{D}_{bf16,f16}, with the decode kernel's
// parameters (head_dim unused: it is D); the FP8 form (a ring of codes, 55 KiB at head size 128)
// fits three blocks an SM, by its registers too.
#define PAGED_DECODE_MMA(T, S, D) \
    extern "C" __global__ void __launch_bounds__(DM_THREADS, 2) paged_decode_mma_d##D##_##S( \
        const T* q, const T* k_cache, const T* v_cache, T* out, float* part_out, float* part_ml, u32* counters, \
        const u32* query_start_loc, const u32* seq_lens, const u32* block_tables, u32 num_reqs, u32 num_heads, \
        u32 num_kv_heads, u32 head_dim, u32 max_blocks_per_seq, u32 block_size, u32 num_blocks, u32 window, \
        float scale, float softcap, u32 part_len) { \
        paged_decode_mma_impl<T, T, D>(q, k_cache, v_cache, out, part_out, part_ml, counters, query_start_loc, \
                                       seq_lens, block_tables, num_reqs, num_heads, num_kv_heads, max_blocks_per_seq, \
                                       block_size, num_blocks, window, scale, softcap, part_len, 1.f, 1.f); \
    } \
    extern "C" __global__ void __launch_bounds__(DM_THREADS, 3) paged_decode_mma_fp8kv_d##D##_##S( \
        const T* q, const unsigned char* k_cache, const unsigned char* v_cache, T* out, float* part_out, \
        float* part_ml, u32* counters, const u32* query_start_loc, const u32* seq_lens, const u32* block_tables, \
        u32 num_reqs, u32 num_heads, u32 num_kv_heads, u32 head_dim, u32 max_blocks_per_seq, u32 block_size, \
        u32 num_blocks, u32 window, float scale, float softcap, u32 part_len, float k_scale, float v_scale) { \
        paged_decode_mma_impl<T, unsigned char, D>(q, k_cache, v_cache, out, part_out, part_ml, counters, \
                                                   query_start_loc, seq_lens, block_tables, num_reqs, num_heads, \
                                                   num_kv_heads, max_blocks_per_seq, block_size, num_blocks, window, \
                                                   scale, softcap, part_len, k_scale, v_scale); \
    }
// paged_decode_mma_warp_d{D}_{bf16,f16}: the decode kernel's parameters but the partition
// workspace (part_out, part_ml, counters, part_len: unused, one partition).
#define PAGED_DECODE_MMA_WARP(T, S, D) \
    extern "C" __global__ void __launch_bounds__(DM_THREADS, 2) paged_decode_mma_warp_d##D##_##S( \
        const T* q, const T* k_cache, const T* v_cache, T* out, float* part_out, float* part_ml, u32* counters, \
        const u32* query_start_loc, const u32* seq_lens, const u32* block_tables, u32 num_reqs, u32 num_heads, \
        u32 num_kv_heads, u32 head_dim, u32 max_blocks_per_seq, u32 block_size, u32 num_blocks, u32 window, \
        float scale, float softcap, u32 part_len) { \
        paged_decode_mma_warp_impl<T, D, DM_LOAD_WARP>(q, k_cache, v_cache, out, query_start_loc, seq_lens, \
                                                       block_tables, num_reqs, num_heads, num_kv_heads, \
                                                       max_blocks_per_seq, block_size, num_blocks, window, scale, \
                                                       softcap, nullptr, nullptr); \
    }
// paged_decode_mma_tensor_d{D}_{bf16,f16}: the per-warp kernel's parameters, then the tensor maps
// of the K and V caches (3-d: D columns, num_kv_heads heads, num_blocks * 16 slots; boxes of 64
// x 1 x 16, 128-byte swizzle).
#define PAGED_DECODE_MMA_TENSOR(T, S, D) \
    extern "C" __global__ void __launch_bounds__(DM_THREADS, 2) paged_decode_mma_tensor_d##D##_##S( \
        const T* q, const T* k_cache, const T* v_cache, T* out, float* part_out, float* part_ml, u32* counters, \
        const u32* query_start_loc, const u32* seq_lens, const u32* block_tables, u32 num_reqs, u32 num_heads, \
        u32 num_kv_heads, u32 head_dim, u32 max_blocks_per_seq, u32 block_size, u32 num_blocks, u32 window, \
        float scale, float softcap, u32 part_len, const __grid_constant__ TensorMap k_map, \
        const __grid_constant__ TensorMap v_map) { \
        DM_TENSOR_BODY(T, D) \
    }
#define PAGED_DECODE_MMA_HEAD_DIMS(T, S) \
    PAGED_DECODE_MMA(T, S, 64) \
    PAGED_DECODE_MMA(T, S, 80) \
    PAGED_DECODE_MMA(T, S, 96) \
    PAGED_DECODE_MMA(T, S, 128) \
    PAGED_DECODE_MMA_WARP(T, S, 64) \
    PAGED_DECODE_MMA_WARP(T, S, 80) \
    PAGED_DECODE_MMA_WARP(T, S, 96) \
    PAGED_DECODE_MMA_WARP(T, S, 128) \
    PAGED_DECODE_MMA_TENSOR(T, S, 64) \
    PAGED_DECODE_MMA_TENSOR(T, S, 128)
FOR_EACH_HALF_DTYPE(PAGED_DECODE_MMA_HEAD_DIMS)
