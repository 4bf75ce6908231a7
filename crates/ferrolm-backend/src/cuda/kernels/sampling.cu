// Sampling and logprobs where the logits are: per row, what ferrolm-sampling's
// `RowRequest::apply` computes on the host, step by step (plan.rs, filters.rs, logprobs.rs):
// - raw statistics for logprobs: max and ln(sum(exp(l - max))) over the non-NaN logits in f64,
//   the chosen token's logprob, and the top N (N <= 20) in `rank_desc` order (value descending,
//   NaN last, ties to the lower id);
// - scores: a constrained row's token mask first (ids whose bit is clear, or past the mask's
//   words, score -inf), then penalties and masks from a sparse per-row list (one entry per token;
//   an id the token mask disallows stays -inf), NaN -> -inf, +inf -> FLT_MAX;
// - greedy: argmax, lowest id on ties, -inf skipped;
// - otherwise: top-k as an exact threshold on the order-preserving key of the score (ties to the
//   lower ids), weights exp((s - max) / T) over the survivors, top-p as the smallest rank-order
//   prefix whose weight reaches top_p of the total (ties to the lower ids), min-p at
//   min_p * (max weight), then the first id (in id order) whose cumulative weight exceeds
//   u * total, or the last weighted id.
//
// The first pass over a row (max, argmax, sum of exponentials) runs in logit_stats, many blocks
// per row, and so do the weights of rows that sample without adjustments or top-k
// (sample_weights); then one block of SAMPLE_THREADS per row does the rest. Every kernel that
// forms a row's scores applies its token mask (`mask_allows`): the argmax of logit_stats, the
// weights of sample_weights, the scratch copy of sample_rows. The raw statistics (max and sum,
// for logprobs) never see it: logprobs are those of the raw row. Thresholds are found
// by radix select, 8 bits a pass, over per-warp histograms in dynamic shared memory ([warps, 256]
// u32 counts, then [warps, 256] f64 masses). Every sum and scan runs in a fixed order (no
// floating-point atomics), so a row's result depends on nothing but the row and its parameters.
// Sums are f64 as on the host but in another order: a choice can differ from the host's only where
// u * total or top_p * total sits on a cumulative boundary to within that rounding.

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define RADIX_BINS 256
#define SAMPLE_MAX_TOP 20
// Consecutive ids per thread in the id-order scans (ties, the draw).
#define SCAN_ITEMS 8

#define SAMPLE_GREEDY 0u
#define SAMPLE_RANDOM 1u
#define SAMPLE_LOGPROBS 2u
#define ADJUST_REPETITION 1u
#define ADJUST_MASK 2u
#define NO_ID 0xffffffffu
#define FULL_MASK 0xffffffffu
#define POS_INF __int_as_float(0x7f800000)
#define MAX_FINITE __int_as_float(0x7f7fffff)

// Mirrors `RowParams` in sampling.rs.
struct SampleRow {
    double u;
    float temperature, top_p, min_p, repetition_penalty, frequency_penalty, presence_penalty;
    u32 top_k;  // 0: off
    u32 mode;
    u32 token;  // SAMPLE_LOGPROBS: the token whose logprob is wanted
    u32 num_top;
    u32 adjust_start, adjust_len;
    u32 scratch_row;  // NO_ID: none (greedy rows without adjustments, logprob rows)
    u32 mask_start;   // the row's first word in the token masks; NO_ID: no mask
};

// Mirrors `Adjust` in sampling.rs.
struct SampleAdjust {
    u32 token, output_count, flags;
};

// Mirrors `RowResult` in sampling.rs.
struct SampleOut {
    u32 token;  // NO_ID: nothing to pick
    float logprob;
    u32 top_ids[SAMPLE_MAX_TOP];
    float top_logprobs[SAMPLE_MAX_TOP];
};

struct SampleSmem {
    SampleRow p;
    double red_d[SAMPLE_WARPS];
    u64 red_k[SAMPLE_WARPS];
    float red_f[SAMPLE_WARPS];
    u32 red_u[SAMPLE_WARPS];
    u32 red_i[SAMPLE_WARPS];
    // Radix select: the bin picked, what is still to take below it, the mass of the bins above.
    u32 pick, need, ties;
    double mass;
    u32 found;
    // The top-p select's first pass, done by sample_weights chunk by chunk: [chunks, RADIX_BINS]
    // counts and masses of the weights by their top 8 bits; null when the row has none.
    const u32* top_counts;
    const double* top_masses;
    u32 top_chunks;
};

__device__ __forceinline__ float sanitize(float x) { return isnan(x) ? NEG_INF : (x == POS_INF ? MAX_FINITE : x); }

