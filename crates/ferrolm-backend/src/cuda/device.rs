//! [`Cuda`]: the device interface over the CUDA ops, with weights, activations and the paged
//! KV cache in device memory in one compute dtype (bf16 by default; f32 to compare closely with
//! the CPU). Norm weights, biases and the residual stream stay f32. It owns the [`Gpu`] and the
//! state the ops keep beside it: the decode attention's workspace ([`PagedAttention`]) and the
//! tuned GEMM plans ([`Gemms`]).
//!
//! The fused forms of the interface take today's fused kernels where they apply: the qkv
//! projection, rotation and cache write in one GEMV kernel (or the projection, then one kernel
//! for the rest, with the q/k norms too where a model has them), and the gate/up projection
//! with its activation in one GEMV kernel. In an FP8 model, the norms and gated activations
//! that write a projection's input write its FP8 codes too ([`CudaTensor`]), so that an FP8 GEMM
//! reads them instead of quantizing its input first.

use std::sync::{Mutex, PoisonError};

use cudarc::driver::{CudaSlice, CudaView};

use super::{
    add_normed_rms_norm, add_rms_norm, add_sigmoid_gated, embedding, fp8, fp8_qkv_rope_cache_fits, gated_activation,
    gather_rows, linear, linear_fp8, linear_fp8_qkv_rope_cache, linear_gated, linear_gated_fp8, linear_qkv_rope_cache,
    moe, qkv_norm_rope_cache, qkv_norm_rope_cache_fits, qkv_rope_cache, reshape_and_cache, reshape_and_cache_fp8,
    rms_norm, rms_norm_inplace, rope, softcap, split_qkv, Fp8Cache, Fp8CacheMut, Fp8GemmTuning, Fp8Operands, Fp8View,
    GatedOut, GemmTuning, Gemms, Gpu, GpuAttentionMetadata, GpuError, GpuExperts, GpuFp8Matrix, GpuMoeScratch,
    GpuRopeTable, GpuRowCodes, GpuTensor, GpuView, GpuViewMut, PagedAttention, QkNorms, QkvOut, QkvRows, RowCodes,
    RowCodesMut, GEMV_MAX_M,
};
use crate::device::{
    unfused_attention_input, AttentionInput, Device, GatedActivation, KvCacheDtype, KvScales, LayerAttention, Linear,
    MatrixUse, MoeInput, MoeShape, Precision, RopeFrequencies, Shaped,
};
use crate::{DType, Fp8Matrix, HostTensor};

/// One GPU as a [`Device`], computing in `dtype`.
pub struct Cuda {
    gpu: Gpu,
    attention: PagedAttention,
    gemms: Gemms,
    dtype: DType,
    /// `[largest FP8 matrix]` in `dtype`: where a product of more rows than the FP8 GEMV takes
    /// dequantizes its matrix (`linear_fp8`). Allocated, and grown, as FP8 matrices are placed,
    /// so that it is counted before the KV cache takes the memory left.
    fp8_scratch: Mutex<Option<GpuTensor>>,
}

