// The routed experts of a mixture-of-experts MLP (cuda/moe.rs): routing, grouping by expert,
// each chosen expert's gated MLP, and the weighted sum of each token's choices.
//
// Words: token t's j-th choice is its slot s = t * top_k + j, with expert topk_ids[s] and
// weight topk_weights[s]. Grouping sorts the n = T * top_k slots by expert: expert e's slots take
// the sorted positions [offsets[e], offsets[e + 1]), slot s sits at slot_pos[s], and sorted
// position p belongs to token sorted_token[p]. `active` lists the experts with a slot, in id
// order, and meta = {active experts, row tiles}. How one expert's slots are ordered among
// themselves is left to shared-memory atomics: no result depends on it, since every slot's row
// is computed on its own (per-token sums in the GEMV kernels, per-row mma results in the GEMM)
// and a token's slots are summed in j order.
//
// Two paths, chosen on the host from T alone (graphs capture a step's launches):
// - few slots per expert: moe_route_align (one block routes and groups), moe_gate_up_gemv (a
//   block per (column group, active expert) loops over that expert's tokens, so each chosen
//   expert's gate/up rows are read once), moe_down_gemv (a block per (row group, token) sums
//   the token's top_k slots in registers and writes `out`: no atomics, no second pass). Blocks
//   of one row group are adjacent for every token, so an expert two tokens chose is read from
//   the L2 the second time.
// - more: moe_route (a warp per token), moe_align (one block), the grouped GEMMs
//   moe_gate_up_gemm and moe_down_gemm (a block per (column tile, row tile), the row tiles cut
//   per expert by moe_align; one launch per projection over every expert, sized for the most
//   tiles T can give, surplus blocks exit), then moe_combine.
//
// Every kernel starts with pdl_enter: the weights it reads depend on the routing.

#define MOE_MAX_EXPERTS 1024
#define MOE_MAX_TOP_K 32
#define MOE_ALIGN_THREADS 1024
#define MOE_ROUTE_WARPS 8
#define MOE_GEMV_WARPS 8
// Tokens of one expert a pass of moe_gate_up_gemv over its rows serves.
#define MOE_GEMV_TOKENS 8

template <typename T> struct MoeIsF32 { static constexpr bool value = false; };
template <> struct MoeIsF32<float> { static constexpr bool value = true; };

// act 1: silu, 2: gelu_tanh (elementwise.cu), of the gate times the up value.
__device__ __forceinline__ float moe_gated(float g, float u, u32 act) {
    return (act == 1 ? silu(g) : gelu_tanh(g)) * u;
}

// ---------------------------------------------------------------------------------------------
// Routing and grouping

// (p, e) ranks before (q, f): the larger probability first, the lower id on ties.
__device__ __forceinline__ bool moe_ranks_before(float p, u32 e, float q, u32 f) {
    return p > q || (p == q && e < f);
}

