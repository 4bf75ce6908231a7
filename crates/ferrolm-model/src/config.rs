//! `ModelConfig`: what the decoder needs to know about a model, read from a Hugging Face
//! `config.json` in either key style (old: `rope_theta` / `rope_scaling` / `torch_dtype`; new:
//! `rope_parameters` / `dtype`), plus the `generation_config.json` defaults.
//!
//! Everything architecture-specific is resolved here into plain flags, so that the decoder is one
//! code path switched by data.

use std::path::Path;

use ferrolm_backend::{DType, GatedActivation, Heads, KvCacheDtype, LayerAttention};
use ferrolm_sampling::GenerationDefaults;
use serde::Deserialize;
use serde_json::Value;

use crate::rope::{RopeParams, RopeScaling};
use crate::ModelError;

mod moe;
pub mod quant;

pub use moe::MoeConfig;
pub use quant::Quantization;

/// The decoder families ferrolm runs, by their HF `architectures` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Phi3,
    Gemma,
    Gemma2,
    /// Gemma 3's text model (`Gemma3ForCausalLM`).
    Gemma3,
    Qwen2Moe,
    Qwen3Moe,
    Mixtral,
}

impl Architecture {
    pub const SUPPORTED: [(&'static str, Architecture); 11] = [
        ("LlamaForCausalLM", Architecture::Llama),
        ("MistralForCausalLM", Architecture::Mistral),
        ("Qwen2ForCausalLM", Architecture::Qwen2),
        ("Qwen3ForCausalLM", Architecture::Qwen3),
        ("Phi3ForCausalLM", Architecture::Phi3),
        ("GemmaForCausalLM", Architecture::Gemma),
        ("Gemma2ForCausalLM", Architecture::Gemma2),
        ("Gemma3ForCausalLM", Architecture::Gemma3),
        ("Qwen2MoeForCausalLM", Architecture::Qwen2Moe),
        ("Qwen3MoeForCausalLM", Architecture::Qwen3Moe),
        ("MixtralForCausalLM", Architecture::Mixtral),
    ];

    pub fn from_hf_name(name: &str) -> Option<Architecture> {
        Self::SUPPORTED.iter().find(|(n, _)| *n == name).map(|(_, a)| *a)
    }

    pub fn hf_name(self) -> &'static str {
        Self::SUPPORTED.iter().find(|(_, a)| *a == self).map(|(n, _)| *n).unwrap_or("?")
    }

    fn supported_list() -> String {
        Self::SUPPORTED.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
    }
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub architecture: Architecture,
    /// Rows of the embedding (and of the LM head's weight): every id a prompt may hold.
    pub vocab_size: usize,
    /// Ids the LM head computes logits for, its first rows: `vocab_size` as read, lowered by
    /// [`ModelConfig::limit_output_vocab`] to the ids a tokenizer can decode, so that the rows
    /// a checkpoint pads its embedding with (Qwen2.5: 152,064 for 151,665 tokens) are never
    /// sampled nor reported as logprobs. Logits rows are `[rows, output_vocab_size]`.
    pub output_vocab_size: usize,
    pub hidden_size: usize,
    /// The dense MLPs' intermediate size (Mixtral: its experts').
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub activation: GatedActivation,
    /// Biases on q/k/v projections (Qwen2, Qwen2-MoE's `qkv_bias`, or Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Biases on gate/up/down (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm of each q and k head before RoPE (Qwen3, Qwen3-MoE, Gemma 3).
    pub qk_norm: bool,
    /// Each sub-layer's output is normed before it joins the residual, and the MLP has an input
    /// norm of its own (Gemma 2/3: `post_attention_layernorm` on the attention output,
    /// `pre_feedforward_layernorm`, `post_feedforward_layernorm`).
    pub sandwich_norms: bool,
    /// Norm weights are stored as `w - 1` and applied as `(1 + w)` (Gemma).
    pub norm_unit_offset: bool,
    /// Embeddings are multiplied by `sqrt(hidden_size)` (Gemma).
    pub embedding_multiplier: f32,
    /// The window of the model's sliding-window layers, if it has any.
    pub sliding_window: Option<usize>,
    /// `[num_hidden_layers]`: which layers attend through `sliding_window` (all of them, for
    /// Mistral-style models; alternating or patterned for the families that mix windowed and
    /// global layers). All false when `sliding_window` is `None`.
    pub sliding_layers: Vec<bool>,
    /// The softmax scale is `query_pre_attn_scalar^-0.5` rather than `head_dim^-0.5` (Gemma 2/3).
    pub query_pre_attn_scalar: Option<f32>,
    /// Attention scores soft-capped at this value (Gemma 2's `attn_logit_softcapping`).
    pub attn_logit_softcapping: Option<f32>,
    /// Logits soft-capped at this value (Gemma 2's `final_logit_softcapping`).
    pub final_logit_softcapping: Option<f32>,
    /// The RoPE of every layer but those that take `sliding_rope`.
    pub rope_theta: f32,
    /// Fraction of each head that rotates (Phi-3's `partial_rotary_factor`).
    pub partial_rotary_factor: f32,
    pub rope_scaling: RopeScaling,
    /// The RoPE of the sliding-window layers where it is not the others' (Gemma 3: base
    /// `rope_local_base_freq`, no scaling).
    pub sliding_rope: Option<RopeParams>,
    /// Weights stored with `qkv_proj` and `gate_up_proj` fused (Phi-3).
    pub fused_projections: bool,
    /// Routed experts in the MLPs of the sparse layers ([`ModelConfig::layer_is_sparse`]).
    pub moe: Option<MoeConfig>,
    /// How the projections' weights are quantized: the checkpoint's FP8 scheme, or
    /// `--quantization fp8` ([`ModelConfig::quantize_at_load`]).
    pub quantization: Option<Quantization>,
    /// The KV cache's element type (`--kv-cache-dtype`; the compute dtype unless set).
    pub kv_cache_dtype: KvCacheDtype,
    pub dtype: DType,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The raw keys we read; unknown keys are ignored.
#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<usize>,
    original_max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    attention_bias: Option<bool>,
    qkv_bias: Option<bool>,
    mlp_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<usize>,
    #[serde(rename = "_sliding_window_pattern")]
    sliding_window_pattern_private: Option<usize>,
    rope_theta: Option<f64>,
    rope_local_base_freq: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    partial_rotary_factor: Option<f64>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
}

