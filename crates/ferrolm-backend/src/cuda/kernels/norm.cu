// RMSNorm as the CPU backend computes it: `x * (1 / sqrt(mean(x^2) + eps)) * w` in f32.
// One block per row; the weight `w` is f32 `[hidden]`.

// x, out: [rows, hidden]. `out` may be `x` (in place): each thread reads an element before
// it writes the same element.
template <typename X, typename T>
__device__ __forceinline__ void rms_norm_impl(const X* x, const float* w, T* out, u32 hidden, float eps) {
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * hidden;
    float sum_sq = 0.f;
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = to_float(x[base + i]);
        sum_sq += v * v;
    }
    sum_sq = block_sum(sum_sq, scratch);
    const float inv_rms = 1.f / sqrtf(sum_sq / (float)hidden + eps);
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[base + i] = from_float<T>(to_float(x[base + i]) * inv_rms * w[i]);
    }
}

#define RMS_NORM(T, S) \
    extern "C" __global__ void rms_norm_##S(const T* x, const float* w, T* out, u32 hidden, float eps) { \
        pdl_enter(); \
        rms_norm_impl<T, T>(x, w, out, hidden, eps); \
    } \
    extern "C" __global__ void rms_norm_from_f32_##S(const float* x, const float* w, T* out, u32 hidden, \
                                                     float eps) { \
        pdl_enter(); \
        rms_norm_impl<float, T>(x, w, out, hidden, eps); \
    }
FOR_EACH_DTYPE(RMS_NORM)

// residual, x, out: [rows, hidden]. `residual += x` (rounded to R, as an R tensor would hold
// it: R is T, or f32 for an f32 residual stream), then `out = rms_norm(residual)`.
template <typename R, typename T>
__device__ __forceinline__ void add_rms_norm_impl(R* residual, const T* x, const float* w, T* out, u32 hidden,
                                                  float eps) {
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * hidden;
    float sum_sq = 0.f;
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) {
        const R sum = from_float<R>(to_float(residual[base + i]) + to_float(x[base + i]));
        residual[base + i] = sum;
        const float v = to_float(sum);
        sum_sq += v * v;
    }
    sum_sq = block_sum(sum_sq, scratch);
    const float inv_rms = 1.f / sqrtf(sum_sq / (float)hidden + eps);
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[base + i] = from_float<T>(to_float(residual[base + i]) * inv_rms * w[i]);
    }
}

#define ADD_RMS_NORM(T, S) \
    extern "C" __global__ void add_rms_norm_##S(T* residual, const T* x, const float* w, T* out, u32 hidden, \
                                                float eps) { \
        pdl_enter(); \
        add_rms_norm_impl<T, T>(residual, x, w, out, hidden, eps); \
    } \
    extern "C" __global__ void add_rms_norm_f32_residual_##S(float* residual, const T* x, const float* w, T* out, \
                                                             u32 hidden, float eps) { \
        pdl_enter(); \
        add_rms_norm_impl<float, T>(residual, x, w, out, hidden, eps); \
    }
FOR_EACH_DTYPE(ADD_RMS_NORM)
