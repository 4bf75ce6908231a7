//! The decoder on an NVIDIA GPU (`cuda` feature): the same steps as [`Model::forward`], with
//! weights, activations and the paged KV cache in device memory, in one dtype chosen at load
//! (bf16 by default; f32 to compare closely with the CPU backend).
//!
//! Per step the host uploads the batch's index buffers (a few KB), the GPU runs every layer, and
//! only what the sampler needs comes back: the argmax and its logprob for rows the engine marks
//! `argmax_only`, the full f32 row for the others.

use ferrolm_backend::cuda::{self as gpu_ops, CudaSlice, Gpu, GpuAttentionMetadata, GpuError, GpuRopeTable, GpuTensor};
use ferrolm_backend::DType;

use crate::config::{Activation, ModelConfig};
use crate::input::ModelInput;
use crate::model::{Linear, Model};
use crate::runner::{ModelRunner, StepLogits};
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

    /// `x`: `[m, in]` -> `y`: `[m, out]`.
    fn forward(&self, gpu: &Gpu, x: &GpuTensor, m: usize, y: &mut GpuTensor) -> Result<(), GpuError> {
        gpu_ops::linear(
            gpu,
            x.view(),
            m,
            self.in_features,
            self.weight.view(),
            self.out_features,
            self.bias.as_ref().map(GpuTensor::view),
            y.view_mut(),
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

/// One step's index buffers on the device.
struct StepBuffers {
    token_ids: CudaSlice<u32>,
    positions: CudaSlice<u32>,
    query_start_loc: CudaSlice<u32>,
    seq_lens: CudaSlice<u32>,
    block_tables: CudaSlice<u32>,
    slot_mapping: CudaSlice<i64>,
    logits_indices: CudaSlice<u32>,
}

/// The model on one GPU, with its KV cache.
pub struct CudaRunner {
    gpu: Gpu,
    config: ModelConfig,
    dtype: DType,
    /// `[vocab, hidden]`
    embed_tokens: GpuTensor,
    layers: Vec<GpuLayer>,
    /// f32 `[hidden]`
    norm: GpuTensor,
    /// `[vocab, hidden]`; `None` when tied to `embed_tokens`.
    lm_head: Option<GpuTensor>,
    rope: GpuRopeTable,
    /// Per layer: K and V caches, `[num_blocks * block_size, kv_size]` each.
    kv: Vec<(GpuTensor, GpuTensor)>,
    block_size: usize,
    weight_bytes: usize,
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
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            kv: Vec::new(),
            block_size: 0,
            weight_bytes,
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
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

    fn upload_step(&self, input: &ModelInput) -> Result<StepBuffers, GpuError> {
        let g = &self.gpu;
        Ok(StepBuffers {
            token_ids: g.upload(&input.token_ids)?,
            positions: g.upload(&input.positions)?,
            query_start_loc: g.upload(&input.query_start_loc)?,
            seq_lens: g.upload(&input.seq_lens)?,
            block_tables: g.upload(&input.block_tables)?,
            slot_mapping: g.upload(&input.slot_mapping)?,
            logits_indices: g.upload(&input.logits_indices)?,
        })
    }

    /// The decoder: returns f32 logits `[logits_indices.len(), vocab]` on the device.
    fn forward(&mut self, input: &ModelInput) -> Result<GpuTensor, GpuError> {
        let (g, cfg, dt) = (&self.gpu, &self.config, self.dtype);
        let t = input.num_tokens();
        let (h, q_size, kv_size, inter) = (cfg.hidden_size, cfg.q_size(), cfg.kv_size(), cfg.intermediate_size);
        let (heads, kv_heads, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let eps = cfg.rms_norm_eps;
        let b = self.upload_step(input)?;
        let max_query_len = input.query_start_loc.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
        let meta = GpuAttentionMetadata {
            query_start_loc: &b.query_start_loc,
            seq_lens: &b.seq_lens,
            block_tables: &b.block_tables,
            max_blocks_per_seq: input.max_blocks_per_seq,
            max_query_len,
            block_size: self.block_size,
            sliding_window: cfg.sliding_window,
            scale: 1.0 / (hd as f32).sqrt(),
        };

        // [T, hidden]: the residual stream stays f32 between layers (the layers compute in `dt`),
        // so rounding does not accumulate over the depth of the model.
        let mut residual = GpuTensor::zeros(g, DType::F32, t * h)?;
        gpu_ops::embedding(
            g,
            &b.token_ids,
            self.embed_tokens.view(),
            h,
            cfg.embedding_multiplier,
            residual.view_mut(),
        )?;
        let mut normed = GpuTensor::zeros(g, dt, t * h)?;
        // [T, hidden]: the previous sub-layer's output, added into `residual` by the next norm.
        let mut pending = GpuTensor::zeros(g, dt, t * h)?;
        let mut qkv = GpuTensor::zeros(g, dt, t * (q_size + 2 * kv_size))?;
        let mut q = GpuTensor::zeros(g, dt, t * q_size)?;
        let mut k = GpuTensor::zeros(g, dt, t * kv_size)?;
        let mut v = GpuTensor::zeros(g, dt, t * kv_size)?;
        let mut attn = GpuTensor::zeros(g, dt, t * q_size)?;
        let mut o = GpuTensor::zeros(g, dt, t * h)?;
        let mut gate_up = GpuTensor::zeros(g, dt, t * 2 * inter)?;
        let mut act = GpuTensor::zeros(g, dt, t * inter)?;

        for (i, (layer, (k_cache, v_cache))) in self.layers.iter().zip(self.kv.iter_mut()).enumerate() {
            if i == 0 {
                gpu_ops::rms_norm(g, residual.view(), layer.input_layernorm.view(), eps, normed.view_mut())?;
            } else {
                gpu_ops::add_rms_norm(
                    g,
                    residual.view_mut(),
                    pending.view(),
                    layer.input_layernorm.view(),
                    eps,
                    normed.view_mut(),
                )?;
            }
            layer.qkv_proj.forward(g, &normed, t, &mut qkv)?;
            gpu_ops::split_qkv(g, qkv.view(), q_size, kv_size, q.view_mut(), k.view_mut(), v.view_mut())?;
            if let Some((qn, kn)) = &layer.qk_norm {
                gpu_ops::rms_norm_inplace(g, q.view_mut(), qn.view(), eps)?;
                gpu_ops::rms_norm_inplace(g, k.view_mut(), kn.view(), eps)?;
            }
            gpu_ops::rope(g, q.view_mut(), &b.positions, heads, hd, &self.rope)?;
            gpu_ops::rope(g, k.view_mut(), &b.positions, kv_heads, hd, &self.rope)?;
            gpu_ops::reshape_and_cache(
                g,
                k.view(),
                v.view(),
                &b.slot_mapping,
                kv_size,
                k_cache.view_mut(),
                v_cache.view_mut(),
            )?;
            gpu_ops::paged_attention(
                g,
                q.view(),
                k_cache.view(),
                v_cache.view(),
                &meta,
                heads,
                kv_heads,
                hd,
                attn.view_mut(),
            )?;
            layer.o_proj.forward(g, &attn, t, &mut o)?;
            gpu_ops::add_rms_norm(
                g,
                residual.view_mut(),
                o.view(),
                layer.post_attention_layernorm.view(),
                eps,
                normed.view_mut(),
            )?;
            layer.gate_up_proj.forward(g, &normed, t, &mut gate_up)?;
            match cfg.activation {
                Activation::Silu => gpu_ops::silu_and_mul(g, gate_up.view(), inter, act.view_mut())?,
                Activation::GeluTanh => gpu_ops::gelu_tanh_and_mul(g, gate_up.view(), inter, act.view_mut())?,
            }
            layer.down_proj.forward(g, &act, t, &mut pending)?;
        }

        // Only the rows whose logits are wanted go through the final norm and the LM head.
        let rows = input.logits_indices.len();
        let mut last_residual = GpuTensor::zeros(g, DType::F32, rows * h)?;
        let mut last_out = GpuTensor::zeros(g, dt, rows * h)?;
        gpu_ops::gather_rows(g, residual.view(), h, &b.logits_indices, last_residual.view_mut())?;
        if !self.layers.is_empty() {
            gpu_ops::gather_rows(g, pending.view(), h, &b.logits_indices, last_out.view_mut())?;
        }
        let mut final_normed = GpuTensor::zeros(g, dt, rows * h)?;
        gpu_ops::add_rms_norm(
            g,
            last_residual.view_mut(),
            last_out.view(),
            self.norm.view(),
            eps,
            final_normed.view_mut(),
        )?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        let mut logits = GpuTensor::zeros(g, DType::F32, rows * cfg.vocab_size)?;
        gpu_ops::linear(g, final_normed.view(), rows, h, head.view(), cfg.vocab_size, None, logits.view_mut())?;
        Ok(logits)
    }
}

impl ModelRunner for CudaRunner {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn device(&self) -> String {
        format!("cuda:0 ({})", self.gpu.name())
    }

    fn allocate_kv_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), ModelError> {
        // Free the old cache first so that its memory can be reused.
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

    fn execute(&mut self, input: &ModelInput, argmax_only: &[bool]) -> Result<StepLogits, ModelError> {
        let vocab = self.config.vocab_size;
        let rows = input.logits_indices.len();
        assert_eq!(argmax_only.len(), rows, "execute: argmax_only has {} of {rows} rows", argmax_only.len());
        if self.kv.is_empty() && self.config.num_hidden_layers > 0 {
            return Err(ModelError::Device("execute before allocate_kv_cache".into()));
        }
        if input.num_tokens() == 0 {
            return Ok(StepLogits::with_vocab(vocab));
        }
        let logits = self.forward(input)?;
        let g = &self.gpu;
        let argmax = if argmax_only.iter().any(|&a| a) {
            gpu_ops::argmax_logsumexp(g, logits.view(), vocab)?
        } else {
            Vec::new()
        };
        let full_rows: Vec<u32> = (0..rows as u32).filter(|&r| !argmax_only[r as usize]).collect();
        let full = if full_rows.is_empty() {
            Vec::new()
        } else if full_rows.len() == rows {
            logits.to_f32_vec(g)?
        } else {
            let indices = g.upload(&full_rows)?;
            let mut picked = GpuTensor::zeros(g, DType::F32, full_rows.len() * vocab)?;
            gpu_ops::gather_rows(g, logits.view(), vocab, &indices, picked.view_mut())?;
            picked.to_f32_vec(g)?
        };
        let mut out = StepLogits::with_vocab(vocab);
        let mut next_full = 0;
        for r in 0..rows {
            if argmax_only[r] {
                out.push_argmax(argmax[r].token_id, argmax[r].token_logprob);
            } else {
                out.push_full(&full[next_full * vocab..(next_full + 1) * vocab]);
                next_full += 1;
            }
        }
        Ok(out)
    }
}