// One warp routes one token: p = softmax(logits) in f32, then top_k rounds, each taking the
// best (p, e) that ranks after the previous round's choice (so no list of taken experts is
// kept). Lane 0 writes the ids and the weights, p or p over the chosen p's sum (in j order).
__device__ void moe_route_token(const float* logits, u32 num_experts, u32 top_k, u32 norm, u32* ids, float* weights) {
    const u32 lane = threadIdx.x & 31;
    float mx = NEG_INF;
    for (u32 e = lane; e < num_experts; e += 32) mx = fmaxf(mx, logits[e]);
    mx = warp_max(mx);
    float sum = 0.f;
    for (u32 e = lane; e < num_experts; e += 32) sum += expf(logits[e] - mx);
    sum = warp_sum(sum);
    float prev_p = __int_as_float(0x7f800000);
    u32 prev_e = 0;
    float total = 0.f;
    for (u32 j = 0; j < top_k; j++) {
        float best_p = -1.f;
        u32 best_e = 0xffffffffu;
        for (u32 e = lane; e < num_experts; e += 32) {
            const float p = expf(logits[e] - mx) / sum;
            if (moe_ranks_before(prev_p, prev_e, p, e) && moe_ranks_before(p, e, best_p, best_e)) {
                best_p = p;
                best_e = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float p = __shfl_xor_sync(0xffffffffu, best_p, o);
            const u32 e = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (moe_ranks_before(p, e, best_p, best_e)) {
                best_p = p;
                best_e = e;
            }
        }
        if (lane == 0) {
            ids[j] = best_e;
            weights[j] = best_p;
        }
        total += best_p;
        prev_p = best_p;
        prev_e = best_e;
    }
    if (norm && lane == 0) {
        for (u32 j = 0; j < top_k; j++) weights[j] = weights[j] / total;
    }
}

// An exclusive scan over the block's threads of V values each; `totals` gets the sums. Every
// thread calls it.
template <int V> __device__ __forceinline__ void moe_block_scan(const u32 (&v)[V], u32 (&excl)[V], u32 (&totals)[V]) {
    __shared__ u32 warp_s[V][32];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    u32 incl[V];
#pragma unroll
    for (int i = 0; i < V; i++) {
        incl[i] = v[i];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u32 x = __shfl_up_sync(0xffffffffu, incl[i], o);
            if (lane >= (u32)o) incl[i] += x;
        }
        if (lane == 31) warp_s[i][warp] = incl[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < V; i++) {
        u32 base = 0, total = 0;
        for (u32 w = 0; w < num_warps; w++) {
            const u32 s = warp_s[i][w];
            base += w < warp ? s : 0;
            total += s;
        }
        excl[i] = base + incl[i] - v[i];
        totals[i] = total;
    }
}

// Groups the n slots by expert (see the header). With block_m > 0 it also cuts each expert's
// rows into row tiles of block_m for the grouped GEMM: tiles[2 i], tiles[2 i + 1] = (expert,
// first sorted position) of tile i. One block of at least num_experts threads
// (MOE_ALIGN_THREADS at most); every thread calls it.
__device__ void moe_align_slots(const u32* topk_ids, u32 n, u32 top_k, u32 num_experts, u32 block_m, u32* offsets,
                                u32* active, u32* slot_pos, u32* sorted_token, u32* tiles, u32* meta) {
    __shared__ u32 count_s[MOE_MAX_EXPERTS];
    const u32 tid = threadIdx.x;
    for (u32 e = tid; e < num_experts; e += blockDim.x) count_s[e] = 0;
    __syncthreads();
    for (u32 s = tid; s < n; s += blockDim.x) atomicAdd(&count_s[topk_ids[s]], 1u);
    __syncthreads();
    const u32 c = tid < num_experts ? count_s[tid] : 0;
    // Per expert: its rows, whether it is active, its row tiles.
    const u32 v[3] = {c, c > 0 ? 1u : 0u, block_m ? (c + block_m - 1) / block_m : 0u};
    u32 excl[3], totals[3];
    moe_block_scan<3>(v, excl, totals);
    if (tid < num_experts) {
        offsets[tid] = excl[0];
        count_s[tid] = excl[0];  // from here on: the expert's next sorted position
        if (c > 0) active[excl[1]] = tid;
        for (u32 i = 0; i < v[2]; i++) {
            tiles[2 * (excl[2] + i)] = tid;
            tiles[2 * (excl[2] + i) + 1] = excl[0] + i * block_m;
        }
    }
    if (tid == 0) {
        offsets[num_experts] = n;
        meta[0] = totals[1];
        meta[1] = totals[2];
    }
    __syncthreads();
    for (u32 s = tid; s < n; s += blockDim.x) {
        const u32 p = atomicAdd(&count_s[topk_ids[s]], 1u);
        slot_pos[s] = p;
        sorted_token[p] = s / top_k;
    }
}

// logits: f32 [tokens, num_experts]; topk_ids, topk_weights: [tokens, top_k]. Grid:
// ceil(tokens / MOE_ROUTE_WARPS) blocks of MOE_ROUTE_WARPS warps, a warp per token.
__device__ __forceinline__ void moe_route_impl(const float* logits, u32* topk_ids, float* topk_weights, u32 tokens,
                                               u32 num_experts, u32 top_k, u32 norm) {
    pdl_enter();
    const u32 t = blockIdx.x * MOE_ROUTE_WARPS + (threadIdx.x >> 5);
    if (t >= tokens) return;
    moe_route_token(logits + (u64)t * num_experts, num_experts, top_k, norm, topk_ids + (u64)t * top_k,
                    topk_weights + (u64)t * top_k);
}

// moe_route and moe_align in one block (a thread per expert and a warp per token, no more: the
// host sizes it), for a few tokens (no row tiles).
__device__ __forceinline__ void moe_route_align_impl(const float* logits, u32* topk_ids, float* topk_weights,
                                                     u32 tokens, u32 num_experts, u32 top_k, u32 norm, u32* offsets,
                                                     u32* active, u32* slot_pos, u32* sorted_token, u32* meta) {
    pdl_enter();
    for (u32 t = threadIdx.x >> 5; t < tokens; t += blockDim.x >> 5) {
        moe_route_token(logits + (u64)t * num_experts, num_experts, top_k, norm, topk_ids + (u64)t * top_k,
                        topk_weights + (u64)t * top_k);
    }
    __syncthreads();
    moe_align_slots(topk_ids, tokens * top_k, top_k, num_experts, 0, offsets, active, slot_pos, sorted_token,
                    nullptr, meta);
}

// ---------------------------------------------------------------------------------------------
// Few slots: GEMV kernels (the loads of gemv.cu: 16-byte chunks, several in flight per lane)

// Adds one 8-element chunk c of the gate and up rows times each of M tokens' x rows.
template <typename T, int M>
__device__ __forceinline__ void moe_gate_up_chunk(const Raw8<T>& graw, const Raw8<T>& uraw, const T* const (&xr)[M],
                                                  u32 c, float (&acc)[2][M]) {
    float g[8], u[8];
    unpack8(graw, g);
    unpack8(uraw, u);
#pragma unroll
    for (int r = 0; r < M; r++) {
        Raw8<T> xraw;
        load_raw(xr[r] + (u64)c * 8, xraw);
        float xv[8];
        unpack8(xraw, xv);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            acc[0][r] = fmaf(g[i], xv[i], acc[0][r]);
            acc[1][r] = fmaf(u[i], xv[i], acc[1][r]);
        }
    }
}

