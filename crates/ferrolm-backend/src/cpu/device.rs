//! [`Cpu`]: the device interface over the CPU ops. Activations are f32 `Vec`s; weights stay in
//! host memory in their checkpoint dtype (a memory-mapped file where it can be), widened as
//! they are used; FP8 weights dequantized exactly to f32 at load. Nothing fails at run time: the
//! error type is `Infallible`.
//!
//! By default every product is exact in f32. A [`Cpu`] made with [`Cpu::with_fp8_inputs`]
//! computes the inputs of FP8 projections as the GPU does in bf16 and f16, quantized per token
//! ([`Fp8Inputs`]), so that a CPU run is the reference of a GPU run of that precision.

use std::borrow::Cow;
use std::convert::Infallible;

use super::{
    add_rms_norm, add_sigmoid_gated, embedding, gelu_tanh_and_mul, linear, moe, paged_attention,
    reshape_and_cache_into, rms_norm, rms_norm_inplace, rope, silu_and_mul, softcap, AttentionMetadata, CpuMoeScratch,
    KvStore, MoeWeights,
};
use crate::device::{
    Device, GatedActivation, KvCacheDtype, KvScales, LayerAttention, Linear, MoeInput, MoeShape, Precision,
    RopeFrequencies, Shaped,
};
use crate::{DType, Fp8GemmScaling, Fp8Matrix, HostTensor, MatrixUse};

/// The CPU as a [`Device`]. How it computes with an FP8 projection's inputs is set when the
/// projection's matrix is placed ([`Device::fp8_matrix`]): a model loaded by
/// `Cpu::with_fp8_inputs(Fp8Inputs::GPU)` quantizes them whichever `Cpu` runs it;
/// `Cpu::default()` places matrices that compute exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cpu {
    fp8_inputs: Fp8Inputs,
}

/// How the CPU computes with the inputs of an FP8 projection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fp8Inputs {
    /// As they are: the exact product with the dequantized weights.
    #[default]
    Exact,
    /// Quantized to e4m3 in steps of more than this many rows, for the matrices a linear op
    /// reads that an FP8 GEMM takes ([`Fp8Matrix::gemm_scaling`]), where the product's output
    /// features (n) are a multiple of 16 too: per token (each row's `amax / 448`, as
    /// [`Fp8Matrix::quantize_rows`] quantizes a matrix) beside weights of one scale a row, per
    /// token and 128 columns beside 128 x 128 blocks. What the GPU does in bf16 and f16 beyond
    /// its FP8 GEMV (`cuda::GEMV_MAX_M` rows), where its FP8 GEMM takes the product (over
    /// blocks, with `GpuOptions::fp8_block_gemm`, the default). Not modelled: the GPU's fallbacks
    /// to a dequantized copy where that option is off (block inputs then stay unquantized on the
    /// GPU; no test model has blocks of 128 over a wider matrix), where cuBLASLt has no FP8
    /// GEMM for a shape, or where a step's codes need more bytes than the FP8 scratch holds
    /// (sized for the largest FP8 matrix dequantized; on the tiny test models, steps of about
    /// 240 tokens; the tests' steps are smaller).
    QuantizedBeyond(usize),
}

impl Fp8Inputs {
    /// What the CUDA backend does in bf16 and f16: quantized beyond its FP8 GEMV's 4 rows
    /// (`cuda::GEMV_MAX_M`, which a check there keeps equal to this).
    pub const GPU: Fp8Inputs = Fp8Inputs::QuantizedBeyond(4);
}

impl Cpu {
    /// A CPU that computes the inputs of FP8 projections as `fp8_inputs` says.
    pub fn with_fp8_inputs(fp8_inputs: Fp8Inputs) -> Cpu {
        Cpu { fp8_inputs }
    }
}

/// A weight matrix `[out, in]` in host memory, and how the CPU computes with its inputs.
#[derive(Debug)]
pub struct CpuMatrix {
    values: HostTensor,
    /// Steps of more rows than this quantize their inputs as an FP8 GEMM of that scaling does
    /// ([`Fp8Inputs::QuantizedBeyond`]).
    quantize_inputs_beyond: Option<(usize, Fp8GemmScaling)>,
}

