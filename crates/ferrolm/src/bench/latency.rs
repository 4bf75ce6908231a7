//! `ferrolm bench latency`: one request at a time, timing the first token and every decode step,
//! and comparing the decode rate with what this machine's memory bandwidth allows, and the first
//! token with what its prefill's arithmetic allows at this machine's GEMM rate (measured in the
//! same run, on the model's own projections, in FP8 where the run's projections are FP8).
//!
//! Each iteration gets a fresh random prompt, so the prefix cache never shortens a prefill.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrolm_engine::GenerateRequest;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use serde_json::{Map, Value};

use super::bandwidth::{self, Bandwidth, BandwidthArgs, DecodeLimit};
use super::limit::{self, GemmRate, RunWork, Served, StepCaps, ThroughputLimit};
use super::metrics::{LatencySummaries, RequestTiming};
use super::setup::{self, BenchModel, ModelArgs};
use super::{collect_timing, free_engine, model_label, report, Device, SamplingFlags};

#[derive(Args, Debug, Serialize)]
pub struct LatencyArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 32)]
    pub input_len: usize,
    /// Output length in tokens (EOS is ignored).
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Timed requests.
    #[arg(long, default_value_t = 10)]
    pub num_iters: usize,
    /// Untimed requests first (page faults, thread pool start-up, allocator warm-up).
    #[arg(long, default_value_t = 1)]
    pub num_iters_warmup: usize,
    /// Seed of the prompts and of sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    #[serde(flatten)]
    pub sampling: SamplingFlags,
    /// The bandwidth is measured before the model is loaded and again after.
    #[command(flatten)]
    #[serde(flatten)]
    pub bandwidth: BandwidthArgs,
    /// Write every figure, the machine, the model and the flags to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(args: LatencyArgs) -> Result<()> {
    if args.input_len == 0 || args.output_len == 0 || args.num_iters == 0 {
        bail!("--input-len, --output-len and --num-iters must be positive");
    }
    args.sampling.check()?;
    let device = Device::of(&args.model.engine);
    // Measured before the model is loaded and again once it is freed (so that the buffer and the
    // weights are never both resident); the better pass counts, which keeps a burst of other
    // work on the machine from lowering the ceiling.
    let before = args.bandwidth.measure(device)?;

    let (engine, model) = setup::load(&args.model, 1, args.input_len + args.output_len)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let total = args.num_iters_warmup + args.num_iters;
    let bar = report::progress(total, "latency");
    let mut timings = Vec::with_capacity(args.num_iters);
    for i in 0..total {
        let prompt = model.prompts.sample(args.input_len, &mut rng);
        let params = args.sampling.params(args.output_len, args.seed.wrapping_add(i as u64));
        let sent = Instant::now();
        let stream = engine
            .submit(GenerateRequest { prompt_token_ids: prompt, params, grammar: None })
            .context("the request was refused")?;
        let timing = runtime.block_on(collect_timing(stream, sent, args.input_len));
        if !timing.success {
            bail!("iteration {i} failed: {}", timing.error.unwrap_or_default());
        }
        if i >= args.num_iters_warmup {
            timings.push(timing);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let stats = engine.stats();
    free_engine(engine);
    let after = args.bandwidth.measure(device)?;
    let bw = before.best_of(after);

    let summaries = LatencySummaries::from_timings(&timings);
    let decode_tokens: usize = timings.iter().map(|t| t.output_len.saturating_sub(1)).sum();
    let decode_seconds: f64 = timings.iter().map(|t| t.latency - t.ttft).sum();
    let decode_rate = if decode_seconds > 0.0 { decode_tokens as f64 / decode_seconds } else { 0.0 };
    let limit = bandwidth::decode_limit(&bw, bytes_per_decode_token(&model, &args), decode_rate);
    let first = match TtftLimit::measure(&args, device, &model, &bw, summaries.ttft.median) {
        Ok(first) => Some(first),
        Err(e) => {
            eprintln!("warning: no first-token limit: {e:#}");
            None
        }
    };

    print_table(&model, &summaries, decode_rate, &bw, &limit);
    if let Some(first) = &first {
        first.print();
    }
    if let Some(path) = &args.json {
        let mut results = results(&args, &model, &timings, &summaries, decode_rate, &bw, &limit);
        if let Some(first) = &first {
            first.insert_into(&mut results);
        }
        results.insert("num_steps".into(), stats.num_steps.into());
        results.insert("num_steps_ahead".into(), stats.num_steps_ahead.into());
        results.insert("host_gap_seconds".into(), (stats.host_gap_us as f64 / 1e6).into());
        report::write_json(path, &results)?;
    }
    Ok(())
}

/// Mean context of the decode steps: the step that produces output token `k` (k = 2..=out)
/// attends over `input_len + k - 1` tokens.
fn mean_decode_context(args: &LatencyArgs) -> f64 {
    args.input_len as f64 + args.output_len as f64 / 2.0
}

fn bytes_per_decode_token(model: &BenchModel, args: &LatencyArgs) -> f64 {
    model.weight_bytes_per_token() as f64 + model.kv_bytes_per_context_token() as f64 * mean_decode_context(args)
}

fn print_table(model: &BenchModel, s: &LatencySummaries, decode_rate: f64, bw: &Bandwidth, limit: &DecodeLimit) {
    let mut table = report::Table::new("Latency Benchmark Result");
    // A MoE model's decode token reads its top-k experts of each sparse layer, no others.
    let experts = model.config.moe.as_ref().map(|m| format!(", {} experts a layer", m.num_experts_per_tok));
    table
        .text("Model", model_label(model))
        .text("Device", &model.device)
        .num("Mean E2E latency (ms)", s.e2el.mean)
        .num("Decode throughput (tok/s)", decode_rate)
        .latency("Time to First Token", "TTFT", &s.ttft)
        .latency("Time per Output Token (excl. 1st token)", "TPOT", &s.tpot)
        .latency("Inter-token Latency", "ITL", &s.itl)
        .section("Batch-1 Decode Bandwidth Limit")
        .num("Memory read bandwidth (GB/s)", bw.gbps())
        .num(&format!("Bytes read per decode token (MB{})", experts.unwrap_or_default()), limit.bytes_per_token / 1e6)
        .num("Decode limit (tok/s)", limit.tokens_per_s)
        .num("Decode rate reached (tok/s)", decode_rate)
        .text("Fraction of limit", format!("{:.1}%", limit.fraction * 100.0))
        .print();
}

fn results(
    args: &LatencyArgs,
    model: &BenchModel,
    timings: &[RequestTiming],
    summaries: &LatencySummaries,
    decode_rate: f64,
    bw: &Bandwidth,
    limit: &DecodeLimit,
) -> Map<String, Value> {
    let mut r = report::header("latency", args);
    r.insert("device".into(), model.device.clone().into());
    r.insert("dtype".into(), setup::dtype_name(model.dtype).into());
    r.insert("model".into(), model.describe());
    r.insert("load_seconds".into(), model.load_seconds.into());
    r.insert("input_len".into(), args.input_len.into());
    r.insert("output_len".into(), args.output_len.into());
    r.insert("num_iters".into(), args.num_iters.into());
    r.insert("num_iters_warmup".into(), args.num_iters_warmup.into());
    summaries.insert_into(&mut r);
    // The single request's decode rate, as vLLM's latency mode reports `output_throughput`.
    r.insert("output_throughput".into(), decode_rate.into());
    // The names of vLLM's `benchmark_latency.py` (seconds).
    let latencies: Vec<f64> = timings.iter().map(|t| t.latency).collect();
    r.insert("avg_latency".into(), (summaries.e2el.mean / 1000.0).into());
    r.insert("latencies".into(), latencies.into());
    bw.insert_into(&mut r);
    r.insert("weight_bytes_per_token".into(), model.weight_bytes_per_token().into());
    r.insert("kv_bytes_per_context_token".into(), model.kv_bytes_per_context_token().into());
    r.insert("mean_decode_context".into(), mean_decode_context(args).into());
    r.insert("bytes_per_decode_token".into(), limit.bytes_per_token.into());
    r.insert("decode_limit_tokens_per_s".into(), limit.tokens_per_s.into());
    r.insert("fraction_of_limit".into(), limit.fraction.into());
    r
}

/// The first token's limit: its prompt's prefill (every projection of every prompt token, one
/// LM-head row, the causal attention over the prompt, the weights read once per step of at most
/// `--max-num-batched-tokens`), priced as `bench throughput` prices a run, at the GEMM rate
/// measured here at the prefill's rows and the bandwidth measured above.
struct TtftLimit {
    rate: GemmRate,
    work: RunWork,
    /// Milliseconds the prefill takes at those ceilings.
    ms: f64,
    /// The limit over the median TTFT (1 = at the limit).
    fraction: f64,
}

impl TtftLimit {
    fn measure(args: &LatencyArgs, device: Device, model: &BenchModel, bw: &Bandwidth, median_ms: f64) -> Result<Self> {
        let budget = args.model.engine.max_num_batched_tokens;
        let caps = StepCaps { max_num_seqs: 1, max_num_batched_tokens: budget };
        let served = [Served { prompt_len: args.input_len, output_len: 1 }];
        let work = RunWork::of(&model.config, &served, caps, &model.step_weights(), model.kv_bytes_per_context_token());
        // The GPU multiplies in the engine's dtype; the CPU in f32 from the stored weights.
        let weights = if device == Device::Cpu { model.dtype } else { model.activation_dtype };
        let rows = args.input_len.min(budget);
        eprintln!("measuring {device:?} GEMM rate ({rows} rows)...");
        let switches = limit::Fp8Switches::of(&args.model.engine.gpu);
        let rate = limit::measure_gemm_rate(device, &model.config, weights, rows, switches)?;
        // One output token: the limit in tokens per second is one over the prefill's seconds.
        let prefill = ThroughputLimit::of(&work, &rate, bw, 1, 1000.0 / median_ms);
        Ok(TtftLimit { rate, work, ms: 1000.0 / prefill.in_sequence, fraction: prefill.fraction_in_sequence })
    }

    fn print(&self) {
        let mut table = report::Table::new("First-Token Limit (prefill at measured ceilings)");
        self.rate.add_to(&mut table);
        table
            .num("Prefill arithmetic (GFLOP)", (self.work.gemm_flops + self.work.attention_flops) / 1e9)
            .num("TTFT limit (ms)", self.ms)
            .text("Fraction of limit (limit / median TTFT)", format!("{:.1}%", self.fraction * 100.0))
            .print();
    }

    fn insert_into(&self, r: &mut Map<String, Value>) {
        self.rate.insert_into(r);
        r.insert("prefill_gemm_flops".into(), self.work.gemm_flops.into());
        r.insert("prefill_attention_flops".into(), self.work.attention_flops.into());
        r.insert("prefill_weight_read_bytes".into(), self.work.weight_read_bytes.into());
        r.insert("ttft_limit_ms".into(), self.ms.into());
        r.insert("ttft_fraction_of_limit".into(), self.fraction.into());
    }
}