// One pass of moe_gate_up_gemv over gate row j (wg) and up row j (wu) for m <= M tokens, the
// sorted positions first.. (the tokens past m repeat the last one, unstored): each lane's
// chunks of the two rows are loaded a round of U at a time, the next round issued before the
// loop turns (as in gemv.cu: the compiler then keeps the loads together). Every thread of the
// block calls it (it synchronizes).
template <typename T, int M>
__device__ __forceinline__ void moe_gate_up_pass(const T* x, const T* wg, const T* wu, T* act_out,
                                                 const u32* sorted_token, u32 first, u32 m, u32 k, u32 inter, u32 j,
                                                 u32 ksplit, u32 act) {
    constexpr int U = M <= 2 ? 4 : 1;  // the x rows of more tokens take the registers (128 at most)
    __shared__ float part_s[MOE_GEMV_WARPS][2 * M];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % ksplit;
    const T* xr[M];
#pragma unroll
    for (int r = 0; r < M; r++) xr[r] = x + (u64)sorted_token[first + min((u32)r, m - 1)] * k;
    float acc[2][M];
#pragma unroll
    for (int r = 0; r < M; r++) acc[0][r] = acc[1][r] = 0.f;
    const u32 chunks = k / 8, stride = 32 * ksplit;
    u32 c = part * 32 + lane;
    Raw8<T> graw[U], uraw[U];
    auto load_round = [&]() {
#pragma unroll
        for (int u = 0; u < U; u++) {
            load_raw(wg + (u64)(c + stride * u) * 8, graw[u]);
            load_raw(wu + (u64)(c + stride * u) * 8, uraw[u]);
        }
    };
    bool full = j < inter && c + stride * (U - 1) < chunks;
    if (full) load_round();
    if (j < inter) {
        while (full) {
#pragma unroll
            for (int u = 0; u < U; u++) moe_gate_up_chunk<T, M>(graw[u], uraw[u], xr, c + stride * u, acc);
            c += stride * U;
            full = c + stride * (U - 1) < chunks;
            if (full) load_round();
        }
        for (; c < chunks; c += stride) {
            Raw8<T> g, u;
            load_raw(wg + (u64)c * 8, g);
            load_raw(wu + (u64)c * 8, u);
            moe_gate_up_chunk<T, M>(g, u, xr, c, acc);
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int r = 0; r < M; r++) {
            const float s = warp_sum(acc[h][r]);
            if (lane == 0) part_s[warp][h * M + r] = s;
        }
    }
    __syncthreads();
    if (part == 0 && lane < m && j < inter) {
        float g = 0.f, u = 0.f;
        for (u32 p = 0; p < ksplit; p++) {
            g += part_s[warp + p][lane];
            u += part_s[warp + p][M + lane];
        }
        g = to_float(from_float<T>(g));
        u = to_float(from_float<T>(u));
        act_out[(u64)(first + lane) * inter + j] = from_float<T>(moe_gated(g, u, act));
    }
    __syncthreads();
}

