//! Rotary position embedding on the device, with the frequency tables kept on the device.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

use super::gpu::{rows_config, to_u32, Launch};
use super::ops::same_dtype;
use super::{Fp8View, Gemms, Gpu, GpuError, GpuView, GpuViewMut};
use crate::{DType, Heads};

use super::compile::{self, KernelFamilies};

/// The entry points of the RoPE ops; the GEMVs with RoPE in their epilogue are gemv.cu's and
/// fp8_gemv.cu's (loaded with the FP8 products).
pub(crate) const KERNELS: &[KernelFamilies] = &[
    KernelFamilies {
        source: &compile::ROPE,
        names: &[
            "rope",
            "qkv_rope_cache",
            "qkv_rope_cache_vec8",
            "qkv_norm_rope_cache_d64",
            "qkv_norm_rope_cache_d128",
            "qkv_norm_rope_cache_d256",
        ],
        large_shared: false,
    },
    KernelFamilies {
        source: &compile::GEMV,
        names: &["gemv_rope_cache_m1", "gemv_rope_cache_m2", "gemv_rope_cache_m3", "gemv_rope_cache_m4"],
        large_shared: false,
    },
];

/// The inverse frequencies of one model, on the device: `[2, half]`, the table for short
/// positions then the one for positions from `long_start` on (LongRoPE; without it both rows
/// are the one table and `long_start` is never reached).
pub struct GpuRopeTable {
    /// `[2, half]`
    inv_freq: CudaSlice<f32>,
    half: usize,
    long_start: u32,
    attention_scaling: f32,
}

impl GpuRopeTable {
    /// `inv_freq`: `[rotary_dim / 2]`. `long`: the LongRoPE table (same length) and the first
    /// position that uses it.
    pub fn new(
        gpu: &Gpu,
        inv_freq: &[f32],
        long: Option<(u32, &[f32])>,
        attention_scaling: f32,
    ) -> Result<GpuRopeTable, GpuError> {
        let (long_start, long_freq) = long.unwrap_or((u32::MAX, inv_freq));
        assert_eq!(
            long_freq.len(),
            inv_freq.len(),
            "GpuRopeTable: the long table has {} frequencies, the short one {}",
            long_freq.len(),
            inv_freq.len()
        );
        let both: Vec<f32> = inv_freq.iter().chain(long_freq).copied().collect();
        Ok(GpuRopeTable { inv_freq: gpu.upload(&both)?, half: inv_freq.len(), long_start, attention_scaling })
    }

    /// Dimensions rotated per head: `2 * inv_freq.len()`.
    pub fn rotary_dim(&self) -> usize {
        2 * self.half
    }
}

/// Rotary embedding, GPT-NeoX / HF `rotate_half` layout, in place, as [`crate::cpu::rope`]:
/// `x`: `[positions.len(), num_heads, head_dim]`; only the first `table.rotary_dim()` dims of each
/// head rotate, the rest pass through. A token uses the long table when its position is at least
/// the table's `long_start`.
pub fn rope(
    gpu: &Gpu,
    x: GpuViewMut<'_>,
    positions: &impl DevicePtr<u32>,
    num_heads: usize,
    head_dim: usize,
    table: &GpuRopeTable,
) -> Result<(), GpuError> {
    let tokens = positions.len();
    assert_eq!(
        x.len(),
        tokens * num_heads * head_dim,
        "rope: x has {} elements, expected [{tokens} tokens, {num_heads} heads, {head_dim}]",
        x.len()
    );
    assert!(table.rotary_dim() <= head_dim, "rope: {} frequencies rotate more than head_dim {head_dim}", table.half);
    if tokens == 0 || num_heads == 0 || table.half == 0 {
        return Ok(());
    }
    let (x_ptr, pos_ptr, freq_ptr) = (x.ptr(), gpu.index_ptr(positions), gpu.index_ptr(&table.inv_freq));
    let heads = to_u32("rope", "num_heads", num_heads);
    let dim = to_u32("rope", "head_dim", head_dim);
    let half = table.half as u32;
    let mut launch = gpu.launch_builder("rope", x.dtype());
    launch
        .arg(&x_ptr)
        .arg(&pos_ptr)
        .arg(&freq_ptr)
        .arg(&table.long_start)
        .arg(&heads)
        .arg(&dim)
        .arg(&half)
        .arg(&table.attention_scaling);
    // SAFETY: the arguments match the kernel's parameters; x holds `tokens` rows of every head.
    unsafe { launch.launch(rows_config(tokens, num_heads * table.half)) }?;
    Ok(())
}