impl Cuda {
    /// `gpu` computing in `dtype` (f32, bf16 or f16), with its attention workspace and no tuned
    /// GEMM plans yet.
    pub fn new(gpu: Gpu, dtype: DType) -> Result<Cuda, GpuError> {
        let attention = PagedAttention::new(&gpu)?;
        Ok(Cuda { gpu, attention, gemms: Gemms::new()?, dtype, fp8_scratch: Mutex::new(None) })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The GEMMs every projection of this device runs through.
    pub fn gemms(&self) -> &Gemms {
        &self.gemms
    }

    /// [`Gemms::tune`] on this device's GPU: the projections of `weights` at each row count of
    /// `ms` take a cuBLASLt plan where one is faster than `cublasGemmEx`.
    pub fn tune_gemms(
        &self,
        ms: &[usize],
        weights: &[(GpuView<'_>, usize, DType)],
    ) -> Result<Vec<GemmTuning>, GpuError> {
        self.gemms.tune(&self.gpu, ms, weights)
    }

    /// [`Self::tune_gemms`] for FP8 projections (`(w, n, output dtype)`): the FP8 GEMM of each at
    /// each row count of `ms` takes the fastest of cuBLASLt's algorithms.
    pub fn tune_fp8_gemms(
        &self,
        ms: &[usize],
        weights: &[(Fp8View<'_>, usize, DType)],
    ) -> Result<Vec<Fp8GemmTuning>, GpuError> {
        let mut report = Vec::new();
        // f32 activations never take the FP8 GEMM (see `linear_fp8`).
        if self.dtype == DType::F32 {
            return Ok(report);
        }
        for &(w, n, output) in weights {
            report.extend(fp8::tune_gemms(&self.gpu, &self.gemms, w, n, ms, output)?);
        }
        Ok(report)
    }

    fn dtype_of(&self, precision: Precision) -> DType {
        match precision {
            Precision::Compute | Precision::ProjectionInput => self.dtype,
            Precision::F32 => DType::F32,
        }
    }

    /// Whether a buffer of `precision` keeps its rows' FP8 codes: a projection input, where the
    /// FP8 GEMM takes the compute dtype (bf16 or f16).
    fn keeps_codes(&self, precision: Precision) -> bool {
        precision == Precision::ProjectionInput && self.dtype != DType::F32
    }

    /// Runs `f` with the FP8 scratch (an FP8 matrix has been placed, so it exists).
    fn with_fp8_scratch<R>(&self, f: impl FnOnce(&mut GpuTensor) -> R) -> R {
        let mut scratch = self.fp8_scratch.lock().unwrap_or_else(PoisonError::into_inner);
        f(scratch.as_mut().expect("FP8 matrices are placed with their scratch"))
    }
}

/// A weight matrix on the device: in the compute dtype, or (projections read by `linear` and
/// the fused projections, in a layout the FP8 kernels take) e4m3 codes and their scales.
pub enum CudaMatrix {
    Dense(GpuTensor),
    Fp8(GpuFp8Matrix),
}

impl CudaMatrix {
    /// The matrix in the compute dtype; `None` for an FP8 one.
    pub fn dense(&self) -> Option<&GpuTensor> {
        match self {
            CudaMatrix::Dense(t) => Some(t),
            CudaMatrix::Fp8(_) => None,
        }
    }

    /// [`Self::dense`] for an op that only reads dense matrices: the device places FP8 ones only
    /// for `linear` ([`MatrixUse::Linear`]), so another is a caller bug.
    fn expect_dense(&self, op: &str) -> &GpuTensor {
        self.dense().unwrap_or_else(|| panic!("{op}: an FP8 matrix, placed for linear only"))
    }
}

/// An activation buffer on the device, `[rows, cols]` with room for `capacity` rows, and, for a
/// projection input ([`Precision::ProjectionInput`]), its rows' FP8 codes.
///
/// Invariant: `codes_written` holds only while the codes are those of the rows as they are now.
/// Every write of the values goes through [`CudaTensor::view_mut`], which clears it, or
/// [`CudaTensor::view_mut_with_codes`], whose op writes the codes too (an op that fails instead
/// aborts its step, and the next step's rows clear the flag); so does a change of rows.
pub struct CudaTensor {
    /// `[capacity, cols]`
    buf: GpuTensor,
    rows: usize,
    cols: usize,
    codes: Option<GpuRowCodes>,
    codes_written: bool,
}

impl CudaTensor {
    /// `[rows, cols]`
    pub fn view(&self) -> GpuView<'_> {
        self.buf.rows(0..self.rows, self.cols)
    }

    /// `[rows, cols]`, for an op that writes the values alone.
    pub fn view_mut(&mut self) -> GpuViewMut<'_> {
        self.codes_written = false;
        self.buf.rows_mut(0..self.rows, self.cols)
    }

    /// `[rows, cols]`, and where this buffer keeps codes and the FP8 GEMM would read them (more
    /// rows than the FP8 GEMV takes), where the op writing the values writes the codes too.
    pub fn view_mut_with_codes(&mut self) -> (GpuViewMut<'_>, Option<RowCodesMut<'_>>) {
        let rows = self.rows;
        let codes = self.codes.as_mut().filter(|_| rows > GEMV_MAX_M);
        self.codes_written = codes.is_some();
        (self.buf.rows_mut(0..rows, self.cols), codes.map(|c| c.rows_mut(rows)))
    }

    /// The rows' FP8 codes, where the op that wrote them wrote those too.
    pub fn codes(&self) -> Option<RowCodes<'_>> {
        self.codes.as_ref().filter(|_| self.codes_written).map(|c| c.rows(self.rows))
    }

    /// `[n, cols]`: the first `n` rows, whatever the rows set (a replayed graph's real rows).
    pub fn first_rows(&self, n: usize) -> GpuView<'_> {
        self.buf.rows(0..n, self.cols)
    }
}

impl Shaped for CudaTensor {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn set_rows(&mut self, rows: usize) {
        assert!(rows * self.cols <= self.buf.len(), "set_rows: {rows} rows of {} past the capacity", self.cols);
        self.rows = rows;
        self.codes_written = false;
    }
}

/// One layer's paged cache on the device: K and V, each `[num_blocks * block_size, kv_width]`, in
/// the compute dtype or as e4m3 codes of each value divided by the layer's scale.
pub enum CudaKvLayer {
    Dense {
        k: GpuTensor,
        v: GpuTensor,
    },
    /// `len` codes each (their buffers hold at least one byte).
    Fp8 {
        k: CudaSlice<u8>,
        v: CudaSlice<u8>,
        len: usize,
        scales: KvScales,
    },
}

/// One step's batch on the device: views of its index buffers.
pub struct CudaBatch<'a> {
    /// `[T]`
    pub token_ids: CudaView<'a, u32>,
    /// `[T]`
    pub positions: CudaView<'a, u32>,
    /// `[T]`; negative = padding.
    pub slot_mapping: CudaView<'a, i64>,
    /// `[rows]`
    pub logits_indices: CudaView<'a, u32>,
    /// Its `sliding_window`, `scale` and `softcap` are replaced per layer ([`LayerAttention`]).
    pub attention: GpuAttentionMetadata<'a>,
}