// act_out[p, j] = act(gate_e x[token(p)]) * (up_e x[token(p)]) for each sorted position p of
// expert e = active[blockIdx.y]: x [T, k]; w = gate_up [num_experts * 2 * inter, k]; act_out
// [n, inter]. Column j takes `ksplit` warps (as in gemv.cu); the expert's tokens are taken up
// to MOE_GEMV_TOKENS at a time, each pass streaming the two rows once for all of them (the
// pass instantiated for 1, 2, 4 or 8 tokens). Gate and up are rounded to T before the
// activation, as the unfused ops store them. Grid: (ceil(inter / (MOE_GEMV_WARPS / ksplit)),
// min(num_experts, n)); blocks past the active experts exit.
template <typename T>
__device__ __forceinline__ void moe_gate_up_gemv_impl(const T* x, const T* w, T* act_out, const u32* sorted_token,
                                                      const u32* offsets, const u32* active, const u32* meta, u32 k,
                                                      u32 inter, u32 ksplit, u32 act) {
    pdl_enter();
    if (blockIdx.y >= meta[0]) return;
    const u32 e = active[blockIdx.y];
    const u32 first = offsets[e], count = offsets[e + 1] - first;
    const u32 j = blockIdx.x * (MOE_GEMV_WARPS / ksplit) + (threadIdx.x >> 5) / ksplit;
    const T* wg = w + ((u64)e * 2 * inter + j) * k;  // read only when j < inter
    const T* wu = wg + (u64)inter * k;
    for (u32 r0 = 0; r0 < count; r0 += MOE_GEMV_TOKENS) {
        const u32 m = min((u32)MOE_GEMV_TOKENS, count - r0);
        if (m == 1) {
            moe_gate_up_pass<T, 1>(x, wg, wu, act_out, sorted_token, first + r0, m, k, inter, j, ksplit, act);
        } else if (m == 2) {
            moe_gate_up_pass<T, 2>(x, wg, wu, act_out, sorted_token, first + r0, m, k, inter, j, ksplit, act);
        } else if (m <= 4) {
            moe_gate_up_pass<T, 4>(x, wg, wu, act_out, sorted_token, first + r0, m, k, inter, j, ksplit, act);
        } else {
            moe_gate_up_pass<T, MOE_GEMV_TOKENS>(x, wg, wu, act_out, sorted_token, first + r0, m, k, inter, j, ksplit,
                                                 act);
        }
    }
}

// out[t, i] = sum_j w[t, j] * down_e(j)[i, :] . act_out[slot_pos[t, j], :]: act [n, k]; w = down
// [num_experts * n_out, k]; out [T, n_out]. Row i takes `ksplit` warps; a warp's lanes are
// split among the token's top_k slots (32 / top_k lanes each, the rest idle), so that a lane
// streams one down row and one act row with addresses it computes once, a round of U chunks in
// flight (the next issued before the loop turns, as in gemv.cu). Each lane weights its dot
// product by its slot's weight, and the warp's sum is the token's. Grid: ceil(n_out /
// (MOE_GEMV_WARPS / ksplit)) * tokens blocks, the token fastest.
template <typename T>
__device__ __forceinline__ void moe_down_gemv_impl(const T* act, const T* w, T* out, const u32* topk_ids,
                                                   const float* topk_weights, const u32* slot_pos, u32 tokens,
                                                   u32 top_k, u32 k, u32 n_out, u32 ksplit) {
    constexpr int U = 8;
    __shared__ u32 expert_s[MOE_MAX_TOP_K], pos_s[MOE_MAX_TOP_K];
    __shared__ float weight_s[MOE_MAX_TOP_K];
    __shared__ float part_s[MOE_GEMV_WARPS];
    pdl_enter();
    const u32 t = blockIdx.x % tokens, group = blockIdx.x / tokens;
    if (threadIdx.x < top_k) {
        const u32 s = t * top_k + threadIdx.x;
        expert_s[threadIdx.x] = topk_ids[s];
        weight_s[threadIdx.x] = topk_weights[s];
        pos_s[threadIdx.x] = slot_pos[s];
    }
    __syncthreads();
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % ksplit;
    const u32 i = group * (MOE_GEMV_WARPS / ksplit) + warp / ksplit;
    const u32 lanes = 32 / top_k, j = lane / lanes, step = lanes * ksplit, chunks = k / 8;
    const bool busy = j < top_k && i < n_out;
    const T* wrow = busy ? w + ((u64)expert_s[j] * n_out + i) * k : w;
    const T* arow = busy ? act + (u64)pos_s[j] * k : act;
    float dot = 0.f;
    auto use = [&](const Raw8<T>& wraw, const Raw8<T>& araw) {
        float wv[8], av[8];
        unpack8(wraw, wv);
        unpack8(araw, av);
#pragma unroll
        for (int q = 0; q < 8; q++) dot = fmaf(wv[q], av[q], dot);
    };
    u32 c = part * lanes + lane % lanes;
    Raw8<T> wraw[U], araw[U];
    auto load_round = [&]() {
#pragma unroll
        for (int u = 0; u < U; u++) {
            load_raw(wrow + (u64)(c + step * u) * 8, wraw[u]);
            load_raw(arow + (u64)(c + step * u) * 8, araw[u]);
        }
    };
    bool full = busy && c + step * (U - 1) < chunks;
    if (full) load_round();
    if (busy) {
        while (full) {
#pragma unroll
            for (int u = 0; u < U; u++) use(wraw[u], araw[u]);
            c += step * U;
            full = c + step * (U - 1) < chunks;
            if (full) load_round();
        }
        for (; c < chunks; c += step) {
            Raw8<T> wtail, atail;
            load_raw(wrow + (u64)c * 8, wtail);
            load_raw(arow + (u64)c * 8, atail);
            use(wtail, atail);
        }
    }
    const float s = warp_sum(busy ? weight_s[j] * dot : 0.f);
    if (lane == 0) part_s[warp] = s;
    __syncthreads();
    if (part != 0 || lane != 0 || i >= n_out) return;
    float sum = 0.f;
    for (u32 p = 0; p < ksplit; p++) sum += part_s[warp + p];
    out[(u64)t * n_out + i] = from_float<T>(sum);
}

