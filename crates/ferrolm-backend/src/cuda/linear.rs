//! `linear`: `y = x · w^T (+ bias)` with f32 accumulation, through our GEMV kernel
//! (`kernels/gemv.cu`) for one row, or up to [`GEMV_MAX_M`] rows of a small matrix, and through
//! cuBLAS otherwise.

use cudarc::driver::{result as driver, LaunchConfig};

use super::fp8::{self, Epilogue, Fp8View, RowCodes, RowCodesMut};
use super::gemm_tune::{GemmShape, Gemms};
use super::gpu::{rows_config, to_u32};
use super::{Gpu, GpuError, GpuTensor, GpuView, GpuViewMut};
use crate::{DType, GatedActivation};

use super::compile::{self, KernelFamilies};

/// The entry points of `linear` and `linear_gated`.
pub(crate) const KERNELS: &[KernelFamilies] = &[
    KernelFamilies {
        source: &compile::GEMV,
        names: &[
            "gemv_m1",
            "gemv_m2",
            "gemv_m3",
            "gemv_m4",
            "gemv_m1_to_f32",
            "gemv_m2_to_f32",
            "gemv_m3_to_f32",
            "gemv_m4_to_f32",
            "gemv_silu_m1",
            "gemv_silu_m2",
            "gemv_silu_m3",
            "gemv_silu_m4",
            "gemv_gelu_tanh_m1",
            "gemv_gelu_tanh_m2",
            "gemv_gelu_tanh_m3",
            "gemv_gelu_tanh_m4",
        ],
        large_shared: false,
    },
    KernelFamilies { source: &compile::ELEMENTWISE, names: &["bias_add"], large_shared: false },
];

/// Most rows of `x` the GEMV kernel takes (it is instantiated for 1 to 4); more go to cuBLAS.
pub const GEMV_MAX_M: usize = 4;
// The CPU's reference of the GPU's FP8 products quantizes their inputs beyond as many rows.
const _: () = assert!(matches!(crate::cpu::Fp8Inputs::GPU, crate::cpu::Fp8Inputs::QuantizedBeyond(GEMV_MAX_M)));
/// Warps (output columns) per GEMV block (`GEMV_WARPS`).
pub(super) const GEMV_WARPS: usize = 8;

/// `y[m, n] = x[m, k] · w[n, k]^T (+ bias[n])`, `w` in the HF layout `[out, in]`. `x` and `w`
/// share a dtype; `y` is in that dtype or f32 (f32 logits from bf16 activations, say); `bias` is
/// f32. Products accumulate in f32 (no TF32: f32 inputs give f32-exact GEMMs), and the bias is
/// added before the result is rounded to `y`'s dtype.
#[allow(clippy::too_many_arguments)]
pub fn linear(
    gpu: &Gpu,
    gemms: &Gemms,
    x: GpuView<'_>,
    m: usize,
    k: usize,
    w: GpuView<'_>,
    n: usize,
    bias: Option<GpuView<'_>>,
    y: GpuViewMut<'_>,
) -> Result<(), GpuError> {
    linear_with(gpu, gemms, x, m, k, Weight::Dense(w), n, bias, y, Route::Auto)
}

/// [`linear`] through cuBLAS whatever `m` is: the point of comparison of the GEMV kernel.
#[cfg(feature = "bench-internals")]
#[allow(clippy::too_many_arguments)]
pub fn linear_cublas(
    gpu: &Gpu,
    gemms: &Gemms,
    x: GpuView<'_>,
    m: usize,
    k: usize,
    w: GpuView<'_>,
    n: usize,
    bias: Option<GpuView<'_>>,
    y: GpuViewMut<'_>,
) -> Result<(), GpuError> {
    linear_with(gpu, gemms, x, m, k, Weight::Dense(w), n, bias, y, Route::Cublas)
}

