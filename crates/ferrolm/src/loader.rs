//! Turns a model directory and the engine flags into a running engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::builder::BoolishValueParser;
use clap::{ArgAction, Args, ValueEnum};
use ferrolm_backend::DType;
use ferrolm_engine::{EngineConfig, EngineHandle, SchedulerConfig, BLOCK_SIZE};
use ferrolm_model::config::parse_dtype;
use ferrolm_model::{CpuRunner, GenerationConfig, KvCache, Model, ModelConfig, ModelRunner};
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
    /// Where the model runs: `auto` takes the first GPU when this build has CUDA and one is
    /// present, else the CPU.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// Model dtype: bfloat16, float16 or float32. On the GPU, weights and activations (default
    /// bfloat16; float32 to compare closely with the CPU). On the CPU, activations are always
    /// f32 and this sets the dtype of --dummy-weights (default: the config's).
    #[arg(long, value_parser = parse_dtype_flag)]
    pub dtype: Option<String>,
    /// Fraction of the GPU memory left free after the weights that the KV cache takes, in
    /// (0, 1]. On the CPU the cache is sized by --kv-cache-memory-gb (or --num-kv-blocks).
    #[arg(long, default_value_t = 0.9)]
    pub kv_cache_fraction: f64,
    /// Launch each engine step while the one before still runs, where it can be scheduled
    /// ahead; `false` (or 0) collects each step before launching the next, to measure what the
    /// overlap gains. The outputs are the same either way.
    #[arg(long, env = "FERROLM_OVERLAP_STEPS", default_value_t = true, action = ArgAction::Set,
          value_parser = BoolishValueParser::new())]
    pub overlap_steps: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Auto,
    Cpu,
    Cuda,
}

fn parse_dtype_flag(name: &str) -> Result<String, String> {
    match parse_dtype(name) {
        Some(_) => Ok(name.to_owned()),
        None => Err(format!("unknown dtype `{name}`: use bfloat16, float16 or float32")),
    }
}

impl EngineArgs {
    /// `--dtype`, parsed (clap has checked it).
    pub fn dtype(&self) -> Option<DType> {
        self.dtype.as_deref().and_then(parse_dtype)
    }
}

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
    let runner = make_runner(model, args)?;
    let engine = start_engine(runner, Some(Arc::clone(&tokenizer)), eos_token_ids, args)?;
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

/// A model placed on the device `args` ask for, with the KV cache size that device allows
/// (`None`: sized from --kv-cache-memory-gb, on the CPU).
pub struct Placed {
    pub runner: Box<dyn ModelRunner>,
    pub device_kv_blocks: Option<usize>,
}

/// Puts `model` on the CPU or the GPU as `args.device` says.
pub fn make_runner(model: Model, args: &EngineArgs) -> Result<Placed> {
    if !(args.kv_cache_fraction > 0.0 && args.kv_cache_fraction <= 1.0) {
        bail!("--kv-cache-fraction must be in (0, 1], got {}", args.kv_cache_fraction);
    }
    match args.device {
        Device::Cpu => Ok(cpu_runner(model)),
        Device::Cuda => cuda_runner(model, args),
        Device::Auto if cfg!(feature = "cuda") => match cuda_runner_if_present(model, args)? {
            Ok(placed) => Ok(placed),
            Err(model) => Ok(cpu_runner(model)),
        },
        Device::Auto => Ok(cpu_runner(model)),
    }
}

fn cpu_runner(model: Model) -> Placed {
    tracing::info!(device = "cpu", "model placed");
    Placed { runner: Box::new(CpuRunner::new(model)), device_kv_blocks: None }
}

#[cfg(not(feature = "cuda"))]
fn cuda_runner(_model: Model, _args: &EngineArgs) -> Result<Placed> {
    bail!("--device cuda: this build of ferrolm has no CUDA backend (build with `--features cuda`); use --device cpu")
}

#[cfg(not(feature = "cuda"))]
fn cuda_runner_if_present(model: Model, _args: &EngineArgs) -> Result<Result<Placed, Model>> {
    Ok(Err(model))
}

/// The first GPU if there is one (`Err(model)` back otherwise, for the CPU).
#[cfg(feature = "cuda")]
fn cuda_runner_if_present(model: Model, args: &EngineArgs) -> Result<Result<Placed, Model>> {
    match ferrolm_backend::cuda::Gpu::new(0) {
        Ok(gpu) => cuda_place(model, gpu, args).map(Ok),
        Err(err) if err.means_no_gpu() => {
            tracing::info!(reason = %err, "no usable GPU; running on the CPU");
            Ok(Err(model))
        }
        // A GPU that is there but fails must not quietly become a CPU server.
        Err(err) => Err(anyhow::Error::new(err).context("the GPU could not be opened (--device cpu runs without it)")),
    }
}

#[cfg(feature = "cuda")]
fn cuda_runner(model: Model, args: &EngineArgs) -> Result<Placed> {
    let gpu = ferrolm_backend::cuda::Gpu::new(0).context("--device cuda")?;
    cuda_place(model, gpu, args)
}

