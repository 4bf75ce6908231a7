// The FP8-weight GEMV on tensor cores, for bf16 and f16 activations: y[m, n] = x[m, k] · w[n, k]^T
// for m <= 4 rows of x, w being e4m3 codes with a grid of scales whose blocks are at least 64
// columns wide (or whole rows). It takes the products gemv.cu's Fp8Rows kernels take (each weight
// read once, as one byte; exact products of the codes' values and x, summed in f32, though in
// another order and scaled per 64 columns rather than per 16), with far fewer instructions a byte:
// there, every code is widened to f32 and multiplied on its own (about 5.3 instructions a weight
// byte against 2.5 for a bf16 GEMV, too many to keep up with the memory); here, codes become a pair
// of T in about two instructions and one mma.m16n8k16 takes 128 of them. The batch is the mma's n
// dimension (8 wide, m <= 4 used), so 1 to 4 rows cost the same.
//
// A warp takes a tile of 16 rows of w, the mma's A rows: rows 16 t .. 16 t + 15 for a plain product
// (its outputs), or, for a gated one (w = [gate; up], [2 n, k]), gate rows 8 t .. 8 t + 7 as A rows
// 0..7 and the matching up rows as 8..15, so that a lane holds both halves of its outputs (and
// likewise both dims of 8 rotary pairs for the qkv projection with its rotation). Rows past the
// matrix read row 0 and are never stored. k is taken in chunks of 64 columns: lane (g, q) = (lane /
// 4, lane % 4) loads 16 codes (one 16-byte load) of A rows g and g + 8 at columns 64 c + 16 q, and
// the 16 matching values of x row g (zeros for g >= m). Its codes 4 s .. 4 s + 3 are the lane's k
// slots of the chunk's s-th mma: slots 2q, 2q + 1 take codes 4s, 4s + 1, slots 2q + 8, 2q + 9 codes
// 4s + 2, 4s + 3 (the mma sums over k, so any order of k does, as long as A and B agree); x's pairs
// are already in that order. A chunk lies in one scale block (blocks of 64 columns or more start on
// a chunk): with blocks narrower than the row the chunk's sums are scaled before they are added,
// else once at the end.
//
// Codes to T: e4m3x2_to_half2 (common.cuh) gives two exact halves; for bf16
// the halves' bits are moved down 3 places, which reads as the same value times 2^-112 (the bf16
// exponent bias is 112 above the half's; every e4m3 value is a normal half, so none is a bf16
// subnormal), and the sums are multiplied by 2^112 before the scale. A NaN code (quantizers
// saturate, so none is expected) reads as a half NaN, or in bf16 as a finite 2^-112 multiple.
//
// ksplit warps (a power of two up to GEMV_WARPS) share a tile, warp part p taking chunks p,
// p + ksplit, ...: where a lane has a full round, its first FP8_GEMV_UNROLL chunks are loaded
// before waiting on the kernel before (weights depend on none); the parts meet in shared memory. Grid: ceil(tiles /
// (GEMV_WARPS / ksplit)) blocks of GEMV_WARPS warps; needs k % 16 == 0 and 16-byte aligned x.

// Chunks a lane loads before it uses them (32 bytes of codes each: its two rows).
#ifndef FP8_GEMV_UNROLL
#define FP8_GEMV_UNROLL 4
#endif

// Two codes (low 16 bits, the first in the low byte) as a pair of T (the first in the low half)
// for mma16816: halves (common.cuh's e4m3x2_to_half2), or bf16 values times 2^-112
// (fp8_gemv_unscale undoes it).
__device__ __forceinline__ u32 e4m3x2_to_mma(u32 two, __half) { return e4m3x2_to_half2(two); }
__device__ __forceinline__ u32 e4m3x2_to_mma(u32 two, __nv_bfloat16) {
    const u32 h = e4m3x2_to_mma(two, __half());
    return (h & 0x80008000u) | ((h & 0x7fff7fffu) >> 3);
}
__device__ __forceinline__ float fp8_gemv_unscale(__half) { return 1.f; }
__device__ __forceinline__ float fp8_gemv_unscale(__nv_bfloat16) { return 0x1p112f; }

