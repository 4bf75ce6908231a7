//! The device interface one decoder runs on: shaped activation buffers, the weights placed on
//! the device, and the ops of a decoder step. [`crate::cpu::Cpu`] and (feature `cuda`)
//! `crate::cuda::Cuda` implement it by delegating to their ops.
//!
//! Invariants every implementation keeps:
//! - An activation buffer ([`Device::Tensor`]) is `[rows, cols]`: `cols` is fixed when it is
//!   allocated, `rows` is the current step's (at most the capacity it was allocated with). An op
//!   reads and writes the first `rows` rows of each operand; mismatched shapes are caller bugs
//!   and panic with the op's name.
//! - Outputs are overwritten, never accumulated into, unless the op's name says so.
//! - Ops only issue work: none waits for the device or copies to the host, so that a step can
//!   be captured as a CUDA graph and launched ahead of the host.
//! - A fused op (a method with a default body) computes what its default, unfused sequence
//!   computes; a device overrides it where one kernel does it faster.

use crate::{DType, Fp8Matrix, HostTensor};

/// The shape of an activation buffer: `[rows, cols]`, with room for `capacity` rows.
pub trait Shaped {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Sets the rows the next ops see; panics past the capacity.
    fn set_rows(&mut self, rows: usize);
}

/// Which precision an activation buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// The device's compute dtype (f32 on the CPU, bf16 by default on a GPU).
    Compute,
    /// f32 whatever the compute dtype: the residual stream and the logits.
    F32,
    /// The compute dtype, in a buffer that FP8 projections read (a norm's or a gated
    /// activation's output in an FP8 model): a device may keep each row's FP8 codes beside the
    /// values, written by the op that writes them, so that the projection need not quantize them.
    ProjectionInput,
}

/// The activation of a gated MLP: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatedActivation {
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
}

/// A linear layer on a device: `y = x W^T + b`, `W` stored `[out_features, in_features]`.
pub struct Linear<D: Device + ?Sized> {
    pub weight: D::Matrix,
    /// f32 `[out_features]`
    pub bias: Option<D::Vector>,
    pub out_features: usize,
    pub in_features: usize,
}

/// Which ops read a matrix, so that a device may keep FP8 weights only where its kernels for
/// those ops read them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatrixUse {
    /// [`Device::linear`] and the fused projections ([`Device::attention_input`],
    /// [`Device::gated_mlp`]).
    Linear,
    /// A mixture's stacked experts ([`Experts`], read by [`Device::moe`]).
    Experts,
    /// [`Device::embedding`] too: the token table (and the LM head tied to it).
    Embedding,
}

/// The head layout of an attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl Heads {
    /// `num_heads * head_dim`
    pub fn q_size(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// `num_kv_heads * head_dim`
    pub fn kv_size(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// What differs between attention layers of one model (Gemma 2/3 mix windowed and global
/// layers): the batch's metadata is shared, these are per layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttention {
    pub heads: Heads,
    /// A query at position `p` sees keys at positions `j` with `p - window < j <= p`.
    pub sliding_window: Option<usize>,
    /// Softmax scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Attention-logit soft-cap (Gemma 2's `attn_logit_softcapping`): each scaled score `s`
    /// becomes `cap * tanh(s / cap)` before the mask and the softmax.
    pub softcap: Option<f32>,
    /// The KV cache group whose block tables and slot mapping the layer's batch carries (layers
    /// of one window share a group; the decoder hands each layer its group's batch).
    pub kv_group: usize,
}

/// The rotary frequencies of a model, as the device is given them.
#[derive(Clone, Copy, Debug)]
pub struct RopeFrequencies<'a> {
    /// `[rotary_dim / 2]`
    pub inv_freq: &'a [f32],
    /// LongRoPE: the first position that uses the long table, and that table (same length).
    pub long: Option<(u32, &'a [f32])>,
    pub attention_scaling: f32,
}

impl<'a> RopeFrequencies<'a> {
    /// The inverse frequencies for a token at `position`: the long table from its first
    /// position on, the short one before.
    pub fn for_position(&self, position: u32) -> &'a [f32] {
        match self.long {
            Some((start, long)) if position >= start => long,
            _ => self.inv_freq,
        }
    }
}

