// Rotary embedding in the GPT-NeoX / HF `rotate_half` layout, in place: dimension `i < half`
// of a head pairs with `i + half`; dims from `2 * half` on pass through (partial rotary).
// Angles are `position * inv_freq[i]` in f32, as on the CPU.

// x: [T, num_heads, head_dim]; positions: [T]; inv_freq: [2, half], the short table then the
// long one (LongRoPE; both rows equal otherwise). A token at `position >= long_start` uses the
// long table. One block per token.
template <typename T>
__device__ __forceinline__ void rope_impl(T* x, const u32* positions, const float* inv_freq, u32 long_start,
                                          u32 num_heads, u32 head_dim, u32 half, float attention_scaling) {
    const u64 t = blockIdx.x;
    const u32 pos = positions[t];
    const float* freq = inv_freq + (pos >= long_start ? half : 0);
    T* token = x + t * num_heads * head_dim;
    for (u32 e = threadIdx.x; e < num_heads * half; e += blockDim.x) {
        const u32 h = e / half, i = e % half;
        float s, c;
        sincosf((float)pos * freq[i], &s, &c);
        c *= attention_scaling;
        s *= attention_scaling;
        T* head = token + (u64)h * head_dim;
        const float x0 = to_float(head[i]), x1 = to_float(head[i + half]);
        head[i] = from_float<T>(x0 * c - x1 * s);
        head[i + half] = from_float<T>(x1 * c + x0 * s);
    }
}

#define ROPE(T, S) \
    extern "C" __global__ void rope_##S(T* x, const u32* positions, const float* inv_freq, u32 long_start, \
                                        u32 num_heads, u32 head_dim, u32 half, float attention_scaling) { \
        rope_impl<T>(x, positions, inv_freq, long_start, num_heads, head_dim, half, attention_scaling); \
    }
FOR_EACH_DTYPE(ROPE)