impl CudaBatch<'_> {
    /// The attention metadata with `layer`'s window, scale and soft-cap (the work list stays
    /// shared).
    fn layer_metadata(&self, layer: &LayerAttention) -> GpuAttentionMetadata<'_> {
        let m = &self.attention;
        GpuAttentionMetadata {
            query_start_loc: m.query_start_loc.slice(..),
            query_start_loc_host: m.query_start_loc_host,
            seq_lens: m.seq_lens.slice(..),
            block_tables: m.block_tables.slice(..),
            max_blocks_per_seq: m.max_blocks_per_seq,
            max_query_len: m.max_query_len,
            block_size: m.block_size,
            sliding_window: layer.sliding_window,
            scale: layer.scale,
            softcap: layer.softcap,
            work: m.work,
        }
    }
}

fn bias_view(l: &Linear<Cuda>) -> Option<GpuView<'_>> {
    l.bias.as_ref().map(GpuTensor::view)
}

impl Cuda {
    /// `y = x W[..n]^T (+ b[..n])`: the first `n` output features of `w`.
    fn linear_rows(&self, x: &CudaTensor, w: &Linear<Cuda>, n: usize, y: &mut CudaTensor) -> Result<(), GpuError> {
        let (gpu, gemms, m, k) = (&self.gpu, &self.gemms, x.rows, w.in_features);
        let bias = bias_view(w).map(|b| b.slice(0..n));
        match &w.weight {
            // The first `n` rows of the row-major `[out, in]` weight are its first `n * k` elements.
            CudaMatrix::Dense(t) => linear(gpu, gemms, x.view(), m, k, t.slice(0..n * k), n, bias, y.view_mut()),
            CudaMatrix::Fp8(f) => self.with_fp8_scratch(|scratch| {
                linear_fp8(gpu, gemms, x.view(), m, f.view(), n, bias, y.view_mut(), scratch, x.codes())
            }),
        }
    }
}