impl CpuMatrix {
    /// The matrix's values, in their storage dtype.
    pub fn values(&self) -> &HostTensor {
        &self.values
    }

    /// `x`: `[m, k]`, as this matrix's product computes with it: quantized as its FP8 GEMM does
    /// in steps of more rows than its bound with `n` output features a multiple of 16, else as
    /// it is.
    fn input<'x>(&self, x: &'x [f32], m: usize, k: usize, n: usize) -> Cow<'x, [f32]> {
        match self.quantize_inputs_beyond {
            Some((rows, scaling)) if m > rows && n.is_multiple_of(16) => {
                let q = Fp8Matrix::quantize_inputs(&HostTensor::from_f32(vec![m, k], x.to_vec()), scaling);
                Cow::Owned(q.dequantize().to_f32_vec())
            }
            _ => Cow::Borrowed(x),
        }
    }
}

/// An f32 activation buffer `[rows, cols]` with room for `capacity` rows.
#[derive(Clone, Debug)]
pub struct CpuTensor {
    /// `[capacity, cols]`
    data: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl CpuTensor {
    pub fn zeros(capacity: usize, cols: usize) -> CpuTensor {
        CpuTensor { data: vec![0.0; capacity * cols], rows: capacity, cols }
    }

    /// `[rows, cols]`
    pub fn as_slice(&self) -> &[f32] {
        &self.data[..self.rows * self.cols]
    }

    /// `[rows, cols]`
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data[..self.rows * self.cols]
    }
}

impl Shaped for CpuTensor {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn set_rows(&mut self, rows: usize) {
        assert!(rows * self.cols <= self.data.len(), "set_rows: {rows} rows of {} past the capacity", self.cols);
        self.rows = rows;
    }
}

/// The rotary frequency tables, in f32.
#[derive(Clone, Debug)]
pub struct CpuRope {
    /// `[rotary_dim / 2]`
    inv_freq: Vec<f32>,
    /// LongRoPE: the first position of the long table, and the table.
    long: Option<(u32, Vec<f32>)>,
    attention_scaling: f32,
}

impl CpuRope {
    fn frequencies(&self) -> RopeFrequencies<'_> {
        RopeFrequencies {
            inv_freq: &self.inv_freq,
            long: self.long.as_ref().map(|(start, table)| (*start, table.as_slice())),
            attention_scaling: self.attention_scaling,
        }
    }
}

/// One layer's paged cache: K and V, each `[num_blocks * block_size, kv_width]`.
#[derive(Clone, Debug)]
pub struct CpuKvLayer {
    pub k: KvStore,
    pub v: KvStore,
}

/// One step's batch, borrowed from the host arrays that describe it.
#[derive(Clone, Copy, Debug)]
pub struct CpuBatch<'a> {
    /// `[T]`
    pub token_ids: &'a [u32],
    /// `[T]`
    pub positions: &'a [u32],
    /// `[T]`; negative = padding.
    pub slot_mapping: &'a [i64],
    /// `[rows]`
    pub logits_indices: &'a [u32],
    /// Its `sliding_window`, `scale` and `softcap` are replaced per layer ([`LayerAttention`]).
    pub attention: AttentionMetadata<'a>,
}

impl Device for Cpu {
    type Error = Infallible;
    type Tensor = CpuTensor;
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type Rope = CpuRope;
    type KvLayer = CpuKvLayer;
    type Batch<'a> = CpuBatch<'a>;
    type MoeScratch = CpuMoeScratch;

    fn tensor(&self, _precision: Precision, capacity: usize, cols: usize) -> Result<CpuTensor, Infallible> {
        Ok(CpuTensor::zeros(capacity, cols))
    }

    fn tensor_bytes(&self, _precision: Precision, capacity: usize, cols: usize) -> usize {
        capacity * cols * std::mem::size_of::<f32>()
    }

