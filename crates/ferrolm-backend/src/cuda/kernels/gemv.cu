// `linear` for a few rows (decode at small batch): y[m, n] = x[m, k] · w[n, k]^T with M <= 4
// rows of x, where the product is bound by reading `w` once. cuBLAS's GEMM kernels tile for
// large m and reach 60-80% of the bandwidth on these shapes; here every weight byte is read with
// 16-byte loads, several in flight per lane, and used for all M rows.
//
// Each output column j (a row of w) is taken by `ksplit` warps of one block (1, 2, 4 or 8, set
// by the host so that each lane has full rounds of chunks to load: `gemv_ksplit` in linear.rs):
// warp part p, lane l takes the 8-element chunks p * 32 + l, then every (32 * ksplit)-th, of
// w[j, :] and of each x row, and accumulates in f32 (exact products of the inputs, fused
// multiply-adds). The warp sums its lanes with shuffles and the column's warps meet in shared
// memory. Splitting k puts more warps, and so more loads, in flight on the narrow projections
// (under 4096 columns), whose single warp per column would otherwise wait on one load after
// another. Needs k % 8 == 0 and 16-byte aligned x and w (the host checks). Grid:
// ceil(n / (GEMV_WARPS / ksplit)) blocks of GEMV_WARPS warps.
//
// FP8 weights (`gemv_fp8_*`: e4m3 codes and their block grid of scales) take the same kernels
// with f32 activations or blocks narrower than 64 columns (bf16 and f16 activations otherwise
// take fp8_gemv.cu's tensor-core kernel: the same products, summed in another order, with fewer
// instructions), a lane's chunk being 16 codes (16 bytes, as 8 bf16) read with one load and
// converted where they are used (Fp8Rows below); they need k % 16 == 0. A plain FP8 product of
// 2 to 4 rows of x gives a warp two rows of w (gemv_impl): grid ceil(ceil(n / 2) / (GEMV_WARPS /
// ksplit)).

#define GEMV_WARPS 8
// An experiment (FERROLM_KERNEL_DEFINES="GEMV_L2_PREFETCH=1"): before waiting on the kernel
// before, the first wave of blocks also asks the L2 for the rows of the later waves, so that
// those find their weights in the L2 instead of starting to read only when the kernel before
// has finished. For matrices of at most GEMV_L2_PREFETCH_MAX_BYTES
// (the L2 holds them); off by default until measured.
#ifndef GEMV_L2_PREFETCH
#define GEMV_L2_PREFETCH 0
#endif
// An experiment (GEMV_TAIL_ROUND=1): a lane's last chunks, fewer than a round (k = 1152 or 3584
// leave 4 or 6 of them), are loaded together rather than one after another, each waiting for
// the last. The same sums; off by default until measured.
#ifndef GEMV_TAIL_ROUND
#define GEMV_TAIL_ROUND 0
#endif
#ifndef GEMV_L2_PREFETCH_MAX_BYTES
#define GEMV_L2_PREFETCH_MAX_BYTES (24u << 20)
#endif
// Chunks of w each lane loads before it uses them: 8 for one or two rows, 4 for more (their x
// loads take the registers).
#define GEMV_UNROLL(M) ((M) <= 2 ? 8 : 4)

// Loads and conversions use attention.cu's Raw8 / load_raw / unpack8 (8 elements, 16-byte
// aligned): a lane's chunks of w are loaded raw, all before the first is used, and converted to
// f32 where they are used.

template <typename T, int M>
__device__ __forceinline__ void gemv_chunk(const Raw8<T>& wraw, const T* x, u32 k, u32 c, float (&acc)[M]) {
    float wv[8];
    unpack8(wraw, wv);
#pragma unroll
    for (int r = 0; r < M; r++) {
        Raw8<T> xraw;
        load_raw(x + (u64)r * k + (u64)c * 8, xraw);
        float xv[8];
        unpack8(xraw, xv);
#pragma unroll
        for (int i = 0; i < 8; i++) acc[r] = fmaf(wv[i], xv[i], acc[r]);
    }
}

