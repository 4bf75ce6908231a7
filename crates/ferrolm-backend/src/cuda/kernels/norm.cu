// RMSNorm as the CPU backend computes it: `x * (1 / sqrt(mean(x^2) + eps)) * w` in f32.
// One block per row; the weight `w` is f32 `[hidden]`.
//
// Thread t takes the elements t, t + blockDim.x, ... in that order. Its first NORM_CACHED
// elements stay in registers between the sum of squares and the output, and their weights are
// loaded before the wait on the kernel before (no kernel writes them), so that a row of up to
// NORM_CACHED * blockDim.x elements (4096 at 1024 threads) costs one round of loads after the
// wait; elements past that are read again, as are their weights.
//
// Every kernel takes a `RowCodes` last: where it is not null, the block also writes its row's
// FP8 codes and scale (`quantize_row`), for an FP8 projection that reads the normed rows.
#define NORM_CACHED 4

// Where `codes` keeps codes: the row just written (`row`, by every thread of the block) quantized
// into them (`quantize_row`), so that the FP8 projection reading it need not quantize it again.
template <typename T>
__device__ __forceinline__ void quantize_normed_row(const T* row, u32 hidden, RowCodes codes, float* scratch) {
    if (codes.codes == nullptr) return;
    __syncthreads();  // the row's values, written by the whole block
    quantize_row(row, hidden, codes, blockIdx.x, scratch);
}

// Normalises row `blockIdx.x` of `hidden` elements into `out`. `first(i)` gives the element at
// flat index i once the wait is over (it may also store it, as the residual add does); `again(i)`
// reads it back for the elements past the cached ones.
template <typename T, typename First, typename Again>
__device__ __forceinline__ void rms_norm_row(First first, Again again, const float* w, T* out, u32 hidden,
                                             float eps, RowCodes codes) {
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
    quantize_normed_row(out + base, hidden, codes, scratch);
}

// The same for rows of a multiple of 8 elements, 16-byte aligned, with 16-byte accesses: thread
// t takes the 8-element chunks t, t + blockDim.x, ... of its row, its first NORM_VEC_CACHED
// chunks kept in registers (a row of up to 16384 elements at 1024 threads costs one round of
// loads), and `first(i, v)` / `again(i, v)` take the 8 elements from flat index i. The same
// arithmetic per element as `rms_norm_row`; only the order of the sum of squares differs.
#define NORM_VEC_CACHED 2

template <typename T, typename First, typename Again>
__device__ __forceinline__ void rms_norm_row8(First first, Again again, const float* w, T* out, u32 hidden,
                                              float eps, RowCodes codes) {
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * hidden;
    const u32 chunks = hidden / 8;
    float wv[NORM_VEC_CACHED][8], v[NORM_VEC_CACHED][8];
#pragma unroll
    for (int c = 0; c < NORM_VEC_CACHED; c++) {
        const u32 j = threadIdx.x + c * blockDim.x;
        Raw8<float> raw;
        if (j < chunks) load_raw(w + 8 * (u64)j, raw); else zero_raw(raw);
        unpack8(raw, wv[c]);
    }
    pdl_enter();
    float sum_sq = 0.f;
#pragma unroll
    for (int c = 0; c < NORM_VEC_CACHED; c++) {
        const u32 j = threadIdx.x + c * blockDim.x;
        if (j < chunks) {
            first(base + 8 * (u64)j, v[c]);
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) v[c][k] = 0.f;
        }
#pragma unroll
        for (int k = 0; k < 8; k++) sum_sq += v[c][k] * v[c][k];
    }
    for (u32 j = threadIdx.x + NORM_VEC_CACHED * blockDim.x; j < chunks; j += blockDim.x) {
        float u[8];
        first(base + 8 * (u64)j, u);
#pragma unroll
        for (int k = 0; k < 8; k++) sum_sq += u[k] * u[k];
    }
    sum_sq = block_sum(sum_sq, scratch);
    const float inv_rms = 1.f / sqrtf(sum_sq / (float)hidden + eps);
