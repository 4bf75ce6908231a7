// Row-wise copies and element-wise ops: embedding lookup, the q/k/v split, gated activations,
// bias add, row gather and soft-capping. One block per row (gated activations: a few) and threads striding
// over the row's columns.

// ids: [T]; table: [vocab, hidden]; out: [T, hidden] (in T, or f32 for an f32 residual
// stream). An id past the table gives a zero row (callers check ids against the vocabulary;
// this only keeps the read in bounds).
template <typename T, typename O>
__device__ __forceinline__ void embedding_impl(const u32* ids, const T* table, O* out, u32 hidden, u32 vocab,
                                               float scale) {
    const u32 id = ids[blockIdx.x];
    O* row_out = out + (u64)blockIdx.x * hidden;
    const T* row = table + (u64)id * hidden;
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) {
        if (id >= vocab) {
            row_out[i] = from_float<O>(0.f);
        } else {
            row_out[i] = from_float<O>(to_float(row[i]) * scale);
        }
    }
}

#define EMBEDDING(T, S) \
    extern "C" __global__ void embedding_##S(const u32* ids, const T* table, T* out, u32 hidden, u32 vocab, \
                                             float scale) { \
        pdl_enter(); \
        embedding_impl<T, T>(ids, table, out, hidden, vocab, scale); \
    } \
    extern "C" __global__ void embedding_to_f32_##S(const u32* ids, const T* table, float* out, u32 hidden, \
                                                    u32 vocab, float scale) { \
        pdl_enter(); \
        embedding_impl<T, float>(ids, table, out, hidden, vocab, scale); \
    }
FOR_EACH_DTYPE(EMBEDDING)

// qkv: [T, q_size + 2 * kv_size] -> q: [T, q_size], k: [T, kv_size], v: [T, kv_size].
template <typename T>
__device__ __forceinline__ void split_qkv_impl(const T* qkv, T* q, T* k, T* v, u32 q_size, u32 kv_size) {
    const u64 t = blockIdx.x;
    const u32 width = q_size + 2 * kv_size;
    const T* row = qkv + t * width;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) {
        const T val = row[i];
        if (i < q_size) {
            q[t * q_size + i] = val;
        } else if (i < q_size + kv_size) {
            k[t * kv_size + (i - q_size)] = val;
        } else {
            v[t * kv_size + (i - q_size - kv_size)] = val;
        }
    }
}

#define SPLIT_QKV(T, S) \
    extern "C" __global__ void split_qkv_##S(const T* qkv, T* q, T* k, T* v, u32 q_size, u32 kv_size) { \
        pdl_enter(); \
        split_qkv_impl<T>(qkv, q, k, v, q_size, kv_size); \
    }
FOR_EACH_DTYPE(SPLIT_QKV)

// `x * sigmoid(x)`; for very negative x, expf(-x) is +inf and the result -0, as on the CPU.
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// PyTorch's gelu(approximate="tanh").
__device__ __forceinline__ float gelu_tanh(float x) {
    const float sqrt_2_over_pi = 0.7978846f;
    return 0.5f * x * (1.f + tanhf(sqrt_2_over_pi * (x + 0.044715f * x * x * x)));
}

// gate_up: [rows, 2 * inter] (gate columns, then up columns); out: [rows, inter]. Grid:
// (rows, column chunks): a row is spread over blocks, so that one row (a decode step at batch 1)
// still runs on many SMs. Threads take 8 columns at a time with 16-byte accesses where the rows
// allow them (inter a multiple of 8, aligned buffers), else one: the same values either way.
template <typename T, typename Act>
__device__ __forceinline__ void act_and_mul_impl(const T* gate_up, T* out, u32 inter, Act act) {
    const u64 r = blockIdx.x;
    const T* gate = gate_up + r * 2 * inter;
    const T* up = gate + inter;
    T* o = out + r * inter;
    const u32 first = blockIdx.y * blockDim.x + threadIdx.x, stride = gridDim.y * blockDim.x;
    if ((inter & 7) == 0 && (((u64)gate_up | (u64)out) & 15) == 0) {
        for (u32 j = first * 8; j < inter; j += stride * 8) {
            Raw8<T> g_raw, u_raw;
            load_raw(gate + j, g_raw);
            load_raw(up + j, u_raw);
            float g[8], u[8], y[8];
            unpack8(g_raw, g);
            unpack8(u_raw, u);
#pragma unroll
            for (int i = 0; i < 8; i++) y[i] = act(g[i]) * u[i];
            store8(o + j, y);
        }
    } else {
        for (u32 j = first; j < inter; j += stride) o[j] = from_float<T>(act(to_float(gate[j])) * to_float(up[j]));
    }
}

// Where `codes` is not null, the grid is (rows, 1): each block writes its whole row, then the
// row's FP8 codes and scale (`quantize_row`), for the FP8 projection that reads it.
#define ACT_AND_MUL(NAME, ACT, T, S) \
    extern "C" __global__ void NAME##_##S(const T* gate_up, T* out, u32 inter, RowCodes codes) { \
        __shared__ float scratch[32]; \
        pdl_enter(); \
        act_and_mul_impl<T>(gate_up, out, inter, [](float x) { return ACT(x); }); \
        if (codes.codes != nullptr) { \
            __syncthreads(); \
            quantize_row(out + (u64)blockIdx.x * inter, inter, codes, blockIdx.x, scratch); \
        } \
    }
