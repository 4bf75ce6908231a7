//! The model a benchmark runs: a Hugging Face directory through the usual loader, or any shape
//! from a `config.json` with random weights built in memory (`--model-config FILE
//! --dummy-weights`), so that an 8B-class benchmark needs no download.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrolm_backend::{DType, KvCacheDtype};
use ferrolm_engine::EngineHandle;
use ferrolm_model::config::quant::WeightScaling;
use ferrolm_model::config::Quantization;
use ferrolm_model::{GenerationConfig, ModelConfig, WeightSource};
use ferrolm_tokenizer::Tokenizer;
use serde::Serialize;
use serde_json::{json, Value};

use super::limit::StepWeights;
use super::workload::PromptSampler;
use crate::loader::{self, EngineArgs};

#[derive(Args, Clone, Debug, Serialize)]
pub struct ModelArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// A Hugging Face `config.json` giving the model's shape; needs --dummy-weights.
    #[arg(long)]
    pub model_config: Option<PathBuf>,
    /// Random weights instead of the checkpoint's (of --model-config, else of --model's config).
    #[arg(long)]
    pub dummy_weights: bool,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub weight_seed: u64,
}

/// What the reports need to know about the model an engine runs.
pub struct BenchModel {
    pub config: ModelConfig,
    /// Dtype the weights are kept in on the device.
    pub dtype: DType,
    /// Bytes of all weight matrices on the device (embedding and LM head included).
    pub weight_bytes: usize,
    /// Where the model runs: `cpu`, `cuda:0 (NVIDIA H200)`.
    pub device: String,
    /// Dtype of the activations and the KV cache: f32 on the CPU, the engine's dtype on the GPU.
    pub activation_dtype: DType,
    /// Where the model came from: a directory, or `config.json (random weights)`.
    pub source: String,
    pub load_seconds: f64,
    /// Draws prompts from the vocabulary, avoiding special ids.
    pub prompts: PromptSampler,
    /// The model directory's tokenizer, when it has one.
    pub tokenizer: Option<Arc<Tokenizer>>,
}

impl BenchModel {
    /// What a step reads of the weights: every matrix, except that an untied embedding table
    /// is only gathered from (one row), the LM head (or the tied table) is read but for the
    /// rows padding the vocabulary past the tokenizer (no logits are computed for them), and of
    /// a MoE model's routed experts only those the step's tokens pick.
    pub fn step_weights(&self) -> StepWeights {
        let c = &self.config;
        let size = self.dtype.size_in_bytes();
        let row = c.hidden_size * size;
        let unread_head = (c.vocab_size - c.output_vocab_size) * row;
        let read = if c.tie_word_embeddings {
            self.weight_bytes - unread_head
        } else {
            self.weight_bytes - c.vocab_size * row + row - unread_head
        };
        // The layers' matrices may be kept otherwise than the embeddings (FP8 projections are
        // computed from f32 on the CPU): their bytes per element are what the device holds.
        let embeddings = if c.tie_word_embeddings { 1 } else { 2 } * c.vocab_size * row;
        let layer_elements: usize = (0..c.num_hidden_layers).map(|l| c.layer_matrix_elements(l)).sum();
        let layer_size = self.weight_bytes.saturating_sub(embeddings) as f64 / layer_elements.max(1) as f64;
        let (sparse_layers, expert_bytes, experts) = match &c.moe {
            Some(m) => {
                (c.num_sparse_layers(), m.expert_matrix_elements(c.hidden_size) as f64 * layer_size, m.num_experts)
            }
            None => (0, 0.0, 0),
        };
        StepWeights {
            fixed_bytes: read as f64 - (sparse_layers * experts) as f64 * expert_bytes,
            expert_bytes,
            sparse_layers,
            moe: c.moe.clone(),
        }
    }

    /// Weight bytes a decode step of one token reads (see [`Self::step_weights`]): a MoE
    /// model's `top_k` experts in each sparse layer.
    pub fn weight_bytes_per_token(&self) -> usize {
        self.step_weights().bytes(1.0) as usize
    }

    /// Bytes of K and V that one decode step reads per token of context (the CPU computes in
    /// f32; an FP8 cache holds a byte per element).
    pub fn kv_bytes_per_context_token(&self) -> usize {
        let element = self.config.kv_cache_dtype.size_in_bytes(self.activation_dtype);
        self.config.num_hidden_layers * 2 * self.config.kv_size() * element
    }

    /// The model's shape, for the JSON report.
    pub fn describe(&self) -> Value {
        let c = &self.config;
        let moe = c.moe.as_ref().map(|m| {
            json!({
                "num_experts": m.num_experts,
                "num_experts_per_tok": m.num_experts_per_tok,
                "moe_intermediate_size": m.moe_intermediate_size,
                "shared_expert_intermediate_size": m.shared_expert_intermediate_size,
                "num_sparse_layers": c.num_sparse_layers(),
                "norm_topk_prob": m.norm_topk_prob,
            })
        });
        json!({
            "source": self.source,
            "architecture": c.architecture.hf_name(),
            "num_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_heads": c.num_attention_heads,
            "num_kv_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "vocab_size": c.vocab_size,
            "tie_word_embeddings": c.tie_word_embeddings,
            "num_parameters": c.num_parameters(),
            "active_matrix_elements_per_token": c.active_matrix_elements(),
            "moe": moe,
            "weight_bytes": self.weight_bytes,
            "dtype": dtype_name(self.dtype),
            "quantization": c.quantization.map(|q| match q {
                Quantization::Checkpoint(scheme) => format!("{} checkpoint", scheme.method),
                Quantization::Fp8AtLoad(WeightScaling::Block { rows, cols }) => {
                    format!("fp8 at load in {rows} x {cols} blocks")
                }
                Quantization::Fp8AtLoad(_) => "fp8 at load".into(),
            }),
            "kv_cache_dtype": match c.kv_cache_dtype {
                KvCacheDtype::Auto => dtype_name(self.activation_dtype),
                KvCacheDtype::Fp8 => "fp8_e4m3",
            },
        })
    }
}

pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
    }
}

/// Loads (or builds) the model and starts an engine on it; dropping the handle frees the model. `max_pending` (requests of one
/// sequence and at most `longest` tokens) raises the engine's backpressure limits so that a whole offline batch can be queued at once; `longest` (prompt +
/// output tokens of the longest request) is the default `--max-model-len`, so that the KV cache
/// is not sized for a 128K context that the benchmark never uses.
pub fn load(args: &ModelArgs, max_pending: usize, longest: usize) -> Result<(EngineHandle, BenchModel)> {
    let started = Instant::now();
    let mut engine_args = args.engine.clone();
    engine_args.max_pending_sequences = engine_args.max_pending_sequences.max(max_pending);
    engine_args.max_pending_tokens = engine_args.max_pending_tokens.max(max_pending.saturating_mul(longest));

    let dir = args.engine.model.clone();
    let (mut config, source) = match (&args.model_config, &dir) {
        (Some(path), _) => {
            if !args.dummy_weights {
                bail!("--model-config builds a model with random weights: add --dummy-weights");
            }
            (ModelConfig::from_file(path)?, format!("{} (random weights)", path.display()))
        }
        (None, Some(dir)) => {
            let suffix = if args.dummy_weights { " (random weights)" } else { "" };
            (ModelConfig::from_dir(dir)?, format!("{}{suffix}", dir.display()))
        }
        (None, None) => bail!("no model: pass --model DIR, or --model-config FILE --dummy-weights"),
    };
    if engine_args.max_model_len.is_none() {
        engine_args.max_model_len = Some(longest.min(config.max_position_embeddings));
    }
    let on_cpu = engine_args.device == loader::Device::Cpu || !cfg!(feature = "cuda");
    if engine_args.dtype.is_some() && !args.dummy_weights && on_cpu {
        bail!("--dtype on the CPU applies to --dummy-weights only (a checkpoint runs in its own dtype)");
    }
    // A tokenizer only where a directory has one: it names the special ids to keep out of prompts.
    let tokenizer = match &dir {
        Some(dir) if args.model_config.is_none() && dir.join("tokenizer.json").exists() => {
            Some(Arc::new(Tokenizer::from_dir(dir)?))
        }
        _ => None,
    };

    // Random weights are drawn in a float dtype: an FP8 checkpoint's config stands for its
    // projections quantized at load, scaled as the checkpoint scales them.
    if let Some(Quantization::Checkpoint(scheme)) = config.quantization.filter(|_| args.dummy_weights) {
        config.quantization = Some(Quantization::Fp8AtLoad(scheme.weights));
    }
    let weights = if args.dummy_weights {
        WeightSource::random(engine_args.dtype().unwrap_or(config.dtype), args.weight_seed)
    } else {
        WeightSource::open_dir(dir.as_deref().context("a checkpoint needs --model DIR")?)?
    };

    let mut special: Vec<u32> = config.bos_token_id.into_iter().chain(config.eos_token_ids.iter().copied()).collect();
    let mut vocab_size = config.vocab_size;
    if let Some(tok) = &tokenizer {
        // Embedding rows past the tokenizer's vocabulary are padding: no real prompt holds them.
        vocab_size = vocab_size.min(tok.vocab_size());
        // Nor are they sampled: the LM head computes no logits for them (as `loader::load`).
        config.limit_output_vocab(tok.vocab_size());
        special.extend((0..vocab_size as u32).filter(|&id| tok.is_special(id)));
    }
    let prompts = PromptSampler::new(vocab_size, special)?;

    let generation = match (&dir, args.model_config.is_none()) {
        (Some(dir), true) => GenerationConfig::from_dir(dir)?,
        _ => GenerationConfig::default(),
    };
    let eos = loader::eos_token_ids(&config, &generation, tokenizer.as_deref());
    let placed = loader::make_runner(config, &weights, &engine_args)?;
    drop(weights);
    // The runner's config: with the flags' quantization and KV cache dtype.
    let mut config = placed.runner.config().clone();
    let (device, weight_bytes, dtype) = (placed.runner.device(), placed.weight_bytes, placed.weight_dtype);
    let activation_dtype =
        if placed.device_kv_bytes.is_some() { engine_args.dtype().unwrap_or(DType::BF16) } else { DType::F32 };
    config.eos_token_ids = eos.clone();
    let engine = loader::start_engine(placed, tokenizer.clone(), eos, &engine_args)?;
    let model = BenchModel {
        config,
        dtype,
        device,
        activation_dtype,
        weight_bytes,
        source,
        load_seconds: started.elapsed().as_secs_f64(),
        prompts,
        tokenizer,
    };
    Ok((engine, model))
}
