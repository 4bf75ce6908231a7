// Attention of prefill chunks and mixed batches on tensor cores (FlashAttention-2 style), over
// the paged KV cache, computing the function `paged_attention` in attention.cu computes, for
// bf16 and f16 activations.
//
// A block of FA_WARPS warps takes one work item, (request, first query row), and one KV head
// (and, for GQA groups wider than FA_ROWS, one chunk of its query heads). Its FA_ROWS rows are
// (token, query head) pairs, head fastest: with `hpt` query heads per tile (the group, at most
// FA_ROWS) a tile holds FA_ROWS / hpt tokens, so every K/V tile serves the whole GQA group. A
// decode of a mixed batch is a request of one token. Rows past the request's last token or past
// the group are padding: their Q reads as zeros and they are never stored. Warp w owns rows
// 16w..16w+15; a warp with only padding rows skips the maths but still loads and syncs.
//
// Keys are taken in tiles of BN: the K and V rows of a tile are gathered from the paged cache
// with 16-byte cp.async into shared memory, double-buffered. S = Q K^T and O += P V run on
// mma.m16n8k16 with f32 accumulators; the softmax is online, in f32 registers, in base 2.
// P enters P V as a T part plus a T residual (two mma each): rounded once to bf16, each weight
// would be off by up to 2^-9, which rows of few keys do not average away (emulated on inputs like
// the tests': relative errors up to 1e-1 in bf16 and 1.5e-2 in f16; with the residual 4e-3 and
// 5e-4, the rounding of the output itself, as in the other kernels).
//
// An FP8 cache (`flash_attention_fp8kv_*`, C = unsigned char) is read into registers instead,
// 8 codes of K and of V per chunk, a tile ahead (the loads in flight during the tile before's
// maths), and converted to T (code times the cache's scale, rounded once) into the buffer the
// tile before has left: the same shared-memory tiles and the same maths.
//
// Shared memory, T: k_s [2][BN][D + 8], v_s [2][BN][D + 8], q_s [FA_ROWS][D + 8]. The 16-byte
// pad makes a row's stride an odd number of 16-byte units, so the 8 rows one ldmatrix phase
// reads fall in distinct banks. With Q_IN_REGS the Q fragments are loaded into registers once
// and q_s is the second K buffer, free again before the first tile's successor is loaded.

#define FA_WARPS 4
#define FA_THREADS (FA_WARPS * 32)
#define FA_ROWS (FA_WARPS * 16)

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register i holds
// matrix i's fragment: element (lane / 4, 2 * (lane % 4) + {0, 1}), or with .trans its transpose
// (2 * (lane % 4) + {0, 1}, lane / 4).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// (x, y) rounded to a pair of T in one register, x in the low half; `rest` gets what rounding
// left out, rounded the same way.
__device__ __forceinline__ u32 pack2(float x, float y, __nv_bfloat16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const u32*>(&v);
}

__device__ __forceinline__ u32 pack2(float x, float y, __half) {
    const __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<const u32*>(&v);
}

// 8 values times `scale`, rounded to T, as 16 bytes (an FP8 cache's row piece once converted).
template <typename T> __device__ __forceinline__ uint4 pack8_scaled(const float (&x)[8], float scale) {
    uint4 r;
    r.x = pack2(x[0] * scale, x[1] * scale, T());
    r.y = pack2(x[2] * scale, x[3] * scale, T());
    r.z = pack2(x[4] * scale, x[5] * scale, T());
    r.w = pack2(x[6] * scale, x[7] * scale, T());
    return r;
}

__device__ __forceinline__ u32 split2(float x, float y, u32& rest, __nv_bfloat16 tag) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    const float2 f = __bfloat1622float2(v);
    rest = pack2(x - f.x, y - f.y, tag);
    return *reinterpret_cast<const u32*>(&v);
}

__device__ __forceinline__ u32 split2(float x, float y, u32& rest, __half tag) {
    const __half2 v = __floats2half2_rn(x, y);
    const float2 f = __half22float2(v);
    rest = pack2(x - f.x, y - f.y, tag);
    return *reinterpret_cast<const u32*>(&v);
}