// Monotone in `f32::total_cmp` order (-0 below +0).
__device__ __forceinline__ u32 order_key(float x) {
    const u32 b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Larger is earlier in `rank_desc` order; unique per id. NaN ranks below -inf.
__device__ __forceinline__ u64 rank_key(float x, u32 id) {
    const u32 k = isnan(x) ? 0u : order_key(x);
    return ((u64)k << 32) | (u64)(NO_ID - id);
}

// Whether the token mask at word `start` of `masks` ([masked rows, words] packed bits, bit i % 32
// of word i / 32 set when id i is allowed) allows id i; every id when `start` is NO_ID (the row
// has no mask, and `masks` may be null). Ids past the mask's words are never allowed.
__device__ __forceinline__ bool mask_allows(const u32* masks, u32 words, u32 start, u32 i) {
    if (start == NO_ID) return true;
    const u32 w = i >> 5;
    return w < words && ((masks[(u64)start + w] >> (i & 31u)) & 1u) != 0u;
}

// `log_softmax_one`: ((l - max) - ln_sum) in f64, rounded once.
__device__ __forceinline__ float logprob_of(float l, float max, double ln_sum) {
    return (float)(((double)l - (double)max) - ln_sum);
}

// The host's `penalize`, then the mask; each rounding explicit so that nothing is fused.
__device__ __forceinline__ float adjust_logit(float l, const SampleAdjust& a, const SampleRow& p) {
    if (a.flags & ADJUST_REPETITION) {
        l = l > 0.f ? __fdiv_rn(l, p.repetition_penalty) : __fmul_rn(l, p.repetition_penalty);
    }
    if (a.output_count > 0 && (p.frequency_penalty != 0.f || p.presence_penalty != 0.f)) {
        l = __fsub_rn(l, __fmul_rn(p.frequency_penalty, __uint2float_rn(a.output_count)));
        l = __fsub_rn(l, p.presence_penalty);
    }
    return (a.flags & ADJUST_MASK) ? NEG_INF : l;
}

// `exp((s - max) / T)` as the host computes it in f32: the f64 exp rounded once to f32 is the
// correctly rounded expf, which glibc's agrees with (to within rare double-rounding cases).
__device__ __forceinline__ float temper(float s, float max, float t) {
    return (float)exp((double)__fdiv_rn(__fsub_rn(s, max), t));
}

// Block-wide reduction with `op` (commutative) over a block of WARPS warps; every thread gets the
// result, computed in the same fixed order whatever the timing. `red`: WARPS slots of shared memory.
template <int WARPS = SAMPLE_WARPS, typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T* red, Op op) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(FULL_MASK, v, o));
    __syncthreads();  // `red` may still be read by a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = red[0];
    for (u32 w = 1; w < WARPS; ++w) v = op(v, red[w]);
    return v;
}

__device__ __forceinline__ float block_max_f(float v, SampleSmem& sm) {
    return block_reduce(v, sm.red_f, [](float a, float b) { return fmaxf(a, b); });
}
__device__ __forceinline__ double block_sum_d(double v, SampleSmem& sm) {
    return block_reduce(v, sm.red_d, [](double a, double b) { return a + b; });
}
__device__ __forceinline__ u32 block_sum_u(u32 v, SampleSmem& sm) {
    return block_reduce(v, sm.red_u, [](u32 a, u32 b) { return a + b; });
}
__device__ __forceinline__ u32 block_max_u(u32 v, SampleSmem& sm) {
    return block_reduce(v, sm.red_i, [](u32 a, u32 b) { return max(a, b); });
}
__device__ __forceinline__ u32 block_min_u(u32 v, SampleSmem& sm) {
    return block_reduce(v, sm.red_i, [](u32 a, u32 b) { return min(a, b); });
}
__device__ __forceinline__ u64 block_max_k(u64 v, SampleSmem& sm) {
    return block_reduce(v, sm.red_k, [](u64 a, u64 b) { return a > b ? a : b; });
}

// The raw statistics of a row, the first pass over it, spread over blocks of STATS_THREADS: for
// chunk c (ids [c * STATS_CHUNK, (c + 1) * STATS_CHUNK)), the max of the non-NaN logits, the
// greedy best (largest sanitized score among the ids the row's token mask allows, lowest id on
// ties; NO_ID if all are -inf) and the sum of expf(x - chunk max) over the non-NaN logits in f64
// (0 unless the chunk max is finite). The max and the sum are the raw row's, mask or not.
// sample_rows merges a row's chunks in chunk order: the chunks are fixed by the vocabulary alone,
// so a row's result still depends on nothing but the row.
#define STATS_THREADS 256
#define STATS_WARPS (STATS_THREADS / 32)
#define STATS_ITEMS 16
#define STATS_CHUNK (STATS_THREADS * STATS_ITEMS)

// This thread's logits of chunk blockIdx.y of row `raw` (ids first + j * STATS_THREADS), all
// loads in flight at once; ids past the vocabulary read as `fill`.
template <typename T>
__device__ __forceinline__ void load_chunk(const T* raw, u32 vocab, u32 first, float fill, float (&x)[STATS_ITEMS]) {
#pragma unroll
    for (int j = 0; j < STATS_ITEMS; j++) {
        const u32 i = first + j * STATS_THREADS;
        x[j] = i < vocab ? to_float(raw[i]) : fill;
    }
}

// Mirrors `ChunkStats` in sampling.rs.
struct ChunkStats {
    float max, best;
    u32 best_id, pad;
    double sum;
};

// logits: [rows, vocab]; stats: [rows, chunks]; rows: [rows]; masks: [masked rows, words], null
// when no row has a mask (`rows` is then not read). Grid: (rows, chunks).
template <typename T>
__device__ __forceinline__ void logit_stats_impl(const T* logits, u32 vocab, u32 chunks, ChunkStats* stats,
                                                 const SampleRow* rows, const u32* masks, u32 words) {
    __shared__ float red_f[STATS_WARPS];
    __shared__ u32 red_i[STATS_WARPS];
    __shared__ double red_d[STATS_WARPS];
    const T* raw = logits + (u64)blockIdx.x * vocab;
    const u32 first = blockIdx.y * STATS_CHUNK + threadIdx.x;
    const u32 mask_start = masks != nullptr ? rows[blockIdx.x].mask_start : NO_ID;
    // Ids past the vocabulary read as NaN, which nothing counts.
    float x[STATS_ITEMS];
    load_chunk(raw, vocab, first, __int_as_float(0x7fc00000), x);
    float mx = NEG_INF, best = NEG_INF;
    u32 best_id = NO_ID;
#pragma unroll
    for (int j = 0; j < STATS_ITEMS; j++) {
        if (!isnan(x[j])) mx = fmaxf(mx, x[j]);
        const float s = mask_allows(masks, words, mask_start, first + j * STATS_THREADS) ? sanitize(x[j]) : NEG_INF;
        if (s != NEG_INF && s > best) {
            best = s;
            best_id = first + j * STATS_THREADS;
        }
    }
    auto max_f = [](float a, float b) { return fmaxf(a, b); };
    mx = block_reduce<STATS_WARPS>(mx, red_f, max_f);
    const float top = block_reduce<STATS_WARPS>(best, red_f, max_f);
    auto min_u = [](u32 a, u32 b) { return min(a, b); };
    best_id = block_reduce<STATS_WARPS>(best == top ? best_id : NO_ID, red_i, min_u);
    double sum = 0.0;
    if (isfinite(mx)) {
        // Terms in f32 (x - max <= 0, so each is in [0, 1] to a few ulp), summed in f64.
#pragma unroll
        for (int j = 0; j < STATS_ITEMS; j++) {
            if (!isnan(x[j])) sum += (double)expf(x[j] - mx);
        }
        auto add_d = [](double a, double b) { return a + b; };
        sum = block_reduce<STATS_WARPS>(sum, red_d, add_d);
    }
    if (threadIdx.x == 0) {
        stats[(u64)blockIdx.x * chunks + blockIdx.y] = {mx, top, best_id, 0u, sum};
    }
}