/// The weight of a product: dense in x's dtype, or FP8 with
/// - the scratch buffer (x's dtype, at least the matrix's size) that a product of more rows than
///   the FP8 GEMV takes quantizes x into, or dequantizes the matrix into;
/// - x's codes, where the op that wrote x also wrote them (the FP8 GEMM then reads them).
pub(super) enum Weight<'a, 's> {
    Dense(GpuView<'a>),
    Fp8(Fp8View<'a>, &'s mut GpuTensor, Option<RowCodes<'s>>),
}

/// [`linear`] over the first `n` rows of an FP8 matrix `w` (see [`super::fp8`]); `scratch` and
/// `x_codes` as [`Weight::Fp8`] says.
#[allow(clippy::too_many_arguments)]
pub fn linear_fp8(
    gpu: &Gpu,
    gemms: &Gemms,
    x: GpuView<'_>,
    m: usize,
    w: Fp8View<'_>,
    n: usize,
    bias: Option<GpuView<'_>>,
    y: GpuViewMut<'_>,
    scratch: &mut GpuTensor,
    x_codes: Option<RowCodes<'_>>,
) -> Result<(), GpuError> {
    assert!(n <= w.rows(), "linear_fp8: {n} output features from a matrix of {} rows", w.rows());
    linear_with(gpu, gemms, x, m, w.cols(), Weight::Fp8(w, scratch, x_codes), n, bias, y, Route::Auto)
}

/// Which kernel `linear_with` takes (`linear` always takes `Auto`; the others are for the
/// `bench-internals` comparisons).
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "bench-internals"), allow(dead_code))]
enum Route {
    /// The GEMV kernel where it takes the product (with `gemv_ksplit`'s split), else cuBLAS.
    Auto,
    Cublas,
    /// The GEMV kernel with this many warps per column; panics where it does not take the product.
    GemvSplit(usize),
}

#[allow(clippy::too_many_arguments)]
fn linear_with(
    gpu: &Gpu,
    gemms: &Gemms,
    x: GpuView<'_>,
    m: usize,
    k: usize,
    w: Weight<'_, '_>,
    n: usize,
    bias: Option<GpuView<'_>>,
    y: GpuViewMut<'_>,
    route: Route,
) -> Result<(), GpuError> {
    assert_eq!(x.len(), m * k, "linear: x has {} elements, expected [m={m}, k={k}]", x.len());
    match &w {
        Weight::Dense(w) => {
            assert_eq!(w.len(), n * k, "linear: w has {} elements, expected [n={n}, k={k}]", w.len());
            assert_eq!(x.dtype(), w.dtype(), "linear: x is {:?} but w is {:?}", x.dtype(), w.dtype());
        }
        Weight::Fp8(w, _, _) => {
            assert!(w.cols() == k && w.rows() >= n, "linear: an FP8 w of {} columns, k = {k}", w.cols())
        }
    }
    assert_eq!(y.len(), m * n, "linear: y has {} elements, expected [m={m}, n={n}]", y.len());
    assert!(
        y.dtype() == x.dtype() || y.dtype() == DType::F32,
        "linear: y must be {:?} or F32, not {:?}",
        x.dtype(),
        y.dtype()
    );
    if let Some(b) = bias {
        assert_eq!(b.len(), n, "linear: bias has {} elements, expected [n={n}]", b.len());
        assert_eq!(b.dtype(), DType::F32, "linear: bias must be f32, not {:?}", b.dtype());
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    // With a bias, a low-precision output is computed in f32 first, so that the bias is added
    // before the one rounding (a bias cancelling most of a product keeps its precision).
    let scratch = if bias.is_some() && y.dtype() != DType::F32 {
        // SAFETY: the GEMM below writes all `m * n` elements before the bias kernel reads them.
        Some(unsafe { gpu.stream().alloc::<f32>(m * n) }?)
    } else {
        None
    };
    let (acc_ptr, acc_dtype) = scratch.as_ref().map_or((y.ptr(), y.dtype()), |buf| (gpu.index_ptr(buf), DType::F32));
    if let Route::GemvSplit(ksplit) = route {
        assert!(ksplit.is_power_of_two() && ksplit <= GEMV_WARPS, "ksplit {ksplit}: not a power of two up to 8");
    }
    match (w, route) {
        (Weight::Dense(w), Route::Auto) if gemv_fits(x, m, k, w) => {
            gemv(gpu, x, m, k, w, n, gemv_ksplit(n, k), acc_ptr, acc_dtype)?
        }
        (Weight::Dense(w), Route::GemvSplit(ksplit)) => {
            assert!(m <= GEMV_MAX_M && gemv_fits(x, m, k, w), "linear: the GEMV kernel does not take this product");
            gemv(gpu, x, m, k, w, n, ksplit, acc_ptr, acc_dtype)?
        }
        (Weight::Dense(w), Route::Auto | Route::Cublas) => gemm(gpu, gemms, x, m, k, w, n, acc_ptr, acc_dtype)?,
        (Weight::Fp8(w, _, _), _) if fp8::gemv_fits(x, m) => {
            let to_f32 = acc_dtype == DType::F32 && x.dtype() != DType::F32;
            let epilogue = if to_f32 { Epilogue::ToF32 } else { Epilogue::Store };
            let ksplit = match route {
                Route::GemvSplit(ksplit) => Some(ksplit),
                _ => None,
            };
            fp8::gemv(gpu, x, m, w, n, epilogue, ksplit, acc_ptr)?
        }
        (Weight::Fp8(w, scratch, x_codes), _) => {
            if !fp8::gemm(gpu, gemms, x, m, w, n, acc_ptr, acc_dtype, scratch, x_codes)? {
                let dense = dequantized(gpu, w, n, x.dtype(), scratch)?;
                gemm(gpu, gemms, x, m, k, dense, n, acc_ptr, acc_dtype)?
            }
        }
    }
    if let Some(bias) = bias {
        let (y_ptr, bias_ptr, n_u32) = (y.ptr(), bias.ptr(), to_u32("linear", "n", n));
        let mut launch = gpu.launch_builder("bias_add", y.dtype());
        launch.arg(&acc_ptr).arg(&bias_ptr).arg(&y_ptr).arg(&n_u32);
        // SAFETY: the arguments match the kernel's parameters; acc and y hold `m` rows of `n`.
        unsafe { launch.launch(rows_config(m, n)) }?;
    }
    // The scratch buffer is freed in stream order, after the bias kernel has read it.
    drop(scratch);
    Ok(())
}

/// The first `n` rows of `w` dequantized into `scratch` (in `dtype`), for a dense GEMM.
fn dequantized<'s>(
    gpu: &Gpu,
    w: Fp8View<'_>,
    n: usize,
    dtype: DType,
    scratch: &'s mut GpuTensor,
) -> Result<GpuView<'s>, GpuError> {
    let len = n * w.cols();
    assert_eq!(scratch.dtype(), dtype, "linear: an FP8 scratch of {:?} for {dtype:?} activations", scratch.dtype());
    assert!(scratch.len() >= len, "linear: an FP8 scratch of {} elements for [{n}, {}]", scratch.len(), w.cols());
    fp8::dequantize(gpu, w.prefix(n), scratch.slice_mut(0..len))?;
    Ok(scratch.slice(0..len))
}

