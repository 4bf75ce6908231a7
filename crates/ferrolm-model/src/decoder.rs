//! The decoder: one implementation for every supported family and every device, switched by
//! [`ModelConfig`] and generic over [`Device`].
//!
//! Layers mirror HF names (`model.layers.{i}.self_attn.q_proj`, ...). Separate q/k/v and
//! gate/up projections are stacked at load into one matrix each, so every family runs the same
//! two GEMMs where HF runs three and two. What differs between families is stated once, here
//! and in the config: biases (`qkv_bias`, `o_bias`, `mlp_bias`), q/k norms, checkpoints with
//! fused projections, Gemma's `(1 + w)` norms (folded into the weights at load) and scaled
//! embedding, Gemma 2/3's sandwich norms and Gemma 2's soft-capped logits, the gated
//! activation, tied embeddings, each layer's attention (window, scale, soft-cap:
//! [`ModelConfig::layer_attention`]) and RoPE (Gemma 3's local layers have their own), and each
//! layer's MLP, dense or a mixture of experts ([`Mlp`], in `mlp`).
//!
//! [`Decoder::run`] only issues device work, so a step can be captured as a CUDA graph.

use ferrolm_backend::{AttentionInput, Device, KvCacheDtype, KvScales, LayerAttention, Linear};

use crate::activations::Activations;
use crate::config::ModelConfig;
use crate::weights::WeightSource;
use crate::ModelError;

mod matrices;
mod mlp;

use matrices::{Part, Role};
pub use mlp::{Mlp, SharedExpert, SparseMoe};

/// One decoder layer's weights on device `D`.
pub struct Layer<D: Device> {
    /// f32 `[hidden]`
    input_layernorm: D::Vector,
    /// `[q_size + 2 * kv_size, hidden]`
    qkv_proj: Linear<D>,
    /// f32 `[head_dim]` each.
    qk_norm: Option<(D::Vector, D::Vector)>,
    attention: LayerAttention,
    /// The scales of an FP8 KV cache: the checkpoint's, else 1.
    kv_scales: KvScales,
    /// Which of the decoder's `ropes` rotates q and k.
    rope: usize,
    /// `[hidden, q_size]`
    o_proj: Linear<D>,
    /// f32 `[hidden]`: the norm of the MLP's input (HF's `post_attention_layernorm`; Gemma 2/3's
    /// `pre_feedforward_layernorm`).
    post_attention_layernorm: D::Vector,
    /// Gemma 2/3's norms of the attention and MLP outputs.
    sandwich_norms: Option<SandwichNorms<D>>,
    mlp: Mlp<D>,
}

/// The norms of each sub-layer's output before it joins the residual (Gemma 2/3), f32
/// `[hidden]` each.
struct SandwichNorms<D: Device> {
    /// HF's `post_attention_layernorm`, on the attention output.
    attention_output: D::Vector,
    /// `post_feedforward_layernorm`, on the MLP output.
    mlp_output: D::Vector,
}

/// A model's weights on device `D`, and the step that runs them.
pub struct Decoder<D: Device> {
    pub config: ModelConfig,
    /// `[vocab, hidden]`: the embedding table, and the LM head when tied.
    embed_tokens: Linear<D>,
    layers: Vec<Layer<D>>,
    /// f32 `[hidden]`
    norm: D::Vector,
    /// `[vocab, hidden]`; `None` when tied to `embed_tokens`.
    lm_head: Option<Linear<D>>,
    /// The model's RoPE tables: the global one, then the sliding layers' where they have their
    /// own (`ModelConfig::sliding_rope`).
    ropes: Vec<D::Rope>,
    weight_bytes: usize,
}

/// The rows of one step: what the decoder needs of it besides the device batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepRows {
    /// Tokens in the step (`T`).
    pub tokens: usize,
    /// Rows whose logits are wanted.
    pub logits: usize,
    /// The logits rows are all rows in order (a batch of decodes): no gather needed.
    pub identity: bool,
}