#define LOGIT_STATS(T, S) \
    extern "C" __global__ void __launch_bounds__(STATS_THREADS) \
        logit_stats_##S(const T* logits, u32 vocab, u32 chunks, ChunkStats* stats, const SampleRow* rows, \
                        const u32* masks, u32 words) { \
        pdl_enter(); \
        logit_stats_impl<T>(logits, vocab, chunks, stats, rows, masks, words); \
    }
FOR_EACH_DTYPE(LOGIT_STATS)

// Mirrors `ChunkWeights` in sampling.rs.
struct ChunkWeights {
    u32 kept;  // ids with a weight (scores above -inf)
    u32 last;  // 1 + the last id of a weight above 0; 0 if none
    float max_w, pad;
    double total;  // their weights' sum, in thread order then the block's fixed order
};

// Chunks a plain_random row may have (sample_rows adds their totals in shared memory).
#define PLAIN_MAX_CHUNKS (SAMPLE_WARPS * RADIX_BINS)

// A row that samples from its raw scores (nothing to adjust; a token mask is applied where the
// weights are made) without top-k (0, or at least the vocabulary: never below the candidate
// count): its weights are spread over many blocks (sample_weights) instead of one row-long pass
// of its sample_rows block.
__device__ __forceinline__ bool plain_random(const SampleRow& p, u32 vocab, u32 chunks) {
    return p.mode == SAMPLE_RANDOM && p.adjust_len == 0 && (p.top_k == 0 || p.top_k >= vocab) &&
           chunks <= PLAIN_MAX_CHUNKS;
}

// For a plain_random row, what random_pick's weights pass computes, chunk by chunk: weight
// temper(s, top, T) of each score s above -inf (s: the sanitized logit, -inf where the row's
// token mask disallows the id; top: the row's largest, from logit_stats's chunks), -1 for the
// others, written to the row's scratch; and the chunk's ChunkWeights.
// With top-p, also the first pass of its radix select over the chunk (top_counts, top_masses:
// [rows, chunks, RADIX_BINS], the count and the mass of the weights by their top 8 bits; null
// when no row has top-p). Other rows return at once. Grid: (rows, chunks), STATS_THREADS;
// arguments as logit_stats's, then the statistics it wrote, the rows' parameters, the scratch
// rows, out: [rows, chunks], the top-p first pass and the token masks as logit_stats takes them.
template <typename T>
__device__ __forceinline__ void sample_weights_impl(const T* logits, u32 vocab, u32 chunks, const ChunkStats* stats,
                                                    const SampleRow* rows, float* scratch, ChunkWeights* out,
                                                    u32* top_counts, double* top_masses, const u32* masks,
                                                    u32 words) {
    __shared__ float red_f[STATS_WARPS];
    __shared__ u32 red_i[STATS_WARPS];
    __shared__ double red_d[STATS_WARPS];
    __shared__ u32 h_count[STATS_WARPS][RADIX_BINS];
    __shared__ double h_mass[STATS_WARPS][RADIX_BINS];
    const SampleRow& p = rows[blockIdx.x];
    if (!plain_random(p, vocab, chunks)) return;
    auto max_f = [](float a, float b) { return fmaxf(a, b); };
    auto max_u = [](u32 a, u32 b) { return max(a, b); };
    auto add_u = [](u32 a, u32 b) { return a + b; };
    auto add_d = [](double a, double b) { return a + b; };
    const ChunkStats* st = stats + (u64)blockIdx.x * chunks;
    float top = NEG_INF;
    for (u32 c = threadIdx.x; c < chunks; c += STATS_THREADS) top = fmaxf(top, st[c].best);
    top = block_reduce<STATS_WARPS>(top, red_f, max_f);
    // A row of nothing but -inf and NaN has no weights: sample_rows returns before reading any.
    const T* raw = logits + (u64)blockIdx.x * vocab;
    float* sc = scratch + (u64)p.scratch_row * vocab;
    const u32 first = blockIdx.y * STATS_CHUNK + threadIdx.x;
    float x[STATS_ITEMS];
    load_chunk(raw, vocab, first, NEG_INF, x);
    u32 kept = 0, last = 0;
    float max_w = 0.f;
    double total = 0.0;
    float sc_w[STATS_ITEMS];  // the weights written, kept for the top-p pass
#pragma unroll
    for (int j = 0; j < STATS_ITEMS; j++) {
        const u32 i = first + j * STATS_THREADS;
        const float s = mask_allows(masks, words, p.mask_start, i) ? sanitize(x[j]) : NEG_INF;
        float w = -1.f;
        if (s != NEG_INF && top != NEG_INF) {
            w = temper(s, top, p.temperature);
            ++kept;
            total += (double)w;
            max_w = fmaxf(max_w, w);
            if (w > 0.f) last = i + 1;
        }
        sc_w[j] = w;
        if (i < vocab) sc[i] = w;
    }
    kept = block_reduce<STATS_WARPS>(kept, red_i, add_u);
    last = block_reduce<STATS_WARPS>(last, red_i, max_u);
    max_w = block_reduce<STATS_WARPS>(max_w, red_f, max_f);
    total = block_reduce<STATS_WARPS>(total, red_d, add_d);
    const u64 at = (u64)blockIdx.x * chunks + blockIdx.y;
    if (threadIdx.x == 0) out[at] = {kept, last, max_w, 0.f, total};
    if (top_counts == nullptr || !(p.top_p < 1.f)) return;

    // The top-p select's first pass over this chunk, as radix_select makes it: the survivors
    // (weights >= 0) by the top 8 bits of their weight, each bin's masses in lane order.
    static_assert(STATS_THREADS == RADIX_BINS, "one thread per bin");
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (u32 w = 0; w < STATS_WARPS; ++w) {
        h_count[w][threadIdx.x] = 0;
        h_mass[w][threadIdx.x] = 0.0;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < STATS_ITEMS; j++) {
        const u32 i = first + j * STATS_THREADS;
        const float w = i < vocab ? sc_w[j] : -1.f;
        const bool valid = w >= 0.f;
        const u32 ballot = __ballot_sync(FULL_MASK, valid);
        if (ballot == 0) continue;
        const u32 bin = valid ? __float_as_uint(w) >> 24 : RADIX_BINS;
        const u32 peers = __match_any_sync(FULL_MASK, bin);
        double sum = 0.0;
        for (u32 bits = ballot; bits != 0; bits &= bits - 1) {
            const int src = __ffs(bits) - 1;
            const u32 b = __shfl_sync(FULL_MASK, bin, src);
            const double m = __shfl_sync(FULL_MASK, (double)w, src);
            if (b == bin) sum += m;
        }
        if (valid && (u32)(__ffs(peers) - 1) == lane) {
            h_count[warp][bin] += __popc(peers);
            h_mass[warp][bin] += sum;
        }
    }
    __syncthreads();
    u32 c = 0;
    double m = 0.0;
    for (u32 w = 0; w < STATS_WARPS; ++w) {
        c += h_count[w][threadIdx.x];
        m += h_mass[w][threadIdx.x];
    }
    top_counts[at * RADIX_BINS + threadIdx.x] = c;
    top_masses[at * RADIX_BINS + threadIdx.x] = m;
}