// One chunk's four mma: d += A (codes of the lane's two rows, `a`) · B (x's 16 values, `xr`).
template <typename T>
__device__ __forceinline__ void fp8_gemv_chunk(const uint4 (&a)[2], const uint4 (&xr)[2], float (&d)[4]) {
    const u32 wa[4] = {a[0].x, a[0].y, a[0].z, a[0].w}, wb[4] = {a[1].x, a[1].y, a[1].z, a[1].w};
    const u32 xs[8] = {xr[0].x, xr[0].y, xr[0].z, xr[0].w, xr[1].x, xr[1].y, xr[1].z, xr[1].w};
#pragma unroll
    for (int s = 0; s < 4; s++) {
        const u32 frag[4] = {e4m3x2_to_mma(wa[s], T()), e4m3x2_to_mma(wb[s], T()), e4m3x2_to_mma(wa[s] >> 16, T()),
                             e4m3x2_to_mma(wb[s] >> 16, T())};
        mma16816(d, frag, xs[2 * s], xs[2 * s + 1], T());
    }
}

// The tile's products: `acc` gets, for A rows g and g + 8 (rows `row[0]` and `row[1]` of w's
// `rows`; one past them reads row 0), the sums with x rows 2q and 2q + 1: acc[0], acc[1] of A row
// g, acc[2], acc[3] of A row g + 8, scaled. Returns whether this thread holds them (the first of
// the tile's ksplit warps). Every thread of the block must call it (it synchronizes).
template <typename T, int M>
__device__ __forceinline__ bool fp8_gemv_tile(const T* x, const unsigned char* w, u32 k, u32 rows, u32 ksplit,
                                              const Fp8Grid& grid, const u32 (&row)[2], float (&acc)[4]) {
    constexpr int U = FP8_GEMV_UNROLL;
    __shared__ float part_s[GEMV_WARPS][4][32];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const u32 part = warp % ksplit;
    const unsigned char* wrow[2];
    const float* srow[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const u32 r = row[h] < rows ? row[h] : 0;
        wrow[h] = w + (u64)r * k + 16 * q;
        srow[h] = grid.row(r);
    }
    const T* xrow = x + (u64)(g < M ? g : 0) * k + 16 * q;
    const bool has_x = g < M, blocked = grid.col_shift < 31;
    const u32 full_chunks = k / 64, stride = ksplit;
    // The mma sums are the values' times 1 / unscale (see e4m3x2_to_mma); brought back before
    // the scale, so that no sum of a small output drops to a subnormal.
    const float unscale = fp8_gemv_unscale(T());
#pragma unroll
    for (int i = 0; i < 4; i++) acc[i] = 0.f;
    // x's 16 values for chunk c (zeros past k or the batch).
    auto load_x = [&](u32 c, bool valid, uint4 (&xr)[2]) {
        xr[0] = xr[1] = make_uint4(0, 0, 0, 0);
        if (has_x && valid) {
            xr[0] = *reinterpret_cast<const uint4*>(xrow + (u64)c * 64);
            xr[1] = *reinterpret_cast<const uint4*>(xrow + (u64)c * 64 + 8);
        }
    };
    // Adds chunk c's products (codes `a`, x `xr`) to acc, scaled here where blocks are narrower
    // than the row.
    auto use = [&](const uint4 (&a)[2], const uint4 (&xr)[2], u32 c) {
        if (blocked) {
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            fp8_gemv_chunk<T>(a, xr, d);
            const u32 b = (c * 64) >> grid.col_shift;
            const float s0 = srow[0][b], s1 = srow[1][b];
            acc[0] = fmaf(d[0] * unscale, s0, acc[0]);
            acc[1] = fmaf(d[1] * unscale, s0, acc[1]);
            acc[2] = fmaf(d[2] * unscale, s1, acc[2]);
            acc[3] = fmaf(d[3] * unscale, s1, acc[3]);
        } else {
            fp8_gemv_chunk<T>(a, xr, acc);
        }
    };
    uint4 wraw[U][2];
    u32 c = part;
    bool full = c + stride * (U - 1) < full_chunks;
    auto load_w = [&]() {
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                wraw[u][h] = *reinterpret_cast<const uint4*>(wrow[h] + (u64)(c + stride * u) * 64);
            }
        }
    };
    if (full) load_w();
    pdl_enter();
    while (full) {
        // The round's x first, all in flight together.
        uint4 xr[U][2];
#pragma unroll
        for (int u = 0; u < U; u++) load_x(c + stride * u, true, xr[u]);
#pragma unroll
        for (int u = 0; u < U; u++) use(wraw[u], xr[u], c + stride * u);
        c += stride * U;
        full = c + stride * (U - 1) < full_chunks;
        if (full) load_w();
    }
    // The last chunks, fewer than a round, one at a time; in the last (a partial chunk where
    // k % 64 != 0) lanes past k load nothing and add zeros.
    for (; c * 64 < k; c += stride) {
        const bool valid = c * 64 + 16 * q < k;
        uint4 a[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)}, xr[2];
        if (valid) {
#pragma unroll
            for (int h = 0; h < 2; h++) a[h] = *reinterpret_cast<const uint4*>(wrow[h] + (u64)c * 64);
        }
        load_x(c, valid, xr);
        use(a, xr, c);
    }
    if (!blocked) {
        // (unscale first: exact, where a scale times 2^112 could overflow)
        const float s0 = srow[0][0], s1 = srow[1][0];
        acc[0] = acc[0] * unscale * s0;
        acc[1] = acc[1] * unscale * s0;
        acc[2] = acc[2] * unscale * s1;
        acc[3] = acc[3] * unscale * s1;
    }
    // The parts meet: the first warp of the tile adds the others' accumulators.