impl<D: Device> Decoder<D>
where
    ModelError: From<D::Error>,
{
    /// Places `config`'s weights, read from `src`, on `dev`.
    pub fn load(dev: &D, config: ModelConfig, src: &WeightSource) -> Result<Decoder<D>, ModelError> {
        let (v, h) = (config.vocab_size, config.hidden_size);
        let loader = Loader { dev, src, cfg: &config };
        let embed_tokens = loader.linear(&[("model.embed_tokens".into(), v)], h, false, Role::Embedding)?;
        let layers = (0..config.num_hidden_layers).map(|i| loader.layer(i)).collect::<Result<Vec<_>, _>>()?;
        let norm = loader.norm("model.norm.weight", h)?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(loader.linear(&[("lm_head".into(), v)], h, false, Role::AsStored)?)
        };
        let rotary_dim = config.rotary_dim();
        let global = config.rope_scaling.tables(config.rope_theta, rotary_dim)?;
        let mut ropes = vec![dev.rope(global.frequencies())?];
        if let Some(sliding) = &config.sliding_rope {
            ropes.push(dev.rope(sliding.scaling.tables(sliding.theta, rotary_dim)?.frequencies())?);
        }
        let matrices = layers
            .iter()
            .flat_map(|l| [&l.qkv_proj.weight, &l.o_proj.weight].into_iter().chain(l.mlp.matrices()))
            .chain([&embed_tokens.weight])
            .chain(lm_head.as_ref().map(|l| &l.weight));
        let weight_bytes = matrices.map(|m| dev.matrix_bytes(m)).sum();
        Ok(Decoder { config, embed_tokens, layers, norm, lm_head, ropes, weight_bytes })
    }
}

impl<D: Device> Decoder<D> {
    /// Bytes of weight matrices the model holds on its device (every expert of a MoE model).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// The layer the GEMM tuning times for all: every layer's attention has its shapes, and so
    /// has every dense MLP of a dense model.
    pub fn first_layer(&self) -> Option<&Layer<D>> {
        self.layers.first()
    }