/// The shape of a mixture-of-experts MLP's routed experts (see [`Experts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Each expert's intermediate size.
    pub inter: usize,
    pub hidden: usize,
}

/// The routed experts of a mixture-of-experts MLP on a device, stacked: expert `e`'s gate rows
/// then up rows are rows `[e * 2 * inter, (e + 1) * 2 * inter)` of `gate_up`, its down rows are
/// rows `[e * hidden, (e + 1) * hidden)` of `down`. Built with `Device::matrix` from the parts
/// `[gate_0, up_0, gate_1, up_1, ...]` and `[down_0, down_1, ...]`.
pub struct Experts<D: Device + ?Sized> {
    /// `[num_experts * 2 * inter, hidden]`
    pub gate_up: D::Matrix,
    /// `[num_experts * hidden, inter]`
    pub down: D::Matrix,
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Renormalize the top-k probabilities to sum to one (Qwen3-MoE's `norm_topk_prob`; always
    /// for Mixtral, whose softmax over the top-k logits is the same thing).
    pub norm_topk_prob: bool,
    /// Each expert's intermediate size (`moe_intermediate_size`, Mixtral's `intermediate_size`).
    pub inter: usize,
    pub hidden: usize,
    pub activation: GatedActivation,
}

impl<D: Device + ?Sized> Experts<D> {
    pub fn shape(&self) -> MoeShape {
        MoeShape { num_experts: self.num_experts, top_k: self.top_k, inter: self.inter, hidden: self.hidden }
    }
}

/// One step of a mixture-of-experts MLP: route each token to its top-k experts by the softmax
/// of `router_logits` (f32 arithmetic; ties to the lower expert id), and write
/// `out[t] = sum_j w[t, j] * down_e(act(gate_e x[t]) * up_e x[t])` over its chosen experts `e`
/// with weights `w` (the top-k probabilities, renormalized when `norm_topk_prob`).
///
/// The routing is Hugging Face's: `p = softmax(router_logits[t])` in f32; the `top_k` experts
/// by `p`, ties to the lower expert id; weights `p[e]`, divided by their sum when
/// `norm_topk_prob`. The weighted sum is accumulated in f32 and written in `out`'s dtype.
pub struct MoeInput<'a, D: Device + ?Sized> {
    /// `[T, hidden]`
    pub x: &'a D::Tensor,
    /// f32 `[T, num_experts]` (the router's `linear` into an f32 tensor).
    pub router_logits: &'a D::Tensor,
    pub experts: &'a Experts<D>,
    /// The device's own scratch, allocated by `Device::moe_scratch` for at least `T` tokens.
    pub scratch: &'a mut D::MoeScratch,
    /// `[T, hidden]`, overwritten.
    pub out: &'a mut D::Tensor,
}

/// The attention block's input step: project the normed hidden states to q, k and v, apply the
/// q/k norms, rotate q and k, write k and v to the layer's cache, and leave q in `q`.
pub struct AttentionInput<'a, D: Device + ?Sized> {
    /// `[T, hidden]`
    pub x: &'a D::Tensor,
    /// `[q_size + 2 * kv_size, hidden]`
    pub qkv_proj: &'a Linear<D>,
    /// f32 `[head_dim]` each, applied per head before the rotation.
    pub qk_norm: Option<(&'a D::Vector, &'a D::Vector)>,
    pub eps: f32,
    pub heads: Heads,
    pub rope: &'a D::Rope,
    /// `[T, q_size + 2 * kv_size]`, `[T, kv_size]`, `[T, kv_size]`: scratch of the unfused form.
    pub qkv: &'a mut D::Tensor,
    pub k: &'a mut D::Tensor,
    pub v: &'a mut D::Tensor,
    /// `[T, q_size]`: the rotated queries.
    pub q: &'a mut D::Tensor,
    pub kv: &'a mut D::KvLayer,
}

