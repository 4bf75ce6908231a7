// Shared by every kernel of ferrolm's CUDA backend: dtype conversion, reductions and the
// macro that instantiates each op for f32, bf16 and f16 activations.
//
// Conventions: all tensors are row-major; arithmetic runs in f32 whatever the storage dtype,
// and a result is rounded to the storage dtype once, when it is stored. Block sizes are
// multiples of 32 so that full-warp shuffles are valid.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Soft-capping (Gemma 2): `cap * tanh(x / cap)`, in the order HF computes it (divide, tanh,
// multiply); a cap of 0 leaves `x` as it is. Attention kernels that keep scores in base 2 (scaled
// by log2(e)) cap them with the cap scaled the same way: c' tanh(s' / c') with s' = log2(e) s and
// c' = log2(e) c is log2(e) c tanh(s / c).
__device__ __forceinline__ float soft_cap(float x, float cap) { return cap > 0.f ? tanhf(x / cap) * cap : x; }

// `warp_op` (a warp-wide sum or maximum) of `v` over the whole block, returned to every thread;
// lanes past the block's warps count as 0. `scratch`: 32 floats of shared memory.
template <typename WarpOp>
__device__ __forceinline__ float block_allreduce(float v, float* scratch, WarpOp warp_op) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    v = warp_op(v);
    __syncthreads();  // `scratch` may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : 0.f;
    return warp_op(v);
}

// Sum of `v` over the whole block, returned to every thread. `scratch`: 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    return block_allreduce(v, scratch, [](float x) { return warp_sum(x); });
}

// Maximum of `v` over the whole block, returned to every thread, for values >= 0 (an amax).
__device__ __forceinline__ float block_max(float v, float* scratch) {
    return block_allreduce(v, scratch, [](float x) { return warp_max(x); });
}

// Programmatic dependent launch (sm_90 and later; no-ops before). The host launches every
// kernel with programmatic stream serialization, so a kernel's blocks may start while the
// kernel before it on the stream is still running. Every kernel therefore calls `pdl_wait`
// before it reads anything an earlier kernel wrote or writes anything an earlier kernel reads,
// and before it may return: the wait returns once the previous kernel has completed and its
// writes are visible, and since that kernel waited on its own predecessor in the same way,
// every earlier kernel has completed too. Only data no kernel writes (weights, the step's index
// buffers copied in before the step) may be read before it. `pdl_launch_dependents` then lets
// the next kernel's blocks launch (once every block of this one has called it or exited), so
// that its launch and prologue overlap this kernel's work.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Both, at the start of a kernel that has nothing to do before the wait.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch_dependents();
}

// Fetches the 128-byte line holding `p` into the L2 (no register, no L1); always coherent, so it
// may run before `pdl_wait` even on data an earlier kernel is still writing.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

// Asynchronous copies from global to shared memory (sm_80 and later).
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes from global to shared memory, or 16 zero bytes when `valid` is false (nothing read).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Bulk copies (sm_90): contiguous bytes, or a box of a tensor described by a tensor map, from
// global to shared memory in one instruction, completing on a shared-memory mbarrier that counts
// the bytes it expects. Declared for every architecture so that templates may name them in
// branches they discard; before sm_90 they trap.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
#else
    __trap();
#endif
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n.reg .pred P1;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra DONE;\nbra WAIT;\nDONE:\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
#else
    __trap();
#endif
}
// Orders this thread's earlier shared-memory accesses before its later bulk copies into the
// same bytes (the copies write through the async proxy).
__device__ __forceinline__ void fence_proxy_async() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
    __trap();
#endif
}

// A tensor map (the driver's CUtensorMap, encoded on the host by cuTensorMapEncodeTiled),
// passed to a kernel as a `const __grid_constant__` parameter.
struct __align__(128) TensorMap {
    u64 opaque[16];
};

// Copies the box at element coordinates (c0, c1, c2) of `map`'s tensor to shared memory at
// `dst`, completing on `bar`; elements past the tensor's bounds arrive as zeros, and the barrier
// counts the whole box's bytes either way.
__device__ __forceinline__ void tensor_copy_3d(u32 dst, const TensorMap* map, int c0, int c1, int c2, u32 bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
#else
    __trap();
#endif
}

// Fetches a tensor map into the cache the copies read it from.
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
#if __CUDA_ARCH__ >= 900
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
#else
    __trap();
#endif
}

// 8 consecutive elements as loaded with 16-byte accesses (two for f32), converted to f32 when used.
template <typename T> struct Raw8 { uint4 u; };
template <> struct Raw8<float> { float4 a, b; };