pub(crate) fn read_json(path: &Path) -> Result<Value, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::InvalidJson { path: path.to_owned(), message: e.to_string() })
}

/// Token ids given as a number or a list of numbers (`eos_token_id`).
pub(crate) fn token_ids(value: &Option<Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(Value::Array(items)) => items.iter().filter_map(|v| v.as_u64()).map(|n| n as u32).collect(),
        _ => Vec::new(),
    }
}

pub fn parse_dtype(name: &str) -> Option<DType> {
    match name {
        "bfloat16" | "bf16" => Some(DType::BF16),
        "float16" | "half" | "fp16" | "f16" => Some(DType::F16),
        "float32" | "float" | "fp32" | "f32" => Some(DType::F32),
        _ => None,
    }
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<ModelConfig, ModelError> {
        Self::from_file(&dir.join("config.json"))
    }

    pub fn from_file(path: &Path) -> Result<ModelConfig, ModelError> {
        let value = read_json(path)?;
        Self::from_value(value).map_err(|e| match e {
            ModelError::Config(message) => ModelError::Config(format!("{}: {message}", path.display())),
            other => other,
        })
    }

    pub fn from_value(value: Value) -> Result<ModelConfig, ModelError> {
        let raw = RawConfig::deserialize(&value).map_err(|e| ModelError::Config(e.to_string()))?;
        let arch_name = raw
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .ok_or_else(|| ModelError::Config("no `architectures` entry".into()))?;
        let architecture = Architecture::from_hf_name(&arch_name).ok_or_else(|| {
            ModelError::UnsupportedArchitecture { name: arch_name.clone(), supported: Architecture::supported_list() }
        })?;
        let _ = raw.model_type;

        let positive = |name: &str, v: usize| {
            if v == 0 {
                Err(ModelError::Config(format!("`{name}` must be positive")))
            } else {
                Ok(v)
            }
        };
        let hidden_size = positive("hidden_size", raw.hidden_size)?;
        let num_attention_heads = positive("num_attention_heads", raw.num_attention_heads)?;
        let num_key_value_heads =
            positive("num_key_value_heads", raw.num_key_value_heads.unwrap_or(num_attention_heads))?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(ModelError::Config(format!(
                "num_attention_heads ({num_attention_heads}) is not a multiple of num_key_value_heads ({num_key_value_heads})"
            )));
        }
        let head_dim = positive("head_dim", raw.head_dim.unwrap_or(hidden_size / num_attention_heads))?;
        positive("vocab_size", raw.vocab_size)?;
        positive("num_hidden_layers", raw.num_hidden_layers)?;
        positive("intermediate_size", raw.intermediate_size)?;

        let is_gemma = matches!(architecture, Architecture::Gemma | Architecture::Gemma2 | Architecture::Gemma3);
        let gemma_2_or_3 = matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3);
        // Gemma's MLP is GELU-tanh whatever `hidden_act` says (HF overrides the exact "gelu").
        let act_name = raw.hidden_activation.clone().or(raw.hidden_act.clone()).unwrap_or_else(|| "silu".into());
        let activation = match (is_gemma, act_name.as_str()) {
            (true, _) => GatedActivation::GeluTanh,
            (false, "silu" | "swish") => GatedActivation::Silu,
            (false, "gelu_pytorch_tanh" | "gelu_new" | "gelu_tanh") => GatedActivation::GeluTanh,
            (false, other) => return Err(ModelError::Config(format!("unsupported hidden_act `{other}`"))),
        };

        let sliding_window = match architecture {
            Architecture::Mistral | Architecture::Phi3 | Architecture::Mixtral => raw.sliding_window,
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen2Moe | Architecture::Qwen3Moe
                if raw.use_sliding_window == Some(true) =>
            {
                raw.sliding_window
            }
            // HF's default window for both.
            Architecture::Gemma2 | Architecture::Gemma3 => Some(raw.sliding_window.unwrap_or(4096)),
            _ => None,
        };
        if sliding_window == Some(0) {
            return Err(ModelError::Config("`sliding_window` must be positive".into()));
        }
        let sliding_layers = match sliding_layer_types(&raw, architecture)? {
            Some(layers) => layers,
            None => vec![sliding_window.is_some(); raw.num_hidden_layers],
        };

        // Rope parameters: new style `rope_parameters` (holds `rope_theta` too; one set per
        // layer type where the layer types differ, as in Gemma 3's) or old style.
        let per_layer_type = raw
            .rope_parameters
            .as_ref()
            .filter(|p| p.get("full_attention").is_some() || p.get("sliding_attention").is_some());
        let rope_params = match per_layer_type {
            Some(p) => p.get("full_attention").cloned(),
            None => raw.rope_parameters.clone().or(raw.rope_scaling.clone()),
        }
        .filter(|v| v.is_object());
        let default_theta = if architecture == Architecture::Gemma3 { 1_000_000.0 } else { 10000.0 };
        let rope_theta = rope_params
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .or(raw.rope_theta)
            .unwrap_or(default_theta) as f32;
        let partial_rotary_factor = rope_params
            .as_ref()
            .and_then(|p| p.get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            .or(raw.partial_rotary_factor)
            .unwrap_or(1.0) as f32;
        let max_position_embeddings = raw.max_position_embeddings.unwrap_or(2048);
        let rope_scaling = RopeScaling::from_params(
            rope_params.as_ref(),
            max_position_embeddings,
            raw.original_max_position_embeddings,
        )?;
        // Gemma 3's local layers: `rope_local_base_freq` and no scaling in the old style, their
        // own entry in the new.
        let local_theta = raw.rope_local_base_freq.unwrap_or(10000.0);
        let sliding_rope = match (per_layer_type.and_then(|p| p.get("sliding_attention")), architecture) {
            (Some(p), _) => Some(RopeParams {
                theta: p.get("rope_theta").and_then(Value::as_f64).unwrap_or(local_theta) as f32,
                scaling: RopeScaling::from_params(
                    Some(p),
                    max_position_embeddings,
                    raw.original_max_position_embeddings,
                )?,
            }),
            (None, Architecture::Gemma3) => Some(RopeParams { theta: local_theta as f32, scaling: RopeScaling::None }),
            (None, _) => None,
        };

        // HF's defaults where a Gemma 2/3 config leaves these out (Gemma 2's caps 50 and 30,
        // none for Gemma 3, a scalar of 256 for both); `null` turns a soft-cap off. The other
        // families have none of them.
        let (attn_cap, final_cap, pre_attn_scalar) = match architecture {
            Architecture::Gemma2 => (Some(50.0), Some(30.0), Some(256.0)),
            _ => (None, None, Some(256.0)),
        };
        let gemma_key = |key: &str, default: Option<f64>| {
            if gemma_2_or_3 {
                positive_or_default(&value, key, default)
            } else {
                Ok(None)
            }
        };
        let attn_logit_softcapping = gemma_key("attn_logit_softcapping", attn_cap)?;
        let final_logit_softcapping = gemma_key("final_logit_softcapping", final_cap)?;
        let query_pre_attn_scalar = gemma_key("query_pre_attn_scalar", pre_attn_scalar)?;

        let dtype_name = raw.dtype.clone().or(raw.torch_dtype.clone()).unwrap_or_else(|| "bfloat16".into());
        let dtype =
            parse_dtype(&dtype_name).ok_or_else(|| ModelError::Config(format!("unsupported dtype `{dtype_name}`")))?;

        let attention_bias = raw.attention_bias.unwrap_or(false);
        let moe = MoeConfig::from_value(architecture, &value, raw.intermediate_size)?;
        let quantization = quant::parse(&value).map_err(ModelError::UnsupportedQuantization)?;
        let qkv_bias = match architecture {
            Architecture::Qwen2 => true,
            Architecture::Qwen2Moe => raw.qkv_bias.unwrap_or(true),
            _ => attention_bias,
        };
        Ok(ModelConfig {
            architecture,
            vocab_size: raw.vocab_size,
            output_vocab_size: raw.vocab_size,
            hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
            max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(is_gemma),
            activation,
            qkv_bias,
            o_bias: matches!(architecture, Architecture::Llama) && attention_bias,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3),
            sandwich_norms: gemma_2_or_3,
            norm_unit_offset: is_gemma,
            embedding_multiplier: if is_gemma { (hidden_size as f32).sqrt() } else { 1.0 },
            sliding_window,
            sliding_layers,
            query_pre_attn_scalar,
            attn_logit_softcapping,
            final_logit_softcapping,
            rope_theta,
            partial_rotary_factor,
            rope_scaling,
            sliding_rope,
            fused_projections: architecture == Architecture::Phi3,
            moe,
            quantization,
            kv_cache_dtype: KvCacheDtype::Auto,
            dtype,
            bos_token_id: token_ids(&raw.bos_token_id).first().copied(),
            eos_token_ids: token_ids(&raw.eos_token_id),
        })
    }

    /// `--quantization fp8`: the projections are quantized at load. A checkpoint already stored
    /// in FP8 keeps its own scheme (as vLLM takes `fp8` for an `fp8` checkpoint); any other
    /// stored quantization is refused, as it cannot be quantized again.
    pub fn quantize_at_load(&mut self) -> Result<(), ModelError> {
        match self.quantization {
            None => self.quantization = Some(Quantization::FP8_AT_LOAD),
            Some(Quantization::Checkpoint(c)) if c.method == "fp8" => {}
            Some(Quantization::Checkpoint(c)) => {
                return Err(ModelError::UnsupportedQuantization(format!(
                    "--quantization fp8 with a checkpoint already quantized by {}: leave the flag out to use its own \
                     FP8 weights",
                    c.method
                )))
            }
            Some(Quantization::Fp8AtLoad(_)) => {}
        }
        Ok(())
    }

    /// Keeps the logits to the first `num_ids` ids (a tokenizer's size), where the model has
    /// more: ids past a tokenizer have no text, so they must never be sampled. Never raises
    /// `output_vocab_size` past `vocab_size`, nor lowers it below one id.
    pub fn limit_output_vocab(&mut self, num_ids: usize) {
        self.output_vocab_size = self.output_vocab_size.min(num_ids).max(1);
    }

    /// Number of dims of each head that RoPE rotates (even).
    pub fn rotary_dim(&self) -> usize {
        let dim = (self.head_dim as f32 * self.partial_rotary_factor) as usize;
        dim - dim % 2
    }

    pub fn q_size(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    pub fn kv_size(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    pub fn heads(&self) -> Heads {
        Heads { num_heads: self.num_attention_heads, num_kv_heads: self.num_key_value_heads, head_dim: self.head_dim }
    }

    /// The attention window of layer `layer`: `sliding_window` on the layers that slide.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|_| self.sliding_layers.get(layer).copied().unwrap_or(false))
    }

    /// Whether layer `layer` rotates with `sliding_rope` rather than `rope_theta` /
    /// `rope_scaling`: a sliding layer of a model whose sliding layers have a RoPE of their own.
    pub fn layer_takes_sliding_rope(&self, layer: usize) -> bool {
        self.sliding_rope.is_some() && self.sliding_layers.get(layer).copied().unwrap_or(false)
    }

    /// What attention layer `layer` computes over the shared batch metadata: its window
    /// ([`Self::layer_window`]), softmax scale, soft-cap and KV cache group
    /// ([`Self::kv_cache_groups`]).
    pub fn layer_attention(&self, layer: usize) -> LayerAttention {
        let scale = match self.query_pre_attn_scalar {
            // As HF: `query_pre_attn_scalar**-0.5` in double precision, used as an f32.
            Some(s) => (1.0 / f64::from(s).sqrt()) as f32,
            None => 1.0 / (self.head_dim as f32).sqrt(),
        };
        LayerAttention {
            heads: self.heads(),
            sliding_window: self.layer_window(layer),
            scale,
            softcap: self.attn_logit_softcapping,
            kv_group: self.kv_cache_group_of(layer),
        }
    }

    /// Bytes of one KV cache block of `block_size` tokens over all layers, K and V, on a device
    /// that computes in `dtype` (the cache's element is `kv_cache_dtype`'s).
    pub fn kv_bytes_per_block(&self, block_size: usize, dtype: DType) -> usize {
        self.num_hidden_layers * 2 * block_size * self.kv_size() * self.kv_cache_dtype.size_in_bytes(dtype)
    }

    /// Whether layer `layer`'s MLP routes through experts (HF's rule, [`MoeConfig::layer_is_sparse`]).
    pub fn layer_is_sparse(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.layer_is_sparse(layer))
    }

    /// Layers whose MLP routes through experts.
    pub fn num_sparse_layers(&self) -> usize {
        (0..self.num_hidden_layers).filter(|&i| self.layer_is_sparse(i)).count()
    }

    /// Elements of one layer's attention projections: q, k, v and o.
    pub fn attention_matrix_elements(&self) -> usize {
        let h = self.hidden_size;
        h * (self.q_size() + 2 * self.kv_size()) + self.q_size() * h
    }

    /// Elements of layer `layer`'s matrices: its attention, and its dense MLP (gate, up, down)
    /// or its router, every routed expert and the shared expert.
    pub fn layer_matrix_elements(&self, layer: usize) -> usize {
        let h = self.hidden_size;
        let mlp = match &self.moe {
            Some(m) if m.layer_is_sparse(layer) => {
                m.router_and_shared_elements(h) + m.num_experts * m.expert_matrix_elements(h)
            }
            _ => 3 * h * self.intermediate_size,
        };
        self.attention_matrix_elements() + mlp
    }

    /// Elements of layer `layer`'s matrices that one token multiplies with: as
    /// [`Self::layer_matrix_elements`], with only its `num_experts_per_tok` routed experts.
    pub fn layer_active_matrix_elements(&self, layer: usize) -> usize {
        match &self.moe {
            Some(m) if m.layer_is_sparse(layer) => {
                let h = self.hidden_size;
                let unread = m.num_experts - m.num_experts_per_tok;
                self.layer_matrix_elements(layer) - unread * m.expert_matrix_elements(h)
            }
            _ => self.layer_matrix_elements(layer),
        }
    }

    /// Elements of every weight matrix: the layers' (all experts) and the embedding table and
    /// LM head (once when tied).
    pub fn matrix_elements(&self) -> usize {
        let embeddings = if self.tie_word_embeddings { 1 } else { 2 } * self.vocab_size * self.hidden_size;
        (0..self.num_hidden_layers).map(|i| self.layer_matrix_elements(i)).sum::<usize>() + embeddings
    }

    /// Elements of the matrices a step of one token reads: each layer's active matrices
    /// ([`Self::layer_active_matrix_elements`]), the LM head's rows of the output vocabulary,
    /// and the token's one row of an untied embedding table.
    pub fn active_matrix_elements(&self) -> usize {
        let h = self.hidden_size;
        let embedding_row = if self.tie_word_embeddings { 0 } else { h };
        let layers: usize = (0..self.num_hidden_layers).map(|i| self.layer_active_matrix_elements(i)).sum();
        layers + self.output_vocab_size * h + embedding_row
    }

    /// Parameters in the checkpoint (tied embeddings counted once; biases and q/k norms left
    /// out).
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let norms = if self.sandwich_norms { 4 * h } else { 2 * h };
        self.matrix_elements() + self.num_hidden_layers * norms + h
    }
}