// The weight formats gemv_column reads, a chunk of a row of w at a time (16 bytes; 32 for f32):
// - DenseRows<T>: w in the activations' dtype, 8 elements a chunk, used as gemv_chunk uses them.
// - Fp8Rows<T>: e4m3 codes with a block grid of scales (Fp8Grid), 16 codes a chunk. A chunk's
//   products with x are summed, then scaled once by its block's scale (blocks are at least 16
//   columns wide and start on a chunk, so a chunk lies in one block); k % 16 == 0.
// Each gives a row cursor (`row`), loads a chunk raw (`load`) and adds its products with the M
// rows of x to `acc` (`dot`).
template <typename T> struct DenseRows {
    static constexpr u32 ELEMS = 8;
    static constexpr bool DENSE = true;
    typedef Raw8<T> Raw;
    typedef const T* Row;
    const T* w;
    u32 k;
    __device__ __forceinline__ Row row(u64 i) const { return w + i * k; }
    __device__ __forceinline__ void load(Row r, u32 c, Raw& raw) const { load_raw(r + (u64)c * 8, raw); }
    template <int M> __device__ __forceinline__ void dot(Row, const Raw& raw, const T* x, u32 c, float (&acc)[M]) const {
        gemv_chunk<T, M>(raw, x, k, c, acc);
    }
};

template <typename T> struct Fp8Rows {
    static constexpr u32 ELEMS = 16;
    static constexpr bool DENSE = false;
    typedef uint4 Raw;
    struct Row {
        const unsigned char* codes;
        const float* scales;
    };
    const unsigned char* w;
    Fp8Grid grid;
    u32 k;
    __device__ __forceinline__ Row row(u64 i) const { return Row{w + i * k, grid.row(i)}; }
    __device__ __forceinline__ void load(Row r, u32 c, Raw& raw) const {
        raw = *reinterpret_cast<const uint4*>(r.codes + (u64)c * 16);
    }
    template <int M> __device__ __forceinline__ void dot(Row r, const Raw& raw, const T* x, u32 c, float (&acc)[M]) const {
        float wv[16];
        e4m3x16_to_float(raw, wv);
        const float scale = r.scales[(c * 16) >> grid.col_shift];
#pragma unroll
        for (int m = 0; m < M; m++) {
            float sum = 0.f;
#pragma unroll
            for (int half = 0; half < 2; half++) {
                Raw8<T> xraw;
                load_raw(x + (u64)m * k + (u64)c * 16 + half * 8, xraw);
                float xv[8];
                unpack8(xraw, xv);
#pragma unroll
                for (int i = 0; i < 8; i++) sum = fmaf(wv[half * 8 + i], xv[i], sum);
            }
            acc[m] = fmaf(sum, scale, acc[m]);
        }
    }
};

// Gated kernels (ACT 1: silu, 2: gelu_tanh) take w = [gate; up], [2 n, k], and write
// y[r, j] = act(gate_j) * up_j with gate_j = x_r . w[j, :] and up_j = x_r . w[n + j, :], each
// rounded to T first: the bits of `linear` into a T buffer followed by silu_and_mul /
// gelu_tanh_and_mul, with ksplit chosen for the 2 n rows, in one launch and without the
// [m, 2 n] round trip. A warp then takes both rows of its column.
template <int ACT> __device__ __forceinline__ float gated(float g, float u) {
    return (ACT == 1 ? silu(g) : gelu_tanh(g)) * u;
}

