//! [`Gemms`]: the GEMMs of [`super::linear`], through `cublasGemmEx` or through cuBLASLt
//! algorithms chosen by timing for the shapes a model's decode steps run. `Gemms` owns the
//! cuBLASLt handle and the plans tuning kept; the `Gpu` lends its stream, cuBLAS handle and
//! workspace.
//!
//! `cublasGemmEx` picks its kernel by heuristic alone. At a decode batch of a few hundred rows
//! the grid of a GEMM is a few waves of the SMs, and which tile shape (or split of k) fills them
//! best is a question of measurement: [`Gemms::tune`] times cuBLAS's own choice and up to
//! [`CANDIDATES`] cuBLASLt algorithms on each shape it is given, with the model's real weights,
//! and keeps a cuBLASLt plan where one is faster. [`super::linear`]'s GEMMs then take the plan
//! of their exact shape when there is one, and `cublasGemmEx` otherwise, so an untuned shape
//! runs as before.
//!
//! Plans sum split-k partial products in f32 only, as the GEMMs through `cublasGemmEx` do
//! (never in the bf16/f16 output type), and use the `Gpu`'s fixed cuBLAS workspace, so that a
//! captured graph's GEMMs allocate nothing.
//!
//! Within one FP8 GEMM, the plans take cuBLASLt's fast accumulation where the `Gpu`'s options ask
//! for it (the default, [`super::GpuOptions::fp8_fast_accumulation`]), as FP8 inference engines run
//! their GEMMs: the tensor cores' running sums of FP8 products are then never promoted to f32 along
//! k. NVIDIA does not document what those sums keep; DeepSeek-V3's report measured about 14 bits on
//! Hopper. `fp8_gemm_matches_cpu_on_quantized_activations` holds each mode to its bound, and
//! `docs/PERFORMANCE.md` gives what each costs and measures. A shape whose fast plan cuBLASLt
//! declines takes the promoting one. GEMMs over 128 x 128 weight blocks always promote: cuBLASLt
//! applies their scales between blocks of k, and PyTorch, the reference user of these modes,
//! declines fast accumulation with them.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;

use super::gpu::Gpu;
use super::tensor::{GpuTensor, GpuView};
use super::GpuError;
use crate::fp8::GEMM_BLOCK;
use crate::{DType, Fp8GemmScaling};

/// cuBLASLt algorithms timed per shape, in cuBLASLt's order of preference.
pub(crate) const CANDIDATES: usize = 8;
/// FP8 GEMM plans kept at most (one per row count and projection shape); past it they are
/// forgotten and looked up again as needed.
const MAX_FP8_PLANS: usize = 1024;
/// A plan is kept only when it beats `cublasGemmEx` by this factor: closer than that is noise.
const MIN_GAIN: f32 = 0.97;

/// One GEMM as [`super::linear`] issues it: `out[m, n] = x[m, k] · w[n, k]^T`, `x` and `w` in
/// `input`, `out` in `output`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub input: DType,
    pub output: DType,
}

/// One FP8 GEMM: `out[m, n] = (sx · qx[m, k]) · (sw · qw[n, k])^T`, the operands e4m3 codes
/// with their scales, accumulated by the tensor cores (see the module's note on fast
/// accumulation), `out` in `output`. The scales, by `scaling`:
/// - [`Fp8GemmScaling::Rows`]: `sx[m]` per token, `sw[n]` per output feature (cuBLASLt's
///   outer-vector scaling).
/// - [`Fp8GemmScaling::Blocks`]: `sw` per 128 x 128 block, f32 `[ceil(n / 128), L4]` with
///   `L4 = ceil(k / 128)` rounded up to a multiple of 4, the padding zeros (cuBLASLt's
///   BLK128x128_32F: "K-major", the stride between block rows a multiple of 4); `sx` per token
///   and 128 columns, f32 `[k / 128, m]`, tokens fastest (VEC128_32F); m and n multiples of 4.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Fp8GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub output: DType,
    pub scaling: Fp8GemmScaling,
}

