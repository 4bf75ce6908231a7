//! The row-wise ops: embedding lookup, RMSNorm (plain, fused with the residual add, and per
//! head), the q/k/v split, the gated activations, the row gather and the soft-cap of f32 rows. One block per row (the
//! gated activations: a row spread over several).

use cudarc::driver::{DevicePtr, LaunchConfig};

use super::fp8::{RowCodesArg, RowCodesMut};
use super::gpu::{rows_config, to_u32};
use super::{Gpu, GpuError, GpuView, GpuViewMut};
use crate::{DType, GatedActivation};

use super::compile::{self, KernelFamilies};

/// The entry points of the norm and elementwise ops.
pub(crate) const KERNELS: &[KernelFamilies] = &[
    KernelFamilies {
        source: &compile::NORM,
        names: &[
            "rms_norm",
            "rms_norm_from_f32",
            "rms_norm_vec8",
            "rms_norm_from_f32_vec8",
            "add_rms_norm",
            "add_rms_norm_f32_residual",
            "add_rms_norm_vec8",
            "add_rms_norm_f32_residual_vec8",
            "add_normed_rms_norm_vec8",
            "add_normed_rms_norm_f32_residual_vec8",
        ],
        large_shared: false,
    },
    KernelFamilies {
        source: &compile::ELEMENTWISE,
        names: &[
            "embedding",
            "embedding_to_f32",
            "split_qkv",
            "silu_and_mul",
            "gelu_tanh_and_mul",
            "gather_rows",
            "softcap",
        ],
        large_shared: false,
    },
];

/// `out[t, :] = table[ids[t], :] * scale`; `table` is `[vocab, hidden]`, `out` is `[ids.len(), hidden]`,
/// in the activation dtype or f32 (an f32 residual stream). Ids must be below `vocab` (an id past
/// it gives a zero row).
pub fn embedding(
    gpu: &Gpu,
    ids: &impl DevicePtr<u32>,
    table: GpuView<'_>,
    hidden: usize,
    scale: f32,
    out: GpuViewMut<'_>,
) -> Result<(), GpuError> {
    assert!(hidden > 0, "embedding: hidden is 0");
    assert_eq!(table.len() % hidden, 0, "embedding: table has {} elements, not rows of {hidden}", table.len());
    assert_eq!(
        out.len(),
        ids.len() * hidden,
        "embedding: out has {} elements, expected [{}, {hidden}]",
        out.len(),
        ids.len()
    );
    // `out` is in the table's dtype, or f32 (an f32 residual stream).
    let kernel = if out.dtype() == DType::F32 { "embedding_to_f32" } else { "embedding" };
    if kernel == "embedding" {
        same_dtype("embedding", table.dtype(), out.dtype());
    }
    if ids.is_empty() {
        return Ok(());
    }
    let (ids_ptr, table_ptr, out_ptr) = (gpu.index_ptr(ids), table.ptr(), out.ptr());
    let (hidden_u32, vocab) =
        (to_u32("embedding", "hidden", hidden), to_u32("embedding", "vocab", table.len() / hidden));
    let mut launch = gpu.launch_builder(kernel, table.dtype());
    launch.arg(&ids_ptr).arg(&table_ptr).arg(&out_ptr).arg(&hidden_u32).arg(&vocab).arg(&scale);
    // SAFETY: the arguments match the kernel's parameters; every index it forms is checked above.
    unsafe { launch.launch(rows_config(ids.len(), hidden)) }?;
    Ok(())
}

/// Row-wise RMSNorm: `out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w`. `x`, `out`: `[rows, w.len()]`
/// in the activation dtype (`x` may be f32: an f32 residual stream); `w` f32. `codes`, where
/// given, also gets `out`'s rows quantized (see [`super::fp8::GpuRowCodes`]).
pub fn rms_norm(
    gpu: &Gpu,
    x: GpuView<'_>,
    w: GpuView<'_>,
    eps: f32,
    out: GpuViewMut<'_>,
    codes: Option<RowCodesMut<'_>>,
) -> Result<(), GpuError> {
    let hidden = check_rows("rms_norm", x.len(), w);
    assert_eq!(out.len(), x.len(), "rms_norm: out has {} elements, x has {}", out.len(), x.len());
    let rows = x.len() / hidden;
    let codes = RowCodesMut::arg(codes.as_ref(), "rms_norm", rows, hidden);
    let norm = NormLaunch { w, rows, hidden, eps, codes };
    if x.dtype() == DType::F32 && out.dtype() != DType::F32 {
        return launch_rms_norm(gpu, "rms_norm_from_f32", x.ptr(), out.ptr(), out.dtype(), norm);
    }
    same_dtype("rms_norm", x.dtype(), out.dtype());
    launch_rms_norm(gpu, "rms_norm", x.ptr(), out.ptr(), x.dtype(), norm)
}

