// Greedy token and its log-normaliser straight from the logits, so that greedy decoding needs
// no logits download. NaN and -inf logits are no candidates (as in the CPU sampler's argmax);
// ties go to the lower token id.

// `exp(a - m)` that is 1 when `a == m`, so that `m = +inf` gives no NaN.
__device__ __forceinline__ float exp_diff(float a, float m) { return a == m ? 1.f : expf(a - m); }

// Merges the partial state (m2, s2, id2) into (m, s, id): running max, sum of exp(x - max), argmax.
__device__ __forceinline__ void merge_state(float& m, float& s, u32& id, float m2, float s2, u32 id2) {
    const float mx = fmaxf(m, m2);
    if (mx == NEG_INF) {
        id = min(id, id2);
        return;
    }
    s = s * exp_diff(m, mx) + s2 * exp_diff(m2, mx);
    id = m > m2 ? id : (m2 > m ? id2 : min(id, id2));
    m = mx;
}

// logits: [rows, vocab]; ids: [rows]; stats: [rows, 2] = (max, ln(sum(exp(logit - max)))), kept
// apart so that the chosen token's logprob, `-ln_sum`, loses no bits to a large max.
// One block per row. A row with no candidate gets id 0xffffffff, max -inf and ln_sum 0.
template <typename T>
__device__ __forceinline__ void argmax_logsumexp_impl(const T* logits, u32 vocab, u32* ids, float* stats) {
    __shared__ float m_s[32], s_s[32];
    __shared__ u32 id_s[32];
    const T* row = logits + (u64)blockIdx.x * vocab;
    float m = NEG_INF, s = 0.f;
    u32 id = 0xffffffffu;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float x = to_float(row[i]);
        if (isnan(x) || x == NEG_INF) continue;
        if (x > m) {
            s = s * exp_diff(m, x) + 1.f;
            m = x;
            id = i;
        } else {
            s += exp_diff(x, m);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        const u32 id2 = __shfl_xor_sync(0xffffffffu, id, o);
        merge_state(m, s, id, m2, s2, id2);
    }
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    if (lane == 0) {
        m_s[warp] = m;
        s_s[warp] = s;
        id_s[warp] = id;
    }
    __syncthreads();
    if (warp != 0) return;
    m = lane < num_warps ? m_s[lane] : NEG_INF;
    s = lane < num_warps ? s_s[lane] : 0.f;
    id = lane < num_warps ? id_s[lane] : 0xffffffffu;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        const u32 id2 = __shfl_xor_sync(0xffffffffu, id, o);
        merge_state(m, s, id, m2, s2, id2);
    }
    if (lane == 0) {
        ids[blockIdx.x] = id;
        stats[2 * (u64)blockIdx.x] = m;
        stats[2 * (u64)blockIdx.x + 1] = m == NEG_INF ? 0.f : logf(s);
    }
}

#define ARGMAX_LOGSUMEXP(T, S) \
    extern "C" __global__ void argmax_logsumexp_##S(const T* logits, u32 vocab, u32* ids, float* stats) { \
        argmax_logsumexp_impl<T>(logits, vocab, ids, stats); \
    }
FOR_EACH_DTYPE(ARGMAX_LOGSUMEXP)