#define SAMPLE_WEIGHTS(T, S) \
    extern "C" __global__ void __launch_bounds__(STATS_THREADS) \
        sample_weights_##S(const T* logits, u32 vocab, u32 chunks, const ChunkStats* stats, const SampleRow* rows, \
                           float* scratch, ChunkWeights* out, u32* top_counts, double* top_masses, \
                           const u32* masks, u32 words) { \
        pdl_enter(); \
        sample_weights_impl<T>(logits, vocab, chunks, stats, rows, scratch, out, top_counts, top_masses, masks, \
                               words); \
    }
FOR_EACH_DTYPE(SAMPLE_WEIGHTS)

// Exclusive prefix sum over the block in thread order; `*total` gets the sum of all. Fixed order.
template <typename T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* red, T* total) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T x = __shfl_up_sync(FULL_MASK, incl, o);
        if ((int)lane >= o) incl += x;
    }
    T excl = __shfl_up_sync(FULL_MASK, incl, 1);
    if (lane == 0) excl = 0;
    __syncthreads();
    if (lane == 31) red[warp] = incl;
    __syncthreads();
    T before = 0, all = 0;
    for (u32 w = 0; w < SAMPLE_WARPS; ++w) {
        if (w == warp) before = all;
        all += red[w];
    }
    *total = all;
    return before + excl;
}