impl Device for Cuda {
    type Error = GpuError;
    type Tensor = CudaTensor;
    type Matrix = CudaMatrix;
    type Vector = GpuTensor;
    type Rope = GpuRopeTable;
    type KvLayer = CudaKvLayer;
    type Batch<'a> = CudaBatch<'a>;
    type MoeScratch = GpuMoeScratch;

    fn tensor(&self, precision: Precision, capacity: usize, cols: usize) -> Result<CudaTensor, GpuError> {
        // Every buffer is written before it is read: no zeroing needed.
        let buf = GpuTensor::uninit(&self.gpu, self.dtype_of(precision), capacity * cols)?;
        let codes = if self.keeps_codes(precision) { Some(GpuRowCodes::new(&self.gpu, capacity, cols)?) } else { None };
        Ok(CudaTensor { buf, rows: capacity, cols, codes, codes_written: false })
    }

    fn tensor_bytes(&self, precision: Precision, capacity: usize, cols: usize) -> usize {
        let codes = if self.keeps_codes(precision) { GpuRowCodes::bytes(capacity, cols) } else { 0 };
        capacity * cols * self.dtype_of(precision).size_in_bytes() + codes
    }

    fn matrix(&self, parts: Vec<HostTensor>) -> Result<CudaMatrix, GpuError> {
        // Each part straight into its rows: no stacked copy on the host.
        let len = parts.iter().map(HostTensor::num_elements).sum();
        let mut m = GpuTensor::uninit(&self.gpu, self.dtype, len)?;
        let mut start = 0;
        for part in &parts {
            let n = part.num_elements();
            m.slice_mut(start..start + n).copy_from_weights(&self.gpu, part.view())?;
            start += n;
        }
        Ok(CudaMatrix::Dense(m))
    }

    /// Projections read by `linear` keep their codes where the FP8 kernels take the stacked
    /// layout ([`GpuFp8Matrix::new`]); experts, tables and other layouts are dequantized.
    fn fp8_matrix(&self, parts: Vec<Fp8Matrix>, usage: MatrixUse) -> Result<CudaMatrix, GpuError> {
        if usage != MatrixUse::Linear {
            return self.matrix(parts.iter().map(Fp8Matrix::dequantize).collect());
        }
        let stacked = Fp8Matrix::stack(parts).unwrap_or_else(|e| panic!("fp8_matrix: {e}"));
        let Some(m) = GpuFp8Matrix::new(&self.gpu, &stacked)? else {
            return self.matrix(vec![stacked.dequantize()]);
        };
        let len = m.rows() * m.cols();
        let mut scratch = self.fp8_scratch.lock().unwrap_or_else(PoisonError::into_inner);
        if scratch.as_ref().is_none_or(|s| s.len() < len) {
            *scratch = None; // freed before the larger one is allocated
            *scratch = Some(GpuTensor::uninit(&self.gpu, self.dtype, len)?);
        }
        Ok(CudaMatrix::Fp8(m))
    }

    fn matrix_bytes(&self, matrix: &CudaMatrix) -> usize {
        match matrix {
            CudaMatrix::Dense(t) => t.size_in_bytes(),
            CudaMatrix::Fp8(m) => m.size_in_bytes(),
        }
    }

    fn vector(&self, values: &[f32]) -> Result<GpuTensor, GpuError> {
        GpuTensor::from_f32(&self.gpu, values, DType::F32)
    }

    fn rope(&self, f: RopeFrequencies<'_>) -> Result<GpuRopeTable, GpuError> {
        GpuRopeTable::new(&self.gpu, f.inv_freq, f.long, f.attention_scaling)
    }