// GEMV_L2_PREFETCH, where block b takes columns b * (GEMV_WARPS / ksplit) on (BLOCK_COLUMNS of
// gemv_column; not the rope-fused GEMV, whose blocks take pairs of columns): each block of the
// first wave, `wave` blocks as if each SM held two (%nsmid bounds the SM ids, so at least the
// SM count), brings the rows of blocks b + i * wave (i >= 1) into the L2, one prefetch per
// 128-byte line, its warps and lanes taking the lines as they take chunks. Each later block's
// rows are asked for once.
template <typename T, int NW>
__device__ __forceinline__ void gemv_prefetch_later_blocks(const T* w, u32 k, u32 n, u32 ksplit) {
    if ((u64)NW * n * k * sizeof(T) > GEMV_L2_PREFETCH_MAX_BYTES) return;
    u32 num_sms;
    asm("mov.u32 %0, %%nsmid;" : "=r"(num_sms));
    const u32 wave = 2 * num_sms, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (blockIdx.x >= wave) return;
    constexpr u32 LINE = 128 / sizeof(T);  // elements of a 128-byte line
    const u32 part = warp % ksplit, lines = (k + LINE - 1) / LINE, stride = 32 * ksplit;
    for (u32 b = blockIdx.x + wave; b < gridDim.x; b += wave) {
        const u32 j = b * (GEMV_WARPS / ksplit) + warp / ksplit;
        if (j >= n) break;
#pragma unroll
        for (int h = 0; h < NW; h++) {
            const T* row = w + ((u64)h * n + j) * k;
            for (u32 l = part * 32 + lane; l < lines; l += stride) prefetch_l2(row + (u64)l * LINE);
        }
    }
}

// The column sums of the block's warps: for the warp's column j of n (rows h * step + j of w,
// h < NW; a row past the last, `rows`, reads row j again and its sum goes unused) the dot
// products with the M rows of x, its ksplit parts met in shared memory. Returns whether this
// thread holds a column's totals (`sums[h]` of row `lane`): lane < M of the column's first
// warp, for j < n. Every thread of the block must call it (it synchronizes).
template <typename T, int M, int NW, bool BLOCK_COLUMNS = true, typename WF>
__device__ __forceinline__ bool gemv_column(const WF& wf, const T* x, u32 k, u32 n, u32 step, u32 rows, u32 ksplit,
                                            u32 j, float (&sums)[NW]) {
    constexpr int U = GEMV_UNROLL(M * NW);
    __shared__ float part_s[GEMV_WARPS][M * NW];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 part = warp % ksplit;
    float acc[NW][M];
#pragma unroll
    for (int h = 0; h < NW; h++) {
#pragma unroll
        for (int r = 0; r < M; r++) acc[h][r] = 0.f;
    }
    typename WF::Row wr[NW];
#pragma unroll
    for (int h = 0; h < NW; h++) {
        const u64 r = (u64)h * step + j;
        wr[h] = wf.row(r < rows ? r : j);  // read only when j < n
    }
    const u32 chunks = k / WF::ELEMS, stride = 32 * ksplit;
    u32 c = part * 32 + lane;
    // The weights depend on no kernel: the lane's first U chunks are loaded before waiting for
    // the kernel that writes x, so that they stream in while that kernel finishes.
    typename WF::Raw wraw[NW][U];
    bool full = j < n && c + stride * (U - 1) < chunks;
    auto load_w = [&]() {
#pragma unroll
        for (int h = 0; h < NW; h++) {
#pragma unroll
            for (int u = 0; u < U; u++) wf.load(wr[h], c + stride * u, wraw[h][u]);
        }
    };
    if (full) load_w();
    if constexpr (GEMV_L2_PREFETCH != 0 && BLOCK_COLUMNS && WF::DENSE) {
        gemv_prefetch_later_blocks<T, NW>(wf.w, k, n, ksplit);
    }
    pdl_enter();
    if (j < n) {
        while (full) {
#pragma unroll
            for (int h = 0; h < NW; h++) {
#pragma unroll
                for (int u = 0; u < U; u++) wf.template dot<M>(wr[h], wraw[h][u], x, c + stride * u, acc[h]);
            }
            c += stride * U;
            full = c + stride * (U - 1) < chunks;
            if (full) load_w();
        }
        if constexpr (GEMV_TAIL_ROUND != 0) {
            // Fewer than U chunks are left (the loop above stops short of a full round): all
            // loaded at once, then used in order, so the same sums.
#pragma unroll
            for (int h = 0; h < NW; h++) {
#pragma unroll
                for (int u = 0; u < U - 1; u++) {
                    if (c + stride * u < chunks) wf.load(wr[h], c + stride * u, wraw[h][u]);
                }
            }
#pragma unroll
            for (int u = 0; u < U - 1; u++) {
                if (c + stride * u < chunks) {
#pragma unroll
                    for (int h = 0; h < NW; h++) wf.template dot<M>(wr[h], wraw[h][u], x, c + stride * u, acc[h]);
                }
            }
        } else {
            for (; c < chunks; c += stride) {
#pragma unroll
                for (int h = 0; h < NW; h++) {
                    typename WF::Raw tail;
                    wf.load(wr[h], c, tail);
                    wf.template dot<M>(wr[h], tail, x, c, acc[h]);
                }
            }
        }
    }
#pragma unroll
    for (int h = 0; h < NW; h++) {
#pragma unroll
        for (int r = 0; r < M; r++) {
            const float s = warp_sum(acc[h][r]);
            if (lane == 0) part_s[warp][h * M + r] = s;
        }
    }
    __syncthreads();
    if (part != 0 || lane >= M || j >= n) return false;
#pragma unroll
    for (int h = 0; h < NW; h++) {
        sums[h] = 0.f;
        for (u32 p = 0; p < ksplit; p++) sums[h] += part_s[warp + p][h * M + lane];
    }
    return true;
}