    /// `[vocab, hidden]`
    pub fn lm_head(&self) -> &Linear<D> {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// A KV cache of `num_blocks[g]` blocks of `block_size` tokens for each layer of KV cache
    /// group `g` ([`ModelConfig::kv_cache_groups`]); one count serves every group.
    pub fn kv_cache(&self, dev: &D, num_blocks: &[usize], block_size: usize) -> Result<Vec<D::KvLayer>, D::Error> {
        let slots = |layer: &Layer<D>| group_entry(num_blocks, layer.attention.kv_group) * block_size;
        let (width, dtype) = (self.config.kv_size(), self.config.kv_cache_dtype);
        self.layers.iter().map(|l| dev.kv_layer(slots(l), width, dtype, l.kv_scales)).collect()
    }

    /// Issues one step: every layer, then the final norm and the LM head on the step's logits
    /// rows, whose f32 logits end in `a.logits` (`[rows.logits, output_vocab_size]`). `a` must
    /// have room for the step (see [`Activations::ensure`]). `batches` holds the step once per
    /// KV cache group, with that group's block tables and slot mapping (one serves every group);
    /// each layer reads its group's.
    pub fn run(
        &self,
        dev: &D,
        batches: &[D::Batch<'_>],
        rows: StepRows,
        kv: &mut [D::KvLayer],
        a: &mut Activations<D>,
    ) -> Result<(), D::Error> {
        let cfg = &self.config;
        let eps = cfg.rms_norm_eps;
        let layers = self.layers.len();
        assert_eq!(kv.len(), layers, "Decoder::run: a KV cache of {} layers for {layers}", kv.len());
        let num_groups = self.layers.iter().map(|l| l.attention.kv_group + 1).max().unwrap_or(1);
        assert!(
            batches.len() == 1 || batches.len() == num_groups,
            "Decoder::run: a batch of {} KV cache groups for a model of {num_groups}",
            batches.len()
        );
        // The group-independent ops read the first group's batch.
        let batch = &batches[0];
        a.set_rows(rows.tokens, rows.logits);
        dev.embedding(batch, &self.embed_tokens.weight, cfg.embedding_multiplier, &mut a.residual)?;
        for (i, (layer, kv)) in self.layers.iter().zip(kv.iter_mut()).enumerate() {
            let batch = group_entry(batches, layer.attention.kv_group);
            // The previous layer's MLP output joins the residual stream in this layer's norm.
            if i == 0 {
                dev.rms_norm(&a.residual, &layer.input_layernorm, eps, &mut a.normed)?;
            } else {
                let out_norm = self.layers[i - 1].mlp_output_norm();
                add_norm(dev, &mut a.residual, &mut a.pending, out_norm, &layer.input_layernorm, eps, &mut a.normed)?;
            }
            let input = AttentionInput {
                x: &a.normed,
                qkv_proj: &layer.qkv_proj,
                qk_norm: layer.qk_norm.as_ref().map(|(q, k)| (q, k)),
                eps,
                heads: layer.attention.heads,
                rope: &self.ropes[layer.rope],
                qkv: &mut a.qkv,
                k: &mut a.k,
                v: &mut a.v,
                q: &mut a.q,
                kv,
            };
            dev.attention_input(batch, input)?;
            dev.attention(batch, &layer.attention, &a.q, kv, &mut a.attn)?;
            dev.linear(&a.attn, &layer.o_proj, &mut a.o)?;
            let out_norm = layer.sandwich_norms.as_ref().map(|s| &s.attention_output);
            add_norm(dev, &mut a.residual, &mut a.o, out_norm, &layer.post_attention_layernorm, eps, &mut a.normed)?;
            // A sandwich norm of the MLP's output joins the next add (the next layer's or the
            // final one).
            layer.mlp.forward(dev, batch, cfg.activation, a)?;
        }

        // Only the rows whose logits are wanted go through the final norm and the LM head.
        let (last_residual, last_out) = if rows.identity {
            (&mut a.residual, &mut a.pending)
        } else {
            dev.gather_logits_rows(batch, &a.residual, &mut a.last_residual)?;
            if !self.layers.is_empty() {
                dev.gather_logits_rows(batch, &a.pending, &mut a.last_out)?;
            }
            (&mut a.last_residual, &mut a.last_out)
        };
        match self.layers.last() {
            None => dev.rms_norm(last_residual, &self.norm, eps, &mut a.final_normed)?,
            Some(last) => {
                add_norm(dev, last_residual, last_out, last.mlp_output_norm(), &self.norm, eps, &mut a.final_normed)?
            }
        }
        // Logits only for the ids the model may output (`output_vocab_size`): rows padding the
        // vocabulary past the tokenizer are never computed, so never sampled.
        dev.linear_prefix(&a.final_normed, self.lm_head(), &mut a.logits)?;
        match cfg.final_logit_softcapping {
            Some(cap) => dev.softcap(&mut a.logits, cap),
            None => Ok(()),
        }
    }
}

/// `residual += x; out = rms_norm(residual, w)`, with `x` first normed by `x_norm` where the
/// layer has a norm of its sub-layer's output (Gemma 2/3), in one device op.
fn add_norm<D: Device>(
    dev: &D,
    residual: &mut D::Tensor,
    x: &mut D::Tensor,
    x_norm: Option<&D::Vector>,
    w: &D::Vector,
    eps: f32,
    out: &mut D::Tensor,
) -> Result<(), D::Error> {
    match x_norm {
        Some(x_w) => dev.add_normed_rms_norm(residual, x, x_w, w, eps, out),
        None => dev.add_rms_norm(residual, x, w, eps, out),
    }
}

impl<D: Device> Layer<D> {
    /// The norm of this layer's MLP output, where the layer has sandwich norms.
    fn mlp_output_norm(&self) -> Option<&D::Vector> {
        self.sandwich_norms.as_ref().map(|s| &s.mlp_output)
    }

    /// The layer's projections into the compute dtype: qkv, o, and its MLP's
    /// ([`Mlp::projections`]).
    pub fn projections(&self) -> Vec<&Linear<D>> {
        [&self.qkv_proj, &self.o_proj].into_iter().chain(self.mlp.projections()).collect()
    }
}

/// Group `group`'s entry of a per-group list, where one entry serves every group.
fn group_entry<T>(per_group: &[T], group: usize) -> &T {
    if per_group.len() == 1 {
        &per_group[0]
    } else {
        &per_group[group]
    }
}

/// Reads weights from a checkpoint and places them on a device.
struct Loader<'a, D> {
    dev: &'a D,
    src: &'a WeightSource,
    cfg: &'a ModelConfig,
}

impl<D: Device> Loader<'_, D>
where
    ModelError: From<D::Error>,
{
    fn layer(&self, i: usize) -> Result<Layer<D>, ModelError> {
        let cfg = self.cfg;
        let p = format!("model.layers.{i}");
        let (h, q, kv) = (cfg.hidden_size, cfg.q_size(), cfg.kv_size());
        let qkv_proj = if cfg.fused_projections {
            self.linear(&[(format!("{p}.self_attn.qkv_proj"), q + 2 * kv)], h, cfg.qkv_bias, Role::Projection)?
        } else {
            let qkv = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)].map(|(n, o)| (format!("{p}.self_attn.{n}"), o));
            self.linear(&qkv, h, cfg.qkv_bias, Role::Projection)?
        };
        let qk_norm = if cfg.qk_norm {
            let norm = |n: &str| self.norm(&format!("{p}.self_attn.{n}.weight"), cfg.head_dim);
            Some((norm("q_norm")?, norm("k_norm")?))
        } else {
            None
        };
        let layer_norm = |n: &str| self.norm(&format!("{p}.{n}.weight"), h);
        let (post_attention_layernorm, sandwich_norms) = if cfg.sandwich_norms {
            let sandwich = SandwichNorms {
                attention_output: layer_norm("post_attention_layernorm")?,
                mlp_output: layer_norm("post_feedforward_layernorm")?,
            };
            (layer_norm("pre_feedforward_layernorm")?, Some(sandwich))
        } else {
            (layer_norm("post_attention_layernorm")?, None)
        };
        Ok(Layer {
            input_layernorm: layer_norm("input_layernorm")?,
            qkv_proj,
            qk_norm,
            attention: cfg.layer_attention(i),
            kv_scales: self.kv_scales(&p)?,
            // The sliding layers' own RoPE is the decoder's second.
            rope: usize::from(cfg.layer_takes_sliding_rope(i)),
            o_proj: self.linear(&[(format!("{p}.self_attn.o_proj"), h)], q, cfg.o_bias, Role::Projection)?,
            post_attention_layernorm,
            sandwich_norms,
            mlp: self.mlp(i, &p)?,
        })
    }

    /// The projections `parts` (`{prefix}.weight` of `[out, inp]`, and `{prefix}.bias` when
    /// `bias`) stacked into one linear layer, its matrix read as `role` says.
    fn linear(&self, parts: &[(String, usize)], inp: usize, bias: bool, role: Role) -> Result<Linear<D>, ModelError> {
        let matrix_parts: Vec<Part> = parts.iter().map(|(p, out)| (p.clone(), [*out, inp])).collect();
        let weight = self.matrix(&matrix_parts, role)?;
        let bias = if bias {
            let mut values = Vec::new();
            for (p, out) in parts {
                values.extend(self.src.get_f32(&format!("{p}.bias"), &[*out])?);
            }
            Some(self.dev.vector(&values)?)
        } else {
            None
        };
        let out_features = parts.iter().map(|(_, out)| out).sum();
        Ok(Linear { weight, bias, out_features, in_features: inp })
    }

    /// Layer `p`'s KV cache scales, for an FP8 cache: as compressed-tensors stores them
    /// (`self_attn.k_scale`, `v_scale`), as earlier FP8 checkpoints did (`k_proj.output_scale`,
    /// `v_proj.output_scale`, or one `self_attn.kv_scale` for both), else 1.
    fn kv_scales(&self, p: &str) -> Result<KvScales, ModelError> {
        if self.cfg.kv_cache_dtype != KvCacheDtype::Fp8 {
            return Ok(KvScales::default());
        }
        // The first of `names` the checkpoint has (random weights have none).
        let scalar = |names: &[String]| -> Result<Option<f32>, ModelError> {
            let Some(name) = names.iter().find(|n| self.src.shape_of(n).is_some()) else {
                return Ok(None);
            };
            let scale = self.src.get_scalar(name)?;
            if !(scale.is_finite() && scale > 0.0) {
                return Err(ModelError::Config(format!("`{name}` is {scale}, not a positive scale")));
            }
            Ok(Some(scale))
        };
        let attn = format!("{p}.self_attn");
        let both = scalar(&[format!("{attn}.kv_scale")])?;
        let k = scalar(&[format!("{attn}.k_scale"), format!("{attn}.k_proj.output_scale")])?;
        let v = scalar(&[format!("{attn}.v_scale"), format!("{attn}.v_proj.output_scale")])?;
        let one = KvScales::default();
        Ok(KvScales { k: k.or(both).unwrap_or(one.k), v: v.or(both).unwrap_or(one.v) })
    }

    fn norm(&self, name: &str, dim: usize) -> Result<D::Vector, ModelError> {
        let mut w = self.src.get_f32(name, &[dim])?;
        if self.cfg.norm_unit_offset {
            // Gemma stores `w - 1` and computes `x * (1 + w)` in f32.
            w.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(self.dev.vector(&w)?)
    }
}
