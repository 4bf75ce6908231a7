//! FP8 weights on the GPU: a matrix's e4m3 codes, one byte a weight, and its block grid of f32
//! scales ([`GpuFp8Matrix`], placed from [`crate::Fp8Matrix::stack`]'s one grid), and the
//! product of activations with it.
//!
//! Up to [`GEMV_MAX_M`](super::linear) rows take an FP8 GEMV, which reads each weight once, as one
//! byte, and computes with the activations as they are: for bf16 and f16 activations over blocks of
//! 64 columns or more the tensor-core kernel (`fp8_gemv_*` in kernels/fp8_gemv.cu), else the GEMV
//! kernel's FP8 form (`gemv_fp8_*` in kernels/gemv.cu). More rows of bf16 or f16 activations take
//! an FP8 GEMM on the tensor cores where the matrix's scales are of a form cuBLASLt scales by
//! ([`Fp8Matrix::gemm_scaling`]): one scale per row (tensor or channel scales: its outer-vector
//! scaling), the activations quantized per token first (`fp8_quantize_rows`, vLLM's dynamic
//! per-token scales); or 128 x 128 blocks (the block-wise `fp8` checkpoints': its BLK128x128
//! scaling), the activations quantized per token and 128 columns (`fp8_quantize_groups`,
//! DeepSeek-V3's scheme). The product then differs from the CPU's by that rounding too.
//! Everything else (f32 activations, other blocks, a shape cuBLASLt has no FP8 GEMM for)
//! dequantizes the matrix into a scratch buffer in the activations' dtype (`fp8_dequantize`: the
//! value the CPU computes with, rounded once to that dtype) and takes the dense GEMM.
//!
//! Invariants: `cols % 16 == 0` (a GEMV chunk is 16 codes) and the blocks are either a whole
//! row wide or a power of two of at least 16 columns (a chunk lies in one block, found by a
//! shift); [`GpuFp8Matrix::new`] declines other layouts, which the device places dequantized.

use std::marker::PhantomData;

use cudarc::driver::{result as driver, CudaSlice, DeviceRepr, LaunchConfig};

use super::compile::{self, KernelFamilies};
use super::gemm_tune::{Fp8GemmShape, Fp8GemmTuning, Gemms};
use super::gpu::to_u32;
use super::{Gpu, GpuError, GpuTensor, GpuView, GpuViewMut};
use crate::fp8::GEMM_BLOCK;
use crate::{DType, Fp8GemmScaling, Fp8Matrix};

/// The entry points of the FP8 products.
pub(crate) const KERNELS: &[KernelFamilies] = &[
    KernelFamilies {
        source: &compile::GEMV,
        names: &[
            "gemv_fp8_m1",
            "gemv_fp8_m2",
            "gemv_fp8_m3",
            "gemv_fp8_m4",
            "gemv_fp8_m1_to_f32",
            "gemv_fp8_m2_to_f32",
            "gemv_fp8_m3_to_f32",
            "gemv_fp8_m4_to_f32",
            "gemv_fp8_silu_m1",
            "gemv_fp8_silu_m2",
            "gemv_fp8_silu_m3",
            "gemv_fp8_silu_m4",
            "gemv_fp8_gelu_tanh_m1",
            "gemv_fp8_gelu_tanh_m2",
            "gemv_fp8_gelu_tanh_m3",
            "gemv_fp8_gelu_tanh_m4",
        ],
        large_shared: false,
    },
    KernelFamilies {
        source: &compile::FP8_GEMV,
        names: &[
            "fp8_gemv_m1",
            "fp8_gemv_m2",
            "fp8_gemv_m3",
            "fp8_gemv_m4",
            "fp8_gemv_m1_to_f32",
            "fp8_gemv_m2_to_f32",
            "fp8_gemv_m3_to_f32",
            "fp8_gemv_m4_to_f32",
            "fp8_gemv_silu_m1",
            "fp8_gemv_silu_m2",
            "fp8_gemv_silu_m3",
            "fp8_gemv_silu_m4",
            "fp8_gemv_gelu_tanh_m1",
            "fp8_gemv_gelu_tanh_m2",
            "fp8_gemv_gelu_tanh_m3",
            "fp8_gemv_gelu_tanh_m4",
            "fp8_gemv_rope_cache_m1",
            "fp8_gemv_rope_cache_m2",
            "fp8_gemv_rope_cache_m3",
            "fp8_gemv_rope_cache_m4",
        ],
        large_shared: false,
    },
    KernelFamilies {
        source: &compile::FP8,
        names: &["fp8_dequantize", "fp8_quantize_rows", "fp8_quantize_groups"],
        large_shared: false,
    },
];

/// Codes a GEMV chunk holds: the columns must be whole chunks.
const CHUNK: usize = 16;
/// The shift that puts every column of a row in block 0 (`col_shift` of a one-block-wide grid).
const WHOLE_ROW_SHIFT: u32 = 31;