#pragma unroll
    for (int i = 0; i < 4; i++) part_s[warp][i][lane] = acc[i];
    __syncthreads();
    if (part != 0) return false;
    for (u32 p = 1; p < ksplit; p++) {
#pragma unroll
        for (int i = 0; i < 4; i++) acc[i] += part_s[warp + p][i][lane];
    }
    return true;
}

// Plain (ACT 0: 16 outputs a tile, rows 16 t + g and 16 t + g + 8) and gated products (gate rows
// 8 t + g and their up rows n + 8 t + g, ACT 1: silu, 2: gelu_tanh, each rounded to T first).
template <typename T, typename O, int M, int ACT>
__device__ __forceinline__ void fp8_gemv_impl(const T* x, const unsigned char* w, O* y, u32 k, u32 n, u32 ksplit,
                                              Fp8Grid grid) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const u32 tile = blockIdx.x * (GEMV_WARPS / ksplit) + warp / ksplit;
    const u32 row[2] = {ACT == 0 ? tile * 16 + g : tile * 8 + g, ACT == 0 ? tile * 16 + g + 8 : n + tile * 8 + g};
    float acc[4];
    if (!fp8_gemv_tile<T, M>(x, w, k, ACT == 0 ? n : 2 * n, ksplit, grid, row, acc)) return;
#pragma unroll
    for (int b = 0; b < 2; b++) {
        const u32 r = 2 * q + b;
        if (r >= M) continue;
        if constexpr (ACT == 0) {
            if (row[0] < n) y[(u64)r * n + row[0]] = from_float<O>(acc[b]);
            if (row[1] < n) y[(u64)r * n + row[1]] = from_float<O>(acc[2 + b]);
        } else if (row[0] < n) {
            const float gate = to_float(from_float<T>(acc[b])), up = to_float(from_float<T>(acc[2 + b]));
            y[(u64)r * n + row[0]] = from_float<O>(gated<ACT>(gate, up));
        }
    }
}