// Radix select over 32-bit keys, 8 bits a pass from the top, among the ids for which
// `elem(i, key, mass)` is true, walking keys from the largest down.
// Count mode (!SUMS): stops at the `need`-th element; sm.need is left with how many elements of
// exactly the returned key are to be taken (1..=sm.ties).
// Sum mode: stops where the mass reaches `target`; sm.mass is left with the mass of all larger
// keys and sm.ties with the number of elements of the returned key. Where rounding leaves the
// target unreached, the smallest key is returned (everything is taken).
template <bool SUMS, typename Elem>
__device__ u32 radix_select(u32 vocab, Elem elem, u32 need, double target, SampleSmem& sm, u32* hist_count,
                            double* hist_sum) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 prefix = 0, mask = 0;
    __syncthreads();
    if (threadIdx.x == 0) {
        sm.need = need;
        sm.mass = 0.0;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        // With the row's top-p first pass made by sample_weights, plain_pick has left its
        // histogram in warp 0's row (the others zero).
        if (!(SUMS && shift == 24 && sm.top_counts != nullptr)) {
            for (u32 j = threadIdx.x; j < SAMPLE_WARPS * RADIX_BINS; j += SAMPLE_THREADS) {
                hist_count[j] = 0;
                if (SUMS) hist_sum[j] = 0.0;
            }
        }
        __syncthreads();
        u32* my_count = hist_count + warp * RADIX_BINS;
        double* my_sum = hist_sum + warp * RADIX_BINS;
        if (!(SUMS && shift == 24 && sm.top_counts != nullptr)) {
            for (u32 base = 0; base < vocab; base += SAMPLE_THREADS) {
                const u32 i = base + threadIdx.x;
                u32 key = 0;
                double mass = 0.0;
                const bool valid = i < vocab && elem(i, key, mass) && (key & mask) == prefix;
                const u32 ballot = __ballot_sync(FULL_MASK, valid);
                if (ballot == 0) continue;
                const u32 bin = valid ? (key >> shift) & 0xffu : RADIX_BINS;
                const u32 peers = __match_any_sync(FULL_MASK, bin);
                const bool leader = valid && (u32)(__ffs(peers) - 1) == lane;
                if (SUMS) {
                    // Each bin's masses summed in lane order, so that the histogram is reproducible.
                    double total = 0.0;
                    for (u32 bits = ballot; bits != 0; bits &= bits - 1) {
                        const int src = __ffs(bits) - 1;
                        const u32 b = __shfl_sync(FULL_MASK, bin, src);
                        const double m = __shfl_sync(FULL_MASK, mass, src);
                        if (b == bin) total += m;
                    }
                    if (leader) {
                        my_count[bin] += __popc(peers);
                        my_sum[bin] += total;
                    }
                } else if (leader) {
                    my_count[bin] += __popc(peers);
                }
            }
        }
        __syncthreads();
        // Warp 0's row of the histograms becomes the block's (each thread reads only its bin).
        for (u32 b = threadIdx.x; b < RADIX_BINS; b += SAMPLE_THREADS) {
            u32 c = 0;
            double m = 0.0;
            for (u32 w = 0; w < SAMPLE_WARPS; ++w) {
                c += hist_count[w * RADIX_BINS + b];
                if (SUMS) m += hist_sum[w * RADIX_BINS + b];
            }
            hist_count[b] = c;
            if (SUMS) hist_sum[b] = m;
        }
        __syncthreads();
        if (warp == 0) {
            // Lane l holds bins 255 - 8l down to 248 - 8l, so lane order is descending key order.
            u32 c8 = 0;
            double m8 = 0.0;
            for (int j = 0; j < 8; ++j) {
                const u32 b = 255 - 8 * lane - j;
                c8 += hist_count[b];
                if (SUMS) m8 += hist_sum[b];
            }
            u32 c_incl = c8;
            double m_incl = m8;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 c = __shfl_up_sync(FULL_MASK, c_incl, o);
                const double m = __shfl_up_sync(FULL_MASK, m_incl, o);
                if ((int)lane >= o) {
                    c_incl += c;
                    m_incl += m;
                }
            }
            u32 c_excl = __shfl_up_sync(FULL_MASK, c_incl, 1);
            double m_excl = __shfl_up_sync(FULL_MASK, m_incl, 1);
            if (lane == 0) {
                c_excl = 0;
                m_excl = 0.0;
            }
            const u32 need_now = sm.need;
            const double mass_now = sm.mass;
            const bool reached = SUMS ? mass_now + m_incl >= target : c_incl >= need_now;
            const u32 reached_lanes = __ballot_sync(FULL_MASK, reached);
            // Unreached (sum mode, rounding): the lane of the smallest nonempty bins.
            const u32 chosen = reached_lanes != 0 ? __ffs(reached_lanes) - 1
                                                  : 31 - __clz(__ballot_sync(FULL_MASK, c8 > 0));
            if (lane == chosen) {
                u32 c = c_excl, c_last = c_excl, last = NO_ID;
                double m = m_excl, m_last = m_excl;
                u32 pick = NO_ID;
                for (int j = 0; j < 8; ++j) {
                    const u32 b = 255 - 8 * lane - j;
                    const u32 cb = hist_count[b];
                    if (cb == 0) continue;
                    const double mb = SUMS ? hist_sum[b] : 0.0;
                    if (SUMS ? mass_now + (m + mb) >= target : c + cb >= need_now) {
                        pick = b;
                        break;
                    }
                    last = b;
                    c_last = c;
                    m_last = m;
                    c += cb;
                    m += mb;
                }
                if (pick == NO_ID) {  // rounding: the lane's smallest nonempty bin
                    pick = last;
                    c = c_last;
                    m = m_last;
                }
                sm.pick = pick;
                sm.need = need_now - c;
                sm.mass = mass_now + m;
                sm.ties = hist_count[pick];
            }
        }
        __syncthreads();
        prefix |= sm.pick << shift;
        mask |= 0xffu << shift;
    }
    return prefix;
}

// The id of the `m`-th id (from 1, in id order) for which `pred(i)` holds; NO_ID if there are fewer.
template <typename Pred>
__device__ u32 nth_in_id_order(u32 vocab, Pred pred, u32 m, SampleSmem& sm) {
    __syncthreads();
    if (threadIdx.x == 0) sm.found = NO_ID;
    u32 before = 0;  // matches in earlier chunks; the same in every thread
    for (u32 base = 0; base < vocab; base += SAMPLE_THREADS * SCAN_ITEMS) {
        const u32 first = base + threadIdx.x * SCAN_ITEMS;
        u32 local = 0;
        for (u32 j = 0; j < SCAN_ITEMS; ++j) local += (first + j < vocab && pred(first + j)) ? 1u : 0u;
        u32 total;
        const u32 excl = before + block_exclusive_scan(local, sm.red_u, &total);
        if (excl < m && m <= excl + local) {
            u32 c = excl;
            for (u32 j = 0; j < SCAN_ITEMS; ++j) {
                if (first + j < vocab && pred(first + j) && ++c == m) {
                    sm.found = first + j;
                    break;
                }
            }
        }
        before += total;
        if (before >= m) break;
    }
    __syncthreads();
    return sm.found;
}