__device__ __forceinline__ void load_raw(const float* p, Raw8<float>& r) {
    r.a = *reinterpret_cast<const float4*>(p);
    r.b = *reinterpret_cast<const float4*>(p + 4);
}
template <typename T> __device__ __forceinline__ void load_raw(const T* p, Raw8<T>& r) {
    r.u = *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ void zero_raw(Raw8<float>& r) { r.a = r.b = make_float4(0.f, 0.f, 0.f, 0.f); }
template <typename T> __device__ __forceinline__ void zero_raw(Raw8<T>& r) { r.u = make_uint4(0, 0, 0, 0); }

__device__ __forceinline__ void unpack8(const Raw8<float>& r, float (&x)[8]) {
    x[0] = r.a.x; x[1] = r.a.y; x[2] = r.a.z; x[3] = r.a.w;
    x[4] = r.b.x; x[5] = r.b.y; x[6] = r.b.z; x[7] = r.b.w;
}
// The two-element vector of a half type, and its conversion to f32.
template <typename T> struct Pair2;
template <> struct Pair2<__nv_bfloat16> { typedef __nv_bfloat162 type; };
template <> struct Pair2<__half> { typedef __half2 type; };
__device__ __forceinline__ float2 pair_to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 pair_to_float2(__half2 v) { return __half22float2(v); }

template <typename T> __device__ __forceinline__ void unpack8(const Raw8<T>& r, float (&x)[8]) {
    const u32 w[4] = {r.u.x, r.u.y, r.u.z, r.u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = pair_to_float2(*reinterpret_cast<const typename Pair2<T>::type*>(&w[i]));
        x[2 * i] = f.x;
        x[2 * i + 1] = f.y;
    }
}

// Stores 8 consecutive elements, each rounded to T once; `p` 16-byte aligned.
__device__ __forceinline__ void store8(float* p, const float (&x)[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
}
template <typename T> __device__ __forceinline__ void store8(T* p, const float (&x)[8]) {
    __align__(16) T v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = from_float<T>(x[i]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v);
}

// Applies `M(type, suffix)` to each activation dtype; each op defines `M` to declare its
// `extern "C"` kernel `name_suffix` for that dtype.
#define FOR_EACH_DTYPE(M) M(float, f32) M(__nv_bfloat16, bf16) M(__half, f16)
// The same for the tensor-core kernels, which exist for the half types only. The host compiles
// each kernel file once per dtype and redefines both after this header (compile.rs), so that a
// module holds one dtype's entry points and a file whose device functions another uses adds none.
#define FOR_EACH_HALF_DTYPE(M) M(__nv_bfloat16, bf16) M(__half, f16)

// d += a b for one 16x8x16 tile. Fragments (g = lane / 4, c = 2 * (lane % 4)): a0 (g, c..c+1),
// a1 (g + 8, c..), a2 (g, c + 8..), a3 (g + 8, c + 8..) of A [16, 16]; b0 (k c..c+1, n g),
// b1 (k c + 8.., n g) of B [16, 8]; d0, d1 (g, c..c+1), d2, d3 (g + 8, c..c+1) of D [16, 8].
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1, __nv_bfloat16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1, __half) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// FP8 (e4m3: 1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities, 0x7f and 0xff
// NaN) codes as halves, exactly (every e4m3 value is a half), the bits of a __half2 (the first
// code's in the low half). On sm_89 and later one instruction converts the two. Before, the bits
// are moved into a half's: the sign to bit 15, exponent and mantissa to bits 7..13, which reads
// as the code's value times 2^-8 (normal and subnormal alike, the exponent biases differing by
// 8), and the product by 256 is exact. Both read a NaN code as a number (480, or a half NaN):
// codes come from quantizers that saturate, and a scale multiplies every code.
__device__ __forceinline__ u32 e4m3x2_to_half2(u32 two /* low 16 bits: the first code in the low byte */) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u32 h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)two));
    return h;
#else
    const u32 t = __byte_perm(two, 0, 0x1404);  // the two codes in bytes 1 and 3, zeros below
    const u32 h = (t & 0x80008000u) | ((t & 0x7f007f00u) >> 1);
    const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&h), __float2half2_rn(256.f));
    return *reinterpret_cast<const u32*>(&v);
#endif
}

