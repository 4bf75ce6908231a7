//! `moe`: the routed experts of a mixture-of-experts MLP (kernels/moe.cu), and
//! `add_sigmoid_gated`, the gate of a shared expert.
//!
//! A step routes each token on the device (softmax, top-k, renormalization), groups its slots
//! (token, choice) by expert on the device, and runs each chosen expert's gated MLP over its
//! tokens: nothing waits for the device and the launch shapes depend on T alone, so that a
//! captured decode step replays whatever the routing. Which kernels run is [`moe_path`]'s
//! choice:
//! - [`MoePath::Gemv`] for few slots per expert (see [`GEMV_MAX_SLOTS_PER_EXPERT`]): three
//!   launches, bound by reading the chosen experts' weights once;
//! - [`MoePath::Grouped`] otherwise: one grouped tensor-core GEMM per projection over every
//!   expert's row tiles, then a kernel that sums each token's slots.
//!
//! [`GpuMoeScratch`] holds the routing lists and the grouped activations between the kernels.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::gpu::{rows_config, to_u32};
use super::linear::{gemv_ksplit, GEMV_WARPS};
use super::{Gpu, GpuError, GpuTensor, GpuView, GpuViewMut};
use crate::device::MoeShape;
use crate::{DType, GatedActivation};

use super::compile::{self, KernelFamilies};

pub(crate) const KERNELS: &[KernelFamilies] = &[KernelFamilies {
    source: &compile::MOE,
    names: &[
        "moe_route",
        "moe_align",
        "moe_route_align",
        "moe_gate_up_gemv",
        "moe_down_gemv",
        "moe_combine",
        "add_sigmoid_gated",
        "moe_gate_up_gemm_m16",
        "moe_gate_up_gemm_m32",
        "moe_gate_up_gemm_m64",
        "moe_down_gemm_m16",
        "moe_down_gemm_m32",
        "moe_down_gemm_m64",
    ],
    large_shared: false,
}];

/// Mean slots per expert (`T * top_k / num_experts`) up to which a step takes the GEMV kernels.
/// On an H100 (examples/moe_bench.rs), Qwen3-30B-A3B's experts (128, top 8) at 8 and 16 tokens
/// (0.5 and 1 per expert) took 178 and 284 us there against 276 and 436 on the grouped GEMM, and
/// about the same at 64 (4 per expert: 658 against 630); Mixtral's (8, top 2) at 8 tokens (2 per
/// expert) 882 against 1404 us, at 32 (8 per expert) 2075 against 1557.
pub const GEMV_MAX_SLOTS_PER_EXPERT: usize = 2;
/// Mean slots per expert up to which the grouped GEMM takes row tiles of 16, of 64 past it. On
/// the H100, tiles of 16 against 64: Qwen3-30B-A3B at 64 tokens (4 per expert) 630 against 635
/// us, at 256 (16) 703 against 658; Mixtral at 32 tokens (8) 1557 against 1623, at 64 (16) 1972
/// against 1635.
const SMALL_TILE_MAX_SLOTS_PER_EXPERT: usize = 8;
/// Most experts and most choices per token the kernels take (`MOE_MAX_EXPERTS`,
/// `MOE_MAX_TOP_K`).
const MAX_EXPERTS: usize = 1024;
const MAX_TOP_K: usize = 32;
/// Threads of the one-block grouping kernels (`MOE_ALIGN_THREADS`), warps per block of the
/// routing kernel (`MOE_ROUTE_WARPS`), threads of a GEMM block and its tile's columns
/// (`MOE_GEMM_THREADS`, `MOE_BN`).
const ALIGN_THREADS: u32 = 1024;
// The grouping kernels take a thread per expert.
const _: () = assert!(MAX_EXPERTS <= ALIGN_THREADS as usize);
const ROUTE_WARPS: usize = 8;
const GEMM_THREADS: u32 = 128;
const GEMM_BN: usize = 128;
/// The smallest GEMM row tile: the one that can need the most tiles.
const MIN_BLOCK_M: usize = 16;