// ---------------------------------------------------------------------------------------------
// Many slots: grouped GEMM over the row tiles of every expert

#define MOE_GEMM_THREADS 128
#define MOE_BN 128
#define MOE_BK 32
#define MOE_STAGES 3
// A shared row's stride: 80 bytes, an odd number of 16-byte units, so that the 8 rows one
// ldmatrix phase reads fall in distinct banks.
#define MOE_LD (MOE_BK + 8)

// The row tile blockIdx.y of moe_align's list: its expert, first sorted position and rows (0
// for a block past the list). Every thread calls it.
__device__ __forceinline__ u32 moe_row_tile(const u32* tiles, const u32* meta, const u32* offsets, u32 block_m,
                                            u32& e, u32& row0) {
    const u32 tile = blockIdx.y;
    if (tile >= meta[1]) return 0;
    e = tiles[2 * tile];
    row0 = tiles[2 * tile + 1];
    return min(block_m, offsets[e + 1] - row0);
}

// One output tile of a grouped projection on tensor cores (mma.m16n8k16, f32 accumulators):
// rows are sorted positions row0.. of expert e, whose A rows are a[a_rows[p]] (x gathered by
// token) or a[p] (a_rows null: the activations, already in sorted order); B is the expert's
// weight [w_rows, k] (HF layout, so the mma's column-major B is its rows as they are). GATED:
// the block's BN weight rows are BN / 2 gate rows and the same BN / 2 up rows (inter = n_out
// further), each warp holding gate and up of the same columns, and it writes
// act(gate) * up of BN / 2 columns; else BN columns of the product. K in tiles of MOE_BK through
// MOE_STAGES shared buffers filled by cp.async; rows past the tile and columns past k read as
// zeros. 4 warps: WARPS_M x WARPS_N, each MT x NT mma tiles.
template <typename T, int BM, bool GATED>
__device__ __forceinline__ void moe_gemm_mma(const T* a, const u32* a_rows, const T* w, T* out, const u32* tiles,
                                             const u32* meta, const u32* offsets, u32 k, u32 n_out, u32 w_rows,
                                             u32 act) {
    constexpr int WARPS_M = BM == 16 ? 1 : 2, WARPS_N = 4 / WARPS_M;
    constexpr int MT = BM / WARPS_M / 16, NT = MOE_BN / WARPS_N / 8;
    static_assert(NT % 4 == 0, "gate and up halves of whole ldmatrix pairs");
    __shared__ __align__(16) T a_s[MOE_STAGES][BM][MOE_LD];
    __shared__ __align__(16) T b_s[MOE_STAGES][MOE_BN][MOE_LD];
    __shared__ u64 a_off_s[BM];
    pdl_enter();
    u32 e = 0, row0 = 0;
    const u32 rows = moe_row_tile(tiles, meta, offsets, BM, e, row0);
    if (rows == 0) return;
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 wm = warp / WARPS_N, wn = warp % WARPS_N;
    const u32 n0 = blockIdx.x * (GATED ? MOE_BN / 2 : MOE_BN);
    for (u32 r = tid; r < BM; r += MOE_GEMM_THREADS) {
        a_off_s[r] = r < rows ? (u64)(a_rows ? a_rows[row0 + r] : row0 + r) * k : 0;
    }
    __syncthreads();
    const T* w_e = w + (u64)e * w_rows * k;
    const u32 ktiles = (k + MOE_BK - 1) / MOE_BK;
    auto load_stage = [&](u32 stage, u32 kt) {
        const u32 k0 = kt * MOE_BK;
        for (u32 i = tid; i < BM * (MOE_BK / 8); i += MOE_GEMM_THREADS) {
            const u32 r = i / (MOE_BK / 8), kk = k0 + i % (MOE_BK / 8) * 8;
            const bool ok = r < rows && kk < k;
            cp_async16(smem_addr(&a_s[stage][r][kk - k0]), a + (ok ? a_off_s[r] + kk : 0), ok);
        }
        for (u32 i = tid; i < MOE_BN * (MOE_BK / 8); i += MOE_GEMM_THREADS) {
            const u32 r = i / (MOE_BK / 8), kk = k0 + i % (MOE_BK / 8) * 8;
            u32 wrow;
            bool ok;
            if constexpr (GATED) {
                const u32 up = r >= MOE_BN / 2, col = n0 + r - up * (MOE_BN / 2);
                ok = col < n_out;
                wrow = up * n_out + col;
            } else {
                wrow = n0 + r;
                ok = wrow < n_out;
            }
            ok = ok && kk < k;
            cp_async16(smem_addr(&b_s[stage][r][kk - k0]), w_e + (ok ? (u64)wrow * k + kk : 0), ok);
        }
    };
    // The first shared row of the warp's n8 tile nt: gate tiles then up tiles when GATED.
    auto b_row = [&](int nt) -> u32 {
        if constexpr (GATED) {
            return nt < NT / 2 ? wn * (NT / 2) * 8 + nt * 8 : MOE_BN / 2 + wn * (NT / 2) * 8 + (nt - NT / 2) * 8;
        } else {
            return wn * NT * 8 + nt * 8;
        }
    };
    float d[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) d[mt][nt][0] = d[mt][nt][1] = d[mt][nt][2] = d[mt][nt][3] = 0.f;
    }