impl Fp8GemmShape {
    /// The activations' scales: one per token, or per token and 128 columns.
    pub(crate) fn x_scales(&self) -> usize {
        match self.scaling {
            Fp8GemmScaling::Rows => self.m,
            Fp8GemmScaling::Blocks => self.m * self.k.div_ceil(GEMM_BLOCK),
        }
    }
}

/// What tuning measured for one shape.
#[derive(Clone, Debug)]
pub struct GemmTuning {
    pub shape: GemmShape,
    /// `cublasGemmEx`'s time, microseconds per GEMM.
    pub default_us: f32,
    /// The fastest cuBLASLt candidate's, if any ran.
    pub best_us: Option<f32>,
    /// Candidates cuBLASLt offered (and that ran).
    pub candidates: usize,
    /// Whether the shape now runs through cuBLASLt.
    pub taken: bool,
}

/// What tuning measured for one FP8 shape ([`Gemms::tune_fp8`]).
#[derive(Clone, Debug)]
pub struct Fp8GemmTuning {
    pub shape: Fp8GemmShape,
    /// cuBLASLt's preferred algorithm's time (what an untuned shape runs), microseconds per GEMM,
    /// if it ran.
    pub heuristic_us: Option<f32>,
    /// The fastest candidate's, which the shape now runs.
    pub best_us: f32,
    /// Candidates cuBLASLt offered (and that ran).
    pub candidates: usize,
    /// Whether the plan accumulates without promotions to f32 (cuBLASLt's fast accumulation).
    pub fast_accumulation: bool,
}

/// The descriptors of one shape's cuBLASLt GEMM and the algorithm chosen for it.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: Option<sys::cublasLtMatmulAlgo_t>,
    /// Chosen by timing ([`Gemms::tune_fp8`]), so kept when the FP8 plans start over.
    tuned: bool,
    /// An FP8 plan with cuBLASLt's fast accumulation.
    fast_accumulation: bool,
}

impl Plan {
    /// A plan of `desc` alone: its layouts null until set, so that `Drop` frees whatever was
    /// created if a later step fails.
    fn around(desc: sys::cublasLtMatmulDesc_t) -> Plan {
        let null = std::ptr::null_mut();
        Plan { desc, a: null, b: null, d: null, algo: None, tuned: false, fast_accumulation: false }
    }

