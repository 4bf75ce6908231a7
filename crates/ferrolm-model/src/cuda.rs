//! The decoder on an NVIDIA GPU (`cuda` feature): the same steps as [`Model::forward`], with
//! weights, activations and the paged KV cache in device memory, in one dtype chosen at load
//! (bf16 by default; f32 to compare closely with the CPU backend).
//!
//! Per step the host uploads the batch's index buffers (a few KB), the GPU runs every layer and
//! then samples (or takes prompt logprobs) on the logits where they are, and only the chosen
//! tokens and the logprobs asked for come back (`GpuSampler`).

use ferrolm_backend::cuda::{
    self as gpu_ops, GatedActivation, Gpu, GpuAttentionMetadata, GpuError, GpuRopeTable, GpuTensor, GpuView,
    StagedBuffer,
};
use ferrolm_backend::DType;
use ferrolm_sampling::{RowRequest, TokenLogprobs};

mod graphs;
mod workspace;

use graphs::{graph_batch, DecodeGraph, DecodeGraphs, GraphShape, GRAPH_BATCHES};
use workspace::{Activations, StepBuffers};

use crate::config::{Activation, ModelConfig};
use crate::input::ModelInput;
use crate::model::{Linear, Model};
use crate::runner::ModelRunner;
use crate::ModelError;

impl From<GpuError> for ModelError {
    fn from(err: GpuError) -> ModelError {
        ModelError::Device(err.to_string())
    }
}

/// A linear layer on the device: weight `[out, in]` in the model dtype, bias f32.
struct GpuLinear {
    weight: GpuTensor,
    bias: Option<GpuTensor>,
    out_features: usize,
    in_features: usize,
}

impl GpuLinear {
    fn upload(gpu: &Gpu, l: &Linear, dtype: DType) -> Result<GpuLinear, GpuError> {
        let shape = l.weight.shape();
        Ok(GpuLinear {
            weight: GpuTensor::from_weights(gpu, l.weight.view(), dtype)?,
            bias: l.bias.as_deref().map(|b| GpuTensor::from_f32(gpu, b, DType::F32)).transpose()?,
            out_features: shape[0],
            in_features: shape[1],
        })
    }

    /// `x`: the first `m` rows of a `[_, in]` buffer -> the first `m` rows of `y`: `[_, out]`.
    fn forward(&self, gpu: &Gpu, x: &GpuTensor, m: usize, y: &mut GpuTensor) -> Result<(), GpuError> {
        gpu_ops::linear(
            gpu,
            x.rows(0..m, self.in_features),
            m,
            self.in_features,
            self.weight.view(),
            self.out_features,
            self.bias.as_ref().map(GpuTensor::view),
            y.rows_mut(0..m, self.out_features),
        )
    }
}

struct GpuLayer {
    /// f32 `[hidden]`
    input_layernorm: GpuTensor,
    qkv_proj: GpuLinear,
    /// f32 `[head_dim]` each.
    qk_norm: Option<(GpuTensor, GpuTensor)>,
    o_proj: GpuLinear,
    post_attention_layernorm: GpuTensor,
    gate_up_proj: GpuLinear,
    down_proj: GpuLinear,
}

/// The weights on the device.
struct GpuModel {
    /// `[vocab, hidden]`
    embed_tokens: GpuTensor,
    layers: Vec<GpuLayer>,
    /// f32 `[hidden]`
    norm: GpuTensor,
    /// `[vocab, hidden]`; `None` when tied to `embed_tokens`.
    lm_head: Option<GpuTensor>,
    rope: GpuRopeTable,
}

/// The model on one GPU, with its KV cache.
pub struct CudaRunner {
    gpu: Gpu,
    config: ModelConfig,
    dtype: DType,
    model: GpuModel,
    /// Per layer: K and V caches, `[num_blocks * block_size, kv_size]` each.
    kv: Vec<(GpuTensor, GpuTensor)>,
    block_size: usize,
    weight_bytes: usize,
    /// Reused by every step; `None` until the first.
    acts: Option<Activations>,
    graphs: DecodeGraphs,
    /// The index buffers of steps that run eagerly, reused from step to step.
    eager_buffers: Option<StepBuffers>,
    /// Sampling and logprobs on the logits, with its buffers.
    sampler: gpu_ops::GpuSampler,
    /// The `(t, row)` pairs of a step's previous tokens on their way to the device.
    previous: PreviousTokens,
}