#pragma unroll
    for (u32 s = 0; s < MOE_STAGES - 1; s++) {
        if (s < ktiles) load_stage(s, s);
        cp_async_commit();
    }
    for (u32 kt = 0; kt < ktiles; kt++) {
        cp_async_wait<MOE_STAGES - 2>();
        // Tile kt has landed for every thread, and every warp is done with the buffer refilled next.
        __syncthreads();
        if (kt + MOE_STAGES - 1 < ktiles) load_stage((kt + MOE_STAGES - 1) % MOE_STAGES, kt + MOE_STAGES - 1);
        cp_async_commit();
        const u32 st = kt % MOE_STAGES;
#pragma unroll
        for (int ks = 0; ks < MOE_BK / 16; ks++) {
            u32 af[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                ldmatrix_x4(af[mt], smem_addr(&a_s[st][wm * MT * 16 + mt * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]));
            }
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                u32 bf[4];
                const u32 row = b_row(2 * np) + ((lane >> 4) << 3) + (lane & 7);
                ldmatrix_x4(bf, smem_addr(&b_s[st][row][ks * 16 + ((lane >> 3) & 1) * 8]));
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma16816(d[mt][2 * np], af[mt], bf[0], bf[1], T());
                    mma16816(d[mt][2 * np + 1], af[mt], bf[2], bf[3], T());
                }
            }
        }
    }
    cp_async_wait<0>();
    const u32 g = lane >> 2, c2 = (lane & 3) * 2;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32 r = wm * MT * 16 + mt * 16 + g + h * 8;
            if (r >= rows) continue;
            T* out_row = out + (u64)(row0 + r) * n_out;
            if constexpr (GATED) {
#pragma unroll
                for (int nt = 0; nt < NT / 2; nt++) {
                    const u32 col = n0 + wn * (NT / 2) * 8 + nt * 8 + c2;
                    if (col >= n_out) continue;
                    float v[2];
#pragma unroll
                    for (int q = 0; q < 2; q++) {
                        const float gate = to_float(from_float<T>(d[mt][nt][2 * h + q]));
                        const float up = to_float(from_float<T>(d[mt][nt + NT / 2][2 * h + q]));
                        v[q] = moe_gated(gate, up, act);
                    }
                    *reinterpret_cast<u32*>(out_row + col) = pack2(v[0], v[1], T());
                }
            } else {
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const u32 col = n0 + wn * NT * 8 + nt * 8 + c2;
                    if (col >= n_out) continue;
                    *reinterpret_cast<u32*>(out_row + col) = pack2(d[mt][nt][2 * h], d[mt][nt][2 * h + 1], T());
                }
            }
        }
    }
}