/// Which kernels a step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoePath {
    /// Route and group in one block; gate/up per (column group, active expert), looping over the
    /// expert's tokens; down per (row group, token), summing its slots.
    Gemv,
    /// Route, group into row tiles of `block_m` (16, 32 or 64) rows of one expert, one grouped
    /// GEMM per projection, then the weighted sum of each token's slots.
    Grouped { block_m: usize },
}

/// The kernels a step of `tokens` tokens takes, by the mean slots per expert (see
/// [`GEMV_MAX_SLOTS_PER_EXPERT`]): the GEMV kernels for a few, then the grouped GEMM with row
/// tiles of 16, and of 64 where the experts have more rows than that to share each weight tile.
/// Tiles of 32 are there for comparison (`moe_on_path`).
pub fn moe_path(tokens: usize, shape: MoeShape) -> MoePath {
    let slots = tokens * shape.top_k;
    let experts = shape.num_experts.max(1);
    if slots <= GEMV_MAX_SLOTS_PER_EXPERT * experts {
        return MoePath::Gemv;
    }
    let block_m = if slots <= SMALL_TILE_MAX_SLOTS_PER_EXPERT * experts { 16 } else { 64 };
    MoePath::Grouped { block_m }
}

/// The most row tiles `slots` slots can take over `num_experts` experts in tiles of `block_m`:
/// each active expert (at most `min(num_experts, slots)`) leaves at most one partial tile.
fn max_tiles(slots: usize, num_experts: usize, block_m: usize) -> usize {
    (slots + num_experts.min(slots) * (block_m - 1)) / block_m
}

/// The experts of one MoE layer on the device (see [`crate::device::Experts`]).
#[derive(Clone, Copy, Debug)]
pub struct GpuExperts<'a> {
    /// `[num_experts * 2 * inter, hidden]`: each expert's gate rows, then its up rows.
    pub gate_up: GpuView<'a>,
    /// `[num_experts * hidden, inter]`
    pub down: GpuView<'a>,
    pub shape: MoeShape,
    pub norm_topk_prob: bool,
    pub activation: GatedActivation,
}

/// The device buffers of MoE steps of up to `tokens` tokens, for one expert shape and dtype.
/// `n = tokens * top_k` slots; see kernels/moe.cu for the words.
pub struct GpuMoeScratch {
    tokens: usize,
    shape: MoeShape,
    dtype: DType,
    /// `[n]` each: a slot's expert, its weight, its sorted position.
    topk_ids: CudaSlice<u32>,
    topk_weights: CudaSlice<f32>,
    slot_pos: CudaSlice<u32>,
    /// `[n]`: the token of each sorted position.
    sorted_token: CudaSlice<u32>,
    /// `[num_experts + 1]`: where each expert's sorted positions start.
    offsets: CudaSlice<u32>,
    /// `[num_experts]`: the experts with a slot, in id order (the first `meta[0]`).
    active: CudaSlice<u32>,
    /// `[2]`: active experts, GEMM row tiles.
    meta: CudaSlice<u32>,
    /// `[max_tiles, 2]`: each row tile's (expert, first sorted position).
    tiles: CudaSlice<u32>,
    /// `[n, inter]`: `act(gate) * up` of each sorted position.
    act: GpuTensor,
    /// `[n, hidden]`: each sorted position's down projection (the grouped path).
    y: GpuTensor,
}

impl GpuMoeScratch {
    pub fn new(gpu: &Gpu, dtype: DType, tokens: usize, shape: MoeShape) -> Result<GpuMoeScratch, GpuError> {
        let n = tokens * shape.top_k;
        let e = shape.num_experts;
        let words = |len: usize| gpu.stream().alloc_zeros::<u32>(len.max(1));
        Ok(GpuMoeScratch {
            tokens,
            shape,
            dtype,
            topk_ids: words(n)?,
            topk_weights: gpu.stream().alloc_zeros::<f32>(n.max(1))?,
            slot_pos: words(n)?,
            sorted_token: words(n)?,
            offsets: words(e + 1)?,
            active: words(e)?,
            meta: words(2)?,
            tiles: words(2 * max_tiles(n, e, MIN_BLOCK_M))?,
            act: GpuTensor::uninit(gpu, dtype, n * shape.inter)?,
            y: GpuTensor::uninit(gpu, dtype, n * shape.hidden)?,
        })
    }

