//! Turns a model directory and the engine flags into a running engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::builder::BoolishValueParser;
use clap::{ArgAction, Args, ValueEnum};
use ferrolm_backend::cpu::Cpu;
use ferrolm_backend::{DType, KvCacheDtype};
use ferrolm_engine::{EngineConfig, EngineHandle, KvCacheGroupConfig, Load, SchedulerConfig, BLOCK_SIZE};
use ferrolm_model::config::parse_dtype;
use ferrolm_model::{CpuRunner, GenerationConfig, Model, ModelConfig, ModelRunner, WeightSource};
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
    /// Sequences (prompts times `n`) of the requests accepted and not finished, beyond which
    /// new requests are refused with 503 (backpressure).
    #[arg(long, default_value_t = 4096)]
    pub max_pending_sequences: usize,
    /// Prompt tokens of the requests accepted and not finished, beyond which new requests are
    /// refused with 503 (backpressure).
    #[arg(long, default_value_t = 1 << 22)]
    pub max_pending_tokens: usize,
    /// Where the model runs: `auto` takes the first GPU when this build has CUDA and one is
    /// present, else the CPU.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// Model dtype: bfloat16, float16 or float32. On the GPU, weights and activations (default
    /// bfloat16; float32 to compare closely with the CPU). On the CPU, activations are always
    /// f32 and this sets the dtype of --dummy-weights (default: the config's).
    #[arg(long, value_parser = parse_dtype_flag)]
    pub dtype: Option<String>,
    /// Quantize an unquantized checkpoint at load (vLLM's flag): `fp8` quantizes each projection
    /// of the attention and the MLPs to e4m3 with one scale per output row (vLLM takes one per
    /// matrix). A checkpoint stored in FP8 is read as it is, without this flag. The GPU keeps
    /// the projections in e4m3 (one byte a weight; experts are dequantized), the CPU computes
    /// with the dequantized values in f32.
    #[arg(long, value_enum)]
    pub quantization: Option<QuantizationMethod>,
    /// The KV cache's element type (vLLM's flag): `auto`, the model's compute dtype, or `fp8`
    /// (e4m3 of each layer's K and V divided by the checkpoint's scales, else by 1): half the
    /// bytes of bf16 per cached token, so twice the tokens in the same memory.
    #[arg(long, value_enum, default_value_t = KvCacheDtypeFlag::Auto)]
    pub kv_cache_dtype: KvCacheDtypeFlag,
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
    #[command(flatten)]
    pub gpu: GpuArgs,
}

/// Kernel switches of the CUDA backend (ignored on the CPU), there to compare variants on one
/// binary; each also reads its environment variable.
#[derive(Args, Clone, Debug, Serialize)]
pub struct GpuArgs {
    /// Programmatic dependent launch on Hopper and later: each kernel starts while the one
    /// before it finishes (false launches plainly).
    #[arg(long, env = "FERROLM_PDL", action = ArgAction::Set, value_parser = BoolishValueParser::new(),
          default_value_t = true, value_name = "BOOL")]
    pub pdl: bool,
    /// Long decode batches may take the warp-per-head-block attention kernel (false keeps the
    /// block-per-head-block kernel).
    #[arg(long, env = "FERROLM_DECODE_WARP_ITEMS", action = ArgAction::Set,
          value_parser = BoolishValueParser::new(), default_value_t = true, value_name = "BOOL")]
    pub decode_warp_items: bool,
    /// The warp-per-head-block decode kernel copies K/V as tensor-map boxes (Hopper and later).
    #[arg(long, env = "FERROLM_DECODE_TENSOR_COPIES", action = ArgAction::Set,
          value_parser = BoolishValueParser::new(), default_value_t = false, value_name = "BOOL")]
    pub decode_tensor_copies: bool,
    /// Preprocessor definitions every kernel is compiled with, "NAME=VALUE ..." (kernel variants).
    #[arg(long, env = "FERROLM_KERNEL_DEFINES", value_delimiter = ' ', value_name = "NAME=VALUE")]
    pub kernel_defines: Vec<String>,
    /// Replay decode steps from captured CUDA graphs (false runs every step eagerly).
    #[arg(long, env = "FERROLM_CUDA_GRAPHS", action = ArgAction::Set, value_parser = BoolishValueParser::new(),
          default_value_t = true, value_name = "BOOL")]
    pub cuda_graphs: bool,
    /// At start-up, time cuBLAS's default GEMM kernels against cuBLASLt's algorithms on the
    /// decode batches' projections and keep the faster (a second or two; false skips it).
    #[arg(long, env = "FERROLM_GEMM_TUNE", action = ArgAction::Set, value_parser = BoolishValueParser::new(),
          default_value_t = true, value_name = "BOOL")]
    pub gemm_tune: bool,
    /// FP8 GEMMs accumulate without promoting the tensor cores' running sums to f32 (cuBLASLt's
    /// fast accumulation, as FP8 inference engines run them; false keeps the promotions).
    #[arg(long, env = "FERROLM_FP8_FAST_ACCUM", action = ArgAction::Set,
          value_parser = BoolishValueParser::new(), default_value_t = true, value_name = "BOOL")]
    pub fp8_fast_accum: bool,
    /// FP8 weights in 128 x 128 blocks (Qwen3's FP8 checkpoints) take cuBLASLt's block-scaled FP8
    /// GEMM beyond 4 rows a step, their inputs quantized per token and 128 columns (false runs
    /// such products over a copy of the weights dequantized on every call: Qwen3-8B's decode
    /// steps of 64 requests took 12 times as long on an H100).
    #[arg(long, env = "FERROLM_FP8_BLOCK_GEMM", action = ArgAction::Set,
          value_parser = BoolishValueParser::new(), default_value_t = true, value_name = "BOOL")]
    pub fp8_block_gemm: bool,
}