/// In-place row-wise RMSNorm over rows of `w.len()` (used per head for q/k norm).
pub fn rms_norm_inplace(gpu: &Gpu, x: GpuViewMut<'_>, w: GpuView<'_>, eps: f32) -> Result<(), GpuError> {
    let hidden = check_rows("rms_norm_inplace", x.len(), w);
    let norm = NormLaunch { w, rows: x.len() / hidden, hidden, eps, codes: RowCodesArg::NONE };
    launch_rms_norm(gpu, "rms_norm", x.ptr(), x.ptr(), x.dtype(), norm)
}

/// Fused residual add + RMSNorm: `residual += x; out = rms_norm(residual, w, eps)`. The sum is
/// rounded to the residual's dtype before it is normalised, as a stored residual would be. The
/// residual is in the activation dtype of `x` and `out`, or f32 (then the stream between layers
/// keeps f32 precision while the layers compute in bf16/f16). `codes` as in [`rms_norm`].
pub fn add_rms_norm(
    gpu: &Gpu,
    residual: GpuViewMut<'_>,
    x: GpuView<'_>,
    w: GpuView<'_>,
    eps: f32,
    out: GpuViewMut<'_>,
    codes: Option<RowCodesMut<'_>>,
) -> Result<(), GpuError> {
    let hidden = check_rows("add_rms_norm", residual.len(), w);
    assert_eq!(x.len(), residual.len(), "add_rms_norm: x has {} elements, residual {}", x.len(), residual.len());
    assert_eq!(out.len(), residual.len(), "add_rms_norm: out has {} elements, residual {}", out.len(), residual.len());
    same_dtype("add_rms_norm", x.dtype(), out.dtype());
    let kernel = if residual.dtype() == DType::F32 && x.dtype() != DType::F32 {
        "add_rms_norm_f32_residual"
    } else {
        same_dtype("add_rms_norm", residual.dtype(), x.dtype());
        "add_rms_norm"
    };
    let rows = residual.len() / hidden;
    let codes = RowCodesMut::arg(codes.as_ref(), "add_rms_norm", rows, hidden);
    if rows == 0 {
        return Ok(());
    }
    let (res_ptr, x_ptr, w_ptr, out_ptr) = (residual.ptr(), x.ptr(), w.ptr(), out.ptr());
    let hidden_u32 = to_u32("add_rms_norm", "hidden", hidden);
    let (kernel, width) = match norm_vec8(kernel, hidden, &[res_ptr, x_ptr, w_ptr, out_ptr]) {
        Some(vec8) => (vec8, hidden / 8),
        None => (kernel, hidden),
    };
    let mut launch = gpu.launch_builder(kernel, x.dtype());
    launch.arg(&res_ptr).arg(&x_ptr).arg(&w_ptr).arg(&out_ptr).arg(&hidden_u32).arg(&eps).arg(&codes);
    // SAFETY: the arguments match the kernel's parameters; all buffers hold `rows` rows, and so
    // do the codes, where given (checked).
    unsafe { launch.launch(rows_config(rows, width)) }?;
    Ok(())
}