    fn matrix(&self, parts: Vec<HostTensor>) -> Result<CpuMatrix, Infallible> {
        Ok(CpuMatrix { values: HostTensor::concat_rows(parts), quantize_inputs_beyond: None })
    }

    fn fp8_matrix(&self, parts: Vec<Fp8Matrix>, usage: MatrixUse) -> Result<CpuMatrix, Infallible> {
        // The matrix as the GPU places it (one grid of scales for the stacked parts, the same
        // values), whose grid decides whether its FP8 GEMM takes the product.
        let stacked = Fp8Matrix::stack(parts).unwrap_or_else(|e| panic!("fp8_matrix: {e}"));
        let quantize_inputs_beyond = match self.fp8_inputs {
            Fp8Inputs::QuantizedBeyond(rows) if usage == MatrixUse::Linear => {
                stacked.gemm_scaling().map(|scaling| (rows, scaling))
            }
            _ => None,
        };
        Ok(CpuMatrix { values: stacked.dequantize(), quantize_inputs_beyond })
    }

    fn matrix_bytes(&self, matrix: &CpuMatrix) -> usize {
        matrix.values.size_in_bytes()
    }

    fn vector(&self, values: &[f32]) -> Result<Vec<f32>, Infallible> {
        Ok(values.to_vec())
    }

    fn rope(&self, f: RopeFrequencies<'_>) -> Result<CpuRope, Infallible> {
        Ok(CpuRope {
            inv_freq: f.inv_freq.to_vec(),
            long: f.long.map(|(start, table)| (start, table.to_vec())),
            attention_scaling: f.attention_scaling,
        })
    }

    fn kv_layer(
        &self,
        num_slots: usize,
        kv_width: usize,
        dtype: KvCacheDtype,
        scales: KvScales,
    ) -> Result<CpuKvLayer, Infallible> {
        let len = num_slots * kv_width;
        Ok(CpuKvLayer { k: KvStore::zeros(dtype, len, scales.k), v: KvStore::zeros(dtype, len, scales.v) })
    }

    fn compute_dtype(&self) -> DType {
        DType::F32
    }

    fn moe_scratch(&self, tokens: usize, shape: MoeShape) -> Result<CpuMoeScratch, Infallible> {
        Ok(CpuMoeScratch::new(tokens, shape))
    }

    fn moe_scratch_bytes(&self, tokens: usize, shape: MoeShape) -> usize {
        CpuMoeScratch::bytes(tokens, shape)
    }