// One online-softmax step over a tile of S in mma accumulator layout, for a thread's two rows
// (lo: s[nt][0..1], hi: s[nt][2..3]), scores in base 2 and masked ones -inf, given the maxima of
// the thread's own columns: takes each row's max over its 4 lanes, moves the running maxima m
// and the thread's partial sums l to it, turns s into weights, and sets alpha to the factors
// the outputs kept so far must be scaled by. A row that has seen no key yet keeps a max of
// -inf and subtracts 0 instead, so that its weights are exp2(-inf) = 0 rather than NaN.
template <int NT>
__device__ __forceinline__ void softmax_step(float (&s)[NT][4], float mx_lo, float mx_hi, float& m_lo, float& m_hi,
                                             float& l_lo, float& l_hi, float& alpha_lo, float& alpha_hi) {
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    const float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
    const float ref_lo = new_lo == NEG_INF ? 0.f : new_lo, ref_hi = new_hi == NEG_INF ? 0.f : new_hi;
    alpha_lo = exp2f(m_lo - ref_lo);
    alpha_hi = exp2f(m_hi - ref_hi);
    m_lo = new_lo;
    m_hi = new_hi;
    float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        s[nt][0] = exp2f(s[nt][0] - ref_lo);
        s[nt][1] = exp2f(s[nt][1] - ref_lo);
        s[nt][2] = exp2f(s[nt][2] - ref_hi);
        s[nt][3] = exp2f(s[nt][3] - ref_hi);
        sum_lo += s[nt][0] + s[nt][1];
        sum_hi += s[nt][2] + s[nt][3];
    }
    l_lo = l_lo * alpha_lo + sum_lo;
    l_hi = l_hi * alpha_hi + sum_hi;
}

// n / d for n < 2^31, as umulhi(n, mul) >> shift with the host's `fast_divisor(d)` (mul 0: d = 1).
__device__ __forceinline__ u32 fast_div(u32 n, u32 mul, u32 shift) { return mul ? __umulhi(n, mul) >> shift : n; }

// The first key a query at position `pos` sees.
__device__ __forceinline__ u32 window_start(u32 pos, u32 window) {
    return (window != 0 && pos + 1 > window) ? pos + 1 - window : 0;
}