/// The element type of a KV cache (vLLM's `--kv-cache-dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// The device's compute dtype ([`Device::compute_dtype`]).
    #[default]
    Auto,
    /// e4m3 of each layer's K and V divided by its scale ([`KvScales`]): half the bytes of bf16.
    Fp8,
}

impl KvCacheDtype {
    /// Bytes of one cached element on a device that computes in `compute`.
    pub fn size_in_bytes(self, compute: DType) -> usize {
        match self {
            KvCacheDtype::Auto => compute.size_in_bytes(),
            KvCacheDtype::Fp8 => 1,
        }
    }
}

/// The scales of one layer's FP8 K and V caches: a cached element is `e4m3(x / scale)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvScales {
    pub k: f32,
    pub v: f32,
}

impl Default for KvScales {
    /// 1, vLLM's default where a checkpoint brings no scales.
    fn default() -> KvScales {
        KvScales { k: 1.0, v: 1.0 }
    }
}

/// A device the decoder runs on.
pub trait Device {
    type Error: std::error::Error + Send + Sync + 'static;
    /// An activation buffer (see [`Shaped`]).
    type Tensor: Shaped;
    /// A weight matrix `[out, in]` as the device keeps it.
    type Matrix;
    /// A small f32 parameter vector (norm weights, biases).
    type Vector;
    /// A model's rotary frequency tables.
    type Rope;
    /// One layer's paged K and V caches.
    type KvLayer;
    /// One step's flattened batch on the device: token ids, positions, slot mapping, logits
    /// rows and the attention metadata (see docs/ARCHITECTURE.md, "The batch the backend sees").
    type Batch<'a>
    where
        Self: 'a;
    /// A device's scratch for [`Device::moe`] (routing lists, grouped activations).
    type MoeScratch;

    // Placement.