// The same two codes as f32, exactly.
__device__ __forceinline__ float2 e4m3x2_to_float2(u32 two) {
    const u32 h = e4m3x2_to_half2(two);
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// N codes (N / 4 words, the first code in the lowest byte of the first word) as f32.
template <int N> __device__ __forceinline__ void e4m3_words_to_float(const u32 (&words)[N / 4], float (&x)[N]) {
#pragma unroll
    for (int i = 0; i < N / 4; i++) {
        const float2 lo = e4m3x2_to_float2(words[i]), hi = e4m3x2_to_float2(words[i] >> 16);
        x[4 * i] = lo.x;
        x[4 * i + 1] = lo.y;
        x[4 * i + 2] = hi.x;
        x[4 * i + 3] = hi.y;
    }
}

// 16 codes (16 bytes) as f32.
__device__ __forceinline__ void e4m3x16_to_float(const uint4& raw, float (&x)[16]) {
    const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
    e4m3_words_to_float<16>(words, x);
}

// 8 codes (8 bytes) as f32.
__device__ __forceinline__ void e4m3x8_to_float(const uint2& raw, float (&x)[8]) {
    const u32 words[2] = {raw.x, raw.y};
    e4m3_words_to_float<8>(words, x);
}

// An FP8 matrix's scales (crate::fp8's block grid, as the host places it): element (r, c) of
// the `[rows, cols]` codes stands for e4m3(code) * scales[(r / block_rows) * grid_cols +
// (c >> col_shift)], blocks being 2^col_shift columns wide (col_shift 31: the whole row).
struct Fp8Grid {
    const float* scales;
    u32 block_rows;
    u32 col_shift;
    u32 grid_cols;
    // Row r's scales.
    // (rows fit in u32: the host places no larger matrix.)
    __device__ __forceinline__ const float* row(u64 r) const {
        return scales + (u64)((u32)r / block_rows) * grid_cols;
    }
};

// `x` rounded to the nearest e4m3 value (ties to even), saturating at +-448 (NaN stays NaN), as
// crate::fp8::f32_to_e4m3 rounds: one instruction from sm_89 on (the second source goes to the
// low byte), the same rounding on the bits before.
__device__ __forceinline__ unsigned char f32_to_e4m3(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(x));
    return (unsigned char)(pair & 0xff);
#else
    const u32 bits = __float_as_uint(x);
    const u32 sign = (bits >> 24) & 0x80;
    const float a = fabsf(x);
    if (a != a) return (unsigned char)(sign | 0x7f);
    if (a < 0.015625f) {  // below the smallest normal, 2^-6: subnormal steps of 2^-9 (8 of them is 2^-6)
        return (unsigned char)(sign | (u32)__float2int_rn(a * 512.f));
    }
    int e = (int)((bits >> 23) & 0xff) - 127;
    const u32 mant = bits & 0x7fffffu;
    u32 keep = mant >> 20;
    const u32 rem = mant & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (keep & 1))) keep++;
    if (keep == 8) {
        keep = 0;
        e++;
    }
    const int biased = e + 7;
    if (biased > 15 || (biased == 15 && keep > 6)) return (unsigned char)(sign | 0x7e);
    return (unsigned char)(sign | ((u32)biased << 3) | keep);
#endif
}

// Where an activation buffer keeps each row's FP8 codes beside its values (crate::cuda::fp8's
// RowCodes): `codes` [rows, cols] and `scales` f32 [rows]. A null `codes` keeps none.
struct RowCodes {
    unsigned char* codes;
    float* scales;
};

// Two values as e4m3 codes, `lo`'s in the low byte: each rounded as f32_to_e4m3 rounds it (one
// instruction from sm_89 on).
__device__ __forceinline__ u32 f32x2_to_e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    return pair;
#else
    return (u32)f32_to_e4m3(lo) | ((u32)f32_to_e4m3(hi) << 8);
#endif
}

// f(c, v) for each of this thread's runs of 8 values v of `row`, at columns c..c + 7, threads
// taking runs in turn (cols % 8 == 0, `row` 16-byte aligned).
template <typename T, typename F> __device__ __forceinline__ void each_run_of_8(const T* row, u32 cols, F f) {
    for (u32 c = threadIdx.x * 8; c < cols; c += blockDim.x * 8) {
        Raw8<T> raw;
        load_raw(row + c, raw);
        float v[8];
        unpack8(raw, v);
        f(c, v);
    }
}

// Row `r` of `cols` T values (`row`) quantized with its own dynamic scale, as vLLM's FP8 GEMMs
// quantize activations per token: scale = max(amax / 448, 1 / (448 * 512)) and codes = e4m3(x /
// scale), the division in f32 (crate::fp8's quantize_rows, by row). Called by every thread of
// a block (a multiple of 32 threads) once the row is visible to all of them (a __syncthreads
// after a kernel's own writes); `scratch`: 32 floats of shared memory. Threads take 8 values at
// a time (16-byte loads, 8 codes stored at once) where the row and its codes allow it, else
// one: the same codes either way.
template <typename T>
__device__ __forceinline__ void quantize_row(const T* row, u32 cols, RowCodes out, u64 r, float* scratch) {
    unsigned char* codes = out.codes + r * cols;
    const bool by8 = (cols & 7) == 0 && ((u64)row & 15) == 0 && ((u64)codes & 7) == 0;
    float amax = 0.f;
    if (by8) {
        each_run_of_8(row, cols, [&](u32, const float (&v)[8]) {
#pragma unroll
            for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(v[i]));
        });
    } else {
        for (u32 c = threadIdx.x; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(to_float(row[c])));
    }
    amax = block_max(amax, scratch);
    const float scale = fmaxf(amax / 448.f, 1.f / (448.f * 512.f));
    if (threadIdx.x == 0) out.scales[r] = scale;
    if (by8) {
        each_run_of_8(row, cols, [&](u32 c, const float (&v)[8]) {
            u32 words[2];
#pragma unroll
            for (int w = 0; w < 2; w++) {
                const u32 lo = f32x2_to_e4m3x2(v[4 * w] / scale, v[4 * w + 1] / scale);
                const u32 hi = f32x2_to_e4m3x2(v[4 * w + 2] / scale, v[4 * w + 3] / scale);
                words[w] = lo | (hi << 16);
            }
            *reinterpret_cast<uint2*>(codes + c) = make_uint2(words[0], words[1]);
        });
    } else {
        for (u32 c = threadIdx.x; c < cols; c += blockDim.x) codes[c] = f32_to_e4m3(to_float(row[c]) / scale);
    }
}