// A plain FP8 product of 2 to 4 rows of x (ACT 0 over Fp8Rows, M >= 2) takes two rows of w a
// warp, j and j + ceil(n / 2), so that x is loaded and widened once for both (widening the codes
// costs more than a dense row's elements): grid ceil(ceil(n / 2) / (GEMV_WARPS / ksplit))
// blocks. Each row's sum is the one a warp of its own computes. One row of x keeps a warp a row:
// on the H100 (gemv_bench fp8) pairs read the 8B's projections at 2 to 4 rows 15 to 53 % faster,
// at one row no faster and gate_up 18 % slower (half the warps, half the loads in flight).
template <typename T, typename O, int M, int ACT, typename WF>
__device__ __forceinline__ void gemv_impl(const WF& wf, const T* x, O* y, u32 k, u32 n, u32 ksplit) {
    constexpr bool PAIRS = ACT == 0 && !WF::DENSE && M >= 2;
    constexpr int NW = ACT == 0 && !PAIRS ? 1 : 2;  // rows of w per column
    const u32 cols = PAIRS ? (n + 1) / 2 : n;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 j = blockIdx.x * (GEMV_WARPS / ksplit) + warp / ksplit;
    float s[NW];
    if (!gemv_column<T, M, NW>(wf, x, k, cols, cols, PAIRS ? n : NW * n, ksplit, j, s)) return;
    if constexpr (PAIRS) {
        y[(u64)lane * n + j] = from_float<O>(s[0]);
        if (cols + j < n) y[(u64)lane * n + cols + j] = from_float<O>(s[1]);
    } else if constexpr (ACT == 0) {
        y[(u64)lane * n + j] = from_float<O>(s[0]);
    } else {
        const float g = to_float(from_float<T>(s[0])), u = to_float(from_float<T>(s[NW - 1]));
        y[(u64)lane * n + j] = from_float<O>(gated<ACT>(g, u));
    }
}

// Where a GEMV with qkv_rope_cache (rope.cu) in its epilogue writes: q to q_out [M, num_heads *
// head_dim], k and v to the caches [num_slots, num_kv_heads * head_dim] at slot_mapping[r]
// (negative or past the cache: not written), every dim of a head rotated (head_dim = 2 * half).
template <typename T> struct QkvRopeOut {
    T* q_out;
    T* k_cache;
    T* v_cache;
    const u32* positions;
    const i64* slot_mapping;
    const float* inv_freq;
    u32 long_start, num_heads, num_kv_heads, head_dim;
    float attention_scaling;
    i64 num_slots;
};