/// Where a step's rows sit and what turns their q and k: each row's position and cache slot
/// (`[T]` each; a negative slot is padding, its K and V not written), the layer's heads and its
/// RoPE table.
pub struct QkvRows<'a, P, S> {
    pub positions: &'a P,
    pub slot_mapping: &'a S,
    pub heads: Heads,
    pub table: &'a GpuRopeTable,
}

/// Where the attention block's input step writes: q `[T, num_heads * head_dim]`, and the paged
/// K and V caches, `[num_slots, num_kv_heads * head_dim]` each.
pub struct QkvOut<'a> {
    pub q: GpuViewMut<'a>,
    pub k_cache: GpuViewMut<'a>,
    pub v_cache: GpuViewMut<'a>,
}

/// The attention block's input step in one launch: splits `qkv`: `[T, (num_heads + 2 *
/// num_kv_heads) * head_dim]`, rotates q and k as [`rope`] does, writes q to `out.q` and k, v to
/// the paged cache at each row's slot as [`super::reshape_and_cache`] does. Gives the same bits
/// as those ops one after another.
pub fn qkv_rope_cache(
    gpu: &Gpu,
    qkv: GpuView<'_>,
    rows: &QkvRows<'_, impl DevicePtr<u32>, impl DevicePtr<i64>>,
    out: QkvOut<'_>,
) -> Result<(), GpuError> {
    let op = "qkv_rope_cache";
    let QkvRows { positions, slot_mapping, heads, table } = *rows;
    let Heads { num_heads, num_kv_heads, head_dim } = heads;
    let QkvOut { q: q_out, k_cache, v_cache } = out;
    let tokens = positions.len();
    let kv_size = check_qkv_operands(op, rows, &qkv, &q_out, [&k_cache, &v_cache]);
    assert!(table.rotary_dim() <= head_dim, "{op}: {} frequencies rotate more than head_dim {head_dim}", table.half);
    if tokens == 0 {
        return Ok(());
    }
    let (qkv_ptr, pos_ptr, slots_ptr, freq_ptr) =
        (qkv.ptr(), gpu.index_ptr(positions), gpu.index_ptr(slot_mapping), gpu.index_ptr(&table.inv_freq));
    let (q_ptr, kc_ptr, vc_ptr) = (q_out.ptr(), k_cache.ptr(), v_cache.ptr());
    let (heads, kv_heads) = (to_u32(op, "num_heads", num_heads), to_u32(op, "num_kv_heads", num_kv_heads));
    let (dim, half) = (to_u32(op, "head_dim", head_dim), table.half as u32);
    let num_slots = (k_cache.len() / kv_size) as i64;
    // By 8 elements where the dims and buffers allow 16-byte accesses (freq_ptr: the table's
    // rows are `half` floats, so a multiple of 8 keeps the long row aligned too).
    let vec8 = head_dim.is_multiple_of(8)
        && table.half.is_multiple_of(8)
        && [qkv_ptr, freq_ptr, q_ptr, kc_ptr, vc_ptr].iter().all(|p| p.is_multiple_of(16));
    let (kernel, unit) = if vec8 { ("qkv_rope_cache_vec8", 8) } else { (op, 1) };
    let mut launch = gpu.launch_builder(kernel, qkv.dtype());
    launch.arg(&qkv_ptr).arg(&pos_ptr).arg(&slots_ptr).arg(&freq_ptr).arg(&table.long_start);
    launch.arg(&q_ptr).arg(&kc_ptr).arg(&vc_ptr).arg(&heads).arg(&kv_heads).arg(&dim).arg(&half);
    launch.arg(&table.attention_scaling).arg(&num_slots);
    let work = ((num_heads + num_kv_heads) * (head_dim - table.half) + kv_size) / unit;
    // SAFETY: the arguments match the kernel's parameters; qkv and q_out hold `tokens` rows, and
    // the kernel checks every slot against the cache.
    unsafe { launch.launch(qkv_rope_cache_config(tokens, work)) }?;
    Ok(())
}