#pragma unroll
    for (int c = 0; c < NORM_VEC_CACHED; c++) {
        const u32 j = threadIdx.x + c * blockDim.x;
        if (j < chunks) {
            float y[8];
#pragma unroll
            for (int k = 0; k < 8; k++) y[k] = v[c][k] * inv_rms * wv[c][k];
            store8(out + base + 8 * (u64)j, y);
        }
    }
    for (u32 j = threadIdx.x + NORM_VEC_CACHED * blockDim.x; j < chunks; j += blockDim.x) {
        float u[8], wu[8], y[8];
        again(base + 8 * (u64)j, u);
        Raw8<float> raw;
        load_raw(w + 8 * (u64)j, raw);
        unpack8(raw, wu);
#pragma unroll
        for (int k = 0; k < 8; k++) y[k] = u[k] * inv_rms * wu[k];
        store8(out + base + 8 * (u64)j, y);
    }
    quantize_normed_row(out + base, hidden, codes, scratch);
}

// x, out: [rows, hidden]. `out` may be `x` (in place): each thread reads an element before
// it writes the same element.
template <typename X, typename T>
__device__ __forceinline__ void rms_norm_impl(const X* x, const float* w, T* out, u32 hidden, float eps,
                                              RowCodes codes) {
    auto read = [&](u64 i) { return to_float(x[i]); };
    rms_norm_row<T>(read, read, w, out, hidden, eps, codes);
}

// The same by 8-element chunks (hidden a multiple of 8, rows 16-byte aligned).
template <typename X, typename T>
__device__ __forceinline__ void rms_norm_vec8_impl(const X* x, const float* w, T* out, u32 hidden, float eps,
                                                   RowCodes codes) {
    auto read = [&](u64 i, float (&v)[8]) {
        Raw8<X> raw;
        load_raw(x + i, raw);
        unpack8(raw, v);
    };
    rms_norm_row8<T>(read, read, w, out, hidden, eps, codes);
}

#define RMS_NORM(T, S) \
    extern "C" __global__ void rms_norm_##S(const T* x, const float* w, T* out, u32 hidden, float eps, \
                                            RowCodes codes) { \
        rms_norm_impl<T, T>(x, w, out, hidden, eps, codes); \
    } \
    extern "C" __global__ void rms_norm_from_f32_##S(const float* x, const float* w, T* out, u32 hidden, \
                                                     float eps, RowCodes codes) { \
        rms_norm_impl<float, T>(x, w, out, hidden, eps, codes); \
    } \
    extern "C" __global__ void __launch_bounds__(1024) \
        rms_norm_vec8_##S(const T* x, const float* w, T* out, u32 hidden, float eps, RowCodes codes) { \
        rms_norm_vec8_impl<T, T>(x, w, out, hidden, eps, codes); \
    } \
    extern "C" __global__ void __launch_bounds__(1024) \
        rms_norm_from_f32_vec8_##S(const float* x, const float* w, T* out, u32 hidden, float eps, RowCodes codes) { \
        rms_norm_vec8_impl<float, T>(x, w, out, hidden, eps, codes); \
    }
FOR_EACH_DTYPE(RMS_NORM)

// residual, x, out: [rows, hidden]. `residual += x` (rounded to R, as an R tensor would hold
// it: R is T, or f32 for an f32 residual stream), then `out = rms_norm(residual)`.
template <typename R, typename T>
__device__ __forceinline__ void add_rms_norm_impl(R* residual, const T* x, const float* w, T* out, u32 hidden,
                                                  float eps, RowCodes codes) {
    auto add = [&](u64 i) {
        const R sum = from_float<R>(to_float(residual[i]) + to_float(x[i]));
        residual[i] = sum;
        return to_float(sum);
    };
    auto read = [&](u64 i) { return to_float(residual[i]); };
    rms_norm_row<T>(add, read, w, out, hidden, eps, codes);
}

// The same by 8-element chunks (hidden a multiple of 8, rows 16-byte aligned).
template <typename R, typename T>
__device__ __forceinline__ void add_rms_norm_vec8_impl(R* residual, const T* x, const float* w, T* out, u32 hidden,
                                                       float eps, RowCodes codes) {
    auto add = [&](u64 i, float (&v)[8]) {
        Raw8<R> r_raw;
        Raw8<T> x_raw;
        load_raw(residual + i, r_raw);
        load_raw(x + i, x_raw);
        float r[8], xs[8];
        unpack8(r_raw, r);
        unpack8(x_raw, xs);
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = to_float(from_float<R>(r[k] + xs[k]));
        store8(residual + i, v);  // exact: every v[k] is already an R
    };
    auto read = [&](u64 i, float (&v)[8]) {
        Raw8<R> raw;
        load_raw(residual + i, raw);
        unpack8(raw, v);
    };
    rms_norm_row8<T>(add, read, w, out, hidden, eps, codes);
}