// The first id (in id order, from `from`) whose cumulative weight exceeds `target`, the ids below
// `from` weighing `before` together, weights `weight(i)` (0 for ids out of the draw); NO_ID if
// none. A thread whose share looks like it crosses but whose own running sum does not (rounding)
// answers with its last weighted id.
template <typename Weight>
__device__ u32 draw_in_id_order(u32 vocab, Weight weight, double target, SampleSmem& sm, u32 from = 0,
                                double before = 0.0) {
    for (u32 base = from; base < vocab; base += SAMPLE_THREADS * SCAN_ITEMS) {
        const u32 first = base + threadIdx.x * SCAN_ITEMS;
        double local = 0.0;
        for (u32 j = 0; j < SCAN_ITEMS; ++j) local += first + j < vocab ? (double)weight(first + j) : 0.0;
        double total;
        const double start = before + block_exclusive_scan(local, sm.red_d, &total);
        u32 hit = NO_ID;
        if (start + local > target) {
            double c = start;
            for (u32 j = 0; j < SCAN_ITEMS && first + j < vocab; ++j) {
                const float w = weight(first + j);
                if (w <= 0.f) continue;
                c += (double)w;
                hit = first + j;
                if (c > target) break;
            }
        }
        hit = block_min_u(hit, sm);
        if (hit != NO_ID) return hit;
        before += total;
    }
    return NO_ID;
}

// The block's argmax from each thread's best (score, lowest id): the lowest id of the highest
// score, or NO_ID when every score is -inf.
__device__ __forceinline__ u32 greedy_reduce(float best, u32 best_id, SampleSmem& sm) {
    const float top = block_max_f(best, sm);
    if (top == NEG_INF) return NO_ID;
    return block_min_u(best == top ? best_id : NO_ID, sm);
}

// The greedy choice over `score(i)`: the largest, lowest id on ties; NO_ID if all are -inf.
template <typename Score>
__device__ u32 greedy_pick(u32 vocab, Score score, SampleSmem& sm) {
    float best = NEG_INF;
    u32 best_id = NO_ID;
    for (u32 i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        const float s = score(i);
        if (s != NEG_INF && s > best) {
            best = s;
            best_id = i;
        }
    }
    return greedy_reduce(best, best_id, sm);
}

// top-p, min-p and the draw over the weights in `sc` (-1 for ids out of the draw): `kept`
// weighted ids of `total` weight, the largest `max_w`.
__device__ u32 filtered_pick(u32 vocab, float* sc, SampleSmem& sm, u32* hist_count, double* hist_sum, u32 kept,
                             double total, float max_w) {
    const SampleRow& p = sm.p;
    // top-p: keep weights above p_key, and those equal to it up to id p_cut.
    const bool p_on = p.top_p < 1.f && kept > 1;
    u32 p_key = 0, p_cut = NO_ID;
    if (p_on) {
        const double target = (double)p.top_p * total;
        auto survivor = [&](u32 i, u32& key, double& mass) {
            const float w = sc[i];
            key = __float_as_uint(w);
            mass = (double)w;
            return w >= 0.f;
        };
        p_key = radix_select<true>(vocab, survivor, 0, target, sm, hist_count, hist_sum);
        const float tie_w = __uint_as_float(p_key);
        const u32 ties = sm.ties;
        u32 take = ties;
        if (tie_w > 0.f) {
            const double q = ceil((target - sm.mass) / (double)tie_w);
            take = q < 1.0 ? 1u : (q < (double)ties ? (u32)q : ties);
        }
        p_cut = nth_in_id_order(vocab, [&](u32 i) { return sc[i] >= 0.f && __float_as_uint(sc[i]) == p_key; }, take, sm);
    }

    // min-p, then the draw over what is left, in id order.
    const float min_w = p.min_p > 0.f ? __fmul_rn(p.min_p, max_w) : 0.f;
    auto weight = [&](u32 i) {
        const float w = sc[i];
        if (w < 0.f) return 0.f;
        const u32 key = __float_as_uint(w);
        if (p_on && (key < p_key || (key == p_key && i > p_cut))) return 0.f;
        if (p.min_p > 0.f && w < min_w) return 0.f;
        return w;
    };
    double drawn = 0.0;
    u32 last = 0;  // 1 + the last weighted id
    for (u32 i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        const float w = weight(i);
        if (w > 0.f) {
            drawn += (double)w;
            last = i + 1;
        }
    }
    drawn = block_sum_d(drawn, sm);
    last = block_max_u(last, sm);
    const u32 hit = draw_in_id_order(vocab, weight, p.u * drawn, sm);
    return hit != NO_ID ? hit : (last == 0 ? NO_ID : last - 1);
}
// The choice of a plain_random row, whose weights and chunk sums sample_weights wrote. Without
// top-p and min-p the draw needs no pass over the row: the chunk sums, added in chunk order,
// give the total and the chunk where u * total is reached, and the draw scans from there.
__device__ u32 plain_pick(u32 vocab, float* sc, SampleSmem& sm, u32* hist_count, double* hist_sum,
                          const ChunkWeights* cw, u32 chunks) {
    const SampleRow& p = sm.p;
    u32 kept = 0, last = 0;
    float max_w = 0.f;
    double* totals = hist_sum;  // [chunks], free until a radix select
    for (u32 c = threadIdx.x; c < chunks; c += SAMPLE_THREADS) {
        const ChunkWeights w = cw[c];
        kept += w.kept;
        last = max(last, w.last);
        max_w = fmaxf(max_w, w.max_w);
        totals[c] = w.total;
    }
    kept = block_sum_u(kept, sm);
    last = block_max_u(last, sm);
    max_w = block_max_f(max_w, sm);
    if (kept == 0) return NO_ID;
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (u32 c = 0; c < chunks; ++c) total += totals[c];
        sm.mass = total;
    }
    __syncthreads();
    const double total = sm.mass;
    if (p.top_p < 1.f && kept > 1 && sm.top_counts != nullptr) {
        // The top-p select's first histogram from the chunks' (sample_weights), added in chunk
        // order into warp 0's row, the others zeroed: radix_select starts from there.
        for (u32 j = threadIdx.x; j < SAMPLE_WARPS * RADIX_BINS; j += SAMPLE_THREADS) {
            u32 c = 0;
            double m = 0.0;
            for (u32 ch = 0; j < RADIX_BINS && ch < chunks; ++ch) {
                c += sm.top_counts[ch * RADIX_BINS + j];
                m += sm.top_masses[ch * RADIX_BINS + j];
            }
            hist_count[j] = c;
            hist_sum[j] = m;
        }
    }
    if ((p.top_p < 1.f && kept > 1) || p.min_p > 0.f) {
        return filtered_pick(vocab, sc, sm, hist_count, hist_sum, kept, total, max_w);
    }
    // Every weight is in the draw (those of 0 add nothing).
    const double target = p.u * total;
    __syncthreads();  // every thread has read sm.mass
    if (threadIdx.x == 0) {
        double before = 0.0;
        u32 from = NO_ID;
        for (u32 c = 0; c < chunks; ++c) {
            if (before + totals[c] > target) {
                from = c;
                break;
            }
            before += totals[c];
        }
        sm.found = from;
        sm.mass = before;
    }
    __syncthreads();
    const u32 from = sm.found;
    const double before = sm.mass;
    u32 hit = NO_ID;
    if (from != NO_ID) {
        auto weight = [&](u32 i) { return fmaxf(sc[i], 0.f); };
        hit = draw_in_id_order(vocab, weight, target, sm, from * STATS_CHUNK, before);
    }
    return hit != NO_ID ? hit : (last == 0 ? NO_ID : last - 1);
}

