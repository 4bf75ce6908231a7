// Rotary embedding in the GPT-NeoX / HF `rotate_half` layout, in place: dimension `i < half`
// of a head pairs with `i + half`; dims from `2 * half` on pass through (partial rotary).
// Angles are `position * inv_freq[i]` in f32, as on the CPU.

// One rotated pair: (x0, x1) at dims (i, i + half) of a head at position `pos`, with `freq` the
// pair's inverse frequency. Every kernel that rotates goes through this, so all give the same bits.
__device__ __forceinline__ void rope_pair(float x0, float x1, u32 pos, float freq, float attention_scaling,
                                          float& y0, float& y1) {
    float s, c;
    sincosf((float)pos * freq, &s, &c);
    c *= attention_scaling;
    s *= attention_scaling;
    y0 = x0 * c - x1 * s;
    y1 = x1 * c + x0 * s;
}

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
        T* head = token + (u64)h * head_dim;
        float y0, y1;
        rope_pair(to_float(head[i]), to_float(head[i + half]), pos, freq[i], attention_scaling, y0, y1);
        head[i] = from_float<T>(y0);
        head[i + half] = from_float<T>(y1);
    }
}

#define ROPE(T, S) \
    extern "C" __global__ void rope_##S(T* x, const u32* positions, const float* inv_freq, u32 long_start, \
                                        u32 num_heads, u32 head_dim, u32 half, float attention_scaling) { \
        pdl_enter(); \
        rope_impl<T>(x, positions, inv_freq, long_start, num_heads, head_dim, half, attention_scaling); \
    }
FOR_EACH_DTYPE(ROPE)

// What both forms of `qkv_rope_cache` work out once per token (token `blockIdx.x`): its row of
// the projection, its table row, its cache slot, and where each of its heads goes.
template <typename T>
struct QkvRopeToken {
    u64 t;
    u32 pos, num_heads, head_dim, q_size, kv_size;
    i64 slot;
    bool write_kv;  // a negative slot is padding, a slot past the cache is not written either
    const float* freq;
    const T* row;  // [q heads | k heads | v]

    __device__ __forceinline__ QkvRopeToken(const T* qkv, const u32* positions, const i64* slot_mapping,
                                            const float* inv_freq, u32 long_start, u32 num_heads_,
                                            u32 num_kv_heads, u32 head_dim_, u32 half, i64 num_slots)
        : t(blockIdx.x), num_heads(num_heads_), head_dim(head_dim_) {
        pos = positions[t];
        slot = slot_mapping[t];
        write_kv = slot >= 0 && slot < num_slots;
        freq = inv_freq + (pos >= long_start ? half : 0);
        q_size = num_heads * head_dim;
        kv_size = num_kv_heads * head_dim;
        row = qkv + t * (q_size + 2 * kv_size);
    }

    // Head h of the row (k heads follow the q heads), and where it goes: q_out's row for a q
    // head, the cache slot for a k head.
    __device__ __forceinline__ const T* head_in(u32 h) const { return row + (u64)h * head_dim; }
    __device__ __forceinline__ T* head_out(u32 h, T* q_out, T* k_cache) const {
        return h < num_heads ? q_out + t * q_size + (u64)h * head_dim
                             : k_cache + (u64)slot * kv_size + (u64)(h - num_heads) * head_dim;
    }
    // Element d of the token's v, and its place in the cache.
    __device__ __forceinline__ const T* v_in(u32 d) const { return row + q_size + kv_size + d; }
    __device__ __forceinline__ T* v_out(T* v_cache, u32 d) const { return v_cache + (u64)slot * kv_size + d; }
};

// The attention block's input step fused into one pass: splits the fused projection, rotates q
// and k, writes q to `q_out` and k, v to the paged cache at `slot_mapping[t]` (a negative slot is
// padding: its k and v are not written; a slot past the cache neither). The same arithmetic as
// `split_qkv`, `rope` on q and k, and `reshape_and_cache` one after another, so the same bits.
//
// qkv: [T, (num_heads + 2 * num_kv_heads) * head_dim]; q_out: [T, num_heads * head_dim];
// k_cache, v_cache: [num_slots, num_kv_heads * head_dim]. Grid: (T, blocks per token): a
// token's elements are spread over gridDim.y blocks, so that a small batch fills more than a few
// SMs.
template <typename T>
__device__ __forceinline__ void qkv_rope_cache_impl(const T* qkv, const u32* positions, const i64* slot_mapping,
                                                    const float* inv_freq, u32 long_start, T* q_out, T* k_cache,
                                                    T* v_cache, u32 num_heads, u32 num_kv_heads, u32 head_dim,
                                                    u32 half, float attention_scaling, i64 num_slots) {
    const QkvRopeToken<T> tok(qkv, positions, slot_mapping, inv_freq, long_start, num_heads, num_kv_heads, head_dim,
                              half, num_slots);
    // Per head: `half` rotated pairs, then the dims past `2 * half` that pass through.
    const u32 per_head = head_dim - half;
    const u32 rotated = (num_heads + num_kv_heads) * per_head;
    for (u32 e = blockIdx.y * blockDim.x + threadIdx.x; e < rotated + tok.kv_size; e += gridDim.y * blockDim.x) {
        if (e >= rotated) {
            if (tok.write_kv) *tok.v_out(v_cache, e - rotated) = *tok.v_in(e - rotated);
            continue;
        }
        const u32 h = e / per_head, i = e % per_head;
        if (h >= num_heads && !tok.write_kv) continue;
        const T* src = tok.head_in(h);
        T* dst = tok.head_out(h, q_out, k_cache);
        if (i >= half) {
            const u32 d = i + half;
            dst[d] = src[d];
            continue;
        }
        float y0, y1;
        rope_pair(to_float(src[i]), to_float(src[i + half]), tok.pos, tok.freq[i], attention_scaling, y0, y1);
        dst[i] = from_float<T>(y0);
        dst[i + half] = from_float<T>(y1);
    }
}