/// `residual += rms_norm(x, x_w, eps); out = rms_norm(residual, w, eps)`, the normed x rounded
/// to its dtype as [`rms_norm_inplace`] would store it: in one kernel where rows are whole
/// 16-byte chunks, else [`rms_norm_inplace`] on `x` and [`add_rms_norm`] (so `x` may be left
/// normed). `x_w` and `w` are f32 `[hidden]`; the residual as in [`add_rms_norm`]; `codes` as in
/// [`rms_norm`].
#[allow(clippy::too_many_arguments)]
pub fn add_normed_rms_norm(
    gpu: &Gpu,
    residual: GpuViewMut<'_>,
    mut x: GpuViewMut<'_>,
    x_w: GpuView<'_>,
    w: GpuView<'_>,
    eps: f32,
    out: GpuViewMut<'_>,
    codes: Option<RowCodesMut<'_>>,
) -> Result<(), GpuError> {
    let op = "add_normed_rms_norm";
    let hidden = check_rows(op, residual.len(), w);
    assert_eq!(x_w.len(), hidden, "{op}: x's norm weight has {} elements, rows {hidden}", x_w.len());
    assert_eq!(x_w.dtype(), DType::F32, "{op}: x's norm weight must be f32, not {:?}", x_w.dtype());
    assert_eq!(x.len(), residual.len(), "{op}: x has {} elements, residual {}", x.len(), residual.len());
    assert_eq!(out.len(), residual.len(), "{op}: out has {} elements, residual {}", out.len(), residual.len());
    same_dtype(op, x.dtype(), out.dtype());
    let kernel = if residual.dtype() == DType::F32 && x.dtype() != DType::F32 {
        "add_normed_rms_norm_f32_residual_vec8"
    } else {
        same_dtype(op, residual.dtype(), x.dtype());
        "add_normed_rms_norm_vec8"
    };
    let (res_ptr, x_ptr, xw_ptr, w_ptr, out_ptr) = (residual.ptr(), x.ptr(), x_w.ptr(), w.ptr(), out.ptr());
    if !hidden.is_multiple_of(8) || ![res_ptr, x_ptr, xw_ptr, w_ptr, out_ptr].iter().all(|p| p.is_multiple_of(16)) {
        rms_norm_inplace(gpu, x.reborrow(), x_w, eps)?;
        return add_rms_norm(gpu, residual, x.as_view(), w, eps, out, codes);
    }
    let rows = residual.len() / hidden;
    let codes = RowCodesMut::arg(codes.as_ref(), op, rows, hidden);
    if rows == 0 {
        return Ok(());
    }
    let hidden_u32 = to_u32(op, "hidden", hidden);
    let mut launch = gpu.launch_builder(kernel, x.dtype());
    launch.arg(&res_ptr).arg(&x_ptr).arg(&xw_ptr).arg(&w_ptr).arg(&out_ptr).arg(&hidden_u32).arg(&eps).arg(&codes);
    // SAFETY: the arguments match the kernel's parameters; all buffers hold `rows` rows, both
    // weights `hidden` floats, the codes (where given) `rows` rows, and every row is whole
    // 16-byte chunks.
    unsafe { launch.launch(rows_config(rows, hidden / 8)) }?;
    Ok(())
}

/// Splits the fused projection `qkv`: `[T, q_size + 2 * kv_size]` into `q`: `[T, q_size]`,
/// `k`: `[T, kv_size]` and `v`: `[T, kv_size]`.
pub fn split_qkv(
    gpu: &Gpu,
    qkv: GpuView<'_>,
    q_size: usize,
    kv_size: usize,
    q: GpuViewMut<'_>,
    k: GpuViewMut<'_>,
    v: GpuViewMut<'_>,
) -> Result<(), GpuError> {
    let width = q_size + 2 * kv_size;
    assert!(width > 0, "split_qkv: empty rows");
    assert_eq!(qkv.len() % width, 0, "split_qkv: qkv has {} elements, not rows of {width}", qkv.len());
    let tokens = qkv.len() / width;
    assert_eq!(q.len(), tokens * q_size, "split_qkv: q is not [{tokens}, {q_size}]");
    assert_eq!(k.len(), tokens * kv_size, "split_qkv: k is not [{tokens}, {kv_size}]");
    assert_eq!(v.len(), tokens * kv_size, "split_qkv: v is not [{tokens}, {kv_size}]");
    for dtype in [q.dtype(), k.dtype(), v.dtype()] {
        same_dtype("split_qkv", qkv.dtype(), dtype);
    }
    if tokens == 0 {
        return Ok(());
    }
    let (qkv_ptr, q_ptr, k_ptr, v_ptr) = (qkv.ptr(), q.ptr(), k.ptr(), v.ptr());
    let (q_u32, kv_u32) = (to_u32("split_qkv", "q_size", q_size), to_u32("split_qkv", "kv_size", kv_size));
    let mut launch = gpu.launch_builder("split_qkv", qkv.dtype());
    launch.arg(&qkv_ptr).arg(&q_ptr).arg(&k_ptr).arg(&v_ptr).arg(&q_u32).arg(&kv_u32);
    // SAFETY: the arguments match the kernel's parameters; all buffers hold `tokens` rows.
    unsafe { launch.launch(rows_config(tokens, width)) }?;
    Ok(())
}