/// The per-head RMS norms of q and k (`[head_dim]` f32 weights each) and their epsilon.
#[derive(Clone, Copy)]
pub struct QkNorms<'a> {
    pub q: GpuView<'a>,
    pub k: GpuView<'a>,
    pub eps: f32,
}

/// Head sizes [`qkv_norm_rope_cache`] is compiled for (every dim rotated).
const QK_NORM_HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Warps per block of `qkv_norm_rope_cache` (`QKN_WARPS`), one per head.
const QK_NORM_WARPS: usize = 4;

/// Whether [`qkv_norm_rope_cache`] takes heads of `head_dim` rotated by `table`.
pub fn qkv_norm_rope_cache_fits(head_dim: usize, table: &GpuRopeTable) -> bool {
    QK_NORM_HEAD_DIMS.contains(&head_dim) && table.rotary_dim() == head_dim
}

/// [`qkv_rope_cache`] with q and k each RMS-normed per head before the rotation, as
/// [`super::rms_norm_inplace`] on q and k between the split and the rotation would (rounded to
/// the dtype in between; only the order of the sum of squares differs), in one launch: a warp
/// per head. Needs [`qkv_norm_rope_cache_fits`].
pub fn qkv_norm_rope_cache(
    gpu: &Gpu,
    qkv: GpuView<'_>,
    rows: &QkvRows<'_, impl DevicePtr<u32>, impl DevicePtr<i64>>,
    norms: QkNorms<'_>,
    out: QkvOut<'_>,
) -> Result<(), GpuError> {
    let op = "qkv_norm_rope_cache";
    let QkvRows { positions, slot_mapping, heads, table } = *rows;
    let Heads { num_heads, num_kv_heads, head_dim } = heads;
    let QkvOut { q: q_out, k_cache, v_cache } = out;
    let tokens = positions.len();
    let kv_size = check_qkv_operands(op, rows, &qkv, &q_out, [&k_cache, &v_cache]);
    assert!(qkv_norm_rope_cache_fits(head_dim, table), "{op}: head_dim {head_dim} with {} rotated", table.rotary_dim());
    for (what, w) in [("q", norms.q), ("k", norms.k)] {
        assert_eq!(w.dtype(), DType::F32, "{op}: the {what} norm's weight is not f32");
        assert_eq!(w.len(), head_dim, "{op}: the {what} norm's weight is not [{head_dim}]");
    }
    if tokens == 0 {
        return Ok(());
    }
    let (qkv_ptr, pos_ptr, slots_ptr, freq_ptr) =
        (qkv.ptr(), gpu.index_ptr(positions), gpu.index_ptr(slot_mapping), gpu.index_ptr(&table.inv_freq));
    let (qn_ptr, kn_ptr) = (norms.q.ptr(), norms.k.ptr());
    let (q_ptr, kc_ptr, vc_ptr) = (q_out.ptr(), k_cache.ptr(), v_cache.ptr());
    let (heads, kv_heads) = (to_u32(op, "num_heads", num_heads), to_u32(op, "num_kv_heads", num_kv_heads));
    let num_slots = (k_cache.len() / kv_size) as i64;
    let kernel = match head_dim {
        64 => "qkv_norm_rope_cache_d64",
        128 => "qkv_norm_rope_cache_d128",
        256 => "qkv_norm_rope_cache_d256",
        _ => unreachable!("{op}: no kernel for head_dim {head_dim} (QK_NORM_HEAD_DIMS)"),
    };
    let mut launch = gpu.launch_builder(kernel, qkv.dtype());
    launch.arg(&qkv_ptr).arg(&pos_ptr).arg(&slots_ptr).arg(&freq_ptr).arg(&table.long_start);
    launch.arg(&qn_ptr).arg(&kn_ptr).arg(&norms.eps);
    launch.arg(&q_ptr).arg(&kc_ptr).arg(&vc_ptr).arg(&heads).arg(&kv_heads);
    launch.arg(&table.attention_scaling).arg(&num_slots);
    let units = num_heads + 2 * num_kv_heads;
    let cfg = LaunchConfig {
        grid_dim: (to_u32(op, "tokens", tokens), to_u32(op, "head groups", units.div_ceil(QK_NORM_WARPS)), 1),
        block_dim: ((QK_NORM_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's parameters; qkv and q_out hold `tokens` rows, the
    // norms `head_dim` floats each, and the kernel checks every slot against the cache.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Checks the operands of the fused attention-input kernels: `qkv`: `[T, (num_heads + 2 *
/// num_kv_heads) * head_dim]`, a slot per position, `q_out`: `[T, num_heads * head_dim]`, and K
/// and V caches of whole slots of the same size, all in one dtype. Returns a slot's width.
fn check_qkv_operands(
    op: &str,
    rows: &QkvRows<'_, impl DevicePtr<u32>, impl DevicePtr<i64>>,
    qkv: &GpuView<'_>,
    q_out: &GpuViewMut<'_>,
    [k_cache, v_cache]: [&GpuViewMut<'_>; 2],
) -> usize {
    let (heads, tokens, slots) = (rows.heads, rows.positions.len(), rows.slot_mapping.len());
    let (q_size, kv_size) = (heads.num_heads * heads.head_dim, heads.num_kv_heads * heads.head_dim);
    assert!(kv_size > 0, "{op}: no KV heads");
    assert_eq!(slots, tokens, "{op}: {slots} slots for {tokens} positions");
    assert_eq!(qkv.len(), tokens * (q_size + 2 * kv_size), "{op}: qkv is not [{tokens}, q + 2 kv]");
    assert_eq!(q_out.len(), tokens * q_size, "{op}: q_out is not [{tokens}, {q_size}]");
    assert_eq!(k_cache.len(), v_cache.len(), "{op}: k_cache and v_cache differ in size");
    assert_eq!(k_cache.len() % kv_size, 0, "{op}: cache is not whole slots of {kv_size}");
    for dtype in [q_out.dtype(), k_cache.dtype(), v_cache.dtype()] {
        same_dtype(op, qkv.dtype(), dtype);
    }
    kv_size
}

/// Threads per block of `qkv_rope_cache` when a token's elements are spread over several blocks.
const SPREAD_THREADS: usize = 128;

/// One block per token for large batches; for a few tokens (decode at small batch), each token's
/// `work` elements spread over blocks of `SPREAD_THREADS`, so that the kernel is not one SM's
/// work (8B at batch 1: 3584 elements, 28 blocks instead of one of 1024 threads).
fn qkv_rope_cache_config(tokens: usize, work: usize) -> LaunchConfig {
    let spread = if tokens >= 64 { 1 } else { work.div_ceil(SPREAD_THREADS).min(64) };
    if spread <= 1 {
        return rows_config(tokens, work);
    }
    LaunchConfig {
        grid_dim: (tokens as u32, spread as u32, 1),
        block_dim: (SPREAD_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The qkv projection and [`qkv_rope_cache`] together: `x`: `[m, k]` times the fused projection
/// `w`: `[(num_heads + 2 * num_kv_heads) * head_dim, k]` (no bias), rotated and written as
/// [`qkv_rope_cache`] does, with `m` = the number of positions. Where the GEMV kernel takes the
/// product and every dim of a head rotates, one kernel does both (`gemv_rope_cache` in
/// kernels/gemv.cu), the same bits, and `qkv` is left as it was; otherwise [`super::linear`] into
/// `qkv`: `[m, (num_heads + 2 * num_kv_heads) * head_dim]` and then [`qkv_rope_cache`].
pub fn linear_qkv_rope_cache(
    gpu: &Gpu,
    gemms: &Gemms,
    x: GpuView<'_>,
    w: GpuView<'_>,
    rows: &QkvRows<'_, impl DevicePtr<u32>, impl DevicePtr<i64>>,
    qkv: GpuViewMut<'_>,
    out: QkvOut<'_>,
) -> Result<(), GpuError> {
    let op = "linear_qkv_rope_cache";
    let QkvRows { positions, slot_mapping, heads, table } = *rows;
    let Heads { num_heads, num_kv_heads, head_dim } = heads;
    let m = positions.len();
    let (q_size, kv_size) = (num_heads * head_dim, num_kv_heads * head_dim);
    let n = q_size + 2 * kv_size;
    assert!(n > 0 && w.len().is_multiple_of(n), "{op}: w is not [{n}, k]");
    let k = w.len() / n;
    assert_eq!(x.len(), m * k, "{op}: x is not [{m}, {k}]");
    assert_eq!(slot_mapping.len(), m, "{op}: {} slots for {m} positions", slot_mapping.len());
    same_dtype(op, x.dtype(), w.dtype());
    let ksplit = super::linear::gemv_ksplit(n, k);
    let pairs = super::linear::GEMV_WARPS / ksplit / 2;
    let fused = m > 0
        && super::linear::gemv_fits(x, m, k, w)
        && table.rotary_dim() == head_dim
        && pairs >= 1
        && table.half.is_multiple_of(pairs);
    if !fused {
        let held = qkv.len() / n.max(1);
        assert!(held >= m, "{op}: qkv holds {held} rows of {n}, not {m}");
        let mut qkv = qkv.rows(0..m, n);
        super::linear(gpu, gemms, x, m, k, w, n, None, qkv.reborrow())?;
        return qkv_rope_cache(gpu, qkv.as_view(), rows, out);
    }
    let args = RopeEpilogueArgs::new(gpu, op, x, rows, out, k, ksplit);
    let kernel = match m {
        1 => "gemv_rope_cache_m1",
        2 => "gemv_rope_cache_m2",
        3 => "gemv_rope_cache_m3",
        4 => "gemv_rope_cache_m4",
        _ => unreachable!("gemv_fits admits 1..={} rows", super::linear::GEMV_MAX_M),
    };
    let (x_ptr, w_ptr) = (x.ptr(), w.ptr());
    let cfg = LaunchConfig {
        grid_dim: (to_u32(op, "blocks", n / (2 * pairs)), 1, 1),
        block_dim: (super::linear::GEMV_WARPS as u32 * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.launch_builder(kernel, x.dtype());
    launch.arg(&x_ptr).arg(&w_ptr);
    args.push(&mut launch);
    // SAFETY: the arguments match the kernel's parameters; x holds m rows of k, w n rows of k
    // (whole 16-byte chunks, aligned: `gemv_fits`), q_out m rows of q_size, the caches whole
    // slots (each checked by the kernel), and every block's pairs lie in one head
    // (half % pairs == 0, head_dim = 2 * half).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Whether [`linear_fp8_qkv_rope_cache`] takes `m` rows of `x` through the projection `w`:
/// where the tensor-core FP8 GEMV takes the product (1 to 4 rows of bf16 or f16 activations,
/// blocks of 64 columns or more) and every dim of a head rotates, in pairs a tile of 8 fills.
pub fn fp8_qkv_rope_cache_fits(x: GpuView<'_>, m: usize, w: Fp8View<'_>, heads: Heads, table: &GpuRopeTable) -> bool {
    m > 0
        && super::fp8::gemv_fits(x, m)
        && super::fp8::takes_tensor_cores(x.dtype(), w)
        && table.rotary_dim() == heads.head_dim
        && table.half.is_multiple_of(8)
}

/// The qkv projection over FP8 weights and [`qkv_rope_cache`] in one kernel
/// (`fp8_gemv_rope_cache` in kernels/fp8_gemv.cu; [`fp8_qkv_rope_cache_fits`] holds): `x`:
/// `[m, k]` times `w`: `[(num_heads + 2 * num_kv_heads) * head_dim, k]` (no bias), rotated and
/// written as [`qkv_rope_cache`] does, the same bits as the product into a buffer followed by it.
pub fn linear_fp8_qkv_rope_cache(
    gpu: &Gpu,
    x: GpuView<'_>,
    w: Fp8View<'_>,
    rows: &QkvRows<'_, impl DevicePtr<u32>, impl DevicePtr<i64>>,
    out: QkvOut<'_>,
) -> Result<(), GpuError> {
    let op = "linear_fp8_qkv_rope_cache";
    let QkvRows { positions, heads, table, .. } = *rows;
    let Heads { num_heads, num_kv_heads, head_dim } = heads;
    let m = positions.len();
    assert!(fp8_qkv_rope_cache_fits(x, m, w, heads, table), "{op}: the FP8 GEMV does not take this product");
    let (q_size, kv_size) = (num_heads * head_dim, num_kv_heads * head_dim);
    let n = q_size + 2 * kv_size;
    let k = w.cols();
    assert_eq!(w.rows(), n, "{op}: w is not [{n}, {k}]");
    assert_eq!(x.len(), m * k, "{op}: x is not [{m}, {k}]");
    let kernel = match m {
        1 => "fp8_gemv_rope_cache_m1",
        2 => "fp8_gemv_rope_cache_m2",
        3 => "fp8_gemv_rope_cache_m3",
        4 => "fp8_gemv_rope_cache_m4",
        _ => unreachable!("the FP8 GEMV takes 1 to 4 rows"),
    };
    // A tile: 8 rotary pairs (16 rows of w); head_dim = 2 * half with half % 8 == 0, so n % 16 == 0.
    let tiles = n / super::fp8::TC_TILE_ROWS;
    let ksplit = super::fp8::tc_ksplit(tiles, k);
    let args = RopeEpilogueArgs::new(gpu, op, x, rows, out, k, ksplit);
    let x_ptr = x.ptr();
    let (w_ptr, grid) = w.kernel_args();
    let warps = super::linear::GEMV_WARPS;
    let cfg = LaunchConfig {
        grid_dim: (to_u32(op, "blocks", tiles.div_ceil(warps / ksplit)), 1, 1),
        block_dim: (warps as u32 * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.launch_builder(kernel, x.dtype());
    launch.arg(&x_ptr).arg(&w_ptr);
    args.push(&mut launch);
    launch.arg(&grid);
    // SAFETY: the arguments match the kernel's parameters; x holds m rows of k (16-byte aligned),
    // w n rows of k codes with their grid (blocks of 64 columns or more: the fit), q_out m rows of
    // q_size, the caches whole slots (each checked by the kernel).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// The arguments the GEMVs with RoPE in their epilogue (`gemv_rope_cache`, `fp8_gemv_rope_cache`)
/// take after x and w, in their order, from the step's rows and the outputs (checked here).
struct RopeEpilogueArgs {
    q: u64,
    k_cache: u64,
    v_cache: u64,
    positions: u64,
    slot_mapping: u64,
    inv_freq: u64,
    long_start: u32,
    k: u32,
    ksplit: u32,
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    attention_scaling: f32,
    num_slots: i64,
}

impl RopeEpilogueArgs {
    fn new(
        gpu: &Gpu,
        op: &'static str,
        x: GpuView<'_>,
        rows: &QkvRows<'_, impl DevicePtr<u32>, impl DevicePtr<i64>>,
        out: QkvOut<'_>,
        k: usize,
        ksplit: usize,
    ) -> RopeEpilogueArgs {
        let QkvRows { positions, slot_mapping, heads, table } = *rows;
        let Heads { num_heads, num_kv_heads, head_dim } = heads;
        let m = positions.len();
        let (q_size, kv_size) = (num_heads * head_dim, num_kv_heads * head_dim);
        assert_eq!(slot_mapping.len(), m, "{op}: {} slots for {m} positions", slot_mapping.len());
        let QkvOut { q, k_cache, v_cache } = out;
        assert_eq!(q.len(), m * q_size, "{op}: q_out is not [{m}, {q_size}]");
        assert!(kv_size > 0 && k_cache.len().is_multiple_of(kv_size), "{op}: cache is not whole slots of {kv_size}");
        assert_eq!(k_cache.len(), v_cache.len(), "{op}: k_cache and v_cache differ in size");
        for dtype in [q.dtype(), k_cache.dtype(), v_cache.dtype()] {
            same_dtype(op, x.dtype(), dtype);
        }
        RopeEpilogueArgs {
            q: q.ptr(),
            k_cache: k_cache.ptr(),
            v_cache: v_cache.ptr(),
            positions: gpu.index_ptr(positions),
            slot_mapping: gpu.index_ptr(slot_mapping),
            inv_freq: gpu.index_ptr(&table.inv_freq),
            long_start: table.long_start,
            k: to_u32(op, "k", k),
            ksplit: ksplit as u32,
            num_heads: to_u32(op, "num_heads", num_heads),
            num_kv_heads: to_u32(op, "num_kv_heads", num_kv_heads),
            head_dim: to_u32(op, "head_dim", head_dim),
            attention_scaling: table.attention_scaling,
            num_slots: (k_cache.len() / kv_size) as i64,
        }
    }

    fn push<'a>(&'a self, launch: &mut Launch<'a>) {
        launch.arg(&self.q).arg(&self.k_cache).arg(&self.v_cache).arg(&self.positions).arg(&self.slot_mapping);
        launch.arg(&self.inv_freq).arg(&self.long_start).arg(&self.k).arg(&self.ksplit).arg(&self.num_heads);
        launch.arg(&self.num_kv_heads).arg(&self.head_dim).arg(&self.attention_scaling).arg(&self.num_slots);
    }
}
