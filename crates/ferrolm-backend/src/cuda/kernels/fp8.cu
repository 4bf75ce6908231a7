// FP8 (e4m3) operands of the GEMMs: an FP8 weight matrix dequantized for a dense GEMM, and a
// batch's activations quantized per row, or per row and 128 columns, for an FP8 GEMM (see
// crate::cuda::fp8).
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

// Dynamic per-row (per-token) quantization of activations (`quantize_row`), where the kernel
// that wrote them kept no codes (see crate::cuda::fp8). One block of 256 threads per row.
#define FP8_QUANTIZE_ROWS(T, S) \
    extern "C" __global__ void __launch_bounds__(256) fp8_quantize_rows_##S(const T* x, u32 k, unsigned char* codes, \
                                                                            float* scales) { \
        __shared__ float scratch[32]; \
        pdl_enter(); \
        const u64 r = blockIdx.x; \
        quantize_row(x + r * k, k, RowCodes{codes, scales}, r, scratch); \
    }

// Dynamic quantization of activations per token and 128 columns, for the FP8 GEMM over
// 128 x 128 weight blocks (cuBLASLt's VEC128_32F): group g of row r takes the scale
// max(amax / 448, 1 / (448 * 512)) and the codes e4m3(x / scale), the division in f32, as
// quantize_row does a row (crate::fp8's quantize_blocks in blocks of 1 x 128). codes: [rows, k];
// scales: [k / 128, rows], the rows fastest. Rows m .. rows pad the GEMM to a multiple of 4
// tokens: codes and scales zero. One warp per (row, group), 4 values a lane; k % 128 == 0.
// Grid: ceil(rows * k / 128 / 8) blocks of 256 threads.
template <typename T>
__device__ __forceinline__ void quantize_group(const T* x, u32 m, u32 rows, u32 k, unsigned char* codes,
                                               float* scales) {
    const u32 groups = k / 128, lane = threadIdx.x & 31;
    const u64 item = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (item >= (u64)rows * groups) return;
    const u32 r = (u32)(item / groups), g = (u32)(item % groups);
    const u64 at = (u64)r * k + g * 128 + lane * 4;
    float v[4] = {0.f, 0.f, 0.f, 0.f}, amax = 0.f;
    if (r < m) {
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = to_float(x[at + i]);
#pragma unroll
        for (int i = 0; i < 4; i++) amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = r < m ? fmaxf(amax / 448.f, 1.f / (448.f * 512.f)) : 0.f;
    u32 word = 0;
    if (r < m) word = f32x2_to_e4m3x2(v[0] / scale, v[1] / scale) | (f32x2_to_e4m3x2(v[2] / scale, v[3] / scale) << 16);
    *reinterpret_cast<u32*>(codes + at) = word;
    if (lane == 0) scales[(u64)g * rows + r] = scale;
}

#define FP8_QUANTIZE_GROUPS(T, S) \
    extern "C" __global__ void __launch_bounds__(256) fp8_quantize_groups_##S(const T* x, u32 m, u32 rows, u32 k, \
                                                                              unsigned char* codes, float* scales) { \
        pdl_enter(); \
        quantize_group(x, m, rows, k, codes, scales); \
    }

FOR_EACH_DTYPE(FP8_DEQUANTIZE)
FOR_EACH_DTYPE(FP8_QUANTIZE_ROWS)
FOR_EACH_DTYPE(FP8_QUANTIZE_GROUPS)