/// A `[rows, cols]` FP8 matrix in device memory.
pub struct GpuFp8Matrix {
    /// `[rows, cols]` e4m3 codes, owned here and read through `codes_ptr`.
    _codes: CudaSlice<u8>,
    codes_ptr: u64,
    /// f32 `[ceil(rows / block_rows), grid_cols]`
    scales: GpuTensor,
    /// The scales as the FP8 GEMM reads them, where one takes the matrix
    /// ([`Fp8Matrix::gemm_scaling`]), laid out as [`Fp8GemmShape`] says for their scaling: f32
    /// `[rows]`, each row's one scale, where the blocks span the rows; the padded grid of
    /// 128 x 128 blocks.
    gemm_scales: Option<(GpuTensor, Fp8GemmScaling)>,
    rows: usize,
    cols: usize,
    block_rows: usize,
    /// log2 of the block width, or [`WHOLE_ROW_SHIFT`].
    col_shift: u32,
    grid_cols: usize,
}

/// The kernels' `Fp8Grid` (kernels/common.cuh), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Fp8Grid {
    scales: u64,
    block_rows: u32,
    col_shift: u32,
    grid_cols: u32,
    _pad: u32,
}

// SAFETY: a plain #[repr(C)] struct of integers laid out as the kernels' `Fp8Grid` (a pointer
// then three u32, 8-byte aligned: 24 bytes with the padding).
unsafe impl DeviceRepr for Fp8Grid {}

impl GpuFp8Matrix {
    /// Uploads `m`, or `None` where the kernels do not take its layout (see the module's
    /// invariants).
    pub fn new(gpu: &Gpu, m: &Fp8Matrix) -> Result<Option<GpuFp8Matrix>, GpuError> {
        let Some((block_rows, col_shift, grid_cols)) = layout(m) else { return Ok(None) };
        let (_, _, scales) = m.scale_grid();
        let codes = gpu.upload(m.codes())?;
        let block_gemm = gpu.options().fp8_block_gemm;
        let gemm_scales = m
            .gemm_scaling()
            .filter(|&scaling| scaling == Fp8GemmScaling::Rows || block_gemm)
            .map(|scaling| {
                let values: Vec<f32> = match scaling {
                    Fp8GemmScaling::Rows => (0..m.rows()).map(|r| scales[r / block_rows]).collect(),
                    Fp8GemmScaling::Blocks => gemm_block_scales(m.rows(), m.cols(), scales),
                };
                GpuTensor::from_f32(gpu, &values, DType::F32).map(|t| (t, scaling))
            })
            .transpose()?;
        Ok(Some(GpuFp8Matrix {
            gemm_scales,
            codes_ptr: gpu.index_ptr(&codes),
            _codes: codes,
            scales: GpuTensor::from_f32(gpu, scales, DType::F32)?,
            rows: m.rows(),
            cols: m.cols(),
            block_rows,
            col_shift,
            grid_cols,
        }))
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Codes and scales.
    pub fn size_in_bytes(&self) -> usize {
        self.rows * self.cols
            + self.scales.size_in_bytes()
            + self.gemm_scales.as_ref().map_or(0, |(s, _)| s.size_in_bytes())
    }

    pub fn view(&self) -> Fp8View<'_> {
        Fp8View {
            codes: self.codes_ptr,
            grid: self.grid(),
            gemm_scales: self.gemm_scales.as_ref().map(|(s, scaling)| (s.view().ptr(), *scaling)),
            rows: self.rows,
            cols: self.cols,
            _matrix: PhantomData,
        }
    }

    fn grid(&self) -> Fp8Grid {
        Fp8Grid {
            scales: self.scales.view().ptr(),
            block_rows: self.block_rows as u32,
            col_shift: self.col_shift,
            grid_cols: self.grid_cols as u32,
            _pad: 0,
        }
    }
}

/// A `[rows, cols]` matrix's grid of 128 x 128 block scales (`[ceil(rows / 128), L]`, row-major,
/// `L = cols / 128`) as the FP8 GEMM reads it: each block row's `L` scales padded with zeros to a
/// multiple of 4 (see [`Fp8GemmShape`]). A prefix of the rows reads the first block rows.
fn gemm_block_scales(rows: usize, cols: usize, grid: &[f32]) -> Vec<f32> {
    let (block_rows, grid_cols) = (rows.div_ceil(GEMM_BLOCK), cols.div_ceil(GEMM_BLOCK));
    debug_assert_eq!(grid.len(), block_rows * grid_cols);
    let stride = grid_cols.next_multiple_of(4);
    let mut out = vec![0.0; block_rows * stride];
    for (padded, row) in out.chunks_mut(stride).zip(grid.chunks(grid_cols)) {
        padded[..grid_cols].copy_from_slice(row);
    }
    out
}

/// `(block_rows, col_shift, grid_cols)` of `m`'s scale grid where the kernels take it.
fn layout(m: &Fp8Matrix) -> Option<(usize, u32, usize)> {
    let (rows, cols) = (m.rows(), m.cols());
    let (block_rows, block_cols, scales) = m.scale_grid();
    if rows == 0 || cols == 0 || !cols.is_multiple_of(CHUNK) || u32::try_from(rows.max(cols)).is_err() {
        return None;
    }
    let col_shift = if block_cols >= cols {
        WHOLE_ROW_SHIFT
    } else if block_cols.is_power_of_two() && block_cols >= CHUNK {
        block_cols.trailing_zeros()
    } else {
        return None;
    };
    let grid_cols = cols.div_ceil(block_cols);
    debug_assert_eq!(scales.len(), rows.div_ceil(block_rows) * grid_cols);
    Some((block_rows, col_shift, grid_cols))
}

