// RMSNorm as the CPU backend computes it: `x * (1 / sqrt(mean(x^2) + eps)) * w` in f32.
// One block per row; the weight `w` is f32 `[hidden]`.
//
// Thread t takes the elements t, t + blockDim.x, ... in that order. Its first NORM_CACHED
// elements stay in registers between the sum of squares and the output, and their weights are
// loaded before the wait on the kernel before (no kernel writes them), so that a row of up to
// NORM_CACHED * blockDim.x elements (4096 at 1024 threads) costs one round of loads after the
// wait; elements past that are read again, as are their weights.
#define NORM_CACHED 4

// Normalises row `blockIdx.x` of `hidden` elements into `out`. `first(i)` gives the element at
// flat index i once the wait is over (it may also store it, as the residual add does); `again(i)`
// reads it back for the elements past the cached ones.
template <typename T, typename First, typename Again>
__device__ __forceinline__ void rms_norm_row(First first, Again again, const float* w, T* out, u32 hidden,
                                             float eps) {
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * hidden;
    float wv[NORM_CACHED], v[NORM_CACHED];
#pragma unroll
    for (int c = 0; c < NORM_CACHED; c++) {
        const u32 i = threadIdx.x + c * blockDim.x;
        wv[c] = i < hidden ? w[i] : 0.f;
    }
    pdl_enter();
    float sum_sq = 0.f;
#pragma unroll
    for (int c = 0; c < NORM_CACHED; c++) {
        const u32 i = threadIdx.x + c * blockDim.x;
        v[c] = i < hidden ? first(base + i) : 0.f;
        sum_sq += v[c] * v[c];
    }
    for (u32 i = threadIdx.x + NORM_CACHED * blockDim.x; i < hidden; i += blockDim.x) {
        const float vi = first(base + i);
        sum_sq += vi * vi;
    }
    sum_sq = block_sum(sum_sq, scratch);
    const float inv_rms = 1.f / sqrtf(sum_sq / (float)hidden + eps);
#pragma unroll
    for (int c = 0; c < NORM_CACHED; c++) {
        const u32 i = threadIdx.x + c * blockDim.x;
        if (i < hidden) out[base + i] = from_float<T>(v[c] * inv_rms * wv[c]);
    }
    for (u32 i = threadIdx.x + NORM_CACHED * blockDim.x; i < hidden; i += blockDim.x) {
        out[base + i] = from_float<T>(again(base + i) * inv_rms * w[i]);
    }
}

// x, out: [rows, hidden]. `out` may be `x` (in place): each thread reads an element before
// it writes the same element.
template <typename X, typename T>
__device__ __forceinline__ void rms_norm_impl(const X* x, const float* w, T* out, u32 hidden, float eps) {
    auto read = [&](u64 i) { return to_float(x[i]); };
    rms_norm_row<T>(read, read, w, out, hidden, eps);
}

#define RMS_NORM(T, S) \
    extern "C" __global__ void rms_norm_##S(const T* x, const float* w, T* out, u32 hidden, float eps) { \
        rms_norm_impl<T, T>(x, w, out, hidden, eps); \
    } \
    extern "C" __global__ void rms_norm_from_f32_##S(const float* x, const float* w, T* out, u32 hidden, \
                                                     float eps) { \
        rms_norm_impl<float, T>(x, w, out, hidden, eps); \
    }
FOR_EACH_DTYPE(RMS_NORM)

// residual, x, out: [rows, hidden]. `residual += x` (rounded to R, as an R tensor would hold
// it: R is T, or f32 for an f32 residual stream), then `out = rms_norm(residual)`.
template <typename R, typename T>
__device__ __forceinline__ void add_rms_norm_impl(R* residual, const T* x, const float* w, T* out, u32 hidden,
                                                  float eps) {
    auto add = [&](u64 i) {
        const R sum = from_float<R>(to_float(residual[i]) + to_float(x[i]));
        residual[i] = sum;
        return to_float(sum);
    };
    auto read = [&](u64 i) { return to_float(residual[i]); };
    rms_norm_row<T>(add, read, w, out, hidden, eps);
}

#define ADD_RMS_NORM(T, S) \
    extern "C" __global__ void add_rms_norm_##S(T* residual, const T* x, const float* w, T* out, u32 hidden, \
                                                float eps) { \
        add_rms_norm_impl<T, T>(residual, x, w, out, hidden, eps); \
    } \
    extern "C" __global__ void add_rms_norm_f32_residual_##S(float* residual, const T* x, const float* w, T* out, \
                                                             u32 hidden, float eps) { \
        add_rms_norm_impl<float, T>(residual, x, w, out, hidden, eps); \
    }
FOR_EACH_DTYPE(ADD_RMS_NORM)