#[cfg(feature = "cuda")]
impl GpuArgs {
    pub fn options(&self) -> ferrolm_backend::cuda::GpuOptions {
        ferrolm_backend::cuda::GpuOptions {
            programmatic_launch: self.pdl,
            decode_warp_items: self.decode_warp_items,
            decode_tensor_copies: self.decode_tensor_copies,
            kernel_defines: self.kernel_defines.iter().filter(|d| !d.is_empty()).cloned().collect(),
            fp8_fast_accumulation: self.fp8_fast_accum,
            fp8_block_gemm: self.fp8_block_gemm,
        }
    }
}

/// `--kv-cache-dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtypeFlag {
    Auto,
    #[value(alias = "fp8_e4m3")]
    Fp8,
}

impl From<KvCacheDtypeFlag> for KvCacheDtype {
    fn from(flag: KvCacheDtypeFlag) -> KvCacheDtype {
        match flag {
            KvCacheDtypeFlag::Auto => KvCacheDtype::Auto,
            KvCacheDtypeFlag::Fp8 => KvCacheDtype::Fp8,
        }
    }
}

/// `--quantization`: how to quantize a checkpoint at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum QuantizationMethod {
    Fp8,
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

pub fn load(args: &EngineArgs) -> Result<LoadedModel> {
    let dir = model_dir(args)?;
    let mut config = ModelConfig::from_dir(&dir)?;
    let generation = GenerationConfig::from_dir(&dir)?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir)?);
    // Embedding rows past the tokenizer pad the vocabulary: the LM head computes no logits for
    // them. Set before placing the model, so that the GPU's GEMM tuning and memory reserve see
    // the head's real width (the engine would set it too, later).
    config.limit_output_vocab(tokenizer.vocab_size());
    let weights = WeightSource::open_dir(&dir)?;

    let eos_token_ids = eos_token_ids(&config, &generation, Some(&tokenizer));
    tracing::info!(model = %dir.display(), architecture = config.architecture.hf_name(), "model found");
    let runner = make_runner(config, &weights, args)?;
    let engine = start_engine(runner, Some(Arc::clone(&tokenizer)), eos_token_ids, args)?;
    Ok(LoadedModel { dir: dir.clone(), engine, tokenizer, defaults: generation.defaults })
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

/// A model placed on the device `args` ask for, with the memory that device leaves the KV cache
/// (`None`: --kv-cache-memory-gb, on the CPU).
pub struct Placed {
    pub runner: Box<dyn ModelRunner>,
    /// Bytes the KV cache may take on the device, and the dtype it is kept in there.
    pub device_kv_bytes: Option<(usize, DType)>,
    /// Bytes of weight matrices on the device, and the dtype they are kept in there.
    pub weight_bytes: usize,
    pub weight_dtype: DType,
}

/// Places `config`'s weights, read from `weights`, on the CPU or the GPU as `args.device` says.
/// Weights go from the source to the device one tensor at a time.
pub fn make_runner(mut config: ModelConfig, weights: &WeightSource, args: &EngineArgs) -> Result<Placed> {
    if !(args.kv_cache_fraction > 0.0 && args.kv_cache_fraction <= 1.0) {
        bail!("--kv-cache-fraction must be in (0, 1], got {}", args.kv_cache_fraction);
    }
    if args.quantization == Some(QuantizationMethod::Fp8) {
        config.quantize_at_load()?;
    }
    config.kv_cache_dtype = args.kv_cache_dtype.into();
    match args.device {
        Device::Cpu => cpu_runner(config, weights),
        Device::Cuda => cuda_runner(config, weights, args),
        Device::Auto if cfg!(feature = "cuda") => match cuda_runner_if_present(&config, weights, args)? {
            Some(placed) => Ok(placed),
            None => cpu_runner(config, weights),
        },
        Device::Auto => cpu_runner(config, weights),
    }
}