/// Weights (elements) up to which the GEMV kernel also takes 2 to 4 rows. On the H200 it beats
/// cuBLAS at one row on every Llama projection but the down projections (within 5 %), and at 2 to
/// 4 rows only on small matrices (e.g. 2048 x 2048: 6.6 against 10.3 us; 4096 x 14336: 36
/// against 32 us at 2 rows); see examples/gemv_bench.rs.
const GEMV_MULTI_ROW_MAX_WEIGHTS: usize = 8 << 20;

/// Whether the GEMV kernel takes this product: one row, or up to 4 of a small matrix, with rows
/// of whole 16-byte chunks at 16-byte aligned addresses.
pub(super) fn gemv_fits(x: GpuView<'_>, m: usize, k: usize, w: GpuView<'_>) -> bool {
    (m == 1 || (m <= GEMV_MAX_M && w.len() <= GEMV_MULTI_ROW_MAX_WEIGHTS))
        && k > 0
        && k.is_multiple_of(8)
        && x.ptr().is_multiple_of(16)
        && w.ptr().is_multiple_of(16)
}

/// Columns from which the GEMV kernel takes one warp per column: with that many columns one
/// warp each keeps enough loads in flight (on the H200 splitting k made 8B o_proj 9.7 -> 10.9
/// and down 29.3 -> 30.6 us, examples/gemv_bench.rs).
const GEMV_KSPLIT_BELOW_COLUMNS: usize = 4096;

/// Weight chunks (8 elements) a lane of a one-row GEMV loads together before it uses them:
/// `GEMV_UNROLL` in kernels/gemv.cu.
const GEMV_ROUND: usize = 8;