#define ADD_RMS_NORM(T, S) \
    extern "C" __global__ void add_rms_norm_##S(T* residual, const T* x, const float* w, T* out, u32 hidden, \
                                                float eps, RowCodes codes) { \
        add_rms_norm_impl<T, T>(residual, x, w, out, hidden, eps, codes); \
    } \
    extern "C" __global__ void add_rms_norm_f32_residual_##S(float* residual, const T* x, const float* w, T* out, \
                                                             u32 hidden, float eps, RowCodes codes) { \
        add_rms_norm_impl<float, T>(residual, x, w, out, hidden, eps, codes); \
    } \
    extern "C" __global__ void __launch_bounds__(1024) \
        add_rms_norm_vec8_##S(T* residual, const T* x, const float* w, T* out, u32 hidden, float eps, \
                              RowCodes codes) { \
        add_rms_norm_vec8_impl<T, T>(residual, x, w, out, hidden, eps, codes); \
    } \
    extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_f32_residual_vec8_##S( \
        float* residual, const T* x, const float* w, T* out, u32 hidden, float eps, RowCodes codes) { \
        add_rms_norm_vec8_impl<float, T>(residual, x, w, out, hidden, eps, codes); \
    }
FOR_EACH_DTYPE(ADD_RMS_NORM)

// residual, x, out: [rows, hidden]; x_w, w: f32 [hidden]. `residual += rms_norm(x, x_w)` (the
// normed x rounded to T, as `rms_norm` would store it, the sum rounded to R), then `out =
// rms_norm(residual, w)`: Gemma 2/3's norm of a sub-layer's output fused into the residual add
// and norm after it. By 8-element chunks (hidden a multiple of 8, rows 16-byte aligned): a
// first pass sums x's squares, then `add_rms_norm_vec8`'s pass with x normed on the way in.
template <typename R, typename T>
__device__ __forceinline__ void add_normed_rms_norm_vec8_impl(R* residual, const T* x, const float* x_w,
                                                              const float* w, T* out, u32 hidden, float eps,
                                                              RowCodes codes) {
    __shared__ float x_scratch[32];
    const u64 base = (u64)blockIdx.x * hidden;
    const u32 chunks = hidden / 8;
    pdl_enter();
    float sum_sq = 0.f;
    for (u32 j = threadIdx.x; j < chunks; j += blockDim.x) {
        Raw8<T> raw;
        load_raw(x + base + 8 * (u64)j, raw);
        float v[8];
        unpack8(raw, v);
#pragma unroll
        for (int k = 0; k < 8; k++) sum_sq += v[k] * v[k];
    }
    sum_sq = block_sum(sum_sq, x_scratch);
    const float x_inv_rms = 1.f / sqrtf(sum_sq / (float)hidden + eps);
    auto add = [&](u64 i, float (&v)[8]) {
        Raw8<R> r_raw;
        Raw8<T> x_raw;
        Raw8<float> w_raw;
        load_raw(residual + i, r_raw);
        load_raw(x + i, x_raw);
        load_raw(x_w + (i - base), w_raw);
        float r[8], xs[8], xw[8];
        unpack8(r_raw, r);
        unpack8(x_raw, xs);
        unpack8(w_raw, xw);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float normed = to_float(from_float<T>(xs[k] * x_inv_rms * xw[k]));
            v[k] = to_float(from_float<R>(r[k] + normed));
        }
        store8(residual + i, v);  // exact: every v[k] is already an R
    };
    auto read = [&](u64 i, float (&v)[8]) {
        Raw8<R> raw;
        load_raw(residual + i, raw);
        unpack8(raw, v);
    };
    rms_norm_row8<T>(add, read, w, out, hidden, eps, codes);
}

#define ADD_NORMED_RMS_NORM(T, S) \
    extern "C" __global__ void __launch_bounds__(1024) add_normed_rms_norm_vec8_##S( \
        T* residual, const T* x, const float* x_w, const float* w, T* out, u32 hidden, float eps, RowCodes codes) { \
        add_normed_rms_norm_vec8_impl<T, T>(residual, x, x_w, w, out, hidden, eps, codes); \
    } \
    extern "C" __global__ void __launch_bounds__(1024) add_normed_rms_norm_f32_residual_vec8_##S( \
        float* residual, const T* x, const float* x_w, const float* w, T* out, u32 hidden, float eps, \
        RowCodes codes) { \
        add_normed_rms_norm_vec8_impl<float, T>(residual, x, x_w, w, out, hidden, eps, codes); \
    }
FOR_EACH_DTYPE(ADD_NORMED_RMS_NORM)