// q, out: [T, num_heads, D]; caches: [num_slots, num_kv_heads * D]; work: [num_items, 2] of
// (request, first query row), a tile never past its request's rows, or null when no request
// has more than one row (item i is then request i); query_start_loc: [num_reqs + 1]; seq_lens:
// [num_reqs]; block_tables: [num_reqs, max_blocks_per_seq].
// Grid: num_items * num_kv_heads * head_chunks blocks of FA_THREADS, the KV head and head chunk
// fastest. `scale_log2` is the softmax scale times log2(e); `softcap` 0 means no soft-cap of the
// scaled scores (`soft_cap`); `window` 0 means none; `bs_mul`,
// `bs_shift` divide by block_size (see fast_div): positions stay below 2^31.
template <typename T, typename C, int D, int BN, bool Q_IN_REGS>
__device__ __forceinline__ void flash_attention_impl(const T* __restrict__ q, const C* __restrict__ k_cache,
                                                     const C* __restrict__ v_cache, T* __restrict__ out,
                                                     const u32* __restrict__ work,
                                                     const u32* __restrict__ query_start_loc,
                                                     const u32* __restrict__ seq_lens,
                                                     const u32* __restrict__ block_tables, u32 num_heads,
                                                     u32 num_kv_heads, u32 max_blocks_per_seq, u32 block_size,
                                                     u32 bs_mul, u32 bs_shift, u32 num_blocks, u32 window,
                                                     float scale_log2, float softcap, u32 heads_per_tile,
                                                     u32 head_chunks, float k_scale, float v_scale) {
    constexpr bool FP8 = sizeof(C) == 1;
    constexpr int STRIDE = D + 8;        // elements per shared-memory row
    constexpr int CH = D / 8;            // 16-byte chunks per row
    constexpr int TILE = BN * STRIDE;    // elements of one K or V buffer
    constexpr int KSTEPS = D / 16;       // k steps of Q K^T
    constexpr int NT = BN / 8;           // 8-key column tiles of S
    constexpr int DT = D / 8;            // 8-wide column tiles of O
    static_assert(D % 16 == 0 && BN % 16 == 0, "mma tiles");
    static_assert((FA_ROWS * CH) % FA_THREADS == 0 && (BN * CH) % FA_THREADS == 0, "even loads");
    static_assert(!Q_IN_REGS || BN >= FA_ROWS, "q_s must fit in a K buffer");
    extern __shared__ uint4 fa_smem[];
    T* k_s = reinterpret_cast<T*>(fa_smem);
    T* v_s = k_s + 2 * TILE;
    T* q_s = Q_IN_REGS ? k_s + TILE : v_s + 2 * TILE;

    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float cap_log2 = softcap * 1.4426950408889634f;
    const u32 heads_per_item = num_kv_heads * head_chunks;
    const u32 item = blockIdx.x / heads_per_item, rest = blockIdx.x % heads_per_item;
    const u32 kv_head = rest / head_chunks, chunk = rest % head_chunks;
    const u32 r = work ? work[2 * item] : item;
    const u32 q_begin = query_start_loc[r], q_end = query_start_loc[r + 1];
    const u32 t0 = work ? work[2 * item + 1] : q_begin;
    // Only without a work list: a request with no rows this step.
    if (t0 >= q_end) return;
    const u32 group = num_heads / num_kv_heads, hpt = heads_per_tile;
    const u32 head0 = kv_head * group + chunk * hpt;
    const u32 nh = min(hpt, group - chunk * hpt);
    const u32 ntok = min(FA_ROWS / hpt, q_end - t0);
    // The tile's tokens sit at positions pos0..pos_last, the last q_len of the context.
    const u32 pos0 = seq_lens[r] - (q_end - q_begin) + (t0 - q_begin);
    const u32 pos_last = pos0 + ntok - 1;
    const u32 kv_begin = window_start(pos0, window), kv_end = pos_last + 1;
    const u32 last_window_start = window_start(pos_last, window);
    const u32 kv_width = num_kv_heads * D;
    const u32* table = block_tables + (u64)r * max_blocks_per_seq;

#pragma unroll
    for (int i = 0; i < FA_ROWS * CH / FA_THREADS; i++) {
        const u32 e = tid + i * FA_THREADS, m = e / CH, c = e % CH;
        const u32 tok = m / hpt, h = m % hpt;
        const bool valid = tok < ntok && h < nh;
        const T* src = valid ? q + ((u64)(t0 + tok) * num_heads + head0 + h) * D + c * 8 : q;
        cp_async16(smem_addr(q_s + m * STRIDE + c * 8), src, valid);
    }
    // A K/V tile is loaded in two steps, an iteration apart, so that the block-table reads are
    // in flight during a tile's maths rather than stalling the copies: `fetch_blocks` reads the
    // block id of each key this thread copies (keys past the tile's last position get an id
    // past the cache), `load_kv` copies keys key0..key0 + BN - 1 into buffer `buf`. Keys of
    // block ids past the cache read as zeros.
    constexpr int LOADS = BN * CH / FA_THREADS;
    auto fetch_blocks = [&](u32 key0, u32 (&blocks)[LOADS]) {
#pragma unroll
        for (int i = 0; i < LOADS; i++) {
            const u32 key = key0 + (tid + i * FA_THREADS) / CH;
            blocks[i] = key < kv_end ? table[fast_div(key, bs_mul, bs_shift)] : num_blocks;
        }
    };
    auto load_kv = [&](u32 key0, const u32 (&blocks)[LOADS], u32 buf) {
        if constexpr (!FP8) {
#pragma unroll
            for (int i = 0; i < LOADS; i++) {
                const u32 e = tid + i * FA_THREADS, j = e / CH, c = e % CH, key = key0 + j;
                const bool valid = blocks[i] < num_blocks;
                const C* k_src = k_cache;
                const C* v_src = v_cache;
                if (valid) {
                    const u64 slot =
                        (u64)blocks[i] * block_size + (key - fast_div(key, bs_mul, bs_shift) * block_size);
                    const u64 at = slot * kv_width + kv_head * D + c * 8;
                    k_src += at;
                    v_src += at;
                }
                const u32 at = buf * TILE + j * STRIDE + c * 8;
                cp_async16(smem_addr(k_s + at), k_src, valid);
                cp_async16(smem_addr(v_s + at), v_src, valid);
            }
        }
    };
    // FP8: `fetch_codes` loads a tile's codes into registers, `store_codes` converts them into
    // buffer `buf` (keys of block ids past the cache as zeros).
    uint2 k_codes[FP8 ? LOADS : 1], v_codes[FP8 ? LOADS : 1];
    auto fetch_codes = [&](u32 key0, const u32 (&blocks)[LOADS]) {
        if constexpr (FP8) {
#pragma unroll
            for (int i = 0; i < LOADS; i++) {
                const u32 e = tid + i * FA_THREADS, j = e / CH, c = e % CH, key = key0 + j;
                k_codes[i] = v_codes[i] = make_uint2(0, 0);
                if (blocks[i] < num_blocks) {
                    const u64 slot =
                        (u64)blocks[i] * block_size + (key - fast_div(key, bs_mul, bs_shift) * block_size);
                    const u64 at = slot * kv_width + kv_head * D + c * 8;
                    k_codes[i] = *reinterpret_cast<const uint2*>(k_cache + at);
                    v_codes[i] = *reinterpret_cast<const uint2*>(v_cache + at);
                }
            }
        }
    };
    auto store_codes = [&](u32 buf) {
        if constexpr (FP8) {
#pragma unroll
            for (int i = 0; i < LOADS; i++) {
                const u32 e = tid + i * FA_THREADS, j = e / CH, c = e % CH;
                const u32 at = buf * TILE + j * STRIDE + c * 8;
                float kx[8], vx[8];
                e4m3x8_to_float(k_codes[i], kx);
                e4m3x8_to_float(v_codes[i], vx);
                *reinterpret_cast<uint4*>(k_s + at) = pack8_scaled<T>(kx, k_scale);
                *reinterpret_cast<uint4*>(v_s + at) = pack8_scaled<T>(vx, v_scale);
            }
        }
    };
    const u32 num_tiles = (kv_end - kv_begin + BN - 1) / BN;
    u32 blocks[LOADS];
    fetch_blocks(kv_begin, blocks);
    if constexpr (FP8) {
        fetch_codes(kv_begin, blocks);
        cp_async_commit();  // the Q copies
        store_codes(0);
    } else {
        load_kv(kv_begin, blocks, 0);
        cp_async_commit();
    }
    if (num_tiles > 1) fetch_blocks(kv_begin + BN, blocks);

    // This thread's rows of S and O: lo = 16 warp + lane / 4, hi = lo + 8. Padding rows take a
    // real row's position, so that their softmax stays finite.
    const u32 gid = lane >> 2, tig = lane & 3;
    const u32 m_lo = warp * 16 + gid, m_hi = m_lo + 8;
    const u32 tok_lo = m_lo / hpt, tok_hi = m_hi / hpt;
    const bool valid_lo = tok_lo < ntok && m_lo % hpt < nh, valid_hi = tok_hi < ntok && m_hi % hpt < nh;
    const u32 pos_lo = pos0 + min(tok_lo, ntok - 1), pos_hi = pos0 + min(tok_hi, ntok - 1);
    const u32 ws_lo = window_start(pos_lo, window), ws_hi = window_start(pos_hi, window);
    const u32 m_lane = warp * 16 + (lane & 15);
    const bool warp_active = __any_sync(0xffffffffu, m_lane / hpt < ntok && m_lane % hpt < nh);

    // Q fragments of the warp's 16 rows, per k step (unused without Q_IN_REGS).
    u32 qf[Q_IN_REGS ? KSTEPS : 1][4];
    const u32 q_frag_addr = smem_addr(q_s + m_lane * STRIDE + (lane >> 4) * 8);
    if constexpr (Q_IN_REGS) {
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) ldmatrix_x4(qf[ks], q_frag_addr + ks * 32);
        __syncthreads();
    }

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
#pragma unroll
        for (int i = 0; i < 4; i++) o[dt][i] = 0.f;
    }
    float m_run_lo = NEG_INF, m_run_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;
    // Lane address offsets (bytes) of the K (row-major fragments) and V (transposed) ldmatrix.
    const u32 k_lane = (((lane & 7) + ((lane >> 4) << 3)) * STRIDE + ((lane >> 3) & 1) * 8) * sizeof(T);
    const u32 v_lane = (((lane & 7) + (((lane >> 3) & 1) << 3)) * STRIDE + (lane >> 4) * 8) * sizeof(T);

    for (u32 it = 0; it < num_tiles; it++) {
        const u32 buf = it & 1, key0 = kv_begin + it * BN;
        if constexpr (FP8) {
            // The next tile's codes load during this tile's maths; `store_codes` below.
            if (it + 1 < num_tiles) fetch_codes(key0 + BN, blocks);
            if (it + 2 < num_tiles) fetch_blocks(key0 + 2 * BN, blocks);
            cp_async_wait<0>();
        } else {
            if (it + 1 < num_tiles) load_kv(key0 + BN, blocks, buf ^ 1);
            cp_async_commit();
            if (it + 2 < num_tiles) fetch_blocks(key0 + 2 * BN, blocks);
            cp_async_wait<1>();
        }
        __syncthreads();

        if (warp_active) {
            const u32 kb = smem_addr(k_s + buf * TILE) + k_lane;
            const u32 vb = smem_addr(v_s + buf * TILE) + v_lane;
            float s[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                for (int i = 0; i < 4; i++) s[nt][i] = 0.f;
            }
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ks++) {
                u32 a[4];
                if constexpr (Q_IN_REGS) {
#pragma unroll
                    for (int i = 0; i < 4; i++) a[i] = qf[ks][i];
                } else {
                    ldmatrix_x4(a, q_frag_addr + ks * 32);
                }
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    // Keys 16 np..16 np + 15, dims 16 ks..16 ks + 15: b0, b1 of key tiles 2 np, 2 np + 1.
                    u32 b[4];
                    ldmatrix_x4(b, kb + (np * 16 * STRIDE + ks * 16) * sizeof(T));
                    mma16816(s[2 * np], a, b[0], b[1], T());
                    mma16816(s[2 * np + 1], a, b[2], b[3], T());
                }
            }

            // Masks only where some key of the tile is past the first row's position or before
            // the last row's window.
            const bool need_mask = key0 + BN - 1 > pos0 || key0 < last_window_start;
            float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float x = soft_cap(s[nt][i] * scale_log2, cap_log2);
                    if (need_mask) {
                        const u32 key = key0 + nt * 8 + tig * 2 + (i & 1);
                        const u32 pos = i < 2 ? pos_lo : pos_hi, ws = i < 2 ? ws_lo : ws_hi;
                        if (key > pos || key < ws) x = NEG_INF;
                    }
                    s[nt][i] = x;
                }
                mx_lo = fmaxf(mx_lo, fmaxf(s[nt][0], s[nt][1]));
                mx_hi = fmaxf(mx_hi, fmaxf(s[nt][2], s[nt][3]));
            }
            float alpha_lo, alpha_hi;
            softmax_step(s, mx_lo, mx_hi, m_run_lo, m_run_hi, l_lo, l_hi, alpha_lo, alpha_hi);
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                o[dt][0] *= alpha_lo;
                o[dt][1] *= alpha_lo;
                o[dt][2] *= alpha_hi;
                o[dt][3] *= alpha_hi;
            }