// The same by 8 elements with 16-byte accesses, where `half` and `head_dim` are multiples of 8
// and every buffer is 16-byte aligned: a thread's unit is 8 rotated pairs of a head (dims
// i..i+8 with i+half..i+half+8), 8 dims that pass through, or 8 elements of v. The same
// `rope_pair` per pair, so the same bits; a quarter of the 8B's threads per token (448).
template <typename T>
__device__ __forceinline__ void qkv_rope_cache_vec8_impl(const T* qkv, const u32* positions,
                                                         const i64* slot_mapping, const float* inv_freq,
                                                         u32 long_start, T* q_out, T* k_cache, T* v_cache,
                                                         u32 num_heads, u32 num_kv_heads, u32 head_dim, u32 half,
                                                         float attention_scaling, i64 num_slots) {
    const QkvRopeToken<T> tok(qkv, positions, slot_mapping, inv_freq, long_start, num_heads, num_kv_heads, head_dim,
                              half, num_slots);
    const u32 pair_units = half / 8;
    const u32 per_head = (head_dim - half) / 8;  // pair units, then pass-through units
    const u32 rotated = (num_heads + num_kv_heads) * per_head;
    for (u32 e = blockIdx.y * blockDim.x + threadIdx.x; e < rotated + tok.kv_size / 8; e += gridDim.y * blockDim.x) {
        float x0[8], x1[8], y0[8], y1[8];
        Raw8<T> a, b;
        if (e >= rotated) {
            if (!tok.write_kv) continue;
            const u32 d = 8 * (e - rotated);
            load_raw(tok.v_in(d), a);
            unpack8(a, x0);
            store8(tok.v_out(v_cache, d), x0);
            continue;
        }
        const u32 h = e / per_head, u = e % per_head;
        if (h >= num_heads && !tok.write_kv) continue;
        const T* src = tok.head_in(h);
        T* dst = tok.head_out(h, q_out, k_cache);
        if (u >= pair_units) {
            const u32 d = half + 8 * u;  // dims from 2 * half on
            load_raw(src + d, a);
            unpack8(a, x0);
            store8(dst + d, x0);
            continue;
        }
        const u32 i = 8 * u;
        load_raw(src + i, a);
        load_raw(src + i + half, b);
        unpack8(a, x0);
        unpack8(b, x1);
        Raw8<float> f_raw;
        load_raw(tok.freq + i, f_raw);
        float f[8];
        unpack8(f_raw, f);
#pragma unroll
        for (int k = 0; k < 8; k++) rope_pair(x0[k], x1[k], tok.pos, f[k], attention_scaling, y0[k], y1[k]);
        store8(dst + i, y0);
        store8(dst + i + half, y1);
    }
}

#define QKV_ROPE_CACHE(T, S) \
    extern "C" __global__ void qkv_rope_cache_##S( \
        const T* qkv, const u32* positions, const i64* slot_mapping, const float* inv_freq, u32 long_start, \
        T* q_out, T* k_cache, T* v_cache, u32 num_heads, u32 num_kv_heads, u32 head_dim, u32 half, \
        float attention_scaling, i64 num_slots) { \
        pdl_enter(); \
        qkv_rope_cache_impl<T>(qkv, positions, slot_mapping, inv_freq, long_start, q_out, k_cache, v_cache, \
                               num_heads, num_kv_heads, head_dim, half, attention_scaling, num_slots); \
    } \
    extern "C" __global__ void __launch_bounds__(1024) qkv_rope_cache_vec8_##S( \
        const T* qkv, const u32* positions, const i64* slot_mapping, const float* inv_freq, u32 long_start, \
        T* q_out, T* k_cache, T* v_cache, u32 num_heads, u32 num_kv_heads, u32 head_dim, u32 half, \
        float attention_scaling, i64 num_slots) { \
        pdl_enter(); \
        qkv_rope_cache_vec8_impl<T>(qkv, positions, slot_mapping, inv_freq, long_start, q_out, k_cache, v_cache, \
                                    num_heads, num_kv_heads, head_dim, half, attention_scaling, num_slots); \
    }