    fn embedding(
        &self,
        b: &CpuBatch<'_>,
        table: &CpuMatrix,
        scale: f32,
        out: &mut CpuTensor,
    ) -> Result<(), Infallible> {
        embedding(b.token_ids, table.values.view(), out.cols, scale, out.as_mut_slice());
        Ok(())
    }

    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32, out: &mut CpuTensor) -> Result<(), Infallible> {
        rms_norm(x.as_slice(), w, eps, out.as_mut_slice());
        Ok(())
    }

    fn add_rms_norm(
        &self,
        residual: &mut CpuTensor,
        x: &CpuTensor,
        w: &Vec<f32>,
        eps: f32,
        out: &mut CpuTensor,
    ) -> Result<(), Infallible> {
        add_rms_norm(residual.as_mut_slice(), x.as_slice(), w, eps, out.as_mut_slice());
        Ok(())
    }

    fn rms_norm_heads(&self, x: &mut CpuTensor, w: &Vec<f32>, eps: f32) -> Result<(), Infallible> {
        rms_norm_inplace(x.as_mut_slice(), w, eps);
        Ok(())
    }

    fn softcap(&self, x: &mut CpuTensor, cap: f32) -> Result<(), Infallible> {
        softcap(x.as_mut_slice(), cap);
        Ok(())
    }

    fn linear(&self, x: &CpuTensor, w: &Linear<Cpu>, y: &mut CpuTensor) -> Result<(), Infallible> {
        assert_eq!(x.cols, w.in_features, "linear: x has {} columns, the weight takes {}", x.cols, w.in_features);
        assert_eq!(y.cols, w.out_features, "linear: y has {} columns, the weight gives {}", y.cols, w.out_features);
        let m = x.rows;
        assert_eq!(y.rows, m, "linear: y has {} rows, x has {m}", y.rows);
        let (k, n) = (w.in_features, w.out_features);
        let x = w.weight.input(x.as_slice(), m, k, n);
        linear(&x, m, k, w.weight.values.view(), n, w.bias.as_deref(), y.as_mut_slice());
        Ok(())
    }

    fn linear_prefix(&self, x: &CpuTensor, w: &Linear<Cpu>, y: &mut CpuTensor) -> Result<(), Infallible> {
        let (m, k, n) = (x.rows, w.in_features, y.cols);
        assert_eq!(x.cols, k, "linear_prefix: x has {} columns, the weight takes {k}", x.cols);
        assert!(n <= w.out_features, "linear_prefix: y has {n} columns, the weight gives only {}", w.out_features);
        assert_eq!(y.rows, m, "linear_prefix: y has {} rows, x has {m}", y.rows);
        // The first `n` rows of the row-major `[out, in]` weight are its first `n * k` elements.
        let weight = w.weight.values.view().slice(0, n * k);
        let bias = w.bias.as_deref().map(|b| &b[..n]);
        let x = w.weight.input(x.as_slice(), m, k, n);
        linear(&x, m, k, weight, n, bias, y.as_mut_slice());
        Ok(())
    }

    fn split_qkv(
        &self,
        qkv: &CpuTensor,
        q: &mut CpuTensor,
        k: &mut CpuTensor,
        v: &mut CpuTensor,
    ) -> Result<(), Infallible> {
        let (q_size, kv_size) = (q.cols, k.cols);
        assert_eq!(qkv.cols, q_size + 2 * kv_size, "split_qkv: qkv has {} columns", qkv.cols);
        let (q, k, v) = (q.as_mut_slice(), k.as_mut_slice(), v.as_mut_slice());
        for (row, chunk) in qkv.as_slice().chunks_exact(qkv.cols).enumerate() {
            q[row * q_size..(row + 1) * q_size].copy_from_slice(&chunk[..q_size]);
            k[row * kv_size..(row + 1) * kv_size].copy_from_slice(&chunk[q_size..q_size + kv_size]);
            v[row * kv_size..(row + 1) * kv_size].copy_from_slice(&chunk[q_size + kv_size..]);
        }
        Ok(())
    }

    fn rotate(&self, b: &CpuBatch<'_>, table: &CpuRope, head_dim: usize, x: &mut CpuTensor) -> Result<(), Infallible> {
        let (width, scaling) = (x.cols, table.attention_scaling);
        let heads = width / head_dim;
        let (x, positions, frequencies) = (x.as_mut_slice(), b.positions, table.frequencies());
        // Runs of tokens that share one frequency table (LongRoPE switches tables by position).
        let mut start = 0;
        while start < positions.len() {
            let freq = frequencies.for_position(positions[start]);
            let mut end = start + 1;
            while end < positions.len() && std::ptr::eq(frequencies.for_position(positions[end]), freq) {
                end += 1;
            }
            rope(&mut x[start * width..end * width], &positions[start..end], heads, head_dim, freq, scaling);
            start = end;
        }
        Ok(())
    }

    fn write_kv(&self, b: &CpuBatch<'_>, k: &CpuTensor, v: &CpuTensor, kv: &mut CpuKvLayer) -> Result<(), Infallible> {
        reshape_and_cache_into(k.as_slice(), v.as_slice(), b.slot_mapping, k.cols, &mut kv.k, &mut kv.v);
        Ok(())
    }

    fn attention(
        &self,
        b: &CpuBatch<'_>,
        layer: &LayerAttention,
        q: &CpuTensor,
        kv: &CpuKvLayer,
        out: &mut CpuTensor,
    ) -> Result<(), Infallible> {
        let meta = AttentionMetadata {
            sliding_window: layer.sliding_window,
            scale: layer.scale,
            softcap: layer.softcap,
            ..b.attention
        };
        let h = layer.heads;
        paged_attention(
            q.as_slice(),
            kv.k.view(),
            kv.v.view(),
            &meta,
            h.num_heads,
            h.num_kv_heads,
            h.head_dim,
            out.as_mut_slice(),
        );
        Ok(())
    }

    fn gated_activation(
        &self,
        gate_up: &CpuTensor,
        act: GatedActivation,
        out: &mut CpuTensor,
    ) -> Result<(), Infallible> {
        let inter = out.cols;
        match act {
            GatedActivation::Silu => silu_and_mul(gate_up.as_slice(), inter, out.as_mut_slice()),
            GatedActivation::GeluTanh => gelu_tanh_and_mul(gate_up.as_slice(), inter, out.as_mut_slice()),
        }
        Ok(())
    }

    fn moe(&self, _b: &CpuBatch<'_>, a: MoeInput<'_, Cpu>) -> Result<(), Infallible> {
        let e = a.experts;
        let tokens = a.x.rows;
        assert_eq!(a.x.cols, e.hidden, "moe: x has {} columns, the experts take {}", a.x.cols, e.hidden);
        assert_eq!(a.out.cols, e.hidden, "moe: out has {} columns, the experts give {}", a.out.cols, e.hidden);
        assert_eq!(a.router_logits.cols, e.num_experts, "moe: {} router logits a row", a.router_logits.cols);
        assert_eq!((a.router_logits.rows, a.out.rows), (tokens, tokens), "moe: rows differ from x's {tokens}");
        let weights = MoeWeights {
            gate_up: e.gate_up.values.view(),
            down: e.down.values.view(),
            shape: e.shape(),
            norm_topk_prob: e.norm_topk_prob,
            activation: e.activation,
        };
        moe(a.x.as_slice(), a.router_logits.as_slice(), &weights, a.scratch, a.out.as_mut_slice());
        Ok(())
    }

    fn add_sigmoid_gated(&self, out: &mut CpuTensor, x: &CpuTensor, gate: &CpuTensor) -> Result<(), Infallible> {
        assert_eq!((x.rows, x.cols), (out.rows, out.cols), "add_sigmoid_gated: x and out differ in shape");
        assert_eq!((gate.rows, gate.cols), (out.rows, 1), "add_sigmoid_gated: gate is not [{}, 1]", out.rows);
        add_sigmoid_gated(out.as_mut_slice(), x.as_slice(), gate.as_slice());
        Ok(())
    }

    fn gather_logits_rows(&self, b: &CpuBatch<'_>, src: &CpuTensor, dst: &mut CpuTensor) -> Result<(), Infallible> {
        let width = src.cols;
        assert_eq!(dst.cols, width, "gather_logits_rows: {} columns into {width}", dst.cols);
        let (src, dst) = (src.as_slice(), dst.as_mut_slice());
        for (i, &r) in b.logits_indices.iter().enumerate() {
            let r = r as usize;
            dst[i * width..(i + 1) * width].copy_from_slice(&src[r * width..(r + 1) * width]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{random_vec, rng};
    use crate::Fp8Scales;

    /// `y = x w^T` through `cpu`'s linear op over the FP8 matrix `w` (read as a projection).
    fn product(cpu: Cpu, w: &Fp8Matrix, x: &[f32], m: usize) -> Vec<f32> {
        let Ok(weight) = cpu.fp8_matrix(vec![w.clone()], MatrixUse::Linear);
        let linear = Linear::<Cpu> { weight, bias: None, out_features: w.rows(), in_features: w.cols() };
        let (mut x_t, mut y) = (CpuTensor::zeros(m, w.cols()), CpuTensor::zeros(m, w.rows()));
        x_t.as_mut_slice().copy_from_slice(x);
        let Ok(()) = cpu.linear(&x_t, &linear, &mut y);
        y.as_slice().to_vec()
    }

    /// The exact product of `x` (or of its e4m3 values as a GEMM of `quantized` quantizes them)
    /// with `w`'s values.
    fn reference(w: &Fp8Matrix, x: &[f32], m: usize, quantized: Option<Fp8GemmScaling>) -> Vec<f32> {
        let x_t = HostTensor::from_f32(vec![m, w.cols()], x.to_vec());
        let x = match quantized {
            Some(scaling) => Fp8Matrix::quantize_inputs(&x_t, scaling).dequantize(),
            None => x_t,
        }
        .to_f32_vec();
        let mut y = vec![0.0; m * w.rows()];
        crate::cpu::linear(&x, m, w.cols(), w.dequantize().view(), w.rows(), None, &mut y);
        y
    }

    #[test]
    fn fp8_inputs_are_quantized_per_token_only_where_the_gpu_quantizes_them() {
        let mut rng = rng(5);
        let (rows, cols) = (32, 256);
        let values = HostTensor::from_f32(vec![rows, cols], random_vec(&mut rng, rows * cols, 1.0));
        let per_row = Fp8Matrix::quantize_rows(&values);
        let codes = per_row.codes().to_vec();
        let tensor = Fp8Matrix::new(rows, cols, codes.clone(), Fp8Scales::Tensor(0.01)).unwrap();
        let blocks = Fp8Scales::Blocks { block_rows: 16, block_cols: 128, scales: vec![0.01, 0.02, 0.03, 0.04] };
        let blocks = Fp8Matrix::new(rows, cols, codes.clone(), blocks).unwrap();
        let square = Fp8Scales::Blocks { block_rows: 128, block_cols: 128, scales: vec![0.01, 0.02] };
        let square = Fp8Matrix::new(rows, cols, codes, square).unwrap();
        let narrow =
            Fp8Matrix::quantize_rows(&HostTensor::from_f32(vec![24, cols], values.to_f32_vec()[..24 * cols].to_vec()));
        let emulating = Cpu::with_fp8_inputs(Fp8Inputs::QuantizedBeyond(4));
        for m in [1, 4, 5, 9] {
            // Rows of different magnitudes, so that each takes its own scale.
            let x: Vec<f32> = random_vec(&mut rng, m * cols, 1.0)
                .iter()
                .enumerate()
                .map(|(i, v)| v * (1 + i / cols) as f32)
                .collect();
            let beyond = |scaling| (m > 4).then_some(scaling);
            for (what, w, quantizes) in [
                ("row scales", &per_row, beyond(Fp8GemmScaling::Rows)),
                ("a tensor scale", &tensor, beyond(Fp8GemmScaling::Rows)),
                ("128 x 128 blocks", &square, beyond(Fp8GemmScaling::Blocks)),
                ("16 x 128 blocks", &blocks, None),
                ("24 output features", &narrow, None),
            ] {
                let want = reference(w, &x, m, quantizes);
                assert_eq!(product(emulating, w, &x, m), want, "{what}, m = {m}");
                assert_eq!(product(Cpu::default(), w, &x, m), reference(w, &x, m, None), "{what}, m = {m}: exact");
                if quantizes.is_some() {
                    assert_ne!(want, reference(w, &x, m, None), "{what}, m = {m}: the quantization shows");
                }
                if quantizes == Some(Fp8GemmScaling::Blocks) {
                    let per_token = reference(w, &x, m, Some(Fp8GemmScaling::Rows));
                    assert_ne!(want, per_token, "{what}, m = {m}: quantized per 128 columns, not per token");
                }
            }
        }
    }
    #[test]
    fn the_quantizing_cpu_decides_on_the_matrix_as_the_gpu_places_it() {
        let emulating = Cpu::with_fp8_inputs(Fp8Inputs::GPU);
        let part = |rows: usize, cols: usize, scales: Fp8Scales| {
            Fp8Matrix::new(rows, cols, vec![0x38; rows * cols], scales).unwrap()
        };
        let beyond = |parts: Vec<Fp8Matrix>, usage: MatrixUse| {
            let Ok(m) = emulating.fp8_matrix(parts, usage);
            m.quantize_inputs_beyond
        };
        let blocks = |rows: usize, cols: usize, bc: usize| Fp8Scales::Blocks {
            block_rows: 1,
            block_cols: bc,
            scales: vec![0.5; rows * cols.div_ceil(bc)],
        };
        // Parts of a tensor scale and of row scales stack to one scale a row: quantized.
        let mixed = vec![part(3, 32, Fp8Scales::Tensor(0.5)), part(2, 32, Fp8Scales::Rows(vec![1.0, 2.0]))];
        assert_eq!(beyond(mixed, MatrixUse::Linear), Some((4, Fp8GemmScaling::Rows)));
        // A row part beside blocks 16 wide: the stacked grid is 16 wide, as the GPU keeps it.
        let narrow = vec![part(2, 32, Fp8Scales::Rows(vec![1.0, 2.0])), part(2, 32, blocks(2, 32, 16))];
        assert_eq!(beyond(narrow, MatrixUse::Linear), None);
        // Parts of 128 x 128 blocks, each ending on a block row (q, k, v): quantized per 128
        // columns; one ending inside a block row stacks to blocks of one row, which no GEMM takes.
        let square = |rows: usize, cols: usize| Fp8Scales::Blocks {
            block_rows: 128,
            block_cols: 128,
            scales: vec![0.5; rows.div_ceil(128) * cols.div_ceil(128)],
        };
        let qkv =
            vec![part(256, 384, square(256, 384)), part(128, 384, square(128, 384)), part(64, 384, square(64, 384))];
        assert_eq!(beyond(qkv, MatrixUse::Linear), Some((4, Fp8GemmScaling::Blocks)));
        let ragged = vec![part(64, 384, square(64, 384)), part(128, 384, square(128, 384))];
        assert_eq!(beyond(ragged, MatrixUse::Linear), None);
        // Blocks of 128 over columns that are no whole number of them.
        assert_eq!(beyond(vec![part(128, 320, square(128, 320))], MatrixUse::Linear), None);
        // Columns no multiple of 16; experts and embeddings (dense on the GPU).
        assert_eq!(beyond(vec![part(2, 24, Fp8Scales::Tensor(0.5))], MatrixUse::Linear), None);
        assert_eq!(beyond(vec![part(2, 32, Fp8Scales::Tensor(0.5))], MatrixUse::Experts), None);
        assert_eq!(beyond(vec![part(2, 32, Fp8Scales::Tensor(0.5))], MatrixUse::Embedding), None);
        // Exact everywhere by default.
        let Ok(m) = Cpu::default().fp8_matrix(vec![part(2, 32, Fp8Scales::Tensor(0.5))], MatrixUse::Linear);
        assert_eq!(m.quantize_inputs_beyond, None);
    }

    #[test]
    fn a_prefix_quantizes_where_its_own_features_are_whole_chunks() {
        let mut rng = rng(9);
        let (rows, cols, m) = (40, 32, 6);
        let values = HostTensor::from_f32(vec![rows, cols], random_vec(&mut rng, rows * cols, 1.0));
        let w = Fp8Matrix::quantize_rows(&values);
        let cpu = Cpu::with_fp8_inputs(Fp8Inputs::GPU);
        let Ok(weight) = cpu.fp8_matrix(vec![w.clone()], MatrixUse::Linear);
        let linear = Linear::<Cpu> { weight, bias: None, out_features: rows, in_features: cols };
        let x: Vec<f32> =
            random_vec(&mut rng, m * cols, 1.0).iter().enumerate().map(|(i, v)| v * (1 + i % 7) as f32).collect();
        let mut x_t = CpuTensor::zeros(m, cols);
        x_t.as_mut_slice().copy_from_slice(&x);
        for (n, quantized) in [(32, true), (24, false)] {
            let mut y = CpuTensor::zeros(m, n);
            let Ok(()) = cpu.linear_prefix(&x_t, &linear, &mut y);
            let want = reference(&w, &x, m, quantized.then_some(Fp8GemmScaling::Rows));
            let want: Vec<f32> = (0..m).flat_map(|r| want[r * rows..r * rows + n].to_vec()).collect();
            assert_eq!(y.as_slice(), want.as_slice(), "prefix of {n}");
        }
    }
}