#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                // S's accumulators of key tiles 2 kk, 2 kk + 1 are the A fragment of keys 16 kk..
                u32 p[4], p_rest[4];
                p[0] = split2(s[2 * kk][0], s[2 * kk][1], p_rest[0], T());
                p[1] = split2(s[2 * kk][2], s[2 * kk][3], p_rest[1], T());
                p[2] = split2(s[2 * kk + 1][0], s[2 * kk + 1][1], p_rest[2], T());
                p[3] = split2(s[2 * kk + 1][2], s[2 * kk + 1][3], p_rest[3], T());
#pragma unroll
                for (int np = 0; np < DT / 2; np++) {
                    // Keys 16 kk.., dims 16 np..16 np + 15, transposed: b0, b1 of dim tiles 2 np, 2 np + 1.
                    u32 b[4];
                    ldmatrix_x4_trans(b, vb + (kk * 16 * STRIDE + np * 16) * sizeof(T));
                    mma16816(o[2 * np], p, b[0], b[1], T());
                    mma16816(o[2 * np + 1], p, b[2], b[3], T());
                    mma16816(o[2 * np], p_rest, b[0], b[1], T());
                    mma16816(o[2 * np + 1], p_rest, b[2], b[3], T());
                }
            }
        }
        // The buffer of the tile before is free (the last iteration ended on a barrier): FP8
        // codes go in now, copies at the next iteration's start.
        if constexpr (FP8) {
            if (it + 1 < num_tiles) store_codes(buf ^ 1);
        }
        // The next iteration loads into the buffer just read.
        __syncthreads();
    }

    if (warp_active) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
        // Every real row sees at least its own key, so l >= 1.
        const float inv_lo = 1.f / l_lo, inv_hi = 1.f / l_hi;
        if (valid_lo) {
            T* dst = out + ((u64)(t0 + tok_lo) * num_heads + head0 + m_lo % hpt) * D + tig * 2;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                *reinterpret_cast<u32*>(dst + dt * 8) = pack2(o[dt][0] * inv_lo, o[dt][1] * inv_lo, T());
            }
        }
        if (valid_hi) {
            T* dst = out + ((u64)(t0 + tok_hi) * num_heads + head0 + m_hi % hpt) * D + tig * 2;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                *reinterpret_cast<u32*>(dst + dt * 8) = pack2(o[dt][2] * inv_hi, o[dt][3] * inv_hi, T());
            }
        }
    }
}