/// Rows of a [`GpuFp8Matrix`], borrowed.
#[derive(Clone, Copy)]
pub struct Fp8View<'a> {
    codes: u64,
    grid: Fp8Grid,
    /// The scales as an FP8 GEMM reads them, and how they scale, where one takes the matrix.
    gemm_scales: Option<(u64, Fp8GemmScaling)>,
    rows: usize,
    cols: usize,
    _matrix: PhantomData<&'a GpuFp8Matrix>,
}

impl Fp8View<'_> {
    /// The kernels' arguments for the matrix: its codes' address and its grid (`Fp8Grid`).
    pub(super) fn kernel_args(&self) -> (u64, impl DeviceRepr + Copy) {
        (self.codes, self.grid)
    }

    /// The first `n` rows.
    pub fn prefix(self, n: usize) -> Self {
        assert!(n <= self.rows, "an FP8 matrix of {} rows has no first {n}", self.rows);
        Fp8View { rows: n, ..self }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// Each row's FP8 codes of a `[capacity, cols]` activation buffer, with each row's dynamic scale
/// (`kernels/common.cuh`'s `quantize_row`): what an FP8 GEMM reads of its activations. The op
/// that writes the buffer may write them too (the norms and gated activations take a
/// [`RowCodesMut`]), so that the GEMM does not quantize its input again (`fp8_quantize_rows`).
pub struct GpuRowCodes {
    /// `[capacity, cols]`, read by the kernels through `codes_ptr`.
    codes: CudaSlice<u8>,
    codes_ptr: u64,
    /// f32 `[capacity]`
    scales: GpuTensor,
    capacity: usize,
    cols: usize,
}

/// The kernels' `RowCodes` (kernels/common.cuh), passed by value: a null `codes` keeps none.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct RowCodesArg {
    codes: u64,
    scales: u64,
}

// SAFETY: a plain #[repr(C)] struct of two device pointers, laid out as the kernels' `RowCodes`.
unsafe impl DeviceRepr for RowCodesArg {}

impl RowCodesArg {
    pub(super) const NONE: RowCodesArg = RowCodesArg { codes: 0, scales: 0 };

    pub(super) fn keeps_codes(&self) -> bool {
        self.codes != 0
    }
}

/// Where an op writes the codes and scales of its `rows` output rows of `cols`, borrowed from a
/// [`GpuRowCodes`]. An op given one writes them for every row it writes.
pub struct RowCodesMut<'a> {
    arg: RowCodesArg,
    rows: usize,
    cols: usize,
    _codes: PhantomData<&'a mut GpuRowCodes>,
}

/// The codes and scales of `rows` rows of `cols`, borrowed from a [`GpuRowCodes`].
#[derive(Clone, Copy)]
pub struct RowCodes<'a> {
    arg: RowCodesArg,
    rows: usize,
    cols: usize,
    _codes: PhantomData<&'a GpuRowCodes>,
}

impl GpuRowCodes {
    /// Room for `capacity` rows of `cols` codes, unwritten.
    pub fn new(gpu: &Gpu, capacity: usize, cols: usize) -> Result<GpuRowCodes, GpuError> {
        // SAFETY: codes are read only after an op wrote them (the owner's invariant).
        let codes = unsafe { gpu.stream().alloc::<u8>((capacity * cols).max(1)) }?;
        Ok(GpuRowCodes {
            codes_ptr: gpu.index_ptr(&codes),
            codes,
            scales: GpuTensor::uninit(gpu, DType::F32, capacity.max(1))?,
            capacity,
            cols,
        })
    }

    /// Device bytes of [`GpuRowCodes::new`]`(capacity, cols)`.
    pub fn bytes(capacity: usize, cols: usize) -> usize {
        (capacity * cols).max(1) + 4 * capacity.max(1)
    }

    /// Where an op writes rows `0..rows`.
    pub fn rows_mut(&mut self, rows: usize) -> RowCodesMut<'_> {
        let RowCodes { arg, rows, cols, .. } = self.rows(rows);
        RowCodesMut { arg, rows, cols, _codes: PhantomData }
    }

    /// Rows `0..rows`, as an op last wrote them.
    pub fn rows(&self, rows: usize) -> RowCodes<'_> {
        assert!(rows <= self.capacity, "{rows} rows of FP8 codes in room for {}", self.capacity);
        let arg = RowCodesArg { codes: self.codes_ptr, scales: self.scales.view().ptr() };
        RowCodes { arg, rows, cols: self.cols, _codes: PhantomData }
    }

    /// Rows `0..rows`' codes and scales, on the host.
    pub fn to_host(&self, gpu: &Gpu, rows: usize) -> Result<(Vec<u8>, Vec<f32>), GpuError> {
        assert!(rows <= self.capacity, "{rows} rows of FP8 codes in room for {}", self.capacity);
        let mut codes = gpu.download(&self.codes)?;
        codes.truncate(rows * self.cols);
        let mut scales = self.scales.to_f32_vec(gpu)?;
        scales.truncate(rows);
        Ok((codes, scales))
    }
}