// The non-greedy choice for the row whose processed scores are in `sc` (overwritten with weights),
// or, for a plain_random row (`cw` not null), whose weights sample_weights wrote there with each
// chunk's sums in `cw` ([chunks]).
__device__ u32 random_pick(u32 vocab, float* sc, SampleSmem& sm, u32* hist_count, double* hist_sum,
                           const ChunkWeights* cw, u32 chunks) {
    const SampleRow& p = sm.p;
    if (cw != nullptr) return plain_pick(vocab, sc, sm, hist_count, hist_sum, cw, chunks);
    // Candidates: scores above -inf.
    u32 count = 0;
    float top = NEG_INF;
    for (u32 i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        const float s = sanitize(sc[i]);
        if (s != NEG_INF) {
            ++count;
            top = fmaxf(top, s);
        }
    }
    count = block_sum_u(count, sm);
    top = block_max_f(top, sm);
    if (count == 0) return NO_ID;

    // top-k: keep keys above k_key, and those equal to it up to id k_cut.
    const bool k_on = p.top_k > 0 && p.top_k < count;
    u32 k_key = 0, k_cut = NO_ID;
    if (k_on) {
        auto cand = [&](u32 i, u32& key, double&) {
            const float s = sanitize(sc[i]);
            key = order_key(s);
            return s != NEG_INF;
        };
        k_key = radix_select<false>(vocab, cand, p.top_k, 0.0, sm, hist_count, hist_sum);
        const u32 take = sm.need;
        k_cut = nth_in_id_order(vocab, [&](u32 i) {
            const float s = sanitize(sc[i]);
            return s != NEG_INF && order_key(s) == k_key;
        }, take, sm);
    }

    // Weights of the survivors (-1 for the others), written over the scores.
    u32 kept = 0;
    double total = 0.0;
    float max_w = 0.f;
    for (u32 i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        const float s = sanitize(sc[i]);
        const u32 key = order_key(s);
        const bool keep = s != NEG_INF && (!k_on || key > k_key || (key == k_key && i <= k_cut));
        float w = -1.f;
        if (keep) {
            w = temper(s, top, p.temperature);
            ++kept;
            total += (double)w;
            max_w = fmaxf(max_w, w);
        }
        sc[i] = w;
    }
    kept = block_sum_u(kept, sm);
    total = block_sum_d(total, sm);
    max_w = block_max_f(max_w, sm);
    return filtered_pick(vocab, sc, sm, hist_count, hist_sum, kept, total, max_w);
}