// Row r's rotary pair i (dims i and i + half) of qkv head `head`, (x0, x1) rounded to T as the
// qkv buffer of the unfused ops holds them: rotated by rope_pair (q and k) and stored, the bits
// qkv_rope_cache gives.
template <typename T>
__device__ __forceinline__ void qkv_rope_store(const QkvRopeOut<T>& o, u32 r, u32 head, u32 i, float x0, float x1) {
    const u32 half = o.head_dim / 2;
    const u32 q_size = o.num_heads * o.head_dim, kv_size = o.num_kv_heads * o.head_dim;
    if (head >= o.num_heads + o.num_kv_heads) {
        const i64 slot = o.slot_mapping[r];
        if (slot < 0 || slot >= o.num_slots) return;
        T* dst = o.v_cache + (u64)slot * kv_size + (u64)(head - o.num_heads - o.num_kv_heads) * o.head_dim;
        dst[i] = from_float<T>(x0);
        dst[i + half] = from_float<T>(x1);
        return;
    }
    const u32 pos = o.positions[r];
    const float* freq = o.inv_freq + (pos >= o.long_start ? half : 0);
    float y0, y1;
    rope_pair(x0, x1, pos, freq[i], o.attention_scaling, y0, y1);
    T* dst;
    if (head < o.num_heads) {
        dst = o.q_out + (u64)r * q_size + (u64)head * o.head_dim;
    } else {
        const i64 slot = o.slot_mapping[r];
        if (slot < 0 || slot >= o.num_slots) return;
        dst = o.k_cache + (u64)slot * kv_size + (u64)(head - o.num_heads) * o.head_dim;
    }
    dst[i] = from_float<T>(y0);
    dst[i + half] = from_float<T>(y1);
}

// The fused qkv projection with qkv_rope_cache (rope.cu) in its epilogue: w is
// [(num_heads + 2 * num_kv_heads) * head_dim, k] and every dim of a head rotates (head_dim =
// 2 * half). Instead of the columns j..j + cpb - 1 (cpb = GEMV_WARPS / ksplit), a block takes
// P = cpb / 2 rotary pairs, the columns i..i + P - 1 and i + half..i + half + P - 1 of one head
// (half % P == 0, the host checks), so that each pair is rotated where it is computed: q goes to
// q_out [M, num_heads * head_dim], k and v to the caches [num_slots, num_kv_heads * head_dim] at
// slot_mapping[r] (negative or past the cache: not written). The sums are rounded to T before the
// rotation, as the qkv buffer of the unfused ops holds them, and rotated by rope_pair: the same
// bits as linear followed by qkv_rope_cache. Grid: n / cpb blocks of GEMV_WARPS warps.
template <typename T, int M>
__device__ __forceinline__ void gemv_rope_impl(const T* x, const T* w, const QkvRopeOut<T>& o, u32 k, u32 ksplit) {
    __shared__ float vals_s[GEMV_WARPS][M];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 half = o.head_dim / 2, pairs = GEMV_WARPS / ksplit / 2;
    const u32 col = warp / ksplit, p = col % pairs, hi = col / pairs;
    const u32 g = blockIdx.x * pairs + p, head = g / half, i = g % half;
    const u32 n = (o.num_heads + 2 * o.num_kv_heads) * o.head_dim;
    const u32 j = head * o.head_dim + hi * half + i;
    float s[1];
    if (gemv_column<T, M, 1, false>(DenseRows<T>{w, k}, x, k, n, n, n, ksplit, j, s)) {
        vals_s[col][lane] = to_float(from_float<T>(s[0]));
    }
    __syncthreads();
    if (hi != 0 || warp % ksplit != 0 || lane >= M || j >= n) return;
    qkv_rope_store(o, lane, head, i, vals_s[col][lane], vals_s[col + pairs][lane]);
}