// The fused qkv projection with qkv_rope_cache (rope.cu) in its epilogue, as gemv.cu's
// gemv_rope_cache: w is [(num_heads + 2 * num_kv_heads) * head_dim, k] and every dim of a head
// rotates (head_dim = 2 * half, half % 8 == 0). Tile t takes 8 rotary pairs, dims i0 + g and
// i0 + half + g of head (8 t) / half (i0 = 8 t % half) as A rows g and g + 8, so that a lane holds
// both dims of its pairs; the sums are rounded to T and rotated by rope_pair, then q goes to q_out
// [M, num_heads * head_dim], k and v to the caches at slot_mapping[r] (negative or past the
// cache: not written; gemv.cu's qkv_rope_store). The same bits as fp8_gemv into qkv followed by
// qkv_rope_cache. Grid: tiles = n / 16 over GEMV_WARPS / ksplit a block.
template <typename T, int M>
__device__ __forceinline__ void fp8_gemv_rope_impl(const T* x, const unsigned char* w, const QkvRopeOut<T>& o, u32 k,
                                                   u32 ksplit, Fp8Grid grid) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const u32 tile = blockIdx.x * (GEMV_WARPS / ksplit) + warp / ksplit;
    const u32 half = o.head_dim / 2, pair = tile * 8, head = pair / half, i = pair % half + g;
    const u32 n = (o.num_heads + 2 * o.num_kv_heads) * o.head_dim;
    const u32 row[2] = {head * o.head_dim + i, head * o.head_dim + half + i};
    float acc[4];
    if (!fp8_gemv_tile<T, M>(x, w, k, n, ksplit, grid, row, acc) || row[0] >= n) return;
#pragma unroll
    for (int b = 0; b < 2; b++) {
        const u32 r = 2 * q + b;
        if (r < M) qkv_rope_store(o, r, head, i, to_float(from_float<T>(acc[b])), to_float(from_float<T>(acc[2 + b])));
    }
}

#define FP8_GEMV(T, S, M) \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) fp8_gemv_m##M##_##S( \
        const T* x, const unsigned char* w, T* y, u32 k, u32 n, u32 ksplit, Fp8Grid grid) { \
        fp8_gemv_impl<T, T, M, 0>(x, w, y, k, n, ksplit, grid); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) fp8_gemv_m##M##_to_f32_##S( \
        const T* x, const unsigned char* w, float* y, u32 k, u32 n, u32 ksplit, Fp8Grid grid) { \
        fp8_gemv_impl<T, float, M, 0>(x, w, y, k, n, ksplit, grid); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) fp8_gemv_silu_m##M##_##S( \
        const T* x, const unsigned char* w, T* y, u32 k, u32 n, u32 ksplit, Fp8Grid grid) { \
        fp8_gemv_impl<T, T, M, 1>(x, w, y, k, n, ksplit, grid); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) fp8_gemv_gelu_tanh_m##M##_##S( \
        const T* x, const unsigned char* w, T* y, u32 k, u32 n, u32 ksplit, Fp8Grid grid) { \
        fp8_gemv_impl<T, T, M, 2>(x, w, y, k, n, ksplit, grid); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) fp8_gemv_rope_cache_m##M##_##S( \
        const T* x, const unsigned char* w, T* q_out, T* k_cache, T* v_cache, const u32* positions, \
        const i64* slot_mapping, const float* inv_freq, u32 long_start, u32 k, u32 ksplit, u32 num_heads, \
        u32 num_kv_heads, u32 head_dim, float attention_scaling, i64 num_slots, Fp8Grid grid) { \
        const QkvRopeOut<T> o{q_out,      k_cache,   v_cache,      positions, slot_mapping,      inv_freq, \
                              long_start, num_heads, num_kv_heads, head_dim,  attention_scaling, num_slots}; \
        fp8_gemv_rope_impl<T, M>(x, w, o, k, ksplit, grid); \
    }

#define FP8_GEMV_M1(T, S) FP8_GEMV(T, S, 1)
#define FP8_GEMV_M2(T, S) FP8_GEMV(T, S, 2)
#define FP8_GEMV_M3(T, S) FP8_GEMV(T, S, 3)
#define FP8_GEMV_M4(T, S) FP8_GEMV(T, S, 4)
FOR_EACH_HALF_DTYPE(FP8_GEMV_M1)
FOR_EACH_HALF_DTYPE(FP8_GEMV_M2)
FOR_EACH_HALF_DTYPE(FP8_GEMV_M3)
FOR_EACH_HALF_DTYPE(FP8_GEMV_M4)