// The f32 form of moe_gemm_mma (same grid and tiles): a thread per output, its dot product in
// f32 straight from global memory. For f32 runs, which compare with the CPU closely.
template <int BM, bool GATED>
__device__ __forceinline__ void moe_gemm_f32(const float* a, const u32* a_rows, const float* w, float* out,
                                             const u32* tiles, const u32* meta, const u32* offsets, u32 k, u32 n_out,
                                             u32 w_rows, u32 act) {
    pdl_enter();
    u32 e = 0, row0 = 0;
    const u32 rows = moe_row_tile(tiles, meta, offsets, BM, e, row0);
    constexpr u32 COLS = GATED ? MOE_BN / 2 : MOE_BN;
    const u32 n0 = blockIdx.x * COLS;
    const float* w_e = w + (u64)e * w_rows * k;
    for (u32 i = threadIdx.x; i < rows * COLS; i += blockDim.x) {
        const u32 r = i / COLS, col = n0 + i % COLS;
        if (col >= n_out) continue;
        const u32 p = row0 + r;
        const float* x = a + (u64)(a_rows ? a_rows[p] : p) * k;
        const float* w0 = w_e + (u64)col * k;
        float s0 = 0.f, s1 = 0.f;
        for (u32 q = 0; q < k; q++) {
            s0 = fmaf(x[q], w0[q], s0);
            if (GATED) s1 = fmaf(x[q], w0[(u64)n_out * k + q], s1);
        }
        out[(u64)p * n_out + col] = GATED ? moe_gated(s0, s1, act) : s0;
    }
}

template <typename T, int BM, bool GATED>
__device__ __forceinline__ void moe_gemm(const T* a, const u32* a_rows, const T* w, T* out, const u32* tiles,
                                         const u32* meta, const u32* offsets, u32 k, u32 n_out, u32 w_rows, u32 act) {
    if constexpr (MoeIsF32<T>::value) {
        moe_gemm_f32<BM, GATED>(a, a_rows, w, out, tiles, meta, offsets, k, n_out, w_rows, act);
    } else {
        moe_gemm_mma<T, BM, GATED>(a, a_rows, w, out, tiles, meta, offsets, k, n_out, w_rows, act);
    }
}

// out[t, :] = sum_j topk_weights[t, j] * y[slot_pos[t, j], :], in f32, rounded once; y, out:
// rows of `hidden` (a multiple of 8, 16-byte aligned). Grid: T blocks.
template <typename T>
__device__ __forceinline__ void moe_combine_impl(const T* y, T* out, const float* topk_weights, const u32* slot_pos,
                                                 u32 top_k, u32 hidden) {
    pdl_enter();
    const u32 t = blockIdx.x;
    for (u32 c = threadIdx.x * 8; c < hidden; c += blockDim.x * 8) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (u32 j = 0; j < top_k; j++) {
            const u32 s = t * top_k + j;
            const float weight = topk_weights[s];
            Raw8<T> raw;
            load_raw(y + (u64)slot_pos[s] * hidden + c, raw);
            float v[8];
            unpack8(raw, v);
#pragma unroll
            for (int q = 0; q < 8; q++) acc[q] = fmaf(weight, v[q], acc[q]);
        }
        store8(out + (u64)t * hidden + c, acc);
    }
}

