//! Turns a model directory and the engine flags into a running engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use ferrolm_engine::{EngineConfig, EngineHandle, SchedulerConfig};
use ferrolm_model::{GenerationConfig, KvCache, Model, ModelConfig};
use ferrolm_sampling::GenerationDefaults;
use ferrolm_tokenizer::Tokenizer;
use serde::Serialize;

/// Flags shared by every command that runs the engine.
#[derive(Args, Clone, Debug, Serialize)]
pub struct EngineArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, env = "FERROLM_MODEL")]
    pub model: Option<PathBuf>,
    /// Longest sequence (prompt + output) in tokens; defaults to the model's context length.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Most requests running at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one engine step (prefill chunks and decodes together).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// KV cache blocks (of 16 tokens); overrides the size derived from --kv-cache-memory-gb.
    #[arg(long)]
    pub num_kv_blocks: Option<usize>,
    /// Memory given to the KV cache on the CPU backend, in GiB.
    #[arg(long, default_value_t = 2.0)]
    pub kv_cache_memory_gb: f64,
    /// Requests accepted but not finished beyond which new ones are refused (backpressure).
    #[arg(long, default_value_t = 1024)]
    pub max_pending_requests: usize,
}

pub const BLOCK_SIZE: usize = 16;

/// Everything loaded from a model directory.
pub struct LoadedModel {
    /// The model directory actually loaded (`--model`, or the bundled demo model).
    pub dir: PathBuf,
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub defaults: GenerationDefaults,
}

/// The small model that ships with ferrolm, used when no `--model` is given.
pub const DEMO_MODEL: &str = "models/ferrolm-demo-py";

/// `--model`, else the shipped demo model: in the current directory, else in the source tree
/// this binary was built from.
fn model_dir(args: &EngineArgs) -> Result<PathBuf> {
    if let Some(dir) = &args.model {
        return Ok(dir.clone());
    }
    let candidates = [PathBuf::from(DEMO_MODEL), Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(DEMO_MODEL)];
    candidates.into_iter().find(|d| d.join("config.json").is_file()).with_context(|| {
        format!("no --model given and the bundled model ({DEMO_MODEL}) was not found: pass --model DIR")
    })
}

/// The sampling defaults of `generation_config.json` (empty when absent).
fn generation_defaults(dir: &Path) -> Result<GenerationDefaults> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(GenerationDefaults::default());
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not a valid generation config", path.display()))
}

pub fn load(args: &EngineArgs) -> Result<LoadedModel> {
    let dir = model_dir(args)?;
    let config = ModelConfig::from_dir(&dir)?;
    let generation = GenerationConfig::from_dir(&dir)?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir)?);
    let model = Model::from_dir(&dir)?;

    let eos_token_ids = eos_token_ids(&config, &generation, Some(&tokenizer));
    tracing::info!(model = %dir.display(), architecture = config.architecture.hf_name(), "model loaded");
    let engine = start_engine(model, Some(Arc::clone(&tokenizer)), eos_token_ids, args)?;
    Ok(LoadedModel { dir: dir.clone(), engine, tokenizer, defaults: generation_defaults(&dir)? })
}

/// EOS ids of a model: `generation_config.json`, else `config.json`, else the tokenizer's.
pub fn eos_token_ids(config: &ModelConfig, generation: &GenerationConfig, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
    let mut ids = generation.eos_token_ids.clone();
    if ids.is_empty() {
        ids = config.eos_token_ids.clone();
    }
    if ids.is_empty() {
        ids.extend(tokenizer.and_then(Tokenizer::eos_token_id));
    }
    ids
}

/// Sizes the KV cache and the scheduler from `args` and starts the engine on `model`.
pub fn start_engine(
    model: Model,
    tokenizer: Option<Arc<Tokenizer>>,
    eos_token_ids: Vec<u32>,
    args: &EngineArgs,
) -> Result<EngineHandle> {
    let config = &model.config;
    let max_model_len = match args.max_model_len {
        Some(n) if n > config.max_position_embeddings => anyhow::bail!(
            "--max-model-len {n} exceeds the model's context length of {}",
            config.max_position_embeddings
        ),
        Some(n) => n,
        None => config.max_position_embeddings,
    };
    let bytes_per_block = KvCache::bytes_per_block(config.num_hidden_layers, BLOCK_SIZE, config.kv_size());
    let num_blocks = match args.num_kv_blocks {
        Some(n) => n,
        None => {
            let budget = (args.kv_cache_memory_gb * (1u64 << 30) as f64) as usize / bytes_per_block;
            // At least one full-length sequence, at most what the longest batch could use.
            let most = (args.max_num_seqs * max_model_len).div_ceil(BLOCK_SIZE);
            budget.max(max_model_len.div_ceil(BLOCK_SIZE)).min(most)
        }
    };
    let scheduler = SchedulerConfig {
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        block_size: BLOCK_SIZE,
        num_blocks,
        max_model_len,
        long_prefill_token_threshold: None,
        enable_prefix_caching: true,
    };
    tracing::info!(num_blocks, kv_tokens = num_blocks * BLOCK_SIZE, max_model_len, "engine configured");
    let engine = EngineHandle::start(
        model,
        tokenizer,
        EngineConfig { scheduler, max_pending_requests: args.max_pending_requests, eos_token_ids },
    )?;
    Ok(engine)
}