/// `out[r, j] = act(gate_up[r, j]) * gate_up[r, inter + j]` (SiLU, or GELU with the tanh
/// approximation: `gelu_pytorch_tanh`); `gate_up`: `[rows, 2 * inter]`, `out`: `[rows, inter]`.
/// `codes`, where given, also gets `out`'s rows quantized (see [`super::fp8::GpuRowCodes`]).
pub fn gated_activation(
    gpu: &Gpu,
    act: GatedActivation,
    gate_up: GpuView<'_>,
    inter: usize,
    out: GpuViewMut<'_>,
    codes: Option<RowCodesMut<'_>>,
) -> Result<(), GpuError> {
    let op = match act {
        GatedActivation::Silu => "silu_and_mul",
        GatedActivation::GeluTanh => "gelu_tanh_and_mul",
    };
    act_and_mul(gpu, op, gate_up, inter, out, codes)
}

/// `dst[i, :] = src[indices[i], :]`; `src`: `[src_rows, width]`, `dst`: `[indices.len(), width]`
/// (e.g. the rows whose logits are wanted). Indices must be below `src_rows` (one past it gives
/// a zero row).
pub fn gather_rows(
    gpu: &Gpu,
    src: GpuView<'_>,
    width: usize,
    indices: &impl DevicePtr<u32>,
    dst: GpuViewMut<'_>,
) -> Result<(), GpuError> {
    assert!(width > 0, "gather_rows: width is 0");
    assert_eq!(src.len() % width, 0, "gather_rows: src has {} elements, not rows of {width}", src.len());
    assert_eq!(dst.len(), indices.len() * width, "gather_rows: dst is not [{}, {width}]", indices.len());
    same_dtype("gather_rows", src.dtype(), dst.dtype());
    if indices.is_empty() {
        return Ok(());
    }
    let (src_ptr, idx_ptr, dst_ptr) = (src.ptr(), gpu.index_ptr(indices), dst.ptr());
    let (width_u32, src_rows) =
        (to_u32("gather_rows", "width", width), to_u32("gather_rows", "rows", src.len() / width));
    let mut launch = gpu.launch_builder("gather_rows", src.dtype());
    launch.arg(&src_ptr).arg(&idx_ptr).arg(&dst_ptr).arg(&width_u32).arg(&src_rows);
    // SAFETY: the arguments match the kernel's parameters; the kernel checks each index.
    unsafe { launch.launch(rows_config(indices.len(), width)) }?;
    Ok(())
}

