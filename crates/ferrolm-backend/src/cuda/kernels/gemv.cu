// `linear` for a few rows (decode at small batch): y[m, n] = x[m, k] · w[n, k]^T with M <= 4
// rows of x, where the product is bound by reading `w` once. cuBLAS's GEMM kernels tile for
// large m and reach 60-80% of the bandwidth on these shapes; here every weight byte is read with
// 16-byte loads, several in flight per lane, and used for all M rows.
//
// One warp per output column j (a row of w): lane l takes the 8-element chunks l, l + 32, ...
// of w[j, :] and of each x row, accumulates in f32 (exact products of the inputs, fused
// multiply-adds), and the warp sums its lanes. Needs k % 8 == 0 and 16-byte aligned x and w
// (the host checks). Grid: ceil(n / GEMV_WARPS) blocks of GEMV_WARPS warps.

#define GEMV_WARPS 8
// Chunks each lane loads before it uses them (loads in flight per lane and per x row).
#define GEMV_UNROLL 4

// 8 elements at `p` (16-byte aligned) as f32.
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
template <typename T> __device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const T* pair = reinterpret_cast<const T*>(&w[i]);
        v[2 * i] = to_float(pair[0]);
        v[2 * i + 1] = to_float(pair[1]);
    }
}

template <typename T, typename O, int M>
__device__ __forceinline__ void gemv_impl(const T* x, const T* w, O* y, u32 k, u32 n) {
    const u32 lane = threadIdx.x & 31;
    const u32 j = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (j >= n) return;
    const T* wr = w + (u64)j * k;
    const u32 chunks = k / 8;
    float acc[M];
#pragma unroll
    for (int r = 0; r < M; r++) acc[r] = 0.f;

    u32 c = lane;
    for (; c + 32 * (GEMV_UNROLL - 1) < chunks; c += 32 * GEMV_UNROLL) {
        float wv[GEMV_UNROLL][8];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) load8(wr + (u64)(c + 32 * u) * 8, wv[u]);
#pragma unroll
        for (int r = 0; r < M; r++) {
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) {
                float xv[8];
                load8(x + (u64)r * k + (u64)(c + 32 * u) * 8, xv);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[r] = fmaf(wv[u][i], xv[i], acc[r]);
            }
        }
    }
    for (; c < chunks; c += 32) {
        float wv[8];
        load8(wr + (u64)c * 8, wv);
#pragma unroll
        for (int r = 0; r < M; r++) {
            float xv[8];
            load8(x + (u64)r * k + (u64)c * 8, xv);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[r] = fmaf(wv[i], xv[i], acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < M; r++) {
        const float s = warp_sum(acc[r]);
        if (lane == 0) y[(u64)r * n + j] = from_float<O>(s);
    }
}

#define GEMV(T, S, M) \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_m##M##_##S(const T* x, const T* w, T* y, \
                                                                                u32 k, u32 n) { \
        gemv_impl<T, T, M>(x, w, y, k, n); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_m##M##_to_f32_##S( \
        const T* x, const T* w, float* y, u32 k, u32 n) { \
        gemv_impl<T, float, M>(x, w, y, k, n); \
    }
#define GEMV_M1(T, S) GEMV(T, S, 1)
#define GEMV_M2(T, S) GEMV(T, S, 2)
#define GEMV_M3(T, S) GEMV(T, S, 3)
#define GEMV_M4(T, S) GEMV(T, S, 4)
FOR_EACH_DTYPE(GEMV_M1)
FOR_EACH_DTYPE(GEMV_M2)
FOR_EACH_DTYPE(GEMV_M3)
FOR_EACH_DTYPE(GEMV_M4)