/// The `(t, row)` pairs of a step's previous tokens (see [`ModelInput::previous_tokens`]), sent
/// to the device through a buffer kept from step to step.
#[derive(Default)]
struct PreviousTokens {
    staged: Option<StagedBuffer>,
}

impl PreviousTokens {
    /// Queues the writes of `input`'s previous tokens into the step's token ids on the device,
    /// from what the sampler's last launch sampled there.
    fn write(
        &mut self,
        gpu: &Gpu,
        sampler: &gpu_ops::GpuSampler,
        vocab: usize,
        input: &ModelInput,
        buffers: &StepBuffers,
    ) -> Result<(), GpuError> {
        let pairs = &input.previous_tokens;
        if pairs.is_empty() {
            return Ok(());
        }
        let flat: Vec<u32> = pairs.iter().flat_map(|&(t, row)| [t, row]).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&flat);
        if self.staged.as_ref().is_none_or(|b| b.capacity() < bytes.len()) {
            self.staged = None;
            self.staged = Some(StagedBuffer::new(gpu, bytes.len().next_power_of_two())?);
        }
        let staged = self.staged.as_mut().expect("allocated above");
        let part = staged.write(gpu, &[bytes])?[0];
        sampler.write_sampled_tokens(gpu, pairs, &staged.view::<u32>(part), vocab, &buffers.token_ids())
    }
}