impl RowCodesMut<'_> {
    /// The kernels' argument for an op writing `rows` rows of `cols` (the op's own shape,
    /// checked against the codes'); [`RowCodesArg::NONE`] for `None`.
    pub(super) fn arg(codes: Option<&RowCodesMut<'_>>, op: &str, rows: usize, cols: usize) -> RowCodesArg {
        codes.map_or(RowCodesArg::NONE, |c| {
            assert!(
                c.rows == rows && c.cols == cols,
                "{op}: FP8 codes of [{}, {}] for rows of [{rows}, {cols}]",
                c.rows,
                c.cols
            );
            c.arg
        })
    }
}

/// The GEMV kernels of the FP8 products, by rows of x and what follows the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Epilogue {
    /// Rounded to x's dtype.
    Store,
    /// Kept in f32 (logits).
    ToF32,
    Silu,
    GeluTanh,
}

/// `out[m, n] = x[m, k] · w^T` (`w`'s `n` rows of `k`; a gated epilogue takes `w = [gate; up]`,
/// `2 n` rows, and writes `act(gate) * up`) through an FP8 GEMV kernel; `m` is 1 to 4 and x
/// 16-byte aligned (the caller checks, [`gemv_fits`]). Half activations over blocks of 64
/// columns or more take the tensor-core kernel (kernels/fp8_gemv.cu), the rest gemv.cu's;
/// `ksplit` (warps per tile or column) overrides the kernel's choice.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemv(
    gpu: &Gpu,
    x: GpuView<'_>,
    m: usize,
    w: Fp8View<'_>,
    n: usize,
    epilogue: Epilogue,
    ksplit: Option<usize>,
    out_ptr: u64,
) -> Result<(), GpuError> {
    assert!((1..=4).contains(&m), "FP8 GEMV: {m} rows");
    let k = w.cols;
    let warps = super::linear::GEMV_WARPS;
    let rows = if matches!(epilogue, Epilogue::Silu | Epilogue::GeluTanh) { 2 * n } else { n };
    let (kernel, ksplit, columns) = if takes_tensor_cores(x.dtype(), w) {
        const NAMES: [[&str; 4]; 4] = [
            ["fp8_gemv_m1", "fp8_gemv_m2", "fp8_gemv_m3", "fp8_gemv_m4"],
            ["fp8_gemv_m1_to_f32", "fp8_gemv_m2_to_f32", "fp8_gemv_m3_to_f32", "fp8_gemv_m4_to_f32"],
            ["fp8_gemv_silu_m1", "fp8_gemv_silu_m2", "fp8_gemv_silu_m3", "fp8_gemv_silu_m4"],
            ["fp8_gemv_gelu_tanh_m1", "fp8_gemv_gelu_tanh_m2", "fp8_gemv_gelu_tanh_m3", "fp8_gemv_gelu_tanh_m4"],
        ];
        // A warp's tile: 16 rows of w (a gated tile 8 outputs' gate and up rows).
        let tiles = rows.div_ceil(TC_TILE_ROWS);
        (NAMES[epilogue as usize][m - 1], ksplit.unwrap_or_else(|| tc_ksplit(tiles, k)), tiles)
    } else {
        const NAMES: [[&str; 4]; 4] = [
            ["gemv_fp8_m1", "gemv_fp8_m2", "gemv_fp8_m3", "gemv_fp8_m4"],
            ["gemv_fp8_m1_to_f32", "gemv_fp8_m2_to_f32", "gemv_fp8_m3_to_f32", "gemv_fp8_m4_to_f32"],
            ["gemv_fp8_silu_m1", "gemv_fp8_silu_m2", "gemv_fp8_silu_m3", "gemv_fp8_silu_m4"],
            ["gemv_fp8_gelu_tanh_m1", "gemv_fp8_gelu_tanh_m2", "gemv_fp8_gelu_tanh_m3", "gemv_fp8_gelu_tanh_m4"],
        ];
        // A plain product of 2 to 4 rows takes two rows of w a warp, j and j + ceil(n / 2)
        // (kernels/gemv.cu, gemv_impl).
        let columns = match epilogue {
            Epilogue::Store | Epilogue::ToF32 if m >= 2 => n.div_ceil(2),
            _ => n,
        };
        // As many warps per column as the dense kernel takes for as many chunks (16 codes a
        // chunk against 8 elements, so `k / 2` elements' worth): each lane keeps its full rounds.
        (NAMES[epilogue as usize][m - 1], ksplit.unwrap_or_else(|| super::linear::gemv_ksplit(rows, k / 2)), columns)
    };
    let (x_ptr, w_ptr, grid) = (x.ptr(), w.codes, w.grid);
    let (k_u32, n_u32, ksplit_u32) = (to_u32("linear", "k", k), to_u32("linear", "n", n), ksplit as u32);
    let cfg = LaunchConfig {
        grid_dim: (to_u32("linear", "GEMV blocks", columns.div_ceil(warps / ksplit)), 1, 1),
        block_dim: (warps as u32 * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.launch_builder(kernel, x.dtype());
    launch.arg(&x_ptr).arg(&w_ptr).arg(&out_ptr).arg(&k_u32).arg(&n_u32).arg(&ksplit_u32).arg(&grid);
    // SAFETY: the arguments match the kernel's parameters; x holds m rows of k, w at least n (a
    // gated kernel's 2 n) rows of k codes with their grid, out m rows of n in the kernel's
    // output type; k % 16 == 0 (the matrix's invariant) and x is 16-byte aligned (the caller);
    // the tensor-core kernel's blocks are at least 64 columns wide (takes_tensor_cores).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Whether the FP8 GEMV runs on the tensor cores (kernels/fp8_gemv.cu): for bf16 and f16
/// activations, where a 64-column chunk lies in one scale block.
pub(super) fn takes_tensor_cores(dtype: DType, w: Fp8View<'_>) -> bool {
    tensor_cores_take(dtype, w.grid.col_shift)
}

/// [`takes_tensor_cores`] by the activations' dtype and the blocks' `col_shift`.
fn tensor_cores_take(dtype: DType, col_shift: u32) -> bool {
    dtype != DType::F32 && col_shift >= TC_CHUNK.trailing_zeros()
}

/// The tensor-core FP8 GEMV's chunk of columns (4 lanes of 16 codes) and a warp's tile of rows.
const TC_CHUNK: usize = 64;
pub(super) const TC_TILE_ROWS: usize = 16;
/// Chunks a lane of the tensor-core FP8 GEMV loads together (FP8_GEMV_UNROLL in fp8_gemv.cu).
const TC_ROUND: usize = 4;
/// Warps the tensor-core FP8 GEMV aims to run, about 16 a streaming multiprocessor on an H100
/// or H200 (132), enough 16-byte loads in flight to cover the memory's latency.
const TC_TARGET_WARPS: usize = 2048;

/// Warps per tile of the tensor-core FP8 GEMV (a power of two up to `GEMV_WARPS`): as many as
/// bring `tiles` tiles to [`TC_TARGET_WARPS`], short of leaving a lane less than a full round
/// of chunks.
pub(super) fn tc_ksplit(tiles: usize, k: usize) -> usize {
    let by_warps = (TC_TARGET_WARPS / tiles.max(1)).max(1);
    let by_chunks = (k / TC_CHUNK / TC_ROUND).max(1);
    let split = by_warps.min(by_chunks).clamp(1, super::linear::GEMV_WARPS);
    1 << split.ilog2()
}

/// Whether the FP8 GEMV kernel takes `m` rows of `x`: up to 4, whatever the matrix (the dense
/// GEMV leaves 2 to 4 rows of large matrices to cuBLAS; an FP8 matrix's alternative reads more
/// bytes, a dequantized copy or the activations' codes besides its own).
pub(super) fn gemv_fits(x: GpuView<'_>, m: usize) -> bool {
    (1..=super::linear::GEMV_MAX_M).contains(&m) && x.ptr().is_multiple_of(16)
}

/// `out = w`'s values in `out`'s dtype, `[w.rows, w.cols]` (see the module's doc).
pub(super) fn dequantize(gpu: &Gpu, w: Fp8View<'_>, out: GpuViewMut<'_>) -> Result<(), GpuError> {
    assert_eq!(out.len(), w.rows * w.cols, "fp8_dequantize: out is not [{}, {}]", w.rows, w.cols);
    let chunks = (w.rows * w.cols / CHUNK) as u64;
    if chunks == 0 {
        return Ok(());
    }
    let (codes, grid, cols, out_ptr) = (w.codes, w.grid, to_u32("fp8_dequantize", "cols", w.cols), out.ptr());
    let cfg = LaunchConfig {
        grid_dim: (to_u32("fp8_dequantize", "blocks", chunks.div_ceil(256) as usize), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.launch_builder("fp8_dequantize", out.dtype());
    launch.arg(&codes).arg(&grid).arg(&cols).arg(&chunks).arg(&out_ptr);
    // SAFETY: the arguments match the kernel's parameters; `w` holds `chunks` chunks of 16
    // codes (cols % 16 == 0) and `out` as many elements.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// `codes` = `x`'s `m` rows of `k` quantized (`fp8_quantize_rows`), for an op whose kernel does
/// not write its output's codes itself.
pub(super) fn quantize_rows(
    gpu: &Gpu,
    x: GpuView<'_>,
    m: usize,
    k: usize,
    codes: RowCodesMut<'_>,
) -> Result<(), GpuError> {
    assert_eq!(x.len(), m * k, "fp8_quantize_rows: x has {} elements, expected [{m}, {k}]", x.len());
    let arg = RowCodesMut::arg(Some(&codes), "fp8_quantize_rows", m, k);
    launch_quantize_rows(gpu, x, m, k, arg)
}

fn launch_quantize_rows(gpu: &Gpu, x: GpuView<'_>, m: usize, k: usize, codes: RowCodesArg) -> Result<(), GpuError> {
    if m == 0 {
        return Ok(());
    }
    let (x_ptr, k_u32) = (x.ptr(), to_u32("fp8_quantize_rows", "k", k));
    let mut launch = gpu.launch_builder("fp8_quantize_rows", x.dtype());
    launch.arg(&x_ptr).arg(&k_u32).arg(&codes.codes).arg(&codes.scales);
    let cfg = LaunchConfig {
        grid_dim: (to_u32("fp8_quantize_rows", "rows", m), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's parameters; x holds m rows of k, and `codes`
    // room for m rows of k codes and m scales (its owner's shape, or the scratch's, checked).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// Bytes of the quantized activations at the start of the scratch buffer: `[m, k]` codes, then
/// (16-byte aligned) `scales` f32 scales: where they start, and where they end.
fn quantized_bytes(m: usize, k: usize, scales: usize) -> (usize, usize) {
    let scales_at = (m * k).next_multiple_of(16);
    (scales_at, scales_at + 4 * scales)
}

/// Most rows a block GEMM pads through a buffer of its own: past it, the rows up to the last
/// multiple of 4 go straight to the output and only the rest through that buffer (at a second
/// read of the weights, small beside a GEMM of this many rows), so that the buffer stays small.
const PADDED_GEMM_ROWS: usize = 64;

/// A run of an FP8 GEMM's rows: `rows` rows of x from row `first`, run as a GEMM of
/// `gemm_rows`; where those are more, the rows past x's are zeros and the product goes through
/// a buffer of its own, its first `rows` rows copied out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GemmPart {
    first: usize,
    rows: usize,
    gemm_rows: usize,
}

/// The runs an FP8 GEMM of `m` rows over weights scaled by `scaling` takes: one of all the rows,
/// except that blocks take their activations' scales per token and 128 columns with the tokens
/// a multiple of 4 (cuBLASLt's VEC128 layout), padded as [`PADDED_GEMM_ROWS`] says.
fn gemm_parts(m: usize, scaling: Fp8GemmScaling) -> Vec<GemmPart> {
    let (whole, tail) = (m - m % 4, m % 4);
    match scaling {
        Fp8GemmScaling::Blocks if tail != 0 && m > PADDED_GEMM_ROWS => vec![
            GemmPart { first: 0, rows: whole, gemm_rows: whole },
            GemmPart { first: whole, rows: tail, gemm_rows: 4 },
        ],
        Fp8GemmScaling::Blocks => vec![GemmPart { first: 0, rows: m, gemm_rows: m.next_multiple_of(4) }],
        Fp8GemmScaling::Rows => vec![GemmPart { first: 0, rows: m, gemm_rows: m }],
    }
}

/// `codes` = `x`'s `m` rows of `k` quantized per token and 128 columns (`fp8_quantize_groups`),
/// with `rows - m` rows of zeros after them; k % 128 == 0.
fn launch_quantize_groups(
    gpu: &Gpu,
    x: GpuView<'_>,
    m: usize,
    rows: usize,
    k: usize,
    codes: RowCodesArg,
) -> Result<(), GpuError> {
    let op = "fp8_quantize_groups";
    debug_assert!(k.is_multiple_of(GEMM_BLOCK) && rows >= m);
    let warps = rows * (k / GEMM_BLOCK);
    if warps == 0 {
        return Ok(());
    }
    let (x_ptr, m_u32, rows_u32, k_u32) = (x.ptr(), to_u32(op, "m", m), to_u32(op, "rows", rows), to_u32(op, "k", k));
    let mut launch = gpu.launch_builder(op, x.dtype());
    launch.arg(&x_ptr).arg(&m_u32).arg(&rows_u32).arg(&k_u32).arg(&codes.codes).arg(&codes.scales);
    let cfg = LaunchConfig {
        grid_dim: (to_u32(op, "blocks", warps.div_ceil(8)), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's parameters; x holds m rows of k, and `codes` room
    // for `rows` rows of k codes and `rows * k / 128` scales (the scratch's size, checked).
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

/// `out[m, n] = x[m, k] · w^T` through an FP8 GEMM (see the module's doc), reading `x_codes`
/// where the op that wrote `x` also wrote its codes and the weights have a scale a row, else
/// quantizing `x` into `scratch` first; `false`, with nothing issued, where that GEMM does not
/// take the product (f32 activations, weights scaled otherwise, unaligned operands, too small a
/// scratch, or no cuBLASLt algorithm for the shape).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm(
    gpu: &Gpu,
    gemms: &Gemms,
    x: GpuView<'_>,
    m: usize,
    w: Fp8View<'_>,
    n: usize,
    out_ptr: u64,
    out_dtype: DType,
    scratch: &mut GpuTensor,
    x_codes: Option<RowCodes<'_>>,
) -> Result<bool, GpuError> {
    let k = w.cols;
    if let Some(c) = &x_codes {
        assert!(c.rows == m && c.cols == k, "linear: FP8 codes of [{}, {}] for x of [{m}, {k}]", c.rows, c.cols);
    }
    let Some((w_scales, scaling)) = w.gemm_scales else { return Ok(false) };
    // A kernel's codes of x are per token.
    let x_codes = x_codes.filter(|_| scaling == Fp8GemmScaling::Rows);
    let parts = gemm_parts(m, scaling);
    let shapes: Vec<Fp8GemmShape> =
        parts.iter().map(|part| Fp8GemmShape { m: part.gemm_rows, n, k, output: out_dtype, scaling }).collect();
    // Each part's codes, then its scales, in the scratch one after the other (16-byte aligned).
    let mut at = Vec::with_capacity(parts.len());
    let mut bytes = 0usize;
    for shape in &shapes {
        let start = bytes.next_multiple_of(16);
        let (scales_at, end) = quantized_bytes(shape.m, k, shape.x_scales());
        at.push((start, start + scales_at));
        bytes = start + end;
    }
    let fits = x.dtype() != DType::F32
        && n.is_multiple_of(16)
        && out_ptr.is_multiple_of(16)
        && (x_codes.is_some() || bytes <= scratch.size_in_bytes())
        && u32::try_from(m.next_multiple_of(4)).is_ok();
    if !fits || !gemms.fp8_supported(gpu, &shapes) {
        return Ok(false);
    }
    let (scratch_ptr, elem) = (scratch.view_mut().ptr(), out_dtype.size_in_bytes());
    for ((part, &shape), &(codes_at, scales_at)) in parts.iter().zip(&shapes).zip(&at) {
        let codes = match x_codes {
            Some(c) => c.arg,
            None => {
                let arg = RowCodesArg { codes: scratch_ptr + codes_at as u64, scales: scratch_ptr + scales_at as u64 };
                let x = x.slice(part.first * k..(part.first + part.rows) * k);
                match scaling {
                    Fp8GemmScaling::Rows => launch_quantize_rows(gpu, x, part.rows, k, arg)?,
                    Fp8GemmScaling::Blocks => launch_quantize_groups(gpu, x, part.rows, part.gemm_rows, k, arg)?,
                }
                arg
            }
        };
        let out = out_ptr + (part.first * n * elem) as u64;
        // Padding rows: the product into a buffer of its own (freed in stream order), its
        // first rows copied out.
        let padded = if part.gemm_rows == part.rows {
            None
        } else {
            // SAFETY: the GEMM below writes all of it before the copy reads it.
            Some(unsafe { gpu.stream().alloc::<u8>(part.gemm_rows * n * elem) }?)
        };
        let d_ptr = padded.as_ref().map_or(out, |buf| gpu.index_ptr(buf));
        // SAFETY: the weights hold at least n rows of k codes (n <= w.rows) and their scales in
        // the layout of `scaling` (a prefix of the rows reads the first of them); the part's
        // `gemm_rows` rows of codes and their scales were written (by the op that wrote x, or
        // just above); the output holds `gemm_rows` rows of n in `out_dtype` from `d_ptr`; all
        // 16-byte aligned (allocations, k % 16 == 0, the offsets, and the checks above).
        unsafe { gemms.run_fp8(gpu, shape, w.codes, w_scales, codes.codes, codes.scales, d_ptr) }?;
        if padded.is_some() {
            let bytes = part.rows * n * elem;
            // SAFETY: the two buffers are distinct live device memory of at least `bytes` bytes
            // (out holds the part's rows of n, the padded product more), in stream order after
            // the GEMM.
            unsafe { driver::memcpy_dtod_async(out, d_ptr, bytes, gpu.raw_stream()?) }?;
        }
    }
    Ok(true)
}

/// Times cuBLASLt's FP8 GEMMs of `w`'s first `n` rows at each row count of `ms`, into `output`,
/// and keeps the fastest algorithm per shape ([`Gemms::tune_fp8`]): the GEMMs a product of that
/// many rows runs (over blocks, one padded to a multiple of 4 rows, or past 64 rows two: the
/// rows to the last multiple of 4, and 4), each shape once, fewest rows first. A matrix the FP8
/// GEMM does not take (scales it does not scale by, `n` not a multiple of 16) gives nothing.
pub fn tune_gemms(
    gpu: &Gpu,
    gemms: &Gemms,
    w: Fp8View<'_>,
    n: usize,
    ms: &[usize],
    output: DType,
) -> Result<Vec<Fp8GemmTuning>, GpuError> {
    let Some((w_scales, scaling)) = w.gemm_scales else { return Ok(Vec::new()) };
    assert!(n <= w.rows, "tune_gemms: {n} rows of an FP8 matrix of {}", w.rows);
    if !n.is_multiple_of(16) {
        return Ok(Vec::new());
    }
    // The rows each GEMM runs, once each (blocks pad the rows to a multiple of 4).
    let mut rows: Vec<usize> =
        ms.iter().filter(|&&m| m > 0).flat_map(|&m| gemm_parts(m, scaling)).map(|part| part.gemm_rows).collect();
    rows.sort_unstable();
    rows.dedup();
    let mut report = Vec::new();
    for m in rows {
        let shape = Fp8GemmShape { m, n, k: w.cols, output, scaling };
        // SAFETY: the matrix holds at least n rows of k codes and their scales in the layout of
        // `scaling`, 16-byte aligned allocations; n % 16 == 0 (checked).
        report.extend(unsafe { gemms.tune_fp8(gpu, shape, w.codes, w_scales) }?);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Fp8Scales;

    fn matrix(rows: usize, cols: usize, scales: Fp8Scales) -> Fp8Matrix {
        Fp8Matrix::new(rows, cols, vec![0x38; rows * cols], scales).unwrap()
    }

    fn blocks(rows: usize, cols: usize, br: usize, bc: usize) -> Fp8Scales {
        Fp8Scales::Blocks { block_rows: br, block_cols: bc, scales: vec![1.0; rows.div_ceil(br) * cols.div_ceil(bc)] }
    }

    #[test]
    fn block_scales_are_padded_to_four_per_block_row() {
        // 300 rows of 640 columns: 3 block rows (the last partial) of 5 blocks, padded to 8.
        let grid: Vec<f32> = (1..=15).map(|i| i as f32).collect();
        let padded = gemm_block_scales(300, 640, &grid);
        let mut want = vec![0.0; 3 * 8];
        for (r, row) in grid.chunks(5).enumerate() {
            want[r * 8..r * 8 + 5].copy_from_slice(row);
        }
        assert_eq!(padded, want);
        // Four blocks a row need no padding: the checkpoint's grid as it is.
        let grid: Vec<f32> = (1..=8).map(|i| i as f32).collect();
        assert_eq!(gemm_block_scales(256, 512, &grid), grid);
    }

    #[test]
    fn block_gemms_pad_the_tokens_to_a_multiple_of_four() {
        let part = |first, rows, gemm_rows| GemmPart { first, rows, gemm_rows };
        assert_eq!(gemm_parts(5, Fp8GemmScaling::Rows), [part(0, 5, 5)]);
        assert_eq!(gemm_parts(8191, Fp8GemmScaling::Rows), [part(0, 8191, 8191)]);
        // Blocks: a multiple of 4 as it is; a few rows padded whole; more, only the last ones.
        assert_eq!(gemm_parts(64, Fp8GemmScaling::Blocks), [part(0, 64, 64)]);
        assert_eq!(gemm_parts(5, Fp8GemmScaling::Blocks), [part(0, 5, 8)]);
        assert_eq!(gemm_parts(63, Fp8GemmScaling::Blocks), [part(0, 63, 64)]);
        assert_eq!(gemm_parts(130, Fp8GemmScaling::Blocks), [part(0, 128, 128), part(128, 2, 4)]);
        let shape = |scaling| Fp8GemmShape { m: 8, n: 16, k: 256, output: DType::BF16, scaling };
        assert_eq!(shape(Fp8GemmScaling::Blocks).x_scales(), 16);
        assert_eq!(shape(Fp8GemmScaling::Rows).x_scales(), 8);
        assert_eq!(quantized_bytes(5, 256, 16), (1280, 1344));
        assert_eq!(quantized_bytes(3, 20, 3), (64, 76));
    }

    #[test]
    fn the_kernels_take_whole_chunks_and_power_of_two_blocks() {
        // A tensor or row scale spans the row: one block, found by the whole-row shift.
        assert_eq!(layout(&matrix(3, 64, Fp8Scales::Tensor(1.0))), Some((3, WHOLE_ROW_SHIFT, 1)));
        assert_eq!(layout(&matrix(3, 64, Fp8Scales::Rows(vec![1.0; 3]))), Some((1, WHOLE_ROW_SHIFT, 1)));
        // 128-wide blocks over 1040 columns: 9 blocks a row, the last partial.
        assert_eq!(layout(&matrix(300, 1040, blocks(300, 1040, 128, 128))), Some((128, 7, 9)));
        // Blocks at least as wide as the row.
        assert_eq!(layout(&matrix(4, 64, blocks(4, 64, 2, 128))), Some((2, WHOLE_ROW_SHIFT, 1)));
        assert_eq!(layout(&matrix(4, 64, blocks(4, 64, 1, 16))), Some((1, 4, 4)));
        // Columns not whole chunks, blocks narrower than a chunk or not a power of two.
        assert_eq!(layout(&matrix(2, 72, Fp8Scales::Tensor(1.0))), None);
        assert_eq!(layout(&matrix(2, 64, blocks(2, 64, 1, 8))), None);
        assert_eq!(layout(&matrix(2, 96, blocks(2, 96, 1, 48))), None);
        assert_eq!(layout(&matrix(0, 64, Fp8Scales::Tensor(1.0))), None);
    }

    #[test]
    fn the_tensor_core_gemv_takes_half_activations_over_blocks_of_64_columns_or_more() {
        let shift = |m: &Fp8Matrix| layout(m).expect("a layout the kernels take").1;
        let whole = shift(&matrix(3, 64, Fp8Scales::Rows(vec![1.0; 3])));
        let wide = shift(&matrix(300, 1040, blocks(300, 1040, 128, 128)));
        let narrowest = shift(&matrix(32, 256, blocks(32, 256, 16, 64)));
        for s in [whole, wide, narrowest] {
            assert!(tensor_cores_take(DType::BF16, s) && tensor_cores_take(DType::F16, s), "col_shift {s}");
            assert!(!tensor_cores_take(DType::F32, s), "f32, col_shift {s}");
        }
        for bc in [16, 32] {
            let s = shift(&matrix(4, 256, blocks(4, 256, 1, bc)));
            assert!(!tensor_cores_take(DType::BF16, s), "blocks of {bc} columns");
        }
    }

    #[test]
    fn the_tensor_core_gemv_splits_k_toward_its_warps_in_whole_rounds() {
        // Llama-3.1-8B's projections (16-row tiles; gate_up's gated tiles of 8 outputs, 28672 rows):
        // qkv 384 tiles, o_proj 256, gate_up 1792, down 256 over k = 14336, the LM head 8016.
        assert_eq!(tc_ksplit(6144 / 16, 4096), 4);
        assert_eq!(tc_ksplit(4096 / 16, 4096), 8);
        assert_eq!(tc_ksplit(28672 / 16, 4096), 1);
        assert_eq!(tc_ksplit(4096 / 16, 14336), 8);
        assert_eq!(tc_ksplit(128256 / 16, 4096), 1);
        // Short rows leave each part at least a round of chunks: 512 columns are 8 chunks, two
        // rounds, so 2 warps however few the tiles; under a round, one.
        assert_eq!(tc_ksplit(9, 512), 2);
        assert_eq!(tc_ksplit(9, 64), 1);
        assert_eq!(tc_ksplit(1, 8192), 8);
    }
}