/// Uploads the weights, then gives the KV cache `--kv-cache-fraction` of the memory left free.
#[cfg(feature = "cuda")]
fn cuda_place(model: Model, gpu: ferrolm_backend::cuda::Gpu, args: &EngineArgs) -> Result<Placed> {
    use ferrolm_model::cuda::CudaRunner;

    let dtype = args.dtype().unwrap_or(DType::BF16);
    let runner = CudaRunner::new(&model, gpu, dtype).context("cannot load the model onto the GPU")?;
    drop(model);
    // Before the free memory is read: tuning's operands are freed again.
    runner.tune_gemms(args.max_num_seqs).context("cannot tune the GEMMs")?;
    let (free, total) = runner.gpu().memory_info()?;
    // Activations and cuBLAS workspaces of the largest step stay outside the cache.
    let reserve = activation_reserve(runner.config(), args, dtype);
    let budget = (free.saturating_sub(reserve) as f64 * args.kv_cache_fraction) as usize;
    let per_block = runner.kv_bytes_per_block(BLOCK_SIZE);
    let blocks = budget / per_block.max(1);
    tracing::info!(
        device = %runner.device(),
        dtype = ?dtype,
        weights_gib = runner.weight_bytes() as f64 / (1u64 << 30) as f64,
        free_gib = free as f64 / (1u64 << 30) as f64,
        total_gib = total as f64 / (1u64 << 30) as f64,
        kv_blocks = blocks,
        kv_tokens = blocks * BLOCK_SIZE,
        "model placed on the GPU"
    );
    if blocks == 0 {
        bail!("no GPU memory left for the KV cache after the weights ({free} bytes free)");
    }
    Ok(Placed { runner: Box::new(runner), device_kv_blocks: Some(blocks) })
}

/// Most prompt rows a step computes logits of for prompt logprobs (the scheduler's
/// `max_prompt_logprob_rows`): as many as decode rows, and at least 256.
fn prompt_logprob_rows(args: &EngineArgs) -> usize {
    args.max_num_seqs.max(256)
}

/// Bytes of device memory one step's activations may take: the widest rows (the MLP's
/// `[T, 2 * intermediate]`) times the token budget, and the f32 logits of the most rows a step
/// has (a row per request that samples, and the prompt-logprob rows), with room.
#[cfg(feature = "cuda")]
fn activation_reserve(config: &ModelConfig, args: &EngineArgs, dtype: DType) -> usize {
    let t = args.max_num_batched_tokens;
    let width = config.hidden_size * 4 + config.q_size() * 2 + config.kv_size() * 4 + config.intermediate_size * 3;
    let activations = t * width * dtype.size_in_bytes();
    // The scheduler's bound on a step's logits rows under these flags (the pool and length do
    // not enter it).
    let step = SchedulerConfig {
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: t,
        max_prompt_logprob_rows: prompt_logprob_rows(args),
        ..SchedulerConfig::new(1, 1)
    };
    let logits = step.max_logits_rows() * config.vocab_size * 4 * 2;
    (activations + logits) * 2 + (512 << 20)
}

/// Sizes the KV cache and the scheduler from `args` and starts the engine on `placed`.
pub fn start_engine(
    placed: Placed,
    tokenizer: Option<Arc<Tokenizer>>,
    eos_token_ids: Vec<u32>,
    args: &EngineArgs,
) -> Result<EngineHandle> {
    let Placed { runner, device_kv_blocks } = placed;
    let config = runner.config().clone();
    let config = &config;
    let max_model_len = match args.max_model_len {
        Some(n) if n > config.max_position_embeddings => anyhow::bail!(
            "--max-model-len {n} exceeds the model's context length of {}",
            config.max_position_embeddings
        ),
        Some(n) => n,
        None => config.max_position_embeddings,
    };
    let bytes_per_block = KvCache::bytes_per_block(config.num_hidden_layers, BLOCK_SIZE, config.kv_size());
    let num_blocks = match (args.num_kv_blocks, device_kv_blocks) {
        (Some(n), _) => n,
        (None, Some(device)) => device.min((args.max_num_seqs * max_model_len).div_ceil(BLOCK_SIZE)),
        (None, None) => {
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
        max_prompt_logprob_rows: prompt_logprob_rows(args),
        enable_prefix_caching: true,
    };
    tracing::info!(num_blocks, kv_tokens = num_blocks * BLOCK_SIZE, max_model_len, "engine configured");
    let engine = EngineHandle::start(
        runner,
        tokenizer,
        EngineConfig {
            scheduler,
            max_pending_requests: args.max_pending_requests,
            eos_token_ids,
            overlap_steps: args.overlap_steps,
        },
    )?;
    Ok(engine)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::EngineArgs;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    /// `--overlap-steps` (and `FERROLM_OVERLAP_STEPS`, through the same parser) is on by default
    /// and takes the README's `0` as well as `false`.
    #[test]
    fn overlap_steps_is_on_unless_turned_off() -> Result<(), clap::Error> {
        let overlap = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("ferrolm").chain(args.iter().copied())).map(|c| c.engine.overlap_steps)
        };
        assert!(overlap(&[])?);
        assert!(!overlap(&["--overlap-steps", "0"])?);
        assert!(!overlap(&["--overlap-steps", "false"])?);
        assert!(overlap(&["--overlap-steps", "1"])?);
        assert!(overlap(&["--overlap-steps=x"]).is_err());
        Ok(())
    }
}