// out[r, :] += sigmoid(gate[r]) * x[r, :]; gate f32 [rows]. One block per row.
template <typename T>
__device__ __forceinline__ void add_sigmoid_gated_impl(T* out, const T* x, const float* gate, u32 width) {
    pdl_enter();
    const u64 r = blockIdx.x;
    const float s = 1.f / (1.f + expf(-gate[r]));
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) {
        const u64 at = r * width + i;
        out[at] = from_float<T>(fmaf(s, to_float(x[at]), to_float(out[at])));
    }
}

#define MOE_GEMM(T, S, BM) \
    extern "C" __global__ void __launch_bounds__(MOE_GEMM_THREADS) moe_gate_up_gemm_m##BM##_##S( \
        const T* x, const u32* sorted_token, const T* w, T* act_out, const u32* tiles, const u32* meta, \
        const u32* offsets, u32 k, u32 inter, u32 act) { \
        moe_gemm<T, BM, true>(x, sorted_token, w, act_out, tiles, meta, offsets, k, inter, 2 * inter, act); \
    } \
    extern "C" __global__ void __launch_bounds__(MOE_GEMM_THREADS) moe_down_gemm_m##BM##_##S( \
        const T* act_in, const T* w, T* y, const u32* tiles, const u32* meta, const u32* offsets, u32 k, u32 hidden) { \
        moe_gemm<T, BM, false>(act_in, nullptr, w, y, tiles, meta, offsets, k, hidden, hidden, 0); \
    }

#define MOE(T, S) \
    extern "C" __global__ void __launch_bounds__(MOE_ROUTE_WARPS * 32) moe_route_##S( \
        const float* logits, u32* topk_ids, float* topk_weights, u32 tokens, u32 num_experts, u32 top_k, u32 norm) { \
        moe_route_impl(logits, topk_ids, topk_weights, tokens, num_experts, top_k, norm); \
    } \
    extern "C" __global__ void __launch_bounds__(MOE_ALIGN_THREADS) moe_align_##S( \
        const u32* topk_ids, u32 n, u32 top_k, u32 num_experts, u32 block_m, u32* offsets, u32* active, \
        u32* slot_pos, u32* sorted_token, u32* tiles, u32* meta) { \
        pdl_enter(); \
        moe_align_slots(topk_ids, n, top_k, num_experts, block_m, offsets, active, slot_pos, sorted_token, tiles, \
                        meta); \
    } \
    extern "C" __global__ void __launch_bounds__(MOE_ALIGN_THREADS) moe_route_align_##S( \
        const float* logits, u32* topk_ids, float* topk_weights, u32 tokens, u32 num_experts, u32 top_k, u32 norm, \
        u32* offsets, u32* active, u32* slot_pos, u32* sorted_token, u32* meta) { \
        moe_route_align_impl(logits, topk_ids, topk_weights, tokens, num_experts, top_k, norm, offsets, active, \
                             slot_pos, sorted_token, meta); \
    } \
    extern "C" __global__ void __launch_bounds__(MOE_GEMV_WARPS * 32, 2) moe_gate_up_gemv_##S( \
        const T* x, const T* w, T* act_out, const u32* sorted_token, const u32* offsets, const u32* active, \
        const u32* meta, u32 k, u32 inter, u32 ksplit, u32 act) { \
        moe_gate_up_gemv_impl<T>(x, w, act_out, sorted_token, offsets, active, meta, k, inter, ksplit, act); \
    } \
    extern "C" __global__ void __launch_bounds__(MOE_GEMV_WARPS * 32) moe_down_gemv_##S( \
        const T* act_in, const T* w, T* out, const u32* topk_ids, const float* topk_weights, const u32* slot_pos, \
        u32 tokens, u32 top_k, u32 k, u32 hidden, u32 ksplit) { \
        moe_down_gemv_impl<T>(act_in, w, out, topk_ids, topk_weights, slot_pos, tokens, top_k, k, hidden, ksplit); \
    } \
    extern "C" __global__ void moe_combine_##S(const T* y, T* out, const float* topk_weights, const u32* slot_pos, \
                                               u32 top_k, u32 hidden) { \
        moe_combine_impl<T>(y, out, topk_weights, slot_pos, top_k, hidden); \
    } \
    extern "C" __global__ void add_sigmoid_gated_##S(T* out, const T* x, const float* gate, u32 width) { \
        add_sigmoid_gated_impl<T>(out, x, gate, width); \
    } \
    MOE_GEMM(T, S, 16) \
    MOE_GEMM(T, S, 32) \
    MOE_GEMM(T, S, 64)
FOR_EACH_DTYPE(MOE)