fn cpu_runner(config: ModelConfig, weights: &WeightSource) -> Result<Placed> {
    let started = std::time::Instant::now();
    let model = Model::load(&Cpu::default(), config, weights)?;
    tracing::info!(device = "cpu", seconds = started.elapsed().as_secs_f64(), "model placed");
    // The dtype the checkpoint (or --dummy-weights) stores the matrices in.
    let (weight_bytes, weight_dtype) = (model.weight_bytes(), model.lm_head().weight.values().dtype());
    Ok(Placed { runner: Box::new(CpuRunner::new(model)), device_kv_bytes: None, weight_bytes, weight_dtype })
}

#[cfg(not(feature = "cuda"))]
fn cuda_runner(_config: ModelConfig, _weights: &WeightSource, _args: &EngineArgs) -> Result<Placed> {
    bail!("--device cuda: this build of ferrolm has no CUDA backend (build with `--features cuda`); use --device cpu")
}

#[cfg(not(feature = "cuda"))]
fn cuda_runner_if_present(
    _config: &ModelConfig,
    _weights: &WeightSource,
    _args: &EngineArgs,
) -> Result<Option<Placed>> {
    Ok(None)
}

/// The first GPU if there is one (`None` otherwise, for the CPU).
#[cfg(feature = "cuda")]
fn cuda_runner_if_present(config: &ModelConfig, weights: &WeightSource, args: &EngineArgs) -> Result<Option<Placed>> {
    match ferrolm_backend::cuda::Gpu::new(0, &args.gpu.options()) {
        Ok(gpu) => cuda_place(config.clone(), weights, gpu, args).map(Some),
        Err(err) if err.means_no_gpu() => {
            tracing::info!(reason = %err, "no usable GPU; running on the CPU");
            Ok(None)
        }
        // A GPU that is there but fails must not quietly become a CPU server.
        Err(err) => Err(anyhow::Error::new(err).context("the GPU could not be opened (--device cpu runs without it)")),
    }
}

#[cfg(feature = "cuda")]
fn cuda_runner(config: ModelConfig, weights: &WeightSource, args: &EngineArgs) -> Result<Placed> {
    let gpu = ferrolm_backend::cuda::Gpu::new(0, &args.gpu.options()).context("--device cuda")?;
    cuda_place(config, weights, gpu, args)
}

/// Uploads the weights, then gives the KV cache `--kv-cache-fraction` of the memory left free.
#[cfg(feature = "cuda")]
fn cuda_place(
    config: ModelConfig,
    weights: &WeightSource,
    gpu: ferrolm_backend::cuda::Gpu,
    args: &EngineArgs,
) -> Result<Placed> {
    use ferrolm_model::cuda::CudaRunner;

    let dtype = args.dtype().unwrap_or(DType::BF16);
    let started = std::time::Instant::now();
    let mut runner = CudaRunner::load(gpu, dtype, config, weights).context("cannot load the model onto the GPU")?;
    tracing::info!(seconds = started.elapsed().as_secs_f64(), "weights uploaded");
    runner.set_cuda_graphs(args.gpu.cuda_graphs);
    // Before the free memory is read: tuning's operands are freed again.
    if args.gpu.gemm_tune {
        runner.tune_gemms(args.max_num_seqs).context("cannot tune the GEMMs")?;
    }
    let (free, total) = runner.gpu().memory_info()?;
    // Outside the cache: the activations of the largest step, as much again for the sampler's
    // scratch over the step's logits rows (f32 [rows, vocab] and its per-row buffers), and
    // cuBLAS's workspaces with a margin.
    let activations = runner.activation_bytes(args.max_num_batched_tokens, step_logits_rows(args));
    let reserve = 2 * activations + (512 << 20);
    let budget = (free.saturating_sub(reserve) as f64 * args.kv_cache_fraction) as usize;
    tracing::info!(
        device = %runner.device(),
        dtype = ?dtype,
        weights_gib = runner.weight_bytes() as f64 / (1u64 << 30) as f64,
        activations_gib = activations as f64 / (1u64 << 30) as f64,
        free_gib = free as f64 / (1u64 << 30) as f64,
        total_gib = total as f64 / (1u64 << 30) as f64,
        kv_cache_gib = budget as f64 / (1u64 << 30) as f64,
        "model placed on the GPU"
    );
    let weight_bytes = runner.weight_bytes();
    Ok(Placed { runner: Box::new(runner), device_kv_bytes: Some((budget, dtype)), weight_bytes, weight_dtype: dtype })
}