/// `x = cap * tanh(x / cap)` in place, as [`crate::cpu::softcap`]; `x` f32 (the logits), `cap > 0`.
pub fn softcap(gpu: &Gpu, x: GpuViewMut<'_>, cap: f32) -> Result<(), GpuError> {
    assert!(cap > 0.0, "softcap: the cap must be positive, not {cap}");
    assert_eq!(x.dtype(), DType::F32, "softcap: f32 values only, not {:?}", x.dtype());
    if x.is_empty() {
        return Ok(());
    }
    let (x_ptr, n) = (x.ptr(), x.len() as u64);
    let mut launch = gpu.launch_builder("softcap", DType::F32);
    launch.arg(&x_ptr).arg(&n).arg(&cap);
    let blocks = x.len().div_ceil(256).min(4096);
    let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's parameters; the kernel reads and writes `n` floats.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

fn act_and_mul(
    gpu: &Gpu,
    op: &'static str,
    gate_up: GpuView<'_>,
    inter: usize,
    out: GpuViewMut<'_>,
    codes: Option<RowCodesMut<'_>>,
) -> Result<(), GpuError> {
    assert!(inter > 0, "{op}: inter is 0");
    assert_eq!(gate_up.len() % (2 * inter), 0, "{op}: gate_up has {} elements, not rows of 2 * {inter}", gate_up.len());
    let rows = gate_up.len() / (2 * inter);
    assert_eq!(out.len(), rows * inter, "{op}: out has {} elements, expected [{rows}, {inter}]", out.len());
    same_dtype(op, gate_up.dtype(), out.dtype());
    let codes = RowCodesMut::arg(codes.as_ref(), op, rows, inter);
    if rows == 0 {
        return Ok(());
    }
    let (gu_ptr, out_ptr, inter_u32) = (gate_up.ptr(), out.ptr(), to_u32(op, "inter", inter));
    let mut launch = gpu.launch_builder(op, out.dtype());
    launch.arg(&gu_ptr).arg(&out_ptr).arg(&inter_u32).arg(&codes);
    // Blocks of 256 threads, each taking 8 columns at a time where it can (see the kernel), up
    // to 64 blocks per row; fewer per row for a large batch; one per row where it also writes the
    // row's codes (the kernel's amax is over the whole row).
    let per_thread = if inter.is_multiple_of(8) { 8 } else { 1 };
    let chunks = inter.div_ceil(256 * per_thread).min(64).min(4096usize.div_ceil(rows)).max(1);
    let chunks = if codes.keeps_codes() { 1 } else { chunks };
    let cfg = LaunchConfig {
        grid_dim: (to_u32(op, "rows", rows), chunks as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's parameters; both buffers hold `rows` rows, and so
    // do the codes, where given (checked).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// What a plain RMSNorm launch normalises: `rows` rows of `hidden` by `w`, and where their codes go.
struct NormLaunch<'a> {
    w: GpuView<'a>,
    rows: usize,
    hidden: usize,
    eps: f32,
    codes: RowCodesArg,
}

fn launch_rms_norm(
    gpu: &Gpu,
    kernel: &'static str,
    x_ptr: u64,
    out_ptr: u64,
    dtype: DType,
    norm: NormLaunch<'_>,
) -> Result<(), GpuError> {
    let NormLaunch { w, rows, hidden, eps, codes } = norm;
    if rows == 0 {
        return Ok(());
    }
    let (w_ptr, hidden_u32) = (w.ptr(), to_u32("rms_norm", "hidden", hidden));
    let (kernel, width) = match norm_vec8(kernel, hidden, &[x_ptr, w_ptr, out_ptr]) {
        Some(vec8) => (vec8, hidden / 8),
        None => (kernel, hidden),
    };
    let mut launch = gpu.launch_builder(kernel, dtype);
    launch.arg(&x_ptr).arg(&w_ptr).arg(&out_ptr).arg(&hidden_u32).arg(&eps).arg(&codes);
    // SAFETY: the arguments match the kernel's parameters; x and out hold `rows` rows, and so do
    // the codes, where given (checked by the caller).
    unsafe { launch.launch(rows_config(rows, width)) }?;
    Ok(())
}

/// The 8-elements-per-access form of norm kernel `kernel` (kernels/norm.cu), where its rows allow
/// it: a multiple of 8 elements, every buffer 16-byte aligned (then so is every row). A thread
/// per 8 elements: the 8B's rows of 4096 take blocks of 512 threads instead of 1024, and 16-byte
/// accesses instead of 2- and 4-byte ones.
fn norm_vec8(kernel: &'static str, hidden: usize, ptrs: &[u64]) -> Option<&'static str> {
    if !hidden.is_multiple_of(8) || !ptrs.iter().all(|p| p.is_multiple_of(16)) {
        return None;
    }
    Some(match kernel {
        "rms_norm" => "rms_norm_vec8",
        "rms_norm_from_f32" => "rms_norm_from_f32_vec8",
        "add_rms_norm" => "add_rms_norm_vec8",
        "add_rms_norm_f32_residual" => "add_rms_norm_f32_residual_vec8",
        _ => return None,
    })
}

/// Asserts that `len` elements are whole rows of the f32 weight `w`; returns the row width.
fn check_rows(op: &str, len: usize, w: GpuView<'_>) -> usize {
    assert!(!w.is_empty(), "{op}: empty weight");
    assert_eq!(w.dtype(), DType::F32, "{op}: the norm weight must be f32, not {:?}", w.dtype());
    assert_eq!(len % w.len(), 0, "{op}: {len} elements are not whole rows of {}", w.len());
    w.len()
}

pub(crate) fn same_dtype(op: &str, a: DType, b: DType) {
    assert_eq!(a, b, "{op}: buffers of {a:?} and {b:?} mixed");
}