/// Warps per output column of the GEMV kernel (a power of two up to `GEMV_WARPS`): for matrices
/// of fewer than `GEMV_KSPLIT_BELOW_COLUMNS` columns, as many as leave each lane two full rounds
/// of chunks where k is long enough (at least one otherwise), one warp for wider matrices. A
/// lane whose chunks make no full round loads them one at a time after its wait on the kernel
/// before it, instead of all together and before the wait. On the H200 (gemv_bench, one row)
/// the 1B's qkv took 6.7 us at 2 warps (4 chunks a lane) and 4.5 at one (8 chunks), o_proj 4.3
/// and 3.5, and down (k = 8192) 12.8 at 8 warps, 10.9 at 4 and 9.9 at 2 (16 chunks a lane).
pub(super) fn gemv_ksplit(n: usize, k: usize) -> usize {
    if n >= GEMV_KSPLIT_BELOW_COLUMNS {
        return 1;
    }
    let split = (k / 8 / (32 * 2 * GEMV_ROUND)).clamp(1, GEMV_WARPS);
    // The largest power of two not above it.
    1 << split.ilog2()
}

/// [`linear`] through the GEMV kernel with `ksplit` warps per column (a power of two up to 8)
/// instead of [`gemv_ksplit`]'s choice, for benchmarks that look for that choice
/// (examples/gemv_bench.rs). Panics where the GEMV kernel does not take the product.
#[cfg(feature = "bench-internals")]
#[allow(clippy::too_many_arguments)]
pub fn linear_gemv_ksplit(
    gpu: &Gpu,
    gemms: &Gemms,
    x: GpuView<'_>,
    m: usize,
    k: usize,
    w: GpuView<'_>,
    n: usize,
    ksplit: usize,
    y: GpuViewMut<'_>,
) -> Result<(), GpuError> {
    linear_with(gpu, gemms, x, m, k, Weight::Dense(w), n, None, y, Route::GemvSplit(ksplit))
}

/// [`linear_fp8`] through its GEMV kernel with `ksplit` warps per column (or tile) instead of
/// the kernel's own choice, for benchmarks that look for that choice (examples/gemv_bench.rs).
/// Up to [`GEMV_MAX_M`] rows.
#[cfg(feature = "bench-internals")]
#[allow(clippy::too_many_arguments)]
pub fn linear_fp8_gemv_ksplit(
    gpu: &Gpu,
    gemms: &Gemms,
    x: GpuView<'_>,
    m: usize,
    w: Fp8View<'_>,
    n: usize,
    ksplit: usize,
    y: GpuViewMut<'_>,
    scratch: &mut GpuTensor,
) -> Result<(), GpuError> {
    assert!(fp8::gemv_fits(x, m), "linear_fp8_gemv_ksplit: the GEMV kernel does not take this product");
    linear_with(gpu, gemms, x, m, w.cols(), Weight::Fp8(w, scratch, None), n, None, y, Route::GemvSplit(ksplit))
}

/// `out[m, n] = x[m, k] · w[n, k]^T` through the GEMV kernel (`gemv_fits` holds) with `ksplit`
/// warps per column.
#[allow(clippy::too_many_arguments)]
fn gemv(
    gpu: &Gpu,
    x: GpuView<'_>,
    m: usize,
    k: usize,
    w: GpuView<'_>,
    n: usize,
    ksplit: usize,
    out_ptr: u64,
    out_dtype: DType,
) -> Result<(), GpuError> {
    let to_f32 = out_dtype == DType::F32 && x.dtype() != DType::F32;
    let kernel = match (m, to_f32) {
        (1, false) => "gemv_m1",
        (2, false) => "gemv_m2",
        (3, false) => "gemv_m3",
        (4, false) => "gemv_m4",
        (1, true) => "gemv_m1_to_f32",
        (2, true) => "gemv_m2_to_f32",
        (3, true) => "gemv_m3_to_f32",
        (4, true) => "gemv_m4_to_f32",
        _ => unreachable!("gemv_fits admits 1..={GEMV_MAX_M} rows"),
    };
    launch_gemv(gpu, kernel, x, k, w, n, ksplit, out_ptr)
}