    /// An activation buffer of `capacity` rows of `cols`, with `capacity` rows set.
    fn tensor(&self, precision: Precision, capacity: usize, cols: usize) -> Result<Self::Tensor, Self::Error>;
    /// Bytes a [`Self::tensor`] of this shape takes.
    fn tensor_bytes(&self, precision: Precision, capacity: usize, cols: usize) -> usize;
    /// The matrix whose rows are the rows of `parts` in order (fused projections).
    fn matrix(&self, parts: Vec<HostTensor>) -> Result<Self::Matrix, Self::Error>;
    /// The matrix whose rows are the rows of FP8 `parts` in order, for `usage`. By default their
    /// values, dequantized exactly to f32 ([`Fp8Matrix::dequantize`]), placed as [`Self::matrix`]
    /// places an f32 checkpoint's; a device keeps the codes and scales where its kernels for
    /// `usage` read them.
    fn fp8_matrix(&self, parts: Vec<Fp8Matrix>, usage: MatrixUse) -> Result<Self::Matrix, Self::Error> {
        let _ = usage;
        self.matrix(parts.iter().map(Fp8Matrix::dequantize).collect())
    }
    fn matrix_bytes(&self, matrix: &Self::Matrix) -> usize;
    fn vector(&self, values: &[f32]) -> Result<Self::Vector, Self::Error>;
    fn rope(&self, frequencies: RopeFrequencies<'_>) -> Result<Self::Rope, Self::Error>;
    /// One layer's cache: `num_slots` slots of `kv_width` for K and for V, in `dtype` (an FP8
    /// cache scaled by `scales`).
    fn kv_layer(
        &self,
        num_slots: usize,
        kv_width: usize,
        dtype: KvCacheDtype,
        scales: KvScales,
    ) -> Result<Self::KvLayer, Self::Error>;
    /// The dtype activations (and the KV cache) are computed in.
    fn compute_dtype(&self) -> DType;
    /// Scratch for MoE steps of up to `tokens` tokens over experts of this shape
    /// (`num_experts`, `top_k`, `inter`, `hidden` as in [`Experts`]).
    fn moe_scratch(&self, tokens: usize, shape: MoeShape) -> Result<Self::MoeScratch, Self::Error>;
    /// Bytes a [`Self::moe_scratch`] of this size takes.
    fn moe_scratch_bytes(&self, tokens: usize, shape: MoeShape) -> usize;
    /// Whether [`Self::attention_input`] needs its split scratch (`k`, `v`: `[T, kv_size]`)
    /// for a model with (or without) q/k norms and a KV cache of `kv`: the unfused default always
    /// does; a fused form that writes K and V from the projection does not.
    fn splits_kv(&self, qk_norm: bool, kv: KvCacheDtype) -> bool {
        let _ = (qk_norm, kv);
        true
    }

    // Ops.

    /// `out[t, :] = table[token_ids[t], :] * scale`; `table`: `[vocab, hidden]`.
    fn embedding(
        &self,
        batch: &Self::Batch<'_>,
        table: &Self::Matrix,
        scale: f32,
        out: &mut Self::Tensor,
    ) -> Result<(), Self::Error>;

    /// Row-wise RMSNorm: `out = x / sqrt(mean(x^2) + eps) * w`.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Vector, eps: f32, out: &mut Self::Tensor)
        -> Result<(), Self::Error>;

    /// `residual += x; out = rms_norm(residual, w, eps)`.
    fn add_rms_norm(
        &self,
        residual: &mut Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<(), Self::Error>;

    /// RMSNorm in place over every `w`-long piece of each row: per head (q/k norms), or over
    /// whole rows (Gemma 2/3's norms of a sub-layer's output).
    fn rms_norm_heads(&self, x: &mut Self::Tensor, w: &Self::Vector, eps: f32) -> Result<(), Self::Error>;

    /// `residual += rms_norm(x, x_w, eps); out = rms_norm(residual, w, eps)`: a sub-layer's
    /// output norm (Gemma 2/3) and the residual add with the next norm, which a device may do in
    /// one pass. `x` may be left holding its normed rows. By default
    /// [`Device::rms_norm_heads`] on `x` (`x_w` as wide as a row), then [`Device::add_rms_norm`].
    fn add_normed_rms_norm(
        &self,
        residual: &mut Self::Tensor,
        x: &mut Self::Tensor,
        x_w: &Self::Vector,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<(), Self::Error> {
        self.rms_norm_heads(x, x_w, eps)?;
        self.add_rms_norm(residual, x, w, eps, out)
    }

    /// `x = cap * tanh(x / cap)` in place (`cap > 0`); `x`: f32 `[rows, cols]` (the logits:
    /// Gemma 2's `final_logit_softcapping`).
    fn softcap(&self, x: &mut Self::Tensor, cap: f32) -> Result<(), Self::Error>;

    /// `y = x W^T (+ b)`; `y` in its own precision (f32 logits from a compute-dtype `x`).
    fn linear(&self, x: &Self::Tensor, w: &Linear<Self>, y: &mut Self::Tensor) -> Result<(), Self::Error>;

    /// [`Self::linear`] over the first `y.cols` output features of `w` only (`y.cols` at most
    /// `w.out_features`): `y = x W[..y.cols]^T (+ b[..y.cols])`. An LM head whose last rows
    /// pad the vocabulary past the tokenizer's computes no logits for them.
    fn linear_prefix(&self, x: &Self::Tensor, w: &Linear<Self>, y: &mut Self::Tensor) -> Result<(), Self::Error>;

    /// Splits `qkv`: `[T, q + 2 kv]` into `q`: `[T, q]`, `k` and `v`: `[T, kv]`.
    fn split_qkv(
        &self,
        qkv: &Self::Tensor,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &mut Self::Tensor,
    ) -> Result<(), Self::Error>;

    /// Rotary embedding in place (HF `rotate_half` layout) at the batch's positions;
    /// `x`: `[T, heads * head_dim]`.
    fn rotate(
        &self,
        batch: &Self::Batch<'_>,
        rope: &Self::Rope,
        head_dim: usize,
        x: &mut Self::Tensor,
    ) -> Result<(), Self::Error>;

    /// Writes `k`, `v`: `[T, kv_width]` into the cache at the batch's slot mapping (negative
    /// slots are padding and are skipped).
    fn write_kv(
        &self,
        batch: &Self::Batch<'_>,
        k: &Self::Tensor,
        v: &Self::Tensor,
        kv: &mut Self::KvLayer,
    ) -> Result<(), Self::Error>;

    /// Causal attention of every query row over its request's paged K/V (the new tokens'
    /// already written); `q`, `out`: `[T, num_heads * head_dim]`.
    fn attention(
        &self,
        batch: &Self::Batch<'_>,
        layer: &LayerAttention,
        q: &Self::Tensor,
        kv: &Self::KvLayer,
        out: &mut Self::Tensor,
    ) -> Result<(), Self::Error>;

    /// `out[r, j] = act(gate_up[r, j]) * gate_up[r, inter + j]`; `gate_up`: `[rows, 2 * inter]`.
    fn gated_activation(
        &self,
        gate_up: &Self::Tensor,
        act: GatedActivation,
        out: &mut Self::Tensor,
    ) -> Result<(), Self::Error>;

    /// `dst[i, :] = src[logits_indices[i], :]`: the rows whose logits the step wants.
    fn gather_logits_rows(
        &self,
        batch: &Self::Batch<'_>,
        src: &Self::Tensor,
        dst: &mut Self::Tensor,
    ) -> Result<(), Self::Error>;

    /// The routed experts of a MoE MLP (see [`MoeInput`]). Issues device work only (CUDA graphs
    /// capture it): the routing is data-dependent, the launch shapes must not be.
    fn moe(&self, batch: &Self::Batch<'_>, args: MoeInput<'_, Self>) -> Result<(), Self::Error>;

    /// `out[r, :] += sigmoid(gate[r, 0]) * x[r, :]` (Qwen2-MoE's shared expert);
    /// `gate`: f32 `[T, 1]`.
    fn add_sigmoid_gated(
        &self,
        out: &mut Self::Tensor,
        x: &Self::Tensor,
        gate: &Self::Tensor,
    ) -> Result<(), Self::Error>;

    // Fused forms.

    /// The attention block's input step (see [`AttentionInput`]).
    fn attention_input(&self, batch: &Self::Batch<'_>, args: AttentionInput<'_, Self>) -> Result<(), Self::Error> {
        unfused_attention_input(self, batch, args)
    }

    /// `out = act(x W_gate^T) * (x W_up^T)` for `w = [gate; up]`, through `gate_up`:
    /// `[T, 2 * inter]` (scratch).
    fn gated_mlp(
        &self,
        x: &Self::Tensor,
        w: &Linear<Self>,
        act: GatedActivation,
        gate_up: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<(), Self::Error> {
        self.linear(x, w, gate_up)?;
        self.gated_activation(gate_up, act, out)
    }
}

/// [`Device::attention_input`] op by op: projection, split, q/k norms, rotation, cache write.
/// Public so that a device overriding the fused form can fall back to it where its kernel does
/// not apply.
pub fn unfused_attention_input<D: Device + ?Sized>(
    dev: &D,
    batch: &D::Batch<'_>,
    a: AttentionInput<'_, D>,
) -> Result<(), D::Error> {
    dev.linear(a.x, a.qkv_proj, a.qkv)?;
    dev.split_qkv(a.qkv, a.q, a.k, a.v)?;
    if let Some((q_norm, k_norm)) = a.qk_norm {
        dev.rms_norm_heads(a.q, q_norm, a.eps)?;
        dev.rms_norm_heads(a.k, k_norm, a.eps)?;
    }
    dev.rotate(batch, a.rope, a.heads.head_dim, a.q)?;
    dev.rotate(batch, a.rope, a.heads.head_dim, a.k)?;
    dev.write_kv(batch, a.k, a.v, a.kv)
}