// logits: [rows, vocab]; stats: [rows, chunks], logit_stats's; weights: [rows, chunks],
// sample_weights's (null when no row samples), and top_counts, top_masses its first pass of the
// top-p select (null when no row has top-p); rows: [rows]; adjusts: the rows' lists,
// concatenated; masks: [masked rows, words] token masks (null when no row has one); scratch:
// [scratch rows, vocab] f32 (processed scores, then weights, of the rows that have one;
// sample_weights has written those of plain_random rows); out: [rows]. Dynamic shared memory:
// SAMPLE_WARPS * RADIX_BINS * (4 + 8) bytes.
template <typename T>
__device__ __forceinline__ void sample_rows_impl(const T* logits, u32 vocab, const ChunkStats* stats,
                                                 const ChunkWeights* weights, const u32* top_counts,
                                                 const double* top_masses, u32 chunks, const SampleRow* rows,
                                                 const SampleAdjust* adjusts, const u32* masks, u32 words,
                                                 float* scratch, SampleOut* out) {
    extern __shared__ __align__(16) unsigned char sample_smem[];
    u32* hist_count = reinterpret_cast<u32*>(sample_smem);  // [SAMPLE_WARPS, RADIX_BINS]
    double* hist_sum = reinterpret_cast<double*>(sample_smem + SAMPLE_WARPS * RADIX_BINS * sizeof(u32));
    __shared__ SampleSmem sm;
    if (threadIdx.x == 0) {
        sm.p = rows[blockIdx.x];
        // Where sample_weights made the first pass of this row's top-p select.
        const bool first_pass = weights != nullptr && top_counts != nullptr && plain_random(sm.p, vocab, chunks) &&
                                sm.p.top_p < 1.f;
        const u64 at = (u64)blockIdx.x * chunks * RADIX_BINS;
        sm.top_counts = first_pass ? top_counts + at : nullptr;
        sm.top_masses = first_pass ? top_masses + at : nullptr;
        sm.top_chunks = chunks;
    }
    __syncthreads();
    const SampleRow& p = sm.p;
    const T* raw = logits + (u64)blockIdx.x * vocab;
    float* sc = p.scratch_row == NO_ID ? nullptr : scratch + (u64)p.scratch_row * vocab;
    SampleOut* o = out + blockIdx.x;

    // The row's raw statistics from its chunks' (logit_stats); a greedy row with nothing to
    // adjust also has its argmax from them (among the ids its mask allows). Rows with a scratch
    // row copy the logits there, -inf where the mask disallows, but plain_random ones, whose
    // weights are there already.
    if (sc != nullptr && !(weights != nullptr && plain_random(p, vocab, chunks))) {
        for (u32 i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
            sc[i] = mask_allows(masks, words, p.mask_start, i) ? to_float(raw[i]) : NEG_INF;
        }
    }
    const ChunkStats* st = stats + (u64)blockIdx.x * chunks;
    float max = NEG_INF, best = NEG_INF;
    u32 best_id = NO_ID;
    for (u32 c = threadIdx.x; c < chunks; c += SAMPLE_THREADS) {
        max = fmaxf(max, st[c].max);
        // Chunks in id order, each with its lowest id of its best: the lowest id on ties.
        if (st[c].best > best) {
            best = st[c].best;
            best_id = st[c].best_id;
        }
    }
    max = block_max_f(max, sm);
    double ln_sum = 0.0;
    if (isfinite(max)) {
        // Each chunk's sum rescaled from its own max to the row's (chunks of no finite logit
        // add nothing): within 1e-6 of the host's all-f64 sum after the log.
        double sum = 0.0;
        for (u32 c = threadIdx.x; c < chunks; c += SAMPLE_THREADS) {
            if (st[c].max != NEG_INF) sum += st[c].sum * exp((double)st[c].max - (double)max);
        }
        ln_sum = log(block_sum_d(sum, sm));
    }

    // The top N raw logprobs: N passes, each taking the best rank key below the last one taken.
    const u32 n = min(min(p.num_top, vocab), (u32)SAMPLE_MAX_TOP);
    u64 prev = ~0ull;
    for (u32 j = 0; j < SAMPLE_MAX_TOP; ++j) {
        if (j >= n) {
            if (threadIdx.x == 0) {
                o->top_ids[j] = NO_ID;
                o->top_logprobs[j] = NEG_INF;
            }
            continue;
        }
        u64 best = 0;
        for (u32 i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
            const u64 k = rank_key(to_float(raw[i]), i);
            if (k < prev && k > best) best = k;
        }
        best = block_max_k(best, sm);
        prev = best;
        if (threadIdx.x == 0) {
            const u32 id = NO_ID - (u32)best;
            o->top_ids[j] = id;
            o->top_logprobs[j] = logprob_of(to_float(raw[id]), max, ln_sum);
        }
    }

    u32 token = p.token;
    if (p.mode != SAMPLE_LOGPROBS) {
        if (sc != nullptr) {
            // The block reductions above ordered the copy before these writes. An id the mask
            // disallows stays -inf, as the host's penalties leave it.
            for (u32 j = threadIdx.x; j < p.adjust_len; j += SAMPLE_THREADS) {
                const SampleAdjust a = adjusts[p.adjust_start + j];
                if (a.token < vocab && mask_allows(masks, words, p.mask_start, a.token)) {
                    sc[a.token] = adjust_logit(to_float(raw[a.token]), a, p);
                }
            }
            __syncthreads();
        }
        if (p.mode == SAMPLE_GREEDY) {
            token = sc != nullptr ? greedy_pick(vocab, [&](u32 i) { return sanitize(sc[i]); }, sm)
                                  : greedy_reduce(best, best_id, sm);
        } else {
            const bool plain = weights != nullptr && plain_random(p, vocab, chunks);
            const ChunkWeights* cw = plain ? weights + (u64)blockIdx.x * chunks : nullptr;
            token = random_pick(vocab, sc, sm, hist_count, hist_sum, cw, chunks);
        }
    }
    if (threadIdx.x == 0) {
        o->token = token;
        o->logprob = token < vocab ? logprob_of(to_float(raw[token]), max, ln_sum) : NEG_INF;
    }
}

#define SAMPLE_ROWS(T, S) \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows_##S( \
        const T* logits, u32 vocab, const ChunkStats* stats, const ChunkWeights* weights, const u32* top_counts, \
        const double* top_masses, u32 chunks, const SampleRow* rows, const SampleAdjust* adjusts, const u32* masks, \
        u32 words, float* scratch, SampleOut* out) { \
        pdl_enter(); \
        sample_rows_impl<T>(logits, vocab, stats, weights, top_counts, top_masses, chunks, rows, adjusts, masks, \
                            words, scratch, out); \
    }
FOR_EACH_DTYPE(SAMPLE_ROWS)

// The tokens of a step scheduled ahead, taken from the step before it: for each `(t, row)` pair,
// `token_ids[t]` becomes the token sampled into `results[row]`. A row past `num_results` or a
// token past the vocabulary (nothing could be picked) gives token 0; the host drops that row's
// answer anyway. One thread per pair. Compiled once per dtype like the other kernels; T unused.
#define SAMPLED_TOKENS(T, S) \
    extern "C" __global__ void sampled_tokens_##S(const SampleOut* results, u32 num_results, const u32* pairs, \
                                                  u32 num_pairs, u32 vocab, u32* token_ids) { \
        pdl_enter(); \
        const u32 i = blockIdx.x * blockDim.x + threadIdx.x; \
        if (i >= num_pairs) return; \
        const u32 t = pairs[2 * i], row = pairs[2 * i + 1]; \
        const u32 token = row < num_results ? results[row].token : 0; \
        token_ids[t] = token < vocab ? token : 0; \
    }
FOR_EACH_DTYPE(SAMPLED_TOKENS)
