//! The decoder: one implementation for every supported family, switched by [`ModelConfig`].
//!
//! Layers mirror HF names (`model.layers.{i}.self_attn.q_proj`, ...). Separate q/k/v and
//! gate/up projections are fused at load time into one matrix each, so every family runs the
//! same two GEMMs where HF runs three and two.

use std::path::Path;

use ferrolm_backend::cpu::{self, AttentionMetadata};

use crate::config::{Activation, ModelConfig};
use crate::input::{KvCache, ModelInput};
use crate::rope::RopeTables;
use crate::weights::{Tensor, WeightSource};
use crate::ModelError;

/// A linear layer: `y = x W^T + b`, `W` stored `[out, in]` in its file dtype.
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }

    fn in_features(&self) -> usize {
        self.weight.shape()[1]
    }

    /// `x`: `[m, in]` -> `[m, out]`.
    pub fn forward(&self, x: &[f32], m: usize) -> Vec<f32> {
        let n = self.out_features();
        let mut y = vec![0.0; m * n];
        cpu::linear(x, m, self.in_features(), self.weight.view(), n, self.bias.as_deref(), &mut y);
        y
    }

    /// Loads `{prefix}.weight` (and `{prefix}.bias` when `bias`) of shape `[out, in]`.
    fn load(src: &WeightSource, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Linear, ModelError> {
        Ok(Linear {
            weight: src.get(&format!("{prefix}.weight"), &[out, inp])?,
            bias: if bias { Some(src.get_f32(&format!("{prefix}.bias"), &[out])?) } else { None },
        })
    }

    /// Loads several projections with the same input and stacks them into one.
    fn load_fused(src: &WeightSource, parts: &[(String, usize)], inp: usize, bias: bool) -> Result<Linear, ModelError> {
        let mut weights = Vec::with_capacity(parts.len());
        let mut biases = Vec::new();
        for (prefix, out) in parts {
            let l = Linear::load(src, prefix, *out, inp, bias)?;
            weights.push(l.weight);
            if let Some(b) = l.bias {
                biases.extend(b);
            }
        }
        Ok(Linear { weight: Tensor::concat_rows(&weights), bias: if bias { Some(biases) } else { None } })
    }
}

fn load_norm(src: &WeightSource, name: &str, dim: usize, unit_offset: bool) -> Result<Vec<f32>, ModelError> {
    let mut w = src.get_f32(name, &[dim])?;
    if unit_offset {
        // Gemma stores `w - 1` and computes `x * (1 + w)` in f32.
        w.iter_mut().for_each(|x| *x += 1.0);
    }
    Ok(w)
}

pub struct DecoderLayer {
    pub(crate) input_layernorm: Vec<f32>,
    /// `[q_size + 2 * kv_size, hidden]`
    pub(crate) qkv_proj: Linear,
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) o_proj: Linear,
    pub(crate) post_attention_layernorm: Vec<f32>,
    /// `[2 * intermediate, hidden]`: gate rows, then up rows.
    pub(crate) gate_up_proj: Linear,
    pub(crate) down_proj: Linear,
}

impl DecoderLayer {
    fn load(src: &WeightSource, cfg: &ModelConfig, i: usize) -> Result<DecoderLayer, ModelError> {
        let p = format!("model.layers.{i}");
        let (h, q, kv, inter) = (cfg.hidden_size, cfg.q_size(), cfg.kv_size(), cfg.intermediate_size);
        let (qkv_proj, gate_up_proj) = if cfg.fused_projections {
            (
                Linear::load(src, &format!("{p}.self_attn.qkv_proj"), q + 2 * kv, h, cfg.qkv_bias)?,
                Linear::load(src, &format!("{p}.mlp.gate_up_proj"), 2 * inter, h, cfg.mlp_bias)?,
            )
        } else {
            let qkv = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)].map(|(n, o)| (format!("{p}.self_attn.{n}"), o));
            let gate_up = [("gate_proj", inter), ("up_proj", inter)].map(|(n, o)| (format!("{p}.mlp.{n}"), o));
            (Linear::load_fused(src, &qkv, h, cfg.qkv_bias)?, Linear::load_fused(src, &gate_up, h, cfg.mlp_bias)?)
        };
        let qk_norm = |n: &str| -> Result<Option<Vec<f32>>, ModelError> {
            if cfg.qk_norm {
                Ok(Some(load_norm(src, &format!("{p}.self_attn.{n}.weight"), cfg.head_dim, cfg.norm_unit_offset)?))
            } else {
                Ok(None)
            }
        };
        Ok(DecoderLayer {
            input_layernorm: load_norm(src, &format!("{p}.input_layernorm.weight"), h, cfg.norm_unit_offset)?,
            qkv_proj,
            q_norm: qk_norm("q_norm")?,
            k_norm: qk_norm("k_norm")?,
            o_proj: Linear::load(src, &format!("{p}.self_attn.o_proj"), h, q, cfg.o_bias)?,
            post_attention_layernorm: load_norm(
                src,
                &format!("{p}.post_attention_layernorm.weight"),
                h,
                cfg.norm_unit_offset,
            )?,
            gate_up_proj,
            down_proj: Linear::load(src, &format!("{p}.mlp.down_proj"), h, inter, cfg.mlp_bias)?,
        })
    }
}