/// Launches GEMV kernel `kernel` for `n` output columns with `ksplit` warps per column.
#[allow(clippy::too_many_arguments)]
fn launch_gemv(
    gpu: &Gpu,
    kernel: &'static str,
    x: GpuView<'_>,
    k: usize,
    w: GpuView<'_>,
    n: usize,
    ksplit: usize,
    out_ptr: u64,
) -> Result<(), GpuError> {
    let (x_ptr, w_ptr) = (x.ptr(), w.ptr());
    let (k_u32, n_u32) = (to_u32("linear", "k", k), to_u32("linear", "n", n));
    let ksplit_u32 = ksplit as u32;
    let cfg = LaunchConfig {
        grid_dim: (to_u32("linear", "GEMV blocks", n.div_ceil(GEMV_WARPS / ksplit)), 1, 1),
        block_dim: (GEMV_WARPS as u32 * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.launch_builder(kernel, x.dtype());
    launch.arg(&x_ptr).arg(&w_ptr).arg(&out_ptr).arg(&k_u32).arg(&n_u32).arg(&ksplit_u32);
    // SAFETY: the arguments match the kernel's parameters; x holds the kernel's m rows of k, w
    // n rows of k (a gated kernel's 2 n), out m rows of n in the kernel's output type, and the
    // kernel's alignment needs hold (`gemv_fits`).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// `out[m, inter] = act(x · w_gate^T + b_gate) * (x · w_up^T + b_up)` for `w = [gate; up]`
/// (`[2 * inter, k]`), bit for bit as [`linear`] into `gate_up` (`[m, 2 * inter]`, x's dtype)
/// followed by [`super::gated_activation`]. Where the GEMV kernel
/// takes the product and there is no bias, one kernel does both, the activation in its
/// epilogue, and `gate_up` is left as it was. `out_codes`, where given, also gets `out`'s rows
/// quantized (see [`super::fp8::GpuRowCodes`]).
#[allow(clippy::too_many_arguments)]
pub fn linear_gated(
    gpu: &Gpu,
    gemms: &Gemms,
    x: GpuView<'_>,
    m: usize,
    k: usize,
    w: GpuView<'_>,
    inter: usize,
    bias: Option<GpuView<'_>>,
    act: GatedActivation,
    gate_up: GpuViewMut<'_>,
    out: GpuViewMut<'_>,
    out_codes: Option<RowCodesMut<'_>>,
) -> Result<(), GpuError> {
    assert_eq!(w.len(), 2 * inter * k, "linear_gated: w has {} elements, expected [2 * {inter}, {k}]", w.len());
    let out = GatedOut { gate_up, out, codes: out_codes };
    gated_with(gpu, gemms, x, m, k, Weight::Dense(w), inter, bias, act, out)
}

/// [`linear_gated`] over an FP8 `w` (`[2 * inter, k]`), its operands and outputs in `fp8` and
/// `out`.
#[allow(clippy::too_many_arguments)]
pub fn linear_gated_fp8(
    gpu: &Gpu,
    gemms: &Gemms,
    x: GpuView<'_>,
    m: usize,
    w: Fp8View<'_>,
    inter: usize,
    bias: Option<GpuView<'_>>,
    act: GatedActivation,
    fp8: Fp8Operands<'_, '_>,
    out: GatedOut<'_>,
) -> Result<(), GpuError> {
    assert_eq!(w.rows(), 2 * inter, "linear_gated: an FP8 w of {} rows, expected 2 * {inter}", w.rows());
    let weight = Weight::Fp8(w, fp8.scratch, fp8.x_codes);
    gated_with(gpu, gemms, x, m, w.cols(), weight, inter, bias, act, out)
}

/// What an FP8 product takes beside its matrix: as [`Weight::Fp8`] says.
pub struct Fp8Operands<'s, 'c> {
    pub scratch: &'s mut GpuTensor,
    pub x_codes: Option<RowCodes<'c>>,
}

/// Where a gated product's results go: `gate_up` (`[m, 2 * inter]`, scratch), `out`
/// (`[m, inter]`) and, where given, `out`'s codes.
pub struct GatedOut<'a> {
    pub gate_up: GpuViewMut<'a>,
    pub out: GpuViewMut<'a>,
    pub codes: Option<RowCodesMut<'a>>,
}

#[allow(clippy::too_many_arguments)]
fn gated_with(
    gpu: &Gpu,
    gemms: &Gemms,
    x: GpuView<'_>,
    m: usize,
    k: usize,
    w: Weight<'_, '_>,
    inter: usize,
    bias: Option<GpuView<'_>>,
    act: GatedActivation,
    GatedOut { gate_up, out, codes }: GatedOut<'_>,
) -> Result<(), GpuError> {
    assert_eq!(x.len(), m * k, "linear_gated: x has {} elements, expected [m={m}, k={k}]", x.len());
    assert_eq!(out.len(), m * inter, "linear_gated: out has {} elements, expected [{m}, {inter}]", out.len());
    assert_eq!(out.dtype(), x.dtype(), "linear_gated: out is {:?} but x is {:?}", out.dtype(), x.dtype());
    let fused = bias.is_none() && m > 0 && inter > 0;
    match &w {
        Weight::Fp8(w, _, _) if fused && fp8::gemv_fits(x, m) => {
            let epilogue = match act {
                GatedActivation::Silu => Epilogue::Silu,
                GatedActivation::GeluTanh => Epilogue::GeluTanh,
            };
            fp8::gemv(gpu, x, m, *w, inter, epilogue, None, out.ptr())?;
        }
        Weight::Dense(w) if fused && gemv_fits(x, m, k, *w) => {
            assert_eq!(x.dtype(), w.dtype(), "linear_gated: x is {:?} but w is {:?}", x.dtype(), w.dtype());
            let kernel = match (act, m) {
                (GatedActivation::Silu, 1) => "gemv_silu_m1",
                (GatedActivation::Silu, 2) => "gemv_silu_m2",
                (GatedActivation::Silu, 3) => "gemv_silu_m3",
                (GatedActivation::Silu, 4) => "gemv_silu_m4",
                (GatedActivation::GeluTanh, 1) => "gemv_gelu_tanh_m1",
                (GatedActivation::GeluTanh, 2) => "gemv_gelu_tanh_m2",
                (GatedActivation::GeluTanh, 3) => "gemv_gelu_tanh_m3",
                (GatedActivation::GeluTanh, 4) => "gemv_gelu_tanh_m4",
                _ => unreachable!("gemv_fits admits 1..={GEMV_MAX_M} rows"),
            };
            // The split of the unfused product over 2 * inter rows, so that each sum is the same.
            launch_gemv(gpu, kernel, x, k, *w, inter, gemv_ksplit(2 * inter, k), out.ptr())?;
        }
        _ => {
            assert!(inter > 0, "linear_gated: inter is 0");
            let rows = gate_up.len() / (2 * inter);
            assert!(rows >= m, "linear_gated: gate_up holds {rows} rows of 2 * {inter}, not {m}");
            let mut gate_up = gate_up.rows(0..m, 2 * inter);
            linear_with(gpu, gemms, x, m, k, w, 2 * inter, bias, gate_up.reborrow(), Route::Auto)?;
            // The activation writes the codes too, where they are wanted.
            return super::ops::gated_activation(gpu, act, gate_up.as_view(), inter, out, codes);
        }
    }
    // The GEMV's epilogue wrote `out` alone: its codes, where wanted, from it.
    match codes {
        Some(codes) => fp8::quantize_rows(gpu, out.as_view(), m, inter, codes),
        None => Ok(()),
    }
}

/// `out[m, n] = x[m, k] · w[n, k]^T`, `out` of `out_dtype` at `out_ptr`: through the cuBLASLt
/// plan [`Gemms::tune`] kept for this shape, else `cublasGemmEx`.
#[allow(clippy::too_many_arguments)]
fn gemm(
    gpu: &Gpu,
    gemms: &Gemms,
    x: GpuView<'_>,
    m: usize,
    k: usize,
    w: GpuView<'_>,
    n: usize,
    out_ptr: u64,
    out_dtype: DType,
) -> Result<(), GpuError> {
    if k == 0 {
        // An empty product is 0 (cuBLAS is not asked to handle k = 0).
        // SAFETY: `out` covers exactly this many bytes of live device memory.
        unsafe { driver::memset_d8_async(out_ptr, 0, m * n * out_dtype.size_in_bytes(), gpu.raw_stream()?) }?;
        return Ok(());
    }
    let shape = GemmShape { m, n, k, input: w.dtype(), output: out_dtype };
    // SAFETY: the caller checked that x, w and out hold the shape in these dtypes.
    unsafe { gemms.run(gpu, shape, w.ptr(), x.ptr(), out_ptr) }
}
