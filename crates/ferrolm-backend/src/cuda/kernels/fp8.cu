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

FOR_EACH_DTYPE(FP8_DEQUANTIZE)
FOR_EACH_DTYPE(FP8_QUANTIZE_ROWS)