#define GEMV(T, S, M) \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_m##M##_##S(const T* x, const T* w, T* y, \
                                                                                u32 k, u32 n, u32 ksplit) { \
        gemv_impl<T, T, M, 0>(DenseRows<T>{w, k}, x, y, k, n, ksplit); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_m##M##_to_f32_##S( \
        const T* x, const T* w, float* y, u32 k, u32 n, u32 ksplit) { \
        gemv_impl<T, float, M, 0>(DenseRows<T>{w, k}, x, y, k, n, ksplit); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_silu_m##M##_##S( \
        const T* x, const T* w, T* y, u32 k, u32 n, u32 ksplit) { \
        gemv_impl<T, T, M, 1>(DenseRows<T>{w, k}, x, y, k, n, ksplit); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_gelu_tanh_m##M##_##S( \
        const T* x, const T* w, T* y, u32 k, u32 n, u32 ksplit) { \
        gemv_impl<T, T, M, 2>(DenseRows<T>{w, k}, x, y, k, n, ksplit); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_rope_cache_m##M##_##S( \
        const T* x, const T* w, T* q_out, T* k_cache, T* v_cache, const u32* positions, const i64* slot_mapping, \
        const float* inv_freq, u32 long_start, u32 k, u32 ksplit, u32 num_heads, u32 num_kv_heads, u32 head_dim, \
        float attention_scaling, i64 num_slots) { \
        const QkvRopeOut<T> o{q_out,      k_cache,   v_cache,      positions, slot_mapping,      inv_freq, \
                              long_start, num_heads, num_kv_heads, head_dim,  attention_scaling, num_slots}; \
        gemv_rope_impl<T, M>(x, w, o, k, ksplit); \
    }
// The same products over FP8 weights: w holds e4m3 codes, `grid` their scales (Fp8Rows).
#define GEMV_FP8(T, S, M) \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_fp8_m##M##_##S( \
        const T* x, const unsigned char* w, T* y, u32 k, u32 n, u32 ksplit, Fp8Grid grid) { \
        gemv_impl<T, T, M, 0>(Fp8Rows<T>{w, grid, k}, x, y, k, n, ksplit); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_fp8_m##M##_to_f32_##S( \
        const T* x, const unsigned char* w, float* y, u32 k, u32 n, u32 ksplit, Fp8Grid grid) { \
        gemv_impl<T, float, M, 0>(Fp8Rows<T>{w, grid, k}, x, y, k, n, ksplit); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_fp8_silu_m##M##_##S( \
        const T* x, const unsigned char* w, T* y, u32 k, u32 n, u32 ksplit, Fp8Grid grid) { \
        gemv_impl<T, T, M, 1>(Fp8Rows<T>{w, grid, k}, x, y, k, n, ksplit); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_fp8_gelu_tanh_m##M##_##S( \
        const T* x, const unsigned char* w, T* y, u32 k, u32 n, u32 ksplit, Fp8Grid grid) { \
        gemv_impl<T, T, M, 2>(Fp8Rows<T>{w, grid, k}, x, y, k, n, ksplit); \
    }

#define GEMV_M1(T, S) GEMV(T, S, 1)
#define GEMV_M2(T, S) GEMV(T, S, 2)
#define GEMV_M3(T, S) GEMV(T, S, 3)
#define GEMV_M4(T, S) GEMV(T, S, 4)
FOR_EACH_DTYPE(GEMV_M1)
FOR_EACH_DTYPE(GEMV_M2)
FOR_EACH_DTYPE(GEMV_M3)
FOR_EACH_DTYPE(GEMV_M4)
#define GEMV_FP8_M1(T, S) GEMV_FP8(T, S, 1)
#define GEMV_FP8_M2(T, S) GEMV_FP8(T, S, 2)
#define GEMV_FP8_M3(T, S) GEMV_FP8(T, S, 3)
#define GEMV_FP8_M4(T, S) GEMV_FP8(T, S, 4)
FOR_EACH_DTYPE(GEMV_FP8_M1)
FOR_EACH_DTYPE(GEMV_FP8_M2)
FOR_EACH_DTYPE(GEMV_FP8_M3)
FOR_EACH_DTYPE(GEMV_FP8_M4)