pub struct Model {
    pub config: ModelConfig,
    /// `[vocab, hidden]`
    pub(crate) embed_tokens: Tensor,
    pub(crate) layers: Vec<DecoderLayer>,
    pub(crate) norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when tied to `embed_tokens`.
    pub(crate) lm_head: Option<Tensor>,
    pub(crate) rope: RopeTables,
}

impl Model {
    /// Loads a Hugging Face model directory (`config.json` + safetensors).
    pub fn from_dir(dir: &Path) -> Result<Model, ModelError> {
        if !dir.is_dir() {
            let source = std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory");
            return Err(ModelError::io(dir, source));
        }
        let config = ModelConfig::from_dir(dir)?;
        let src = WeightSource::open_dir(dir)?;
        Model::load(config, &src)
    }

    pub fn load(config: ModelConfig, src: &WeightSource) -> Result<Model, ModelError> {
        let (v, h) = (config.vocab_size, config.hidden_size);
        let embed_tokens = src.get("model.embed_tokens.weight", &[v, h])?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| DecoderLayer::load(src, &config, i))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = load_norm(src, "model.norm.weight", h, config.norm_unit_offset)?;
        let lm_head = if config.tie_word_embeddings { None } else { Some(src.get("lm_head.weight", &[v, h])?) };
        let rope = config.rope_scaling.tables(config.rope_theta, config.rotary_dim())?;
        Ok(Model { config, embed_tokens, layers, norm, lm_head, rope })
    }

    /// Bytes of weights the model holds.
    pub fn weight_bytes(&self) -> usize {
        let linear = |l: &Linear| l.weight.size_in_bytes();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| linear(&l.qkv_proj) + linear(&l.o_proj) + linear(&l.gate_up_proj) + linear(&l.down_proj))
            .sum();
        layers + self.embed_tokens.size_in_bytes() + self.lm_head.as_ref().map_or(0, Tensor::size_in_bytes)
    }

    /// A KV cache of `num_blocks` blocks for this model.
    pub fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> KvCache {
        KvCache::new(self.config.num_hidden_layers, num_blocks, block_size, self.config.kv_size())
    }

    fn apply_rope(&self, x: &mut [f32], positions: &[u32], num_heads: usize) {
        let (hd, scaling) = (self.config.head_dim, self.rope.attention_scaling);
        if self.rope.long.is_none() {
            cpu::rope(x, positions, num_heads, hd, &self.rope.inv_freq, scaling);
            return;
        }
        // LongRoPE: runs of tokens that share one frequency table.
        let width = num_heads * hd;
        let mut start = 0;
        while start < positions.len() {
            let table = self.rope.inv_freq_for(positions[start]);
            let mut end = start + 1;
            while end < positions.len() && std::ptr::eq(self.rope.inv_freq_for(positions[end]), table) {
                end += 1;
            }
            cpu::rope(&mut x[start * width..end * width], &positions[start..end], num_heads, hd, table, scaling);
            start = end;
        }
    }

    /// Runs one step. Writes the new tokens' K/V into `kv` and returns the logits of the rows in
    /// `input.logits_indices`: `[logits_indices.len(), vocab]`.
    pub fn forward(&self, input: &ModelInput, kv: &mut KvCache) -> Vec<f32> {
        let cfg = &self.config;
        let t = input.num_tokens();
        let (h, q_size, kv_size, inter) = (cfg.hidden_size, cfg.q_size(), cfg.kv_size(), cfg.intermediate_size);
        let qkv_width = q_size + 2 * kv_size;
        let eps = cfg.rms_norm_eps;

        // [T, hidden]
        let mut residual = vec![0.0; t * h];
        cpu::embedding(&input.token_ids, self.embed_tokens.view(), h, cfg.embedding_multiplier, &mut residual);
        // [T, hidden]: the normed input of the current sub-layer.
        let mut normed = vec![0.0; t * h];
        // [T, hidden]: the output of the previous sub-layer, added into `residual` by the next norm.
        let mut pending: Option<Vec<f32>> = None;

        let meta = AttentionMetadata {
            query_start_loc: &input.query_start_loc,
            seq_lens: &input.seq_lens,
            block_tables: &input.block_tables,
            max_blocks_per_seq: input.max_blocks_per_seq,
            block_size: kv.block_size,
            sliding_window: cfg.sliding_window,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        };
        // [T, q_size], [T, kv_size], [T, kv_size]
        let mut q = vec![0.0; t * q_size];
        let mut k = vec![0.0; t * kv_size];
        let mut v = vec![0.0; t * kv_size];
        let mut attn = vec![0.0; t * q_size];
        let mut act = vec![0.0; t * inter];

        for (layer, (k_cache, v_cache)) in self.layers.iter().zip(kv.layers.iter_mut()) {
            match pending.take() {
                None => cpu::rms_norm(&residual, &layer.input_layernorm, eps, &mut normed),
                Some(out) => cpu::add_rms_norm(&mut residual, &out, &layer.input_layernorm, eps, &mut normed),
            }
            // [T, q_size + 2 * kv_size]
            let qkv = layer.qkv_proj.forward(&normed, t);
            for (row, chunk) in qkv.chunks_exact(qkv_width).enumerate() {
                q[row * q_size..(row + 1) * q_size].copy_from_slice(&chunk[..q_size]);
                k[row * kv_size..(row + 1) * kv_size].copy_from_slice(&chunk[q_size..q_size + kv_size]);
                v[row * kv_size..(row + 1) * kv_size].copy_from_slice(&chunk[q_size + kv_size..]);
            }
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                cpu::rms_norm_inplace(&mut q, qn, eps);
                cpu::rms_norm_inplace(&mut k, kn, eps);
            }
            self.apply_rope(&mut q, &input.positions, cfg.num_attention_heads);
            self.apply_rope(&mut k, &input.positions, cfg.num_key_value_heads);
            cpu::reshape_and_cache(&k, &v, &input.slot_mapping, kv_size, k_cache, v_cache);
            cpu::paged_attention(
                &q,
                k_cache,
                v_cache,
                &meta,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                &mut attn,
            );
            let o = layer.o_proj.forward(&attn, t);
            cpu::add_rms_norm(&mut residual, &o, &layer.post_attention_layernorm, eps, &mut normed);
            // [T, 2 * intermediate]
            let gate_up = layer.gate_up_proj.forward(&normed, t);
            match cfg.activation {
                Activation::Silu => cpu::silu_and_mul(&gate_up, inter, &mut act),
                Activation::GeluTanh => cpu::gelu_tanh_and_mul(&gate_up, inter, &mut act),
            }
            pending = Some(layer.down_proj.forward(&act, t));
        }

        // Only the rows whose logits are wanted go through the final norm and the LM head.
        let rows = input.logits_indices.len();
        let mut last_residual = vec![0.0; rows * h];
        let mut last_out = vec![0.0; rows * h];
        for (i, &r) in input.logits_indices.iter().enumerate() {
            let r = r as usize;
            last_residual[i * h..(i + 1) * h].copy_from_slice(&residual[r * h..(r + 1) * h]);
            if let Some(out) = &pending {
                last_out[i * h..(i + 1) * h].copy_from_slice(&out[r * h..(r + 1) * h]);
            }
        }
        let mut final_normed = vec![0.0; rows * h];
        cpu::add_rms_norm(&mut last_residual, &last_out, &self.norm, eps, &mut final_normed);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        let mut logits = vec![0.0; rows * cfg.vocab_size];
        cpu::linear(&final_normed, rows, h, head.view(), cfg.vocab_size, None, &mut logits);
        logits
    }
}