    /// The descriptors of `shape` (no algorithm yet). Column-major, as `cublasGemmEx` is
    /// called: `out^T [n, m] = (w [k, n])^T · x^T [k, m]`.
    fn new(shape: GemmShape) -> Result<Plan, GpuError> {
        let GemmShape { m, n, k, input, output } = shape;
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)?;
        let mut plan = Plan::around(desc);
        // CUBLAS_OP_T, CUBLAS_OP_N.
        let (transpose, keep): (i32, i32) = (1, 0);
        // SAFETY: the descriptor is live; each attribute is an i32 as cuBLASLt documents.
        unsafe {
            use sys::cublasLtMatmulDescAttributes_t as Desc;
            let ((t, t_len), (n, n_len)) = (attribute(&transpose), attribute(&keep));
            lt::set_matmul_desc_attribute(plan.desc, Desc::CUBLASLT_MATMUL_DESC_TRANSA, t, t_len)?;
            lt::set_matmul_desc_attribute(plan.desc, Desc::CUBLASLT_MATMUL_DESC_TRANSB, n, n_len)?;
        }
        let dim = |v: usize| v as u64;
        plan.a = lt::create_matrix_layout(data_type(input), dim(k), dim(n), k as i64)?;
        plan.b = lt::create_matrix_layout(data_type(input), dim(k), dim(m), k as i64)?;
        plan.d = lt::create_matrix_layout(data_type(output), dim(n), dim(m), n as i64)?;
        Ok(plan)
    }

    /// The descriptors of an FP8 GEMM, as [`Plan::new`]'s (`W` transposed: the layout cuBLASLt's
    /// FP8 GEMMs require), with the operands scaled as `shape.scaling` says, and with fast
    /// accumulation or without. The scale pointers are set per call ([`Plan::set_fp8_scales`]).
    fn fp8(shape: Fp8GemmShape, fast_accumulation: bool) -> Result<Plan, GpuError> {
        let Fp8GemmShape { m, n, k, output, scaling } = shape;
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)?;
        let mut plan = Plan::around(desc);
        plan.fast_accumulation = fast_accumulation;
        let (transpose, keep): (i32, i32) = (1, 0);
        use sys::cublasLtMatmulMatrixScale_t as Scale;
        let (w_mode, x_mode) = match scaling {
            Fp8GemmScaling::Rows => {
                (Scale::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, Scale::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F)
            }
            Fp8GemmScaling::Blocks => {
                (Scale::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, Scale::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F)
            }
        };
        let (w_mode, x_mode) = (w_mode as u32, x_mode as u32);
        let fast = i8::from(fast_accumulation);
        // SAFETY: the descriptor is live; the transposes are i32, the scale modes u32 and the
        // fast-accumulation flag i8, as cuBLASLt documents.
        unsafe {
            use sys::cublasLtMatmulDescAttributes_t as Desc;
            let ((t, t_len), (n_op, n_len)) = (attribute(&transpose), attribute(&keep));
            let ((wm, wm_len), (xm, xm_len)) = (attribute(&w_mode), attribute(&x_mode));
            lt::set_matmul_desc_attribute(plan.desc, Desc::CUBLASLT_MATMUL_DESC_TRANSA, t, t_len)?;
            lt::set_matmul_desc_attribute(plan.desc, Desc::CUBLASLT_MATMUL_DESC_TRANSB, n_op, n_len)?;
            lt::set_matmul_desc_attribute(plan.desc, Desc::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, wm, wm_len)?;
            lt::set_matmul_desc_attribute(plan.desc, Desc::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, xm, xm_len)?;
            let (f, f_len) = attribute(&fast);
            lt::set_matmul_desc_attribute(plan.desc, Desc::CUBLASLT_MATMUL_DESC_FAST_ACCUM, f, f_len)?;
        }
        let (e4m3, dim) = (sys::cudaDataType::CUDA_R_8F_E4M3, |v: usize| v as u64);
        plan.a = lt::create_matrix_layout(e4m3, dim(k), dim(n), k as i64)?;
        plan.b = lt::create_matrix_layout(e4m3, dim(k), dim(m), k as i64)?;
        plan.d = lt::create_matrix_layout(data_type(output), dim(n), dim(m), n as i64)?;
        Ok(plan)
    }

    /// Points an FP8 plan's scales at `w_scales` and `x_scales` (f32, laid out as its
    /// [`Fp8GemmShape::scaling`] says).
    ///
    /// # Safety
    /// The plan is an FP8 one; the pointers must stay valid until its GEMM has run.
    unsafe fn set_fp8_scales(&self, w_scales: u64, x_scales: u64) -> Result<(), GpuError> {
        // SAFETY: the descriptor is live; each attribute is a device pointer.
        unsafe {
            use sys::cublasLtMatmulDescAttributes_t as Desc;
            let ((w, w_len), (x, x_len)) = (attribute(&w_scales), attribute(&x_scales));
            lt::set_matmul_desc_attribute(self.desc, Desc::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, w, w_len)?;
            lt::set_matmul_desc_attribute(self.desc, Desc::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, x, x_len)?;
        }
        Ok(())
    }

    /// Up to `count` algorithms for this plan, cuBLASLt's preferred first, that keep reductions
    /// in f32 and fit in `workspace_bytes`.
    fn candidates(
        &self,
        handle: sys::cublasLtHandle_t,
        count: usize,
        workspace_bytes: usize,
    ) -> Result<Vec<sys::cublasLtMatmulAlgo_t>, GpuError> {
        let pref = lt::create_matmul_pref()?;
        let found = (|| {
            let workspace = workspace_bytes as u64;
            // Split-k partial products only summed in the f32 compute type (not in place in the
            // output type, nor in the output type through the workspace).
            let reductions = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
            // SAFETY: `pref` is live; the attributes are a u64 and a u32 as documented.
            unsafe {
                use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
                let ((w, w_len), (r, r_len)) = (attribute(&workspace), attribute(&reductions));
                lt::set_matmul_pref_attribute(pref, Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, w, w_len)?;
                lt::set_matmul_pref_attribute(pref, Pref::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, r, r_len)?;
            }
            // SAFETY: an all-zero heuristic result is a valid value of this plain C struct; the
            // call writes at most `count` of them and says how many.
            let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> = vec![unsafe { std::mem::zeroed() }; count];
            let mut returned = 0i32;
            // SAFETY: every descriptor is live; `results` holds `count` entries.
            unsafe {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    self.desc,
                    self.a,
                    self.b,
                    self.d,
                    self.d,
                    pref,
                    count as i32,
                    results.as_mut_ptr(),
                    &mut returned,
                )
            }
            .result()?;
            let algos = results
                .iter()
                .take(returned.max(0) as usize)
                .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= workspace_bytes)
                .map(|r| r.algo)
                .collect();
            Ok::<_, GpuError>(algos)
        })();
        // SAFETY: created above, used no more.
        unsafe { lt::destroy_matmul_pref(pref) }?;
        found
    }

    /// Issues the GEMM with `algo` on the `Gpu`'s stream.
    ///
    /// # Safety
    /// `w_ptr`, `x_ptr` and `out_ptr` must hold the plan's shape in its dtypes.
    unsafe fn run(
        &self,
        gpu: &Gpu,
        handle: sys::cublasLtHandle_t,
        algo: &sys::cublasLtMatmulAlgo_t,
        w_ptr: u64,
        x_ptr: u64,
        out_ptr: u64,
    ) -> Result<(), GpuError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (workspace, workspace_bytes) = gpu.blas_workspace();
        let stream = gpu.raw_stream()? as sys::cudaStream_t;
        // SAFETY: the caller vouches for the buffers; the descriptors are live; the workspace is
        // the `Gpu`'s, used in stream order.
        unsafe {
            lt::matmul(
                handle,
                self.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w_ptr as *const c_void,
                self.a,
                x_ptr as *const c_void,
                self.b,
                out_ptr as *const c_void,
                self.d,
                out_ptr as *mut c_void,
                self.d,
                algo,
                workspace as *mut c_void,
                workspace_bytes,
                stream,
            )
        }?;
        Ok(())
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by `Plan::new` or `Plan::fp8` (or is null) and is
        // freed once.
        unsafe {
            for layout in [self.a, self.b, self.d] {
                if !layout.is_null() {
                    let _ = lt::destroy_matrix_layout(layout);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// A value as cuBLASLt's attribute setters take it: its address and size.
fn attribute<T>(value: &T) -> (*const c_void, usize) {
    ((value as *const T).cast(), std::mem::size_of::<T>())
}

fn data_type(dtype: DType) -> sys::cudaDataType {
    match dtype {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

/// The GEMMs of one device's ops: the cuBLASLt handle and the plans tuning kept, by shape.
/// Create one per [`Gpu`] and pass it to every [`super::linear`] on that `Gpu`; a shape without
/// a plan goes through the `Gpu`'s cuBLAS handle.
pub struct Gemms {
    handle: sys::cublasLtHandle_t,
    plans: Mutex<HashMap<GemmShape, Plan>>,
    /// FP8 GEMMs by shape: cuBLASLt's plan (its preferred algorithm, or the fastest where
    /// [`Gemms::tune_fp8`] timed them), or `None` where it has none (`linear_fp8` then
    /// dequantizes the weights).
    fp8_plans: Mutex<HashMap<Fp8GemmShape, Option<Plan>>>,
}

// SAFETY: the handle and the plans' descriptors are only read after creation (cuBLASLt allows
// a handle and descriptors to be used from any thread), except an FP8 plan's scale pointers,
// set and used under the map's mutex; the maps are behind mutexes.
unsafe impl Send for Gemms {}
// SAFETY: as above.
unsafe impl Sync for Gemms {}

impl Gemms {
    /// A cuBLASLt handle and no plans: every GEMM goes through `cublasGemmEx` until [`Self::tune`].
    pub fn new() -> Result<Gemms, GpuError> {
        let (plans, fp8_plans) = (Mutex::new(HashMap::new()), Mutex::new(HashMap::new()));
        Ok(Gemms { handle: lt::create_handle()?, plans, fp8_plans })
    }

    /// `shape`'s GEMM on `gpu`'s stream: through its tuned plan if it has one, else
    /// `cublasGemmEx` (k > 0).
    ///
    /// # Safety
    /// `w_ptr`, `x_ptr` and `out_ptr` must hold `shape`'s operands in its dtypes.
    pub(crate) unsafe fn run(
        &self,
        gpu: &Gpu,
        shape: GemmShape,
        w_ptr: u64,
        x_ptr: u64,
        out_ptr: u64,
    ) -> Result<(), GpuError> {
        {
            let plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(plan) = plans.get(&shape) {
                if let Some(algo) = plan.algo.as_ref() {
                    // SAFETY: as the caller vouches.
                    return unsafe { plan.run(gpu, self.handle, algo, w_ptr, x_ptr, out_ptr) };
                }
            }
        }
        // SAFETY: as the caller vouches.
        unsafe { cublas_gemm(gpu, shape, w_ptr, x_ptr, out_ptr) }
    }

    /// Whether cuBLASLt has an FP8 GEMM of each of `shapes` on this device (its heuristic's
    /// first algorithm, asked once per shape and remembered; an error on the way counts as
    /// none). The plans of all of them are kept until the next call, for [`Self::run_fp8`].
    pub(crate) fn fp8_supported(&self, gpu: &Gpu, shapes: &[Fp8GemmShape]) -> bool {
        let mut plans = self.fp8_plans.lock().unwrap_or_else(|e| e.into_inner());
        let new = shapes.iter().filter(|shape| !plans.contains_key(shape)).count();
        if new > 0 && plans.len() + new > MAX_FP8_PLANS {
            // Prompt chunks bring any number of row counts: start over rather than grow, keeping
            // what tuning chose (a few shapes per decode batch it was given).
            plans.retain(|_, plan| plan.as_ref().is_some_and(|p| p.tuned));
        }
        shapes.iter().all(|&shape| self.fp8_plan(gpu, &mut plans, shape))
    }

    /// `shape`'s entry of `plans`, asked of cuBLASLt where it has none: whether it has a plan.
    fn fp8_plan(&self, gpu: &Gpu, plans: &mut HashMap<Fp8GemmShape, Option<Plan>>, shape: Fp8GemmShape) -> bool {
        let plan = plans.entry(shape).or_insert_with(|| {
            let (workspace, _) = gpu.blas_workspace();
            // The heuristic takes vector scales only with their pointers set: any valid device
            // address stands in until `run_fp8` sets the call's.
            // SAFETY: the workspace lives as long as the `Gpu`; the kept plan holds its address
            // as scales only until `run_fp8` sets the call's, before every run.
            let plan = match unsafe { self.fp8_candidates(gpu, shape, 1, workspace, workspace) } {
                Ok(Some((mut plan, algos))) => {
                    plan.algo = algos.into_iter().next();
                    Some(plan)
                }
                Ok(None) => None,
                Err(e) => {
                    tracing::debug!(?shape, error = %e, "no FP8 GEMM from cuBLASLt");
                    None
                }
            };
            if plan.is_none() && shape.scaling == Fp8GemmScaling::Blocks {
                // Block scaling needs cuBLASLt 12.9 or later on compute capability 9.0: without
                // it each such product dequantizes its matrix, which is worth saying (once a
                // shape).
                tracing::info!(?shape, "no FP8 GEMM over 128 x 128 blocks from cuBLASLt: the matrix is dequantized");
            }
            plan
        });
        plan.is_some()
    }

    /// An FP8 plan of `shape` with its scales at `w_scales` and `x_scales`, and up to `count` of
    /// its algorithms, cuBLASLt's preferred first: with fast accumulation where `gpu`'s options
    /// ask for it and cuBLASLt has one, else with promotions. `None` where cuBLASLt offers no
    /// algorithm; an error where it declines the promoting plan (it declines a shape either
    /// way), the fast plan's decline only logged.
    ///
    /// # Safety
    /// The scale pointers must stay valid while the plan runs with them.
    unsafe fn fp8_candidates(
        &self,
        gpu: &Gpu,
        shape: Fp8GemmShape,
        count: usize,
        w_scales: u64,
        x_scales: u64,
    ) -> Result<Option<(Plan, Vec<sys::cublasLtMatmulAlgo_t>)>, GpuError> {
        let (_, workspace_bytes) = gpu.blas_workspace();
        let fast = gpu.options().fp8_fast_accumulation && shape.scaling == Fp8GemmScaling::Rows;
        let modes: &[bool] = if fast { &[true, false] } else { &[false] };
        for &fast in modes {
            let planned = Plan::fp8(shape, fast).and_then(|plan| {
                // SAFETY: an FP8 plan; the caller vouches for the scales.
                unsafe { plan.set_fp8_scales(w_scales, x_scales) }?;
                let algos = plan.candidates(self.handle, count, workspace_bytes)?;
                Ok((plan, algos))
            });
            match planned {
                Ok((plan, algos)) if !algos.is_empty() => return Ok(Some((plan, algos))),
                Ok(_) => {}
                Err(e) if fast => tracing::debug!(?shape, error = %e, "no fast-accumulation FP8 GEMM from cuBLASLt"),
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// `shape`'s FP8 GEMM ([`Fp8GemmShape`]) on `gpu`'s stream; [`Self::fp8_supported`] said yes.
    ///
    /// # Safety
    /// `w` (`[n, k]` e4m3), `x` (`[m, k]` e4m3), their scales (f32, as [`Fp8GemmShape`] lays
    /// them out for its scaling) and `out` (`[m, n]` of `shape.output`) must be valid device
    /// buffers, 16-byte aligned.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run_fp8(
        &self,
        gpu: &Gpu,
        shape: Fp8GemmShape,
        w: u64,
        w_scales: u64,
        x: u64,
        x_scales: u64,
        out: u64,
    ) -> Result<(), GpuError> {
        let plans = self.fp8_plans.lock().unwrap_or_else(|e| e.into_inner());
        let plan = plans.get(&shape).and_then(Option::as_ref).expect("run_fp8 after fp8_supported said yes of it");
        let algo = plan.algo.as_ref().expect("an FP8 plan is kept with its algorithm");
        // SAFETY: as the caller vouches; the scales are set and used under the lock, in stream
        // order.
        unsafe {
            plan.set_fp8_scales(w_scales, x_scales)?;
            plan.run(gpu, self.handle, algo, w, x, out)
        }
    }

    /// Times up to [`CANDIDATES`] cuBLASLt FP8 algorithms on `shape` with the weights `w` and
    /// their scales `w_scales` (activations of spread codes and unit scales), and keeps the
    /// fastest as the shape's plan, where an untuned shape takes cuBLASLt's preferred one.
    /// `None` where cuBLASLt offers none. Synchronizes the stream: call it outside graph
    /// capture.
    ///
    /// # Safety
    /// `w` (`[n, k]` e4m3) and `w_scales` (f32, as [`Fp8GemmShape`] lays them out for its
    /// scaling) must be valid device buffers, 16-byte aligned, and `shape.n` a multiple of 16.
    pub(crate) unsafe fn tune_fp8(
        &self,
        gpu: &Gpu,
        shape: Fp8GemmShape,
        w: u64,
        w_scales: u64,
    ) -> Result<Option<Fp8GemmTuning>, GpuError> {
        let Fp8GemmShape { m, n, k, output, .. } = shape;
        // Codes of small values of both signs (zeros would time faster than real data).
        let x_host: Vec<u8> = (0..m * k).map(|i| (i.wrapping_mul(2_654_435_761) >> 9) as u8 & 0xb7).collect();
        let x = gpu.upload(&x_host)?;
        let x_scales = GpuTensor::from_f32(gpu, &vec![1.0; shape.x_scales()], DType::F32)?;
        let out = GpuTensor::zeros(gpu, output, m * n)?;
        let (x_ptr, x_scales_ptr, out_ptr) = (gpu.index_ptr(&x), x_scales.view().ptr(), out.view().ptr());
        // SAFETY: the scales outlive the plan's runs here (synchronized below).
        let planned = unsafe { self.fp8_candidates(gpu, shape, CANDIDATES, w_scales, x_scales_ptr) };
        // cuBLASLt declining the shape (an error or no algorithm, as `fp8_supported` counts them)
        // leaves it untuned.
        let (mut plan, algos) = match planned {
            Ok(Some(planned)) => planned,
            Ok(None) => return Ok(None),
            Err(e) => {
                tracing::debug!(?shape, error = %e, "no FP8 GEMM from cuBLASLt to tune");
                return Ok(None);
            }
        };
        let handle = self.handle;
        let mut timed = Vec::new();
        for (i, algo) in algos.into_iter().enumerate() {
            // SAFETY: the caller vouches for the weights; x, its scales and out hold the shape.
            let run = gpu.time_us(|| unsafe { plan.run(gpu, handle, &algo, w, x_ptr, out_ptr) });
            // A candidate that fails to launch is passed over, not fatal.
            if let Ok(us) = run {
                timed.push((i, us, algo));
            }
        }
        gpu.synchronize()?;
        let heuristic_us = timed.iter().find(|(i, _, _)| *i == 0).map(|&(_, us, _)| us);
        let candidates = timed.len();
        let Some((_, best_us, algo)) = timed.into_iter().min_by(|a, b| a.1.total_cmp(&b.1)) else { return Ok(None) };
        (plan.algo, plan.tuned) = (Some(algo), true);
        let fast_accumulation = plan.fast_accumulation;
        self.fp8_plans.lock().unwrap_or_else(|e| e.into_inner()).insert(shape, Some(plan));
        Ok(Some(Fp8GemmTuning { shape, heuristic_us, best_us, candidates, fast_accumulation }))
    }

    /// Forgets every tuned plan: GEMMs go back to `cublasGemmEx` (to compare the two).
    pub fn clear(&self) {
        self.plans.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    fn keep(&self, shape: GemmShape, plan: Plan) {
        self.plans.lock().unwrap_or_else(|e| e.into_inner()).insert(shape, plan);
    }

    /// Times `cublasGemmEx` and up to [`CANDIDATES`] cuBLASLt algorithms on `gpu` on each weight
    /// of `weights` (`(w [n, k], n, output dtype)`) at each row count of `ms`, and keeps, per
    /// shape, a cuBLASLt algorithm that is at least 3 % faster. Half-precision weights only (an
    /// f32 GEMM stays on `cublasGemmEx`, which keeps TF32 off). Synchronizes the stream: call it
    /// outside graph capture. Returns what it measured, shape by shape.
    pub fn tune(
        &self,
        gpu: &Gpu,
        ms: &[usize],
        weights: &[(GpuView<'_>, usize, DType)],
    ) -> Result<Vec<GemmTuning>, GpuError> {
        self.tune_keeping(gpu, ms, weights, MIN_GAIN)
    }

    /// [`Gemms::tune`] keeping the fastest cuBLASLt candidate of every shape whatever its time
    /// against `cublasGemmEx`: to test the cuBLASLt path.
    #[cfg(feature = "bench-internals")]
    pub fn tune_always(
        &self,
        gpu: &Gpu,
        ms: &[usize],
        weights: &[(GpuView<'_>, usize, DType)],
    ) -> Result<Vec<GemmTuning>, GpuError> {
        self.tune_keeping(gpu, ms, weights, f32::INFINITY)
    }

    fn tune_keeping(
        &self,
        gpu: &Gpu,
        ms: &[usize],
        weights: &[(GpuView<'_>, usize, DType)],
        min_gain: f32,
    ) -> Result<Vec<GemmTuning>, GpuError> {
        let mut report = Vec::new();
        for &(w, n, output) in weights {
            assert!(n > 0 && w.len().is_multiple_of(n), "tune_gemms: {} weights are not rows of {n}", w.len());
            if w.dtype() == DType::F32 {
                continue;
            }
            for &m in ms.iter().filter(|&&m| m > 0) {
                report.push(self.tune_one(gpu, w, m, n, output, min_gain)?);
            }
        }
        gpu.synchronize()?;
        Ok(report)
    }

    fn tune_one(
        &self,
        gpu: &Gpu,
        w: GpuView<'_>,
        m: usize,
        n: usize,
        output: DType,
        min_gain: f32,
    ) -> Result<GemmTuning, GpuError> {
        let k = w.len() / n;
        let shape = GemmShape { m, n, k, input: w.dtype(), output };
        // Inputs of small values spread over [-1, 1] (zeros would time faster than real data).
        let x_host: Vec<f32> =
            (0..m * k).map(|i| ((i.wrapping_mul(2_654_435_761) % 2001) as f32 - 1000.0) * 1e-3).collect();
        let x = GpuTensor::from_f32(gpu, &x_host, w.dtype())?;
        let out = GpuTensor::zeros(gpu, output, m * n)?;
        let (w_ptr, x_ptr, out_ptr) = (w.ptr(), x.view().ptr(), out.view().ptr());
        // SAFETY (both timings): `w`, `x` and `out` hold the shape in its dtypes.
        let default_us = gpu.time_us(|| unsafe { cublas_gemm(gpu, shape, w_ptr, x_ptr, out_ptr) })?;
        let mut plan = Plan::new(shape)?;
        let (_, workspace_bytes) = gpu.blas_workspace();
        let handle = self.handle;
        let mut best: Option<(f32, sys::cublasLtMatmulAlgo_t)> = None;
        let mut ran = 0;
        for algo in plan.candidates(handle, CANDIDATES, workspace_bytes)? {
            let timed = gpu.time_us(|| unsafe { plan.run(gpu, handle, &algo, w_ptr, x_ptr, out_ptr) });
            // A candidate that fails to launch is passed over, not fatal.
            let Ok(us) = timed else { continue };
            ran += 1;
            if best.is_none_or(|(b, _)| us < b) {
                best = Some((us, algo));
            }
        }
        let taken = best.is_some_and(|(us, _)| us < min_gain * default_us);
        if let (true, Some((_, algo))) = (taken, best) {
            plan.algo = Some(algo);
            self.keep(shape, plan);
        }
        Ok(GemmTuning { shape, default_us, best_us: best.map(|(us, _)| us), candidates: ran, taken })
    }
}

impl Drop for Gemms {
    fn drop(&mut self) {
        self.clear();
        self.fp8_plans.lock().unwrap_or_else(|e| e.into_inner()).clear();
        // SAFETY: created in `new`, freed once, after its plans.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// `shape`'s GEMM through `cublasGemmEx` (k > 0).
///
/// # Safety
/// `w_ptr`, `x_ptr` and `out_ptr` must hold `shape`'s operands in its dtypes.
unsafe fn cublas_gemm(gpu: &Gpu, shape: GemmShape, w_ptr: u64, x_ptr: u64, out_ptr: u64) -> Result<(), GpuError> {
    let GemmShape { m, n, k, input, output } = shape;
    let (m_i, n_i, k_i) = (gemm_dim("m", m), gemm_dim("n", n), gemm_dim("k", k));
    let (alpha, beta) = (1.0f32, 0.0f32);
    let handle = gpu.blas_handle()?;
    // Column-major view of the row-major buffers: out^T [n, m] = w [k, n]^T · x^T [k, m].
    // SAFETY: the caller vouches for the pointers; alpha and beta are host f32 as the f32
    // compute type expects.
    unsafe {
        blas::gemm_ex(
            handle,
            blas_sys::cublasOperation_t::CUBLAS_OP_T,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            n_i,
            m_i,
            k_i,
            &alpha as *const f32 as *const c_void,
            w_ptr as *const c_void,
            blas_type(input),
            k_i,
            x_ptr as *const c_void,
            blas_type(input),
            k_i,
            &beta as *const f32 as *const c_void,
            out_ptr as *mut c_void,
            blas_type(output),
            n_i,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}

fn blas_type(dtype: DType) -> blas_sys::cudaDataType_t {
    match dtype {
        DType::F32 => blas_sys::cudaDataType_t::CUDA_R_32F,
        DType::BF16 => blas_sys::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => blas_sys::cudaDataType_t::CUDA_R_16F,
    }
}

fn gemm_dim(what: &str, value: usize) -> i32 {
    i32::try_from(value).unwrap_or_else(|_| panic!("linear: {what} = {value} exceeds cuBLAS's 32-bit sizes"))
}