    fn kv_layer(
        &self,
        num_slots: usize,
        kv_width: usize,
        dtype: KvCacheDtype,
        scales: KvScales,
    ) -> Result<CudaKvLayer, GpuError> {
        let len = num_slots * kv_width;
        Ok(match dtype {
            KvCacheDtype::Auto => CudaKvLayer::Dense {
                k: GpuTensor::zeros(&self.gpu, self.dtype, len)?,
                v: GpuTensor::zeros(&self.gpu, self.dtype, len)?,
            },
            KvCacheDtype::Fp8 => {
                // At least one byte, so that an empty cache still owns a valid allocation.
                let zeros = || self.gpu.stream().alloc_zeros::<u8>(len.max(1));
                CudaKvLayer::Fp8 { k: zeros()?, v: zeros()?, len, scales }
            }
        })
    }

    fn compute_dtype(&self) -> DType {
        self.dtype
    }

    /// Models with q/k norms, and FP8 caches, take the unfused attention input (see
    /// `attention_input`).
    fn splits_kv(&self, qk_norm: bool, kv: KvCacheDtype) -> bool {
        qk_norm || kv == KvCacheDtype::Fp8
    }

    fn embedding(
        &self,
        b: &CudaBatch<'_>,
        table: &CudaMatrix,
        scale: f32,
        out: &mut CudaTensor,
    ) -> Result<(), GpuError> {
        let (hidden, table) = (out.cols, table.expect_dense("embedding"));
        embedding(&self.gpu, &b.token_ids, table.view(), hidden, scale, out.view_mut())
    }

    fn rms_norm(&self, x: &CudaTensor, w: &GpuTensor, eps: f32, out: &mut CudaTensor) -> Result<(), GpuError> {
        let (out, codes) = out.view_mut_with_codes();
        rms_norm(&self.gpu, x.view(), w.view(), eps, out, codes)
    }