/// Most prompt rows a step computes logits of for prompt logprobs (the scheduler's
/// `max_prompt_logprob_rows`): as many as decode rows, and at least 256.
fn prompt_logprob_rows(args: &EngineArgs) -> usize {
    args.max_num_seqs.max(256)
}

/// The most logits rows a step has under these flags: the scheduler's bound (a row per request
/// that samples, and the prompt-logprob rows; the pool and length do not enter it).
#[cfg(feature = "cuda")]
fn step_logits_rows(args: &EngineArgs) -> usize {
    let step = SchedulerConfig {
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_prompt_logprob_rows: prompt_logprob_rows(args),
        ..SchedulerConfig::new(1, 1)
    };
    step.max_logits_rows()
}

/// Sizes the KV cache and the scheduler from `args` and starts the engine on `placed`.
pub fn start_engine(
    placed: Placed,
    tokenizer: Option<Arc<Tokenizer>>,
    eos_token_ids: Vec<u32>,
    args: &EngineArgs,
) -> Result<EngineHandle> {
    let Placed { runner, device_kv_bytes, .. } = placed;
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
    let scheduler = SchedulerConfig {
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        block_size: BLOCK_SIZE,
        kv_cache_groups: Vec::new(),
        max_model_len,
        long_prefill_token_threshold: None,
        max_prompt_logprob_rows: prompt_logprob_rows(args),
        enable_prefix_caching: true,
    };
    // The first group's blocks: a sliding group after it takes what its window needs (see
    // `SchedulerConfig::kv_cache_groups_for`), within the same memory.
    let groups = config.kv_cache_groups();
    let windows: Vec<Option<usize>> = groups.iter().map(|g| g.sliding_window).collect();
    // At most what the longest batch could use; at least one full-length sequence (in a
    // sliding group, what a request holds at once).
    let first = KvCacheGroupConfig { sliding_window: windows[0], num_blocks: 0 };
    let most = match first.sliding_window {
        None => (args.max_num_seqs * max_model_len).div_ceil(BLOCK_SIZE),
        Some(_) => scheduler.max_blocks_of(&first, max_model_len, 1).saturating_mul(args.max_num_seqs),
    };
    let within = |budget: usize, dtype: DType| {
        let bytes: Vec<usize> = groups.iter().map(|g| g.kv_bytes_per_block(config, BLOCK_SIZE, dtype)).collect();
        scheduler.num_blocks_within(&windows, &bytes, budget).min(most)
    };
    let num_blocks = match (args.num_kv_blocks, device_kv_bytes) {
        (Some(n), _) => n,
        (None, Some((budget, dtype))) => match within(budget, dtype) {
            0 => bail!("no GPU memory left for the KV cache after the weights ({budget} bytes for it)"),
            n => n,
        },
        // The CPU computes in f32 (its cache is f32 or FP8).
        (None, None) => within((args.kv_cache_memory_gb * (1u64 << 30) as f64) as usize, DType::F32)
            .max(scheduler.max_blocks_of(&first, max_model_len, 1)),
    };
    let scheduler = scheduler.with_kv_cache_groups(&windows, num_blocks);
    for group in &scheduler.kv_cache_groups {
        let (window, blocks) = (group.sliding_window, group.num_blocks);
        tracing::info!(?window, blocks, kv_tokens = blocks * BLOCK_SIZE, "KV cache group");
    }
    tracing::info!(num_blocks, max_model_len, "engine configured");
    let engine = EngineHandle::start(
        runner,
        tokenizer,
        EngineConfig {
            scheduler,
            max_pending: Load { sequences: args.max_pending_sequences, prompt_tokens: args.max_pending_tokens },
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

    /// The kernel switches take the values their environment variables always took ("0", "1").
    #[test]
    fn gpu_switches_take_zero_and_one() -> Result<(), clap::Error> {
        let args = ["ferrolm", "--pdl", "0", "--decode-warp-items", "false", "--decode-tensor-copies", "1"];
        let more = ["--cuda-graphs", "0", "--gemm-tune", "no", "--kernel-defines", "DM_BULK=0 X=1"];
        let gpu = Cli::try_parse_from(args.into_iter().chain(more))?.engine.gpu;
        assert!(!gpu.pdl && !gpu.decode_warp_items && gpu.decode_tensor_copies);
        assert!(!gpu.cuda_graphs && !gpu.gemm_tune);
        assert_eq!(gpu.kernel_defines, ["DM_BULK=0", "X=1"]);
        let defaults = Cli::try_parse_from(["ferrolm"])?.engine.gpu;
        assert!(defaults.pdl && defaults.cuda_graphs && defaults.gemm_tune && !defaults.decode_tensor_copies);
        Ok(())
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