/// `[num_hidden_layers]`: which layers slide, for the families that mix sliding-window and
/// global layers (Gemma 2 and 3): `layer_types` where the config has it, else HF's pattern of
/// the family (Gemma 2: every even layer; Gemma 3: all but every `sliding_window_pattern`-th).
/// `None` for the other families: all their layers slide, or none.
fn sliding_layer_types(raw: &RawConfig, architecture: Architecture) -> Result<Option<Vec<bool>>, ModelError> {
    let n = raw.num_hidden_layers;
    if !matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3) {
        return Ok(None);
    }
    if let Some(types) = &raw.layer_types {
        if types.len() != n {
            return Err(ModelError::Config(format!(
                "`layer_types` has {} entries for {n} layers (num_hidden_layers)",
                types.len()
            )));
        }
        let slides = |t: &String| match t.as_str() {
            "sliding_attention" => Ok(true),
            "full_attention" => Ok(false),
            other => Err(ModelError::Config(format!(
                "unsupported layer type `{other}` in `layer_types` (sliding_attention or full_attention)"
            ))),
        };
        return types.iter().map(slides).collect::<Result<Vec<_>, _>>().map(Some);
    }
    let pattern = match architecture {
        Architecture::Gemma2 => 2,
        _ => raw.sliding_window_pattern.or(raw.sliding_window_pattern_private).unwrap_or(6),
    };
    if pattern == 0 {
        return Err(ModelError::Config("`sliding_window_pattern` must be positive".into()));
    }
    Ok(Some((0..n).map(|i| (i + 1) % pattern != 0).collect()))
}