    fn add_rms_norm(
        &self,
        residual: &mut CudaTensor,
        x: &CudaTensor,
        w: &GpuTensor,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<(), GpuError> {
        let (out, codes) = out.view_mut_with_codes();
        add_rms_norm(&self.gpu, residual.view_mut(), x.view(), w.view(), eps, out, codes)
    }

    fn rms_norm_heads(&self, x: &mut CudaTensor, w: &GpuTensor, eps: f32) -> Result<(), GpuError> {
        rms_norm_inplace(&self.gpu, x.view_mut(), w.view(), eps)
    }

    fn add_normed_rms_norm(
        &self,
        residual: &mut CudaTensor,
        x: &mut CudaTensor,
        x_w: &GpuTensor,
        w: &GpuTensor,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<(), GpuError> {
        let (gpu, (out, codes)) = (&self.gpu, out.view_mut_with_codes());
        add_normed_rms_norm(gpu, residual.view_mut(), x.view_mut(), x_w.view(), w.view(), eps, out, codes)
    }

    fn softcap(&self, x: &mut CudaTensor, cap: f32) -> Result<(), GpuError> {
        softcap(&self.gpu, x.view_mut(), cap)
    }

    fn linear(&self, x: &CudaTensor, w: &Linear<Cuda>, y: &mut CudaTensor) -> Result<(), GpuError> {
        self.linear_rows(x, w, w.out_features, y)
    }

    fn linear_prefix(&self, x: &CudaTensor, w: &Linear<Cuda>, y: &mut CudaTensor) -> Result<(), GpuError> {
        let n = y.cols;
        assert!(n <= w.out_features, "linear_prefix: y has {n} columns, the weight gives only {}", w.out_features);
        self.linear_rows(x, w, n, y)
    }

    fn split_qkv(
        &self,
        qkv: &CudaTensor,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        v: &mut CudaTensor,
    ) -> Result<(), GpuError> {
        let (q_size, kv_size) = (q.cols, k.cols);
        split_qkv(&self.gpu, qkv.view(), q_size, kv_size, q.view_mut(), k.view_mut(), v.view_mut())
    }

    fn rotate(
        &self,
        b: &CudaBatch<'_>,
        table: &GpuRopeTable,
        head_dim: usize,
        x: &mut CudaTensor,
    ) -> Result<(), GpuError> {
        let heads = x.cols / head_dim;
        rope(&self.gpu, x.view_mut(), &b.positions, heads, head_dim, table)
    }

    fn write_kv(
        &self,
        b: &CudaBatch<'_>,
        k: &CudaTensor,
        v: &CudaTensor,
        kv: &mut CudaKvLayer,
    ) -> Result<(), GpuError> {
        let (gpu, width) = (&self.gpu, k.cols);
        match kv {
            CudaKvLayer::Dense { k: k_cache, v: v_cache } => reshape_and_cache(
                gpu,
                k.view(),
                v.view(),
                &b.slot_mapping,
                width,
                k_cache.view_mut(),
                v_cache.view_mut(),
            ),
            CudaKvLayer::Fp8 { k: k_codes, v: v_codes, len, scales } => {
                let (k_cache, v_cache) =
                    (Fp8CacheMut::new(gpu, k_codes, *len, scales.k), Fp8CacheMut::new(gpu, v_codes, *len, scales.v));
                reshape_and_cache_fp8(gpu, k.view(), v.view(), &b.slot_mapping, width, k_cache, v_cache)
            }
        }
    }

    fn attention(
        &self,
        b: &CudaBatch<'_>,
        layer: &LayerAttention,
        q: &CudaTensor,
        kv: &CudaKvLayer,
        out: &mut CudaTensor,
    ) -> Result<(), GpuError> {
        let (gpu, meta) = (&self.gpu, b.layer_metadata(layer));
        match kv {
            CudaKvLayer::Dense { k, v } => {
                self.attention.run(gpu, q.view(), k.view(), v.view(), &meta, layer.heads, out.view_mut())
            }
            CudaKvLayer::Fp8 { k, v, len, scales } => {
                let (k_cache, v_cache) = (Fp8Cache::new(gpu, k, *len, scales.k), Fp8Cache::new(gpu, v, *len, scales.v));
                self.attention.run_fp8(gpu, q.view(), k_cache, v_cache, &meta, layer.heads, out.view_mut())
            }
        }
    }

    fn gated_activation(
        &self,
        gate_up: &CudaTensor,
        act: GatedActivation,
        out: &mut CudaTensor,
    ) -> Result<(), GpuError> {
        let (gpu, inter) = (&self.gpu, out.cols);
        let (out, codes) = out.view_mut_with_codes();
        gated_activation(gpu, act, gate_up.view(), inter, out, codes)
    }

    fn moe_scratch(&self, tokens: usize, shape: MoeShape) -> Result<GpuMoeScratch, GpuError> {
        GpuMoeScratch::new(&self.gpu, self.dtype, tokens, shape)
    }

    fn moe_scratch_bytes(&self, tokens: usize, shape: MoeShape) -> usize {
        GpuMoeScratch::bytes(self.dtype, tokens, shape)
    }

    fn moe(&self, _batch: &CudaBatch<'_>, a: MoeInput<'_, Cuda>) -> Result<(), GpuError> {
        let ex = a.experts;
        let experts = GpuExperts {
            gate_up: ex.gate_up.expect_dense("moe").view(),
            down: ex.down.expect_dense("moe").view(),
            shape: ex.shape(),
            norm_topk_prob: ex.norm_topk_prob,
            activation: ex.activation,
        };
        moe(&self.gpu, a.x.view(), a.router_logits.view(), &experts, a.scratch, a.out.view_mut())
    }

    fn add_sigmoid_gated(&self, out: &mut CudaTensor, x: &CudaTensor, gate: &CudaTensor) -> Result<(), GpuError> {
        assert_eq!(gate.cols, 1, "add_sigmoid_gated: gate has {} columns, not 1", gate.cols);
        let width = out.cols;
        add_sigmoid_gated(&self.gpu, out.view_mut(), x.view(), gate.view(), width)
    }

    fn gather_logits_rows(&self, b: &CudaBatch<'_>, src: &CudaTensor, dst: &mut CudaTensor) -> Result<(), GpuError> {
        gather_rows(&self.gpu, src.view(), src.cols, &b.logits_indices, dst.view_mut())
    }

    fn attention_input(&self, b: &CudaBatch<'_>, a: AttentionInput<'_, Cuda>) -> Result<(), GpuError> {
        let (gpu, w) = (&self.gpu, a.qkv_proj);
        // The fused kernels write K and V in the compute dtype: an FP8 cache takes the ops one by
        // one, its cache write quantizing them (`splits_kv` gave it the split scratch).
        let CudaKvLayer::Dense { k: k_cache, v: v_cache } = a.kv else {
            return unfused_attention_input(self, b, a);
        };
        let rows = QkvRows { positions: &b.positions, slot_mapping: &b.slot_mapping, heads: a.heads, table: a.rope };
        if let Some((q_norm, k_norm)) = a.qk_norm {
            // q/k norms sit between the split and the rotation: the projection, then one kernel
            // for the rest where it takes the head size, else op by op.
            if !qkv_norm_rope_cache_fits(a.heads.head_dim, a.rope) {
                return unfused_attention_input(self, b, a);
            }
            self.linear(a.x, w, a.qkv)?;
            let norms = QkNorms { q: q_norm.view(), k: k_norm.view(), eps: a.eps };
            let out = QkvOut { q: a.q.view_mut(), k_cache: k_cache.view_mut(), v_cache: v_cache.view_mut() };
            return qkv_norm_rope_cache(gpu, a.qkv.view(), &rows, norms, out);
        }
        let out = QkvOut { q: a.q.view_mut(), k_cache: k_cache.view_mut(), v_cache: v_cache.view_mut() };
        // Projection, rotation and cache write in one kernel where a GEMV takes the product.
        match (&w.bias, &w.weight) {
            (None, CudaMatrix::Dense(weight)) => {
                return linear_qkv_rope_cache(
                    gpu,
                    &self.gemms,
                    a.x.view(),
                    weight.view(),
                    &rows,
                    a.qkv.view_mut(),
                    out,
                );
            }
            (None, CudaMatrix::Fp8(weight))
                if fp8_qkv_rope_cache_fits(a.x.view(), a.x.rows, weight.view(), a.heads, a.rope) =>
            {
                return linear_fp8_qkv_rope_cache(gpu, a.x.view(), weight.view(), &rows, out);
            }
            _ => {}
        }
        self.linear(a.x, w, a.qkv)?;
        qkv_rope_cache(gpu, a.qkv.view(), &rows, out)
    }

    fn gated_mlp(
        &self,
        x: &CudaTensor,
        w: &Linear<Cuda>,
        act: GatedActivation,
        gate_up: &mut CudaTensor,
        out: &mut CudaTensor,
    ) -> Result<(), GpuError> {
        let (gpu, gemms, m, k, inter) = (&self.gpu, &self.gemms, x.rows, w.in_features, out.cols);
        let (x_view, bias, gate_up) = (x.view(), bias_view(w), gate_up.view_mut());
        let (out, codes) = out.view_mut_with_codes();
        match &w.weight {
            CudaMatrix::Dense(t) => {
                linear_gated(gpu, gemms, x_view, m, k, t.view(), inter, bias, act, gate_up, out, codes)
            }
            CudaMatrix::Fp8(f) => self.with_fp8_scratch(|scratch| {
                let (fp8, out) = (Fp8Operands { scratch, x_codes: x.codes() }, GatedOut { gate_up, out, codes });
                linear_gated_fp8(gpu, gemms, x_view, m, f.view(), inter, bias, act, fp8, out)
            }),
        }
    }
}
