// FP8 (e4m3) operands of the GEMMs: an FP8 weight matrix dequantized for a dense GEMM, and a
// batch's activations quantized per row for an FP8 GEMM (see crate::cuda::fp8).
// An FP8 matrix's values in T: out[r, c] = e4m3(codes[r, c]) * scale(r, c), the product in f32
// rounded once, as crate::fp8 dequantizes (the operand of a cuBLAS GEMM where the GEMV does not
// take the product). Each thread converts one 16-code chunk (cols % 16 == 0). Grid: ceil(chunks /
// 256) blocks of 256 threads.
#define FP8_DEQUANTIZE(T, S) \
    extern "C" __global__ void __launch_bounds__(256) fp8_dequantize_##S(const unsigned char* codes, Fp8Grid grid, \
                                                                         u32 cols, u64 chunks, T* out) { \
        pdl_enter(); \
        const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; \
        if (i >= chunks) return; \
        const u64 e = i * 16, r = e / cols; \
        const u32 c = (u32)(e - r * cols); \
        float v[16]; \
        e4m3x16_to_float(*reinterpret_cast<const uint4*>(codes + e), v); \
        const float scale = grid.row(r)[c >> grid.col_shift]; \
        _Pragma("unroll") for (int j = 0; j < 16; j++) out[e + j] = from_float<T>(v[j] * scale); \
    }

// Dynamic per-row (per-token) quantization of activations, as vLLM's FP8 GEMMs quantize them:
// scales[r] = max(amax_r / 448, 1 / (448 * 512)) and codes[r, c] = e4m3(x[r, c] / scales[r]),
// the division in f32 (crate::fp8's quantize_rows, by row). One block of 256 threads per row.
#define FP8_QUANTIZE_ROWS(T, S) \
    extern "C" __global__ void __launch_bounds__(256) fp8_quantize_rows_##S(const T* x, u32 k, unsigned char* codes, \
                                                                            float* scales) { \
        __shared__ float red_s[32]; \
        pdl_enter(); \
        const u64 r = blockIdx.x; \
        const T* row = x + r * k; \
        float amax = 0.f; \
        for (u32 c = threadIdx.x; c < k; c += blockDim.x) amax = fmaxf(amax, fabsf(to_float(row[c]))); \
        amax = warp_max(amax); \
        if ((threadIdx.x & 31) == 0) red_s[threadIdx.x >> 5] = amax; \
        __syncthreads(); \
        for (u32 w = 0; w < (blockDim.x >> 5); w++) amax = fmaxf(amax, red_s[w]); \
        const float scale = fmaxf(amax / 448.f, 1.f / (448.f * 512.f)); \
        if (threadIdx.x == 0) scales[r] = scale; \
        for (u32 c = threadIdx.x; c < k; c += blockDim.x) codes[r * k + c] = f32_to_e4m3(to_float(row[c]) / scale); \
    }

FOR_EACH_DTYPE(FP8_DEQUANTIZE)
FOR_EACH_DTYPE(FP8_QUANTIZE_ROWS)