/// The positive number under `key`: `default` where the config leaves the key out (HF's default
/// for the class), none where it is `null`.
fn positive_or_default(value: &Value, key: &str, default: Option<f64>) -> Result<Option<f32>, ModelError> {
    let number = match value.get(key) {
        None => default,
        Some(Value::Null) => None,
        Some(v) => Some(v.as_f64().ok_or_else(|| ModelError::Config(format!("`{key}` must be a number, not {v}")))?),
    };
    match number {
        Some(x) if !x.is_finite() || x <= 0.0 => Err(ModelError::Config(format!("`{key}` must be positive, not {x}"))),
        _ => Ok(number.map(|x| x as f32)),
    }
}

/// What ferrolm reads from `generation_config.json`, read once: the end-of-sequence ids and
/// the sampling defaults a request's own values override.
#[derive(Clone, Debug, Default)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    pub defaults: GenerationDefaults,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; a missing file gives no ids and no defaults.
    pub fn from_dir(dir: &Path) -> Result<GenerationConfig, ModelError> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(GenerationConfig::default());
        }
        let value = read_json(&path)?;
        let defaults = GenerationDefaults::deserialize(&value)
            .map_err(|e| ModelError::InvalidJson { path: path.clone(), message: e.to_string() })?;
        Ok(GenerationConfig { eos_token_ids: token_ids(&value.get("eos_token_id").cloned()), defaults })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        })
    }

    #[test]
    fn old_and_new_rope_keys_agree() -> Result<(), ModelError> {
        let mut old = base();
        old["rope_theta"] = json!(500000.0);
        old["torch_dtype"] = json!("float16");
        let mut new = base();
        new["rope_parameters"] = json!({"rope_theta": 500000.0, "rope_type": "default"});
        new["dtype"] = json!("float16");
        let (a, b) = (ModelConfig::from_value(old)?, ModelConfig::from_value(new)?);
        assert_eq!(a.rope_theta, 500000.0);
        assert_eq!(b.rope_theta, 500000.0);
        assert_eq!(a.dtype, DType::F16);
        assert_eq!(b.dtype, DType::F16);
        assert_eq!(a.num_key_value_heads, 4);
        assert_eq!(a.head_dim, 16);
        Ok(())
    }

    #[test]
    fn unknown_architecture_names_it_and_lists_supported() {
        let mut v = base();
        v["architectures"] = json!(["FalconForCausalLM"]);
        let err = ModelConfig::from_value(v).unwrap_err().to_string();
        assert!(err.contains("FalconForCausalLM"), "{err}");
        assert!(err.contains("Qwen3ForCausalLM") && err.contains("GemmaForCausalLM"), "{err}");
    }

    #[test]
    fn output_vocab_is_lowered_to_a_tokenizer_never_raised() -> Result<(), ModelError> {
        let mut c = ModelConfig::from_value(base())?;
        assert_eq!((c.vocab_size, c.output_vocab_size), (320, 320), "logits cover every row as read");
        c.limit_output_vocab(300);
        assert_eq!((c.vocab_size, c.output_vocab_size), (320, 300), "the embedding keeps its rows");
        c.limit_output_vocab(400);
        assert_eq!(c.output_vocab_size, 300, "a larger tokenizer raises nothing");
        c.limit_output_vocab(0);
        assert_eq!(c.output_vocab_size, 1);
        Ok(())
    }

    #[test]
    fn gqa_must_divide() {
        let mut v = base();
        v["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_value(v).is_err());
    }

    #[test]
    fn eos_single_or_list() {
        assert_eq!(token_ids(&Some(json!(7))), vec![7]);
        assert_eq!(token_ids(&Some(json!([7, 9]))), vec![7, 9]);
        assert!(token_ids(&None).is_empty());
    }

    #[test]
    fn architecture_flags() -> Result<(), ModelError> {
        let mut v = base();
        v["architectures"] = json!(["GemmaForCausalLM"]);
        v["hidden_act"] = json!("gelu");
        let c = ModelConfig::from_value(v)?;
        assert_eq!(c.activation, GatedActivation::GeluTanh);
        assert!(c.norm_unit_offset && c.tie_word_embeddings);
        assert_eq!(c.embedding_multiplier, 8.0);

        let mut v = base();
        v["architectures"] = json!(["Qwen2ForCausalLM"]);
        v["sliding_window"] = json!(4096);
        v["use_sliding_window"] = json!(false);
        let c = ModelConfig::from_value(v)?;
        assert!(c.qkv_bias && c.sliding_window.is_none());

        let mut v = base();
        v["architectures"] = json!(["MistralForCausalLM"]);
        v["sliding_window"] = json!(24);
        assert_eq!(ModelConfig::from_value(v)?.sliding_window, Some(24));
        Ok(())
    }

    /// `base()` as a Gemma 2 or 3 of `layers` layers with a window of 8.
    fn gemma(arch: &str, layers: usize) -> Value {
        let mut v = base();
        v["architectures"] = json!([arch]);
        v["num_hidden_layers"] = json!(layers);
        v["sliding_window"] = json!(8);
        v
    }

    fn windows(c: &ModelConfig) -> Vec<Option<usize>> {
        (0..c.num_hidden_layers).map(|i| c.layer_window(i)).collect()
    }

    #[test]
    fn gemma2_layers_alternate_unless_layer_types_say_otherwise() -> Result<(), ModelError> {
        // HF's default: layer i slides when i is even.
        let c = ModelConfig::from_value(gemma("Gemma2ForCausalLM", 5))?;
        assert_eq!(windows(&c), [Some(8), None, Some(8), None, Some(8)]);
        assert!(c.sandwich_norms && c.norm_unit_offset && !c.qk_norm && c.sliding_rope.is_none());

        let mut v = gemma("Gemma2ForCausalLM", 3);
        v["layer_types"] = json!(["full_attention", "sliding_attention", "sliding_attention"]);
        assert_eq!(windows(&ModelConfig::from_value(v.clone())?), [None, Some(8), Some(8)]);

        v["layer_types"] = json!(["full_attention", "sliding_attention"]);
        let err = ModelConfig::from_value(v.clone()).unwrap_err().to_string();
        assert!(err.contains("`layer_types` has 2 entries for 3 layers"), "{err}");
        v["layer_types"] = json!(["full_attention", "chunked_attention", "full_attention"]);
        let err = ModelConfig::from_value(v).unwrap_err().to_string();
        assert!(err.contains("chunked_attention"), "{err}");

        // No window in the config: HF's 4096.
        let mut v = gemma("Gemma2ForCausalLM", 2);
        v.as_object_mut().map(|o| o.remove("sliding_window"));
        assert_eq!(windows(&ModelConfig::from_value(v)?), [Some(4096), None]);
        Ok(())
    }

    #[test]
    fn gemma3_layers_follow_the_pattern_or_layer_types() -> Result<(), ModelError> {
        // HF: layer i slides unless (i + 1) % pattern == 0; the pattern defaults to 6.
        let c = ModelConfig::from_value(gemma("Gemma3ForCausalLM", 7))?;
        let local = Some(8);
        assert_eq!(windows(&c), [local, local, local, local, local, None, local]);
        assert!(c.qk_norm && c.sandwich_norms && c.norm_unit_offset);

        let mut v = gemma("Gemma3ForCausalLM", 6);
        v["sliding_window_pattern"] = json!(3);
        assert_eq!(windows(&ModelConfig::from_value(v)?), [local, local, None, local, local, None]);
        let mut v = gemma("Gemma3ForCausalLM", 4);
        v["_sliding_window_pattern"] = json!(2);
        assert_eq!(windows(&ModelConfig::from_value(v.clone())?), [local, None, local, None]);
        // `layer_types` wins over the pattern.
        v["layer_types"] = json!(["full_attention", "full_attention", "sliding_attention", "full_attention"]);
        assert_eq!(windows(&ModelConfig::from_value(v)?), [None, None, local, None]);

        let mut v = gemma("Gemma3ForCausalLM", 4);
        v["sliding_window_pattern"] = json!(0);
        assert!(ModelConfig::from_value(v).is_err());
        Ok(())
    }

    /// Gemma 3 4B's text config in the old style (`rope_theta`, `rope_scaling`,
    /// `rope_local_base_freq`) and the new (`rope_parameters` per layer type) give the same
    /// RoPEs: linear scaling by 8 on the global layers only, base 10000 unscaled on the local.
    #[test]
    fn gemma3_ropes_in_both_styles() -> Result<(), ModelError> {
        let mut old = gemma("Gemma3ForCausalLM", 6);
        old["rope_theta"] = json!(1_000_000.0);
        old["rope_local_base_freq"] = json!(10000.0);
        old["rope_scaling"] = json!({"rope_type": "linear", "factor": 8.0});
        let mut new = gemma("Gemma3ForCausalLM", 6);
        new["rope_parameters"] = json!({
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        });
        for v in [old, new] {
            let c = ModelConfig::from_value(v)?;
            assert_eq!((c.rope_theta, &c.rope_scaling), (1_000_000.0, &RopeScaling::Linear { factor: 8.0 }));
            assert_eq!(c.sliding_rope, Some(RopeParams { theta: 10000.0, scaling: RopeScaling::None }));
            let sliding: Vec<bool> = (0..6).map(|i| c.layer_takes_sliding_rope(i)).collect();
            assert_eq!(sliding, [true, true, true, true, true, false]);
            // The global layers' frequencies are scaled, the local layers' are not.
            let global = c.rope_scaling.tables(c.rope_theta, c.rotary_dim())?;
            let local = c.sliding_rope.as_ref().map(|r| r.scaling.tables(r.theta, c.rotary_dim())).transpose()?;
            assert_eq!(global.inv_freq[0], 1.0 / 8.0);
            assert_eq!(local.map(|t| t.inv_freq[0]), Some(1.0));
        }

        // Gemma 3 1B: no scaling, HF's defaults for the bases.
        let c = ModelConfig::from_value(gemma("Gemma3ForCausalLM", 2))?;
        assert_eq!((c.rope_theta, &c.rope_scaling), (1_000_000.0, &RopeScaling::None));
        assert_eq!(c.sliding_rope, Some(RopeParams { theta: 10000.0, scaling: RopeScaling::None }));
        // Gemma 2 rotates every layer alike.
        let c = ModelConfig::from_value(gemma("Gemma2ForCausalLM", 2))?;
        assert!(c.sliding_rope.is_none() && !c.layer_takes_sliding_rope(0));
        Ok(())
    }

    #[test]
    fn gemma_softcaps_and_attention_scale() -> Result<(), ModelError> {
        let mut v = gemma("Gemma2ForCausalLM", 2);
        v["query_pre_attn_scalar"] = json!(144);
        v["attn_logit_softcapping"] = json!(50.0);
        v["final_logit_softcapping"] = json!(30.0);
        let c = ModelConfig::from_value(v)?;
        assert_eq!((c.attn_logit_softcapping, c.final_logit_softcapping), (Some(50.0), Some(30.0)));
        let a = c.layer_attention(0);
        assert_eq!((a.scale, a.softcap, a.sliding_window), (1.0 / 12.0, Some(50.0), Some(8)));
        assert_eq!(c.layer_attention(1).sliding_window, None);

        // Left out: HF's Gemma 2 defaults. `null`: off.
        let c = ModelConfig::from_value(gemma("Gemma2ForCausalLM", 2))?;
        assert_eq!((c.attn_logit_softcapping, c.final_logit_softcapping), (Some(50.0), Some(30.0)));
        assert_eq!(c.layer_attention(0).scale, 1.0 / 16.0);
        let mut v = gemma("Gemma2ForCausalLM", 2);
        v["attn_logit_softcapping"] = Value::Null;
        v["final_logit_softcapping"] = Value::Null;
        let c = ModelConfig::from_value(v)?;
        assert_eq!((c.attn_logit_softcapping, c.final_logit_softcapping), (None, None));

        // Gemma 3 has none by default, and takes them if set.
        let c = ModelConfig::from_value(gemma("Gemma3ForCausalLM", 2))?;
        assert_eq!((c.layer_attention(0).softcap, c.final_logit_softcapping), (None, None));
        let mut v = gemma("Gemma3ForCausalLM", 2);
        v["attn_logit_softcapping"] = json!(20.0);
        v["final_logit_softcapping"] = json!(15.0);
        let c = ModelConfig::from_value(v)?;
        assert_eq!((c.layer_attention(1).softcap, c.final_logit_softcapping), (Some(20.0), Some(15.0)));

        // Gemma 1 and the others: 1 / sqrt(head_dim), no caps whatever the keys say.
        let mut v = base();
        v["architectures"] = json!(["GemmaForCausalLM"]);
        v["attn_logit_softcapping"] = json!(50.0);
        let c = ModelConfig::from_value(v)?;
        assert_eq!((c.layer_attention(0).scale, c.layer_attention(0).softcap), (0.25, None));

        for bad in [json!(0.0), json!(-30.0), json!("30")] {
            let mut v = gemma("Gemma2ForCausalLM", 2);
            v["final_logit_softcapping"] = bad.clone();
            let err = ModelConfig::from_value(v).unwrap_err().to_string();
            assert!(err.contains("final_logit_softcapping"), "{bad}: {err}");
        }
        Ok(())
    }

    #[test]
    fn the_fixture_configs_of_gemma_2_and_3_read_as_hf_reads_them() -> Result<(), ModelError> {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures");
        let c = ModelConfig::from_dir(&fixtures.join("gemma2_softcap"))?;
        assert_eq!(c.architecture, Architecture::Gemma2);
        assert_eq!(windows(&c), [Some(12), None, Some(12), None]);
        assert_eq!((c.layer_attention(0).scale, c.layer_attention(0).softcap), (0.25, Some(50.0)));
        assert_eq!(c.final_logit_softcapping, Some(30.0));

        let c = ModelConfig::from_dir(&fixtures.join("gemma3_text"))?;
        assert_eq!(c.architecture, Architecture::Gemma3);
        assert_eq!(windows(&c), [Some(10), Some(10), None, Some(10), None]);
        assert_eq!((c.rope_theta, &c.rope_scaling), (1_000_000.0, &RopeScaling::None));
        assert_eq!(c.sliding_rope, Some(RopeParams { theta: 10000.0, scaling: RopeScaling::None }));
        assert_eq!((c.layer_attention(2).softcap, c.final_logit_softcapping), (None, None));
        Ok(())
    }

    #[test]
    fn moe_families_take_their_dense_relatives_flags() -> Result<(), ModelError> {
        let moe = |arch: &str, extra: Value| {
            let mut v = base();
            v["architectures"] = json!([arch]);
            v.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
            ModelConfig::from_value(v)
        };
        let qwen2 = moe("Qwen2MoeForCausalLM", json!({"num_experts": 4, "mlp_only_layers": [1], "sliding_window": 0}))?;
        assert!(qwen2.qkv_bias && !qwen2.qk_norm && qwen2.sliding_window.is_none());
        assert_eq!((qwen2.layer_is_sparse(0), qwen2.layer_is_sparse(1), qwen2.num_sparse_layers()), (true, false, 1));
        assert!(!moe("Qwen2MoeForCausalLM", json!({"qkv_bias": false}))?.qkv_bias);
        let qwen3 = moe("Qwen3MoeForCausalLM", json!({"num_local_experts": 12, "num_experts_per_tok": 3}))?;
        assert!(qwen3.qk_norm && !qwen3.qkv_bias);
        assert_eq!(qwen3.moe.as_ref().map(|m| (m.num_experts, m.num_experts_per_tok)), Some((12, 3)));
        let mixtral = moe("MixtralForCausalLM", json!({"num_local_experts": 4, "sliding_window": 32}))?;
        assert_eq!(mixtral.sliding_window, Some(32));
        assert_eq!(mixtral.moe.as_ref().map(|m| m.moe_intermediate_size), Some(128));
        assert!(ModelConfig::from_value(base())?.moe.is_none());
        let err = moe("MixtralForCausalLM", json!({"num_local_experts": 2, "num_experts_per_tok": 3})).unwrap_err();
        assert!(err.to_string().contains("num_experts_per_tok"), "{err}");
        Ok(())
    }

    /// The published sizes of two MoE models: all their parameters, and what one token reads.
    #[test]
    fn moe_models_count_every_expert_and_read_top_k() -> Result<(), ModelError> {
        let bench = |name: &str| {
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench-configs").join(name);
            ModelConfig::from_file(&path)
        };
        let qwen = bench("qwen3-30b-a3b.json")?;
        // Per layer: attention 2048 x (4096 + 2 x 512) + 4096 x 2048 = 18,874,368; router
        // 128 x 2048; 128 experts of 3 x 2048 x 768 = 4,718,592.
        assert_eq!(qwen.layer_matrix_elements(0), 18_874_368 + 262_144 + 128 * 4_718_592);
        assert_eq!(qwen.layer_active_matrix_elements(0), 18_874_368 + 262_144 + 8 * 4_718_592);
        // 48 layers, untied 151,936 x 2048 embedding and head: 30.5B.
        assert_eq!(qwen.matrix_elements(), 48 * 623_116_288 + 2 * 311_164_928);
        assert_eq!(qwen.num_parameters(), 30_531_911_680 + 48 * 2 * 2048 + 2048);
        // One token: the active layers, the head and one embedding row.
        assert_eq!(qwen.active_matrix_elements(), 48 * 56_885_248 + 311_164_928 + 2048);

        let mixtral = bench("mixtral-8x7b.json")?;
        // Attention 4096 x (4096 + 2 x 1024) + 4096 x 4096 = 41,943,040; router 8 x 4096;
        // experts of 3 x 4096 x 14,336 = 176,160,768.
        assert_eq!(mixtral.layer_matrix_elements(31), 41_943_040 + 32_768 + 8 * 176_160_768);
        assert_eq!(mixtral.matrix_elements(), 32 * 1_451_261_952 + 2 * 32_000 * 4096);
        assert_eq!(mixtral.num_parameters(), 46_702_526_464 + 32 * 2 * 4096 + 4096);
        assert_eq!(mixtral.active_matrix_elements(), 32 * 394_297_344 + 32_000 * 4096 + 4096);

        // A dense model's token reads every matrix but the embedding table's other rows.
        let dense = ModelConfig::from_value(base())?;
        assert_eq!(dense.layer_active_matrix_elements(1), dense.layer_matrix_elements(1));
        assert_eq!(dense.matrix_elements() - dense.active_matrix_elements(), 319 * 64);
        Ok(())
    }
}