    /// Bytes [`GpuMoeScratch::new`] allocates.
    pub fn bytes(dtype: DType, tokens: usize, shape: MoeShape) -> usize {
        let n = tokens * shape.top_k;
        let e = shape.num_experts;
        let words = 4 * n + (e + 1) + e + 2 + 2 * max_tiles(n, e, MIN_BLOCK_M);
        words * 4 + n * (shape.inter + shape.hidden) * dtype.size_in_bytes()
    }

    /// Tokens a step may have.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

/// `out[t] = sum_j w[t, j] * down_e(act(gate_e x[t]) * up_e x[t])` over token t's top-k experts
/// `e` by the softmax of `router_logits` (see [`crate::device::MoeInput`]): `x`, `out`:
/// `[T, hidden]` in the experts' dtype; `router_logits`: f32 `[T, num_experts]`. Gate and up
/// are rounded to the dtype before the activation, and the activation and each expert's down
/// projection when stored, as the unfused ops store them; the weighted sum is f32, rounded once.
pub fn moe(
    gpu: &Gpu,
    x: GpuView<'_>,
    router_logits: GpuView<'_>,
    experts: &GpuExperts<'_>,
    scratch: &mut GpuMoeScratch,
    out: GpuViewMut<'_>,
) -> Result<(), GpuError> {
    let tokens = x.len() / experts.shape.hidden.max(1);
    moe_on_path(gpu, x, router_logits, experts, scratch, out, moe_path(tokens, experts.shape))
}

/// [`moe`] through the kernels of `path` whatever T is (tests and benchmarks compare the paths;
/// exported with the `bench-internals` feature).
pub fn moe_on_path(
    gpu: &Gpu,
    x: GpuView<'_>,
    router_logits: GpuView<'_>,
    experts: &GpuExperts<'_>,
    scratch: &mut GpuMoeScratch,
    out: GpuViewMut<'_>,
    path: MoePath,
) -> Result<(), GpuError> {
    let tokens = check_moe(x, router_logits, experts, scratch, &out);
    if tokens == 0 {
        return Ok(());
    }
    let step = Step { gpu, x, logits: router_logits, experts, scratch, out, tokens };
    match path {
        MoePath::Gemv => step.gemv(),
        MoePath::Grouped { block_m } => step.grouped(block_m),
    }
}

/// Checks the shapes and dtypes of a step; returns T.
fn check_moe(
    x: GpuView<'_>,
    logits: GpuView<'_>,
    ex: &GpuExperts<'_>,
    scratch: &GpuMoeScratch,
    out: &GpuViewMut<'_>,
) -> usize {
    let MoeShape { num_experts, top_k, inter, hidden } = ex.shape;
    assert!(hidden > 0 && hidden.is_multiple_of(8), "moe: hidden {hidden} is not a positive multiple of 8");
    assert!(inter > 0 && inter.is_multiple_of(8), "moe: inter {inter} is not a positive multiple of 8");
    assert!(num_experts <= MAX_EXPERTS, "moe: {num_experts} experts, the kernels take up to {MAX_EXPERTS}");
    assert!(
        top_k >= 1 && top_k <= num_experts.min(MAX_TOP_K),
        "moe: top_k {top_k} is not in 1..={}",
        num_experts.min(MAX_TOP_K)
    );
    assert_eq!(x.len() % hidden, 0, "moe: x has {} elements, not rows of hidden {hidden}", x.len());
    let tokens = x.len() / hidden;
    assert_eq!(out.len(), x.len(), "moe: out has {} elements, expected [{tokens}, {hidden}]", out.len());
    assert_eq!(
        logits.len(),
        tokens * num_experts,
        "moe: router_logits has {} elements, expected [{tokens}, {num_experts}]",
        logits.len()
    );
    assert_eq!(logits.dtype(), DType::F32, "moe: router_logits must be f32, not {:?}", logits.dtype());
    assert_eq!(
        ex.gate_up.len(),
        num_experts * 2 * inter * hidden,
        "moe: gate_up is not [{num_experts} * 2 * {inter}, {hidden}]"
    );
    assert_eq!(ex.down.len(), num_experts * hidden * inter, "moe: down is not [{num_experts} * {hidden}, {inter}]");
    for (what, dtype) in [("gate_up", ex.gate_up.dtype()), ("down", ex.down.dtype()), ("out", out.dtype())] {
        assert_eq!(dtype, x.dtype(), "moe: x is {:?} but {what} is {dtype:?}", x.dtype());
    }
    assert_eq!(scratch.shape, ex.shape, "moe: the scratch was made for {:?}, not {:?}", scratch.shape, ex.shape);
    assert_eq!(scratch.dtype, x.dtype(), "moe: the scratch holds {:?}, x is {:?}", scratch.dtype, x.dtype());
    assert!(tokens <= scratch.tokens, "moe: {tokens} tokens, the scratch holds {}", scratch.tokens);
    for (what, ptr) in [("x", x.ptr()), ("gate_up", ex.gate_up.ptr()), ("down", ex.down.ptr()), ("out", out.ptr())] {
        assert!(ptr.is_multiple_of(16), "moe: {what} is not 16-byte aligned");
    }
    tokens
}

/// One step's operands, while its kernels are issued.
struct Step<'s, 'a> {
    gpu: &'s Gpu,
    x: GpuView<'a>,
    logits: GpuView<'a>,
    experts: &'s GpuExperts<'a>,
    scratch: &'s mut GpuMoeScratch,
    out: GpuViewMut<'a>,
    tokens: usize,
}

impl Step<'_, '_> {
    fn gemv(self) -> Result<(), GpuError> {
        let Step { gpu, x, logits, experts: ex, scratch: s, out, tokens } = self;
        let MoeShape { num_experts, top_k, inter, hidden } = ex.shape;
        let dtype = x.dtype();
        let slots = tokens * top_k;
        let (t_u32, e_u32, k_u32) = (to_u32("moe", "T", tokens), num_experts as u32, top_k as u32);
        let (inter_u32, hidden_u32) = (to_u32("moe", "inter", inter), to_u32("moe", "hidden", hidden));
        let norm = u32::from(ex.norm_topk_prob);
        let (logits_ptr, ids, weights) = (logits.ptr(), gpu.index_ptr(&s.topk_ids), gpu.index_ptr(&s.topk_weights));
        let (offsets, active, meta) = (gpu.index_ptr(&s.offsets), gpu.index_ptr(&s.active), gpu.index_ptr(&s.meta));
        let (slot_pos, sorted_token) = (gpu.index_ptr(&s.slot_pos), gpu.index_ptr(&s.sorted_token));
        let mut launch = gpu.launch_builder("moe_route_align", dtype);
        launch.arg(&logits_ptr).arg(&ids).arg(&weights).arg(&t_u32).arg(&e_u32).arg(&k_u32).arg(&norm);
        launch.arg(&offsets).arg(&active).arg(&slot_pos).arg(&sorted_token).arg(&meta);
        // SAFETY: the arguments match the kernel's parameters; every list holds T * top_k slots
        // or num_experts (+ 1) entries (`GpuMoeScratch::new`, `check_moe`).
        unsafe { launch.launch(one_block(route_align_threads(tokens, num_experts))) }?;

        let (x_ptr, gate_up, act_ptr) = (x.ptr(), ex.gate_up.ptr(), s.act.view().ptr());
        let act = activation_code(ex.activation);
        let ksplit = gemv_ksplit(2 * inter, hidden);
        let ksplit_u32 = ksplit as u32;
        let cfg = LaunchConfig {
            grid_dim: (
                to_u32("moe", "GEMV blocks", inter.div_ceil(GEMV_WARPS / ksplit)),
                num_experts.min(slots) as u32,
                1,
            ),
            block_dim: (GEMV_WARPS as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = gpu.launch_builder("moe_gate_up_gemv", dtype);
        launch.arg(&x_ptr).arg(&gate_up).arg(&act_ptr).arg(&sorted_token).arg(&offsets).arg(&active).arg(&meta);
        launch.arg(&hidden_u32).arg(&inter_u32).arg(&ksplit_u32).arg(&act);
        // SAFETY: the arguments match the kernel's parameters; x holds T rows of hidden, act
        // T * top_k rows of inter, gate_up num_experts * 2 * inter rows of hidden.
        unsafe { launch.launch(cfg) }?;

        let (down, out_ptr) = (ex.down.ptr(), out.ptr());
        let ksplit = gemv_ksplit(hidden, top_k * inter);
        let ksplit_u32 = ksplit as u32;
        let groups = hidden.div_ceil(GEMV_WARPS / ksplit);
        let cfg = LaunchConfig {
            grid_dim: (to_u32("moe", "GEMV blocks", groups * tokens), 1, 1),
            block_dim: (GEMV_WARPS as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = gpu.launch_builder("moe_down_gemv", dtype);
        launch.arg(&act_ptr).arg(&down).arg(&out_ptr).arg(&ids).arg(&weights).arg(&slot_pos);
        launch.arg(&t_u32).arg(&k_u32).arg(&inter_u32).arg(&hidden_u32).arg(&ksplit_u32);
        // SAFETY: the arguments match the kernel's parameters; out holds T rows of hidden, down
        // num_experts * hidden rows of inter.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    fn grouped(self, block_m: usize) -> Result<(), GpuError> {
        let Step { gpu, x, logits, experts: ex, scratch: s, out, tokens } = self;
        let MoeShape { num_experts, top_k, inter, hidden } = ex.shape;
        let (gate_up_gemm, down_gemm) = match block_m {
            16 => ("moe_gate_up_gemm_m16", "moe_down_gemm_m16"),
            32 => ("moe_gate_up_gemm_m32", "moe_down_gemm_m32"),
            64 => ("moe_gate_up_gemm_m64", "moe_down_gemm_m64"),
            _ => panic!("moe: no GEMM for row tiles of {block_m}"),
        };
        let dtype = x.dtype();
        let slots = tokens * top_k;
        let (t_u32, n_u32, e_u32, k_u32) =
            (to_u32("moe", "T", tokens), to_u32("moe", "slots", slots), num_experts as u32, top_k as u32);
        let (inter_u32, hidden_u32, block_m_u32) =
            (to_u32("moe", "inter", inter), to_u32("moe", "hidden", hidden), block_m as u32);
        let norm = u32::from(ex.norm_topk_prob);
        let (logits_ptr, ids, weights) = (logits.ptr(), gpu.index_ptr(&s.topk_ids), gpu.index_ptr(&s.topk_weights));
        let (offsets, active, meta) = (gpu.index_ptr(&s.offsets), gpu.index_ptr(&s.active), gpu.index_ptr(&s.meta));
        let (slot_pos, sorted_token, tiles) =
            (gpu.index_ptr(&s.slot_pos), gpu.index_ptr(&s.sorted_token), gpu.index_ptr(&s.tiles));

        let mut launch = gpu.launch_builder("moe_route", dtype);
        launch.arg(&logits_ptr).arg(&ids).arg(&weights).arg(&t_u32).arg(&e_u32).arg(&k_u32).arg(&norm);
        let cfg = LaunchConfig {
            grid_dim: (to_u32("moe", "T", tokens.div_ceil(ROUTE_WARPS)), 1, 1),
            block_dim: (ROUTE_WARPS as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's parameters; logits hold T rows of
        // num_experts, ids and weights T rows of top_k.
        unsafe { launch.launch(cfg) }?;

        let mut launch = gpu.launch_builder("moe_align", dtype);
        launch.arg(&ids).arg(&n_u32).arg(&k_u32).arg(&e_u32).arg(&block_m_u32);
        launch.arg(&offsets).arg(&active).arg(&slot_pos).arg(&sorted_token).arg(&tiles).arg(&meta);
        // SAFETY: the arguments match the kernel's parameters; `tiles` holds the most row tiles
        // of the smallest block_m, so of this one too.
        unsafe { launch.launch(one_block(ALIGN_THREADS)) }?;

        let row_tiles = to_u32("moe", "row tiles", max_tiles(slots, num_experts, block_m));
        let (x_ptr, gate_up, act_ptr) = (x.ptr(), ex.gate_up.ptr(), s.act.view().ptr());
        let act = activation_code(ex.activation);
        let mut launch = gpu.launch_builder(gate_up_gemm, dtype);
        launch.arg(&x_ptr).arg(&sorted_token).arg(&gate_up).arg(&act_ptr).arg(&tiles).arg(&meta).arg(&offsets);
        launch.arg(&hidden_u32).arg(&inter_u32).arg(&act);
        // SAFETY: the arguments match the kernel's parameters; the grid's row tiles past
        // `meta[1]` exit, and each tile's rows lie in its expert's sorted positions.
        unsafe { launch.launch(gemm_config(inter.div_ceil(GEMM_BN / 2), row_tiles)) }?;

        let (down, y_ptr) = (ex.down.ptr(), s.y.view().ptr());
        let mut launch = gpu.launch_builder(down_gemm, dtype);
        launch.arg(&act_ptr).arg(&down).arg(&y_ptr).arg(&tiles).arg(&meta).arg(&offsets);
        launch.arg(&inter_u32).arg(&hidden_u32);
        // SAFETY: as above; y holds T * top_k rows of hidden.
        unsafe { launch.launch(gemm_config(hidden.div_ceil(GEMM_BN), row_tiles)) }?;

        let out_ptr = out.ptr();
        let mut launch = gpu.launch_builder("moe_combine", dtype);
        launch.arg(&y_ptr).arg(&out_ptr).arg(&weights).arg(&slot_pos).arg(&k_u32).arg(&hidden_u32);
        // SAFETY: the arguments match the kernel's parameters; out holds T rows of hidden.
        unsafe { launch.launch(rows_config(tokens, hidden / 8)) }?;
        Ok(())
    }
}

/// Threads of `moe_route_align`: a thread per expert (its grouping scans one value per expert
/// and thread) and a warp per token, no more: at batch 1 its few slots are grouped by one or a
/// few warps rather than waiting on the barriers of 32 (Qwen3-30B-A3B: 128 threads, not 1024).
fn route_align_threads(tokens: usize, num_experts: usize) -> u32 {
    let threads = num_experts.max(32 * tokens).next_multiple_of(32).clamp(64, ALIGN_THREADS as usize);
    threads as u32
}

fn one_block(threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (1, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

fn gemm_config(column_tiles: usize, row_tiles: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (to_u32("moe", "column tiles", column_tiles), row_tiles, 1),
        block_dim: (GEMM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernels' code for `act`: 1 silu, 2 gelu_tanh.
fn activation_code(act: GatedActivation) -> u32 {
    match act {
        GatedActivation::Silu => 1,
        GatedActivation::GeluTanh => 2,
    }
}

/// `out[r, :] += sigmoid(gate[r]) * x[r, :]`: `out`, `x`: `[rows, width]` in one dtype; `gate`:
/// f32 `[rows]`.
pub fn add_sigmoid_gated(
    gpu: &Gpu,
    out: GpuViewMut<'_>,
    x: GpuView<'_>,
    gate: GpuView<'_>,
    width: usize,
) -> Result<(), GpuError> {
    assert!(width > 0, "add_sigmoid_gated: width is 0");
    assert_eq!(out.len() % width, 0, "add_sigmoid_gated: out has {} elements, not rows of {width}", out.len());
    let rows = out.len() / width;
    assert_eq!(x.len(), out.len(), "add_sigmoid_gated: x has {} elements, out {}", x.len(), out.len());
    assert_eq!(gate.len(), rows, "add_sigmoid_gated: gate has {} elements, expected [{rows}, 1]", gate.len());
    assert_eq!(gate.dtype(), DType::F32, "add_sigmoid_gated: gate must be f32, not {:?}", gate.dtype());
    assert_eq!(x.dtype(), out.dtype(), "add_sigmoid_gated: x is {:?} but out is {:?}", x.dtype(), out.dtype());
    if rows == 0 {
        return Ok(());
    }
    let (out_ptr, x_ptr, gate_ptr, width_u32) =
        (out.ptr(), x.ptr(), gate.ptr(), to_u32("add_sigmoid_gated", "width", width));
    let mut launch = gpu.launch_builder("add_sigmoid_gated", out.dtype());
    launch.arg(&out_ptr).arg(&x_ptr).arg(&gate_ptr).arg(&width_u32);
    // SAFETY: the arguments match the kernel's parameters; out and x hold `rows` rows of
    // `width`, gate `rows` values.
    unsafe { launch.launch(rows_config(rows, width)) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3_30B: MoeShape = MoeShape { num_experts: 128, top_k: 8, inter: 768, hidden: 2048 };
    const MIXTRAL: MoeShape = MoeShape { num_experts: 8, top_k: 2, inter: 14336, hidden: 4096 };

    #[test]
    fn few_slots_take_the_gemv_and_row_tiles_follow_the_rows_per_expert() {
        assert_eq!(moe_path(1, QWEN3_30B), MoePath::Gemv);
        assert_eq!(moe_path(32, QWEN3_30B), MoePath::Gemv);
        assert_eq!(moe_path(33, QWEN3_30B), MoePath::Grouped { block_m: 16 });
        assert_eq!(moe_path(128, QWEN3_30B), MoePath::Grouped { block_m: 16 });
        assert_eq!(moe_path(129, QWEN3_30B), MoePath::Grouped { block_m: 64 });
        assert_eq!(moe_path(8192, QWEN3_30B), MoePath::Grouped { block_m: 64 });
        assert_eq!(moe_path(8, MIXTRAL), MoePath::Gemv);
        assert_eq!(moe_path(9, MIXTRAL), MoePath::Grouped { block_m: 16 });
        assert_eq!(moe_path(32, MIXTRAL), MoePath::Grouped { block_m: 16 });
        assert_eq!(moe_path(256, MIXTRAL), MoePath::Grouped { block_m: 64 });
    }

    #[test]
    fn the_grid_has_a_tile_for_every_routing() {
        // Every way of spreading `slots` over the experts needs at most `max_tiles` tiles.
        for (slots, experts, block_m) in [(65, 8, 16), (100, 128, 16), (2048, 128, 16), (300, 3, 64), (7, 128, 32)] {
            let bound = max_tiles(slots, experts, block_m);
            // All in one expert; one slot in each of the others and the rest in one; evenly.
            let one = slots.div_ceil(block_m);
            let active = experts.min(slots);
            let singles = (active - 1) + (slots - (active - 1)).div_ceil(block_m);
            let even: usize =
                (0..active).map(|e| (slots / active + usize::from(e < slots % active)).div_ceil(block_m)).sum();
            assert!(one <= bound && singles <= bound && even <= bound, "{slots} slots, {experts} experts, {block_m}");
        }
        assert_eq!(max_tiles(2048, 128, 16), 248);
    }

    #[test]
    fn scratch_bytes_count_every_buffer() {
        let shape = MoeShape { num_experts: 4, top_k: 2, inter: 16, hidden: 8 };
        // 10 slots: four lists of 10, offsets 5, active 4, meta 2, tiles 2 * 4; act and y.
        let words = 40 + 5 + 4 + 2 + 2 * max_tiles(10, 4, 16);
        assert_eq!(GpuMoeScratch::bytes(DType::BF16, 5, shape), words * 4 + 10 * 24 * 2);
    }
}