FOR_EACH_DTYPE(QKV_ROPE_CACHE)

// `qkv_rope_cache` with the per-head RMS norms of q and k (Qwen3, Gemma 3) between the split and
// the rotation, for head size D with every dim rotated: each q and k head is normalised as
// `rms_norm` does (x * (1 / sqrt(mean(x^2) + eps)) * w in f32, rounded to T as the unfused op
// stores it; only the order of the sum of squares differs), then rotated and stored; v is
// copied. One warp per head, lane l holding dims l + 32 j: since half = D / 2 is a multiple of
// 32, both dims of a rotated pair sit in one lane. Units: the q heads, the k heads, then the v
// heads. q_norm, k_norm: f32 [D]. Grid: (T, ceil((num_heads + 2 * num_kv_heads) / QKN_WARPS)).
#define QKN_WARPS 4
template <typename T, int D>
__device__ __forceinline__ void qkv_norm_rope_cache_impl(const T* qkv, const u32* positions, const i64* slot_mapping,
                                                         const float* inv_freq, u32 long_start, const float* q_norm,
                                                         const float* k_norm, float eps, T* q_out, T* k_cache,
                                                         T* v_cache, u32 num_heads, u32 num_kv_heads,
                                                         float attention_scaling, i64 num_slots) {
    constexpr int PER = D / 32, HALF = PER / 2;
    static_assert(D % 64 == 0, "pairs within a lane");
    const QkvRopeToken<T> tok(qkv, positions, slot_mapping, inv_freq, long_start, num_heads, num_kv_heads, D, D / 2,
                              num_slots);
    const u32 lane = threadIdx.x & 31, unit = blockIdx.y * QKN_WARPS + (threadIdx.x >> 5);
    const u32 heads = num_heads + num_kv_heads;
    if (unit >= heads + num_kv_heads || (unit >= num_heads && !tok.write_kv)) return;
    if (unit >= heads) {
        const u32 base = (unit - heads) * D;
#pragma unroll
        for (int j = 0; j < PER; j++) *tok.v_out(v_cache, base + lane + 32 * j) = *tok.v_in(base + lane + 32 * j);
        return;
    }
    const T* src = tok.head_in(unit);
    T* dst = tok.head_out(unit, q_out, k_cache);
    const float* w = unit < num_heads ? q_norm : k_norm;
    float x[PER];
    float sum_sq = 0.f;
#pragma unroll
    for (int j = 0; j < PER; j++) {
        x[j] = to_float(src[lane + 32 * j]);
        sum_sq += x[j] * x[j];
    }
    sum_sq = warp_sum(sum_sq);
    const float inv_rms = 1.f / sqrtf(sum_sq / (float)D + eps);
#pragma unroll
    for (int j = 0; j < PER; j++) x[j] = to_float(from_float<T>(x[j] * inv_rms * w[lane + 32 * j]));
#pragma unroll
    for (int j = 0; j < HALF; j++) {
        const u32 i = lane + 32 * j;
        float y0, y1;
        rope_pair(x[j], x[j + HALF], tok.pos, tok.freq[i], attention_scaling, y0, y1);
        dst[i] = from_float<T>(y0);
        dst[i + D / 2] = from_float<T>(y1);
    }
}

#define QKV_NORM_ROPE_CACHE_D(T, S, D) \
    extern "C" __global__ void __launch_bounds__(QKN_WARPS * 32) qkv_norm_rope_cache_d##D##_##S( \
        const T* qkv, const u32* positions, const i64* slot_mapping, const float* inv_freq, u32 long_start, \
        const float* q_norm, const float* k_norm, float eps, T* q_out, T* k_cache, T* v_cache, u32 num_heads, \
        u32 num_kv_heads, float attention_scaling, i64 num_slots) { \
        pdl_enter(); \
        qkv_norm_rope_cache_impl<T, D>(qkv, positions, slot_mapping, inv_freq, long_start, q_norm, k_norm, eps, q_out, \
                                       k_cache, v_cache, num_heads, num_kv_heads, attention_scaling, num_slots); \
    }
#define QKV_NORM_ROPE_CACHE(T, S) \
    QKV_NORM_ROPE_CACHE_D(T, S, 64) \
    QKV_NORM_ROPE_CACHE_D(T, S, 128) \
    QKV_NORM_ROPE_CACHE_D(T, S, 256)
FOR_EACH_DTYPE(QKV_NORM_ROPE_CACHE)
