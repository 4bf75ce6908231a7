//! `ModelConfig`: what the decoder needs to know about a model, read from a Hugging Face
//! `config.json` in either key style (old: `rope_theta` / `rope_scaling` / `torch_dtype`; new:
//! `rope_parameters` / `dtype`), plus the `generation_config.json` defaults.
//!
//! Everything architecture-specific is resolved here into plain flags, so that the decoder is one
//! code path switched by data.

use std::path::Path;

use ferrolm_backend::{DType, GatedActivation, Heads, LayerAttention};
use ferrolm_sampling::GenerationDefaults;
use serde::Deserialize;
use serde_json::Value;

use crate::rope::RopeScaling;
use crate::ModelError;

/// The decoder families ferrolm runs, by their HF `architectures` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Phi3,
    Gemma,
}

impl Architecture {
    pub const SUPPORTED: [(&'static str, Architecture); 6] = [
        ("LlamaForCausalLM", Architecture::Llama),
        ("MistralForCausalLM", Architecture::Mistral),
        ("Qwen2ForCausalLM", Architecture::Qwen2),
        ("Qwen3ForCausalLM", Architecture::Qwen3),
        ("Phi3ForCausalLM", Architecture::Phi3),
        ("GemmaForCausalLM", Architecture::Gemma),
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
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub activation: GatedActivation,
    /// Biases on q/k/v projections (Qwen2, or Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Biases on gate/up/down (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm of each q and k head before RoPE (Qwen3).
    pub qk_norm: bool,
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
    pub rope_theta: f32,
    /// Fraction of each head that rotates (Phi-3's `partial_rotary_factor`).
    pub partial_rotary_factor: f32,
    pub rope_scaling: RopeScaling,
    /// Weights stored with `qkv_proj` and `gate_up_proj` fused (Phi-3).
    pub fused_projections: bool,
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
    mlp_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    rope_theta: Option<f64>,
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
        let raw: RawConfig = serde_json::from_value(value).map_err(|e| ModelError::Config(e.to_string()))?;
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

        let is_gemma = architecture == Architecture::Gemma;
        // Gemma's MLP is GELU-tanh whatever `hidden_act` says (HF overrides the exact "gelu").
        let act_name = raw.hidden_activation.clone().or(raw.hidden_act.clone()).unwrap_or_else(|| "silu".into());
        let activation = match (is_gemma, act_name.as_str()) {
            (true, _) => GatedActivation::GeluTanh,
            (false, "silu" | "swish") => GatedActivation::Silu,
            (false, "gelu_pytorch_tanh" | "gelu_new" | "gelu_tanh") => GatedActivation::GeluTanh,
            (false, other) => return Err(ModelError::Config(format!("unsupported hidden_act `{other}`"))),
        };

        let sliding_window = match architecture {
            Architecture::Mistral | Architecture::Phi3 => raw.sliding_window,
            Architecture::Qwen2 | Architecture::Qwen3 if raw.use_sliding_window == Some(true) => raw.sliding_window,
            _ => None,
        };

        // Rope parameters: new style `rope_parameters` (holds `rope_theta` too) or old style.
        let rope_params = raw.rope_parameters.clone().or(raw.rope_scaling.clone()).filter(|v| v.is_object());
        let rope_theta = rope_params
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .or(raw.rope_theta)
            .unwrap_or(10000.0) as f32;
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

        let dtype_name = raw.dtype.clone().or(raw.torch_dtype.clone()).unwrap_or_else(|| "bfloat16".into());
        let dtype =
            parse_dtype(&dtype_name).ok_or_else(|| ModelError::Config(format!("unsupported dtype `{dtype_name}`")))?;

        let attention_bias = raw.attention_bias.unwrap_or(false);
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
            qkv_bias: architecture == Architecture::Qwen2 || attention_bias,
            o_bias: matches!(architecture, Architecture::Llama) && attention_bias,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            qk_norm: architecture == Architecture::Qwen3,
            norm_unit_offset: is_gemma,
            embedding_multiplier: if is_gemma { (hidden_size as f32).sqrt() } else { 1.0 },
            sliding_window,
            sliding_layers: vec![sliding_window.is_some(); raw.num_hidden_layers],
            rope_theta,
            partial_rotary_factor,
            rope_scaling,
            fused_projections: architecture == Architecture::Phi3,
            dtype,
            bos_token_id: token_ids(&raw.bos_token_id).first().copied(),
            eos_token_ids: token_ids(&raw.eos_token_id),
        })
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

    /// What attention layer `layer` computes over the shared batch metadata: its window
    /// ([`Self::layer_window`]), softmax scale and KV cache group ([`Self::kv_cache_groups`]).
    pub fn layer_attention(&self, layer: usize) -> LayerAttention {
        LayerAttention {
            heads: self.heads(),
            sliding_window: self.layer_window(layer),
            scale: 1.0 / (self.head_dim as f32).sqrt(),
            kv_group: self.kv_cache_group_of(layer),
        }
    }

    /// Bytes of one KV cache block of `block_size` tokens over all layers, K and V, in `dtype`.
    pub fn kv_bytes_per_block(&self, block_size: usize, dtype: DType) -> usize {
        self.num_hidden_layers * 2 * block_size * self.kv_size() * dtype.size_in_bytes()
    }

    /// Elements of one layer's projection matrices: q, k, v, o, gate, up and down.
    pub fn layer_matrix_elements(&self) -> usize {
        let h = self.hidden_size;
        h * (self.q_size() + 2 * self.kv_size()) + self.q_size() * h + 3 * h * self.intermediate_size
    }

    /// Parameters in the checkpoint (tied embeddings counted once).
    pub fn num_parameters(&self) -> usize {
        let (h, v) = (self.hidden_size, self.vocab_size);
        let per_layer = self.layer_matrix_elements() + 2 * h;
        let embeddings = if self.tie_word_embeddings { v * h } else { 2 * v * h };
        self.num_hidden_layers * per_layer + embeddings + h
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
}