impl CudaRunner {
    /// Uploads `model`'s weights to `gpu` in `dtype` (f32, bf16 or f16). The KV cache comes
    /// later, from [`ModelRunner::allocate_kv_cache`], once its size is known.
    pub fn new(model: &Model, gpu: Gpu, dtype: DType) -> Result<CudaRunner, ModelError> {
        let cfg = &model.config;
        let f32_vec = |v: &[f32]| GpuTensor::from_f32(&gpu, v, DType::F32);
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            layers.push(GpuLayer {
                input_layernorm: f32_vec(&l.input_layernorm)?,
                qkv_proj: GpuLinear::upload(&gpu, &l.qkv_proj, dtype)?,
                qk_norm: match (&l.q_norm, &l.k_norm) {
                    (Some(q), Some(k)) => Some((f32_vec(q)?, f32_vec(k)?)),
                    _ => None,
                },
                o_proj: GpuLinear::upload(&gpu, &l.o_proj, dtype)?,
                post_attention_layernorm: f32_vec(&l.post_attention_layernorm)?,
                gate_up_proj: GpuLinear::upload(&gpu, &l.gate_up_proj, dtype)?,
                down_proj: GpuLinear::upload(&gpu, &l.down_proj, dtype)?,
            });
        }
        let embed_tokens = GpuTensor::from_weights(&gpu, model.embed_tokens.view(), dtype)?;
        let lm_head = model.lm_head.as_ref().map(|t| GpuTensor::from_weights(&gpu, t.view(), dtype)).transpose()?;
        let norm = f32_vec(&model.norm)?;
        let long = model.rope.long.as_ref().map(|(start, table)| (*start, table.as_slice()));
        let rope = GpuRopeTable::new(&gpu, &model.rope.inv_freq, long, model.rope.attention_scaling)?;
        gpu.synchronize()?;
        let layer_bytes: usize = layers
            .iter()
            .map(|l| {
                [&l.qkv_proj, &l.o_proj, &l.gate_up_proj, &l.down_proj]
                    .iter()
                    .map(|p| p.weight.size_in_bytes())
                    .sum::<usize>()
            })
            .sum();
        let weight_bytes =
            layer_bytes + embed_tokens.size_in_bytes() + lm_head.as_ref().map_or(0, GpuTensor::size_in_bytes);
        Ok(CudaRunner {
            gpu,
            config: cfg.clone(),
            dtype,
            model: GpuModel { embed_tokens, layers, norm, lm_head, rope },
            kv: Vec::new(),
            block_size: 0,
            weight_bytes,
            acts: None,
            graphs: DecodeGraphs::new(),
            eager_buffers: None,
            sampler: gpu_ops::GpuSampler::new(),
            previous: PreviousTokens::default(),
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Times cuBLAS against cuBLASLt's algorithms on the GEMMs of this runner's decode steps, so
    /// that each takes the faster (`Gpu::tune_gemms`): the projections and the LM head at each
    /// decode graph batch from 128 rows up to the one holding `max_decode_batch`. The first layer
    /// stands for all: every layer has the same shapes. `FERROLM_GEMM_TUNE=0` skips it; other
    /// shapes (prompt chunks among them: at 8192 rows tuning gained 0.4 %) keep `cublasGemmEx`.
    pub fn tune_gemms(&self, max_decode_batch: usize) -> Result<(), ModelError> {
        if std::env::var("FERROLM_GEMM_TUNE").is_ok_and(|v| v == "0") {
            return Ok(());
        }
        let Some(layer) = self.model.layers.first() else { return Ok(()) };
        fn projection(l: &GpuLinear) -> (GpuView<'_>, usize, DType) {
            // A bias is added to an f32 product (see `linear`).
            let output = if l.bias.is_some() { DType::F32 } else { l.weight.dtype() };
            (l.weight.view(), l.out_features, output)
        }
        let head = self.model.lm_head.as_ref().unwrap_or(&self.model.embed_tokens);
        let vocab = head.len() / layer.qkv_proj.in_features.max(1);
        let weights = [
            projection(&layer.qkv_proj),
            projection(&layer.o_proj),
            projection(&layer.gate_up_proj),
            projection(&layer.down_proj),
            (head.view(), vocab, DType::F32),
        ];
        let started = std::time::Instant::now();
        // Decode batches from 128 rows on, where the GEMMs approach their compute bound: tuning
        // times each on one copy of the weights, which the L2 may hold, and below that the
        // weights' reads dominate.
        let largest = graph_batch(max_decode_batch).unwrap_or(GRAPH_BATCHES[GRAPH_BATCHES.len() - 1]);
        let ms: Vec<usize> = GRAPH_BATCHES.iter().copied().filter(|&m| (128..=largest).contains(&m)).collect();
        if ms.is_empty() {
            return Ok(());
        }
        let report = self.gpu.tune_gemms(&ms, &weights)?;
        for t in &report {
            tracing::debug!(
                m = t.shape.m,
                n = t.shape.n,
                k = t.shape.k,
                cublas_us = t.default_us,
                cublaslt_us = t.best_us,
                candidates = t.candidates,
                taken = t.taken,
                "GEMM tuned"
            );
        }
        let taken = report.iter().filter(|t| t.taken).count();
        // One layer's GEMMs and the head at the largest decode batch, before and after: what a
        // decode step of that batch gains per layer.
        let (before, after) = report.iter().filter(|t| t.shape.m == largest).fold((0.0, 0.0), |(before, after), t| {
            let tuned = if t.taken { t.best_us.unwrap_or(t.default_us) } else { t.default_us };
            (before + t.default_us, after + tuned)
        });
        tracing::info!(
            shapes = report.len(),
            taken,
            seconds = started.elapsed().as_secs_f64(),
            rows = largest,
            us_before = before,
            us_after = after,
            "decode GEMMs tuned: cuBLASLt algorithms kept where faster than cuBLAS's default"
        );
        Ok(())
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Device bytes of one KV block of `block_size` tokens, over all layers.
    pub fn kv_bytes_per_block(&self, block_size: usize) -> usize {
        self.config.num_hidden_layers * 2 * block_size * self.config.kv_size() * self.dtype.size_in_bytes()
    }

    /// Disables (or re-enables) CUDA graphs for decode steps; on by default unless the
    /// environment sets `FERROLM_CUDA_GRAPHS=0`.
    pub fn set_cuda_graphs(&mut self, enabled: bool) {
        self.graphs.clear();
        self.graphs.disabled = !enabled;
    }

    /// Runs the decoder over `input`; the f32 logits of its `logits_indices` rows are then the
    /// first rows of `self.acts`' `logits` (see [`Self::logits`]). A batch of decodes replays a
    /// captured graph; anything else runs eagerly.
    fn forward(&mut self, input: &ModelInput) -> Result<(), GpuError> {
        let rows = input.logits_indices.len();
        let shape = if self.graphs.disabled || self.model.layers.is_empty() { None } else { GraphShape::of(input) };
        let Some(shape) = shape else {
            self.ensure_activations(input.num_tokens(), rows)?;
            StepBuffers::upload_reusing(&mut self.eager_buffers, &self.gpu, input)?;
            let buffers = self.eager_buffers.as_ref().expect("buffers were just written");
            self.previous.write(&self.gpu, &self.sampler, self.config.vocab_size, input, buffers)?;
            let step = StepShape::of(input);
            let acts = self.acts.as_mut().expect("activations were just ensured");
            return decoder(&self.gpu, &self.config, &self.model, &mut self.kv, self.block_size, acts, buffers, &step);
        };
        let padded = shape.pad(input);
        self.ensure_activations(shape.batch, shape.batch)?;
        if let Some(entry) = self.graphs.graphs.get_mut(&shape) {
            entry.buffers.copy_from(&self.gpu, &padded)?;
            self.previous.write(&self.gpu, &self.sampler, self.config.vocab_size, input, &entry.buffers)?;
            return entry.graph.launch();
        }
        // Only a capture needs the step's host-side shape; a replay has it baked in.
        let step = StepShape::of(&padded);
        let buffers = StepBuffers::upload(&self.gpu, &padded)?;
        self.previous.write(&self.gpu, &self.sampler, self.config.vocab_size, input, &buffers)?;
        let acts = self.acts.as_mut().expect("activations were just ensured");
        let (g, cfg, model, block_size) = (&self.gpu, &self.config, &self.model, self.block_size);
        let kv = &mut self.kv;
        match g.capture(|| decoder(g, cfg, model, kv, block_size, acts, &buffers, &step)) {
            Ok(graph) => {
                graph.launch()?;
                self.graphs.graphs.insert(shape, DecodeGraph { buffers, graph });
                Ok(())
            }
            Err(err) => {
                tracing::warn!("CUDA graph capture failed ({err}); decode steps run without graphs");
                self.graphs.clear();
                self.graphs.disabled = true;
                decoder(g, cfg, model, kv, block_size, acts, &buffers, &step)
            }
        }
    }

    /// Grows the activation buffers for a step of `tokens` tokens and `rows` logits rows;
    /// captured graphs go when the buffers move.
    fn ensure_activations(&mut self, tokens: usize, rows: usize) -> Result<(), GpuError> {
        if Activations::ensure(&mut self.acts, &self.gpu, &self.config, self.dtype, tokens, rows)? {
            self.graphs.clear();
        }
        Ok(())
    }

    /// `[rows, vocab]` f32: the logits the last [`Self::forward`] computed.
    fn logits(&self, rows: usize) -> GpuView<'_> {
        let acts = self.acts.as_ref().expect("forward ran");
        acts.logits.rows(0..rows, self.config.vocab_size)
    }
}

/// What the decoder needs of a step besides its device buffers.
struct StepShape {
    /// `[num_reqs + 1]`, as in the step's `ModelInput`.
    query_start_loc: Vec<u32>,
    tokens: usize,
    rows: usize,
    max_query_len: usize,
    max_blocks_per_seq: usize,
    /// The logits rows are all rows in order (a batch of decodes): no gather needed.
    identity_rows: bool,
}

impl StepShape {
    fn of(input: &ModelInput) -> StepShape {
        let max_query_len = input.query_start_loc.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
        StepShape {
            query_start_loc: input.query_start_loc.clone(),
            tokens: input.num_tokens(),
            rows: input.logits_indices.len(),
            max_query_len,
            max_blocks_per_seq: input.max_blocks_per_seq,
            identity_rows: input.logits_indices.len() == input.num_tokens()
                && input.logits_indices.iter().enumerate().all(|(i, &r)| r as usize == i),
        }
    }
}

/// The decoder: issues every layer and the LM head for one step, writing f32 logits of the
/// step's `rows` rows into the first rows of `a.logits`. Issues launches only (no host copy and
/// no synchronization), so that a decode step can be captured as a graph.
#[allow(clippy::too_many_arguments)]
fn decoder(
    g: &Gpu,
    cfg: &ModelConfig,
    model: &GpuModel,
    kv: &mut [(GpuTensor, GpuTensor)],
    block_size: usize,
    a: &mut Activations,
    b: &StepBuffers,
    step: &StepShape,
) -> Result<(), GpuError> {
    let (t, rows) = (step.tokens, step.rows);
    let (h, q_size, kv_size, inter) = (cfg.hidden_size, cfg.q_size(), cfg.kv_size(), cfg.intermediate_size);
    let (heads, kv_heads, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    let eps = cfg.rms_norm_eps;
    let meta = GpuAttentionMetadata {
        query_start_loc: b.query_start_loc(),
        query_start_loc_host: &step.query_start_loc,
        seq_lens: b.seq_lens(),
        block_tables: b.block_tables(),
        max_blocks_per_seq: step.max_blocks_per_seq,
        max_query_len: step.max_query_len,
        block_size,
        sliding_window: cfg.sliding_window,
        scale: 1.0 / (hd as f32).sqrt(),
        work: Default::default(),
    };
    let qkv_width = q_size + 2 * kv_size;

    gpu_ops::embedding(
        g,
        &b.token_ids(),
        model.embed_tokens.view(),
        h,
        cfg.embedding_multiplier,
        a.residual.rows_mut(0..t, h),
    )?;
    for (i, (layer, (k_cache, v_cache))) in model.layers.iter().zip(kv.iter_mut()).enumerate() {
        if i == 0 {
            gpu_ops::rms_norm(
                g,
                a.residual.rows(0..t, h),
                layer.input_layernorm.view(),
                eps,
                a.normed.rows_mut(0..t, h),
            )?;
        } else {
            gpu_ops::add_rms_norm(
                g,
                a.residual.rows_mut(0..t, h),
                a.pending.rows(0..t, h),
                layer.input_layernorm.view(),
                eps,
                a.normed.rows_mut(0..t, h),
            )?;
        }
        let qkv = &layer.qkv_proj;
        if layer.qk_norm.is_none() && qkv.bias.is_none() {
            // Projection, rotation and cache write in one kernel where the GEMV takes the product.
            gpu_ops::linear_qkv_rope_cache(
                g,
                a.normed.rows(0..t, h),
                h,
                qkv.weight.view(),
                &b.positions(),
                &b.slot_mapping(),
                heads,
                kv_heads,
                hd,
                &model.rope,
                a.qkv.rows_mut(0..t, qkv_width),
                a.q.rows_mut(0..t, q_size),
                k_cache.view_mut(),
                v_cache.view_mut(),
            )?;
        } else if let Some((qn, kn)) = &layer.qk_norm {
            qkv.forward(g, &a.normed, t, &mut a.qkv)?;
            // q/k norms sit between the split and the rotation: the unfused path.
            let (q, k, v) = (a.q.rows_mut(0..t, q_size), a.k.rows_mut(0..t, kv_size), a.v.rows_mut(0..t, kv_size));
            gpu_ops::split_qkv(g, a.qkv.rows(0..t, qkv_width), q_size, kv_size, q, k, v)?;
            gpu_ops::rms_norm_inplace(g, a.q.rows_mut(0..t, q_size), qn.view(), eps)?;
            gpu_ops::rms_norm_inplace(g, a.k.rows_mut(0..t, kv_size), kn.view(), eps)?;
            gpu_ops::rope(g, a.q.rows_mut(0..t, q_size), &b.positions(), heads, hd, &model.rope)?;
            gpu_ops::rope(g, a.k.rows_mut(0..t, kv_size), &b.positions(), kv_heads, hd, &model.rope)?;
            gpu_ops::reshape_and_cache(
                g,
                a.k.rows(0..t, kv_size),
                a.v.rows(0..t, kv_size),
                &b.slot_mapping(),
                kv_size,
                k_cache.view_mut(),
                v_cache.view_mut(),
            )?;
        } else {
            qkv.forward(g, &a.normed, t, &mut a.qkv)?;
            gpu_ops::qkv_rope_cache(
                g,
                a.qkv.rows(0..t, qkv_width),
                &b.positions(),
                &b.slot_mapping(),
                heads,
                kv_heads,
                hd,
                &model.rope,
                a.q.rows_mut(0..t, q_size),
                k_cache.view_mut(),
                v_cache.view_mut(),
            )?;
        }
        gpu_ops::paged_attention(
            g,
            a.q.rows(0..t, q_size),
            k_cache.view(),
            v_cache.view(),
            &meta,
            heads,
            kv_heads,
            hd,
            a.attn.rows_mut(0..t, q_size),
        )?;
        layer.o_proj.forward(g, &a.attn, t, &mut a.o)?;
        gpu_ops::add_rms_norm(
            g,
            a.residual.rows_mut(0..t, h),
            a.o.rows(0..t, h),
            layer.post_attention_layernorm.view(),
            eps,
            a.normed.rows_mut(0..t, h),
        )?;
        let act = match cfg.activation {
            Activation::Silu => GatedActivation::Silu,
            Activation::GeluTanh => GatedActivation::GeluTanh,
        };
        let up = &layer.gate_up_proj;
        gpu_ops::linear_gated(
            g,
            a.normed.rows(0..t, h),
            t,
            up.in_features,
            up.weight.view(),
            inter,
            up.bias.as_ref().map(GpuTensor::view),
            act,
            a.gate_up.rows_mut(0..t, 2 * inter),
            a.act.rows_mut(0..t, inter),
        )?;
        layer.down_proj.forward(g, &a.act, t, &mut a.pending)?;
    }

    // Only the rows whose logits are wanted go through the final norm and the LM head.
    let (last_residual, last_out) = if step.identity_rows {
        (&mut a.residual, &a.pending)
    } else {
        gpu_ops::gather_rows(
            g,
            a.residual.rows(0..t, h),
            h,
            &b.logits_indices(),
            a.last_residual.rows_mut(0..rows, h),
        )?;
        if !model.layers.is_empty() {
            gpu_ops::gather_rows(g, a.pending.rows(0..t, h), h, &b.logits_indices(), a.last_out.rows_mut(0..rows, h))?;
        }
        (&mut a.last_residual, &a.last_out)
    };
    if model.layers.is_empty() {
        gpu_ops::rms_norm(
            g,
            last_residual.rows(0..rows, h),
            model.norm.view(),
            eps,
            a.final_normed.rows_mut(0..rows, h),
        )?;
    } else {
        gpu_ops::add_rms_norm(
            g,
            last_residual.rows_mut(0..rows, h),
            last_out.rows(0..rows, h),
            model.norm.view(),
            eps,
            a.final_normed.rows_mut(0..rows, h),
        )?;
    }
    let head = model.lm_head.as_ref().unwrap_or(&model.embed_tokens);
    let vocab = cfg.vocab_size;
    gpu_ops::linear(
        g,
        a.final_normed.rows(0..rows, h),
        rows,
        h,
        head.view(),
        vocab,
        None,
        a.logits.rows_mut(0..rows, vocab),
    )
}

impl ModelRunner for CudaRunner {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn device(&self) -> String {
        format!("cuda:0 ({})", self.gpu.name())
    }

    fn allocate_kv_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), ModelError> {
        // Free the old cache first so that its memory can be reused; graphs that wrote it go too.
        self.graphs.clear();
        self.kv.clear();
        let len = num_blocks * block_size * self.config.kv_size();
        for _ in 0..self.config.num_hidden_layers {
            let k = GpuTensor::zeros(&self.gpu, self.dtype, len)?;
            let v = GpuTensor::zeros(&self.gpu, self.dtype, len)?;
            self.kv.push((k, v));
        }
        self.block_size = block_size;
        self.gpu.synchronize()?;
        Ok(())
    }

    fn launch(&mut self, input: &ModelInput, rows: &[RowRequest<'_>]) -> Result<(), ModelError> {
        let num_rows = input.logits_indices.len();
        assert_eq!(rows.len(), num_rows, "launch: {} requests for {num_rows} logits rows", rows.len());
        if self.kv.is_empty() && self.config.num_hidden_layers > 0 {
            return Err(ModelError::Device("launch before allocate_kv_cache".into()));
        }
        if input.num_tokens() > 0 {
            self.forward(input)?;
        }
        // Taken out for the call so that the logits can stay borrowed from `self`.
        let mut sampler = std::mem::take(&mut self.sampler);
        let launched = sampler.launch(&self.gpu, self.logits(num_rows), self.config.vocab_size, rows);
        self.sampler = sampler;
        Ok(launched?)
    }

    fn collect(&mut self) -> Result<Vec<Option<TokenLogprobs>>, ModelError> {
        Ok(self.sampler.collect()?)
    }
}