// One kernel per (head_dim, dtype): flash_attention_d{D}_{bf16,f16}. The host's table in
// flash_attention.rs repeats (D, BN, Q_IN_REGS) to size the shared memory.
#define FLASH_ATTENTION(T, S, D, BN, Q_IN_REGS) \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, 2) flash_attention_d##D##_##S( \
        const T* q, const T* k_cache, const T* v_cache, T* out, const u32* work, const u32* query_start_loc, \
        const u32* seq_lens, const u32* block_tables, u32 num_heads, u32 num_kv_heads, u32 max_blocks_per_seq, \
        u32 block_size, u32 bs_mul, u32 bs_shift, u32 num_blocks, u32 window, float scale_log2, float softcap, \
        u32 heads_per_tile, u32 head_chunks) { \
        pdl_enter(); \
        flash_attention_impl<T, T, D, BN, Q_IN_REGS>(q, k_cache, v_cache, out, work, query_start_loc, seq_lens, \
                                                     block_tables, num_heads, num_kv_heads, max_blocks_per_seq, \
                                                     block_size, bs_mul, bs_shift, num_blocks, window, scale_log2, \
                                                     softcap, heads_per_tile, head_chunks, 1.f, 1.f); \
    } \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, 2) flash_attention_fp8kv_d##D##_##S( \
        const T* q, const unsigned char* k_cache, const unsigned char* v_cache, T* out, const u32* work, \
        const u32* query_start_loc, const u32* seq_lens, const u32* block_tables, u32 num_heads, u32 num_kv_heads, \
        u32 max_blocks_per_seq, u32 block_size, u32 bs_mul, u32 bs_shift, u32 num_blocks, u32 window, \
        float scale_log2, float softcap, u32 heads_per_tile, u32 head_chunks, float k_scale, float v_scale) { \
        pdl_enter(); \
        flash_attention_impl<T, unsigned char, D, BN, Q_IN_REGS>( \
            q, k_cache, v_cache, out, work, query_start_loc, seq_lens, block_tables, num_heads, num_kv_heads, \
            max_blocks_per_seq, block_size, bs_mul, bs_shift, num_blocks, window, scale_log2, softcap, \
            heads_per_tile, head_chunks, k_scale, v_scale); \
    }
#define FLASH_ATTENTION_HEAD_DIMS(T, S) \
    FLASH_ATTENTION(T, S, 64, 64, true) \
    FLASH_ATTENTION(T, S, 80, 64, true) \
    FLASH_ATTENTION(T, S, 96, 64, true) \
    FLASH_ATTENTION(T, S, 128, 64, true) \
    FLASH_ATTENTION(T, S, 256, 32, false)
FOR_EACH_HALF_DTYPE(FLASH_ATTENTION_HEAD_DIMS)