#define SILU_AND_MUL(T, S) ACT_AND_MUL(silu_and_mul, silu, T, S)
#define GELU_TANH_AND_MUL(T, S) ACT_AND_MUL(gelu_tanh_and_mul, gelu_tanh, T, S)
FOR_EACH_DTYPE(SILU_AND_MUL)
FOR_EACH_DTYPE(GELU_TANH_AND_MUL)

// y: [rows, n] = acc: [rows, n] + bias: [n], where `acc` is the f32 GEMM result, so that the sum
// is rounded to T once. `acc` may be `y` when T is f32 (each thread reads, then writes, its element).
#define BIAS_ADD(T, S) \
    extern "C" __global__ void bias_add_##S(const float* acc, const float* bias, T* y, u32 n) { \
        pdl_enter(); \
        const u64 base = (u64)blockIdx.x * n; \
        for (u32 j = threadIdx.x; j < n; j += blockDim.x) y[base + j] = from_float<T>(acc[base + j] + bias[j]); \
    }
FOR_EACH_DTYPE(BIAS_ADD)

// src: [src_rows, width]; indices: [rows]; dst: [rows, width]. An index past `src` gives a zero row.
#define GATHER_ROWS(T, S) \
    extern "C" __global__ void gather_rows_##S(const T* src, const u32* indices, T* dst, u32 width, u32 src_rows) { \
        pdl_enter(); \
        const u32 r = indices[blockIdx.x]; \
        T* out = dst + (u64)blockIdx.x * width; \
        for (u32 j = threadIdx.x; j < width; j += blockDim.x) { \
            out[j] = r < src_rows ? src[(u64)r * width + j] : from_float<T>(0.f); \
        } \
    }
FOR_EACH_DTYPE(GATHER_ROWS)

// x[i] = cap * tanh(x[i] / cap) (`soft_cap`) over n f32 values (the logits, whatever the
// activation dtype: T is unused), a grid-stride loop.
#define SOFTCAP(T, S) \
    extern "C" __global__ void softcap_##S(float* x, u64 n, float cap) { \
        pdl_enter(); \
        for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) { \
            x[i] = soft_cap(x[i], cap); \
        } \
    }
FOR_EACH_DTYPE(SOFTCAP)

// The XOR of src's n16 16-byte words into sink[0..4], read with streaming loads (evict-first,
// no L1): a grid-stride loop of one 16-byte load per thread per step, each block's XOR folded
// into sink with one atomic per 4-byte lane of the word. What the device's memory read rate is
// measured with (read_rate.rs); T is unused.
#define STREAM_READ_XOR(T, S) \
    extern "C" __global__ void stream_read_xor_##S(const uint4* src, u64 n16, u32* sink) { \
        pdl_enter(); \
        uint4 acc = make_uint4(0, 0, 0, 0); \
        for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n16; i += (u64)gridDim.x * blockDim.x) { \
            const uint4 v = __ldcs(src + i); \
            acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w; \
        } \
        for (int o = 16; o > 0; o >>= 1) { \
            acc.x ^= __shfl_xor_sync(0xffffffffu, acc.x, o); \
            acc.y ^= __shfl_xor_sync(0xffffffffu, acc.y, o); \
            acc.z ^= __shfl_xor_sync(0xffffffffu, acc.z, o); \
            acc.w ^= __shfl_xor_sync(0xffffffffu, acc.w, o); \
        } \
        __shared__ uint4 warps_acc[32]; \
        if ((threadIdx.x & 31) == 0) warps_acc[threadIdx.x >> 5] = acc; \
        __syncthreads(); \
        if (threadIdx.x == 0) { \
            for (u32 w = 1; w < blockDim.x / 32; w++) { \
                acc.x ^= warps_acc[w].x; acc.y ^= warps_acc[w].y; acc.z ^= warps_acc[w].z; acc.w ^= warps_acc[w].w; \
            } \
            atomicXor(sink, acc.x); atomicXor(sink + 1, acc.y); atomicXor(sink + 2, acc.z); atomicXor(sink + 3, acc.w); \
        } \
    }
FOR_EACH_DTYPE(STREAM_READ_XOR)

// dst[i] = (i * 0x9e3779b9) | 1 for i < n: a buffer of distinct non-zero words written on the
// device (the read-rate buffer; a host fill of a GiB takes about a second). T is unused.
#define FILL_WORD_PATTERN(T, S) \
    extern "C" __global__ void fill_word_pattern_##S(u32* dst, u64 n) { \
        pdl_enter(); \
        for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) { \
            dst[i] = ((u32)i * 0x9e3779b9u) | 1u; \
        } \
    }
FOR_EACH_DTYPE(FILL_WORD_PATTERN)
